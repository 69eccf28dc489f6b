//! What the feed's server holds for streams that do not read (issue 42, item 5), on
//! loopback with real gRPC: a client that opens streams without `accepts_parts` and
//! never reads made the server hold a whole snapshot per stream, without bound. Now a node
//! identity holds at most `streams_per_node` streams, and whole batches in flight share
//! one budget: a stream that finds no room within `whole_wait` is cut with
//! RESOURCE_EXHAUSTED and counted, while nodes that take parts are served as before.

use std::{sync::Arc, time::Duration};

use k8s_openapi::api::core::v1::Service;
use proxy_agent::{
    feed::server::{Cut, Hub, HubOptions, grpc},
    feed::wire::v1,
    source::Snapshot,
};

/// A hub holding `n` Services (~60 bytes each on the wire).
fn hub_with(n: usize) -> Arc<Hub> {
    let hub = Hub::new(HubOptions::default());
    let mut snap = Snapshot::default();
    for i in 0..n {
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("service-{i}"), "namespace": "default"},
            "spec": {"clusterIP": format!("10.96.{}.{}", i / 250, i % 250 + 1),
                     "ports": [{"name": "http", "port": 80}]}
        }))
        .expect("service");
        snap.model.add_service(&svc);
    }
    hub.publish(&snap);
    hub
}

async fn serve(hub: Arc<Hub>, limits: grpc::FeedLimits) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let feed = grpc::Feed::with_limits(hub, grpc::Identity::Insecure, limits);
    tokio::spawn(grpc::serve(listener, feed, None));
    addr
}

/// A stream of `node`'s, on a connection of its own whose windows (HTTP/2 flow control)
/// are the protocol's default 64 KiB: what the node does not read stays on the server.
async fn open(
    addr: &str,
    node: &str,
    accepts_parts: bool,
) -> Result<tonic::Streaming<v1::Batch>, tonic::Status> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .expect("connect");
    let mut client =
        v1::node_feed_client::NodeFeedClient::new(ch).max_decoding_message_size(usize::MAX);
    let req = v1::WatchRequest {
        node_name: node.into(),
        accepts_parts,
        ..Default::default()
    };
    client.watch(req).await.map(|r| r.into_inner())
}

const LIMITS: grpc::FeedLimits = grpc::FeedLimits {
    streams_per_node: 4,
    // Room for two whole snapshots of `SERVICES` (~300 KiB each).
    whole_budget_bytes: 700 << 10,
    whole_wait: Duration::from_secs(1),
};
const SERVICES: usize = 5000;

#[tokio::test]
async fn one_node_holds_a_bounded_number_of_streams() {
    let hub = hub_with(10);
    let addr = serve(Arc::clone(&hub), LIMITS).await;
    let mut held = Vec::new();
    for _ in 0..LIMITS.streams_per_node {
        held.push(open(&addr, "node-a", true).await.expect("within the bound"));
    }
    let refused = open(&addr, "node-a", true)
        .await
        .expect_err("past the bound");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert_eq!(hub.counts().cuts.get(Cut::StreamsPerNode), 1);
    // Another node is not counted against node A; a stream closed gives its slot back.
    open(&addr, "node-b", true).await.expect("node B");
    drop(held.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while open(&addr, "node-a", true).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn streams_that_take_whole_batches_and_never_read_are_cut_past_the_budget() {
    let hub = hub_with(SERVICES);
    let addr = serve(Arc::clone(&hub), LIMITS).await;
    // Twenty nodes ask for whole batches and never read them.
    let mut unread = Vec::new();
    for i in 0..20 {
        unread.push(
            open(&addr, &format!("node-{i}"), false)
                .await
                .expect("a stream"),
        );
    }
    // Two fit in the budget; the other eighteen find no room within `whole_wait`, and
    // are cut.
    tokio::time::sleep(LIMITS.whole_wait + Duration::from_secs(1)).await;
    assert_eq!(
        hub.counts().cuts.get(Cut::WholeBudget),
        18,
        "{:?}",
        hub.counts()
    );
    let mut cut = 0;
    let mut got = 0;
    for s in &mut unread {
        match tokio::time::timeout(Duration::from_secs(5), s.message()).await {
            Ok(Err(status)) if status.code() == tonic::Code::ResourceExhausted => cut += 1,
            Ok(Ok(Some(b))) if b.snapshot && b.ops.len() == SERVICES => got += 1,
            other => panic!("neither a snapshot nor a cut: {other:?}"),
        }
    }
    assert_eq!((got, cut), (2, 18));

    // A node that takes parts is not held to the budget.
    let mut parts = open(&addr, "node-parts", true).await.expect("a stream");
    let first = tokio::time::timeout(Duration::from_secs(5), parts.message())
        .await
        .expect("in time")
        .expect("a part")
        .expect("one");
    assert!(first.snapshot && first.continued, "{first:?}");

    // Read, the two whole snapshots gave their room back: a new whole stream is served.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut late = open(&addr, "node-late", false).await.expect("a stream");
    let b = tokio::time::timeout(Duration::from_secs(5), late.message())
        .await
        .expect("in time")
        .expect("a batch")
        .expect("one");
    assert!(b.snapshot && b.ops.len() == SERVICES, "{} ops", b.ops.len());
}
