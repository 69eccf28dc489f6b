//! Frontends (`SERVICES`), their backend sets (`BACKEND_SLOTS`, `MAGLEV`) and the
//! frontend replies are shown as (`REV_NAT`).

/// Lookup scope of a service entry: used by traffic from outside the node (and by every
/// caller when the service has a single scope).
pub const SCOPE_EXTERNAL: u8 = 0;
/// Lookup scope of a service entry: traffic from pods and the node itself, used only when
/// the service carries [`SVC_F_TWO_SCOPES`] (internal and external backends differ).
pub const SCOPE_INTERNAL: u8 = 1;

/// `ServiceValue::flags`: `sessionAffinity: ClientIP`.
pub const SVC_F_AFFINITY: u16 = 1 << 0;
/// `ServiceValue::flags`: internal traffic looks up the `SCOPE_INTERNAL` entry.
pub const SVC_F_TWO_SCOPES: u16 = 1 << 1;
/// `ServiceValue::flags`: with no backends, drop silently instead of rejecting.
pub const SVC_F_DROP_NO_BACKENDS: u16 = 1 << 2;
/// `ServiceValue::flags`: an external frontend (NodePort, external IP, load-balancer IP):
/// masqueraded like kube-proxy's KUBE-EXT chains.
pub const SVC_F_EXTERNAL: u16 = 1 << 3;
/// `ServiceValue::flags`: `externalTrafficPolicy: Local`: outside clients keep their
/// source address (only traffic the node itself sends is masqueraded).
pub const SVC_F_EXT_LOCAL: u16 = 1 << 4;
/// `ServiceValue::flags`: only sources in `SOURCE_RANGES` for this service id may connect.
pub const SVC_F_SOURCE_RANGES: u16 = 1 << 5;
/// Backends have unequal weights: `WEIGHTS` holds them (else every weight is 1).
pub const SVC_F_WEIGHTED: u16 = 1 << 6;
/// `ServiceValue::flags`: direct server return (an external frontend in `dsr` mode, or a
/// TCP one in `hybrid`): a new flow from outside the node to a backend on another node
/// keeps the client's address, and carries the frontend to the backend's node in an IP
/// option (`dsr`), whose agent sends the replies straight back as the frontend.
pub const SVC_F_DSR: u16 = 1 << 7;

/// Most backend slots one service entry may reference; bounds the BPF loops.
pub const MAX_BACKENDS_PER_SERVICE: u32 = 65_535;

/// A service frontend: VIP, port and protocol, in one lookup scope.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub family: u8,
    pub scope: u8,
    pub _pad: [u8; 3],
}

/// What a frontend leads to. `count` backend slots are live under `(id, rev)`; the agent
/// writes a new set under a new `rev` and then replaces this value in one update, so a
/// lookup sees either the old set or the new one, never a mix.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// Agent-assigned, unique per frontend; also names the slots and affinity entries.
    pub id: u32,
    /// Generation of the backend slots in use.
    pub rev: u32,
    /// Number of live slots; 0 means "no usable endpoints": reject (or drop).
    pub count: u16,
    /// `SVC_F_*`.
    pub flags: u16,
    /// `sessionAffinity` timeout in seconds (0 when affinity is off).
    pub affinity_timeout_s: u32,
    /// Key into `REV_NAT` that turns a backend address back into this frontend.
    pub rev_nat_id: u32,
    /// `sched::*`: how a new flow's slot is chosen.
    pub scheduler: u8,
    pub _pad: u8,
    /// `SH`/`MH`: the length of the Maglev table in `MAGLEV` (0 for the others).
    pub table_len: u16,
}

/// Entries of a Maglev table per `MAGLEV` value.
pub const MAGLEV_CHUNK: u32 = 16;

/// `MAGLEV_CHUNK` consecutive entries of a service entry's Maglev table, keyed by
/// `BackendSlotKey {service_id, rev, slot: entry / MAGLEV_CHUNK}`: each the slot (of
/// that generation's `BACKEND_SLOTS`) a flow hashing to it takes. A table of thousands of
/// entries is a few hundred small values, which stay in the cache where thousands of
/// slot entries did not.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaglevChunk {
    pub slots: [u16; MAGLEV_CHUNK as usize],
}

/// One backend slot of one generation of a service's backend set.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlotKey {
    pub service_id: u32,
    pub rev: u32,
    /// 0-based, `< ServiceValue::count`.
    pub slot: u32,
}

/// The backend a slot points at.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendSlot {
    pub backend_id: u32,
}

/// Reverse-NAT value (keyed by `ServiceValue::rev_nat_id`, a `u32`): the frontend that
/// replies must appear to come from.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNatValue {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub family: u8,
    pub proto: u8,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<ServiceKey>(), 24);
        assert_eq!(size_of::<ServiceValue>(), 24);
        assert_eq!(size_of::<BackendSlotKey>(), 12);
        assert_eq!(size_of::<BackendSlot>(), 4);
        assert_eq!(size_of::<MaglevChunk>(), 32);
        assert_eq!(size_of::<RevNatValue>(), 20);
    }

    /// No implicit padding: the sum of the field sizes equals the struct size. (With the
    /// `user` feature, `bytemuck::Pod`'s derive proves the same at compile time.)
    #[test]
    fn no_implicit_padding() {
        assert_eq!(size_of::<ServiceKey>(), 16 + 2 + 1 + 1 + 1 + 3);
        assert_eq!(size_of::<ServiceValue>(), 4 + 4 + 2 + 2 + 4 + 4 + 4);
        assert_eq!(size_of::<RevNatValue>(), 16 + 2 + 1 + 1);
    }
}
