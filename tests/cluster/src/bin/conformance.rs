//! `cargo xtask conformance`: Kubernetes' own sig-network e2e specs (e2e.test, built from
//! tools/cluster/conformance) against a box with two real nodes, once with the agent as
//! the DaemonSet and no kube-proxy anywhere (`--proxy agent`), once with kube-proxy
//! itself (`--proxy kube-proxy`, nftables mode, a process on each node as kubeadm's
//! DaemonSet would run it). Each run writes ginkgo's JUnit and JSON reports into `--out`;
//! `--summarize` turns the two JSON reports into docs/conformance.md's table.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, ValueEnum};
use proxy_cluster::{cluster::Cluster, daemonset, node::Nodes};
use serde_json::Value;

/// The specs: sig-network's Services, Conntrack, Networking, KubeProxy and traffic
/// distribution groups.
const FOCUS: &str =
    r"\[sig-network\] (Services|Conntrack|Networking|KubeProxy|Traffic ?Distribution)";
/// What the box cannot be: no cloud load balancer, a single stack, no DNS add-on, no
/// disruption of the shared machine; slow and serial specs left out for time.
const SKIP: &str =
    r"LoadBalancer|ESIPP|\[Feature:|\[Serial\]|\[Disruptive\]|\[Slow\]|IPv6|DualStack|DNS";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Proxy {
    /// deploy/ as the DaemonSet.
    Agent,
    /// kube-proxy (nftables mode), the reference.
    KubeProxy,
}

#[derive(Parser)]
struct Args {
    /// Folder holding the box's binaries, kube-proxy and e2e.test.
    #[arg(long)]
    bin_dir: PathBuf,
    /// Which proxy serves the box's Services.
    #[arg(long, value_enum)]
    proxy: Option<Proxy>,
    /// Only the [Conformance] specs among them.
    #[arg(long)]
    conformance_only: bool,
    /// ginkgo --focus (default: the sig-network groups above).
    #[arg(long)]
    focus: Option<String>,
    /// Where the reports go.
    #[arg(long)]
    out: PathBuf,
    /// Write the table of both runs' reports in `out` into this Markdown file.
    #[arg(long)]
    summarize: Option<PathBuf>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    fs::create_dir_all(&args.out)?;
    if let Some(proxy) = args.proxy {
        // A signal drops the box (and e2e.test with it), which cleans everything up.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = run(&args, proxy) => r?,
            _ = tokio::signal::ctrl_c() => bail!("interrupted"),
            _ = term.recv() => bail!("terminated"),
        }
    }
    if let Some(doc) = &args.summarize {
        summarize(&args.out, doc)?;
    }
    Ok(())
}

fn name(proxy: Proxy) -> &'static str {
    match proxy {
        Proxy::Agent => "agent",
        Proxy::KubeProxy => "kube-proxy",
    }
}

async fn run(args: &Args, proxy: Proxy) -> Result<()> {
    test_support::require_root("cargo xtask conformance")?;
    let (nodes, cluster) = proxy_cluster::node::start_box("conformance", 2).await?;
    let mut kube_proxies = Vec::new();
    match proxy {
        Proxy::Agent => {
            daemonset::deploy_agent(&cluster, &nodes, &nodes.cluster_pod_cidr()).await?;
        }
        Proxy::KubeProxy => {
            for i in 0..nodes.nodes().len() {
                kube_proxies.push(start_kube_proxy(&cluster, &nodes, i, &args.bin_dir)?);
            }
        }
    }
    let report = args.out.join(name(proxy));
    let _ = fs::remove_dir_all(&report);
    fs::create_dir_all(&report)?;
    let mut focus = args.focus.clone().unwrap_or_else(|| FOCUS.into());
    if args.conformance_only {
        focus = format!("{focus}.*\\[Conformance\\]");
    }
    let started = Instant::now();
    let status = tokio::process::Command::new(args.bin_dir.join("e2e.test"))
        .kill_on_drop(true)
        .arg(format!(
            "--kubeconfig={}",
            cluster.admin_kubeconfig().display()
        ))
        .arg("--provider=skeleton")
        .arg(format!(
            "--kubectl-path={}",
            args.bin_dir.join("kubectl").display()
        ))
        .arg(format!("--report-dir={}", report.display()))
        .arg(format!(
            "--ginkgo.junit-report={}",
            report.join("junit.xml").display()
        ))
        .arg(format!(
            "--ginkgo.json-report={}",
            report.join("report.json").display()
        ))
        .arg(format!("--ginkgo.focus={focus}"))
        .arg(format!("--ginkgo.skip={SKIP}"))
        .arg("--ginkgo.timeout=3h")
        .arg("--ginkgo.no-color")
        .arg("--ginkgo.flake-attempts=1")
        .arg("--allowed-not-ready-nodes=0")
        .arg("--dump-logs-on-failure=false")
        .arg("--disable-log-dump")
        .stdout(fs::File::create(report.join("e2e.log"))?)
        .stderr(fs::File::create(report.join("e2e.stderr"))?)
        .status()
        .await
        .context("running e2e.test")?;
    let run = serde_json::json!({
        "minutes": started.elapsed().as_secs_f64() / 60.0,
        "date": today(),
        "focus": focus,
        "skip": SKIP,
        "status": status.to_string(),
    });
    fs::write(report.join("run.json"), serde_json::to_vec_pretty(&run)?)?;
    eprintln!(
        "conformance ({}): e2e.test {status} after {:.1} min; reports in {}",
        name(proxy),
        started.elapsed().as_secs_f64() / 60.0,
        report.display()
    );
    drop(kube_proxies);
    drop(nodes);
    drop(cluster);
    Ok(())
}

/// kube-proxy on node `i`, as kubeadm's DaemonSet runs it (host network: the node's
/// namespace), nftables mode, with the settings that would reach beyond the node's
/// namespace switched off: no conntrack table size (a machine-wide sysctl), no OOM score.
fn start_kube_proxy(
    cluster: &Cluster,
    nodes: &Nodes,
    i: usize,
    bin_dir: &Path,
) -> Result<std::process::Child> {
    let node = &nodes.nodes()[i];
    let dir = node.dir().join("kube-proxy");
    fs::create_dir_all(&dir)?;
    let kubeconfig = dir.join("kubeconfig.conf");
    // Bound to system:node-proxier by the bootstrap RBAC policy.
    cluster.write_client_kubeconfig(&kubeconfig, "system:kube-proxy", &[])?;
    let config = format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         mode: nftables\nclientConnection:\n  kubeconfig: {}\nclusterCIDR: {}\n\
         hostnameOverride: {}\nconntrack:\n  maxPerCore: 0\noomScoreAdj: 0\n\
         metricsBindAddress: 127.0.0.1:10249\n",
        kubeconfig.display(),
        nodes.cluster_pod_cidr(),
        node.name,
    );
    fs::write(dir.join("config.conf"), config)?;
    nodes.spawn_on_node(
        cluster,
        i,
        &format!("{}-kube-proxy", node.name),
        &bin_dir.join("kube-proxy"),
        &[
            format!("--config={}", dir.join("config.conf").display()),
            "--v=2".into(),
        ],
    )
}

/// One spec's outcome: state and, for a skip or a failure, ginkgo's message.
#[derive(Clone, Debug)]
struct Outcome {
    state: String,
    message: String,
}

/// Specs by full name, from ginkgo's JSON report (specs left out by focus/skip are not
/// counted; those skipped at run time, with their reason, are).
fn read_report(path: &Path) -> Result<BTreeMap<String, Outcome>> {
    let text = fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let suites: Value = serde_json::from_str(&text)?;
    let mut specs = BTreeMap::new();
    for suite in suites.as_array().into_iter().flatten() {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            if spec["LeafNodeType"] != "It" {
                continue;
            }
            let state = spec["State"].as_str().unwrap_or_default().to_string();
            let message = spec["Failure"]["Message"].as_str().unwrap_or_default();
            // A spec filtered out has no failure, and never ran.
            if state == "skipped" && message.is_empty() {
                continue;
            }
            let mut name: Vec<&str> = spec["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            name.extend(spec["LeafNodeText"].as_str());
            let first_line = message.lines().next().unwrap_or_default();
            specs.insert(
                name.join(" "),
                Outcome {
                    state,
                    message: first_line.chars().take(160).collect(),
                },
            );
        }
    }
    Ok(specs)
}

fn summarize(out: &Path, doc: &Path) -> Result<()> {
    let agent = read_report(&out.join("agent/report.json"))?;
    let kube_proxy = read_report(&out.join("kube-proxy/report.json")).unwrap_or_default();
    if agent.is_empty() {
        bail!(
            "no spec ran with the agent (see {})",
            out.join("agent/e2e.log").display()
        );
    }
    let count =
        |m: &BTreeMap<String, Outcome>, s: &str| m.values().filter(|o| o.state == s).count();
    let run_of = |proxy: &str| -> Value {
        fs::read_to_string(out.join(proxy).join("run.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default()
    };
    let (agent_run, kube_proxy_run) = (run_of("agent"), run_of("kube-proxy"));
    let mut text = String::new();
    text += "# Kubernetes' sig-network e2e specs on the box\n\n";
    text +=
        "<!-- Written by `cargo xtask conformance` (tests/cluster/src/bin/conformance.rs). -->\n\n";
    text += &format!(
        "`e2e.test` of k8s.io/kubernetes v1.37.2 against the [cluster in a box](cluster-in-a-box.md) \
         with two real nodes, once with the agent as the DaemonSet (no kube-proxy anywhere), \
         once with kube-proxy v1.37.2 in nftables mode. Focus `{}`, skip `{}`. Run {} \
         (`cargo xtask conformance`); run time: agent {:.1} min, kube-proxy {:.1} min. JUnit and JSON reports: `target/conformance/<proxy>/`. \
         How the box differs from a real cluster, and why specs are left out: \
         [cluster in a box](cluster-in-a-box.md#kubernetes-own-conformance-tests).\n\n",
        agent_run["focus"]
            .as_str()
            .unwrap_or_default()
            .replace('|', "\\|"),
        SKIP.replace('|', "\\|"),
        agent_run["date"].as_str().unwrap_or("(undated)"),
        agent_run["minutes"].as_f64().unwrap_or_default(),
        kube_proxy_run["minutes"].as_f64().unwrap_or_default(),
    );
    text += &format!(
        "| | passed | failed | skipped |\n|---|---|---|---|\n| agent | {} | {} | {} |\n| kube-proxy (nftables) | {} | {} | {} |\n\n",
        count(&agent, "passed"),
        count(&agent, "failed") + count(&agent, "timedout") + count(&agent, "panicked"),
        count(&agent, "skipped"),
        count(&kube_proxy, "passed"),
        count(&kube_proxy, "failed")
            + count(&kube_proxy, "timedout")
            + count(&kube_proxy, "panicked"),
        count(&kube_proxy, "skipped"),
    );
    text += "| spec | agent | kube-proxy | reason (failure or skip) |\n|---|---|---|---|\n";
    let names: std::collections::BTreeSet<&String> =
        agent.keys().chain(kube_proxy.keys()).collect();
    for spec in names {
        let a = agent.get(spec);
        let k = kube_proxy.get(spec);
        let cell = |o: Option<&Outcome>| o.map_or("—".to_string(), |o| o.state.clone());
        let reason = [a, k]
            .into_iter()
            .flatten()
            .map(|o| o.message.as_str())
            .find(|m| !m.is_empty())
            .unwrap_or_default()
            .replace('|', "\\|");
        text += &format!(
            "| {} | {} | {} | {} |\n",
            spec.replace('|', "\\|"),
            cell(a),
            cell(k),
            reason
        );
    }
    fs::write(doc, text)?;
    eprintln!("conformance: table in {}", doc.display());
    Ok(())
}

/// Today's date (UTC), for the report's table.
fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
