//! KPNG's split over the wire: `proxy-agent serve` watches (here: the manifests) and
//! feeds the agents of two nodes (`--source server=`), whose programs carry real traffic
//! from outside. The server killed with -9 under churn (traffic keeps flowing from the
//! pins; both nodes converge once it is back), a stopped node that does not delay the
//! other, and a replica taking over. Root only (see `proxy_e2e::multinode`).

use std::time::Duration;

use proxy_e2e::multinode::{MultiNode, NODE_A, NODE_B};
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

#[needs_root]
#[test]
fn agents_fed_by_a_server_carry_traffic_through_its_kill_and_converge_after() {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&manifests(0)).expect("manifests");
    let server = tb.start_server(0, "node-a").expect("server");
    let source = format!("server={server}");
    if let Err(e) = tb.start_agents_with(frontends(0), &["--source", &source]) {
        panic!("{e:#}\nserver:\n{}", tb.server_log(0));
    }
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
    let source = format!("server={first},{second}");
    if let Err(e) = tb.start_agents_with(frontends(0), &["--source", &source]) {
        panic!("{e:#}\nserver:\n{}", tb.server_log(0));
    }

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
