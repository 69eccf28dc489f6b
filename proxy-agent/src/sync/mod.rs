//! The sync loop: rebuilds the node view when the source changes (bursts coalesced by a
//! minimum interval), resyncs periodically, and hands the view to the dataplane.

use std::{path::PathBuf, time::Duration};

use anyhow::Result;
use notify::Watcher as _;
use tokio::sync::mpsc;

use crate::{
    dataplane::Dataplane,
    model::{NodeInfo, NodeView, ViewConfig, node_view},
    source::files,
};

/// Timing of the sync loop (kube-proxy's minSyncPeriod / syncPeriod).
#[derive(Clone, Copy, Debug)]
pub struct SyncTiming {
    pub min_interval: Duration,
    pub resync: Duration,
}

impl Default for SyncTiming {
    fn default() -> Self {
        Self {
            min_interval: Duration::from_millis(100),
            resync: Duration::from_secs(30),
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

/// Runs until `shutdown` resolves: programs the view from `manifests` now and on change.
pub async fn run_files<D: Dataplane>(
    manifests: PathBuf,
    node: NodeInfo,
    cfg: ViewConfig,
    dataplane: &mut D,
    timing: SyncTiming,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok() {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(&manifests, notify::RecursiveMode::NonRecursive)?;
    tokio::pin!(shutdown);
    let mut resync = tokio::time::interval(timing.resync);
    loop {
        apply_once(&manifests, &node, &cfg, dataplane);
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = resync.tick() => {}
            Some(()) = rx.recv() => {
                // Coalesce a burst of file events into one sync.
                tokio::time::sleep(timing.min_interval).await;
                while rx.try_recv().is_ok() {}
            }
        }
    }
}

fn apply_once<D: Dataplane>(
    manifests: &std::path::Path,
    node: &NodeInfo,
    cfg: &ViewConfig,
    dataplane: &mut D,
) {
    let view = match view_from_manifests(manifests, node, cfg) {
        Ok(v) => v,
        Err(e) => {
            // Keep what is programmed: an unreadable folder must not flush live services.
            tracing::error!(
                error = format!("{e:#}"),
                "cannot read manifests; keeping the current state"
            );
            return;
        }
    };
    match dataplane.apply(&view) {
        Ok(report) => {
            if report.frontends_written + report.frontends_removed + report.backends_removed > 0 {
                tracing::info!(
                    written = report.frontends_written,
                    removed = report.frontends_removed,
                    backends_removed = report.backends_removed,
                    frontends = view.len(),
                    "dataplane synced"
                );
            }
            for f in &report.failed {
                tracing::error!(frontend = f, "frontend not programmed");
            }
        }
        Err(e) => tracing::error!(
            error = format!("{e:#}"),
            "dataplane sync failed; will retry"
        ),
    }
}
