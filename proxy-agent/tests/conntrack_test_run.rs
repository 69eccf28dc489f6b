//! The per-packet path's connection tracking through the real classifier
//! (`BPF_PROG_TEST_RUN`): flows age by their state's limit at the default timeouts (time
//! is moved by ageing the entries, as if the flow had idled that long), closed flows
//! give their tuple and masquerade port back, a SYN flood evicts no answered flow, a
//! client port shared by two frontends keeps both flows apart, and the collector frees
//! what expired, and the port filters: a reply is probed for only from a port a flow's
//! reply tuple uses, a flow or service looked for only on a port a frontend uses, and
//! both filters' marks rebuilt from the tables; an answered flow's replies go alone (one
//! lookup) until it closes, and keep it alive by themselves. Root only.

mod support;

use std::net::SocketAddr;

use proxy_agent::{
    dataplane::bpf::{
        conntrack_gc::{self, monotonic_ns},
        port_backfill::{self, Fresh},
        port_filters::{self, marked},
    },
    model::{FrontendKind, NodeView, Protocol},
};
use proxy_common::{CT_DIR_FORWARD, CT_DIR_REPLY, CtKey, CtValue, map_names};
use support::tc_harness::*;
use test_support::needs_root;

const SYN: u8 = 0x02;
const SYN_ACK: u8 = 0x12;
const ACK: u8 = 0x10;
const FIN_ACK: u8 = 0x11;
const RST: u8 = 0x04;

/// Moves every flow's clock back by `secs`, as if it had idled that long (both entries:
/// replies that go alone stamp their own).
fn age(h: &mut Harness, secs: u64) {
    let d = secs * 1_000_000_000;
    for table in [&mut h.maps.conntrack, &mut h.maps.conntrack_new] {
        let all: Vec<(CtKey, CtValue)> = table.iter().filter_map(Result::ok).collect();
        for (k, mut v) in all {
            v.last_seen_ns = v.last_seen_ns.wrapping_sub(d);
            table.insert(&k, &v, 0).expect("age an entry");
        }
    }
}

fn counts(h: &Harness) -> (usize, usize) {
    (
        h.maps.conntrack.iter().count(),
        h.maps.conntrack_new.iter().count(),
    )
}

/// Runs a TCP segment; returns the verdict and (source, destination) as it left.
fn seg(h: &Harness, src: SocketAddr, dst: SocketAddr, flags: u8) -> (u32, SocketAddr, SocketAddr) {
    let (verdict, out) = h.run(&tcp_with_flags(src, dst, flags));
    let seen = inspect(&out);
    (verdict, seen.src, seen.dst)
}

/// A node with one ClusterIP (10.96.0.10:80 → 10.244.1.5:8080): the harness, a pod
/// client, the VIP and the backend.
fn one_clusterip() -> (Harness, SocketAddr, SocketAddr, SocketAddr) {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    clusterip(&mut h, &["10.244.1.5:8080"]);
    (
        h,
        sa("10.244.0.3:40000"),
        sa("10.96.0.10:80"),
        sa("10.244.1.5:8080"),
    )
}

fn clusterip(h: &mut Harness, backends: &[&str]) {
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        backends,
    )]));
}

#[needs_root]
#[test]
fn tcp_flows_age_by_their_state_at_the_default_timeouts() {
    let (mut h, client, vip, be) = one_clusterip();

    assert_eq!(seg(&h, client, vip, SYN), (TC_ACT_OK, client, be));
    assert_eq!(
        counts(&h),
        (0, 2),
        "an unanswered flow lives in the new-flows table"
    );
    assert_eq!(seg(&h, be, client, SYN_ACK), (TC_ACT_OK, vip, client));
    assert_eq!(
        counts(&h),
        (0, 2),
        "a SYN-ACK alone does not establish a flow (a spoofed SYN gets one too)"
    );
    assert_eq!(seg(&h, client, vip, ACK), (TC_ACT_OK, client, be));
    assert_eq!(
        counts(&h),
        (2, 0),
        "handshake complete: both entries moved to the answered table"
    );

    // A keep-alive connection idle past every unanswered timeout (60 s TCP, 30 s UDP):
    // either side may speak first afterwards.
    age(&mut h, 65);
    assert_eq!(
        seg(&h, be, client, ACK),
        (TC_ACT_OK, vip, client),
        "server speaks after 65 s"
    );
    age(&mut h, 65);
    assert_eq!(
        seg(&h, client, vip, ACK),
        (TC_ACT_OK, client, be),
        "client speaks after 65 s"
    );
    age(&mut h, 86_000);
    assert_eq!(seg(&h, be, client, ACK).1, vip, "established: 24 h");

    // Half closed: kube-proxy's tcpCloseWaitTimeout (1 h).
    seg(&h, client, vip, FIN_ACK);
    age(&mut h, 3_500);
    assert_eq!(
        seg(&h, be, client, FIN_ACK).1,
        vip,
        "half closed for 58 min"
    );
    // Both FINs: netfilter's TIME_WAIT, 120 s.
    age(&mut h, 110);
    assert_eq!(seg(&h, client, vip, ACK).2, be, "TIME_WAIT at 110 s");
    age(&mut h, 121);
    let (verdict, src, _) = seg(&h, be, client, ACK);
    assert_eq!(
        (verdict, src),
        (TC_ACT_UNSPEC, be),
        "TIME_WAIT over: not translated"
    );

    // A mid-stream segment with no flow opens none: dropped as netfilter's INVALID.
    assert_eq!(seg(&h, client, vip, ACK).0, TC_ACT_SHOT);
    assert_eq!(h.counter("ct_invalid"), 1);

    // A new connection on the same tuple; a RST closes it (netfilter's CLOSE, 10 s).
    assert_eq!(seg(&h, client, vip, SYN), (TC_ACT_OK, client, be));
    seg(&h, be, client, SYN_ACK);
    seg(&h, be, client, RST);
    age(&mut h, 9);
    assert_eq!(seg(&h, client, vip, ACK).2, be, "CLOSE at 9 s");
    age(&mut h, 11);
    assert_eq!(
        seg(&h, client, vip, ACK).0,
        TC_ACT_SHOT,
        "CLOSE over after 11 s idle"
    );
}

#[needs_root]
#[test]
fn an_unanswered_flow_expires_after_60_s() {
    let (mut h, client, vip, be) = one_clusterip();
    seg(&h, client, vip, SYN);
    age(&mut h, 59);
    assert_eq!(
        seg(&h, be, client, SYN_ACK).1,
        vip,
        "a late SYN-ACK at 59 s"
    );
    let (mut h, ..) = one_clusterip();
    seg(&h, client, vip, SYN);
    age(&mut h, 61);
    assert_eq!(
        seg(&h, be, client, SYN_ACK).0,
        TC_ACT_UNSPEC,
        "too late at 61 s"
    );
}

#[needs_root]
#[test]
fn a_syn_on_a_closed_flow_reaches_a_live_backend() {
    let (mut h, client, vip, old) = one_clusterip();
    seg(&h, client, vip, SYN);
    seg(&h, old, client, SYN_ACK);
    seg(&h, client, vip, FIN_ACK);
    seg(&h, old, client, FIN_ACK);
    // The backend leaves; the client reconnects from the same port while the old flow
    // is in TIME_WAIT.
    clusterip(&mut h, &["10.244.2.6:8080"]);
    assert_eq!(
        seg(&h, client, vip, SYN),
        (TC_ACT_OK, client, sa("10.244.2.6:8080"))
    );
    assert_eq!(h.counter("ct_reused"), 1);
    // An established flow keeps its backend after removal (it finishes there).
    let client2 = sa("10.244.0.3:40001");
    assert_eq!(seg(&h, client2, vip, SYN).2, sa("10.244.2.6:8080"));
    seg(&h, sa("10.244.2.6:8080"), client2, SYN_ACK);
    clusterip(&mut h, &["10.244.3.7:8080"]);
    assert_eq!(seg(&h, client2, vip, ACK).2, sa("10.244.2.6:8080"));
}

#[needs_root]
#[test]
fn udp_answered_then_silent_for_35_s_keeps_translating() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    h.apply(&NodeView::from([frontend(
        "10.96.0.53",
        53,
        Protocol::Udp,
        &["10.244.1.5:5353"],
    )]));
    let (client, vip, be) = (
        sa("10.244.0.3:40000"),
        sa("10.96.0.53:53"),
        sa("10.244.1.5:5353"),
    );
    let udp = |h: &Harness, s, d| {
        let (v, out) = h.run(&packet(s, d, false));
        let seen = inspect(&out);
        (v, seen.src, seen.dst)
    };
    assert_eq!(udp(&h, client, vip).2, be);
    assert_eq!(udp(&h, be, client).1, vip);
    age(&mut h, 35);
    assert_eq!(
        udp(&h, be, client),
        (TC_ACT_OK, vip, client),
        "server pushes after 35 s"
    );
    age(&mut h, 100);
    assert_eq!(udp(&h, client, vip).2, be, "udpStreamTimeout: 120 s");
    age(&mut h, 121);
    assert_eq!(
        udp(&h, be, client).0,
        TC_ACT_UNSPEC,
        "expired after 120 s idle"
    );
}

/// A NodePort with masquerade on ports 20000-20003 only.
fn tiny_port_range(h: &mut Harness) {
    configure_node_with(
        h,
        false,
        proxy_agent::dataplane::bpf::ConntrackOptions {
            masquerade_ports: (20_000, 20_003),
            ..Default::default()
        },
    );
    let (np, mut st) = frontend("192.0.2.10", 30080, Protocol::Tcp, &["10.244.2.9:8080"]);
    st.kind = FrontendKind::NodePort;
    h.apply(&NodeView::from([(np, st)]));
}

#[needs_root]
#[test]
fn masquerade_ports_of_closed_and_expired_flows_are_reused() {
    let mut h = Harness::new(&[]);
    tiny_port_range(&mut h);
    let np = sa("192.0.2.10:30080");
    let be = sa("10.244.2.9:8080");
    let outside = |i: u16| SocketAddr::new("198.51.100.7".parse().expect("ip"), 40_000 + i);
    let mut taken = Vec::new();
    for i in 0..4 {
        let (v, src, dst) = seg(&h, outside(i), np, SYN);
        assert_eq!((v, dst), (TC_ACT_OK, be));
        assert!((20_000..=20_003).contains(&src.port()), "{src}");
        seg(&h, be, src, SYN_ACK);
        seg(&h, outside(i), np, ACK);
        taken.push(src);
    }
    taken.sort();
    taken.dedup();
    assert_eq!(taken.len(), 4, "every port once");
    assert_eq!(
        seg(&h, outside(4), np, SYN).0,
        TC_ACT_SHOT,
        "all four in use"
    );
    assert_eq!(h.counter("snat_ports_exhausted"), 1);
    // The backend resets one connection: its port is free a second after its last packet.
    seg(&h, be, taken[0], RST);
    assert_eq!(
        seg(&h, outside(9), np, SYN).0,
        TC_ACT_SHOT,
        "a closed flow holds its tuple for a second"
    );
    age(&mut h, 2);
    let (v, src, _) = seg(&h, outside(5), np, SYN);
    assert_eq!(
        (v, src),
        (TC_ACT_OK, taken[0]),
        "the reset flow's port, reused"
    );
    // Unanswered flows give theirs back once they expire (60 s).
    assert_eq!(seg(&h, outside(6), np, SYN).0, TC_ACT_SHOT);
    age(&mut h, 61);
    let (v, src, _) = seg(&h, outside(7), np, SYN);
    assert_eq!(v, TC_ACT_OK, "an expired flow's port");
    assert_eq!(src, taken[0]);
    // The answered flows are established (24 h): theirs stay taken.
    assert_eq!(seg(&h, outside(8), np, SYN).0, TC_ACT_SHOT);
    assert!(h.counter("ct_reused") >= 2);
}

#[needs_root]
#[test]
fn a_syn_flood_evicts_no_answered_flow() {
    const ESTABLISHED: u16 = 200;
    const FLOOD: u32 = 20_000;
    let mut h = Harness::new(&[(map_names::CONNTRACK_NEW, 1_024)]);
    let (np, be) = node_port_to_remote_backend(&mut h);
    let client = |i: u16| SocketAddr::new("198.51.100.7".parse().expect("ip"), 40_000 + i);
    let mut masq = Vec::new();
    for i in 0..ESTABLISHED {
        let (_, src, _) = seg(&h, client(i), np, SYN);
        seg(&h, be, src, SYN_ACK);
        seg(&h, client(i), np, ACK);
        masq.push(src);
    }
    // Spoofed SYNs from 20k sources: each makes two entries and claims a port, and the
    // backend answers each with a SYN-ACK that no client acknowledges.
    let started = std::time::Instant::now();
    for n in 0..FLOOD {
        let spoofed = SocketAddr::new(
            std::net::Ipv4Addr::from(0xc612_0000 | n).into(),
            1_024 + (n % 60_000) as u16,
        );
        let (_, src, _) = seg(&h, spoofed, np, SYN);
        seg(&h, be, src, SYN_ACK);
    }
    let rate = f64::from(FLOOD) / started.elapsed().as_secs_f64();
    let mut kept = 0;
    for (i, src) in masq.iter().enumerate() {
        let fwd = seg(&h, client(i as u16), np, ACK);
        let back = seg(&h, be, *src, ACK);
        if fwd == (TC_ACT_OK, *src, be) && back.1 == np && back.2 == client(i as u16) {
            kept += 1;
        }
    }
    eprintln!(
        "SYN flood: {FLOOD} spoofed SYNs, each answered by the backend ({rate:.0} SYN + \
         SYN-ACK pairs/s through BPF_PROG_TEST_RUN), into a 1,024-entry new-flows table; \
         established flows kept: {kept}/{ESTABLISHED}"
    );
    assert_eq!(kept, ESTABLISHED, "every answered flow survives the flood");
    // No port of an answered flow was handed to a flooding one.
    let answered: std::collections::HashSet<CtKey> = h
        .maps
        .conntrack
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| k.dir == CT_DIR_REPLY)
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        answered.len(),
        usize::from(ESTABLISHED),
        "only established flows in the answered table, no half-open flooding one"
    );
    let clash = h
        .maps
        .conntrack_new
        .iter()
        .filter_map(Result::ok)
        .any(|(k, _)| answered.contains(&k));
    assert!(!clash, "a flooding flow got an answered flow's tuple");
}

/// Half-open flows cannot hold the masquerade ports (issue 42, item 6): when the range
/// runs short, a new flow takes the port of a TCP flow that was never assured (no SYN-ACK
/// seen, or one no client acknowledged: what a SYN flood leaves) and began over a second
/// ago, as netfilter's early drop takes unassured entries; within that second it keeps
/// it, and while the range has room nobody loses one. An assured flow's port is never
/// taken, in the answered table or (that table full) in the table of new flows.
#[needs_root]
#[test]
fn half_open_flows_give_their_masquerade_ports_to_new_flows() {
    let np = sa("192.0.2.10:30080");
    let be = sa("10.244.2.9:8080");
    let outside = |i: u16| SocketAddr::new("198.51.100.7".parse().expect("ip"), 40_000 + i);

    // With room in the range a half-open flow keeps its port, however old.
    let mut h = Harness::new(&[]);
    tiny_port_range(&mut h);
    seg(&h, outside(0), np, SYN);
    age(&mut h, 2);
    assert_eq!(seg(&h, outside(1), np, SYN).0, TC_ACT_OK);
    assert_eq!(h.counter("snat_port_reclaimed"), 0);
    assert_eq!(counts(&h), (0, 4), "both half-open flows kept");

    // Room for one answered flow: the second assured flow stays in the new-flows table.
    let mut h = Harness::new(&[(map_names::CONNTRACK, 2)]);
    tiny_port_range(&mut h);
    let mut assured = Vec::new();
    for i in 0..2 {
        let (v, src, dst) = seg(&h, outside(i), np, SYN);
        assert_eq!((v, dst), (TC_ACT_OK, be));
        seg(&h, be, src, SYN_ACK);
        seg(&h, outside(i), np, ACK);
        assured.push(src);
    }
    assert_eq!(
        (counts(&h), h.counter("ct_full")),
        ((2, 2), 1),
        "one assured flow answered, the other left in the new-flows table"
    );
    // The other two ports: a SYN never answered, and one whose SYN-ACK nobody
    // acknowledges (a flood's, spoofed or not).
    let (v, quiet, _) = seg(&h, outside(2), np, SYN);
    assert_eq!(v, TC_ACT_OK);
    let (v, syn_recv, _) = seg(&h, outside(3), np, SYN);
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(seg(&h, be, syn_recv, SYN_ACK).1, np);
    let half_open = [quiet, syn_recv];
    assert_eq!(
        seg(&h, outside(4), np, SYN).0,
        TC_ACT_SHOT,
        "within a second of their SYN, half-open flows keep their ports"
    );
    assert_eq!(h.counter("snat_port_reclaimed"), 0);

    age(&mut h, 2);
    let (v, src, dst) = seg(&h, outside(5), np, SYN);
    assert_eq!(
        (v, dst),
        (TC_ACT_OK, be),
        "a second later a new client gets a half-open flow's port"
    );
    assert!(half_open.contains(&src), "{src} of {half_open:?}");
    assert_eq!(h.counter("snat_port_reclaimed"), 1);
    // The flow that lost its port lost both entries: its client's ACK finds no flow.
    let loser = if src == quiet { 2 } else { 3 };
    assert_eq!(seg(&h, outside(loser), np, ACK).0, TC_ACT_SHOT);
    // The backend may still hold the lost flow's half-open socket on that tuple: it
    // answers the new SYN with that flow's ACK, the client resets it (which clears the
    // socket), and the client's retransmitted SYN finds its flow and port still there.
    assert_eq!(seg(&h, be, src, ACK), (TC_ACT_OK, np, outside(5)));
    assert_eq!(seg(&h, outside(5), np, RST), (TC_ACT_OK, src, be));
    let reused = h.counter("ct_reused");
    assert_eq!(
        seg(&h, outside(5), np, SYN),
        (TC_ACT_OK, src, be),
        "the retransmitted SYN keeps the port"
    );
    assert_eq!(
        h.counter("ct_reused"),
        reused,
        "a client's RST before its handshake does not close the flow"
    );
    assert_eq!(
        seg(&h, be, src, SYN_ACK),
        (TC_ACT_OK, np, outside(5)),
        "the new flow's answer reaches its client"
    );

    // A flood that goes on: every two seconds a new SYN, half of them answered by the
    // backend and never acknowledged. Each takes a half-open port (32 tries, 16 of which
    // may reclaim, over 4 ports), never an assured one.
    for r in 0..20u16 {
        age(&mut h, 2);
        let (v, src, _) = seg(&h, outside(10 + r), np, SYN);
        assert_eq!(v, TC_ACT_OK, "round {r}");
        assert!(
            half_open.contains(&src),
            "round {r}: {src} of {half_open:?}"
        );
        if r % 2 == 0 {
            seg(&h, be, src, SYN_ACK);
        }
    }
    assert_eq!(h.counter("snat_port_reclaimed"), 21);
    for (i, src) in assured.iter().enumerate() {
        let client = outside(i as u16);
        assert_eq!(
            seg(&h, client, np, ACK),
            (TC_ACT_OK, *src, be),
            "assured flow {i} kept its port"
        );
        assert_eq!(seg(&h, be, *src, ACK), (TC_ACT_OK, np, client));
    }
}

#[needs_root]
#[test]
fn one_client_port_to_two_frontends_sharing_a_backend() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    h.apply(&NodeView::from([
        frontend("10.96.0.10", 80, Protocol::Tcp, &["10.244.1.5:8080"]),
        frontend("10.96.0.11", 80, Protocol::Tcp, &["10.244.1.5:8080"]),
    ]));
    let (client, vip1, vip2, be) = (
        sa("10.244.0.3:40000"),
        sa("10.96.0.10:80"),
        sa("10.244.1.5:8080"),
        sa("10.244.1.5:8080"),
    );
    let vip2 = SocketAddr::new("10.96.0.11".parse().expect("ip"), vip2.port() - 8000);
    assert_eq!(seg(&h, client, vip1, SYN), (TC_ACT_OK, client, be));
    let (v, src2, dst2) = seg(&h, client, vip2, SYN);
    assert_eq!((v, dst2), (TC_ACT_OK, be));
    assert_eq!(src2.ip(), client.ip(), "the client's address is kept");
    assert_ne!(
        src2.port(),
        client.port(),
        "a new source port keeps the flows apart"
    );
    assert_eq!(seg(&h, be, client, SYN_ACK), (TC_ACT_OK, vip1, client));
    assert_eq!(seg(&h, be, src2, SYN_ACK), (TC_ACT_OK, vip2, client));
}

#[needs_root]
#[test]
fn the_collector_frees_expired_flows_and_orphans() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    clusterip(&mut h, &["10.244.1.5:8080"]);
    let (vip, be) = (sa("10.96.0.10:80"), sa("10.244.1.5:8080"));
    let client = |i: u16| SocketAddr::new("10.244.0.3".parse().expect("ip"), 40_000 + i);
    for i in 0..10 {
        seg(&h, client(i), vip, SYN);
        seg(&h, be, client(i), SYN_ACK);
        seg(&h, client(i), vip, ACK);
    }
    seg(&h, client(10), vip, SYN); // never answered
    seg(&h, be, client(0), RST); // closed
    // An orphaned reply entry (its flow gone), written 10 s ago.
    let (orphan_key, orphan) = h
        .maps
        .conntrack
        .iter()
        .filter_map(Result::ok)
        .find(|(k, _)| k.dir == CT_DIR_REPLY)
        .expect("a reply entry");
    let mut orphan_key = orphan_key;
    orphan_key.dport = 1u16.to_be();
    let orphan = CtValue {
        last_seen_ns: monotonic_ns() - 10_000_000_000,
        ..orphan
    };
    h.maps
        .conntrack
        .insert(&orphan_key, &orphan, 0)
        .expect("insert");
    let st = conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!(
        (st.answered, st.new, st.collected),
        (20, 2, 1),
        "only the orphan: {st:?}"
    );
    assert_eq!(
        st.answered_capacity,
        u64::from(proxy_common::capacity::CONNTRACK)
    );
    age(&mut h, 11);
    let st = conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!(
        (st.answered, st.new, st.collected),
        (18, 2, 2),
        "the reset flow: {st:?}"
    );
    age(&mut h, 50);
    let st = conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!(
        (st.answered, st.new, st.collected),
        (18, 0, 2),
        "the unanswered one: {st:?}"
    );
    // The established ones live on and still translate.
    assert_eq!(seg(&h, be, client(3), ACK).1, vip);
}

/// A flow netfilter translated before the classifier was attached (in `NETFILTER_FLOWS`,
/// as the agent writes it from the kernel's conntrack table at start): its mid-stream
/// segments go on untouched to netfilter instead of being dropped as `ct_invalid`, and a
/// SYN on its tuple is a new connection of ours.
#[needs_root]
#[test]
fn a_flow_netfilter_translated_before_us_is_left_to_it() {
    let (mut h, client, vip, be) = one_clusterip();
    let other = sa("10.244.0.4:40001");
    let (saddr, family) = proxy_common::addr::to_words(client.ip());
    let key = CtKey {
        saddr,
        daddr: proxy_common::addr::to_words(vip.ip()).0,
        sport: client.port().to_be(),
        dport: vip.port().to_be(),
        proto: proxy_common::PROTO_TCP,
        family,
        dir: CT_DIR_FORWARD,
        _pad: 0,
    };
    h.maps
        .netfilter_flows
        .insert(&key, &1, 0)
        .expect("NETFILTER_FLOWS");

    assert_eq!(
        seg(&h, client, vip, ACK),
        (TC_ACT_UNSPEC, client, vip),
        "left to netfilter, untouched"
    );
    assert_eq!(
        seg(&h, other, vip, ACK).0,
        TC_ACT_SHOT,
        "a flow nobody knows"
    );
    assert_eq!(
        (h.counter("netfilter_pass"), h.counter("ct_invalid")),
        (1, 1)
    );
    assert_eq!(counts(&h), (0, 0), "no flow of ours for either");

    assert_eq!(
        seg(&h, client, vip, SYN),
        (TC_ACT_OK, client, be),
        "a SYN on the tuple: a new connection, ours"
    );
    assert_eq!(seg(&h, client, vip, ACK).2, be, "and then its segments too");
}

/// A socket address's port as the maps hold it (network byte order).
fn port_be(a: SocketAddr) -> u16 {
    a.port().to_be()
}

/// The flow's reply entry's `frontend_node` (the one flow in the tables).
fn reply_frontend_node(h: &Harness) -> Option<u8> {
    h.ct_entries()
        .iter()
        .find(|(k, _)| k.dir == CT_DIR_REPLY)
        .map(|(_, v)| v.frontend_node)
}

/// Every byte of a port filter cleared, as in a filter made new.
fn clear(filter: &mut port_filters::PortFilter) {
    for idx in 0..proxy_common::capacity::REPLY_PORTS {
        filter
            .set(idx, &[0u8; proxy_common::PORTS_PER_ENTRY], 0)
            .expect("clear");
    }
}

/// The reply-port filter: a flow marks its backend's port before its reply entry is
/// written; a packet from an unmarked port is not probed as a reply. A filter emptied
/// (as one made new beside older flow tables is) leaves the live flow's replies
/// untranslated until the agent marks the ports of the tracked flows again.
#[needs_root]
#[test]
fn replies_are_probed_only_from_marked_ports_and_the_marks_rebuild_from_the_flows() {
    let (mut h, client, vip, be) = one_clusterip();
    assert!(!marked(&h.maps.reply_ports, port_be(be)).expect("read"));
    assert_eq!(seg(&h, client, vip, SYN), (TC_ACT_OK, client, be));
    assert!(marked(&h.maps.reply_ports, port_be(be)).expect("read"));
    assert!(
        !marked(&h.maps.reply_ports, port_be(client)).expect("read"),
        "a client's port is no reply tuple's source port"
    );
    assert_eq!(
        reply_frontend_node(&h),
        Some(0),
        "not known before the first reply"
    );
    assert_eq!(seg(&h, be, client, SYN_ACK), (TC_ACT_OK, vip, client));
    assert_eq!(
        reply_frontend_node(&h),
        Some(proxy_common::CT_NODE_NO),
        "the first reply learns the ClusterIP is no node address, for the next ones"
    );
    assert_eq!(seg(&h, client, vip, ACK), (TC_ACT_OK, client, be));
    assert_eq!(seg(&h, be, client, ACK), (TC_ACT_OK, vip, client));

    // The marks gone (a filter made new while this flow lives): its reply is not
    // looked up, so it leaves untranslated.
    clear(&mut h.maps.reply_ports);
    let (_, src, _) = seg(&h, be, client, ACK);
    assert_eq!(src, be, "no mark: no reply probe");

    // The start's pass over the tables marks the flow's port again.
    let fresh = Fresh {
        reply_ports: true,
        frontend_ports: false,
    };
    let marked_now = port_backfill::mark_from_tables(&mut h.maps, fresh).expect("mark");
    assert_eq!(marked_now, (1, 0), "one reply tuple's source port");
    assert_eq!(seg(&h, be, client, ACK), (TC_ACT_OK, vip, client));
    assert_eq!(seg(&h, client, vip, ACK), (TC_ACT_OK, client, be));
}

/// The frontend-port filter: the agent marks a frontend's port before its service entry;
/// a packet to an unmarked port passes without a flow or service lookup. A frontend's
/// removal keeps its mark, so its live flow goes on; an emptied filter (one made new)
/// is filled again from the service entries and the flows' forward entries.
#[needs_root]
#[test]
fn frontend_ports_are_marked_before_their_services_and_kept_for_live_flows() {
    let (mut h, client, vip, be) = one_clusterip();
    assert!(marked(&h.maps.frontend_ports, port_be(vip)).expect("read"));
    assert!(!marked(&h.maps.frontend_ports, 81u16.to_be()).expect("read"));
    assert_eq!(seg(&h, client, vip, SYN), (TC_ACT_OK, client, be));
    assert_eq!(seg(&h, be, client, SYN_ACK), (TC_ACT_OK, vip, client));
    assert_eq!(seg(&h, client, vip, ACK), (TC_ACT_OK, client, be));

    // Emptied: the VIP's packets are no longer looked at at all.
    clear(&mut h.maps.frontend_ports);
    let other = sa("10.244.0.3:40001");
    assert_eq!(seg(&h, other, vip, SYN), (TC_ACT_UNSPEC, other, vip));
    assert_eq!(seg(&h, client, vip, ACK), (TC_ACT_UNSPEC, client, vip));
    let fresh = Fresh {
        reply_ports: false,
        frontend_ports: true,
    };
    let marked_now = port_backfill::mark_from_tables(&mut h.maps, fresh).expect("mark");
    assert_eq!(
        marked_now,
        (0, 1),
        "the frontend's port, from its entry and its flow"
    );
    assert_eq!(seg(&h, client, vip, ACK), (TC_ACT_OK, client, be));

    // The frontend removed: its port stays marked, and its established flow keeps its
    // backend (kube-proxy's conntrack does the same).
    h.apply(&NodeView::new());
    assert!(marked(&h.maps.frontend_ports, port_be(vip)).expect("read"));
    assert_eq!(seg(&h, client, vip, ACK), (TC_ACT_OK, client, be));
    assert_eq!(seg(&h, be, client, ACK), (TC_ACT_OK, vip, client));

    // Without the flow entries either, only the service entries fill it: a live flow
    // whose frontend is gone would pass untranslated, hence the flows' pass.
    clear(&mut h.maps.frontend_ports);
    for table in [&mut h.maps.conntrack, &mut h.maps.conntrack_new] {
        let keys: Vec<CtKey> = table.keys().filter_map(Result::ok).collect();
        for k in keys {
            table.remove(&k).expect("remove");
        }
    }
    let marked_now = port_backfill::mark_from_tables(&mut h.maps, fresh).expect("mark");
    assert_eq!(
        marked_now,
        (0, 0),
        "no service entry and no flow: nothing to mark"
    );
}

/// A frontend on the node's own address (an eTP Local NodePort, its outside client kept):
/// the first reply learns so into the reply entry, and every reply, first or later,
/// leaves as the NodePort.
#[needs_root]
#[test]
fn replies_of_a_node_address_frontend_learn_it_once() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let (np, mut st) = frontend("192.0.2.10", 30080, Protocol::Tcp, &["10.244.1.5:8080"]);
    st.kind = FrontendKind::NodePort;
    st.external_local = true;
    h.apply(&NodeView::from([(np, st)]));
    let (client, nodeport, be) = (
        sa("198.51.100.7:41000"),
        sa("192.0.2.10:30080"),
        sa("10.244.1.5:8080"),
    );
    assert_eq!(seg(&h, client, nodeport, SYN).2, be);
    assert_eq!(reply_frontend_node(&h), Some(0));
    let (_, src, dst) = seg(&h, be, client, SYN_ACK);
    assert_eq!((src, dst), (nodeport, client));
    assert_eq!(reply_frontend_node(&h), Some(proxy_common::CT_NODE_YES));
    assert_eq!(seg(&h, client, nodeport, ACK).2, be);
    let (_, src, dst) = seg(&h, be, client, ACK);
    assert_eq!(
        (src, dst),
        (nodeport, client),
        "a later reply, from what was learnt"
    );
}

/// `one_clusterip` with the client's flow through it answered (its handshake done: both
/// entries in the answered table).
fn answered_clusterip() -> (Harness, SocketAddr, SocketAddr, SocketAddr) {
    let (h, client, vip, be) = one_clusterip();
    seg(&h, client, vip, SYN);
    seg(&h, be, client, SYN_ACK);
    seg(&h, client, vip, ACK);
    assert_eq!(counts(&h), (2, 0), "answered");
    (h, client, vip, be)
}

/// The answered flow's two entries: (forward, reply).
fn answered_pair(h: &Harness) -> (CtValue, CtValue) {
    let all: Vec<(CtKey, CtValue)> = h.maps.conntrack.iter().filter_map(Result::ok).collect();
    let find = |dir| {
        all.iter()
            .find(|(k, _)| k.dir == dir)
            .map(|(_, v)| *v)
            .expect("an entry of that direction")
    };
    (find(CT_DIR_FORWARD), find(CT_DIR_REPLY))
}

const S: u64 = 1_000_000_000;

/// A reply that changes no state goes alone: translated from its entry, which it
/// stamps, the forward entry untouched; such replies alone keep the flow alive past its
/// forward entry's stamp, for the programs and for the collector.
#[needs_root]
#[test]
fn replies_go_alone_and_keep_their_flow_alive() {
    let (mut h, client, vip, be) = answered_clusterip();

    age(&mut h, 100);
    let (fwd, _) = answered_pair(&h);
    assert_eq!(seg(&h, be, client, ACK), (TC_ACT_OK, vip, client));
    let (f, r) = answered_pair(&h);
    assert_eq!(
        f.last_seen_ns, fwd.last_seen_ns,
        "the forward entry untouched"
    );
    assert!(
        r.last_seen_ns > f.last_seen_ns + 90 * S,
        "the reply stamped its own entry"
    );

    // Only the server speaks for most of a day, then the client is silent past the
    // established limit (24 h) by its own stamp: the flow lives on.
    age(&mut h, 86_000);
    assert_eq!(
        seg(&h, be, client, ACK).1,
        vip,
        "the server, after 86,000 s"
    );
    age(&mut h, 1_000);
    let st = conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!(st.collected, 0, "alive by its replies: {st:?}");
    assert_eq!(
        seg(&h, client, vip, ACK),
        (TC_ACT_OK, client, be),
        "the client, 87,100 s after its last packet, keeps its backend"
    );
    assert_eq!(h.counter("ct_reused"), 0, "the same flow, not a new one");
    let (f, _) = answered_pair(&h);
    assert!(
        f.last_seen_ns > monotonic_ns() - 10 * S,
        "the forward entry stamped again"
    );

    // Both silent past the limit: gone.
    age(&mut h, 86_500);
    let st = conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!((st.collected, st.answered), (2, 0), "{st:?}");
}

/// A FIN from either side marks both entries; the closing flow's replies take the
/// forward entry's state and limit again (every reply stamps it).
#[needs_root]
#[test]
fn a_closing_flows_replies_no_longer_go_alone() {
    let (mut h, client, vip, be) = answered_clusterip();
    let fin = proxy_common::CT_F_FIN_ORIG;
    assert_eq!(answered_pair(&h).1.flags & fin, 0);
    assert_eq!(seg(&h, client, vip, FIN_ACK).2, be);
    let (f, r) = answered_pair(&h);
    assert_ne!(f.flags & fin, 0, "the forward entry's state");
    assert_ne!(r.flags & fin, 0, "and the reply entry's");

    age(&mut h, 100);
    assert_eq!(seg(&h, be, client, ACK).1, vip);
    let (f, _) = answered_pair(&h);
    assert!(
        f.last_seen_ns > monotonic_ns() - 10 * S,
        "the reply stamped the forward entry"
    );
    // The server's FIN, then netfilter's TIME_WAIT (120 s) by the forward entry.
    seg(&h, be, client, FIN_ACK);
    let (f, r) = answered_pair(&h);
    let fin_reply = proxy_common::CT_F_FIN_REPLY;
    assert_ne!(f.flags & fin_reply, 0);
    assert_ne!(r.flags & fin_reply, 0);
    age(&mut h, 121);
    assert_eq!(
        seg(&h, be, client, ACK).0,
        TC_ACT_UNSPEC,
        "TIME_WAIT over: the late reply is not translated"
    );
}

/// Issue 42, item 3: a table of answered flows filled to the brim — with flows that
/// carry nothing more, as a forger's would — keeps a real flow unanswered (and
/// evictable) only until the collector's next pass: past 90% the idlest flows go, down to
/// 80%, the ones in use stay, and the waiting flow's next segment is answered.
#[needs_root]
#[test]
fn a_full_answered_table_makes_room_for_the_next_answer() {
    let mut h = Harness::new(&[(map_names::CONNTRACK, 100)]);
    let (np, be) = node_port_to_remote_backend(&mut h);
    let client = |i: u16| SocketAddr::new("198.51.100.7".parse().expect("ip"), 40_000 + i);
    let open = |h: &Harness, i: u16| {
        let (_, src, _) = seg(h, client(i), np, SYN);
        seg(h, be, src, SYN_ACK);
        seg(h, client(i), np, ACK);
        src
    };
    let masq: Vec<SocketAddr> = (0..50).map(|i| open(&h, i)).collect();
    assert_eq!(h.maps.conntrack.iter().count(), 100, "full");
    let waiting = open(&h, 50);
    assert!(h.counter("ct_full") >= 1, "no room for the 51st");
    // Flows 0..10 had answers from the backend (then idled longest); the last ten are in
    // use; the others never heard from the backend after the handshake, as a forger's.
    for src in &masq[..10] {
        seg(&h, be, *src, ACK);
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    for i in 40..50 {
        seg(&h, client(i), np, ACK);
    }
    let st = conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!((st.evicted, st.answered), (20, 80), "{st:?}");
    let answered: Vec<CtKey> = h.maps.conntrack.keys().filter_map(Result::ok).collect();
    let kept = |i: u16| {
        answered
            .iter()
            .any(|k| k.dir == CT_DIR_FORWARD && k.sport == client(i).port().to_be())
    };
    for i in (0..10).chain(40..50) {
        assert!(kept(i), "flow {i}, answered by its backend or in use, kept");
    }
    assert_eq!(
        (10..40).filter(|i| !kept(*i)).count(),
        10,
        "ten silent flows gone"
    );
    // The waiting flow's next segment: answered now.
    assert_eq!(seg(&h, client(50), np, ACK), (TC_ACT_OK, waiting, be));
    assert_eq!(
        h.maps.conntrack.iter().count(),
        82,
        "the 51st flow answered"
    );
}

/// Node-a configured, with NodePort 192.0.2.10:30080 to 10.244.2.9:8080 (another
/// node's pod: masqueraded): the frontend and the backend.
fn node_port_to_remote_backend(h: &mut Harness) -> (SocketAddr, SocketAddr) {
    configure_node(h, false);
    let (np, mut st) = frontend("192.0.2.10", 30080, Protocol::Tcp, &["10.244.2.9:8080"]);
    st.kind = FrontendKind::NodePort;
    h.apply(&NodeView::from([(np, st)]));
    (sa("192.0.2.10:30080"), sa("10.244.2.9:8080"))
}
