//! What the cluster-in-a-box tests do through the API (`proxy_cluster::cluster`): `deploy/`'s
//! documents read and applied as they are, Pods made Ready as the kubelet would report
//! them for a testbed's backends, and the backends a Service reaches.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::{
    core::v1::{Pod, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use proxy_testbed::{Testbed, target};
use serde_json::{Value, json};

use crate::cluster::eventually;

/// The repository's `deploy/`.
pub fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// Every document of a YAML file.
pub fn yaml_docs(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    serde_norway::Deserializer::from_str(&text)
        .map(|d| Ok(serde::Deserialize::deserialize(d)?))
        .filter(|v: &Result<Value>| !matches!(v, Ok(Value::Null)))
        .collect()
}

pub fn object<T: serde::de::DeserializeOwned>(value: Value) -> Result<T> {
    Ok(serde_json::from_value(value)?)
}

/// Container `name` of the first `kind` (a Deployment, a DaemonSet) in the file `path`.
pub fn container(path: &Path, kind: &str, name: &str) -> Result<Value> {
    let doc = yaml_docs(path)?
        .into_iter()
        .find(|d| d["kind"] == kind)
        .with_context(|| format!("no {kind} in {}", path.display()))?;
    doc["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .cloned()
        .with_context(|| format!("no container {name} in {}", path.display()))
}

/// A list of strings (a container's `command` or `args`).
pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(String::from))
        .collect()
}

/// An agent argument of `deploy/` with the safety remaps for a testbed node: kube-proxy's
/// folder becomes `kube_proxy_dir`, the pin folder the testbed's, and `--cgroup=auto`
/// (which would hook every process here) the testbed's cgroup.
pub fn node_arg(arg: &str, kube_proxy_dir: &Path, tb: &Testbed) -> String {
    if arg == "--cgroup=auto" {
        return format!("--cgroup={}", tb.cgroup_path().display());
    }
    arg.replace("/var/lib/kube-proxy", &kube_proxy_dir.display().to_string())
        .replace("/bpffs/proxy-agent", &tb.pin_dir().display().to_string())
}

/// The ServiceAccounts, ClusterRoles and ClusterRoleBindings of `path`, applied as they
/// are; any other kind fails unless `others_allowed` (then it is left out).
pub async fn apply_rbac(client: &Client, path: &Path, others_allowed: bool) -> Result<()> {
    let pp = PostParams::default();
    for doc in yaml_docs(path)? {
        match doc["kind"].as_str() {
            Some("ServiceAccount") => {
                let ns = doc["metadata"]["namespace"].as_str().unwrap_or("default");
                Api::<ServiceAccount>::namespaced(client.clone(), ns)
                    .create(&pp, &object(doc.clone())?)
                    .await?;
            }
            Some("ClusterRole") => {
                Api::<ClusterRole>::all(client.clone())
                    .create(&pp, &object(doc.clone())?)
                    .await?;
            }
            Some("ClusterRoleBinding") => {
                Api::<ClusterRoleBinding>::all(client.clone())
                    .create(&pp, &object(doc.clone())?)
                    .await?;
            }
            _ if others_allowed => {}
            other => bail!("{}: unexpected kind {other:?}", path.display()),
        }
    }
    Ok(())
}

/// What the kubelet would report for Pod `web-{i}` (the testbed's backend `i`), the
/// Ready condition's transition now (the controller's trigger time comes from it).
pub async fn set_ready(pods: &Api<Pod>, i: usize, ready: bool) -> Result<()> {
    let ip = Testbed::backend_ip4(i);
    let now = k8s_openapi::chrono::Utc::now()
        .to_rfc3339_opts(k8s_openapi::chrono::SecondsFormat::Secs, true);
    let status = json!({"status": {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                        "lastTransitionTime": now}],
    }});
    pods.patch_status(
        &format!("web-{i}"),
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await?;
    Ok(())
}

/// The distinct backends that answered `count` connections to `vip:port`.
pub fn backends_seen(tb: &Testbed, vip: &str, port: u16, count: u32) -> Result<BTreeSet<String>> {
    let t = target(vip, port);
    let attempts = tb.client(&["--target", &t, "--count", &count.to_string()])?;
    if let Some(bad) = attempts.iter().find(|a| !a.ok) {
        bail!("a connection to {t} failed: {bad:?}\n{}", tb.agent_log());
    }
    Ok(attempts.into_iter().filter_map(|a| a.backend).collect())
}

/// Waits until connections to `vip:port` reach exactly `want` backends.
pub async fn until_backends(
    tb: &Testbed,
    vip: &str,
    port: u16,
    want: usize,
    what: &str,
) -> Result<()> {
    eventually(what, || async {
        Ok((backends_seen(tb, vip, port, 12)?.len() == want).then_some(()))
    })
    .await
    .with_context(|| tb.agent_log())
}
