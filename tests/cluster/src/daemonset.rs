//! The agent as deploy/ ships it, on the box's real nodes ([`crate::node`]): the
//! kustomization rendered (its resources, namespace and image tags — all it uses), then
//! applied with only the safety remaps below, kubeadm's `kube-proxy` ConfigMap beside it,
//! and the kubelets start it.
//!
//! Remaps (each a path of the machine, never of the node alone):
//! - the `bpffs` hostPath `/sys/fs/bpf` becomes a folder of the box: each node's
//!   init container mounts its own bpffs there, inside that node's mount namespace;
//! - `--cgroup=auto` becomes the node's own cgroup v2 subtree (`$(NODE_NAME)` expanded by
//!   the kubelet): auto would hook the machine's root cgroup.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};
use kube::{
    Api, Client,
    api::{DynamicObject, PostParams},
    discovery::Scope,
};
use serde_json::{Value, json};

use crate::{cluster::Cluster, node::Nodes};

/// How long the DaemonSet gets until every node's agent is Ready (its startup probe).
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// deploy/, as `kubectl kustomize deploy/` renders it: each resource's documents, the
/// namespace set where missing, and `images:` applied to every container.
pub fn kustomize(dir: &Path) -> Result<Vec<Value>> {
    let kustomization: Value = serde_norway::from_str(
        &std::fs::read_to_string(dir.join("kustomization.yaml")).context("kustomization.yaml")?,
    )?;
    let namespace = kustomization["namespace"].as_str();
    let mut docs = Vec::new();
    for resource in kustomization["resources"].as_array().into_iter().flatten() {
        let file = dir.join(resource.as_str().context("a resource is a path")?);
        let text = std::fs::read_to_string(&file).with_context(|| format!("{}", file.display()))?;
        for doc in serde_norway::Deserializer::from_str(&text) {
            let mut doc: Value = serde::Deserialize::deserialize(doc)?;
            if doc.is_null() {
                continue;
            }
            if let Some(ns) = namespace {
                let kind = doc["kind"].as_str().unwrap_or_default();
                if !matches!(kind, "ClusterRole" | "ClusterRoleBinding" | "Namespace") {
                    doc["metadata"]["namespace"] = json!(ns);
                }
            }
            docs.push(doc);
        }
    }
    for image in kustomization["images"].as_array().into_iter().flatten() {
        let name = image["name"].as_str().context("images: a name")?;
        let new_name = image["newName"].as_str().unwrap_or(name);
        let tag = image["newTag"].as_str();
        for doc in &mut docs {
            let spec = &mut doc["spec"]["template"]["spec"];
            for list in ["initContainers", "containers"] {
                for c in spec[list].as_array_mut().into_iter().flatten() {
                    let current = c["image"].as_str().unwrap_or_default();
                    let (base, old_tag) = current.split_once(':').unwrap_or((current, ""));
                    if base == name {
                        c["image"] = json!(format!("{new_name}:{}", tag.unwrap_or(old_tag)));
                    }
                }
            }
        }
    }
    Ok(docs)
}

/// The safety remaps (module doc) on the DaemonSet of `docs`.
pub fn remap_for_box(docs: &mut [Value], nodes: &Nodes, bpffs: &Path) -> Result<()> {
    let ds = docs
        .iter_mut()
        .find(|d| d["kind"] == "DaemonSet")
        .context("deploy/ has no DaemonSet")?;
    let spec = &mut ds["spec"]["template"]["spec"];
    for volume in spec["volumes"].as_array_mut().into_iter().flatten() {
        if volume["hostPath"]["path"] == "/sys/fs/bpf" {
            volume["hostPath"]["path"] = json!(bpffs);
        }
    }
    let cgroup = nodes.cgroup_v2_path_of("$(NODE_NAME)");
    let agent = spec["containers"]
        .as_array_mut()
        .and_then(|c| c.iter_mut().find(|c| c["name"] == "agent"))
        .context("no agent container")?;
    let args = agent["args"].as_array_mut().context("agent args")?;
    let auto = args
        .iter_mut()
        .find(|a| *a == "--cgroup=auto")
        .context("the agent's args have no --cgroup=auto to remap")?;
    *auto = json!(format!("--cgroup={}", cgroup.display()));
    Ok(())
}

/// kubeadm's `kube-proxy` ConfigMap: its config.conf (clusterCIDR: the box's Pod range)
/// and a kubeconfig.conf naming the API server as the nodes reach it, with the Pod's
/// ServiceAccount token and CA, as kubeadm writes it.
pub async fn create_kube_proxy_configmap(
    client: &Client,
    cluster: &Cluster,
    pod_cidr: &str,
) -> Result<()> {
    let config = include_str!("../../../proxy-agent/tests/data/kubeadm-kube-proxy-config.conf")
        .replace(
            "clusterCIDR: 10.244.0.0/16",
            &format!("clusterCIDR: {pod_cidr}"),
        );
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority: \
         /var/run/secrets/kubernetes.io/serviceaccount/ca.crt\n    server: {}\n  name: default\n\
         contexts:\n- context:\n    cluster: default\n    namespace: default\n    user: default\n  \
         name: default\ncurrent-context: default\nusers:\n- name: default\n  user:\n    \
         tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n",
        cluster.server()
    );
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "kube-proxy", "namespace": "kube-system"},
        "data": {"config.conf": config, "kubeconfig.conf": kubeconfig},
    }))?;
    Api::<ConfigMap>::namespaced(client.clone(), "kube-system")
        .create(&PostParams::default(), &cm)
        .await
        .context("creating kube-system/kube-proxy")?;
    Ok(())
}

/// Creates every object of `docs` (any kind the API server serves).
pub async fn apply(client: &Client, docs: &[Value]) -> Result<()> {
    for doc in docs {
        let api_version = doc["apiVersion"].as_str().context("apiVersion")?;
        let kind = doc["kind"].as_str().context("kind")?;
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let gvk = kube::api::GroupVersionKind::gvk(group, version, kind);
        let (resource, caps) = kube::discovery::pinned_kind(client, &gvk)
            .await
            .with_context(|| format!("discovering {api_version} {kind}"))?;
        let obj: DynamicObject = serde_json::from_value(doc.clone())?;
        let api: Api<DynamicObject> = match (caps.scope, obj.metadata.namespace.as_deref()) {
            (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &resource),
            (Scope::Namespaced, None) => Api::default_namespaced_with(client.clone(), &resource),
            (Scope::Cluster, _) => Api::all_with(client.clone(), &resource),
        };
        api.create(&PostParams::default(), &obj)
            .await
            .with_context(|| format!("creating {kind} {:?}", obj.metadata.name))?;
    }
    Ok(())
}

/// deploy/ on the box: rendered, remapped, applied with kubeadm's ConfigMap; returns once
/// the DaemonSet's Pod is Ready on every node (the kubelet's startup probe passed).
pub async fn deploy_agent(cluster: &Cluster, nodes: &Nodes, pod_cidr: &str) -> Result<Vec<Value>> {
    let client = cluster.client().await?;
    let deploy = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let mut docs = kustomize(&deploy)?;
    remap_for_box(&mut docs, nodes, &cluster.dir().join("bpffs"))?;
    create_kube_proxy_configmap(&client, cluster, pod_cidr).await?;
    apply(&client, &docs).await?;
    wait_rolled_out(cluster, nodes.nodes().len(), None).await?;
    Ok(docs)
}

/// Waits until the DaemonSet has `count` Ready Pods of its current template (after an
/// update: none of the old one left).
pub async fn wait_rolled_out(
    cluster: &Cluster,
    count: usize,
    deadline: Option<Instant>,
) -> Result<()> {
    let api: Api<DaemonSet> = Api::namespaced(cluster.client().await?, "kube-system");
    let deadline = deadline.unwrap_or_else(|| Instant::now() + READY_TIMEOUT);
    loop {
        let ds = api.get("proxy-agent").await?;
        let generation = ds.metadata.generation.unwrap_or_default();
        let status = ds.status.unwrap_or_default();
        let done = status.observed_generation == Some(generation)
            && status.updated_number_scheduled.unwrap_or_default() as usize == count
            && status.number_ready as usize == count
            && status.number_available.unwrap_or_default() as usize == count
            && status.desired_number_scheduled as usize == count;
        if done {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "DaemonSet proxy-agent not rolled out on {count} nodes: {status:?}\n{}",
                cluster.log_tail("node-0-kubelet")
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
