//! Node-wide settings (`NODE_CONFIG`) and the LPM tries (`LOCAL_NETS`, `SOURCE_RANGES`).

use crate::conntrack::CtTimeouts;

/// `NodeConfig::flags`: masquerade every service connection (kube-proxy's masqueradeAll).
pub const CFG_MASQUERADE_ALL: u32 = 1 << 0;
/// `NodeConfig::flags`: pod traffic can be told apart (`LOCAL_NETS` holds the pod CIDRs).
pub const CFG_LOCAL_DETECTOR: u32 = 1 << 1;
/// The node's own pod CIDRs are known (`LPM_TAG_NODE_PODS`): a backend outside them and
/// the node's addresses is on another node.
pub const CFG_NODE_PODS: u32 = 1 << 2;

/// `LpmData::tag` of a pod-network CIDR in `LOCAL_NETS` (or'ed with the family).
pub const LPM_TAG_POD: u32 = 0;
/// `LpmData::tag` of one of the node's own addresses in `LOCAL_NETS` (or'ed with the family).
pub const LPM_TAG_NODE: u32 = 0x100;
/// `LpmData::tag` of one of this node's own pod CIDRs (its Node's `spec.podCIDRs`) in
/// `LOCAL_NETS` (or'ed with the family): a backend there is on this node (direct server
/// return is only for backends elsewhere).
pub const LPM_TAG_NODE_PODS: u32 = 0x200;
/// `LpmData::tag` of another node's address in `LOCAL_NETS` (or'ed with the family): the
/// entry nodes whose direct server return a backend's node believes.
pub const LPM_TAG_PEER_NODE: u32 = 0x300;
/// Bits of `LpmData::tag` every LPM key matches in full before the address bits.
pub const LPM_TAG_BITS: u32 = 32;

/// Node-wide settings of the per-packet path (`NODE_CONFIG`, one entry at index 0).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeConfig {
    /// The node address masqueraded IPv4 traffic leaves with (word 0; 0 = none).
    pub snat_v4: [u32; 4],
    /// The node address masqueraded IPv6 traffic leaves with (zero = none).
    pub snat_v6: [u32; 4],
    /// `CFG_*`.
    pub flags: u32,
    /// Connection-tracking timeouts, in seconds, by state (0 = the built-in default).
    pub timeouts: CtTimeouts,
    /// Masquerade source ports, host byte order, inclusive (0 = `SNAT_PORT_MIN`/`MAX`).
    pub snat_port_min: u16,
    pub snat_port_max: u16,
}

/// Data of an LPM-trie key: a tag matched in full, then the address bits.
/// `LOCAL_NETS`: tag = `LPM_TAG_POD | family` or `LPM_TAG_NODE | family`.
/// `SOURCE_RANGES`: tag = the service id.
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LpmData {
    /// Always matched in full (the key's prefix length counts its 32 bits first).
    pub tag: u32,
    pub addr: [u32; 4],
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<NodeConfig>(), 68);
        assert_eq!(size_of::<LpmData>(), 20);
    }

    /// No implicit padding: the sum of the field sizes equals the struct size.
    #[test]
    fn no_implicit_padding() {
        assert_eq!(size_of::<NodeConfig>(), 16 + 16 + 4 + 28 + 2 + 2);
    }
}
