//! A BPF_PROG_TEST_RUN harness for the per-packet classifier: the real program, maps
//! written by the agent's own sync code, crafted packets in, verdicts and bytes out.

use std::net::{IpAddr, SocketAddr};

use aya::{
    Ebpf, TestRun as _, TestRunOptions,
    programs::{SchedClassifier, Xdp},
};
use proxy_agent::{
    dataplane::bpf::{self, MapSet, Mirror},
    model::{Frontend, FrontendKind, FrontendState, NodeSettings, NodeView, Protocol},
    trace::{
        self,
        packet::{fold, sum16},
    },
};

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_UNSPEC: u32 = u32::MAX; // -1
pub const TC_ACT_REDIRECT: u32 = 7;

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

pub struct Harness {
    pub ebpf: Ebpf,
    pub maps: MapSet,
    pub state: Mirror,
}

impl Harness {
    pub fn new(max_entries: &[(&str, u32)]) -> Self {
        Self::on(&bpf::Kernel::probed_helpers(), max_entries)
    }

    /// The programs loaded with `kernel`'s switches (an older kernel's fallbacks).
    pub fn on(kernel: &bpf::Kernel, max_entries: &[(&str, u32)]) -> Self {
        let (mut ebpf, maps) = bpf::load_private_on(kernel, max_entries).expect("load");
        let prog: &mut SchedClassifier = ebpf
            .program_mut("tc_ingress")
            .expect("program")
            .try_into()
            .expect("type");
        prog.load().expect("verifier accepts tc_ingress");
        let state = Mirror::adopt(&maps).expect("adopt");
        Harness { ebpf, maps, state }
    }

    pub fn apply(&mut self, view: &NodeView) -> proxy_agent::dataplane::ApplyReport {
        self.state.apply(&mut self.maps, view).expect("apply")
    }

    /// Runs one packet; returns the verdict and the packet as the program left it.
    pub fn run(&self, packet: &[u8]) -> (u32, Vec<u8>) {
        self.run_ingress(packet, None)
    }

    /// `run` as if the packet arrived on interface `ifindex` (of the calling thread's
    /// network namespace): the FIB lookups start there.
    pub fn run_on(&self, packet: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
        // A `struct __sk_buff` with only `ifindex` (offset 40) set.
        let mut skb = [0u8; 192];
        skb[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        self.run_ingress(packet, Some(&skb))
    }

    fn run_ingress(&self, packet: &[u8], skb: Option<&[u8]>) -> (u32, Vec<u8>) {
        let prog: &SchedClassifier = self
            .ebpf
            .program("tc_ingress")
            .expect("program")
            .try_into()
            .expect("type");
        test_run_tc(prog, packet, skb)
    }

    /// Runs one packet through the egress program (`tc_egress`, loaded on first use):
    /// what the node itself sends.
    pub fn run_egress(&mut self, packet: &[u8]) -> (u32, Vec<u8>) {
        self.run_egress_from(packet, 0)
    }

    /// `run_egress` for a packet that came in on interface `ingress_ifindex` (0: one
    /// the node made itself).
    pub fn run_egress_from(&mut self, packet: &[u8], ingress_ifindex: u32) -> (u32, Vec<u8>) {
        let prog: &mut SchedClassifier = self
            .ebpf
            .program_mut("tc_egress")
            .expect("program")
            .try_into()
            .expect("type");
        if prog.fd().is_err() {
            prog.load().expect("verifier accepts tc_egress");
        }
        // A `struct __sk_buff` with only `ingress_ifindex` (offset 36) set.
        let mut skb = [0u8; 192];
        skb[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
        test_run_tc(prog, packet, Some(&skb))
    }

    /// Runs one packet through the XDP program (`xdp_ingress`, loaded on first use) as if
    /// it arrived on interface `ifindex` (of the calling thread's network namespace; 0:
    /// none given, loopback).
    pub fn run_xdp(&mut self, packet: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
        let prog: &mut Xdp = self
            .ebpf
            .program_mut("xdp_ingress")
            .expect("program")
            .try_into()
            .expect("type");
        if prog.fd().is_err() {
            prog.load().expect("verifier accepts xdp_ingress");
        }
        let mut out = vec![0u8; packet.len() + 256];
        // A `struct xdp_md`: data 0, data_end = the packet's length, ingress_ifindex.
        let mut md = [0u8; 24];
        md[4..8].copy_from_slice(&(packet.len() as u32).to_ne_bytes());
        md[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        let res = prog
            .test_run(TestRunOptions {
                data_in: Some(packet),
                data_out: Some(&mut out),
                ctx_in: (ifindex != 0).then_some(&md[..]),
                ..Default::default()
            })
            .expect("test_run");
        out.truncate(res.data_size_out as usize);
        (res.return_value, out)
    }

    /// Every conntrack entry, answered flows and new ones.
    pub fn ct_entries(&self) -> Vec<(proxy_common::CtKey, proxy_common::CtValue)> {
        let answered = self.maps.conntrack.iter().filter_map(Result::ok);
        answered
            .chain(self.maps.conntrack_new.iter().filter_map(Result::ok))
            .collect()
    }

    pub fn counter(&self, name: &str) -> u64 {
        self.maps
            .counters()
            .expect("counters")
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
            .expect("counter exists")
    }
}

/// One `BPF_PROG_TEST_RUN` of a classifier, with `skb` as its `struct __sk_buff` if given.
fn test_run_tc(prog: &SchedClassifier, packet: &[u8], skb: Option<&[u8]>) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; packet.len() + 256];
    let res = prog
        .test_run(TestRunOptions {
            data_in: Some(packet),
            data_out: Some(&mut out),
            ctx_in: skb,
            ..Default::default()
        })
        .expect("test_run");
    out.truncate(res.data_size_out as usize);
    (res.return_value, out)
}

pub fn frontend(
    ip: &str,
    port: u16,
    protocol: Protocol,
    backends: &[&str],
) -> (Frontend, FrontendState) {
    (
        Frontend {
            ip: ip.parse().expect("ip"),
            port,
            protocol,
        },
        FrontendState::builder(format!("default/test:{port}"), FrontendKind::ClusterIp)
            .backends(backends.iter().map(|b| b.parse().expect("backend")))
            .build(),
    )
}

/// Ethernet + IP + TCP SYN (or UDP) with valid checksums.
pub fn packet(src: SocketAddr, dst: SocketAddr, tcp: bool) -> Vec<u8> {
    let proto = if tcp { Protocol::Tcp } else { Protocol::Udp };
    trace::packet::build(src, dst, proto)
}

/// The packet's addresses, its checksums verified.
pub fn inspect(pkt: &[u8]) -> trace::packet::Seen {
    trace::packet::inspect(pkt).unwrap_or_else(|e| panic!("bad packet: {e}"))
}

pub fn sa(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

/// The node of the scenarios: node-a, 192.0.2.10, pod network 10.244.0.0/16.
pub fn configure_node(h: &mut Harness, masquerade_all: bool) {
    configure_node_with(h, masquerade_all, Default::default());
}

pub fn configure_node_with(
    h: &mut Harness,
    masquerade_all: bool,
    conntrack: bpf::ConntrackOptions,
) {
    bpf::writer::configure(
        &mut h.maps,
        &NodeSettings {
            pod_cidrs: vec![
                "10.244.0.0/16".parse().expect("cidr"),
                "fd00:244::/48".parse().expect("cidr"),
            ],
            node_addresses: vec![
                "192.0.2.10".parse().expect("ip"),
                "2001:db8:a::10".parse().expect("ip"),
            ],
            masquerade_all,
            // This node's own pods (xdp_test_run's `xt1`); 10.244.2.0/24 is another node's.
            node_pod_cidrs: vec![
                "10.244.1.0/24".parse().expect("cidr"),
                "fd00:244:1::/64".parse().expect("cidr"),
            ],
            peer_addresses: Vec::new(),
        },
        &conntrack,
    )
    .expect("configure");
}

/// TCP with a packet's flags (SYN for new flows, then ACK, FIN...).
pub fn tcp_with_flags(src: SocketAddr, dst: SocketAddr, flags: u8) -> Vec<u8> {
    trace::packet::build_tcp(src, dst, flags)
}

/// An Ethernet frame carrying an ICMP (IPv4) or ICMPv6 error from `src` to `dst`:
/// `kind`, `code`, the 32-bit word after the checksum (`info`: an MTU, or 0), `quote`.
pub fn icmp_error(
    src: IpAddr,
    dst: IpAddr,
    kind: u8,
    code: u8,
    info: u32,
    quote: &[u8],
) -> Vec<u8> {
    let mut msg = vec![kind, code, 0, 0];
    msg.extend_from_slice(&info.to_be_bytes());
    msg.extend_from_slice(quote);
    // ICMP's checksum covers the message; ICMPv6's a pseudo-header too.
    let (proto, acc) = match (src, dst) {
        (IpAddr::V4(_), _) => (1, 0),
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut pseudo = Vec::new();
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, 58]);
            (58, sum16(&pseudo, 0))
        }
        _ => unreachable!("one family"),
    };
    let c = fold(sum16(&msg, acc));
    msg[2..4].copy_from_slice(&c.to_be_bytes());
    // IPv4's ICMP errors go as network control (TOS 0xc0), as the kernel sends them.
    let mut pkt = trace::packet::ip_frame(src, dst, proto, 0xc0, msg.len()).expect("one family");
    pkt.extend_from_slice(&msg);
    pkt
}
