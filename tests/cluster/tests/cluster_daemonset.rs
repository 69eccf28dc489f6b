//! The agent as the DaemonSet, started by real kubelets (`proxy_cluster::node`,
//! `proxy_cluster::daemonset`): deploy/ rendered as kustomize does and applied with only the
//! safety remaps (the bpffs host path, `--cgroup=auto` to each node's cgroup subtree),
//! its startup probe gating readiness; then Pods on two nodes reach Services through it
//! — a ClusterIP from a Pod (both backends, across nodes), a NodePort from outside the
//! nodes, a Pod reaching itself through its own Service — with no kube-proxy anywhere;
//! and a rolling update of the DaemonSet under that traffic with no failed request.
//! Needs root and the nodes' binaries.

use std::collections::BTreeSet;

use anyhow::{Context as _, Result};
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Pod, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api,
    api::{ListParams, LogParams, Patch, PatchParams, PostParams},
};
use proxy_cluster::{
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
    // Running is not yet in the Service: the probe below starts once the EndpointSlice
    // controller has both (a probe that began before once saw web-b alone).
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    eventually(
        "both web endpoints ready in the Service's slices",
        || async {
            let list = slices
                .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
                .await?;
            let ready = list
                .items
                .iter()
                .flat_map(|s| &s.endpoints)
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                .count();
            Ok((ready == 2).then_some(()))
        },
    )
    .await?;

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
    if seen != BTreeSet::from(["web-a", "web-b"]) {
        // What node-0's agent did meanwhile, for whoever reads the failure.
        let agent = running
            .items
            .iter()
            .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("node-0"))
            .and_then(|p| p.metadata.name.clone())
            .unwrap_or_default();
        let tail = LogParams {
            tail_lines: Some(60),
            ..LogParams::default()
        };
        let agent_log = agents.logs(&agent, &tail).await.unwrap_or_default();
        panic!("answers to {WEB_VIP} from a Pod: {logs}\nnode-0's agent ({agent}):\n{agent_log}");
    }

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

    // A rolling update of the DaemonSet under traffic: a Pod keeps asking the ClusterIP
    // (every 100 ms) and the test the NodePort from outside, while each node's agent is
    // replaced in turn (maxUnavailable 1). The programs and maps stay pinned while the
    // new agent adopts them: no request may fail.
    // 90 s of requests: the rollout below must end inside them.
    let steady = format!(
        "end=$(($(date +%s) + 90)); while [ $(date +%s) -lt $end ]; do \
         curl -q -s --connect-timeout 2 --max-time 3 http://{WEB_VIP}/hostname || echo FAILED; \
         echo; sleep 0.1; done"
    );
    pods.create(
        &pp,
        &agnhost_pod("steady", "node-0", &["/bin/sh", "-c", &steady], "Never")?,
    )
    .await?;
    wait_pod(&pods, "steady", "Running").await?;
    let before: BTreeSet<String> = agent_pods(&agents).await?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let outside = {
        let (stop, addr) = (stop.clone(), format!("{}:{NODE_PORT}", nodes.nodes()[1].ip));
        std::thread::spawn(move || {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match http_get(&addr, "/hostname") {
                    Ok(a) if a.starts_with("web-") => ok += 1,
                    other => failed.push(format!("{other:?}")),
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            (ok, failed)
        })
    };
    let started = std::time::Instant::now();
    let ds: Api<DaemonSet> = Api::namespaced(client.clone(), "kube-system");
    let bump = json!({"spec": {"template": {"metadata": {"annotations": {"test/rollout": "1"}}}}});
    ds.patch("proxy-agent", &PatchParams::default(), &Patch::Merge(&bump))
        .await?;
    daemonset::wait_rolled_out(&cluster, 2, None).await?;
    let rolled = started.elapsed();
    let after = agent_pods(&agents).await?;
    assert!(
        before.is_disjoint(&after),
        "every agent Pod replaced: {before:?} then {after:?}"
    );
    // A few more seconds of traffic after the last new agent is Ready.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (outside_ok, outside_failed) = outside
        .join()
        .map_err(|_| anyhow::anyhow!("outside client panicked"))?;
    assert!(
        outside_failed.is_empty() && outside_ok > 20,
        "NodePort from outside during the rollout ({rolled:?}): {outside_ok} ok, failed: {outside_failed:?}"
    );
    assert!(
        rolled < std::time::Duration::from_secs(80),
        "the rollout ({rolled:?}) outlasted the Pod's 90 s of requests"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(150);
    while pods
        .get("steady")
        .await?
        .status
        .and_then(|s| s.phase)
        .as_deref()
        != Some("Succeeded")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the steady Pod never finished"
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    let logs = pods.logs("steady", &LogParams::default()).await?;
    let answers: Vec<&str> = logs.lines().filter(|l| !l.is_empty()).collect();
    let failed = answers.iter().filter(|l| l.contains("FAILED")).count();
    assert!(
        failed == 0 && answers.len() >= 100,
        "ClusterIP from a Pod during the rollout ({rolled:?}): {failed} of {} failed",
        answers.len()
    );
    eprintln!(
        "rolling update: {rolled:?}; {} requests from a Pod and {outside_ok} from outside, none failed",
        answers.len()
    );
    drop(nodes);
    Ok(())
}

/// The names of the agent's Pods.
async fn agent_pods(agents: &Api<Pod>) -> Result<BTreeSet<String>> {
    Ok(agents
        .list(&ListParams::default().labels("app=proxy-agent"))
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect())
}
