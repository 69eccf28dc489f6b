//! Per-packet service NAT (TC ingress): DNAT of packets addressed to a frontend, with
//! connection tracking so every packet of a flow keeps its backend, masquerade (SNAT to
//! the node) where kube-proxy would masquerade, reverse NAT of the replies, source-range
//! filtering, and TCP resets for services without endpoints. Packets that are not ours
//! pass on untouched (`TCX_NEXT`).

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        __sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT,
        TC_ACT_UNSPEC,
    },
    btf_maps::lpm_trie::Key,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::TcContext,
};
use proxy_common::{
    AFFINITY_BY_ADDR, Backend, CFG_LOCAL_DETECTOR, CFG_MASQUERADE_ALL, CT_DIR_FORWARD,
    CT_DIR_REPLY, CT_F_CLOSING, CT_F_REPLIED, CT_F_SNAT, CtKey, CtTimeouts, CtValue, FAMILY_V4,
    FAMILY_V6, FragKey, FragPorts, LPM_TAG_BITS, LPM_TAG_NODE, LPM_TAG_POD, LpmData, NodeConfig,
    PROTO_SCTP, PROTO_TCP, PROTO_UDP, SNAT_PORT_MAX, SNAT_PORT_MIN, SVC_F_EXT_LOCAL,
    SVC_F_EXTERNAL, SVC_F_SOURCE_RANGES, ServiceValue, TAIL_SCTP_CRC, counter, crc32c,
};

use crate::{
    lb::{self, Client, NoBackend},
    maps::{
        CONNTRACK, FRAGMENTS, LOCAL_NETS, NODE_CONFIG, REV_NAT, SCRATCH_FORWARD, SCRATCH_REPLY,
        SCTP_PENDING, SCTP_ZEROS, SOURCE_RANGES, TC_TAIL, count, ct_scratch,
    },
    reject, route,
};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
pub const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
const IPV4_SADDR_OFF: usize = ETH_HLEN + 12;
const IPV4_DADDR_OFF: usize = ETH_HLEN + 16;
const IPV6_SADDR_OFF: usize = ETH_HLEN + 8;
const IPV6_DADDR_OFF: usize = ETH_HLEN + 24;
const IPV6_HLEN: usize = 40;
const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;

/// Where a translated packet goes next.
pub enum Verdict {
    /// On through the stack (routing, local delivery).
    Stack,
    /// Already sent out of an interface: return this code.
    Redirected(i32),
}

impl Verdict {
    fn code(self) -> i32 {
        match self {
            Verdict::Stack => DONE,
            Verdict::Redirected(code) => code,
        }
    }
}

/// Not ours: let the next program (or the stack) have it.
const PASS_ON: i32 = TC_ACT_UNSPEC;
const DONE: i32 = TC_ACT_OK as i32;
pub const DROP: i32 = TC_ACT_SHOT as i32;

/// The parts of a TCP/UDP packet the NAT reads and rewrites.
pub struct Packet {
    pub family: u8,
    pub proto: u8,
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    /// Network byte order, as in the packet.
    pub sport: u16,
    pub dport: u16,
    /// A later fragment of an IPv4 datagram: no L4 header here, the ports come from the
    /// first fragment (`FRAGMENTS`), and only addresses are rewritten.
    pub tail: bool,
    pub l4_off: usize,
}

impl Packet {
    fn ct_key(&self, dir: u8) -> CtKey {
        CtKey {
            saddr: self.saddr,
            daddr: self.daddr,
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            family: self.family,
            dir,
            _pad: 0,
        }
    }
}

/// Where a packet comes from, as kube-proxy's local-traffic detector sees it.
struct Origin {
    /// From the pod network (`clusterCIDR`).
    pod: bool,
    /// Sent by the node itself (one of its addresses, or loopback).
    node: bool,
}

/// The classifier: translate, then — for SCTP only — hand the checksum to the tail call.
pub fn ingress(ctx: &TcContext) -> i32 {
    let pkt = match parse(ctx) {
        Ok(Some(pkt)) => pkt,
        Ok(None) => return PASS_ON,
        Err(v) => return v,
    };
    let verdict = match translate(ctx, &pkt) {
        Ok(v) | Err(v) => v,
    };
    if pkt.proto == PROTO_SCTP {
        finish(ctx, verdict)
    } else {
        verdict
    }
}

#[inline(always)]
fn translate(ctx: &TcContext, pkt: &Packet) -> Result<i32, i32> {
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(verdict) = reply(ctx, pkt, now)? {
        return Ok(verdict);
    }
    if let Some(verdict) = established(ctx, pkt, now)? {
        return Ok(verdict);
    }
    if pkt.tail {
        return Ok(PASS_ON); // its first fragment started no flow
    }
    new_flow(ctx, pkt)
}

// The three paths are separate functions (not inlined) so their locals never share one
// stack frame: the BPF stack is 512 bytes.

/// A reply of a translated flow: the frontend as source, and the client back as
/// destination when the flow was masqueraded.
#[inline(never)]
fn reply(ctx: &TcContext, pkt: &Packet, now: u64) -> Result<Option<i32>, i32> {
    let Some(ct) = CONNTRACK.get_ptr_mut(&pkt.ct_key(CT_DIR_REPLY)) else {
        return Ok(None);
    };
    let closing = closing_flag(ctx, pkt);
    // SAFETY: the entry stays valid during this program run (RCU); racy stores of the
    // timestamp and state bits are harmless.
    let entry = unsafe { *ct };
    if expired(&entry, pkt.proto, now) {
        return Ok(None);
    }
    // SAFETY: as above.
    unsafe {
        (*ct).last_seen_ns = now;
        (*ct).flags |= closing;
    }
    // SAFETY: the value is copied out at once.
    let Some(frontend) = (unsafe { REV_NAT.get(&entry.rev_nat_id).copied() }) else {
        return Ok(Some(DONE));
    };
    mark_replied(pkt, &entry, &frontend.addr, frontend.port, closing);
    rewrite(ctx, pkt, Side::Source, &frontend.addr, frontend.port)?;
    let snat = entry.flags & CT_F_SNAT != 0;
    if snat {
        rewrite(ctx, pkt, Side::Destination, &entry.nat_addr, entry.nat_port)?;
    }
    count(counter::CT_REPLY_NAT);
    let dst = if snat { &entry.nat_addr } else { &pkt.daddr };
    if snat || is_node_address(pkt.family, &frontend.addr) {
        return Ok(Some(
            route::forward(ctx, pkt.family, &frontend.addr, dst).code(),
        ));
    }
    Ok(Some(DONE))
}

/// A packet of a flow we already translated keeps its backend while that exists.
#[inline(never)]
fn established(ctx: &TcContext, pkt: &Packet, now: u64) -> Result<Option<i32>, i32> {
    // A reference into the map, not a copy: the BPF stack is small. Other CPUs only
    // touch `last_seen_ns` and `flags` of a live entry.
    let Some(ct) = CONNTRACK.get_ptr_mut(&pkt.ct_key(CT_DIR_FORWARD)) else {
        return Ok(None);
    };
    // SAFETY: the pointer stays valid memory for the program's run (RCU); under eviction
    // pressure the LRU may recycle the entry meanwhile, which at worst misroutes this
    // one packet.
    let ct = unsafe { &mut *ct };
    if expired(ct, pkt.proto, now) {
        return Ok(None); // idle too long: balanced again
    }
    // TCP and SCTP keep their backend to the end (a terminating pod finishes its
    // connections); a UDP flow whose backend is gone is balanced again.
    if pkt.proto == PROTO_UDP && lb::backend(ct.backend_id).is_none() {
        return Ok(None);
    }
    let closing = closing_flag(ctx, pkt);
    if ct.flags & CT_F_SNAT != 0 {
        rewrite(ctx, pkt, Side::Source, &ct.nat_addr, ct.nat_port)?;
    }
    rewrite(
        ctx,
        pkt,
        Side::Destination,
        &ct.backend_addr,
        ct.backend_port,
    )?;
    ct.last_seen_ns = now;
    ct.flags |= closing;
    if ct.flags & CT_F_SNAT != 0 {
        return Ok(Some(
            route::forward(ctx, pkt.family, &ct.nat_addr, &ct.backend_addr).code(),
        ));
    }
    Ok(Some(DONE))
}

/// A new flow: find the service, check source ranges, choose a backend, decide on
/// masquerade, record both directions, translate.
#[inline(never)]
fn new_flow(ctx: &TcContext, pkt: &Packet) -> Result<i32, i32> {
    // A reference into the map, not a copy: the BPF stack is small.
    let Some(cfg) = NODE_CONFIG.get(0) else {
        return Ok(PASS_ON); // unreachable: index 0 of a one-entry array
    };
    let origin = origin(pkt, cfg);
    let internal = origin.pod || origin.node;
    let Some(svc) = lb::lookup_service(pkt.daddr, pkt.dport, pkt.proto, pkt.family, internal)
    else {
        return Ok(PASS_ON);
    };
    count(counter::SVC_HIT);
    if svc.flags & SVC_F_SOURCE_RANGES != 0 && !source_allowed(svc.id, pkt) {
        count(counter::SOURCE_RANGE_DROP);
        return Err(DROP);
    }
    let client = Client {
        id: pkt.saddr,
        kind: AFFINITY_BY_ADDR,
        family: pkt.family,
    };
    let (backend_id, be) = match lb::select_backend(&svc, &client) {
        Ok(found) => found,
        Err(NoBackend::Reject) => return reject::refuse(ctx, pkt),
        Err(NoBackend::Drop) => return Err(DROP),
    };
    let Some(entry) = ct_scratch(SCRATCH_FORWARD) else {
        return Err(DROP); // unreachable: a valid index
    };
    entry.backend_id = backend_id;
    entry.backend_addr = be.addr;
    entry.backend_port = be.port;
    entry.rev_nat_id = svc.rev_nat_id;
    if masquerade(&svc, cfg, &origin, pkt, &be) {
        // A zero address (none configured for the family) means no masquerade.
        entry.nat_addr = if pkt.family == FAMILY_V4 {
            cfg.snat_v4
        } else {
            cfg.snat_v6
        };
    }
    record(pkt, &be, entry)?;
    if entry.flags & CT_F_SNAT != 0 {
        rewrite(ctx, pkt, Side::Source, &entry.nat_addr, entry.nat_port)?;
    }
    rewrite(ctx, pkt, Side::Destination, &be.addr, be.port)?;
    if entry.flags & CT_F_SNAT != 0 {
        return Ok(route::forward(ctx, pkt.family, &entry.nat_addr, &be.addr).code());
    }
    Ok(DONE)
}

/// Writes the flow's forward and reply entries. `entry` arrives with the backend, the
/// reverse-NAT id and — to masquerade — the node address in `nat_addr`; with masquerade a
/// source port is claimed and `entry` leaves with `CT_F_SNAT` and `nat_port` set.
/// (Few, scalar-or-pointer arguments: the verifier takes no stack-passed ones.)
#[inline(never)]
fn record(pkt: &Packet, be: &Backend, entry: &mut CtValue) -> Result<(), i32> {
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    entry.last_seen_ns = now;
    let Some(reply) = ct_scratch(SCRATCH_REPLY) else {
        return Err(DROP); // unreachable: a valid index
    };
    reply.last_seen_ns = now;
    reply.backend_id = entry.backend_id;
    reply.rev_nat_id = entry.rev_nat_id;
    let mut reply_key = CtKey {
        saddr: be.addr,
        daddr: pkt.saddr,
        sport: be.port,
        dport: pkt.sport,
        proto: pkt.proto,
        family: pkt.family,
        dir: CT_DIR_REPLY,
        _pad: 0,
    };
    if entry.nat_addr != [0; 4] {
        reply.flags = CT_F_SNAT;
        reply.nat_addr = pkt.saddr;
        reply.nat_port = pkt.sport;
        reply_key.daddr = entry.nat_addr;
        let Some(port) = allocate_port(&mut reply_key, reply) else {
            count(counter::SNAT_PORTS_EXHAUSTED);
            return Err(DROP);
        };
        entry.flags = CT_F_SNAT;
        entry.nat_port = port;
        count(counter::SNAT);
    } else if CONNTRACK.insert(&reply_key, reply, 0).is_err() {
        count(counter::CT_CREATE_FAILED);
    }
    // A forward entry without its reply entry would leave replies untranslated; the
    // packet is translated either way.
    if CONNTRACK
        .insert(&pkt.ct_key(CT_DIR_FORWARD), entry, 0)
        .is_err()
    {
        count(counter::CT_CREATE_FAILED);
    }
    Ok(())
}

/// kube-proxy's masquerade rules: `masqueradeAll`; hairpin (a pod reaching itself);
/// external frontends always with `externalTrafficPolicy: Cluster`, only for traffic the
/// node sends with `Local`; ClusterIPs for traffic from outside the pod network.
fn masquerade(
    svc: &ServiceValue,
    cfg: &NodeConfig,
    origin: &Origin,
    pkt: &Packet,
    be: &Backend,
) -> bool {
    if cfg.flags & CFG_MASQUERADE_ALL != 0 || be.addr == pkt.saddr {
        return true;
    }
    if svc.flags & SVC_F_EXTERNAL != 0 {
        return svc.flags & SVC_F_EXT_LOCAL == 0 || origin.node;
    }
    cfg.flags & CFG_LOCAL_DETECTOR != 0 && !origin.pod
}

fn lpm_key(tag: u32, family: u8, addr: [u32; 4]) -> Key<LpmData> {
    let bits = if family == FAMILY_V4 { 32 } else { 128 };
    Key::new(LPM_TAG_BITS + bits, LpmData { tag, addr })
}

fn origin(pkt: &Packet, cfg: &NodeConfig) -> Origin {
    let family = u32::from(pkt.family);
    let pod = cfg.flags & CFG_LOCAL_DETECTOR != 0
        && LOCAL_NETS
            .get(&lpm_key(LPM_TAG_POD | family, pkt.family, pkt.saddr))
            .is_some();
    let loopback = if pkt.family == FAMILY_V4 {
        pkt.saddr[0].to_ne_bytes()[0] == 127
    } else {
        pkt.saddr == [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])]
    };
    let node = loopback
        || LOCAL_NETS
            .get(&lpm_key(LPM_TAG_NODE | family, pkt.family, pkt.saddr))
            .is_some();
    Origin { pod, node }
}

/// `CT_F_CLOSING` for a TCP segment carrying FIN or RST, else 0.
fn closing_flag(ctx: &TcContext, pkt: &Packet) -> u8 {
    if pkt.proto != PROTO_TCP || pkt.tail {
        return 0;
    }
    match ctx.load::<u8>(pkt.l4_off + 13) {
        Ok(flags) if flags & (TCP_FIN | TCP_RST) != 0 => CT_F_CLOSING,
        _ => 0,
    }
}

/// Whether an entry has been idle longer than its state allows.
fn expired(ct: &CtValue, proto: u8, now: u64) -> bool {
    let t = NODE_CONFIG
        .get(0)
        .map(|c| c.timeouts)
        .unwrap_or(CtTimeouts::DEFAULT);
    let pick = |v: u32, default: u32| if v == 0 { default } else { v };
    let d = CtTimeouts::DEFAULT;
    // SCTP has no FIN to watch: its associations age like TCP connections that never
    // close.
    let secs = if proto == PROTO_TCP || proto == PROTO_SCTP {
        if ct.flags & CT_F_CLOSING != 0 {
            pick(t.tcp_closing, d.tcp_closing)
        } else if ct.flags & CT_F_REPLIED != 0 {
            pick(t.tcp_established, d.tcp_established)
        } else {
            pick(t.tcp_syn, d.tcp_syn)
        }
    } else if ct.flags & CT_F_REPLIED != 0 {
        pick(t.udp_stream, d.udp_stream)
    } else {
        pick(t.udp, d.udp)
    };
    now.wrapping_sub(ct.last_seen_ns) > u64::from(secs) * 1_000_000_000
}

/// Marks the forward entry of the flow a reply belongs to as answered (and closing).
/// Reply entries are always "answered": they exist because a forward packet went out.
#[inline(never)]
fn mark_replied(
    pkt: &Packet,
    reply: &CtValue,
    frontend: &[u32; 4],
    frontend_port: u16,
    closing: u8,
) {
    let snat = reply.flags & CT_F_SNAT != 0;
    let key = CtKey {
        saddr: if snat { reply.nat_addr } else { pkt.daddr },
        daddr: *frontend,
        sport: if snat { reply.nat_port } else { pkt.dport },
        dport: frontend_port,
        proto: pkt.proto,
        family: pkt.family,
        dir: CT_DIR_FORWARD,
        _pad: 0,
    };
    if let Some(fwd) = CONNTRACK.get_ptr_mut(&key) {
        // SAFETY: as for every entry update: valid for this run, racy bits harmless.
        unsafe { (*fwd).flags |= CT_F_REPLIED | closing };
    }
}

/// One of the node's own addresses (or loopback).
fn is_node_address(family: u8, addr: &[u32; 4]) -> bool {
    LOCAL_NETS
        .get(&lpm_key(LPM_TAG_NODE | u32::from(family), family, *addr))
        .is_some()
}

fn source_allowed(service_id: u32, pkt: &Packet) -> bool {
    SOURCE_RANGES
        .get(&lpm_key(service_id, pkt.family, pkt.saddr))
        .is_some()
}

/// Finds a free masquerade port: claims the reply tuple with `BPF_NOEXIST`, so two flows
/// never share one. Returns the port in network byte order.
#[inline(never)]
fn allocate_port(reply_key: &mut CtKey, reply: &CtValue) -> Option<u16> {
    let range = u32::from(SNAT_PORT_MAX - SNAT_PORT_MIN) + 1;
    // SAFETY: no preconditions.
    let start = unsafe { bpf_get_prandom_u32() } % range;
    for i in 0..8u32 {
        let port = (SNAT_PORT_MIN as u32 + (start + i * 7919) % range) as u16;
        reply_key.dport = port.to_be();
        if CONNTRACK
            .insert(reply_key, reply, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            return Some(port.to_be());
        }
    }
    None
}

/// The interface a packet arrived on.
pub fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context is a valid __sk_buff; ifindex is a plain readable field.
    unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex }
}

/// Reads the 5-tuple; `None` for anything that is not unfragmented TCP/UDP over IP.
#[inline(always)]
fn parse(ctx: &TcContext) -> Result<Option<Packet>, i32> {
    let ether_type = u16::from_be(ctx.load::<u16>(12).map_err(|_| PASS_ON)?);
    let (family, proto, saddr, daddr, l4_off, frag) = match ether_type {
        ETH_P_IP => {
            let ver_ihl: u8 = ctx.load(ETH_HLEN).map_err(|_| PASS_ON)?;
            let ihl = usize::from(ver_ihl & 0x0f) * 4;
            if ihl < 20 {
                return Ok(None);
            }
            let proto: u8 = ctx.load(ETH_HLEN + 9).map_err(|_| PASS_ON)?;
            let s: u32 = ctx.load(IPV4_SADDR_OFF).map_err(|_| PASS_ON)?;
            let d: u32 = ctx.load(IPV4_DADDR_OFF).map_err(|_| PASS_ON)?;
            let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).map_err(|_| PASS_ON)?);
            let frag = frag & 0x3fff != 0;
            (
                FAMILY_V4,
                proto,
                [s, 0, 0, 0],
                [d, 0, 0, 0],
                ETH_HLEN + ihl,
                frag,
            )
        }
        ETH_P_IPV6 => {
            // Extension headers (fragments among them) are not walked: such packets pass
            // untranslated.
            let proto: u8 = ctx.load(ETH_HLEN + 6).map_err(|_| PASS_ON)?;
            let s: [u32; 4] = ctx.load(IPV6_SADDR_OFF).map_err(|_| PASS_ON)?;
            let d: [u32; 4] = ctx.load(IPV6_DADDR_OFF).map_err(|_| PASS_ON)?;
            (FAMILY_V6, proto, s, d, ETH_HLEN + IPV6_HLEN, false)
        }
        _ => return Ok(None),
    };
    if proto != PROTO_TCP && proto != PROTO_UDP && proto != PROTO_SCTP {
        return Ok(None);
    }
    let (sport, dport, tail) = if frag {
        let found = fragment(ctx, l4_off);
        if found == 0 {
            return Ok(None);
        }
        (found as u16, (found >> 16) as u16, found & FRAG_TAIL != 0)
    } else {
        let sport: u16 = ctx.load(l4_off).map_err(|_| PASS_ON)?;
        let dport: u16 = ctx.load(l4_off + 2).map_err(|_| PASS_ON)?;
        (sport, dport, false)
    };
    Ok(Some(Packet {
        family,
        proto,
        saddr,
        daddr,
        sport,
        dport,
        tail,
        l4_off,
    }))
}

/// `fragment`'s answer: the ports (bits 0–31), a later fragment (`FRAG_TAIL`), found
/// (`FRAG_FOUND`); 0 leaves the packet alone. A scalar: the BPF calling convention has
/// no room for a struct.
const FRAG_TAIL: u64 = 1 << 32;
const FRAG_FOUND: u64 = 1 << 33;

/// A fragment of an IPv4 datagram (more-fragments set, or an offset). The first one is
/// parsed as usual and leaves its ports for the others; a later one borrows them, or —
/// ahead of its first fragment, or not ours — passes untouched.
#[inline(never)]
fn fragment(ctx: &TcContext, l4_off: usize) -> u64 {
    let (Ok(saddr), Ok(daddr), Ok(id), Ok(proto), Ok(frag)) = (
        ctx.load::<u32>(IPV4_SADDR_OFF),
        ctx.load::<u32>(IPV4_DADDR_OFF),
        ctx.load::<u16>(ETH_HLEN + 4),
        ctx.load::<u8>(ETH_HLEN + 9),
        ctx.load::<u16>(ETH_HLEN + 6),
    ) else {
        return 0;
    };
    let key = FragKey {
        saddr,
        daddr,
        id,
        proto,
        _pad: 0,
    };
    if u16::from_be(frag) & 0x1fff != 0 {
        // SAFETY: the value is copied out at once.
        return match unsafe { FRAGMENTS.get(&key).copied() } {
            Some(p) => FRAG_FOUND | FRAG_TAIL | u64::from(p.sport) | u64::from(p.dport) << 16,
            None => 0,
        };
    }
    let (Ok(sport), Ok(dport)) = (ctx.load::<u16>(l4_off), ctx.load::<u16>(l4_off + 2)) else {
        return 0;
    };
    // A full table only costs this datagram's later fragments their translation.
    let _ = FRAGMENTS.insert(&key, &FragPorts { sport, dport }, 0);
    FRAG_FOUND | u64::from(sport) | u64::from(dport) << 16
}

enum Side {
    Source,
    Destination,
}

/// Rewrites one side's address and port, keeping the IPv4 header checksum and the L4
/// checksum (whose pseudo-header covers the addresses) valid.
#[inline(never)]
fn rewrite(
    ctx: &TcContext,
    pkt: &Packet,
    side: Side,
    addr: &[u32; 4],
    port: u16,
) -> Result<(), i32> {
    let (old_addr, old_port, port_off) = match side {
        Side::Source => (pkt.saddr, pkt.sport, pkt.l4_off),
        Side::Destination => (pkt.daddr, pkt.dport, pkt.l4_off + 2),
    };
    if pkt.tail {
        return rewrite_ipv4_address(ctx, pkt, side, addr);
    }
    if pkt.proto == PROTO_SCTP {
        return rewrite_sctp(ctx, pkt, side, addr, port);
    }
    let (csum_off, zero_flag) = if pkt.proto == PROTO_TCP {
        (pkt.l4_off + 16, 0)
    } else {
        // A zero UDP checksum (IPv4) means "none" and must stay zero.
        (pkt.l4_off + 6, u64::from(BPF_F_MARK_MANGLED_0))
    };
    let fail = |_| {
        count(counter::REWRITE_FAILED);
        DROP
    };
    let pseudo = u64::from(BPF_F_PSEUDO_HDR) | zero_flag | 4;
    if pkt.family == FAMILY_V4 {
        let addr_off = match side {
            Side::Source => IPV4_SADDR_OFF,
            Side::Destination => IPV4_DADDR_OFF,
        };
        ctx.l4_csum_replace(csum_off, u64::from(old_addr[0]), u64::from(addr[0]), pseudo)
            .map_err(fail)?;
        ctx.l3_csum_replace(IPV4_CSUM_OFF, u64::from(old_addr[0]), u64::from(addr[0]), 4)
            .map_err(fail)?;
        ctx.store(addr_off, &addr[0], 0).map_err(fail)?;
    } else {
        let addr_off = match side {
            Side::Source => IPV6_SADDR_OFF,
            Side::Destination => IPV6_DADDR_OFF,
        };
        for i in 0..4 {
            ctx.l4_csum_replace(csum_off, u64::from(old_addr[i]), u64::from(addr[i]), pseudo)
                .map_err(fail)?;
        }
        ctx.store(addr_off, addr, 0).map_err(fail)?;
    }
    ctx.l4_csum_replace(
        csum_off,
        u64::from(old_port),
        u64::from(port),
        zero_flag | 2,
    )
    .map_err(fail)?;
    ctx.store(port_off, &port, 0).map_err(fail)?;
    Ok(())
}

/// One IPv4 address and the header checksum, nothing else: what a later fragment needs
/// (the L4 checksum, covering the whole datagram, was adjusted in the first fragment)
/// and what SCTP needs (its checksum covers no addresses).
#[inline(never)]
fn rewrite_ipv4_address(
    ctx: &TcContext,
    pkt: &Packet,
    side: Side,
    addr: &[u32; 4],
) -> Result<(), i32> {
    let fail = |_| {
        count(counter::REWRITE_FAILED);
        DROP
    };
    let (old_addr, addr_off) = match side {
        Side::Source => (pkt.saddr[0], IPV4_SADDR_OFF),
        Side::Destination => (pkt.daddr[0], IPV4_DADDR_OFF),
    };
    ctx.l3_csum_replace(IPV4_CSUM_OFF, u64::from(old_addr), u64::from(addr[0]), 4)
        .map_err(fail)?;
    ctx.store(addr_off, &addr[0], 0).map_err(fail)
}

/// SCTP's checksum (CRC32c) covers no addresses, only the packet: addresses change with
/// the IPv4 header checksum alone, ports with an in-place CRC update.
#[inline(never)]
fn rewrite_sctp(
    ctx: &TcContext,
    pkt: &Packet,
    side: Side,
    addr: &[u32; 4],
    port: u16,
) -> Result<(), i32> {
    let fail = |_| {
        count(counter::REWRITE_FAILED);
        DROP
    };
    let (old_port, port_off, source) = match side {
        Side::Source => (pkt.sport, pkt.l4_off, true),
        Side::Destination => (pkt.dport, pkt.l4_off + 2, false),
    };
    let len = if pkt.family == FAMILY_V4 {
        rewrite_ipv4_address(ctx, pkt, side, addr)?;
        let total = u16::from_be(ctx.load::<u16>(ETH_HLEN + 2).map_err(fail)?);
        u32::from(total).wrapping_sub((pkt.l4_off - ETH_HLEN) as u32)
    } else {
        let addr_off = match side {
            Side::Source => IPV6_SADDR_OFF,
            Side::Destination => IPV6_DADDR_OFF,
        };
        ctx.store(addr_off, addr, 0).map_err(fail)?;
        u32::from(u16::from_be(ctx.load::<u16>(ETH_HLEN + 4).map_err(fail)?))
    };
    if port == old_port {
        return Ok(());
    }
    ctx.store(port_off, &port, 0).map_err(fail)?;
    // The checksum is finished once per packet, by the tail call `finish` makes.
    let Some(p) = SCTP_PENDING.get_ptr_mut(0) else {
        return Err(DROP); // unreachable: index 0 of a one-entry array
    };
    // SAFETY: this CPU's slot, used by one packet at a time.
    let p = unsafe { &mut *p };
    // Ports as loaded are the little-endian halves of the packet's first word.
    p.delta ^= u32::from(old_port ^ port) << if source { 0 } else { 16 };
    p.len = len;
    p.sum_off = (pkt.l4_off + 8) as u32;
    Ok(())
}

/// The classifier's last step for SCTP: a packet whose ports changed goes on to the
/// checksum tail call with the verdict; any other ends here.
#[inline(always)]
pub fn finish(ctx: &TcContext, verdict: i32) -> i32 {
    let Some(p) = SCTP_PENDING.get_ptr_mut(0) else {
        return verdict;
    };
    // SAFETY: this CPU's slot, used by one packet at a time.
    let p = unsafe { &mut *p };
    if p.delta == 0 {
        return verdict;
    }
    p.verdict = verdict;
    // SAFETY: a valid context and program array; returns only if the call fails.
    unsafe { TC_TAIL.tail_call(ctx, TAIL_SCTP_CRC) };
    p.delta = 0;
    count(counter::REWRITE_FAILED);
    DROP // a wrong checksum would be dropped by the receiver anyway
}

/// The tail call: applies the pending port change to the SCTP checksum, returns the
/// classifier's verdict.
pub fn sctp_checksum(ctx: &TcContext) -> i32 {
    let Some(p) = SCTP_PENDING.get_ptr_mut(0) else {
        return DROP;
    };
    // SAFETY: this CPU's slot, used by one packet at a time.
    let p = unsafe { &mut *p };
    let (delta, verdict) = (p.delta, p.verdict);
    p.delta = 0;
    // Beyond the table: an offloaded segment, whose CRC the kernel computes later.
    let Some(zeros) = SCTP_ZEROS.get(p.len) else {
        return verdict;
    };
    let off = p.sum_off as usize;
    let Ok(sum) = ctx.load::<u32>(off) else {
        count(counter::REWRITE_FAILED);
        return DROP;
    };
    let sum = crc32c::after_first_word_change(sum, delta, *zeros);
    if ctx.store(off, &sum, 0).is_err() {
        count(counter::REWRITE_FAILED);
        return DROP;
    }
    verdict
}
