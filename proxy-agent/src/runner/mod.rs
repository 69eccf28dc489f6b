//! The runner: turns each new snapshot from a source into the node view and hands it
//! to the dataplane — bursts coalesced by a minimum interval, an audit that compares the
//! dataplane with what was programmed a little at a time between changes (one pass per
//! resync period) and repairs drift, and retries with backoff when an apply fails.
//! When is the pacing's to say (`pacing`, on a `clock`); what, the programmer's.

pub mod clock;
pub mod latency;
pub mod pacing;
mod programmer;
pub mod status;

use anyhow::Result;
use tokio::sync::watch;

use self::{
    clock::TokioClock,
    pacing::Pacing,
    programmer::{Programmer, log_rejections},
};
pub use self::{pacing::Timing, status::Status};
use crate::{
    dataplane::Dataplane,
    model::{NodeInfo, NodeView, ViewConfig, node_view},
    source::{SharedSnapshot, files},
};

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
    log_rejections(&rejected);
    Ok(view)
}

/// Runs until `shutdown` resolves or the source goes away.
///
/// Each snapshot is compared with the previous one (persistent maps: in proportion to
/// the changes), only the Services that changed are rebuilt in the view, and only the
/// frontends that changed are handed to the dataplane. Between changes the audit checks
/// the dataplane against what was programmed, a step at a time; the periodic resync
/// re-attaches hooks. A full rebuild and compare happens only at the first snapshot, on
/// a new node identity or settings, and after a failed apply.
pub async fn run<D: Dataplane>(
    mut source: watch::Receiver<Option<SharedSnapshot>>,
    cfg: ViewConfig,
    dataplane: &mut D,
    timing: Timing,
    status: Status,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    tokio::pin!(shutdown);
    status.set_health_timeout(timing.resync * 2);
    let mut pacing = Pacing::new(timing, TokioClock);
    let mut programmer = Programmer::new(dataplane, cfg, status.clone());
    loop {
        let wake = pacing.next_wake();
        let forced = tokio::select! {
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
                false
            }
            _ = sleep_until(wake) => true,
        };
        // An audit step, when it is all that is due: a change, a retry or the resync
        // goes first.
        if forced && let Some(began) = pacing.start_audit_step() {
            if !source.has_changed().unwrap_or(false)
                && let Some(pass_done) = programmer.audit_step()
            {
                pacing.audit_step_done(began, pass_done);
            }
            continue;
        }
        // Coalesce: at most one apply per minimum interval — but a shutdown does not wait
        // for it (the pinned programs keep serving what is programmed).
        if let Some(not_before) = pacing.apply_not_before() {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                _ = sleep_until(not_before) => {}
            }
        }
        let Some(snapshot) = source.borrow_and_update().clone() else {
            continue; // the source has not seen everything yet
        };
        programmer.bring_up_to(&snapshot, forced, &mut pacing);
    }
}

/// Sleeps until `deadline` on tokio's clock (the one `TokioClock` reads).
async fn sleep_until(deadline: std::time::Instant) {
    tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)).await;
}
