//! Table-driven tests of the node view on real k8s-openapi objects.

use std::collections::BTreeSet;

use super::EndpointSet;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::json;

use super::*;
use crate::{
    ClusterModel, Frontend, FrontendKind, NodeInfo, Protocol, ViewConfig, WhenEmpty, node_view,
};

fn model(services: &[serde_json::Value], slices: &[serde_json::Value]) -> ClusterModel {
    let mut m = ClusterModel::default();
    for s in services {
        let svc: Service = serde_json::from_value(s.clone()).expect("service");
        m.add_service(&svc);
    }
    for s in slices {
        let slice: EndpointSlice = serde_json::from_value(s.clone()).expect("slice");
        m.add_slice(&slice);
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

fn set(addrs: &[&str]) -> EndpointSet {
    addrs.iter().map(|a| a.parse().expect("addr")).collect()
}

/// The test node: node-a in zone-a, with one address of each family.
fn node_a() -> NodeInfo {
    NodeInfo {
        name: "node-a".into(),
        labels: [(
            "topology.kubernetes.io/zone".to_string(),
            "zone-a".to_string(),
        )]
        .into(),
        addresses: vec![
            "192.0.2.10".parse().expect("ip"),
            "2001:db8:a::10".parse().expect("ip"),
        ],
        ..NodeInfo::default()
    }
}

fn health_checks(
    m: &ClusterModel,
    node: &NodeInfo,
    cfg: &ViewConfig,
) -> std::collections::BTreeMap<u16, HealthCheck> {
    let mut t = crate::ViewTracker::new(node.clone(), cfg.clone());
    t.rebuild(m);
    t.health_checks()
}

fn view_of(m: &ClusterModel) -> (crate::NodeView, Vec<Rejection>) {
    node_view(m, &node_a(), &ViewConfig::default())
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
        // A missing serving condition means serving, whatever ready says (kube-proxy's
        // endpointslicecache): a terminating one is a fallback.
        (
            json!([{"addresses": ["10.244.3.8"], "conditions": {"ready": false, "terminating": true}}]),
            vec!["10.244.3.8:8080"],
        ),
        // Only an endpoint's first address counts; leading zeros read as decimal.
        (
            json!([{"addresses": ["010.244.003.009", "10.244.3.10"]}]),
            vec!["10.244.3.9:8080"],
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
        let (view, rejected) = view_of(&m);
        assert!(rejected.is_empty());
        let st = &view[&fe("10.96.0.10", 80, Protocol::Tcp)];
        assert_eq!(
            st.backends.endpoints,
            set(&expected),
            "endpoints {endpoints}"
        );
        if expected.is_empty() {
            assert_eq!(
                st.backends.when_empty,
                WhenEmpty::Reject,
                "no endpoint anywhere: reject"
            );
        }
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
    let (view, _) = view_of(&m);
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)]
            .backends
            .endpoints,
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
    let (view, _) = view_of(&m);
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)]
            .backends
            .endpoints,
        set(&["10.244.1.5:8081"])
    );
    assert_eq!(
        view[&fe("10.96.0.10", 53, Protocol::Udp)]
            .backends
            .endpoints,
        set(&["10.244.1.5:5353"])
    );
    // Name and protocol both match: the TCP dns port takes the slice's TCP port.
    assert_eq!(
        view[&fe("10.96.0.10", 53, Protocol::Tcp)]
            .backends
            .endpoints,
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
    let (view, _) = view_of(&m);
    assert_eq!(view.len(), 2);
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)]
            .backends
            .endpoints,
        set(&["10.244.1.5:8080"])
    );
    assert_eq!(
        view[&fe("fd96::10", 80, Protocol::Tcp)].backends.endpoints,
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
    let (view, rejected) = view_of(&m);
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
        let (view, _) = view_of(&model(&[svc("web", spec)], &[]));
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
    let (view, rejected) = view_of(&m);
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
        view[&fe("10.96.0.10", 80, Protocol::Tcp)]
            .backends
            .endpoints,
        set(&["10.244.1.5:8080"])
    );
    assert!(view.contains_key(&fe("10.96.0.30", 81, Protocol::Tcp)));
    assert_eq!(view.len(), 2);
}

/// An endpoint on `node`, ready, with optional zone/node hints.
fn ep_on(addr: &str, node: &str, zone_hints: &[&str], node_hints: &[&str]) -> serde_json::Value {
    let mut e = json!({"addresses": [addr], "nodeName": node,
                       "conditions": {"ready": true, "serving": true, "terminating": false}});
    if !zone_hints.is_empty() || !node_hints.is_empty() {
        e["hints"] = json!({"forZones": zone_hints.iter().map(|z| json!({"name": z})).collect::<Vec<_>>(),
                            "forNodes": node_hints.iter().map(|n| json!({"name": n})).collect::<Vec<_>>()});
    }
    e
}

fn ep_cond(
    addr: &str,
    node: &str,
    ready: bool,
    serving: bool,
    terminating: bool,
) -> serde_json::Value {
    json!({"addresses": [addr], "nodeName": node,
           "conditions": {"ready": ready, "serving": serving, "terminating": terminating}})
}

#[test]
fn internal_traffic_policy_local() {
    // (endpoints, expected backends, expected verdict when empty)
    let cases: Vec<(serde_json::Value, Vec<&str>, WhenEmpty)> = vec![
        (
            json!([
                ep_on("10.244.1.5", "node-a", &[], &[]),
                ep_on("10.244.2.6", "node-b", &[], &[])
            ]),
            vec!["10.244.1.5:8080"],
            WhenEmpty::Drop,
        ),
        // Endpoints elsewhere only: drop (not reject) here.
        (
            json!([ep_on("10.244.2.6", "node-b", &[], &[])]),
            vec![],
            WhenEmpty::Drop,
        ),
        // No endpoint anywhere: reject.
        (json!([]), vec![], WhenEmpty::Reject),
        // Local ones only terminating: fall back to them.
        (
            json!([
                ep_cond("10.244.1.5", "node-a", false, true, true),
                ep_on("10.244.2.6", "node-b", &[], &[])
            ]),
            vec!["10.244.1.5:8080"],
            WhenEmpty::Drop,
        ),
    ];
    for (endpoints, expected, when_empty) in cases {
        let mut spec = web_spec();
        spec["internalTrafficPolicy"] = json!("Local");
        let m = model(
            &[svc("web", spec)],
            &[slice(
                "web-1",
                "web",
                "IPv4",
                http_ports(),
                endpoints.clone(),
            )],
        );
        let (view, _) = view_of(&m);
        let st = &view[&fe("10.96.0.10", 80, Protocol::Tcp)];
        assert_eq!(st.backends.endpoints, set(&expected), "{endpoints}");
        assert_eq!(st.backends.when_empty, when_empty, "{endpoints}");
        assert!(st.internal.is_none());
    }
}

fn nodeport_spec(etp: &str) -> serde_json::Value {
    json!({"type": "LoadBalancer", "clusterIP": "10.96.0.10", "externalTrafficPolicy": etp,
           "externalIPs": ["203.0.113.7"],
           "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080, "protocol": "TCP"}]})
}

fn with_lb_status(mut svc: serde_json::Value, ingress: serde_json::Value) -> serde_json::Value {
    svc["status"] = json!({"loadBalancer": {"ingress": ingress}});
    svc
}

#[test]
fn external_frontends_nodeport_external_ip_load_balancer() {
    let service = with_lb_status(
        svc("web", nodeport_spec("Cluster")),
        json!([{"ip": "198.51.100.1"}, {"ip": "198.51.100.2", "ipMode": "Proxy"}, {"hostname": "lb.example"}]),
    );
    let eps = json!([
        ep_on("10.244.1.5", "node-a", &[], &[]),
        ep_on("10.244.2.6", "node-b", &[], &[])
    ]);
    let m = model(
        &[service],
        &[slice("web-1", "web", "IPv4", http_ports(), eps)],
    );
    let (view, rejected) = view_of(&m);
    assert!(rejected.is_empty(), "{rejected:?}");
    let kinds: Vec<(String, FrontendKind)> =
        view.iter().map(|(f, s)| (f.to_string(), s.kind)).collect();
    assert_eq!(
        kinds,
        vec![
            ("10.96.0.10:80/TCP".to_string(), FrontendKind::ClusterIp),
            ("127.0.0.1:30080/TCP".to_string(), FrontendKind::NodePort),
            ("192.0.2.10:30080/TCP".to_string(), FrontendKind::NodePort),
            (
                "198.51.100.1:80/TCP".to_string(),
                FrontendKind::LoadBalancer
            ),
            ("203.0.113.7:80/TCP".to_string(), FrontendKind::ExternalIp),
        ],
        "ipMode Proxy and hostname-only ingresses get no frontend; the IPv6 node address \
         serves no IPv4 Service"
    );
    for st in view.values() {
        assert_eq!(
            st.backends.endpoints,
            set(&["10.244.1.5:8080", "10.244.2.6:8080"])
        );
        assert!(st.internal.is_none());
    }
}

#[test]
fn node_port_addresses_and_localhost() {
    let m = model(&[svc("web", nodeport_spec("Cluster"))], &[]);
    let cases: Vec<(Vec<&str>, bool, Vec<&str>)> = vec![
        (vec![], true, vec!["127.0.0.1", "192.0.2.10"]),
        (vec![], false, vec!["192.0.2.10"]),
        (vec!["192.0.2.0/24"], true, vec!["192.0.2.10"]),
        (vec!["127.0.0.0/8"], true, vec!["127.0.0.1"]),
        (vec!["10.0.0.0/8"], true, vec![]),
    ];
    for (cidrs, localhost, expected) in cases {
        let cfg = ViewConfig {
            node_port_addresses: cidrs.iter().map(|c| c.parse().expect("cidr")).collect(),
            localhost_node_ports: localhost,
            ..ViewConfig::default()
        };
        let (view, _) = node_view(&m, &node_a(), &cfg);
        let got: Vec<String> = view
            .iter()
            .filter(|(_, s)| s.kind == FrontendKind::NodePort)
            .map(|(f, _)| f.ip.to_string())
            .collect();
        assert_eq!(
            got, expected,
            "nodePortAddresses {cidrs:?} localhost {localhost}"
        );
    }
}

/// `nodePortAddresses: [primary]`: the node's first address of each family only; the
/// Node's pod CIDRs are the pod network under `detectLocalMode: NodeCIDR`.
#[test]
fn primary_node_port_addresses_and_node_cidr() {
    let m = model(&[svc("web", nodeport_spec("Cluster"))], &[]);
    let mut node = node_a();
    node.addresses.insert(1, "192.0.2.99".parse().expect("ip"));
    node.pod_cidrs = vec!["10.244.3.0/24".parse().expect("cidr")];
    let cfg = ViewConfig {
        node_port_primary: true,
        pod_cidrs_from_node: true,
        ..ViewConfig::default()
    };
    let (view, _) = node_view(&m, &node, &cfg);
    let got: Vec<String> = view
        .iter()
        .filter(|(_, s)| s.kind == FrontendKind::NodePort)
        .map(|(f, _)| f.ip.to_string())
        .collect();
    assert_eq!(got, ["192.0.2.10"], "primary, no loopback, IPv4 Service");
    let settings = crate::NodeSettings::new(&node, [], &cfg);
    assert_eq!(settings.pod_cidrs, node.pod_cidrs);
    assert_eq!(
        crate::health_check_addresses(&node, &cfg),
        Some(vec![
            "192.0.2.10".parse().expect("ip"),
            "2001:db8:a::10".parse().expect("ip")
        ])
    );
}

/// loadBalancerSourceRanges that admit the node admit the LB IP as a source too (the node
/// reaching a VIP it holds locally), as kube-proxy's firewall chain does.
#[test]
fn source_ranges_admitting_the_node_admit_its_load_balancer_ip() {
    for (ranges, lb_admitted) in [
        (vec!["192.0.2.0/24"], true),
        (vec!["198.51.100.0/24"], false),
    ] {
        let mut spec = nodeport_spec("Cluster");
        spec["type"] = json!("LoadBalancer");
        spec["loadBalancerSourceRanges"] = json!(ranges);
        let s = with_lb_status(svc("web", spec), json!([{"ip": "203.0.113.50"}]));
        let (view, _) = view_of(&model(&[s], &[]));
        let (_, st) = view
            .iter()
            .find(|(_, s)| s.kind == FrontendKind::LoadBalancer)
            .expect("LB frontend");
        let lb: ipnet::IpNet = "203.0.113.50/32".parse().expect("net");
        assert_eq!(
            st.source_ranges.contains(&lb),
            lb_admitted,
            "{ranges:?}: {:?}",
            st.source_ranges
        );
    }
}

/// 70 slices × 1,000 endpoints: more than a Service port's backend slots. That Service is
/// refused alone, with its reason; the others are programmed.
#[test]
fn a_service_too_big_for_the_maps_is_refused_alone() {
    let mut slices = Vec::new();
    for s in 0..70u32 {
        let eps: Vec<serde_json::Value> = (0..1000u32)
            .map(|i| {
                let n = s * 1000 + i;
                ep(
                    &format!("10.{}.{}.{}", 100 + n / 65536, (n / 256) % 256, n % 256),
                    true,
                    true,
                    false,
                )
            })
            .collect();
        slices.push(slice(
            &format!("big-{s}"),
            "big",
            "IPv4",
            http_ports(),
            json!(eps),
        ));
    }
    slices.push(slice(
        "web-1",
        "web",
        "IPv4",
        http_ports(),
        json!([ep("10.244.1.5", true, true, false)]),
    ));
    let mut big = web_spec();
    big["clusterIP"] = json!("10.96.0.99");
    let m = model(&[svc("big", big), svc("web", web_spec())], &slices);
    // The limit the runner gives the view: the BPF dataplane's.
    let cfg = ViewConfig {
        max_endpoints: 65_535,
        ..ViewConfig::default()
    };
    let (view, rejected) = node_view(&m, &node_a(), &cfg);
    assert!(!view.contains_key(&fe("10.96.0.99", 80, Protocol::Tcp)));
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)]
            .backends
            .endpoints,
        set(&["10.244.1.5:8080"])
    );
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(&*rejected[0].object.name, "big");
    assert!(
        rejected[0]
            .reason
            .contains("70000 endpoints exceed the 65535"),
        "{}",
        rejected[0].reason
    );
}

/// What the API server's validation refuses, refused here too (the file source has no API
/// server in front of it), each named; the rest of the node stays programmed.
#[test]
fn objects_the_api_server_would_refuse_are_refused_by_name() {
    let port = |p: i64, np: i64| json!({"name": format!("p{p}"), "port": p, "targetPort": 8080, "nodePort": np, "protocol": "TCP"});
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (
            json!({"clusterIP": "10.96.0.50", "ports": [port(80, 0), port(80, 0)]}),
            "port 80/TCP given twice",
        ),
        (
            json!({"clusterIPs": ["None", "10.96.0.50"], "ports": [port(80, 0)]}),
            "invalid clusterIP \"None\"",
        ),
        (
            json!({"clusterIP": "127.0.0.1", "ports": [port(80, 0)]}),
            "not a unicast address",
        ),
        (
            json!({"clusterIP": "255.255.255.255", "ports": [port(80, 0)]}),
            "not a unicast address",
        ),
        // Another Service's ClusterIP and port: the first (default/a-web) keeps it.
        (
            json!({"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}),
            "already belongs to default/a-web:http",
        ),
    ];
    for (spec, needle) in cases {
        let mut web = svc("a-web", web_spec());
        web["metadata"]["name"] = json!("a-web");
        let m = model(&[web, svc("bad", spec.clone())], &[]);
        let (view, rejected) = view_of(&m);
        assert!(
            rejected
                .iter()
                .any(|r| *r.object.name == *"bad" && r.reason.contains(needle)),
            "{spec}: {needle:?} not in {rejected:?}"
        );
        assert!(
            view.values().all(|s| !s.service.starts_with("default/bad")),
            "{spec}: programmed anyway"
        );
        assert_eq!(
            view[&fe("10.96.0.10", 80, Protocol::Tcp)].service,
            "default/a-web:http"
        );
    }
    // A slice port out of range is named, not silently dropped.
    let m = model(
        &[svc("web", web_spec())],
        &[slice(
            "web-1",
            "web",
            "IPv4",
            json!([{"name": "http", "port": 0, "protocol": "TCP"}]),
            json!([ep("10.244.1.5", true, true, false)]),
        )],
    );
    let (_, rejected) = view_of(&m);
    assert!(
        rejected
            .iter()
            .any(|r| r.kind == crate::error::ObjectKind::EndpointSlice
                && r.reason.contains("port 0 out of range")),
        "{rejected:?}"
    );
}

/// From a file (no API server validated it), a nodePort the API server would refuse
/// costs that port its NodePort alone: the ClusterIP, the Service's other ports and their
/// NodePorts stay, as kube-proxy would still serve them. (They refused the whole Service.)
#[test]
fn a_bad_node_port_from_a_file_costs_that_node_port_alone() {
    let port = |name: &str, p: i64, np: i64| json!({"name": name, "port": p, "targetPort": 8080, "nodePort": np, "protocol": "TCP"});
    let spec = json!({"type": "NodePort", "clusterIP": "10.96.0.50", "ports": [
        port("low", 80, 22), port("huge", 81, 70000), port("ok", 82, 30100), port("again", 83, 30100),
    ]});
    let (view, rejected) = view_of(&model(&[svc("np", spec)], &[]));
    for p in [80, 81, 82, 83] {
        assert!(
            view.contains_key(&fe("10.96.0.50", p, Protocol::Tcp)),
            "ClusterIP port {p} left out: {rejected:?}"
        );
    }
    let node_ports: BTreeSet<(u16, String)> = view
        .iter()
        .filter(|(_, st)| st.kind == FrontendKind::NodePort)
        .map(|(f, st)| (f.port, st.service.clone()))
        .collect();
    assert_eq!(
        node_ports,
        BTreeSet::from([(30100, "default/np:ok".to_string())])
    );
    let reasons: Vec<&str> = rejected.iter().map(|r| r.reason.as_str()).collect();
    for needle in [
        "port low: nodePort 22 outside the node-port range 30000-32767",
        "port huge: nodePort 70000 out of range 1-65535",
        "port again: nodePort 30100/TCP given twice (port ok has it)",
    ] {
        assert!(
            reasons.iter().any(|r| r.contains(needle)),
            "{needle:?} not in {reasons:?}"
        );
    }
    assert_eq!(rejected.len(), 3, "{reasons:?}");
    assert!(rejected.iter().all(|r| *r.object.name == *"np"));
}

/// From the API server, a nodePort outside this node's `nodePortRange` is programmed: the
/// API server accepted it under its own `--service-node-port-range`, which clusters
/// change, and kube-proxy programs what it stored. (The whole Service was refused, its
/// ClusterIP too.) The same object from a file loses that NodePort alone.
#[test]
fn node_ports_the_api_server_stored_are_programmed_whatever_the_range() {
    let spec = json!({"type": "NodePort", "clusterIP": "10.96.0.50", "ports": [
        {"name": "http", "port": 80, "targetPort": 8080, "nodePort": 40000, "protocol": "TCP"}]});
    let m = model(&[svc("np", spec)], &[]);
    let cfg = ViewConfig {
        api_validated: true,
        ..ViewConfig::default()
    };
    let (view, rejected) = node_view(&m, &node_a(), &cfg);
    assert!(rejected.is_empty(), "{rejected:?}");
    assert!(view.contains_key(&fe("10.96.0.50", 80, Protocol::Tcp)));
    assert_eq!(
        view[&fe("192.0.2.10", 40000, Protocol::Tcp)].kind,
        FrontendKind::NodePort
    );
    assert!(view.contains_key(&fe("127.0.0.1", 40000, Protocol::Tcp)));

    let (view, rejected) = view_of(&m);
    assert!(view.contains_key(&fe("10.96.0.50", 80, Protocol::Tcp)));
    assert!(view.values().all(|st| st.kind != FrontendKind::NodePort));
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(
        rejected[0]
            .reason
            .contains("port http: nodePort 40000 outside the node-port range 30000-32767"),
        "{rejected:?}"
    );
}

/// Endpoint addresses the API server refuses (Kubernetes' `ValidateEndpointIP`:
/// unspecified, loopback, link-local, link-local multicast; IPv4-mapped ones judged as
/// IPv4) are refused from a file, each endpoint alone and named; the Service's other
/// endpoints stay. (They were programmed: a backend of 127.0.0.1 or 169.254.169.254 sent
/// the Service's traffic to the node itself or to the cloud's metadata service.) From the
/// API server, which validated them, what it stored is programmed.
#[test]
fn endpoint_addresses_the_api_server_refuses_are_refused_from_files_by_name() {
    let dual = json!({"clusterIPs": ["10.96.0.10", "fd00::10"], "ipFamilies": ["IPv4", "IPv6"],
                      "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]});
    let v4_special = [
        "0.0.0.0",
        "127.0.0.1",
        "127.8.0.1",
        "169.254.169.254",
        "224.0.0.251",
    ];
    let v6_special = [
        "::",
        "::1",
        "fe80::1",
        "ff02::fb",
        "ff12::1",
        "::ffff:127.0.0.1",
    ];
    let eps = |good: &str, special: &[&str]| {
        let mut all = vec![ep(good, true, true, false)];
        all.extend(special.iter().map(|a| ep(a, true, true, false)));
        serde_json::Value::Array(all)
    };
    let m = model(
        &[svc("web", dual)],
        &[
            slice(
                "web-v4",
                "web",
                "IPv4",
                http_ports(),
                eps("10.244.1.5", &v4_special),
            ),
            slice(
                "web-v6",
                "web",
                "IPv6",
                http_ports(),
                eps("fd00:244::5", &v6_special),
            ),
        ],
    );
    let (view, rejected) = view_of(&m);
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)]
            .backends
            .endpoints,
        set(&["10.244.1.5:8080"])
    );
    assert_eq!(
        view[&fe("fd00::10", 80, Protocol::Tcp)].backends.endpoints,
        set(&["[fd00:244::5]:8080"])
    );
    for (slice_name, addrs) in [("web-v4", &v4_special[..]), ("web-v6", &v6_special[..])] {
        for addr in addrs {
            let shown = addr.parse::<std::net::IpAddr>().expect("ip").to_string();
            assert!(
                rejected
                    .iter()
                    .any(|r| r.kind == crate::error::ObjectKind::EndpointSlice
                        && *r.object.name == *slice_name
                        && r.reason
                            .starts_with(&format!("endpoint address {shown}: may not be"))),
                "{addr} not refused: {rejected:?}"
            );
        }
    }
    assert_eq!(rejected.len(), v4_special.len() + v6_special.len());
    let why = |addr: &str| {
        crate::objects::special_endpoint_ip(addr.parse().expect("ip"))
            .map_or(String::new(), |w| w.to_string())
    };
    assert!(why("169.254.169.254").contains("link-local range"));
    assert!(why("224.0.0.251").contains("link-local multicast"));
    assert!(why("::ffff:127.0.0.1").contains("loopback"));
    for fine in [
        "10.244.1.5",
        "224.0.1.1",
        "ff05::1",
        "fd00::1",
        "2001:db8::1",
    ] {
        assert_eq!(why(fine), "", "{fine}");
    }

    let cfg = ViewConfig {
        api_validated: true,
        ..ViewConfig::default()
    };
    let (view, rejected) = node_view(&m, &node_a(), &cfg);
    assert!(rejected.is_empty(), "{rejected:?}");
    assert_eq!(
        view[&fe("10.96.0.10", 80, Protocol::Tcp)]
            .backends
            .endpoints
            .len(),
        1 + v4_special.len()
    );
}

/// Found by `tests/fuzz_parsers.rs`: external and load-balancer IPs were taken as they came,
/// so `externalIPs: ["::1"]` or an ingress IP of 127.0.0.1 took over the node's own
/// loopback traffic to that port. They are left out by name, as invalid ones are; the
/// Service's other frontends stay.
#[test]
fn special_external_and_load_balancer_ips_are_refused_by_name() {
    let spec = json!({"type": "LoadBalancer", "clusterIP": "10.96.0.10",
                      "externalIPs": ["::1", "203.0.113.7", "0.0.0.0", "169.254.1.1"],
                      "ports": [{"port": 80, "protocol": "TCP", "nodePort": 30080}]});
    let service = with_lb_status(
        svc("a", spec),
        json!([{"ip": "127.0.0.1"}, {"ip": "224.0.0.1"}, {"ip": "198.51.100.1"}]),
    );
    let (view, rejected) = view_of(&model(&[service], &[]));
    let vips: Vec<String> = view
        .iter()
        .filter(|(_, s)| s.kind != FrontendKind::NodePort)
        .map(|(f, _)| f.ip.to_string())
        .collect();
    assert_eq!(vips, ["10.96.0.10", "198.51.100.1", "203.0.113.7"]);
    for ip in ["::1", "0.0.0.0", "169.254.1.1", "127.0.0.1", "224.0.0.1"] {
        assert!(
            rejected.iter().any(|r| *r.object.name == *"a"
                && r.reason.contains(&format!("{ip:?}: not a unicast address"))),
            "{ip} not refused: {rejected:?}"
        );
    }
}

#[test]
fn external_traffic_policy_local_keeps_two_scopes() {
    let cases: Vec<(serde_json::Value, Vec<&str>, WhenEmpty)> = vec![
        (
            json!([
                ep_on("10.244.1.5", "node-a", &[], &[]),
                ep_on("10.244.2.6", "node-b", &[], &[])
            ]),
            vec!["10.244.1.5:8080"],
            WhenEmpty::Drop,
        ),
        // No local endpoint: outside traffic is dropped here, pods still reach node-b's.
        (
            json!([ep_on("10.244.2.6", "node-b", &[], &[])]),
            vec![],
            WhenEmpty::Drop,
        ),
    ];
    for (eps, external, when_empty) in cases {
        let m = model(
            &[svc("web", nodeport_spec("Local"))],
            &[slice("web-1", "web", "IPv4", http_ports(), eps.clone())],
        );
        let (view, _) = view_of(&m);
        let cip = &view[&fe("10.96.0.10", 80, Protocol::Tcp)];
        assert!(cip.internal.is_none(), "the ClusterIP is not external");
        for f in [
            fe("192.0.2.10", 30080, Protocol::Tcp),
            fe("203.0.113.7", 80, Protocol::Tcp),
        ] {
            let st = &view[&f];
            assert_eq!(st.backends.endpoints, set(&external), "{f} {eps}");
            assert_eq!(st.backends.when_empty, when_empty);
            let internal = st.internal.as_ref().expect("two scopes");
            assert_eq!(
                internal.endpoints, cip.backends.endpoints,
                "internal traffic short-circuits to every endpoint"
            );
        }
    }
}

#[test]
fn topology_hints_and_fallbacks() {
    // (endpoints, expected backends for node-a in zone-a)
    let cases: Vec<(&str, serde_json::Value, Vec<&str>)> = vec![
        (
            "zone hints for our zone",
            json!([
                ep_on("10.244.1.5", "node-x", &["zone-a"], &[]),
                ep_on("10.244.2.6", "node-y", &["zone-b"], &[])
            ]),
            vec!["10.244.1.5:8080"],
        ),
        (
            "one endpoint without hints: ignore hints",
            json!([
                ep_on("10.244.1.5", "node-x", &["zone-a"], &[]),
                ep_on("10.244.2.6", "node-y", &[], &[])
            ]),
            vec!["10.244.1.5:8080", "10.244.2.6:8080"],
        ),
        (
            "no hint for our zone: ignore hints",
            json!([
                ep_on("10.244.1.5", "node-x", &["zone-c"], &[]),
                ep_on("10.244.2.6", "node-y", &["zone-b"], &[])
            ]),
            vec!["10.244.1.5:8080", "10.244.2.6:8080"],
        ),
        (
            "node hints for our node (PreferSameNode)",
            json!([
                ep_on("10.244.1.5", "node-a", &["zone-a"], &["node-a"]),
                ep_on("10.244.3.7", "node-z", &["zone-a"], &["node-z"])
            ]),
            vec!["10.244.1.5:8080"],
        ),
        (
            "node hints, none for us: fall back to zone",
            json!([
                ep_on("10.244.1.5", "node-x", &["zone-a"], &["node-x"]),
                ep_on("10.244.2.6", "node-y", &["zone-b"], &["node-y"])
            ]),
            vec!["10.244.1.5:8080"],
        ),
    ];
    for (name, eps, expected) in cases {
        let mut spec = web_spec();
        spec["trafficDistribution"] = json!("PreferClose");
        let m = model(
            &[svc("web", spec)],
            &[slice("web-1", "web", "IPv4", http_ports(), eps)],
        );
        let (view, _) = view_of(&m);
        assert_eq!(
            view[&fe("10.96.0.10", 80, Protocol::Tcp)]
                .backends
                .endpoints,
            set(&expected),
            "{name}"
        );
    }
}

#[test]
fn service_proxy_name_label_opts_in() {
    let mut labelled = svc("web", web_spec());
    labelled["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "ebpf-proxy"});
    let m = model(&[labelled], &[]);
    let (view, _) = view_of(&m);
    assert!(
        view.is_empty(),
        "a Service naming another proxy is not ours"
    );
    let cfg = ViewConfig {
        service_proxy_name: Some("ebpf-proxy".into()),
        ..ViewConfig::default()
    };
    let (view, _) = node_view(&m, &node_a(), &cfg);
    assert_eq!(view.len(), 1, "a Service naming us is ours");
}

#[test]
fn scheduler_comes_from_the_annotation_else_the_node() {
    use crate::schedule::Scheduler;
    let mut annotated = svc("web", web_spec());
    annotated["metadata"]["annotations"] = json!({
        "ebpf.proxy.k8s.io/scheduler": "mh",
        "ebpf.proxy.k8s.io/weights": "10.244.1.5=3, bogus",
    });
    let mut unknown = svc("api", web_spec());
    unknown["spec"]["clusterIP"] = json!("10.96.0.11");
    unknown["metadata"]["annotations"] = json!({"ebpf.proxy.k8s.io/scheduler": "fastest"});
    let m = model(&[annotated, unknown], &[]);
    let cfg = ViewConfig {
        scheduler: Scheduler::Rr,
        maglev_table_len: 509,
        ..ViewConfig::default()
    };
    let (view, rejected) = node_view(&m, &node_a(), &cfg);
    let web = &view[&fe("10.96.0.10", 80, Protocol::Tcp)];
    assert_eq!(web.schedule.scheduler, Scheduler::Mh);
    assert_eq!(web.schedule.table_len, 509);
    assert_eq!(web.schedule.weight("10.244.1.5".parse().expect("ip")), 3);
    let api = &view[&fe("10.96.0.11", 80, Protocol::Tcp)];
    assert_eq!(
        api.schedule.scheduler,
        Scheduler::Rr,
        "unknown name: the node's"
    );
    assert_eq!(api.schedule.table_len, 0, "no table for rr");
    let reasons: Vec<&str> = rejected.iter().map(|r| r.reason.as_str()).collect();
    assert!(
        reasons.iter().any(|r| r.contains("fastest"))
            && reasons.iter().any(|r| r.contains("bogus")),
        "both problems reported: {reasons:?}"
    );
}

#[test]
fn single_stack_ipv6_service_uses_only_ipv6() {
    let spec = json!({"clusterIP": "fd96::10", "clusterIPs": ["fd96::10"], "ipFamilies": ["IPv6"], "type": "NodePort",
                      "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}]});
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
    let (view, _) = view_of(&m);
    let frontends: Vec<String> = view.keys().map(ToString::to_string).collect();
    assert_eq!(
        frontends,
        vec!["[2001:db8:a::10]:30080/TCP", "[fd96::10]:80/TCP"],
        "no 127.0.0.1 NodePort for IPv6"
    );
    assert!(
        view.values()
            .all(|s| s.backends.endpoints == set(&["[fd00:244::5]:8080"]))
    );
}

#[test]
fn health_check_node_ports_count_ready_local_endpoints() {
    let mut spec = nodeport_spec("Local");
    spec["healthCheckNodePort"] = json!(32000);
    let cluster = {
        let mut s = nodeport_spec("Cluster");
        s["clusterIP"] = json!("10.96.0.11");
        s["healthCheckNodePort"] = json!(32001);
        s
    };
    let eps = json!([
        ep_on("10.244.1.5", "node-a", &[], &[]),
        ep_cond("10.244.1.6", "node-a", false, true, true),
        ep_on("10.244.2.6", "node-b", &[], &[])
    ]);
    let m = model(
        &[svc("web", spec), svc("other", cluster)],
        &[slice("web-1", "web", "IPv4", http_ports(), eps)],
    );
    let checks = health_checks(&m, &node_a(), &ViewConfig::default());
    assert_eq!(
        checks.keys().copied().collect::<Vec<_>>(),
        vec![32000],
        "only eTP Local Services have one"
    );
    assert_eq!(
        checks[&32000].local_endpoints, 1,
        "ready local endpoints only"
    );
    let node_c = NodeInfo {
        name: "node-c".into(),
        ..node_a()
    };
    assert_eq!(
        health_checks(&m, &node_c, &ViewConfig::default())[&32000].local_endpoints,
        0
    );
}

#[test]
fn direct_server_return_follows_the_mode_and_the_annotation_on_external_frontends() {
    use crate::lb_mode::LbMode;
    let spec = |cip: &str, tcp: u16, udp: u16| {
        json!({"clusterIP": cip, "type": "NodePort",
               "ports": [{"name": "t", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": tcp},
                         {"name": "u", "port": 53, "targetPort": 5353, "protocol": "UDP", "nodePort": udp}]})
    };
    let node_mode = svc("web", spec("10.96.0.10", 30080, 30053));
    let mut snat = svc("api", spec("10.96.0.11", 30081, 30054));
    snat["metadata"]["annotations"] = json!({"ebpf.proxy.k8s.io/lb-mode": "snat"});
    let mut dsr = svc("db", spec("10.96.0.12", 30082, 30055));
    dsr["metadata"]["annotations"] = json!({"ebpf.proxy.k8s.io/lb-mode": "dsr"});
    let mut bad = svc("odd", spec("10.96.0.13", 30083, 30056));
    bad["metadata"]["annotations"] = json!({"ebpf.proxy.k8s.io/lb-mode": "direct"});
    let m = model(&[node_mode, snat, dsr, bad], &[]);
    let cfg = ViewConfig {
        lb_mode: LbMode::Hybrid,
        ..ViewConfig::default()
    };
    let (view, rejected) = node_view(&m, &node_a(), &cfg);
    let node_ip = node_a().addresses[0].to_string();
    let dsr_of = |port: u16, protocol| view[&fe(&node_ip, port, protocol)].dsr;
    // The node's hybrid: TCP returns directly, UDP is masqueraded.
    assert!(dsr_of(30080, Protocol::Tcp));
    assert!(!dsr_of(30053, Protocol::Udp));
    // The annotation wins, both ways.
    assert!(!dsr_of(30081, Protocol::Tcp));
    assert!(dsr_of(30082, Protocol::Tcp) && dsr_of(30055, Protocol::Udp));
    // An unknown mode: the node's, and the Service says why.
    assert!(dsr_of(30083, Protocol::Tcp) && !dsr_of(30056, Protocol::Udp));
    assert!(
        rejected.iter().any(|r| r.reason.contains("direct")),
        "{rejected:?}"
    );
    // Never a ClusterIP: pods and the node reach backends as ever.
    assert!(!view[&fe("10.96.0.12", 80, Protocol::Tcp)].dsr);
}

/// The other nodes' addresses are the entry nodes direct server return believes: every
/// address of every other Node, once, sorted; never this node's own (by name or by an
/// address it shares).
#[test]
fn peer_addresses_are_the_other_nodes_addresses() {
    let node = |name: &str, addrs: &[&str]| NodeInfo {
        name: name.into(),
        addresses: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        ..Default::default()
    };
    let me = node("node-a", &["192.0.2.10", "2001:db8::10"]);
    let nodes = [
        node("node-a", &["192.0.2.10", "2001:db8::10"]),
        node("node-c", &["192.0.2.12", "2001:db8::12", "192.0.2.11"]),
        node("node-b", &["192.0.2.11", "203.0.113.11"]),
        // A stale twin claiming this node's address is not a peer by it.
        node("old-a", &["192.0.2.10"]),
    ];
    let settings = crate::NodeSettings::new(&me, &nodes, &ViewConfig::default());
    let got: Vec<String> = settings
        .peer_addresses
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        got,
        ["192.0.2.11", "192.0.2.12", "203.0.113.11", "2001:db8::12"]
    );
}
