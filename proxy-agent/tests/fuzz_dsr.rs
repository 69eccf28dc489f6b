//! A fuzzer for direct server return's option (IPv4) and Destination Options header
//! (IPv6) at the backend's node, through the real classifier (`BPF_PROG_TEST_RUN`, the
//! packet arriving on an interface of a namespace of its own). Node-b's agent programs a
//! NodePort in `dsr` mode whose backend is its pod 10.244.2.7:8080 ([fd00:244:2::7]:8080).
//! Each case is one SYN that carries an option or header — well formed or with a byte
//! changed — from a source outside, a pod or the node, to the backend or another
//! address, naming an entry node (another node of the cluster, node-b itself, a
//! stranger), sent by the entry node's MAC or another's, on the uplink or a pod's
//! interface. What must hold for every packet:
//!
//! - a flow is learnt only for what node-b permits (issue 42): an option that parses,
//!   naming port 30080 at an address that is not node-b's, through the entry node
//!   node-b knows, on a TCP packet to the backend itself, from a source neither a pod's
//!   nor the node's, arriving on the uplink from the entry node's MAC;
//! - a learnt packet goes on unchanged (the backend's node translates nothing of it),
//!   a refused one is dropped, and one that carries no option of ours (a byte changed
//!   its type or length) goes on as any other packet;
//! - and over the run both learnt and refused packets occur (the property is not empty).
//!
//! Root only. Bounded cases by default; `PROXY_FUZZ_CASES` (`cargo xtask fuzz`) runs long.

mod support;

use std::{
    cell::{Cell, RefCell},
    net::{IpAddr, SocketAddr},
};

use proptest::{
    prelude::*,
    test_runner::{TestCaseError, TestRunner},
};
use proxy_agent::trace::packet::{add_dsr, build_tcp, fold, sum16};
use proxy_common::{
    CT_F_DSR_BACKEND, DSR_HDR6_LEN, DSR_HDR6_WORDS, DSR_OPT_LEN, DsrNamed, parse_dsr_header6,
    parse_dsr_option,
};
use support::{fuzz_config, tc_harness::*, testbed::*};
use test_support::needs_root;

/// Sources: an outside client, a pod of the cluster, node-b itself.
const SOURCES: [(&str, &str); 3] = [
    ("192.0.2.99", "2001:db8:a::99"),
    ("10.244.1.5", "fd00:244:1::5"),
    ("192.0.2.20", "2001:db8:a::20"),
];
/// Destinations: the backend, another pod of node-b's.
const DESTINATIONS: [(&str, &str); 2] = [
    ("10.244.2.7", "fd00:244:2::7"),
    ("10.244.2.8", "fd00:244:2::8"),
];
/// Frontends an option names: the entry node's NodePort address, node-b's own, another.
const FRONTENDS: [(&str, &str); 3] = [
    ("192.0.2.10", "2001:db8:a::10"),
    ("192.0.2.20", "2001:db8:a::20"),
    ("6.6.6.6", "2001:db8::66"),
];
/// Entry nodes an option names: the one node-b knows, node-b itself, the client.
const ENTRIES: [(&str, &str); 3] = [
    (ENTRY_NODE, ENTRY_NODE6),
    ("192.0.2.20", "2001:db8:a::20"),
    ("192.0.2.99", "2001:db8:a::99"),
];
/// Senders on the wire: the entry node, the client.
const SENDERS: [[u8; 6]; 2] = [ENTRY_NODE_MAC, CLIENT_MAC];

#[derive(Clone, Debug)]
struct Forged {
    v6: bool,
    source: usize,
    destination: usize,
    dport: u16,
    frontend: usize,
    port: u16,
    entry: usize,
    sender: usize,
    on_pods: bool,
    /// A byte of the option (header) changed: (index, value).
    corrupt: Option<(usize, u8)>,
}

fn forged() -> BoxedStrategy<Forged> {
    (
        any::<bool>(),
        prop_oneof![3 => Just(0usize), 1 => 1..3usize],
        prop_oneof![3 => Just(0usize), 1 => Just(1usize)],
        prop_oneof![3 => Just(8080u16), 1 => any::<u16>()],
        prop_oneof![3 => Just(0usize), 1 => 1..3usize],
        prop_oneof![3 => Just(30080u16), 1 => any::<u16>()],
        (
            prop_oneof![3 => Just(0usize), 1 => 1..3usize],
            prop_oneof![3 => Just(0usize), 1 => Just(1usize)],
        ),
        prop::bool::weighted(0.25),
        prop::option::weighted(0.3, (0..40usize, any::<u8>())),
    )
        .prop_map(
            |(
                v6,
                source,
                destination,
                dport,
                frontend,
                port,
                (entry, sender),
                on_pods,
                corrupt,
            )| {
                Forged {
                    v6,
                    source,
                    destination,
                    dport,
                    frontend,
                    port,
                    entry,
                    sender,
                    on_pods,
                    corrupt,
                }
            },
        )
        .boxed()
}

fn pick(pair: (&str, &str), v6: bool) -> IpAddr {
    (if v6 { pair.1 } else { pair.0 }).parse().expect("ip")
}

/// The words of an address, in network byte order (the maps' layout).
fn words(ip: IpAddr) -> [u32; 4] {
    proxy_common::addr::to_words(ip).0
}

/// The SYN with the option (IPv4, after the base header) or header (IPv6, first), and
/// the option's bytes as they ended up (after `corrupt`).
fn packet(f: &Forged) -> (Vec<u8>, Vec<u8>) {
    let src = SocketAddr::new(pick(SOURCES[f.source], f.v6), 40_000);
    let dst = SocketAddr::new(pick(DESTINATIONS[f.destination], f.v6), f.dport);
    let frontend = SocketAddr::new(pick(FRONTENDS[f.frontend], f.v6), f.port);
    let mut pkt = build_tcp(src, dst, 0x02);
    pkt[6..12].copy_from_slice(&SENDERS[f.sender]);
    add_dsr(&mut pkt, frontend, pick(ENTRIES[f.entry], f.v6));
    let (at, len) = if f.v6 {
        (54, usize::from(DSR_HDR6_LEN))
    } else {
        (34, usize::from(DSR_OPT_LEN))
    };
    if let Some((i, v)) = f.corrupt {
        // Not the IPv6 header's next-header byte: that would change what follows, not
        // what the header says.
        let i = i % len;
        if !(f.v6 && i == 0) {
            pkt[at + i] = v;
        }
    }
    if !f.v6 {
        pkt[24..26].fill(0);
        let c = fold(sum16(&pkt[14..34 + len], 0));
        pkt[24..26].copy_from_slice(&c.to_be_bytes());
    }
    let opt = pkt[at..at + len].to_vec();
    (pkt, opt)
}

/// What `f`'s option (header) names, if it still parses as ours.
fn named(f: &Forged, opt: &[u8]) -> Option<DsrNamed> {
    if f.v6 {
        let w: [u32; DSR_HDR6_WORDS] = std::array::from_fn(|i| {
            u32::from_ne_bytes(opt[4 * i..4 * i + 4].try_into().expect("4 bytes"))
        });
        parse_dsr_header6(&w).map(|(_, n)| n)
    } else {
        parse_dsr_option(opt.try_into().expect("12 bytes"))
    }
}

/// Whether node-b may learn a flow from `f` (the module's first rule).
fn permitted(f: &Forged, opt: &[u8]) -> bool {
    let Some(n) = named(f, opt) else {
        return false;
    };
    let node_b = words(pick(FRONTENDS[1], f.v6));
    u16::from_be(n.port) == 30080
        && n.frontend != node_b
        && n.entry == words(pick(ENTRIES[0], f.v6))
        && f.sender == 0
        && f.source == 0
        && f.destination == 0
        && f.dport == 8080
        && !f.on_pods
}

fn clear_flows(h: &mut Harness) {
    for table in [&mut h.maps.conntrack, &mut h.maps.conntrack_new] {
        let keys: Vec<_> = table.keys().filter_map(Result::ok).collect();
        for k in keys {
            let _ = table.remove(&k);
        }
    }
}

#[needs_root]
#[test]
fn forged_dsr_options_teach_the_backends_node_only_what_it_permits() {
    in_testbed(|uplink, pods| {
        // Cells: proptest's property is an `Fn`.
        let h = RefCell::new(backend_node(&["10.244.2.7:8080", "[fd00:244:2::7]:8080"]));
        let mut runner = TestRunner::new(fuzz_config(400));
        let (learnt, refused) = (Cell::new(0u32), Cell::new(0u32));
        let result = runner.run(&forged(), |f| {
            let mut h = h.borrow_mut();
            clear_flows(&mut h);
            let (pkt, opt) = packet(&f);
            let (verdict, out) = h.run_on(&pkt, if f.on_pods { pods } else { uplink });
            let learned = h
                .ct_entries()
                .iter()
                .any(|(_, v)| v.flags & CT_F_DSR_BACKEND != 0);
            if permitted(&f, &opt) {
                prop_assert!(learned, "a permitted option was not learnt: {:?}", f);
                prop_assert_eq!(verdict, TC_ACT_UNSPEC, "passed on");
                prop_assert_eq!(&out, &pkt, "unchanged");
                learnt.set(learnt.get() + 1);
            } else {
                prop_assert!(!learned, "learnt from a forged option: {:?}", f);
                if named(&f, &opt).is_some() {
                    prop_assert_eq!(verdict, TC_ACT_SHOT, "a refused option is dropped");
                }
                refused.set(refused.get() + 1);
            }
            Ok::<(), TestCaseError>(())
        });
        if let Err(e) = result {
            panic!("{e}");
        }
        let (learnt, refused) = (learnt.get(), refused.get());
        assert!(
            learnt > 0 && refused > 0,
            "learnt {learnt}, refused {refused}"
        );
    });
}
