//! The agent as the DaemonSet, started by real kubelets (`proxy_e2e::node`,
//! `proxy_e2e::daemonset`): deploy/ rendered as kustomize does and applied with only the
//! safety remaps (the bpffs host path, `--cgroup=auto` to each node's cgroup subtree),
//! its startup probe gating readiness; then Pods on two nodes reach Services through it
//! — a ClusterIP from a Pod (both backends, across nodes), a NodePort from outside the
//! nodes, a Pod reaching itself through its own Service — with no kube-proxy anywhere.
//! Needs root and the nodes' binaries.

use std::collections::BTreeSet;

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::{
    Api,
    api::{ListParams, LogParams, PostParams},
};
use proxy_e2e::{
    cluster::eventually,
    daemonset,
    node::{agnhost_pod, http_get, start_box, wait_pod},
};
use serde_json::json;
use test_support::needs_root;

const NS: &str = "ds";
const WEB_VIP: &str = "10.96.100.10";
const SELF_VIP: &str = "10.96.100.11";
const NODE_PORT: u16 = 30090;

#[tokio::test]
#[needs_root]
async fn the_daemonset_started_by_kubelets_serves_pods() -> Result<()> {
    let (nodes, cluster) = start_box("the_daemonset_started_by_kubelets_serves_pods", 2).await?;
    let client = cluster.client().await?;
    daemonset::deploy_agent(&cluster, &nodes, &nodes.cluster_pod_cidr()).await?;
    let agents: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    let running = agents
        .list(&ListParams::default().labels("app=proxy-agent"))
        .await?;
    let on: BTreeSet<String> = running
        .items
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    assert_eq!(on, BTreeSet::from(["node-0".into(), "node-1".into()]));

    cluster.create_namespace(NS).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();
    let server = ["/agnhost", "netexec", "--http-port=8080"];
    for (name, node) in [("web-a", "node-0"), ("web-b", "node-1")] {
        let mut pod = agnhost_pod(name, node, &server, "Always")?;
        pod.metadata
            .labels
            .get_or_insert_default()
            .insert("svc".into(), "web".into());
        pods.create(&pp, &pod).await?;
    }
    let port = json!([{"name": "http", "port": 80, "targetPort": 8080, "nodePort": NODE_PORT}]);
    services
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {"type": "NodePort", "clusterIP": WEB_VIP,
                         "selector": {"svc": "web"}, "ports": port}}))?,
        )
        .await?;
    services
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": "selfie"},
                "spec": {"clusterIP": SELF_VIP, "selector": {"app": "selfie"},
                         "ports": [{"port": 80, "targetPort": 8080}]}}))?,
        )
        .await?;
    wait_pod(&pods, "web-a", "Running").await?;
    wait_pod(&pods, "web-b", "Running").await?;

    // A ClusterIP from a Pod on node-0: both backends answer, none fails.
    let probe = format!(
        "for i in $(seq 30); do curl -q -s --connect-timeout 2 --max-time 5 \
         http://{WEB_VIP}/hostname || echo FAILED; echo; done"
    );
    pods.create(
        &pp,
        &agnhost_pod("client", "node-0", &["/bin/sh", "-c", &probe], "Never")?,
    )
    .await?;
    wait_pod(&pods, "client", "Succeeded").await?;
    let logs = pods.logs("client", &LogParams::default()).await?;
    let seen: BTreeSet<&str> = logs.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(
        seen,
        BTreeSet::from(["web-a", "web-b"]),
        "answers to {WEB_VIP} from a Pod: {logs}"
    );

    // The NodePort from outside the nodes (the root namespace's end of the box network),
    // on each node's address.
    for node in nodes.nodes() {
        let addr = format!("{}:{NODE_PORT}", node.ip);
        let answers: BTreeSet<String> = (0..20)
            .map(|_| http_get(&addr, "/hostname").map(|a| a.trim().to_string()))
            .collect::<Result<_>>()
            .with_context(|| format!("NodePort {addr} from outside the nodes"))?;
        assert_eq!(
            answers,
            BTreeSet::from(["web-a".into(), "web-b".into()]),
            "NodePort {addr}"
        );
    }

    // A Pod reaching itself through its own Service (the only endpoint: hairpin).
    let selfie = format!(
        "/agnhost netexec --http-port=8080 & sleep 2; \
         for i in $(seq 60); do curl -q -s --connect-timeout 2 --max-time 5 \
         http://{SELF_VIP}/hostname && echo && exit 0; sleep 1; done; exit 1"
    );
    pods.create(
        &pp,
        &agnhost_pod("selfie", "node-1", &["/bin/sh", "-c", &selfie], "Never")?,
    )
    .await?;
    eventually("the selfie Pod done", || async {
        let pod = pods.get("selfie").await?;
        let phase = pod.status.and_then(|s| s.phase).unwrap_or_default();
        Ok(matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase))
    })
    .await?;
    let logs = pods.logs("selfie", &LogParams::default()).await?;
    assert!(
        logs.lines().any(|l| l == "selfie"),
        "a Pod through its own Service {SELF_VIP}: {logs}"
    );
    drop(nodes);
    Ok(())
}
