//! What the churn benchmark (`src/bin/churn.rs`) reads from an agent it treats as a black
//! box: view diffs from `/debug/watch`, its metrics, and its process's CPU time, memory and
//! BPF maps from /proc; and the latency figures made of them.

use std::{
    collections::HashMap,
    fs,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use proxy_testbed::fake_apiserver::{Change, Population};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Latency {
    /// Quantiles over every change made, in ms; `None` when the quantile falls among the
    /// changes never seen (it is then longer than the churn plus the drain).
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
    pub mean_seen_ms: Option<f64>,
    /// The agent's own figure for comparison: the mean of its network programming
    /// histogram over the churn and the drain (it counts slice changes it applied).
    pub agent_mean_ms: Option<f64>,
    pub agent_observed: u64,
    /// Mean latency of the changes made in each second of the churn (a rising series: the
    /// agent falls behind), ms; `None` where none of that second's changes was seen.
    pub per_second_mean_ms: Vec<Option<f64>>,
}

pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// What `/debug/watch` showed: when each fresh address first appeared in a `+` line.
#[derive(Default)]
pub struct Seen {
    pub first: HashMap<u32, SystemTime>,
    pub dropped: u64,
}

/// Opens `/debug/watch` (subscribed once its headers are back) and records, in a task,
/// the first `+` line holding each fresh address.
pub async fn watch_view(addr: &str, seen: Arc<Mutex<Seen>>) -> Result<tokio::task::JoinHandle<()>> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    // HTTP/1.0: the body is the connection's rest, no chunks.
    stream
        .write_all(b"GET /debug/watch HTTP/1.0\r\n\r\n")
        .await?;
    let mut reader = tokio::io::BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        let n = tokio::time::timeout(Duration::from_secs(10), reader.read_line(&mut line))
            .await
            .context("/debug/watch did not answer")??;
        if n == 0 {
            bail!("/debug/watch closed before its headers ended");
        }
        if line.starts_with("HTTP/") && !line.contains(" 200") {
            bail!("/debug/watch answered {}", line.trim());
        }
        if line == "\r\n" || line == "\n" {
            break;
        }
    }
    Ok(tokio::spawn(async move {
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let now = SystemTime::now();
            let mut s = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match parse_watch_line(&line) {
                WatchLine::Added(fresh) => {
                    for ip in fresh {
                        s.first.entry(u32::from(ip)).or_insert(now);
                    }
                }
                WatchLine::Dropped(n) => s.dropped += n,
                WatchLine::Other => {}
            }
        }
    }))
}

/// What one line of `/debug/watch` tells the bench.
#[derive(Debug, PartialEq, Eq)]
pub enum WatchLine {
    /// A `+` line: the fresh endpoint addresses it holds.
    Added(Vec<Ipv4Addr>),
    /// `# N lines dropped (slow reader)`.
    Dropped(u64),
    Other,
}

/// Reads a `/debug/watch` line: `+ VIP:PORT/PROTO ns/name:port Kind -> ip:port,ip:port ...`.
pub fn parse_watch_line(line: &str) -> WatchLine {
    if let Some(rest) = line.strip_prefix("# ") {
        return rest
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .map_or(WatchLine::Other, WatchLine::Dropped);
    }
    if !line.starts_with("+ ") {
        return WatchLine::Other;
    }
    WatchLine::Added(
        line.split([' ', ',', '\n'])
            .filter_map(|token| match token.parse::<SocketAddr>() {
                Ok(SocketAddr::V4(a)) if Population::is_fresh(*a.ip()) => Some(*a.ip()),
                _ => None,
            })
            .collect(),
    )
}

/// Quantiles over `total` changes, of which `seen` (sorted, ms) were seen.
pub fn latency(seen: &[f64], total: usize) -> Latency {
    let q = |p: f64| -> Option<f64> {
        if total == 0 {
            return None;
        }
        // Nearest rank over every change made; unseen ones rank last.
        let rank = ((p * total as f64).ceil() as usize).clamp(1, total);
        seen.get(rank - 1).copied()
    };
    Latency {
        p50_ms: q(0.50),
        p90_ms: q(0.90),
        p99_ms: q(0.99),
        max_ms: q(1.0),
        mean_seen_ms: (!seen.is_empty()).then(|| seen.iter().sum::<f64>() / seen.len() as f64),
        ..Latency::default()
    }
}

/// Mean latency of the changes made in each second since the first change.
pub fn per_second(changes: &[Change], per_change: &[Option<f64>]) -> Vec<Option<f64>> {
    let Some(first) = changes.first().map(|c| c.trigger) else {
        return Vec::new();
    };
    let mut buckets: Vec<(f64, usize)> = Vec::new();
    for (c, latency) in changes.iter().zip(per_change) {
        let second = c
            .trigger
            .duration_since(first)
            .map_or(0, |d| d.as_secs() as usize);
        if buckets.len() <= second {
            buckets.resize(second + 1, (0.0, 0));
        }
        if let Some(l) = latency {
            buckets[second].0 += l;
            buckets[second].1 += 1;
        }
    }
    buckets
        .into_iter()
        .map(|(sum, n)| (n > 0).then(|| (sum / n as f64 * 10.0).round() / 10.0))
        .collect()
}

/// A port free on loopback now (the kernel's choice), for a process started next.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("finding a free loopback port")?
        .port())
}

/// `GET path` on loopback: the body of a 200 answer.
pub async fn http_get(addr: &str, path: &str) -> Result<String> {
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
            .await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        anyhow::Ok(out)
    };
    let text = tokio::time::timeout(Duration::from_secs(30), fetch)
        .await
        .with_context(|| format!("GET {addr}{path}: no answer in 30 s"))??;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET {addr}{path}: malformed answer"))?;
    if !head.lines().next().is_some_and(|l| l.contains(" 200")) {
        bail!("GET {addr}{path}: {}", head.lines().next().unwrap_or(""));
    }
    Ok(body.to_string())
}

/// `/metrics`, or nothing when the agent is too busy to answer (its figures are then
/// missing from the run, which goes on).
pub async fn scrape(addr: &str) -> String {
    match http_get(addr, "/metrics").await {
        Ok(text) => text,
        Err(e) => {
            eprintln!("  (metrics: {e:#})");
            String::new()
        }
    }
}

/// A labelled series' values by one label's value (`name{label="v"} x` → v: x).
pub fn labelled(text: &str, name: &str, label: &str) -> std::collections::BTreeMap<String, f64> {
    let prefix = format!("{name}{{{label}=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (value_of_label, rest) = rest.split_once('"')?;
            let v = rest.rsplit_once(' ')?.1.trim().parse().ok()?;
            Some((value_of_label.to_string(), v))
        })
        .collect()
}

/// utime + stime of `pid`, seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    let ticks = cpu_ticks(&stat).with_context(|| format!("malformed /proc/{pid}/stat"))?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks as f64 / hz.max(1.0))
}

/// utime + stime (fields 14 and 15) of a /proc/<pid>/stat line, in clock ticks.
fn cpu_ticks(stat: &str) -> Option<u64> {
    // The fields after the command name, which may hold spaces and parentheses; they
    // start at field 3.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| fields.get(i - 3)?.parse::<u64>().ok();
    Some(field(14)? + field(15)?)
}

/// CPU time every process on the machine has used since boot (all but idle and iowait
/// in /proc/stat), seconds.
pub fn machine_busy_seconds() -> Result<f64> {
    let stat = fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let ticks = busy_ticks(&stat).context("malformed /proc/stat")?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks as f64 / hz.max(1.0))
}

/// The `cpu` line's ticks but idle (4th) and iowait (5th); guest time is already in user.
fn busy_ticks(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    let total: u64 = ticks.iter().sum();
    Some(total - ticks.get(3)? - ticks.get(4)?)
}

/// VmRSS and VmHWM of `pid`, MiB.
pub fn memory_mib(pid: u32) -> Result<(f64, f64)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kib = |key: &str| -> Option<f64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    Ok((
        kib("VmRSS:").unwrap_or(0.0) / 1024.0,
        kib("VmHWM:").unwrap_or(0.0) / 1024.0,
    ))
}

/// The memory the kernel charges for the BPF maps `pid` holds open (`memlock` in each
/// map fd's fdinfo, each map once): bytes and maps.
pub fn bpf_map_memory(pid: u32) -> Result<(u64, usize)> {
    let mut by_id: HashMap<u64, u64> = HashMap::new();
    let dir = format!("/proc/{pid}/fdinfo");
    for entry in fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let Ok(entry) = entry else { continue };
        let Ok(info) = fs::read_to_string(entry.path()) else {
            continue;
        };
        let field = |key: &str| -> Option<u64> {
            info.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().parse().ok())
        };
        if let (Some(id), Some(memlock)) = (field("map_id:"), field("memlock:")) {
            by_id.insert(id, memlock);
        }
    }
    Ok((by_id.values().sum(), by_id.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plus_line_yields_its_fresh_addresses_only() {
        let line = "+ 172.16.0.5:80/TCP default/s5:http ClusterIp -> 10.0.0.50:8080,10.128.0.7:8080,\
                    10.128.1.0:8080 internal -> 10.128.0.9:8080\n";
        assert_eq!(
            parse_watch_line(line),
            WatchLine::Added(vec![
                Ipv4Addr::new(10, 128, 0, 7),
                Ipv4Addr::new(10, 128, 1, 0),
                Ipv4Addr::new(10, 128, 0, 9)
            ])
        );
        let gone = "- 172.16.0.5:80/TCP default/s5:http ClusterIp -> 10.128.0.7:8080\n";
        assert_eq!(parse_watch_line(gone), WatchLine::Other);
        assert_eq!(
            parse_watch_line("# 17 lines dropped (slow reader)\n"),
            WatchLine::Dropped(17)
        );
    }

    #[test]
    fn quantiles_count_unseen_changes_as_the_slowest() {
        // 100 changes, 98 seen at 1..=98 ms: p50 is seen, p99 falls among the unseen.
        let seen: Vec<f64> = (1..=98).map(f64::from).collect();
        let l = latency(&seen, 100);
        assert_eq!(l.p50_ms, Some(50.0));
        assert_eq!(l.p90_ms, Some(90.0));
        assert_eq!(l.p99_ms, None);
        assert_eq!(l.max_ms, None);
        assert_eq!(l.mean_seen_ms, Some(49.5));
        let all = latency(&seen, 98);
        assert_eq!(all.p99_ms, Some(98.0));
        assert_eq!(all.max_ms, Some(98.0));
        assert_eq!(latency(&[], 0).p50_ms, None);
    }

    #[test]
    fn per_second_means_follow_the_trigger_times() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let change = |ms: u64| Change {
            seq: ms,
            slice: 0,
            address: Population::FRESH_BASE,
            trigger: t0 + Duration::from_millis(ms),
        };
        let changes = [change(0), change(500), change(1_200), change(2_100)];
        let latencies = [Some(10.0), Some(20.0), None, Some(40.0)];
        assert_eq!(
            per_second(&changes, &latencies),
            vec![Some(15.0), None, Some(40.0)]
        );
    }

    #[test]
    fn labelled_series_are_read_by_their_label() {
        let text = "# HELP x\nm{map=\"SERVICES\"} 4096\nm{map=\"BACKENDS\"} 12\nmx{map=\"A\"} 1\n";
        let got = labelled(text, "m", "map");
        assert_eq!(got.len(), 2);
        assert_eq!(got["SERVICES"], 4096.0);
        assert_eq!(got["BACKENDS"], 12.0);
    }

    #[test]
    fn cpu_ticks_skip_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (proxy (agent) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 \
                    8 0 123 456 789";
        assert_eq!(cpu_ticks(stat), Some(300));
        assert_eq!(cpu_ticks("garbage"), None);
    }

    #[test]
    fn busy_ticks_leave_out_idle_and_iowait() {
        let stat = "cpu  100 5 50 1000 20 3 2 1 7 0\ncpu0 50 2 25 500 10 1 1 0 0 0\n";
        assert_eq!(busy_ticks(stat), Some(161));
    }

    #[test]
    fn ansi_colours_are_stripped() {
        assert_eq!(
            strip_ansi("\u{1b}[2m2025\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m x"),
            "2025 ERROR x"
        );
    }
}
