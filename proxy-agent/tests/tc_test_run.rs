//! The real TC program on crafted packets (`BPF_PROG_TEST_RUN`), with maps written by the
//! agent's own sync code: verdicts, rewritten bytes, valid checksums, connection tracking,
//! and a full map that is reported without touching other services. Root only.

mod support;

use std::{collections::BTreeSet, net::SocketAddr};

use proxy_agent::{
    dataplane::bpf,
    model::{BackendSet, FrontendKind, NodeSettings, NodeView, Protocol, WhenEmpty},
    trace::{
        self,
        packet::{fold, sum16},
    },
};
use support::tc_harness::*;
use test_support::needs_root;

// ---- tests -------------------------------------------------------------------------

#[needs_root]
#[test]
fn tcp_v4_dnat_and_reverse_nat_with_valid_checksums() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.1.5:8080"],
    )]));
    let client = sa("10.244.0.3:40000");

    let (verdict, out) = h.run(&packet(client, sa("10.96.0.10:80"), true));
    assert_eq!(verdict, TC_ACT_OK);
    let seen = inspect(&out);
    assert_eq!(
        seen.dst,
        sa("10.244.1.5:8080"),
        "destination rewritten to the backend"
    );
    assert_eq!(seen.src, client, "source untouched");
    assert_eq!(h.ct_entries().len(), 2, "forward and reply entries");

    let (verdict, out) = h.run(&packet(sa("10.244.1.5:8080"), client, true));
    assert_eq!(verdict, TC_ACT_OK);
    let seen = inspect(&out);
    assert_eq!(
        seen.src,
        sa("10.96.0.10:80"),
        "reply source rewritten to the VIP"
    );
    assert_eq!(seen.dst, client);
    assert!(h.counter("ct_reply_nat") >= 1);
}

#[needs_root]
#[test]
fn udp_v6_dnat_and_reverse_nat_with_valid_checksums() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([frontend(
        "fd96::10",
        53,
        Protocol::Udp,
        &["[fd00:244:1::5]:5353"],
    )]));
    let client = sa("[fd00:244::3]:41000");
    let (verdict, out) = h.run(&packet(client, sa("[fd96::10]:53"), false));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out).dst, sa("[fd00:244:1::5]:5353"));
    let (verdict, out) = h.run(&packet(sa("[fd00:244:1::5]:5353"), client, false));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out).src, sa("[fd96::10]:53"));
}

#[needs_root]
#[test]
fn udp_v4_zero_checksum_stays_zero() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([frontend(
        "10.96.0.53",
        53,
        Protocol::Udp,
        &["10.244.1.9:5353"],
    )]));
    let mut pkt = packet(sa("10.244.0.3:40001"), sa("10.96.0.53:53"), false);
    pkt[34 + 6] = 0;
    pkt[34 + 7] = 0;
    let (verdict, out) = h.run(&pkt);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(&out[40..42], &[0, 0], "no checksum must stay no checksum");
    assert_eq!(inspect(&out).dst, sa("10.244.1.9:5353"));
}

#[needs_root]
#[test]
fn packets_not_for_a_service_pass_untouched() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.1.5:8080"],
    )]));
    for pkt in [
        packet(sa("10.244.0.3:40000"), sa("10.96.0.10:81"), true), // other port
        packet(sa("10.244.0.3:40000"), sa("10.96.0.10:80"), false), // other protocol
        packet(sa("10.244.0.3:40000"), sa("10.244.1.5:8080"), true), // a pod directly
    ] {
        let (verdict, out) = h.run(&pkt);
        assert_eq!(
            verdict, TC_ACT_UNSPEC,
            "not ours: hand on to the next program"
        );
        assert_eq!(out, pkt, "bytes untouched");
    }
}

/// Found by `fuzz_packets.rs`: the classifier read an IP header without its version, so an
/// "IPv6" frame whose header said version 7 (which `ipv6_rcv` drops) was masqueraded to a
/// NodePort's backend, taking a flow entry and a masquerade port; an "IPv4" header of
/// version 5 was translated too. Only headers of their own version are ours.
#[needs_root]
#[test]
fn ip_headers_of_another_version_pass_untouched() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let (np, mut st) = frontend(
        "2001:db8:a::10",
        30053,
        Protocol::Udp,
        &["[fd00:244:1::7]:5353"],
    );
    st.kind = FrontendKind::NodePort;
    h.apply(&NodeView::from([
        frontend("10.96.0.10", 80, Protocol::Tcp, &["10.244.1.5:8080"]),
        (np, st),
    ]));
    // The fuzzer's minimized input: fd00:244::3:1024 -> [2001:db8:a::10]:30053, version 7.
    let mut v6 = packet(
        sa("[fd00:244::3]:1024"),
        sa("[2001:db8:a::10]:30053"),
        false,
    );
    v6[14] = 0x70;
    let mut v4 = packet(sa("10.244.0.3:40000"), sa("10.96.0.10:80"), true);
    v4[14] = 0x55;
    v4[24..26].fill(0);
    let c = fold(sum16(&v4[14..34], 0));
    v4[24..26].copy_from_slice(&c.to_be_bytes());
    for pkt in [v6, v4] {
        let (verdict, out) = h.run(&pkt);
        assert_eq!(verdict, TC_ACT_UNSPEC, "{pkt:02x?}");
        assert_eq!(out, pkt, "bytes untouched");
    }
    assert!(
        h.ct_entries().is_empty(),
        "no flow for a packet that is not one"
    );
}

#[needs_root]
#[test]
fn service_without_backends_rejects_tcp_with_a_reset_and_udp_with_icmp() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([
        frontend("10.96.0.20", 80, Protocol::Tcp, &[]),
        frontend("10.96.0.20", 53, Protocol::Udp, &[]),
    ]));
    let syn = packet(sa("10.244.0.3:40000"), sa("10.96.0.20:80"), true);
    let (verdict, out) = h.run(&syn);
    assert_eq!(
        verdict, TC_ACT_REDIRECT,
        "a reset goes back out of the interface"
    );
    let seen = inspect(&out);
    assert_eq!(
        (seen.src, seen.dst),
        (sa("10.96.0.20:80"), sa("10.244.0.3:40000")),
        "addresses swapped"
    );
    assert_eq!(&out[0..6], &syn[6..12], "back to the sender's MAC");
    let tcp = &out[34..];
    assert_eq!(tcp[13], 0x14, "RST|ACK");
    let seq_in = u32::from_be_bytes([syn[38], syn[39], syn[40], syn[41]]);
    let payload = 5; // "hello" on the SYN
    assert_eq!(
        u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]),
        seq_in + payload + 1,
        "acknowledges the SYN and its data"
    );
    assert_eq!(out.len(), 14 + 20 + 20, "payload trimmed");
    assert_eq!(h.counter("reject_sent"), 1);
    let (verdict, icmp) = h.run(&packet(sa("10.244.0.3:40000"), sa("10.96.0.20:53"), false));
    assert_eq!(
        verdict, TC_ACT_REDIRECT,
        "UDP without endpoints: ICMP port unreachable"
    );
    assert_eq!(
        trace::packet::is_refusal(&icmp),
        Ok(true),
        "valid ICMP port unreachable"
    );
    assert_eq!(&icmp[26..30], &[10, 96, 0, 20], "from the service address");
    assert_eq!(&icmp[30..34], &[10, 244, 0, 3], "to the client");
    assert_eq!(h.counter("no_backend_reject"), 2);
}

#[needs_root]
#[test]
fn a_flow_keeps_its_backend_and_new_flows_spread() {
    let mut h = Harness::new(&[]);
    let backends = ["10.244.1.5:8080", "10.244.2.6:8080", "10.244.3.7:8080"];
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &backends,
    )]));
    let vip = sa("10.96.0.10:80");
    let first = inspect(&h.run(&packet(sa("10.244.0.3:40000"), vip, true)).1).dst;
    for _ in 0..20 {
        assert_eq!(
            inspect(&h.run(&packet(sa("10.244.0.3:40000"), vip, true)).1).dst,
            first
        );
    }
    let mut chosen = BTreeSet::new();
    for port in 41000..41060 {
        chosen.insert(
            inspect(
                &h.run(&packet(
                    SocketAddr::new("10.244.0.3".parse().expect("ip"), port),
                    vip,
                    true,
                ))
                .1,
            )
            .dst,
        );
    }
    let expected: BTreeSet<SocketAddr> = backends.iter().map(|b| sa(b)).collect();
    assert_eq!(
        chosen, expected,
        "60 new flows reach every backend and no other"
    );
}

/// The flows' clock on a kernel without `bpf_ktime_get_coarse_ns` (before 5.11, which
/// refused the whole classifier for the unknown helper): with the switch off, a new
/// flow is stamped by the fine monotonic clock (never behind a read made before the
/// packet, as the coarse clock, a tick behind, almost always is); with it on, by a clock
/// never ahead of a read made after.
#[needs_root]
#[test]
fn the_flows_clock_reads_the_fine_clock_where_the_coarse_one_is_missing() {
    let monotonic = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: writes the one timespec passed.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    };
    for coarse_clock in [false, true] {
        let kernel = bpf::Kernel {
            coarse_clock,
            ..bpf::Kernel::probed_helpers()
        };
        let mut h = Harness::on(&kernel, &[]);
        h.apply(&NodeView::from([frontend(
            "10.96.0.10",
            80,
            Protocol::Tcp,
            &["10.244.1.5:8080"],
        )]));
        let (mut behind, mut flows) = (0, 0);
        for port in 40000..40020 {
            let before = monotonic();
            let client = SocketAddr::new("10.244.0.3".parse().expect("ip"), port);
            h.run(&packet(client, sa("10.96.0.10:80"), true));
            let after = monotonic();
            let stamps: Vec<u64> = h
                .maps
                .conntrack_new
                .iter()
                .flatten()
                .filter(|(k, _)| k.sport == port.to_be() || k.dport == port.to_be())
                .map(|(_, v)| v.last_seen_ns)
                .collect();
            assert!(!stamps.is_empty(), "flow from port {port} recorded");
            for stamp in stamps {
                assert!(stamp <= after, "stamped {stamp} after {after}");
                behind += usize::from(stamp < before);
                flows += 1;
            }
        }
        if coarse_clock {
            assert!(
                behind > 0,
                "the coarse clock was never a tick behind: was it used?"
            );
        } else {
            assert_eq!(
                behind, 0,
                "{behind} of {flows} stamps were behind the clock"
            );
        }
    }
}

#[needs_root]
#[test]
fn backend_set_flip_leaves_only_the_new_generation() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.1.5:8080", "10.244.2.6:8080"],
    )]));
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.2.6:8080", "10.244.3.7:8080"],
    )]));
    let svc: Vec<_> = h
        .maps
        .services
        .iter()
        .map(|e| e.expect("entry").1)
        .collect();
    assert_eq!(svc.len(), 1);
    assert_eq!((svc[0].rev, svc[0].count), (2, 2));
    let slots: Vec<_> = h.maps.slots.iter().map(|e| e.expect("entry").0).collect();
    assert_eq!(slots.len(), 2, "old generation removed");
    assert!(slots.iter().all(|k| k.rev == 2));
    assert_eq!(h.maps.backends.iter().count(), 2, "unused backend removed");
    for port in 42000..42030 {
        let dst = inspect(
            &h.run(&packet(
                SocketAddr::new("10.244.0.3".parse().expect("ip"), port),
                sa("10.96.0.10:80"),
                true,
            ))
            .1,
        )
        .dst;
        assert_ne!(dst, sa("10.244.1.5:8080"), "removed backend never chosen");
    }
}

#[needs_root]
#[test]
fn full_map_is_reported_and_other_services_keep_working() {
    let mut h = Harness::new(&[("BACKEND_SLOTS", 4)]);
    let a = frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.1.5:8080", "10.244.2.6:8080", "10.244.3.7:8080"],
    );
    let report = h.apply(&NodeView::from([a.clone()]));
    assert!(report.failed.is_empty());
    let b = frontend(
        "10.96.0.11",
        80,
        Protocol::Tcp,
        &["10.244.4.8:8080", "10.244.5.9:8080"],
    );
    let report = h.apply(&NodeView::from([a.clone(), b]));
    assert_eq!(report.failed.len(), 1, "{report:?}");
    assert!(
        report.failed[0].to_string().contains("10.96.0.11"),
        "{report:?}"
    );
    assert_eq!(
        h.maps.services.iter().count(),
        1,
        "the failed service is not half-written"
    );
    assert_eq!(
        h.maps.slots.iter().count(),
        3,
        "partial slots were rolled back"
    );
    let (verdict, out) = h.run(&packet(sa("10.244.0.3:40000"), sa("10.96.0.10:80"), true));
    assert_eq!(verdict, TC_ACT_OK);
    assert!(
        a.1.backends.endpoints.contains(&inspect(&out).dst),
        "existing service still serves"
    );
}

#[needs_root]
#[test]
fn two_scopes_pods_use_the_internal_set_outside_clients_the_external_one() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let (f, mut st) = frontend("203.0.113.7", 80, Protocol::Tcp, &["10.244.1.5:8080"]);
    st.kind = FrontendKind::ExternalIp;
    st.external_local = true;
    st.internal = Some(Box::new(BackendSet {
        endpoints: [sa("10.244.2.6:8080")].into(),
        when_empty: WhenEmpty::Reject,
    }));
    h.apply(&NodeView::from([(f, st)]));
    assert_eq!(
        h.maps.services.iter().count(),
        2,
        "external and internal scope entries"
    );
    for port in 43000..43010 {
        let pod = inspect(
            &h.run(&packet(
                SocketAddr::new("10.244.0.3".parse().expect("ip"), port),
                sa("203.0.113.7:80"),
                true,
            ))
            .1,
        );
        assert_eq!(
            pod.dst,
            sa("10.244.2.6:8080"),
            "pod traffic short-circuits to the internal set"
        );
        let outside = inspect(
            &h.run(&packet(
                SocketAddr::new("198.51.100.7".parse().expect("ip"), port),
                sa("203.0.113.7:80"),
                true,
            ))
            .1,
        );
        assert_eq!(
            outside.dst,
            sa("10.244.1.5:8080"),
            "outside traffic gets the local endpoints"
        );
        assert_eq!(
            outside.src.ip().to_string(),
            "198.51.100.7",
            "eTP Local keeps the client address"
        );
    }
}

#[needs_root]
#[test]
fn masquerade_rewrites_the_source_and_replies_find_their_way_back() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let (np, mut st) = frontend("192.0.2.10", 30080, Protocol::Tcp, &["10.244.2.9:8080"]);
    st.kind = FrontendKind::NodePort;
    h.apply(&NodeView::from([
        frontend("10.96.0.10", 80, Protocol::Tcp, &["10.244.1.5:8080"]),
        (np, st),
    ]));
    let node = "192.0.2.10".parse::<std::net::IpAddr>().expect("ip");

    // (client, frontend, masqueraded?) — kube-proxy's rules.
    let cases = [
        ("10.244.0.3:40000", "10.96.0.10:80", false), // pod to ClusterIP
        ("198.51.100.7:40001", "10.96.0.10:80", true), // outside the pod network to ClusterIP
        ("198.51.100.7:40002", "192.0.2.10:30080", true), // NodePort, eTP Cluster
        ("10.244.0.3:40003", "192.0.2.10:30080", true), // pod to NodePort, eTP Cluster
    ];
    let mut snat_ports = BTreeSet::new();
    for (client, fe, masq) in cases {
        let (verdict, out) = h.run(&packet(sa(client), sa(fe), true));
        assert_eq!(verdict, TC_ACT_OK, "{client} -> {fe}");
        let seen = inspect(&out);
        assert_eq!(
            seen.src.ip() == node,
            masq,
            "{client} -> {fe}: masquerade expected {masq}, source {}",
            seen.src
        );
        if !masq {
            assert_eq!(seen.src, sa(client));
            continue;
        }
        assert!(
            (proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX).contains(&seen.src.port()),
            "port from the SNAT range: {}",
            seen.src
        );
        assert!(
            snat_ports.insert(seen.src.port()),
            "SNAT ports are never shared"
        );
        // The backend answers the node; the reply goes back to the client, from the frontend.
        let (verdict, back) = h.run(&packet(seen.dst, seen.src, true));
        assert_eq!(verdict, TC_ACT_OK);
        let back = inspect(&back);
        assert_eq!(
            (back.src, back.dst),
            (sa(fe), sa(client)),
            "reply of {client} -> {fe}"
        );
        // Later packets of the flow keep the same translation.
        let again = inspect(&h.run(&packet(sa(client), sa(fe), true)).1);
        assert_eq!((again.src, again.dst), (seen.src, seen.dst));
    }
    assert_eq!(h.counter("snat"), 3);
}

#[needs_root]
#[test]
fn hairpin_and_masquerade_all() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.0.3:8080"],
    )]));
    let seen = inspect(
        &h.run(&packet(sa("10.244.0.3:40000"), sa("10.96.0.10:80"), true))
            .1,
    );
    assert_eq!(
        seen.src.ip().to_string(),
        "192.0.2.10",
        "a pod reaching itself is masqueraded"
    );
    configure_node(&mut h, true);
    let seen = inspect(
        &h.run(&packet(sa("10.244.7.7:40000"), sa("10.96.0.10:80"), true))
            .1,
    );
    assert_eq!(
        seen.src.ip().to_string(),
        "192.0.2.10",
        "masqueradeAll masquerades pod traffic too"
    );
    // masqueradeAll is kube-proxy's cluster-IP rule: an outside client of an eTP Local
    // NodePort keeps its address (and eTP Cluster masquerades as always).
    for (external_local, masq) in [(true, false), (false, true)] {
        let (np, mut st) = frontend("192.0.2.10", 30080, Protocol::Tcp, &["10.244.2.9:8080"]);
        st.kind = FrontendKind::NodePort;
        st.external_local = external_local;
        h.apply(&NodeView::from([(np, st)]));
        let port = if external_local { 41000 } else { 41001 };
        let seen = inspect(
            &h.run(&packet(
                SocketAddr::new("198.51.100.7".parse().expect("ip"), port),
                sa("192.0.2.10:30080"),
                true,
            ))
            .1,
        );
        assert_eq!(
            seen.src.ip().to_string() == "192.0.2.10",
            masq,
            "masqueradeAll, eTP Local {external_local}: source {}",
            seen.src
        );
    }
}

#[needs_root]
#[test]
fn load_balancer_source_ranges_allow_and_drop() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let (lb, mut st) = frontend("203.0.113.50", 80, Protocol::Tcp, &["10.244.1.5:8080"]);
    st.kind = FrontendKind::LoadBalancer;
    st.source_ranges = vec!["198.51.100.0/25".parse().expect("cidr")].into();
    h.apply(&NodeView::from([(lb, st.clone())]));
    let (verdict, out) = h.run(&packet(
        sa("198.51.100.7:40000"),
        sa("203.0.113.50:80"),
        true,
    ));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out).dst, sa("10.244.1.5:8080"));
    let (verdict, _) = h.run(&packet(
        sa("198.51.100.200:40000"),
        sa("203.0.113.50:80"),
        true,
    ));
    assert_eq!(verdict, TC_ACT_SHOT, "outside the ranges: dropped");
    assert_eq!(h.counter("source_range_drop"), 1);
    // Widening the ranges is a map update, not a reload.
    let mut ranges = st.source_ranges.to_vec();
    ranges.push("198.51.100.128/25".parse().expect("cidr"));
    st.source_ranges = ranges.into();
    h.apply(&NodeView::from([(lb, st)]));
    let (verdict, _) = h.run(&packet(
        sa("198.51.100.200:40001"),
        sa("203.0.113.50:80"),
        true,
    ));
    assert_eq!(verdict, TC_ACT_OK);
}

#[needs_root]
#[test]
fn drop_when_policy_leaves_no_endpoint_here() {
    let mut h = Harness::new(&[]);
    let (f, mut st) = frontend("10.96.0.40", 80, Protocol::Tcp, &[]);
    st.backends.when_empty = WhenEmpty::Drop;
    h.apply(&NodeView::from([(f, st)]));
    let (verdict, _) = h.run(&packet(sa("10.244.0.3:40000"), sa("10.96.0.40:80"), true));
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(
        (h.counter("no_backend_drop"), h.counter("no_backend_reject")),
        (1, 0)
    );
}

#[needs_root]
#[test]
fn refusals_are_rate_limited() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([frontend(
        "10.96.0.20",
        80,
        Protocol::Tcp,
        &[],
    )]));
    let syn = packet(sa("10.244.0.3:40000"), sa("10.96.0.20:80"), true);
    // One bucket of 100 per CPU (the test thread may move between CPUs), refilled at 1
    // per ms.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let started = std::time::Instant::now();
    let verdicts: Vec<u32> = (0..300).map(|_| h.run(&syn).0).collect();
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let sent = verdicts.iter().filter(|v| **v == TC_ACT_REDIRECT).count() as u64;
    assert!(sent >= 100, "the burst goes out: {sent}");
    assert!(
        sent <= 100 * cpus + elapsed_ms * cpus + 5,
        "{sent} refusals in {elapsed_ms} ms"
    );
    assert!(sent < 300, "some refusals were held back");
    assert_eq!(h.counter("reject_sent"), sent);
    assert_eq!(h.counter("reject_rate_limited"), 300 - sent);
}

/// A refusal the packet cannot have (IP options: not worth a reset or an error) is a
/// drop, counted by its reason like every other, not a silent one.
#[needs_root]
#[test]
fn a_refusal_not_made_is_dropped_and_counted_by_its_reason() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([
        frontend("10.96.0.20", 80, Protocol::Tcp, &[]),
        frontend("10.96.0.20", 53, Protocol::Udp, &[]),
    ]));
    for (dst, tcp) in [("10.96.0.20:80", true), ("10.96.0.20:53", false)] {
        let pkt = with_ip_options(packet(sa("10.244.0.3:40000"), sa(dst), tcp));
        let (verdict, _) = h.run(&pkt);
        assert_eq!(verdict, TC_ACT_SHOT, "{dst}");
    }
    assert_eq!(
        h.counter("no_backend_reject"),
        2,
        "both reached the refusal"
    );
    assert_eq!(h.counter("reject_ip_options"), 2);
    assert_eq!(h.counter("reject_sent"), 0);
    assert_eq!(h.counter("drop_unreachable"), 0);
}

/// `pkt` (IPv4, as `packet` builds it) with 4 bytes of IP options (three NOPs, the end of
/// the list); its lengths and header checksum follow.
fn with_ip_options(mut pkt: Vec<u8>) -> Vec<u8> {
    pkt.splice(34..34, [1, 1, 1, 0]);
    pkt[14] = 0x46;
    let total = u16::from_be_bytes([pkt[16], pkt[17]]) + 4;
    pkt[16..18].copy_from_slice(&total.to_be_bytes());
    pkt[24..26].fill(0);
    let c = fold(sum16(&pkt[14..38], 0));
    pkt[24..26].copy_from_slice(&c.to_be_bytes());
    pkt
}

#[needs_root]
#[test]
fn flows_of_removed_backends_are_cleared() {
    let mut h = Harness::new(&[]);
    let both = ["10.244.1.5:5353", "10.244.2.6:5353"];
    h.apply(&NodeView::from([frontend(
        "10.96.0.53",
        53,
        Protocol::Udp,
        &both,
    )]));
    for port in 41000..41020 {
        h.run(&packet(
            SocketAddr::new("10.244.0.3".parse().expect("ip"), port),
            sa("10.96.0.53:53"),
            false,
        ));
    }
    let count_to = |h: &Harness, ip: &str| {
        let id = h
            .maps
            .backends
            .iter()
            .filter_map(Result::ok)
            .find(|(_, b)| proxy_common::addr::from_words(b.addr, b.family).to_string() == ip)
            .map(|(id, _)| id);
        h.ct_entries()
            .into_iter()
            .filter(|(_, v)| Some(v.backend_id) == id)
            .count()
    };
    assert!(count_to(&h, "10.244.1.5") > 0 && count_to(&h, "10.244.2.6") > 0);
    let before_other = count_to(&h, "10.244.2.6");
    h.apply(&NodeView::from([frontend(
        "10.96.0.53",
        53,
        Protocol::Udp,
        &["10.244.2.6:5353"],
    )]));
    let left: Vec<_> = h.ct_entries().into_iter().collect();
    assert!(
        left.iter()
            .all(|(_, v)| h.maps.backends.get(&v.backend_id, 0).is_ok()),
        "no entry points at a removed backend"
    );
    assert_eq!(
        count_to(&h, "10.244.2.6"),
        before_other,
        "other flows untouched"
    );
}

// ---- SCTP --------------------------------------------------------------------------

fn sctp_packet(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    trace::packet::build(src, dst, Protocol::Sctp)
}

/// The packet's SCTP addresses, its IPv4 header checksum and CRC32c verified.
fn inspect_sctp(pkt: &[u8]) -> (SocketAddr, SocketAddr) {
    let seen = inspect(pkt);
    (seen.src, seen.dst)
}

/// DNAT to a backend on another port, and the reply back from the frontend, both
/// families: addresses and ports change, the CRC32c stays valid (updated in place).
#[needs_root]
#[test]
fn sctp_dnat_and_reverse_nat_keep_the_crc32c_valid() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([
        frontend("10.96.0.30", 3868, Protocol::Sctp, &["10.244.1.7:13868"]),
        frontend("fd96::30", 3868, Protocol::Sctp, &["[fd00:244:1::7]:13868"]),
    ]));
    for (client, vip, backend) in [
        ("10.244.0.3:5000", "10.96.0.30:3868", "10.244.1.7:13868"),
        (
            "[fd00:244::3]:5000",
            "[fd96::30]:3868",
            "[fd00:244:1::7]:13868",
        ),
    ] {
        let (client, vip, backend) = (sa(client), sa(vip), sa(backend));
        let (verdict, out) = h.run(&sctp_packet(client, vip));
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(inspect_sctp(&out), (client, backend), "to the backend");
        // A second packet of the association takes the conntrack path.
        let (_, out) = h.run(&sctp_packet(client, vip));
        assert_eq!(inspect_sctp(&out), (client, backend), "established");
        let (verdict, out) = h.run(&sctp_packet(backend, client));
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(inspect_sctp(&out), (vip, client), "reply from the frontend");
    }
    // Without endpoints: ICMP port unreachable, as for UDP.
    h.apply(&NodeView::from([frontend(
        "10.96.0.30",
        3868,
        Protocol::Sctp,
        &[],
    )]));
    let (verdict, icmp) = h.run(&sctp_packet(sa("10.244.0.3:5001"), sa("10.96.0.30:3868")));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(
        (icmp[23], icmp[34], icmp[35]),
        (1, 3, 3),
        "ICMP port unreachable"
    );
}

/// kube-proxy clears UDP flows per Service port: a pod that leaves one Service but still
/// serves another loses only the first one's flows (and TCP flows are never cleared).
#[needs_root]
#[test]
fn udp_flows_are_cleared_per_service() {
    let mut h = Harness::new(&[]);
    let shared = "10.244.1.5:5353";
    let other = "10.244.2.6:5353";
    let view = |a: &[&str]| {
        NodeView::from([
            frontend("10.96.0.53", 53, Protocol::Udp, a),
            frontend("10.96.0.54", 53, Protocol::Udp, &[shared]),
            frontend("10.96.0.55", 5353, Protocol::Tcp, &[shared]),
        ])
    };
    h.apply(&view(&[shared]));
    let client = |port: u16| SocketAddr::new("10.244.0.3".parse().expect("ip"), port);
    for (port, vip, tcp) in [
        (41000, "10.96.0.53:53", false),
        (41001, "10.96.0.54:53", false),
        (41002, "10.96.0.55:5353", true),
    ] {
        let (verdict, out) = h.run(&packet(client(port), sa(vip), tcp));
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(inspect(&out).dst, sa(shared));
    }
    let flows = |h: &Harness| -> BTreeSet<u16> {
        h.ct_entries()
            .into_iter()
            .filter(|(k, _)| k.dir == proxy_common::CT_DIR_FORWARD)
            .map(|(k, _)| u16::from_be(k.sport))
            .collect()
    };
    assert_eq!(flows(&h), BTreeSet::from([41000, 41001, 41002]));
    // The pod leaves 10.96.0.53 only.
    h.apply(&view(&[other]));
    assert_eq!(
        flows(&h),
        BTreeSet::from([41001, 41002]),
        "only the flow of the Service the pod left is cleared"
    );
    let (_, out) = h.run(&packet(client(41000), sa("10.96.0.53:53"), false));
    assert_eq!(
        inspect(&out).dst,
        sa(other),
        "the next datagram is balanced again"
    );
    let (_, out) = h.run(&packet(client(41001), sa("10.96.0.54:53"), false));
    assert_eq!(
        inspect(&out).dst,
        sa(shared),
        "the other Service's flow is untouched"
    );
}

// ---- IPv4 fragments ----------------------------------------------------------------

/// A UDP datagram of `len` payload bytes from `src` to `dst` (valid checksum), as two
/// IPv4 fragments of one identity: the UDP header and the first 1000 bytes, then the rest.
fn udp_fragments(src: SocketAddr, dst: SocketAddr, len: usize) -> [Vec<u8>; 2] {
    let (std::net::IpAddr::V4(s), std::net::IpAddr::V4(d)) = (src.ip(), dst.ip()) else {
        panic!("IPv4 only");
    };
    let mut udp = Vec::new();
    udp.extend(src.port().to_be_bytes());
    udp.extend(dst.port().to_be_bytes());
    udp.extend(((8 + len) as u16).to_be_bytes());
    udp.extend([0, 0]);
    udp.extend((0..len).map(|i| (i * 31 + 7) as u8));
    let pseudo = sum16(&s.octets(), 0) + sum16(&d.octets(), 0) + 17 + udp.len() as u32;
    let sum = fold(sum16(&udp, pseudo));
    udp[6..8].copy_from_slice(&sum.to_be_bytes());
    let cut = 8 + 1000; // a multiple of 8, as fragment offsets are
    let piece = |data: &[u8], offset: usize, more: bool| {
        let mut pkt = vec![0x02, 0, 0, 0, 0, 0x0b, 0x02, 0, 0, 0, 0, 0x0a, 0x08, 0x00];
        let mut ip = vec![0x45, 0];
        ip.extend(((20 + data.len()) as u16).to_be_bytes());
        ip.extend(0x4242u16.to_be_bytes()); // identification
        let frag = (offset / 8) as u16 | if more { 0x2000 } else { 0 };
        ip.extend(frag.to_be_bytes());
        ip.extend([64, 17, 0, 0]);
        ip.extend(s.octets());
        ip.extend(d.octets());
        let sum = fold(sum16(&ip, 0));
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        pkt.extend(ip);
        pkt.extend(data);
        pkt
    };
    [piece(&udp[..cut], 0, true), piece(&udp[cut..], cut, false)]
}

/// Reassembles two fragments as the receiver would, checking the IPv4 header checksums
/// and the UDP checksum of the whole datagram; returns (source, destination).
fn reassemble(first: &[u8], second: &[u8]) -> (SocketAddr, SocketAddr) {
    for f in [first, second] {
        assert_eq!(fold(sum16(&f[14..34], 0)), 0, "IPv4 header checksum");
    }
    let ip = |f: &[u8], at: usize| std::net::Ipv4Addr::new(f[at], f[at + 1], f[at + 2], f[at + 3]);
    let (s, d) = (ip(first, 26), ip(first, 30));
    assert_eq!(
        (ip(second, 26), ip(second, 30)),
        (s, d),
        "both fragments agree"
    );
    let mut udp = first[34..].to_vec();
    udp.extend(&second[34..]);
    let pseudo = sum16(&s.octets(), 0) + sum16(&d.octets(), 0) + 17 + udp.len() as u32;
    assert_eq!(
        fold(sum16(&udp, pseudo)),
        0,
        "UDP checksum over the datagram"
    );
    let port = |at: usize| u16::from_be_bytes([udp[at], udp[at + 1]]);
    (
        SocketAddr::new(s.into(), port(0)),
        SocketAddr::new(d.into(), port(2)),
    )
}

/// A fragmented UDP datagram (a large DNS answer, say) is translated whole: the first
/// fragment as any packet, the later one by the ports the first left behind; both ways.
/// A later fragment that arrives first, or belongs to no flow, passes untouched.
#[needs_root]
#[test]
fn fragmented_udp_is_translated_in_every_fragment() {
    let mut h = Harness::new(&[]);
    h.apply(&NodeView::from([frontend(
        "10.96.0.53",
        53,
        Protocol::Udp,
        &["10.244.1.5:5353"],
    )]));
    let (client, vip, backend) = (
        sa("10.244.0.3:41000"),
        sa("10.96.0.53:53"),
        sa("10.244.1.5:5353"),
    );
    let [first, second] = udp_fragments(client, vip, 2000);
    let (v1, out1) = h.run(&first);
    let (v2, out2) = h.run(&second);
    assert_eq!((v1, v2), (TC_ACT_OK, TC_ACT_OK));
    assert_eq!(
        reassemble(&out1, &out2),
        (client, backend),
        "to the backend"
    );
    let [first, second] = udp_fragments(backend, client, 3000);
    let (_, out1) = h.run(&first);
    let (_, out2) = h.run(&second);
    assert_eq!(
        reassemble(&out1, &out2),
        (vip, client),
        "the reply from the frontend"
    );
    // A later fragment with no first fragment seen: left alone.
    let [_, orphan] = udp_fragments(sa("10.244.0.9:41001"), vip, 2000);
    let mut orphan = orphan;
    orphan[18..20].copy_from_slice(&0x9999u16.to_be_bytes()); // another identity
    let sum = fold(sum16(
        &{
            let mut ip = orphan[14..34].to_vec();
            ip[10] = 0;
            ip[11] = 0;
            ip
        },
        0,
    ));
    orphan[24..26].copy_from_slice(&sum.to_be_bytes());
    let (verdict, out) = h.run(&orphan);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(out, orphan, "untouched");
}

/// A table of local networks left full (by an earlier config with more pod CIDRs than it
/// holds) does not poison the next configuration: stale entries go before new ones.
#[needs_root]
#[test]
fn a_full_local_networks_table_does_not_poison_the_next_config() {
    let mut h = Harness::new(&[]);
    let capacity = proxy_common::capacity::LOCAL_NETS;
    let many: Vec<ipnet::IpNet> = (0..capacity)
        .map(|i| {
            format!("10.{}.{}.0/24", 100 + i / 256, i % 256)
                .parse()
                .expect("cidr")
        })
        .collect();
    let too_many = NodeSettings {
        pod_cidrs: many
            .iter()
            .copied()
            .chain(["172.16.0.0/12".parse().expect("cidr")])
            .collect(),
        ..Default::default()
    };
    let err = bpf::writer::configure(&mut h.maps, &too_many, &Default::default())
        .expect_err("more than it holds");
    assert!(format!("{err:#}").contains("local networks"), "{err:#}");
    // The table is full now; the usual config still applies, and works.
    configure_node(&mut h, false);
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.1.5:8080"],
    )]));
    let seen = inspect(
        &h.run(&packet(sa("10.244.0.3:40000"), sa("10.96.0.10:80"), true))
            .1,
    );
    assert_eq!(
        seen.src,
        sa("10.244.0.3:40000"),
        "pod traffic told apart again"
    );
}
