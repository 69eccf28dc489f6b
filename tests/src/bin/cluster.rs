//! `cargo xtask cluster`: the cluster in a box (`proxy_e2e::cluster`) until Ctrl-C or
//! SIGTERM, then everything it started and wrote is gone.

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use proxy_e2e::cluster::{Cluster, ClusterOptions};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser)]
struct Args {
    /// Folder holding etcd, kube-apiserver and kube-controller-manager.
    #[arg(long)]
    bin_dir: PathBuf,
    /// The Service ClusterIP range (virtual: never routed).
    #[arg(long, default_value = "10.96.0.0/16")]
    service_cidr: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    let opts = ClusterOptions {
        service_cidr: args.service_cidr,
        ..ClusterOptions::new(args.bin_dir)
    };
    let mut term = signal(SignalKind::terminate())?;
    // A signal while starting drops the half-started cluster, which cleans up too.
    let cluster = tokio::select! {
        c = Cluster::start(opts) => c?,
        _ = tokio::signal::ctrl_c() => return Ok(()),
        _ = term.recv() => return Ok(()),
    };
    let pki = cluster.dir().join("pki");
    println!(
        "cluster in a box: kube-apiserver at {server} (etcd, kube-controller-manager; no kubelet)\n\
         \n  export KUBECONFIG={kubeconfig}\n\
         \n  curl --cacert {pki}/ca.crt --cert {pki}/admin.crt --key {pki}/admin.key {server}/readyz\n\
         \nlogs: {logs}\nCtrl-C stops it and removes {dir}",
        server = cluster.server(),
        kubeconfig = cluster.admin_kubeconfig().display(),
        pki = pki.display(),
        logs = cluster.dir().join("logs").display(),
        dir = cluster.dir().display(),
    );
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    eprintln!("stopping");
    drop(cluster);
    Ok(())
}
