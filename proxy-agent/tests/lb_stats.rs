//! Per-frontend and per-backend statistics through the real classifier
//! (`BPF_PROG_TEST_RUN`): a TCP flow's connection, packets and bytes each way land in its
//! (frontend, backend) pair of `LB_STATS` and in `dump --stats`'s rows and table; the two
//! scopes of a frontend make one row; a backend behind two frontends counts under each
//! apart, as IPVS counts a real server per virtual service; the collector recounts
//! `ACTIVE_CONNS` from live flows, folds a removed backend's counts into its frontend's
//! and drops those of removed frontends. An answered flow counts in its own entries,
//! and its counts survive whoever removes them: the programs, the collector, the
//! writer clearing a removed UDP backend's flows. Root only.

mod support;

use std::net::SocketAddr;

use proxy_agent::{
    dataplane::bpf::{
        conntrack_gc::{self, monotonic_ns},
        stats::{self, Totals},
    },
    model::{BackendSet, FrontendKind, NodeView, Protocol, WhenEmpty},
    trace::packet::{fold, sum16},
};
use proxy_common::{CT_DIR_FORWARD, CtKey, CtValue, ServiceValue, StatsKey};
use support::tc_harness::*;
use test_support::needs_root;

const SYN: u8 = 0x02;
const SYN_ACK: u8 = 0x12;
const PSH_ACK: u8 = 0x18;
const RST: u8 = 0x04;

const VIP: &str = "10.96.0.10:80";
const BACKEND: &str = "10.244.1.5:8080";
const CLIENT: &str = "10.244.0.3:40000";

/// An IPv4 TCP segment with `extra` bytes of data after the builder's five, checksums
/// valid (the program updates them incrementally, so `inspect` would catch a bad one).
fn tcp_data(src: SocketAddr, dst: SocketAddr, flags: u8, extra: usize) -> Vec<u8> {
    let mut p = tcp_with_flags(src, dst, flags);
    p.resize(p.len() + extra, b'x');
    let ip_len = (p.len() - 14) as u16;
    p[16..18].copy_from_slice(&ip_len.to_be_bytes());
    p[24..26].fill(0);
    let c = fold(sum16(&p[14..34], 0));
    p[24..26].copy_from_slice(&c.to_be_bytes());
    p[50..52].fill(0);
    let mut pseudo = p[26..34].to_vec();
    pseudo.extend_from_slice(&[0, 6]);
    pseudo.extend_from_slice(&((p.len() - 34) as u16).to_be_bytes());
    let c = fold(sum16(&p[34..], sum16(&pseudo, 0)));
    p[50..52].copy_from_slice(&c.to_be_bytes());
    p
}

/// Runs a packet the program must translate; returns its length.
fn run_ok(h: &Harness, pkt: &[u8]) -> u64 {
    let (verdict, out) = h.run(pkt);
    assert_eq!(verdict, TC_ACT_OK, "translated and passed on");
    inspect(&out);
    pkt.len() as u64
}

/// The service entries, by scope.
fn entries(h: &Harness) -> Vec<ServiceValue> {
    let mut v: Vec<(u8, ServiceValue)> = h
        .maps
        .services
        .iter()
        .map(|e| e.expect("SERVICES entry"))
        .map(|(k, v)| (k.scope, v))
        .collect();
    v.sort_by_key(|(scope, _)| *scope);
    v.into_iter().map(|(_, v)| v).collect()
}

/// A frontend's pairs, summed.
fn lb_stats(h: &Harness, rev_nat_id: u32) -> Totals {
    let mut t = Totals::default();
    for entry in h.maps.lb_stats.iter() {
        let (key, per_cpu) = entry.expect("LB_STATS entry");
        if key.rev_nat_id == rev_nat_id {
            t += per_cpu.iter().sum::<Totals>();
        }
    }
    t
}

fn pair_stats(h: &Harness, rev_nat_id: u32, backend_id: u32) -> Option<Totals> {
    let key = StatsKey {
        rev_nat_id,
        backend_id,
    };
    h.maps
        .lb_stats
        .get(&key, 0)
        .ok()
        .map(|per_cpu| per_cpu.iter().sum())
}

/// The node with one ClusterIP (`ip`:`port`) and its one backend.
fn one_frontend(ip: &str, port: u16, protocol: Protocol, backend: &str) -> Harness {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    h.apply(&NodeView::from([frontend(ip, port, protocol, &[backend])]));
    h
}

/// A ClusterIP, one client's TCP flow through it: SYN, SYN-ACK, data. Returns the
/// harness and what the flow's packets should have added up to.
fn one_flow() -> (Harness, Totals) {
    let h = one_frontend("10.96.0.10", 80, Protocol::Tcp, BACKEND);
    let syn = run_ok(&h, &tcp_with_flags(sa(CLIENT), sa(VIP), SYN));
    let syn_ack = run_ok(&h, &tcp_with_flags(sa(BACKEND), sa(CLIENT), SYN_ACK));
    let data = run_ok(&h, &tcp_data(sa(CLIENT), sa(VIP), PSH_ACK, 100));
    assert_eq!((syn, syn_ack, data), (59, 59, 159), "frame lengths");
    let expected = Totals {
        conns: 1,
        packets_in: 2,
        bytes_in: syn + data,
        packets_out: 1,
        bytes_out: syn_ack,
    };
    (h, expected)
}

#[needs_root]
#[test]
fn a_tcp_flow_is_counted_per_frontend_and_per_backend() {
    let (h, expected) = one_flow();
    let [svc] = entries(&h)[..] else {
        panic!("one service entry")
    };
    assert_eq!(lb_stats(&h, svc.rev_nat_id), expected, "LB_STATS, summed");
    let backend_id = h
        .maps
        .backends
        .keys()
        .next()
        .expect("one backend")
        .expect("key");
    assert_eq!(
        pair_stats(&h, svc.rev_nat_id, backend_id),
        Some(expected),
        "the pair's entry"
    );
    assert_eq!(h.maps.lb_stats.keys().count(), 1, "one pair counted");

    let rows = stats::read(&h.maps).expect("read");
    let [row] = &rows[..] else {
        panic!("one row: {rows:?}")
    };
    assert_eq!(
        (row.address, row.protocol, row.scheduler),
        (sa(VIP), Protocol::Tcp, "random")
    );
    assert_eq!(row.service_ids, [svc.id]);
    assert_eq!(row.stats, expected);
    let [b] = &row.backends[..] else {
        panic!("one backend: {:?}", row.backends)
    };
    assert_eq!((b.address, b.id, b.weight), (sa(BACKEND), backend_id, 1));
    assert_eq!(b.stats, expected);

    let totals = stats::frontend_totals(&h.maps).expect("totals");
    assert_eq!(
        totals.into_iter().collect::<Vec<_>>(),
        [(row.frontend(), expected)],
        "what /metrics reads"
    );
}

#[needs_root]
#[test]
fn dump_stats_shows_the_flow_and_its_open_connection() {
    let (mut h, _) = one_flow();
    conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    let table = stats::render_table(&stats::read(&h.maps).expect("read"), false);
    let expected = "\
Prot LocalAddress:Port Scheduler  Weight ActiveConn    Conns   InPkts  OutPkts  InBytes OutBytes
  -> RemoteAddress:Port
TCP  10.96.0.10:80 random                                  1        2        1      218       59
  -> 10.244.1.5:8080                   1          1        1        2        1      218       59
";
    assert_eq!(table, expected, "got:\n{table}");
}

/// An `externalTrafficPolicy: Local` NodePort has an external and an internal entry:
/// one row with both entries' counts, each backend once.
#[needs_root]
#[test]
fn both_scopes_of_a_frontend_make_one_row() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    let (np, mut st) = frontend("192.0.2.10", 30080, Protocol::Tcp, &[BACKEND]);
    st.kind = FrontendKind::NodePort;
    st.external_local = true;
    st.internal = Some(Box::new(BackendSet {
        endpoints: [sa(BACKEND), sa("10.244.2.6:8080")].into(),
        when_empty: WhenEmpty::Reject,
    }));
    h.apply(&NodeView::from([(np, st)]));
    let scopes = entries(&h);
    assert_eq!(scopes.len(), 2, "external and internal entries");
    let node_port = sa("192.0.2.10:30080");
    let outside = tcp_with_flags(sa("198.51.100.7:40000"), node_port, SYN);
    let pod = tcp_with_flags(sa(CLIENT), node_port, SYN);
    for pkt in [&outside, &pod] {
        let (verdict, _) = h.run(pkt);
        assert_ne!(verdict, TC_ACT_SHOT, "a new flow");
    }
    for v in &scopes {
        assert_eq!(lb_stats(&h, v.rev_nat_id).conns, 1, "one flow per scope");
    }

    let rows = stats::read(&h.maps).expect("read");
    let [row] = &rows[..] else {
        panic!("one row for both scopes: {rows:?}")
    };
    let mut ids: Vec<u32> = scopes.iter().map(|v| v.id).collect();
    ids.sort_unstable();
    assert_eq!(row.service_ids, ids);
    assert_eq!(
        row.stats,
        Totals {
            conns: 2,
            packets_in: 2,
            bytes_in: (outside.len() + pod.len()) as u64,
            ..Totals::default()
        }
    );
    let backends: Vec<SocketAddr> = row.backends.iter().map(|b| b.address).collect();
    assert_eq!(backends, [sa(BACKEND), sa("10.244.2.6:8080")], "each once");
    let per_backend: u64 = row.backends.iter().map(|b| b.stats.conns).sum();
    assert_eq!(per_backend, 2, "the two flows, on whichever backends");
}

#[needs_root]
#[test]
fn the_collector_recounts_active_connections_and_drops_stats_of_removed_entries() {
    let (mut h, expected) = one_flow();
    let old_backend = h
        .maps
        .backends
        .keys()
        .next()
        .expect("one backend")
        .expect("key");
    // Drifted counts: a lost decrement, and a backend with no flows at all.
    h.maps
        .active_conns
        .insert(&old_backend, &5, 0)
        .expect("insert");
    h.maps.active_conns.insert(&4242, &3, 0).expect("insert");
    conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!(h.maps.active_conns.get(&old_backend, 0).ok(), Some(1));
    assert!(
        h.maps.active_conns.get(&4242, 0).is_err(),
        "no flows: no entry"
    );

    // The flow closes: no longer active.
    run_ok(&h, &tcp_with_flags(sa(CLIENT), sa(VIP), RST));
    conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert!(h.maps.active_conns.get(&old_backend, 0).is_err(), "closed");

    // The backend leaves the Service: its pair goes, folded into the frontend's.
    let [svc] = entries(&h)[..] else {
        panic!("one service entry")
    };
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.2.6:8080"],
    )]));
    assert!(h.maps.backends.get(&old_backend, 0).is_err(), "removed");
    conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!(pair_stats(&h, svc.rev_nat_id, old_backend), None);
    let folded = pair_stats(&h, svc.rev_nat_id, 0).expect("the frontend's removed backends");
    assert_eq!(
        (folded.conns, folded.packets_in),
        (1, 2),
        "the flow's packets before it was answered (its RST counts in its live entry)"
    );
    let rows = stats::read(&h.maps).expect("read");
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].stats.conns, expected.conns,
        "the frontend keeps its count"
    );
    assert_eq!(
        rows[0].stats.packets_in,
        expected.packets_in + 1,
        "and the RST"
    );
    let backends: Vec<SocketAddr> = rows[0].backends.iter().map(|b| b.address).collect();
    assert_eq!(backends, [sa("10.244.2.6:8080")]);
    assert_eq!(rows[0].backends[0].stats, Totals::default());

    // The frontend goes too.
    h.apply(&NodeView::new());
    conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!(h.maps.lb_stats.keys().count(), 0, "LB_STATS emptied");
    assert!(stats::read(&h.maps).expect("read").is_empty());
    assert!(stats::frontend_totals(&h.maps).expect("totals").is_empty());
}

/// One endpoint behind two ClusterIPs (one backend id): each frontend's row counts only
/// its own flows to it, as IPVS counts a real server per virtual service.
#[needs_root]
#[test]
fn a_backend_of_two_frontends_counts_under_each_apart() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    h.apply(&NodeView::from([
        frontend("10.96.0.10", 80, Protocol::Tcp, &[BACKEND]),
        frontend("10.96.0.11", 80, Protocol::Tcp, &[BACKEND]),
    ]));
    assert_eq!(h.maps.backends.keys().count(), 1, "one backend id");
    run_ok(&h, &tcp_with_flags(sa(CLIENT), sa(VIP), SYN));
    run_ok(&h, &tcp_with_flags(sa("10.244.0.3:40001"), sa(VIP), SYN));
    run_ok(&h, &tcp_with_flags(sa(CLIENT), sa("10.96.0.11:80"), SYN));
    let rows = stats::read(&h.maps).expect("read");
    let conns: Vec<(SocketAddr, u64, u64)> = rows
        .iter()
        .map(|r| (r.address, r.stats.conns, r.backends[0].stats.conns))
        .collect();
    assert_eq!(
        conns,
        [(sa(VIP), 2, 2), (sa("10.96.0.11:80"), 1, 1)],
        "(frontend, its connections, the backend's under it)"
    );
}

/// The answered flows' entries holding counts, with their keys.
fn counting_entries(h: &Harness) -> Vec<(CtKey, CtValue)> {
    h.maps
        .conntrack
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, v)| v.packets > 0)
        .collect()
}

fn only_backend(h: &Harness) -> u32 {
    h.maps
        .backends
        .keys()
        .next()
        .expect("one backend")
        .expect("key")
}

/// `one_flow`, then more packets both ways once the flow is answered: they count in the
/// flow's entries, not in its pair's `LB_STATS` entry, and every reader adds them.
fn answered_flow() -> (Harness, Totals, Totals) {
    let (h, before) = one_flow();
    assert!(
        h.maps.conntrack_new.keys().next().is_none(),
        "the flow moved to the answered table"
    );
    let a = run_ok(&h, &tcp_data(sa(CLIENT), sa(VIP), PSH_ACK, 300));
    let b = run_ok(&h, &tcp_data(sa(CLIENT), sa(VIP), PSH_ACK, 7));
    let c = run_ok(&h, &tcp_data(sa(BACKEND), sa(CLIENT), PSH_ACK, 1000));
    let answered = Totals {
        packets_in: 2,
        bytes_in: a + b,
        packets_out: 1,
        bytes_out: c,
        ..Totals::default()
    };
    let mut total = before;
    total += answered;
    (h, before, total)
}

#[needs_root]
#[test]
fn an_answered_flow_counts_in_its_entries_and_every_reader_adds_them() {
    let (h, before, total) = answered_flow();
    let [svc] = entries(&h)[..] else {
        panic!("one service entry")
    };
    let backend_id = only_backend(&h);
    assert_eq!(
        pair_stats(&h, svc.rev_nat_id, backend_id),
        Some(before),
        "the pair's entry holds only the packets before the flow was answered"
    );
    let mut held: Vec<(u8, u64, u64)> = counting_entries(&h)
        .iter()
        .map(|(k, v)| (k.dir, v.packets, v.bytes))
        .collect();
    held.sort_unstable();
    assert_eq!(
        held,
        [
            (CT_DIR_FORWARD, 2, total.bytes_in - before.bytes_in),
            (1, 1, total.bytes_out - before.bytes_out)
        ],
        "(direction, packets, bytes) in the flow's two entries"
    );
    let rows = stats::read(&h.maps).expect("read");
    assert_eq!(rows[0].stats, total, "dump --stats: the frontend");
    assert_eq!(rows[0].backends[0].stats, total, "and its backend");
    let totals = stats::frontend_totals(&h.maps).expect("totals");
    assert_eq!(
        totals.values().copied().collect::<Vec<_>>(),
        [total],
        "/metrics"
    );
}

/// The programs remove a flow (a SYN reopening it after its RST): its entries' counts
/// go to the pair first.
#[needs_root]
#[test]
fn a_flow_the_programs_remove_leaves_its_counts_to_its_pair() {
    let (h, _, mut total) = answered_flow();
    let [svc] = entries(&h)[..] else {
        panic!("one service entry")
    };
    let backend_id = only_backend(&h);
    let rst = run_ok(&h, &tcp_with_flags(sa(CLIENT), sa(VIP), RST));
    let syn = run_ok(&h, &tcp_with_flags(sa(CLIENT), sa(VIP), SYN));
    total += Totals {
        conns: 1,
        packets_in: 2,
        bytes_in: rst + syn,
        ..Totals::default()
    };
    assert!(
        counting_entries(&h).is_empty(),
        "the old flow's entries are gone, the new one is unanswered"
    );
    assert_eq!(
        pair_stats(&h, svc.rev_nat_id, backend_id),
        Some(total),
        "everything in the pair's entry now"
    );
    assert_eq!(stats::read(&h.maps).expect("read")[0].stats, total);
}

/// The collector expires the flow: its entries' counts go to the pair's `ended` entry
/// (the agent's own), the totals unchanged; once the backend leaves, they fold into the
/// frontend's removed backends with the rest.
#[needs_root]
#[test]
fn a_flow_the_collector_expires_keeps_its_counts() {
    let (mut h, before, total) = answered_flow();
    let [svc] = entries(&h)[..] else {
        panic!("one service entry")
    };
    let backend_id = only_backend(&h);
    let a_day_later = monotonic_ns() + 86_400_000_000_000;
    let st = conntrack_gc::collect(&mut h.maps, a_day_later).expect("collect");
    assert_eq!(st.collected, 2, "both entries expired");
    assert!(h.maps.conntrack.keys().next().is_none());
    let ended = StatsKey::ended(svc.rev_nat_id, backend_id);
    let held: Totals = h
        .maps
        .lb_stats
        .get(&ended, 0)
        .expect("the pair's ended entry")
        .iter()
        .sum();
    let mut moved = total;
    moved.conns -= before.conns;
    moved.packets_in -= before.packets_in;
    moved.bytes_in -= before.bytes_in;
    moved.packets_out -= before.packets_out;
    moved.bytes_out -= before.bytes_out;
    assert_eq!(held, moved, "what the entries held");
    let rows = stats::read(&h.maps).expect("read");
    assert_eq!(rows[0].stats, total, "the totals unchanged");
    assert_eq!(rows[0].backends[0].stats, total);

    // The backend leaves: its pair and its ended entry fold into the frontend's.
    h.apply(&NodeView::from([frontend(
        "10.96.0.10",
        80,
        Protocol::Tcp,
        &["10.244.2.6:8080"],
    )]));
    conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert!(h.maps.lb_stats.get(&ended, 0).is_err(), "folded and gone");
    assert_eq!(
        pair_stats(&h, svc.rev_nat_id, 0),
        Some(total),
        "the frontend's removed backends"
    );
    assert_eq!(stats::read(&h.maps).expect("read")[0].stats, total);

    // The frontend goes: nothing left.
    h.apply(&NodeView::new());
    conntrack_gc::collect(&mut h.maps, monotonic_ns()).expect("collect");
    assert_eq!(h.maps.lb_stats.keys().count(), 0, "LB_STATS emptied");
}

/// A UDP backend leaves its frontend: the writer clears its flows at once (kube-proxy's
/// conntrack flush), their counts kept in the pair's `ended` entry.
#[needs_root]
#[test]
fn a_udp_flow_the_writer_clears_keeps_its_counts() {
    let dns = "10.96.0.53:53";
    let (backend, other) = ("10.244.1.5:5353", "10.244.2.6:5353");
    let mut h = one_frontend("10.96.0.53", 53, Protocol::Udp, backend);
    let query = run_ok(&h, &packet(sa(CLIENT), sa(dns), false));
    let answer = run_ok(&h, &packet(sa(backend), sa(CLIENT), false));
    // Answered (a UDP flow is, at its first reply): these count in its entries.
    let q2 = run_ok(&h, &packet(sa(CLIENT), sa(dns), false));
    let a2 = run_ok(&h, &packet(sa(backend), sa(CLIENT), false));
    assert_eq!(counting_entries(&h).len(), 2, "both entries count");
    let total = Totals {
        conns: 1,
        packets_in: 2,
        bytes_in: query + q2,
        packets_out: 2,
        bytes_out: answer + a2,
    };
    let [svc] = entries(&h)[..] else {
        panic!("one service entry")
    };
    let backend_id = only_backend(&h);
    assert_eq!(stats::read(&h.maps).expect("read")[0].stats, total);

    h.apply(&NodeView::from([frontend(
        "10.96.0.53",
        53,
        Protocol::Udp,
        &[other],
    )]));
    assert!(
        h.maps.conntrack.keys().next().is_none(),
        "the flow was cleared"
    );
    let ended: Totals = h
        .maps
        .lb_stats
        .get(&StatsKey::ended(svc.rev_nat_id, backend_id), 0)
        .expect("the pair's ended entry")
        .iter()
        .sum();
    assert_eq!(
        (
            ended.packets_in,
            ended.packets_out,
            ended.bytes_in,
            ended.bytes_out
        ),
        (1, 1, q2, a2),
        "the packets after the flow was answered"
    );
    assert_eq!(
        stats::frontend_totals(&h.maps)
            .expect("totals")
            .into_values()
            .collect::<Vec<_>>(),
        [total],
        "the frontend's totals unchanged"
    );
}
