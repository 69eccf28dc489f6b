//! The DaemonSet on a real control plane: the cluster in a box (`proxy_cluster::cluster`: the
//! real kube-apiserver, etcd and EndpointSlice controller), `deploy/rbac.yaml` applied,
//! and the agent run with exactly the command line and environment of
//! `deploy/daemonset.yaml` (read from it, not copied), authenticated as the `proxy-agent`
//! ServiceAccount through kubeadm's kube-proxy ConfigMap — so a missing RBAC verb or a
//! wrong flag fails here. The "node" is a namespace testbed; Pods are made Ready through
//! the API (standing in for the kubelet) with the testbed's backend addresses, so the
//! real controller writes the slices the agent programs, and traffic checks each step.
//!
//! Two deliberate differences from a node, both for the safety rules of this repository:
//! host paths are the test's own folders (`/var/lib/kube-proxy`, `/sys/fs/bpf`), and
//! `--cgroup=auto` becomes the testbed's cgroup (auto would hook every process here).
//!
//! Needs root (namespaces, BPF) and the cluster binaries (`cargo xtask cluster
//! --build-only`); says which is missing when it skips.

use std::{collections::BTreeSet, path::Path};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::{
    core::v1::{Node, Pod, Service},
    discovery::v1::EndpointSlice,
    events::v1::Event,
};
use kube::{
    Api,
    api::{DeleteParams, ListParams, PostParams},
};
use proxy_cluster::{
    box_api::{
        apply_rbac, backends_seen, container, deploy, node_arg, object, set_ready, strings,
        until_backends,
    },
    cluster::{Cluster, ClusterOptions, eventually, require_binaries},
};
use proxy_testbed::{Path_, TCP_PORT, TCP_TARGET, Testbed, target};
use serde_json::{Value, json};
use test_support::needs_root;

const NODE: &str = "node-a";
/// The testbed node's address on the client side.
const NODE_IP: &str = "10.10.0.1";
const VIP: &str = "10.96.0.10";
const OTHER_PROXY_VIP: &str = "10.96.0.30";
const STICKY_VIP: &str = "10.96.0.11";
const NODE_PORT: i32 = 30081;
/// The testbed client's address, as an unmasqueraded backend sees it.
const CLIENT_IP: &str = "10.10.0.2";

/// An agent's argv and the environment it runs with.
struct Command {
    argv: Vec<String>,
    env: Vec<(String, String)>,
}

/// The agent container of `deploy/daemonset.yaml`: its argv (after the command's program)
/// with host paths mapped into `kube_proxy_dir` and the testbed, and its environment with
/// the downward API resolved for `NODE`.
fn daemonset_command(kube_proxy_dir: &Path, tb: &Testbed) -> Result<Command> {
    let container = container(&deploy().join("daemonset.yaml"), "DaemonSet", "agent")?;
    let command = strings(&container["command"]);
    assert_eq!(command.first().map(String::as_str), Some("proxy-agent"));
    let argv: Vec<String> = command[1..]
        .iter()
        .cloned()
        .chain(strings(&container["args"]))
        .map(|a| node_arg(&a, kube_proxy_dir, tb))
        .collect();
    let mut env = Vec::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().context("env name")?.to_string();
        if let Some(v) = e["value"].as_str() {
            env.push((name, v.to_string()));
        } else if e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName" {
            env.push((name, NODE.to_string()));
        } else if e["valueFrom"]["configMapKeyRef"]["optional"] == true {
            // proxy-agent-config has no such key on a kubeadm cluster: left unset.
        } else {
            bail!("daemonset.yaml: env {name} of a kind this test does not know: {e}");
        }
    }
    Ok(Command { argv, env })
}

/// kubeadm's `kube-proxy` ConfigMap: its config.conf verbatim (paths mapped) and a
/// kubeconfig.conf as kubeadm writes it, naming the API server and the token file.
fn write_kube_proxy_configmap(dir: &Path, cluster: &Cluster, token: &str) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let config = include_str!("../../../proxy-agent/tests/data/kubeadm-kube-proxy-config.conf")
        .replace("/var/lib/kube-proxy", &dir.display().to_string());
    std::fs::write(dir.join("config.conf"), config)?;
    let token_file = dir.join("token");
    std::fs::write(&token_file, token)?;
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority: {}\n    \
         server: {}\n  name: default\ncontexts:\n- context:\n    cluster: default\n    \
         namespace: default\n    user: default\n  name: default\ncurrent-context: default\n\
         users:\n- name: default\n  user:\n    tokenFile: {}\n",
        cluster.ca_file().display(),
        cluster.server(),
        token_file.display()
    );
    std::fs::write(dir.join("kubeconfig.conf"), kubeconfig)?;
    Ok(())
}

#[needs_root]
#[tokio::test(flavor = "multi_thread")]
async fn the_daemonsets_command_line_serves_a_real_clusters_services() -> Result<()> {
    const TEST: &str = "the_daemonsets_command_line_serves_a_real_clusters_services";
    let bin_dir = require_binaries(TEST);
    let mut cluster = Cluster::start(ClusterOptions::new(bin_dir)).await?;
    let client = cluster.client().await?;
    apply_rbac(&client, &deploy().join("rbac.yaml"), false).await?;

    let mut tb = Testbed::new(2)?;
    let node: Node = object(json!({
        "metadata": {"name": NODE, "labels": {"kubernetes.io/os": "linux"}},
        "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]},
    }))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let pp = PostParams::default();
    let port = json!([{"name": "http", "port": TCP_PORT, "targetPort": TCP_TARGET}]);
    for spec in [
        json!({"metadata": {"name": "web"},
               "spec": {"clusterIP": VIP, "selector": {"app": "web"}, "ports": port}}),
        // Never programmed: headless, ExternalName, and one for another service proxy.
        json!({"metadata": {"name": "headless"},
               "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": port}}),
        json!({"metadata": {"name": "external"},
               "spec": {"type": "ExternalName", "externalName": "example.invalid"}}),
        json!({"metadata": {"name": "other", "labels": {"service.kubernetes.io/service-proxy-name": "other-proxy"}},
               "spec": {"clusterIP": OTHER_PROXY_VIP, "selector": {"app": "web"}, "ports": port}}),
    ] {
        services.create(&pp, &object(spec)?).await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for i in 0..2 {
        let pod: Pod = object(json!({
            "metadata": {"name": format!("web-{i}"), "labels": {"app": "web"}},
            "spec": {"nodeName": NODE,
                     "containers": [{"name": "web", "image": "example.invalid/web"}]},
        }))?;
        pods.create(&pp, &pod).await?;
        set_ready(&pods, i, true).await?;
    }
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    eventually("the controller's slice with both Pods", || async {
        let lp = ListParams::default().labels("kubernetes.io/service-name=web");
        let ready = slices
            .list(&lp)
            .await?
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter())
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .count();
        Ok((ready == 2).then_some(()))
    })
    .await
    .with_context(|| cluster.log_tail("kube-controller-manager"))?;

    // The agent, as the DaemonSet runs it, as the proxy-agent ServiceAccount.
    let token = cluster
        .service_account_token("kube-system", "proxy-agent")
        .await?;
    let kube_proxy_dir = std::env::temp_dir().join(format!("pxy-kp-{}", tb.id));
    write_kube_proxy_configmap(&kube_proxy_dir, &cluster, &token)?;
    let _relay = cluster.expose_in_netns(Path::new(&format!("/run/netns/{}", tb.node_ns())))?;
    let Command { argv, env } = daemonset_command(&kube_proxy_dir, &tb)?;
    // `kubernetes` (10.96.0.1:443, no endpoints here) and web: nothing else.
    tb.start_agent_argv(&argv, &env, Path_::PerPacket, 2)
        .with_context(|| format!("argv {argv:?}"))?;
    let log = tb.agent_log();
    assert!(log.contains("API server reachable"), "{log}");
    until_backends(&tb, VIP, TCP_PORT, 2, "both Pods serving").await?;
    let dump = tb.dump()?;
    let vips: BTreeSet<String> = dump["services"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["frontend"].as_str().map(String::from))
        .collect();
    assert!(
        !vips.iter().any(|v| v.contains(OTHER_PROXY_VIP)),
        "another proxy's Service was programmed: {vips:?}"
    );

    // kube-proxy's birth cry, written with the ServiceAccount's RBAC.
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    eventually("the Starting event on the Node", || async {
        Ok(events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("Starting")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(NODE)
            }))
    })
    .await?;

    // A Pod turning NotReady: new connections avoid it.
    set_ready(&pods, 1, false).await?;
    until_backends(
        &tb,
        VIP,
        TCP_PORT,
        1,
        "only web-0 after web-1 turned NotReady",
    )
    .await?;

    // The API server restarts: traffic keeps flowing, and a change made as it comes back
    // (before the agent's watch is back) is caught by the relist.
    cluster.stop_apiserver();
    assert_eq!(
        backends_seen(&tb, VIP, TCP_PORT, 6)?.len(),
        1,
        "traffic while the API server is down"
    );
    cluster.start_apiserver().await?;
    set_ready(&pods, 1, true).await?;
    until_backends(
        &tb,
        VIP,
        TCP_PORT,
        2,
        "web-1 back after the API server restart",
    )
    .await?;

    // Session affinity: one client, one Pod.
    let sticky = json!({"metadata": {"name": "sticky"},
        "spec": {"clusterIP": STICKY_VIP, "selector": {"app": "web"}, "ports": port,
                 "sessionAffinity": "ClientIP"}});
    services.create(&pp, &object(sticky)?).await?;
    let t = target(STICKY_VIP, TCP_PORT);
    let sticky_seen = eventually("the sticky Service", || async {
        let attempts = tb.client(&["--target", &t, "--count", "12"])?;
        Ok(attempts.iter().all(|a| a.ok).then(|| {
            attempts
                .into_iter()
                .filter_map(|a| a.backend)
                .collect::<BTreeSet<_>>()
        }))
    })
    .await
    .with_context(|| tb.agent_log())?;
    assert_eq!(
        sticky_seen.len(),
        1,
        "ClientIP affinity spread: {sticky_seen:?}"
    );

    // A LoadBalancer Service (no load balancer here: its NodePort and health check are
    // what one would use) with externalTrafficPolicy: Local: outside clients keep their
    // address; the healthCheckNodePort counts this node's endpoints.
    let local = json!({"metadata": {"name": "local"},
        "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local", "selector": {"app": "web"},
                 "ports": [{"name": "http", "port": TCP_PORT, "targetPort": TCP_TARGET,
                            "nodePort": NODE_PORT}]}});
    let local = services.create(&pp, &object(local)?).await?;
    let hc_port = local
        .spec
        .and_then(|s| s.health_check_node_port)
        .context("no healthCheckNodePort allocated")?;
    let t = target(NODE_IP, NODE_PORT as u16);
    let attempts = eventually("the eTP Local NodePort", || async {
        let attempts = tb.client(&["--target", &t, "--count", "6"])?;
        Ok(attempts.iter().all(|a| a.ok).then_some(attempts))
    })
    .await
    .with_context(|| tb.agent_log())?;
    for a in &attempts {
        let seen = a.seen_as.as_deref().unwrap_or("");
        assert!(seen.starts_with(CLIENT_IP), "eTP Local masqueraded: {a:?}");
    }
    let health = eventually("the health-check node port", || async {
        Ok(tb.get_in_node(&format!("http://{NODE_IP}:{hc_port}/")).ok())
    })
    .await?;
    let health: Value = serde_json::from_str(health.trim()).context("health JSON")?;
    assert_eq!(health["localEndpoints"], 2, "{health}");
    assert_eq!(health["service"]["name"], "local", "{health}");

    // A Pod terminating (deleted with a grace period; no kubelet ends it): its open
    // connection finishes on it, new connections avoid it.
    let mut session = tb.spawn_session(&target(VIP, TCP_PORT), 200)?;
    let first = session.first_attempt()?;
    let held = first.backend.clone().context("first answer")?;
    let held_pod = (0..2)
        .find(|i| Testbed::backend_name(*i) == held)
        .context("which Pod answered")?;
    pods.delete(
        &format!("web-{held_pod}"),
        &DeleteParams {
            grace_period_seconds: Some(300),
            ..DeleteParams::default()
        },
    )
    .await?;
    eventually("new connections off the terminating Pod", || async {
        let seen = backends_seen(&tb, VIP, TCP_PORT, 12)?;
        Ok((seen.len() == 1 && !seen.contains(&held)).then_some(()))
    })
    .await
    .with_context(|| tb.agent_log())?;
    let attempts = session.finish()?;
    assert!(
        attempts
            .iter()
            .all(|a| a.ok && a.backend.as_deref() == Some(held.as_str())),
        "the terminating Pod's connection broke or moved: {attempts:?}"
    );

    // Network programming latency from the real controller's trigger times.
    let metrics = tb.get_in_node("http://127.0.0.1:10249/metrics")?;
    let count = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kubeproxy_network_programming_duration_seconds_count "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .with_context(|| format!("no programming histogram:\n{metrics}"))?;
    assert!(count >= 2.0, "changes observed: {count}\n{metrics}");

    // The Service deleted: its VIP is no longer translated.
    let before = tb.dump()?["services"].as_array().map_or(0, Vec::len);
    services.delete("web", &DeleteParams::default()).await?;
    tb.wait_frontends(before - 1)
        .with_context(|| tb.agent_log())?;
    let gone = tb.client(&[
        "--target",
        &target(VIP, TCP_PORT),
        "--count",
        "1",
        "--timeout-ms",
        "500",
    ])?;
    assert!(!gone[0].ok, "still served after deletion: {gone:?}");
    let _ = std::fs::remove_dir_all(&kube_proxy_dir);
    Ok(())
}
