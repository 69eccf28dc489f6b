//! The API-server source against a fake API server on loopback: initial list (and nothing
//! programmed before every list arrived), add/modify/delete, no-op updates, a broken
//! watch, a 410 Gone relist, bookmarks — asserted through the dataplane the sync loop
//! drives: a recording dataplane, and (as root) the real BPF maps. And the API client
//! against the fake server's faults (issue 25): a 410 storm, an etcd restore, a huge
//! event, Retry-After, a token file, a bad CA.

mod support;

use std::{net::SocketAddr, time::Duration};

use proxy_agent::{
    dataplane::{ApplyReport, Dataplane, bpf},
    model::{Frontend, NodeView, Protocol, ViewConfig},
    runner::{self, Status, Timing},
    source,
};
use serde_json::{Value, json};
use support::fake_apiserver::{FakeApiServer, Kind, OldVersions, Options, Throttle};
use test_support::needs_root;
use tokio::sync::mpsc;

fn service(name: &str, ip: &str, port: u16) -> Value {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
           "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": port, "targetPort": 8080, "protocol": "TCP"}]}})
}

fn slice(name: &str, svc: &str, addrs: &[&str]) -> Value {
    let eps: Vec<Value> = addrs
        .iter()
        .map(|a| json!({"addresses": [a], "conditions": {"ready": true}}))
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": svc}},
           "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": eps})
}

fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a"}},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}})
}

fn fe(ip: &str, port: u16) -> Frontend {
    Frontend {
        ip: ip.parse().expect("ip"),
        port,
        protocol: Protocol::Tcp,
    }
}

fn backends(view: &NodeView, ip: &str, port: u16) -> Vec<SocketAddr> {
    view.get(&fe(ip, port))
        .map(|s| s.backends.endpoints.iter().collect())
        .unwrap_or_default()
}

/// Sends every view the sync loop applies to the test.
struct Recording(mpsc::UnboundedSender<NodeView>);

impl Dataplane for Recording {
    fn apply(&mut self, view: &NodeView) -> proxy_agent::dataplane::error::Result<ApplyReport> {
        let _ = self.0.send(view.clone());
        Ok(ApplyReport::default())
    }
}

fn timing() -> Timing {
    Timing {
        min_interval: Duration::from_millis(10),
        resync: Duration::from_secs(600),
        retry: Duration::from_millis(100),
    }
}

/// Starts the source, on the agent's own API client, and the sync loop on `dataplane`, as
/// the agent does; returns the status handle.
fn start<D: Dataplane + Send + 'static>(server: &FakeApiServer, dataplane: D) -> Status {
    start_with_caps(server, dataplane, Default::default())
}

/// `start` with the client's answers held to `caps`.
fn start_with_caps<D: Dataplane + Send + 'static>(
    server: &FakeApiServer,
    mut dataplane: D,
    caps: source::api_server::AnswerCaps,
) -> Status {
    let (tx, rx) = tokio::sync::watch::channel(None);
    let status = Status::default();
    let client =
        source::api_server::client_with_caps(server.config(), &status.api_counters(), caps)
            .expect("the agent's client");
    tokio::spawn(source::kube::run(
        client,
        source::kube::KubeOptions {
            node_name: "node-a".into(),
            label_selector: source::kube::label_selector(None),
            counters: status.api_counters(),
            // As `proxy-agent run` has it.
            stream_first_list: true,
            all_nodes: true,
            ..Default::default()
        },
        tx,
    ));
    let st = status.clone();
    tokio::spawn(async move {
        let _ = runner::run(
            rx,
            ViewConfig::default(),
            &mut dataplane,
            timing(),
            st,
            std::future::pending(),
        )
        .await;
    });
    status
}

/// The next applied view that satisfies `pred` (earlier ones are skipped).
async fn until(
    rx: &mut mpsc::UnboundedReceiver<NodeView>,
    what: &str,
    pred: impl Fn(&NodeView) -> bool,
) -> NodeView {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(v)) if pred(&v) => return v,
            Ok(Some(_)) => continue,
            _ => panic!("timed out waiting for: {what}"),
        }
    }
}

#[tokio::test]
async fn watcher_drives_the_view_through_every_event_kind() {
    let server = FakeApiServer::start().await;
    server.apply(Kind::Services, service("web", "10.96.0.10", 80));
    server.apply(
        Kind::EndpointSlices,
        slice("web-1", "web", &["10.244.1.5", "10.244.2.6"]),
    );
    server.apply(Kind::Nodes, node());
    server.hold_lists(Kind::Nodes);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));

    // Nothing is programmed until every resource has been listed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rx.try_recv().is_err(),
        "programmed before the Node list arrived"
    );
    server.release_lists();
    let v = until(&mut rx, "initial view", |v| !v.is_empty()).await;
    assert_eq!(
        backends(&v, "10.96.0.10", 80),
        vec![
            "10.244.1.5:8080".parse().expect("sa"),
            "10.244.2.6:8080".parse().expect("sa")
        ]
    );
    assert_eq!(
        status.snapshot().expect("snapshot").node.addresses,
        vec!["192.0.2.10".parse::<std::net::IpAddr>().expect("ip")]
    );

    // Add.
    server.apply(Kind::Services, service("api", "10.96.0.11", 443));
    server.apply(Kind::EndpointSlices, slice("api-1", "api", &["10.244.3.7"]));
    until(&mut rx, "added service", |v| {
        backends(v, "10.96.0.11", 443).len() == 1
    })
    .await;

    // Modify.
    server.apply(Kind::EndpointSlices, slice("web-1", "web", &["10.244.2.6"]));
    until(&mut rx, "modified slice", |v| {
        backends(v, "10.96.0.10", 80).len() == 1
    })
    .await;

    // A no-op update (same content, new resourceVersion) programs nothing.
    server.apply(Kind::EndpointSlices, slice("web-1", "web", &["10.244.2.6"]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rx.try_recv().is_err(),
        "a change that nets to nothing was applied"
    );

    // Delete.
    server.delete(Kind::Services, "default", "api");
    until(&mut rx, "deleted service", |v| {
        !v.contains_key(&fe("10.96.0.11", 443))
    })
    .await;

    // A bookmark, then a broken watch: the watcher resumes and sees later changes.
    server.bookmark();
    server.break_watches();
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.apply(Kind::Services, service("late", "10.96.0.12", 80));
    until(&mut rx, "change after a broken watch", |v| {
        v.contains_key(&fe("10.96.0.12", 80))
    })
    .await;

    // 410 Gone: a deletion missed during an outage is found by the relist.
    let lists_before = server.lists_served("services");
    server.delete_silently(Kind::Services, "default", "late");
    server.expire_history();
    server.break_watches();
    until(&mut rx, "relist after 410 Gone", |v| {
        !v.contains_key(&fe("10.96.0.12", 80))
    })
    .await;
    assert!(
        server.lists_served("services") > lists_before,
        "410 Gone must relist"
    );
    assert!(status.counters().syncs_ok >= 5);
}

/// A nodePort outside the default 30000-32767, which an API server with another
/// `--service-node-port-range` accepted: its ClusterIP and NodePort are programmed, as
/// kube-proxy programs what the API server stored. (The whole Service was refused.)
#[tokio::test]
async fn a_node_port_the_api_server_accepted_is_programmed_outside_the_default_range() {
    let server = FakeApiServer::start().await;
    let mut np = service("np", "10.96.0.30", 80);
    np["spec"]["type"] = json!("NodePort");
    np["spec"]["ports"][0]["nodePort"] = json!(40000);
    server.apply(Kind::Services, np);
    server.apply(Kind::EndpointSlices, slice("np-1", "np", &["10.244.1.5"]));
    server.apply(Kind::Nodes, node());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    let v = until(&mut rx, "the Service programmed", |v| !v.is_empty()).await;
    let want = vec!["10.244.1.5:8080".parse::<SocketAddr>().expect("sa")];
    assert_eq!(backends(&v, "10.96.0.30", 80), want, "ClusterIP: {v:#?}");
    assert_eq!(backends(&v, "192.0.2.10", 40000), want, "NodePort: {v:#?}");
    assert_eq!(status.counters().objects_rejected, 0);
}

/// One Service the agent cannot decode (a field of another type) among 300 good ones in
/// one list: the good ones are programmed, the bad one is named once (with the field) and
/// counted, the list is not retried, and the log stays small. The same in a watch event:
/// named, its last readable version stays. (The list failed whole and was retried
/// forever — a fresh node programmed nothing — and kube-client logged the whole body, 300
/// KB here, at WARN on every retry.)
#[tokio::test]
async fn an_undecodable_service_costs_itself_alone_and_a_short_log_line() {
    // The test's runtime is single-threaded: every task logs here.
    let (log, _guard) = support::logs::Captured::start();
    let server = FakeApiServer::start().await;
    let padding = "x".repeat(1000);
    for i in 0..300 {
        let ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
        let mut svc = service(&format!("svc-{i}"), &ip, 80);
        svc["metadata"]["annotations"] = json!({"padding": padding});
        server.apply(Kind::Services, svc);
    }
    let mut bad = service("bad", "10.96.9.9", 80);
    bad["spec"]["ports"] = json!(7);
    server.apply(Kind::Services, bad);
    server.apply(Kind::Nodes, node());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    let v = until(&mut rx, "the 300 good Services", |v| v.len() == 300).await;
    assert!(!v.contains_key(&fe("10.96.9.9", 80)));
    // A retry would have come by now (the watcher's backoff starts under a second).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(server.lists_served("services"), 1, "the list was retried");
    assert_eq!(status.counters().objects_rejected, 1);
    let lines = log.lines_with("default/bad");
    assert_eq!(lines.len(), 1, "{}", log.text());
    assert!(
        lines[0].contains("kind=\"Service\"") && lines[0].contains("spec.ports: invalid type"),
        "{}",
        lines[0]
    );

    let mut broken = service("svc-0", "10.96.0.1", 80);
    broken["spec"]["ports"] = json!("eighty");
    server.apply(Kind::Services, broken);
    server.apply(Kind::Services, service("late", "10.96.8.8", 80));
    let v = until(&mut rx, "a later change", |v| {
        v.contains_key(&fe("10.96.8.8", 80))
    })
    .await;
    assert!(
        v.contains_key(&fe("10.96.0.1", 80)),
        "svc-0's last readable version stays"
    );
    let lines = log.lines_with("default/svc-0");
    assert_eq!(lines.len(), 1, "{}", log.text());
    assert!(lines[0].contains("spec.ports"), "{}", lines[0]);
    let text = log.text();
    assert!(
        text.len() < 4096,
        "{} bytes of log:\n{}",
        text.len(),
        &text[..text.len().min(3000)]
    );
}

/// kube-proxy's server-side selector: headless Services and those of another service
/// proxy never reach the agent (nor their slices).
#[tokio::test]
async fn services_and_slices_are_listed_with_kube_proxys_label_selector() {
    let server = FakeApiServer::start().await;
    let mut other = service("other", "10.96.0.20", 80);
    other["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "some-other-proxy"});
    server.apply(Kind::Services, other);
    let mut other_slice = slice("other-1", "other", &["10.244.1.9"]);
    other_slice["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"] =
        json!("some-other-proxy");
    server.apply(Kind::EndpointSlices, other_slice);
    server.apply(Kind::Services, service("web", "10.96.0.10", 80));
    server.apply(Kind::EndpointSlices, slice("web-1", "web", &["10.244.1.5"]));
    server.apply(Kind::Nodes, node());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    let v = until(&mut rx, "initial view", |v| !v.is_empty()).await;
    assert!(!v.contains_key(&fe("10.96.0.20", 80)), "{v:#?}");
    let expected = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name";
    assert_eq!(server.label_selector("services"), expected);
    assert_eq!(server.label_selector("endpointslices"), expected);
    assert_eq!(server.label_selector("nodes"), "");
    // Filtered by the server: the model never held them.
    let model = status.snapshot().expect("snapshot").model.clone();
    let names = |it: Vec<String>| it.join(",");
    assert_eq!(
        model.service_count(),
        1,
        "{}",
        names(model.services().map(|(r, _)| r.to_string()).collect())
    );
    assert_eq!(
        model.slice_count(),
        1,
        "{}",
        names(
            model
                .slices()
                .map(|(k, _)| k.object().to_string())
                .collect()
        )
    );
}

/// kube-proxy's `/healthz` fails while the node is draining (the cluster autoscaler's
/// taint, or a deletion timestamp) so load balancers stop sending it traffic; `/livez`
/// stays 200 (a restart would not help). Both count their answers by code.
#[tokio::test]
async fn healthz_fails_and_livez_holds_while_the_node_drains() {
    let server = FakeApiServer::start().await;
    server.apply(Kind::Services, service("web", "10.96.0.10", 80));
    server.apply(Kind::EndpointSlices, slice("web-1", "web", &["10.244.1.5"]));
    server.apply(Kind::Nodes, node());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    until(&mut rx, "initial view", |v| !v.is_empty()).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let st = status.clone();
    let a = addr.clone();
    tokio::spawn(async move {
        proxy_agent::http_server::serve(
            &a,
            proxy_agent::http_server::Endpoints::Metrics,
            st,
            None,
            false,
        )
        .await
    });
    let get = |path: &'static str| {
        let addr = addr.clone();
        async move {
            for _ in 0..50 {
                if let Ok(r) = reqwest_lite(&addr, path).await {
                    return r;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("{addr}{path} never answered")
        }
    };
    assert_eq!(get("/healthz").await, 200);
    assert_eq!(get("/livez").await, 200);

    let mut tainted = node();
    tainted["spec"] = json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler",
                                          "value": "1700000000", "effect": "NoSchedule"}]});
    server.apply(Kind::Nodes, tainted);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !status.snapshot().is_some_and(|s| s.node.draining) {
        assert!(tokio::time::Instant::now() < deadline, "taint never seen");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(get("/healthz").await, 503);
    assert_eq!(get("/livez").await, 200);
    let metrics = http_body(&addr, "/metrics").await;
    for line in [
        "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
        "kubeproxy_proxy_healthz_total{code=\"503\"} 1",
        "kubeproxy_proxy_livez_total{code=\"200\"} 2",
        // The first list counts (one Service, one slice), as kube-proxy counts its adds.
        "kubeproxy_sync_proxy_rules_service_changes_total 1",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total 1",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
    // kube-proxy's /proxyMode, as the e2e specs ask it (200 and a mode).
    assert_eq!(get("/proxyMode").await, 200);
    assert!(
        http_body(&addr, "/proxyMode")
            .await
            .ends_with("\r\n\r\nebpf")
    );
}

/// The status code of a GET on loopback.
async fn reqwest_lite(addr: &str, path: &str) -> std::io::Result<u16> {
    let text = http(addr, path).await?;
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad answer: {text}")))
}

async fn http_body(addr: &str, path: &str) -> String {
    http(addr, path).await.expect("GET")
}

async fn http(addr: &str, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out)
}

/// kube-proxy's birth cry: a "Starting" event about this Node.
#[tokio::test]
async fn starting_event_on_the_node() {
    let server = FakeApiServer::start().await;
    source::events::announce_start(server.client(), "node-a")
        .await
        .expect("the Starting event");
    let events = server.events();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!(e["reason"], "Starting", "{e}");
    assert_eq!(e["type"], "Normal", "{e}");
    assert_eq!(e["regarding"]["kind"], "Node", "{e}");
    assert_eq!(e["regarding"]["name"], "node-a", "{e}");
    assert_eq!(e["reportingController"], "proxy-agent", "{e}");
}

/// A node whose Node object does not exist yet has no addresses and no topology: nothing
/// is programmed from that empty node; the Node's creation releases the first view. The
/// other Nodes, watched too (DSR's peers), never stand in for it, and are published.
#[tokio::test]
async fn nothing_is_programmed_until_this_nodes_node_object_exists() {
    let server = FakeApiServer::start().await;
    server.apply(Kind::Services, service("web", "10.96.0.10", 80));
    server.apply(Kind::EndpointSlices, slice("web-1", "web", &["10.244.1.5"]));
    let other = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-b"},
                       "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.11"}]}});
    server.apply(Kind::Nodes, other);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        rx.try_recv().is_err(),
        "programmed a view without this node's Node object"
    );
    assert!(status.snapshot().is_none());
    server.apply(Kind::Nodes, node());
    let v = until(&mut rx, "view once the Node exists", |v| !v.is_empty()).await;
    assert_eq!(backends(&v, "10.96.0.10", 80).len(), 1);
    let snap = status.snapshot().expect("snapshot");
    assert_eq!(
        snap.node.addresses,
        vec!["192.0.2.10".parse::<std::net::IpAddr>().expect("ip")]
    );
    let peers: Vec<(&str, String)> = snap
        .nodes
        .values()
        .map(|n| (n.name.as_str(), n.addresses[0].to_string()))
        .collect();
    assert_eq!(
        peers,
        [
            ("node-a", "192.0.2.10".into()),
            ("node-b", "192.0.2.11".into())
        ]
    );
    // Another Node's new address alone reaches the snapshot.
    let moved = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-b"},
                       "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.12"}]}});
    server.apply(Kind::Nodes, moved);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while status.snapshot().expect("snapshot").nodes["node-b"].addresses
        != vec!["192.0.2.12".parse::<std::net::IpAddr>().expect("ip")]
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "node-b's new address"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.delete(Kind::Nodes, "", "node-b");
    while status
        .snapshot()
        .expect("snapshot")
        .nodes
        .contains_key("node-b")
    {
        assert!(tokio::time::Instant::now() < deadline, "node-b's deletion");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Owns private maps and writes views into them, as the agent's BPF dataplane does.
struct Maps {
    maps: bpf::MapSet,
    state: bpf::Mirror,
    _ebpf: aya::Ebpf,
    applied: mpsc::UnboundedSender<()>,
}

impl Dataplane for Maps {
    fn apply(&mut self, view: &NodeView) -> proxy_agent::dataplane::error::Result<ApplyReport> {
        let r = bpf::MapsDataplane::new(&mut self.maps, &mut self.state).apply(view);
        let _ = self.applied.send(());
        r
    }
}

/// The frontends (VIP:port) and backend counts the real SERVICES map holds.
fn programmed(maps: &bpf::MapSet) -> Vec<(SocketAddr, u16)> {
    let mut v: Vec<(SocketAddr, u16)> = maps
        .services
        .iter()
        .map(|e| {
            let (k, val) = e.expect("entry");
            let ip = proxy_common::addr::from_words(k.addr, k.family);
            (SocketAddr::new(ip, u16::from_be(k.port)), val.count)
        })
        .collect();
    v.sort();
    v
}

#[needs_root]
#[tokio::test]
async fn services_appear_change_and_disappear_in_the_bpf_maps() {
    let server = FakeApiServer::start().await;
    server.apply(Kind::Services, service("web", "10.96.0.10", 80));
    server.apply(
        Kind::EndpointSlices,
        slice("web-1", "web", &["10.244.1.5", "10.244.2.6"]),
    );
    server.apply(Kind::Nodes, node());
    let (ebpf, maps) = bpf::load_private(&[]).expect("load");
    // A second handle on the same maps, for the test to read.
    let (tx, mut applied) = mpsc::unbounded_channel();
    let state = bpf::Mirror::adopt(&maps).expect("adopt");
    let reader = maps.duplicate().expect("second handle on the maps");
    start(
        &server,
        Maps {
            maps,
            state,
            _ebpf: ebpf,
            applied: tx,
        },
    );

    let wait = |want: Vec<(SocketAddr, u16)>| {
        let reader = &reader;
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                if programmed(reader) == want {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "maps hold {:?}, want {want:?}",
                    programmed(reader)
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let sa = |s: &str| s.parse::<SocketAddr>().expect("sa");
    wait(vec![(sa("10.96.0.10:80"), 2)]).await;
    server.apply(Kind::EndpointSlices, slice("web-1", "web", &["10.244.1.5"]));
    wait(vec![(sa("10.96.0.10:80"), 1)]).await;
    server.apply(Kind::Services, service("api", "10.96.0.11", 443));
    wait(vec![(sa("10.96.0.10:80"), 1), (sa("10.96.0.11:443"), 0)]).await;
    server.delete(Kind::Services, "default", "web");
    wait(vec![(sa("10.96.0.11:443"), 0)]).await;
    assert!(applied.try_recv().is_ok());
    assert_eq!(
        reader.backends.iter().count(),
        0,
        "backends of the deleted service are gone"
    );
}

// The API client, as robust as client-go (issue 25).

/// Web (10.96.0.10:80, one backend) and this node, before the agent starts.
fn seed(server: &FakeApiServer) {
    server.apply(Kind::Services, service("web", "10.96.0.10", 80));
    server.apply(Kind::EndpointSlices, slice("web-1", "web", &["10.244.1.5"]));
    server.apply(Kind::Nodes, node());
}

const RESOURCES: [&str; 3] = ["services", "endpointslices", "nodes"];

/// Waits until `pred` holds of the status's counters.
async fn until_counted(
    status: &Status,
    what: &str,
    pred: impl Fn(&runner::status::Counters) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !pred(&status.counters()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}; counters: {:?}",
            status.counters().api
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A 410 on every watch: each relist is sent back at once. kube's backoff reset on every
/// event, the relist's included, so all three resources relisted about once a second
/// forever (12 or so in 10 s); the backoff now grows (0.4–0.8 s, then 0.8–1.6 s, 1.6–3.2 s,
/// 3.2–6.4 s: at most 4 in 10 s), and the relists and 410s are counted.
#[tokio::test]
async fn a_410_storm_relists_a_bounded_number_of_times() {
    let server = FakeApiServer::start().await;
    seed(&server);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    until(&mut rx, "initial view", |v| !v.is_empty()).await;
    let before: Vec<u64> = RESOURCES.iter().map(|r| server.lists_served(r)).collect();
    server.gone_storm(true);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let lists: Vec<u64> = RESOURCES
        .iter()
        .zip(&before)
        .map(|(r, b)| server.lists_served(r) - b)
        .collect();
    server.clear_faults();
    eprintln!("lists in 10 s of 410s, by resource {RESOURCES:?}: {lists:?}");
    for (r, n) in RESOURCES.iter().zip(&lists) {
        assert!(
            (2..=5).contains(n),
            "{r}: {n} lists in 10 s of 410s (all: {lists:?})"
        );
    }
    let c = status.counters();
    for (r, n) in RESOURCES.iter().zip(&lists) {
        assert_eq!(c.api.relists.get(r), Some(n), "{r}: {:?}", c.api);
        let gone = c
            .api
            .errors
            .iter()
            .filter(|((res, kind, code), _)| res == r && kind.as_str() == "watch" && *code == 410)
            .map(|(_, n)| *n)
            .sum::<u64>();
        assert!(
            gone >= *n,
            "{r}: {gone} 410s counted for {n} relists: {:?}",
            c.api
        );
    }
    // The relists swapped in the same objects: the view held throughout.
    assert_eq!(backends(&status.view(), "10.96.0.10", 80).len(), 1);
    let metrics = proxy_agent::metrics::render(&status, None).expect("metrics");
    let line = format!(
        "proxy_agent_api_relists_total{{resource=\"services\"}} {}",
        lists[0]
    );
    assert!(metrics.contains(&line), "{line} missing:\n{metrics}");
    assert!(
        metrics.contains(
            "proxy_agent_api_errors_total{resource=\"services\",kind=\"watch\",code=\"410\"}"
        ),
        "{metrics}"
    );
}

/// An etcd restore: objects from the backup, `api` gone with it, `fresh` made since; the
/// agent's resourceVersions are from before. kube watched again from them forever (504
/// ResourceVersionTooLarge, or a 410 on the request), so `api` stayed programmed and
/// `fresh` never came; a relist from scratch converges.
async fn an_etcd_restore_relists_and_converges(old: OldVersions) {
    let server = FakeApiServer::start().await;
    seed(&server);
    server.apply(Kind::Services, service("api", "10.96.0.11", 443));
    server.apply(Kind::EndpointSlices, slice("api-1", "api", &["10.244.3.7"]));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    until(&mut rx, "both Services", |v| {
        backends(v, "10.96.0.10", 80).len() == 1 && backends(v, "10.96.0.11", 443).len() == 1
    })
    .await;
    server.restore(
        [
            (Kind::Services, service("web", "10.96.0.10", 80)),
            (
                Kind::EndpointSlices,
                slice("web-1", "web", &["10.244.1.5", "10.244.2.6"]),
            ),
            (Kind::Nodes, node()),
        ],
        old,
    );
    server.apply(Kind::Services, service("fresh", "10.96.0.12", 80));
    until(&mut rx, "the restored cluster", |v| {
        backends(v, "10.96.0.10", 80).len() == 2
            && !v.contains_key(&fe("10.96.0.11", 443))
            && v.contains_key(&fe("10.96.0.12", 80))
    })
    .await;
    let code = match old {
        OldVersions::TooLarge => 504,
        OldVersions::Gone => 410,
    };
    let answered: Vec<u16> = server
        .served("services")
        .iter()
        .filter(|s| s.watch)
        .map(|s| s.code)
        .collect();
    assert!(answered.contains(&code), "watches answered {answered:?}");
    let c = status.counters().api;
    assert!(
        c.relists.get("services").copied().unwrap_or(0) >= 1,
        "{c:?}"
    );
    assert!(
        c.errors
            .iter()
            .any(|((r, kind, k), _)| *r == "services" && kind.as_str() == "watch" && *k == code),
        "{c:?}"
    );
}

#[tokio::test]
async fn an_etcd_restore_answered_too_large_relists_and_converges() {
    an_etcd_restore_relists_and_converges(OldVersions::TooLarge).await;
}

#[tokio::test]
async fn an_etcd_restore_answered_gone_on_the_watch_request_relists_and_converges() {
    an_etcd_restore_relists_and_converges(OldVersions::Gone).await;
}

/// This process's resident set, from /proc/self/status (`VmRSS` or `VmHWM`), in bytes.
fn memory(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"))
}

/// A list page past its cap: kube read a page whole, however large, before parsing it.
/// Held to a 1 MiB cap here (64 MiB in the agent), a page of 500 Services of 8 KiB (4 MB)
/// is refused as soon as it passes the cap, named and counted (`list_too_large`), and the
/// Services are listed again in pages a tenth the size: every one is programmed. A
/// single object past the cap stays refused, and what was programmed stays.
#[tokio::test]
async fn a_list_page_past_its_cap_is_refused_and_listed_again_in_smaller_pages() {
    const SERVICES: usize = 500;
    let server = FakeApiServer::start().await;
    let filler = "x".repeat(8 * 1024);
    server.preload(
        Kind::Services,
        (0..SERVICES).map(|i| {
            let mut s = service(
                &format!("s{i:03}"),
                &format!("10.96.{}.{}", i / 250, i % 250 + 1),
                80,
            );
            s["metadata"]["annotations"] = json!({"filler": filler});
            s
        }),
    );
    server.apply(Kind::Nodes, node());
    let caps = source::api_server::AnswerCaps {
        list_page_bytes: 1 << 20,
        ..Default::default()
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start_with_caps(&server, Recording(tx), caps);
    let view = until(&mut rx, "every Service programmed", |v| v.len() == SERVICES).await;
    assert_eq!(view.len(), SERVICES);
    let counts = status.counters().api;
    assert_eq!(
        counts.errors.get(&(
            "services",
            source::api_server::ApiErrorKind::ListTooLarge,
            0
        )),
        Some(&1),
        "{counts:?}"
    );
    // One refused page of 500, then 10 pages of 50 (each ~400 KB, under the cap).
    assert_eq!(server.lists_served("services"), 2);
    assert_eq!(server.pages_served("services"), 1 + SERVICES as u64 / 50);
    // One object past the cap by itself: refused at every page size; the node keeps what
    // it had and says why.
    let mut huge = service("huge", "10.96.9.9", 80);
    huge["metadata"]["annotations"] = json!({"filler": "x".repeat(2 << 20)});
    server.preload(Kind::Services, [huge]);
    until_counted(
        &status,
        "the huge object refused at one object a page",
        |c| {
            c.api
                .errors
                .get(&(
                    "services",
                    source::api_server::ApiErrorKind::ListTooLarge,
                    0,
                ))
                .is_some_and(|n| *n >= 3)
        },
    )
    .await;
    assert_eq!(status.view().len(), SERVICES, "what was programmed stays");
}

/// A 100 MB watch event: kube buffered the whole line, then parsed it (a 400 MB line took
/// 442 MB). It is cut at the 16 MiB cap: the resident set grows by at most a small
/// multiple of the cap, the watch relists (counted, named), and later changes arrive.
#[tokio::test]
async fn a_huge_watch_event_is_cut_at_the_cap_and_the_watch_relists() {
    let cap = source::api_server::MAX_EVENT_BYTES as u64;
    let server = FakeApiServer::start().await;
    seed(&server);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    until(&mut rx, "initial view", |v| !v.is_empty()).await;
    let base = memory("VmRSS");
    // The peak from now on: reset the high-water mark where the kernel lets us (Linux
    // 4.0+), and sample besides.
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(memory("VmRSS"));
                std::thread::sleep(Duration::from_millis(2));
            }
            peak
        })
    };
    server.huge_event(Kind::Services, 100 * 1024 * 1024);
    until_counted(
        &status,
        "the huge event refused and Services relisted",
        |c| {
            c.api.relists.get("services").copied().unwrap_or(0) >= 1
                && c.api
                    .errors
                    .keys()
                    .any(|(r, kind, _)| *r == "services" && kind.as_str() == "event_too_large")
        },
    )
    .await;
    // The watch goes on after the relist.
    server.apply(Kind::Services, service("after", "10.96.0.13", 80));
    until(&mut rx, "a change after the relist", |v| {
        v.contains_key(&fe("10.96.0.13", 80))
    })
    .await;
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut peak = sampler.join().expect("sampler");
    if reset {
        peak = peak.max(memory("VmHWM"));
    }
    let grew = peak.saturating_sub(base);
    eprintln!(
        "a 100 MiB event grew the resident set by {} MiB",
        grew >> 20
    );
    assert!(
        grew < 4 * cap,
        "resident set grew by {} MiB for a 100 MiB event (cap {} MiB)",
        grew >> 20,
        cap >> 20
    );
    assert_eq!(backends(&status.view(), "10.96.0.10", 80).len(), 1);
}

/// Retry-After on a 429 (a list) and a 503 (a watch request): the request is sent again
/// after the wait the server asked for, not after the watcher's own backoff (kube dropped
/// the header and came back in 0.8 s), and each wait is counted.
#[tokio::test]
async fn retry_after_is_honoured_on_lists_and_watches() {
    let server = FakeApiServer::start().await;
    seed(&server);
    server.throttle(
        Kind::Services,
        Throttle {
            code: 429,
            retry_after: Some(Duration::from_secs(3)),
            times: 1,
        },
    );
    let (tx, mut rx) = mpsc::unbounded_channel();
    let status = start(&server, Recording(tx));
    until(&mut rx, "initial view", |v| !v.is_empty()).await;
    let lists: Vec<_> = server
        .served("services")
        .into_iter()
        .filter(|s| !s.watch)
        .collect();
    assert_eq!(lists.iter().map(|s| s.code).collect::<Vec<_>>(), [429, 200]);
    let waited = lists[1].at - lists[0].at;
    assert!(
        waited >= Duration::from_millis(2900),
        "came back after {waited:?}"
    );

    // A watch request answered 503 with Retry-After: 2.
    server.throttle(
        Kind::Nodes,
        Throttle {
            code: 503,
            retry_after: Some(Duration::from_secs(2)),
            times: 1,
        },
    );
    server.break_watches();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let watches = loop {
        let w: Vec<_> = server
            .served("nodes")
            .into_iter()
            .filter(|s| s.watch)
            .collect();
        if w.last().is_some_and(|s| s.code == 200) && w.iter().any(|s| s.code == 503) {
            break w;
        }
        assert!(tokio::time::Instant::now() < deadline, "watches: {w:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let i = watches.iter().position(|s| s.code == 503).expect("the 503");
    let waited = watches[i + 1].at - watches[i].at;
    assert!(
        waited >= Duration::from_millis(1900),
        "came back after {waited:?}"
    );
    let c = status.counters().api;
    let counted = |r: &str, code: u16| {
        c.errors
            .iter()
            .filter(|((res, kind, k), _)| *res == r && kind.as_str() == "retry_after" && *k == code)
            .map(|(_, n)| *n)
            .sum::<u64>()
    };
    assert_eq!(
        (counted("services", 429), counted("nodes", 503)),
        (1, 1),
        "{c:?}"
    );
}

/// A kubeconfig for `server` whose user reads its token from `token_file`.
fn kubeconfig_with_token_file(server: &FakeApiServer, token_file: &std::path::Path) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: '{}'}}\n\
         contexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\n\
         current-context: fake\nusers:\n- name: fake\n  user: {{tokenFile: '{}'}}\n",
        server.url(),
        token_file.display()
    )
}

/// A token file written with `echo` ends in a newline: kube put it in the header as is,
/// which cannot be sent, so the agent never authenticated. It is trimmed, as client-go
/// trims it, and a rotated file is read again.
#[tokio::test]
async fn a_token_file_ending_in_a_newline_authenticates_and_a_rotated_one_is_read_again() {
    let server = FakeApiServer::start().await;
    server.require_token(Some("t0ken-1"));
    let dir = std::env::temp_dir().join(format!("kube-source-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let token = dir.join("token");
    std::fs::write(&token, "t0ken-1\n").expect("token");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_with_token_file(&server, &token)).expect("kubeconfig");
    let opts = source::api_server::ApiServerOptions {
        kubeconfig: Some(kubeconfig.display().to_string()),
        api_server: None,
    };
    let config = source::api_server::client_config(&opts)
        .await
        .expect("config");
    let client = source::api_server::client(config, &Default::default()).expect("client");
    client
        .apiserver_version()
        .await
        .expect("authenticated with the trimmed token");
    // kubelet's rotation: a new file renamed over the old.
    std::fs::write(dir.join("token.new"), "t0ken-2\n").expect("token");
    std::fs::rename(dir.join("token.new"), &token).expect("rename");
    server.require_token(Some("t0ken-2"));
    client
        .apiserver_version()
        .await
        .expect("authenticated with the rotated token");
    assert_eq!(server.unauthorized(), 0);
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// What `f` logs (tracing, this thread), as text.
async fn logs_of(f: impl std::future::Future<Output = ()>) -> String {
    #[derive(Clone, Default)]
    struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log buffer").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buffer = Buffer::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    {
        let _guard = tracing::subscriber::set_default(subscriber);
        f.await;
    }
    String::from_utf8_lossy(&buffer.0.lock().expect("log buffer")).into_owned()
}

/// A CA that did not sign the server's certificate: kube's error said only "client error
/// (Connect)"; the log line now carries the whole chain, down to rustls's reason.
#[tokio::test]
async fn a_bad_ca_is_logged_with_its_tls_cause() {
    let server = FakeApiServer::try_start_tls(Options::default())
        .await
        .expect("https");
    let good = source::api_server::client(server.config(), &Default::default()).expect("client");
    good.apiserver_version()
        .await
        .expect("the right CA is trusted");
    let other = FakeApiServer::try_start_tls(Options::default())
        .await
        .expect("https");
    let mut config = server.config();
    config.root_cert = other.config().root_cert;
    let client = source::api_server::client(config, &Default::default()).expect("client");
    let url = server.url();
    let logs = logs_of(async {
        let _ = tokio::time::timeout(
            Duration::from_millis(1500),
            source::api_server::wait_reachable(&client, &url),
        )
        .await;
    })
    .await;
    let line = logs
        .lines()
        .find(|l| l.contains("cannot reach the API server"))
        .unwrap_or_else(|| panic!("no error logged:\n{logs}"));
    assert!(
        line.contains("invalid peer certificate") && line.contains("UnknownIssuer"),
        "the TLS cause is missing: {line}"
    );
    assert!(server.tls_failures() >= 1);
}

/// A token the server refuses: the log says so, instead of suggesting the address is wrong.
#[tokio::test]
async fn a_refused_token_is_logged_as_credentials_not_the_address() {
    let server = FakeApiServer::start().await;
    server.require_token(Some("right"));
    let mut config = server.config();
    config.auth_info.token = Some("wrong".to_string().into());
    let client = source::api_server::client(config, &Default::default()).expect("client");
    let url = server.url();
    let logs = logs_of(async {
        let _ = tokio::time::timeout(
            Duration::from_millis(500),
            source::api_server::wait_reachable(&client, &url),
        )
        .await;
    })
    .await;
    assert!(logs.contains("refused our credentials"), "{logs}");
    assert!(!logs.contains("if this is not its address"), "{logs}");
    assert!(server.unauthorized() >= 1);
}
