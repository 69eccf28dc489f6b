//! Backends (`BACKENDS`) and their membership of service entries (`MEMBERS`).

/// `Backend::state`: receives new connections.
pub const BACKEND_ACTIVE: u8 = 0;
/// `Backend::state`: keeps existing flows, gets no new ones.
pub const BACKEND_TERMINATING: u8 = 1;

/// A backend, keyed by its agent-assigned id (`u32`).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend {
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub family: u8,
    /// `BACKEND_*`.
    pub state: u8,
    pub _pad: [u8; 3],
}

/// `MEMBERS` key: a backend id in a service entry's current backend set. The value (`u64`)
/// is the agent's `CLOCK_MONOTONIC` time (the clock of `bpf_ktime_get_ns`) when the pair
/// was added: an affinity entry or socket binding made before then is from an earlier
/// life of the ids and is ignored.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberKey {
    pub service_id: u32,
    pub backend_id: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<Backend>(), 24);
        assert_eq!(size_of::<MemberKey>(), 8);
    }

    /// No implicit padding: the sum of the field sizes equals the struct size.
    #[test]
    fn no_implicit_padding() {
        assert_eq!(size_of::<Backend>(), 16 + 2 + 1 + 1 + 1 + 3);
    }
}
