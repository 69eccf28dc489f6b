//! The cluster-wide model (Services and EndpointSlices as the source reports them) and the
//! pure function that turns it, plus this node's identity and settings, into this node's
//! view: one entry per frontend (VIP, port, protocol) with the backends each kind of
//! traffic leads to. Plain data in, plain data out.

mod endpoints;
pub mod sloppy;
mod view;

pub use view::{HealthCheck, Rejection, health_check_addresses, health_checks, node_view};

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, SocketAddr},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde::Serialize;

/// `namespace/name` of a Kubernetes object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectRef {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ObjectRef {
    /// The reference of an object's metadata; objects without a name get "<unnamed>".
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        Self {
            namespace: meta.namespace.clone().unwrap_or_else(|| "default".into()),
            name: meta.name.clone().unwrap_or_else(|| "<unnamed>".into()),
        }
    }
}

/// Every Service and EndpointSlice the source knows, keyed by reference.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterModel {
    pub services: BTreeMap<ObjectRef, Service>,
    pub slices: BTreeMap<ObjectRef, EndpointSlice>,
}

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
    /// Connection-tracking timeouts of the per-packet path.
    pub conntrack: crate::config::ConntrackSettings,
    /// CIDRs whose node addresses get NodePorts; empty (and not `primary`): every node
    /// address.
    pub node_port_addresses: Vec<ipnet::IpNet>,
    /// `nodePortAddresses: [primary]`: this node's primary addresses get NodePorts too.
    pub node_port_primary: bool,
    /// NodePorts outside this range (the API server's `--service-node-port-range`) are
    /// refused, as the API server refuses them.
    pub node_port_range: (u16, u16),
    /// `127.0.0.1:<nodePort>` works (IPv4 only).
    pub localhost_node_ports: bool,
    /// Services labelled `service.kubernetes.io/service-proxy-name` are ours only when the
    /// label names this proxy.
    pub service_proxy_name: Option<String>,
}

impl Default for ViewConfig {
    fn default() -> Self {
        Self {
            pod_cidrs: Vec::new(),
            pod_cidrs_from_node: false,
            masquerade_all: false,
            conntrack: Default::default(),
            node_port_addresses: Vec::new(),
            node_port_primary: false,
            node_port_range: DEFAULT_NODE_PORT_RANGE,
            localhost_node_ports: true,
            service_proxy_name: None,
        }
    }
}

/// Transport protocol of a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// Where traffic for a Service port arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            SocketAddr::new(self.ip, self.port),
            self.protocol
        )
    }
}

/// What kind of address a frontend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum FrontendKind {
    ClusterIp,
    ExternalIp,
    LoadBalancer,
    NodePort,
}

/// What happens to a new connection when a backend set is empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum WhenEmpty {
    /// No endpoint anywhere: refuse (kube-proxy's REJECT).
    Reject,
    /// Endpoints exist, but the traffic policy allows none of them here: drop.
    Drop,
}

/// The backends one kind of traffic to a frontend may use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BackendSet {
    pub endpoints: BTreeSet<SocketAddr>,
    pub when_empty: WhenEmpty,
}

/// What this node does with traffic to one frontend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FrontendState {
    /// `namespace/name:port` of the Service port, for logs and dumps.
    pub service: String,
    pub kind: FrontendKind,
    /// The backends for traffic from outside the node (and for all traffic when
    /// `internal` is `None`).
    pub backends: BackendSet,
    /// The backends for traffic from pods and the node itself, when they differ
    /// (`externalTrafficPolicy: Local` short-circuits internal traffic to every endpoint).
    pub internal: Option<BackendSet>,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout_s: Option<u32>,
    /// `externalTrafficPolicy: Local` on an external frontend: outside clients keep their
    /// source address.
    pub external_local: bool,
    /// `internalTrafficPolicy: Local` on a ClusterIP frontend: only this node's endpoints.
    pub internal_local: bool,
    /// `loadBalancerSourceRanges` (load-balancer frontends only); empty: everyone.
    pub source_ranges: Vec<ipnet::IpNet>,
}

/// What the per-packet path needs to know about this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeSettings {
    pub pod_cidrs: Vec<ipnet::IpNet>,
    pub node_addresses: Vec<IpAddr>,
    pub masquerade_all: bool,
    pub conntrack: crate::config::ConntrackSettings,
}

impl NodeSettings {
    pub fn new(node: &NodeInfo, cfg: &ViewConfig) -> Self {
        Self {
            pod_cidrs: if cfg.pod_cidrs_from_node {
                node.pod_cidrs.clone()
            } else {
                cfg.pod_cidrs.clone()
            },
            node_addresses: node.addresses.clone(),
            masquerade_all: cfg.masquerade_all,
            conntrack: cfg.conntrack.clone(),
        }
    }
}

/// This node's desired dataplane state.
pub type NodeView = BTreeMap<Frontend, FrontendState>;

/// KPNG-style node log lines: `-` for each frontend state that went away or changed, `+`
/// for each that appeared or changed.
pub fn diff_lines(old: &NodeView, new: &NodeView) -> Vec<String> {
    let mut lines = Vec::new();
    for (fe, st) in old {
        if new.get(fe) != Some(st) {
            lines.push(format!("- {fe} {}", describe(st)));
        }
    }
    for (fe, st) in new {
        if old.get(fe) != Some(st) {
            lines.push(format!("+ {fe} {}", describe(st)));
        }
    }
    lines
}

fn describe(st: &FrontendState) -> String {
    let set = |b: &BackendSet| {
        if b.endpoints.is_empty() {
            format!("none ({:?})", b.when_empty).to_lowercase()
        } else {
            b.endpoints
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        }
    };
    let mut s = format!("{} {:?} -> {}", st.service, st.kind, set(&st.backends));
    if let Some(internal) = &st.internal {
        s.push_str(&format!(" internal -> {}", set(internal)));
    }
    if let Some(t) = st.affinity_timeout_s {
        s.push_str(&format!(" affinity {t}s"));
    }
    s
}
