//! This node's view: each frontend (VIP, port, protocol) with what its traffic leads to
//! (`FrontendState`), all of them (`NodeView`), and the log lines of a change.

use std::{
    collections::BTreeSet,
    fmt,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use serde::Serialize;

use crate::{compact, endpoint_set::EndpointSet, schedule};

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
