//! The real XDP program (`xdp_ingress`) on crafted packets (`BPF_PROG_TEST_RUN`), with
//! maps written by the agent's own sync code, in a network namespace of the test's own
//! whose FIB and neighbour table the program consults: every branch — translate and
//! `XDP_TX` (a backend behind the interface the packet came in on), translate and
//! `XDP_REDIRECT` (a backend behind another interface), `XDP_PASS` unchanged to TC
//! (fragments, IPv6 extension headers, ICMP errors, no neighbour entry, the node's own
//! traffic, a refusal), `XDP_DROP` (source ranges, a mid-stream segment of no flow) —
//! with bytes and checksums checked, and the flow XDP opened carried on by TC. Root only.

mod support;

use std::{net::SocketAddr, process::Command};

use proxy_agent::{
    model::{FrontendKind, NodeView, Protocol},
    trace::packet::{fold, sum16},
};
use support::{tc_harness::*, testbed::*};
use test_support::needs_root;

/// The interface's MAC, as `ip` reports it in this thread's namespace (sysfs shows the
/// namespace it was mounted in).
fn mac_of(name: &str) -> [u8; 6] {
    let out = Command::new("ip")
        .args(["-o", "link", "show", "dev", name])
        .output()
        .expect("ip");
    let text = String::from_utf8_lossy(&out.stdout);
    let mac = text
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .expect("link/ether");
    let mut out = [0u8; 6];
    for (o, part) in out.iter_mut().zip(mac.split(':')) {
        *o = u8::from_str_radix(part, 16).expect("hex");
    }
    out
}

/// A harness with the node configured and NodePort 30080 (TCP and UDP, both families)
/// to `backends`.
fn node_port(backends_v4: &[&str], backends_v6: &[&str]) -> Harness {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let mut view = NodeView::new();
    for (ip, backends) in [("192.0.2.10", backends_v4), ("2001:db8:a::10", backends_v6)] {
        for proto in [Protocol::Tcp, Protocol::Udp] {
            let (f, mut st) = frontend(ip, 30080, proto, backends);
            st.kind = FrontendKind::NodePort;
            view.insert(f, st);
        }
    }
    h.apply(&view);
    h
}

fn ttl(pkt: &[u8]) -> u8 {
    if pkt[12..14] == [0x08, 0x00] {
        pkt[22]
    } else {
        pkt[21]
    }
}

/// The frame XDP sent: next hop's MAC, our interface's MAC, one hop less, the translated
/// addresses (checksums verified by `inspect`).
fn assert_sent(out: &[u8], sent: &[u8], dmac: [u8; 6], via: &str, dst: SocketAddr) {
    assert_eq!(out[0..6], dmac, "the next hop's MAC");
    assert_eq!(out[6..12], mac_of(via), "the egress interface's MAC");
    assert_eq!(ttl(out), ttl(sent) - 1, "one hop less to live");
    let seen = inspect(out);
    assert_eq!(seen.dst, dst, "destination is the backend");
    let node = if dst.is_ipv4() {
        "192.0.2.10"
    } else {
        "2001:db8:a::10"
    };
    assert_eq!(
        seen.src.ip(),
        node.parse::<std::net::IpAddr>().expect("ip"),
        "masqueraded to the node (externalTrafficPolicy: Cluster)"
    );
}

#[needs_root]
#[test]
fn remote_backend_translated_and_sent_back_out_with_xdp_tx() {
    in_testbed(|uplink, _| {
        let mut h = node_port(&["10.244.2.7:8080"], &["[fd00:244:2::7]:8080"]);
        for (client, frontend, backend) in [
            ("192.0.2.99:40000", "192.0.2.10:30080", "10.244.2.7:8080"),
            (
                "[2001:db8:a::99]:40000",
                "[2001:db8:a::10]:30080",
                "[fd00:244:2::7]:8080",
            ),
        ] {
            for tcp in [true, false] {
                let pkt = packet(sa(client), sa(frontend), tcp);
                let (verdict, out) = h.run_xdp(&pkt, uplink);
                assert_eq!(verdict, XDP_TX, "{client} -> {frontend} tcp={tcp}");
                assert_sent(&out, &pkt, OTHER_NODE_MAC, UPLINK, sa(backend));
            }
        }
        assert_eq!(h.counter("xdp_tx"), 4);
        assert_eq!(h.ct_entries().len(), 8, "two entries per flow, as at TC");
    });
}

#[needs_root]
#[test]
fn local_backend_translated_and_redirected_to_its_interface() {
    in_testbed(|uplink, _| {
        let mut h = node_port(&["10.244.1.5:8080"], &["[fd00:244:1::5]:8080"]);
        for (client, frontend, backend) in [
            ("192.0.2.99:40000", "192.0.2.10:30080", "10.244.1.5:8080"),
            (
                "[2001:db8:a::99]:40000",
                "[2001:db8:a::10]:30080",
                "[fd00:244:1::5]:8080",
            ),
        ] {
            for tcp in [true, false] {
                let pkt = packet(sa(client), sa(frontend), tcp);
                let (verdict, out) = h.run_xdp(&pkt, uplink);
                assert_eq!(verdict, XDP_REDIRECT, "{client} -> {frontend} tcp={tcp}");
                assert_sent(&out, &pkt, POD_MAC, PODS, sa(backend));
            }
        }
        assert_eq!(h.counter("xdp_redirect"), 4);
    });
}

/// The flow XDP opened is the one TC knows: the backend's reply is translated back at TC
/// (the pod side), and the client's next segment goes on at XDP with the same backend and
/// masquerade port.
#[needs_root]
#[test]
fn flow_opened_at_xdp_is_reverse_translated_by_tc_and_continues_at_xdp() {
    in_testbed(|uplink, _| {
        let mut h = node_port(&["10.244.2.7:8080"], &[]);
        let (client, frontend) = (sa("192.0.2.99:40000"), sa("192.0.2.10:30080"));
        let syn = tcp_with_flags(client, frontend, 0x02);
        let (verdict, out) = h.run_xdp(&syn, uplink);
        assert_eq!(verdict, XDP_TX);
        let masq = inspect(&out).src;

        let syn_ack = tcp_with_flags(sa("10.244.2.7:8080"), masq, 0x12);
        let (verdict, out) = h.run(&syn_ack);
        assert!(
            verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
            "TC translates the reply: {verdict}"
        );
        let seen = inspect(&out);
        assert_eq!(seen.src, frontend, "reply from the frontend");
        assert_eq!(seen.dst, client, "back to the client");

        let ack = tcp_with_flags(client, frontend, 0x10);
        let (verdict, out) = h.run_xdp(&ack, uplink);
        assert_eq!(verdict, XDP_TX, "the established flow stays at XDP");
        let seen = inspect(&out);
        assert_eq!((seen.src, seen.dst), (masq, sa("10.244.2.7:8080")));
        assert_eq!(h.ct_entries().len(), 2, "one flow, one pair of entries");
        assert_eq!(h.counter("ct_reply_nat"), 1);
    });
}

/// What XDP cannot finish reaches TC exactly as it arrived, with nothing recorded.
#[needs_root]
#[test]
fn what_xdp_cannot_finish_passes_to_tc_unchanged() {
    in_testbed(|uplink, _| {
        // 10.244.1.6 has no neighbour entry: the FIB cannot give its MAC.
        let mut h = node_port(&["10.244.1.6:8080"], &["[fd00:244:1::6]:8080"]);
        let client = sa("192.0.2.99:40000");
        let np = sa("192.0.2.10:30080");

        let mut fragment = packet(client, np, false);
        fragment[20] |= 0x20; // more fragments
        refresh_ipv4_checksum(&mut fragment);

        let mut ext = packet(
            sa("[2001:db8:a::99]:40000"),
            sa("[2001:db8:a::10]:30080"),
            false,
        );
        let hop_by_hop = [17u8, 0, 1, 4, 0, 0, 0, 0]; // next: UDP; PadN
        ext.splice(54..54, hop_by_hop);
        ext[20] = 0; // next header: hop-by-hop options
        let plen = u16::from_be_bytes([ext[18], ext[19]]) + 8;
        ext[18..20].copy_from_slice(&plen.to_be_bytes());

        let quote = &packet(sa("10.244.1.6:8080"), client, false)[14..42];
        let icmp = icmp_error(
            "192.0.2.99".parse().expect("ip"),
            "192.0.2.10".parse().expect("ip"),
            3,
            3,
            0,
            quote,
        );

        let node_local = packet(client, sa("192.0.2.10:22"), true);
        let no_neighbour = packet(client, np, true);
        let no_neighbour_v6 = packet(
            sa("[2001:db8:a::99]:40000"),
            sa("[2001:db8:a::10]:30080"),
            true,
        );
        let cases = [
            ("fragment", fragment, false),
            ("IPv6 extension header", ext, false),
            ("ICMP error", icmp, false),
            ("the node's own traffic", node_local, false),
            ("no neighbour entry", no_neighbour.clone(), true),
            ("no neighbour entry (IPv6)", no_neighbour_v6, true),
        ];
        let mut ours = 0;
        for (what, pkt, counted) in cases {
            let (verdict, out) = h.run_xdp(&pkt, uplink);
            assert_eq!(verdict, XDP_PASS, "{what}");
            assert_eq!(out, pkt, "{what}: bytes untouched");
            assert!(h.ct_entries().is_empty(), "{what}: no flow recorded");
            ours += u64::from(counted);
            assert_eq!(h.counter("xdp_to_tc"), ours, "{what}");
        }
        assert_eq!(h.counter("xdp_tx") + h.counter("xdp_redirect"), 0);
        // TC then opens the flow as it always did.
        let (verdict, out) = h.run(&no_neighbour);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(inspect(&out).dst, sa("10.244.1.6:8080"));
    });
}

#[needs_root]
#[test]
fn refusal_is_left_to_tc_and_denies_are_dropped_at_xdp() {
    in_testbed(|uplink, _| {
        let mut h = Harness::new(&[]);
        configure_node(&mut h, false);
        let (lb, mut st) = frontend("203.0.113.50", 80, Protocol::Tcp, &["10.244.2.7:8080"]);
        st.kind = FrontendKind::LoadBalancer;
        st.source_ranges = vec!["198.51.100.0/25".parse().expect("cidr")].into();
        let (empty, mut est) = frontend("192.0.2.10", 30081, Protocol::Tcp, &[]);
        est.kind = FrontendKind::NodePort;
        h.apply(&NodeView::from([(lb, st), (empty, est)]));

        let allowed = packet(sa("198.51.100.7:40000"), sa("203.0.113.50:80"), true);
        let (verdict, out) = h.run_xdp(&allowed, uplink);
        assert_eq!(verdict, XDP_TX, "inside the source ranges");
        assert_sent(
            &out,
            &allowed,
            OTHER_NODE_MAC,
            UPLINK,
            sa("10.244.2.7:8080"),
        );

        let denied = packet(sa("198.51.100.200:40000"), sa("203.0.113.50:80"), true);
        let (verdict, _) = h.run_xdp(&denied, uplink);
        assert_eq!(verdict, XDP_DROP, "outside the source ranges");
        assert_eq!(h.counter("source_range_drop"), 1);

        let syn = packet(sa("192.0.2.99:40002"), sa("192.0.2.10:30081"), true);
        let (verdict, out) = h.run_xdp(&syn, uplink);
        assert_eq!(verdict, XDP_PASS, "a refusal is sent by TC");
        assert_eq!(out, syn);
        let (verdict, _) = h.run(&syn);
        assert_eq!(verdict, TC_ACT_REDIRECT, "TC answers with a reset");
        assert_eq!(h.counter("xdp_drop"), 1);
    });
}

#[needs_root]
#[test]
fn mid_stream_segment_of_no_flow_is_dropped_at_xdp() {
    in_testbed(|uplink, _| {
        let mut h = node_port(&["10.244.2.7:8080"], &[]);
        let ack = tcp_with_flags(sa("192.0.2.99:40000"), sa("192.0.2.10:30080"), 0x10);
        let (verdict, _) = h.run_xdp(&ack, uplink);
        assert_eq!(verdict, XDP_DROP);
        assert_eq!(h.counter("ct_invalid"), 1);
        assert_eq!(h.counter("xdp_drop"), 1);
    });
}

fn refresh_ipv4_checksum(pkt: &mut [u8]) {
    pkt[24..26].fill(0);
    let c = fold(sum16(&pkt[14..34], 0));
    pkt[24..26].copy_from_slice(&c.to_be_bytes());
}

/// A reply of a masqueraded flow arriving on the uplink (a backend on another node) is
/// reverse-translated at XDP and sent back out to the client.
#[needs_root]
#[test]
fn reply_from_a_remote_backend_is_reverse_translated_at_xdp() {
    in_testbed(|uplink, _| {
        let mut h = node_port(&["10.244.2.7:8080"], &["[fd00:244:2::7]:8080"]);
        for (client, frontend) in [
            ("192.0.2.99:40000", "192.0.2.10:30080"),
            ("[2001:db8:a::99]:40000", "[2001:db8:a::10]:30080"),
        ] {
            let (client, frontend) = (sa(client), sa(frontend));
            let syn = tcp_with_flags(client, frontend, 0x02);
            let (verdict, out) = h.run_xdp(&syn, uplink);
            assert_eq!(verdict, XDP_TX);
            let sent = inspect(&out);
            let syn_ack = tcp_with_flags(sent.dst, sent.src, 0x12);
            let (verdict, out) = h.run_xdp(&syn_ack, uplink);
            assert_eq!(verdict, XDP_TX, "the reply goes back out of the uplink");
            assert_eq!(out[0..6], CLIENT_MAC, "to the client's MAC");
            let seen = inspect(&out);
            assert_eq!((seen.src, seen.dst), (frontend, client), "{client}");
            assert_eq!(seen.tcp_flags, 0x12);
        }
        assert_eq!(h.counter("ct_reply_nat"), 2);
    });
}

/// A harness as `node_port`'s, its frontends (on the node's address `node_ip`) in
/// direct-server-return mode.
fn node_port_dsr_on(node_ip: &str, backends: &[&str]) -> Harness {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let mut view = NodeView::new();
    for proto in [Protocol::Tcp, Protocol::Udp] {
        let (f, mut st) = frontend(node_ip, 30080, proto, backends);
        st.kind = FrontendKind::NodePort;
        st.dsr = true;
        view.insert(f, st);
    }
    h.apply(&view);
    h
}

/// `node_port_dsr_on` the node's IPv4 address.
fn node_port_dsr(backends: &[&str]) -> Harness {
    node_port_dsr_on("192.0.2.10", backends)
}

/// `node_port_dsr_on` the node's IPv6 address.
fn node_port_dsr6(backends: &[&str]) -> Harness {
    node_port_dsr_on("2001:db8:a::10", backends)
}

/// The packet carries DSR's option for `frontend` right after its base header, naming
/// this node (192.0.2.10) as the entry, and is 12 bytes longer than `sent`.
fn assert_dsr_option(out: &[u8], sent: &[u8], frontend: SocketAddr) {
    assert_eq!(out.len(), sent.len() + 12, "twelve bytes more");
    assert_eq!(out[14], 0x48, "IPv4, a 32-byte header");
    let std::net::IpAddr::V4(ip) = frontend.ip() else {
        panic!("IPv4 only")
    };
    let (p, a) = (frontend.port().to_be_bytes(), ip.octets());
    assert_eq!(
        out[34..46],
        [0x9a, 12, p[0], p[1], a[0], a[1], a[2], a[3], 192, 0, 2, 10],
        "the option names the frontend and this node"
    );
    assert_eq!(
        out[46..],
        sent[34..],
        "the L4 header and payload as they were"
    );
}

/// DSR at the client's node: to a backend on another node the client's address is kept
/// and the frontend rides along in an IP option — at XDP (sent back out, one hop less)
/// and at TC, for the first packet and the flow's next ones; checksums valid.
#[needs_root]
#[test]
fn dsr_keeps_the_client_and_carries_the_frontend_at_xdp_and_tc() {
    in_testbed(|uplink, _| {
        let mut h = node_port_dsr(&["10.244.2.7:8080"]);
        let (frontend, backend) = (sa("192.0.2.10:30080"), sa("10.244.2.7:8080"));
        let mut sent = 0;
        for (i, tcp) in [true, false].into_iter().enumerate() {
            let client = sa(&format!("192.0.2.99:{}", 40000 + i));
            let pkt = packet(client, frontend, tcp);
            let (verdict, out) = h.run_xdp(&pkt, uplink);
            assert_eq!(verdict, XDP_TX, "tcp={tcp}");
            assert_eq!(out[0..6], OTHER_NODE_MAC, "to the backend's node");
            assert_eq!(ttl(&out), ttl(&pkt) - 1);
            let seen = inspect(&out);
            assert_eq!(
                (seen.src, seen.dst),
                (client, backend),
                "the client's address kept"
            );
            let mut expect = out.clone();
            expect.drain(34..46);
            assert_dsr_option(&out, &expect, frontend);

            let client = sa(&format!("192.0.2.99:{}", 41000 + i));
            let pkt = packet(client, frontend, tcp);
            let (verdict, out) = h.run(&pkt);
            assert!(
                verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
                "TC translates: {verdict}"
            );
            let seen = inspect(&out);
            assert_eq!((seen.src, seen.dst), (client, backend));
            let mut expect = out.clone();
            expect.drain(34..46);
            assert_dsr_option(&out, &expect, frontend);
            sent += 2;
        }
        // The flow's next segment carries it too.
        let client = sa("192.0.2.99:40000");
        let ack = tcp_with_flags(client, frontend, 0x10);
        let (verdict, out) = h.run_xdp(&ack, uplink);
        assert_eq!(verdict, XDP_TX);
        assert_eq!(inspect(&out).dst, backend);
        assert_eq!(out[34..36], [0x9a, 12]);
        sent += 1;
        assert_eq!(h.counter("dsr_sent"), sent);
        assert_eq!(h.counter("snat"), 0, "nothing masqueraded");
    });
}

/// A DSR frontend's flow to a backend on this node is translated as any other (its
/// replies pass through here anyway): no option, masqueraded as kube-proxy would.
#[needs_root]
#[test]
fn dsr_to_a_local_backend_is_plain_nat() {
    in_testbed(|uplink, _| {
        let mut h = node_port_dsr(&["10.244.1.5:8080"]);
        let pkt = packet(sa("192.0.2.99:40000"), sa("192.0.2.10:30080"), true);
        let (verdict, out) = h.run_xdp(&pkt, uplink);
        assert_eq!(verdict, XDP_REDIRECT);
        assert_sent(&out, &pkt, POD_MAC, PODS, sa("10.244.1.5:8080"));
        assert_eq!(out[14], 0x45, "no option");
        assert_eq!(h.counter("dsr_sent"), 0);
    });
}

/// The backend's node: the option (IPv6: header) makes the flow's entries there, the
/// packet goes on untouched (this node translates nothing of it), and the backend's
/// replies leave as the frontend, to the client, straight out — with valid checksums;
/// the client's ACK completes the handshake there (the flow is kept as established, not
/// as new).
#[needs_root]
#[test]
fn the_backend_node_learns_the_flow_and_answers_as_the_frontend() {
    in_testbed(|uplink, _| {
        backend_node_learns(
            node_port_dsr(&["10.244.2.7:8080"]),
            uplink,
            ("192.0.2.99:40000", "192.0.2.10:30080", "10.244.2.7:8080"),
        );
    });
}

#[needs_root]
#[test]
fn the_backend_node_learns_an_ipv6_flow_and_answers_as_the_frontend() {
    in_testbed(|uplink, _| {
        backend_node_learns(
            node_port_dsr6(&["[fd00:244:2::7]:8080"]),
            uplink,
            (
                "[2001:db8:a::99]:40000",
                "[2001:db8:a::10]:30080",
                "[fd00:244:2::7]:8080",
            ),
        );
    });
}

/// The body of both: the entry node `entry` opens the flow at XDP, a second harness is
/// the backend's node (`backend_node`), the packet arriving on its uplink.
fn backend_node_learns(
    mut entry: Harness,
    uplink: u32,
    (client, frontend, backend): (&str, &str, &str),
) {
    let (client, frontend, backend) = (sa(client), sa(frontend), sa(backend));
    let (_, syn) = entry.run_xdp(&tcp_with_flags(client, frontend, 0x02), uplink);
    let syn = via_entry_node(&syn);
    let node_b = backend_node(&[&backend.to_string()]);
    let (verdict, out) = node_b.run_on(&syn, uplink);
    assert_eq!(verdict, TC_ACT_UNSPEC, "passed on");
    assert_eq!(out, syn, "untouched");
    assert_eq!(node_b.counter("dsr_received"), 1);

    let (_, out) = node_b.run(&tcp_with_flags(backend, client, 0x12));
    let seen = inspect(&out);
    assert_eq!((seen.src, seen.dst), (frontend, client), "as the frontend");
    assert_eq!(node_b.counter("ct_reply_nat"), 1);

    let (_, ack) = entry.run_xdp(&tcp_with_flags(client, frontend, 0x10), uplink);
    let ack = via_entry_node(&ack);
    let (verdict, out) = node_b.run_on(&ack, uplink);
    assert_eq!((verdict, out), (TC_ACT_UNSPEC, ack));
    assert_eq!(node_b.counter("dsr_received"), 1, "learnt once");
    let entries = node_b.ct_entries();
    assert_eq!(entries.len(), 2, "one flow, two entries");
    let family = if client.is_ipv4() {
        proxy_common::FAMILY_V4
    } else {
        proxy_common::FAMILY_V6
    };
    assert!(
        entries.iter().all(|(k, _)| k.family == family),
        "a flow of the client's family"
    );
    let fwd = entries
        .iter()
        .find(|(k, _)| k.dir == proxy_common::CT_DIR_FORWARD)
        .expect("forward entry");
    assert_ne!(
        fwd.1.flags & proxy_common::CT_F_ASSURED,
        0,
        "established after the handshake"
    );
    assert_eq!(
        node_b.maps.conntrack.iter().count(),
        2,
        "in the answered table"
    );
}

/// An option is believed only as the backend's agent permits (ABI.md, `DSR_PERMITS`)
/// and from another node of the cluster: each forged or misplaced one is refused,
/// counted by its reason, dropped, makes no entry, and the pod's SYN-ACK is not turned
/// into the frontend's. Issue 42's items 1 and 2.
#[needs_root]
#[test]
fn a_forged_dsr_option_is_refused_by_reason() {
    in_testbed(|uplink, pods| {
        let client = sa("192.0.2.99:40000");
        let mut entry = node_port_dsr(&["10.244.2.7:8080"]);
        let (_, syn) = entry.run_xdp(
            &tcp_with_flags(client, sa("192.0.2.10:30080"), 0x02),
            uplink,
        );
        let syn = via_entry_node(&syn);
        // From entry node `addr` by `mac`.
        let entered = |mac: [u8; 6], addr: &str| {
            let mut p = syn.clone();
            set_dsr_entry(&mut p, mac, addr, "::");
            p
        };
        // The option's port and address, rewritten: `[type, len, port, addr, entry]` at 34.
        let naming = |pkt: &[u8], frontend: &str| {
            let fe = sa(frontend);
            let std::net::IpAddr::V4(ip) = fe.ip() else {
                panic!("IPv4")
            };
            let mut p = pkt.to_vec();
            p[36..38].copy_from_slice(&fe.port().to_be_bytes());
            p[38..42].copy_from_slice(&ip.octets());
            header_checksum(&mut p);
            p
        };
        // The same SYN, from `src` to `dst` (addresses rewritten, option kept).
        let between = |pkt: &[u8], src: &str, dst: &str| {
            let (src, dst) = (sa(src), sa(dst));
            let (std::net::IpAddr::V4(s), std::net::IpAddr::V4(d)) = (src.ip(), dst.ip()) else {
                panic!("IPv4")
            };
            let mut p = pkt.to_vec();
            p[26..30].copy_from_slice(&s.octets());
            p[30..34].copy_from_slice(&d.octets());
            p[46..48].copy_from_slice(&src.port().to_be_bytes());
            p[48..50].copy_from_slice(&dst.port().to_be_bytes());
            header_checksum(&mut p);
            p
        };
        let cases: [(&str, Harness, Vec<u8>, u32, &str); 11] = [
            (
                "no Service in dsr mode here",
                {
                    let mut h = Harness::new(&[]);
                    configure_node_b(&mut h);
                    h
                },
                syn.clone(),
                uplink,
                "dsr_refused_frontend",
            ),
            (
                "a frontend no Service has (6.6.6.6:443)",
                backend_node(&["10.244.2.7:8080"]),
                naming(&syn, "6.6.6.6:443"),
                uplink,
                "dsr_refused_frontend",
            ),
            (
                "a destination that is no backend of it",
                backend_node(&["10.244.2.8:8080"]),
                syn.clone(),
                uplink,
                "dsr_refused_frontend",
            ),
            (
                "this node's own NodePort address",
                backend_node(&["10.244.2.7:8080"]),
                naming(&syn, "192.0.2.20:30080"),
                uplink,
                "dsr_refused_frontend",
            ),
            (
                "a backend on another node",
                backend_node(&["10.244.3.7:8080"]),
                between(&syn, "192.0.2.99:40000", "10.244.3.7:8080"),
                uplink,
                "dsr_refused_backend",
            ),
            (
                "a pod's source address",
                backend_node(&["10.244.2.7:8080"]),
                between(&syn, "10.244.1.5:40000", "10.244.2.7:8080"),
                uplink,
                "dsr_refused_source",
            ),
            (
                "an outside source, from a pod's interface (spoofed)",
                backend_node(&["10.244.2.7:8080"]),
                syn.clone(),
                pods,
                "dsr_refused_source",
            ),
            (
                "an entry node that is no node of the cluster (the client's address)",
                backend_node(&["10.244.2.7:8080"]),
                entered(CLIENT_MAC, "192.0.2.99"),
                uplink,
                "dsr_refused_node",
            ),
            (
                "a node's address, from another sender on the wire (the client's MAC)",
                backend_node(&["10.244.2.7:8080"]),
                entered(CLIENT_MAC, ENTRY_NODE),
                uplink,
                "dsr_refused_node",
            ),
            (
                "this node's own address as the entry",
                backend_node(&["10.244.2.7:8080"]),
                entered(OTHER_NODE_MAC, "192.0.2.20"),
                uplink,
                "dsr_refused_node",
            ),
            (
                "a node with no neighbour entry (unknown MAC: nothing to check against)",
                backend_node(&["10.244.2.7:8080"]),
                entered(ENTRY_NODE_MAC, UNRESOLVED_NODE),
                uplink,
                "dsr_refused_node",
            ),
        ];
        for (case, node_b, pkt, ifindex, reason) in cases {
            let (verdict, _) = node_b.run_on(&pkt, ifindex);
            assert_eq!(verdict, TC_ACT_SHOT, "{case}: dropped");
            assert_eq!(node_b.counter(reason), 1, "{case}: counted as {reason}");
            assert_eq!(node_b.counter("dsr_received"), 0, "{case}: nothing learnt");
            assert!(node_b.ct_entries().is_empty(), "{case}: no entry");
            // The pod's answer leaves as itself, not as the named frontend.
            let addr = |at: usize| {
                std::net::Ipv4Addr::from(<[u8; 4]>::try_from(&pkt[at..at + 4]).expect("4"))
            };
            let port = |at: usize| u16::from_be_bytes([pkt[at], pkt[at + 1]]);
            let (src, dst) = (
                SocketAddr::from((addr(26), port(46))),
                SocketAddr::from((addr(30), port(48))),
            );
            let (_, out) = node_b.run_on(&tcp_with_flags(dst, src, 0x12), pods);
            assert_eq!(inspect(&out).src, dst, "{case}: the SYN-ACK is the pod's");
        }
    });
}

/// The same over IPv6: a Destination Options header naming a frontend no Service of
/// this node's has, or from a pod's interface, makes no flow.
#[needs_root]
#[test]
fn a_forged_dsr_header_over_ipv6_is_refused() {
    in_testbed(|uplink, pods| {
        let (client, frontend) = (sa("[2001:db8:a::99]:40000"), sa("[2001:db8:a::10]:30080"));
        let mut entry = node_port_dsr6(&["[fd00:244:2::7]:8080"]);
        let (_, syn) = entry.run_xdp(&tcp_with_flags(client, frontend, 0x02), uplink);
        let syn = via_entry_node(&syn);
        let mut stranger = syn.clone();
        set_dsr_entry(&mut stranger, CLIENT_MAC, "0.0.0.0", "2001:db8:a::99");
        let mut other_sender = syn.clone();
        set_dsr_entry(&mut other_sender, CLIENT_MAC, "0.0.0.0", ENTRY_NODE6);
        let mut bare = Harness::new(&[]);
        configure_node_b(&mut bare);
        let cases = [
            (
                "no Service in dsr mode here",
                bare,
                &syn,
                uplink,
                "dsr_refused_frontend",
            ),
            (
                "an outside source, from a pod's interface",
                backend_node(&["[fd00:244:2::7]:8080"]),
                &syn,
                pods,
                "dsr_refused_source",
            ),
            (
                "an entry node that is no node of the cluster",
                backend_node(&["[fd00:244:2::7]:8080"]),
                &stranger,
                uplink,
                "dsr_refused_node",
            ),
            (
                "a node's address, from another sender on the wire",
                backend_node(&["[fd00:244:2::7]:8080"]),
                &other_sender,
                uplink,
                "dsr_refused_node",
            ),
        ];
        for (case, node_b, pkt, ifindex, reason) in cases {
            let (verdict, _) = node_b.run_on(pkt, ifindex);
            assert_eq!(verdict, TC_ACT_SHOT, "{case}: dropped");
            assert_eq!(node_b.counter(reason), 1, "{case}: counted as {reason}");
            assert!(node_b.ct_entries().is_empty(), "{case}: no entry");
        }
        // The entry node's own header is believed.
        let node_b = backend_node(&["[fd00:244:2::7]:8080"]);
        let (verdict, out) = node_b.run_on(&syn, uplink);
        assert_eq!((verdict, &out), (TC_ACT_UNSPEC, &syn), "passed on");
        assert_eq!(node_b.counter("dsr_received"), 1);
    });
}

/// A flow the node opened itself outranks the option: a learned flow never replaces
/// it, and the node's own new connection on a learned tuple replaces the learned one.
#[needs_root]
#[test]
fn a_learned_flow_never_outranks_the_nodes_own() {
    in_testbed(|uplink, _| {
        let (client, frontend, backend) = (
            sa("192.0.2.99:40000"),
            sa("192.0.2.10:30080"),
            sa("10.244.2.7:8080"),
        );
        let mut entry = node_port_dsr(&["10.244.2.7:8080"]);
        let (_, syn) = entry.run_xdp(&tcp_with_flags(client, frontend, 0x02), uplink);
        let syn = via_entry_node(&syn);
        // node-b with the same Service, whose NodePort on 192.0.2.10 also reaches it
        // (as an address load balancers send to node-b would).
        let mut node_b = backend_node(&["10.244.2.7:8080"]);
        let mut view = NodeView::new();
        for node_ip in ["192.0.2.20", "192.0.2.10"] {
            let (f, mut st) = frontend_at(node_ip);
            st.kind = FrontendKind::LoadBalancer;
            st.dsr = true;
            view.insert(f, st);
        }
        node_b.apply(&view);
        // The node's own flow first: the client's SYN straight to 192.0.2.10:30080.
        let direct = tcp_with_flags(client, frontend, 0x02);
        let (_, out) = node_b.run_on(&direct, uplink);
        assert_eq!(inspect(&out).dst, backend, "the node's own flow");
        let (verdict, out) = node_b.run_on(&syn, uplink);
        assert_eq!((verdict, out), (TC_ACT_UNSPEC, syn.clone()));
        assert_eq!(node_b.counter("dsr_refused_clash"), 1);
        assert_eq!(node_b.counter("dsr_received"), 0);
        assert!(
            node_b
                .ct_entries()
                .iter()
                .all(|(_, v)| v.flags & proxy_common::CT_F_DSR_BACKEND == 0),
            "no learned entry"
        );

        // Learned first, then the node's own SYN on the tuple: the learned flow goes.
        let mut node_b = backend_node(&["10.244.2.7:8080"]);
        node_b.apply(&view);
        node_b.run_on(&syn, uplink);
        assert_eq!(node_b.counter("dsr_received"), 1);
        let (_, out) = node_b.run_on(&direct, uplink);
        assert_eq!(inspect(&out).dst, backend, "balanced by the node");
        assert!(
            node_b
                .ct_entries()
                .iter()
                .all(|(_, v)| v.flags & proxy_common::CT_F_DSR_BACKEND == 0),
            "the learned flow replaced"
        );
    });
}

/// The IPv4 header checksum of a packet whose header has options (`ihl` > 5).
fn header_checksum(pkt: &mut [u8]) {
    let len = usize::from(pkt[14] & 0x0f) * 4;
    pkt[24..26].fill(0);
    let c = fold(sum16(&pkt[14..14 + len], 0));
    pkt[24..26].copy_from_slice(&c.to_be_bytes());
}

/// Issue 42, item 3: a flow is answered only by a reply that came by the route back to
/// its source. A pod forging the remote backend's SYN-ACK (from the pods' interface,
/// while the backend's route is the uplink) leaves the flow unanswered — the client's
/// ACK promotes nothing, the flow stays in the table a flood may evict — while the
/// backend's own SYN-ACK (on the uplink) answers it. A bridge's port answers for the
/// bridge (`IF_MASTERS`).
#[needs_root]
#[test]
fn a_forged_answer_never_makes_a_flow_answered() {
    in_testbed(|uplink, pods| {
        let h = node_port(&["10.244.2.7:8080"], &[]);
        let (client, frontend, backend) = (
            sa("192.0.2.99:40000"),
            sa("192.0.2.10:30080"),
            sa("10.244.2.7:8080"),
        );
        let (_, out) = h.run_on(&tcp_with_flags(client, frontend, 0x02), uplink);
        let to_backend = inspect(&out);
        assert_eq!(to_backend.dst, backend);
        let masqueraded = to_backend.src;
        let answer = tcp_with_flags(backend, masqueraded, 0x12);
        let ack = tcp_with_flags(client, frontend, 0x10);

        let (_, out) = h.run_on(&answer, pods);
        assert_eq!(inspect(&out).src, frontend, "still translated");
        assert_eq!(h.counter("ct_reply_unverified"), 1);
        h.run_on(&ack, uplink);
        assert_eq!(h.maps.conntrack.iter().count(), 0, "nothing answered");
        assert_eq!(h.maps.conntrack_new.iter().count(), 2, "the flow stays new");

        h.run_on(&answer, uplink);
        h.run_on(&ack, uplink);
        assert_eq!(h.counter("ct_reply_unverified"), 1);
        assert_eq!(
            h.maps.conntrack.iter().count(),
            2,
            "answered by the backend"
        );

        // Behind a bridge: the pods' interface a port of `xtb`, which holds the route.
        let script = "set -e
            ip addr flush dev xt1
            ip link add xtb type bridge
            ip link set xt1 master xtb
            ip link set xtb up
            ip addr add 10.244.1.1/24 dev xtb";
        let ok = Command::new("sh")
            .args(["-c", script])
            .status()
            .expect("sh");
        assert!(ok.success(), "bridge");
        let mut local = node_port(&["10.244.1.5:8080"], &[]);
        let bridged = ifindex("xtb");
        let answered = |h: &mut Harness| {
            let (_, out) = h.run_on(&tcp_with_flags(client, frontend, 0x02), uplink);
            let nat = inspect(&out).src;
            h.run_on(&tcp_with_flags(sa("10.244.1.5:8080"), nat, 0x12), pods);
            h.run_on(&tcp_with_flags(client, frontend, 0x10), uplink);
            h.maps.conntrack.iter().count() == 2
        };
        assert!(!answered(&mut local), "a port without its master known");
        let mut fresh = node_port(&["10.244.1.5:8080"], &[]);
        let mut masters: aya::maps::HashMap<_, u32, u32> = fresh
            .ebpf
            .map_mut("IF_MASTERS")
            .expect("IF_MASTERS")
            .try_into()
            .expect("hash");
        masters.insert(&pods, &bridged, 0).expect("insert");
        assert!(answered(&mut fresh), "the port answers for its bridge");
    });
}

/// A frontend at `node_ip`:30080 whose one backend is 10.244.2.7:8080.
fn frontend_at(
    node_ip: &str,
) -> (
    proxy_agent::model::Frontend,
    proxy_agent::model::FrontendState,
) {
    frontend(node_ip, 30080, Protocol::Tcp, &["10.244.2.7:8080"])
}

/// The option's 12 bytes count in XDP's MTU check: a packet that fits the uplink as it
/// came, but not with the option, is left to TC unchanged (which answers "fragmentation
/// needed" with room for the option); without DSR the same packet goes out at XDP.
#[needs_root]
#[test]
fn dsr_counts_its_option_in_the_mtu_check() {
    in_testbed(|uplink, _| {
        // UDP, no checksum, don't-fragment, 1496 bytes of IP: 4 under the MTU.
        let mut pkt = packet(sa("192.0.2.99:40000"), sa("192.0.2.10:30080"), false);
        pkt.truncate(42);
        pkt.resize(14 + 1496, 0x5a);
        pkt[16..18].copy_from_slice(&1496u16.to_be_bytes());
        pkt[20..22].copy_from_slice(&0x4000u16.to_be_bytes());
        pkt[38..40].copy_from_slice(&(1496u16 - 20).to_be_bytes());
        pkt[40..42].fill(0);
        refresh_ipv4_checksum(&mut pkt);
        let mut dsr = node_port_dsr(&["10.244.2.7:8080"]);
        let (verdict, out) = dsr.run_xdp(&pkt, uplink);
        assert_eq!((verdict, &out), (XDP_PASS, &pkt), "left to TC, unchanged");
        assert_eq!(dsr.counter("xdp_to_tc"), 1);
        let mut snat = node_port(&["10.244.2.7:8080"], &[]);
        let (verdict, _) = snat.run_xdp(&pkt, uplink);
        assert_eq!(verdict, XDP_TX, "it fits without the option");
    });
}

/// The packet carries DSR's IPv6 Destination Options header for `frontend` right after
/// its base header, which names it as the next header and counts it in the payload
/// length; the L4 protocol `next` follows it.
fn assert_dsr_header6(out: &[u8], frontend: SocketAddr, next: u8) {
    let std::net::IpAddr::V6(ip) = frontend.ip() else {
        panic!("IPv6 only")
    };
    assert_eq!(out[20], 60, "next header: Destination Options");
    let payload = usize::from(u16::from_be_bytes([out[18], out[19]]));
    assert_eq!(
        payload,
        out.len() - 54,
        "the payload length counts the header"
    );
    let mut hdr = vec![next, 4, 0x1b, 36];
    hdr.extend(ip.octets());
    hdr.extend(
        "2001:db8:a::10"
            .parse::<std::net::Ipv6Addr>()
            .expect("ip")
            .octets(),
    );
    hdr.extend(frontend.port().to_be_bytes());
    hdr.extend([0, 0]);
    assert_eq!(
        out[54..94],
        hdr[..],
        "the header names the frontend and this node"
    );
}

/// DSR over IPv6 at the client's node: the client's address kept, the frontend in a
/// 40-byte Destination Options header — at XDP and at TC, TCP and UDP, the flow's next
/// segment too; checksums valid behind the header.
#[needs_root]
#[test]
fn dsr_over_ipv6_carries_the_frontend_in_a_destination_options_header() {
    in_testbed(|uplink, _| {
        let mut h = node_port_dsr6(&["[fd00:244:2::7]:8080"]);
        let (frontend, backend) = (sa("[2001:db8:a::10]:30080"), sa("[fd00:244:2::7]:8080"));
        let mut sent = 0;
        for (i, tcp) in [true, false].into_iter().enumerate() {
            let proto = if tcp { 6 } else { 17 };
            let client = sa(&format!("[2001:db8:a::99]:{}", 40000 + i));
            let pkt = packet(client, frontend, tcp);
            let (verdict, out) = h.run_xdp(&pkt, uplink);
            assert_eq!(verdict, XDP_TX, "tcp={tcp}");
            assert_eq!(out[0..6], OTHER_NODE_MAC, "to the backend's node");
            assert_eq!(ttl(&out), ttl(&pkt) - 1);
            assert_eq!(out.len(), pkt.len() + 40, "40 bytes more");
            let seen = inspect(&out);
            assert_eq!(
                (seen.src, seen.dst),
                (client, backend),
                "the client's address kept"
            );
            assert_dsr_header6(&out, frontend, proto);

            let client = sa(&format!("[2001:db8:a::99]:{}", 41000 + i));
            let pkt = packet(client, frontend, tcp);
            let (verdict, out) = h.run(&pkt);
            assert!(
                verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT,
                "TC translates: {verdict}"
            );
            assert_eq!(out.len(), pkt.len() + 40, "40 bytes more");
            let seen = inspect(&out);
            assert_eq!((seen.src, seen.dst), (client, backend));
            assert_dsr_header6(&out, frontend, proto);
            sent += 2;
        }
        let client = sa("[2001:db8:a::99]:40000");
        let (verdict, out) = h.run_xdp(&tcp_with_flags(client, frontend, 0x10), uplink);
        assert_eq!(verdict, XDP_TX);
        assert_eq!(inspect(&out).dst, backend);
        assert_dsr_header6(&out, frontend, 6);
        sent += 1;
        assert_eq!(h.counter("dsr_sent"), sent);
        assert_eq!(h.counter("snat"), 0, "nothing masqueraded");
    });
}

/// IPv6's 40 bytes count in the MTU check: a datagram that fits the uplink as it came
/// but not with the header is left to TC unchanged at XDP, and TC answers "packet too
/// big" with the MTU less the header; without DSR it goes out at XDP.
#[needs_root]
#[test]
fn dsr_over_ipv6_counts_its_header_in_the_mtu_check() {
    in_testbed(|uplink, _| {
        // UDP, 1490 bytes of IPv6: 10 under the MTU, 30 over it with the header.
        let client = sa("[2001:db8:a::99]:40000");
        let frontend = sa("[2001:db8:a::10]:30080");
        let mut pkt = packet(client, frontend, false);
        pkt.truncate(62);
        pkt.resize(14 + 1490, 0x5a);
        pkt[18..20].copy_from_slice(&1450u16.to_be_bytes());
        pkt[58..60].copy_from_slice(&1450u16.to_be_bytes());
        pkt[60..62].fill(0);
        let pseudo = sum16(&pkt[22..54], 0) + 17 + 1450;
        let c = fold(sum16(&pkt[54..], pseudo));
        pkt[60..62].copy_from_slice(&c.to_be_bytes());
        inspect(&pkt);
        let mut dsr = node_port_dsr6(&["[fd00:244:2::7]:8080"]);
        let (verdict, out) = dsr.run_xdp(&pkt, uplink);
        assert_eq!((verdict, &out), (XDP_PASS, &pkt), "left to TC, unchanged");
        assert_eq!(dsr.counter("xdp_to_tc"), 1);
        let (verdict, out) = dsr.run_on(&pkt, uplink);
        assert_eq!(verdict, TC_ACT_REDIRECT, "TC answers, back out");
        assert_eq!((out[20], out[54]), (58, 2), "ICMPv6 packet too big");
        assert_eq!(
            u32::from_be_bytes([out[58], out[59], out[60], out[61]]),
            1460,
            "the MTU less the header"
        );
        let mut snat = node_port(&[], &["[fd00:244:2::7]:8080"]);
        let (verdict, _) = snat.run_xdp(&pkt, uplink);
        assert_eq!(verdict, XDP_TX, "it fits without the header");
    });
}
