//! ICMP errors about translated flows through the real programs (`BPF_PROG_TEST_RUN`),
//! as netfilter's RELATED handling translates them: errors from a backend or a router
//! about a packet the client sent, from the client's side about a reply, and — through
//! the egress program — errors and replies the node itself sends for an endpoint on its
//! own address. Every output is compared byte for byte with an error built from scratch
//! around the packet the other side knows (so every checksum — outer IPv4 header, ICMP /
//! ICMPv6 with its pseudo-header, the quote's IPv4 header and L4 checksum — is checked).
//! Root only.

mod support;

use std::net::{IpAddr, SocketAddr};

use proxy_agent::{
    model::{FrontendKind, NodeView, Protocol},
    trace::packet::{build, fold, sum16},
};
use support::tc_harness::*;
use test_support::needs_root;

/// The IP packet `src` -> `dst` (TCP or UDP, valid checksums) as an error quotes it: its
/// first `len` bytes (`None`: all of it).
fn quote(src: SocketAddr, dst: SocketAddr, tcp: bool, len: Option<usize>) -> Vec<u8> {
    let proto = if tcp { Protocol::Tcp } else { Protocol::Udp };
    let ip = build(src, dst, proto)[14..].to_vec();
    ip[..len.unwrap_or(ip.len())].to_vec()
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

/// One error case: the error as it arrives and as it must leave.
struct Case {
    /// The error's source (a backend, a router, a client) and destination.
    from: &'static str,
    to: &'static str,
    kind: u8,
    code: u8,
    info: u32,
    /// The quoted packet as it was sent on its side of the node.
    quoted: (SocketAddr, SocketAddr),
    /// After translation.
    want_from: &'static str,
    want_to: &'static str,
    want_quoted: (SocketAddr, SocketAddr),
    tcp: bool,
    /// Quote only this many bytes of the packet (`None`: all).
    cut: Option<usize>,
}

fn check(h: &mut Harness, c: &Case, egress: bool) {
    let arriving = icmp_error(
        ip(c.from),
        ip(c.to),
        c.kind,
        c.code,
        c.info,
        &quote(c.quoted.0, c.quoted.1, c.tcp, c.cut),
    );
    let want = icmp_error(
        ip(c.want_from),
        ip(c.want_to),
        c.kind,
        c.code,
        c.info,
        &quote(c.want_quoted.0, c.want_quoted.1, c.tcp, c.cut),
    );
    let before = h.counter("icmp_error_nat");
    let (verdict, out) = if egress {
        h.run_egress(&arriving)
    } else {
        h.run(&arriving)
    };
    assert_eq!(
        verdict, TC_ACT_OK,
        "type {} from {}: translated and passed on",
        c.kind, c.from
    );
    assert_eq!(
        out, want,
        "type {} code {} from {} about {:?}: every byte",
        c.kind, c.code, c.from, c.quoted
    );
    assert_eq!(h.counter("icmp_error_nat"), before + 1);
}

/// Runs `pkt` (ingress) and returns the source it left with (the masquerade address
/// and port, or the client's own).
fn open(h: &Harness, src: SocketAddr, dst: SocketAddr, tcp: bool) -> SocketAddr {
    let (verdict, out) = h.run(&packet(src, dst, tcp));
    assert_eq!(verdict, TC_ACT_OK, "flow {src} -> {dst} opened");
    inspect(&out).src
}

#[needs_root]
#[test]
fn errors_about_client_packets_reach_the_client_v4() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let (np, mut np_state) = frontend("192.0.2.10", 30080, Protocol::Tcp, &["10.244.2.9:8080"]);
    np_state.kind = FrontendKind::NodePort;
    h.apply(&NodeView::from([
        frontend("10.96.0.53", 53, Protocol::Udp, &["10.244.1.5:5353"]),
        (np, np_state),
    ]));
    // A pod's UDP flow to a ClusterIP, not masqueraded.
    let (client, vip, be) = (
        sa("10.244.0.3:40000"),
        sa("10.96.0.53:53"),
        sa("10.244.1.5:5353"),
    );
    assert_eq!(open(&h, client, vip, false), client);
    // The backend's port unreachable: from the frontend, about the frontend.
    check(
        &mut h,
        &Case {
            from: "10.244.1.5",
            to: "10.244.0.3",
            kind: 3,
            code: 3,
            info: 0,
            quoted: (client, be),
            want_from: "10.96.0.53",
            want_to: "10.244.0.3",
            want_quoted: (client, vip),
            tcp: false,
            cut: None,
        },
        false,
    );
    // A router's time exceeded keeps the router's address.
    check(
        &mut h,
        &Case {
            from: "10.244.9.1",
            to: "10.244.0.3",
            kind: 11,
            code: 0,
            info: 0,
            quoted: (client, be),
            want_from: "10.244.9.1",
            want_to: "10.244.0.3",
            want_quoted: (client, vip),
            tcp: false,
            cut: Some(28),
        },
        false,
    );
    // An outside client's TCP flow to a NodePort, masqueraded: a router between node and
    // backend says "fragmentation needed" (MTU 1400) to the node, about the masqueraded
    // packet; the client gets it about its own packet to the NodePort.
    let (outside, nodeport, be) = (
        sa("198.51.100.7:40000"),
        sa("192.0.2.10:30080"),
        sa("10.244.2.9:8080"),
    );
    let masq = open(&h, outside, nodeport, true);
    assert_eq!(masq.ip(), ip("192.0.2.10"), "masqueraded");
    for cut in [None, Some(28)] {
        check(
            &mut h,
            &Case {
                from: "10.244.2.1",
                to: "192.0.2.10",
                kind: 3,
                code: 4,
                info: 1400,
                quoted: (masq, be),
                want_from: "10.244.2.1",
                want_to: "198.51.100.7",
                want_quoted: (outside, nodeport),
                tcp: true,
                cut, // whole (TCP checksum updated) and cut to 8 bytes (none quoted)
            },
            false,
        );
    }
    // The backend itself answers with a port unreachable: from the NodePort.
    check(
        &mut h,
        &Case {
            from: "10.244.2.9",
            to: "192.0.2.10",
            kind: 3,
            code: 3,
            info: 0,
            quoted: (masq, be),
            want_from: "192.0.2.10",
            want_to: "198.51.100.7",
            want_quoted: (outside, nodeport),
            tcp: true,
            cut: None,
        },
        false,
    );
    // Errors about nothing we translated pass untouched.
    let stray = icmp_error(
        ip("10.244.1.5"),
        ip("10.244.0.3"),
        3,
        3,
        0,
        &quote(sa("10.244.0.3:40001"), be, false, None),
    );
    assert_eq!(h.run(&stray), (TC_ACT_UNSPEC, stray.clone()));
}

#[needs_root]
#[test]
fn errors_about_client_packets_reach_the_client_v6() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    h.apply(&NodeView::from([frontend(
        "fd96::53",
        53,
        Protocol::Udp,
        &["[fd00:244:1::5]:5353"],
    )]));
    let (client, vip, be) = (
        sa("[fd00:244::3]:40000"),
        sa("[fd96::53]:53"),
        sa("[fd00:244:1::5]:5353"),
    );
    assert_eq!(open(&h, client, vip, false), client);
    // ICMPv6 port unreachable (type 1 code 4) from the backend.
    check(
        &mut h,
        &Case {
            from: "fd00:244:1::5",
            to: "fd00:244::3",
            kind: 1,
            code: 4,
            info: 0,
            quoted: (client, be),
            want_from: "fd96::53",
            want_to: "fd00:244::3",
            want_quoted: (client, vip),
            tcp: false,
            cut: None,
        },
        false,
    );
    // Masqueraded (masqueradeAll) TCP: "packet too big" (type 2, MTU 1280) from a router.
    let mut h = Harness::new(&[]);
    configure_node(&mut h, true);
    h.apply(&NodeView::from([frontend(
        "fd96::10",
        80,
        Protocol::Tcp,
        &["[fd00:244:1::5]:8080"],
    )]));
    let (vip, be) = (sa("[fd96::10]:80"), sa("[fd00:244:1::5]:8080"));
    let masq = open(&h, client, vip, true);
    assert_eq!(masq.ip(), ip("2001:db8:a::10"), "masqueraded");
    for cut in [None, Some(48)] {
        check(
            &mut h,
            &Case {
                from: "fd00:244:1::1",
                to: "2001:db8:a::10",
                kind: 2,
                code: 0,
                info: 1280,
                quoted: (masq, be),
                want_from: "fd00:244:1::1",
                want_to: "fd00:244::3",
                want_quoted: (client, vip),
                tcp: true,
                cut,
            },
            false,
        );
    }
    // Time exceeded (type 3) from the backend itself: from the frontend.
    check(
        &mut h,
        &Case {
            from: "fd00:244:1::5",
            to: "2001:db8:a::10",
            kind: 3,
            code: 0,
            info: 0,
            quoted: (masq, be),
            want_from: "fd96::10",
            want_to: "fd00:244::3",
            want_quoted: (client, vip),
            tcp: true,
            cut: None,
        },
        false,
    );
}

/// The other direction: the client's side reports an error about a reply (the client
/// itself: port unreachable for a UDP reply after it closed its socket; a router; the
/// node's own forwarding, at egress). The backend gets it about the reply it sent, from
/// the address it sent to.
#[needs_root]
#[test]
fn errors_about_replies_reach_the_backend() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let (np, mut st) = frontend("192.0.2.10", 30053, Protocol::Udp, &["10.244.2.9:5353"]);
    st.kind = FrontendKind::NodePort;
    h.apply(&NodeView::from([(np, st)]));
    let (outside, nodeport, be) = (
        sa("198.51.100.7:40000"),
        sa("192.0.2.10:30053"),
        sa("10.244.2.9:5353"),
    );
    let masq = open(&h, outside, nodeport, false);
    check(
        &mut h,
        &Case {
            from: "198.51.100.7",
            to: "192.0.2.10",
            kind: 3,
            code: 3,
            info: 0,
            quoted: (nodeport, outside),
            want_from: "192.0.2.10",
            want_to: "10.244.2.9",
            want_quoted: (be, masq),
            tcp: false,
            cut: None,
        },
        false,
    );
    // IPv6, not masqueraded: a router on the client's side about a too big reply.
    h.apply(&NodeView::from([frontend(
        "fd96::10",
        80,
        Protocol::Tcp,
        &["[fd00:244:1::5]:8080"],
    )]));
    let (client, vip, be) = (
        sa("[fd00:244::3]:40000"),
        sa("[fd96::10]:80"),
        sa("[fd00:244:1::5]:8080"),
    );
    assert_eq!(open(&h, client, vip, true), client);
    // The node's own forwarding found the client's link too small for the reply: its
    // error goes to the reply's source, the ClusterIP, and leaves through the egress
    // program, which sends it to the backend instead.
    check(
        &mut h,
        &Case {
            from: "2001:db8:a::10",
            to: "fd96::10",
            kind: 2,
            code: 0,
            info: 1280,
            quoted: (vip, client),
            want_from: "2001:db8:a::10",
            want_to: "fd00:244:1::5",
            want_quoted: (be, client),
            tcp: true,
            cut: None,
        },
        true,
    );
    check(
        &mut h,
        &Case {
            from: "fd00:244::1",
            to: "fd96::10",
            kind: 2,
            code: 0,
            info: 1400,
            quoted: (vip, client),
            want_from: "fd00:244::1",
            want_to: "fd00:244:1::5",
            want_quoted: (be, client),
            tcp: true,
            cut: None,
        },
        false,
    );
}

/// An endpoint on the node's own address (a hostNetwork pod): flows to it are never
/// masqueraded (delivered locally, as kube-proxy's POSTROUTING masquerade never sees
/// them), and what the node sends back — replies, and its own ICMP errors — leaves
/// through the egress program with the frontend's address.
#[needs_root]
#[test]
fn an_endpoint_on_the_node_address_answers_from_the_frontend() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, true); // masqueradeAll: still not masqueraded
    let (np, mut st) = frontend("192.0.2.10", 30080, Protocol::Tcp, &["192.0.2.10:8080"]);
    st.kind = FrontendKind::NodePort;
    h.apply(&NodeView::from([
        frontend("10.96.0.10", 80, Protocol::Tcp, &["192.0.2.10:8080"]),
        frontend("10.96.0.53", 53, Protocol::Udp, &["192.0.2.10:5353"]),
        (np, st),
    ]));
    let (pod, vip, host) = (
        sa("10.244.0.3:40000"),
        sa("10.96.0.10:80"),
        sa("192.0.2.10:8080"),
    );
    let (verdict, out) = h.run(&packet(pod, vip, true));
    assert_eq!(verdict, TC_ACT_OK, "delivered by the stack");
    let seen = inspect(&out);
    assert_eq!(
        (seen.src, seen.dst),
        (pod, host),
        "DNAT only, no masquerade"
    );
    // The SYN-ACK from the node's stack, on its way out.
    let (verdict, out) = h.run_egress(&tcp_with_flags(host, pod, 0x12));
    assert_eq!(verdict, TC_ACT_OK);
    let seen = inspect(&out);
    assert_eq!((seen.src, seen.dst), (vip, pod), "from the ClusterIP");
    assert_eq!(h.counter("ct_reply_nat"), 1);
    assert!(
        h.ct_entries()
            .iter()
            .all(|(_, v)| v.flags & proxy_common::CT_F_SNAT == 0),
        "not masqueraded"
    );
    // From outside, through the NodePort.
    let outside = sa("198.51.100.7:40000");
    let nodeport = sa("192.0.2.10:30080");
    assert_eq!(open(&h, outside, nodeport, true), outside, "client kept");
    let (_, out) = h.run_egress(&tcp_with_flags(host, outside, 0x12));
    let seen = inspect(&out);
    assert_eq!(
        (seen.src, seen.dst),
        (nodeport, outside),
        "from the NodePort"
    );
    // Nothing to listen on the UDP port: the node's own port unreachable leaves from the
    // ClusterIP, about the ClusterIP.
    let (dns, host_dns) = (sa("10.96.0.53:53"), sa("192.0.2.10:5353"));
    assert_eq!(open(&h, pod, dns, false), pod);
    check(
        &mut h,
        &Case {
            from: "192.0.2.10",
            to: "10.244.0.3",
            kind: 3,
            code: 3,
            info: 0,
            quoted: (pod, host_dns),
            want_from: "10.96.0.53",
            want_to: "10.244.0.3",
            want_quoted: (pod, dns),
            tcp: false,
            cut: None,
        },
        true,
    );
    // Packets the node sends that belong to no flow pass untouched.
    let other = packet(host, sa("10.244.0.3:40001"), true);
    assert_eq!(h.run_egress(&other), (TC_ACT_UNSPEC, other.clone()));
    // Forwarded packets (an input interface) are not looked at, even a flow's reply.
    let forwarded = tcp_with_flags(host, pod, 0x10);
    assert_eq!(
        h.run_egress_from(&forwarded, 1),
        (TC_ACT_UNSPEC, forwarded.clone())
    );
    assert_eq!(
        h.run_egress(&forwarded).0,
        TC_ACT_OK,
        "made here: translated"
    );
}

/// The node's own "fragmentation needed" about a forwarded (DNATed, not masqueraded)
/// packet — its forwarding found the backend's link too small — leaves through the
/// egress program quoting the packet the client sent, so the client's PMTU discovery
/// works.
#[needs_root]
#[test]
fn the_nodes_own_fragmentation_needed_quotes_the_frontend() {
    let mut h = one_service("10.96.0.10", 80, "10.244.1.5:8080");
    let (client, vip, be) = (
        sa("10.244.0.3:40000"),
        sa("10.96.0.10:80"),
        sa("10.244.1.5:8080"),
    );
    assert_eq!(open(&h, client, vip, true), client);
    check(
        &mut h,
        &Case {
            from: "192.0.2.10",
            to: "10.244.0.3",
            kind: 3,
            code: 4,
            info: 1280,
            quoted: (client, be),
            want_from: "192.0.2.10",
            want_to: "10.244.0.3",
            want_quoted: (client, vip),
            tcp: true,
            cut: None,
        },
        true,
    );
}

/// A harness serving one TCP frontend from one backend, the node configured.
fn one_service(vip: &str, port: u16, backend: &str) -> Harness {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    h.apply(&NodeView::from([frontend(
        vip,
        port,
        Protocol::Tcp,
        &[backend],
    )]));
    h
}

/// Found by `fuzz_packets.rs`: an error whose IP length ends at its ICMP header, followed
/// by padding that looks like a quote, had the padding translated and the ICMP checksum
/// adjusted for it — so the error's own (8-byte) message no longer checked. Only a quote
/// inside the error's IP packet is read; this one passes untouched.
#[needs_root]
#[test]
fn a_quote_past_the_errors_ip_length_is_not_read() {
    let h = one_service("10.96.0.10", 80, "10.244.1.5:8080");
    let (client, vip, be) = (
        sa("10.244.0.3:1024"),
        sa("10.96.0.10:80"),
        sa("10.244.1.5:8080"),
    );
    assert_eq!(open(&h, client, vip, true), client);
    // The fuzzer's minimized input: a router's port unreachable whose IP length (28)
    // holds the ICMP header alone, with a checksum right for those 8 bytes.
    let mut err = icmp_error(
        ip("192.0.2.1"),
        ip("10.244.0.3"),
        3,
        3,
        0,
        &quote(client, be, true, None),
    );
    err[16..18].copy_from_slice(&28u16.to_be_bytes());
    err[24..26].fill(0);
    let c = fold(sum16(&err[14..34], 0));
    err[24..26].copy_from_slice(&c.to_be_bytes());
    err[36..38].fill(0);
    let c = fold(sum16(&err[34..42], 0));
    err[36..38].copy_from_slice(&c.to_be_bytes());
    let (verdict, out) = h.run(&err);
    assert_eq!(verdict, TC_ACT_UNSPEC, "not an error about a flow");
    assert_eq!(out, err, "bytes untouched");
}

/// Both classifiers load, and the verifier's walk of each stays well inside its budget
/// (1,000,000 instructions): ICMP translation added paths to both.
#[needs_root]
#[test]
fn the_classifiers_stay_inside_the_verifier_budget() {
    let mut h = Harness::new(&[]);
    h.run_egress(&packet(sa("10.0.0.1:1"), sa("10.0.0.2:2"), true));
    for name in ["tc_ingress", "tc_egress"] {
        let prog: &aya::programs::SchedClassifier = h
            .ebpf
            .program(name)
            .expect("program")
            .try_into()
            .expect("type");
        let walked = prog
            .info()
            .expect("info")
            .verified_instruction_count()
            .expect("kernel reports it");
        eprintln!("{name}: the verifier walked {walked} instructions");
        assert!(walked < 800_000, "{name}: {walked} of 1,000,000");
    }
}
