//! This node as the view needs it (`NodeInfo`), its proxy settings (`ViewConfig`), and
//! what the per-packet path needs to know of it (`NodeSettings`).

use std::{collections::BTreeMap, net::IpAddr};

use serde::Serialize;

use crate::{lb_mode, schedule};

/// This node, as the view needs it: from its Node object, or from flags and config.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The node's own addresses (NodePorts listen on them).
    pub addresses: Vec<IpAddr>,
    /// The Node is going away (a deletion timestamp, or the cluster autoscaler's
    /// `ToBeDeletedByClusterAutoscaler` taint): `/healthz` fails so load balancers drain it.
    pub draining: bool,
    /// The Node's `spec.podCIDRs` (for `detectLocalMode: NodeCIDR`).
    pub pod_cidrs: Vec<ipnet::IpNet>,
}

impl NodeInfo {
    /// The node's primary address of each family, as kube-proxy picks them: the first of
    /// that family (the Node's InternalIPs come before its ExternalIPs).
    pub fn primary_addresses(&self) -> Vec<IpAddr> {
        let v4 = self.addresses.iter().find(|ip| ip.is_ipv4());
        let v6 = self.addresses.iter().find(|ip| ip.is_ipv6());
        v4.into_iter().chain(v6).copied().collect()
    }

    /// `topology.kubernetes.io/zone`, if the node has one.
    pub fn zone(&self) -> Option<&str> {
        self.labels
            .get("topology.kubernetes.io/zone")
            .map(String::as_str)
    }
}

/// The API server's default `--service-node-port-range`.
pub const DEFAULT_NODE_PORT_RANGE: (u16, u16) = (30_000, 32_767);

/// This node's proxy settings (kube-proxy's, where it has them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ViewConfig {
    /// The pod network (`clusterCIDR` with `detectLocalMode: ClusterCIDR`); empty when
    /// pod traffic cannot be told apart.
    pub pod_cidrs: Vec<ipnet::IpNet>,
    /// `detectLocalMode: NodeCIDR`: the pod network is this Node's `spec.podCIDRs`.
    pub pod_cidrs_from_node: bool,
    /// kube-proxy's `masqueradeAll`.
    pub masquerade_all: bool,
    /// CIDRs whose node addresses get NodePorts; empty (and not `primary`): every node
    /// address.
    pub node_port_addresses: Vec<ipnet::IpNet>,
    /// `nodePortAddresses: [primary]`: this node's primary addresses get NodePorts too.
    pub node_port_primary: bool,
    /// NodePorts outside this range (the API server's `--service-node-port-range`) are
    /// refused, as the API server refuses them — from sources it did not validate
    /// (`api_validated` false): each such nodePort alone, the rest of its Service stays.
    pub node_port_range: (u16, u16),
    /// The objects come from the API server, which validated them under its own settings
    /// (its `--service-node-port-range` may differ from `node_port_range`): the checks
    /// that repeat its validation (the node-port range, endpoint addresses) are skipped,
    /// and what it stored is programmed, as kube-proxy programs it. The runner sets it
    /// from each snapshot (`Snapshot::api_validated`); false (files) checks them.
    pub api_validated: bool,
    /// `127.0.0.1:<nodePort>` works (IPv4 only).
    pub localhost_node_ports: bool,
    /// Services labelled `service.kubernetes.io/service-proxy-name` are ours only when the
    /// label names this proxy.
    pub service_proxy_name: Option<String>,
    /// The node's scheduler (a Service's annotation overrides it).
    pub scheduler: schedule::Scheduler,
    /// The node's load-balancer mode (`ebpf.loadBalancer.mode`; a Service's annotation
    /// overrides it).
    pub lb_mode: lb_mode::LbMode,
    /// Maglev table length of the hashing schedulers.
    pub maglev_table_len: u32,
    /// The most endpoints one frontend may have: the dataplane's limit
    /// (`Dataplane::max_endpoints`); a port with more is refused alone.
    pub max_endpoints: usize,
}

impl Default for ViewConfig {
    fn default() -> Self {
        Self {
            pod_cidrs: Vec::new(),
            pod_cidrs_from_node: false,
            masquerade_all: false,
            node_port_addresses: Vec::new(),
            node_port_primary: false,
            node_port_range: DEFAULT_NODE_PORT_RANGE,
            api_validated: false,
            localhost_node_ports: true,
            service_proxy_name: None,
            scheduler: schedule::Scheduler::Random,
            lb_mode: lb_mode::LbMode::Snat,
            maglev_table_len: schedule::DEFAULT_MAGLEV_TABLE_LEN,
            max_endpoints: usize::MAX,
        }
    }
}

/// What the per-packet path needs to know about this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeSettings {
    pub pod_cidrs: Vec<ipnet::IpNet>,
    pub node_addresses: Vec<IpAddr>,
    pub masquerade_all: bool,
    /// The Node's own `spec.podCIDRs`: backends there are on this node (direct server
    /// return is for the others).
    pub node_pod_cidrs: Vec<ipnet::IpNet>,
    /// The other Nodes' addresses, sorted, without duplicates: the entry nodes whose
    /// direct server return this node believes.
    pub peer_addresses: Vec<IpAddr>,
}

impl NodeSettings {
    /// This node's settings; `nodes` are the cluster's Nodes as the source knows them
    /// (its own among them or not).
    pub fn new<'a>(
        node: &NodeInfo,
        nodes: impl IntoIterator<Item = &'a NodeInfo>,
        cfg: &ViewConfig,
    ) -> Self {
        let peer_addresses: std::collections::BTreeSet<IpAddr> = nodes
            .into_iter()
            .filter(|n| n.name != node.name)
            .flat_map(|n| n.addresses.iter().copied())
            .filter(|ip| !node.addresses.contains(ip))
            .collect();
        Self {
            pod_cidrs: if cfg.pod_cidrs_from_node {
                node.pod_cidrs.clone()
            } else {
                cfg.pod_cidrs.clone()
            },
            node_addresses: node.addresses.clone(),
            masquerade_all: cfg.masquerade_all,
            node_pod_cidrs: node.pod_cidrs.clone(),
            peer_addresses: peer_addresses.into_iter().collect(),
        }
    }
}
