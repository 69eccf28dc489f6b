//! Test client: joins a cgroup and a netns, then connects repeatedly, one JSON line each.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::Parser;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    netns: Option<PathBuf>,
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// Given more than once with `--proto udp --reuse-socket`: one socket sends to each
    /// in turn; with `--proto tcp-churn`: connections go to each in turn.
    #[arg(long, required = true)]
    target: Vec<SocketAddr>,
    /// tcp, udp (unconnected: sendto/recvfrom), udp-connected, or tcp-churn (connections
    /// reset at once, one summary line)
    #[arg(long, default_value = "tcp")]
    proto: String,
    #[arg(long, default_value_t = 1)]
    count: u32,
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// One socket for all attempts: one UDP flow or one TCP connection (reconnected
    /// after a failure).
    #[arg(long)]
    reuse_socket: bool,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    proxy_testbed::client::enter(a.netns.as_deref(), a.cgroup.as_deref())?;
    let mut targets = a.target.into_iter();
    let target = targets
        .next()
        .ok_or_else(|| anyhow::anyhow!("--target is required"))?;
    proxy_testbed::client::run(&proxy_testbed::client::Run {
        target,
        more_targets: targets.collect(),
        udp: a.proto.starts_with("udp"),
        connected: a.proto == "udp-connected",
        churn: a.proto == "tcp-churn",
        reuse: a.reuse_socket,
        count: a.count,
        interval: Duration::from_millis(a.interval_ms),
        timeout: Duration::from_millis(a.timeout_ms),
    })
}
