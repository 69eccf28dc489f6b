//! What the runner last did, shared with the HTTP server and metrics: the model, the
//! node view, counters, and a stream of view diffs for `proxy-agent watch`.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio::sync::broadcast;

use crate::{
    dataplane::{
        ApplyReport, ErrorKind,
        bpf::{AttachFailures, ForeignClassifier, NodeHooks, XdpStatus},
    },
    model::{NodeView, diff_lines},
    source::{
        ChangeCounts, SharedSnapshot,
        api_server::{ApiCounters, ApiCounts},
    },
};

/// Counters and the latest state, as the debug endpoint shows them.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Counters {
    pub syncs_ok: u64,
    pub syncs_failed: u64,
    pub frontends_failed: u64,
    /// Frontends the dataplane can never hold as the view gives them (not retried).
    pub frontends_refused: u64,
    /// Frontends programmed otherwise than their Service says (`wrr` weights scaled).
    pub frontends_adjusted: u64,
    pub objects_rejected: u64,
    pub udp_sockets_destroyed: u64,
    /// Audit passes ended, frontends it wrote again, entries it removed.
    pub audit_passes: u64,
    pub audit_repaired: u64,
    pub audit_removed: u64,
    /// Classifier attachments to interfaces that failed.
    pub interface_attach_failures: u64,
    /// Events (the "Starting" event) the API server did not record.
    pub events_failed: u64,
    /// Hooks of ours found lost (pin deleted, link detached, filter deleted) and attached
    /// again.
    pub hooks_repaired: u64,
    /// Stale classifiers of other pin folders (their agent gone) taken off our interfaces.
    pub stale_classifiers_removed: u64,
    /// Foreign classifiers on our interfaces now, left in place.
    pub foreign_classifiers: u64,
    pub last_sync_seconds: f64,
    /// Answers of `/healthz` and `/livez` by status code (kube-proxy's
    /// `proxy_healthz_total` and `proxy_livez_total`).
    pub healthz_answers: std::collections::BTreeMap<u16, u64>,
    pub livez_answers: std::collections::BTreeMap<u16, u64>,
    /// Changes the source has seen, and those the last sync included.
    pub changes_seen: ChangeCounts,
    pub changes_synced: ChangeCounts,
    /// Service ports with a Local traffic policy and no local endpoint, by policy
    /// (`internal`, `external`) and family (`IPv4`, `IPv6`), as of the last sync.
    pub no_local_endpoints: std::collections::BTreeMap<(&'static str, &'static str), u64>,
    /// The per-packet path's connection tracking, as its collector last measured it.
    pub conntrack: ConntrackFill,
    /// The service-side maps, as of the last apply.
    pub maps: crate::dataplane::MapFill,
    /// Dataplane calls that failed, by call (`apply`, `stage`, `configure`, `resync`,
    /// `audit`) and the error's kind (`proxy_dataplane::ErrorKind`).
    pub dataplane_errors: std::collections::BTreeMap<(&'static str, ErrorKind), u64>,
    /// API errors by kind and status, and relists, as the source counted them.
    pub api: ApiCounts,
}

impl Counters {
    fn count_dataplane_error(&mut self, call: &'static str, e: &crate::dataplane::Error) {
        *self.dataplane_errors.entry((call, e.kind())).or_default() += 1;
    }
}

/// How full the connection-tracking tables are (entries, two per flow) and how many
/// entries the collector has removed in all.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ConntrackFill {
    pub answered: u64,
    pub answered_capacity: u64,
    pub new: u64,
    pub new_capacity: u64,
    pub collected_total: u64,
    /// Entries of live answered flows removed to keep room for promotions.
    pub evicted_total: u64,
}

#[derive(Default)]
struct State {
    snapshot: Option<SharedSnapshot>,
    view: NodeView,
    counters: Counters,
    /// The oldest source change not yet in the dataplane (kube-proxy's healthz clock).
    pending_since: Option<std::time::Instant>,
    last_updated: Option<std::time::SystemTime>,
    /// How long a change may wait before `/healthz` fails (2 × syncPeriod).
    health_timeout: Duration,
    /// Since when the source has had no link to where its data comes from (the server
    /// feed): the data may be older than that.
    source_lost_since: Option<std::time::Instant>,
}

/// What `/livez` and `/healthz` answer, by kube-proxy's rules: the proxy is healthy while
/// starting and while synced, unhealthy once a change has waited longer than the timeout
/// (2 × syncPeriod); `/healthz` also fails while the node is draining, so load balancers
/// stop sending it traffic (`/livez` does not: restarting would not help). Ours besides:
/// `/healthz` fails while a foreign classifier (another agent's) sits on an interface we
/// serve, since what it translates is not what we were told (`/livez` does not: a
/// restart would find it again).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// The proxy itself (`/livez`).
    pub healthy: bool,
    /// The Node is not being deleted nor tainted for deletion by the cluster autoscaler.
    pub node_eligible: bool,
    pub last_updated: Option<std::time::SystemTime>,
    /// How long the oldest pending change has waited.
    pub pending_for: Option<Duration>,
    /// Classifiers of other agents on the interfaces we serve (`/healthz` fails while
    /// there is one).
    pub foreign_classifiers: Vec<ForeignClassifier>,
}

impl Health {
    /// What `/healthz` answers: the proxy is healthy, the node eligible, and no foreign
    /// classifier shares our interfaces.
    pub fn serving(&self) -> bool {
        self.healthy && self.node_eligible && self.foreign_classifiers.is_empty()
    }
}

struct Inner {
    state: Mutex<State>,
    diffs: broadcast::Sender<String>,
    histograms: Histograms,
    attach_failures: AttachFailures,
    xdp: XdpStatus,
    api: ApiCounters,
    hooks: NodeHooks,
}

/// Latency distributions, as kube-proxy exports them.
#[derive(Clone)]
pub struct Histograms {
    /// How long each dataplane sync took.
    pub sync: Histogram,
    /// From an EndpointSlice change (its trigger time) to this node holding it.
    pub programming: Histogram,
    /// The same, in kube-proxy's buckets (0.25 s to 5 min), under kube-proxy's name.
    pub programming_kube: Histogram,
}

impl Default for Histograms {
    fn default() -> Self {
        // 1 ms to ~65 s: we aim at milliseconds, kube-proxy's tail is seconds.
        let buckets = || Histogram::new(exponential_buckets(0.001, 2.0, 17));
        Self {
            sync: buckets(),
            programming: buckets(),
            programming_kube: super::latency::kube_proxy_programming_histogram(),
        }
    }
}

/// A cheap handle; clones share the same state.
#[derive(Clone)]
pub struct Status(Arc<Inner>);

impl Default for Status {
    fn default() -> Self {
        let (diffs, _) = broadcast::channel(4096);
        Self(Arc::new(Inner {
            state: Mutex::new(State::default()),
            diffs,
            histograms: Histograms::default(),
            attach_failures: AttachFailures::default(),
            xdp: XdpStatus::default(),
            api: ApiCounters::default(),
            hooks: NodeHooks::default(),
        }))
    }
}

impl Status {
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        // A panic elsewhere while holding the lock leaves plain data behind: keep going.
        let mut guard = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    /// The latency histograms (clones share their counts).
    pub fn histograms(&self) -> Histograms {
        self.0.histograms.clone()
    }

    pub(crate) fn observe_programming(&self, took: Duration) {
        self.0.histograms.programming.observe(took.as_secs_f64());
        self.0
            .histograms
            .programming_kube
            .observe(took.as_secs_f64());
    }

    pub(crate) fn set_health_timeout(&self, timeout: Duration) {
        self.with(|s| s.health_timeout = timeout);
    }

    /// A change arrived from the source.
    pub(crate) fn queued(&self, now: std::time::Instant) {
        self.with(|s| {
            s.pending_since.get_or_insert(now);
        });
    }

    /// The source's change counts as of its latest snapshot.
    pub(crate) fn seen(&self, changes: ChangeCounts) {
        self.with(|s| s.counters.changes_seen = changes);
    }

    /// Everything the source said is in effect.
    pub(crate) fn updated(&self) {
        self.with(|s| {
            s.pending_since = None;
            s.last_updated = Some(std::time::SystemTime::now());
        });
    }

    /// The source's link to its data (the server feed): lost, the data ages, and past
    /// the health timeout `/healthz` fails as it does for a change that waits too long.
    pub fn source_link(&self, up: bool, now: std::time::Instant) {
        self.with(|s| {
            if up {
                s.source_lost_since = None;
            } else {
                s.source_lost_since.get_or_insert(now);
            }
        });
    }

    /// Whether the proxy is healthy now, as the healthCheckNodePort listeners ask it.
    pub fn health_probe(&self) -> crate::health_check::ProxyHealthy {
        let status = self.clone();
        Arc::new(move || status.health(std::time::Instant::now()).healthy)
    }

    pub fn health(&self, now: std::time::Instant) -> Health {
        let foreign = self.0.hooks.report().foreign;
        self.with(|s| {
            // Data from a source without its link is as old as the link's loss.
            let pending_for = s
                .pending_since
                .into_iter()
                .chain(s.source_lost_since)
                .min()
                .map(|t| now.saturating_duration_since(t));
            let timeout = if s.health_timeout.is_zero() {
                Duration::from_secs(60)
            } else {
                s.health_timeout
            };
            Health {
                healthy: pending_for.is_none_or(|p| p < timeout),
                node_eligible: s.snapshot.as_ref().is_none_or(|snap| !snap.node.draining),
                last_updated: s.last_updated,
                pending_for,
                foreign_classifiers: foreign,
            }
        })
    }

    /// Counts one answer of `/healthz` (`livez: false`) or `/livez`.
    pub fn count_health_answer(&self, livez: bool, code: u16) {
        self.with(|s| {
            let answers = if livez {
                &mut s.counters.livez_answers
            } else {
                &mut s.counters.healthz_answers
            };
            *answers.entry(code).or_insert(0) += 1;
        });
    }

    /// An event that could not be recorded (logged by whoever tried).
    pub fn count_event_failure(&self) {
        self.with(|s| s.counters.events_failed += 1);
    }

    /// A dataplane call that failed: logged by the caller, counted here by its kind.
    pub(crate) fn count_dataplane_error(&self, call: &'static str, e: &crate::dataplane::Error) {
        self.with(|s| s.counters.count_dataplane_error(call, e));
    }

    pub(crate) fn count_rejections(&self, n: usize) {
        self.with(|s| s.counters.objects_rejected += n as u64);
    }

    /// The view the last sync recorded, as the same entries in another tree (the
    /// tracker's compaction): kept instead, so the old tree is not held beside it.
    pub(crate) fn replace_view(&self, view: &NodeView) {
        self.with(|s| s.view = view.clone());
    }

    pub(crate) fn record_sync(
        &self,
        snapshot: &SharedSnapshot,
        view: &NodeView,
        previous: Option<&NodeView>,
        took: Duration,
        outcome: &Result<ApplyReport, crate::dataplane::Error>,
        no_local: std::collections::BTreeMap<(&'static str, &'static str), u64>,
    ) {
        self.0.histograms.sync.observe(took.as_secs_f64());
        self.with(|s| {
            s.snapshot = Some(SharedSnapshot::clone(snapshot));
            s.counters.changes_synced = snapshot.changes;
            s.counters.no_local_endpoints = no_local;
            s.view = view.clone();
            s.counters.last_sync_seconds = took.as_secs_f64();
            if let Ok(r) = outcome {
                s.counters.frontends_refused += r.refused.len() as u64;
                s.counters.frontends_adjusted += r.adjusted.len() as u64;
            }
            match outcome {
                Ok(r) if r.failed.is_empty() => {
                    s.counters.maps = r.fill.unwrap_or(s.counters.maps);
                    s.counters.syncs_ok += 1;
                    s.counters.udp_sockets_destroyed += r.udp_sockets_destroyed as u64;
                }
                Ok(r) => {
                    s.counters.maps = r.fill.unwrap_or(s.counters.maps);
                    s.counters.syncs_failed += 1;
                    s.counters.frontends_failed += r.failed.len() as u64;
                }
                Err(e) => {
                    s.counters.syncs_failed += 1;
                    s.counters.count_dataplane_error("apply", e);
                }
            }
        });
        // After the counters: the maps hold the view already, and a first sync's
        // lines (one per frontend, 100k of them) are made only for someone watching.
        if self.0.diffs.receiver_count() > 0 {
            let empty = NodeView::new();
            for line in diff_lines(previous.unwrap_or(&empty), view) {
                // A subscriber that went meanwhile is fine.
                let _ = self.0.diffs.send(line);
            }
        }
    }

    /// One audit step: what it repaired is logged and counted; a pass that ends with
    /// nothing pending confirms the programmed state (as kube-proxy's periodic sync
    /// moves `sync_proxy_rules_last_timestamp_seconds`).
    pub(crate) fn record_audit(&self, report: &crate::dataplane::AuditReport) {
        if report.repaired + report.removed > 0 {
            tracing::warn!(
                frontends_repaired = report.repaired,
                entries_removed = report.removed,
                "the audit found the dataplane drifted from what was programmed; repaired"
            );
        }
        self.with(|s| {
            s.counters.audit_repaired += report.repaired as u64;
            s.counters.audit_removed += report.removed as u64;
            if report.pass_done {
                s.counters.audit_passes += 1;
                if s.pending_since.is_none() {
                    s.last_updated = Some(std::time::SystemTime::now());
                }
            }
        });
    }

    /// A snapshot that changed nothing in the view is in effect as it is.
    pub(crate) fn record_unchanged(&self, snapshot: &SharedSnapshot) {
        self.with(|s| {
            s.snapshot = Some(SharedSnapshot::clone(snapshot));
            s.counters.changes_synced = snapshot.changes;
        });
    }

    /// The latest snapshot the view was built from.
    pub fn snapshot(&self) -> Option<SharedSnapshot> {
        self.with(|s| s.snapshot.clone())
    }

    /// The latest node view.
    pub fn view(&self) -> NodeView {
        self.with(|s| s.view.clone())
    }

    /// Records a collector pass: the tables' fill now, `collected` more removals of ended
    /// flows and `evicted` of live ones (room).
    pub fn record_conntrack(&self, fill: ConntrackFill, collected: u64, evicted: u64) {
        self.with(|s| {
            let c = &s.counters.conntrack;
            s.counters.conntrack = ConntrackFill {
                collected_total: c.collected_total + collected,
                evicted_total: c.evicted_total + evicted,
                ..fill
            };
        });
    }

    pub fn counters(&self) -> Counters {
        let mut c = self.with(|s| s.counters.clone());
        c.interface_attach_failures = self.0.attach_failures.get();
        c.api = self.0.api.get();
        let hooks = self.0.hooks.report();
        c.hooks_repaired = hooks.repaired;
        c.stale_classifiers_removed = hooks.stale_removed;
        c.foreign_classifiers = hooks.foreign.len() as u64;
        c
    }

    /// The API source's counts of errors and relists (clones share them).
    pub fn api_counters(&self) -> ApiCounters {
        self.0.api.clone()
    }

    /// The dataplane's count of failed classifier attachments (clones share it).
    pub fn attach_failures(&self) -> AttachFailures {
        self.0.attach_failures.clone()
    }

    /// Which interfaces run the XDP program, and how (clones share it).
    pub fn xdp(&self) -> XdpStatus {
        self.0.xdp.clone()
    }

    /// The dataplane's report of its hooks' checks (clones share it).
    pub fn hooks(&self) -> NodeHooks {
        self.0.hooks.clone()
    }

    /// View diffs (`+`/`-` lines) from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<String> {
        self.0.diffs.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn healthz_fails_when_a_change_waits_too_long() {
        let st = Status::default();
        st.set_health_timeout(Duration::from_secs(60));
        let t0 = Instant::now();
        assert!(
            st.health(t0).healthy,
            "healthy while starting, as kube-proxy"
        );
        st.queued(t0);
        assert!(
            !st.health(t0 + Duration::from_secs(61)).healthy,
            "never synced"
        );
        st.updated();
        assert!(st.health(t0).healthy);
        st.queued(t0);
        st.queued(t0 + Duration::from_secs(30)); // the oldest pending change counts
        let h = st.health(t0 + Duration::from_secs(59));
        assert!(h.healthy && h.pending_for == Some(Duration::from_secs(59)));
        assert!(!st.health(t0 + Duration::from_secs(61)).healthy, "stuck");
        st.updated();
        let h = st.health(t0 + Duration::from_secs(61));
        assert!(h.healthy && h.pending_for.is_none() && h.last_updated.is_some());
    }

    #[test]
    fn a_foreign_classifier_fails_healthz_while_it_is_there() {
        let st = Status::default();
        let t0 = Instant::now();
        st.hooks().set_foreign(vec![ForeignClassifier {
            interface: "eth0".into(),
            hook: "ingress",
            attach: "tcx",
            program: "tc_ingress".into(),
            program_id: 7,
            pin_dir: Some("/sys/fs/bpf/other".into()),
            agent_running: true,
            shadows_ours: true,
        }]);
        let h = st.health(t0);
        assert!(h.healthy, "/livez stays 200: {h:?}");
        assert!(!h.serving() && h.foreign_classifiers.len() == 1, "{h:?}");
        assert_eq!(st.counters().foreign_classifiers, 1);
        st.hooks().set_foreign(Vec::new());
        assert!(st.health(t0).serving());
    }

    #[test]
    fn a_draining_node_is_not_eligible_but_still_live() {
        use crate::source::Snapshot;
        let st = Status::default();
        let t0 = Instant::now();
        assert!(st.health(t0).node_eligible);
        let mut snap = Snapshot::default();
        snap.node.draining = true;
        st.with(|s| s.snapshot = Some(Arc::new(snap)));
        let h = st.health(t0);
        assert!(h.healthy && !h.node_eligible, "{h:?}");
    }
}
