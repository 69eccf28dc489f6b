//! The deploy/ manifests parse, and the examples produce the frontends the demo expects.

use std::path::Path;

#[test]
fn deploy_yaml_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut kinds = Vec::new();
    for file in ["daemonset.yaml", "rbac.yaml", "config.yaml"] {
        let text = std::fs::read_to_string(dir.join(file)).expect("read");
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(doc).expect("valid YAML");
            kinds.push(v["kind"].as_str().expect("kind").to_string());
            if v["kind"] == "DaemonSet" {
                // The node's network (its interfaces, its conntrack) and its processes
                // (pods' network namespaces, for stale connected UDP sockets).
                let pod = &v["spec"]["template"]["spec"];
                assert_eq!(pod["hostNetwork"], true, "{pod}");
                assert_eq!(pod["hostPID"], true, "{pod}");
                let caps = &pod["containers"][0]["securityContext"]["capabilities"]["add"];
                for cap in ["BPF", "NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"] {
                    assert!(
                        caps.as_array().is_some_and(|c| c.iter().any(|x| x == cap)),
                        "{cap} missing: {caps}"
                    );
                }
                // The node's name from the downward API, as kubeadm's kube-proxy has it.
                let env = &pod["containers"][0]["env"];
                assert!(
                    env.as_array()
                        .is_some_and(|e| e.iter().any(|x| x["name"] == "NODE_NAME"
                            && x["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName")),
                    "NODE_NAME missing: {env}"
                );
            }
        }
    }
    for k in [
        "DaemonSet",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
    ] {
        assert!(
            kinds.iter().any(|x| x == k),
            "{k} missing from deploy/: {kinds:?}"
        );
    }
}

#[test]
fn examples_build_the_demo_view() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let view =
        proxy_agent::sync::view_from_manifests(&dir, &Default::default(), &Default::default())
            .expect("examples load");
    // web: 2 families x (http, dns); empty: 1.
    assert_eq!(view.len(), 5, "{view:#?}");
    let web = view
        .values()
        .find(|s| s.service == "default/web:http")
        .expect("web http");
    assert_eq!(
        web.backends.endpoints.len(),
        3,
        "named targetPort resolved through the slice"
    );
    assert!(web.backends.endpoints.iter().all(|b| b.port() == 8080));
}
