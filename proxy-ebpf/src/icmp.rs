//! ICMP and ICMPv6 errors about translated flows, as netfilter translates its RELATED
//! packets: the packet an error quotes is put back the way its sender saw it (the
//! frontend instead of the backend, the client instead of the masquerade address), and
//! the error's own addresses follow, so "port unreachable", "fragmentation needed" /
//! "packet too big" and "time exceeded" reach the socket they concern.
//!
//! Both directions: an error about a packet the client sent (from the backend or a
//! router between the node and the backend) is found through the flow's reply entry, one
//! about a reply (from the client's side) through its forward entry.
//!
//! Layer 4. Owns: the translation of ICMP errors about translated flows, and
//! `ICMP_SCRATCH`. May import: layers 0-3 (`maps`, `verdict`, `packet`, `stats`, `drop`,
//! `node`, `conntrack`, `lb`, `reject`, `route`).

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use proxy_common::{
    CT_DIR_FORWARD, CT_DIR_REPLY, CT_F_SNAT, CtKey, FAMILY_V4, FAMILY_V6, PROTO_SCTP, PROTO_TCP,
    PROTO_UDP, counter,
};

use crate::{
    conntrack,
    drop::{self, Reason},
    frame::csum::{delta, delta16, fixed},
    maps::count,
    node::is_node_address,
    packet::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6},
    route,
    verdict::{DONE, PASS_ON},
};

const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
const ICMP_HLEN: usize = 8;
const IPV6_HLEN: usize = 40;

/// Per-CPU room for an error's `Quote` and `Edit` (`ICMP_SCRATCH`): on the stack they
/// would push the classifier's call chain past the verifier's 512 bytes.
struct Scratch {
    q: Quote,
    e: Edit,
}

/// Per-CPU room for the ICMP error being translated (not pinned: each load has its own).
#[btf_map]
static ICMP_SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// An ICMP error's layout and the tuple of the packet it quotes.
struct Quote {
    family: u8,
    /// The quoted packet's protocol.
    proto: u8,
    icmp_off: usize,
    /// The quoted IP header and its L4 header.
    inner_off: usize,
    l4_off: usize,
    /// Where the error's IP packet ends (its length, within the frame): what follows is
    /// padding, which no checksum covers.
    end: usize,
    /// The error's own addresses.
    outer_saddr: [u32; 4],
    outer_daddr: [u32; 4],
    /// The quoted packet's tuple (network byte order).
    saddr: [u32; 4],
    daddr: [u32; 4],
    sport: u16,
    dport: u16,
}

/// What the error becomes: the quoted tuple and the outer addresses after translation.
struct Edit {
    saddr: [u32; 4],
    daddr: [u32; 4],
    sport: u16,
    dport: u16,
    outer_saddr: [u32; 4],
    outer_daddr: [u32; 4],
}

/// Translates an ICMP error about a flow we translated; `PASS_ON` for anything else.
/// `egress`: the node sent it (a "fragmentation needed" from its own forwarding, a port
/// unreachable from an endpoint on the node's address) and it is on its way out.
#[inline(never)]
pub fn translate(ctx: &TcContext, egress: bool) -> i32 {
    let Some(scratch) = ICMP_SCRATCH.get_ptr_mut(0) else {
        return PASS_ON; // unreachable: index 0 of a one-entry array
    };
    // SAFETY: this CPU's slot, used by one packet at a time.
    let Scratch { q, e } = unsafe { &mut *scratch };
    if !parse(ctx, q) {
        return PASS_ON;
    }
    e.saddr = q.saddr;
    e.daddr = q.daddr;
    e.sport = q.sport;
    e.dport = q.dport;
    if !plan(q, e) {
        return PASS_ON;
    }
    // The error's addresses mirror the quoted packet's: it comes from where that packet
    // went (or a router on the way) and goes to where it came from.
    e.outer_saddr = if q.outer_saddr == q.daddr {
        e.daddr
    } else {
        q.outer_saddr
    };
    e.outer_daddr = if q.outer_daddr == q.saddr {
        e.saddr
    } else {
        q.outer_daddr
    };
    if let Err(v) = rewrite(ctx, q, e) {
        return v;
    }
    count(counter::ICMP_ERROR_NAT);
    let rerouted = e.outer_daddr != q.outer_daddr;
    // A new destination needs a new route; a source that is one of the node's addresses
    // (a NodePort frontend) would be dropped by the stack as a martian.
    if rerouted || (!egress && is_node_address(q.family, &e.outer_saddr)) {
        return route::forward(ctx, q.family, &e.outer_saddr, &e.outer_daddr).code();
    }
    DONE
}

/// Reads an ICMP error (IPv4 types 3, 11, 12; ICMPv6 types 1-4) quoting TCP, UDP or SCTP.
/// (IPv4 options, in the error or the quote, and IPv6 extension headers are not walked:
/// such errors pass untranslated.)
#[inline(always)]
fn parse(ctx: &TcContext, q: &mut Quote) -> bool {
    parse_into(ctx, q).is_some()
}

#[inline(always)]
fn parse_into(ctx: &TcContext, q: &mut Quote) -> Option<()> {
    let ether_type = u16::from_be(ctx.load::<u16>(12).ok()?);
    let len = ctx.len() as usize;
    let ip_end;
    q.family = FAMILY_V4;
    q.outer_saddr = [0; 4];
    q.outer_daddr = [0; 4];
    q.saddr = [0; 4];
    q.daddr = [0; 4];
    if ether_type == ETH_P_IP {
        let head: [u32; 5] = ctx.load(ETH_HLEN).ok()?;
        let [ver_ihl, _, len_hi, len_lo] = head[0].to_ne_bytes();
        ip_end = ETH_HLEN + usize::from(u16::from_be_bytes([len_hi, len_lo]));
        let [_, proto, _, _] = head[2].to_ne_bytes();
        if ver_ihl != 0x45 || proto != IPPROTO_ICMP {
            return None;
        }
        q.icmp_off = ETH_HLEN + 20;
        let kind: u8 = ctx.load(q.icmp_off).ok()?;
        if kind != 3 && kind != 11 && kind != 12 {
            return None;
        }
        q.outer_saddr[0] = head[3];
        q.outer_daddr[0] = head[4];
        q.inner_off = q.icmp_off + ICMP_HLEN;
        let inner: [u32; 5] = ctx.load(q.inner_off).ok()?;
        let [ver_ihl, _, _, _] = inner[0].to_ne_bytes();
        let [_, proto, _, _] = inner[2].to_ne_bytes();
        // Only a first fragment (or a whole datagram) carries the ports.
        let [_, _, frag_hi, frag_lo] = inner[1].to_ne_bytes();
        if ver_ihl != 0x45 || u16::from_be_bytes([frag_hi, frag_lo]) & 0x1fff != 0 {
            return None;
        }
        q.proto = proto;
        q.saddr[0] = inner[3];
        q.daddr[0] = inner[4];
        q.l4_off = q.inner_off + 20;
    } else if ether_type == ETH_P_IPV6 {
        let version: u8 = ctx.load(ETH_HLEN).ok()?;
        let payload: u16 = ctx.load(ETH_HLEN + 4).ok()?;
        ip_end = ETH_HLEN + IPV6_HLEN + usize::from(u16::from_be(payload));
        let next: u8 = ctx.load(ETH_HLEN + 6).ok()?;
        if version >> 4 != 6 || next != IPPROTO_ICMPV6 {
            return None;
        }
        q.family = FAMILY_V6;
        q.icmp_off = ETH_HLEN + IPV6_HLEN;
        let kind: u8 = ctx.load(q.icmp_off).ok()?;
        if !(1..=4).contains(&kind) {
            return None;
        }
        q.outer_saddr = ctx.load(ETH_HLEN + 8).ok()?;
        q.outer_daddr = ctx.load(ETH_HLEN + 24).ok()?;
        q.inner_off = q.icmp_off + ICMP_HLEN;
        let inner_version: u8 = ctx.load(q.inner_off).ok()?;
        if inner_version >> 4 != 6 {
            return None;
        }
        q.proto = ctx.load(q.inner_off + 6).ok()?;
        q.saddr = ctx.load(q.inner_off + 8).ok()?;
        q.daddr = ctx.load(q.inner_off + 24).ok()?;
        q.l4_off = q.inner_off + IPV6_HLEN;
    } else {
        return None;
    }
    if q.proto != PROTO_TCP && q.proto != PROTO_UDP && q.proto != PROTO_SCTP {
        return None;
    }
    // The quoted ports must lie inside the error's own IP packet: bytes past its length
    // (padding) are not part of the message its checksum covers.
    // The quoted ports must lie inside the error's own IP packet: bytes past its length
    // (padding) are not part of the message its checksum covers.
    q.end = if ip_end < len { ip_end } else { len };
    if q.end < q.l4_off + 4 {
        return None;
    }
    q.sport = ctx.load(q.l4_off).ok()?;
    q.dport = ctx.load(q.l4_off + 2).ok()?;
    Some(())
}

/// Finds the flow the quoted packet belongs to and fills in its translated tuple.
#[inline(never)]
fn plan(q: &Quote, e: &mut Edit) -> bool {
    // The quote is a packet the client sent, as it reached the backend: the flow's reply
    // tuple is the quote reversed.
    let key = CtKey {
        saddr: q.daddr,
        daddr: q.saddr,
        sport: q.dport,
        dport: q.sport,
        proto: q.proto,
        family: q.family,
        dir: CT_DIR_REPLY,
        _pad: 0,
    };
    if let Some(entry) = conntrack::lookup(&key)
        && !conntrack::partner(&key, entry.value, entry.new).is_null()
    {
        // SAFETY: map memory, valid for this program run.
        let r = unsafe { &*entry.value };
        e.daddr = r.xlate_addr;
        e.dport = r.xlate_port;
        if r.flags & CT_F_SNAT != 0 {
            e.saddr = r.nat_addr;
            e.sport = r.nat_port;
        }
        return true;
    }
    // The quote is a reply as it reached the client: the flow's forward tuple is the
    // quote reversed.
    let key = CtKey {
        dir: CT_DIR_FORWARD,
        ..key
    };
    let Some(entry) = conntrack::lookup(&key) else {
        return false;
    };
    // SAFETY: as above.
    let f = unsafe { &*entry.value };
    e.saddr = f.xlate_addr;
    e.sport = f.xlate_port;
    if f.flags & CT_F_SNAT != 0 {
        e.daddr = f.nat_addr;
        e.dport = f.nat_port;
    }
    true
}

/// Writes `e` into the error: quoted addresses and ports, the quote's IPv4 header and L4
/// checksums, the outer addresses and IPv4 header checksum, and the ICMP checksum (which
/// covers the quote, and for ICMPv6 a pseudo-header of the outer addresses). Checksums
/// are computed, not left to helpers: a locally made error is `CHECKSUM_NONE` and no
/// checksum state of the skb applies to a quote.
#[inline(never)]
fn rewrite(ctx: &TcContext, q: &Quote, e: &Edit) -> Result<(), i32> {
    let fail = |_| drop::packet(Reason::RewriteFailed);
    let v4 = q.family == FAMILY_V4;
    let words = if v4 { 1 } else { 4 };
    let mut addrs = 0u64; // the quote's address changes
    let mut outer = 0u64; // the error's address changes
    for i in 0..4 {
        if i < words {
            addrs += delta(q.saddr[i], e.saddr[i]) + delta(q.daddr[i], e.daddr[i]);
            outer += delta(q.outer_saddr[i], e.outer_saddr[i])
                + delta(q.outer_daddr[i], e.outer_daddr[i]);
        }
    }
    let ports = delta16(q.sport, e.sport) + delta16(q.dport, e.dport);
    // Everything that changes inside the ICMP message adds up here.
    let mut icmp = addrs + ports;
    let (s_off, d_off) = if v4 {
        (q.inner_off + 12, q.inner_off + 16)
    } else {
        (q.inner_off + 8, q.inner_off + 24)
    };
    if v4 {
        ctx.store(s_off, &e.saddr[0], 0).map_err(fail)?;
        ctx.store(d_off, &e.daddr[0], 0).map_err(fail)?;
        let off = q.inner_off + 10;
        let old: u16 = ctx.load(off).map_err(fail)?;
        let new = fixed(old, addrs);
        icmp += delta16(old, new);
        ctx.store(off, &new, 0).map_err(fail)?;
    } else {
        ctx.store(s_off, &e.saddr, 0).map_err(fail)?;
        ctx.store(d_off, &e.daddr, 0).map_err(fail)?;
    }
    ctx.store(q.l4_off, &e.sport, 0).map_err(fail)?;
    ctx.store(q.l4_off + 2, &e.dport, 0).map_err(fail)?;
    // The quote's L4 checksum (pseudo-header and ports), when the quote holds it.
    let len = q.end;
    let csum_off = match q.proto {
        PROTO_UDP => q.l4_off + 6,
        PROTO_TCP => q.l4_off + 16,
        _ => 0, // SCTP's CRC covers no addresses, and a quote rarely the whole packet
    };
    if csum_off != 0 && len >= csum_off + 2 {
        let old: u16 = ctx.load(csum_off).map_err(fail)?;
        // A zero UDP checksum (IPv4) means none, and stays so.
        if !(q.proto == PROTO_UDP && v4 && old == 0) {
            let mut new = fixed(old, addrs + ports);
            if q.proto == PROTO_UDP && new == 0 {
                new = 0xffff;
            }
            icmp += delta16(old, new);
            ctx.store(csum_off, &new, 0).map_err(fail)?;
        }
    }
    // The error's own addresses.
    if v4 {
        ctx.store(ETH_HLEN + 12, &e.outer_saddr[0], 0)
            .map_err(fail)?;
        ctx.store(ETH_HLEN + 16, &e.outer_daddr[0], 0)
            .map_err(fail)?;
        let old: u16 = ctx.load(ETH_HLEN + 10).map_err(fail)?;
        ctx.store(ETH_HLEN + 10, &fixed(old, outer), 0)
            .map_err(fail)?;
    } else {
        ctx.store(ETH_HLEN + 8, &e.outer_saddr, 0).map_err(fail)?;
        ctx.store(ETH_HLEN + 24, &e.outer_daddr, 0).map_err(fail)?;
        icmp += outer; // ICMPv6's pseudo-header
    }
    let off = q.icmp_off + 2;
    let old: u16 = ctx.load(off).map_err(fail)?;
    ctx.store(off, &fixed(old, icmp), 0).map_err(fail)
}
