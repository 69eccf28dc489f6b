//! IPVS's schedulers through the real classifier (`BPF_PROG_TEST_RUN`) on maps the
//! agent's own sync code wrote: each scheduler's choices for new flows against a
//! reference written here in Rust (round-robin order, source/destination/Maglev hashing
//! by the table the agent laid out, least connection by the counts in `ACTIVE_CONNS`),
//! the same Maglev choice on two "nodes" that numbered their backends differently, and
//! session affinity on top of every scheduler. Root only: it loads BPF programs.

mod support;

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
};

use proxy_agent::{
    dataplane::bpf::Mirror,
    model::schedule::{DEFAULT_MAGLEV_TABLE_LEN, Schedule, Scheduler, parse_weights},
    model::{Frontend, FrontendState, NodeView, Protocol},
    trace,
};
use support::tc_harness;
use test_support::needs_root;

const VIP: &str = "10.96.0.10:80";

fn backends(n: u8) -> Vec<String> {
    (1..=n).map(|i| format!("10.244.1.{i}:8080")).collect()
}

fn service(scheduler: Scheduler, weights: &str, n: u8) -> (Frontend, FrontendState) {
    let eps = backends(n);
    let refs: Vec<&str> = eps.iter().map(String::as_str).collect();
    let (fe, mut st) = tc_harness::frontend("10.96.0.10", 80, Protocol::Tcp, &refs);
    let (weights, problems) = parse_weights(weights);
    assert!(problems.is_empty(), "{problems:?}");
    st.schedule = Schedule::new(scheduler, weights.into(), DEFAULT_MAGLEV_TABLE_LEN);
    (fe, st)
}

struct Node(tc_harness::Harness);

impl Node {
    fn with(frontends: &[(Frontend, FrontendState)]) -> Self {
        let mut h = tc_harness::Harness::new(&[]);
        let view: NodeView = frontends.iter().cloned().collect();
        let report = h.apply(&view);
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        Node(h)
    }

    /// Where a new TCP flow from `client` goes.
    fn new_flow(&self, client: SocketAddr) -> SocketAddr {
        let vip: SocketAddr = VIP.parse().expect("vip");
        let (verdict, out) = self
            .0
            .run(&trace::packet::build(client, vip, Protocol::Tcp));
        assert_eq!(
            verdict,
            tc_harness::TC_ACT_OK,
            "new flow from {client} translated"
        );
        tc_harness::inspect(&out).dst
    }

    fn backend_id(&self, endpoint: &str) -> u32 {
        self.programmed(endpoint).expect("backend programmed")
    }

    /// The backend's id, if any slot holds it.
    fn programmed(&self, endpoint: &str) -> Option<u32> {
        let sa: SocketAddr = endpoint.parse().expect("endpoint");
        let (addr, _) = proxy_common::addr::to_words(sa.ip());
        self.0
            .maps
            .backends
            .iter()
            .filter_map(Result::ok)
            .find(|(_, b)| b.addr == addr && u16::from_be(b.port) == sa.port())
            .map(|(id, _)| id)
    }

    /// Sets a backend's active connections (nothing for one that takes no slot: a
    /// weight-0 backend is left out of the layout).
    fn set_active(&mut self, endpoint: &str, n: u64) {
        let Some(id) = self.programmed(endpoint) else {
            return;
        };
        self.0
            .maps
            .active_conns
            .insert(&id, &n, 0)
            .expect("ACTIVE_CONNS");
    }

    fn active(&self, endpoint: &str) -> u64 {
        let id = self.backend_id(endpoint);
        self.0.maps.active_conns.get(&id, 0).unwrap_or(0)
    }
}

fn client(i: u32, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::from([10, 244, (i >> 8) as u8 + 2, i as u8]), port)
}

/// The agent's slot layout for `st`, as endpoints (the reference's table).
fn layout(st: &FrontendState) -> Vec<SocketAddr> {
    let eps: Vec<SocketAddr> = st.backends.endpoints.iter().collect();
    let vip: SocketAddr = VIP.parse().expect("vip");
    proxy_agent::dataplane::layout::slots(&st.schedule, &eps, vip.ip())
        .into_iter()
        .map(|i| eps[i as usize])
        .collect()
}

fn hash(sa: SocketAddr, with_port: bool) -> usize {
    let (words, _) = proxy_common::addr::to_words(sa.ip());
    let port = if with_port { sa.port().to_be() } else { 0 };
    proxy_common::sched_hash(&words, port) as usize
}

/// Runs on CPU 0 only: round-robin cursors are per CPU.
fn pin_to_one_cpu() {
    let mut set = nix::sched::CpuSet::new();
    set.set(0).expect("cpu 0");
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).expect("affinity");
}

#[needs_root]
#[test]
fn round_robin_takes_the_slots_in_turn_and_wrr_by_weight() {
    pin_to_one_cpu();
    for (scheduler, weights) in [
        (Scheduler::Rr, ""),
        (Scheduler::Wrr, "10.244.1.1=3,10.244.1.2=1,10.244.1.3=2"),
    ] {
        let svc = service(scheduler, weights, 3);
        let slots = layout(&svc.1);
        let node = Node::with(&[svc]);
        let picks: Vec<SocketAddr> = (0..24)
            .map(|i| node.new_flow(client(1, 40_000 + i)))
            .collect();
        // The cursor starts at a random slot; from there the picks follow the layout.
        let start = slots
            .iter()
            .position(|s| *s == picks[0])
            .expect("first pick is a backend");
        let rotations: Vec<usize> = (0..slots.len()).filter(|&r| slots[r] == picks[0]).collect();
        let follows = |start: usize| {
            picks
                .iter()
                .enumerate()
                .all(|(k, p)| *p == slots[(start + k) % slots.len()])
        };
        assert!(
            rotations.into_iter().any(follows),
            "{scheduler:?}: picks {picks:?} do not walk the layout {slots:?} (first at {start})"
        );
        if scheduler == Scheduler::Wrr {
            let count = |i: u8| {
                picks
                    .iter()
                    .filter(|p| p.ip() == IpAddr::from([10, 244, 1, i]))
                    .count()
            };
            assert_eq!((count(1), count(2), count(3)), (12, 4, 8), "weights 3:1:2");
        }
    }
}

#[needs_root]
#[test]
fn hashing_schedulers_pick_what_the_agents_table_says() {
    for scheduler in [Scheduler::Sh, Scheduler::Mh, Scheduler::Dh] {
        let svc = service(scheduler, "", 5);
        let table = layout(&svc.1);
        let node = Node::with(&[svc]);
        let mut seen = BTreeMap::<SocketAddr, usize>::new();
        for i in 0..300 {
            let c = client(i, 30_000 + (i as u16 * 7));
            let got = node.new_flow(c);
            let want = match scheduler {
                Scheduler::Sh => table[hash(c, false) % table.len()],
                Scheduler::Mh => table[hash(c, true) % table.len()],
                _ => table[0], // dh: the one slot the frontend's address hashes to
            };
            assert_eq!(got, want, "{scheduler:?}: flow from {c}");
            *seen.entry(got).or_default() += 1;
            if scheduler == Scheduler::Sh {
                // The same client from another port: the same backend.
                assert_eq!(node.new_flow(client(i, 50_000 + i as u16)), got);
            }
        }
        if scheduler == Scheduler::Dh {
            assert_eq!(seen.len(), 1, "dh sends every flow to one backend");
        } else {
            assert_eq!(seen.len(), 5, "{scheduler:?} spreads: {seen:?}");
        }
    }
}

#[needs_root]
#[test]
fn maglev_picks_the_same_backend_on_every_node() {
    let svc = service(Scheduler::Mh, "", 7);
    let node_a = Node::with(std::slice::from_ref(&svc));
    // Node B numbered its backends differently: another Service came first.
    let other = {
        let (_, st) = tc_harness::frontend(
            "10.96.0.1",
            80,
            Protocol::Tcp,
            &["10.244.1.7:8080", "10.244.1.5:8080", "10.244.9.9:80"],
        );
        (
            Frontend {
                ip: "10.96.0.1".parse().expect("ip"),
                port: 80,
                protocol: Protocol::Tcp,
            },
            st,
        )
    };
    let node_b = Node::with(&[other, svc.clone()]);
    assert_ne!(
        node_a.backend_id("10.244.1.7:8080"),
        node_b.backend_id("10.244.1.7:8080"),
        "the nodes' backend ids differ"
    );
    for i in 0..500 {
        let c = client(i, 20_000 + i as u16);
        assert_eq!(node_a.new_flow(c), node_b.new_flow(c), "flow from {c}");
    }
    // A restarted agent adopts the table from the maps: nothing to rewrite.
    let mut node_a = node_a;
    node_a.0.state = Mirror::adopt(&node_a.0.maps).expect("adopt");
    let report = node_a.0.apply(&std::iter::once(svc).collect());
    assert_eq!(
        report.frontends_written, 0,
        "the adopted Maglev table is kept"
    );
}

#[needs_root]
#[test]
fn least_connection_schedulers_pick_the_least_loaded() {
    let b = backends(3);
    // (scheduler, weights, active connections, expected pick): IPVS's cost functions.
    let cases = [
        // lc: fewest connections; weights do not count (beyond 0).
        (Scheduler::Lc, "10.244.1.1=9", [5, 1, 7], 1),
        // wlc: active/weight: 2/1 = 2, 6/4 = 1.5, 9/1 = 9.
        (Scheduler::Wlc, "10.244.1.2=4", [2, 6, 9], 1),
        // sed: (active+1)/weight: 2/1 = 2, 4/4 = 1, 9/1 = 9.
        (Scheduler::Sed, "10.244.1.2=4", [1, 3, 8], 1),
        // nq: an idle backend first, whatever the weights.
        (Scheduler::Nq, "10.244.1.2=50", [3, 1, 0], 2),
        // A weight-0 backend takes nothing new, however idle (it has no slot).
        (Scheduler::Wlc, "10.244.1.1=0", [0, 4, 6], 1),
        (Scheduler::Nq, "10.244.1.1=0", [0, 4, 6], 1),
    ];
    for (scheduler, weights, active, want) in cases {
        let mut node = Node::with(&[service(scheduler, weights, 3)]);
        for (ep, n) in b.iter().zip(active) {
            node.set_active(ep, n);
        }
        let got = node.new_flow(client(1, 41_000));
        assert_eq!(
            got,
            b[want].parse::<SocketAddr>().expect("sa"),
            "{scheduler:?} weights {weights:?} active {active:?}"
        );
        assert_eq!(
            node.active(&b[want]),
            active[want] + 1,
            "the new flow counts at once"
        );
    }
    // Repeated new flows fill the least loaded up to the others: the picks equal a
    // reference that always takes the minimum.
    let mut node = Node::with(&[service(Scheduler::Lc, "", 3)]);
    let mut reference: HashMap<&str, u64> = HashMap::new();
    for (ep, n) in b.iter().zip([10u64, 4, 7]) {
        node.set_active(ep, n);
        reference.insert(ep.as_str(), n);
    }
    for i in 0..3 {
        let got = node.new_flow(client(2, 42_000 + i));
        let min = *reference.values().min().expect("three");
        assert_eq!(reference[got.to_string().as_str()], min, "flow {i}: {got}");
        *reference.get_mut(got.to_string().as_str()).expect("known") += 1;
    }
}

#[needs_root]
#[test]
fn session_affinity_holds_with_every_scheduler() {
    for scheduler in Scheduler::ALL {
        let (fe, mut st) = service(scheduler, "", 4);
        st.affinity_timeout_s = Some(10_800);
        let node = Node::with(&[(fe, st)]);
        for i in 0..8 {
            let first = node.new_flow(client(i, 10_000));
            for port in 10_001..10_006 {
                assert_eq!(
                    node.new_flow(client(i, port)),
                    first,
                    "{scheduler:?}: client {i} keeps its backend"
                );
            }
        }
    }
}
