//! Per-packet service NAT, one pipeline for two hooks (TC ingress, and XDP on the node's
//! external interfaces): DNAT of packets addressed to a frontend, with connection
//! tracking so every packet of a flow keeps its backend, masquerade (SNAT to the node)
//! where kube-proxy would masquerade, reverse NAT of the replies, source-range filtering,
//! and TCP resets for services without endpoints. Packets that are not ours pass on
//! untouched (`TCX_NEXT`, `XDP_PASS`). Parsing lives in `packet`, flow state and
//! masquerade ports in `conntrack`, rewriting in `nat`, service lookup and backend choice
//! in `lb`, forwarding in `route`; the hook's own operations in `frame`.
//!
//! At XDP every translated packet leaves by the FIB (`XDP_TX`, `XDP_REDIRECT`); what the
//! pipeline cannot finish there — fragments, SCTP, ICMP errors, a refusal to send, a
//! packet the FIB cannot place (no neighbour entry yet, too big, no route) — passes to TC
//! before anything in it changed, so TC handles it as if XDP were not there. Either hook
//! opens and finds the same conntrack entries.
//!
//! Layer 5, an entry pipeline. Owns: the programs' bodies (`ingress`, `egress`, `xdp`) and
//! the order of their steps (reply, the frontend-port filter, established, new flow),
//! source ranges and netfilter's flows. May import: layers 0-4 (every module but `sock`
//! and `main`).

use aya_ebpf::programs::{TcContext, XdpContext};
use proxy_common::{
    AFFINITY_BY_ADDR, CT_DIR_FORWARD, CT_DIR_REPLY, CT_F_ASSURED, CT_F_DSR, CT_F_REPLIED,
    CT_F_SNAT, CT_NODE_NO, CT_NODE_YES, CtKey, CtValue, FAMILY_V4, PROTO_SCTP, PROTO_TCP,
    PROTO_UDP, SVC_F_DSR, SVC_F_SOURCE_RANGES, counter,
};

use crate::{
    conntrack::{self, SCRATCH_FORWARD, ct_scratch, scratch},
    drop::{self, Reason},
    dsr,
    frame::Frame,
    icmp,
    lb::{self, Client, NoBackend},
    maps::{NETFILTER_FLOWS, NODE_CONFIG, SOURCE_RANGES, count},
    nat::{self, Side, rewrite},
    node::{is_node_address, lpm_key, origin},
    packet::{self, Packet, parse},
    reject, route, stats,
    verdict::{DONE, DROP, PASS_ON, TO_TC, xdp_action},
};

/// The classifier: translate, then — for SCTP only — hand the checksum to the tail call.
/// ICMP errors about translated flows are translated too.
pub fn ingress(ctx: &TcContext) -> i32 {
    let pkt = match parse(ctx, PASS_ON) {
        Ok(Some(pkt)) => pkt,
        Ok(None) => return icmp::translate(ctx, false),
        Err(v) => return v,
    };
    // The backend's node of a direct-server-return flow: an option names the frontend
    // (XDP passes such packets on, as they name no frontend of the node's).
    if let Some(verdict) = dsr::arrival(ctx, &pkt) {
        return verdict;
    }
    let verdict = match translate(ctx, &pkt) {
        Ok(v) | Err(v) => v,
    };
    if pkt.proto == PROTO_SCTP {
        nat::finish(ctx, verdict)
    } else {
        verdict
    }
}

/// The egress program (same interfaces): what the node itself sends about translated
/// flows — replies of endpoints on the node's own addresses (hostNetwork pods, the API
/// server), which never cross an ingress classifier, and ICMP errors the node makes
/// (a "fragmentation needed" from its forwarding, a port unreachable from a local
/// endpoint) — gets the reverse translation.
pub fn egress(ctx: &TcContext) -> i32 {
    // Forwarded packets (they came in on some interface) were translated there, or are
    // not ours: only what the node itself made (no input interface) is looked at.
    if packet::ingress_ifindex(ctx) != 0 {
        return PASS_ON;
    }
    let pkt = match parse(ctx, PASS_ON) {
        Ok(Some(pkt)) => pkt,
        Ok(None) => return icmp::translate(ctx, true),
        Err(v) => return v,
    };
    if pkt.tail {
        return PASS_ON; // a later fragment of a local reply: not translated (ABI.md)
    }
    // Most of what the node sends is its own traffic, from ports no reply tuple uses.
    if !conntrack::may_be_reply(pkt.sport) {
        return PASS_ON;
    }
    let now = conntrack::now();
    let verdict = match reply(ctx, &pkt, now, true) {
        Ok(Some(v)) | Err(v) => v,
        Ok(None) => PASS_ON,
    };
    if pkt.proto == PROTO_SCTP {
        nat::finish(ctx, verdict)
    } else {
        verdict
    }
}

/// The XDP program (external interfaces): translate what can be finished here and send
/// it by the FIB; pass everything else to the stack — and TC — unchanged.
pub fn xdp(ctx: &XdpContext) -> u32 {
    let pkt = match parse(ctx, PASS_ON) {
        Ok(Some(pkt)) => pkt,
        // ICMP errors, fragments, IPv6 extension headers, not IP: TC's.
        Ok(None) | Err(_) => return xdp_action(PASS_ON),
    };
    if pkt.proto == PROTO_SCTP {
        return xdp_action(PASS_ON); // its CRC32c is TC's tail call
    }
    let verdict = match translate(ctx, &pkt) {
        Ok(v) | Err(v) => v,
    };
    if verdict == DROP {
        count(counter::XDP_DROP);
    } else if verdict == TO_TC {
        count(counter::XDP_TO_TC);
    }
    xdp_action(verdict)
}

#[inline(always)]
fn translate<F: Frame>(ctx: &F, pkt: &Packet) -> Result<i32, i32> {
    let now = conntrack::now();
    if conntrack::may_be_reply(pkt.sport)
        && let Some(verdict) = reply(ctx, pkt, now, false)?
    {
        return Ok(verdict);
    }
    // Not for a frontend's port: no flow of ours, no new one (most of a node's traffic).
    if !lb::may_be_frontend(pkt.dport) {
        return Ok(PASS_ON);
    }
    if let Some(verdict) = established(ctx, pkt, now)? {
        return Ok(verdict);
    }
    if pkt.tail {
        return Ok(PASS_ON); // its first fragment started no flow
    }
    match new_flow(ctx, pkt)? {
        Some(verdict) => Ok(verdict),
        None => open_flow(ctx, pkt),
    }
}

// The three paths are separate functions (not inlined) so their locals never share one
// stack frame: the BPF stack is 512 bytes.

/// A reply of a translated flow: the frontend as source, and the client back as
/// destination when the flow was masqueraded. The reply counts for the flow's state
/// (answered, FIN, RST) and keeps it alive, whichever side speaks. `egress`: a reply the
/// node itself sends (an endpoint on its own address), already on its way out.
/// An answered flow's reply that changes no state goes alone (`conntrack::reply_alone`):
/// one lookup, its forward entry untouched.
#[inline(never)]
fn reply<F: Frame>(ctx: &F, pkt: &Packet, now: u64, egress: bool) -> Result<Option<i32>, i32> {
    let key = pkt.ct_key(CT_DIR_REPLY);
    let Some(entry) = conntrack::lookup(&key) else {
        return Ok(None);
    };
    // SAFETY: entries stay valid memory during this program run (RCU); racy stores of
    // the timestamps and state bits are harmless.
    let alone = !entry.new && conntrack::reply_alone(pkt, unsafe { &*entry.value }, now);
    // A flow's first reply is its answer only if it came by the route back to its
    // source: one forged from elsewhere (a pod claiming the backend's address) is
    // translated, but the flow stays unanswered — evictable, on the short timeouts.
    let unproven = entry.new && !egress && !route::reply_by_route(ctx, pkt);
    if unproven {
        count(counter::CT_REPLY_UNVERIFIED);
    }
    // The state first, so one path follows for both kinds (the verifier walks it once);
    // at XDP a reply left to TC is stamped twice, which changes nothing.
    let bits = u32::from(conntrack::segment_flags(pkt, true)) | if unproven { UNPROVEN } else { 0 };
    if !alone && !reply_state(&key, entry.value, entry.new, bits, now) {
        return Ok(None);
    }
    if !entry.new {
        // SAFETY: as above.
        unsafe { (*entry.value).last_seen_ns = now };
    }
    // SAFETY: as above; the fields are copied out before the entry can move.
    let (frontend, frontend_port, snat, client, client_port) = unsafe {
        let r = &*entry.value;
        (
            r.xlate_addr,
            r.xlate_port,
            r.flags & CT_F_SNAT != 0,
            r.nat_addr,
            r.nat_port,
        )
    };
    let dst = if snat { client } else { pkt.daddr };
    // At XDP every reply leaves by the FIB, or goes to TC before anything changed. (A
    // direct-server-return reply, as another node's frontend, goes through the stack.)
    let redirect = F::XDP || (!egress && (snat || frontend_is_node(entry.value, pkt, &frontend)));
    let hop = if redirect {
        route::lookup(ctx, pkt, &frontend, &dst, 0)
    } else {
        0
    };
    if F::XDP && hop <= 0 {
        return Ok(Some(TO_TC));
    }
    conntrack::account(&entry, stats::OUT, ctx.len());
    // A TCP flow is assured by the client's ACK of this SYN-ACK (see `established`):
    // a spoofed SYN that the backend answers must not reach the answered table.
    if entry.new && pkt.proto != PROTO_TCP && !unproven {
        conntrack::promote(&key);
    }
    if hop < 0 {
        return too_big(ctx, pkt, hop).map(Some);
    }
    rewrite(ctx, pkt, Side::Source, &frontend, frontend_port)?;
    if snat {
        rewrite(ctx, pkt, Side::Destination, &client, client_port)?;
    }
    count(counter::CT_REPLY_NAT);
    if redirect {
        return Ok(Some(route::redirect(ctx, hop).code()));
    }
    Ok(Some(DONE))
}

/// `reply_state`'s bit beside the segment's: the reply did not come by its route, so it
/// is not the flow's answer.
const UNPROVEN: u32 = 1 << 8;

/// A reply that does not go alone counts for its flow's state: the forward entry (live,
/// this flow's) stamped and marked answered (unless `bits` has `UNPROVEN`), its
/// segment's FIN or RST (`bits`) in both entries, a flow other than TCP assured. `false`:
/// no live flow has this reply entry. (Five scalar or pointer arguments, no packet —
/// LLVM would pass its fields apart: the verifier takes no stack-passed ones.)
#[inline(never)]
fn reply_state(key: &CtKey, reply: *mut CtValue, new: bool, bits: u32, now: u64) -> bool {
    let answered = bits & UNPROVEN == 0;
    let bits = bits as u8;
    let fwd = conntrack::partner(key, reply, new);
    if fwd.is_null() {
        return false;
    }
    // SAFETY: map memory, valid for this program run (RCU); racy stores of the stamp
    // and state bits are harmless.
    let (fwd, r) = unsafe { (&mut *fwd, &*reply) };
    // An answered flow's replies may have gone alone: the reply entry's stamp counts.
    if conntrack::expired(fwd, if new { None } else { Some(r) }, key.proto, now) {
        return false;
    }
    fwd.last_seen_ns = now;
    fwd.flags |= bits;
    if answered {
        fwd.flags |= CT_F_REPLIED;
        if key.proto != PROTO_TCP {
            fwd.flags |= CT_F_ASSURED;
        }
    }
    // (The reply entry keeps them too: a closing flow's replies stop going alone.)
    // SAFETY: as above.
    unsafe { (*reply).flags |= bits };
    true
}

/// Whether a flow's frontend (`frontend`, from its reply entry `reply`) is one of the
/// node's addresses: looked up at the flow's first reply, then read from the entry.
/// (The node's addresses seldom change; a flow keeps what it learnt, as it keeps its
/// backend.)
#[inline(always)]
fn frontend_is_node(reply: *mut CtValue, pkt: &Packet, frontend: &[u32; 4]) -> bool {
    // SAFETY: map memory, valid for this program run; a racy store of the same answer
    // from two CPUs is harmless.
    let known = unsafe { (*reply).frontend_node };
    match known {
        CT_NODE_YES => true,
        CT_NODE_NO => false,
        _ => {
            let node = is_node_address(pkt.family, frontend);
            // SAFETY: as above.
            unsafe { (*reply).frontend_node = if node { CT_NODE_YES } else { CT_NODE_NO } };
            node
        }
    }
}

/// A packet of a flow we already translated keeps its backend while the flow lives.
#[inline(never)]
fn established<F: Frame>(ctx: &F, pkt: &Packet, now: u64) -> Result<Option<i32>, i32> {
    let key = pkt.ct_key(CT_DIR_FORWARD);
    let Some(entry) = conntrack::lookup(&key) else {
        return Ok(None);
    };
    // TCP and SCTP keep their backend to the end (a terminating pod finishes its
    // connections); a UDP flow whose backend is gone is balanced again.
    // SAFETY: the pointer stays valid memory for the program's run (RCU).
    let backend_gone =
        pkt.proto == PROTO_UDP && lb::backend(unsafe { (*entry.value).backend_id }).is_none();
    if conntrack::over(&key, pkt, entry.value, entry.new, now, backend_gone) {
        if pkt.is_syn() {
            count(counter::CT_REUSED);
        }
        conntrack::forget(&key, entry.value, entry.new);
        return Ok(None); // balanced again as a new flow
    }
    // A reference into the map, not a copy: the BPF stack is small. Other CPUs only
    // touch `last_seen_ns`, `flags` and the counts of a live entry.
    // SAFETY: as above.
    let ct = unsafe { &mut *entry.value };
    if ct.flags & CT_F_DSR != 0 {
        let verdict = dsr_send(ctx, pkt, &ct.xlate_addr, ct.xlate_port, false)?;
        if verdict != TO_TC {
            dsr_seen(ctx, pkt, ct, entry.new, now);
        }
        return Ok(Some(verdict));
    }
    let snat = ct.flags & CT_F_SNAT != 0;
    // At XDP every packet leaves by the FIB (from the client's address when not
    // masqueraded), or goes to TC before anything changed.
    let route = snat || F::XDP;
    let hop = if route {
        let src = if snat { &ct.nat_addr } else { &pkt.saddr };
        route::lookup(ctx, pkt, src, &ct.xlate_addr, 0)
    } else {
        0
    };
    if F::XDP && hop <= 0 {
        return Ok(Some(TO_TC));
    }
    if hop < 0 {
        return too_big(ctx, pkt, hop).map(Some);
    }
    if snat {
        rewrite(ctx, pkt, Side::Source, &ct.nat_addr, ct.nat_port)?;
    }
    rewrite(ctx, pkt, Side::Destination, &ct.xlate_addr, ct.xlate_port)?;
    ct.last_seen_ns = now;
    conntrack::forward_segment(&key, pkt, ct, entry.new);
    conntrack::account(&entry, stats::IN, ctx.len());
    // The client's ACK of the backend's SYN-ACK: the handshake is complete, the flow
    // moves to the answered table.
    let assure = entry.new && conntrack::completes_handshake(pkt, ct.flags);
    if assure {
        ct.flags |= CT_F_ASSURED;
    }
    let verdict = if route {
        route::redirect(ctx, hop).code()
    } else {
        DONE
    };
    if assure {
        conntrack::promote_forward(&key, ct);
    }
    Ok(Some(verdict))
}

/// A packet too big for its next hop (`hop` is minus the MTU): answered at TC; at XDP
/// (whose FIB lookups never say so) left to TC.
#[inline(always)]
fn too_big<F: Frame>(ctx: &F, pkt: &Packet, hop: i64) -> Result<i32, i32> {
    match ctx.tc() {
        Some(tc) => reject::too_big(tc, pkt, (-hop) as u32),
        None => Ok(TO_TC),
    }
}

/// A new flow: find the service, check source ranges, choose a backend and decide on
/// masquerade; `None` leaves the flow's forward entry in `SCRATCH_FORWARD` for
/// `open_flow`. Only a SYN opens a TCP flow.
#[inline(never)]
fn new_flow<F: Frame>(ctx: &F, pkt: &Packet) -> Result<Option<i32>, i32> {
    // A reference into the map, not a copy: the BPF stack is small.
    let Some(cfg) = NODE_CONFIG.get(0) else {
        return Ok(Some(PASS_ON)); // unreachable: index 0 of a one-entry array
    };
    let origin = origin(pkt, cfg);
    let internal = origin.pod || origin.node;
    let Some(svc) = lb::lookup_service(pkt.daddr, pkt.dport, pkt.proto, pkt.family, internal)
    else {
        return Ok(Some(PASS_ON));
    };
    count(counter::SVC_HIT);
    if svc.flags & SVC_F_SOURCE_RANGES != 0 && !source_allowed(svc.id, pkt) {
        return Err(drop::packet(Reason::SourceRange));
    }
    // A flow netfilter translated before we were attached (kube-proxy's, during a
    // migration): its conntrack entry still carries it, DNAT included, so it goes on
    // there. A SYN on its tuple is a new connection, and ours.
    if !pkt.is_syn() && netfilter_flow(pkt) {
        count(counter::NETFILTER_PASS);
        return Ok(Some(PASS_ON));
    }
    // A mid-stream segment of a flow we do not know (lost, expired): balancing it would
    // send it to a backend that never saw the connection. Dropped, as kube-proxy drops
    // what netfilter marks INVALID; the client's retransmissions end in its own timeout
    // or a reset from a backend it reconnects to.
    if pkt.proto == PROTO_TCP && !pkt.is_syn() {
        return Err(drop::packet(Reason::CtInvalid));
    }
    let client = Client {
        id: &pkt.saddr,
        kind: AFFINITY_BY_ADDR,
        family: pkt.family,
        port: pkt.sport,
    };
    let slot = lb::schedule(svc, &client);
    let Some(aff_key) = lb::affinity_key_in_scratch(svc, &client) else {
        return Err(drop::packet(Reason::Unreachable)); // a valid index
    };
    let (backend_id, be) = match lb::select_backend(svc, aff_key, slot) {
        Ok(found) => found,
        Err(NoBackend::Reject) => {
            return match ctx.tc() {
                Some(tc) => reject::refuse(tc, pkt).map(Some),
                // XDP sends nothing back: TC refuses the same packet.
                None => Ok(Some(TO_TC)),
            };
        }
        Err(NoBackend::Drop(verdict)) => return Err(verdict),
    };
    let Some(entry) = ct_scratch(SCRATCH_FORWARD) else {
        return Err(drop::packet(Reason::Unreachable)); // a valid index
    };
    entry.backend_id = backend_id;
    entry.xlate_addr = be.addr;
    entry.xlate_port = be.port;
    entry.rev_nat_id = svc.rev_nat_id;
    // Direct server return: a client outside the node, a backend on another node. The
    // client's address is kept; the backend's node answers as the frontend.
    let dsr = svc.flags & SVC_F_DSR != 0 && !internal && dsr::applies(ctx, &be.addr);
    // An endpoint on the node's own address is delivered locally, where kube-proxy's
    // masquerade (in POSTROUTING) never applies: the client's address is kept, and the
    // endpoint's replies are translated on their way out (`egress`).
    if dsr {
        entry.flags = CT_F_DSR;
    } else if nat::masquerade(&svc, cfg, &origin, pkt, &be.addr)
        && !is_node_address(pkt.family, &be.addr)
    {
        // A zero address (none configured for the family) means no masquerade.
        entry.nat_addr = if pkt.family == FAMILY_V4 {
            cfg.snat_v4
        } else {
            cfg.snat_v6
        };
    }
    // At XDP the flow opens only where its first packet can be sent: otherwise TC opens
    // it, as if XDP had not looked (nothing counted, nothing recorded).
    if F::XDP && xdp_hop(ctx, pkt) <= 0 {
        return Ok(Some(TO_TC));
    }
    lb::opened(&svc, backend_id);
    Ok(None)
}

/// XDP: where the flow `new_flow` prepared would go (`route::lookup`), before anything is
/// recorded. (Its own frame: the FIB's parameters would crowd `new_flow`'s.)
#[inline(never)]
fn xdp_hop<F: Frame>(ctx: &F, pkt: &Packet) -> i64 {
    let Some(entry) = scratch(SCRATCH_FORWARD) else {
        return 0;
    };
    let src = if entry.nat_addr == [0; 4] {
        &pkt.saddr
    } else {
        &entry.nat_addr
    };
    route::lookup(
        ctx,
        pkt,
        src,
        &entry.xlate_addr,
        grow(ctx, entry.flags & CT_F_DSR != 0),
    )
}

/// The bytes a flow's packets gain before they leave (`route::lookup`'s `grow`).
#[inline(always)]
fn grow<F: Frame>(ctx: &F, dsr: bool) -> u32 {
    if dsr { dsr::overhead(ctx) } else { 0 }
}

/// A direct-server-return packet, to `backend`: by the FIB with room for the option (at
/// XDP `hop_known`: `new_flow` looked), translated, the option pushed, sent. (Its own
/// path, apart from masquerade's branches: the verifier walks each once.)
#[inline(never)]
fn dsr_send<F: Frame>(
    ctx: &F,
    pkt: &Packet,
    backend: &[u32; 4],
    port: u16,
    hop_known: bool,
) -> Result<i32, i32> {
    let hop = if F::XDP && hop_known {
        1
    } else {
        route::lookup(ctx, pkt, &pkt.saddr, backend, dsr::overhead(ctx))
    };
    if F::XDP && hop <= 0 {
        return Ok(TO_TC);
    }
    if hop < 0 {
        return too_big(ctx, pkt, hop);
    }
    rewrite(ctx, pkt, Side::Destination, backend, port)?;
    dsr::push(ctx, pkt)?;
    Ok(route::redirect(ctx, hop).code())
}

/// A direct-server-return flow's packet was sent: its state. No reply ever comes back
/// this way, so the client's own next packet (its ACK after the SYN, a UDP flow's
/// second datagram) is what makes the flow established here.
#[inline(never)]
fn dsr_seen<F: Frame>(ctx: &F, pkt: &Packet, ct: &mut CtValue, new: bool, now: u64) {
    ct.last_seen_ns = now;
    ct.flags |= conntrack::segment_flags(pkt, false);
    let entry = conntrack::Entry {
        value: core::ptr::from_mut(ct),
        new,
    };
    conntrack::account(&entry, stats::IN, ctx.len());
    if new && !pkt.is_syn() {
        ct.flags |= CT_F_REPLIED | CT_F_ASSURED;
        conntrack::promote_forward(&pkt.ct_key(CT_DIR_FORWARD), ct);
    }
}

/// Records the flow `new_flow` prepared (both directions) and translates its first
/// packet. (Apart from `new_flow`, so their frames never stack: the BPF stack is 512
/// bytes for the whole call chain.)
#[inline(never)]
fn open_flow<F: Frame>(ctx: &F, pkt: &Packet) -> Result<i32, i32> {
    let Some(entry) = scratch(SCRATCH_FORWARD) else {
        return Err(drop::packet(Reason::Unreachable)); // a valid index
    };
    conntrack::record(pkt, entry)?;
    stats::account(
        entry.rev_nat_id,
        entry.backend_id,
        stats::IN,
        ctx.len(),
        true,
    );
    // (`record` may have masqueraded it after all: a clash on the reply tuple.)
    if entry.flags & CT_F_DSR != 0 {
        return dsr_send(ctx, pkt, &entry.xlate_addr, entry.xlate_port, true);
    }
    let snat = entry.flags & CT_F_SNAT != 0;
    // At XDP `new_flow` found the hop (the FIB's answer waits in `route`'s per-CPU slot);
    // a source port `record` chose changes no route.
    let route = snat || F::XDP;
    let hop = if F::XDP {
        1
    } else if snat {
        route::lookup(ctx, pkt, &entry.nat_addr, &entry.xlate_addr, 0)
    } else {
        0
    };
    if hop < 0 {
        // The flow stays recorded: the sender retries, smaller.
        return too_big(ctx, pkt, hop);
    }
    if snat {
        rewrite(ctx, pkt, Side::Source, &entry.nat_addr, entry.nat_port)?;
    }
    rewrite(
        ctx,
        pkt,
        Side::Destination,
        &entry.xlate_addr,
        entry.xlate_port,
    )?;
    if route {
        return Ok(route::redirect(ctx, hop).code());
    }
    Ok(DONE)
}

/// Whether netfilter was translating this flow before the classifier was attached.
#[inline(never)]
fn netfilter_flow(pkt: &Packet) -> bool {
    NETFILTER_FLOWS
        .get_ptr(&pkt.ct_key(CT_DIR_FORWARD))
        .is_some()
}

#[inline(never)]
fn source_allowed(service_id: u32, pkt: &Packet) -> bool {
    SOURCE_RANGES
        .get(&lpm_key(service_id, pkt.family, pkt.saddr))
        .is_some()
}
