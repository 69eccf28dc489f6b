//! KPNG's split over the wire: `proxy-agent serve` watches (here: the manifests) and
//! feeds the agents of two nodes (`--source server=`), whose programs carry real traffic
//! from outside. The server killed with -9 under churn (traffic keeps flowing from the
//! pins; both nodes converge once it is back), a stopped node that does not delay the
//! other, a replica taking over, and a node cut off from the server by the network
//! while the server goes on serving the other. Root only (see `proxy_testbed::multinode`).

use std::time::{Duration, Instant};

use proxy_testbed::multinode::{MultiNode, NODE_A, NODE_B};
use test_support::needs_root;

/// A NodePort Service on node B's pod (3 frontends: ClusterIP, node IP, 127.0.0.1) and
/// `extra` ClusterIP Services (1 each).
fn manifests(extra: usize) -> String {
    let mut y = String::from(
        "---\napiVersion: v1\nkind: Service\nmetadata: {name: cross, namespace: default}\n\
         spec: {type: NodePort, clusterIP: 10.96.1.1, ports: [{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30080}]}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {name: cross-1, namespace: default, labels: {kubernetes.io/service-name: cross}}\n\
         addressType: IPv4\nports: [{name: http, protocol: TCP, port: 8080}]\n\
         endpoints:\n- {addresses: [\"10.244.2.2\"], nodeName: node-b, conditions: {ready: true}}\n",
    );
    for i in 0..extra {
        y.push_str(&format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: extra-{i}, namespace: default}}\n\
             spec: {{clusterIP: 10.96.2.{}, ports: [{{name: http, protocol: TCP, port: 80}}]}}\n",
            i + 1
        ));
    }
    y
}

fn frontends(extra: usize) -> usize {
    3 + extra
}

/// Every one of `count` connections through node `addr`'s NodePort reaches pod B.
fn all_reach_pod_b(tb: &MultiNode, addr: &str, count: u32) {
    let attempts = tb
        .client(&[
            "--target",
            &format!("{addr}:30080"),
            "--count",
            &count.to_string(),
            "--interval-ms",
            "20",
        ])
        .expect("client");
    let bad: Vec<_> = attempts
        .iter()
        .filter(|a| !a.ok || a.backend.as_deref() != Some("pod-b"))
        .collect();
    assert!(
        bad.is_empty(),
        "through {addr}: {bad:?}\nnode-a:\n{}\nnode-b:\n{}",
        tb.log("node-a"),
        tb.log("node-b")
    );
}

const CONVERGE: Duration = Duration::from_secs(20);

/// Starts both nodes' agents fed by `servers` (`--source server=…`) with `extra` flags,
/// holding the base manifests' frontends; panics with the first server's log.
fn start_fed_agents(tb: &mut MultiNode, servers: &[&str], extra: &[&str]) {
    let source = format!("server={}", servers.join(","));
    let mut args = vec!["--source", source.as_str()];
    args.extend_from_slice(extra);
    if let Err(e) = tb.start_agents_with(frontends(0), &args) {
        panic!("{e:#}\nserver:\n{}", tb.server_log(0));
    }
}

#[needs_root]
#[test]
fn agents_fed_by_a_server_carry_traffic_through_its_kill_and_converge_after() {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&manifests(0)).expect("manifests");
    let server = tb.start_server(0, "node-a").expect("server");
    start_fed_agents(&mut tb, &[&server], &[]);
    all_reach_pod_b(&tb, NODE_A, 10);
    all_reach_pod_b(&tb, NODE_B, 10);

    // Churn, then kill -9 of the server in the middle of it.
    for extra in 1..=3 {
        tb.write_manifests(&manifests(extra)).expect("manifests");
        std::thread::sleep(Duration::from_millis(150));
    }
    tb.kill_server(0);
    tb.write_manifests(&manifests(5)).expect("manifests");
    // No server: the pinned programs keep serving what they hold.
    all_reach_pod_b(&tb, NODE_A, 30);
    all_reach_pod_b(&tb, NODE_B, 30);
    let held_a = tb.frontends("node-a");
    assert!(
        held_a.is_some_and(|n| n < frontends(5)),
        "node A took a change with no server: {held_a:?}"
    );

    // Back (a new epoch: a snapshot), and both nodes converge to the manifests.
    tb.start_server(0, "node-a").expect("server again");
    for node in ["node-a", "node-b"] {
        if let Err(e) = tb.wait_frontends(node, frontends(5), CONVERGE) {
            panic!("{e:#}\nserver:\n{}", tb.server_log(0));
        }
    }
    all_reach_pod_b(&tb, NODE_A, 10);
    all_reach_pod_b(&tb, NODE_B, 10);
}

#[needs_root]
#[test]
fn a_stopped_node_delays_no_other_and_a_replica_takes_over() {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&manifests(0)).expect("manifests");
    let first = tb.start_server(0, "node-a").expect("server 0");
    let second = tb.start_server(1, "node-b").expect("server 1");
    start_fed_agents(&mut tb, &[&first, &second], &[]);

    // Node B stuck (SIGSTOP): node A still takes every change at once.
    tb.pause_agent("node-b", true).expect("stop node B");
    for extra in 1..=20 {
        tb.write_manifests(&manifests(extra)).expect("manifests");
        std::thread::sleep(Duration::from_millis(20));
    }
    let a = tb.wait_frontends("node-a", frontends(20), Duration::from_secs(5));
    tb.pause_agent("node-b", false).expect("continue node B");
    a.expect("node A delayed by a stopped node B");
    tb.wait_frontends("node-b", frontends(20), CONVERGE)
        .expect("node B after it went on");

    // The first replica (the one both use) killed: they move to the other, which has
    // watched all along.
    tb.kill_server(0);
    tb.write_manifests(&manifests(2)).expect("manifests");
    for node in ["node-a", "node-b"] {
        if let Err(e) = tb.wait_frontends(node, frontends(2), CONVERGE) {
            panic!("{e:#}\nserver 1:\n{}", tb.server_log(1));
        }
    }
    all_reach_pod_b(&tb, NODE_A, 10);
    all_reach_pod_b(&tb, NODE_B, 10);
}

/// What node `node`'s agent logs each time it loses a server.
fn links_lost(tb: &MultiNode, node: &str) -> usize {
    let log = tb.log(node);
    log.matches("no feed from this server").count() + log.matches("the feed's stream ended").count()
}

/// Node A's `/healthz` (healthzBindAddress, 0.0.0.0:10256), asked from the client.
fn healthz_a(tb: &MultiNode) -> Option<u16> {
    tb.http_get(&format!("http://{NODE_A}:10256/healthz"))
        .ok()
        .map(|(code, _)| code)
}

/// Polls `done` until it holds; past `within`, panics with `what` and the logs.
fn wait_for(tb: &MultiNode, within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what} within {within:?}\nnode-a:\n{}\nserver:\n{}",
            tb.log("node-a"),
            tb.server_log(0)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The health timeout is 2 × syncPeriod: 6 s with `--resync-s 3`.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(6);

#[needs_root]
#[test]
fn a_partitioned_node_serves_from_its_pins_and_resumes_once_healed() {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&manifests(0)).expect("manifests");
    // The server on node B: only node A's feed crosses the LAN, where it is cut.
    let server = tb.start_server(0, "node-b").expect("server");
    start_fed_agents(&mut tb, &[&server], &["--resync-s", "3"]);
    all_reach_pod_b(&tb, NODE_A, 10);
    all_reach_pod_b(&tb, NODE_B, 10);
    assert_eq!(healthz_a(&tb), Some(200), "{}", tb.log("node-a"));

    let lost_before = links_lost(&tb, "node-a");
    tb.partition("node-a", &server, true).expect("partition");
    // The server goes on serving node B: a change reaches B, not A.
    tb.write_manifests(&manifests(1)).expect("manifests");
    if let Err(e) = tb.wait_frontends("node-b", frontends(1), CONVERGE) {
        panic!("{e:#}\nserver:\n{}", tb.server_log(0));
    }
    all_reach_pod_b(&tb, NODE_A, 30);
    assert_eq!(
        tb.frontends("node-a"),
        Some(frontends(0)),
        "node A took a change across the partition"
    );
    // Until A takes the silence (15 s) as a lost link its data counts as current.
    assert_eq!(healthz_a(&tb), Some(200), "{}", tb.log("node-a"));
    wait_for(
        &tb,
        Duration::from_secs(30),
        "node A noticed the partition (is the rule in place?)",
        || links_lost(&tb, "node-a") > lost_before,
    );
    let noticed = Instant::now();
    // Lost for longer than the health timeout: /healthz fails (data too old), while the
    // pins go on serving what they hold.
    wait_for(
        &tb,
        HEALTH_TIMEOUT * 3,
        "node A's /healthz failed after the link's loss",
        || healthz_a(&tb) == Some(503),
    );
    let failed_after = noticed.elapsed();
    assert!(
        failed_after >= HEALTH_TIMEOUT - Duration::from_secs(1),
        "/healthz failed {failed_after:?} after the link was lost, before the health timeout"
    );
    all_reach_pod_b(&tb, NODE_A, 10);
    assert_eq!(tb.frontends("node-a"), Some(frontends(0)));

    // Healed: A reconnects to the same server (same epoch), resumes from the revision
    // it holds, and converges; /healthz recovers.
    let streams_before = tb.log("node-a").matches("the feed streams").count();
    tb.partition("node-a", &server, false).expect("heal");
    if let Err(e) = tb.wait_frontends("node-a", frontends(1), CONVERGE) {
        panic!("{e:#}\nserver:\n{}", tb.server_log(0));
    }
    wait_for(
        &tb,
        Duration::from_secs(10),
        "node A's /healthz recovered",
        || healthz_a(&tb) == Some(200),
    );
    let log = tb.log("node-a");
    let streams: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("the feed streams"))
        .collect();
    assert!(streams.len() > streams_before, "no new stream:\n{log}");
    let resumed = streams.last().expect("a stream");
    assert!(
        resumed.contains("snapshot=false"),
        "node A reconnected with a snapshot, not a resume: {resumed}\n{log}"
    );

    // The resumed stream is live: the next change reaches both.
    tb.write_manifests(&manifests(2)).expect("manifests");
    for node in ["node-a", "node-b"] {
        if let Err(e) = tb.wait_frontends(node, frontends(2), CONVERGE) {
            panic!("{e:#}\nserver:\n{}", tb.server_log(0));
        }
    }
    all_reach_pod_b(&tb, NODE_A, 10);
    all_reach_pod_b(&tb, NODE_B, 10);
}
