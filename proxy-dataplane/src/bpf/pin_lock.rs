//! One agent per pin folder: two agents adopting the same maps and links would undo each
//! other's writes. The agent holds an exclusive `flock` on the folder for its lifetime (the
//! kernel drops it when the process ends, however it ends); a second one waits for it —
//! an upgrade's new agent may start while the old one is still stopping — then gives up
//! with an error naming the folder.

use std::{fs, os::fd::AsRawFd as _, path::Path, time::Duration};

use crate::error::{ErrorKind, Kind as _, Result, fail};

/// How long a second agent waits for the first to exit.
const WAIT: Duration = Duration::from_secs(30);

/// The held lock; dropping it releases the folder.
pub struct PinLock(
    #[allow(
        dead_code,
        reason = "held, never read: the lock lives as long as the file is open"
    )]
    fs::File,
);

/// Takes the folder's lock, waiting up to `WAIT` while another process holds it.
pub fn lock(pin_dir: &Path) -> Result<PinLock> {
    lock_within(pin_dir, WAIT)
}

pub fn lock_within(pin_dir: &Path, wait: Duration) -> Result<PinLock> {
    let dir = fs::File::open(pin_dir)
        .kind_with(ErrorKind::Io, || format!("opening {}", pin_dir.display()))?;
    let deadline = std::time::Instant::now() + wait;
    let mut said = false;
    loop {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(PinLock(dir));
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(err).kind_with(ErrorKind::Io, || format!("locking {}", pin_dir.display()));
        }
        if std::time::Instant::now() >= deadline {
            fail!(
                ErrorKind::Io,
                "another agent holds {} (one agent per pin folder); stop it, or give this one \
                 its own --bpffs",
                pin_dir.display()
            );
        }
        if !said {
            tracing::warn!(pins = %pin_dir.display(), "another agent holds the pin folder; waiting for it to exit");
            said = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The folder's lock if no agent holds it now; `None` while one does.
pub fn try_lock(pin_dir: &Path) -> Result<Option<PinLock>> {
    let dir = fs::File::open(pin_dir)
        .kind_with(ErrorKind::Io, || format!("opening {}", pin_dir.display()))?;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(Some(PinLock(dir)));
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Ok(None);
    }
    Err(err).kind_with(ErrorKind::Io, || format!("locking {}", pin_dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_agent_waits_then_gives_up_and_gets_it_once_released() {
        let dir = std::env::temp_dir().join(format!("pin-lock-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("mkdir");
        let first = lock(&dir).expect("first agent");
        let started = std::time::Instant::now();
        let err = lock_within(&dir, Duration::from_millis(300))
            .err()
            .expect("held");
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "did not wait"
        );
        assert!(
            format!("{err:#}").contains("another agent holds"),
            "{err:#}"
        );
        assert!(try_lock(&dir).expect("try").is_none(), "held, yet taken");
        drop(first);
        let _second = lock_within(&dir, Duration::from_millis(300)).expect("released");
        fs::remove_dir_all(&dir).expect("rm");
    }
}
