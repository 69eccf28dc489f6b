//! Session affinity (`AFFINITY`).

/// `AffinityKey::kind`: the client is identified by its source address (per-packet path).
pub const AFFINITY_BY_ADDR: u8 = 0;
/// `AffinityKey::kind`: the client is identified by its network-namespace cookie
/// (connect-time path, where the source address is not chosen yet).
pub const AFFINITY_BY_NETNS: u8 = 1;

/// Session-affinity key: one client of one service.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// Client address, or the netns cookie in words 0-1 (`AFFINITY_BY_NETNS`).
    pub client: [u32; 4],
    pub service_id: u32,
    pub family: u8,
    /// `AFFINITY_BY_*`.
    pub kind: u8,
    pub _pad: [u8; 2],
}

/// Session-affinity value: the backend a client is pinned to and when it was last used.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityValue {
    /// `bpf_ktime_get_ns()` of the last use.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<AffinityKey>(), 24);
        assert_eq!(size_of::<AffinityValue>(), 16);
        // The kernel rejects hash values aligned above 8 bytes.
        assert!(align_of::<AffinityValue>() <= 8);
    }

    /// No implicit padding: the sum of the field sizes equals the struct size.
    #[test]
    fn no_implicit_padding() {
        assert_eq!(size_of::<AffinityKey>(), 16 + 4 + 1 + 1 + 2);
        assert_eq!(size_of::<AffinityValue>(), 8 + 4 + 4);
    }
}
