//! `cargo xtask bench`: our dataplane against kube-proxy-shaped iptables and nftables
//! rules, side by side, in one run on the same machine. Every contender gets its own
//! namespace testbed (client → node → three nginx pods); contenders alternate (A B A B …)
//! and report connection rates as ratios to the pods reached directly. Before them, the
//! schedulers' own figures (new-flow cost per scheduler, Maglev table rebuilds), in
//! `schedulers.json`. Figures only.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use proxy_bench::{PerPacket, WrkResult, maglev, schedulers};
use proxy_testbed::{
    Path_, Testbed,
    kube_proxy::{self, restore},
    sh,
};

#[derive(Parser)]
struct Args {
    /// Small sizes and short runs: keeps the harness working in CI.
    #[arg(long)]
    quick: bool,
    /// The agent binary.
    #[arg(long)]
    agent: PathBuf,
    /// Where the JSON and the plot go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Only the schedulers' figures (no testbeds, no Service scales).
    #[arg(long)]
    schedulers_only: bool,
    /// Only the per-packet figures (BPF_PROG_TEST_RUN: TC and XDP) at each scale, no
    /// testbeds.
    #[arg(long)]
    per_packet_only: bool,
    /// Only the throughput figures (live frames through a veth: XDP, TC, iptables,
    /// nftables), no testbeds.
    #[arg(long)]
    throughput_only: bool,
    /// The throughput run's contenders (comma-separated: xdp, tc, iptables, nftables;
    /// default all), e.g. to profile one.
    #[arg(long, value_delimiter = ',')]
    contenders: Vec<String>,
    /// Frames a round in the throughput run (default: 200,000 quick, 2,000,000 full).
    #[arg(long)]
    frames: Option<u32>,
    /// Only these scales of Services (comma-separated), e.g. to re-measure one: the
    /// side-by-side and per-packet figures, without the schedulers and throughput runs.
    #[arg(long, value_delimiter = ',')]
    services: Vec<usize>,
    /// Endpoints of the measured Service, of the testbed's three nginx pods (its first is
    /// the pod the direct contender connects to).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=3))]
    measured_endpoints: u8,
    /// Interleaved rounds at each scale (default 10; 5 with `--quick`, the fewest the
    /// medians are taken over): more resolve a smaller difference between contenders.
    #[arg(long, value_parser = clap::value_parser!(u32).range(5..))]
    rounds: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
enum Contender {
    Direct,
    ConnectTime,
    PerPacket,
    Iptables,
    Nftables,
}

/// Largest scale each netfilter contender is built for: loading kube-proxy-shaped rules is
/// super-linear here (BENCH-NOTES.md: nft -f ~50 s at 10k, iptables-restore minutes).
const IPTABLES_MAX: usize = 10_000;
const NFT_MAX: usize = 5_000;

#[derive(Default, serde::Serialize)]
struct Scale {
    services: usize,
    per_packet: PerPacket,
    /// The XDP program per packet, beside a pass-through XDP program and our TC path.
    xdp: proxy_bench::xdp::XdpPerPacket,
    /// Connection rate, latency, per contender (means over rounds).
    wrk: BTreeMap<String, WrkResult>,
    /// Connection rate as a ratio to direct: the median of the rounds' ratios.
    ratio: BTreeMap<String, f64>,
    /// The rounds' ratios' range (min, max).
    ratio_range: BTreeMap<String, (f64, f64)>,
    /// Each turn's connection rate per contender (one 1-second slice each, in turn).
    turns: Vec<BTreeMap<String, f64>>,
    /// The median of the turns' ratios to direct (each turn's contenders run within
    /// seconds of each other) with its 95% confidence interval: what the run resolves.
    turn_ratio: BTreeMap<String, TurnRatio>,
    /// The load average before each round.
    load: Vec<String>,
    /// Rounds where the direct path was slower than a proxied one.
    warnings: Vec<String>,
    /// Milliseconds to program every Service / to apply one endpoint change.
    program_all_ms: BTreeMap<String, f64>,
    one_change_ms: BTreeMap<String, f64>,
    agent_rss_mib: f64,
    bpf_map_mib: f64,
    /// What one TCP connection (connect, then reset) costs its client: with no hooks,
    /// and in the hooked cgroup to the pod's own address and to the frontend.
    connection_ns: BTreeMap<String, Cost>,
}

/// The median of a contender's per-turn ratios and its 95% confidence interval.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
struct TurnRatio {
    median: f64,
    ci95: (f64, f64),
    turns: usize,
}

/// Per contender but `baseline`, `TurnRatio` over the turns that ran `baseline`.
fn turn_ratios(turns: &[BTreeMap<String, f64>], baseline: &str) -> BTreeMap<String, TurnRatio> {
    proxy_bench::ratios_to(turns, baseline)
        .into_iter()
        .filter(|(name, _)| name != baseline)
        .map(|(name, mut v)| {
            let ci95 = proxy_bench::median_ci95(&v);
            let turns = v.len();
            let median = proxy_bench::median(&mut v);
            (
                name,
                TurnRatio {
                    median,
                    ci95,
                    turns,
                },
            )
        })
        .collect()
}

struct Bed {
    contender: Contender,
    tb: Testbed,
    nginx: Vec<Child>,
}

impl Drop for Bed {
    fn drop(&mut self) {
        for n in &mut self.nginx {
            let _ = n.kill();
            let _ = n.wait();
        }
    }
}

fn nginx_conf(dir: &Path, i: usize) -> Result<PathBuf> {
    let conf = dir.join(format!("nginx-{i}.conf"));
    std::fs::write(
        &conf,
        format!(
            "master_process off;\nworker_processes 1;\npid {d}/nginx-{i}.pid;\nerror_log {d}/nginx-{i}.err;\nevents {{ worker_connections 4096; }}\nhttp {{ access_log off; client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n server {{ listen {port} reuseport backlog=4096; location / {{ return 200 \"ok\\n\"; }} }} }}\n",
            d = dir.display(),
            port = proxy_bench::BACKEND_PORT
        ),
    )?;
    Ok(conf)
}

fn bed(contender: Contender, n: usize, work: &Path, scale: &mut Scale) -> Result<Bed> {
    // Owned by the Bed from the start, so a failed setup still stops what it started.
    let mut bed = Bed {
        contender,
        tb: Testbed::new(3)?,
        nginx: Vec::new(),
    };
    let dir = work.join(format!("{contender:?}-{n}"));
    std::fs::create_dir_all(&dir)?;
    for i in 0..3 {
        let conf = nginx_conf(&dir, i)?;
        bed.nginx.push(
            Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &bed.tb.backend_ns(i),
                    "taskset",
                    "-c",
                    "1",
                    "nginx",
                    "-c",
                ])
                .arg(&conf)
                .args(["-g", "daemon off;"])
                .stderr(Stdio::null())
                .spawn()
                .context("starting nginx")?,
        );
    }
    let tb = &mut bed.tb;
    let client = tb.client_ns();
    for (k, v) in [
        ("net.ipv4.ip_local_port_range", "1024 65000"),
        ("net.ipv4.tcp_tw_reuse", "1"),
    ] {
        sh(&[
            "ip",
            "netns",
            "exec",
            &client,
            "sysctl",
            "-qw",
            &format!("{k}={v}"),
        ])?;
    }
    let svcs = proxy_bench::services(n);
    let node = tb.node_ns();
    let label = format!("{contender:?}");
    match contender {
        Contender::Direct => {}
        Contender::ConnectTime | Contender::PerPacket => {
            // Files of 10k Services: one file of 100k passed the file source's limit.
            let files = proxy_bench::manifest_files(&svcs);
            tb.write_manifests(&files.iter().map(|(k, v)| (k.as_str(), v.clone())).collect())?;
            let t = Instant::now();
            let path = if contender == Contender::ConnectTime {
                Path_::ConnectTime
            } else {
                Path_::PerPacket
            };
            tb.start_agent(path, n)?;
            scale.program_all_ms.insert(
                format!("{label} (agent, end to end)"),
                t.elapsed().as_secs_f64() * 1e3,
            );
            if contender == Contender::ConnectTime {
                let (rss, maps) = agent_memory(tb)?;
                scale.agent_rss_mib = rss;
                scale.bpf_map_mib = maps;
            }
        }
        Contender::Iptables => {
            let rules = dir.join("rules.iptables");
            std::fs::write(&rules, kube_proxy::iptables_rules(&svcs))?;
            let t = Instant::now();
            restore(&node, "iptables-restore", &[], &rules)?;
            scale
                .program_all_ms
                .insert(label.clone(), t.elapsed().as_secs_f64() * 1e3);
            let change = dir.join("change.iptables");
            std::fs::write(
                &change,
                kube_proxy::iptables_one_change(&svcs, svcs.len() - 1),
            )?;
            let t = Instant::now();
            restore(&node, "iptables-restore", &["--noflush"], &change)?;
            scale
                .one_change_ms
                .insert(label, t.elapsed().as_secs_f64() * 1e3);
            // Put the changed Service back as it was (it may be the measured one).
            restore(&node, "iptables-restore", &[], &rules)?;
        }
        Contender::Nftables => {
            let rules = dir.join("rules.nft");
            std::fs::write(&rules, kube_proxy::nft_rules(&svcs))?;
            let t = Instant::now();
            restore(&node, "nft", &["-f"], &rules)?;
            scale
                .program_all_ms
                .insert(label.clone(), t.elapsed().as_secs_f64() * 1e3);
            let change = dir.join("change.nft");
            std::fs::write(&change, kube_proxy::nft_one_change(&svcs, svcs.len() - 1))?;
            let t = Instant::now();
            restore(&node, "nft", &["-f"], &change)?;
            scale
                .one_change_ms
                .insert(label, t.elapsed().as_secs_f64() * 1e3);
            sh(&["ip", "netns", "exec", &node, "nft", "flush", "ruleset"])?;
            restore(&node, "nft", &["-f"], &rules)?;
        }
    }
    Ok(bed)
}

/// The agent's RSS and the memory of its BPF maps (from the fdinfo of its map fds).
fn agent_memory(tb: &Testbed) -> Result<(f64, f64)> {
    let pid = tb.agent_pid().context("agent running")?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let mut memlock = 0u64;
    for fd in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))? {
        let info = std::fs::read_to_string(fd?.path()).unwrap_or_default();
        if info.contains("map_type:") {
            memlock += info
                .lines()
                .find_map(|l| l.strip_prefix("memlock:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Ok((rss_kib / 1024.0, memlock as f64 / (1024.0 * 1024.0)))
}

fn wrk(bed: &Bed, secs: u32) -> Result<WrkResult> {
    let target = match bed.contender {
        Contender::Direct => format!(
            "http://{}:{}/",
            Testbed::backend_ip4(proxy_bench::DIRECT_POD),
            proxy_bench::BACKEND_PORT
        ),
        _ => format!("http://{}:80/", proxy_bench::VIP),
    };
    let wrk = format!(
        "ip netns exec {} taskset -c 0 wrk -t1 -c8 -d{secs}s --latency -H 'Connection: close' {target}",
        bed.tb.client_ns()
    );
    // Every client in its own testbed's cgroup, one level below the root, as a pod's
    // processes are in theirs: only the connect-time contender's has our hooks. (In the
    // root cgroup the direct contender would skip what a nested cgroup costs — its
    // pressure-stall and CPU accounting — which no pod skips; one run at 1 Service
    // showed no difference it could resolve.)
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec {wrk}",
        bed.tb.cgroup_path().display()
    );
    let out = Command::new("sh")
        .args(["-c", &script])
        .output()
        .context("running wrk")?;
    if !out.status.success() {
        bail!("wrk: {}", String::from_utf8_lossy(&out.stderr));
    }
    proxy_bench::parse_wrk(&String::from_utf8_lossy(&out.stdout))
}

/// What one TCP connection costs its client (`e2e-client --proto tcp-churn`: connect,
/// then reset; pinned to CPU 0 as wrk is), ns, all from the connect-time contender's
/// client namespace: in the direct contender's cgroup (no hooks) to the pod, and in the
/// hooked cgroup to the pod's own address (no hook translates it: what the hooks'
/// presence costs every other connection) and to the frontend. `rounds` rounds of
/// `count` connections each, the order rotating. Per kind: the median of the rounds,
/// and the median of each round's difference to the unhooked run of the same round with
/// the differences' range (paired: a slow spell of the VM falls on both).
fn connection_cost(beds: &[Bed], rounds: u32, count: u32) -> Result<BTreeMap<String, Cost>> {
    let find = |c: Contender| {
        beds.iter()
            .find(|b| b.contender == c)
            .with_context(|| format!("no {c:?} testbed"))
    };
    let (direct, hooked) = (find(Contender::Direct)?, find(Contender::ConnectTime)?);
    let pod = format!(
        "{}:{}",
        Testbed::backend_ip4(proxy_bench::DIRECT_POD),
        proxy_bench::BACKEND_PORT
    );
    let frontend = format!("{}:80", proxy_bench::VIP);
    // The measured Service's pods in turn, reached directly: what its spread over them
    // costs without the hooks.
    let pods = proxy_bench::measured_endpoints().join(",");
    const BASE: &str = "no hooks, to the pod";
    let runs = [
        (BASE, direct, &pod),
        ("no hooks, to its pods in turn", direct, &pods),
        ("hooked, to the pod", hooked, &pod),
        ("hooked, to the frontend", hooked, &frontend),
    ];
    let mut samples: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        for (name, cgroup, target) in proxy_bench::rotated(&runs, round as usize) {
            let ns = churn(&hooked.tb, &cgroup.tb, target, count)
                .with_context(|| format!("{name}: {target}"))?;
            samples.entry(name).or_default().push(ns);
        }
    }
    let base = samples.get(BASE).cloned().unwrap_or_default();
    Ok(samples
        .into_iter()
        .map(|(k, mut v)| {
            let mut diffs: Vec<f64> = v.iter().zip(&base).map(|(x, b)| x - b).collect();
            let (lo, hi) = proxy_bench::range(&diffs);
            let cost = Cost {
                ns: proxy_bench::median(&mut v),
                over_unhooked: proxy_bench::median(&mut diffs),
                over_range: (lo, hi),
            };
            (k.to_string(), cost)
        })
        .collect())
}

/// One kind of connection's cost (`connection_cost`).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
struct Cost {
    /// The median of the rounds, ns.
    ns: f64,
    /// The median of the rounds' differences to the unhooked run, ns, and their range.
    over_unhooked: f64,
    over_range: (f64, f64),
}

/// `count` connections to `target` from `netns`'s client namespace in `cgroup`'s cgroup:
/// ns each.
fn churn(netns: &Testbed, cgroup: &Testbed, target: &str, count: u32) -> Result<f64> {
    let out = Command::new("taskset")
        .args(["-c", "0"])
        .arg(proxy_testbed::helper_bin("e2e-client"))
        .arg("--netns")
        .arg(format!("/run/netns/{}", netns.client_ns()))
        .arg("--cgroup")
        .arg(cgroup.cgroup_path())
        .args(target.split(',').flat_map(|t| ["--target", t]))
        .args(["--proto", "tcp-churn", "--timeout-ms", "5000"])
        .args(["--count", &count.to_string()])
        .output()
        .context("running e2e-client")?;
    let line = String::from_utf8_lossy(&out.stdout);
    let a: proxy_testbed::Attempt = serde_json::from_str(line.trim()).with_context(|| {
        format!(
            "e2e-client said {line:?} ({})",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if !a.ok || a.seq != count {
        bail!("{} of {count} connections made: {:?}", a.seq, a.error);
    }
    Ok(a.ms * 1e6 / f64::from(count))
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: single-threaded here; the harness reads it to find the agent.
    unsafe { std::env::set_var("PROXY_AGENT_BIN", &args.agent) };
    test_support::require_root("the benchmark")?;
    proxy_bench::MEASURED_ENDPOINTS.store(
        usize::from(args.measured_endpoints),
        std::sync::atomic::Ordering::Relaxed,
    );
    let (scales, secs, rounds, runs): (Vec<usize>, u32, u32, u32) = if args.quick {
        (vec![1, 100], 1, 5, 2_000)
    } else {
        // 10 rounds: 50 turns resolve a ratio to about ±0.03 (95%) on this VM, where a
        // turn's paired ratio has a standard deviation of ~9%; 25 to about ±0.04.
        (vec![1, 1_000, 10_000, 100_000], 5, 10, 200_000)
    };
    let rounds = args.rounds.unwrap_or(rounds);
    let scales = if args.services.is_empty() {
        scales
    } else {
        args.services.clone()
    };
    std::fs::create_dir_all(&args.out)?;
    if args.per_packet_only {
        return per_packet_figures(&scales, runs, args.quick);
    }
    let chosen = !args.services.is_empty();
    if !args.throughput_only && !chosen {
        scheduler_figures(args.quick, &args.out)?;
    }
    if args.schedulers_only {
        return Ok(());
    }
    if !chosen {
        throughput_figures(&args)?;
    }
    if args.throughput_only {
        return Ok(());
    }
    let work = std::env::temp_dir().join(format!("pxy-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut results = Vec::new();
    for &n in &scales {
        eprintln!("bench: {n} Services");
        let mut scale = Scale {
            services: n,
            ..Default::default()
        };
        scale.per_packet = proxy_bench::per_packet(n, runs)?;
        scale.xdp = proxy_bench::xdp::per_packet(n, runs, if args.quick { 3 } else { 5 })?;
        let (all, one) = proxy_bench::our_control_plane(n)?;
        scale.program_all_ms.insert("ours (maps)".into(), all);
        scale.one_change_ms.insert("ours (maps)".into(), one);
        let mut contenders = vec![
            Contender::Direct,
            Contender::ConnectTime,
            Contender::PerPacket,
        ];
        if n <= IPTABLES_MAX {
            contenders.push(Contender::Iptables);
        }
        if n <= NFT_MAX {
            contenders.push(Contender::Nftables);
        }
        let mut beds = Vec::new();
        for c in contenders {
            beds.push(bed(c, n, &work, &mut scale).with_context(|| format!("{c:?} at {n}"))?);
        }
        let mut sums: BTreeMap<String, Vec<WrkResult>> = BTreeMap::new();
        let mut per_round = Vec::new();
        let mut per_turn = Vec::new();
        // Interleaved: each contender's `secs` in a round come as 1-second slices, the
        // contenders taking turns, so a slow spell of the machine (seconds long on a VM)
        // falls on all of them — with one 5-second run each, a spell at a reversal fell
        // on one contender's two runs. The order rotates by one each turn: every
        // contender takes every place in turn, and none runs twice in a row (a reversed
        // order ran the ends twice, warm).
        for round in 0..rounds {
            scale.load.push(proxy_bench::load_average());
            let mut slices: BTreeMap<String, Vec<WrkResult>> = BTreeMap::new();
            for slice in 0..secs {
                let turn = (round * secs + slice) as usize;
                let order = proxy_bench::rotated(&beds, turn);
                let mut this_turn = BTreeMap::new();
                for b in order {
                    let r = wrk(b, 1).with_context(|| format!("{:?} at {n}", b.contender))?;
                    let name = format!("{:?}", b.contender);
                    this_turn.insert(name.clone(), r.requests_per_s);
                    slices.entry(name).or_default().push(r);
                }
                per_turn.push(this_turn);
            }
            let mut this_round = BTreeMap::new();
            for (name, rs) in slices {
                let r = proxy_bench::mean_of(&rs);
                this_round.insert(name.clone(), r.requests_per_s);
                sums.entry(name).or_default().push(r);
            }
            per_round.push(this_round);
        }
        for (name, rs) in sums {
            scale.wrk.insert(name, proxy_bench::mean_of(&rs));
        }
        let (summary, warnings) = proxy_bench::ratio_summary(&per_round, "Direct");
        scale.ratio = summary.iter().map(|(k, r)| (k.clone(), r.median)).collect();
        scale.ratio_range = summary
            .iter()
            .map(|(k, r)| (k.clone(), (r.min, r.max)))
            .collect();
        scale.warnings = warnings;
        scale.turn_ratio = turn_ratios(&per_turn, "Direct");
        scale.turns = per_turn;
        scale.connection_ns =
            connection_cost(&beds, rounds, if args.quick { 2_000 } else { 50_000 })
                .context("the cost of a connection")?;
        drop(beds);
        print_scale(&scale);
        results.push(scale);
    }
    let _ = std::fs::remove_dir_all(&work);
    let json = serde_json::json!({
        "date": sh(&["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"])?.trim(),
        "kernel": sh(&["uname", "-r"])?.trim(),
        "cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "iptables": sh(&["iptables", "--version"]).unwrap_or_default().trim(),
        "nft": sh(&["nft", "--version"]).unwrap_or_default().trim(),
        "wrk": "wrk -t1 -c8 --latency -H 'Connection: close' (pinned to CPU 0; nginx on CPU 1)",
        "quick": args.quick,
        "rounds": rounds,
        "measured_endpoints": args.measured_endpoints,
        "scales": results,
    });
    let json_path = args.out.join("bench.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&json)?)?;
    let svg = args.out.join("bench.svg");
    plot(&results, &svg)?;
    println!("\nwrote {} and {}", json_path.display(), svg.display());
    Ok(())
}

/// Packets per second per core into a backend namespace, per contender: printed, and
/// written to `throughput.json`.
fn throughput_figures(args: &Args) -> Result<()> {
    let (quick, out) = (args.quick, &args.out);
    // An established flow's cost does not grow with the Services (conntrack for
    // netfilter, hash lookups for ours): one scale, where the rules load in seconds.
    let (n, frames, rounds) = if quick {
        (100, 200_000, 3)
    } else {
        (1_000, 2_000_000, 5)
    };
    eprintln!("bench: throughput");
    let frames = args.frames.unwrap_or(frames);
    let t = match proxy_bench::throughput::throughput(n, frames, rounds, &args.contenders) {
        Err(e) if proxy_bench::throughput::live_frames_refused(&e) => {
            println!("\nthroughput: not measured: this kernel refuses live frames ({e:#})");
            return Ok(());
        }
        r => r.context("throughput")?,
    };
    println!(
        "\nthroughput, {} Services, established flow, {} frames a round, medians of {} rounds on CPU {} (Mpps delivered, spread, share delivered):",
        t.services, t.frames_per_round, t.rounds, t.cpu
    );
    for r in &t.rates {
        println!(
            "  {:<10} {:>6.3} Mpps (±{:.3}) {:>6.1}%",
            r.contender,
            r.mpps,
            r.mpps_spread,
            r.delivered_share * 100.0
        );
    }
    println!(
        "  XDP ÷ iptables {:.2}x (target ≥ 2.5), XDP ÷ TC {:.2}x (target ≥ 1.5), XDP ÷ nftables {:.2}x",
        t.ratio("xdp", "iptables"),
        t.ratio("xdp", "tc"),
        t.ratio("xdp", "nftables")
    );
    let json = serde_json::json!({
        "date": sh(&["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"])?.trim(),
        "kernel": sh(&["uname", "-r"])?.trim(),
        "cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "iptables": sh(&["iptables", "--version"]).unwrap_or_default().trim(),
        "nft": sh(&["nft", "--version"]).unwrap_or_default().trim(),
        "quick": quick,
        "load": proxy_bench::load_average(),
        "throughput": t,
    });
    write_json(out, "throughput.json", &json)
}

/// Writes one benchmark's figures as `out/name`, and says where.
fn write_json(out: &Path, name: &str, json: &serde_json::Value) -> Result<()> {
    let path = out.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(json)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// New-flow cost per scheduler and Maglev rebuild times: printed, and written to
/// `schedulers.json`.
fn scheduler_figures(quick: bool, out: &Path) -> Result<()> {
    let (runs, backends, reps) = if quick {
        (
            schedulers::Runs {
                batch: 500,
                rounds: 2,
            },
            &[100, 1_000][..],
            2,
        )
    } else {
        (
            schedulers::Runs {
                batch: 2_000,
                rounds: 25,
            },
            &[100, 1_000, 10_000][..],
            9,
        )
    };
    eprintln!("bench: schedulers");
    let costs = schedulers::new_flow_costs(runs).context("new-flow cost per scheduler")?;
    let rebuilds = maglev::rebuild_times(backends, reps).context("Maglev rebuild times")?;
    print_schedulers(&costs, &rebuilds);
    let json = serde_json::json!({
        "date": sh(&["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"])?.trim(),
        "kernel": sh(&["uname", "-r"])?.trim(),
        "cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "quick": quick,
        "runs": runs,
        "new_flow": costs,
        "maglev_rebuild": rebuilds,
    });
    write_json(out, "schedulers.json", &json)
}

fn print_schedulers(costs: &schedulers::SchedulerCosts, rebuilds: &[maglev::MaglevRebuild]) {
    println!(
        "\nNew flow per scheduler (BPF_PROG_TEST_RUN; a Service of {} endpoints each, {} \
         flows each; a pass-through program: {:.0} ns). ns: mean; ÷ random: median of \
         the rounds' ratios",
        costs.endpoints, costs.flows_per_scheduler, costs.pass_through_ns
    );
    println!(
        "  {:<10} {:>8} {:>9} {:>15} {:>10}",
        "scheduler", "ns", "÷ random", "rounds' range", "endpoints"
    );
    for s in &costs.schedulers {
        println!(
            "  {:<10} {:>8.0} {:>9.3} {:>7.3}-{:<7.3} {:>10}",
            s.scheduler,
            s.new_flow_ns,
            s.ratio_to_random,
            s.ratio_min,
            s.ratio_max,
            s.endpoints_reached
        );
    }
    println!(
        "\nMaglev (mh) rebuild: the table in user space; programming the frontend and one \
         endpoint change, applied to maps"
    );
    println!(
        "  {:>8} {:>9} {:>7} {:>10} {:>12} {:>13}",
        "backends", "table len", "entries", "table ms", "program ms", "one change ms"
    );
    for r in rebuilds {
        println!(
            "  {:>8} {:>9} {:>7} {:>10.3} {:>12.1} {:>13.1}",
            r.backends, r.table_len, r.entries, r.table_ms, r.program_ms, r.one_change_ms
        );
    }
}

fn print_scale(s: &Scale) {
    println!(
        "\n{} Services (load average before each round: {})",
        s.services,
        s.load.join(" | ")
    );
    println!(
        "  {:<14} {:>10} {:>7} {:>13} {:>9} {:>9}",
        "contender", "conn/s", "ratio", "rounds' range", "p50 ms", "p99 ms"
    );
    for (k, r) in &s.wrk {
        let (lo, hi) = s.ratio_range.get(k).copied().unwrap_or_default();
        println!(
            "  {k:<14} {:>10.0} {:>7.2} {:>13} {:>9.3} {:>9.3}",
            r.requests_per_s,
            s.ratio.get(k).copied().unwrap_or(0.0),
            format!("{lo:.2}–{hi:.2}"),
            r.p50_ms,
            r.p99_ms
        );
    }
    for (k, t) in &s.turn_ratio {
        let (lo, hi) = t.ci95;
        println!(
            "  {k}: median of {} turns' ratios {:.3}, 95% confidence {lo:.3}–{hi:.3}",
            t.turns, t.median
        );
    }
    for w in &s.warnings {
        println!("  WARNING: {w}");
    }
    if !s.connection_ns.is_empty() {
        let parts: Vec<String> = s
            .connection_ns
            .iter()
            .map(|(k, c)| {
                let (lo, hi) = c.over_range;
                format!(
                    "{k} {:.0} ns ({:+.0}; {lo:+.0} to {hi:+.0})",
                    c.ns, c.over_unhooked
                )
            })
            .collect();
        println!(
            "  one TCP connection (connect, reset; medians of rounds; over the unhooked run of each round): {}",
            parts.join(", ")
        );
    }
    print_per_packet(s);
    for (k, v) in &s.program_all_ms {
        println!("  program all    {k:<32} {v:>10.1} ms");
    }
    for (k, v) in &s.one_change_ms {
        println!("  one change     {k:<32} {v:>10.3} ms");
    }
    println!(
        "  agent RSS {:.1} MiB, BPF maps {:.1} MiB",
        s.agent_rss_mib, s.bpf_map_mib
    );
}

fn print_per_packet(s: &Scale) {
    let pp = &s.per_packet;
    println!(
        "  per packet (BPF_PROG_TEST_RUN): established {:.0} ns, new flow {:.0} ns, reply {:.0} ns, not for a Service {:.0} ns (on a frontend's port {:.0} ns), pass-through {:.0} ns ({:.2}x / {:.2}x / {:.2}x / {:.2}x)",
        pp.established_ns,
        pp.new_flow_ns,
        pp.reply_ns,
        pp.other_ns,
        pp.other_frontend_port_ns,
        pp.pass_through_ns,
        pp.established_ns / pp.pass_through_ns.max(1.0),
        pp.new_flow_ns / pp.pass_through_ns.max(1.0),
        pp.reply_ns / pp.pass_through_ns.max(1.0),
        pp.other_ns / pp.pass_through_ns.max(1.0)
    );
    let x = &s.xdp;
    println!(
        "  XDP per packet (medians of {} rounds, spread): established {:.0} ns (±{:.0}), new flow {:.0} ns (±{:.0}), XDP pass-through {:.0} ns (±{:.0}), TC established {:.0} ns (±{:.0}); XDP/pass {:.2}x, TC/XDP {:.2}x",
        x.rounds,
        x.xdp_established_ns,
        x.xdp_established_spread_ns,
        x.xdp_new_flow_ns,
        x.xdp_new_flow_spread_ns,
        x.xdp_pass_ns,
        x.xdp_pass_spread_ns,
        x.tc_established_ns,
        x.tc_established_spread_ns,
        x.established_vs_pass(),
        x.tc_vs_xdp()
    );
    let st = &x.steady;
    println!(
        "  steady state (repeat {} behind a restoring front, medians of {} rounds, spread): XDP established {:.0} ns (±{:.0}) vs pass {:.0} ns (±{:.0}) = {:.2}x; TC established {:.0} ns (±{:.0}), its reply {:.0} ns (±{:.0}), new flow {:.0} ns (±{:.0}) vs pass {:.0} ns (±{:.0}) = {:.2}x / {:.2}x / {:.2}x",
        st.repeat,
        st.rounds,
        st.xdp_established_ns,
        st.xdp_established_spread_ns,
        st.xdp_pass_ns,
        st.xdp_pass_spread_ns,
        st.xdp_established_vs_pass(),
        st.tc_established_ns,
        st.tc_established_spread_ns,
        st.tc_reply_ns,
        st.tc_reply_spread_ns,
        st.tc_new_flow_ns,
        st.tc_new_flow_spread_ns,
        st.tc_pass_ns,
        st.tc_pass_spread_ns,
        st.tc_established_vs_pass(),
        st.tc_reply_vs_pass(),
        st.tc_new_flow_vs_pass()
    );
}

/// The per-packet figures alone (`--per-packet-only`), printed as the full run prints
/// them.
fn per_packet_figures(scales: &[usize], runs: u32, quick: bool) -> Result<()> {
    for &n in scales {
        let s = Scale {
            services: n,
            per_packet: proxy_bench::per_packet(n, runs)?,
            xdp: proxy_bench::xdp::per_packet(n, runs, if quick { 3 } else { 5 })?,
            ..Default::default()
        };
        println!("\n{n} Services");
        print_per_packet(&s);
    }
    Ok(())
}

/// Connection rate (ratio to direct) against the number of Services, one line per
/// contender.
fn plot(results: &[Scale], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let max_n = results
        .iter()
        .map(|s| s.services)
        .max()
        .unwrap_or(1)
        .max(10) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "New connections/s, as a ratio to reaching the pod directly",
            ("sans-serif", 20),
        )
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((1f64..max_n).log_scale(), 0f64..1.2f64)?;
    chart
        .configure_mesh()
        .x_desc("Services")
        .y_desc("ratio to direct")
        .draw()?;
    let names = ["Direct", "ConnectTime", "PerPacket", "Iptables", "Nftables"];
    for (i, name) in names.iter().enumerate() {
        let points: Vec<(f64, f64)> = results
            .iter()
            .filter_map(|s| s.ratio.get(*name).map(|r| (s.services.max(1) as f64, *r)))
            .collect();
        if points.is_empty() {
            continue;
        }
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
