//! What the runner keeps between snapshots and does with each, apart from when: the
//! view tracker and the model it was built from, the frontends not yet applied, what
//! the last apply was given — and the steps that move them (stage a partial snapshot,
//! sync a complete one, audit a step of what is programmed).

use std::{collections::BTreeSet, time::SystemTime};

use super::{
    clock::Clock,
    latency,
    pacing::{AUDIT_STEPS, Pacing},
    status::Status,
};
use crate::{
    dataplane::{ApplyReport, Dataplane},
    health_check::HealthServers,
    model::{
        Frontend, NodeSettings, NodeView, Rejection, ViewConfig, ViewTracker,
        health_check_addresses,
    },
    source::SharedSnapshot,
};

/// Trigger times of EndpointSlice changes not yet in the dataplane, for network
/// programming latency (kube-proxy's histogram): observed when a sync holding them
/// succeeds.
#[derive(Default)]
struct Programming(Vec<SystemTime>);

impl Programming {
    /// Everything seen so far is in effect.
    fn done(&mut self, status: &Status) {
        status.updated();
        let now = SystemTime::now();
        for t in self.0.drain(..) {
            status.observe_programming(latency::since(t, now));
        }
    }
}

/// The runner's state between snapshots, and the dataplane it programs.
pub(super) struct Programmer<'d, D> {
    dataplane: &'d mut D,
    cfg: ViewConfig,
    status: Status,
    settings: Option<NodeSettings>,
    health: HealthServers,
    programming: Programming,
    tracker: Option<ViewTracker>,
    /// The model the tracker's view was built from.
    tracked: Option<SharedSnapshot>,
    /// Frontends changed since the last successful apply, and whether the next apply
    /// must compare everything (the first, and after a failure).
    pending: BTreeSet<Frontend>,
    full_apply: bool,
    applied: Option<NodeView>,
    /// The source's count of unreadable objects, as last counted.
    last_unreadable: u64,
}

impl<'d, D: Dataplane> Programmer<'d, D> {
    pub(super) fn new(dataplane: &'d mut D, cfg: ViewConfig, status: Status) -> Self {
        // The dataplane's limits arrive in the view as settings.
        let cfg = ViewConfig {
            max_endpoints: cfg.max_endpoints.min(dataplane.max_endpoints()),
            ..cfg
        };
        Self {
            dataplane,
            cfg,
            health: HealthServers::new(status.health_probe()),
            status,
            settings: None,
            programming: Programming::default(),
            tracker: None,
            tracked: None,
            pending: BTreeSet::new(),
            full_apply: true,
            applied: None,
            last_unreadable: 0,
        }
    }

    /// One step of the audit, once what is programmed is settled (applied, and no failed
    /// apply waiting for its retry): whether it ended a pass (`None`: no step ran).
    pub(super) fn audit_step(&mut self) -> Option<bool> {
        if self.full_apply || self.applied.is_none() {
            return None;
        }
        // A pass takes a little more than AUDIT_STEPS steps (the share is rounded up).
        match self.dataplane.audit(1.0 / f64::from(AUDIT_STEPS)) {
            Ok(report) => {
                self.status.record_audit(&report);
                Some(report.pass_done)
            }
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), kind = %e.kind(), "auditing the dataplane failed");
                self.status.count_dataplane_error("audit", &e);
                None
            }
        }
    }

    /// A snapshot from the source: a partial one is staged; a complete one brings the
    /// view up to it and applies what changed (everything, after a failure), with the
    /// periodic resync when the clock woke the loop and it is due. `pacing` hears of the
    /// resync and of the apply and its outcome.
    pub(super) fn bring_up_to<C: Clock>(
        &mut self,
        snapshot: &SharedSnapshot,
        forced: bool,
        pacing: &mut Pacing<C>,
    ) {
        if snapshot.partial {
            self.stage(snapshot);
            return;
        }
        // Trigger times count from the first complete snapshot on: before it, the
        // first lists' objects, which changed nothing programmed.
        let after_partial = self.tracked.as_ref().is_some_and(|s| s.partial);
        // Checks that repeat the API server's validation are for sources it did not
        // validate (a change of source rebuilds the view, as a change of settings does).
        self.cfg.api_validated = snapshot.api_validated;
        self.configure(snapshot);
        let resync = forced && pacing.resync_due();
        let mut t = self
            .tracker
            .take()
            .unwrap_or_else(|| ViewTracker::new(snapshot.node.clone(), self.cfg.clone()));
        let first = self.update_view(&mut t, snapshot, after_partial);
        if resync {
            pacing.resynced();
            if let Err(e) = self.dataplane.resync() {
                tracing::warn!(
                    error = format!("{e:#}"),
                    kind = %e.kind(),
                    "checking the dataplane's hooks failed"
                );
                self.status.count_dataplane_error("resync", &e);
            }
        }
        if !self.full_apply && self.pending.is_empty() {
            // Nothing this node does changed: the change is in effect as it is.
            self.status.record_unchanged(snapshot);
            self.programming.done(&self.status);
        } else {
            pacing.apply_begins();
            if self.apply(&mut t, snapshot, first) {
                pacing.apply_succeeded();
            } else {
                pacing.apply_failed();
            }
        }
        self.tracker = Some(t);
    }

    /// A partial snapshot (the first lists, still arriving): the view updated with what
    /// it brought, and the dataplane stages it. Nothing is applied, reported or served;
    /// the first complete snapshot's apply compares everything as usual.
    fn stage(&mut self, snapshot: &SharedSnapshot) {
        let mut cfg = self.cfg.clone();
        cfg.api_validated = snapshot.api_validated;
        let mut t = self
            .tracker
            .take()
            .unwrap_or_else(|| ViewTracker::new(snapshot.node.clone(), cfg.clone()));
        let node_changed = t.set_node(&snapshot.node, &cfg);
        let started = std::time::Instant::now();
        let changes = match self.tracked.as_ref() {
            Some(prev) if !node_changed => t.update(
                &snapshot.model,
                &prev.model.changes_to(&snapshot.model).services,
            ),
            _ => t.rebuild(&snapshot.model),
        };
        self.tracked = Some(SharedSnapshot::clone(snapshot));
        // Logged and counted now: to the tracker they are not new any more.
        log_rejections(&changes.new_rejections);
        if !changes.new_rejections.is_empty() {
            self.status.count_rejections(changes.new_rejections.len());
        }
        match self.dataplane.stage(t.view(), &changes.frontends) {
            Ok(staged) => tracing::debug!(
                staged,
                frontends = t.view().len(),
                took_ms = started.elapsed().as_millis() as u64,
                "first programming staged ahead"
            ),
            // The apply writes everything then.
            Err(e) => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    kind = %e.kind(),
                    "staging the first programming failed"
                );
                self.status.count_dataplane_error("stage", &e);
            }
        }
        self.tracker = Some(t);
    }

    /// Tells the dataplane who this node is, when that changed (a failure is tried again
    /// with the next snapshot).
    fn configure(&mut self, snapshot: &SharedSnapshot) {
        let wanted = NodeSettings::new(&snapshot.node, snapshot.nodes.values(), &self.cfg);
        if self.settings.as_ref() == Some(&wanted) {
            return;
        }
        match self.dataplane.configure(&wanted) {
            Ok(()) => self.settings = Some(wanted),
            Err(e) => {
                tracing::error!(
                    error = format!("{e:#}"),
                    kind = %e.kind(),
                    "configuring the node settings failed; will retry"
                );
                self.status.count_dataplane_error("configure", &e);
            }
        }
    }

    /// Brings the view `t` up to `snapshot`: the changed Services, or everything (the
    /// first snapshot, a new node identity or settings). Their frontends join the pending
    /// ones; the health-check listeners follow. Whether this was the first complete view.
    fn update_view(
        &mut self,
        t: &mut ViewTracker,
        snapshot: &SharedSnapshot,
        after_partial: bool,
    ) -> bool {
        let node_changed = t.set_node(&snapshot.node, &self.cfg);
        let view_started = std::time::Instant::now();
        let changes = match &self.tracked {
            Some(prev) => {
                let model_changes = prev.model.changes_to(&snapshot.model);
                if !after_partial {
                    self.programming.0.extend(model_changes.triggers);
                }
                if node_changed {
                    t.rebuild(&snapshot.model)
                } else {
                    t.update(&snapshot.model, &model_changes.services)
                }
            }
            None => t.rebuild(&snapshot.model),
        };
        let first = self.tracked.is_none() || after_partial;
        if first {
            tracing::info!(
                frontends = t.view().len(),
                took_ms = view_started.elapsed().as_millis() as u64,
                "node view built"
            );
        }
        self.tracked = Some(SharedSnapshot::clone(snapshot));
        self.pending.extend(changes.frontends.iter().copied());
        if changes.health || node_changed || first {
            self.health.update(
                &t.health_checks(),
                health_check_addresses(&snapshot.node, &self.cfg).as_deref(),
            );
        }
        log_rejections(&changes.new_rejections);
        let unreadable = if snapshot.unreadable != self.last_unreadable {
            self.last_unreadable = snapshot.unreadable;
            snapshot.unreadable as usize
        } else {
            0
        };
        if !changes.new_rejections.is_empty() || unreadable > 0 {
            // What the source could not read counts too (its lines were logged there).
            self.status
                .count_rejections(changes.new_rejections.len() + unreadable);
        }
        first
    }

    /// Hands the view to the dataplane — the pending frontends, or everything — and
    /// records the outcome: whether every frontend was programmed (else a retry is due).
    fn apply(&mut self, t: &mut ViewTracker, snapshot: &SharedSnapshot, first: bool) -> bool {
        let view = t.view().clone();
        let started = std::time::Instant::now();
        let outcome = if self.full_apply {
            self.dataplane.apply(&view)
        } else {
            self.dataplane.apply_changes(&view, &self.pending)
        };
        self.status.record_sync(
            snapshot,
            &view,
            self.applied.as_ref(),
            started.elapsed(),
            &outcome,
            t.no_local_endpoints(),
        );
        self.applied = Some(view);
        if first {
            // Built in key order: see `model::compact`. After the apply, not before it;
            // the applied view is the compacted one (the same entries), so the next
            // sync's diff against it stays in proportion to its changes.
            t.compact();
            self.applied = Some(t.view().clone());
            self.status.replace_view(t.view());
        }
        if let Ok(report) = &outcome {
            log_left_as_they_are(report);
        }
        match outcome {
            Ok(report) if report.failed.is_empty() => {
                self.programming.done(&self.status);
                self.pending.clear();
                self.full_apply = false;
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
                true
            }
            Ok(report) => {
                for f in &report.failed {
                    tracing::error!(frontend = %f, "frontend not programmed; will retry");
                }
                self.full_apply = true;
                false
            }
            Err(e) => {
                tracing::error!(
                    error = format!("{e:#}"),
                    "dataplane sync failed; will retry"
                );
                self.full_apply = true;
                false
            }
        }
    }
}

/// Frontends refused or adjusted: not retried, since the dataplane can never hold them
/// as they are. The rest of the node is programmed, and stays healthy.
fn log_left_as_they_are(report: &ApplyReport) {
    for f in &report.refused {
        tracing::error!(frontend = %f, "frontend refused by the dataplane; not retried");
    }
    for f in &report.adjusted {
        tracing::warn!(frontend = %f, "frontend programmed otherwise than its Service says");
    }
}

/// Logs each object the view left out.
pub(super) fn log_rejections(rejections: &[Rejection]) {
    for r in rejections {
        tracing::warn!(kind = r.kind.as_str(), object = %r.object, reason = %r.reason, "skipping invalid object");
    }
}
