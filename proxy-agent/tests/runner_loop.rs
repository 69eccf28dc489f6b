//! The sync loop's own promises: a shutdown never waits for the coalescing interval
//! (`minSyncPeriod: 60s` once kept SIGTERM waiting for up to two minutes); only the
//! frontends that changed reach the dataplane; a failed apply is retried on the pacing's
//! schedule; a frontend the dataplane can never hold never makes the node unhealthy
//! (`wrr` weights past a frontend's slots once did). The timing rules themselves are
//! `runner::pacing`'s tests; these check the loop follows them, on tokio's paused clock
//! (time moves only when every task waits), so none waits for real time.

mod support;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use proxy_agent::{
    dataplane::{ApplyReport, Dataplane, ErrorKind, FrontendIssue, Issue, bpf},
    model::{NodeView, ViewConfig},
    runner::{self, Status, Timing},
    source::Snapshot,
};
use test_support::needs_root;

/// Counts applies; a test waits for the count.
/// Runs the loop on `rx` with the default view settings for `how_long` of the test's
/// clock.
async fn run_for(
    rx: tokio::sync::watch::Receiver<Option<proxy_agent::source::SharedSnapshot>>,
    dataplane: &mut impl Dataplane,
    timing: Timing,
    status: &Status,
    how_long: Duration,
) {
    runner::run(
        rx,
        ViewConfig::default(),
        dataplane,
        timing,
        status.clone(),
        tokio::time::sleep(how_long),
    )
    .await
    .expect("run");
}

struct Counting(tokio::sync::watch::Sender<usize>);

impl Dataplane for Counting {
    fn apply(&mut self, _view: &NodeView) -> proxy_agent::dataplane::error::Result<ApplyReport> {
        self.0.send_modify(|n| *n += 1);
        Ok(ApplyReport::default())
    }
}

#[tokio::test(start_paused = true)]
async fn shutdown_does_not_wait_for_the_minimum_sync_interval() {
    let (tx, rx) = tokio::sync::watch::channel(None);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (applied, mut applies) = tokio::sync::watch::channel(0);
    let mut dataplane = Counting(applied);
    let timing = Timing {
        min_interval: Duration::from_secs(60),
        resync: Duration::from_secs(600),
        retry: Duration::from_millis(100),
    };
    let task = tokio::spawn(async move {
        runner::run(
            rx,
            ViewConfig::default(),
            &mut dataplane,
            timing,
            Status::default(),
            async {
                let _ = stop_rx.await;
            },
        )
        .await
    });
    let mut snapshot = Snapshot::default();
    tx.send(Some(Arc::new(snapshot.clone()))).expect("send");
    tokio::time::timeout(Duration::from_secs(5), applies.wait_for(|n| *n > 0))
        .await
        .expect("the first sync came")
        .expect("the dataplane is there");
    // A second change now waits for the 60 s interval; a shutdown must not.
    snapshot.node.name = "changed".into();
    tx.send(Some(Arc::new(snapshot))).expect("send");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let asked = tokio::time::Instant::now();
    stop_tx.send(()).expect("stop");
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("the loop ended within 2 s of the shutdown")
        .expect("join")
        .expect("run");
    assert!(asked.elapsed() < Duration::from_secs(2));
    assert_eq!(*applies.borrow(), 1, "the second change waited");
}

/// Records what each apply was given.
#[derive(Clone)]
struct Recording(Arc<tokio::sync::watch::Sender<Vec<Applied>>>);

#[derive(Clone, Debug, PartialEq)]
enum Applied {
    /// Every frontend compared, and how many the view held.
    All(usize),
    /// Only these frontends.
    Only(Vec<String>),
    /// Staged ahead (a partial snapshot): how many frontends were handed over.
    Staged(usize),
}

impl Default for Recording {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::watch::channel(Vec::new()).0))
    }
}

impl Recording {
    fn log(&self) -> Vec<Applied> {
        self.0.borrow().clone()
    }

    fn push(&self, applied: Applied) {
        self.0.send_modify(|log| log.push(applied));
    }

    /// Waits (on the test's clock) for the `n`th apply or stage.
    async fn wait_for(&self, n: usize) {
        let mut log = self.0.subscribe();
        let waited = tokio::time::timeout(Duration::from_secs(10), log.wait_for(|l| l.len() >= n));
        assert!(
            matches!(waited.await, Ok(Ok(_))),
            "not {n} applies: {:?}",
            self.log()
        );
    }
}

impl Dataplane for Recording {
    fn apply(&mut self, view: &NodeView) -> proxy_agent::dataplane::error::Result<ApplyReport> {
        self.push(Applied::All(view.len()));
        Ok(ApplyReport::default())
    }

    fn apply_changes(
        &mut self,
        _view: &NodeView,
        changed: &std::collections::BTreeSet<proxy_agent::model::Frontend>,
    ) -> proxy_agent::dataplane::error::Result<ApplyReport> {
        let only = changed.iter().map(ToString::to_string).collect();
        self.push(Applied::Only(only));
        Ok(ApplyReport::default())
    }

    fn stage(
        &mut self,
        view: &NodeView,
        changed: &std::collections::BTreeSet<proxy_agent::model::Frontend>,
    ) -> proxy_agent::dataplane::error::Result<usize> {
        assert!(
            changed.iter().all(|fe| view.get(fe).is_some()),
            "staged frontends are the partial view's"
        );
        self.push(Applied::Staged(changed.len()));
        Ok(changed.len())
    }
}

fn service(i: usize) -> k8s_openapi::api::core::v1::Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("svc-{i}"), "namespace": "ns"},
        "spec": {"clusterIP": format!("10.96.{}.{}", i / 250, i % 250 + 1),
                 "ports": [{"port": 80, "targetPort": 8080}]},
    }))
    .expect("service")
}

fn slice(i: usize, addr: &str) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("svc-{i}-1"), "namespace": "ns",
                     "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
        "addressType": "IPv4",
        "ports": [{"port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [addr]}],
    }))
    .expect("slice")
}

#[tokio::test(start_paused = true)]
async fn one_changed_service_hands_the_dataplane_its_frontend_alone() {
    let (tx, rx) = tokio::sync::watch::channel(None);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let recording = Recording::default();
    let mut dataplane = recording.clone();
    let timing = Timing {
        min_interval: Duration::from_millis(10),
        resync: Duration::from_secs(600),
        retry: Duration::from_millis(100),
    };
    let task = tokio::spawn(async move {
        runner::run(
            rx,
            ViewConfig::default(),
            &mut dataplane,
            timing,
            Status::default(),
            async {
                let _ = stop_rx.await;
            },
        )
        .await
    });
    let mut snapshot = Snapshot::default();
    for i in 0..2000 {
        snapshot.model.add_service(&service(i));
        snapshot.model.add_slice(&slice(i, "10.244.0.1"));
    }
    tx.send(Some(Arc::new(snapshot.clone()))).expect("send");
    recording.wait_for(1).await;
    // One endpoint moves in one Service; another Service changes only in what the view
    // does not use (an annotation): nothing of it reaches the dataplane.
    snapshot.model.add_slice(&slice(1234, "10.244.9.9"));
    let mut annotated = service(7);
    annotated.metadata.annotations = Some([("a".to_string(), "b".to_string())].into());
    snapshot.model.add_service(&annotated);
    tx.send(Some(Arc::new(snapshot.clone()))).expect("send");
    recording.wait_for(2).await;
    assert_eq!(
        recording.log(),
        vec![
            Applied::All(2000),
            Applied::Only(vec!["10.96.4.235:80/TCP".into()])
        ]
    );
    stop_tx.send(()).expect("stop");
    task.await.expect("join").expect("run");
}

/// Partial snapshots (the first lists arriving) are only staged, each with the frontends
/// it added; nothing is applied until the first complete snapshot, whose apply compares
/// everything.
#[tokio::test(start_paused = true)]
async fn partial_snapshots_are_staged_and_only_the_complete_one_is_applied() {
    let (tx, rx) = tokio::sync::watch::channel(None);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let recording = Recording::default();
    let mut dataplane = recording.clone();
    let timing = Timing {
        min_interval: Duration::from_millis(10),
        resync: Duration::from_secs(600),
        retry: Duration::from_millis(100),
    };
    let task = tokio::spawn(async move {
        runner::run(
            rx,
            ViewConfig::default(),
            &mut dataplane,
            timing,
            Status::default(),
            async {
                let _ = stop_rx.await;
            },
        )
        .await
    });
    let mut snapshot = Snapshot {
        partial: true,
        ..Snapshot::default()
    };
    for i in 0..1000 {
        snapshot.model.add_service(&service(i));
        snapshot.model.add_slice(&slice(i, "10.244.0.1"));
    }
    tx.send(Some(Arc::new(snapshot.clone()))).expect("send");
    recording.wait_for(1).await;
    for i in 1000..1500 {
        snapshot.model.add_service(&service(i));
        snapshot.model.add_slice(&slice(i, "10.244.0.1"));
    }
    tx.send(Some(Arc::new(snapshot.clone()))).expect("send");
    recording.wait_for(2).await;
    for i in 1500..2000 {
        snapshot.model.add_service(&service(i));
        snapshot.model.add_slice(&slice(i, "10.244.0.1"));
    }
    snapshot.partial = false;
    tx.send(Some(Arc::new(snapshot.clone()))).expect("send");
    recording.wait_for(3).await;
    // Nothing more comes of it (50 ms on the test's clock, past the 10 ms interval).
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        recording.log(),
        vec![
            Applied::Staged(1000),
            Applied::Staged(500),
            Applied::All(2000)
        ]
    );
    stop_tx.send(()).expect("stop");
    task.await.expect("join").expect("run");
}

/// Refuses one frontend on every apply, as a dataplane refuses one it can never hold.
struct Refusing;

impl Dataplane for Refusing {
    fn apply(&mut self, view: &NodeView) -> proxy_agent::dataplane::error::Result<ApplyReport> {
        Ok(ApplyReport {
            refused: view
                .iter()
                .take(1)
                .map(|(fe, st)| FrontendIssue {
                    frontend: *fe,
                    service: st.service.clone(),
                    issue: Issue::TooManySlots {
                        slots: 300,
                        max: 256,
                    },
                })
                .collect(),
            ..ApplyReport::default()
        })
    }
}

/// A frontend the dataplane refuses is named and counted, not retried, and the node stays
/// healthy past two sync periods (a failed frontend fails `/healthz` by then).
#[tokio::test(start_paused = true)]
async fn a_frontend_the_dataplane_refuses_never_makes_the_node_unhealthy() {
    let (log, _guard) = support::logs::Captured::start();
    let (tx, rx) = tokio::sync::watch::channel(None);
    let mut snapshot = Snapshot::default();
    snapshot.model.add_service(&service(1));
    tx.send(Some(Arc::new(snapshot))).expect("send");
    let status = Status::default();
    let timing = Timing {
        min_interval: Duration::from_millis(10),
        resync: Duration::from_millis(200),
        retry: Duration::from_millis(20),
    };
    run_for(rx, &mut Refusing, timing, &status, Duration::from_secs(1)).await;
    // The loop ran a second on the test's clock; the health clock is the real one.
    let health = status.health(Instant::now() + timing.resync * 2);
    assert!(health.healthy, "{health:?}");
    let c = status.counters();
    // Once, then once per resync (every 200 ms): never retried with backoff (20 ms).
    assert!((1..=6).contains(&c.frontends_refused), "{c:?}");
    assert_eq!((c.syncs_failed, c.frontends_failed), (0, 0), "{c:?}");
    assert!(
        !log.lines_with(
            "10.96.0.2:80/TCP (ns/svc-1:80): 300 backend slots exceed the 256 per frontend"
        )
        .is_empty()
    );
    drop(tx);
}

/// Fails its first `fails` applies, and records when each apply came (tokio's clock).
struct Flaky {
    fails: usize,
    at: Vec<tokio::time::Instant>,
}

impl Dataplane for Flaky {
    fn apply(&mut self, _view: &NodeView) -> proxy_agent::dataplane::error::Result<ApplyReport> {
        self.at.push(tokio::time::Instant::now());
        if self.at.len() <= self.fails {
            return Err(proxy_agent::dataplane::Error::caused(
                ErrorKind::Map,
                "writing service entry",
                std::io::Error::from_raw_os_error(libc::ENOSPC),
            ));
        }
        Ok(ApplyReport::default())
    }
}

/// A failed apply is tried again after the retry delay, doubling with each failure, and
/// not again once it succeeds (`pacing` has the rule; this, the loop following it); each
/// failure is counted by its kind (`proxy_agent_dataplane_errors_total`).
#[tokio::test(start_paused = true)]
async fn a_failed_apply_is_retried_after_a_delay_that_doubles() {
    let (tx, rx) = tokio::sync::watch::channel(None);
    tx.send(Some(Arc::new(Snapshot::default()))).expect("send");
    let mut dataplane = Flaky {
        fails: 3,
        at: Vec::new(),
    };
    let timing = Timing {
        min_interval: Duration::from_millis(10),
        resync: Duration::from_secs(600),
        retry: Duration::from_millis(100),
    };
    let status = Status::default();
    run_for(rx, &mut dataplane, timing, &status, Duration::from_secs(5)).await;
    let after: Vec<u128> = dataplane
        .at
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    assert_eq!(after, [100, 200, 400], "{:?}", dataplane.at);
    let c = status.counters();
    assert_eq!((c.syncs_failed, c.syncs_ok), (3, 1), "{c:?}");
    assert_eq!(
        c.dataplane_errors.get(&("apply", ErrorKind::Map)),
        Some(&3),
        "{c:?}"
    );
    let metrics = proxy_agent::metrics::render(&status, None).expect("metrics");
    for (kind, n) in [("map", 3), ("netlink", 0)] {
        let line =
            format!("proxy_agent_dataplane_errors_total{{call=\"apply\",kind=\"{kind}\"}} {n}");
        assert!(metrics.contains(&line), "{line} missing from:\n{metrics}");
    }
    drop(tx);
}

/// `wrr` weights of 255 and 256 over 1,000 endpoints (legal objects) wanted 255,500
/// backend slots, past a frontend's 65,535: the writer refused the frontend, the runner
/// retried it forever, and `/healthz` and `/livez` went 503 after two sync periods. Now
/// its weights are scaled to fit: it is programmed (1,000 slots), named in the log,
/// counted in `proxy_agent_frontends_adjusted_total`, and the node stays healthy.
#[needs_root]
#[tokio::test(start_paused = true)]
async fn wrr_weights_past_a_frontends_slots_are_scaled_and_the_node_stays_healthy() {
    let (log, _guard) = support::logs::Captured::start();
    let (_ebpf, mut maps) = bpf::load_private(&[]).expect("load");
    let mut state = bpf::Mirror::adopt(&maps).expect("adopt");
    let addrs: Vec<String> = (0..1000)
        .map(|i| format!("10.1.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let weights: Vec<String> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{a}={}", 255 + i % 2))
        .collect();
    let mut svc = service(1);
    svc.metadata.annotations = Some(
        [
            ("ebpf.proxy.k8s.io/scheduler".to_string(), "wrr".to_string()),
            ("ebpf.proxy.k8s.io/weights".to_string(), weights.join(",")),
        ]
        .into(),
    );
    let endpoints: Vec<serde_json::Value> = addrs
        .iter()
        .map(|a| serde_json::json!({"addresses": [a]}))
        .collect();
    let mut slice = slice(1, "10.1.0.1");
    slice.endpoints = serde_json::from_value(serde_json::Value::Array(endpoints)).expect("eps");
    let mut snapshot = Snapshot::default();
    snapshot.model.add_service(&svc);
    snapshot.model.add_slice(&slice);
    let (tx, rx) = tokio::sync::watch::channel(None);
    tx.send(Some(Arc::new(snapshot))).expect("send");
    let status = Status::default();
    let timing = Timing {
        min_interval: Duration::from_millis(10),
        resync: Duration::from_millis(300),
        retry: Duration::from_millis(50),
    };
    let mut dataplane = bpf::MapsDataplane::new(&mut maps, &mut state);
    run_for(rx, &mut dataplane, timing, &status, Duration::from_secs(2)).await;
    // Two seconds passed on the test's clock; on the health clock, past two periods.
    let health = status.health(Instant::now() + timing.resync * 2);
    assert!(health.healthy, "two sync periods have passed: {health:?}");
    let c = status.counters();
    assert_eq!((c.frontends_failed, c.frontends_refused), (0, 0), "{c:?}");
    assert!(c.frontends_adjusted >= 1, "{c:?}");
    let metrics = proxy_agent::metrics::render(&status, None).expect("metrics");
    assert!(
        metrics.contains(&format!(
            "proxy_agent_frontends_adjusted_total {}",
            c.frontends_adjusted
        )),
        "{metrics}"
    );
    // 64 slots each, reduced by their gcd: one each.
    let counts: Vec<u16> = maps
        .services
        .iter()
        .map(|e| e.expect("entry").1.count)
        .collect();
    assert_eq!(counts, [1000]);
    let named = log.lines_with("10.96.0.2:80/TCP (ns/svc-1:80): wrr weights scaled down");
    assert!(!named.is_empty(), "{}", log.text());
    assert!(
        named[0].contains("255500 slots wanted, 1000 written"),
        "{}",
        named[0]
    );
    drop(tx);
}
