//! ICMP errors and node-local endpoints through the per-packet path, with real traffic:
//! a backend's port unreachable reaches the client's connected UDP socket as
//! ECONNREFUSED (ClusterIP v4/v6, masqueraded NodePort); a client doing path MTU
//! discovery completes a large upload across a lower-MTU link between node and backend
//! (ClusterIP v4/v6 through the node's forwarding, whose own "fragmentation needed" the
//! egress program translates; masqueraded NodePort, whose packets skip that forwarding
//! and are answered by the classifier); and an endpoint on the node's own address (a
//! hostNetwork pod) answers through a ClusterIP and a NodePort from the frontend's
//! address. Root only: each test says so and skips otherwise. (Namespaces, veths and
//! pins are the testbed's own.)

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
};

use proxy_testbed::{Path_, Testbed, ip, target, web_manifests};
use test_support::needs_root;

/// A dual-stack NodePort Service `name` (ClusterIPs `vip4`, `vip6`) with `ports`
/// (name, protocol, port, targetPort, nodePort) and endpoints `v4`, `v6`.
fn service(
    name: &str,
    vip4: &str,
    vip6: &str,
    ports: &[(&str, &str, u16, u16, u16)],
    v4: &str,
    v6: &str,
) -> String {
    let mut svc = format!(
        "apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: NodePort
  ipFamilies: [IPv4, IPv6]
  clusterIP: {vip4}
  clusterIPs: [{vip4}, {vip6}]
  ports:
"
    );
    for (pname, proto, port, tport, nport) in ports {
        svc.push_str(&format!(
            "  - {{name: {pname}, protocol: {proto}, port: {port}, targetPort: {tport}, nodePort: {nport}}}\n"
        ));
    }
    for (family, addr) in [("IPv4", v4), ("IPv6", v6)] {
        svc.push_str(&format!(
            "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-{}
  namespace: default
  labels: {{kubernetes.io/service-name: {name}}}
addressType: {family}
ports:
",
            family.to_lowercase()
        ));
        for (pname, proto, _, tport, _) in ports {
            svc.push_str(&format!(
                "- {{name: {pname}, protocol: {proto}, port: {tport}}}\n"
            ));
        }
        svc.push_str(&format!(
            "endpoints:\n- addresses: [\"{addr}\"]\n  conditions: {{ready: true}}\n"
        ));
    }
    svc
}

/// Web's frontends (4 + the empty Service), and per NodePort Service port: two
/// ClusterIPs, the NodePort on both node addresses and on 127.0.0.1.
fn frontends(ports: usize) -> usize {
    5 + ports * 5
}

/// A testbed whose agent serves the web manifests plus `extra` (NodePort Services of
/// `ports` ports in all), with the node's addresses given, on the per-packet path.
fn testbed(backends: usize, extra: String, ports: usize) -> Testbed {
    testbed_with(backends, extra, ports, false)
}

/// `testbed`, with `xdp`: the XDP program in native mode on the node's veths (GRO on
/// every end, so frames redirected into a veth are received; checksum offload off, so
/// the client's packets carry full checksums).
fn testbed_with(backends: usize, extra: String, ports: usize, xdp: bool) -> Testbed {
    let mut tb = Testbed::new(backends).expect("testbed");
    let mut files: BTreeMap<&str, String> = web_manifests(&[0], None);
    files.insert("extra.yaml", extra);
    tb.write_manifests(&files).expect("manifests");
    let mut args = vec!["--node-ip", "10.10.0.1", "--node-ip", "fd10::1"];
    if xdp {
        tb.disable_offload().expect("offload off");
        let mut ends: Vec<(String, String)> = tb
            .node_interfaces()
            .into_iter()
            .map(|i| (tb.node_ns(), i))
            .collect();
        ends.push((tb.client_ns(), "eth0".into()));
        ends.extend((0..backends).map(|i| (tb.backend_ns(i), "eth0".to_string())));
        for (ns, dev) in ends {
            proxy_testbed::sh(&[
                "ip", "netns", "exec", &ns, "ethtool", "-K", &dev, "gro", "on",
            ])
            .expect("gro on");
        }
        args.extend(["--xdp", "native"]);
    }
    tb.start_agent_with(Path_::PerPacket, frontends(ports), &args)
        .expect("agent");
    tb
}

/// Runs a python3 script in the client namespace; returns its stdout.
fn python(tb: &Testbed, script: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &tb.client_ns(), "python3", "-c", script])
        .output()
        .expect("python3 client");
    assert!(
        out.status.success(),
        "client script failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        tb.agent_log()
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// UDP to a Service whose targetPort nobody listens on: the backend's ICMP port
/// unreachable, translated, fails the client's connected socket with ECONNREFUSED —
/// through a ClusterIP (v4, v6) and a masqueraded NodePort, whose error comes back to
/// the node's address and must be sent on to the client.
#[needs_root]
#[test]
fn per_packet_port_unreachable_reaches_a_connected_udp_socket() {
    port_unreachable(false);
}

/// The same with XDP in front: the requests are translated at XDP, the ICMP errors about
/// them take the TC path (XDP passes every ICMP error on) and are translated there.
#[needs_root]
#[test]
fn xdp_port_unreachable_reaches_a_connected_udp_socket() {
    port_unreachable(true);
}

fn port_unreachable(xdp: bool) {
    let closed = service(
        "closed",
        "10.96.0.50",
        "fd96::50",
        &[("dns", "UDP", 53, 5999, 30053)],
        &Testbed::backend_ip4(0),
        &Testbed::backend_ip6(0),
    );
    let tb = testbed_with(1, closed, 1, xdp);
    let script = r#"
import socket
def probe(fam, addr):
    s = socket.socket(fam, socket.SOCK_DGRAM)
    s.settimeout(2)
    s.connect(addr)
    try:
        for _ in range(3):
            s.send(b"anyone?")
            try:
                s.recv(100)
                return "answered"
            except socket.timeout:
                continue
            except ConnectionRefusedError:
                return "refused"
        return "timeout"
    finally:
        s.close()
print(probe(socket.AF_INET, ("10.96.0.50", 53)),
      probe(socket.AF_INET6, ("fd96::50", 53)),
      probe(socket.AF_INET, ("10.10.0.1", 30053)))
"#;
    let got = python(&tb, script);
    assert_eq!(
        got,
        "refused refused refused",
        "ClusterIP v4, ClusterIP v6, NodePort (masqueraded)\n{}",
        tb.agent_log()
    );
    assert!(tb.counter("icmp_error_nat") >= 3);
    if xdp {
        // IPv6's neighbour may be unresolved yet: that request takes the TC path.
        assert!(
            tb.counter("xdp_redirect") + tb.counter("xdp_tx") >= 2,
            "the requests went through XDP: {}",
            tb.dump().expect("dump")["counters"]
        );
    }
}

/// The node's link to the backend carries 1280 bytes; the client's and the backend's own
/// links 1500 (a narrower hop between them, as behind a router). A 4 MB upload
/// with path MTU discovery (DF set, TCP's default) must complete, and the client's socket
/// must have learned the smaller MTU — through the ClusterIPs (the node's forwarding
/// answers with its own error, which the egress program translates) and through a
/// masqueraded NodePort (redirected past the node's forwarding: the classifier checks
/// the FIB's MTU and answers). Without either the upload stalls: a black hole.
#[needs_root]
#[test]
fn per_packet_pmtu_discovery_across_a_lower_mtu_link() {
    pmtu_discovery(false);
}

/// The same with XDP in front: frames too big for the narrower hop are passed to TC
/// unchanged (the FIB's MTU check at XDP), where they are answered or forwarded as
/// without XDP; the handshakes and the small segments go through XDP.
#[needs_root]
#[test]
fn xdp_pmtu_discovery_across_a_lower_mtu_link() {
    pmtu_discovery(true);
}

fn pmtu_discovery(xdp: bool) {
    let bulk = service(
        "bulk",
        "10.96.0.40",
        "fd96::40",
        &[("sink", "TCP", 9000, 9000, 30090)],
        &Testbed::backend_ip4(0),
        &Testbed::backend_ip6(0),
    );
    let mut tb = testbed_with(1, bulk, 1, xdp);
    // Only the node's end: the backend keeps 1500 and advertises an MSS that fits it, so
    // the client learns of the narrower hop only from an ICMP error (as behind a router).
    let node_if = &tb.node_interfaces()[1];
    ip(&tb.node_ns(), &format!("link set {node_if} mtu 1280")).expect("mtu");
    // A sink on the backend: reads to the end, answers with the byte count.
    let sink = r#"
import socket, threading
srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("::", 9000))
srv.listen(16)
print("ready", flush=True)
def serve(c):
    n = 0
    while True:
        b = c.recv(65536)
        if not b:
            break
        n += len(b)
    c.sendall(str(n).encode())
    c.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;
    let mut server = Command::new("ip")
        .args(["netns", "exec", &tb.backend_ns(0), "python3", "-c", sink])
        .stdout(Stdio::piped())
        .spawn()
        .expect("sink");
    let mut ready = String::new();
    BufReader::new(server.stdout.take().expect("stdout"))
        .read_line(&mut ready)
        .expect("sink ready");
    assert_eq!(ready.trim(), "ready");
    tb.keep(server);
    let script = r#"
import socket
SIZE = 4 * 1024 * 1024
def upload(fam, addr):
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(addr)
    try:
        s.sendall(b"x" * SIZE)
        s.shutdown(socket.SHUT_WR)
        got = int(s.recv(100))
        if fam == socket.AF_INET:
            mtu = s.getsockopt(socket.IPPROTO_IP, 14)      # IP_MTU
        else:
            mtu = s.getsockopt(socket.IPPROTO_IPV6, 24)    # IPV6_MTU
        return "%s/%d" % ("ok" if got == SIZE else "short", mtu)
    except Exception as e:
        return type(e).__name__
    finally:
        s.close()
print(upload(socket.AF_INET, ("10.96.0.40", 9000)),
      upload(socket.AF_INET6, ("fd96::40", 9000)),
      upload(socket.AF_INET, ("10.10.0.1", 30090)))
"#;
    let got = python(&tb, script);
    assert_eq!(
        got,
        "ok/1280 ok/1280 ok/1280",
        "ClusterIP v4, ClusterIP v6, NodePort (masqueraded): completed, MTU learned\n{}",
        tb.agent_log()
    );
    let (nat, too_big) = (tb.counter("icmp_error_nat"), tb.counter("too_big_sent"));
    assert!(nat >= 2, "the node's own errors, translated");
    assert!(too_big >= 1, "the classifier's");
    if xdp {
        assert!(tb.counter("xdp_to_tc") >= 1, "too big at XDP: passed to TC");
        assert!(
            tb.counter("xdp_redirect") + tb.counter("xdp_tx") >= 1,
            "the rest through XDP"
        );
    }
    // Again without segmentation offload: full-size frames instead of GSO packets (the
    // FIB's own MTU check instead of ours), the learned MTUs forgotten first.
    let client = tb.client_ns();
    proxy_testbed::sh(&[
        "ip", "netns", "exec", &client, "ethtool", "-K", "eth0", "tso", "off", "gso", "off",
    ])
    .expect("offload off");
    ip(&client, "route flush cache").expect("flush");
    ip(&client, "-6 route flush cache").expect("flush");
    let got = python(&tb, script);
    assert_eq!(
        got,
        "ok/1280 ok/1280 ok/1280",
        "without offload: completed, MTU learned\n{}",
        tb.agent_log()
    );
    assert!(tb.counter("icmp_error_nat") >= nat + 2, "learned afresh");
    assert!(tb.counter("too_big_sent") > too_big, "learned afresh");
}

/// A hostNetwork endpoint: an echo server in the node's namespace, the endpoint being
/// the node's own address. A client outside reaches it through the ClusterIPs and the
/// NodePort (TCP and connected UDP) and gets its answers from the address it asked —
/// the node's stack sends them, the egress program translates them — with its own
/// address kept (delivered locally, never masqueraded, as with kube-proxy).
#[needs_root]
#[test]
fn per_packet_host_network_endpoint_through_clusterip_and_nodeport() {
    let host = service(
        "host",
        "10.96.0.60",
        "fd96::60",
        &[
            ("http", "TCP", 80, 8081, 30081),
            ("dns", "UDP", 53, 5454, 30054),
        ],
        "10.10.0.1",
        "fd10::1",
    );
    let mut tb = testbed(1, host, 2);
    let node = tb.node_ns();
    tb.start_echo(&node, "node", 8081, 5454).expect("echo");
    for (t, proto) in [
        (target("10.96.0.60", 80), "tcp"),
        (target("fd96::60", 80), "tcp"),
        (target("10.10.0.1", 30081), "tcp"),
        (target("fd10::1", 30081), "tcp"),
        (target("10.96.0.60", 53), "udp-connected"),
        (target("fd96::60", 53), "udp-connected"),
        (target("10.10.0.1", 30054), "udp-connected"),
    ] {
        // The echo server may take a moment to bind.
        let mut attempts = Vec::new();
        for _ in 0..20 {
            attempts = tb
                .client(&["--target", &t, "--proto", proto, "--count", "3"])
                .expect("client");
            if attempts.iter().all(|a| a.ok) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        assert!(
            attempts.iter().all(|a| a.ok),
            "{proto} {t}: {attempts:?}\n{}",
            tb.agent_log()
        );
        for a in &attempts {
            assert_eq!(a.backend.as_deref(), Some("node"), "{proto} {t}");
            assert_eq!(
                a.peer.as_deref(),
                Some(t.as_str()),
                "{proto} {t}: answered from the frontend"
            );
            let seen = a.seen_as.as_deref().unwrap_or("");
            assert!(
                seen.contains("10.10.0.2") || seen.contains("fd10::2"),
                "{proto} {t}: the client's address is kept, the endpoint saw {seen}"
            );
        }
    }
}

/// The other direction: the node's link to the client carries 1280 bytes (client and
/// backend links 1500), and the backend sends 4 MB. Its too-big replies are reported to
/// the backend about the packet it sent: through the ClusterIPs by the node's forwarding
/// (its error goes to the reply's source, the ClusterIP — routed towards the client side
/// as a real node's default route would — and the egress program sends it on to the
/// backend, quoting the backend's own packet), through a masqueraded NodePort by the
/// classifier (replies it redirects skip the stack's check). Without either the download
/// stalls.
#[needs_root]
#[test]
fn per_packet_pmtu_discovery_for_replies() {
    let bulk = service(
        "bulk",
        "10.96.0.40",
        "fd96::40",
        &[("source", "TCP", 9000, 9000, 30090)],
        &Testbed::backend_ip4(0),
        &Testbed::backend_ip6(0),
    );
    let mut tb = testbed(1, bulk, 1);
    let (node, node_if) = (tb.node_ns(), tb.node_interfaces()[0].clone());
    ip(&node, &format!("link set {node_if} mtu 1280")).expect("mtu");
    ip(&node, "route add 10.96.0.0/16 via 10.10.0.2").expect("route");
    ip(&node, "-6 route add fd96::/64 via fd10::2").expect("route");
    // A source on the backend: sends 4 MB to whoever connects.
    let source = r#"
import socket, threading
srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("::", 9000))
srv.listen(16)
print("ready", flush=True)
def serve(c):
    try:
        c.sendall(b"y" * (4 * 1024 * 1024))
    finally:
        c.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;
    let mut server = Command::new("ip")
        .args(["netns", "exec", &tb.backend_ns(0), "python3", "-c", source])
        .stdout(Stdio::piped())
        .spawn()
        .expect("source");
    let mut ready = String::new();
    BufReader::new(server.stdout.take().expect("stdout"))
        .read_line(&mut ready)
        .expect("source ready");
    assert_eq!(ready.trim(), "ready");
    tb.keep(server);
    let script = r#"
import socket
def download(fam, addr):
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(20)
    try:
        s.connect(addr)
        n = 0
        while True:
            b = s.recv(65536)
            if not b:
                break
            n += len(b)
        return "ok" if n == 4 * 1024 * 1024 else "short"
    except Exception as e:
        return type(e).__name__
    finally:
        s.close()
print(download(socket.AF_INET, ("10.96.0.40", 9000)),
      download(socket.AF_INET6, ("fd96::40", 9000)),
      download(socket.AF_INET, ("10.10.0.1", 30090)))
"#;
    let got = python(&tb, script);
    assert_eq!(
        got,
        "ok ok ok",
        "ClusterIP v4, ClusterIP v6, NodePort (masqueraded)\n{}",
        tb.agent_log()
    );
    let (nat, too_big) = (tb.counter("icmp_error_nat"), tb.counter("too_big_sent"));
    assert!(nat >= 2, "the node's own errors");
    assert!(too_big >= 1, "the classifier's");
    // Again with full-size frames from the backend (no segmentation offload), what it
    // learned forgotten first.
    let backend = tb.backend_ns(0);
    proxy_testbed::sh(&[
        "ip", "netns", "exec", &backend, "ethtool", "-K", "eth0", "tso", "off", "gso", "off",
    ])
    .expect("offload off");
    ip(&backend, "route flush cache").expect("flush");
    ip(&backend, "-6 route flush cache").expect("flush");
    let got = python(&tb, script);
    assert_eq!(got, "ok ok ok", "without offload\n{}", tb.agent_log());
    assert!(tb.counter("icmp_error_nat") >= nat + 2, "learned afresh");
    assert!(tb.counter("too_big_sent") > too_big, "learned afresh");
}
