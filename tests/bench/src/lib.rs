//! The benchmarks (`cargo xtask bench`: the binaries `bench`, `fanout` and `churn`) and
//! the soak (`soak`), on the testbeds of `proxy-testbed`.
//!
//! Side-by-side benchmark pieces: the Services (as manifests for our agent; the
//! kube-proxy-shaped rules for the same Services are in `proxy_testbed::kube_proxy`), the
//! per-packet cost of the real classifier (and of the XDP program: `xdp`), and parsing
//! wrk's report. The schedulers' own figures are in `schedulers` (new-flow cost) and
//! `maglev` (table rebuilds); the XDP throughput in `throughput`, its generator
//! (`bench-ebpf`, built by build.rs) in `gen_object`. What the churn benchmark reads of
//! the agent is `churn`'s; the soak's API-server faults, `api_feed`'s.

pub mod api_feed;
pub mod churn;
mod gen_object;
pub mod maglev;
pub mod schedulers;
pub mod steady;
pub mod throughput;
pub mod xdp;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    time::Instant,
};

use anyhow::{Context as _, Result};
use aya::{TestRun as _, TestRunOptions, programs::SchedClassifier};
use proxy_agent::{
    dataplane::bpf::{self, Mirror},
    model::schedule::Schedule,
    model::{Frontend, FrontendKind, FrontendState, NodeView, Protocol},
    trace::packet,
};

/// The measured Service: its VIP, port and backend pods (nginx on 8081).
pub const VIP: &str = "10.96.0.10";
pub const BACKEND_PORT: u16 = 8081;
/// The pod the direct contender connects to: the measured Service's first endpoint.
pub const DIRECT_POD: usize = 1;

/// How many of the testbed's three pods the measured Service has (`bench
/// --measured-endpoints`).
pub static MEASURED_ENDPOINTS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(3);

pub fn measured_endpoints() -> Vec<String> {
    let n = MEASURED_ENDPOINTS
        .load(std::sync::atomic::Ordering::Relaxed)
        .clamp(1, 3);
    (0..n)
        .map(|i| {
            let pod = (DIRECT_POD + i) % 3;
            format!(
                "{}:{BACKEND_PORT}",
                proxy_testbed::Testbed::backend_ip4(pod)
            )
        })
        .collect()
}

/// Filler Service `i`: its VIP and its two (never contacted) endpoints.
fn filler(i: usize) -> (String, [String; 2]) {
    // 62 500 addresses per /16: 100k Services span two of them.
    let (hi, mid, lo) = (i / 62_500, (i / 250) % 250, i % 250 + 1);
    let vip = format!("10.{}.{mid}.{lo}", 97 + hi);
    let ep = |k: usize| format!("10.{}.{mid}.{lo}:{BACKEND_PORT}", 100 + 2 * k + hi);
    (vip, [ep(0), ep(1)])
}

/// The services of one scale: `n` in all, the measured one in the middle.
pub fn services(n: usize) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = (0..n.saturating_sub(1))
        .map(|i| {
            let (vip, eps) = filler(i);
            (vip, eps.to_vec())
        })
        .collect();
    out.insert(out.len() / 2, (VIP.to_string(), measured_endpoints()));
    out
}

/// Manifests for our agent.
pub fn manifests(svcs: &[(String, Vec<String>)]) -> String {
    let mut y = String::with_capacity(svcs.len() * 600);
    for (i, (vip, eps)) in svcs.iter().enumerate() {
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: bench}}\nspec: {{clusterIP: {vip}, ports: [{{name: http, protocol: TCP, port: 80, targetPort: {BACKEND_PORT}}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{i}-1, namespace: bench, labels: {{kubernetes.io/service-name: s{i}}}}}\naddressType: IPv4\nports: [{{name: http, protocol: TCP, port: {BACKEND_PORT}}}]\nendpoints:\n"
        );
        for ep in eps {
            let ip = ep.rsplit_once(':').map_or(ep.as_str(), |(ip, _)| ip);
            let _ = writeln!(
                y,
                "- {{addresses: [\"{ip}\"], conditions: {{ready: true}}}}"
            );
        }
    }
    y
}

/// Services per manifest file: 10,000 Services of 10 endpoints are ~5 MB, well under the
/// file source's limit (`files::MAX_FILE_BYTES`, 16 MiB), which refused the 52 MB single
/// file of 100k Services (issue 24).
pub const SERVICES_PER_FILE: usize = 10_000;

/// `manifests` split into files of at most `SERVICES_PER_FILE` Services each, by name.
pub fn manifest_files(svcs: &[(String, Vec<String>)]) -> BTreeMap<String, String> {
    svcs.chunks(SERVICES_PER_FILE)
        .enumerate()
        .map(|(k, chunk)| {
            // The names stay those of one file: Service `i` is `s{i}` across the files.
            let text = manifests(chunk);
            let offset = k * SERVICES_PER_FILE;
            let text = if offset == 0 {
                text
            } else {
                renumber(&text, offset)
            };
            (format!("services-{k:03}.yaml"), text)
        })
        .collect()
}

/// `manifests` of a chunk names its Services from `s0`: shift them by `offset`.
fn renumber(text: &str, offset: usize) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 50);
    let mut rest = text;
    // Every object name is `s<i>` or `s<i>-1` after `name: ` (`service-name: ` too).
    while let Some(at) = rest.find("name: s") {
        let (head, tail) = rest.split_at(at + "name: s".len());
        out.push_str(head);
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        let i: usize = tail[..digits].parse().unwrap_or(0);
        let _ = write!(out, "{}", i + offset);
        rest = &tail[digits..];
    }
    out.push_str(rest);
    out
}

/// One contender's ratios over the rounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ratio {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// Per contender, its ratio to `baseline` in each sample (a round, a turn) that ran the
/// baseline, in order (the baseline's own 1.0s included).
pub fn ratios_to(samples: &[BTreeMap<String, f64>], baseline: &str) -> BTreeMap<String, Vec<f64>> {
    let mut ratios: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for sample in samples {
        let Some(&base) = sample.get(baseline).filter(|b| **b > 0.0) else {
            continue;
        };
        for (name, v) in sample {
            ratios.entry(name.clone()).or_default().push(v / base);
        }
    }
    ratios
}

/// Per contender, the median of its per-round ratios to `baseline` and their range; and a
/// warning for each round in which the baseline was slower than another contender (the
/// machine was busy: a proxied path cannot beat the direct one).
pub fn ratio_summary(
    rounds: &[BTreeMap<String, f64>],
    baseline: &str,
) -> (BTreeMap<String, Ratio>, Vec<String>) {
    let mut warnings = Vec::new();
    for (i, round) in rounds.iter().enumerate() {
        let Some(&base) = round.get(baseline).filter(|b| **b > 0.0) else {
            continue;
        };
        for (name, v) in round
            .iter()
            .filter(|(name, v)| *name != baseline && **v > base)
        {
            warnings.push(format!(
                "round {}: {baseline} ({base:.0}/s) slower than {name} ({v:.0}/s): the \
                 machine was busy",
                i + 1
            ));
        }
    }
    let summary = ratios_to(rounds, baseline)
        .into_iter()
        .map(|(name, mut v)| {
            let (min, max) = range(&v);
            let median = median(&mut v);
            (name, Ratio { median, min, max })
        })
        .collect();
    (summary, warnings)
}

/// The machine's load average (1, 5, 15 min), as /proc/loadavg has it.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// wrk's figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct WrkResult {
    pub requests_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub errors: u64,
}

/// `items` in turn `turn`'s order: rotated left by `turn`, so over `items.len()` turns
/// each takes every place once, and (with three or more: the bench has at least three
/// contenders) the last of one turn is never the first of the next.
pub fn rotated<T>(items: &[T], turn: usize) -> Vec<&T> {
    let k = turn % items.len().max(1);
    items[k..].iter().chain(&items[..k]).collect()
}

/// The mean of runs of equal length: rates and latency percentiles averaged, errors
/// summed.
pub fn mean_of(rs: &[WrkResult]) -> WrkResult {
    let k = rs.len().max(1) as f64;
    WrkResult {
        requests_per_s: rs.iter().map(|r| r.requests_per_s).sum::<f64>() / k,
        p50_ms: rs.iter().map(|r| r.p50_ms).sum::<f64>() / k,
        p99_ms: rs.iter().map(|r| r.p99_ms).sum::<f64>() / k,
        errors: rs.iter().map(|r| r.errors).sum(),
    }
}

fn duration_ms(s: &str) -> Option<f64> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| c.is_alphabetic())?);
    let v: f64 = num.parse().ok()?;
    Some(match unit {
        "us" => v / 1000.0,
        "ms" => v,
        "s" => v * 1000.0,
        "m" => v * 60_000.0,
        _ => return None,
    })
}

/// Parses `wrk --latency` output.
pub fn parse_wrk(out: &str) -> Result<WrkResult> {
    let mut r = WrkResult::default();
    for line in out.lines() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix("Requests/sec:") {
            r.requests_per_s = v.trim().parse().context("Requests/sec")?;
        } else if let Some(v) = t.strip_prefix("50%") {
            r.p50_ms = duration_ms(v).unwrap_or(0.0);
        } else if let Some(v) = t.strip_prefix("99%") {
            r.p99_ms = duration_ms(v).unwrap_or(0.0);
        } else if t.starts_with("Socket errors:") || t.starts_with("Non-2xx") {
            r.errors += t
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|n| n.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    anyhow::ensure!(
        r.requests_per_s > 0.0,
        "no Requests/sec in wrk output:\n{out}"
    );
    Ok(r)
}

/// The node view of `svcs` (ClusterIPs on port 80).
fn view_of(svcs: &[(String, Vec<String>)]) -> Result<NodeView> {
    let mut view = NodeView::new();
    for (vip, eps) in svcs {
        let endpoints = eps.iter().map(|e| e.parse()).collect::<Result<_, _>>()?;
        let (fe, state) = cluster_ip(vip.parse()?, endpoints, Schedule::default());
        view.insert(fe, state);
    }
    Ok(view)
}

/// A ClusterIP frontend on port 80 with `endpoints`, scheduled by `schedule`.
fn cluster_ip(
    vip: IpAddr,
    endpoints: BTreeSet<SocketAddr>,
    schedule: Schedule,
) -> (Frontend, FrontendState) {
    (
        Frontend {
            ip: vip,
            port: 80,
            protocol: Protocol::Tcp,
        },
        FrontendState::builder(vip.to_string(), FrontendKind::ClusterIp)
            .backends(endpoints)
            .schedule(schedule)
            .build(),
    )
}

/// The smallest and the largest value ((`f64::MAX`, `f64::MIN`) for none).
pub fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)))
}

/// The width of `range`: max − min.
pub fn spread_of(v: &[f64]) -> f64 {
    let (lo, hi) = range(v);
    hi - lo
}

/// The distribution-free 95% confidence interval of the median of `v` (order statistics:
/// the k-th smallest and k-th largest values, the largest k for which fewer than k of n
/// samples fall below the true median with probability ≤ 2.5%); for 5 samples or fewer,
/// their range. (0, 0) for none.
pub fn median_ci95(v: &[f64]) -> (f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    // P(X ≤ j) for X ~ Binomial(n, 1/2), accumulated until it passes 2.5%.
    let (mut cdf, mut term) = (0.0, 0.5f64.powi(n as i32));
    let mut k = 0;
    for j in 0..=n {
        cdf += term;
        if cdf > 0.025 {
            k = j;
            break;
        }
        term *= (n - j) as f64 / (j + 1) as f64;
    }
    let k = k.max(1);
    (v[k - 1], v[n - k])
}

/// The middle value (the mean of the two middle ones for an even count; 0 for none):
/// one disturbed repetition does not move it.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Mean nanoseconds per run of the real classifier (established flow and new flows) and of
/// a pass-through program, with `n` Services in the maps.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PerPacket {
    pub established_ns: f64,
    pub new_flow_ns: f64,
    /// The backend's reply on the established flow.
    pub reply_ns: f64,
    /// A packet for no Service (pod to pod, on a port no frontend uses): what most of a
    /// node's traffic costs the classifier.
    pub other_ns: f64,
    /// The same, on a port some frontend also uses (80): what the frontend-port filter
    /// spares the packet above (the flow tables', the origin's and the services' lookups).
    pub other_frontend_port_ns: f64,
    pub pass_through_ns: f64,
}

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

/// `CONNTRACK_NEW`'s size in the per-packet benchmarks: room for every new flow a run
/// makes (60,000 ports, two entries each), so new flows are measured without LRU
/// evictions.
const CONNTRACK_NEW_ROOM: u32 = 262_144;

pub fn per_packet(n: usize, runs: u32) -> Result<PerPacket> {
    let (mut ebpf, mut maps) =
        bpf::load_private(&[(proxy_common::map_names::CONNTRACK_NEW, CONNTRACK_NEW_ROOM)])?;
    for name in ["tc_ingress", "tc_pass"] {
        let prog: &mut SchedClassifier = ebpf.program_mut(name).context("program")?.try_into()?;
        prog.load()?;
    }
    let view = view_of(&services(n))?;
    let mut state = Mirror::adopt(&maps)?;
    state.apply(&mut maps, &view)?;
    let vip: SocketAddr = format!("{VIP}:80").parse()?;
    // The established flow: a completed handshake (SYN, SYN-ACK, ACK), so its packets
    // are looked up as an established connection's are.
    let client: SocketAddr = "10.244.0.3:40000".parse()?;
    let backend;
    {
        let p: &SchedClassifier = ebpf.program("tc_ingress").context("program")?.try_into()?;
        let run = |data: &[u8]| -> Result<Vec<u8>> {
            let mut out = vec![0u8; 256];
            let res = p.test_run(TestRunOptions {
                data_in: Some(data),
                data_out: Some(&mut out),
                ..Default::default()
            })?;
            out.truncate(res.data_size_out as usize);
            Ok(out)
        };
        let out = run(&packet::build_tcp(client, vip, TCP_SYN))?;
        backend = packet::inspect(&out).map_err(anyhow::Error::msg)?.dst;
        run(&packet::build_tcp(backend, client, TCP_SYN | TCP_ACK))?;
        run(&packet::build_tcp(client, vip, TCP_ACK))?;
    }
    let mean = |prog: &str, packet_of: &dyn Fn(u32) -> Result<Vec<u8>>| -> Result<f64> {
        let p: &SchedClassifier = ebpf.program(prog).context("program")?.try_into()?;
        let mut total = 0u128;
        let mut out = vec![0u8; 256];
        for i in 0..runs {
            let data = packet_of(i)?;
            let res = p.test_run(TestRunOptions {
                data_in: Some(&data),
                data_out: Some(&mut out),
                ..Default::default()
            })?;
            total += res.duration.as_nanos();
        }
        Ok(total as f64 / f64::from(runs))
    };
    let established = |_| Ok(packet::build_tcp(client, vip, TCP_ACK));
    // New flows: a SYN from another port each time.
    let new_flow = |i: u32| {
        let src: SocketAddr = format!("10.244.0.3:{}", 1024 + (i % 60_000)).parse()?;
        Ok(packet::build_tcp(src, vip, TCP_SYN))
    };
    let reply = |_| Ok(packet::build_tcp(backend, client, TCP_ACK));
    let other: SocketAddr = "10.244.1.9:9000".parse()?;
    let other_80: SocketAddr = "10.244.1.9:80".parse()?;
    let other = |_| Ok(packet::build_tcp(client, other, TCP_ACK));
    let other_80 = |_| Ok(packet::build_tcp(client, other_80, TCP_ACK));
    // Alternate the contenders so drift hits all alike.
    let mut pp = PerPacket::default();
    let rounds = 2;
    let share = |ns: f64| ns / f64::from(rounds);
    for _ in 0..rounds {
        pp.pass_through_ns += share(mean("tc_pass", &established)?);
        pp.established_ns += share(mean("tc_ingress", &established)?);
        pp.new_flow_ns += share(mean("tc_ingress", &new_flow)?);
        pp.reply_ns += share(mean("tc_ingress", &reply)?);
        pp.other_ns += share(mean("tc_ingress", &other)?);
        pp.other_frontend_port_ns += share(mean("tc_ingress", &other_80)?);
    }
    drop(maps);
    Ok(pp)
}

/// Ours: programming all Services into (private) maps, and one endpoint change.
pub fn our_control_plane(n: usize) -> Result<(f64, f64)> {
    let (_ebpf, mut maps) = bpf::load_private(&[])?;
    let mut state = Mirror::adopt(&maps)?;
    let svcs = services(n);
    let view = view_of(&svcs)?;
    let t = Instant::now();
    state.apply(&mut maps, &view)?;
    let all = t.elapsed().as_secs_f64() * 1e3;
    let mut changed = svcs.clone();
    let last = changed.len() - 1;
    changed[last].1.pop();
    let view = view_of(&changed)?;
    let t = Instant::now();
    state.apply(&mut maps, &view)?;
    Ok((all, t.elapsed().as_secs_f64() * 1e3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_ci95_takes_the_order_statistics_of_the_binomial_table() {
        let v: Vec<f64> = (1..=50).rev().map(f64::from).collect();
        // n = 50: the 18th and the 33rd of the sorted samples (the published table).
        assert_eq!(median_ci95(&v), (18.0, 33.0));
        let v: Vec<f64> = (1..=9).map(f64::from).collect();
        assert_eq!(median_ci95(&v), (2.0, 8.0));
        assert_eq!(median_ci95(&[3.0, 1.0, 2.0]), (1.0, 3.0));
        assert_eq!(median_ci95(&[]), (0.0, 0.0));
    }

    /// The full bench's 100k Services load from files the file source accepts, every
    /// Service once (the single 52 MB file was refused by the 16 MiB limit).
    #[test]
    fn the_full_sizes_are_loadable_by_the_file_source() {
        let svcs = services(100_000);
        let files = manifest_files(&svcs);
        assert_eq!(files.len(), 10);
        let limit = proxy_agent::source::files::MAX_FILE_BYTES as usize;
        for (name, text) in &files {
            assert!(text.len() < limit, "{name}: {} bytes", text.len());
        }
        // Names continue across files: s0..s99999, each once.
        let names: std::collections::BTreeSet<&str> = files
            .values()
            .flat_map(|t| t.lines())
            .filter_map(|l| l.strip_prefix("metadata: {name: "))
            .filter_map(|l| l.split(',').next())
            .filter(|n| !n.ends_with("-1"))
            .collect();
        assert_eq!(names.len(), 100_000);
        assert!(names.contains("s99999") && names.contains("s10000"));
        // The last file read by the file source itself: accepted whole.
        let dir = std::env::temp_dir().join(format!("bench-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (name, text) = files.iter().next_back().expect("a file");
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        let parsed = proxy_agent::source::files::parse_file(&path);
        std::fs::remove_dir_all(&dir).expect("clean up");
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors.first());
        assert!(parsed.complete);
        assert_eq!(parsed.model.service_count(), SERVICES_PER_FILE);
    }

    #[test]
    fn ratios_are_medians_of_rounds_and_a_slower_baseline_is_flagged() {
        let round = |d: f64, p: f64| {
            BTreeMap::from([("Direct".to_string(), d), ("PerPacket".to_string(), p)])
        };
        let rounds = [round(100.0, 90.0), round(100.0, 80.0), round(50.0, 60.0)];
        let (summary, warnings) = ratio_summary(&rounds, "Direct");
        let r = summary["PerPacket"];
        assert_eq!((r.median, r.min, r.max), (0.9, 0.8, 1.2));
        let d = summary["Direct"];
        assert_eq!((d.median, d.min, d.max), (1.0, 1.0, 1.0));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("round 3: Direct"), "{warnings:?}");
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn turns_rotate_so_no_contender_runs_twice_in_a_row() {
        let items = ["a", "b", "c", "d", "e"];
        let mut places = [[0; 5]; 5];
        let mut last = None;
        for turn in 0..10 {
            let order = rotated(&items, turn);
            assert_eq!(order.len(), 5);
            assert_ne!(Some(order[0]), last, "turn {turn}");
            last = Some(order[4]);
            for (place, item) in order.iter().enumerate() {
                places[items.iter().position(|i| i == *item).unwrap()][place] += 1;
            }
        }
        // Ten turns: every contender twice in every place.
        assert!(places.iter().flatten().all(|n| *n == 2), "{places:?}");
        assert!(rotated::<u8>(&[], 3).is_empty());
    }

    #[test]
    fn a_rounds_slices_average_and_their_errors_add_up() {
        let r = |rate, p99, errors| WrkResult {
            requests_per_s: rate,
            p50_ms: 0.2,
            p99_ms: p99,
            errors,
        };
        let m = mean_of(&[r(20_000.0, 4.0, 1), r(18_000.0, 2.0, 2)]);
        assert_eq!(m.requests_per_s, 19_000.0);
        assert_eq!(m.p99_ms, 3.0);
        assert_eq!(m.errors, 3);
    }
}
