//! The compact model as wire messages, and back. Writing never fails; reading checks
//! what a message could get wrong (an address of the wrong length, an enum value this
//! version does not know, a prefix longer than its address), so a bad message is
//! refused whole rather than half applied.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, UNIX_EPOCH},
};

use crate::model::{
    NodeInfo, ObjectRef, Protocol,
    error::PortError,
    lb_mode::LbMode,
    objects::{
        EndpointInfo, Hints, NodeName, PortInfo, Rare, RareFields, ServiceInfo, SliceInfo,
        SlicePort, TargetPort, intern,
    },
    schedule::Scheduler,
    service_error::ServiceError,
};

use super::v1;

/// Why a message cannot be read into the model.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("{0}: missing")]
    Missing(&'static str),
    #[error("an address of {0} bytes (4 or 16 expected)")]
    AddressLength(usize),
    #[error("prefix length {0} longer than its address")]
    Prefix(u32),
    #[error("{what} {value} unknown to this version")]
    Enum { what: &'static str, value: i32 },
    #[error("{what} {value} out of range")]
    Range { what: &'static str, value: u64 },
}

pub fn ip_to_wire(ip: IpAddr) -> v1::Ip {
    v1::Ip {
        addr: match ip {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        },
    }
}

pub fn ip_from_wire(ip: &v1::Ip) -> Result<IpAddr, DecodeError> {
    addr_from_bytes(&ip.addr)
}

fn addr_from_bytes(b: &[u8]) -> Result<IpAddr, DecodeError> {
    if let Ok(a) = <[u8; 4]>::try_from(b) {
        return Ok(IpAddr::V4(Ipv4Addr::from(a)));
    }
    if let Ok(a) = <[u8; 16]>::try_from(b) {
        return Ok(IpAddr::V6(Ipv6Addr::from(a)));
    }
    Err(DecodeError::AddressLength(b.len()))
}

fn ips_from_wire(ips: &[v1::Ip]) -> Result<Vec<IpAddr>, DecodeError> {
    ips.iter().map(ip_from_wire).collect()
}

fn cidr_to_wire(net: &ipnet::IpNet) -> v1::Cidr {
    v1::Cidr {
        addr: ip_to_wire(net.addr()).addr,
        prefix_len: u32::from(net.prefix_len()),
    }
}

fn cidr_from_wire(c: &v1::Cidr) -> Result<ipnet::IpNet, DecodeError> {
    let ip = addr_from_bytes(&c.addr)?;
    let len = u8::try_from(c.prefix_len).map_err(|_| DecodeError::Prefix(c.prefix_len))?;
    ipnet::IpNet::new(ip, len).map_err(|_| DecodeError::Prefix(c.prefix_len))
}

pub fn ref_to_wire(r: &ObjectRef) -> v1::ObjectRef {
    v1::ObjectRef {
        namespace: r.namespace.to_string(),
        name: r.name.to_string(),
    }
}

pub fn ref_from_wire(r: Option<&v1::ObjectRef>) -> Result<ObjectRef, DecodeError> {
    let r = r.ok_or(DecodeError::Missing("ref"))?;
    Ok(ObjectRef::new(&r.namespace, &r.name))
}

fn protocol_to_wire(p: Option<Protocol>) -> i32 {
    (match p {
        None => v1::Protocol::Unspecified,
        Some(Protocol::Tcp) => v1::Protocol::Tcp,
        Some(Protocol::Udp) => v1::Protocol::Udp,
        Some(Protocol::Sctp) => v1::Protocol::Sctp,
    }) as i32
}

fn protocol_from_wire(value: i32) -> Result<Option<Protocol>, DecodeError> {
    match v1::Protocol::try_from(value) {
        Ok(v1::Protocol::Unspecified) => Ok(None),
        Ok(v1::Protocol::Tcp) => Ok(Some(Protocol::Tcp)),
        Ok(v1::Protocol::Udp) => Ok(Some(Protocol::Udp)),
        Ok(v1::Protocol::Sctp) => Ok(Some(Protocol::Sctp)),
        Err(_) => Err(DecodeError::Enum {
            what: "protocol",
            value,
        }),
    }
}

/// An optional setting as the wire's enum: `all`'s order from 1, 0 for the node's own
/// (schedulers, load-balancer modes).
fn choice_to_wire<T: PartialEq + Copy>(all: &[T], v: Option<T>) -> i32 {
    v.and_then(|v| all.iter().position(|x| *x == v))
        .map_or(0, |i| i as i32 + 1)
}

fn choice_from_wire<T: Copy>(
    all: &[T],
    what: &'static str,
    value: i32,
) -> Result<Option<T>, DecodeError> {
    if value == 0 {
        return Ok(None);
    }
    usize::try_from(value - 1)
        .ok()
        .and_then(|i| all.get(i).copied())
        .map(Some)
        .ok_or(DecodeError::Enum { what, value })
}

fn u16_from_wire(what: &'static str, v: u32) -> Result<u16, DecodeError> {
    u16::try_from(v).map_err(|_| DecodeError::Range {
        what,
        value: u64::from(v),
    })
}

pub fn service_to_wire(r: &ObjectRef, s: &ServiceInfo) -> v1::Service {
    v1::Service {
        r#ref: Some(ref_to_wire(r)),
        proxy_name: s.rare.proxy_name.clone(),
        invalid: s.rare.invalid.as_ref().map(ToString::to_string),
        external_name: s.external_name,
        cluster_ips: s.cluster_ips.iter().copied().map(ip_to_wire).collect(),
        external_ips: s
            .rare
            .external_ips
            .iter()
            .copied()
            .map(ip_to_wire)
            .collect(),
        lb_ips: s.rare.lb_ips.iter().copied().map(ip_to_wire).collect(),
        source_ranges: s.rare.source_ranges.iter().map(cidr_to_wire).collect(),
        problems: s.rare.problems.clone(),
        ports: s.ports.iter().map(port_to_wire).collect(),
        node_port_type: s.node_port_type,
        internal_local: s.internal_local,
        external_policy_local: s.external_policy_local,
        affinity_timeout_s: s.affinity_timeout_s,
        health_check_node_port: s.rare.health_check_node_port.map(u32::from),
        scheduler: choice_to_wire(&Scheduler::ALL, s.rare.scheduler),
        lb_mode: choice_to_wire(&LbMode::ALL, s.rare.lb_mode),
        weights: s
            .rare
            .weights
            .iter()
            .map(|(ip, w)| v1::Weight {
                ip: Some(ip_to_wire(*ip)),
                weight: *w,
            })
            .collect(),
    }
}

fn port_to_wire(p: &PortInfo) -> v1::ServicePort {
    let (port, protocol, invalid) = match &p.port {
        Ok((n, proto)) => (u32::from(*n), protocol_to_wire(Some(*proto)), None),
        Err(why) => (0, 0, Some(why.to_string())),
    };
    v1::ServicePort {
        name: p.name.to_string(),
        // Derived on this side (`PortInfo::display`); still sent for older peers.
        display: p.display().into_owned(),
        port,
        protocol,
        invalid,
        node_port: p.node_port.map(u32::from),
        target_port: Some(match p.target_port {
            TargetPort::Number(n) => v1::service_port::TargetPort::Number(n),
            TargetPort::Named => v1::service_port::TargetPort::Named(true),
        }),
    }
}

pub fn service_from_wire(s: &v1::Service) -> Result<(ObjectRef, ServiceInfo), DecodeError> {
    let r = ref_from_wire(s.r#ref.as_ref())?;
    let weights = s
        .weights
        .iter()
        .map(|w| {
            let ip = ip_from_wire(w.ip.as_ref().ok_or(DecodeError::Missing("weight ip"))?)?;
            Ok((ip, w.weight))
        })
        .collect::<Result<BTreeMap<_, _>, DecodeError>>()?;
    let rare = RareFields {
        proxy_name: s.proxy_name.clone(),
        invalid: s.invalid.clone().map(ServiceError::Reported),
        external_ips: ips_from_wire(&s.external_ips)?,
        lb_ips: ips_from_wire(&s.lb_ips)?,
        source_ranges: s
            .source_ranges
            .iter()
            .map(cidr_from_wire)
            .collect::<Result<_, _>>()?,
        problems: s.problems.clone(),
        health_check_node_port: s
            .health_check_node_port
            .map(|p| u16_from_wire("healthCheckNodePort", p))
            .transpose()?,
        scheduler: choice_from_wire(&Scheduler::ALL, "scheduler", s.scheduler)?,
        lb_mode: choice_from_wire(&LbMode::ALL, "load-balancer mode", s.lb_mode)?,
        weights: weights.into(),
    };
    let info = ServiceInfo {
        external_name: s.external_name,
        cluster_ips: ips_from_wire(&s.cluster_ips)?,
        ports: s
            .ports
            .iter()
            .map(port_from_wire)
            .collect::<Result<_, _>>()?,
        node_port_type: s.node_port_type,
        internal_local: s.internal_local,
        external_policy_local: s.external_policy_local,
        affinity_timeout_s: s.affinity_timeout_s,
        rare: Rare::new(rare),
    };
    Ok((r, info))
}

fn port_from_wire(p: &v1::ServicePort) -> Result<PortInfo, DecodeError> {
    let port = match &p.invalid {
        Some(why) => Err(PortError::Reported(why.clone())),
        None => {
            let proto = protocol_from_wire(p.protocol)?.ok_or(DecodeError::Enum {
                what: "service port protocol",
                value: p.protocol,
            })?;
            Ok((u16_from_wire("port", p.port)?, proto))
        }
    };
    Ok(PortInfo {
        name: intern(&p.name),
        port,
        node_port: p
            .node_port
            .map(|n| u16_from_wire("nodePort", n))
            .transpose()?,
        target_port: match p.target_port {
            Some(v1::service_port::TargetPort::Number(n)) => TargetPort::Number(n),
            Some(v1::service_port::TargetPort::Named(_)) => TargetPort::Named,
            None => return Err(DecodeError::Missing("targetPort")),
        },
    })
}

pub fn slice_to_wire(r: &ObjectRef, s: &SliceInfo) -> v1::Slice {
    v1::Slice {
        r#ref: Some(ref_to_wire(r)),
        service: s.service.as_deref().map(str::to_string),
        family: (match s.ipv4 {
            None => v1::AddressFamily::Unspecified,
            Some(true) => v1::AddressFamily::Ipv4,
            Some(false) => v1::AddressFamily::Ipv6,
        }) as i32,
        ports: s
            .ports
            .iter()
            .map(|p| v1::SlicePort {
                name: p.name.to_string(),
                protocol: protocol_to_wire(p.protocol),
                port: p.port,
            })
            .collect(),
        endpoints: s
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| v1::Endpoint {
                ip: Some(ip_to_wire(e.ip)),
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                node: e.node.map(|n| n.as_str().to_string()),
                has_hints: s.hints_of(i).is_some(),
                hint_zones: s.zone_hints(i).iter().map(|z| z.to_string()).collect(),
                hint_nodes: s.node_hints(i).iter().map(|n| n.to_string()).collect(),
            })
            .collect(),
        bad_addresses: s.bad_addresses.to_vec(),
        trigger_time_unix_nanos: s.trigger_time.and_then(|t| {
            let since = t.duration_since(UNIX_EPOCH).ok()?;
            i64::try_from(since.as_nanos()).ok()
        }),
    }
}

pub fn slice_from_wire(s: &v1::Slice) -> Result<(ObjectRef, SliceInfo), DecodeError> {
    let r = ref_from_wire(s.r#ref.as_ref())?;
    let ipv4 = match v1::AddressFamily::try_from(s.family) {
        Ok(v1::AddressFamily::Unspecified) => None,
        Ok(v1::AddressFamily::Ipv4) => Some(true),
        Ok(v1::AddressFamily::Ipv6) => Some(false),
        Err(_) => {
            return Err(DecodeError::Enum {
                what: "address family",
                value: s.family,
            });
        }
    };
    let ports = s
        .ports
        .iter()
        .map(|p| {
            Ok(SlicePort {
                name: intern(&p.name),
                protocol: protocol_from_wire(p.protocol)?,
                port: p.port,
            })
        })
        .collect::<Result<_, DecodeError>>()?;
    let mut hints: Vec<(u32, Hints)> = Vec::new();
    let endpoints = s
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let ip = ip_from_wire(e.ip.as_ref().ok_or(DecodeError::Missing("endpoint ip"))?)?;
            let ep = EndpointInfo {
                ip,
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                node: e.node.as_deref().map(NodeName::new),
            };
            if e.has_hints {
                hints.push((
                    i as u32,
                    Hints {
                        zones: e.hint_zones.iter().map(|z| intern(z)).collect(),
                        nodes: e.hint_nodes.iter().map(|n| intern(n)).collect(),
                    },
                ));
            }
            Ok(ep)
        })
        .collect::<Result<_, DecodeError>>()?;
    let trigger_time = match s.trigger_time_unix_nanos {
        None => None,
        Some(n) => {
            let n = u64::try_from(n).map_err(|_| DecodeError::Range {
                what: "trigger time",
                value: n as u64,
            })?;
            Some(UNIX_EPOCH + Duration::from_nanos(n))
        }
    };
    let info = SliceInfo {
        service: s.service.as_deref().map(std::sync::Arc::from),
        ipv4,
        ports,
        endpoints,
        bad_addresses: s.bad_addresses.clone().into(),
        hints: hints.into(),
        trigger_time,
    };
    Ok((r, info))
}

pub fn node_to_wire(n: &NodeInfo) -> v1::Node {
    v1::Node {
        name: n.name.clone(),
        labels: n.labels.clone().into_iter().collect(),
        addresses: n.addresses.iter().copied().map(ip_to_wire).collect(),
        draining: n.draining,
        pod_cidrs: n.pod_cidrs.iter().map(cidr_to_wire).collect(),
    }
}

/// A Node as its peers see it: its name and addresses, nothing else.
pub fn peer_to_wire(n: &NodeInfo) -> v1::Node {
    v1::Node {
        name: n.name.clone(),
        addresses: n.addresses.iter().copied().map(ip_to_wire).collect(),
        ..Default::default()
    }
}

/// A peer back: its name (which keys it) and addresses.
pub fn peer_from_wire(n: &v1::Node) -> Result<NodeInfo, DecodeError> {
    if n.name.is_empty() {
        return Err(DecodeError::Missing("set_peer.name"));
    }
    Ok(NodeInfo {
        name: n.name.clone(),
        addresses: ips_from_wire(&n.addresses)?,
        ..Default::default()
    })
}

pub fn node_from_wire(n: &v1::Node) -> Result<NodeInfo, DecodeError> {
    Ok(NodeInfo {
        name: n.name.clone(),
        labels: n.labels.clone().into_iter().collect(),
        addresses: ips_from_wire(&n.addresses)?,
        draining: n.draining,
        pod_cidrs: n
            .pod_cidrs
            .iter()
            .map(cidr_from_wire)
            .collect::<Result<_, _>>()?,
    })
}
