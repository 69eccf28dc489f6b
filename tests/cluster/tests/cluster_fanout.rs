//! Fan-out mode on a real control plane: `proxy-agent serve` run with the command line of
//! `deploy/fanout/server.yaml` (read from it) as its ServiceAccount, with exactly the RBAC
//! that file grants, against the cluster in a box's real kube-apiserver and EndpointSlice
//! controller; the node's agent run with `deploy/fanout/agent-fed.yaml`'s arguments, fed
//! only by the server over mutual TLS (its identity the kubelet-style client certificate
//! `system:node:node-a` signed by the cluster CA, as the overlay uses), with no
//! kubeconfig at all. Pods are made Ready through the API (no kubelet here), so the real
//! controller writes the slices that cross the hop; traffic checks each step, through
//! an API server restart and a kill -9 of the server.
//!
//! The safety remaps of `cluster_agent.rs` hold: host paths are the test's folders, the
//! cgroup is the testbed's; both processes live in the testbed node's namespace, where
//! the server listens on loopback (on a cluster: the control-plane nodes' addresses).
//! Needs root and the cluster binaries (`cargo xtask cluster --build-only`).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::{Api, api::PostParams};
use proxy_cluster::{
    box_api::{
        apply_rbac, backends_seen, container, deploy, node_arg, object, set_ready, strings,
        until_backends,
    },
    cluster::{Cluster, ClusterOptions, eventually, require_binaries},
};
use proxy_testbed::{Path_, TCP_PORT, TCP_TARGET, Testbed, agent_bin, metric};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use serde_json::{Value, json};
use test_support::needs_root;

const NODE: &str = "node-a";
const NODE_IP: &str = "10.10.0.1";
const VIP: &str = "10.96.0.10";
const FEED: &str = "127.0.0.1:10270";
const SERVER_METRICS: &str = "127.0.0.1:10271";

/// A container's `args` in a manifest file.
fn container_args(file: &Path, kind: &str, name: &str) -> Result<Vec<String>> {
    Ok(strings(&container(file, kind, name)?["args"]))
}

/// The feed's TLS files as the overlay expects them: the Secret `proxy-agent-feed-tls`
/// (a feed CA and the server's certificate for its address), the cluster CA for the
/// nodes' client certificates, and the node's kubelet client certificate and key in one
/// PEM (`kubelet-client-current.pem`).
struct FeedPki {
    feed_dir: PathBuf,
    kubelet_pem: PathBuf,
}

fn feed_pki(dir: &Path, cluster: &Cluster) -> Result<FeedPki> {
    let feed_dir = dir.join("feed");
    std::fs::create_dir_all(&feed_dir)?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "proxy-agent-feed-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate()?;
    std::fs::write(feed_dir.join("ca.crt"), ca.self_signed(&ca_key)?.pem())?;
    let issuer = Issuer::new(ca, ca_key);
    let mut server = CertificateParams::new(vec!["127.0.0.1".to_string()])?;
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate()?;
    std::fs::write(
        feed_dir.join("tls.crt"),
        server.signed_by(&key, &issuer)?.pem(),
    )?;
    std::fs::write(feed_dir.join("tls.key"), key.serialize_pem())?;
    // The kubelet's client certificate: system:node:<name> in system:nodes, by the
    // cluster CA.
    let kubeconfig = dir.join("kubelet-client.kubeconfig");
    let (cert, key) = cluster.write_client_kubeconfig(
        &kubeconfig,
        &format!("system:node:{NODE}"),
        &["system:nodes"],
    )?;
    let pem = std::fs::read_to_string(cert)? + &std::fs::read_to_string(key)?;
    let kubelet_pem = dir.join("kubelet-client-current.pem");
    std::fs::write(&kubelet_pem, pem)?;
    Ok(FeedPki {
        feed_dir,
        kubelet_pem,
    })
}

/// The server as `server.yaml` runs it, its paths mapped, listening on the node's
/// loopback, in the testbed node's namespace.
struct Server {
    child: Child,
    log: PathBuf,
}

impl Server {
    fn start(
        tb: &Testbed,
        dir: &Path,
        pki: &FeedPki,
        cluster: &Cluster,
        kubeconfig: &Path,
    ) -> Result<Self> {
        let args: Vec<String> =
            container_args(&deploy().join("fanout/server.yaml"), "Deployment", "serve")?
                .into_iter()
                .map(|a| {
                    let a = a
                        .replace("/etc/proxy-agent/feed", &pki.feed_dir.display().to_string())
                        .replace(
                            "/etc/proxy-agent/cluster-ca/ca.crt",
                            &cluster.ca_file().display().to_string(),
                        );
                    if a.starts_with("--listen=") {
                        format!("--listen={FEED}")
                    } else {
                        a
                    }
                })
                .collect();
        if args.first().map(String::as_str) != Some("serve")
            || !args.iter().any(|a| a.starts_with("--metrics-address="))
        {
            bail!("server.yaml's args: not serve with a metrics address: {args:?}");
        }
        let log = dir.join("server.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let child = Command::new(agent_bin())
            .arg("--netns")
            .arg(format!("/run/netns/{}", tb.node_ns()))
            .args(&args)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .env("NODE_NAME", "control-plane")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting proxy-agent serve")?;
        Ok(Self { child, log })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The fed agent: `agent-fed.yaml`'s args, paths mapped as in `cluster_agent.rs`.
fn fed_agent_argv(tb: &Testbed, dir: &Path, pki: &FeedPki) -> Result<Vec<String>> {
    let args = container_args(
        &deploy().join("fanout/agent-fed.yaml"),
        "DaemonSet",
        "agent",
    )?;
    Ok(args
        .into_iter()
        .map(|a| {
            let a = a
                .replace("$(FEED_SERVERS)", FEED)
                .replace(
                    "/var/lib/kubelet/pki/kubelet-client-current.pem",
                    &pki.kubelet_pem.display().to_string(),
                )
                .replace("/etc/proxy-agent/feed", &pki.feed_dir.display().to_string());
            node_arg(&a, dir, tb)
        })
        .collect())
}

#[needs_root]
#[tokio::test(flavor = "multi_thread")]
async fn agents_fed_only_by_the_server_serve_a_real_clusters_services() -> Result<()> {
    const TEST: &str = "agents_fed_only_by_the_server_serve_a_real_clusters_services";
    let bin_dir = require_binaries(TEST);
    let mut cluster = Cluster::start(ClusterOptions::new(bin_dir)).await?;
    let client = cluster.client().await?;
    // The server's ServiceAccount and RBAC exactly as the overlay grants them.
    apply_rbac(&client, &deploy().join("fanout/server.yaml"), true).await?;

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
    services
        .create(
            &pp,
            &object(json!({"metadata": {"name": "web"},
            "spec": {"clusterIP": VIP, "selector": {"app": "web"}, "ports": port}}))?,
        )
        .await?;
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

    let dir = std::env::temp_dir().join(format!("pxy-fanout-box-{}", tb.id));
    std::fs::create_dir_all(&dir)?;
    // kubeadm's kube-proxy config, which the fed DaemonSet still reads (no kubeconfig.conf:
    // a fed agent that reached for the API server would fail).
    std::fs::write(
        dir.join("config.conf"),
        include_str!("../../../proxy-agent/tests/data/kubeadm-kube-proxy-config.conf")
            .replace("/var/lib/kube-proxy", &dir.display().to_string()),
    )?;
    let pki = feed_pki(&dir, &cluster)?;
    let kubeconfig = cluster
        .service_account_kubeconfig("kube-system", "proxy-agent-serve")
        .await?;
    let _relay = cluster.expose_in_netns(Path::new(&format!("/run/netns/{}", tb.node_ns())))?;
    let mut server = Server::start(&tb, &dir, &pki, &cluster, &kubeconfig)?;

    let argv = fed_agent_argv(&tb, &dir, &pki)?;
    let env = [("NODE_NAME".to_string(), NODE.to_string())];
    // `kubernetes` (10.96.0.1:443, no endpoints here) and web.
    tb.start_agent_argv(&argv, &env, Path_::PerPacket, 2)
        .with_context(|| format!("argv {argv:?}\nserver:\n{}", server.log()))?;
    until_backends(&tb, VIP, TCP_PORT, 2, "both Pods, through the server").await?;
    let log = tb.agent_log();
    assert!(log.contains("the feed streams"), "{log}");
    assert!(
        !log.contains("API server reachable"),
        "a fed agent reached the API server:\n{log}"
    );

    // A Pod turning NotReady: the controller's slice change crosses the hop.
    set_ready(&pods, 1, false).await?;
    until_backends(
        &tb,
        VIP,
        TCP_PORT,
        1,
        "only web-0 after web-1 turned NotReady",
    )
    .await?;

    // The API server restarts: the server relists, the agents never notice.
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

    // kill -9 of the server: the pins keep serving; a change made while it is down
    // arrives once it is back (a new epoch: a snapshot, applied as a diff).
    server.kill();
    set_ready(&pods, 0, false).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        backends_seen(&tb, VIP, TCP_PORT, 12)?.len(),
        2,
        "traffic without a server"
    );
    let mut server = Server::start(&tb, &dir, &pki, &cluster, &kubeconfig)?;
    until_backends(
        &tb,
        VIP,
        TCP_PORT,
        1,
        "web-0's NotReady after the server came back",
    )
    .await
    .with_context(|| server.log())?;

    // Programming latency from the real controller's trigger times, across the hop.
    let metrics = tb.get_in_node("http://127.0.0.1:10249/metrics")?;
    let count = metric(
        &metrics,
        "kubeproxy_network_programming_duration_seconds_count",
    )
    .with_context(|| format!("no programming histogram:\n{metrics}"))?;
    assert!(count >= 2.0, "changes observed: {count}\n{metrics}");

    // The server's own metrics and health.
    let served: Value = eventually("the server's metrics", || async {
        let text = tb.get_in_node(&format!("http://{SERVER_METRICS}/metrics"))?;
        let connected = metric(&text, "proxy_agent_feed_nodes_connected");
        Ok((connected == Some(1.0)).then(|| {
            json!({"ready": metric(&text, "proxy_agent_feed_ready"),
                   "snapshots": metric(&text, "proxy_agent_feed_snapshots_total"),
                   "objects": metric(&text, "proxy_agent_feed_objects")})
        }))
    })
    .await
    .with_context(|| server.log())?;
    assert_eq!(served["ready"], 1.0, "{served}");
    assert!(served["snapshots"].as_f64() >= Some(1.0), "{served}");
    // Two Services (kubernetes, web) and web's slice at least.
    assert!(served["objects"].as_f64() >= Some(3.0), "{served}");
    let health = tb.get_in_node(&format!("http://{SERVER_METRICS}/healthz"))?;
    assert!(health.contains("ok"), "{health}");
    server.kill();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
