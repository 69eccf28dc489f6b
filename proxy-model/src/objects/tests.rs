//! The compact records' tests: interning, special addresses.

use super::*;

#[test]
fn one_name_is_one_string() {
    let a = intern("kube-system");
    let b = intern(&String::from("kube-system"));
    assert!(Arc::ptr_eq(&a, &b));
    assert_eq!(&*a, "kube-system");
    assert!(!Arc::ptr_eq(&a, &intern("default")));
}

#[test]
fn a_plain_service_boxes_nothing_rare_and_reads_the_same() {
    let plain: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "a", "namespace": "d"},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}
    }))
    .expect("a Service");
    let info = ServiceInfo::from_k8s(&plain);
    assert!(info.rare.0.is_none(), "no rare field set: no box");
    assert!(info.rare.external_ips.is_empty() && info.rare.invalid.is_none());
    let mut external = plain.clone();
    if let Some(spec) = external.spec.as_mut() {
        spec.external_ips = Some(vec!["192.0.2.1".into()]);
    }
    let info2 = ServiceInfo::from_k8s(&external);
    assert!(info2.rare.0.is_some());
    assert_eq!(
        info2.rare.external_ips,
        vec!["192.0.2.1".parse::<IpAddr>().unwrap()]
    );
    // A box left at the defaults equals none, and settles to none.
    let mut written = info.clone();
    written.rare.problems.clear();
    assert!(written.rare.0.is_some());
    assert_eq!(written, info);
    written.rare.settle();
    assert!(written.rare.0.is_none());
    // The rare fields serialize beside the others, as one struct did.
    let json = serde_json::to_value(&info2).expect("serializes");
    assert_eq!(json["external_ips"], serde_json::json!(["192.0.2.1"]));
    assert_eq!(json["cluster_ips"], serde_json::json!(["10.96.0.1"]));
}

#[test]
fn node_names_are_four_bytes_interned_once_and_read_back() {
    assert_eq!(std::mem::size_of::<Option<NodeName>>(), 4);
    assert!(
        std::mem::size_of::<EndpointInfo>() <= 24,
        "a million of them"
    );
    let (a, b) = (
        NodeName::new("node-a-objects-test"),
        NodeName::new("node-b"),
    );
    assert_eq!(
        a,
        NodeName::new("node-a-objects-test"),
        "the same name, the same index"
    );
    assert_ne!(a, b);
    assert_eq!(a.as_str(), "node-a-objects-test");
    assert_eq!(format!("{b:?}"), "\"node-b\"");
    assert_eq!(serde_json::to_string(&b).expect("json"), "\"node-b\"");
    let ep = EndpointInfo {
        ip: "10.0.0.1".parse().expect("ip"),
        ready: true,
        serving: true,
        terminating: false,
        node: Some(b),
    };
    assert!(ep.is_on("node-b") && !ep.is_on("node-a-objects-test"));
}
