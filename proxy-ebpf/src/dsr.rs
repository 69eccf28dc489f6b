//! Direct server return. At the node a client sent to, a flow of a DSR frontend whose
//! backend is on another node keeps the client's address: each of its packets, once
//! translated to the backend, carries the frontend — in an IPv4 option, or in an IPv6
//! Destination Options header (`proxy_common::dsr`). At the backend's node that makes
//! the flow's entries there — the client's tuple towards the frontend, and the backend's
//! reply tuple — so the backend's replies leave that node as the frontend, straight to
//! the client.
//!
//! Why an option, not IPIP or Geneve: the packet stays a routed packet between pod
//! networks, as every other (no tunnel device, no second header to route), the frontend
//! travels in 12 bytes (IPv4) or 40 (IPv6) instead of 20 or 40 and more, and Linux skips
//! an option it does not know, so the backend's stack needs nothing. The network between
//! nodes must let IP options (IPv6: Destination Options headers) through, and let a node
//! send packets with another node's address as source.
//!
//! An option is believed only as `DSR_PERMITS` allows (ABI.md): from a source that is
//! not a pod's or the node's and that routes back by the interface the packet came in
//! on, through an entry node the agent knows as another node of the cluster whose
//! neighbour handed the frame over (`route::sent_by_neighbour`), naming a frontend of a
//! Service in `dsr` mode with the packet's destination — a backend of it on this node —
//! and never over a flow the node opened itself. Anything else is counted by reason and
//! dropped: no packet from a pod or a stranger makes a flow that steers another
//! client's traffic, and a pod's forgery dies at its own node.
//!
//! Layer 4. Owns: pushing the option (`push`), believing it (`refusal`), learning a flow
//! from it (`arrival`, `proxy_dsr_learn`, `ARRIVAL`). May import: layers 0-3.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use proxy_common::{
    CFG_NODE_PODS, CT_DIR_FORWARD, CT_DIR_REPLY, CT_F_ASSURED, CT_F_DSR_BACKEND, CtKey, CtValue,
    DSR_ANY_NODE, DSR_HDR6_LEN, DSR_HDR6_WORDS, DSR_OPT_LEN, DsrNamed, DsrPermitKey, FAMILY_V4,
    FAMILY_V6, IPPROTO_DSTOPTS, LPM_TAG_PEER_NODE, PROTO_TCP, PROTO_UDP, counter,
    dsr_header6_first, dsr_header6_last, dsr_option, is_dsr_header6, parse_dsr_option,
};

use crate::{
    conntrack::{self, SCRATCH_FORWARD, SCRATCH_REPLY, ct_scratch},
    drop::{self, Reason},
    frame::{Frame, csum},
    maps::{DSR_PERMITS, LOCAL_NETS, NODE_CONFIG, count},
    node::{is_node_address, lpm_key, on_node, on_node_pods, origin},
    packet::{ETH_HLEN, IPV4_CSUM_OFF, IPV6_HLEN, Packet},
    route,
    verdict::PASS_ON,
};

/// Where the IPv4 option goes: right after the base header.
const OPT_OFF: usize = ETH_HLEN + 20;
/// Where the IPv6 header goes: right after the base header.
const HDR6_OFF: usize = ETH_HLEN + IPV6_HLEN;

/// Whether the frame is IPv6 (read from the packet, not from a `Packet`: see `arrival`).
#[inline(always)]
fn is_v6<F: Frame>(ctx: &F) -> bool {
    matches!(ctx.load::<u8>(ETH_HLEN), Ok(v) if v >> 4 == 6)
}

/// Bytes the option adds to every packet of the frame's family (the MTU checks count
/// them).
#[inline(always)]
pub fn overhead<F: Frame>(ctx: &F) -> u32 {
    if is_v6(ctx) {
        u32::from(DSR_HDR6_LEN)
    } else {
        u32::from(DSR_OPT_LEN)
    }
}

/// Whether a packet's flow may take direct server return: IPv4 without options of its
/// own (room for ours), not a later fragment; IPv6 with TCP or UDP right after the base
/// header (no extension headers of its own). Read from the packet, not from a `Packet`
/// (see `arrival`).
#[inline(always)]
fn fits<F: Frame>(ctx: &F) -> bool {
    if is_v6(ctx) {
        return matches!(ctx.load::<u8>(ETH_HLEN + 6), Ok(PROTO_TCP | PROTO_UDP));
    }
    matches!(
        (ctx.load::<u8>(ETH_HLEN), ctx.load::<u16>(ETH_HLEN + 6)),
        (Ok(0x45), Ok(frag)) if u16::from_be(frag) & 0x1fff == 0
    )
}

/// Whether a new flow to `backend` takes direct server return: its packet `fits`, and
/// the backend is on another node. (Its own frame: `new_flow`'s has no room left.)
#[inline(never)]
pub fn applies<F: Frame>(ctx: &F, backend: &[u32; 4]) -> bool {
    let family = if is_v6(ctx) { FAMILY_V6 } else { FAMILY_V4 };
    fits(ctx) && !on_node(family, backend)
}

/// The option for the frontend `pkt` was sent to, into the packet already translated to
/// its backend (`pkt` as parsed before that).
#[inline(never)]
pub fn push<F: Frame>(ctx: &F, pkt: &Packet) -> Result<(), i32> {
    // This node, as the backend's node will check it: its address of the family (zero
    // when it has none, which the backend's node refuses).
    let Some(cfg) = NODE_CONFIG.get(0) else {
        return Err(drop::packet(Reason::Unreachable)); // index 0 of a one-entry array
    };
    if is_v6(ctx) {
        push_v6(ctx, pkt, &cfg.snat_v6)
    } else {
        push_v4(ctx, pkt.daddr[0], pkt.dport, cfg.snat_v4[0])
    }?;
    count(counter::DSR_SENT);
    Ok(())
}

fn push_failed(_: i64) -> i32 {
    drop::packet(Reason::RewriteFailed)
}

/// IPv4: 12 bytes after the base header, the header's length fields and checksum updated
/// (the L4 checksum does not cover the IP header; the header still sums to zero, so a
/// `CHECKSUM_COMPLETE` sum stays right).
#[inline(always)]
fn push_v4<F: Frame>(ctx: &F, addr: u32, port: u16, entry: u32) -> Result<(), i32> {
    // The version/IHL byte with TOS, and the total length: the words that change.
    let (Ok(word0), Ok(total), Ok(check)) = (
        ctx.load::<u16>(ETH_HLEN),
        ctx.load::<u16>(ETH_HLEN + 2),
        ctx.load::<u16>(IPV4_CSUM_OFF),
    ) else {
        return Err(drop::packet(Reason::RewriteFailed));
    };
    ctx.grow_network_header::<{ ETH_HLEN + 20 }, { DSR_OPT_LEN as usize }>()
        .map_err(push_failed)?;
    let opt = dsr_option(addr, port, entry);
    // IHL is the low nibble of the first byte: three more 32-bit words.
    let b = word0.to_ne_bytes();
    let new_word0 = u16::from_ne_bytes([b[0] + DSR_OPT_LEN / 4, b[1]]);
    let new_total = (u16::from_be(total) + DSR_OPT_LEN as u16).to_be();
    let mut d = csum::delta16(word0, new_word0) + csum::delta16(total, new_total);
    // The option's words join the sum (as if they went from zero).
    for i in 0..DSR_OPT_LEN as usize / 2 {
        d += csum::delta16(0, u16::from_ne_bytes([opt[2 * i], opt[2 * i + 1]]));
    }
    ctx.store(ETH_HLEN, &new_word0).map_err(push_failed)?;
    ctx.store(ETH_HLEN + 2, &new_total).map_err(push_failed)?;
    ctx.store(OPT_OFF, &opt).map_err(push_failed)?;
    ctx.store(IPV4_CSUM_OFF, &csum::fixed(check, d))
        .map_err(push_failed)?;
    Ok(())
}

/// IPv6: a 40-byte Destination Options header after the base header, which now names it
/// as the next header and counts it in its payload length. No IP checksum, and the L4
/// checksum's pseudo-header takes the upper-layer length, which stays: only a
/// `CHECKSUM_COMPLETE` sum has to follow the new bytes.
#[inline(always)]
fn push_v6<F: Frame>(ctx: &F, pkt: &Packet, entry: &[u32; 4]) -> Result<(), i32> {
    // The payload length, and the next header with the hop limit: the words that change.
    let (Ok(payload), Ok(next_hop)) =
        (ctx.load::<u16>(ETH_HLEN + 4), ctx.load::<u16>(ETH_HLEN + 6))
    else {
        return Err(drop::packet(Reason::RewriteFailed));
    };
    ctx.grow_network_header::<{ ETH_HLEN + IPV6_HLEN }, { DSR_HDR6_LEN as usize }>()
        .map_err(push_failed)?;
    let b = next_hop.to_ne_bytes();
    let new_next_hop = u16::from_ne_bytes([IPPROTO_DSTOPTS, b[1]]);
    let new_payload = (u16::from_be(payload) + u16::from(DSR_HDR6_LEN)).to_be();
    ctx.store(ETH_HLEN + 4, &new_payload).map_err(push_failed)?;
    ctx.store(ETH_HLEN + 6, &new_next_hop)
        .map_err(push_failed)?;
    let mut d = csum::delta16(payload, new_payload) + csum::delta16(next_hop, new_next_hop);
    // Word by word, straight into the packet (no 40 bytes on the shared stack), in
    // `dsr_header6`'s order; each joins the sum as if it went from zero.
    let mut put = |i: usize, w: u32| -> Result<(), i32> {
        ctx.store(HDR6_OFF + 4 * i, &w).map_err(push_failed)?;
        d += u64::from(w);
        Ok(())
    };
    put(0, dsr_header6_first(b[0]))?;
    for i in 0..4 {
        put(1 + i, pkt.daddr[i])?;
        put(5 + i, entry[i])?;
    }
    put(DSR_HDR6_WORDS - 1, dsr_header6_last(pkt.dport))?;
    ctx.bytes_changed(d);
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
    /// What the option names (`found`).
    named: DsrNamed,
    /// The `DSR_PERMITS` key `refusal` looks for (here, not on the classifier's stack).
    permit: DsrPermitKey,
}

/// (Per CPU, not on the stack: the classifier's call chain shares 512 bytes.)
#[btf_map]
static ARRIVAL: PerCpuArray<Arrival, 1> = PerCpuArray::new();

/// At the backend's node (TC): a packet whose option names a frontend. Its flow's
/// entries are made (or refreshed), and the packet goes on as it is — the node it came
/// through translated it. `None`: no option of ours, so the packet is handled as any
/// other. An option not believed (`refusal`, counted) drops its packet: it is a forgery
/// (a pod's, a stranger's), or comes in a window where two agents disagree (a Service
/// just changed mode, a node just joined) in which its flow could not work anyway (the
/// backend's replies would leave untranslated). Dropped at a pod's own node, a pod's
/// forgery never reaches the node it names.
#[inline(never)]
pub fn arrival<F: Frame>(ctx: &F, pkt: &Packet) -> Option<i32> {
    // Most packets carry nothing of ours: told by one byte, before any map.
    if !may_carry(ctx) {
        return None;
    }
    let a = ARRIVAL.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot, used by one packet at a time.
    let a = unsafe { &mut *a };
    // The option, read from the packet, not from `pkt` (a check on `pkt`'s fields would
    // narrow what the verifier knows of them in the caller, and every narrowing is one
    // more walk of the whole pipeline after this).
    if !found(ctx, &mut a.named) {
        return None;
    }
    if let Some(reason) = refusal(ctx, pkt) {
        return Some(drop::packet(reason));
    }
    a.pkt = Packet {
        daddr: a.named.frontend,
        dport: a.named.port,
        ..*pkt
    };
    a.backend = pkt.daddr;
    a.backend_port = pkt.dport;
    proxy_dsr_learn();
    Some(PASS_ON)
}

/// Why the option in `ARRIVAL` is not believed, or `None`. (Its own frame, apart from
/// `arrival`'s; its key in `ARRIVAL`: the classifier's call chain shares 512 bytes of
/// stack.)
#[inline(never)]
fn refusal<F: Frame>(ctx: &F, pkt: &Packet) -> Option<Reason> {
    let Some(cfg) = NODE_CONFIG.get(0) else {
        return Some(Reason::Unreachable); // index 0 of a one-entry array
    };
    let from = origin(pkt, cfg);
    if from.pod || from.node || !route::arrived_by_route(ctx, pkt.family, &pkt.saddr, &pkt.daddr) {
        return Some(Reason::DsrRefusedSource);
    }
    let Some(a) = ARRIVAL.get_ptr_mut(0) else {
        return Some(Reason::Unreachable); // index 0 of a one-entry array
    };
    // SAFETY: this CPU's slot, used by one packet at a time.
    let a = unsafe { &mut *a };
    // The node the client sent to: another node of the cluster, whose neighbour (its
    // own MAC, or the router's on the way to it) handed this frame over.
    if !is_peer(pkt.family, &a.named.entry)
        || !route::sent_by_neighbour(ctx, pkt.family, &pkt.daddr, &a.named.entry)
    {
        return Some(Reason::DsrRefusedNode);
    }
    let frontend = &a.named.frontend;
    let port = a.named.port;
    let key = &mut a.permit;
    *key = DsrPermitKey {
        frontend: *frontend,
        backend: pkt.daddr,
        frontend_port: port,
        backend_port: pkt.dport,
        proto: pkt.proto,
        family: pkt.family,
        _pad: [0; 2],
    };
    if DSR_PERMITS.get_ptr(key).is_none() {
        // A NodePort's frontend is the entry node's address: any address but this
        // node's own (a packet naming those was never sent by another node).
        key.frontend = DSR_ANY_NODE;
        if is_node_address(pkt.family, frontend) || DSR_PERMITS.get_ptr(key).is_none() {
            return Some(Reason::DsrRefusedFrontend);
        }
    }
    // (A node that does not know its pod CIDRs cannot tell: its entry nodes send the
    // option to its local backends too, and `DSR_PERMITS` still binds the pair. The
    // node's own addresses are not asked: a DSR backend is a pod on another node.)
    if cfg.flags & CFG_NODE_PODS != 0 && !on_node_pods(pkt.family, &pkt.daddr) {
        return Some(Reason::DsrRefusedBackend);
    }
    None
}

/// Another node of the cluster (the agent writes their addresses), not this one.
#[inline(always)]
fn is_peer(family: u8, addr: &[u32; 4]) -> bool {
    LOCAL_NETS
        .get(&lpm_key(
            LPM_TAG_PEER_NODE | u32::from(family),
            family,
            *addr,
        ))
        .is_some()
        && !is_node_address(family, addr)
}

/// Whether a packet has room for an option of ours: IPv4 with a header long enough,
/// IPv6 with a Destination Options header first. (A leaf frame of its own: `arrival`'s
/// sits under the classifier's deepest chain.)
#[inline(never)]
fn may_carry<F: Frame>(ctx: &F) -> bool {
    match ctx.load::<u8>(ETH_HLEN) {
        Ok(v) if v >> 4 == 4 => v & 0x0f >= 5 + DSR_OPT_LEN / 4,
        Ok(v) if v >> 4 == 6 => matches!(ctx.load::<u8>(ETH_HLEN + 6), Ok(IPPROTO_DSTOPTS)),
        _ => false,
    }
}

/// Whether a packet carries an option of ours — IPv4 with room for it after the base
/// header, or IPv6 with our header first — and what it names, into `named`.
#[inline(always)]
fn found<F: Frame>(ctx: &F, named: &mut DsrNamed) -> bool {
    let Ok(ver_ihl) = ctx.load::<u8>(ETH_HLEN) else {
        return false;
    };
    if ver_ihl >> 4 == 6 {
        let (Ok(IPPROTO_DSTOPTS), Ok(first), Ok(last)) = (
            ctx.load::<u8>(ETH_HLEN + 6),
            ctx.load::<u32>(HDR6_OFF),
            ctx.load::<u32>(HDR6_OFF + usize::from(DSR_HDR6_LEN) - 4),
        ) else {
            return false;
        };
        if !is_dsr_header6(first) {
            return false;
        }
        // Word by word, into `named` (per CPU), not through the stack.
        for i in 0..4 {
            let (Ok(f), Ok(e)) = (
                ctx.load::<u32>(HDR6_OFF + 4 + 4 * i),
                ctx.load::<u32>(HDR6_OFF + 20 + 4 * i),
            ) else {
                return false;
            };
            named.frontend[i] = f;
            named.entry[i] = e;
        }
        let p = last.to_ne_bytes();
        named.port = u16::from_ne_bytes([p[0], p[1]]);
        return true;
    }
    if ver_ihl >> 4 != 4 || ver_ihl & 0x0f < 5 + DSR_OPT_LEN / 4 {
        return false;
    }
    let Ok(opt) = ctx.load::<[u8; DSR_OPT_LEN as usize]>(OPT_OFF) else {
        return false;
    };
    match parse_dsr_option(&opt) {
        Some(n) => {
            *named = n;
            true
        }
        None => false,
    }
}

/// Who holds a live flow on the arrival's tuple (`holder`): this learned flow, the
/// node's own (which the option never outranks), or a learned flow to another backend
/// (the entry node chose again: replaced).
const SAME: u32 = 0;
const NODES_OWN: u32 = 1;
const REPLACE: u32 = 2;

/// (Its own frame: `proxy_dsr_learn`'s sits deep in the classifier's call chain.)
#[inline(never)]
fn holder(fwd: *const CtValue, a: *const Arrival) -> u32 {
    // SAFETY: map memory, valid for this program run (RCU); `a` is this CPU's slot.
    let (v, a) = unsafe { (&*fwd, &*a) };
    if v.flags & CT_F_DSR_BACKEND == 0 {
        NODES_OWN
    } else if v.xlate_addr == a.backend && v.xlate_port == a.backend_port {
        SAME
    } else {
        REPLACE
    }
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
    let now = conntrack::now();
    a.key = a.pkt.ct_key(CT_DIR_FORWARD);
    let key = &a.key;
    if let Some(entry) = conntrack::lookup(key) {
        let live = !conntrack::over(key, &a.pkt, entry.value, entry.new, now, false);
        let held = if live {
            holder(entry.value, a)
        } else {
            REPLACE
        };
        // The node's own flow on the client's tuple outranks the option.
        if held == NODES_OWN {
            count(counter::DSR_REFUSED_CLASH);
            return 0;
        }
        if held == SAME {
            // SAFETY: map memory, valid for this program run (RCU).
            let ct = unsafe { &mut *entry.value };
            ct.last_seen_ns = now;
            conntrack::forward_segment(key, &a.pkt, ct, entry.new);
            if entry.new && conntrack::completes_handshake(&a.pkt, ct.flags) {
                ct.flags |= CT_F_ASSURED;
                conntrack::promote_forward(key, ct);
            }
            return 1;
        }
        conntrack::forget(key, entry.value, entry.new);
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
