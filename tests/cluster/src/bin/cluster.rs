//! `cargo xtask cluster`: the cluster in a box (`proxy_cluster::cluster`) until Ctrl-C or
//! SIGTERM, then everything it started and wrote is gone.

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use proxy_cluster::{
    cluster::{Cluster, ClusterOptions},
    node::{Nodes, NodesOptions},
};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser)]
struct Args {
    /// Folder holding etcd, kube-apiserver and kube-controller-manager.
    #[arg(long)]
    bin_dir: PathBuf,
    /// The Service ClusterIP range (virtual: never routed).
    #[arg(long, default_value = "10.96.0.0/16")]
    service_cidr: String,
    /// Real nodes (kubelet, containerd, CNI), 0 to 2.
    #[arg(long, default_value_t = 0)]
    nodes: usize,
    /// The agent binary whose image (proxy-agent:0.1.0) the nodes get.
    #[arg(long)]
    agent: Option<PathBuf>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    let base = if args.nodes > 0 {
        ClusterOptions::with_nodes(&args.bin_dir)
    } else {
        ClusterOptions::new(&args.bin_dir)
    };
    let opts = ClusterOptions {
        service_cidr: args.service_cidr.clone(),
        ..base
    };
    let mut term = signal(SignalKind::terminate())?;
    // A signal while starting drops the half-started cluster, which cleans up too.
    let cluster = tokio::select! {
        c = Cluster::start(opts) => c?,
        _ = tokio::signal::ctrl_c() => return Ok(()),
        _ = term.recv() => return Ok(()),
    };
    let nodes = if args.nodes > 0 {
        let agent = args.agent.clone().unwrap_or_else(proxy_testbed::agent_bin);
        let images =
            proxy_cluster::images::for_box(&args.bin_dir, &agent, &cluster.dir().join("images"))?;
        let opts = NodesOptions {
            count: args.nodes,
            bin_dir: args.bin_dir.clone(),
            images,
            service_cidr: args.service_cidr.clone(),
        };
        let nodes = tokio::select! {
            n = Nodes::start(&cluster, opts) => n?,
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = term.recv() => return Ok(()),
        };
        for node in nodes.nodes() {
            println!(
                "node {}: Ready, IP {} (netns {}), Pods in {}",
                node.name, node.ip, node.netns, node.pod_cidr
            );
        }
        Some(nodes)
    } else {
        None
    };
    let pki = cluster.dir().join("pki");
    println!(
        "cluster in a box: kube-apiserver at {server} (etcd, kube-controller-manager, {nodes} node(s))\n\
         \n  export KUBECONFIG={kubeconfig}\n\
         \n  curl --cacert {pki}/ca.crt --cert {pki}/admin.crt --key {pki}/admin.key {server}/readyz\n\
         \nlogs: {logs}\nCtrl-C stops it and removes {dir}",
        server = cluster.server(),
        kubeconfig = cluster.admin_kubeconfig().display(),
        pki = pki.display(),
        logs = cluster.dir().join("logs").display(),
        dir = cluster.dir().display(),
        nodes = args.nodes,
    );
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("stopping");
    drop(nodes);
    drop(cluster);
    Ok(())
}
