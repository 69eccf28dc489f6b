//! The sync loop's own promises: a shutdown never waits for the coalescing interval
//! (`minSyncPeriod: 60s` once kept SIGTERM waiting for up to two minutes).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use proxy_agent::{
    dataplane::{ApplyReport, Dataplane},
    model::{NodeView, ViewConfig},
    source::Snapshot,
    sync::{self, Status, SyncTiming},
};

struct Counting(Arc<std::sync::atomic::AtomicUsize>);

impl Dataplane for Counting {
    fn apply(&mut self, _view: &NodeView) -> anyhow::Result<ApplyReport> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(ApplyReport::default())
    }
}

#[tokio::test]
async fn shutdown_does_not_wait_for_the_minimum_sync_interval() {
    let (tx, rx) = tokio::sync::watch::channel(None);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let applied = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut dataplane = Counting(applied.clone());
    let timing = SyncTiming {
        min_interval: Duration::from_secs(60),
        resync: Duration::from_secs(600),
        retry: Duration::from_millis(100),
    };
    let task = tokio::spawn(async move {
        sync::run(
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
    let deadline = Instant::now() + Duration::from_secs(5);
    while applied.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "first sync never came");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A second change now waits for the 60 s interval; a shutdown must not.
    snapshot.node.name = "changed".into();
    tx.send(Some(Arc::new(snapshot))).expect("send");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let asked = Instant::now();
    stop_tx.send(()).expect("stop");
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("the loop ended within 2 s of the shutdown")
        .expect("join")
        .expect("run");
    assert!(asked.elapsed() < Duration::from_secs(2));
}
