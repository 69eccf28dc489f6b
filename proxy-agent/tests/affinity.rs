//! Session affinity follows the Service's current backends, through the real classifier
//! (`BPF_PROG_TEST_RUN`) and maps written by the agent's sync code: a client is never
//! pinned to an endpoint that left the Service (even one still serving another), and
//! backend ids reused after a restart never resurrect an old pin. Root only.

mod support;

use std::{collections::BTreeSet, net::SocketAddr};

use proxy_agent::{
    dataplane::bpf::Mirror,
    model::{Frontend, FrontendKind, FrontendState, NodeView, Protocol},
    trace,
};
use support::tc_harness;
use test_support::needs_root;

const CLIENTS: u8 = 40;

/// The shared test-run harness, plus what these tests ask of it.
struct Harness(tc_harness::Harness);

impl Harness {
    fn new() -> Self {
        Harness(tc_harness::Harness::new(&[]))
    }

    fn apply(&mut self, view: &NodeView) {
        let report = self.0.apply(view);
        assert!(report.failed.is_empty(), "{:?}", report.failed);
    }

    /// A restarted agent: a fresh mirror adopted from the maps.
    fn restart(&mut self) {
        self.0.state = Mirror::adopt(&self.0.maps).expect("adopt");
    }

    /// Where a new TCP flow from client `i` (10.244.0.i, source port `port`) to `vip` goes.
    fn new_flow(&self, i: u8, port: u16, vip: SocketAddr) -> SocketAddr {
        let src = SocketAddr::new([10, 244, 0, i].into(), port);
        let (_, out) = self.0.run(&trace::packet::build(src, vip, Protocol::Tcp));
        tc_harness::inspect(&out).dst
    }

    /// Where each client's new flow goes.
    fn round(&self, port: u16, vip: SocketAddr) -> Vec<SocketAddr> {
        (1..=CLIENTS).map(|i| self.new_flow(i, port, vip)).collect()
    }
}

impl std::ops::Deref for Harness {
    type Target = tc_harness::Harness;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Harness {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// A TCP ClusterIP frontend with `sessionAffinity: ClientIP` (one hour).
fn sticky(ip: &str, backends: &[&str]) -> (Frontend, FrontendState) {
    (
        Frontend {
            ip: ip.parse().expect("ip"),
            port: 80,
            protocol: Protocol::Tcp,
        },
        FrontendState::builder(format!("default/{ip}"), FrontendKind::ClusterIp)
            .backends(backends.iter().map(|b| sa(b)))
            .affinity(3600)
            .build(),
    )
}

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

const B: &str = "10.244.1.5:8080";
const C: &str = "10.244.2.6:8080";
const D: &str = "10.244.3.7:8080";

#[needs_root]
#[test]
fn affinity_never_pins_to_an_endpoint_that_left_the_service() {
    let mut h = Harness::new();
    let (vip, other) = (sa("10.96.0.10:80"), sa("10.96.0.11:80"));
    // B serves both Services; every client is pinned to it on the first.
    let view =
        |first: &[&str]| NodeView::from([sticky("10.96.0.10", first), sticky("10.96.0.11", &[B])]);
    h.apply(&view(&[B]));
    assert!(h.round(40_000, vip).iter().all(|d| *d == sa(B)));
    // B leaves the first Service but still serves the second (its id lives on).
    h.apply(&view(&[C, D]));
    let after: BTreeSet<SocketAddr> = h.round(40_001, vip).into_iter().collect();
    assert_eq!(
        after,
        BTreeSet::from([sa(C), sa(D)]),
        "new flows must follow the Service's backends, not old pins"
    );
    // Pins to the new backends hold, and the second Service still reaches B.
    let pinned = h.round(40_002, vip);
    assert_eq!(h.round(40_003, vip), pinned, "new pins hold");
    assert!(h.round(40_000, other).iter().all(|d| *d == sa(B)));
}

#[needs_root]
#[test]
fn backend_ids_reused_after_a_restart_never_resurrect_a_pin() {
    let mut h = Harness::new();
    let vip = sa("10.96.0.10:80");
    h.apply(&NodeView::from([sticky("10.96.0.10", &[B])]));
    let b_id = h
        .maps
        .backends
        .iter()
        .filter_map(Result::ok)
        .map(|(id, _)| id)
        .next()
        .expect("B's id");
    assert!(h.round(40_000, vip).iter().all(|d| *d == sa(B)));
    // B goes (its id is freed), the agent restarts, and new endpoints arrive: the first
    // takes B's old id.
    h.apply(&NodeView::from([sticky("10.96.0.10", &[])]));
    h.restart();
    h.apply(&NodeView::from([sticky("10.96.0.10", &[C, D])]));
    let reused = h
        .maps
        .backends
        .get(&b_id, 0)
        .expect("the id is in use again");
    assert_eq!(
        reused.port,
        8080u16.to_be(),
        "the scenario needs B's id reused"
    );
    // Were old pins honoured, every client would land on whichever backend now has B's id.
    let after: BTreeSet<SocketAddr> = h.round(40_001, vip).into_iter().collect();
    assert_eq!(
        after,
        BTreeSet::from([sa(C), sa(D)]),
        "pins of a reused id must not come back"
    );
}

#[needs_root]
#[test]
fn adoption_restores_and_prunes_memberships() {
    let mut h = Harness::new();
    let view = NodeView::from([sticky("10.96.0.10", &[B, C])]);
    h.apply(&view);
    let programmed: BTreeSet<_> = h.maps.members.keys().filter_map(Result::ok).collect();
    assert_eq!(programmed.len(), 2);
    // Maps from an agent without MEMBERS (or one that died mid-write): one pair missing,
    // one that is not programmed.
    let first = *programmed.first().expect("a pair");
    h.maps.members.remove(&first).expect("remove");
    let stray = proxy_common::MemberKey {
        service_id: 999,
        backend_id: 999,
    };
    h.maps.members.insert(&stray, &1, 0).expect("insert");
    h.restart();
    h.apply(&view);
    let now: BTreeSet<_> = h.maps.members.keys().filter_map(Result::ok).collect();
    assert_eq!(now, programmed);
}
