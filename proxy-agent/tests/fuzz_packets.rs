//! A packet fuzzer: random and mutated packets through the real classifiers (ingress and
//! egress, each ingress packet through the XDP program first) with `BPF_PROG_TEST_RUN`, against a small fixed set of frontends. Each case is a
//! few flows (a client's packets, the backend's replies, ICMP errors about them, unrelated
//! traffic), each packet then mutated: bytes flipped, cut short or extended, lengths,
//! header lengths, fragment fields and checksums broken, IPv4 options and IPv6 extension
//! headers added (with checksums refixed or not). What must hold for every packet:
//!
//! - traffic that matches no frontend and no flow (no address of a frontend, node or
//!   backend anywhere in its bytes) is handed on (`TC_ACT_UNSPEC`) byte for byte unchanged,
//!   and anything handed on is unchanged; at XDP (no next hop without an interface)
//!   every packet is dropped or passed to TC unchanged;
//! - a translated packet whose checksums were valid has valid IPv4, TCP, UDP, SCTP, ICMP
//!   and ICMPv6 checksums;
//! - no packet is translated to an address no map holds: a new destination is a backend
//!   of the frontend it was sent to, or an address the flow table held; a new source is a
//!   node address (masquerade), a frontend (replies), or an address the flow table held;
//!   what is sent back goes to the sender.
//!
//! Root only. Bounded cases by default; `PROXY_FUZZ_CASES` (`cargo xtask fuzz`) runs long.

mod support;

use std::{
    cell::RefCell,
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
};

use proptest::{
    prelude::*,
    sample::Index,
    test_runner::{TestCaseError, TestRunner},
};
use proxy_agent::{
    model::{FrontendKind, NodeView, Protocol},
    trace::packet::{build, build_tcp, fold, sum16},
};
use proxy_common::crc32c::sctp_checksum;
use support::{fuzz_config, tc_harness::*};
use test_support::needs_root;

// ---- the node ---------------------------------------------------------------------

/// (frontend, protocol, backends, NodePort?)
const FRONTENDS: [(&str, Protocol, &[&str], bool); 8] = [
    (
        "10.96.0.10:80",
        Protocol::Tcp,
        &["10.244.1.5:8080", "10.244.2.6:8080"],
        false,
    ),
    ("10.96.0.10:53", Protocol::Udp, &["10.244.1.7:5353"], false),
    (
        "[fd96::10]:80",
        Protocol::Tcp,
        &["[fd00:244:1::5]:8080"],
        false,
    ),
    (
        "[fd96::10]:53",
        Protocol::Udp,
        &["[fd00:244:1::7]:5353"],
        false,
    ),
    (
        "192.0.2.10:30080",
        Protocol::Tcp,
        &["10.244.2.6:8080"],
        true,
    ),
    (
        "[2001:db8:a::10]:30053",
        Protocol::Udp,
        &["[fd00:244:1::7]:5353"],
        true,
    ),
    ("10.96.0.20:80", Protocol::Tcp, &[], false),
    ("10.96.0.10:9", Protocol::Sctp, &["10.244.1.5:9999"], false),
];

/// The node's addresses (`configure_node`).
const NODE: [&str; 2] = ["192.0.2.10", "2001:db8:a::10"];

/// Clients: pods (inside the pod network), outside hosts, the node itself.
const CLIENTS_V4: [&str; 3] = ["10.244.0.3", "198.51.100.7", "192.0.2.10"];
const CLIENTS_V6: [&str; 3] = ["fd00:244::3", "2001:db8:ff::7", "2001:db8:a::10"];
/// Routers between the node and a backend or a client (they send ICMP errors).
const ROUTERS: [&str; 2] = ["192.0.2.1", "2001:db8:a::1"];
/// Hosts that have nothing to do with any Service.
const STRANGERS_V4: [&str; 3] = ["203.0.113.9", "198.51.100.99", "10.244.0.77"];
const STRANGERS_V6: [&str; 3] = ["2001:db8:ff::99", "fd00:244::77", "fe80::1"];

fn view() -> NodeView {
    FRONTENDS
        .iter()
        .map(|(fe, proto, backends, node_port)| {
            let addr: SocketAddr = fe.parse().expect("frontend");
            let (f, mut st) = frontend(&addr.ip().to_string(), addr.port(), *proto, backends);
            if *node_port {
                st.kind = FrontendKind::NodePort;
            }
            (f, st)
        })
        .collect()
}

/// Every address a map holds for the Services: frontends, node, backends.
fn service_addresses() -> BTreeSet<IpAddr> {
    let mut all = BTreeSet::new();
    for (fe, _, backends, _) in FRONTENDS {
        all.insert(fe.parse::<SocketAddr>().expect("fe").ip());
        for b in backends {
            all.insert(b.parse::<SocketAddr>().expect("backend").ip());
        }
    }
    all.extend(NODE.iter().map(|n| n.parse::<IpAddr>().expect("node")));
    all
}

// ---- reading packets (never trusting them) ----------------------------------------

/// What a frame holds, read defensively.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Parsed {
    v4: bool,
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    /// Offsets of the IP header, the transport header and the end of the IP packet.
    l3: usize,
    l4: usize,
    end: usize,
    /// A fragment (IPv4 MF or offset, or an IPv6 fragment header): no whole L4 checksum.
    fragment: bool,
    /// The offset of a later fragment (no transport header in it).
    later_fragment: bool,
}

impl Parsed {
    fn ports(&self, pkt: &[u8]) -> Option<(u16, u16)> {
        if self.later_fragment || !matches!(self.proto, 6 | 17 | 132) {
            return None;
        }
        let l4 = pkt.get(self.l4..self.l4 + 4)?;
        Some((
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        ))
    }
}

/// A whole IP packet (lengths consistent with the frame), or nothing.
fn parse(pkt: &[u8]) -> Option<Parsed> {
    parse_with(pkt, true)
}

/// The headers of an IP packet, lengths not checked (`end` is cut to the frame).
fn parse_headers(pkt: &[u8]) -> Option<Parsed> {
    parse_with(pkt, false)
}

fn parse_with(pkt: &[u8], strict: bool) -> Option<Parsed> {
    let ethertype = u16::from_be_bytes([*pkt.get(12)?, *pkt.get(13)?]);
    match ethertype {
        0x0800 => {
            let ip = pkt.get(14..34)?;
            if ip[0] >> 4 != 4 {
                return None;
            }
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            // A length of 0 is only whole in a BIG TCP (GSO) packet, which a test run never
            // is: the stack drops it (ip_rcv), so it is read as broken, not as whole.
            let total = match usize::from(u16::from_be_bytes([ip[2], ip[3]])) {
                0 if !strict => pkt.len() - 14,
                n => n,
            };
            if ihl < 20 || (strict && (total < ihl || 14 + total > pkt.len())) {
                return None;
            }
            let total = total.clamp(ihl.min(pkt.len() - 14), pkt.len() - 14);
            let frag = u16::from_be_bytes([ip[6], ip[7]]);
            let offset = frag & 0x1fff;
            let s: [u8; 4] = ip[12..16].try_into().ok()?;
            let d: [u8; 4] = ip[16..20].try_into().ok()?;
            Some(Parsed {
                v4: true,
                src: s.into(),
                dst: d.into(),
                proto: ip[9],
                l3: 14,
                l4: 14 + ihl,
                end: 14 + total,
                fragment: frag & 0x2000 != 0 || offset != 0,
                later_fragment: offset != 0,
            })
        }
        0x86dd => {
            let ip = pkt.get(14..54)?;
            if ip[0] >> 4 != 6 {
                return None;
            }
            let end = match usize::from(u16::from_be_bytes([ip[4], ip[5]])) {
                0 if !strict => pkt.len(),
                n => 54 + n,
            };
            if strict && end > pkt.len() {
                return None;
            }
            let end = end.min(pkt.len());
            let s: [u8; 16] = ip[8..24].try_into().ok()?;
            let d: [u8; 16] = ip[24..40].try_into().ok()?;
            let (mut next, mut at) = (ip[6], 54);
            let (mut fragment, mut later) = (false, false);
            // Hop-by-hop, routing, fragment, destination options.
            for _ in 0..4 {
                match next {
                    0 | 43 | 60 => {
                        let h = pkt.get(at..at + 2)?;
                        next = h[0];
                        at += (usize::from(h[1]) + 1) * 8;
                    }
                    44 => {
                        let h = pkt.get(at..at + 8)?;
                        next = h[0];
                        let off = u16::from_be_bytes([h[2], h[3]]);
                        fragment = true;
                        later = off >> 3 != 0;
                        at += 8;
                    }
                    _ => break,
                }
            }
            if strict && at > end {
                return None;
            }
            let at = at.min(end);
            Some(Parsed {
                v4: false,
                src: s.into(),
                dst: d.into(),
                proto: next,
                l3: 14,
                l4: at,
                end,
                fragment,
                later_fragment: later,
            })
        }
        _ => None,
    }
}

/// The transport checksum's pseudo-header sum.
fn pseudo(p: &Parsed, pkt: &[u8], len: usize) -> u32 {
    let addrs = if p.v4 {
        &pkt[p.l3 + 12..p.l3 + 20]
    } else {
        &pkt[p.l3 + 8..p.l3 + 40]
    };
    sum16(addrs, 0) + u32::from(p.proto) + len as u32
}

/// Whether every checksum the packet carries is right (those of fragments' transport
/// headers cannot be checked and count as right).
fn checksums_ok(pkt: &[u8]) -> bool {
    let Some(p) = parse(pkt) else { return false };
    if p.v4 && fold(sum16(&pkt[p.l3..p.l4], 0)) != 0 {
        return false;
    }
    if p.fragment {
        return true;
    }
    let l4 = &pkt[p.l4..p.end];
    match p.proto {
        6 if l4.len() >= 20 => fold(sum16(l4, pseudo(&p, pkt, l4.len()))) == 0,
        17 if l4.len() >= 8 => {
            (p.v4 && l4[6..8] == [0, 0]) || fold(sum16(l4, pseudo(&p, pkt, l4.len()))) == 0
        }
        132 if l4.len() >= 12 => {
            u32::from_le_bytes([l4[8], l4[9], l4[10], l4[11]]) == sctp_checksum(l4)
        }
        1 if p.v4 && l4.len() >= 8 => fold(sum16(l4, 0)) == 0,
        58 if !p.v4 && l4.len() >= 8 => fold(sum16(l4, pseudo(&p, pkt, l4.len()))) == 0,
        6 | 17 | 132 | 1 | 58 => false,
        _ => true,
    }
}

/// Recomputes the checksums a mutation broke, where the packet still has them.
fn fix_checksums(pkt: &mut [u8]) {
    let Some(p) = parse(pkt) else { return };
    if p.v4 {
        pkt[p.l3 + 10..p.l3 + 12].fill(0);
        let c = fold(sum16(&pkt[p.l3..p.l4], 0));
        pkt[p.l3 + 10..p.l3 + 12].copy_from_slice(&c.to_be_bytes());
    }
    if p.fragment {
        return;
    }
    let len = p.end - p.l4;
    let at = match p.proto {
        6 if len >= 20 => 16,
        17 if len >= 8 => 6,
        1 if p.v4 && len >= 8 => 2,
        58 if !p.v4 && len >= 8 => 2,
        132 if len >= 12 => {
            pkt[p.l4 + 8..p.l4 + 12].fill(0);
            let c = sctp_checksum(&pkt[p.l4..p.end]);
            pkt[p.l4 + 8..p.l4 + 12].copy_from_slice(&c.to_le_bytes());
            return;
        }
        _ => return,
    };
    pkt[p.l4 + at..p.l4 + at + 2].fill(0);
    let acc = if p.proto == 1 {
        0
    } else {
        pseudo(&p, pkt, len)
    };
    let mut c = fold(sum16(&pkt[p.l4..p.end], acc));
    if c == 0 && p.proto == 17 {
        c = 0xffff;
    }
    pkt[p.l4 + at..p.l4 + at + 2].copy_from_slice(&c.to_be_bytes());
}

/// Whether any of `addrs` appears anywhere in `pkt`'s bytes.
fn mentions(pkt: &[u8], addrs: &BTreeSet<IpAddr>) -> bool {
    addrs.iter().any(|a| {
        let bytes: Vec<u8> = match a {
            IpAddr::V4(v4) => v4.octets().to_vec(),
            IpAddr::V6(v6) => v6.octets().to_vec(),
        };
        pkt.windows(bytes.len()).any(|w| w == bytes)
    })
}

// ---- building packets --------------------------------------------------------------

fn packet_of(src: SocketAddr, dst: SocketAddr, proto: Protocol, flags: u8) -> Vec<u8> {
    match proto {
        Protocol::Tcp => build_tcp(src, dst, flags),
        p => build(src, dst, p),
    }
}

/// Changes made to a packet after it was built.
#[derive(Clone, Debug)]
enum Mutation {
    /// A byte anywhere (the index is over the first 64 bytes when `head`).
    Byte {
        at: Index,
        head: bool,
        value: u8,
    },
    Truncate(Index),
    Extend(Vec<u8>),
    /// IPv4 options (1 to 10 words of `fill`) after the fixed header, lengths adjusted.
    Ipv4Options {
        words: usize,
        fill: u8,
    },
    /// An IPv6 hop-by-hop header (PadN) before the transport header.
    Ipv6HopByHop,
    /// IPv4 fragment fields, or an IPv6 fragment header.
    Fragment {
        more: bool,
        offset: u16,
    },
    /// A length field: IPv4 total length / IPv6 payload length / UDP length.
    Length {
        which: u8,
        value: u16,
    },
    /// IPv4 header length nibble, or TCP data offset.
    HeaderLength {
        tcp: bool,
        value: u8,
    },
}

fn mutation() -> BoxedStrategy<Mutation> {
    prop_oneof![
        6 => (any::<Index>(), prop::bool::weighted(0.75), any::<u8>())
            .prop_map(|(at, head, value)| Mutation::Byte { at, head, value }),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => prop::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Extend),
        1 => (1..=10usize, any::<u8>()).prop_map(|(words, fill)| Mutation::Ipv4Options { words, fill }),
        1 => Just(Mutation::Ipv6HopByHop),
        1 => (any::<bool>(), prop_oneof![Just(0u16), Just(1), any::<u16>()])
            .prop_map(|(more, offset)| Mutation::Fragment { more, offset }),
        2 => (0..3u8, prop_oneof![0..100u16, any::<u16>()])
            .prop_map(|(which, value)| Mutation::Length { which, value }),
        1 => (any::<bool>(), 0..16u8).prop_map(|(tcp, value)| Mutation::HeaderLength { tcp, value }),
    ]
    .boxed()
}

fn mutate(pkt: &mut Vec<u8>, m: &Mutation) {
    let v4 = pkt.get(12..14) == Some(&[0x08, 0x00]);
    let v6 = pkt.get(12..14) == Some(&[0x86, 0xdd]);
    match m {
        Mutation::Byte { at, head, value } => {
            let span = if *head { pkt.len().min(64) } else { pkt.len() };
            if span > 0 {
                let i = at.index(span);
                pkt[i] = *value;
            }
        }
        // Never below an Ethernet header: BPF_PROG_TEST_RUN refuses shorter frames.
        Mutation::Truncate(at) if pkt.len() > 14 => {
            let n = 14 + at.index(pkt.len() - 14 + 1);
            pkt.truncate(n);
        }
        Mutation::Extend(bytes) => pkt.extend_from_slice(bytes),
        Mutation::Ipv4Options { words, fill } if v4 && pkt.len() >= 34 => {
            let ihl = usize::from(pkt[14] & 0x0f) * 4;
            if ihl + words * 4 > 60 {
                return;
            }
            let at = 14 + ihl;
            if at > pkt.len() {
                return;
            }
            pkt.splice(at..at, std::iter::repeat_n(*fill, words * 4));
            pkt[14] = 0x40 | ((ihl / 4 + words) as u8);
            let total = u16::from_be_bytes([pkt[16], pkt[17]]).wrapping_add((words * 4) as u16);
            pkt[16..18].copy_from_slice(&total.to_be_bytes());
            fix_checksums(pkt);
        }
        Mutation::Ipv6HopByHop if v6 && pkt.len() >= 54 => {
            let next = pkt[20];
            pkt.splice(54..54, [next, 0, 1, 4, 0, 0, 0, 0]);
            pkt[20] = 0;
            let len = u16::from_be_bytes([pkt[18], pkt[19]]).wrapping_add(8);
            pkt[18..20].copy_from_slice(&len.to_be_bytes());
        }
        Mutation::Fragment { more, offset } if v4 && pkt.len() >= 34 => {
            let v = (u16::from(*more) << 13) | (offset & 0x1fff);
            pkt[20..22].copy_from_slice(&v.to_be_bytes());
            pkt[18..20].copy_from_slice(&0x1234u16.to_be_bytes());
        }
        Mutation::Fragment { more, offset } if v6 && pkt.len() >= 54 => {
            let next = pkt[20];
            let off = ((offset & 0x1fff) << 3) | u16::from(*more);
            let mut h = vec![next, 0];
            h.extend_from_slice(&off.to_be_bytes());
            h.extend_from_slice(&0x1234_5678u32.to_be_bytes());
            pkt.splice(54..54, h);
            pkt[20] = 44;
            let len = u16::from_be_bytes([pkt[18], pkt[19]]).wrapping_add(8);
            pkt[18..20].copy_from_slice(&len.to_be_bytes());
        }
        Mutation::Length { which, value } => {
            let at = match (*which, v4, v6) {
                (0, true, _) => 16,
                (0, _, true) => 18,
                (1, true, _) if pkt.len() >= 34 => 14 + usize::from(pkt[14] & 0x0f) * 4 + 4,
                (1, _, true) => 58,
                _ => return,
            };
            if let Some(b) = pkt.get_mut(at..at + 2) {
                b.copy_from_slice(&value.to_be_bytes());
            }
        }
        Mutation::HeaderLength { tcp: false, value } if v4 && pkt.len() > 14 => {
            pkt[14] = 0x40 | (value & 0x0f);
        }
        Mutation::HeaderLength { tcp: true, value } => {
            if let Some(p) = parse(pkt).filter(|p| p.proto == 6)
                && let Some(b) = pkt.get_mut(p.l4 + 12)
            {
                *b = (*value << 4) | (*b & 0x0f);
            }
        }
        _ => {}
    }
}

// ---- cases --------------------------------------------------------------------------

/// A client's flow to a frontend (or to a port next to it).
#[derive(Clone, Debug)]
struct Flow {
    client: usize,
    frontend: usize,
    sport: u16,
    /// Another port than the frontend's (no frontend: must pass untouched unless
    /// something else relates it).
    port_off: bool,
}

#[derive(Clone, Debug)]
enum What {
    /// The client's packet to the frontend, with these TCP flags.
    Forward(u8),
    /// The backend's (or, before a forward packet was translated, a backend's) reply.
    Reply(u8),
    /// An ICMP error about the flow's translated packet, from a router or the backend,
    /// to its sender (type/code from the list below).
    ErrorAboutForward { from_backend: bool, kind: usize },
    /// An ICMP error from the client's side about the reply, to the frontend.
    ErrorAboutReply { kind: usize },
    /// Traffic between hosts that have nothing to do with a Service.
    Stranger {
        src: usize,
        dst: usize,
        proto: usize,
        sport: u16,
        dport: u16,
    },
}

/// (IPv4 type, code), (IPv6 type, code), info.
type ErrorKind = ((u8, u8), (u8, u8), u32);

/// Port unreachable, fragmentation needed / packet too big, time exceeded.
const ERRORS: [ErrorKind; 3] = [
    ((3, 3), (1, 4), 0),
    ((3, 4), (2, 0), 1280),
    ((11, 0), (3, 0), 0),
];

#[derive(Clone, Debug)]
struct Step {
    flow: usize,
    what: What,
    egress: bool,
    mutations: Vec<Mutation>,
    /// Refix the checksums after mutating: odd but checksum-valid packets.
    refix: bool,
}

#[derive(Clone, Debug)]
struct Case {
    flows: Vec<Flow>,
    steps: Vec<Step>,
}

fn case() -> BoxedStrategy<Case> {
    let flow = (
        0..3usize,
        0..FRONTENDS.len(),
        1024..=65535u16,
        prop::bool::weighted(0.1),
    )
        .prop_map(|(client, frontend, sport, port_off)| Flow {
            client,
            frontend,
            sport,
            port_off,
        });
    let flags = prop_oneof![
        Just(0x02u8),
        Just(0x10),
        Just(0x12),
        Just(0x11),
        Just(0x04),
        any::<u8>()
    ];
    let what = prop_oneof![
        4 => flags.clone().prop_map(What::Forward),
        3 => flags.prop_map(What::Reply),
        1 => (any::<bool>(), 0..ERRORS.len())
            .prop_map(|(from_backend, kind)| What::ErrorAboutForward { from_backend, kind }),
        1 => (0..ERRORS.len()).prop_map(|kind| What::ErrorAboutReply { kind }),
        2 => (0..3usize, 0..3usize, 0..3usize, any::<u16>(), any::<u16>())
            .prop_map(|(src, dst, proto, sport, dport)| What::Stranger { src, dst, proto, sport, dport }),
    ];
    let step = (
        0..3usize,
        what,
        prop::bool::weighted(0.2),
        prop_oneof![
            2 => Just(Vec::new()),
            3 => prop::collection::vec(mutation(), 1..4),
        ],
        any::<bool>(),
    )
        .prop_map(|(flow, what, egress, mutations, refix)| Step {
            flow,
            what,
            egress,
            mutations,
            refix,
        });
    (
        prop::collection::vec(flow, 3),
        prop::collection::vec(step, 1..10),
    )
        .prop_map(|(flows, steps)| Case { flows, steps })
        .boxed()
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

/// What one case's packets became: the translated forward packet per flow.
#[derive(Default)]
struct Seen {
    forward: [Option<(SocketAddr, SocketAddr)>; 3],
}

/// The packet a step sends.
fn materialize(case: &Case, step: &Step, seen: &Seen) -> Vec<u8> {
    let flow = &case.flows[step.flow];
    let (fe, proto, backends, _) = FRONTENDS[flow.frontend];
    let mut fe: SocketAddr = fe.parse().expect("fe");
    if flow.port_off {
        fe.set_port(fe.port().wrapping_add(1).max(1));
    }
    let clients = if fe.is_ipv4() { CLIENTS_V4 } else { CLIENTS_V6 };
    let client = SocketAddr::new(ip(clients[flow.client]), flow.sport);
    let backend: SocketAddr = backends
        .first()
        .map_or_else(|| SocketAddr::new(fe.ip(), 8080), |b| b.parse().expect("b"));
    // The flow as translated, if it was.
    let (out_src, out_dst) = seen.forward[step.flow].unwrap_or((client, backend));
    let router = ip(ROUTERS[usize::from(!fe.is_ipv4())]);
    let quote = |src: SocketAddr, dst: SocketAddr| build(src, dst, proto)[14..].to_vec();
    let error = |kind: usize, from: IpAddr, to: IpAddr, q: Vec<u8>| {
        let ((t4, c4), (t6, c6), info) = ERRORS[kind];
        let (t, c) = if fe.is_ipv4() { (t4, c4) } else { (t6, c6) };
        icmp_error(from, to, t, c, info, &q)
    };
    match &step.what {
        What::Forward(flags) => packet_of(client, fe, proto, *flags),
        What::Reply(flags) => packet_of(out_dst, out_src, proto, *flags),
        What::ErrorAboutForward { from_backend, kind } => {
            let from = if *from_backend { out_dst.ip() } else { router };
            error(*kind, from, out_src.ip(), quote(out_src, out_dst))
        }
        What::ErrorAboutReply { kind } => error(*kind, router, fe.ip(), quote(fe, client)),
        What::Stranger {
            src,
            dst,
            proto,
            sport,
            dport,
        } => {
            let pool = if fe.is_ipv4() {
                STRANGERS_V4
            } else {
                STRANGERS_V6
            };
            let proto = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][*proto];
            packet_of(
                SocketAddr::new(ip(pool[*src]), (*sport).max(1)),
                SocketAddr::new(ip(pool[*dst]), (*dport).max(1)),
                proto,
                0x02,
            )
        }
    }
}

/// Every address and (address, port) the flow tables hold.
fn flow_table_addresses(h: &Harness) -> (BTreeSet<IpAddr>, BTreeSet<SocketAddr>) {
    let mut ips = BTreeSet::new();
    let mut socks = BTreeSet::new();
    for (k, v) in h.ct_entries() {
        for (words, port) in [
            (k.saddr, k.sport),
            (k.daddr, k.dport),
            (v.nat_addr, v.nat_port),
            (v.xlate_addr, v.xlate_port),
        ] {
            let a = proxy_common::addr::from_words(words, k.family);
            ips.insert(a);
            socks.insert(SocketAddr::new(a, u16::from_be(port)));
        }
    }
    (ips, socks)
}

fn clear_flows(h: &mut Harness) {
    let keys: Vec<_> = h.maps.conntrack.keys().filter_map(Result::ok).collect();
    for k in keys {
        let _ = h.maps.conntrack.remove(&k);
    }
    let keys: Vec<_> = h.maps.conntrack_new.keys().filter_map(Result::ok).collect();
    for k in keys {
        let _ = h.maps.conntrack_new.remove(&k);
    }
}

/// BPF_PROG_TEST_RUN (kernel 6.18) refuses an IPv4 or IPv6 frame shorter than its fixed
/// IP header (EINVAL); such a frame is padded with zeros to it. Shorter ones can still
/// reach TC on a real interface: the classifier's bounds checks, which the verifier
/// enforces, are what covers them, and frames of other types are run at any length.
fn runnable(pkt: &mut Vec<u8>) {
    let min = match pkt.get(12..14) {
        Some([0x08, 0x00]) => 34,
        Some([0x86, 0xdd]) => 54,
        _ => 14,
    };
    if pkt.len() < min {
        pkt.resize(min, 0);
    }
}

/// Runs one case on a clean flow table and checks every packet.
fn run_case(
    h: &mut Harness,
    case: &Case,
    related: &BTreeSet<IpAddr>,
    tally: &mut Tally,
) -> Result<(), TestCaseError> {
    clear_flows(h);
    let mut seen = Seen::default();
    let node: BTreeSet<IpAddr> = NODE.iter().map(|n| ip(n)).collect();
    for (n, step) in case.steps.iter().enumerate() {
        let mut pkt = materialize(case, step, &seen);
        for m in &step.mutations {
            mutate(&mut pkt, m);
        }
        if step.refix {
            fix_checksums(&mut pkt);
        }
        runnable(&mut pkt);
        let (held_ips, held_socks) = flow_table_addresses(h);
        if !step.egress {
            // XDP first, as on the wire: with no interface (no FIB answer) it sends
            // nothing, so each packet is dropped (as TC drops it) or passed to TC byte
            // for byte unchanged.
            let (action, out) = h.run_xdp(&pkt, 0);
            let what = || format!("step {n} (xdp): {pkt:02x?} -> {action} {out:02x?}");
            prop_assert!(
                matches!(action, XDP_PASS | XDP_DROP),
                "XDP sent a packet it had no next hop for, {}",
                what()
            );
            if action == XDP_PASS {
                prop_assert_eq!(&out, &pkt, "passed to TC, but changed: {}", what());
            }
            if !mentions(&pkt, related) {
                prop_assert_eq!(action, XDP_PASS, "not ours, but kept at XDP: {}", what());
            }
        }
        // A refused test run panics, which proptest reports with the minimized case.
        let (verdict, out) = if step.egress {
            h.run_egress(&pkt)
        } else {
            h.run(&pkt)
        };
        tally.count(&pkt, verdict, &out, related);
        let hook = if step.egress { "egress" } else { "ingress" };
        let what = || format!("step {n} ({hook}): {pkt:02x?} -> {verdict} {out:02x?}");
        prop_assert!(
            matches!(
                verdict,
                TC_ACT_UNSPEC | TC_ACT_OK | TC_ACT_SHOT | TC_ACT_REDIRECT
            ),
            "unknown verdict, {}",
            what()
        );
        if verdict == TC_ACT_UNSPEC {
            prop_assert_eq!(&out, &pkt, "handed on, but changed: {}", what());
        }
        if !mentions(&pkt, related) {
            prop_assert_eq!(verdict, TC_ACT_UNSPEC, "not ours, but kept: {}", what());
            continue;
        }
        if verdict == TC_ACT_SHOT || out == pkt {
            continue;
        }
        // A whole packet stays whole, and its checksums right; a broken one (cut short,
        // lengths wrong) may stay broken, but its addresses are checked all the same.
        if parse(&pkt).is_some() || verdict == TC_ACT_REDIRECT {
            prop_assert!(
                parse(&out).is_some(),
                "translated into no whole IP packet: {}",
                what()
            );
        }
        if checksums_ok(&pkt) || verdict == TC_ACT_REDIRECT {
            prop_assert!(checksums_ok(&out), "checksums: {}", what());
        }
        let (Some(i), Some(o)) = (parse_headers(&pkt), parse_headers(&out)) else {
            return Err(TestCaseError::fail(format!(
                "a frame that is not IP changed: {}",
                what()
            )));
        };
        if verdict == TC_ACT_REDIRECT {
            // Sent back: a reset or an ICMP error to the sender, from where it was sent.
            prop_assert_eq!(o.dst, i.src, "sent back, but elsewhere: {}", what());
            prop_assert!(
                o.src == i.dst || node.contains(&o.src),
                "sent back from a stranger: {}",
                what()
            );
            continue;
        }
        let (o_ports, i_ports) = (o.ports(&out), i.ports(&pkt));
        if o.dst != i.dst || o_ports.map(|p| p.1) != i_ports.map(|p| p.1) {
            let fe = FRONTENDS.iter().find(|(fe, proto, _, _)| {
                let fe: SocketAddr = fe.parse().expect("fe");
                let number = match proto {
                    Protocol::Tcp => 6,
                    Protocol::Udp => 17,
                    Protocol::Sctp => 132,
                };
                fe.ip() == i.dst && Some(fe.port()) == i_ports.map(|p| p.1) && number == i.proto
            });
            let to_backend = fe.is_some_and(|(_, _, backends, _)| {
                o_ports.is_some_and(|(_, d)| {
                    backends.contains(&SocketAddr::new(o.dst, d).to_string().as_str())
                })
            });
            let to_held = match o_ports {
                Some((_, d)) => held_socks.contains(&SocketAddr::new(o.dst, d)),
                None => held_ips.contains(&o.dst),
            };
            prop_assert!(
                to_backend || to_held,
                "destination {} held by no map: {}",
                o.dst,
                what()
            );
        }
        if o.src != i.src || o_ports.map(|p| p.0) != i_ports.map(|p| p.0) {
            let from_frontend = o_ports.is_some_and(|(s, _)| {
                FRONTENDS.iter().any(|(fe, ..)| {
                    fe.parse::<SocketAddr>().ok() == Some(SocketAddr::new(o.src, s))
                })
            });
            let masqueraded = node.contains(&o.src);
            let from_held = held_ips.contains(&o.src);
            prop_assert!(
                from_frontend || masqueraded || from_held,
                "source {} held by no map: {}",
                o.src,
                what()
            );
        }
        if !step.egress
            && matches!(step.what, What::Forward(_))
            && step.mutations.is_empty()
            && let (Some((s, d)), true) = (o_ports, o.src != o.dst)
        {
            seen.forward[step.flow] = Some((SocketAddr::new(o.src, s), SocketAddr::new(o.dst, d)));
        }
    }
    Ok(())
}

/// What the packets met, for the run's summary line.
#[derive(Debug, Default)]
struct Tally {
    packets: u64,
    strangers: u64,
    handed_on: u64,
    translated: u64,
    translated_checksums_checked: u64,
    sent_back: u64,
    dropped: u64,
}

impl Tally {
    fn count(&mut self, pkt: &[u8], verdict: u32, out: &[u8], related: &BTreeSet<IpAddr>) {
        self.packets += 1;
        self.strangers += u64::from(!mentions(pkt, related));
        match verdict {
            TC_ACT_UNSPEC => self.handed_on += 1,
            TC_ACT_SHOT => self.dropped += 1,
            TC_ACT_REDIRECT => self.sent_back += 1,
            _ if out != pkt => {
                self.translated += 1;
                self.translated_checksums_checked += u64::from(checksums_ok(pkt));
            }
            _ => self.handed_on += 1,
        }
    }
}

#[needs_root]
#[test]
fn random_and_mutated_packets_through_the_classifiers() {
    let mut h = Harness::new(&[]);
    configure_node(&mut h, false);
    h.apply(&view());
    let related = service_addresses();
    let h = RefCell::new(h);
    let mut runner = TestRunner::new(fuzz_config(500));
    let started = std::time::Instant::now();
    let tally = RefCell::new(Tally::default());
    let result = runner.run(&case(), |case| {
        run_case(
            &mut h.borrow_mut(),
            &case,
            &related,
            &mut tally.borrow_mut(),
        )
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    eprintln!(
        "fuzz_packets: {} cases in {:.1} s: {:?}",
        runner.config().cases,
        started.elapsed().as_secs_f64(),
        tally.borrow()
    );
}
