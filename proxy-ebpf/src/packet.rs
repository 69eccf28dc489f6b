//! Reading a packet: the 5-tuple (and TCP flags) of TCP/UDP/SCTP over IPv4 or IPv6, with
//! IPv4 fragments taking their ports from the datagram's first fragment, and IPv6's ports
//! found behind direct server return's header.
//!
//! Layer 1. Owns: `Packet` and its parsing (at either hook), the header offsets and TCP
//! flag bits, the skb's input interface, and the `FRAGMENTS` bookkeeping. May import:
//! `maps`, `verdict`, `frame`.

use aya_ebpf::{EbpfContext as _, bindings::__sk_buff, programs::TcContext};
use proxy_common::{
    CtKey, DSR_HDR6_LEN, FAMILY_V4, FAMILY_V6, FragKey, FragPorts, IPPROTO_DSTOPTS, PROTO_SCTP,
    PROTO_TCP, PROTO_UDP, is_dsr_header6,
};

use crate::{frame::Frame, maps::FRAGMENTS};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86DD;
pub const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
pub const IPV4_SADDR_OFF: usize = ETH_HLEN + 12;
pub const IPV4_DADDR_OFF: usize = ETH_HLEN + 16;
pub const IPV6_SADDR_OFF: usize = ETH_HLEN + 8;
pub const IPV6_DADDR_OFF: usize = ETH_HLEN + 24;
pub const IPV6_HLEN: usize = 40;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// The bytes every step reads directly (`Frame::linearize`): the longest headers
/// (Ethernet, IPv6, an L4 header's first 20 bytes) and an ICMP error's quote (an outer
/// IPv6 header, ICMPv6's 8 bytes, the quoted IPv6 header and its first 8 bytes), with room.
const HEADERS_LEN: usize = 128;

/// The parts of a TCP/UDP/SCTP packet the NAT reads and rewrites.
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
    /// TCP's flags byte (0 for other protocols and later fragments).
    pub tcp_flags: u8,
    pub l4_off: usize,
}

impl Packet {
    pub fn ct_key(&self, dir: u8) -> CtKey {
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

    /// A TCP SYN without ACK: the only segment that opens a connection.
    pub fn is_syn(&self) -> bool {
        self.proto == PROTO_TCP && self.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN
    }
}

/// The interface a packet first came in on (`skb_iif`): 0 for one the node made itself.
pub fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context is a valid __sk_buff; ingress_ifindex is a plain readable field.
    unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ingress_ifindex }
}

/// Reads the 5-tuple; `None` for anything that is not TCP/UDP/SCTP over IP (and for
/// IPv4 fragments we cannot place; at XDP for every fragment: TC places them, so all of a
/// datagram's fragments take one path).
#[inline(always)]
pub fn parse<F: Frame>(ctx: &F, pass: i32) -> Result<Option<Packet>, i32> {
    ctx.linearize(HEADERS_LEN);
    let ether_type = u16::from_be(ctx.load::<u16>(12).map_err(|_| pass)?);
    let (family, proto, saddr, daddr, l4_off, frag) = match ether_type {
        ETH_P_IP => {
            let ver_ihl: u8 = ctx.load(ETH_HLEN).map_err(|_| pass)?;
            let ihl = usize::from(ver_ihl & 0x0f) * 4;
            // Not IPv4 (the stack drops it: ip_rcv checks the version): not ours either.
            if ver_ihl >> 4 != 4 || ihl < 20 {
                return Ok(None);
            }
            let proto: u8 = ctx.load(ETH_HLEN + 9).map_err(|_| pass)?;
            let s: u32 = ctx.load(IPV4_SADDR_OFF).map_err(|_| pass)?;
            let d: u32 = ctx.load(IPV4_DADDR_OFF).map_err(|_| pass)?;
            let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).map_err(|_| pass)?);
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
            // untranslated. So does a header of another version (ipv6_rcv drops it).
            // The one exception is direct server return's own header, first and alone
            // before TCP or UDP (`dsr`): the backend's node reads the ports behind it.
            let version: u8 = ctx.load(ETH_HLEN).map_err(|_| pass)?;
            if version >> 4 != 6 {
                return Ok(None);
            }
            let mut proto: u8 = ctx.load(ETH_HLEN + 6).map_err(|_| pass)?;
            let mut l4_off = ETH_HLEN + IPV6_HLEN;
            if proto == IPPROTO_DSTOPTS {
                let first: u32 = ctx.load(l4_off).map_err(|_| pass)?;
                let next = first.to_ne_bytes()[0];
                if !is_dsr_header6(first) || (next != PROTO_TCP && next != PROTO_UDP) {
                    return Ok(None);
                }
                proto = next;
                l4_off += usize::from(DSR_HDR6_LEN);
            }
            let s: [u32; 4] = ctx.load(IPV6_SADDR_OFF).map_err(|_| pass)?;
            let d: [u32; 4] = ctx.load(IPV6_DADDR_OFF).map_err(|_| pass)?;
            (FAMILY_V6, proto, s, d, l4_off, false)
        }
        _ => return Ok(None),
    };
    if proto != PROTO_TCP && proto != PROTO_UDP && proto != PROTO_SCTP {
        return Ok(None);
    }
    if frag && F::XDP {
        return Ok(None);
    }
    let (sport, dport, tail) = if frag {
        let found = fragment(ctx, l4_off);
        if found == 0 {
            return Ok(None);
        }
        (found as u16, (found >> 16) as u16, found & FRAG_TAIL != 0)
    } else {
        let sport: u16 = ctx.load(l4_off).map_err(|_| pass)?;
        let dport: u16 = ctx.load(l4_off + 2).map_err(|_| pass)?;
        (sport, dport, false)
    };
    let tcp_flags = if proto == PROTO_TCP && !tail {
        ctx.load::<u8>(l4_off + 13).map_err(|_| pass)?
    } else {
        0
    };
    Ok(Some(Packet {
        family,
        proto,
        saddr,
        daddr,
        sport,
        dport,
        tail,
        tcp_flags,
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
fn fragment<F: Frame>(ctx: &F, l4_off: usize) -> u64 {
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
