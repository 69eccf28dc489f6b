//! Real nodes in the box (`proxy_cluster::node`): the scheduler places Pods on two kubelets,
//! containerd and runc start them from the images built here (agnhost, pause), the CNI
//! bridge gives them addresses, and traffic flows Pod to Pod across nodes and from outside
//! the nodes to a Pod. Needs root (namespaces, cgroups, mounts) and the nodes' binaries.

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api,
    api::{LogParams, PostParams},
};
use proxy_cluster::node::{agnhost_pod, http_get, start_box, wait_pod};
use test_support::needs_root;

const NS: &str = "nodes";

#[tokio::test]
#[needs_root]
async fn pods_run_on_two_kubelets_and_reach_each_other() -> Result<()> {
    let (nodes, cluster) = start_box("pods_run_on_two_kubelets_and_reach_each_other", 2).await?;
    cluster.create_namespace(NS).await?;
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, NS);
    let pp = PostParams::default();
    let server = ["/agnhost", "netexec", "--http-port=8080"];
    pods.create(&pp, &agnhost_pod("web-0", "node-0", &server, "Always")?)
        .await?;
    pods.create(&pp, &agnhost_pod("web-1", "node-1", &server, "Always")?)
        .await?;
    let web1 = wait_pod(&pods, "web-1", "Running").await?;
    let web0 = wait_pod(&pods, "web-0", "Running").await?;
    let ip_of = |p: &Pod| -> Result<String> {
        p.status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .context("Pod has no IP")
    };
    let (ip0, ip1) = (ip_of(&web0)?, ip_of(&web1)?);
    for (ip, node) in [(&ip0, &nodes.nodes()[0]), (&ip1, &nodes.nodes()[1])] {
        assert!(
            node.holds_pod_ip(ip.parse()?),
            "{ip} is not in {}",
            node.pod_cidr
        );
    }

    // From outside the nodes (the root namespace's end of the box network) to each Pod.
    for (ip, name) in [(&ip0, "web-0"), (&ip1, "web-1")] {
        let answer = http_get(&format!("{ip}:8080"), "/hostname")?;
        assert_eq!(answer.trim(), name, "GET /hostname from {ip}");
    }
    // Pod to Pod across nodes, with the e2e specs' own tools: curl and OpenBSD nc in the
    // agnhost image, through dash.
    let probe = format!(
        "curl -q -s --connect-timeout 2 http://{ip1}:8080/hostname; echo; \
         echo hostName | nc -v -t -w 2 {ip1} 8080 2>&1 | grep -c succeeded"
    );
    pods.create(
        &pp,
        &agnhost_pod("client", "node-0", &["/bin/sh", "-c", &probe], "Never")?,
    )
    .await?;
    wait_pod(&pods, "client", "Succeeded").await?;
    let logs = pods.logs("client", &LogParams::default()).await?;
    let lines: Vec<&str> = logs.lines().collect();
    assert_eq!(lines, ["web-1", "1"], "the client Pod's output: {logs:?}");
    // The Pods' processes are in each node's own cgroup subtree (the kubelet's
    // cgroupRoot), in every hierarchy.
    for i in 0..2 {
        assert!(
            nodes.pod_processes(i) >= 2,
            "node-{i}'s kubepods cgroups hold no pause and agnhost processes"
        );
    }
    Ok(())
}
