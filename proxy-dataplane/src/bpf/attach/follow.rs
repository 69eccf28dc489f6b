//! Follows the node's interfaces: the classifier goes onto every wanted interface that
//! exists at start and every one that appears later, and its pin goes with the device.
//! The classifiers are shared with the dataplane, whose resync checks them.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{ErrorKind, Kind as _, Result};
use tokio::io::{Interest, unix::AsyncFd};

use super::{
    device_events::{DeviceChange, DeviceEvents},
    links::Classifiers,
};

/// The rtnetlink subscription and the links it drives.
pub struct InterfaceFollower {
    events: DeviceEvents,
    classifiers: Arc<Mutex<Classifiers>>,
}

/// The classifiers, whoever panicked while holding them (their maps stay consistent:
/// each change is applied whole or logged as failed).
pub fn lock(classifiers: &Mutex<Classifiers>) -> MutexGuard<'_, Classifiers> {
    classifiers.lock().unwrap_or_else(|p| p.into_inner())
}

impl InterfaceFollower {
    /// Subscribes, then serves every interface present now (blocking until the dump
    /// ends), so the agent reports ready only with its classifiers in place.
    pub fn start(classifiers: Arc<Mutex<Classifiers>>) -> Result<Self> {
        let mut follower = Self {
            events: DeviceEvents::open()?,
            classifiers,
        };
        follower.dump_blocking()?;
        follower.events.set_non_blocking()?;
        Ok(follower)
    }

    /// Names of the interfaces served now.
    pub fn attached(&self) -> Vec<String> {
        lock(&self.classifiers)
            .attached()
            .map(str::to_string)
            .collect()
    }

    fn dump_blocking(&mut self) -> Result<()> {
        loop {
            lock(&self.classifiers).begin_dump();
            self.events.request_dump()?;
            let interrupted = loop {
                let changes = self
                    .events
                    .read()
                    .kind(ErrorKind::Netlink, "reading the link dump")?;
                if let Some(i) = self.apply(changes) {
                    break i;
                }
            };
            if !interrupted {
                return Ok(());
            }
            tracing::debug!("links changed during the dump; dumping again");
        }
    }

    /// Applies changes in order; `Some(interrupted)` once a dump has ended.
    fn apply(&mut self, changes: Vec<DeviceChange>) -> Option<bool> {
        let mut done = None;
        let mut classifiers = lock(&self.classifiers);
        for change in changes {
            if let DeviceChange::DumpDone { interrupted } = change {
                done = Some(interrupted);
            }
            classifiers.handle(change);
        }
        done
    }

    /// Follows notifications until the socket fails. Lost notifications (the socket's
    /// buffer overran) and interrupted dumps are repaired with a new dump.
    pub async fn run(self) -> Result<()> {
        let Self {
            events,
            classifiers,
        } = self;
        // SAFETY: `DeviceEvents` owns its socket for its whole life and always reports
        // that same descriptor.
        let mut fd = unsafe { AsyncFd::register_with_interest(events, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)
            .kind(ErrorKind::Netlink, "polling the route netlink socket")?;
        loop {
            let mut guard = fd.readable_mut().await?;
            let read = guard.try_io(|inner| inner.get_mut().read());
            let dump_again = match read {
                Err(_would_block) => continue,
                Ok(Ok(changes)) => {
                    let mut classifiers = lock(&classifiers);
                    changes.into_iter().any(|change| {
                        let again = change == DeviceChange::DumpDone { interrupted: true };
                        classifiers.handle(change);
                        again
                    })
                }
                Ok(Err(e)) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    tracing::warn!(
                        "link notifications lost (socket buffer overrun); re-reading every link"
                    );
                    true
                }
                Ok(Err(e)) => return Err(e).kind(ErrorKind::Netlink, "reading link notifications"),
            };
            if dump_again {
                lock(&classifiers).begin_dump();
                guard.get_inner_mut().request_dump()?;
            }
        }
    }
}
