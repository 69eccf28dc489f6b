//! `cargo xtask cluster-scale`: the agent against the cluster in a box at N Services, as
//! an operator would meet it — Services and Pods created through the API, the real
//! EndpointSlice controller writing the slices — measuring the time from the agent's
//! start to every Service programmed, then the network programming latency (from the
//! controller's trigger time to this node holding the change) under a churn of Pod
//! readiness changes, with the agent's CPU and RSS. Root (the agent's namespace and
//! bpffs); loopback only.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use proxy_cluster::cluster::{Cluster, ClusterOptions};
use proxy_testbed::{Path_, Testbed, metric};
use serde_json::json;
use tokio::{sync::Semaphore, task::JoinSet};

#[derive(Parser)]
struct Args {
    /// Folder holding etcd, kube-apiserver and kube-controller-manager.
    #[arg(long)]
    bin_dir: std::path::PathBuf,
    /// Services (one Pod each).
    #[arg(long, default_value_t = 1000)]
    services: usize,
    /// Pod readiness flips per second during the churn.
    #[arg(long, default_value_t = 20)]
    changes_per_s: u32,
    /// Length of the churn.
    #[arg(long, default_value_t = 30)]
    churn_s: u64,
}

const NODE: &str = "node-a";
/// Requests in flight while creating objects.
const PARALLEL: usize = 32;

fn pod_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256)
}

fn now_rfc3339() -> String {
    k8s_openapi::chrono::Utc::now()
        .to_rfc3339_opts(k8s_openapi::chrono::SecondsFormat::Micros, true)
}

async fn set_ready(pods: &Api<Pod>, i: usize, ready: bool) -> Result<()> {
    let status = json!({"status": {"phase": "Running", "podIP": pod_ip(i), "podIPs": [{"ip": pod_ip(i)}],
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                        "lastTransitionTime": now_rfc3339()}]}});
    pods.patch_status(
        &format!("p{i}"),
        &PatchParams::default(),
        &Patch::Merge(&status),
    )
    .await?;
    Ok(())
}

/// Runs `f(i)` for every `i` in `0..n`, `PARALLEL` at a time.
async fn for_each<F, Fut>(n: usize, f: F) -> Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(PARALLEL));
    let mut tasks = JoinSet::new();
    for i in 0..n {
        let permit = permits.clone().acquire_owned().await?;
        let fut = f(i);
        tasks.spawn(async move {
            let r = fut.await;
            drop(permit);
            r
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

/// A Prometheus histogram's cumulative buckets: (upper bound, count).
fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&format!("{name}_bucket{{le=\""))?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The upper bound of the bucket holding quantile `q` of what a histogram observed
/// between two scrapes.
fn quantile(before: &str, after: &str, name: &str, q: f64) -> Option<f64> {
    let old = buckets(before, name);
    let delta: Vec<(f64, f64)> = buckets(after, name)
        .into_iter()
        .map(|(le, c)| {
            let was = old.iter().find(|(l, _)| *l == le).map_or(0.0, |(_, c)| *c);
            (le, c - was)
        })
        .collect();
    let total = delta.last()?.1;
    delta
        .iter()
        .find(|(_, c)| *c >= q * total && total > 0.0)
        .map(|(le, _)| *le)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    test_support::require_root("cluster-scale")?;
    let n = args.services;
    let cluster = Cluster::start(ClusterOptions::new(&args.bin_dir)).await?;
    let client = cluster.client().await?;
    let node: Node = serde_json::from_value(json!({"metadata": {"name": NODE},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.10.0.1"}]}}))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");

    let created = Instant::now();
    for_each(n, |i| {
        let (services, pods) = (services.clone(), pods.clone());
        async move {
            let svc: Service = serde_json::from_value(json!({"metadata": {"name": format!("s{i}")},
                "spec": {"selector": {"svc": format!("s{i}")},
                         "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}))?;
            services.create(&PostParams::default(), &svc).await?;
            let pod: Pod = serde_json::from_value(json!({"metadata": {"name": format!("p{i}"),
                    "labels": {"svc": format!("s{i}")}},
                "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "example.invalid/c"}]}}))?;
            pods.create(&PostParams::default(), &pod).await?;
            set_ready(&pods, i, true).await
        }
    })
    .await?;
    println!(
        "created {n} Services and {n} Pods in {:.1} s",
        created.elapsed().as_secs_f64()
    );
    // The controller's own pace is not the agent's: wait for every slice first.
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> =
        Api::namespaced(client.clone(), "default");
    loop {
        let ready = slices
            .list(&Default::default())
            .await?
            .items
            .iter()
            .filter(|s| {
                s.endpoints
                    .iter()
                    .any(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            })
            .count();
        if ready >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "the EndpointSlice controller wrote all {n} slices {:.1} s after the first object",
        created.elapsed().as_secs_f64()
    );

    let mut tb = Testbed::new(1)?;
    let kubeconfig = cluster.admin_kubeconfig().display().to_string();
    let _relay = cluster.expose_in_netns(std::path::Path::new(&format!(
        "/run/netns/{}",
        tb.node_ns()
    )))?;
    let argv: Vec<String> = [
        "run",
        "--source=kube",
        &format!("--kubeconfig={kubeconfig}"),
        &format!("--bpffs={}", tb.pin_dir().display()),
        "--cgroup=none",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let env = vec![("NODE_NAME".to_string(), NODE.to_string())];
    // The controller may still be writing slices: "all programmed" is every Service with
    // its endpoint, read from the agent's own view.
    let started = Instant::now();
    tb.start_agent_argv(&argv, &env, Path_::PerPacket, 0)?;
    let metrics = || tb.get_in_node("http://127.0.0.1:10249/metrics");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        // From the pinned maps themselves: frontends that hold a backend.
        let with_endpoints = tb.dump().map_or(0, |d| {
            d["services"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|s| s["backends"].as_array().is_some_and(|b| !b.is_empty()))
                .count()
        });
        if with_endpoints >= n {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "not all programmed after 600 s ({with_endpoints} of {n})\n{}",
                tb.agent_log()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let all_programmed = started.elapsed();
    println!(
        "agent start to all {n} Services programmed: {:.2} s",
        all_programmed.as_secs_f64()
    );

    // Churn: readiness flips at a steady rate.
    let before = metrics()?;
    let cpu0 = metric(&before, "process_cpu_seconds_total").unwrap_or(0.0);
    let count0 = metric(
        &before,
        "proxy_agent_network_programming_duration_seconds_count",
    )
    .unwrap_or(0.0);
    let period = Duration::from_secs_f64(1.0 / f64::from(args.changes_per_s.max(1)));
    let churn_end = Instant::now() + Duration::from_secs(args.churn_s);
    let mut i = 0usize;
    let mut flips = 0u64;
    let mut tick = tokio::time::interval(period);
    while Instant::now() < churn_end {
        tick.tick().await;
        let pods = pods.clone();
        let (k, ready) = (i % n, (i / n) % 2 == 1);
        tokio::spawn(async move { set_ready(&pods, k, ready).await });
        i += 1;
        flips += 1;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = metrics()?;
    let cpu = metric(&after, "process_cpu_seconds_total").unwrap_or(0.0) - cpu0;
    let observed = metric(
        &after,
        "proxy_agent_network_programming_duration_seconds_count",
    )
    .unwrap_or(0.0)
        - count0;
    let name = "proxy_agent_network_programming_duration_seconds";
    let rss = metric(&after, "process_resident_memory_bytes").unwrap_or(0.0) / 1_048_576.0;
    println!(
        "churn: {flips} readiness changes at {}/s for {} s; {observed} slice changes observed",
        args.changes_per_s, args.churn_s
    );
    println!(
        "network programming latency during the churn (trigger time to this node; bucket \
         upper bounds): p50 <= {:?} s, p99 <= {:?} s",
        quantile(&before, &after, name, 0.5),
        quantile(&before, &after, name, 0.99)
    );
    println!(
        "agent CPU during the churn: {:.1}% of a core; RSS {:.0} MiB",
        100.0 * cpu / (args.churn_s as f64 + 5.0),
        rss
    );
    let _ = tb.kill_agent();
    drop(tb);
    drop(cluster);
    Ok(())
}
