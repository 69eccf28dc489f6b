//! kube-proxy's REJECT for a service without endpoints, on the per-packet path: a TCP
//! packet is turned into a reset, a UDP one into an ICMP (or ICMPv6) port unreachable,
//! and either is sent back out of the interface it came in on, so the client fails at
//! once instead of waiting for a timeout. A translated packet too big for its next hop
//! is answered the same way, with "fragmentation needed" / "packet too big".
//!
//! Layer 3. Owns: the refusals (TCP reset, ICMP port unreachable, "too big") and their
//! rate limit, `REJECT_CREDIT`. May import: layers 0-2 (`maps`, `verdict`, `packet`,
//! `stats`, `drop`, `node`).

use aya_ebpf::{
    bindings::{TC_ACT_REDIRECT, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC},
    btf_maps::PerCpuArray,
    helpers::{bpf_csum_diff, bpf_redirect},
    macros::btf_map,
    programs::TcContext,
};
use proxy_common::{FAMILY_V4, PROTO_SCTP, PROTO_TCP, PROTO_UDP, counter};

use crate::{
    drop::{self, Reason},
    frame::{Frame, csum},
    maps::count,
    packet::{ETH_HLEN, Packet},
};

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const TCP_HLEN: usize = 20;

/// Refusals a CPU may send in a burst, and how fast its credit refills (one per
/// `REFUSAL_COST_NS`): 1000 per second per CPU, like the kernel's own ICMP rate limit.
const REFUSAL_BURST: u64 = 100;
const REFUSAL_COST_NS: u64 = 1_000_000;

/// A helper failed while the refusal was being made or sent.
const FAILED: Reason = Reason::RejectFailed;

/// Answers `pkt` with a TCP reset or an ICMP port unreachable, as the verdict for a
/// refused connection; past the rate limit the packet is dropped (and counted).
pub fn refuse(ctx: &TcContext, pkt: &Packet) -> Result<i32, i32> {
    if !take_credit() {
        return Err(drop::packet(Reason::RejectRateLimited));
    }
    match pkt.proto {
        PROTO_TCP => tcp_reset(ctx, pkt),
        // kube-proxy's REJECT answers UDP and SCTP alike.
        PROTO_UDP | PROTO_SCTP => icmp_error(ctx, pkt, 0),
        _ => Err(drop::packet(Reason::Unreachable)), // frontends are of those three
    }
}

/// Per-CPU credit for refusals (resets and ICMP errors), in nanoseconds (not pinned: each
/// load has its own).
#[btf_map]
static REJECT_CREDIT: PerCpuArray<[u64; 2], 1> = PerCpuArray::new();

/// A per-CPU token bucket: [credit in ns, last refill time].
fn take_credit() -> bool {
    let Some(slot) = REJECT_CREDIT.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: per-CPU slot, no concurrent writer on this CPU; no preconditions for ktime.
    unsafe {
        let now = aya_ebpf::helpers::bpf_ktime_get_ns();
        let [credit, last] = *slot;
        let credit = (credit + now.saturating_sub(last)).min(REFUSAL_BURST * REFUSAL_COST_NS);
        if credit < REFUSAL_COST_NS {
            *slot = [credit, now];
            return false;
        }
        *slot = [credit - REFUSAL_COST_NS, now];
    }
    true
}

/// The quoted packet in an ICMP error: the original IP header and 8 bytes of its L4
/// header (20 for "too big", whose packet is long: a TCP packet's checksum offload state
/// keeps its header from being cut shorter).
const QUOTE_L4: usize = 8;
const QUOTE_L4_TOO_BIG: usize = 20;
const ICMP_HLEN: usize = 8;

/// Answers `pkt` — too big for the next hop's `mtu` — with ICMP "fragmentation needed"
/// (type 3 code 4) or ICMPv6 "packet too big" (type 2), from its destination, so the
/// sender's path MTU discovery works through the translation. Rate-limited with the
/// refusals.
pub fn too_big(ctx: &TcContext, pkt: &Packet, mtu: u32) -> Result<i32, i32> {
    if !take_credit() {
        return Err(drop::packet(Reason::RejectRateLimited));
    }
    let verdict = icmp_error(ctx, pkt, mtu)?;
    count(counter::TOO_BIG_SENT);
    Ok(verdict)
}

/// ICMP type 3 code 3 (IPv4) or ICMPv6 type 1 code 4, quoting the packet; with `mtu`,
/// type 3 code 4 (IPv4) or ICMPv6 type 2 carrying it; or the packet dropped, its reason
/// counted (here, in this function's own frame).
#[inline(never)]
fn icmp_error(ctx: &TcContext, pkt: &Packet, mtu: u32) -> Result<i32, i32> {
    make_icmp_error(ctx, pkt, mtu).map_err(drop::packet)
}

/// `icmp_error`'s making: room for the new headers is opened in front of the original
/// ones, which become the quote.
#[inline(always)]
fn make_icmp_error(ctx: &TcContext, pkt: &Packet, mtu: u32) -> Result<i32, Reason> {
    let v4 = pkt.family == FAMILY_V4;
    let ip_hlen = if v4 { 20 } else { 40 };
    if pkt.l4_off != ETH_HLEN + ip_hlen {
        // IP options, an extension header: not worth an error.
        return Err(Reason::RejectIpOptions);
    }
    let quote = ip_hlen + if mtu == 0 { QUOTE_L4 } else { QUOTE_L4_TOO_BIG };
    let room = ip_hlen + ICMP_HLEN;
    // Cut to the quote first: that also ends a GSO packet's offload state, which
    // opening room in front would otherwise have to adjust.
    ctx.change_tail((ETH_HLEN + quote) as u32, 0)
        .map_err(|_| FAILED)?;
    ctx.adjust_room(room as i32, BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| FAILED)?;
    swap_macs(ctx)?;
    let icmp_off = ETH_HLEN + ip_hlen;
    let payload_len = (ICMP_HLEN + quote) as u16;
    // Type and code, checksum zero; the next word is unused, or holds the MTU (IPv4: its
    // low 16 bits).
    let (kind, code): (u8, u8) = match (v4, mtu) {
        (true, 0) => (3, 3),
        (true, _) => (3, 4),
        (false, 0) => (1, 4),
        (false, _) => (2, 0),
    };
    let icmp_head = [u32::from_ne_bytes([kind, code, 0, 0]), mtu.to_be()];
    ctx.store(icmp_off, &icmp_head, 0).map_err(|_| FAILED)?;
    let mut sum: u64 = u64::from(icmp_head[0]) + u64::from(icmp_head[1]);
    if v4 {
        let ip = [
            u32::from_ne_bytes([0x45, 0, 0, 0])
                | u32::from((ip_hlen as u16 + payload_len).to_be()) << 16,
            0,
            u32::from_ne_bytes([64, 1, 0, 0]),
            pkt.daddr[0],
            pkt.saddr[0],
        ];
        let csum = fold(csum_diff(&ip)?);
        let ip = [ip[0], ip[1], ip[2] | u32::from(csum) << 16, ip[3], ip[4]];
        ctx.store(ETH_HLEN, &ip, 0).map_err(|_| FAILED)?;
    } else {
        let len_nh_hop = u32::from(payload_len.to_be()) | u32::from_ne_bytes([0, 0, 58, 64]);
        ctx.store(ETH_HLEN, &u32::from_ne_bytes([0x60, 0, 0, 0]), 0)
            .map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 4, &len_nh_hop, 0)
            .map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 8, &pkt.daddr, 0).map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 24, &pkt.saddr, 0)
            .map_err(|_| FAILED)?;
        // ICMPv6's checksum covers a pseudo-header.
        for i in 0..4 {
            sum += u64::from(pkt.daddr[i]) + u64::from(pkt.saddr[i]);
        }
        sum += u64::from(u32::from(payload_len).to_be());
        sum += u64::from(u32::from_ne_bytes([0, 0, 0, 58]));
    }
    // The quote, word by word from the packet (no large stack buffer).
    let quote_off = icmp_off + ICMP_HLEN;
    for i in 0..(40 + QUOTE_L4_TOO_BIG) / 4 {
        if i * 4 >= quote {
            break;
        }
        sum += u64::from(ctx.load::<u32>(quote_off + i * 4).map_err(|_| FAILED)?);
    }
    ctx.store(icmp_off + 2, &fold(sum), 0).map_err(|_| FAILED)?;
    if mtu == 0 {
        count(counter::REJECT_SENT);
    }
    send_back(ctx)
}

fn swap_macs(ctx: &TcContext) -> Result<(), Reason> {
    let macs: [u8; 12] = ctx.load(0).map_err(|_| FAILED)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0).map_err(|_| FAILED)
}

/// Sends the rewritten packet back out of the interface it came in on.
fn send_back(ctx: &TcContext) -> Result<i32, Reason> {
    // SAFETY: helper with no memory arguments.
    let verdict = unsafe { bpf_redirect(Frame::ifindex(ctx), 0) };
    if verdict == i64::from(TC_ACT_REDIRECT) {
        Ok(TC_ACT_REDIRECT as i32)
    } else {
        Err(Reason::Unreachable) // the helper fails only for flags it does not know
    }
}

/// A TCP reset answering `pkt`; or the packet dropped, its reason counted (here, in this
/// function's own frame).
#[inline(never)]
fn tcp_reset(ctx: &TcContext, pkt: &Packet) -> Result<i32, i32> {
    make_tcp_reset(ctx, pkt).map_err(drop::packet)
}

#[inline(always)]
fn make_tcp_reset(ctx: &TcContext, pkt: &Packet) -> Result<i32, Reason> {
    let l4 = pkt.l4_off;
    let flags: u8 = ctx.load(l4 + 13).map_err(|_| FAILED)?;
    if flags & TCP_RST != 0 {
        // Never answer a reset. (None gets here: only a SYN opens a flow, and a SYN with
        // RST is none: `Packet::is_syn`.)
        return Err(Reason::Unreachable);
    }
    let seq = u32::from_be(ctx.load::<u32>(l4 + 4).map_err(|_| FAILED)?);
    let ack = u32::from_be(ctx.load::<u32>(l4 + 8).map_err(|_| FAILED)?);
    let doff = usize::from(ctx.load::<u8>(l4 + 12).map_err(|_| FAILED)? >> 4) * 4;
    let v4 = pkt.family == FAMILY_V4;
    if l4 != ETH_HLEN + if v4 { 20 } else { 40 } {
        // IP options, an extension header: not worth a reset.
        return Err(Reason::RejectIpOptions);
    }
    let ip_payload = if v4 {
        let tot = usize::from(u16::from_be(
            ctx.load::<u16>(ETH_HLEN + 2).map_err(|_| FAILED)?,
        ));
        tot.saturating_sub(l4 - ETH_HLEN)
    } else {
        usize::from(u16::from_be(
            ctx.load::<u16>(ETH_HLEN + 4).map_err(|_| FAILED)?,
        ))
    };
    let data_len = ip_payload.saturating_sub(doff) as u32;
    // RFC 793: answer an ACK with its ack number as our sequence; otherwise acknowledge
    // everything the segment occupied.
    let (rst_seq, rst_ack, rst_flags) = if flags & TCP_ACK != 0 {
        (ack, 0, TCP_RST)
    } else {
        let occupied = data_len + u32::from(flags & TCP_SYN != 0) + u32::from(flags & TCP_FIN != 0);
        (0, seq.wrapping_add(occupied), TCP_RST | TCP_ACK)
    };

    // Keep only the headers, then rewrite them in place, swapped.
    let new_len = (l4 + TCP_HLEN) as u32;
    ctx.change_tail(new_len, 0).map_err(|_| FAILED)?;
    swap_macs(ctx)?;

    let tcp = TcpHeader {
        sport: pkt.dport,
        dport: pkt.sport,
        seq: rst_seq.to_be(),
        ack: rst_ack.to_be(),
        off_flags: u16::from_be_bytes([5 << 4, rst_flags]).to_be(),
        window: 0,
        csum: 0,
        urg: 0,
    };
    let tcp_len = TCP_HLEN as u32;
    let csum = if v4 {
        let ihl = l4 - ETH_HLEN;
        // IPv4: swap addresses, new length, fresh TTL, recomputed header checksum.
        ctx.store(ETH_HLEN + 2, &((ihl + TCP_HLEN) as u16).to_be(), 0)
            .map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 8, &64u8, 0).map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 12, &pkt.daddr[0], 0)
            .map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 16, &pkt.saddr[0], 0)
            .map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 10, &0u16, 0).map_err(|_| FAILED)?;
        let iph: [u32; 5] = ctx.load(ETH_HLEN).map_err(|_| FAILED)?;
        let ip_csum = fold(csum_diff(&iph)?);
        ctx.store(ETH_HLEN + 10, &ip_csum, 0).map_err(|_| FAILED)?;
        let pseudo = [
            pkt.daddr[0],
            pkt.saddr[0],
            u32::from_be_bytes([0, 0, 0, PROTO_TCP]).to_be(),
            tcp_len.to_be(),
        ];
        fold(csum_diff(&pseudo)? as u64 + csum_diff(tcp.words())? as u64)
    } else {
        ctx.store(ETH_HLEN + 4, &(TCP_HLEN as u16).to_be(), 0)
            .map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 7, &64u8, 0).map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 8, &pkt.daddr, 0).map_err(|_| FAILED)?;
        ctx.store(ETH_HLEN + 24, &pkt.saddr, 0)
            .map_err(|_| FAILED)?;
        let mut pseudo = [0u32; 10];
        pseudo[..4].copy_from_slice(&pkt.daddr);
        pseudo[4..8].copy_from_slice(&pkt.saddr);
        pseudo[8] = tcp_len.to_be();
        pseudo[9] = u32::from_be_bytes([0, 0, 0, PROTO_TCP]).to_be();
        fold(csum_diff(&pseudo)? as u64 + csum_diff(tcp.words())? as u64)
    };
    let tcp = TcpHeader { csum, ..tcp };
    ctx.store(l4, &tcp, 0).map_err(|_| FAILED)?;
    count(counter::REJECT_SENT);
    send_back(ctx)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct TcpHeader {
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    off_flags: u16,
    window: u16,
    csum: u16,
    urg: u16,
}

impl TcpHeader {
    fn words(&self) -> &[u32; 5] {
        // SAFETY: 20 bytes, #[repr(C)] without padding, 4-byte aligned via u32 fields.
        unsafe { &*(self as *const Self as *const [u32; 5]) }
    }
}

/// One's-complement sum of `words` (a multiple of 4 bytes), unfolded.
fn csum_diff<const N: usize>(words: &[u32; N]) -> Result<u32, Reason> {
    // SAFETY: the helper reads N*4 bytes from a valid stack buffer and writes nothing.
    let sum = unsafe {
        bpf_csum_diff(
            core::ptr::null_mut(),
            0,
            words.as_ptr() as *mut u32,
            (N * 4) as u32,
            0,
        )
    };
    if sum < 0 { Err(FAILED) } else { Ok(sum as u32) }
}

/// Folds a 32-bit one's-complement sum to the 16-bit checksum field value.
fn fold(sum: impl Into<u64>) -> u16 {
    !csum::fold(sum.into())
}
