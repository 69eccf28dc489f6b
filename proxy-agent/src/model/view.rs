//! Model → node view, with kube-proxy's semantics for ClusterIP Services.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
};

use k8s_openapi::{
    api::{
        core::v1::{Service, ServicePort},
        discovery::v1::{Endpoint, EndpointSlice},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};

use super::{ClusterModel, Frontend, FrontendState, NodeView, ObjectRef, Protocol};

/// Label that ties an EndpointSlice to its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
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
/// endpoint address) are left out and reported; everything else still applies.
pub fn node_view(model: &ClusterModel) -> (NodeView, Vec<Rejection>) {
    let mut view = NodeView::new();
    let mut rejected = Vec::new();
    for (sref, svc) in &model.services {
        let reject = |reason: String| Rejection {
            kind: "Service",
            object: sref.clone(),
            reason,
        };
        let Some(spec) = &svc.spec else {
            rejected.push(reject("no spec".into()));
            continue;
        };
        // ExternalName and headless Services are not proxied (as in kube-proxy).
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let ips = match cluster_ips(svc) {
            Ok(ips) if ips.is_empty() => continue,
            Ok(ips) => ips,
            Err(reason) => {
                rejected.push(reject(reason));
                continue;
            }
        };
        let affinity = affinity_timeout(svc);
        let slices: Vec<&EndpointSlice> = model
            .slices
            .iter()
            .filter(|(r, s)| r.namespace == sref.namespace && owner(s) == Some(&sref.name))
            .map(|(_, s)| s)
            .collect();
        for port in spec.ports.iter().flatten() {
            let (number, protocol) = match port_and_protocol(port) {
                Ok(p) => p,
                Err(reason) => {
                    rejected.push(reject(reason));
                    continue;
                }
            };
            let port_name = port.name.clone().unwrap_or_default();
            for &ip in &ips {
                let (backends, bad) = endpoints_for(&slices, &port_name, protocol, ip, port);
                rejected.extend(bad);
                view.insert(
                    Frontend {
                        ip,
                        port: number,
                        protocol,
                    },
                    FrontendState {
                        service: format!("{sref}:{}", display_port(port)),
                        backends,
                        affinity_timeout_s: affinity,
                    },
                );
            }
        }
    }
    (view, rejected)
}

fn display_port(port: &ServicePort) -> String {
    match &port.name {
        Some(n) if !n.is_empty() => n.clone(),
        _ => port.port.to_string(),
    }
}

/// The Service's cluster IPs (dual-stack `clusterIPs`, else `clusterIP`); empty for a
/// headless Service.
fn cluster_ips(svc: &Service) -> Result<Vec<IpAddr>, String> {
    let spec = svc.spec.as_ref().ok_or("no spec")?;
    let raw: Vec<&String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
        (_, Some(ip)) => vec![ip],
        _ => vec![],
    };
    let mut ips = Vec::new();
    for ip in raw {
        if ip.is_empty() || ip == "None" {
            return Ok(vec![]);
        }
        ips.push(
            ip.parse::<IpAddr>()
                .map_err(|e| format!("invalid clusterIP {ip:?}: {e}"))?,
        );
    }
    Ok(ips)
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
        other => Err(other.to_string()),
    }
}

fn affinity_timeout(svc: &Service) -> Option<u32> {
    let spec = svc.spec.as_ref()?;
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

/// Endpoints of one Service port for one IP family, merged over all slices and
/// de-duplicated: ready ones, or — when none is ready — serving and terminating ones.
fn endpoints_for(
    slices: &[&EndpointSlice],
    port_name: &str,
    protocol: Protocol,
    vip: IpAddr,
    svc_port: &ServicePort,
) -> (BTreeSet<SocketAddr>, Vec<super::Rejection>) {
    let mut ready = BTreeSet::new();
    let mut terminating = BTreeSet::new();
    let mut bad = Vec::new();
    let family = if vip.is_ipv4() { "IPv4" } else { "IPv6" };
    for slice in slices {
        if slice.address_type != family {
            continue;
        }
        let Some(target_port) = slice_port(slice, port_name, protocol, svc_port) else {
            continue;
        };
        for ep in &slice.endpoints {
            for addr in &ep.addresses {
                let Ok(ip) = addr.parse::<IpAddr>() else {
                    bad.push(super::Rejection {
                        kind: "EndpointSlice",
                        object: ObjectRef::of(&slice.metadata),
                        reason: format!("invalid endpoint address {addr:?}"),
                    });
                    continue;
                };
                if ip.is_ipv4() != vip.is_ipv4() {
                    continue;
                }
                let sa = SocketAddr::new(ip, target_port);
                if is_ready(ep) {
                    ready.insert(sa);
                } else if is_serving_terminating(ep) {
                    terminating.insert(sa);
                }
            }
        }
    }
    (if ready.is_empty() { terminating } else { ready }, bad)
}

/// The backend port for a Service port in one slice: the slice port with the same name
/// and protocol (this is how a named targetPort arrives resolved), else a numeric
/// targetPort.
fn slice_port(
    slice: &EndpointSlice,
    port_name: &str,
    protocol: Protocol,
    svc_port: &ServicePort,
) -> Option<u16> {
    let matched = slice.ports.iter().flatten().find(|p| {
        p.name.as_deref().unwrap_or("") == port_name
            && self::protocol(p.protocol.as_deref()).ok() == Some(protocol)
    })?;
    let number = matched.port.or(match &svc_port.target_port {
        Some(IntOrString::Int(n)) => Some(*n),
        None => Some(svc_port.port),
        Some(IntOrString::String(_)) => None,
    })?;
    u16::try_from(number).ok().filter(|p| *p != 0)
}

fn is_ready(ep: &Endpoint) -> bool {
    // A missing condition means "ready" (discovery.k8s.io/v1 semantics).
    ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true)
}

fn is_serving_terminating(ep: &Endpoint) -> bool {
    let Some(c) = ep.conditions.as_ref() else {
        return false;
    };
    c.serving.unwrap_or(false) && c.terminating.unwrap_or(false)
}

#[cfg(test)]
#[path = "view_tests.rs"]
mod tests;
