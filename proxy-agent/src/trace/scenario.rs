//! The packet-scenario format (`../shared/scenarios/README.md`): node settings, objects,
//! packets and what must happen to them. Parsing validates everything — a malformed file
//! is refused with the case and the field that is wrong, before anything is loaded.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde::Deserialize;

use crate::model::{ClusterModel, NodeInfo, Protocol, ViewConfig};

/// What a packet's fate is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Dnat,
    Drop,
    Reject,
    Accept,
    Local,
    /// The node learnt a direct-server-return flow from the packet's option (`dsr`):
    /// its destination's reply left as the frontend the option names.
    Learned,
}

impl Verdict {
    fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "dnat" => Verdict::Dnat,
            "drop" => Verdict::Drop,
            "reject" => Verdict::Reject,
            "accept" => Verdict::Accept,
            "local" => Verdict::Local,
            "learned" => Verdict::Learned,
            other => return Err(format!("unknown verdict {other:?}")),
        })
    }
}

/// The expected outcome of one packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    pub verdict: Verdict,
    pub endpoints: Vec<SocketAddr>,
    pub masquerade: Option<bool>,
}

/// One packet to run.
#[derive(Clone, Debug)]
pub struct Packet {
    pub name: String,
    pub protocol: Protocol,
    pub src: IpAddr,
    pub src_port: Option<u16>,
    pub dst: SocketAddr,
    /// The frontend a direct-server-return option (IPv6: header) in the packet names,
    /// as if another node had sent it on.
    pub dsr: Option<SocketAddr>,
    pub expect: Option<Expect>,
}

/// Node settings, after the file's defaults and a case's overrides.
#[derive(Clone, Debug, Default)]
pub struct Node {
    pub info: NodeInfo,
    pub view: ViewConfig,
}

/// One case: a node, its objects, its packets.
#[derive(Clone, Debug)]
pub struct Case {
    pub id: String,
    pub node: Node,
    pub model: ClusterModel,
    pub packets: Vec<Packet>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    node: serde_json::Map<String, serde_json::Value>,
    cases: Vec<RawCase>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCase {
    id: String,
    #[serde(default)]
    node: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    objects: RawObjects,
    packets: Vec<serde_json::Value>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawObjects {
    #[serde(default)]
    services: Vec<serde_json::Value>,
    #[serde(default)]
    endpointslices: Vec<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawNode {
    node_name: Option<String>,
    #[serde(rename = "nodeIPs")]
    node_ips: Option<Vec<String>>,
    labels: Option<BTreeMap<String, String>>,
    #[serde(rename = "clusterCIDRs")]
    cluster_cidrs: Option<Vec<String>>,
    local_detector: Option<String>,
    masquerade_all: Option<bool>,
    node_port_addresses: Option<Vec<String>>,
    localhost_node_ports: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPacket {
    name: String,
    proto: String,
    src_ip: String,
    #[serde(default)]
    src_port: Option<u16>,
    dst_ip: String,
    dst_port: u32,
    #[serde(default)]
    dsr: Option<String>,
    #[serde(default)]
    expect: Option<RawExpect>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExpect {
    verdict: String,
    #[serde(default)]
    endpoints: Vec<String>,
    #[serde(default)]
    masquerade: Option<bool>,
}

/// Parses and validates a scenario file. Errors name the case and the field.
pub fn parse(text: &str) -> Result<Vec<Case>, String> {
    let raw: RawFile = serde_json::from_str(text).map_err(|e| format!("scenario file: {e}"))?;
    let mut cases = Vec::new();
    for (i, rc) in raw.cases.into_iter().enumerate() {
        let at = |field: &str, msg: String| format!("case {:?} (#{i}): {field}: {msg}", rc.id);
        let mut merged = raw.node.clone();
        merged.extend(rc.node.clone());
        let node = node_settings(merged).map_err(|e| at("node", e))?;
        let mut model = ClusterModel::default();
        for (j, v) in rc.objects.services.iter().enumerate() {
            let svc: Service = serde_json::from_value(v.clone())
                .map_err(|e| at(&format!("objects.services[{j}]"), e.to_string()))?;
            model.add_service(&svc);
        }
        for (j, v) in rc.objects.endpointslices.iter().enumerate() {
            let slice: EndpointSlice = serde_json::from_value(v.clone())
                .map_err(|e| at(&format!("objects.endpointslices[{j}]"), e.to_string()))?;
            model.add_slice(&slice);
        }
        let mut packets = Vec::new();
        for (j, v) in rc.packets.iter().enumerate() {
            let field = format!("packets[{j}]");
            let rp: RawPacket =
                serde_json::from_value(v.clone()).map_err(|e| at(&field, e.to_string()))?;
            packets.push(packet(rp).map_err(|e| at(&field, e))?);
        }
        cases.push(Case {
            id: rc.id,
            node,
            model,
            packets,
        });
    }
    Ok(cases)
}

fn node_settings(raw: serde_json::Map<String, serde_json::Value>) -> Result<Node, String> {
    let raw: RawNode =
        serde_json::from_value(serde_json::Value::Object(raw)).map_err(|e| e.to_string())?;
    let ips = |list: Option<Vec<String>>, field: &str| -> Result<Vec<IpAddr>, String> {
        list.unwrap_or_default()
            .iter()
            .map(|s| s.parse().map_err(|e| format!("{field}: {s:?}: {e}")))
            .collect()
    };
    let nets = |list: Option<Vec<String>>, field: &str| -> Result<Vec<ipnet::IpNet>, String> {
        list.unwrap_or_default()
            .iter()
            .map(|s| s.parse().map_err(|e| format!("{field}: {s:?}: {e}")))
            .collect()
    };
    let cluster_cidrs = nets(raw.cluster_cidrs, "clusterCIDRs")?;
    let pod_cidrs = match raw.local_detector.as_deref().unwrap_or("ClusterCIDR") {
        "ClusterCIDR" => cluster_cidrs,
        "None" => Vec::new(),
        other => return Err(format!("localDetector: unknown {other:?}")),
    };
    Ok(Node {
        info: NodeInfo {
            name: raw.node_name.unwrap_or_else(|| "node-a".into()),
            labels: raw.labels.unwrap_or_default(),
            addresses: ips(raw.node_ips, "nodeIPs")?,
            ..NodeInfo::default()
        },
        view: ViewConfig {
            pod_cidrs,
            masquerade_all: raw.masquerade_all.unwrap_or(false),
            node_port_addresses: nets(raw.node_port_addresses, "nodePortAddresses")?,
            localhost_node_ports: raw.localhost_node_ports.unwrap_or(true),
            ..ViewConfig::default()
        },
    })
}

fn packet(rp: RawPacket) -> Result<Packet, String> {
    let protocol = match rp.proto.as_str() {
        "TCP" | "tcp" => Protocol::Tcp,
        "UDP" | "udp" => Protocol::Udp,
        "SCTP" | "sctp" => Protocol::Sctp,
        other => return Err(format!("proto: unsupported {other:?}")),
    };
    let src: IpAddr = rp
        .src_ip
        .parse()
        .map_err(|e| format!("src_ip: {:?}: {e}", rp.src_ip))?;
    let dst_ip: IpAddr = rp
        .dst_ip
        .parse()
        .map_err(|e| format!("dst_ip: {:?}: {e}", rp.dst_ip))?;
    if src.is_ipv4() != dst_ip.is_ipv4() {
        return Err("src_ip and dst_ip are of different families".into());
    }
    let dst_port = u16::try_from(rp.dst_port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("dst_port: {} out of range 1-65535", rp.dst_port))?;
    let dsr = match &rp.dsr {
        None => None,
        Some(text) => {
            let fe: SocketAddr = text.parse().map_err(|e| format!("dsr: {text:?}: {e}"))?;
            if fe.is_ipv4() != dst_ip.is_ipv4() {
                return Err("dsr and dst_ip are of different families".into());
            }
            if protocol == Protocol::Sctp {
                return Err("dsr: TCP and UDP only".into());
            }
            Some(fe)
        }
    };
    let expect = match rp.expect {
        None => None,
        Some(e) => Some(Expect {
            verdict: Verdict::parse(&e.verdict).map_err(|m| format!("expect.verdict: {m}"))?,
            endpoints: e
                .endpoints
                .iter()
                .map(|s| {
                    s.parse()
                        .map_err(|err| format!("expect.endpoints: {s:?}: {err}"))
                })
                .collect::<Result<_, String>>()?,
            masquerade: e.masquerade,
        }),
    };
    Ok(Packet {
        name: rp.name,
        protocol,
        src,
        src_port: rp.src_port,
        dst: SocketAddr::new(dst_ip, dst_port),
        dsr,
        expect,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_files_name_the_case_and_field() {
        let good_packet = r#"{"name": "p", "proto": "TCP", "src_ip": "10.0.0.1", "dst_ip": "10.96.0.1", "dst_port": 80}"#;
        let cases = [
            (
                r#"{"cases": [{"id": "a", "packets": [{"name": "p", "proto": "ICMP", "src_ip": "10.0.0.1", "dst_ip": "10.96.0.1", "dst_port": 80}]}]}"#,
                r#"case "a" (#0): packets[0]: proto"#,
            ),
            (
                r#"{"cases": [{"id": "b", "packets": [{"name": "p", "proto": "TCP", "src_ip": "10.0.0.999", "dst_ip": "10.96.0.1", "dst_port": 80}]}]}"#,
                "packets[0]: src_ip",
            ),
            (
                r#"{"cases": [{"id": "c", "packets": [{"name": "p", "proto": "TCP", "src_ip": "10.0.0.1", "dst_ip": "10.96.0.1", "dst_port": 70000}]}]}"#,
                "dst_port",
            ),
            (
                r#"{"cases": [{"id": "d", "packets": [{"name": "p", "proto": "TCP", "src_ip": "10.0.0.1", "dst_ip": "10.96.0.1", "dst_port": 80, "expect": {"verdict": "maybe"}}]}]}"#,
                "expect.verdict",
            ),
            (
                &format!(
                    r#"{{"cases": [{{"id": "e", "node": {{"nodeIPs": ["x"]}}, "packets": [{good_packet}]}}]}}"#
                ),
                r#"case "e" (#0): node: nodeIPs"#,
            ),
            (
                &format!(
                    r#"{{"cases": [{{"id": "f", "objects": {{"services": [{{"spec": {{"ports": 7}}}}]}}, "packets": [{good_packet}]}}]}}"#
                ),
                "objects.services[0]",
            ),
            (
                &format!(
                    r#"{{"cases": [{{"id": "g", "surprise": 1, "packets": [{good_packet}]}}]}}"#
                ),
                "unknown field",
            ),
        ];
        for (text, needle) in cases {
            let err = parse(text).expect_err(text);
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
    }
}
