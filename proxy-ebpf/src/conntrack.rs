//! Connection tracking of the per-packet path: a flow's two entries (forward, keyed by
//! the client's tuple; reply, keyed by the backend's), its TCP state and its idle limit,
//! and the claims on reply tuples, masquerade source ports among them.
//!
//! New flows live in `CONNTRACK_NEW` (LRU) until the backend answers; then both entries
//! move to `CONNTRACK` (a hash the agent's collector expires by the same limits). So a
//! flood of new flows — spoofed SYNs at a NodePort — can only evict other unanswered
//! flows, never an established one, as netfilter's early drop only takes unassured
//! entries. The forward entry holds the flow's state for both directions.
//!
//! Layer 3. Owns: the flow entries (`CONNTRACK`, `CONNTRACK_NEW`: lookup, state bits,
//! expiry, promotion, removal), the claims on reply tuples and the masquerade port
//! allocation that retries them, the reply-port marks (`REPLY_PORTS`: set and read),
//! the flows' clock, and `CT_SCRATCH`. May import: layers 0-2 (`maps`,
//! `verdict`, `packet`, `stats`, `drop`, `node`); never `nat`, which may use it.

use aya_ebpf::{
    Global,
    bindings::BPF_NOEXIST,
    btf_maps::PerCpuArray,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
    macros::btf_map,
};
use proxy_common::{
    CT_DIR_REPLY, CT_F_ASSURED, CT_F_DSR_BACKEND, CT_F_FIN_ORIG, CT_F_FIN_REPLY, CT_F_REPLIED,
    CT_F_RST, CT_F_SNAT, CtKey, CtTimeouts, CtValue, PROTO_TCP, SNAT_PORT_MAX, SNAT_PORT_MIN,
    counter, ct_closed, elapsed_ns, flow_last_seen, forward_key_of, port_slot, reply_key_of,
    set_forward_key, set_reply_key,
};

use crate::{
    drop::{self, Reason},
    maps::{CONNTRACK, CONNTRACK_NEW, NODE_CONFIG, REPLY_PORTS, count, port_marked},
    packet::{Packet, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    stats,
};

/// Per-CPU room for a new flow's two conntrack values while they are built (forward at
/// `SCRATCH_FORWARD`, reply at `SCRATCH_REPLY`): the 512-byte BPF stack has none to spare
/// on that path. (Not pinned: each load has its own.)
#[btf_map]
static CT_SCRATCH: PerCpuArray<CtValue, 2> = PerCpuArray::new();
pub const SCRATCH_FORWARD: u32 = 0;
pub const SCRATCH_REPLY: u32 = 1;

/// This CPU's scratch value `idx`, zeroed. Nothing else runs on this CPU until the
/// current packet is done, so the slot is ours meanwhile.
#[inline(always)]
pub fn ct_scratch(idx: u32) -> Option<&'static mut CtValue> {
    let p = CT_SCRATCH.get_ptr_mut(idx)?;
    // SAFETY: a valid per-CPU slot, used by one packet at a time (see above).
    let v = unsafe { &mut *p };
    crate::mem::zero(v);
    Some(v)
}

/// Per-CPU room for the partner keys the lookups build (40 bytes each), one slot per
/// function that builds one, off the deep call chains' stack: 5.10's and 6.1's
/// verifiers round every frame up to 32 bytes and refused the classifier at 544 of 512
/// (tests/stack_budget.rs keeps the count). A key in map memory is a valid key for a
/// lookup. (Not pinned: each load has its own.)
#[btf_map]
static CT_KEY_SCRATCH: PerCpuArray<CtKey, 4> = PerCpuArray::new();
const KEY_PARTNER: u32 = 0;
const KEY_STALE: u32 = 1;
const KEY_PROMOTE_REPLY: u32 = 2;
const KEY_PROMOTE_FORWARD: u32 = 3;

/// This CPU's key slot `idx`, filled in place by `set` (a key built on the stack and
/// copied would cost the frame it saves). As for `ct_scratch`, the slot is the current
/// packet's; each slot belongs to one function, and none of them calls another's owner.
#[inline(always)]
fn key_scratch(idx: u32, set: impl FnOnce(&mut CtKey)) -> Option<&'static CtKey> {
    let p = CT_KEY_SCRATCH.get_ptr_mut(idx)?;
    // SAFETY: a valid per-CPU slot, used by one packet at a time (see above).
    let slot = unsafe { &mut *p };
    set(slot);
    Some(slot)
}

/// This CPU's scratch value `idx` as the current packet left it.
#[inline(always)]
pub fn scratch(idx: u32) -> Option<&'static mut CtValue> {
    let p = CT_SCRATCH.get_ptr_mut(idx)?;
    // SAFETY: as for `ct_scratch`.
    Some(unsafe { &mut *p })
}

/// Whether this kernel has `bpf_ktime_get_coarse_ns` (Linux 5.11): set by the agent at
/// load from its probe. Without it the other branch of `now` is dead code the verifier
/// removes unchecked (5.10 refused the whole program for the unknown helper).
#[unsafe(no_mangle)]
static COARSE_CLOCK: Global<u8> = Global::new(1);

/// The flows' clock: `CLOCK_MONOTONIC` at the kernel tick's resolution (the agent's
/// collector reads the same clock, finer). The limits are seconds long, and the
/// coarse read costs a fraction of `bpf_ktime_get_ns` (no clock source read: a
/// paravirtual TSC in a VM) on every packet; before 5.11, the fine read.
#[inline(always)]
pub fn now() -> u64 {
    if COARSE_CLOCK.load() != 0 {
        // SAFETY: no preconditions.
        unsafe { bpf_ktime_get_coarse_ns() }
    } else {
        // SAFETY: no preconditions.
        unsafe { bpf_ktime_get_ns() }
    }
}

/// An entry found in one of the two tables.
pub struct Entry {
    pub value: *mut CtValue,
    /// In `CONNTRACK_NEW`: the flow has not been answered yet.
    pub new: bool,
}

/// Looks `key` up among answered flows, then among new ones.
#[inline(always)]
pub fn lookup(key: &CtKey) -> Option<Entry> {
    if let Some(value) = CONNTRACK.get_ptr_mut(key) {
        return Some(Entry { value, new: false });
    }
    CONNTRACK_NEW
        .get_ptr_mut(key)
        .map(|value| Entry { value, new: true })
}

#[inline(always)]
fn lookup_in(key: &CtKey, new: bool) -> Option<*mut CtValue> {
    if new {
        CONNTRACK_NEW.get_ptr_mut(key)
    } else {
        CONNTRACK.get_ptr_mut(key)
    }
}

/// Removes entry `key`; an answered flow's counts go to its pair first. (Already gone —
/// another CPU, the collector — is fine.)
#[inline(always)]
fn remove_in(key: &CtKey, new: bool) {
    if new {
        let _ = CONNTRACK_NEW.remove(key);
        return;
    }
    if let Some(v) = CONNTRACK.get_ptr(key) {
        stats::fold(v, key.dir);
    }
    let _ = CONNTRACK.remove(key);
}

/// Counts a packet of `len` bytes going `dir` (`stats::IN`, `OUT`) on the flow whose
/// entry of that direction is `entry`: in the entry once the flow is answered, in its
/// pair's `LB_STATS` entry before (an LRU eviction would lose counts held in the entry).
#[inline(always)]
pub fn account(entry: &Entry, dir: u8, len: u32) {
    if entry.new {
        // SAFETY: map memory, valid for this program run.
        let (rev_nat_id, backend_id) =
            unsafe { ((*entry.value).rev_nat_id, (*entry.value).backend_id) };
        stats::account(rev_nat_id, backend_id, dir, len, false);
    } else {
        stats::answered(entry.value, len);
    }
}

/// Whether a flow in state `flags` last seen at `last_seen_ns` has idled past its limit.
#[inline(always)]
fn idle_past(proto: u8, flags: u8, last_seen_ns: u64, now: u64) -> bool {
    let t = NODE_CONFIG
        .get(0)
        .map(|c| c.timeouts)
        .unwrap_or(CtTimeouts::DEFAULT);
    t.expired(proto, flags, last_seen_ns, now)
}

/// Whether the flow has idled past the limit of its state, by its forward entry `fwd`
/// and, for an answered flow, its reply entry `reply` (replies that go alone stamp only
/// theirs: `reply_alone`).
#[inline(always)]
pub fn expired(fwd: &CtValue, reply: Option<&CtValue>, proto: u8, now: u64) -> bool {
    idle_past(proto, fwd.flags, flow_last_seen(fwd, reply), now)
}

/// `expired`, from the forward side (entry `fwd` at `key`): the reply entry is looked up
/// only when the forward entry's own stamp has run out — and then lends it its later one.
#[inline(always)]
pub fn forward_expired(key: &CtKey, fwd: *mut CtValue, new: bool, now: u64) -> bool {
    // SAFETY: map memory, valid for this program run.
    let (flags, last) = unsafe { ((*fwd).flags, (*fwd).last_seen_ns) };
    // (Replies of an unanswered flow stamp the forward entry.)
    idle_past(key.proto, flags, last, now) && (new || expired_by_reply(key, fwd, now))
}

/// `forward_expired`'s rare part, in a frame of its own (the reply's key).
#[inline(never)]
fn expired_by_reply(key: &CtKey, fwd: *mut CtValue, now: u64) -> bool {
    // SAFETY: map memory, valid for this program run; a racy stamp is harmless.
    let f = unsafe { &mut *fwd };
    let Some(reply) = CONNTRACK.get_ptr(&reply_key_of(key, f)) else {
        return true;
    };
    // SAFETY: as above.
    let last = unsafe { (*reply).last_seen_ns };
    if idle_past(key.proto, f.flags, last, now) {
        return true;
    }
    f.last_seen_ns = last;
    false
}

/// The state bits a flow's reply entry carries besides `CT_F_SNAT`: a closing flow's
/// replies take its forward entry's state and limit.
const CLOSING: u8 = CT_F_FIN_ORIG | CT_F_FIN_REPLY | CT_F_RST;

/// A forward packet's state bits (FIN, RST) on its flow's forward entry `fwd` (at
/// `key`), and on the reply entry too, so the replies stop going alone.
///
/// A client's RST before its handshake completed does not close the flow: it is what
/// a client in SYN_SENT sends when its SYN on a reclaimed port (`reclaim`) met the
/// backend's half-open socket of the flow that held the port (the backend answers with
/// that flow's ACK). The RST clears that socket; the client's SYN retransmission must
/// then find the same flow and port, not a new port and another such socket. The flow
/// stays half-open: it ages out, or is reclaimed, as one.
#[inline(always)]
pub fn forward_segment(key: &CtKey, pkt: &Packet, fwd: &mut CtValue, new: bool) {
    let mut bits = segment_flags(pkt, false);
    if fwd.flags & CT_F_ASSURED == 0 {
        bits &= !CT_F_RST;
    }
    if bits != 0 {
        fwd.flags |= bits;
        closing_to_reply(key, fwd, new, bits);
    }
}

/// `forward_segment`'s part for the reply entry, in a frame of its own (the reply's
/// key): looked up only for packets with such bits.
#[inline(never)]
fn closing_to_reply(key: &CtKey, fwd: *const CtValue, new: bool, bits: u8) {
    // SAFETY: map memory, valid for this program run.
    let reply_key = reply_key_of(key, unsafe { &*fwd });
    if let Some(r) = lookup_in(&reply_key, new) {
        // SAFETY: as above; a racy store of a state bit is harmless.
        unsafe { (*r).flags |= bits };
    }
}

/// Whether a reply may go alone — translated from its reply entry `reply` (in the table
/// of answered flows), stamping only that entry, its forward entry not looked up: it
/// changes no state (no SYN, FIN or RST) and its flow is live by the reply entry's own
/// stamp, at an established flow's limit; its flow is not closing (no FIN or RST seen:
/// `closing_to_reply`). Anything else takes the forward entry's state and limit.
#[inline(always)]
pub fn reply_alone(pkt: &Packet, reply: &CtValue, now: u64) -> bool {
    let changes_state =
        pkt.proto == PROTO_TCP && pkt.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0;
    !changes_state
        && reply.flags & CLOSING == 0
        && !idle_past(
            pkt.proto,
            CT_F_REPLIED | CT_F_ASSURED,
            reply.last_seen_ns,
            now,
        )
}

/// The state bits a TCP segment adds to its flow (FIN by direction, RST).
#[inline(always)]
pub fn segment_flags(pkt: &Packet, reply: bool) -> u8 {
    if pkt.proto != PROTO_TCP {
        return 0;
    }
    let mut out = 0;
    if pkt.tcp_flags & TCP_RST != 0 {
        out |= CT_F_RST;
    }
    if pkt.tcp_flags & TCP_FIN != 0 {
        out |= if reply { CT_F_FIN_REPLY } else { CT_F_FIN_ORIG };
    }
    out
}

/// Whether a forward-direction packet ends its flow's claim on the tuple: the flow
/// expired, a SYN reopens a closed TCP connection (netfilter reopens from TIME_WAIT and
/// CLOSE) or one learnt from direct server return's option (a new connection: the
/// node's own, or the entry node's again, outranks what was learnt), or a UDP flow's
/// backend is gone.
#[inline(always)]
pub fn over(
    key: &CtKey,
    pkt: &Packet,
    fwd: *mut CtValue,
    new: bool,
    now: u64,
    backend_gone: bool,
) -> bool {
    // SAFETY: map memory, valid for this program run.
    let flags = unsafe { (*fwd).flags };
    forward_expired(key, fwd, new, now)
        || (pkt.is_syn() && (ct_closed(flags) || flags & CT_F_DSR_BACKEND != 0))
        || backend_gone
}

/// Removes a flow: its forward entry `key` and the reply entry it names.
#[inline(never)]
pub fn forget(key: &CtKey, fwd: *const CtValue, new: bool) {
    // SAFETY: map memory, valid for this program run.
    let reply = reply_key_of(key, unsafe { &*fwd });
    remove_in(&reply, new);
    remove_in(key, new);
}

/// A reply entry's forward partner, if it still belongs to this reply (a stale reply
/// entry whose tuple was re-used points at another flow's backend); null if none. (A raw
/// pointer, not an `Option`: a BPF function returns one register.)
#[inline(never)]
pub fn partner(reply_key: &CtKey, reply: *const CtValue, new: bool) -> *mut CtValue {
    // SAFETY: map memory, valid for this program run.
    let Some(fwd_key) = key_scratch(KEY_PARTNER, |k| {
        set_forward_key(k, reply_key, unsafe { &*reply })
    }) else {
        return core::ptr::null_mut();
    };
    let Some(fwd) = lookup_in(fwd_key, new) else {
        return core::ptr::null_mut();
    };
    // SAFETY: as above.
    let f = unsafe { &*fwd };
    if f.xlate_addr == reply_key.saddr && f.xlate_port == reply_key.sport {
        fwd
    } else {
        core::ptr::null_mut()
    }
}

/// A TCP segment from the client that acknowledges the backend's SYN-ACK: for a flow
/// still in the table of new flows, the three-way handshake is complete — now, or
/// earlier when the answered table was full (`promote` is tried again).
#[inline(always)]
pub fn completes_handshake(pkt: &Packet, flags: u8) -> bool {
    pkt.proto == PROTO_TCP && pkt.tcp_flags & TCP_ACK != 0 && flags & CT_F_REPLIED != 0
}

/// `promote`, from the forward side: the flow whose forward entry is `fwd` (at `key`).
#[inline(never)]
pub fn promote_forward(key: &CtKey, fwd: *const CtValue) {
    // SAFETY: map memory, valid for this program run.
    if let Some(reply_key) = key_scratch(KEY_PROMOTE_REPLY, |k| {
        set_reply_key(k, key, unsafe { &*fwd })
    }) {
        promote(reply_key);
    }
}

/// The flow is assured: both entries move to the table of answered flows.
/// With that table full the flow stays where it is (still translated, but evictable),
/// assured: a TCP flow's next acknowledging segment tries again (`completes_handshake`;
/// the agent's collector keeps room: `conntrack_gc::make_room`).
#[inline(never)]
pub fn promote(reply_key: &CtKey) {
    let Some(reply) = CONNTRACK_NEW.get_ptr_mut(reply_key) else {
        return;
    };
    // SAFETY: map memory, valid for this program run.
    let Some(fwd_key) = key_scratch(KEY_PROMOTE_FORWARD, |k| {
        set_forward_key(k, reply_key, unsafe { &*reply })
    }) else {
        return;
    };
    let Some(fwd) = CONNTRACK_NEW.get_ptr_mut(fwd_key) else {
        return;
    };
    // SAFETY: as above; the helper copies the values.
    if CONNTRACK.insert(reply_key, unsafe { &*reply }, 0).is_err() {
        count(counter::CT_FULL);
        return;
    }
    // SAFETY: as above.
    if CONNTRACK.insert(fwd_key, unsafe { &*fwd }, 0).is_err() {
        let _ = CONNTRACK.remove(reply_key);
        count(counter::CT_FULL);
        return;
    }
    let _ = CONNTRACK_NEW.remove(fwd_key);
    let _ = CONNTRACK_NEW.remove(reply_key);
}

/// Whether the flow holding reply tuple `key` (entry `reply`) no longer needs it: its
/// forward entry is gone or names another reply tuple, or the flow expired, or it closed
/// more than a second ago.
/// (Inlined into `claim`, its one caller; its partner key is in `CT_KEY_SCRATCH`.)
#[inline(always)]
fn stale(key: &CtKey, reply: *const CtValue, new: bool, now: u64) -> bool {
    // SAFETY: map memory, valid for this program run.
    let r = unsafe { &*reply };
    let Some(fwd_key) = key_scratch(KEY_STALE, |k| set_forward_key(k, key, r)) else {
        return true;
    };
    let Some(fwd) = lookup_in(fwd_key, new) else {
        return true;
    };
    // SAFETY: as above.
    let f = unsafe { &*fwd };
    if f.xlate_addr != key.saddr || f.xlate_port != key.sport {
        return true;
    }
    // A closed flow keeps its tuple for a moment: its last ACK (or a retransmitted FIN)
    // must still find it, or the backend's socket lingers in LAST_ACK and answers the
    // next flow's SYN on the same tuple with a challenge ACK. (The reply entry's stamp
    // counts too: replies may go alone.)
    let last = flow_last_seen(f, Some(r));
    let closed_long_enough = ct_closed(f.flags) && elapsed_ns(now, last) > CLOSED_TUPLE_HOLD_NS;
    if idle_past(key.proto, f.flags, last, now) || closed_long_enough {
        remove_in(fwd_key, new);
        return true;
    }
    false
}

/// How long a closed flow (TIME_WAIT, CLOSE) keeps its reply tuple from new flows after
/// its last packet.
const CLOSED_TUPLE_HOLD_NS: u64 = 1_000_000_000;

/// How long a TCP flow that was never assured (no client ACK of a SYN-ACK: a half-open
/// flow, SYN_SENT or SYN_RECV) keeps its masquerade port when the range runs short,
/// from its first packet: time for a backend's SYN-ACK and the client's ACK, and a
/// client whose first SYN found no port gets one with its retransmission (Linux: 1 s
/// later). See docs/decisions/0001-masquerade-port-reclaim.md.
const UNASSURED_HOLD_NS: u64 = 1_000_000_000;

/// Whether a packet from source port `sport` may be a reply: some flow's reply tuple
/// has (or had) that source port. When not, the reply probe (a lookup in each table,
/// both missing) is skipped: a client's ephemeral port is rarely a backend's port.
#[inline(always)]
pub fn may_be_reply(sport: u16) -> bool {
    port_marked(&REPLY_PORTS, sport)
}

/// Marks `sport` as a reply tuple's source port, before the entry is written (so a
/// reply on another CPU that finds the entry finds the mark too). A byte store, no
/// read-modify-write: marks by other CPUs in the same word are never lost.
#[inline(always)]
fn mark_reply_port(sport: u16) {
    let (idx, byte) = port_slot(sport);
    if let Some(ports) = REPLY_PORTS.get_ptr_mut(idx) {
        // SAFETY: map memory, valid for this program run; a byte store is atomic.
        unsafe {
            if (*ports)[byte] == 0 {
                core::ptr::write_volatile(&mut (*ports)[byte], 1);
            }
        }
    }
}

/// Claims reply tuple `key` for a new flow by writing its reply entry `value` into the
/// table of new flows, unless a live flow holds the tuple. A closed or expired flow
/// holding it gives it up (its entries go). (A frame of its own, `stale` inside it: the
/// three callers' frames stay small.)
#[inline(never)]
pub fn claim(key: &CtKey, value: &CtValue) -> bool {
    let now = now();
    mark_reply_port(key.sport);
    if let Some(old) = CONNTRACK.get_ptr_mut(key) {
        if !stale(key, old, false, now) {
            return false;
        }
        remove_in(key, false);
        count(counter::CT_REUSED);
    }
    if CONNTRACK_NEW
        .insert(key, value, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        return true;
    }
    let Some(old) = CONNTRACK_NEW.get_ptr_mut(key) else {
        return false;
    };
    if !stale(key, old, true, now) {
        return false;
    }
    let _ = CONNTRACK_NEW.remove(key);
    count(counter::CT_REUSED);
    CONNTRACK_NEW
        .insert(key, value, u64::from(BPF_NOEXIST))
        .is_ok()
}

/// Random ports tried before a flow is refused for want of one (netfilter tries up to
/// 128 on a crowded range). Closed flows hold theirs for a second, so at thousands of
/// new flows a second to one backend a good part of the range is briefly taken.
const PORT_TRIES: u32 = 32;

/// Of `PORT_TRIES`, the first ones take only free ports (no live flow's); the rest may
/// also take a half-open flow's (`reclaim`). Sixteen taken ports in a row mean the range
/// is short (at 80 % of it taken, one new flow in 35 gets there; at 95 %, 44 %): only
/// then does a half-open flow lose its port, as netfilter's early drop takes unassured
/// entries only when its table is full.
const FREE_TRIES: u32 = 16;

/// Finds a free source port for a flow whose reply tuple is `reply_key` (destination
/// port to be chosen) and claims it with the flow's reply entry. A port is free when no
/// live flow's replies use the same tuple: closed and expired flows give theirs back;
/// when the range runs short, half-open flows do too (`FREE_TRIES`, `reclaim`).
/// Returns the port in network byte order.
#[inline(never)]
fn allocate_port(reply_key: &mut CtKey, reply: &CtValue) -> Option<u16> {
    let (mut min, mut max) = (SNAT_PORT_MIN, SNAT_PORT_MAX);
    if let Some(cfg) = NODE_CONFIG.get(0)
        && cfg.snat_port_min != 0
        && cfg.snat_port_max >= cfg.snat_port_min
    {
        (min, max) = (cfg.snat_port_min, cfg.snat_port_max);
    }
    let range = u32::from(max - min) + 1;
    for i in 0..PORT_TRIES {
        // SAFETY: no preconditions.
        let port = (u32::from(min) + unsafe { bpf_get_prandom_u32() } % range) as u16;
        reply_key.dport = port.to_be();
        if claim(reply_key, reply) || (i >= FREE_TRIES && reclaim(reply_key, reply)) {
            return Some(port.to_be());
        }
    }
    None
}

/// Takes reply tuple `key` (a masquerade port) for a new flow (reply entry `value`) from
/// the flow holding it, if that is a half-open TCP flow: in the table of new flows,
/// never assured (the client never acknowledged a SYN-ACK, if one came), its first
/// packet over `UNASSURED_HOLD_NS` ago — what a SYN flood leaves. Its two entries go.
/// An assured flow never loses its port; nor does a UDP or SCTP flow (a late answer
/// would reach the new flow's client, with no sequence number to refuse it by).
/// (A leaf frame of its own: the classifier's call chain has no stack to spare.)
#[inline(never)]
fn reclaim(key: &CtKey, value: &CtValue) -> bool {
    if key.proto != PROTO_TCP || CONNTRACK.get_ptr(key).is_some() {
        return false;
    }
    let Some(old) = CONNTRACK_NEW.get_ptr(key) else {
        return false;
    };
    // SAFETY: map memory, valid for this program run.
    let r = unsafe { &*old };
    // An unanswered flow's reply entry is stamped at its first packet only: the flow's
    // age, whatever SYN-ACKs the backend retransmits.
    if elapsed_ns(now(), r.last_seen_ns) <= UNASSURED_HOLD_NS {
        return false;
    }
    let fwd_key = forward_key_of(key, r);
    let Some(fwd) = CONNTRACK_NEW.get_ptr(&fwd_key) else {
        return false; // `claim` frees an orphan itself
    };
    // SAFETY: as above.
    let f = unsafe { &*fwd };
    if f.flags & CT_F_ASSURED != 0 || f.xlate_addr != key.saddr || f.xlate_port != key.sport {
        return false;
    }
    let _ = CONNTRACK_NEW.remove(&fwd_key);
    let _ = CONNTRACK_NEW.remove(key);
    count(counter::SNAT_PORT_RECLAIMED);
    CONNTRACK_NEW
        .insert(key, value, u64::from(BPF_NOEXIST))
        .is_ok()
}

/// Writes a new flow's two entries into the table of new flows. `fwd` arrives with the
/// backend (`xlate_*`, `backend_id`), the reverse-NAT id and — to masquerade — the node
/// address in `nat_addr`; it leaves with `CT_F_SNAT` and `nat_port` when the flow got a
/// source port: always when masqueraded, and when the client's own reply tuple is held
/// by another live flow (one client port reaching two frontends that share a backend),
/// as netfilter's implicit source NAT resolves such clashes.
/// (Few, scalar-or-pointer arguments: the verifier takes no stack-passed ones.)
#[inline(never)]
pub fn record(pkt: &Packet, fwd: &mut CtValue) -> Result<(), i32> {
    let now = now();
    fwd.last_seen_ns = now;
    let Some(reply) = ct_scratch(SCRATCH_REPLY) else {
        return Err(drop::packet(Reason::Unreachable)); // a valid index
    };
    reply.last_seen_ns = now;
    reply.backend_id = fwd.backend_id;
    reply.rev_nat_id = fwd.rev_nat_id;
    reply.xlate_addr = pkt.daddr;
    reply.xlate_port = pkt.dport;
    let mut reply_key = CtKey {
        saddr: fwd.xlate_addr,
        daddr: pkt.saddr,
        sport: fwd.xlate_port,
        dport: pkt.sport,
        proto: pkt.proto,
        family: pkt.family,
        dir: CT_DIR_REPLY,
        _pad: 0,
    };
    let kept_source = fwd.nat_addr == [0; 4];
    if kept_source && claim(&reply_key, reply) {
        insert_forward(pkt, fwd);
        return Ok(());
    }
    if kept_source {
        fwd.nat_addr = pkt.saddr; // a new port, the same address
    }
    reply.flags = CT_F_SNAT;
    reply.nat_addr = pkt.saddr;
    reply.nat_port = pkt.sport;
    reply_key.daddr = fwd.nat_addr;
    let Some(port) = allocate_port(&mut reply_key, reply) else {
        return Err(drop::packet(Reason::SnatPortsExhausted));
    };
    fwd.flags = CT_F_SNAT;
    fwd.nat_port = port;
    count(counter::SNAT);
    insert_forward(pkt, fwd);
    Ok(())
}

#[inline(never)]
pub fn insert_forward(pkt: &Packet, fwd: &CtValue) {
    // A forward entry without its reply entry would leave replies untranslated; the
    // packet is translated either way.
    if CONNTRACK_NEW
        .insert(&pkt.ct_key(proxy_common::CT_DIR_FORWARD), fwd, 0)
        .is_err()
    {
        count(counter::CT_CREATE_FAILED);
    }
}
