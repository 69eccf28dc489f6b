//! Forwarding of translated packets by the FIB. At TC: packets whose source is one of the
//! node's own addresses (masqueraded flows, and replies from NodePorts) — the stack would
//! drop them as martians (a forwarded packet claiming a local source) — go straight out
//! of the interface the FIB picks, with the neighbour resolved by the kernel. At XDP:
//! every translated packet, with the neighbour's address from the FIB (`XDP_TX` out of
//! the interface it came in on, `XDP_REDIRECT` to another); without one (no neighbour
//! entry yet, no route, too big) the packet goes to TC unchanged, which resolves or
//! answers. Since these packets skip the stack's forwarding, they also skip its MTU
//! check: `lookup` makes it (the FIB knows the egress MTU), and at TC a packet too big is
//! answered with "fragmentation needed" or "packet too big" instead of vanishing (no PMTU
//! black hole).
//!
//! Layer 3. Owns: the FIB lookup with its MTU check, the strict reverse-path check
//! (`arrived_by_route`) and the neighbour check (`sent_by_neighbour`), the redirect out
//! of an interface, and
//! XDP's next hop (`XDP_HOP`: MAC addresses, TTL). May import: layers 0-2 (`maps`,
//! `verdict`, `frame`, `packet`, `stats`, `drop`, `node`).

use aya_ebpf::{
    bindings::{
        __sk_buff, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH,
        BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH, bpf_fib_lookup,
    },
    btf_maps::PerCpuArray,
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    macros::btf_map,
};
use proxy_common::{FAMILY_V4, PROTO_TCP, counter};

use crate::{
    drop::{self, Reason},
    frame::{Frame, csum},
    maps::{IF_MASTERS, count},
    packet::{ETH_HLEN, Packet},
    verdict::{Verdict, XDP_REDIRECTED, XDP_SENT_BACK},
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// Packets "arriving" on loopback are the node's own or a `BPF_PROG_TEST_RUN`: the stack
/// handles those.
const LOOPBACK_IFINDEX: u32 = 1;
/// IPv4's don't-fragment bit (in the flags/offset word, host order).
const IP_DF: u16 = 0x4000;
const IPV4_TTL_OFF: usize = ETH_HLEN + 8;
const IPV6_HOP_LIMIT_OFF: usize = ETH_HLEN + 7;

/// Where an XDP packet goes once translated: the FIB's answer, kept per CPU between the
/// lookup (before the rewrite) and the send (after it).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NextHop {
    /// Destination MAC then source MAC: the Ethernet header's first 12 bytes.
    macs: [u8; 12],
    ifindex: u32,
}

/// (Not pinned: each load has its own.)
#[btf_map]
static XDP_HOP: PerCpuArray<NextHop, 1> = PerCpuArray::new();

/// Sends the packet (already rewritten to `src` -> `dst`) out of its route's interface;
/// falls back to the stack when there is no route. No MTU check: for packets that cannot
/// be answered with an error (ICMP errors themselves). TC only.
#[inline(never)]
pub fn forward<F: Frame>(ctx: &F, family: u8, src: &[u32; 4], dst: &[u32; 4]) -> Verdict {
    redirect(ctx, fib(ctx, family, src, dst, 0, 0))
}

/// Where the packet `pkt` goes once rewritten to `src` -> `dst`: an interface (> 0), the
/// stack (0; at XDP: TC, the packet unchanged), or — too big for that interface, and not
/// to be fragmented — minus the MTU (TC only). A scalar: a BPF function returns one
/// register. Call before rewriting, so an error can quote the packet as its sender knows
/// it, and so XDP can leave to TC what it cannot send. `grow`: bytes the packet gains
/// before it leaves (direct server return's option), counted in the MTU check and taken
/// off the MTU a "too big" answer gives.
#[inline(never)]
pub fn lookup<F: Frame>(ctx: &F, pkt: &Packet, src: &[u32; 4], dst: &[u32; 4], grow: u32) -> i64 {
    // The headers each segment of an offloaded (GSO) packet carries.
    let mut headers = (pkt.l4_off - ETH_HLEN) as u32;
    if pkt.proto == PROTO_TCP {
        let Ok(doff) = ctx.load::<u8>(pkt.l4_off + 12) else {
            return 0;
        };
        headers += u32::from(doff >> 4) * 4;
    } else {
        headers += 8;
    }
    let hop = fib(ctx, pkt.family, src, dst, headers, grow);
    if hop < 0 && pkt.family == FAMILY_V4 {
        // IPv4 without DF may be fragmented: the stack's business (as before).
        match ctx.load::<u16>(ETH_HLEN + 6) {
            Ok(frag) if u16::from_be(frag) & IP_DF != 0 => {}
            _ => return 0,
        }
    }
    if hop < 0 {
        // The sender's packets must leave room for what this node adds.
        return hop + i64::from(grow);
    }
    hop
}

/// Sends the packet out of interface `hop` (from `lookup`), or on to the stack (0).
/// At XDP, `hop` > 0 only: the Ethernet header and TTL change here, last.
#[inline(always)]
pub fn redirect<F: Frame>(ctx: &F, hop: i64) -> Verdict {
    if hop <= 0 {
        return Verdict::Stack;
    }
    if F::XDP {
        return send(ctx);
    }
    // SAFETY: no memory arguments (the kernel resolves the neighbour itself).
    let r = unsafe { bpf_redirect_neigh(hop as u32, core::ptr::null_mut(), 0, 0) };
    Verdict::Redirected(r as i32)
}

/// XDP: the next hop's MACs, one hop less to live, and out.
#[inline(never)]
fn send<F: Frame>(ctx: &F) -> Verdict {
    let Some(next) = XDP_HOP.get_ptr(0) else {
        return Verdict::Stack; // unreachable: index 0 of a one-entry array
    };
    // SAFETY: this CPU's slot, written by `fib` for this packet.
    let next = unsafe { *next };
    if ctx.store(0, &next.macs).is_err() || decrement_ttl(ctx).is_err() {
        return Verdict::Redirected(drop::packet(Reason::RewriteFailed));
    }
    if next.ifindex == ctx.ifindex() {
        count(counter::XDP_TX);
        return Verdict::Redirected(XDP_SENT_BACK);
    }
    count(counter::XDP_REDIRECT);
    // SAFETY: no memory arguments.
    unsafe { bpf_redirect(next.ifindex, 0) };
    Verdict::Redirected(XDP_REDIRECTED)
}

/// A router's part: IPv4's TTL (and its header checksum), IPv6's hop limit. (`fib` made
/// sure there was a hop left.)
#[inline(always)]
fn decrement_ttl<F: Frame>(ctx: &F) -> Result<(), i64> {
    let ether_type = u16::from_be(ctx.load::<u16>(12)?);
    if ether_type == crate::packet::ETH_P_IP {
        // TTL and protocol share a 16-bit word of the header checksum.
        let word: u16 = ctx.load(IPV4_TTL_OFF)?;
        let ttl = word.to_ne_bytes()[0].wrapping_sub(1);
        let new = u16::from_ne_bytes([ttl, word.to_ne_bytes()[1]]);
        let old_csum: u16 = ctx.load(crate::packet::IPV4_CSUM_OFF)?;
        ctx.store(IPV4_TTL_OFF, &new)?;
        ctx.store(
            crate::packet::IPV4_CSUM_OFF,
            &csum::replaced(old_csum, u32::from(word), u32::from(new), 2),
        )
    } else {
        let hops: u8 = ctx.load(IPV6_HOP_LIMIT_OFF)?;
        ctx.store(IPV6_HOP_LIMIT_OFF, &hops.wrapping_sub(1))
    }
}

/// The FIB's answer for `src` -> `dst` (see `lookup`); `headers` > 0 checks the MTU, with
/// the per-segment headers of a GSO packet (the FIB helper lets every GSO packet pass).
/// At XDP only a full answer (neighbour known, MTU fits, a hop left to live) is an
/// interface; anything else is 0. `grow` (see `lookup`) counts for packets that are not
/// GSO (a GSO packet's segments shrink by as much when the room is made).
#[inline(always)]
fn fib<F: Frame>(
    ctx: &F,
    family: u8,
    src: &[u32; 4],
    dst: &[u32; 4],
    headers: u32,
    grow: u32,
) -> i64 {
    let ingress = ctx.ifindex();
    if ingress == LOOPBACK_IFINDEX {
        return 0;
    }
    // A plain C struct; all-zero is a valid value.
    let mut slot = core::mem::MaybeUninit::<bpf_fib_lookup>::uninit();
    let p = crate::mem::zeroed_in(&mut slot);
    ask(p, ingress, family, src, dst);
    if F::XDP {
        return xdp_fib(ctx, family, p, grow);
    }
    // With `tot_len` left zero the helper checks the skb against the egress device's
    // MTU and reports that MTU in `mtu_result`; a packet that grows gives its length to
    // come (and hears the MTU only when it is too big).
    // SAFETY: the context is a valid __sk_buff; gso_size is a plain readable field.
    if grow > 0 && unsafe { (*(ctx.ptr() as *const __sk_buff)).gso_size } == 0 {
        p.__bindgen_anon_1.tot_len = (ctx.len() as usize - ETH_HLEN) as u16 + grow as u16;
    }
    let rc = route_of(ctx, p);
    // SAFETY: the helper wrote the union's `mtu_result` (zero when it did not).
    let mtu = u32::from(unsafe { p.__bindgen_anon_1.mtu_result });
    if rc == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) {
        return if headers > 0 && mtu > 0 {
            -i64::from(mtu)
        } else {
            0
        };
    }
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) && rc != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return 0;
    }
    if headers > 0 && mtu > 0 {
        // SAFETY: the context is a valid __sk_buff; gso_size is a plain readable field.
        let gso = unsafe { (*(ctx.ptr() as *const __sk_buff)).gso_size };
        if gso != 0 && gso + headers > mtu {
            return -i64::from(mtu);
        }
    }
    i64::from(p.ifindex)
}

/// `arrived_by_route`'s FIB parameters. (Not pinned: each load has its own.)
#[btf_map]
static RP_FIB: PerCpuArray<bpf_fib_lookup, 1> = PerCpuArray::new();

/// Strict reverse path (`rp_filter=1`): whether the node's route back to `src` (from
/// `dst`) leaves by the interface the packet came in on. What a packet teaches the node
/// (`dsr::arrival`) must come from where its source is, not from a pod or a host that
/// made up that source. At TC and XDP alike; on loopback (the node's own packets, a test
/// run without an interface) there is no such route: false.
#[inline(never)]
pub fn arrived_by_route<F: Frame>(ctx: &F, family: u8, src: &[u32; 4], dst: &[u32; 4]) -> bool {
    // The way back: from the packet's destination to its source.
    let Some(p) = way_to(ctx, family, dst, src) else {
        return false;
    };
    let rc = route_of(ctx, p);
    (rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) || rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH))
        && leaves_by_ingress(ctx, p.ifindex)
}

/// Whether the frame was handed over by the neighbour the node reaches `node` through
/// (from its address `own`): the route to `node` leaves by the interface the frame came
/// in on, and the Ethernet source is that route's next hop — `node` itself on its
/// link, or the router towards it. A stranger on the wire that names `node` sends with
/// its own MAC. No neighbour entry known: false (the kernel made one when `node` asked
/// for this node's address, as it did before sending). TC only (at XDP the Ethernet
/// header is the same, but nothing there learns from it).
#[inline(never)]
pub fn sent_by_neighbour<F: Frame>(ctx: &F, family: u8, own: &[u32; 4], node: &[u32; 4]) -> bool {
    let Some(p) = way_to(ctx, family, own, node) else {
        return false;
    };
    let rc = with_neighbour(ctx, p);
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) || !leaves_by_ingress(ctx, p.ifindex) {
        return false;
    }
    // SAFETY: after a successful lookup the union holds the MAC addresses.
    let next_hop = unsafe { p.__bindgen_anon_6.__bindgen_anon_2.dmac };
    matches!(ctx.load::<[u8; 6]>(6), Ok(sender) if sender == next_hop)
}

/// `RP_FIB`, asked for the route `from` -> `to` out of the frame's interface: `None` on
/// loopback (the node's own packets, a test run without an interface), which has no
/// such route. Per CPU, not on the stack: these checks sit under the classifier's
/// deepest frames.
#[inline(always)]
fn way_to<F: Frame>(
    ctx: &F,
    family: u8,
    from: &[u32; 4],
    to: &[u32; 4],
) -> Option<&'static mut bpf_fib_lookup> {
    let ingress = ctx.ifindex();
    if ingress == LOOPBACK_IFINDEX {
        return None;
    }
    let p = RP_FIB.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used by one packet at a time; a plain C struct, for
    // which all-zero is a valid value.
    let p = unsafe { &mut *p };
    crate::mem::zero(p);
    ask(p, ingress, family, from, to);
    // A length any route carries: the question is the route, not this packet's size.
    p.__bindgen_anon_1.tot_len = 64;
    Some(p)
}

/// Whether a route out of `egress` leads back where the frame came in: the same
/// interface, or — a bridge's port — its bridge, as the kernel's own check sees it
/// (`IF_MASTERS`).
#[inline(always)]
fn leaves_by_ingress<F: Frame>(ctx: &F, egress: u32) -> bool {
    let ingress = ctx.ifindex();
    // SAFETY: map memory, valid for this program run; the value is copied at once.
    egress == ingress
        || IF_MASTERS
            .get_ptr(&ingress)
            .is_some_and(|m| unsafe { *m } == egress)
}

/// Whether a flow's reply may count as its answer: it arrived by the route back to its
/// source (`arrived_by_route`), or it is the node's own (loopback). A pod or host that
/// forges a backend's answer from elsewhere makes no flow answered.
#[inline(always)]
pub fn reply_by_route<F: Frame>(ctx: &F, pkt: &Packet) -> bool {
    ctx.ifindex() == LOOPBACK_IFINDEX || arrived_by_route(ctx, pkt.family, &pkt.saddr, &pkt.daddr)
}

/// The FIB's answer to `p` (`BPF_FIB_LKUP_RET_*`, or below zero), without the neighbour
/// where the kernel allows it (the callers that need the MACs ask `xdp_fib`).
#[inline(always)]
fn route_of<F: Frame>(ctx: &F, p: &mut bpf_fib_lookup) -> i64 {
    let size = core::mem::size_of::<bpf_fib_lookup>() as i32;
    // SAFETY: `p` is a valid, correctly sized parameter block.
    let rc = unsafe { fib_lookup(ctx.ptr(), p, size, BPF_FIB_LOOKUP_SKIP_NEIGH) };
    if rc >= 0 {
        return rc;
    }
    // Kernels before 6.3 refuse SKIP_NEIGH (-EINVAL, before touching `p`): ask again with
    // the neighbour lookup, whose NO_NEIGH answer the callers accept as well.
    with_neighbour(ctx, p)
}

/// The FIB's answer to `p` with the neighbour: on success the union holds the MACs.
#[inline(always)]
fn with_neighbour<F: Frame>(ctx: &F, p: &mut bpf_fib_lookup) -> i64 {
    // SAFETY: `p` is a valid, correctly sized parameter block.
    unsafe {
        fib_lookup(
            ctx.ptr(),
            p,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    }
}

/// Fills a zeroed FIB query for `src` -> `dst`, from interface `ingress`.
#[inline(always)]
fn ask(p: &mut bpf_fib_lookup, ingress: u32, family: u8, src: &[u32; 4], dst: &[u32; 4]) {
    p.ifindex = ingress;
    if family == FAMILY_V4 {
        p.family = AF_INET;
        p.__bindgen_anon_3.ipv4_src = src[0];
        p.__bindgen_anon_4.ipv4_dst = dst[0];
    } else {
        p.family = AF_INET6;
        p.__bindgen_anon_3.ipv6_src = *src;
        p.__bindgen_anon_4.ipv6_dst = *dst;
    }
}

/// XDP's FIB lookup: with the neighbour (the MACs go into `XDP_HOP`), and the frame's
/// length for the MTU check (no GSO at XDP: a frame is one packet).
#[inline(never)]
fn xdp_fib<F: Frame>(ctx: &F, family: u8, p: &mut bpf_fib_lookup, grow: u32) -> i64 {
    let ttl = if family == FAMILY_V4 {
        ctx.load::<u8>(IPV4_TTL_OFF)
    } else {
        ctx.load::<u8>(IPV6_HOP_LIMIT_OFF)
    };
    match ttl {
        // The stack answers with "time exceeded".
        Ok(t) if t > 1 => {}
        _ => return 0,
    }
    p.__bindgen_anon_1.tot_len = (ctx.len() as usize - ETH_HLEN) as u16 + grow as u16;
    if with_neighbour(ctx, p) != i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        return 0;
    }
    let Some(next) = XDP_HOP.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's slot, used by one packet at a time.
    let next = unsafe { &mut *next };
    // SAFETY: after a successful lookup the union holds the MAC addresses.
    let (smac, dmac) = unsafe {
        let m = &p.__bindgen_anon_6.__bindgen_anon_2;
        (m.smac, m.dmac)
    };
    next.macs = [
        dmac[0], dmac[1], dmac[2], dmac[3], dmac[4], dmac[5], smac[0], smac[1], smac[2], smac[3],
        smac[4], smac[5],
    ];
    next.ifindex = p.ifindex;
    i64::from(p.ifindex)
}
