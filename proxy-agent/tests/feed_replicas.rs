//! Feed replicas judged by their data (issue 42, item 4), on loopback with real gRPC: an
//! agent given `server=R1,R2` where R1 has no synced view (it never listed, or its API
//! watch failed past its bound) is fed by R2, goes back to R1 once R1 has data, and never
//! counts a replica without data as its link (`/healthz` fails past the health timeout);
//! a replica fed by the fake API server answers `/healthz` 503 and refuses (or ends) the
//! nodes' streams with `no_view_status` until its first list, and again once its watch
//! has failed past its bound. Also: an agent is told every Node's addresses (its peers).

mod support;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Service;
use proxy_agent::{
    feed::server::{Cut, Hub, HubOptions, grpc, http},
    feed::wire::{is_no_view, v1},
    model::NodeInfo,
    runner::Status,
    source::feed::{self, FeedOptions},
    source::{self, SharedSnapshot, Snapshot},
};
use serde_json::json;
use support::fake_apiserver::{FakeApiServer, Kind};
use tokio::sync::watch;

fn service(name: &str, ip: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "default"},
           "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}})
}

/// A snapshot holding one Service, `name`.
fn holding(name: &str) -> Snapshot {
    let mut snap = Snapshot::default();
    let svc: Service = serde_json::from_value(service(name, "10.96.0.10")).expect("service");
    snap.model.add_service(&svc);
    snap
}

/// Serves `hub` in plain text on a loopback port.
async fn replica(hub: Arc<Hub>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let feed = grpc::Feed::new(hub, grpc::Identity::Insecure);
    tokio::spawn(grpc::serve(listener, feed, None));
    addr
}

/// The Services of the latest snapshot the feed published.
fn services(rx: &watch::Receiver<Option<SharedSnapshot>>) -> Vec<String> {
    rx.borrow()
        .as_ref()
        .map(|s| {
            s.model
                .services()
                .map(|(r, _)| r.name.to_string())
                .collect()
        })
        .unwrap_or_default()
}

async fn wait_until(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the feed publishes, the runner status its link is told to, and every `on_link`.
type Agent = (
    watch::Receiver<Option<SharedSnapshot>>,
    Status,
    Arc<Mutex<Vec<bool>>>,
);

/// The agent's feed on `servers`, its link told to a runner status.
fn agent(servers: Vec<String>, prefer_every: Duration) -> Agent {
    let status = Status::default();
    let links = Arc::new(Mutex::new(Vec::new()));
    let (link, seen) = (status.clone(), Arc::clone(&links));
    let opts = FeedOptions {
        servers,
        node: NodeInfo {
            name: "node-a".into(),
            ..Default::default()
        },
        tls: None,
        on_link: Arc::new(move |up| {
            seen.lock().unwrap_or_else(|p| p.into_inner()).push(up);
            link.source_link(up, std::time::Instant::now());
        }),
        prefer_every,
    };
    // As `proxy-agent run` starts it: no link yet.
    status.source_link(false, std::time::Instant::now());
    let (tx, rx) = watch::channel(None);
    tokio::spawn(feed::run(opts, tx));
    (rx, status, links)
}

#[tokio::test]
async fn an_agent_is_fed_by_the_first_replica_with_data_and_goes_back_when_it_has_some() {
    let first = Hub::new(HubOptions::default());
    let second = Hub::new(HubOptions::default());
    second.publish(&holding("from-second"));
    let servers = vec![
        replica(Arc::clone(&first)).await,
        replica(Arc::clone(&second)).await,
    ];
    let (rx, status, _) = agent(servers, Duration::from_millis(500));

    // The first replica never listed: the agent takes the second's data, at once.
    wait_until(Duration::from_secs(5), "fed by the second replica", || {
        services(&rx) == ["from-second"]
    })
    .await;
    assert!(status.health(std::time::Instant::now()).healthy);

    // The first has data now: preferred, the agent goes back to it.
    first.publish(&holding("from-first"));
    wait_until(Duration::from_secs(5), "back on the first replica", || {
        services(&rx) == ["from-first"]
    })
    .await;

    // The first's API watch fails past its bound: the agent moves on again, and comes
    // back once it answers.
    first.set_api_lost(true);
    wait_until(
        Duration::from_secs(5),
        "on the second replica again",
        || services(&rx) == ["from-second"],
    )
    .await;
    first.set_api_lost(false);
    wait_until(
        Duration::from_secs(5),
        "back on the first replica again",
        || services(&rx) == ["from-first"],
    )
    .await;
    assert!(
        first.counts().cuts.get(Cut::NoView) >= 2,
        "{:?}",
        first.counts()
    );
}

#[tokio::test]
async fn a_replica_without_data_never_counts_as_the_link() {
    let empty = Hub::new(HubOptions::default());
    let servers = vec![replica(Arc::clone(&empty)).await];
    let (rx, status, links) = agent(servers, Duration::from_millis(500));
    // Longer than a keepalive (5 s): the replica's stream gives nothing to program.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(rx.borrow().is_none());
    let told = links.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        !told.contains(&true),
        "a replica without data was taken as the link: {told:?}"
    );
    // No replica delivered data within the health timeout (60 s by default): unhealthy.
    let later = std::time::Instant::now() + Duration::from_secs(61);
    assert!(!status.health(later).healthy, "{:?}", status.health(later));
}

/// `GET path` on `addr`: the status and the body.
async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .expect("write");
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).await.expect("read");
    let code = answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// A stream from `addr` as node-a asks for it.
async fn watch_stream(addr: &str) -> Result<tonic::Streaming<v1::Batch>, tonic::Status> {
    let mut client = v1::node_feed_client::NodeFeedClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let req = v1::WatchRequest {
        node_name: "node-a".into(),
        accepts_parts: true,
        ..Default::default()
    };
    client.watch(req).await.map(|r| r.into_inner())
}

#[tokio::test]
async fn a_replica_says_it_has_no_view_until_its_first_list_and_after_its_watch_is_lost() {
    let api = FakeApiServer::start().await;
    api.apply(Kind::Services, service("web", "10.96.0.10"));
    api.hold_lists(Kind::Services);
    // The replica as `proxy-agent serve --source kube` runs it, with a bound of 2 s.
    let hub = Hub::new(HubOptions::default());
    let health = source::kube::WatchHealth::default();
    let opts = source::kube::KubeOptions {
        node_name: "proxy-agent-serve".into(),
        label_selector: source::kube::label_selector(None),
        all_nodes: true,
        without_own_node: true,
        backoff: source::kube::Backoff::with_delays(
            Duration::from_millis(100),
            Duration::from_millis(400),
        ),
        health: health.clone(),
        ..Default::default()
    };
    let (tx, rx) = watch::channel(None);
    tokio::spawn(source::kube::run(api.client(), opts, tx));
    tokio::spawn(proxy_agent::feed::server::ingest(Arc::clone(&hub), rx));
    let bound = Duration::from_secs(2);
    tokio::spawn(proxy_agent::feed::server::judge_view(
        Arc::downgrade(&hub),
        health.clone(),
        bound,
    ));
    tokio::spawn(proxy_agent::feed::server::probe_api(
        api.client(),
        health,
        Duration::from_millis(300),
    ));
    let feed = replica(Arc::clone(&hub)).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let web = listener.local_addr().expect("addr").to_string();
    let app = http::app(Arc::clone(&hub));
    tokio::spawn(async move { axum::serve(listener, app).await });

    // Before the first full list: 503, and a node's Watch is refused as "no view".
    let (code, body) = http_get(&web, "/healthz").await;
    assert_eq!(code, 503, "{body}");
    let refused = watch_stream(&feed)
        .await
        .expect_err("refused before a list");
    assert!(is_no_view(&refused), "{refused:?}");

    // Listed: 200, and a stream gives the snapshot.
    api.release_lists();
    let deadline = Instant::now() + Duration::from_secs(10);
    while http_get(&web, "/healthz").await.0 != 200 {
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut open = watch_stream(&feed).await.expect("a stream once listed");
    let first = open.message().await.expect("a message").expect("one");
    assert!(first.snapshot && first.ops.len() == 1, "{first:?}");

    // The API server refuses us from now on (a credential or RBAC mistake): past the
    // bound, 503, the open stream ends as "no view", and a new one is refused.
    let lost_at = Instant::now();
    api.require_token(Some("another"));
    api.break_watches();
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(15), open.message()).await {
            Err(_) => panic!("the open stream was not ended within 15 s"),
            Ok(Ok(Some(_keepalive))) => continue,
            Ok(Ok(None)) => panic!("the stream ended without a status"),
            Ok(Err(status)) => break status,
        }
    };
    assert!(is_no_view(&ended), "{ended:?}");
    assert!(
        lost_at.elapsed() >= bound,
        "ended {:?} after the API failed, before the bound",
        lost_at.elapsed()
    );
    let (code, body) = http_get(&web, "/healthz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("failing"), "{body}");
    let refused = watch_stream(&feed).await.expect_err("refused once lost");
    assert!(is_no_view(&refused), "{refused:?}");
    let (_, metrics) = http_get(&web, "/metrics").await;
    assert!(metrics.contains("proxy_agent_feed_api_lost 1"), "{metrics}");
    assert!(
        metrics.contains("proxy_agent_feed_cuts_total{reason=\"no_view\"} 3"),
        "{metrics}"
    );

    // The API server answers again: the replica serves again.
    api.require_token(None);
    let deadline = Instant::now() + Duration::from_secs(15);
    while http_get(&web, "/healthz").await.0 != 200 {
        assert!(Instant::now() < deadline, "never served again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut again = watch_stream(&feed).await.expect("a stream again");
    let first = again.message().await.expect("a message").expect("one");
    assert!(first.snapshot && first.ops.len() == 1, "{first:?}");
}

fn with_node(snap: &mut Snapshot, name: &str, ip: &str) {
    let mut node = NodeInfo {
        name: name.into(),
        addresses: vec![ip.parse().expect("ip")],
        ..Default::default()
    };
    node.labels
        .insert("topology.kubernetes.io/zone".into(), "z1".into());
    snap.nodes.insert(name.into(), node);
}

/// Every Node in the latest snapshot the feed published, with its first address.
fn peers(rx: &watch::Receiver<Option<SharedSnapshot>>) -> Vec<(String, String)> {
    rx.borrow()
        .as_ref()
        .map(|s| {
            s.nodes
                .values()
                .map(|n| (n.name.clone(), n.addresses[0].to_string()))
                .collect()
        })
        .unwrap_or_default()
}

/// The agent asks for peers over real gRPC: its snapshots carry every Node's addresses
/// (its own Node's included, which stays `Snapshot::node` with its labels), as the
/// snapshot brings them and as a Node's address changes or it goes.
#[tokio::test]
async fn an_agent_is_told_every_nodes_addresses_as_they_change() {
    let hub = Hub::new(HubOptions::default());
    let mut snap = holding("web");
    with_node(&mut snap, "node-a", "192.0.2.10");
    with_node(&mut snap, "node-b", "192.0.2.11");
    hub.publish(&snap);
    let addr = replica(Arc::clone(&hub)).await;
    let (rx, _status, _links) = agent(vec![addr], feed::PREFER_EVERY);
    let pair = |n: &str, ip: &str| (n.to_string(), ip.to_string());
    let within = Duration::from_secs(10);
    wait_until(within, "both Nodes from the snapshot", || {
        peers(&rx) == [pair("node-a", "192.0.2.10"), pair("node-b", "192.0.2.11")]
    })
    .await;
    {
        let got = rx.borrow();
        let got = got.as_ref().expect("a snapshot");
        assert_eq!(got.node.zone(), Some("z1"), "its own Node, whole");
        assert!(
            got.nodes["node-b"].labels.is_empty(),
            "peers: addresses only"
        );
    }
    with_node(&mut snap, "node-b", "192.0.2.12");
    hub.publish(&snap);
    wait_until(within, "node-b's new address", || {
        peers(&rx) == [pair("node-a", "192.0.2.10"), pair("node-b", "192.0.2.12")]
    })
    .await;
    snap.nodes.remove("node-b");
    hub.publish(&snap);
    wait_until(within, "node-b gone", || {
        peers(&rx) == [pair("node-a", "192.0.2.10")]
    })
    .await;
    assert_eq!(services(&rx), ["web"]);
}
