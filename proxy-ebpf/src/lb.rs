//! Service lookup and backend selection, shared by the connect-time and per-packet paths
//! so both choose from the same maps with the same rules.
//!
//! Layer 3. Owns: service lookup (and the frontend-port filter before it), the
//! schedulers, backend selection, session affinity, the active-connection counts, and
//! `LC_SCRATCH`. May import: layers 0-2 (`maps`, `verdict`, `packet`, `stats`, `drop`,
//! `node`).

use aya_ebpf::{
    btf_maps::PerCpuArray,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::btf_map,
};
use core::{
    intrinsics::{AtomicOrdering, atomic_xadd},
    num::NonZeroU32,
};

use proxy_common::{
    AffinityKey, AffinityValue, BACKEND_ACTIVE, Backend, BackendSlotKey, MAGLEV_CHUNK, MemberKey,
    SCOPE_EXTERNAL, SCOPE_INTERNAL, SVC_F_AFFINITY, SVC_F_DROP_NO_BACKENDS, SVC_F_TWO_SCOPES,
    SVC_F_WEIGHTED, ServiceKey, ServiceValue, counter, sched, sched_hash,
};

use crate::{
    drop::{self, Reason},
    maps::{
        ACTIVE_CONNS, AFFINITY, BACKEND_SLOTS, BACKENDS, FRONTEND_PORTS, MAGLEV, MEMBERS,
        RR_CURSORS, SERVICES, WEIGHTS, count, port_marked,
    },
};

/// Why no backend was chosen for a packet or connection addressed to a service.
pub enum NoBackend {
    /// kube-proxy's REJECT: refuse at once.
    Reject,
    /// Drop silently: the drop's verdict, its reason counted (`no_backend_drop`, for a
    /// connection too). (Counted here, in `select_backend`'s frame: the per-packet
    /// caller's has no stack to spare.)
    Drop(i32),
}

/// Per-CPU room for the affinity key of the per-packet path (`affinity_key_in_scratch`):
/// its chain through `select_backend` has no stack to spare on the verifiers that round
/// every frame up to 32 bytes (tests/stack_budget.rs). TC and XDP run one packet at a
/// time per CPU; the connect-time hooks, which an interrupt's packet may interrupt, keep
/// theirs on the stack. (Not pinned: each load has its own.)
#[btf_map]
static AFFINITY_KEY_SCRATCH: PerCpuArray<AffinityKey, 1> = PerCpuArray::new();

/// The affinity key of `client` for `svc`, as the connect-time hooks keep it.
#[inline(always)]
pub fn affinity_key(svc: &ServiceValue, client: &Client<'_>) -> AffinityKey {
    let mut key = AffinityKey::default();
    set_affinity_key(&mut key, svc, client);
    key
}

/// The same in this CPU's scratch slot, filled in place: for TC and XDP only (above).
#[inline(always)]
pub fn affinity_key_in_scratch(
    svc: &ServiceValue,
    client: &Client<'_>,
) -> Option<&'static AffinityKey> {
    let p = AFFINITY_KEY_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: a valid per-CPU slot, the current packet's (see above).
    let key = unsafe { &mut *p };
    set_affinity_key(key, svc, client);
    Some(key)
}

#[inline(always)]
fn set_affinity_key(key: &mut AffinityKey, svc: &ServiceValue, client: &Client<'_>) {
    key.client = *client.id;
    key.service_id = svc.id;
    key.family = client.family;
    key.kind = client.kind;
    key._pad = [0; 2];
}

/// Who is asking, for session affinity and the hashing schedulers.
pub struct Client<'a> {
    /// A reference, not a copy: the per-packet caller's frame has no room for one.
    pub id: &'a [u32; 4],
    pub kind: u8,
    pub family: u8,
    /// The client's port, network byte order (0 at connect time: not chosen yet).
    pub port: u16,
}

/// Whether some frontend has (or had) port `dport` (network byte order): when not, a
/// packet to it is for no service, and no flow of ours (a flow's packets go to its
/// frontend's port, marked before the frontend existed and never cleared).
#[inline(always)]
pub fn may_be_frontend(dport: u16) -> bool {
    port_marked(&FRONTEND_PORTS, dport)
}

/// Finds the service entry for a frontend. Internal traffic (from pods or the node itself)
/// uses the internal scope when the service has one (its backends differ from the
/// external view, e.g. `externalTrafficPolicy: Local`). A reference into the map, not a
/// copy: the deep call chains have no stack to spare, and an entry the agent replaces is
/// a new element (the maps are not preallocated), so this one stays as read.
#[inline(always)]
pub fn lookup_service(
    addr: [u32; 4],
    port: u16,
    proto: u8,
    family: u8,
    internal: bool,
) -> Option<&'static ServiceValue> {
    let mut key = ServiceKey {
        addr,
        port,
        proto,
        family,
        scope: SCOPE_EXTERNAL,
        _pad: [0; 3],
    };
    // SAFETY: map memory, valid for this program run (see above).
    let svc = unsafe { SERVICES.get(&key)? };
    if !internal || svc.flags & SVC_F_TWO_SCOPES == 0 {
        return Some(svc);
    }
    key.scope = SCOPE_INTERNAL;
    // SAFETY: as above.
    unsafe { SERVICES.get(&key) }.or(Some(svc))
}

/// Picks a backend for a new connection to `svc`: the client's affinity entry while it is
/// fresh, otherwise the one in `slot`, which the caller had `schedule` pick (`sched::*`;
/// by default a uniformly random slot, iptables' `statistic mode random` semantics).
/// (Apart, so the scheduler's frame never stacks on this one: the BPF stack is 512 bytes
/// for the whole call chain.)
/// Not inlined: its keys get their own stack frame.
#[inline(never)]
pub fn select_backend(
    svc: &ServiceValue,
    aff_key: &AffinityKey,
    slot: u32,
) -> Result<(u32, Backend), NoBackend> {
    if svc.count == 0 {
        return Err(no_backend(svc));
    }
    let affinity = svc.flags & SVC_F_AFFINITY != 0;
    // The clock only for affinity's timestamps (a clock read is not free in a VM).
    let now = if affinity {
        // SAFETY: bpf_ktime_get_ns has no preconditions.
        unsafe { bpf_ktime_get_ns() }
    } else {
        0
    };
    if affinity {
        // The two fields read once each, into registers (the whole value copied took
        // stack the per-packet chain has not): another CPU may rewrite the entry in place
        // (an LRU map's), and every check below must be of the id that is used.
        // SAFETY: map memory, valid for this program run.
        if let Some((backend_id, last_used_ns)) =
            unsafe { AFFINITY.get(aff_key) }.map(|aff| unsafe {
                (
                    core::ptr::read_volatile(&aff.backend_id),
                    core::ptr::read_volatile(&aff.last_used_ns),
                )
            })
        {
            let timeout_ns = u64::from(svc.affinity_timeout_s) * 1_000_000_000;
            // Only while the backend is still in this service's set, and already was when
            // the entry was last used (ids freed and reused later start a new membership).
            if proxy_common::elapsed_ns(now, last_used_ns) <= timeout_ns
                && member_since(svc.id, backend_id, last_used_ns)
            {
                if let Some(be) = active_backend(backend_id) {
                    count(counter::AFFINITY_HIT);
                    remember(aff_key, backend_id, now);
                    return Ok((backend_id, be));
                }
            }
        }
    }
    let (id, be) = match backend_in_slot(svc, slot) {
        Some(found) => found,
        None => {
            // The agent flipped the service to a new backend set between our two lookups
            // and already removed the old slots: read the entry again, once.
            let Some(fresh) = lookup_fresh(svc) else {
                count(counter::BACKEND_MISSING);
                return Err(NoBackend::Reject);
            };
            if fresh.count == 0 {
                return Err(no_backend(&fresh));
            }
            let slot = slot % u32::from(fresh.count);
            backend_in_slot(&fresh, slot).ok_or_else(|| {
                count(counter::BACKEND_MISSING);
                NoBackend::Reject
            })?
        }
    };
    if affinity {
        remember(aff_key, id, now);
    }
    Ok((id, be))
}

/// The slot `svc`'s scheduler picks for a new flow from `client` (`< svc.count`; 0 when
/// the service has no slots).
#[inline(never)]
pub fn schedule(svc: &ServiceValue, client: &Client<'_>) -> u32 {
    let count = nonzero(u32::from(svc.count));
    match svc.scheduler {
        sched::RR | sched::WRR => round_robin(svc.id) % count,
        sched::SH => maglev(svc, sched_hash(client.id, 0)),
        sched::MH => maglev(svc, sched_hash(client.id, client.port)),
        s if is_least_conn(s) => {
            let weighted = if svc.flags & SVC_F_WEIGHTED != 0 {
                LC_WEIGHTED
            } else {
                0
            };
            proxy_least_loaded(
                svc.id,
                svc.rev,
                u32::from(svc.count),
                u32::from(s) | weighted,
            )
        }
        // RANDOM, and DH: the agent wrote the one slot the frontend's address hashes to.
        _ => random() % count,
    }
}

/// `n`, or 1 for 0 (never 0 where it is called): a `%` by a `NonZeroU32` has no
/// division-by-zero panic path, which the verifier refuses (a subprogram must end in an
/// exit) and which LLVM keeps even after a check it lost track of.
#[inline(always)]
fn nonzero(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

#[inline(always)]
fn random() -> u32 {
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    unsafe { bpf_get_prandom_u32() }
}

/// The slot that entry `hash % table_len` of `svc`'s Maglev table names (a table the
/// agent has not written yet: the slot `hash % count` names).
#[inline(always)]
fn maglev(svc: &ServiceValue, hash: u32) -> u32 {
    let entry = hash % nonzero(u32::from(svc.table_len));
    let key = BackendSlotKey {
        service_id: svc.id,
        rev: svc.rev,
        slot: entry / MAGLEV_CHUNK,
    };
    // SAFETY: the value is read at once.
    match unsafe { MAGLEV.get(&key) } {
        Some(chunk) => chunk
            .slots
            .get((entry % MAGLEV_CHUNK) as usize)
            .map_or(0, |s| u32::from(*s)),
        None => hash % nonzero(u32::from(svc.count)),
    }
}

#[inline(always)]
pub fn is_least_conn(scheduler: u8) -> bool {
    (sched::LC..=sched::NQ).contains(&scheduler)
}

/// This CPU's next turn through service entry `id`'s slots (a new cursor starts at a
/// random slot, so CPUs do not all start with the first backend).
#[inline(never)]
fn round_robin(id: u32) -> u32 {
    if let Some(cursor) = RR_CURSORS.get_ptr_mut(&id) {
        // SAFETY: this CPU's own value; nothing else runs on this CPU meanwhile.
        unsafe {
            *cursor = (*cursor).wrapping_add(1);
            return *cursor;
        }
    }
    let start = random();
    // LRU: inserting never fails for want of room.
    let _ = RR_CURSORS.insert(&id, &start, 0);
    start
}

/// The least-connection scan's state (`lb::proxy_least_loaded`), per CPU.
#[repr(C)]
struct LcScan {
    slot_key: BackendSlotKey,
    member_key: MemberKey,
    mode: u32,
    /// Slots left to look at.
    count: u32,
    best_slot: u32,
    best_active: u64,
    best_weight: u64,
}

/// Its room, per CPU (not pinned: each load has its own).
#[btf_map]
static LC_SCRATCH: PerCpuArray<LcScan, 1> = PerCpuArray::new();

/// The least-connection schedulers: of up to `sched::LC_SCAN` slots from a random start
/// (every slot when there are no more), the one whose backend has the lowest cost. The
/// random start breaks ties evenly.
///
/// A global BPF function (exported, scalar arguments): the verifier checks it once, on
/// its own, instead of once per path that reaches it — its loop walked inline on every
/// path of the classifier took it past the verifier's million-instruction budget.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn proxy_least_loaded(id: u32, rev: u32, count: u32, mode: u32) -> u32 {
    // The scan's state and lookup keys live in a per-CPU scratch value, not on the
    // stack: this frame adds to the classifier's call chain, whose stacks share 512
    // bytes.
    let Some(st) = LC_SCRATCH.get_ptr_mut(0) else {
        return 0; // unreachable: index 0 of a one-entry array
    };
    // SAFETY: this CPU's scratch, used by one program run at a time.
    let st = unsafe { &mut *st };
    let count = nonzero(count.min(u32::from(u16::MAX)));
    st.mode = mode;
    st.count = count.get();
    st.slot_key = BackendSlotKey {
        service_id: id,
        rev,
        slot: random() % count,
    };
    st.best_slot = st.slot_key.slot;
    st.best_active = u64::MAX;
    st.best_weight = 1;
    for _ in 0..sched::LC_SCAN {
        if st.count == 0 {
            break;
        }
        st.count -= 1;
        if let Some(backend) = backend_id_in(&st.slot_key) {
            st.member_key = MemberKey {
                service_id: id,
                backend_id: backend,
            };
            if consider(st) {
                return st.slot_key.slot; // never queue: an idle backend wins outright
            }
        }
        st.slot_key.slot += 1;
        if st.slot_key.slot >= count.get() {
            st.slot_key.slot = 0;
        }
    }
    st.best_slot
}

/// Weighs the backend `st.member_key` names (in slot `st.slot_key.slot`) against the
/// best so far; true when it is idle and the scheduler is never-queue.
#[inline(always)]
fn consider(st: &mut LcScan) -> bool {
    let scheduler = (st.mode & 0xff) as u8;
    // Capped so the cross products fit 64 bits: BPF has no 128-bit multiply.
    // SAFETY: the values are copied out at once.
    let active = unsafe { ACTIVE_CONNS.get(&st.member_key.backend_id).copied() }
        .unwrap_or(0)
        .min(u64::from(u32::MAX));
    let weight = if st.mode & LC_WEIGHTED != 0 {
        // SAFETY: as above.
        u64::from(
            unsafe { WEIGHTS.get(&st.member_key).copied() }
                .unwrap_or(1)
                .min(0xffff),
        )
    } else {
        1
    };
    // Weight 0 is quiesced: IPVS sends it no new connections.
    if weight == 0 {
        return false;
    }
    if scheduler == sched::NQ && active == 0 {
        return true;
    }
    // Shortest expected delay (and never queue's fallback) counts the new connection
    // too; plain least connection ignores weights.
    let active = if scheduler >= sched::SED {
        active + 1
    } else {
        active
    };
    let weight = if scheduler == sched::LC { 1 } else { weight };
    // Cost is active/weight, compared by cross-multiplying.
    if st.best_active == u64::MAX || active * st.best_weight < st.best_active * weight {
        st.best_slot = st.slot_key.slot;
        st.best_active = active;
        st.best_weight = weight;
    }
    false
}

/// `proxy_least_loaded`'s `mode` bit: the service has unequal weights (`WEIGHTS`).
const LC_WEIGHTED: u32 = 1 << 8;

/// The backend id in a slot.
#[inline(always)]
fn backend_id_in(key: &BackendSlotKey) -> Option<u32> {
    // SAFETY: the value is copied out at once.
    unsafe { BACKEND_SLOTS.get(key) }.map(|s| s.backend_id)
}

/// A new connection to backend `id` of `svc`: one more open on it, for the
/// least-connection schedulers' load. (Called by the callers of `select_backend`, not by
/// it: its frame would stack on that one's.)
#[inline(never)]
pub fn opened(svc: &ServiceValue, id: u32) {
    if !is_least_conn(svc.scheduler) {
        return;
    }
    match ACTIVE_CONNS.get_ptr_mut(&id) {
        // SAFETY: a live map value; other CPUs add at the same time, hence the atomic.
        Some(p) => unsafe {
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, 1);
        },
        None => {
            // The first connection: another CPU racing here only loses a count, which
            // the collector's recount restores.
            let _ = ACTIVE_CONNS.insert(&id, &1, 0);
        }
    }
}

/// Looks a backend up by id; `None` when it was removed.
#[inline(always)]
pub fn backend(id: u32) -> Option<Backend> {
    // SAFETY: the value is copied out at once.
    unsafe { BACKENDS.get(&id).copied() }
}

/// Whether `backend_id` is in service entry `service_id`'s current backend set, and has
/// been since `at_ns` or earlier: a choice made at `at_ns` still stands.
#[inline(always)]
pub fn member_since(service_id: u32, backend_id: u32, at_ns: u64) -> bool {
    let key = MemberKey {
        service_id,
        backend_id,
    };
    // SAFETY: the value is copied out at once.
    unsafe { MEMBERS.get(&key).copied() }.is_some_and(|since| since <= at_ns)
}

#[inline(always)]
pub fn active_backend(id: u32) -> Option<Backend> {
    backend(id).filter(|b| b.state == BACKEND_ACTIVE)
}

#[inline(always)]
fn backend_in_slot(svc: &ServiceValue, slot: u32) -> Option<(u32, Backend)> {
    let key = BackendSlotKey {
        service_id: svc.id,
        rev: svc.rev,
        slot,
    };
    let id = backend_id_in(&key)?;
    Some((id, backend(id)?))
}

/// Re-reads the service whose entry `svc` was, by id, through its reverse-NAT frontend.
#[inline(always)]
fn lookup_fresh(svc: &ServiceValue) -> Option<&'static ServiceValue> {
    // SAFETY: map memory, valid for this program run (see `lookup_service`).
    let frontend = unsafe { crate::maps::REV_NAT.get(&svc.rev_nat_id)? };
    // The entry that changed may be either scope's: try both.
    for internal in [false, true] {
        if let Some(fresh) = lookup_service(
            frontend.addr,
            frontend.port,
            frontend.proto,
            frontend.family,
            internal,
        ) && fresh.id == svc.id
        {
            return Some(fresh);
        }
    }
    None
}

#[inline(always)]
fn remember(key: &AffinityKey, backend_id: u32, now: u64) {
    let value = AffinityValue {
        last_used_ns: now,
        backend_id,
        _pad: 0,
    };
    // An LRU map evicts rather than fails; a failure only loses stickiness, never traffic.
    let _ = AFFINITY.insert(key, &value, 0);
}

#[inline(always)]
fn no_backend(svc: &ServiceValue) -> NoBackend {
    if svc.flags & SVC_F_DROP_NO_BACKENDS != 0 {
        NoBackend::Drop(drop::packet(Reason::NoBackend))
    } else {
        count(counter::NO_BACKEND_REJECT);
        NoBackend::Reject
    }
}
