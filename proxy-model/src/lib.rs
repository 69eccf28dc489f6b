//! The cluster-wide model (Services and EndpointSlices as the source reports them) and the
//! pure function that turns it, plus this node's identity and settings, into this node's
//! view: one entry per frontend (VIP, port, protocol) with the backends each kind of
//! traffic leads to. Plain data in, plain data out.

pub mod compact;
mod endpoint;
mod endpoint_set;
mod endpoints;
pub mod frontend_builder;
pub mod lb_mode;
mod narrow;
pub mod objects;
pub mod schedule;
mod slice_endpoints;
pub mod sloppy;
mod tracker;
mod view;

pub use endpoint_set::EndpointSet;
pub use objects::{ServiceInfo, SliceInfo};

pub use tracker::{ViewChanges, ViewTracker};
pub use view::{HealthCheck, Rejection, health_check_addresses, node_view};

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde::Serialize;

/// `namespace/name` of a Kubernetes object. Shared strings: the model's keys, the
/// tracker's and the claims are clones of one another (at 100k Services, a dozen copies
/// of each name as `String`s took some 25 MiB), and namespaces are interned.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectRef {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ObjectRef {
    /// The reference of an object's metadata; objects without a name get "<unnamed>".
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        Self::new(
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or("<unnamed>"),
        )
    }

    /// `namespace/name`, the namespace interned.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: objects::intern(namespace),
            name: name.into(),
        }
    }
}

/// Where an EndpointSlice sits in the model: under the Service it belongs to, so a
/// Service's slices are one range of the map.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct SliceKey {
    pub namespace: Arc<str>,
    /// `kubernetes.io/service-name` ("" for a slice that names none).
    pub service: Arc<str>,
    pub name: Arc<str>,
}

impl SliceKey {
    /// The slice's own reference.
    pub fn object(&self) -> ObjectRef {
        ObjectRef {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

/// Every Service and EndpointSlice the source knows, in their compact form. Persistent
/// maps: a copy costs O(1) and shares everything with the original, and two versions of
/// one lineage diff in proportion to what changed between them (`changed_services`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterModel {
    services: imbl::OrdMap<ObjectRef, Arc<ServiceInfo>>,
    slices: imbl::OrdMap<SliceKey, Arc<SliceInfo>>,
    /// Each slice's owner, to find its entry when it is deleted or relabelled.
    slice_owners: imbl::OrdMap<ObjectRef, Arc<str>>,
}

impl ClusterModel {
    /// Adds or replaces a Service; `false` if the model already held it as it is.
    pub fn insert_service(&mut self, r: ObjectRef, svc: ServiceInfo) -> bool {
        if self.services.get(&r).is_some_and(|old| **old == svc) {
            return false;
        }
        self.services.insert(r, Arc::new(svc));
        true
    }

    pub fn remove_service(&mut self, r: &ObjectRef) -> bool {
        self.services.remove(r).is_some()
    }

    /// Adds or replaces an EndpointSlice; `false` if the model already held it as it is.
    pub fn insert_slice(&mut self, r: ObjectRef, slice: SliceInfo) -> bool {
        let key = SliceKey {
            namespace: r.namespace.clone(),
            service: slice.service.clone().unwrap_or_else(|| "".into()),
            name: r.name.clone(),
        };
        if self.slices.get(&key).is_some_and(|old| **old == slice) {
            return false;
        }
        // Relabelled to another Service: it leaves the old one.
        if let Some(old_owner) = self.slice_owners.get(&r).filter(|o| **o != key.service) {
            let old = SliceKey {
                service: old_owner.clone(),
                ..key.clone()
            };
            self.slices.remove(&old);
        }
        self.slice_owners.insert(r, key.service.clone());
        self.slices.insert(key, Arc::new(slice));
        true
    }

    pub fn remove_slice(&mut self, r: &ObjectRef) -> bool {
        let Some(owner) = self.slice_owners.remove(r) else {
            return false;
        };
        self.slices
            .remove(&SliceKey {
                namespace: r.namespace.clone(),
                service: owner,
                name: r.name.clone(),
            })
            .is_some()
    }

    /// Adds a Service from its API object.
    pub fn add_service(&mut self, svc: &Service) -> bool {
        self.insert_service(ObjectRef::of(&svc.metadata), ServiceInfo::from_k8s(svc))
    }

    /// Adds an EndpointSlice from its API object.
    pub fn add_slice(&mut self, slice: &EndpointSlice) -> bool {
        self.insert_slice(ObjectRef::of(&slice.metadata), SliceInfo::from_k8s(slice))
    }

    pub fn services(&self) -> impl Iterator<Item = (&ObjectRef, &ServiceInfo)> {
        self.services.iter().map(|(r, s)| (r, &**s))
    }

    pub fn service(&self, r: &ObjectRef) -> Option<&ServiceInfo> {
        self.services.get(r).map(|s| &**s)
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn slices(&self) -> impl Iterator<Item = (&SliceKey, &SliceInfo)> {
        self.slices.iter().map(|(k, s)| (k, &**s))
    }

    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// The slices of one Service: one range of the map.
    pub fn slices_of<'a>(
        &'a self,
        service: &'a ObjectRef,
    ) -> impl Iterator<Item = (&'a SliceKey, &'a SliceInfo)> {
        let from = SliceKey {
            namespace: service.namespace.clone(),
            service: service.name.clone(),
            name: "".into(),
        };
        self.slices
            .range(from..)
            .take_while(move |(k, _)| k.namespace == service.namespace && k.service == service.name)
            .map(|(k, s)| (k, &**s))
    }

    /// Makes this model equal to `fresh` (a relist, a reload) by changing only the
    /// entries that differ, so it keeps sharing the rest with its earlier versions (and
    /// diffs against them stay proportional). Returns how many objects changed.
    pub fn replace_with(&mut self, fresh: &ClusterModel) -> u64 {
        let mut changed = 0;
        let gone: Vec<ObjectRef> = self
            .services
            .keys()
            .filter(|r| !fresh.services.contains_key(*r))
            .cloned()
            .collect();
        for r in gone {
            changed += u64::from(self.remove_service(&r));
        }
        for (r, svc) in &fresh.services {
            if self.services.get(r) != Some(svc) {
                self.services.insert(r.clone(), Arc::clone(svc));
                changed += 1;
            }
        }
        let gone: Vec<ObjectRef> = self
            .slice_owners
            .keys()
            .filter(|r| !fresh.slice_owners.contains_key(*r))
            .cloned()
            .collect();
        for r in gone {
            changed += u64::from(self.remove_slice(&r));
        }
        for (key, slice) in &fresh.slices {
            let r = ObjectRef {
                namespace: key.namespace.clone(),
                name: key.name.clone(),
            };
            if self.slices.get(key) != Some(slice) {
                changed += u64::from(self.insert_slice(r, (**slice).clone()));
            }
        }
        changed
    }

    /// Adds every object of `other` (later files win).
    pub fn extend(&mut self, other: &ClusterModel) {
        for (r, svc) in &other.services {
            self.services.insert(r.clone(), Arc::clone(svc));
        }
        for (key, slice) in &other.slices {
            let r = ObjectRef {
                namespace: key.namespace.clone(),
                name: key.name.clone(),
            };
            self.insert_slice(r, (**slice).clone());
        }
    }

    /// The Services whose inputs differ between `self` and `newer` (the Service itself,
    /// or one of its slices), and the slices whose change-trigger time is new. In
    /// proportion to the changes when `newer` was derived from `self`.
    pub fn changes_to(&self, newer: &ClusterModel) -> ModelChanges {
        let mut out = ModelChanges::default();
        for d in self.services.diff(&newer.services) {
            let r = match d {
                imbl::ordmap::DiffItem::Add(r, _) | imbl::ordmap::DiffItem::Remove(r, _) => r,
                imbl::ordmap::DiffItem::Update { new: (r, _), .. } => r,
            };
            out.services.insert(r.clone());
            out.service_objects += 1;
        }
        let owner = |k: &SliceKey| ObjectRef {
            namespace: k.namespace.clone(),
            name: k.service.clone(),
        };
        for d in self.slices.diff(&newer.slices) {
            match d {
                imbl::ordmap::DiffItem::Add(k, s) => {
                    out.services.insert(owner(k));
                    out.slices += 1;
                    out.triggers.extend(s.trigger_time);
                }
                imbl::ordmap::DiffItem::Remove(k, _) => {
                    out.services.insert(owner(k));
                    out.slices += 1;
                }
                imbl::ordmap::DiffItem::Update { old, new } => {
                    out.services.insert(owner(new.0));
                    out.slices += 1;
                    if new.1.trigger_time != old.1.trigger_time {
                        out.triggers.extend(new.1.trigger_time);
                    }
                }
            }
        }
        out
    }
}

impl ClusterModel {
    /// Each object that differs between `self` and `newer`, as the ops that turn one into
    /// the other (the node-view feed's): removals first, and a slice moved to another
    /// Service only set (its removal under the old owner would remove the move). In
    /// proportion to the changes when `newer` was derived from `self`.
    pub fn object_changes(&self, newer: &ClusterModel) -> Vec<ObjectChange> {
        use imbl::ordmap::DiffItem;
        let mut removed = Vec::new();
        let mut set = Vec::new();
        for d in self.services.diff(&newer.services) {
            match d {
                DiffItem::Remove(r, _) => removed.push(ObjectChange::RemoveService(r.clone())),
                DiffItem::Add(r, s) | DiffItem::Update { new: (r, s), .. } => {
                    set.push(ObjectChange::SetService(r.clone(), Arc::clone(s)))
                }
            }
        }
        let mut moved = BTreeSet::new();
        for d in self.slices.diff(&newer.slices) {
            match d {
                DiffItem::Remove(k, _) => removed.push(ObjectChange::RemoveSlice(k.object())),
                DiffItem::Add(k, s) | DiffItem::Update { new: (k, s), .. } => {
                    moved.insert(k.object());
                    set.push(ObjectChange::SetSlice(k.object(), Arc::clone(s)));
                }
            }
        }
        removed.retain(|c| !matches!(c, ObjectChange::RemoveSlice(r) if moved.contains(r)));
        removed.extend(set);
        removed
    }
}

/// One object's change, as the node-view feed sends it.
#[derive(Clone, Debug, PartialEq)]
pub enum ObjectChange {
    SetService(ObjectRef, Arc<ServiceInfo>),
    RemoveService(ObjectRef),
    SetSlice(ObjectRef, Arc<SliceInfo>),
    RemoveSlice(ObjectRef),
}

/// What differs between two versions of the model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelChanges {
    /// Services to rebuild: changed themselves, or one of their slices did (a Service
    /// that no longer exists is in here too: its frontends go).
    pub services: BTreeSet<ObjectRef>,
    /// Service objects added, changed or removed.
    pub service_objects: u64,
    /// EndpointSlice entries added, changed or removed.
    pub slices: u64,
    /// Change-trigger times new in the newer version (each EndpointSlice change once).
    pub triggers: Vec<std::time::SystemTime>,
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
    /// Shared with the other frontends of the Service port and the dataplane's mirror.
    pub endpoints: EndpointSet,
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
    /// Boxed: few frontends have one (`externalTrafficPolicy: Local`), and inline it
    /// took 32 bytes in every frontend's state.
    pub internal: Option<Box<BackendSet>>,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout_s: Option<u32>,
    /// `externalTrafficPolicy: Local` on an external frontend: outside clients keep their
    /// source address.
    pub external_local: bool,
    /// `internalTrafficPolicy: Local` on a ClusterIP frontend: only this node's endpoints.
    pub internal_local: bool,
    /// `loadBalancerSourceRanges` (load-balancer frontends only); empty: everyone.
    pub source_ranges: Box<[ipnet::IpNet]>,
    /// How new flows pick among the backends.
    pub schedule: schedule::Schedule,
    /// Direct server return (an external frontend): outside clients keep their address
    /// to backends on other nodes, whose nodes answer as the frontend.
    pub dsr: bool,
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

/// This node's desired dataplane state: what it does with each frontend. A persistent
/// map of shared states: a copy (for the debug endpoint, the last programmed view) costs
/// O(1), and one frontend changes without copying the others.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeView(imbl::OrdMap<Frontend, Arc<FrontendState>>);

impl NodeView {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, fe: Frontend, st: FrontendState) -> Option<Arc<FrontendState>> {
        self.0.insert(fe, Arc::new(st))
    }

    /// Sets a frontend's state, shared with whoever else holds it.
    pub fn set(&mut self, fe: Frontend, st: Arc<FrontendState>) -> Option<Arc<FrontendState>> {
        self.0.insert(fe, st)
    }

    pub fn remove(&mut self, fe: &Frontend) -> Option<Arc<FrontendState>> {
        self.0.remove(fe)
    }

    /// With fuller nodes, after a first build (`compact`).
    pub fn compact(&mut self) {
        self.0 = compact::ord_map(&self.0);
    }

    pub fn get(&self, fe: &Frontend) -> Option<&FrontendState> {
        self.0.get(fe).map(|s| &**s)
    }

    pub fn shared(&self, fe: &Frontend) -> Option<&Arc<FrontendState>> {
        self.0.get(fe)
    }

    pub fn contains_key(&self, fe: &Frontend) -> bool {
        self.0.contains_key(fe)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&Frontend, &FrontendState)> {
        self.0.iter().map(|(f, s)| (f, &**s))
    }

    pub fn keys(&self) -> impl Iterator<Item = &Frontend> {
        self.0.keys()
    }

    pub fn values(&self) -> impl Iterator<Item = &FrontendState> {
        self.0.values().map(|s| &**s)
    }

    /// The frontends whose state differs between `self` and `newer`: in proportion to
    /// the changes when one was derived from the other.
    pub fn changed_frontends(&self, newer: &NodeView) -> BTreeSet<Frontend> {
        self.0
            .diff(&newer.0)
            .map(|d| match d {
                imbl::ordmap::DiffItem::Add(f, _) | imbl::ordmap::DiffItem::Remove(f, _) => *f,
                imbl::ordmap::DiffItem::Update { new: (f, _), .. } => *f,
            })
            .collect()
    }
}

impl std::ops::Index<&Frontend> for NodeView {
    type Output = FrontendState;

    fn index(&self, fe: &Frontend) -> &FrontendState {
        &self.0[fe]
    }
}

impl FromIterator<(Frontend, FrontendState)> for NodeView {
    fn from_iter<I: IntoIterator<Item = (Frontend, FrontendState)>>(iter: I) -> Self {
        Self(iter.into_iter().map(|(f, s)| (f, Arc::new(s))).collect())
    }
}

impl<'a> IntoIterator for &'a NodeView {
    type Item = (&'a Frontend, &'a FrontendState);
    type IntoIter = Box<dyn Iterator<Item = Self::Item> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl<const N: usize> From<[(Frontend, FrontendState); N]> for NodeView {
    fn from(entries: [(Frontend, FrontendState); N]) -> Self {
        entries.into_iter().collect()
    }
}

impl Extend<(Frontend, FrontendState)> for NodeView {
    fn extend<I: IntoIterator<Item = (Frontend, FrontendState)>>(&mut self, iter: I) {
        for (f, s) in iter {
            self.insert(f, s);
        }
    }
}

/// KPNG-style node log lines: `-` for each frontend state that went away or changed, `+`
/// for each that appeared or changed.
pub fn diff_lines(old: &NodeView, new: &NodeView) -> Vec<String> {
    let changed = old.changed_frontends(new);
    let mut lines = Vec::new();
    for fe in &changed {
        if let Some(st) = old.get(fe) {
            lines.push(format!("- {fe} {}", describe(st)));
        }
    }
    for fe in &changed {
        if let Some(st) = new.get(fe) {
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
                .map(|a| a.to_string())
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
