//! `proxy-agent trace`: packets through the real programs on private maps (or a copy of
//! a running node's), printed as text or JSON lines.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use clap::Args;
use proxy_agent::{dataplane::bpf, source};

#[derive(Args)]
pub struct TraceArgs {
    /// A scenario file (../shared/scenarios/README.md); exit status 1 if any packet
    /// differs from its `expect`.
    #[arg(long, conflicts_with_all = ["objects", "packet"])]
    scenario: Option<PathBuf>,
    /// Services and EndpointSlices (a folder or file of manifests), for `--packet`.
    #[arg(long, requires = "packet", conflicts_with = "live")]
    objects: Option<PathBuf>,
    /// One packet: `tcp 10.244.0.3:40000 -> 10.96.0.10:80`.
    #[arg(long)]
    packet: Option<String>,
    /// Trace `--packet` against a running node's maps (copied from its pins; never written).
    #[arg(long, requires = "packet")]
    live: bool,
    /// The running node's pin folder, for `--live`.
    #[arg(long, default_value = bpf::DEFAULT_PIN_DIR)]
    bpffs: PathBuf,
    /// JSON lines instead of text.
    #[arg(long)]
    json: bool,
    /// Which datapath: the per-packet classifier (`tc`), real connects through the
    /// connect-time hooks (`connect`, pod- and node-sourced packets), or `both`.
    #[arg(long, value_enum, default_value = "tc")]
    path: TracePath,
    /// The node's addresses (for `--packet`; repeatable).
    #[arg(long = "node-ip")]
    node_ips: Vec<std::net::IpAddr>,
    /// The pod network (for `--packet`; repeatable); none: pod traffic is not told apart.
    #[arg(long = "cluster-cidr")]
    cluster_cidrs: Vec<ipnet::IpNet>,
    #[arg(long)]
    masquerade_all: bool,
    #[arg(long, default_value = "node-a")]
    node_name: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TracePath {
    Tc,
    Connect,
    Both,
}

/// Exit status for a scenario file that cannot be used at all.
pub const EXIT_BAD_SCENARIO: i32 = 2;

/// The largest scenario file read (`--scenario /dev/zero` once grew to 10 GB).
const MAX_SCENARIO_BYTES: u64 = 64 << 20;

fn read_scenario(path: &Path) -> Result<String> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("{}: not a regular file", path.display());
    }
    if meta.len() > MAX_SCENARIO_BYTES {
        anyhow::bail!(
            "{}: {} bytes, larger than the {MAX_SCENARIO_BYTES} a scenario may be",
            path.display(),
            meta.len()
        );
    }
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

pub fn trace(args: TraceArgs) -> Result<()> {
    use proxy_agent::trace::{self, scenario};
    if args.live {
        let spec = args.packet.as_deref().context("--live needs --packet")?;
        let packet = trace::parse_packet_spec(spec).map_err(anyhow::Error::msg)?;
        let outcomes = trace::run_live(&args.bpffs, std::slice::from_ref(&packet))?;
        for o in &outcomes {
            if args.json {
                outln!("{}", serde_json::to_string(o)?);
            } else {
                outln!("path: {}\n{}", o.path, trace::describe(o, None));
            }
        }
        return Ok(());
    }
    let cases = match (&args.scenario, &args.packet, &args.objects) {
        (Some(path), _, _) => {
            let text = read_scenario(path)?;
            match scenario::parse(&text) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{}: {e}", path.display());
                    std::process::exit(EXIT_BAD_SCENARIO);
                }
            }
        }
        (None, Some(spec), Some(objects)) => {
            let packet = trace::parse_packet_spec(spec).map_err(anyhow::Error::msg)?;
            let (model, errors) = source::files::load(objects)?;
            for e in errors {
                tracing::warn!(error = %e, "skipping manifest");
            }
            vec![scenario::Case {
                id: "packet".into(),
                node: scenario::Node {
                    info: proxy_agent::model::NodeInfo {
                        name: args.node_name.clone(),
                        addresses: args.node_ips.clone(),
                        ..Default::default()
                    },
                    view: proxy_agent::model::ViewConfig {
                        pod_cidrs: args.cluster_cidrs.clone(),
                        masquerade_all: args.masquerade_all,
                        ..Default::default()
                    },
                },
                model,
                packets: vec![packet],
            }]
        }
        _ => anyhow::bail!("give --scenario FILE, or --objects DIR and --packet SPEC"),
    };
    let opts = trace::TraceOptions {
        connect_probe: (args.path != TracePath::Tc)
            .then(std::env::current_exe)
            .transpose()
            .context("locating this executable for the connect probe")?,
        skip_tc: args.path == TracePath::Connect,
    };
    let outcomes = trace::run(&cases, &opts)?;
    let packets: Vec<&scenario::Packet> = cases.iter().flat_map(|c| &c.packets).collect();
    let mut current_case = String::new();
    for (i, o) in &outcomes {
        let p = packets.get(*i).copied();
        if args.json {
            outln!("{}", serde_json::to_string(o)?);
            continue;
        }
        let heading = format!("case {} (path: {})", o.case, o.path);
        if heading != current_case {
            outln!("{heading}");
            current_case = heading;
        }
        outln!("{}", trace::describe(o, p));
    }
    let failed = outcomes.iter().filter(|(_, o)| !o.ok()).count();
    if !args.json {
        outln!(
            "\n{} packets, {} as expected, {failed} differ",
            outcomes.len(),
            outcomes.len() - failed
        );
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
