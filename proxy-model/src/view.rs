//! Model → node view, with kube-proxy's semantics: ClusterIPs, external IPs, load-balancer
//! IPs and NodePorts; traffic policies; endpoint conditions; topology; dual-stack;
//! session affinity; reject vs drop.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
};

use super::{
    cluster::{ClusterModel, ObjectRef, SliceKey},
    endpoint_set::EndpointSet,
    endpoints::{Categorized, Endpoint, Policies, categorize, dedupe},
    error::ObjectKind,
    frontend::{BackendSet, Frontend, FrontendKind, FrontendState, Protocol, WhenEmpty},
    node::{NodeInfo, ViewConfig},
    objects::{PortInfo, ServiceInfo, SliceInfo, TargetPort, special_endpoint_ip},
};

/// An object (or part of one) left out of the view, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub kind: ObjectKind,
    pub object: ObjectRef,
    pub reason: String,
}

/// What one Service contributes to the node view: its frontends (before VIP collisions
/// with other Services are settled), what was left out, its health-check port.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServiceView {
    /// Sorted by frontend. A vector, not a map: most Services have one or two, and a
    /// map's node costs ten times their size at 100k Services.
    pub frontends: Vec<(Frontend, Arc<FrontendState>)>,
    pub rejections: Vec<Rejection>,
    pub health: Option<(u16, HealthCheck)>,
    /// Service ports with a Local traffic policy and no local endpoint, as
    /// (policy, family), once per Service port and family.
    pub no_local: Vec<(&'static str, &'static str)>,
}

impl ServiceView {
    pub fn is_empty(&self) -> bool {
        self.frontends.is_empty() && self.rejections.is_empty() && self.health.is_none()
    }

    /// The state this Service wants for `fe`, if it wants `fe`.
    pub fn frontend(&self, fe: &Frontend) -> Option<&Arc<FrontendState>> {
        frontend_in(&self.frontends, fe)
    }

    /// Adds or replaces the state for `fe`, keeping the order.
    fn set_frontend(&mut self, fe: Frontend, st: Arc<FrontendState>) {
        match self.frontends.binary_search_by(|(f, _)| f.cmp(&fe)) {
            Ok(i) => self.frontends[i].1 = st,
            Err(i) => self.frontends.insert(i, (fe, st)),
        }
    }
}

/// `fe`'s state among a Service's `frontends`, sorted by frontend.
pub(super) fn frontend_in<'a>(
    frontends: &'a [(Frontend, Arc<FrontendState>)],
    fe: &Frontend,
) -> Option<&'a Arc<FrontendState>> {
    frontends
        .binary_search_by(|(f, _)| f.cmp(fe))
        .ok()
        .map(|i| &frontends[i].1)
}

/// One Service's part of the view: its frontends with the backends each kind of traffic
/// uses, with kube-proxy's semantics.
pub fn service_view(
    sref: &ObjectRef,
    svc: &ServiceInfo,
    model: &ClusterModel,
    node: &NodeInfo,
    cfg: &ViewConfig,
) -> ServiceView {
    let mut out = ServiceView::default();
    let rejection = |reason: String| rejection(sref, reason);
    if !is_ours(svc, cfg) || svc.external_name {
        return out;
    }
    let slices: Vec<(&SliceKey, &SliceInfo)> = model.slices_of(sref).collect();
    out.health = health_check(sref, svc, &slices, node, cfg);
    if let Some(reason) = &svc.rare.invalid {
        out.rejections.push(rejection(reason.to_string()));
        return out;
    }
    if svc.cluster_ips.is_empty() {
        // Headless: DNS only, nothing to proxy.
        return out;
    }
    out.rejections
        .extend(svc.rare.problems.iter().cloned().map(rejection));
    slice_rejections(&slices, cfg, &mut out.rejections);
    let externally_accessible = !svc.rare.external_ips.is_empty() || svc.node_port_type;
    let policies = Policies {
        internal_local: svc.internal_local,
        external_local: externally_accessible && svc.external_policy_local,
        externally_accessible,
    };
    let schedule = crate::schedule::Schedule::new(
        svc.rare.scheduler.unwrap_or(cfg.scheduler),
        svc.rare.weights.clone(),
        cfg.maglev_table_len,
    );
    for port in &svc.ports {
        let (number, protocol) = match &port.port {
            Ok(p) => *p,
            Err(reason) => {
                out.rejections.push(rejection(reason.to_string()));
                continue;
            }
        };
        let service = format!("{sref}:{}", port.display());
        let node_port = match port.node_port {
            Some(n) if !cfg.api_validated && !in_node_port_range(n, cfg.node_port_range) => {
                out.rejections.push(rejection(format!(
                    "port {}: nodePort {n} outside the node-port range {}-{} \
                     (ebpf.nodePortRange, the API server's --service-node-port-range); \
                     its NodePort is not programmed",
                    port.display(),
                    cfg.node_port_range.0,
                    cfg.node_port_range.1
                )));
                None
            }
            other => other,
        };
        let view = PortView {
            sref,
            svc,
            slices: &slices,
            node,
            cfg,
            policies,
            schedule: &schedule,
            port,
            number,
            protocol,
            service: &service,
            node_port,
        };
        view.family(true, &mut out);
        view.family(false, &mut out);
    }
    out.frontends.shrink_to_fit();
    out.no_local = no_local_endpoints(&out.frontends);
    out
}

/// A rejection of the Service `sref`.
fn rejection(sref: &ObjectRef, reason: String) -> Rejection {
    Rejection {
        kind: ObjectKind::Service,
        object: sref.clone(),
        reason,
    }
}

/// What the slices say that the API server would have refused: addresses that are not
/// addresses, and (from a source it did not validate) addresses no endpoint may have,
/// each endpoint alone (`endpoints_for` leaves them out).
fn slice_rejections(
    slices: &[(&SliceKey, &SliceInfo)],
    cfg: &ViewConfig,
    rejections: &mut Vec<Rejection>,
) {
    for (key, slice) in slices {
        for addr in &slice.bad_addresses {
            rejections.push(Rejection {
                kind: ObjectKind::EndpointSlice,
                object: key.object(),
                reason: format!("invalid endpoint address {addr:?}"),
            });
        }
        // What the API server refuses, from a source it did not validate: each endpoint
        // alone (endpoints_for leaves them out).
        if !cfg.api_validated {
            for ep in slice.endpoints.iter() {
                if let Some(why) = special_endpoint_ip(ep.ip) {
                    rejections.push(Rejection {
                        kind: ObjectKind::EndpointSlice,
                        object: key.object(),
                        reason: format!(
                            "endpoint address {}: {why}, as the API server says; left out",
                            ep.ip
                        ),
                    });
                }
            }
        }
    }
}

/// Gives each `wanted` frontend its state in `out`; two ports of this Service on one VIP
/// and port: the first keeps it. (Between Services the tracker settles it.)
fn claim(
    out: &mut ServiceView,
    wanted: Vec<(Frontend, Arc<FrontendState>)>,
    sref: &ObjectRef,
    service: &str,
) {
    for (fe, st) in wanted {
        if let Some(other) = out.frontend(&fe).filter(|o| o.service != st.service) {
            out.rejections.push(rejection(
                sref,
                format!(
                    "{fe} already belongs to {}; not programmed for {service}",
                    other.service
                ),
            ));
            continue;
        }
        out.set_frontend(fe, st);
    }
}

/// One port of a Service, as `service_view` reads it.
#[derive(Clone, Copy)]
struct PortView<'a> {
    sref: &'a ObjectRef,
    svc: &'a ServiceInfo,
    slices: &'a [(&'a SliceKey, &'a SliceInfo)],
    node: &'a NodeInfo,
    cfg: &'a ViewConfig,
    policies: Policies,
    schedule: &'a crate::schedule::Schedule,
    port: &'a PortInfo,
    number: u16,
    protocol: Protocol,
    /// `namespace/name:port`.
    service: &'a str,
    /// The NodePort, when this node programs it.
    node_port: Option<u16>,
}

impl PortView<'_> {
    /// The port's frontends of one family (`v4`, else IPv6), into `out`.
    fn family(&self, v4: bool, out: &mut ServiceView) {
        let PortView {
            sref,
            svc,
            slices,
            node,
            cfg,
            policies,
            schedule,
            port,
            number,
            protocol,
            service,
            node_port,
        } = *self;
        let family_ips = |ips: &[IpAddr]| -> Vec<IpAddr> {
            ips.iter()
                .copied()
                .filter(|ip| ip.is_ipv4() == v4)
                .collect()
        };
        let cips = family_ips(&svc.cluster_ips);
        if cips.is_empty() {
            // The Service is not of this family (ipFamilies).
            return;
        }
        let (eps, bad) = endpoints_for(slices, port, protocol, v4, &node.name, cfg);
        out.rejections.extend(bad);
        let sets = categorize(&eps, policies, &node.name, node.zone());
        // Too many for one frontend's backend slots: refused alone, named and
        // counted, so the rest of the node stays programmed and healthy.
        let most = sets.cluster.len().max(sets.local.len());
        if most > cfg.max_endpoints {
            out.rejections.push(rejection(
                sref,
                format!(
                    "port {} ({}): {most} endpoints exceed the {} one Service port can hold",
                    number,
                    if v4 { "IPv4" } else { "IPv6" },
                    cfg.max_endpoints
                ),
            ));
            return;
        }
        // Every frontend of this port and family shares one state per kind.
        let mut states: BTreeMap<FrontendKind, Arc<FrontendState>> = BTreeMap::new();
        let mut state_for = |kind: FrontendKind| {
            Arc::clone(states.entry(kind).or_insert_with(|| {
                let mut st = frontend_state(service, kind, &sets, policies, svc.affinity_timeout_s);
                st.schedule = schedule.clone();
                st.dsr = kind != FrontendKind::ClusterIp
                    && svc
                        .rare
                        .lb_mode
                        .unwrap_or(cfg.lb_mode)
                        .direct_return(protocol);
                if kind == FrontendKind::LoadBalancer {
                    st.source_ranges = lb_source_ranges(svc, node, v4).into();
                }
                Arc::new(st)
            }))
        };
        let mut wanted: Vec<(Frontend, Arc<FrontendState>)> = Vec::new();
        // ClusterIPs, external IPs, load-balancer IPs, then NodePorts: the order in
        // which this Service's own collisions are settled below.
        for (ips, kind) in [
            (cips, FrontendKind::ClusterIp),
            (family_ips(&svc.rare.external_ips), FrontendKind::ExternalIp),
            (family_ips(&svc.rare.lb_ips), FrontendKind::LoadBalancer),
        ] {
            for ip in ips {
                let fe = Frontend {
                    ip,
                    port: number,
                    protocol,
                };
                wanted.push((fe, state_for(kind)));
            }
        }
        if let Some(node_port) = node_port {
            for ip in node_port_ips(node, cfg, v4) {
                wanted.push((
                    Frontend {
                        ip,
                        port: node_port,
                        protocol,
                    },
                    state_for(FrontendKind::NodePort),
                ));
            }
        }
        claim(out, wanted, sref, service);
    }
}

/// `loadBalancerSourceRanges` of one family on a load-balancer frontend.
fn lb_source_ranges(svc: &ServiceInfo, node: &NodeInfo, v4: bool) -> Vec<ipnet::IpNet> {
    let mut ranges: Vec<ipnet::IpNet> = svc
        .rare
        .source_ranges
        .iter()
        .copied()
        .filter(|n| n.addr().is_ipv4() == v4)
        .collect();
    // kube-proxy: when the ranges admit the node, the node reaching the LB IP is
    // admitted even with the LB IP as its source (a VIP held locally, where such
    // traffic loops back from it).
    let node_admitted = node
        .primary_addresses()
        .iter()
        .any(|ip| ranges.iter().any(|n| n.contains(ip)));
    if node_admitted {
        ranges.extend(
            svc.rare
                .lb_ips
                .iter()
                .filter(|ip| ip.is_ipv4() == v4)
                .map(|ip| ipnet::IpNet::from(*ip)),
        );
    }
    ranges
}

/// kube-proxy's `sync_proxy_rules_no_local_endpoints_total`: Service ports whose Local
/// traffic policy finds no endpoint on this node, per policy and family.
fn no_local_endpoints(
    frontends: &[(Frontend, Arc<FrontendState>)],
) -> Vec<(&'static str, &'static str)> {
    let mut seen = BTreeSet::new();
    for (fe, st) in frontends {
        let family = if fe.ip.is_ipv4() { "IPv4" } else { "IPv6" };
        let policy = if st.internal_local {
            "internal"
        } else if st.external_local {
            "external"
        } else {
            continue;
        };
        if st.backends.endpoints.is_empty() {
            seen.insert((policy, family, st.service.as_str()));
        }
    }
    seen.into_iter().map(|(p, f, _)| (p, f)).collect()
}

/// A `healthCheckNodePort` of an `externalTrafficPolicy: Local` Service: load balancers
/// ask it whether this node has local endpoints.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HealthCheck {
    pub service: ObjectRef,
    pub local_endpoints: usize,
}

/// A Service's health-check port, if it has one here: kube-proxy answers 200 with the
/// number of local endpoints, 503 without.
fn health_check(
    sref: &ObjectRef,
    svc: &ServiceInfo,
    slices: &[(&SliceKey, &SliceInfo)],
    node: &NodeInfo,
    cfg: &ViewConfig,
) -> Option<(u16, HealthCheck)> {
    let port = svc.rare.health_check_node_port?;
    if !svc.external_policy_local {
        return None;
    }
    // Ready local endpoints, counted once per address (as kube-proxy counts them).
    let local: BTreeSet<IpAddr> = slices
        .iter()
        .flat_map(|(_, s)| s.endpoints.iter())
        .filter(|ep| ep.ready && ep.is_on(&node.name))
        .filter(|ep| cfg.api_validated || special_endpoint_ip(ep.ip).is_none())
        .map(|ep| ep.ip)
        .collect();
    Some((
        port,
        HealthCheck {
            service: sref.clone(),
            local_endpoints: local.len(),
        },
    ))
}

/// The backends each kind of traffic uses, per kube-proxy's policies.
fn frontend_state(
    service: &str,
    kind: FrontendKind,
    sets: &Categorized,
    policies: Policies,
    affinity: Option<u32>,
) -> FrontendState {
    let set = |endpoints: &EndpointSet| BackendSet {
        endpoints: endpoints.clone(),
        when_empty: if sets.has_any {
            WhenEmpty::Drop
        } else {
            WhenEmpty::Reject
        },
    };
    let (backends, internal) = match kind {
        FrontendKind::ClusterIp if policies.internal_local => (set(&sets.local), None),
        FrontendKind::ClusterIp => (set(&sets.cluster), None),
        // eTP Local: outside traffic only to local endpoints; pods and the node itself
        // short-circuit to every endpoint.
        _ if policies.external_local => (set(&sets.local), Some(set(&sets.cluster))),
        _ => (set(&sets.cluster), None),
    };
    FrontendState {
        service: service.to_string(),
        kind,
        backends,
        internal: internal.map(Box::new),
        affinity_timeout_s: affinity,
        external_local: kind != FrontendKind::ClusterIp && policies.external_local,
        internal_local: kind == FrontendKind::ClusterIp && policies.internal_local,
        source_ranges: Box::default(),
        schedule: Default::default(),
        dsr: false,
    }
}

/// kube-proxy serves unlabelled Services; a labelled one only if it names this proxy.
fn is_ours(svc: &ServiceInfo, cfg: &ViewConfig) -> bool {
    match &svc.rare.proxy_name {
        None => true,
        Some(name) => cfg.service_proxy_name.as_deref() == Some(name.as_str()),
    }
}

/// Whether a nodePort lies in this node's node-port range (the API server's
/// `--service-node-port-range`): from a file, a NodePort of 22 would take over the node's
/// ssh, and through `localhostNodePorts` its loopback too.
fn in_node_port_range(n: u16, range: (u16, u16)) -> bool {
    (range.0..=range.1).contains(&n)
}

/// Whether NodePorts answer on `ip`: `nodePortAddresses` CIDRs (`all` and `localhost`
/// are CIDRs by then) and `primary` (this node's first address of each family); unset,
/// every address.
fn node_port_allowed(ip: &IpAddr, node: &NodeInfo, cfg: &ViewConfig) -> bool {
    if cfg.node_port_addresses.is_empty() && !cfg.node_port_primary {
        return true;
    }
    cfg.node_port_addresses.iter().any(|n| n.contains(ip))
        || (cfg.node_port_primary && node.primary_addresses().contains(ip))
}

/// Where health-check node ports listen, as kube-proxy's: every address (both families)
/// unless `nodePortAddresses` narrows them to the node addresses it names.
pub fn health_check_addresses(node: &NodeInfo, cfg: &ViewConfig) -> Option<Vec<IpAddr>> {
    if cfg.node_port_addresses.is_empty() && !cfg.node_port_primary {
        return None;
    }
    let loopbacks = [
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
    ];
    Some(
        node.addresses
            .iter()
            .chain(&loopbacks)
            .copied()
            .filter(|ip| node_port_allowed(ip, node, cfg))
            .collect(),
    )
}

/// Node addresses of one family that serve NodePorts (`nodePortAddresses`, or all), plus
/// 127.0.0.1 when `localhostNodePorts` allows.
fn node_port_ips(node: &NodeInfo, cfg: &ViewConfig, v4: bool) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = node
        .addresses
        .iter()
        .copied()
        .filter(|ip| ip.is_ipv4() == v4)
        .filter(|ip| node_port_allowed(ip, node, cfg))
        .collect();
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let loopback_allowed = node_port_allowed(&loopback, node, cfg);
    if v4 && cfg.localhost_node_ports && loopback_allowed && !ips.contains(&loopback) {
        ips.push(loopback);
    }
    ips
}

/// Endpoints of one Service port for one IP family, merged over the slices of that
/// family and de-duplicated.
fn endpoints_for<'a>(
    slices: &[(&SliceKey, &'a SliceInfo)],
    svc_port: &PortInfo,
    protocol: Protocol,
    v4: bool,
    node: &str,
    cfg: &ViewConfig,
) -> (Vec<Endpoint<'a>>, Vec<Rejection>) {
    let mut eps = Vec::new();
    let mut bad = Vec::new();
    for (key, slice) in slices {
        if slice.ipv4 != Some(v4) {
            continue;
        }
        let target_port = match slice_port(slice, &svc_port.name, protocol, svc_port) {
            None => continue,
            Some(Ok(p)) => p,
            Some(Err(n)) => {
                bad.push(Rejection {
                    kind: ObjectKind::EndpointSlice,
                    object: key.object(),
                    reason: format!("port {n} out of range 1-65535"),
                });
                continue;
            }
        };
        for (i, ep) in slice.endpoints.iter().enumerate() {
            if ep.ip.is_ipv4() != v4 {
                continue;
            }
            if !cfg.api_validated && special_endpoint_ip(ep.ip).is_some() {
                continue; // named above, in service_view
            }
            eps.push(Endpoint {
                addr: SocketAddr::new(ep.ip, target_port),
                ready: ep.ready,
                serving: ep.serving,
                terminating: ep.terminating,
                local: ep.is_on(node),
                zone_hints: slice.zone_hints(i),
                node_hints: slice.node_hints(i),
            });
        }
    }
    (dedupe(eps), bad)
}

/// The backend port for a Service port in one slice: the slice port with the same name
/// and protocol (this is how a named targetPort arrives resolved), else a numeric
/// targetPort.
fn slice_port(
    slice: &SliceInfo,
    port_name: &str,
    protocol: Protocol,
    svc_port: &PortInfo,
) -> Option<Result<u16, i32>> {
    let matched = slice
        .ports
        .iter()
        .find(|p| *p.name == *port_name && p.protocol == Some(protocol))?;
    let number = matched.port.or(match svc_port.target_port {
        TargetPort::Number(n) => Some(n),
        TargetPort::Named => None,
    })?;
    Some(u16::try_from(number).ok().filter(|p| *p != 0).ok_or(number))
}

#[cfg(test)]
#[path = "view_tests.rs"]
mod tests;
