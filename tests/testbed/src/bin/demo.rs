//! `cargo xtask demo`: a namespace testbed with three backend pods, the agent on the
//! example manifests, requests to the ClusterIP through each datapath, and the spread.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Parser;
use proxy_testbed::{Path_, TCP_PORT, Testbed, UDP_PORT, VIP4, VIP6, spread, target};

#[derive(Parser)]
struct Args {
    #[arg(long)]
    agent: PathBuf,
    #[arg(long)]
    manifests: PathBuf,
    #[arg(long, default_value_t = 300)]
    requests: u32,
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: single-threaded at this point; the harness reads it to find the agent.
    unsafe { std::env::set_var("PROXY_AGENT_BIN", &args.agent) };
    test_support::require_root("the demo")?;
    let n = args.requests.to_string();
    println!(
        "{:<13} {:<22} {:>8} {:>10} {:>10} {:>10} {:>7}",
        "path", "target", "requests", "backend-0", "backend-1", "backend-2", "failed"
    );
    let mut frontends = 0;
    for path in [Path_::ConnectTime, Path_::PerPacket] {
        let mut tb = Testbed::new(3).context("building the testbed")?;
        tb.copy_manifests(&args.manifests)?;
        if frontends == 0 {
            frontends = count_frontends(&args.manifests)?;
        }
        tb.start_agent(path, frontends)?;
        for (vip, proto, port) in [
            (VIP4, "tcp", TCP_PORT),
            (VIP6, "tcp", TCP_PORT),
            (VIP4, "udp", UDP_PORT),
        ] {
            let t = target(vip, port);
            let attempts = tb.client(&["--target", &t, "--proto", proto, "--count", &n])?;
            let s = spread(&attempts);
            let failed = attempts.iter().filter(|a| !a.ok).count();
            let get = |i: usize| s.get(&Testbed::backend_name(i)).copied().unwrap_or(0);
            let name = match path {
                Path_::ConnectTime => "connect-time",
                Path_::PerPacket => "per-packet",
            };
            println!(
                "{name:<13} {:<22} {:>8} {:>10} {:>10} {:>10} {:>7}",
                format!("{proto} {t}"),
                attempts.len(),
                get(0),
                get(1),
                get(2),
                failed
            );
        }
        println!("\nTraffic per frontend and backend (proxy-agent dump --stats):");
        print!("{}", agent_output(&args.agent, &["dump", "--stats"], &tb)?);
        println!("\nPer Service port (/metrics):");
        let metrics = service_metrics(&tb)?;
        let mut lines: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("proxy_agent_service_"))
            .collect();
        lines.sort_unstable();
        for line in lines {
            println!("{line}");
        }
        if path == Path_::PerPacket {
            println!("\nWhat the kernel holds (proxy-agent dump):");
            print!("{}", agent_output(&args.agent, &["dump"], &tb)?);
        }
        println!();
    }
    println!("\nTestbed removed (namespaces, cgroup, bpffs mount).");
    Ok(())
}

/// What `proxy-agent ARGS --bpffs PINS` prints about the testbed's pins.
fn agent_output(agent: &std::path::Path, args: &[&str], tb: &Testbed) -> Result<String> {
    let out = std::process::Command::new(agent)
        .args(args)
        .arg("--bpffs")
        .arg(tb.pin_dir())
        .output()
        .with_context(|| format!("running {} {args:?}", agent.display()))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The agent's `/metrics`, fetched inside the node's namespace (its metrics address).
fn service_metrics(tb: &Testbed) -> Result<String> {
    let script = "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:10249/metrics').read().decode())";
    proxy_testbed::sh(&[
        "ip",
        "netns",
        "exec",
        &tb.node_ns(),
        "python3",
        "-c",
        script,
    ])
}

/// Frontends the example manifests produce, by the agent's own parser.
fn count_frontends(dir: &std::path::Path) -> Result<usize> {
    Ok(
        proxy_agent::runner::view_from_manifests(dir, &Default::default(), &Default::default())?
            .len(),
    )
}
