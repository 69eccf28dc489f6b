//! Table-driven tests of the node view on real k8s-openapi objects.

use std::{collections::BTreeSet, net::SocketAddr};

use serde_json::json;

use super::*;
use crate::model::{ClusterModel, Frontend, ObjectRef, Protocol};

fn model(services: &[serde_json::Value], slices: &[serde_json::Value]) -> ClusterModel {
    let mut m = ClusterModel::default();
    for s in services {
        let svc: Service = serde_json::from_value(s.clone()).expect("service");
        m.services.insert(ObjectRef::of(&svc.metadata), svc);
    }
    for s in slices {
        let slice: EndpointSlice = serde_json::from_value(s.clone()).expect("slice");
        m.slices.insert(ObjectRef::of(&slice.metadata), slice);
    }
    m
}

fn svc(name: &str, spec: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "default"}, "spec": spec})
}

fn slice(
    name: &str,
    service: &str,
    family: &str,
    ports: serde_json::Value,
    endpoints: serde_json::Value,
) -> serde_json::Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "namespace": "default",
                        "labels": {"kubernetes.io/service-name": service}},
           "addressType": family, "ports": ports, "endpoints": endpoints})
}

fn ep(addr: &str, ready: bool, serving: bool, terminating: bool) -> serde_json::Value {
    json!({"addresses": [addr], "conditions": {"ready": ready, "serving": serving, "terminating": terminating}})
}

fn fe(ip: &str, port: u16, protocol: Protocol) -> Frontend {
    Frontend {
        ip: ip.parse().expect("ip"),
        port,
        protocol,
    }
}

fn set(addrs: &[&str]) -> BTreeSet<SocketAddr> {
    addrs.iter().map(|a| a.parse().expect("addr")).collect()
}

fn web_spec() -> serde_json::Value {
    json!({"clusterIP": "10.96.0.10",
           "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]})
}

fn http_ports() -> serde_json::Value {
    json!([{"name": "http", "port": 8080, "protocol": "TCP"}])
}

#[test]
fn endpoints_by_condition() {
    // (endpoints, expected backends)
    let cases: Vec<(serde_json::Value, Vec<&str>)> = vec![
        (
            json!([
                ep("10.244.1.5", true, true, false),
                ep("10.244.2.6", true, true, false)
            ]),
            vec!["10.244.1.5:8080", "10.244.2.6:8080"],
        ),
        // Not ready and not terminating: out.
        (
            json!([
                ep("10.244.1.5", true, true, false),
                ep("10.244.2.6", false, false, false)
            ]),
            vec!["10.244.1.5:8080"],
        ),
        // Ready ones exist: terminating ones are not used.
        (
            json!([
                ep("10.244.1.5", true, true, false),
                ep("10.244.2.6", false, true, true)
            ]),
            vec!["10.244.1.5:8080"],
        ),
        // None ready: fall back to serving + terminating.
        (
            json!([
                ep("10.244.1.5", false, true, true),
                ep("10.244.2.6", false, false, true)
            ]),
            vec!["10.244.1.5:8080"],
        ),
        // A missing ready condition means ready.
        (
            json!([{"addresses": ["10.244.3.7"]}]),
            vec!["10.244.3.7:8080"],
        ),
        (json!([]), vec![]),
    ];
    for (endpoints, expected) in cases {
        let m = model(
            &[svc("web", web_spec())],
            &[slice(
                "web-1",
                "web",
                "IPv4",
                http_ports(),
                endpoints.clone(),
            )],
        );
        let (view, rejected) = node_view(&m);
        assert!(rejected.is_empty());
        let st = &view[&fe("10.96.0.10", 80, Protocol::Tcp)];
        assert_eq!(st.backends, set(&expected), "endpoints {endpoints}");
    }
}

#[test]
fn slices_merge_and_deduplicate() {
    let m = model(
        &[svc("web", web_spec())],
        &[
            slice(
                "web-1",
                "web",
                "IPv4",
                http_ports(),
                json!([ep("10.244.1.5", true, true, false)]),
            ),
            slice(
                "web-2",
                "web",
                "IPv4",
                http_ports(),
                json!([
                    ep("10.244.1.5", true, true, false),
                    ep("10.244.2.6", true, true, false)
                ]),
            ),
            // Another Service's slice is not ours.
            slice(
                "other-1",
                "other",
                "IPv4",
                http_ports(),
                json!([ep("10.244.9.9", true, true, false)]),
            ),
        ],
    );
    let (view, _) = node_view(&m);
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)].backends,
        set(&["10.244.1.5:8080", "10.244.2.6:8080"])
    );
}

#[test]
fn target_port_by_name_and_number() {
    let spec = json!({"clusterIP": "10.96.0.10", "ports": [
        {"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP"},
        {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 53, "targetPort": 5353, "protocol": "TCP"}]});
    let ports = json!([{"name": "http", "port": 8081, "protocol": "TCP"},
                       {"name": "dns", "port": 5353, "protocol": "UDP"},
                       {"name": "dns-tcp", "port": 5354, "protocol": "TCP"}]);
    let m = model(
        &[svc("web", spec)],
        &[slice(
            "web-1",
            "web",
            "IPv4",
            ports,
            json!([ep("10.244.1.5", true, true, false)]),
        )],
    );
    let (view, _) = node_view(&m);
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)].backends,
        set(&["10.244.1.5:8081"])
    );
    assert_eq!(
        view[&fe("10.96.0.10", 53, Protocol::Udp)].backends,
        set(&["10.244.1.5:5353"])
    );
    // Name and protocol both match: the TCP dns port takes the slice's TCP port.
    assert_eq!(
        view[&fe("10.96.0.10", 53, Protocol::Tcp)].backends,
        set(&["10.244.1.5:5354"])
    );
}

#[test]
fn dual_stack_takes_one_family_per_slice() {
    let spec = json!({"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd96::10"],
                      "ipFamilies": ["IPv4", "IPv6"],
                      "ports": [{"name": "http", "port": 80, "targetPort": 8080}]});
    let m = model(
        &[svc("web", spec)],
        &[
            slice(
                "web-4",
                "web",
                "IPv4",
                http_ports(),
                json!([ep("10.244.1.5", true, true, false)]),
            ),
            slice(
                "web-6",
                "web",
                "IPv6",
                http_ports(),
                json!([ep("fd00:244::5", true, true, false)]),
            ),
        ],
    );
    let (view, _) = node_view(&m);
    assert_eq!(view.len(), 2);
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)].backends,
        set(&["10.244.1.5:8080"])
    );
    assert_eq!(
        view[&fe("fd96::10", 80, Protocol::Tcp)].backends,
        set(&["[fd00:244::5]:8080"])
    );
}

#[test]
fn headless_and_external_name_are_not_proxied() {
    let m = model(
        &[
            svc(
                "headless",
                json!({"clusterIP": "None", "ports": [{"port": 80}]}),
            ),
            svc(
                "ext",
                json!({"type": "ExternalName", "externalName": "example.org", "ports": [{"port": 80}]}),
            ),
        ],
        &[],
    );
    let (view, rejected) = node_view(&m);
    assert!(view.is_empty() && rejected.is_empty());
}

#[test]
fn session_affinity_timeouts() {
    let cases = [
        (json!({}), None),
        (json!({"sessionAffinity": "None"}), None),
        (json!({"sessionAffinity": "ClientIP"}), Some(10_800)),
        (
            json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}}),
            Some(60),
        ),
    ];
    for (extra, expected) in cases {
        let mut spec = web_spec();
        for (k, v) in extra.as_object().expect("object") {
            spec[k] = v.clone();
        }
        let (view, _) = node_view(&model(&[svc("web", spec)], &[]));
        assert_eq!(
            view[&fe("10.96.0.10", 80, Protocol::Tcp)].affinity_timeout_s,
            expected,
            "{extra}"
        );
    }
}

#[test]
fn invalid_objects_are_rejected_with_reasons_and_others_apply() {
    let m = model(
        &[
            svc("web", web_spec()),
            svc(
                "badip",
                json!({"clusterIP": "10.96.0.999", "ports": [{"port": 80}]}),
            ),
            svc(
                "badport",
                json!({"clusterIP": "10.96.0.30", "ports": [{"port": 70000}, {"name": "ok", "port": 81}]}),
            ),
            svc(
                "badproto",
                json!({"clusterIP": "10.96.0.31", "ports": [{"port": 80, "protocol": "ICMP"}]}),
            ),
        ],
        &[slice(
            "web-1",
            "web",
            "IPv4",
            http_ports(),
            json!([
                ep("10.244.1.5", true, true, false),
                ep("not-an-ip", true, true, false)
            ]),
        )],
    );
    let (view, rejected) = node_view(&m);
    let reasons: Vec<String> = rejected
        .iter()
        .map(|r| format!("{} {}: {}", r.kind, r.object, r.reason))
        .collect();
    let has = |needle: &str| reasons.iter().any(|r| r.contains(needle));
    assert!(has("default/badip") && has("10.96.0.999"), "{reasons:?}");
    assert!(has("default/badport") && has("70000"), "{reasons:?}");
    assert!(has("default/badproto") && has("ICMP"), "{reasons:?}");
    assert!(
        has("EndpointSlice default/web-1") && has("not-an-ip"),
        "{reasons:?}"
    );
    // The valid service, the valid port of badport and the valid endpoint still apply.
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)].backends,
        set(&["10.244.1.5:8080"])
    );
    assert!(view.contains_key(&fe("10.96.0.30", 81, Protocol::Tcp)));
    assert_eq!(view.len(), 2);
}
