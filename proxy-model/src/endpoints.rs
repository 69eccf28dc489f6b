//! Endpoints of one Service port: merged from every slice, de-duplicated, and sorted into
//! the cluster-wide and node-local sets each traffic policy uses — kube-proxy's
//! `CategorizeEndpoints`, including the serving+terminating fallback and topology hints.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc};

use super::endpoint_set::EndpointSet;

/// One endpoint address of one Service port, with what the view needs to know about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint<'a> {
    pub addr: SocketAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// On this node.
    pub local: bool,
    pub zone_hints: &'a [Arc<str>],
    pub node_hints: &'a [Arc<str>],
}

fn names_contain(names: &[Arc<str>], name: &str) -> bool {
    names.iter().any(|n| &**n == name)
}

impl Endpoint<'_> {
    fn serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }

    /// Preference when two slices list the same address: ready over serving+terminating
    /// over neither.
    fn rank(&self) -> u8 {
        if self.ready {
            2
        } else if self.serving_terminating() {
            1
        } else {
            0
        }
    }
}

/// Keeps one entry per address, the best-ranked one.
pub fn dedupe(endpoints: Vec<Endpoint<'_>>) -> Vec<Endpoint<'_>> {
    let mut by_addr: BTreeMap<SocketAddr, Endpoint<'_>> = BTreeMap::new();
    for ep in endpoints {
        match by_addr.get(&ep.addr) {
            Some(existing) if existing.rank() >= ep.rank() => {}
            _ => {
                by_addr.insert(ep.addr, ep);
            }
        }
    }
    by_addr.into_values().collect()
}

/// Which policies a Service port uses.
#[derive(Clone, Copy, Debug)]
pub struct Policies {
    pub internal_local: bool,
    /// `externalTrafficPolicy: Local` on an externally reachable Service.
    pub external_local: bool,
    pub externally_accessible: bool,
}

impl Policies {
    fn uses_cluster_endpoints(&self) -> bool {
        // External traffic needs cluster endpoints even with eTP Local: internal traffic
        // to external addresses short-circuits to them.
        !self.internal_local || self.externally_accessible
    }

    fn uses_local_endpoints(&self) -> bool {
        self.internal_local || self.external_local
    }
}

/// The endpoint sets of one Service port on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Categorized {
    pub cluster: EndpointSet,
    pub local: EndpointSet,
    /// Some endpoint anywhere can serve (decides reject vs drop).
    pub has_any: bool,
}

/// kube-proxy's categorisation for `node` in `zone`.
pub fn categorize(
    endpoints: &[Endpoint<'_>],
    policies: Policies,
    node: &str,
    zone: Option<&str>,
) -> Categorized {
    let mut out = Categorized::default();
    if policies.uses_cluster_endpoints() {
        let mode = topology_mode(endpoints, node, zone);
        let pick = |f: &dyn Fn(&Endpoint<'_>) -> bool| -> EndpointSet {
            endpoints
                .iter()
                .filter(|e| f(e) && mode.allows(e, node, zone))
                .map(|e| e.addr)
                .collect()
        };
        out.cluster = pick(&|e| e.ready);
        if out.cluster.is_empty() {
            out.cluster = pick(&|e| e.serving_terminating());
        }
        out.has_any = !out.cluster.is_empty();
    }
    if !policies.uses_local_endpoints() {
        return out;
    }
    let local_ready = endpoints.iter().any(|e| e.local && e.ready);
    out.has_any |= endpoints.iter().any(|e| e.ready || e.serving_terminating());
    out.local = endpoints
        .iter()
        .filter(|e| {
            e.local
                && if local_ready {
                    e.ready
                } else {
                    e.serving_terminating()
                }
        })
        .map(|e| e.addr)
        .collect();
    out
}

/// Which topology hints, if any, restrict the cluster endpoints.
enum TopologyMode {
    None,
    SameNode,
    SameZone,
}

impl TopologyMode {
    fn allows(&self, e: &Endpoint<'_>, node: &str, zone: Option<&str>) -> bool {
        match self {
            TopologyMode::None => true,
            TopologyMode::SameNode => names_contain(e.node_hints, node),
            TopologyMode::SameZone => zone.is_some_and(|z| names_contain(e.zone_hints, z)),
        }
    }
}

/// Hints are used only when every ready endpoint carries them and at least one is for
/// this node (node hints, from `PreferSameNode`) or zone (zone hints, from
/// `PreferClose`/`PreferSameZone` or topology-aware routing); otherwise all endpoints
/// are used, as kube-proxy falls back.
fn topology_mode(endpoints: &[Endpoint<'_>], node: &str, zone: Option<&str>) -> TopologyMode {
    let ready: Vec<&Endpoint<'_>> = endpoints.iter().filter(|e| e.ready).collect();
    if ready.is_empty() {
        return TopologyMode::None;
    }
    let all_node_hints = ready.iter().all(|e| !e.node_hints.is_empty());
    if all_node_hints && ready.iter().any(|e| names_contain(e.node_hints, node)) {
        return TopologyMode::SameNode;
    }
    let all_zone_hints = ready.iter().all(|e| !e.zone_hints.is_empty());
    if all_zone_hints && zone.is_some_and(|z| ready.iter().any(|e| names_contain(e.zone_hints, z)))
    {
        return TopologyMode::SameZone;
    }
    TopologyMode::None
}
