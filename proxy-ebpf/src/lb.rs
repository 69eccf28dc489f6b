//! Service lookup and backend selection, shared by the connect-time and per-packet paths
//! so both choose from the same maps with the same rules.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};
use proxy_common::{
    AffinityKey, AffinityValue, BACKEND_ACTIVE, Backend, BackendSlotKey, MemberKey, SCOPE_EXTERNAL,
    SCOPE_INTERNAL, SVC_F_AFFINITY, SVC_F_DROP_NO_BACKENDS, SVC_F_TWO_SCOPES, ServiceKey,
    ServiceValue, counter,
};

use crate::maps::{AFFINITY, BACKEND_SLOTS, BACKENDS, MEMBERS, SERVICES, count};

/// Why no backend was chosen for a packet or connection addressed to a service.
pub enum NoBackend {
    /// kube-proxy's REJECT: refuse at once.
    Reject,
    /// Drop silently.
    Drop,
}

/// Who is asking, for session affinity.
pub struct Client {
    pub id: [u32; 4],
    pub kind: u8,
    pub family: u8,
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
/// fresh, otherwise a uniformly random slot (iptables' `statistic mode random` semantics).
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
            if now.saturating_sub(aff.last_used_ns) <= timeout_ns
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
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    let slot = unsafe { bpf_get_prandom_u32() } % u32::from(svc.count);
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
    Ok((id, be))
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
