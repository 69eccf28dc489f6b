//! Direct server return (IPv4). At the node a client sent to, a flow of a DSR frontend
//! whose backend is on another node keeps the client's address: each of its packets,
//! once translated to the backend, carries the frontend in an IP option
//! (`proxy_common::dsr`). At the backend's node the option makes the flow's entries there
//! — the client's tuple towards the frontend, and the backend's reply tuple — so the
//! backend's replies leave that node as the frontend, straight to the client.
//!
//! Why an IP option, not IPIP or Geneve: the packet stays a routed packet between pod
//! networks, as every other (no tunnel device, no second header to route), the frontend
//! travels in 8 bytes instead of 20 or more, and Linux skips an option it does not know,
//! so the backend's stack needs nothing. The network between nodes must let IP options
//! through, and let a node send packets with another node's address as source.
//!
//! Layer 4. Owns: pushing the option (`push`), learning a flow from it (`arrival`,
//! `proxy_dsr_learn`, `ARRIVAL`). May import: layers 0-3.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use proxy_common::{
    CT_DIR_FORWARD, CT_DIR_REPLY, CT_F_ASSURED, CT_F_DSR_BACKEND, CtKey, DSR_OPT_LEN, counter,
    dsr_option, parse_dsr_option,
};

use crate::{
    conntrack::{self, SCRATCH_FORWARD, SCRATCH_REPLY, ct_scratch},
    frame::{Frame, csum},
    maps::count,
    packet::{ETH_HLEN, IPV4_CSUM_OFF, Packet},
    verdict::PASS_ON,
};

/// Bytes the option adds to every packet (the MTU checks count them).
pub const OVERHEAD: u32 = DSR_OPT_LEN as u32;
/// Where the option goes: right after the IPv4 base header.
const OPT_OFF: usize = ETH_HLEN + 20;

/// Whether a packet's flow may take direct server return: IPv4 without options of its
/// own (room for ours), not a later fragment. Read from the packet, not from a `Packet`
/// (see `arrival`).
#[inline(always)]
pub fn fits<F: Frame>(ctx: &F) -> bool {
    matches!(
        (ctx.load::<u8>(ETH_HLEN), ctx.load::<u16>(ETH_HLEN + 6)),
        (Ok(0x45), Ok(frag)) if u16::from_be(frag) & 0x1fff == 0
    )
}

/// The option for frontend `addr:port` (network order), into a packet already
/// translated to its backend: 8 bytes after the base header, the header's length fields
/// and checksum updated (the L4 checksum does not cover the IP header).
#[inline(never)]
pub fn push<F: Frame>(ctx: &F, addr: u32, port: u16) -> Result<(), i32> {
    let fail = |_| {
        count(counter::REWRITE_FAILED);
        crate::verdict::DROP
    };
    // The version/IHL byte with TOS, and the total length: the words that change.
    let (Ok(word0), Ok(total), Ok(check)) = (
        ctx.load::<u16>(ETH_HLEN),
        ctx.load::<u16>(ETH_HLEN + 2),
        ctx.load::<u16>(IPV4_CSUM_OFF),
    ) else {
        return Err(crate::verdict::DROP);
    };
    ctx.grow_ipv4_header().map_err(fail)?;
    let opt = dsr_option(addr, port);
    // IHL is the low nibble of the first byte: two more 32-bit words.
    let b = word0.to_ne_bytes();
    let new_word0 = u16::from_ne_bytes([b[0] + 2, b[1]]);
    let new_total = (u16::from_be(total) + DSR_OPT_LEN as u16).to_be();
    let mut d = csum::delta16(word0, new_word0) + csum::delta16(total, new_total);
    // The option's words join the sum (as if they went from zero).
    for i in 0..4 {
        d += csum::delta16(0, u16::from_ne_bytes([opt[2 * i], opt[2 * i + 1]]));
    }
    ctx.store(ETH_HLEN, &new_word0).map_err(fail)?;
    ctx.store(ETH_HLEN + 2, &new_total).map_err(fail)?;
    ctx.store(OPT_OFF, &opt).map_err(fail)?;
    ctx.store(IPV4_CSUM_OFF, &csum::fixed(check, d))
        .map_err(fail)?;
    count(counter::DSR_SENT);
    Ok(())
}

/// A flow `arrival` found, for `proxy_dsr_learn`: the packet as its client sent it (to
/// the frontend), and its backend here.
pub struct Arrival {
    pkt: Packet,
    /// `pkt`'s forward key, and the backend's reply tuple.
    key: CtKey,
    reply_key: CtKey,
    backend: [u32; 4],
    backend_port: u16,
}

/// (Per CPU, not on the stack: the classifier's call chain shares 512 bytes.)
#[btf_map]
static ARRIVAL: PerCpuArray<Arrival, 1> = PerCpuArray::new();

/// At the backend's node (TC): a packet whose option names a frontend. Its flow's
/// entries are made (or refreshed), and the packet goes on as it is — the node it came
/// through translated it. `None`: no option of ours.
#[inline(never)]
pub fn arrival<F: Frame>(ctx: &F, pkt: &Packet) -> Option<i32> {
    // IPv4 with room for the option: read from the packet, not from `pkt` (a check on
    // `pkt`'s fields would narrow what the verifier knows of them in the caller, and
    // every narrowing is one more walk of the whole pipeline after this).
    let ver_ihl: u8 = ctx.load(ETH_HLEN).ok()?;
    if ver_ihl >> 4 != 4 || ver_ihl & 0x0f < 7 {
        return None;
    }
    let opt: [u8; 8] = ctx.load(OPT_OFF).ok()?;
    let (addr, port) = parse_dsr_option(&opt)?;
    let a = ARRIVAL.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used by one packet at a time.
    let a = unsafe { &mut *a };
    a.pkt = Packet {
        daddr: [addr, 0, 0, 0],
        dport: port,
        ..*pkt
    };
    a.backend = pkt.daddr;
    a.backend_port = pkt.dport;
    proxy_dsr_learn();
    Some(PASS_ON)
}

/// `arrival`'s bookkeeping, on the flow in `ARRIVAL`: refreshed if known (its TCP state,
/// the handshake's completion), else recorded — both entries, the backend's reply tuple
/// translated back to the frontend. A global BPF function (exported, no arguments): the
/// verifier checks it once, on its own, not once per path of the classifier.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn proxy_dsr_learn() -> u32 {
    let Some(a) = ARRIVAL.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's slot, filled by `arrival` for this packet.
    let a = unsafe { &mut *a };
    // SAFETY: no preconditions.
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
    a.key = a.pkt.ct_key(CT_DIR_FORWARD);
    let key = &a.key;
    if let Some(entry) = conntrack::lookup(key) {
        // SAFETY: map memory, valid for this program run (RCU).
        let ct = unsafe { &mut *entry.value };
        if !conntrack::over(&a.pkt, ct, now, false) {
            ct.last_seen_ns = now;
            ct.flags |= conntrack::segment_flags(&a.pkt, false);
            if entry.new && conntrack::completes_handshake(&a.pkt, ct.flags) {
                ct.flags |= CT_F_ASSURED;
                conntrack::promote_forward(key, ct);
            }
            return 1;
        }
        conntrack::forget(key, ct, entry.new);
    }
    // As `conntrack::record` keeps a client's source — but a clash on the reply tuple
    // is left alone: this node may not change the client's tuple. (Not `record` itself:
    // its frames on top of these would pass the 512-byte stack.)
    let (Some(fwd), Some(reply)) = (ct_scratch(SCRATCH_FORWARD), ct_scratch(SCRATCH_REPLY)) else {
        return 0;
    };
    fwd.last_seen_ns = now;
    fwd.xlate_addr = a.backend;
    fwd.xlate_port = a.backend_port;
    fwd.flags = CT_F_DSR_BACKEND;
    reply.last_seen_ns = now;
    reply.xlate_addr = a.pkt.daddr;
    reply.xlate_port = a.pkt.dport;
    a.reply_key = CtKey {
        saddr: a.backend,
        daddr: a.pkt.saddr,
        sport: a.backend_port,
        dport: a.pkt.sport,
        dir: CT_DIR_REPLY,
        ..a.key
    };
    if !conntrack::claim(&a.reply_key, reply) {
        return 0;
    }
    conntrack::insert_forward(&a.pkt, fwd);
    count(counter::DSR_RECEIVED);
    1
}
