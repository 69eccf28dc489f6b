//! Service lookup and backend selection, shared by the connect-time and per-packet paths
//! so both choose from the same maps with the same rules.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};
use core::intrinsics::{AtomicOrdering, atomic_xadd};

use proxy_common::{
    AffinityKey, AffinityValue, BACKEND_ACTIVE, Backend, BackendSlotKey, MemberKey, SCOPE_EXTERNAL,
    SCOPE_INTERNAL, SVC_F_AFFINITY, SVC_F_DROP_NO_BACKENDS, SVC_F_TWO_SCOPES, SVC_F_WEIGHTED,
    ServiceKey, ServiceValue, counter, sched, sched_hash,
};

use crate::maps::{
    ACTIVE_CONNS, AFFINITY, BACKEND_SLOTS, BACKENDS, MEMBERS, RR_CURSORS, SERVICES, WEIGHTS, count,
};

/// Why no backend was chosen for a packet or connection addressed to a service.
pub enum NoBackend {
    /// kube-proxy's REJECT: refuse at once.
    Reject,
    /// Drop silently.
    Drop,
}

/// Who is asking, for session affinity and the hashing schedulers.
pub struct Client {
    pub id: [u32; 4],
    pub kind: u8,
    pub family: u8,
    /// The client's port, network byte order (0 at connect time: not chosen yet).
    pub port: u16,
}

/// Finds the service entry for a frontend. Internal traffic (from pods or the node itself)
/// uses the internal scope when the service has one (its backends differ from the
/// external view, e.g. `externalTrafficPolicy: Local`).
#[inline(always)]
pub fn lookup_service(
    addr: [u32; 4],
    port: u16,
    proto: u8,
    family: u8,
    internal: bool,
) -> Option<ServiceValue> {
    let mut key = ServiceKey {
        addr,
        port,
        proto,
        family,
        scope: SCOPE_EXTERNAL,
        _pad: [0; 3],
    };
    // SAFETY: the value is copied out at once.
    let svc = unsafe { *SERVICES.get(&key)? };
    if !internal || svc.flags & SVC_F_TWO_SCOPES == 0 {
        return Some(svc);
    }
    key.scope = SCOPE_INTERNAL;
    // SAFETY: as above.
    unsafe { SERVICES.get(&key).copied() }.or(Some(svc))
}

/// Picks a backend for a new connection to `svc`: the client's affinity entry while it is
/// fresh, otherwise the slot its scheduler picks (`sched::*`; by default a uniformly
/// random one, iptables' `statistic mode random` semantics).
/// Not inlined: its keys get their own stack frame (the BPF stack is 512 bytes in all).
#[inline(never)]
pub fn select_backend(svc: &ServiceValue, client: &Client) -> Result<(u32, Backend), NoBackend> {
    if svc.count == 0 {
        return Err(no_backend(svc));
    }
    let affinity = svc.flags & SVC_F_AFFINITY != 0;
    let aff_key = AffinityKey {
        client: client.id,
        service_id: svc.id,
        family: client.family,
        kind: client.kind,
        _pad: [0; 2],
    };
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if affinity {
        // SAFETY: the value is copied out at once.
        if let Some(aff) = unsafe { AFFINITY.get(&aff_key).copied() } {
            let timeout_ns = u64::from(svc.affinity_timeout_s) * 1_000_000_000;
            // Only while the backend is still in this service's set, and already was when
            // the entry was last used (ids freed and reused later start a new membership).
            if proxy_common::elapsed_ns(now, aff.last_used_ns) <= timeout_ns
                && member_since(svc.id, aff.backend_id, aff.last_used_ns)
            {
                if let Some(be) = active_backend(aff.backend_id) {
                    count(counter::AFFINITY_HIT);
                    remember(&aff_key, aff.backend_id, now);
                    return Ok((aff.backend_id, be));
                }
            }
        }
    }
    let slot = schedule(svc, client);
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
        remember(&aff_key, id, now);
    }
    if is_least_conn(svc.scheduler) {
        opened(id);
    }
    Ok((id, be))
}

/// The slot `svc`'s scheduler picks for a new flow from `client` (`< svc.count`, which
/// the caller checked is not 0).
#[inline(always)]
pub fn schedule(svc: &ServiceValue, client: &Client) -> u32 {
    let count = u32::from(svc.count);
    match svc.scheduler {
        sched::RR | sched::WRR => round_robin(svc.id) % count,
        sched::SH => sched_hash(&client.id, 0) % count,
        sched::MH => sched_hash(&client.id, client.port) % count,
        s if is_least_conn(s) => least_loaded(svc),
        // RANDOM, and DH: the agent wrote the one slot the frontend's address hashes to.
        _ => random() % count,
    }
}

#[inline(always)]
fn random() -> u32 {
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    unsafe { bpf_get_prandom_u32() }
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

/// The least-connection schedulers: of up to `sched::LC_SCAN` slots from a random start
/// (every slot when there are no more), the one whose backend has the lowest cost. The
/// random start breaks ties evenly.
#[inline(never)]
fn least_loaded(svc: &ServiceValue) -> u32 {
    let count = u32::from(svc.count);
    let start = random() % count;
    let weighted = svc.flags & SVC_F_WEIGHTED != 0;
    // Cost of a backend as a fraction active/weight: compared by cross-multiplying.
    let mut best_slot = start;
    let (mut best_active, mut best_weight) = (u64::MAX, 1u64);
    for i in 0..sched::LC_SCAN {
        if i >= count {
            break;
        }
        let slot = (start + i) % count;
        let key = BackendSlotKey {
            service_id: svc.id,
            rev: svc.rev,
            slot,
        };
        // SAFETY: the value is copied out at once.
        let Some(id) = (unsafe { BACKEND_SLOTS.get(&key) }).map(|s| s.backend_id) else {
            continue;
        };
        // Capped so the cross products below fit 64 bits (weights are at most 2^8): no
        // 128-bit multiply, which BPF does not have.
        // SAFETY: as above.
        let active = unsafe { ACTIVE_CONNS.get(&id).copied() }
            .unwrap_or(0)
            .min(u64::from(u32::MAX));
        let weight = if weighted {
            let key = MemberKey {
                service_id: svc.id,
                backend_id: id,
            };
            // SAFETY: as above.
            u64::from(
                unsafe { WEIGHTS.get(&key).copied() }
                    .unwrap_or(1)
                    .min(1 << 16),
            )
        } else {
            1
        };
        if weight == 0 {
            continue; // quiesced: IPVS sends a weight-0 server no new connections
        }
        // Never queue: an idle backend wins outright.
        if svc.scheduler == sched::NQ && active == 0 {
            return slot;
        }
        // Shortest expected delay (and never queue's fallback) counts the new connection.
        let active = if svc.scheduler >= sched::SED {
            active + 1
        } else {
            active
        };
        let weight = if svc.scheduler == sched::LC {
            1
        } else {
            weight
        };
        if best_active == u64::MAX
            || active.wrapping_mul(best_weight) < best_active.wrapping_mul(weight)
        {
            best_slot = slot;
            best_active = active;
            best_weight = weight;
        }
    }
    best_slot
}

/// One more connection open on backend `id` (the least-connection schedulers' load).
#[inline(never)]
fn opened(id: u32) {
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
    // SAFETY: the value is copied out at once.
    let id = unsafe { BACKEND_SLOTS.get(&key)? }.backend_id;
    Some((id, backend(id)?))
}

/// Re-reads the service whose entry `svc` was, by id, through its reverse-NAT frontend.
#[inline(always)]
fn lookup_fresh(svc: &ServiceValue) -> Option<ServiceValue> {
    // SAFETY: the value is copied out at once.
    let frontend = unsafe { crate::maps::REV_NAT.get(&svc.rev_nat_id).copied()? };
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
        count(counter::NO_BACKEND_DROP);
        NoBackend::Drop
    } else {
        count(counter::NO_BACKEND_REJECT);
        NoBackend::Reject
    }
}
