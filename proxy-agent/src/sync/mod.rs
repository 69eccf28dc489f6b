//! The sync loop: turns each new snapshot from a source into the node view and hands it
//! to the dataplane — bursts coalesced by a minimum interval, a periodic resync that
//! repairs drift, and retries with backoff when an apply fails.

pub mod latency;
pub mod status;

use std::time::Duration;

use anyhow::Result;
use tokio::{sync::watch, time::Instant};

pub use self::status::Status;
use crate::{
    dataplane::Dataplane,
    health::HealthServers,
    model::{
        NodeInfo, NodeSettings, NodeView, ViewConfig, health_check_addresses, health_checks,
        node_view,
    },
    source::{SharedSnapshot, files},
};

/// The last snapshot the dataplane fully holds, for network programming latency.
#[derive(Default)]
struct Programmed(Option<SharedSnapshot>);

impl Programmed {
    /// `snapshot` is now in effect: observes how long its new EndpointSlice changes
    /// took. The first snapshot is only remembered (its trigger times are history).
    fn record(&mut self, snapshot: &SharedSnapshot, status: &Status) {
        status.updated();
        if let Some(prev) = &self.0 {
            let now = std::time::SystemTime::now();
            for t in latency::new_triggers(&prev.model, &snapshot.model) {
                status.observe_programming(latency::since(t, now));
            }
        }
        self.0 = Some(SharedSnapshot::clone(snapshot));
    }
}

/// Timing of the sync loop (kube-proxy's minSyncPeriod / syncPeriod).
#[derive(Clone, Copy, Debug)]
pub struct SyncTiming {
    pub min_interval: Duration,
    pub resync: Duration,
    /// First retry delay after a failed apply; doubles up to `resync`.
    pub retry: Duration,
}

impl Default for SyncTiming {
    fn default() -> Self {
        Self {
            min_interval: Duration::from_millis(100),
            resync: Duration::from_secs(30),
            retry: Duration::from_secs(1),
        }
    }
}

/// Reads the manifests and builds the node view, logging every object left out.
pub fn view_from_manifests(
    dir: &std::path::Path,
    node: &NodeInfo,
    cfg: &ViewConfig,
) -> Result<NodeView> {
    let (model, errors) = files::load(dir)?;
    for e in &errors {
        tracing::warn!(error = %e, "skipping manifest");
    }
    let (view, rejected) = node_view(&model, node, cfg);
    for r in &rejected {
        tracing::warn!(kind = r.kind, object = %r.object, reason = %r.reason, "skipping invalid object");
    }
    Ok(view)
}

/// Runs until `shutdown` resolves or the source goes away.
pub async fn run<D: Dataplane>(
    mut source: watch::Receiver<Option<SharedSnapshot>>,
    cfg: ViewConfig,
    dataplane: &mut D,
    timing: SyncTiming,
    status: Status,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    tokio::pin!(shutdown);
    status.set_health_timeout(timing.resync * 2);
    let mut last_sync: Option<Instant> = None;
    let mut next_resync = Instant::now() + timing.resync;
    let mut retry_at: Option<Instant> = None;
    let mut retry_delay = timing.retry;
    let mut current: Option<NodeView> = None;
    let mut last_rejections = Vec::new();
    let mut last_unreadable = 0;
    let mut settings: Option<NodeSettings> = None;
    let mut health = HealthServers::new(status.clone());
    let mut programmed = Programmed::default();
    loop {
        let wake = retry_at.map_or(next_resync, |r| r.min(next_resync));
        let mut forced = false;
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            changed = source.changed() => {
                if changed.is_err() {
                    tracing::warn!("source stopped; keeping the programmed state");
                    return Ok(());
                }
                status.queued(std::time::Instant::now());
                if let Some(snapshot) = source.borrow().as_ref() {
                    status.seen(snapshot.changes);
                }
            }
            _ = tokio::time::sleep_until(wake) => forced = true,
        }
        // Coalesce: at most one sync per minimum interval — but a shutdown does not wait
        // for it (the pinned programs keep serving what is programmed).
        if let Some(last) = last_sync {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                _ = tokio::time::sleep_until(last + timing.min_interval) => {}
            }
        }
        let Some(snapshot) = source.borrow_and_update().clone() else {
            continue; // the source has not seen everything yet
        };
        let wanted = NodeSettings::new(&snapshot.node, &cfg);
        if settings.as_ref() != Some(&wanted) {
            match dataplane.configure(&wanted) {
                Ok(()) => settings = Some(wanted),
                Err(e) => tracing::error!(
                    error = format!("{e:#}"),
                    "configuring the node settings failed; will retry"
                ),
            }
        }
        health.update(
            &health_checks(&snapshot.model, &snapshot.node, &cfg),
            health_check_addresses(&snapshot.node, &cfg).as_deref(),
        );
        let (view, rejected) = node_view(&snapshot.model, &snapshot.node, &cfg);
        if rejected != last_rejections || snapshot.unreadable != last_unreadable {
            for r in &rejected {
                tracing::warn!(kind = r.kind, object = %r.object, reason = %r.reason, "skipping invalid object");
            }
            // What the source could not read counts too (its lines were logged there).
            status.count_rejections(rejected.len() + snapshot.unreadable as usize);
            last_rejections = rejected;
            last_unreadable = snapshot.unreadable;
        }
        let resync = forced && Instant::now() >= next_resync;
        if resync {
            next_resync = Instant::now() + timing.resync;
            if let Err(e) = dataplane.resync() {
                tracing::warn!(error = format!("{e:#}"), "re-reading the dataplane failed");
            }
        } else if !forced && current.as_ref() == Some(&view) {
            // Nothing this node does changed: the change is in effect as it is.
            status.record_unchanged(&snapshot);
            programmed.record(&snapshot, &status);
            continue;
        }
        last_sync = Some(Instant::now());
        let started = std::time::Instant::now();
        let outcome = dataplane.apply(&view);
        status.record_sync(
            &snapshot,
            &view,
            current.as_ref(),
            started.elapsed(),
            &outcome,
        );
        match outcome {
            Ok(report) if report.failed.is_empty() => {
                programmed.record(&snapshot, &status);
                if report.frontends_written + report.frontends_removed > 0 {
                    tracing::info!(
                        written = report.frontends_written,
                        removed = report.frontends_removed,
                        backends_removed = report.backends_removed,
                        udp_sockets_destroyed = report.udp_sockets_destroyed,
                        frontends = view.len(),
                        "dataplane synced"
                    );
                }
                retry_at = None;
                retry_delay = timing.retry;
            }
            Ok(report) => {
                for f in &report.failed {
                    tracing::error!(frontend = f, "frontend not programmed; will retry");
                }
                retry_at = Some(Instant::now() + retry_delay);
                retry_delay = (retry_delay * 2).min(timing.resync);
            }
            Err(e) => {
                tracing::error!(
                    error = format!("{e:#}"),
                    "dataplane sync failed; will retry"
                );
                retry_at = Some(Instant::now() + retry_delay);
                retry_delay = (retry_delay * 2).min(timing.resync);
            }
        }
        current = Some(view);
    }
}
