//! The compact model: from each Service and EndpointSlice only what the node view reads,
//! parsed once when the object arrives (addresses as `IpAddr`, ports as numbers, node
//! and zone names shared), instead of whole API objects with every annotation kept and
//! parsed again on every sync. What cannot be parsed is kept as the reason, so the view
//! reports it exactly where it would have used the value.

use std::{
    collections::HashSet,
    net::IpAddr,
    sync::{Arc, Mutex, OnceLock},
    time::SystemTime,
};

use k8s_openapi::{
    api::{
        core::v1::{Service, ServicePort},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::util::intstr::IntOrString,
    chrono::DateTime,
};
use serde::Serialize;

pub use super::endpoint::{EndpointInfo, NodeName};
use super::{
    error::{PortError, SpecialIp},
    frontend::Protocol,
    service_error::ServiceError,
    slice_endpoints::SliceEndpoints,
    sloppy,
};
use super::{lb_mode, schedule};

/// Label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Label naming the proxy that serves a Service (kube-proxy skips labelled Services).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Set by the endpoints controllers on every EndpointSlice they write.
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds`.
const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;

/// One Service, as the view needs it: what every Service has here, the rest in `rare`
/// (96 bytes with its allocation, where one struct of every field took 256: 15 MiB at
/// 100k Services).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ServiceInfo {
    pub external_name: bool,
    /// `clusterIPs` (or `clusterIP`); empty for a headless Service.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<PortInfo>,
    /// `type: NodePort` or `LoadBalancer`.
    pub node_port_type: bool,
    pub internal_local: bool,
    /// `externalTrafficPolicy: Local` (in effect only if the Service is reachable from
    /// outside).
    pub external_policy_local: bool,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout_s: Option<u32>,
    #[serde(flatten)]
    pub rare: Rare,
}

/// What few Services have: labels and annotations of ours, external and load-balancer
/// addresses, problems.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RareFields {
    /// The `service.kubernetes.io/service-proxy-name` label, if any.
    pub proxy_name: Option<String>,
    /// The Service as a whole cannot be used (no spec, bad ports, bad cluster IPs): why.
    pub invalid: Option<ServiceError>,
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`, except `ipMode: Proxy` ones.
    pub lb_ips: Vec<IpAddr>,
    pub source_ranges: Vec<ipnet::IpNet>,
    /// Parts left out (a bad external IP, load-balancer IP or source range): why.
    pub problems: Vec<String>,
    pub health_check_node_port: Option<u16>,
    /// The scheduler annotation (`None`: the node's).
    pub scheduler: Option<crate::schedule::Scheduler>,
    /// The weights annotation.
    pub weights: crate::schedule::Weights,
    /// The load-balancer mode annotation (`None`: the node's).
    pub lb_mode: Option<crate::lb_mode::LbMode>,
}

/// `RareFields`, boxed only when some field is set: reads see the defaults through
/// `Deref`; a write makes the box (`DerefMut`), and `settle` drops one left at the
/// defaults.
#[derive(Clone, Debug, Default)]
pub struct Rare(Option<Box<RareFields>>);

impl Rare {
    pub fn new(fields: RareFields) -> Self {
        let mut r = Self(Some(Box::new(fields)));
        r.settle();
        r
    }

    /// Drops a box that holds only defaults.
    pub fn settle(&mut self) {
        if self
            .0
            .as_deref()
            .is_some_and(|f| *f == RareFields::default())
        {
            self.0 = None;
        }
    }
}

impl std::ops::Deref for Rare {
    type Target = RareFields;
    fn deref(&self) -> &RareFields {
        static NONE: OnceLock<RareFields> = OnceLock::new();
        self.0
            .as_deref()
            .unwrap_or_else(|| NONE.get_or_init(RareFields::default))
    }
}

impl std::ops::DerefMut for Rare {
    fn deref_mut(&mut self) -> &mut RareFields {
        self.0.get_or_insert_with(Box::default)
    }
}

impl PartialEq for Rare {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Rare {}

impl Serialize for Rare {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (**self).serialize(s)
    }
}

/// One Service port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PortInfo {
    /// The port's name ("" when unnamed): how slices name their ports. Interned: a
    /// cluster's Services repeat a few names ("http", "dns").
    pub name: Arc<str>,
    /// Port number and protocol, or why they are unusable.
    pub port: Result<(u16, Protocol), PortError>,
    pub node_port: Option<u16>,
    pub target_port: TargetPort,
}

impl PortInfo {
    /// The name, or the number when unnamed, for logs.
    pub fn display(&self) -> std::borrow::Cow<'_, str> {
        match &self.port {
            _ if !self.name.is_empty() => self.name.as_ref().into(),
            Ok((n, _)) => n.to_string().into(),
            Err(_) => "(invalid)".into(),
        }
    }
}

/// A Service port's `targetPort`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum TargetPort {
    Number(i32),
    /// A named port: only slices resolve it.
    Named,
}

/// One EndpointSlice, as the view needs it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SliceInfo {
    /// The Service it belongs to (`kubernetes.io/service-name`); shared with the model's
    /// key of the slice.
    pub service: Option<Arc<str>>,
    /// `IPv4` or `IPv6`; `None` for FQDN slices (not proxied).
    pub ipv4: Option<bool>,
    // Boxed slices: exact size, 8 bytes less each than a vector.
    pub ports: Box<[SlicePort]>,
    pub endpoints: SliceEndpoints,
    /// Endpoint addresses that do not parse, as written.
    pub bad_addresses: Box<[String]>,
    /// Topology hints, by the index of their endpoint in `endpoints`, ascending: only
    /// the endpoints that have any (a pointer in every endpoint was 8 MiB of a million).
    pub hints: Box<[(u32, Hints)]>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`.
    #[serde(skip)]
    pub trigger_time: Option<SystemTime>,
}

/// One port of a slice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SlicePort {
    /// Interned, as `PortInfo::name`.
    pub name: Arc<str>,
    /// `None`: a protocol we do not proxy.
    pub protocol: Option<Protocol>,
    pub port: Option<i32>,
}

/// `hints.forZones` and `hints.forNodes`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Hints {
    pub zones: Vec<Arc<str>>,
    pub nodes: Vec<Arc<str>>,
}

/// Past this many distinct names, new ones are no longer kept (each gets its own copy):
/// the table never shrinks.
const MAX_INTERNED: usize = 65_536;

/// Namespaces, node and zone names, shared by every object and endpoint that names them:
/// a cluster has few of them and a million endpoints may repeat them. Never shrinks
/// (bounded by the cluster's names, and by `MAX_INTERNED`).
pub fn intern(name: &str) -> Arc<str> {
    static NAMES: OnceLock<Mutex<HashSet<Arc<str>>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(n) = names.get(name) {
        return Arc::clone(n);
    }
    let n: Arc<str> = Arc::from(name);
    if names.len() < MAX_INTERNED {
        names.insert(Arc::clone(&n));
    }
    n
}

/// The protocol a port's `protocol` names (TCP when it names none), if we serve it.
pub fn protocol(raw: Option<&str>) -> Option<Protocol> {
    match raw.unwrap_or("TCP") {
        "TCP" => Some(Protocol::Tcp),
        "UDP" => Some(Protocol::Udp),
        "SCTP" => Some(Protocol::Sctp),
        _ => None,
    }
}

impl ServiceInfo {
    /// Reads what the view uses from a Service.
    pub fn from_k8s(svc: &Service) -> Self {
        let proxy_name = svc
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL))
            .cloned();
        let Some(spec) = &svc.spec else {
            return Self {
                rare: Rare::new(RareFields {
                    proxy_name,
                    invalid: Some(ServiceError::NoSpec),
                    ..Default::default()
                }),
                ..Default::default()
            };
        };
        let mut ports: Vec<PortInfo> = spec.ports.iter().flatten().map(port_info).collect();
        let mut info = Self {
            external_name: spec.type_.as_deref() == Some("ExternalName"),
            node_port_type: matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer")),
            internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            external_policy_local: spec.external_traffic_policy.as_deref() == Some("Local"),
            affinity_timeout_s: affinity_timeout(spec),
            ..Default::default()
        };
        let mut rare = RareFields {
            proxy_name,
            health_check_node_port: spec
                .health_check_node_port
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0),
            ..Default::default()
        };
        let whole = check_ports(&mut ports, spec.ports.iter().flatten(), &mut rare.problems)
            .and_then(|()| cluster_ips(spec.cluster_ips.as_ref(), spec.cluster_ip.as_ref()));
        match whole {
            Ok(ips) => info.cluster_ips = ips,
            Err(reason) => {
                rare.invalid = Some(reason);
                info.rare = Rare::new(rare);
                return info;
            }
        }
        // Exact sizes: `collect` over a flattened Option grows by doubling, and at 100k
        // Services the spare room was a quarter of the model.
        ports.shrink_to_fit();
        info.ports = ports;
        let (external_ips, bad) = parse_ips(spec.external_ips.iter().flatten(), "externalIP");
        rare.external_ips = external_ips;
        rare.problems.extend(bad);
        let (lb_ips, bad) = parse_ips(load_balancer_ips(svc).iter(), "load-balancer IP");
        rare.lb_ips = lb_ips;
        rare.problems.extend(bad);
        let (ranges, bad) = parse_cidrs(spec.load_balancer_source_ranges.iter().flatten());
        rare.source_ranges = ranges;
        rare.problems.extend(bad);
        let annotations = svc.metadata.annotations.as_ref();
        if let Some(name) = annotations.and_then(|a| a.get(schedule::SCHEDULER_ANNOTATION)) {
            match schedule::Scheduler::parse(name) {
                Ok((s, note)) => {
                    rare.scheduler = Some(s);
                    rare.problems.extend(note);
                }
                Err(e) => rare.problems.push(format!(
                    "{}: {e}; the node's scheduler is used",
                    schedule::SCHEDULER_ANNOTATION
                )),
            }
        }
        if let Some(text) = annotations.and_then(|a| a.get(lb_mode::LB_MODE_ANNOTATION)) {
            match text.parse() {
                Ok(m) => rare.lb_mode = Some(m),
                Err(e) => rare.problems.push(format!(
                    "{}: {e}; the node's mode is used",
                    lb_mode::LB_MODE_ANNOTATION
                )),
            }
        }
        if let Some(text) = annotations.and_then(|a| a.get(schedule::WEIGHTS_ANNOTATION)) {
            let (weights, bad) = schedule::parse_weights(text);
            rare.weights = weights.into();
            rare.problems.extend(bad);
        }
        info.rare = Rare::new(rare);
        info
    }
}

fn port_info(port: &ServicePort) -> PortInfo {
    PortInfo {
        name: intern(port.name.as_deref().unwrap_or_default()),
        port: port_and_protocol(port),
        node_port: port
            .node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0),
        target_port: match &port.target_port {
            Some(IntOrString::Int(n)) => TargetPort::Number(*n),
            None => TargetPort::Number(port.port),
            Some(IntOrString::String(_)) => TargetPort::Named,
        },
    }
}

fn port_and_protocol(port: &ServicePort) -> Result<(u16, Protocol), PortError> {
    let number = u16::try_from(port.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or(PortError::OutOfRange(port.port))?;
    let protocol =
        protocol(port.protocol.as_deref()).ok_or_else(|| PortError::UnsupportedProtocol {
            port: number,
            protocol: port.protocol.clone().unwrap_or_default(),
        })?;
    Ok((number, protocol))
}

/// The API server's checks of a Service's ports that kube-proxy relies on. A port given
/// twice (per protocol) refuses the Service as a whole; a nodePort out of 1-65535, or
/// given twice (per protocol), costs that port its NodePort alone (left out of `parsed`,
/// described in `problems`), as it would cost kube-proxy only that rule. (The node-port
/// range is this node's setting: the view checks it.)
fn check_ports<'a>(
    parsed: &mut [PortInfo],
    raw: impl Iterator<Item = &'a ServicePort>,
    problems: &mut Vec<String>,
) -> Result<(), ServiceError> {
    let mut seen = std::collections::BTreeSet::new();
    let mut node_ports = std::collections::BTreeMap::new();
    for (port, raw) in parsed.iter_mut().zip(raw) {
        // A bad number or protocol leaves out that port alone (reported where ports are
        // read); the checks here are of the Service as a whole.
        let Ok((number, protocol)) = port.port else {
            continue;
        };
        if !seen.insert((number, protocol)) {
            return Err(ServiceError::PortTwice {
                port: number,
                protocol,
            });
        }
        match raw.node_port {
            None | Some(0) => {}
            Some(n) => {
                let Some(n) = u16::try_from(n).ok().filter(|n| *n != 0) else {
                    problems.push(format!(
                        "port {}: nodePort {n} out of range 1-65535; its NodePort is not \
                         programmed",
                        port.display()
                    ));
                    continue;
                };
                if let Some(first) = node_ports.get(&(n, protocol)) {
                    problems.push(format!(
                        "port {}: nodePort {n}/{protocol} given twice (port {first} has it); \
                         its NodePort is not programmed",
                        port.display()
                    ));
                    port.node_port = None;
                    continue;
                }
                node_ports.insert((n, protocol), port.display().into_owned());
            }
        }
    }
    Ok(())
}

/// The Service's cluster IPs (dual-stack `clusterIPs`, else `clusterIP`); empty for a
/// headless Service.
fn cluster_ips(
    cluster_ips: Option<&Vec<String>>,
    cluster_ip: Option<&String>,
) -> Result<Vec<IpAddr>, ServiceError> {
    let raw: Vec<&String> = match (cluster_ips, cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
        (_, Some(ip)) => vec![ip],
        _ => vec![],
    };
    // Headless: "None" (or nothing) alone; beside an address it is invalid, as the API
    // server says.
    if raw.iter().all(|ip| ip.is_empty() || *ip == "None") {
        return Ok(vec![]);
    }
    // Exact size: a pushed vector holds room for four (68 bytes for one address).
    let mut ips = Vec::with_capacity(raw.len());
    for ip in raw {
        let parsed = sloppy::parse_ip(ip).map_err(|reason| ServiceError::InvalidClusterIp {
            ip: ip.clone(),
            reason,
        })?;
        if !is_unicast_service_ip(parsed) {
            return Err(ServiceError::NotUnicast(ip.clone()));
        }
        if ips.contains(&parsed) {
            return Err(ServiceError::ClusterIpTwice(ip.clone()));
        }
        ips.push(parsed);
    }
    if ips.len() == 2 && ips[0].is_ipv4() == ips[1].is_ipv4() {
        return Err(ServiceError::TwoOfOneFamily);
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

/// Why the API server refuses `ip` as an endpoint address, if it does (Kubernetes'
/// `ValidateEndpointIP`, formerly `ValidateNonSpecialIP`: unspecified, loopback and
/// link-local addresses make no sense as endpoints, and link-local ones are the node's
/// own business — 169.254.169.254 is the cloud's metadata service). IPv4-mapped IPv6
/// addresses are judged as their IPv4 address, as Go's `net.IP` methods judge them.
pub fn special_endpoint_ip(ip: IpAddr) -> Option<SpecialIp> {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let (unspecified, loopback, link_local, link_local_multicast) = match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            (
                v4.is_unspecified(),
                v4.is_loopback(),
                v4.is_link_local(),
                o[0] == 224 && o[1] == 0 && o[2] == 0,
            )
        }
        IpAddr::V6(v6) => {
            let o = v6.octets();
            (
                v6.is_unspecified(),
                v6.is_loopback(),
                v6.is_unicast_link_local(),
                // Go's IsLinkLocalMulticast: multicast of link-local scope (ff02::/16,
                // and the same scope with other flags).
                o[0] == 0xff && o[1] & 0x0f == 0x02,
            )
        }
    };
    if unspecified {
        Some(SpecialIp::Unspecified)
    } else if loopback {
        Some(SpecialIp::Loopback)
    } else if link_local {
        Some(SpecialIp::LinkLocal)
    } else if link_local_multicast {
        Some(SpecialIp::LinkLocalMulticast)
    } else {
        None
    }
}

/// Parses a Service's extra VIPs (external and load-balancer IPs); invalid ones, and
/// those no Service may have (an external IP of 127.0.0.1 would take over the node's own
/// loopback traffic), are left out and described.
fn parse_ips<'a>(raw: impl Iterator<Item = &'a String>, what: &str) -> (Vec<IpAddr>, Vec<String>) {
    let mut ips = Vec::new();
    let mut bad = Vec::new();
    for s in raw {
        match sloppy::parse_ip(s) {
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

/// `loadBalancerSourceRanges`; the invalid ones are left out and described.
fn parse_cidrs<'a>(raw: impl Iterator<Item = &'a String>) -> (Vec<ipnet::IpNet>, Vec<String>) {
    let mut nets = Vec::new();
    let mut bad = Vec::new();
    for s in raw {
        match sloppy::parse_cidr(s.trim()) {
            Ok(n) => nets.push(n),
            Err(e) => bad.push(format!("invalid loadBalancerSourceRange {s:?}: {e}")),
        }
    }
    (nets, bad)
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

fn affinity_timeout(spec: &k8s_openapi::api::core::v1::ServiceSpec) -> Option<u32> {
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

impl SliceInfo {
    /// Reads what the view uses from an EndpointSlice.
    pub fn from_k8s(slice: &EndpointSlice) -> Self {
        let mut bad_addresses = Vec::new();
        let mut hinted: Vec<(u32, Hints)> = Vec::new();
        let endpoints: Vec<EndpointInfo> = slice
            .endpoints
            .iter()
            .filter_map(|ep| {
                // kube-proxy uses an endpoint's first address only (the others are the
                // same pod's, and the API requires at least one).
                let addr = ep.addresses.first()?;
                let Ok(ip) = sloppy::parse_ip(addr) else {
                    bad_addresses.push(addr.clone());
                    return None;
                };
                let cond = ep.conditions.as_ref();
                let hints = ep.hints.as_ref().map(|h| Hints {
                    zones: h
                        .for_zones
                        .iter()
                        .flatten()
                        .map(|z| intern(&z.name))
                        .collect(),
                    nodes: h
                        .for_nodes
                        .iter()
                        .flatten()
                        .map(|n| intern(&n.name))
                        .collect(),
                });
                Some((
                    EndpointInfo {
                        ip,
                        // A missing condition means "ready"/"serving" (discovery.k8s.io/v1),
                        // each on its own, as kube-proxy's endpointslicecache reads them.
                        ready: cond.and_then(|c| c.ready).unwrap_or(true),
                        serving: cond.and_then(|c| c.serving).unwrap_or(true),
                        terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
                        node: ep.node_name.as_deref().map(NodeName::new),
                    },
                    hints.filter(|h| !h.zones.is_empty() || !h.nodes.is_empty()),
                ))
            })
            .enumerate()
            .map(|(i, (ep, hints))| {
                if let Some(h) = hints {
                    hinted.push((i as u32, h));
                }
                ep
            })
            .collect();
        let mut ports: Vec<SlicePort> = slice
            .ports
            .iter()
            .flatten()
            .map(|p| SlicePort {
                name: intern(p.name.as_deref().unwrap_or_default()),
                protocol: protocol(p.protocol.as_deref()),
                port: p.port,
            })
            .collect();
        ports.shrink_to_fit();
        Self {
            service: slice
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(SERVICE_NAME_LABEL))
                .map(|s| Arc::from(s.as_str())),
            ipv4: match slice.address_type.as_str() {
                "IPv4" => Some(true),
                "IPv6" => Some(false),
                _ => None,
            },
            ports: ports.into(),
            endpoints: endpoints.into(),
            bad_addresses: bad_addresses.into(),
            hints: hinted.into(),
            trigger_time: slice
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(TRIGGER_TIME))
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .map(SystemTime::from),
        }
    }
}

impl SliceInfo {
    /// The topology hints of endpoint `i`, if it has any.
    pub fn hints_of(&self, i: usize) -> Option<&Hints> {
        self.hints
            .binary_search_by_key(&i, |(at, _)| *at as usize)
            .ok()
            .map(|k| &self.hints[k].1)
    }

    pub fn zone_hints(&self, i: usize) -> &[Arc<str>] {
        self.hints_of(i).map_or(&[], |h| &h.zones)
    }

    pub fn node_hints(&self, i: usize) -> &[Arc<str>] {
        self.hints_of(i).map_or(&[], |h| &h.nodes)
    }
}

#[cfg(test)]
mod tests;
