//! kube-proxy's REJECT for a service without endpoints, on the per-packet path: a TCP
//! packet is turned into a reset and sent back out of the interface it came in on, so the
//! client fails at once instead of waiting for a timeout. Other protocols are dropped
//! (ICMP unreachables come with the external-traffic path).

use aya_ebpf::{
    bindings::TC_ACT_REDIRECT,
    helpers::{bpf_csum_diff, bpf_redirect},
    programs::TcContext,
};
use proxy_common::{FAMILY_V4, PROTO_TCP, counter};

use crate::{
    maps::count,
    tc::{DROP, ETH_HLEN, Packet, ifindex},
};

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const TCP_HLEN: usize = 20;

/// Answers `pkt` with a TCP reset (or drops it), as the verdict for a refused connection.
#[inline(never)]
pub fn refuse(ctx: &TcContext, pkt: &Packet) -> Result<i32, i32> {
    if pkt.proto != PROTO_TCP {
        return Err(DROP);
    }
    let l4 = pkt.l4_off;
    let flags: u8 = ctx.load(l4 + 13).map_err(|_| DROP)?;
    if flags & TCP_RST != 0 {
        return Err(DROP); // never answer a reset
    }
    let seq = u32::from_be(ctx.load::<u32>(l4 + 4).map_err(|_| DROP)?);
    let ack = u32::from_be(ctx.load::<u32>(l4 + 8).map_err(|_| DROP)?);
    let doff = usize::from(ctx.load::<u8>(l4 + 12).map_err(|_| DROP)? >> 4) * 4;
    let v4 = pkt.family == FAMILY_V4;
    let ip_payload = if v4 {
        let tot = usize::from(u16::from_be(
            ctx.load::<u16>(ETH_HLEN + 2).map_err(|_| DROP)?,
        ));
        tot.saturating_sub(l4 - ETH_HLEN)
    } else {
        usize::from(u16::from_be(
            ctx.load::<u16>(ETH_HLEN + 4).map_err(|_| DROP)?,
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
    ctx.change_tail(new_len, 0).map_err(|_| DROP)?;
    let macs: [u8; 12] = ctx.load(0).map_err(|_| DROP)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0).map_err(|_| DROP)?;

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
            .map_err(|_| DROP)?;
        ctx.store(ETH_HLEN + 8, &64u8, 0).map_err(|_| DROP)?;
        ctx.store(ETH_HLEN + 12, &pkt.daddr[0], 0)
            .map_err(|_| DROP)?;
        ctx.store(ETH_HLEN + 16, &pkt.saddr[0], 0)
            .map_err(|_| DROP)?;
        if ihl != 20 {
            return Err(DROP); // options: not worth a reset
        }
        ctx.store(ETH_HLEN + 10, &0u16, 0).map_err(|_| DROP)?;
        let iph: [u32; 5] = ctx.load(ETH_HLEN).map_err(|_| DROP)?;
        let ip_csum = fold(csum_diff(&iph)?);
        ctx.store(ETH_HLEN + 10, &ip_csum, 0).map_err(|_| DROP)?;
        let pseudo = [
            pkt.daddr[0],
            pkt.saddr[0],
            u32::from_be_bytes([0, 0, 0, PROTO_TCP]).to_be(),
            tcp_len.to_be(),
        ];
        fold(csum_diff(&pseudo)? as u64 + csum_diff(tcp.words())? as u64)
    } else {
        ctx.store(ETH_HLEN + 4, &(TCP_HLEN as u16).to_be(), 0)
            .map_err(|_| DROP)?;
        ctx.store(ETH_HLEN + 7, &64u8, 0).map_err(|_| DROP)?;
        ctx.store(ETH_HLEN + 8, &pkt.daddr, 0).map_err(|_| DROP)?;
        ctx.store(ETH_HLEN + 24, &pkt.saddr, 0).map_err(|_| DROP)?;
        let mut pseudo = [0u32; 10];
        pseudo[..4].copy_from_slice(&pkt.daddr);
        pseudo[4..8].copy_from_slice(&pkt.saddr);
        pseudo[8] = tcp_len.to_be();
        pseudo[9] = u32::from_be_bytes([0, 0, 0, PROTO_TCP]).to_be();
        fold(csum_diff(&pseudo)? as u64 + csum_diff(tcp.words())? as u64)
    };
    let tcp = TcpHeader { csum, ..tcp };
    ctx.store(l4, &tcp, 0).map_err(|_| DROP)?;
    count(counter::REJECT_SENT);
    // SAFETY: helper with no memory arguments; back out of the interface it came in on.
    let verdict = unsafe { bpf_redirect(ifindex(ctx), 0) };
    if verdict == i64::from(TC_ACT_REDIRECT) {
        Ok(TC_ACT_REDIRECT as i32)
    } else {
        Err(DROP)
    }
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
fn csum_diff<const N: usize>(words: &[u32; N]) -> Result<u32, i32> {
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
    if sum < 0 { Err(DROP) } else { Ok(sum as u32) }
}

/// Folds a 32-bit one's-complement sum to the 16-bit checksum field value.
fn fold(sum: impl Into<u64>) -> u16 {
    let mut s: u64 = sum.into();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}
