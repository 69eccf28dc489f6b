//! The deploy/ manifests parse, and the examples produce the frontends the demo expects.

use std::path::Path;

use serde_json::Value;

/// The agent container's capabilities (docs/operations.md, "Privileges").
const PRIVILEGES: [&str; 3] = ["NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"];

#[test]
fn deploy_yaml_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut kinds = Vec::new();
    for file in ["daemonset.yaml", "rbac.yaml", "config.yaml"] {
        let text = std::fs::read_to_string(dir.join(file)).expect("read");
        for doc in serde_norway::Deserializer::from_str(&text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(doc).expect("valid YAML");
            kinds.push(v["kind"].as_str().expect("kind").to_string());
            if v["kind"] == "DaemonSet" {
                // The node's network (its interfaces, its conntrack) and its processes
                // (pods' network namespaces, for stale connected UDP sockets).
                let pod = &v["spec"]["template"]["spec"];
                assert_eq!(pod["hostNetwork"], true, "{pod}");
                assert_eq!(pod["hostPID"], true, "{pod}");
                // Exactly these capabilities, nothing of the runtime's default set: each
                // one is needed by a feature (docs/operations.md, "Privileges"), as
                // tests/e2e/tests/privileges.rs shows by running the agent without it.
                let caps = &pod["containers"][0]["securityContext"]["capabilities"];
                assert_eq!(caps["drop"], serde_json::json!(["ALL"]), "{caps}");
                assert_eq!(caps["add"], serde_json::json!(PRIVILEGES), "{caps}");
                assert_eq!(
                    pod["containers"][0]["securityContext"]["privileged"], false,
                    "{pod}"
                );
                // Cluster DNS is a Service this agent serves: the node's resolver instead.
                assert_eq!(pod["dnsPolicy"], "Default", "{pod}");
                // The API server, kube-proxy's ConfigMap (whose kubeconfig names the API
                // server's real address: the in-cluster one is a ClusterIP only we serve).
                let args: Vec<&str> = pod["containers"][0]["args"]
                    .as_array()
                    .expect("args")
                    .iter()
                    .filter_map(Value::as_str)
                    .collect();
                assert_eq!(args[0], "run", "{args:?}");
                assert!(args.contains(&"--source=kube"), "{args:?}");
                assert!(
                    args.contains(&"--config=/var/lib/kube-proxy/config.conf"),
                    "{args:?}"
                );
                let mounts = &pod["containers"][0]["volumeMounts"];
                assert!(
                    mounts
                        .as_array()
                        .is_some_and(|m| m.iter().any(|m| m["mountPath"] == "/var/lib/kube-proxy")),
                    "{mounts}"
                );
                assert!(
                    pod["volumes"]
                        .as_array()
                        .is_some_and(|v| v.iter().any(|v| v["configMap"]["name"] == "kube-proxy")),
                    "kube-proxy's ConfigMap is not mounted"
                );
                // Probes on kube-proxy's healthz port, on the paths the agent serves.
                for probe in ["startupProbe", "livenessProbe"] {
                    let p = &pod["containers"][0][probe]["httpGet"];
                    assert_eq!(p["port"], 10256, "{probe}: {p}");
                    assert_eq!(p["path"], "/livez", "{probe}: {p}");
                }
                // Image tags follow the crate's version.
                let image = pod["containers"][0]["image"].as_str().expect("image");
                assert_eq!(
                    image,
                    format!("proxy-agent:{}", env!("CARGO_PKG_VERSION")),
                    "image"
                );
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

/// `kubectl apply -k deploy/` applies every manifest, with the crate's image tag.
#[test]
fn kustomization_lists_every_manifest() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let text = std::fs::read_to_string(dir.join("kustomization.yaml")).expect("read");
    let k: Value = serde_norway::from_str(&text).expect("valid YAML");
    let resources: Vec<&str> = k["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for file in std::fs::read_dir(&dir).expect("deploy/") {
        let name = file
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .to_string();
        if name.ends_with(".yaml") && name != "kustomization.yaml" {
            assert!(
                resources.contains(&name.as_str()),
                "{name} not in kustomization"
            );
        }
    }
    for r in &resources {
        assert!(dir.join(r).exists(), "{r} listed but missing");
    }
    assert_eq!(k["images"][0]["newTag"], env!("CARGO_PKG_VERSION"));
}

#[test]
fn examples_build_the_demo_view() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let view =
        proxy_agent::runner::view_from_manifests(&dir, &Default::default(), &Default::default())
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
