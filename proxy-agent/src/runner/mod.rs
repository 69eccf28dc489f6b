//! The runner: turns each new snapshot from a source into the node view and hands it
//! to the dataplane — bursts coalesced by a minimum interval, an audit that compares the
//! dataplane with what was programmed a little at a time between changes (one pass per
//! resync period) and repairs drift, and retries with backoff when an apply fails.

pub mod latency;
pub mod status;

use std::{collections::BTreeSet, time::Duration};

use anyhow::Result;
use tokio::{sync::watch, time::Instant};

pub use self::status::Status;
use crate::{
    dataplane::Dataplane,
    health_check::HealthServers,
    model::{
        Frontend, NodeInfo, NodeSettings, NodeView, ViewConfig, ViewTracker,
        health_check_addresses, node_view,
    },
    source::{SharedSnapshot, files},
};

/// Trigger times of EndpointSlice changes not yet in the dataplane, for network
/// programming latency (kube-proxy's histogram): observed when a sync holding them
/// succeeds.
#[derive(Default)]
struct Programming(Vec<std::time::SystemTime>);

impl Programming {
    /// Everything seen so far is in effect.
    fn done(&mut self, status: &Status) {
        status.updated();
        let now = std::time::SystemTime::now();
        for t in self.0.drain(..) {
            status.observe_programming(latency::since(t, now));
        }
    }
}

/// Timing of the runner (kube-proxy's minSyncPeriod / syncPeriod).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub min_interval: Duration,
    pub resync: Duration,
    /// First retry delay after a failed apply; doubles up to `resync`.
    pub retry: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            // kube-proxy's minSyncPeriod is 1 s because each iptables sync is costly; a
            // map update is not, so bursts are coalesced over a much shorter window: at
            // 100 changes/s a change waits at most this long (100 ms here made the p99
            // floor ~130 ms, issue 24's target is 50 ms).
            min_interval: Duration::from_millis(10),
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
    log_rejections(&rejected);
    Ok(view)
}

/// A partial snapshot (the first lists, still arriving): the view updated with what it
/// brought, and the dataplane stages it. Nothing is applied, reported or served; the
/// first complete snapshot's apply compares everything as usual.
fn stage<D: Dataplane>(
    snapshot: &SharedSnapshot,
    cfg: &ViewConfig,
    dataplane: &mut D,
    tracker: &mut Option<ViewTracker>,
    tracked: &mut Option<SharedSnapshot>,
    status: &Status,
) {
    let mut cfg = cfg.clone();
    cfg.api_validated = snapshot.api_validated;
    let t = tracker.get_or_insert_with(|| ViewTracker::new(snapshot.node.clone(), cfg.clone()));
    let node_changed = t.set_node(&snapshot.node, &cfg);
    let started = std::time::Instant::now();
    let changes = match tracked.as_ref() {
        Some(prev) if !node_changed => t.update(
            &snapshot.model,
            &prev.model.changes_to(&snapshot.model).services,
        ),
        _ => t.rebuild(&snapshot.model),
    };
    *tracked = Some(SharedSnapshot::clone(snapshot));
    // Logged and counted now: to the tracker they are not new any more.
    log_rejections(&changes.new_rejections);
    if !changes.new_rejections.is_empty() {
        status.count_rejections(changes.new_rejections.len());
    }
    match dataplane.stage(t.view(), &changes.frontends) {
        Ok(staged) => tracing::debug!(
            staged,
            frontends = t.view().len(),
            took_ms = started.elapsed().as_millis() as u64,
            "first programming staged ahead"
        ),
        // The apply writes everything then.
        Err(e) => tracing::warn!(
            error = format!("{e:#}"),
            "staging the first programming failed"
        ),
    }
}

fn log_rejections(rejections: &[crate::model::Rejection]) {
    for r in rejections {
        tracing::warn!(kind = r.kind.as_str(), object = %r.object, reason = %r.reason, "skipping invalid object");
    }
}

/// Steps of the audit per resync period: each compares about 1/`AUDIT_STEPS` of what is
/// programmed (at 100k Services, a thousand frontends: milliseconds, not the seconds a
/// whole pass takes), so no change waits long behind one.
const AUDIT_STEPS: u32 = 100;

/// The most of a core the audit takes: a step that took `t` is followed by the next no
/// sooner than `t × AUDIT_DUTY_DIVISOR` later. (At 100k Services a step of 256 frontends
/// takes ~9 ms of lookups: every 300 ms, that was 3% of a core beside the traffic.)
const AUDIT_DUTY_DIVISOR: u32 = 100;

/// When the audit's steps run: one every `every` at most, spaced so the audit takes no
/// more than 1/`AUDIT_DUTY_DIVISOR` of a core, and a new pass no sooner than `period`
/// after the last one began. A small node's pass ends within a few steps, and each pass
/// walks every bucket of the maps (empty ones too: millions); back to back, those walks
/// kept an idle agent at one Service at 1.2% of a core (0.2% paced). A pass longer than `period`
/// (above ~25k frontends) is followed by the next at once.
struct AuditPace {
    every: Duration,
    period: Duration,
    /// When the pass under way began (its first step).
    pass_began: Option<Instant>,
}

impl AuditPace {
    /// The next step's time, after a step that began at `began` and ended at `now`
    /// (`done`: it ended its pass).
    fn after_step(&mut self, began: Instant, now: Instant, done: bool) -> Instant {
        let pass_began = *self.pass_began.get_or_insert(began);
        let next = now + self.every.max((now - began) * AUDIT_DUTY_DIVISOR);
        if !done {
            return next;
        }
        self.pass_began = None;
        next.max(pass_began + self.period)
    }
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
    // The dataplane's limits arrive in the view as settings.
    let mut cfg = ViewConfig {
        max_endpoints: cfg.max_endpoints.min(dataplane.max_endpoints()),
        ..cfg
    };
    status.set_health_timeout(timing.resync * 2);
    let mut last_sync: Option<Instant> = None;
    let mut next_resync = Instant::now() + timing.resync;
    let audit_every = (timing.resync / AUDIT_STEPS).max(Duration::from_millis(5));
    let mut next_audit = Instant::now() + audit_every;
    let mut audit_pace = AuditPace {
        every: audit_every,
        period: timing.resync,
        pass_began: None,
    };
    let mut retry_at: Option<Instant> = None;
    let mut retry_delay = timing.retry;
    let mut last_unreadable = 0;
    let mut settings: Option<NodeSettings> = None;
    let mut health = HealthServers::new(status.health_probe());
    let mut programming = Programming::default();
    let mut tracker: Option<ViewTracker> = None;
    // The model the tracker's view was built from.
    let mut tracked: Option<SharedSnapshot> = None;
    // Frontends changed since the last successful apply, and whether the next apply must
    // compare everything (the first, after a failure, after a resync).
    let mut pending: BTreeSet<Frontend> = BTreeSet::new();
    let mut full_apply = true;
    let mut applied: Option<NodeView> = None;
    loop {
        let wake = retry_at
            .map_or(next_resync, |r| r.min(next_resync))
            .min(next_audit);
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
        // An audit step, when it is all that is due: a change, a retry or the resync
        // goes first.
        let now = Instant::now();
        if forced && now >= next_audit && now < next_resync && retry_at.is_none_or(|r| now < r) {
            next_audit = now + audit_every;
            let settled = !full_apply && applied.is_some();
            if settled && !source.has_changed().unwrap_or(false) {
                // A pass takes a little more than AUDIT_STEPS steps (the share is rounded up).
                match dataplane.audit(1.0 / f64::from(AUDIT_STEPS)) {
                    Ok(report) => {
                        status.record_audit(&report);
                        next_audit = audit_pace.after_step(now, Instant::now(), report.pass_done);
                    }
                    Err(e) => {
                        tracing::warn!(error = format!("{e:#}"), "auditing the dataplane failed")
                    }
                }
            }
            continue;
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
        if snapshot.partial {
            stage(
                &snapshot,
                &cfg,
                dataplane,
                &mut tracker,
                &mut tracked,
                &status,
            );
            continue;
        }
        // Trigger times count from the first complete snapshot on: before it, the
        // first lists' objects, which changed nothing programmed.
        let after_partial = tracked.as_ref().is_some_and(|s| s.partial);
        // Checks that repeat the API server's validation are for sources it did not
        // validate (a change of source rebuilds the view, as a change of settings does).
        cfg.api_validated = snapshot.api_validated;
        let wanted = NodeSettings::new(&snapshot.node, snapshot.nodes.values(), &cfg);
        if settings.as_ref() != Some(&wanted) {
            match dataplane.configure(&wanted) {
                Ok(()) => settings = Some(wanted),
                Err(e) => tracing::error!(
                    error = format!("{e:#}"),
                    "configuring the node settings failed; will retry"
                ),
            }
        }
        let resync = forced && Instant::now() >= next_resync;
        // The view: the changed Services, or everything (the first snapshot, a new node
        // identity or settings).
        let t = tracker.get_or_insert_with(|| ViewTracker::new(snapshot.node.clone(), cfg.clone()));
        let node_changed = t.set_node(&snapshot.node, &cfg);
        let view_started = std::time::Instant::now();
        let changes = match &tracked {
            Some(prev) => {
                let model_changes = prev.model.changes_to(&snapshot.model);
                if !after_partial {
                    programming.0.extend(model_changes.triggers);
                }
                if node_changed {
                    t.rebuild(&snapshot.model)
                } else {
                    t.update(&snapshot.model, &model_changes.services)
                }
            }
            None => t.rebuild(&snapshot.model),
        };
        let first = tracked.is_none() || after_partial;
        if first {
            tracing::info!(
                frontends = t.view().len(),
                took_ms = view_started.elapsed().as_millis() as u64,
                "node view built"
            );
        }
        tracked = Some(SharedSnapshot::clone(&snapshot));
        pending.extend(changes.frontends.iter().copied());
        if changes.health || node_changed || first {
            health.update(
                &t.health_checks(),
                health_check_addresses(&snapshot.node, &cfg).as_deref(),
            );
        }
        log_rejections(&changes.new_rejections);
        let unreadable = if snapshot.unreadable != last_unreadable {
            last_unreadable = snapshot.unreadable;
            snapshot.unreadable as usize
        } else {
            0
        };
        if !changes.new_rejections.is_empty() || unreadable > 0 {
            // What the source could not read counts too (its lines were logged there).
            status.count_rejections(changes.new_rejections.len() + unreadable);
        }
        if resync {
            next_resync = Instant::now() + timing.resync;
            if let Err(e) = dataplane.resync() {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "checking the dataplane's hooks failed"
                );
            }
        }
        if !full_apply && pending.is_empty() {
            // Nothing this node does changed: the change is in effect as it is.
            status.record_unchanged(&snapshot);
            programming.done(&status);
            continue;
        }
        last_sync = Some(Instant::now());
        let view = t.view().clone();
        let started = std::time::Instant::now();
        let outcome = if full_apply {
            dataplane.apply(&view)
        } else {
            dataplane.apply_changes(&view, &pending)
        };
        status.record_sync(
            &snapshot,
            &view,
            applied.as_ref(),
            started.elapsed(),
            &outcome,
            t.no_local_endpoints(),
        );
        applied = Some(view);
        if first {
            // Built in key order: see `model::compact`. After the apply, not before it;
            // the applied view is the compacted one (the same entries), so the next
            // sync's diff against it stays in proportion to its changes.
            t.compact();
            applied = Some(t.view().clone());
            status.replace_view(t.view());
        }
        if let Ok(report) = &outcome {
            // Not retried: the dataplane can never hold them as they are. The rest of the
            // node is programmed, and stays healthy.
            for f in &report.refused {
                tracing::error!(frontend = %f, "frontend refused by the dataplane; not retried");
            }
            for f in &report.adjusted {
                tracing::warn!(frontend = %f, "frontend programmed otherwise than its Service says");
            }
        }
        match outcome {
            Ok(report) if report.failed.is_empty() => {
                programming.done(&status);
                pending.clear();
                full_apply = false;
                if report.frontends_written + report.frontends_removed > 0 {
                    tracing::info!(
                        written = report.frontends_written,
                        removed = report.frontends_removed,
                        backends_removed = report.backends_removed,
                        udp_sockets_destroyed = report.udp_sockets_destroyed,
                        frontends = t.view().len(),
                        took_ms = started.elapsed().as_millis() as u64,
                        "dataplane synced"
                    );
                }
                retry_at = None;
                retry_delay = timing.retry;
            }
            Ok(report) => {
                for f in &report.failed {
                    tracing::error!(frontend = %f, "frontend not programmed; will retry");
                }
                full_apply = true;
                retry_at = Some(Instant::now() + retry_delay);
                retry_delay = (retry_delay * 2).min(timing.resync);
            }
            Err(e) => {
                tracing::error!(
                    error = format!("{e:#}"),
                    "dataplane sync failed; will retry"
                );
                full_apply = true;
                retry_at = Some(Instant::now() + retry_delay);
                retry_delay = (retry_delay * 2).min(timing.resync);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pace() -> AuditPace {
        AuditPace {
            every: Duration::from_millis(300),
            period: Duration::from_secs(30),
            pass_began: None,
        }
    }

    #[test]
    fn a_short_pass_waits_for_its_period_and_a_long_one_does_not() {
        let t0 = Instant::now();
        let mut p = pace();
        let ms = Duration::from_millis;
        // Three quick steps: the next pass begins a period after this one began.
        assert_eq!(p.after_step(t0, t0, false), t0 + ms(300));
        assert_eq!(
            p.after_step(t0 + ms(300), t0 + ms(300), false),
            t0 + ms(600)
        );
        assert_eq!(
            p.after_step(t0 + ms(600), t0 + ms(600), true),
            t0 + ms(30_000)
        );
        // The next pass, 40 s long: the one after it begins one step later.
        let t1 = t0 + ms(30_000);
        assert_eq!(p.after_step(t1, t1, false), t1 + ms(300));
        let end = t1 + ms(40_000);
        assert_eq!(p.after_step(end, end, true), end + ms(300));
        // A pass of one step.
        let t2 = end + ms(300);
        assert_eq!(p.after_step(t2, t2, true), t2 + ms(30_000));
    }

    #[test]
    fn a_slow_step_spaces_the_next_to_keep_the_audit_to_one_percent_of_a_core() {
        let t0 = Instant::now();
        let mut p = pace();
        let ms = Duration::from_millis;
        // 9 ms of work: the next step 900 ms after it ended, not 300.
        assert_eq!(p.after_step(t0, t0 + ms(9), false), t0 + ms(909));
        // 2 ms: the step interval still rules.
        let t1 = t0 + ms(909);
        assert_eq!(p.after_step(t1, t1 + ms(2), false), t1 + ms(302));
    }
}
