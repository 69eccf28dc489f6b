//! Traffic from outside the node, across nodes: a multi-node testbed with one agent per
//! node (see `proxy_testbed::multinode`). Root only.

use std::{thread, time::Duration};

use proxy_testbed::multinode::{CLIENT, MultiNode, NODE_A, NODE_B};
use test_support::needs_root;

fn slice(name: &str, svc: &str, pods: &[(&str, &str)]) -> String {
    let mut s = format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: default, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: IPv4\nports: [{{name: http, protocol: TCP, port: 8080}}, {{name: dns, protocol: UDP, port: 5353}}]\nendpoints:\n"
    );
    for (ip, node) in pods {
        s.push_str(&format!(
            "- {{addresses: [\"{ip}\"], nodeName: {node}, conditions: {{ready: true}}}}\n"
        ));
    }
    if pods.is_empty() {
        s.push_str("  []\n");
    }
    s
}

const POD_A: (&str, &str) = ("10.244.1.2", "node-a");
const POD_B: (&str, &str) = ("10.244.2.2", "node-b");

fn manifests(dns_pods: &[(&str, &str)]) -> String {
    let svc = |name: &str, spec: &str| {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n{spec}\n"
        )
    };
    let http = "{name: http, protocol: TCP, port: 80, targetPort: 8080";
    let mut y = String::new();
    y += &svc(
        "cross",
        &format!(
            "spec: {{type: NodePort, clusterIP: 10.96.1.1, ports: [{http}, nodePort: 30080}}]}}"
        ),
    );
    y += &svc(
        "local",
        &format!(
            "spec: {{type: NodePort, clusterIP: 10.96.1.2, externalTrafficPolicy: Local, healthCheckNodePort: 32081, ports: [{http}, nodePort: 30081}}]}}"
        ),
    );
    y += &svc(
        "lb",
        &format!(
            "spec: {{type: LoadBalancer, clusterIP: 10.96.1.3, loadBalancerSourceRanges: [{CLIENT}/32], ports: [{http}, nodePort: 30082}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 203.0.113.50}}]}}}}"
        ),
    );
    y += &svc(
        "lbdeny",
        &format!(
            "spec: {{type: LoadBalancer, clusterIP: 10.96.1.4, loadBalancerSourceRanges: [10.0.0.0/8], ports: [{http}, nodePort: 30083}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 203.0.113.51}}]}}}}"
        ),
    );
    y += &svc(
        "ext",
        &format!("spec: {{clusterIP: 10.96.1.5, externalIPs: [203.0.113.7], ports: [{http}}}]}}"),
    );
    y += &svc(
        "hair",
        &format!("spec: {{clusterIP: 10.96.1.6, ports: [{http}}}]}}"),
    );
    y += &svc(
        "dns",
        "spec: {type: NodePort, clusterIP: 10.96.1.7, ports: [{name: dns, protocol: UDP, port: 53, targetPort: 5353, nodePort: 30053}]}",
    );
    y += &slice("cross-1", "cross", &[POD_B]);
    y += &slice("local-1", "local", &[POD_A]);
    y += &slice("lb-1", "lb", &[POD_A, POD_B]);
    y += &slice("lbdeny-1", "lbdeny", &[POD_A]);
    y += &slice("ext-1", "ext", &[POD_B]);
    y += &slice("hair-1", "hair", &[POD_A]);
    y += &slice("dns-1", "dns", dns_pods);
    y
}

/// Service-map entries per node: NodePort and LB Services have ClusterIP, node-IP and
/// 127.0.0.1 NodePorts; eTP Local adds an internal scope to each external frontend.
const FRONTENDS: usize = 3 + 5 + 4 + 4 + 2 + 1 + 3;

fn testbed() -> MultiNode {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&manifests(&[POD_A, POD_B]))
        .expect("manifests");
    tb.start_agents(FRONTENDS).expect("agents");
    tb
}

fn one(tb: &MultiNode, args: &[&str]) -> proxy_testbed::Attempt {
    tb.client(args).expect("client").remove(0)
}

#[needs_root]
#[test]
fn traffic_from_outside_the_node() {
    let tb = testbed();

    // NodePort on node A, backend on node B, and back: the backend sees node A.
    let a = one(
        &tb,
        &["--target", &format!("{NODE_A}:30080"), "--count", "1"],
    );
    assert!(a.ok, "{a:?}\n{}", tb.log("node-a"));
    assert_eq!(
        (a.backend.as_deref(), a.seen_as.as_deref()),
        (Some("pod-b"), Some(NODE_A)),
        "masqueraded to node A"
    );

    // externalTrafficPolicy Local: the client address reaches the backend; a node without
    // a local endpoint drops.
    let a = one(
        &tb,
        &["--target", &format!("{NODE_A}:30081"), "--count", "1"],
    );
    assert!(a.ok, "{a:?}");
    assert_eq!(
        (a.backend.as_deref(), a.seen_as.as_deref()),
        (Some("pod-a"), Some(CLIENT)),
        "source kept"
    );
    let b = one(
        &tb,
        &[
            "--target",
            &format!("{NODE_B}:30081"),
            "--count",
            "1",
            "--timeout-ms",
            "700",
        ],
    );
    assert!(
        !b.ok && b.error.as_deref() == Some("TimedOut"),
        "dropped on node B: {b:?}"
    );

    // healthCheckNodePort: 200 with the local endpoint count on node A, 503 on node B.
    let (code, body) = tb
        .http_get(&format!("http://{NODE_A}:32081/healthz"))
        .expect("health A");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("\"localEndpoints\":1") && body.contains("\"name\":\"local\""),
        "{body}"
    );
    let (code, body) = tb
        .http_get(&format!("http://{NODE_B}:32081/healthz"))
        .expect("health B");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"localEndpoints\":0"), "{body}");

    // loadBalancerSourceRanges: listed clients reach the LB IP, others are dropped.
    let a = one(&tb, &["--target", "203.0.113.50:80", "--count", "1"]);
    assert!(a.ok && a.seen_as.as_deref() == Some(NODE_A), "{a:?}");
    let d = one(
        &tb,
        &[
            "--target",
            "203.0.113.51:80",
            "--count",
            "1",
            "--timeout-ms",
            "700",
        ],
    );
    assert!(!d.ok, "outside the source ranges: {d:?}");

    // An external IP reaches its backend (on the other node).
    let a = one(&tb, &["--target", "203.0.113.7:80", "--count", "1"]);
    assert!(a.ok && a.backend.as_deref() == Some("pod-b"), "{a:?}");

    // Hairpin: a pod reaching itself through its Service (masqueraded to its node).
    let h = tb
        .from_pod("a", &["--target", "10.96.1.6:80", "--count", "1"])
        .expect("pod")
        .remove(0);
    assert!(h.ok, "{h:?}\n{}", tb.log("node-a"));
    assert_eq!(
        (h.backend.as_deref(), h.seen_as.as_deref()),
        (Some("pod-a"), Some(NODE_A))
    );
}

#[needs_root]
#[test]
fn udp_flow_recovers_when_its_backend_goes_away() {
    let tb = testbed();
    let target = format!("{NODE_A}:30053");
    // One connected socket: one flow, like a DNS stub resolver.
    let client = tb
        .spawn_client(&[
            "--target",
            &target,
            "--proto",
            "udp",
            "--reuse-socket",
            "--count",
            "30",
            "--interval-ms",
            "50",
            "--timeout-ms",
            "700",
        ])
        .expect("client");
    thread::sleep(Duration::from_millis(400));
    // Which backend is the flow pinned to? Ask the node's map dump... simpler: remove
    // pod-a; a flow on pod-b must stay there, a flow on pod-a must move.
    tb.write_manifests(&manifests(&[POD_B])).expect("manifests");
    let attempts = client.finish().expect("client output");
    let first = attempts[0].backend.clone();
    let failed: Vec<_> = attempts.iter().filter(|a| !a.ok).collect();
    assert!(
        failed.len() <= 1,
        "at most the packet in flight at the change may be lost: {failed:?}"
    );
    let late: Vec<_> = attempts.iter().filter(|a| a.at_ms > 1200.0).collect();
    assert!(!late.is_empty());
    assert!(
        late.iter()
            .all(|a| a.ok && a.backend.as_deref() == Some("pod-b")),
        "first {first:?}, then {late:?}"
    );
}

/// The same Services with the XDP program on both nodes: a NodePort, an LB IP and an
/// external IP on node A whose backend is on node B are translated at node A's XDP and
/// sent back out of the LAN interface they came in on (`XDP_TX`), and the replies from
/// node B come back through XDP too; an LB IP's source-range deny is dropped at XDP.
///
/// Native XDP. The LAN bridge's ports (the uplinks' veth peers) get an XDP program that
/// only passes: without one, frames sent back out with `XDP_TX` into a veth whose peer
/// has only GRO's NAPI arrive too late (the client resets the SYN-ACKs of connections
/// it gave up on), a property of veth, not of the program (generic XDP, or an XDP
/// program on the peer, and every connection completes).
#[needs_root]
#[test]
fn xdp_sends_remote_backends_traffic_back_out_of_the_uplink() {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&manifests(&[POD_A, POD_B]))
        .expect("manifests");
    tb.prepare_for_xdp().expect("veths ready for XDP");
    let _lan_xdp = tb.pass_on_lan_ports().expect("xdp_pass on the LAN ports");
    tb.start_agents_with(FRONTENDS, &["--xdp", "native"])
        .expect("agents");
    let tx = |tb: &MultiNode| tb.counter("node-a", "xdp_tx");
    let before = tx(&tb);
    let all = tb
        .client(&["--target", &format!("{NODE_A}:30080"), "--count", "5"])
        .expect("client");
    assert!(all.iter().all(|a| a.ok), "{all:?}\n{}", tb.log("node-a"));
    let a = all[0].clone();
    assert!(
        a.ok,
        "{a:?}\nnode-a: {}\nnode-b: {}",
        tb.dump("node-a").expect("dump")["counters"],
        tb.dump("node-b").expect("dump")["counters"]
    );
    assert_eq!(
        (a.backend.as_deref(), a.seen_as.as_deref()),
        (Some("pod-b"), Some(NODE_A)),
        "masqueraded to node A"
    );
    let after_np = tx(&tb);
    assert!(
        after_np > before,
        "the NodePort's packets went back out at XDP: {before} -> {after_np}"
    );
    let e = one(&tb, &["--target", "203.0.113.7:80", "--count", "3"]);
    assert!(e.ok && e.backend.as_deref() == Some("pod-b"), "{e:?}");
    let l = one(&tb, &["--target", "203.0.113.50:80", "--count", "3"]);
    assert!(l.ok && l.seen_as.as_deref() == Some(NODE_A), "{l:?}");
    let u = tb
        .client(&[
            "--target",
            &format!("{NODE_A}:30053"),
            "--proto",
            "udp",
            "--count",
            "10",
        ])
        .expect("client");
    assert!(u.iter().all(|a| a.ok), "UDP NodePort: {u:?}");
    assert!(tx(&tb) > after_np, "external IP, LB IP and UDP at XDP too");
    let drops = tb.counter("node-a", "xdp_drop");
    let d = one(
        &tb,
        &[
            "--target",
            "203.0.113.51:80",
            "--count",
            "1",
            "--timeout-ms",
            "700",
        ],
    );
    assert!(!d.ok, "outside the source ranges: {d:?}");
    assert!(
        tb.counter("node-a", "xdp_drop") > drops,
        "the deny dropped at XDP"
    );
    assert_eq!(
        tb.dump("node-a").expect("dump")["xdp"][&format!("la{}", tb.id)],
        "native"
    );
}
