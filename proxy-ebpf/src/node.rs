//! The node's own addresses and the pod network, as the agent writes them into
//! `LOCAL_NETS`: whether an address is one of the node's, and where a packet comes from
//! (kube-proxy's local-traffic detector).
//!
//! Layer 2. Owns: `is_node_address`, `on_node`, `on_node_pods`, `origin` and `Origin`,
//! `lpm_key` (the key of both LPM tries). May import: `maps`, `verdict`, `packet`, `stats`.

use aya_ebpf::btf_maps::lpm_trie::Key;
use proxy_common::{
    CFG_LOCAL_DETECTOR, FAMILY_V4, LPM_TAG_BITS, LPM_TAG_NODE, LPM_TAG_NODE_PODS, LPM_TAG_POD,
    LpmData, NodeConfig,
};

use crate::{maps::LOCAL_NETS, packet::Packet};

/// Where a packet comes from, as kube-proxy's local-traffic detector sees it.
pub struct Origin {
    /// From the pod network (`clusterCIDR`).
    pub pod: bool,
    /// Sent by the node itself (one of its addresses, or loopback).
    pub node: bool,
}

/// The key of `addr` under `tag` in an LPM trie of `LpmData` (`LOCAL_NETS`, and
/// `SOURCE_RANGES` by service id).
pub fn lpm_key(tag: u32, family: u8, addr: [u32; 4]) -> Key<LpmData> {
    let bits = if family == FAMILY_V4 { 32 } else { 128 };
    Key::new(LPM_TAG_BITS + bits, LpmData { tag, addr })
}

/// (Not inlined, as the rest of the LPM lookups: their keys would crowd `new_flow`'s
/// frame.)
#[inline(never)]
pub fn origin(pkt: &Packet, cfg: &NodeConfig) -> Origin {
    let family = u32::from(pkt.family);
    let pod = cfg.flags & CFG_LOCAL_DETECTOR != 0
        && LOCAL_NETS
            .get(&lpm_key(LPM_TAG_POD | family, pkt.family, pkt.saddr))
            .is_some();
    let loopback = if pkt.family == FAMILY_V4 {
        pkt.saddr[0].to_ne_bytes()[0] == 127
    } else {
        pkt.saddr == [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])]
    };
    let node = loopback
        || LOCAL_NETS
            .get(&lpm_key(LPM_TAG_NODE | family, pkt.family, pkt.saddr))
            .is_some();
    Origin { pod, node }
}

/// One of the node's own addresses (or loopback).
#[inline(never)]
pub fn is_node_address(family: u8, addr: &[u32; 4]) -> bool {
    LOCAL_NETS
        .get(&lpm_key(LPM_TAG_NODE | u32::from(family), family, *addr))
        .is_some()
}

/// A backend on this node: in one of its own pod CIDRs, or on one of its addresses.
/// (Without the Node's pod CIDRs every pod backend looks remote.)
#[inline(never)]
pub fn on_node(family: u8, addr: &[u32; 4]) -> bool {
    on_node_pods(family, addr) || is_node_address(family, addr)
}

/// In one of the node's own pod CIDRs. (Inlined: `dsr::refusal` is deep in the
/// classifier's call chain.)
#[inline(always)]
pub fn on_node_pods(family: u8, addr: &[u32; 4]) -> bool {
    LOCAL_NETS
        .get(&lpm_key(
            LPM_TAG_NODE_PODS | u32::from(family),
            family,
            *addr,
        ))
        .is_some()
}
