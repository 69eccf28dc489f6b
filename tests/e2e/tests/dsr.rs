//! Direct server return across the multi-node testbed (see `proxy_testbed::multinode`): a
//! NodePort in `dsr` mode on node A whose backend is on node B. The backend sees the
//! client's own address; its replies leave node B with node A's address and port,
//! straight to the client — watched on the LAN bridge, where node A's port carries
//! none of them; 100,000 connections through it with none failed; a connection goes on
//! while node A's agent is killed and started again; a client's full-size segments,
//! too big once the option is added, are answered "fragmentation needed" with the MTU
//! less the option, and its connection goes on at that size. The same over IPv6 (a
//! Destination Options header instead of the option): TCP and UDP, the wire watched,
//! an agent restart, 10,000 connections, "packet too big" with room for the header.
//! Root only.

use std::{thread, time::Duration};

use proxy_testbed::multinode::{CLIENT, CLIENT6, MultiNode, NODE_A, NODE_A6, NODE_B, POD_A, POD_B};
use test_support::needs_root;

const PORT: u16 = 30090;

fn manifests() -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: dsr, namespace: default, annotations: {{ebpf.proxy.k8s.io/lb-mode: dsr}}}}\nspec: {{type: NodePort, clusterIP: 10.96.1.9, ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: {PORT}}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: dsr-1, namespace: default, labels: {{kubernetes.io/service-name: dsr}}}}\naddressType: IPv4\nports: [{{name: http, protocol: TCP, port: 8080}}]\nendpoints:\n- {{addresses: [\"10.244.2.2\"], nodeName: node-b, conditions: {{ready: true}}}}\n"
    )
}

/// ClusterIP, node-IP NodePort, 127.0.0.1 NodePort.
const FRONTENDS: usize = 3;

const PORT6: u16 = 30091;

/// An IPv6 NodePort in `dsr` mode (TCP 8080 and UDP 5353 of pod B), on dual-stack agents.
fn manifests6() -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: dsr6, namespace: default, annotations: {{ebpf.proxy.k8s.io/lb-mode: dsr}}}}\nspec: {{type: NodePort, ipFamilies: [IPv6], clusterIP: \"fd00:96::9\", clusterIPs: [\"fd00:96::9\"], ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: {PORT6}}}, {{name: dns, protocol: UDP, port: 53, targetPort: 5353, nodePort: {PORT6}}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: dsr6-1, namespace: default, labels: {{kubernetes.io/service-name: dsr6}}}}\naddressType: IPv6\nports: [{{name: http, protocol: TCP, port: 8080}}, {{name: dns, protocol: UDP, port: 5353}}]\nendpoints:\n- {{addresses: [\"fd00:244:2::2\"], nodeName: node-b, conditions: {{ready: true}}}}\n"
    )
}

/// The ClusterIP and the node-IP NodePort, each TCP and UDP.
const FRONTENDS6: usize = 4;

/// What a test needs of one family's Service: how its testbed starts, the addresses
/// and port, what the client learns, and how much traffic it sends.
struct Family {
    manifests: fn() -> String,
    frontends: usize,
    /// The agents given the nodes' IPv6 addresses too.
    dual_stack: bool,
    /// `nft`'s name of the family ("ip", "ip6").
    nft: &'static str,
    node_a: &'static str,
    client: &'static str,
    port: u16,
    /// The Service serves UDP too: datagrams are sent beside the TCP connections.
    udp: bool,
    /// Asks on the connection kept open through node A's agent restart.
    session: usize,
    /// Connections of the churn.
    churn: u32,
    /// `IP_MTU` / `IPV6_MTU` for Python's `getsockopt`, and `ip`'s route cache flush.
    mtu_sockopt: &'static str,
    flush: &'static [&'static str],
    /// The MTU the client learns from node A: 1,500 less the option or header.
    learned_mtu: u32,
}

const V4: Family = Family {
    manifests,
    frontends: FRONTENDS,
    dual_stack: false,
    nft: "ip",
    node_a: NODE_A,
    client: CLIENT,
    port: PORT,
    udp: false,
    session: 60,
    churn: 100_000,
    mtu_sockopt: "socket.IPPROTO_IP, 14",
    flush: &["ip", "route", "flush", "cache"],
    learned_mtu: 1488,
};

const V6: Family = Family {
    manifests: manifests6,
    frontends: FRONTENDS6,
    dual_stack: true,
    nft: "ip6",
    node_a: NODE_A6,
    client: CLIENT6,
    port: PORT6,
    udp: true,
    session: 40,
    churn: 10_000,
    mtu_sockopt: "socket.IPPROTO_IPV6, 24",
    flush: &["ip", "-6", "route", "flush", "cache"],
    learned_mtu: 1460,
};

impl Family {
    /// The NodePort on node A, as the client dials it.
    fn target(&self) -> String {
        let ip: std::net::IpAddr = self.node_a.parse().expect("node A's address");
        std::net::SocketAddr::new(ip, self.port).to_string()
    }
}

/// The testbed with its agents for `family`'s Service; `xdp`: the XDP program on the
/// nodes' interfaces too (native, on veths readied for it), else the TC path alone. (The
/// LAN ports' own pass-through program, which `XDP_TX` into a veth needs, lives as long
/// as the guard.)
fn testbed(family: &Family, xdp: bool) -> (MultiNode, Option<aya::Ebpf>) {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&(family.manifests)())
        .expect("manifests");
    if family.dual_stack {
        tb.dual_stack();
    }
    if !xdp {
        tb.start_agents(family.frontends).expect("agents");
        return (tb, None);
    }
    tb.prepare_for_xdp().expect("veths ready for XDP");
    let lan = tb.pass_on_lan_ports().expect("xdp_pass on the LAN ports");
    tb.start_agents_with(family.frontends, &["--xdp", "native"])
        .expect("agents");
    (tb, Some(lan))
}

/// Counters on the LAN bridge of replies (from `family`'s port to the client) by the
/// bridge port they came in on: node A's, node B's (with node A's address).
fn watch_replies(tb: &MultiNode, family: &Family) {
    let Family {
        nft: ip,
        node_a,
        client,
        port,
        ..
    } = family;
    let rules = format!(
        "table bridge dsrwatch {{\n\
         counter from_a {{ }}\n\
         counter from_b {{ }}\n\
         chain watch {{\n\
         type filter hook forward priority 0;\n\
         iifname \"{a}\" {ip} daddr {client} th sport {port} counter name from_a\n\
         iifname \"{b}\" {ip} saddr {node_a} {ip} daddr {client} th sport {port} counter name from_b\n\
         }}\n}}\n",
        a = tb.lan_port("a"),
        b = tb.lan_port("b"),
    );
    let file = std::env::temp_dir().join(format!("dsrwatch-{}.nft", tb.id));
    std::fs::write(&file, rules).expect("rules file");
    let loaded = tb.lan_nft(&["-f", file.to_str().expect("utf-8")]);
    let _ = std::fs::remove_file(file);
    loaded.expect("nft bridge rules in the LAN namespace");
}

fn replies(tb: &MultiNode, from: &str) -> u64 {
    let out = tb
        .lan_nft(&["-j", "list", "counter", "bridge", "dsrwatch", from])
        .expect("counter");
    let v: serde_json::Value = serde_json::from_str(&out).expect("nft json");
    v["nftables"]
        .as_array()
        .and_then(|a| a.iter().find_map(|o| o["counter"]["packets"].as_u64()))
        .expect("packets")
}

#[needs_root]
#[test]
fn dsr_at_tc_keeps_the_client_address_and_replies_bypass_the_entry_node() {
    dsr_end_to_end(&V4, false);
}

#[needs_root]
#[test]
fn dsr_at_xdp_keeps_the_client_address_and_replies_bypass_the_entry_node() {
    dsr_end_to_end(&V4, true);
}

#[needs_root]
#[test]
fn dsr_over_ipv6_at_tc_keeps_the_client_address_and_replies_bypass_the_entry_node() {
    dsr_end_to_end(&V6, false);
}

#[needs_root]
#[test]
fn dsr_over_ipv6_at_xdp_keeps_the_client_address_and_replies_bypass_the_entry_node() {
    dsr_end_to_end(&V6, true);
}

/// 20 TCP connections (and over IPv6 10 UDP datagrams): the backend sees the client's
/// own address, UDP's answers come from the frontend, and every reply leaves node B as
/// node A (none through node A); a connection through node A's agent restart; the churn.
fn dsr_end_to_end(family: &Family, xdp: bool) {
    let (mut tb, _lan_xdp) = testbed(family, xdp);
    watch_replies(&tb, family);
    let sent_at_xdp = |tb: &MultiNode| tb.counter("node-a", "xdp_tx");
    let xdp_before = sent_at_xdp(&tb);
    let target = family.target();
    let logs = |tb: &MultiNode| format!("{}\n{}", tb.log("node-a"), tb.log("node-b"));
    let tcp = tb
        .client(&["--target", &target, "--count", "20"])
        .expect("client");
    assert!(tcp.iter().all(|a| a.ok), "{tcp:?}\n{}", logs(&tb));
    for at in &tcp {
        assert_eq!(at.backend.as_deref(), Some("pod-b"));
        assert_eq!(
            at.seen_as.as_deref(),
            Some(family.client),
            "the client's own address"
        );
    }
    let mut asked = 20;
    if family.udp {
        let udp = tb
            .client(&["--target", &target, "--proto", "udp", "--count", "10"])
            .expect("client");
        assert!(udp.iter().all(|a| a.ok), "{udp:?}\n{}", logs(&tb));
        for at in &udp {
            assert_eq!(at.backend.as_deref(), Some("pod-b"));
            assert_eq!(
                at.seen_as.as_deref(),
                Some(family.client),
                "the client's own address"
            );
            assert_eq!(
                at.peer.as_deref(),
                Some(target.as_str()),
                "answered as the frontend"
            );
        }
        asked += 10;
    }
    let (from_a, from_b) = (replies(&tb, "from_a"), replies(&tb, "from_b"));
    assert_eq!(from_a, 0, "no reply passed node A");
    assert!(
        from_b >= asked,
        "replies came from node B as node A: {from_b}"
    );
    assert!(tb.counter("node-a", "dsr_sent") >= asked);
    if xdp {
        assert!(
            sent_at_xdp(&tb) - xdp_before >= asked,
            "node A sent them at XDP, back out of the LAN port"
        );
    }
    assert_eq!(
        tb.counter("node-a", "ct_reply_nat"),
        0,
        "node A translated no reply"
    );
    assert!(tb.counter("node-b", "dsr_received") >= asked);
    assert!(tb.counter("node-b", "ct_reply_nat") >= asked);
    // Pod B answers from behind a bridge: its replies come by their route (the bridge
    // port's master, `IF_MASTERS`), so every flow is answered, none left unverified.
    assert_eq!(tb.counter("node-b", "ct_reply_unverified"), 0);

    // A connection kept open, asking every 50 ms, while node A's agent is killed and
    // started again: not one answer missed.
    let session = tb
        .spawn_client(&[
            "--target",
            &target,
            "--reuse-socket",
            "--count",
            &family.session.to_string(),
            "--interval-ms",
            "50",
            "--timeout-ms",
            "1000",
        ])
        .expect("client");
    thread::sleep(Duration::from_millis(500));
    tb.restart_agent("node-a", family.frontends)
        .expect("restart");
    let answers = session.finish().expect("session");
    // A broken flow shows as a failed attempt (the client then reconnects).
    assert_eq!(answers.len(), family.session, "{answers:?}");
    assert!(
        answers.iter().all(|a| a.ok),
        "one connection throughout, no answer missed: {answers:?}\n{}",
        tb.log("node-a")
    );

    // The churn: connections each reset once up.
    let churn = tb
        .client(&[
            "--target",
            &target,
            "--proto",
            "tcp-churn",
            "--count",
            &family.churn.to_string(),
            "--timeout-ms",
            "5000",
        ])
        .expect("client");
    assert!(
        churn.len() == 1 && churn[0].ok && churn[0].seq == family.churn,
        "{churn:?}"
    );
    assert_eq!(replies(&tb, "from_a"), 0, "still none through node A");
}

#[needs_root]
#[test]
fn dsr_at_tc_answers_too_big_with_room_for_its_option() {
    too_big_with_room_for_the_option(&V4, false);
}

#[needs_root]
#[test]
fn dsr_at_xdp_leaves_too_big_to_tc_which_answers_with_room_for_its_option() {
    too_big_with_room_for_the_option(&V4, true);
}

#[needs_root]
#[test]
fn dsr_over_ipv6_answers_too_big_with_room_for_its_header() {
    too_big_with_room_for_the_option(&V6, false);
}

/// Every link is 1,500 bytes. With segmentation offload the client's segments travel
/// as one GSO packet, and node A makes room for the option (IPv6: header) by shrinking
/// its segments: the upload completes at the client's MTU. Without offload the client's
/// full-size segments (don't-fragment; every IPv6 packet) fit the LAN as sent, but not
/// with the 12-byte option (40-byte header): node A answers "fragmentation needed"
/// ("packet too big") with 1,488 (1,460) (at TC; XDP leaves them to TC unchanged, where
/// GRO would merge them again unless it is off), the client learns it, and the 200 kB it
/// sends reach the backend.
fn too_big_with_room_for_the_option(family: &Family, xdp: bool) {
    let (tb, _lan_xdp) = testbed(family, xdp);
    let (node_a, port, sockopt) = (family.node_a, family.port, family.mtu_sockopt);
    let upload = format!(
        r#"
import socket
s = socket.create_connection(("{node_a}", {port}), timeout=10)
f = s.makefile("rb")
first = f.readline()
s.sendall(b"x" * 200000 + b"\n")
second = f.readline()
print(first.split()[0].decode(), second.split()[0].decode(), s.getsockopt({sockopt}))
"#
    );
    let learned = format!("pod-b pod-b {}", family.learned_mtu);
    let offloaded = tb.client_python(&upload).expect("the client's upload");
    // Node A's port sees the client's segments merged by GRO (at XDP: as frames, which
    // XDP leaves to TC, too big with the option, and GRO merges again before TC): most
    // of them. A segment GRO leaves alone (a flush between two: XDP, or a busy machine
    // at TC — seen once each) is a full-size DF frame that does not fit with the
    // option, answered with 1,488 (1,460), rightly. So either MTU is right, and what
    // counts is that the upload completes.
    let ok: &[&str] = &["pod-b pod-b 1500", &learned];
    assert!(
        ok.contains(&offloaded.trim()),
        "with offload: greeted before and after the upload, at the client's MTU: {}\n{}",
        offloaded.trim(),
        tb.log("node-a")
    );
    tb.in_client(&["ethtool", "-K", "eth0", "tso", "off", "gso", "off"])
        .expect("offload off");
    tb.in_client(family.flush).expect("flush");
    if xdp {
        // What XDP passes on would be merged again by GRO into one packet, whose
        // segments TC shrinks: this checks TC's answer to single frames.
        let port = format!("la{}", tb.id);
        tb.in_node("node-a", &["ethtool", "-K", &port, "gro", "off"])
            .expect("GRO off on node A's LAN port");
    }
    let too_big_before = tb.counter("node-a", "too_big_sent");
    let to_tc_before = tb.counter("node-a", "xdp_to_tc");
    let got = tb.client_python(&upload).expect("the client's upload");
    assert_eq!(
        got.trim(),
        learned,
        "without offload: greeted before and after the upload, the MTU learned\n{}",
        tb.log("node-a")
    );
    assert!(
        tb.counter("node-a", "too_big_sent") > too_big_before,
        "node A's answer"
    );
    assert!(tb.counter("node-a", "dsr_sent") > 0, "through DSR");
    if xdp {
        assert!(
            tb.counter("node-a", "xdp_to_tc") > to_tc_before,
            "XDP left it to TC"
        );
    }
}

const HIJACK_PORT: u16 = 30092;

/// Python that builds `ip` and `tcp`: an IPv4 SYN from `src:sport` to `dst:8080` whose
/// IP header carries DSR's option naming `frontend` through entry node `entry`, its
/// header checksum right; the TCP checksum right only when `tcp_ok` (else 0xdead).
fn forged_syn(
    src: &str,
    sport: u16,
    dst: &str,
    (frontend, port): (&str, u16),
    entry: &str,
    tcp_ok: bool,
) -> String {
    let tcp_ok = if tcp_ok { "True" } else { "False" };
    format!(
        r#"
import socket, struct
def csum(b):
    if len(b) % 2: b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16: s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff
src, dst = socket.inet_aton("{src}"), socket.inet_aton("{dst}")
opt = bytes([0x9a, 12]) + struct.pack("!H", {port}) + socket.inet_aton("{frontend}") + socket.inet_aton("{entry}")
tcp = struct.pack("!HHIIBBHHH", {sport}, 8080, 1000, 0, 5 << 4, 0x02, 65535, 0 if {tcp_ok} else 0xdead, 0)
if {tcp_ok}:
    tcp = tcp[:16] + struct.pack("!H", csum(src + dst + struct.pack("!BBH", 0, 6, len(tcp)) + tcp)) + tcp[18:]
ip = struct.pack("!BBHHHBBH4s4s", 0x48, 0, 32 + len(tcp), 1, 0, 64, 6, 0, src, dst) + opt
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]"#
    )
}

/// A NodePort in the default mode (masquerade, no DSR anywhere) whose backend is pod B.
fn hijack_manifests() -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: plain, namespace: default}}\nspec: {{type: NodePort, clusterIP: 10.96.1.10, ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: {HIJACK_PORT}}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: plain-1, namespace: default, labels: {{kubernetes.io/service-name: plain}}}}\naddressType: IPv4\nports: [{{name: http, protocol: TCP, port: 8080}}]\nendpoints:\n- {{addresses: [\"10.244.2.2\"], nodeName: node-b, conditions: {{ready: true}}}}\n"
    )
}

/// Issue 42, item 2: pod A (on node A, with the `CAP_NET_RAW` containers have) puts ONE
/// frame on its veth "from" the outside client's port 45678 to itself, with DSR's
/// option naming node A's NodePort through entry node B, and a bad TCP checksum. Node A
/// must learn nothing from it (refused as a spoofed source, and dropped), and the
/// client's own connection from that port to the NodePort must still reach the
/// Service's backend, pod B — on main before the fix it reached pod A, whose answers
/// left as the NodePort.
#[needs_root]
#[test]
fn a_pod_cannot_hijack_a_client_with_a_forged_dsr_option() {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&hijack_manifests()).expect("manifests");
    tb.start_agents(FRONTENDS).expect("agents");
    let gateway = tb.pod_gateway_mac("node-a").expect("gateway MAC");
    let forge = format!(
        r#"{syn}
eth = bytes.fromhex("{gw}") + bytes(6) + b"\x08\x00"
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
s.send(eth + ip + tcp)
print("sent")
"#,
        syn = forged_syn(CLIENT, 45678, POD_A, (NODE_A, HIJACK_PORT), NODE_B, false),
        gw = gateway.replace(':', ""),
    );
    assert_eq!(
        tb.pod_python("a", &forge).expect("forged frame").trim(),
        "sent"
    );
    let refused = (0..50)
        .map(|_| {
            thread::sleep(Duration::from_millis(100));
            tb.counter("node-a", "dsr_refused_source")
        })
        .find(|&n| n > 0)
        .unwrap_or(0);
    assert_eq!(refused, 1, "the forged option refused as a spoofed source");
    assert_eq!(tb.counter("node-a", "dsr_received"), 0, "nothing learnt");
    let connect = format!(
        r#"
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{CLIENT}", 45678))
s.settimeout(5)
s.connect(("{NODE_A}", {HIJACK_PORT}))
print(s.makefile().readline().split()[0])
"#
    );
    let answered_by = tb.client_python(&connect).expect("the client's connection");
    assert_eq!(
        answered_by.trim(),
        "pod-b",
        "the client reaches the Service's backend, not the forger\n{}",
        tb.log("node-a")
    );
}

/// Issue 42, item 1: a backend's node believes the option only from another node of the
/// cluster. The outside client, on the nodes' own network, sends node B ONE frame "from"
/// itself to pod B with a well-formed option naming node A's DSR NodePort through entry
/// node A — everything right but the sender: the frame comes from the client's MAC, not
/// from node A's. Node B must refuse it (`dsr_refused_node`) and learn nothing; before
/// the fix it learnt the flow.
#[needs_root]
#[test]
fn a_client_cannot_pose_as_an_entry_node() {
    let mut tb = MultiNode::new().expect("testbed");
    tb.write_manifests(&manifests()).expect("manifests");
    tb.start_agents(FRONTENDS).expect("agents");
    let node_b_mac = tb.uplink_mac("node-b").expect("node B's MAC");
    let forge = format!(
        r#"{syn}
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
eth = bytes.fromhex("{mac}") + s.getsockname()[4] + b"\x08\x00"
s.send(eth + ip + tcp)
print("sent")
"#,
        syn = forged_syn(CLIENT, 45679, POD_B, (NODE_A, PORT), NODE_A, true),
        mac = node_b_mac.replace(':', ""),
    );
    assert_eq!(
        tb.client_python(&forge).expect("forged frame").trim(),
        "sent"
    );
    let refused = (0..50)
        .map(|_| {
            thread::sleep(Duration::from_millis(100));
            tb.counter("node-b", "dsr_refused_node")
        })
        .find(|&n| n > 0)
        .unwrap_or(0);
    assert_eq!(
        refused,
        1,
        "the option refused: not from node A\n{}",
        tb.log("node-b")
    );
    assert_eq!(tb.counter("node-b", "dsr_received"), 0, "nothing learnt");
    // Node A's own DSR still works: the client's connection through it is answered by
    // pod B straight from node B (the flow node B learnt from node A's option).
    let attempts = tb
        .client(&["--target", &format!("{NODE_A}:{PORT}"), "--count", "3"])
        .expect("client");
    assert!(
        attempts.iter().all(|a| a.ok),
        "connections through node A: {attempts:?}\n{}",
        tb.log("node-b")
    );
    assert!(
        tb.counter("node-b", "dsr_received") >= 3,
        "learnt from node A"
    );
}
