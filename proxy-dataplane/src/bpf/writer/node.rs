//! The node settings: masquerade addresses and flags, connection-tracking timeouts and
//! ports, the pod network, the node's own pod CIDRs and its own addresses, and the other
//! nodes' addresses (direct server return's entry nodes).

use crate::error::{ErrorKind, Kind as _, Result};
use aya::maps::lpm_trie::Key as LpmKey;
use proxy_common::{
    CFG_LOCAL_DETECTOR, CFG_MASQUERADE_ALL, CFG_NODE_PODS, CtTimeouts, FAMILY_V4, FAMILY_V6,
    LPM_TAG_NODE, LPM_TAG_NODE_PODS, LPM_TAG_PEER_NODE, LPM_TAG_POD, LpmData, NodeConfig,
};

use crate::bpf::{codec::lpm_key, maps::remove_ignoring_absent};
use crate::bpf::{maps::MapSet, options::ConntrackOptions};
use proxy_model::NodeSettings;

/// Writes the node settings: the masquerade addresses and flags, the pod network and the
/// node's own addresses (who is "inside").
pub fn configure(maps: &mut MapSet, node: &NodeSettings, ct: &ConntrackOptions) -> Result<()> {
    let first = |v4: bool| {
        node.node_addresses
            .iter()
            .find(|a| a.is_ipv4() == v4)
            .map_or([0; 4], |a| proxy_common::addr::to_words(*a).0)
    };
    let mut flags = 0;
    if node.masquerade_all {
        flags |= CFG_MASQUERADE_ALL;
    }
    if !node.pod_cidrs.is_empty() {
        flags |= CFG_LOCAL_DETECTOR;
    }
    if !node.node_pod_cidrs.is_empty() {
        flags |= CFG_NODE_PODS;
    }
    let secs = |d: std::time::Duration| u32::try_from(d.as_secs().max(1)).unwrap_or(u32::MAX);
    let cfg = NodeConfig {
        snat_v4: first(true),
        snat_v6: first(false),
        flags,
        timeouts: CtTimeouts {
            tcp_syn: secs(ct.tcp_syn),
            tcp_established: secs(ct.tcp_established),
            tcp_closing: secs(ct.tcp_close_wait),
            udp: secs(ct.udp),
            udp_stream: secs(ct.udp_stream),
            // No kube-proxy setting: netfilter's TIME_WAIT and CLOSE (the built-in defaults).
            tcp_time_wait: 0,
            tcp_close: 0,
        },
        snat_port_min: ct.masquerade_ports.0,
        snat_port_max: ct.masquerade_ports.1,
    };
    maps.node_config.set(0, &cfg, 0)?;
    let mut wanted = Vec::new();
    let tagged = |tag: u32, net: &ipnet::IpNet| {
        let family = if net.addr().is_ipv4() {
            FAMILY_V4
        } else {
            FAMILY_V6
        };
        lpm_key(tag | u32::from(family), net)
    };
    for net in &node.pod_cidrs {
        wanted.push(tagged(LPM_TAG_POD, net));
    }
    for net in &node.node_pod_cidrs {
        wanted.push(tagged(LPM_TAG_NODE_PODS, net));
    }
    for ip in &node.node_addresses {
        wanted.push(tagged(LPM_TAG_NODE, &ipnet::IpNet::from(*ip)));
    }
    for ip in &node.peer_addresses {
        wanted.push(tagged(LPM_TAG_PEER_NODE, &ipnet::IpNet::from(*ip)));
    }
    let present: Vec<LpmKey<LpmData>> = maps.local_nets.keys().filter_map(|k| k.ok()).collect();
    // Stale entries go first: a table left full by an earlier run (or config) must not
    // refuse the entries this one needs.
    // (A set: with every other node's addresses there are thousands.)
    let kept: std::collections::HashSet<(u32, LpmData)> =
        wanted.iter().map(|w| (w.prefix_len(), w.data())).collect();
    for key in present {
        if !kept.contains(&(key.prefix_len(), key.data())) {
            remove_ignoring_absent(maps.local_nets.remove(&key))?;
        }
    }
    for key in &wanted {
        maps.local_nets
            .insert(key, &1, 0)
            .kind_with(ErrorKind::Map, || {
                format!("writing {} local networks", wanted.len())
            })?;
    }
    Ok(())
}
