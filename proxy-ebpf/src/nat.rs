//! Address translation of the per-packet path: rewriting addresses and ports with their
//! checksums (IPv4 header, TCP/UDP pseudo-header, SCTP's CRC32c) and masquerade
//! decisions. The masquerade source ports are `conntrack`'s: a port is a claim on a reply
//! tuple.
//!
//! Layer 4. Owns: the address and port rewrites with their checksums, the masquerade
//! decision, and the SCTP checksum's tail call (`finish`, `sctp_checksum`). May import:
//! layers 0-3 (`maps`, `verdict`, `packet`, `stats`, `drop`, `node`, `conntrack`, `lb`,
//! `reject`, `route`).

use aya_ebpf::programs::TcContext;
use proxy_common::{
    CFG_LOCAL_DETECTOR, CFG_MASQUERADE_ALL, FAMILY_V4, NodeConfig, PROTO_SCTP, PROTO_TCP,
    SVC_F_EXT_LOCAL, SVC_F_EXTERNAL, ServiceValue, TAIL_SCTP_CRC, crc32c,
};

use crate::{
    drop::{self, Reason},
    frame::{CsumKind, Frame, csum},
    maps::{SCTP_PENDING, SCTP_ZEROS, TC_TAIL},
    node::Origin,
    packet::{
        ETH_HLEN, IPV4_CSUM_OFF, IPV4_DADDR_OFF, IPV4_SADDR_OFF, IPV6_DADDR_OFF, IPV6_SADDR_OFF,
        Packet,
    },
};

/// kube-proxy's masquerade rules: hairpin (a pod reaching itself); external frontends
/// always with `externalTrafficPolicy: Cluster`, only for traffic the node sends with
/// `Local`; ClusterIPs with `masqueradeAll`, else for traffic from outside the pod
/// network. (`masqueradeAll` is a rule of kube-proxy's cluster-IP chain only, so outside
/// clients of an eTP Local NodePort keep their address even then.)
pub fn masquerade(
    svc: &ServiceValue,
    cfg: &NodeConfig,
    origin: &Origin,
    pkt: &Packet,
    backend: &[u32; 4],
) -> bool {
    if *backend == pkt.saddr {
        return true;
    }
    if svc.flags & SVC_F_EXTERNAL != 0 {
        return svc.flags & SVC_F_EXT_LOCAL == 0 || origin.node;
    }
    cfg.flags & CFG_MASQUERADE_ALL != 0 || (cfg.flags & CFG_LOCAL_DETECTOR != 0 && !origin.pod)
}

pub enum Side {
    Source,
    Destination,
}

/// Rewrites one side's address and port, keeping the IPv4 header checksum and the L4
/// checksum (whose pseudo-header covers the addresses) valid. (Checksums the way the hook
/// can: `Frame`.)
#[inline(never)]
pub fn rewrite<F: Frame>(
    ctx: &F,
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
    let (csum_off, kind) = if pkt.proto == PROTO_TCP {
        (pkt.l4_off + 16, CsumKind::Always)
    } else {
        // A zero UDP checksum (IPv4) means "none" and must stay zero.
        (pkt.l4_off + 6, CsumKind::ZeroIsNone)
    };
    let fail = |_| drop::packet(Reason::RewriteFailed);
    // The writes go straight into the packet; each checksum is folded once from the
    // sum of its changes.
    let mut pseudo = 0u64;
    if pkt.family == FAMILY_V4 {
        let addr_off = match side {
            Side::Source => IPV4_SADDR_OFF,
            Side::Destination => IPV4_DADDR_OFF,
        };
        pseudo = csum::delta(old_addr[0], addr[0]);
        fix_ipv4_header_csum(ctx, pseudo).map_err(fail)?;
        ctx.store(addr_off, &addr[0]).map_err(fail)?;
    } else {
        let addr_off = match side {
            Side::Source => IPV6_SADDR_OFF,
            Side::Destination => IPV6_DADDR_OFF,
        };
        for i in 0..4 {
            pseudo += csum::delta(old_addr[i], addr[i]);
        }
        ctx.store(addr_off, addr).map_err(fail)?;
    }
    let plain = if port == old_port {
        0
    } else {
        csum::delta16(old_port, port)
    };
    ctx.l4_csum_diff(csum_off, pseudo, plain, kind)
        .map_err(fail)?;
    if port != old_port {
        ctx.store(port_off, &port).map_err(fail)?;
    }
    Ok(())
}

/// The IPv4 header checksum after the header changed by `d` (a `csum::delta`).
#[inline(always)]
fn fix_ipv4_header_csum<F: Frame>(ctx: &F, d: u64) -> Result<(), i64> {
    let old: u16 = ctx.load(IPV4_CSUM_OFF)?;
    ctx.store(IPV4_CSUM_OFF, &csum::fixed(old, d))
}

/// One IPv4 address and the header checksum, nothing else: what a later fragment needs
/// (the L4 checksum, covering the whole datagram, was adjusted in the first fragment)
/// and what SCTP needs (its checksum covers no addresses).
#[inline(never)]
fn rewrite_ipv4_address<F: Frame>(
    ctx: &F,
    pkt: &Packet,
    side: Side,
    addr: &[u32; 4],
) -> Result<(), i32> {
    let fail = |_| drop::packet(Reason::RewriteFailed);
    let (old_addr, addr_off) = match side {
        Side::Source => (pkt.saddr[0], IPV4_SADDR_OFF),
        Side::Destination => (pkt.daddr[0], IPV4_DADDR_OFF),
    };
    fix_ipv4_header_csum(ctx, csum::delta(old_addr, addr[0])).map_err(fail)?;
    ctx.store(addr_off, &addr[0]).map_err(fail)
}

/// SCTP's checksum (CRC32c) covers no addresses, only the packet: addresses change with
/// the IPv4 header checksum alone, ports with an in-place CRC update.
#[inline(never)]
fn rewrite_sctp<F: Frame>(
    ctx: &F,
    pkt: &Packet,
    side: Side,
    addr: &[u32; 4],
    port: u16,
) -> Result<(), i32> {
    let fail = |_| drop::packet(Reason::RewriteFailed);
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
        ctx.store(addr_off, addr).map_err(fail)?;
        u32::from(u16::from_be(ctx.load::<u16>(ETH_HLEN + 4).map_err(fail)?))
    };
    if port == old_port {
        return Ok(());
    }
    ctx.store(port_off, &port).map_err(fail)?;
    // The checksum is finished once per packet, by the tail call `finish` makes.
    let Some(p) = SCTP_PENDING.get_ptr_mut(0) else {
        return Err(drop::packet(Reason::Unreachable)); // index 0 of a one-entry array
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
    drop::packet(Reason::RewriteFailed) // a wrong checksum would be dropped by the receiver anyway
}

/// The tail call: applies the pending port change to the SCTP checksum, returns the
/// classifier's verdict.
pub fn sctp_checksum(ctx: &TcContext) -> i32 {
    let Some(p) = SCTP_PENDING.get_ptr_mut(0) else {
        return drop::packet(Reason::Unreachable); // index 0 of a one-entry array
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
        return drop::packet(Reason::RewriteFailed);
    };
    let sum = crc32c::after_first_word_change(sum, delta, *zeros);
    if ctx.store(off, &sum, 0).is_err() {
        return drop::packet(Reason::RewriteFailed);
    }
    verdict
}
