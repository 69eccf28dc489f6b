//! Model → node view, with kube-proxy's semantics: ClusterIPs, external IPs, load-balancer
//! IPs and NodePorts; traffic policies; endpoint conditions; topology; dual-stack;
//! session affinity; reject vs drop.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr, SocketAddr},
};

use k8s_openapi::{
    api::{
        core::v1::{Service, ServicePort, ServiceSpec},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::util::intstr::IntOrString,
};

use super::{
    BackendSet, ClusterModel, Frontend, FrontendKind, FrontendState, NodeInfo, NodeView, ObjectRef,
    Protocol, ViewConfig, WhenEmpty,
    endpoints::{Categorized, Endpoint, Policies, categorize, dedupe},
};

/// Label that ties an EndpointSlice to its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Label naming the proxy that serves a Service (kube-proxy skips labelled Services).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds`.
const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;

/// An object (or part of one) left out of the view, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub kind: &'static str,
    pub object: ObjectRef,
    pub reason: String,
}

/// Builds this node's view. Invalid objects (or invalid parts: one bad port, one bad
/// address) are left out and reported; everything else still applies.
pub fn node_view(
    model: &ClusterModel,
    node: &NodeInfo,
    cfg: &ViewConfig,
) -> (NodeView, Vec<Rejection>) {
    let mut view = NodeView::new();
    let mut rejected = Vec::new();
    // Slices by the Service they belong to: one pass, not one scan per Service.
    let mut slices_of: HashMap<(&str, &str), Vec<&EndpointSlice>> = HashMap::new();
    for (r, s) in &model.slices {
        if let Some(owner) = owner(s) {
            slices_of
                .entry((r.namespace.as_str(), owner.as_str()))
                .or_default()
                .push(s);
        }
    }
    for (sref, svc) in &model.services {
        let rejection = |reason: String| Rejection {
            kind: "Service",
            object: sref.clone(),
            reason,
        };
        let Some(spec) = &svc.spec else {
            rejected.push(rejection("no spec".into()));
            continue;
        };
        if !is_ours(svc, cfg) || spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        if let Err(reason) = check_ports(spec, cfg.node_port_range) {
            rejected.push(rejection(reason));
            continue;
        }
        let cluster_ips = match cluster_ips(spec) {
            // Headless: DNS only, nothing to proxy.
            Ok(ips) if ips.is_empty() => continue,
            Ok(ips) => ips,
            Err(reason) => {
                rejected.push(rejection(reason));
                continue;
            }
        };
        let (external_ips, bad) = parse_ips(spec.external_ips.iter().flatten(), "externalIP");
        rejected.extend(bad.into_iter().map(rejection));
        let (lb_ips, bad) = parse_ips(load_balancer_ips(svc).iter(), "load-balancer IP");
        rejected.extend(bad.into_iter().map(rejection));
        let externally_accessible = !external_ips.is_empty()
            || matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
        let policies = Policies {
            internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            external_local: externally_accessible
                && spec.external_traffic_policy.as_deref() == Some("Local"),
            externally_accessible,
        };
        let affinity = affinity_timeout(spec);
        let (source_ranges, bad) = parse_cidrs(spec.load_balancer_source_ranges.iter().flatten());
        rejected.extend(bad.into_iter().map(rejection));
        let slices: &[&EndpointSlice] = slices_of
            .get(&(sref.namespace.as_str(), sref.name.as_str()))
            .map_or(&[], Vec::as_slice);
        for port in spec.ports.iter().flatten() {
            let (number, protocol) = match port_and_protocol(port) {
                Ok(p) => p,
                Err(reason) => {
                    rejected.push(rejection(reason));
                    continue;
                }
            };
            let service = format!("{sref}:{}", display_port(port));
            for v4 in [true, false] {
                let family_ips = |ips: &[IpAddr]| -> Vec<IpAddr> {
                    ips.iter()
                        .copied()
                        .filter(|ip| ip.is_ipv4() == v4)
                        .collect()
                };
                let cips = family_ips(&cluster_ips);
                if cips.is_empty() {
                    // The Service is not of this family (ipFamilies).
                    continue;
                }
                let (eps, bad) = endpoints_for(slices, port, protocol, v4, &node.name);
                rejected.extend(bad);
                let sets = categorize(&eps, policies, &node.name, node.zone());
                // Too many for one frontend's backend slots: refused alone, named and
                // counted, so the rest of the node stays programmed and healthy.
                let most = sets.cluster.len().max(sets.local.len());
                if most > proxy_common::MAX_BACKENDS_PER_SERVICE as usize {
                    rejected.push(rejection(format!(
                        "port {} ({}): {most} endpoints exceed the {} one Service port can hold",
                        number,
                        if v4 { "IPv4" } else { "IPv6" },
                        proxy_common::MAX_BACKENDS_PER_SERVICE
                    )));
                    continue;
                }
                let mut add = |ip: IpAddr, port: u16, kind: FrontendKind| {
                    let fe = Frontend { ip, port, protocol };
                    // Two Services on one VIP and port (the API server allocates ClusterIPs
                    // and NodePorts once; files and external IPs can collide): the first
                    // in namespace/name order keeps it, the other is refused, named.
                    if let Some(other) = view.get(&fe).filter(|o| o.service != service) {
                        rejected.push(rejection(format!(
                            "{fe} already belongs to {}; not programmed for {service}",
                            other.service
                        )));
                        return;
                    }
                    let mut st = frontend_state(&service, kind, &sets, policies, affinity);
                    if kind == FrontendKind::LoadBalancer {
                        st.source_ranges = source_ranges
                            .iter()
                            .copied()
                            .filter(|n| n.addr().is_ipv4() == v4)
                            .collect();
                        // kube-proxy: when the ranges admit the node, the node reaching
                        // the LB IP is admitted even with the LB IP as its source (a VIP
                        // held locally, where such traffic loops back from it).
                        let node_admitted = node
                            .primary_addresses()
                            .iter()
                            .any(|ip| st.source_ranges.iter().any(|n| n.contains(ip)));
                        if node_admitted {
                            st.source_ranges
                                .extend(family_ips(&lb_ips).into_iter().map(ipnet::IpNet::from));
                        }
                    }
                    view.insert(fe, st);
                };
                for ip in cips {
                    add(ip, number, FrontendKind::ClusterIp);
                }
                for ip in family_ips(&external_ips) {
                    add(ip, number, FrontendKind::ExternalIp);
                }
                for ip in family_ips(&lb_ips) {
                    add(ip, number, FrontendKind::LoadBalancer);
                }
                if let Some(node_port) = node_port(port) {
                    for ip in node_port_ips(node, cfg, v4) {
                        add(ip, node_port, FrontendKind::NodePort);
                    }
                }
            }
        }
    }
    (view, rejected)
}

/// A `healthCheckNodePort` of an `externalTrafficPolicy: Local` Service: load balancers
/// ask it whether this node has local endpoints.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HealthCheck {
    pub service: ObjectRef,
    pub local_endpoints: usize,
}

/// Health-check ports of this node, by port: kube-proxy answers 200 with the number of
/// local endpoints, 503 without.
pub fn health_checks(
    model: &ClusterModel,
    node: &NodeInfo,
    cfg: &ViewConfig,
) -> BTreeMap<u16, HealthCheck> {
    let mut out = BTreeMap::new();
    for (sref, svc) in &model.services {
        let Some(spec) = &svc.spec else { continue };
        let Some(port) = spec
            .health_check_node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
        else {
            continue;
        };
        if !is_ours(svc, cfg) || spec.external_traffic_policy.as_deref() != Some("Local") {
            continue;
        }
        // Ready local endpoints, counted once per address (as kube-proxy counts them).
        let mut local = BTreeSet::new();
        for (r, slice) in &model.slices {
            if r.namespace != sref.namespace || owner(slice) != Some(&sref.name) {
                continue;
            }
            for ep in &slice.endpoints {
                let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
                if ready && ep.node_name.as_deref() == Some(node.name.as_str()) {
                    local.extend(ep.addresses.iter().cloned());
                }
            }
        }
        out.insert(
            port,
            HealthCheck {
                service: sref.clone(),
                local_endpoints: local.len(),
            },
        );
    }
    out
}

/// The backends each kind of traffic uses, per kube-proxy's policies.
fn frontend_state(
    service: &str,
    kind: FrontendKind,
    sets: &Categorized,
    policies: Policies,
    affinity: Option<u32>,
) -> FrontendState {
    let set = |endpoints: &BTreeSet<SocketAddr>| BackendSet {
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
        internal,
        affinity_timeout_s: affinity,
        external_local: kind != FrontendKind::ClusterIp && policies.external_local,
        internal_local: kind == FrontendKind::ClusterIp && policies.internal_local,
        source_ranges: Vec::new(),
    }
}

/// `loadBalancerSourceRanges`; the invalid ones are left out and described.
fn parse_cidrs<'a>(raw: impl Iterator<Item = &'a String>) -> (Vec<ipnet::IpNet>, Vec<String>) {
    let mut nets = Vec::new();
    let mut bad = Vec::new();
    for s in raw {
        match super::sloppy::parse_cidr(s.trim()) {
            Ok(n) => nets.push(n),
            Err(e) => bad.push(format!("invalid loadBalancerSourceRange {s:?}: {e}")),
        }
    }
    (nets, bad)
}

/// kube-proxy serves unlabelled Services; a labelled one only if it names this proxy.
fn is_ours(svc: &Service, cfg: &ViewConfig) -> bool {
    match svc
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL))
    {
        None => true,
        Some(name) => cfg.service_proxy_name.as_deref() == Some(name.as_str()),
    }
}

fn display_port(port: &ServicePort) -> String {
    match &port.name {
        Some(n) if !n.is_empty() => n.clone(),
        _ => port.port.to_string(),
    }
}

/// The Service's cluster IPs (dual-stack `clusterIPs`, else `clusterIP`); empty for a
/// headless Service.
fn cluster_ips(spec: &ServiceSpec) -> Result<Vec<IpAddr>, String> {
    let raw: Vec<&String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
        (_, Some(ip)) => vec![ip],
        _ => vec![],
    };
    // Headless: "None" (or nothing) alone; beside an address it is invalid, as the API
    // server says.
    if raw.iter().all(|ip| ip.is_empty() || *ip == "None") {
        return Ok(vec![]);
    }
    let mut ips = Vec::new();
    for ip in raw {
        let parsed =
            super::sloppy::parse_ip(ip).map_err(|e| format!("invalid clusterIP {ip:?}: {e}"))?;
        if !is_unicast_service_ip(parsed) {
            return Err(format!(
                "clusterIP {ip:?}: not a unicast address a Service can have (loopback, \
                 unspecified, broadcast, multicast and link-local are not)"
            ));
        }
        if ips.contains(&parsed) {
            return Err(format!("clusterIPs: {ip} twice"));
        }
        ips.push(parsed);
    }
    if ips.len() == 2 && ips[0].is_ipv4() == ips[1].is_ipv4() {
        return Err("clusterIPs: two addresses of one family".into());
    }
    Ok(ips)
}

/// What the API server accepts as a Service VIP (ClusterIP, external or LB IP) — and what
/// would otherwise hijack the node's own traffic (loopback) or every host (broadcast).
fn is_unicast_service_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            !(v4.is_loopback()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_link_local())
        }
        IpAddr::V6(v6) => {
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || v6.is_unicast_link_local())
        }
    }
}

/// Parses a Service's extra VIPs (external and load-balancer IPs); invalid ones, and
/// those no Service may have (an external IP of 127.0.0.1 would take over the node's own
/// loopback traffic), are left out and described.
fn parse_ips<'a>(raw: impl Iterator<Item = &'a String>, what: &str) -> (Vec<IpAddr>, Vec<String>) {
    let mut ips = Vec::new();
    let mut bad = Vec::new();
    for s in raw {
        match super::sloppy::parse_ip(s) {
            Ok(ip) if is_unicast_service_ip(ip) => ips.push(ip),
            Ok(_) => bad.push(format!(
                "{what} {s:?}: not a unicast address a Service can have (loopback, \
                 unspecified, broadcast, multicast and link-local are not)"
            )),
            Err(e) => bad.push(format!("invalid {what} {s:?}: {e}")),
        }
    }
    (ips, bad)
}

/// `status.loadBalancer.ingress[].ip`, except `ipMode: Proxy` ones (the load balancer
/// proxies, so traffic arrives addressed to the node, not to the LB IP).
fn load_balancer_ips(svc: &Service) -> Vec<String> {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
        .filter_map(|i| i.ip.clone())
        .collect()
}

fn node_port(port: &ServicePort) -> Option<u16> {
    port.node_port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
}

/// The API server's checks of a Service's ports that kube-proxy relies on: no port or
/// nodePort out of range or given twice (per protocol), nodePorts inside the node-port
/// range (a NodePort of 22 would take over the node's ssh, and through
/// `localhostNodePorts` its loopback too).
fn check_ports(spec: &ServiceSpec, range: (u16, u16)) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    let mut node_ports = std::collections::BTreeSet::new();
    for port in spec.ports.iter().flatten() {
        // A bad number or protocol leaves out that port alone (reported where ports are
        // read); the checks here are of the Service as a whole.
        let Ok((number, protocol)) = port_and_protocol(port) else {
            continue;
        };
        if !seen.insert((number, protocol)) {
            return Err(format!("port {number}/{protocol} given twice"));
        }
        match port.node_port {
            None | Some(0) => {}
            Some(n) => {
                let Some(n) = u16::try_from(n).ok().filter(|n| *n != 0) else {
                    return Err(format!("nodePort {n} out of range 1-65535"));
                };
                if n < range.0 || n > range.1 {
                    return Err(format!(
                        "nodePort {n} outside the node-port range {}-{} \
                         (ebpf.nodePortRange, the API server's --service-node-port-range)",
                        range.0, range.1
                    ));
                }
                if !node_ports.insert((n, protocol)) {
                    return Err(format!("nodePort {n}/{protocol} given twice"));
                }
            }
        }
    }
    Ok(())
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

fn port_and_protocol(port: &ServicePort) -> Result<(u16, Protocol), String> {
    let number = u16::try_from(port.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("port {} out of range 1-65535", port.port))?;
    let protocol = protocol(port.protocol.as_deref())
        .map_err(|p| format!("port {number}: unsupported protocol {p:?}"))?;
    Ok((number, protocol))
}

fn protocol(raw: Option<&str>) -> Result<Protocol, String> {
    match raw.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        other => Err(other.to_string()),
    }
}

fn affinity_timeout(spec: &ServiceSpec) -> Option<u32> {
    if spec.session_affinity.as_deref() != Some("ClientIP") {
        return None;
    }
    let timeout = spec
        .session_affinity_config
        .as_ref()
        .and_then(|c| c.client_ip.as_ref())
        .and_then(|c| c.timeout_seconds)
        .and_then(|t| u32::try_from(t).ok())
        .filter(|t| *t > 0)
        .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_S);
    Some(timeout)
}

fn owner(slice: &EndpointSlice) -> Option<&String> {
    slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)
}

/// Endpoints of one Service port for one IP family, merged over the slices of that
/// family and de-duplicated.
fn endpoints_for(
    slices: &[&EndpointSlice],
    svc_port: &ServicePort,
    protocol: Protocol,
    v4: bool,
    node: &str,
) -> (Vec<Endpoint>, Vec<Rejection>) {
    let port_name = svc_port.name.as_deref().unwrap_or("");
    let mut eps = Vec::new();
    let mut bad = Vec::new();
    let family = if v4 { "IPv4" } else { "IPv6" };
    for slice in slices {
        if slice.address_type != family {
            continue;
        }
        let target_port = match slice_port(slice, port_name, protocol, svc_port) {
            None => continue,
            Some(Ok(p)) => p,
            Some(Err(n)) => {
                bad.push(Rejection {
                    kind: "EndpointSlice",
                    object: ObjectRef::of(&slice.metadata),
                    reason: format!("port {n} out of range 1-65535"),
                });
                continue;
            }
        };
        for ep in &slice.endpoints {
            let cond = ep.conditions.as_ref();
            let hints = ep.hints.as_ref();
            // kube-proxy uses an endpoint's first address only (the others are the same
            // pod's, and the API requires at least one).
            for addr in ep.addresses.iter().take(1) {
                let Ok(ip) = super::sloppy::parse_ip(addr) else {
                    bad.push(Rejection {
                        kind: "EndpointSlice",
                        object: ObjectRef::of(&slice.metadata),
                        reason: format!("invalid endpoint address {addr:?}"),
                    });
                    continue;
                };
                if ip.is_ipv4() != v4 {
                    continue;
                }
                eps.push(Endpoint {
                    addr: SocketAddr::new(ip, target_port),
                    // A missing condition means "ready"/"serving" (discovery.k8s.io/v1), each
                    // on its own, as kube-proxy's endpointslicecache reads them.
                    ready: cond.and_then(|c| c.ready).unwrap_or(true),
                    serving: cond.and_then(|c| c.serving).unwrap_or(true),
                    terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
                    local: ep.node_name.as_deref() == Some(node),
                    zone_hints: hints
                        .and_then(|h| h.for_zones.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|z| z.name.clone())
                        .collect(),
                    node_hints: hints
                        .and_then(|h| h.for_nodes.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|n| n.name.clone())
                        .collect(),
                });
            }
        }
    }
    (dedupe(eps), bad)
}

/// The backend port for a Service port in one slice: the slice port with the same name
/// and protocol (this is how a named targetPort arrives resolved), else a numeric
/// targetPort.
fn slice_port(
    slice: &EndpointSlice,
    port_name: &str,
    protocol: Protocol,
    svc_port: &ServicePort,
) -> Option<Result<u16, i32>> {
    let matched = slice.ports.iter().flatten().find(|p| {
        p.name.as_deref().unwrap_or("") == port_name
            && self::protocol(p.protocol.as_deref()).ok() == Some(protocol)
    })?;
    let number = matched.port.or(match &svc_port.target_port {
        Some(IntOrString::Int(n)) => Some(*n),
        None => Some(svc_port.port),
        Some(IntOrString::String(_)) => None,
    })?;
    Some(u16::try_from(number).ok().filter(|p| *p != 0).ok_or(number))
}

#[cfg(test)]
#[path = "view_tests.rs"]
mod tests;
