//! `cargo xtask soak`: both datapaths at once under traffic shaped like a cluster's —
//! short TCP connections, keep-alive connections idle past the 60 s unanswered-TCP limit,
//! DNS-like UDP, connected UDP idle past the 30 s UDP limit — while endpoints churn and
//! the agent is killed (-9) and started again. Prints requests, failures by kind and the
//! conntrack fill; exits non-zero on any failure.
//!
//! One testbed, one agent carrying both the cgroup hooks (on the testbed's cgroup) and
//! the classifier (on the node's interfaces): clients in the cgroup take the connect-time
//! path, clients outside it reach the node untranslated and take the per-packet path.
//!
//! The objects come from the fake API server (`--source api`, the default), which
//! meanwhile throws faults at the agent on a schedule (`proxy_bench::api_feed`); after each,
//! the pinned maps must come to hold exactly what the server holds. `--source files`
//! serves them from a folder, without faults.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use proxy_bench::api_feed::{ApiFeed, Fault};
use proxy_testbed::{
    Attempt, Background, EMPTY_VIP4, Path_, TCP_PORT, TCP_TARGET, Testbed, UDP_PORT, UDP_TARGET,
    VIP4, VIP6, fake_apiserver::OldVersions, target, web_manifests,
};

/// Where the agent's objects come from.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Source {
    /// The fake API server, with faults on a schedule.
    Api,
    /// A folder of manifests, no faults.
    Files,
}

#[derive(Parser)]
struct Args {
    /// The agent binary.
    #[arg(long)]
    agent: PathBuf,
    /// How long traffic runs.
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Seconds between agent restarts (kill -9, start again).
    #[arg(long, default_value_t = 50)]
    restart_secs: u64,
    /// Seconds between endpoint changes of the busy Service (the web Service changes
    /// every fourth time).
    #[arg(long, default_value_t = 5)]
    churn_secs: u64,
    /// Also put every endpoint change on the timeline (stderr).
    #[arg(long)]
    verbose: bool,
    /// Where the objects come from.
    #[arg(long, value_enum, default_value_t = Source::Api)]
    source: Source,
    /// Seconds between API-server faults (`--source api`).
    #[arg(long, default_value_t = 20)]
    fault_secs: u64,
}

/// A second Service whose endpoints change at every churn step (IPv4, TCP and UDP).
const BUSY_VIP4: &str = "10.96.0.11";
/// web (2 families × 2 ports) + empty + busy (2 ports).
const FRONTENDS: usize = 7;
/// With the API server, a Service without endpoints (TCP 80) is replaced by the next of
/// these at each fault: the change each fault must not lose, and the one it must not
/// leave behind (never the one before, so a stale map cannot pass for a fresh one). No
/// client uses them.
const EXTRA_VIP4: [&str; 7] = [
    "10.96.0.31",
    "10.96.0.32",
    "10.96.0.33",
    "10.96.0.34",
    "10.96.0.35",
    "10.96.0.36",
    "10.96.0.37",
];
/// The node the agent is, as the API server has it.
const NODE_NAME: &str = "soak-node";
/// How long the maps may take to hold what the server holds once a fault ended: past the
/// watchers' 30 s backoff cap.
const CONVERGE_WITHIN: Duration = Duration::from_secs(45);
/// Idle gaps of the long-lived flows: past kube-proxy's unanswered TCP (60 s) and UDP
/// (30 s) timeouts, which a flow that was answered must outlive.
const KEEPALIVE_IDLE_MS: u64 = 65_000;
const UDP_IDLE_MS: u64 = 35_000;
/// The node's addresses, which per-packet flows are masqueraded to (`masqueradeAll`).
const NODE4: &str = "10.10.0.1";
const NODE6: &str = "fd10::1";
const METRICS: &str = "127.0.0.1:10249";
/// BPF counters that must stay zero: each means a packet or socket the proxy failed.
const MUST_STAY_ZERO: [&str; 11] = [
    "no_backend_reject",
    "no_backend_drop",
    "backend_missing",
    "ct_create_failed",
    "sock_rev_nat_failed",
    "rewrite_failed",
    "snat_ports_exhausted",
    "ct_full",
    "reject_sent",
    "reject_failed",
    "drop_unreachable",
];

/// Client processes, killed when dropped: no client outlives the run, however it ends.
struct Kill(Vec<u32>);

impl Drop for Kill {
    fn drop(&mut self) {
        for pid in &self.0 {
            // SAFETY: signalling a child of ours; its reader reaps it.
            unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    ShortTcp,
    DnsUdp,
    KeepAliveTcp,
    ConnectedUdp,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::ShortTcp => "short tcp",
            Kind::DnsUdp => "dns-like udp",
            Kind::KeepAliveTcp => "keep-alive tcp (65 s idle)",
            Kind::ConnectedUdp => "connected udp (35 s idle)",
        }
    }
}

/// When each Service's endpoint set changed: (time, bit i = backend i present).
#[derive(Default)]
struct Membership(BTreeMap<&'static str, Vec<(Instant, u8)>>);

impl Membership {
    /// Whether a backend left `service` between `from` and `to`.
    fn removal_between(&self, service: &str, from: Instant, to: Instant) -> bool {
        self.0.get(service).is_some_and(|log| {
            log.windows(2)
                .any(|w| w[0].1 & !w[1].1 != 0 && w[1].0 >= from && w[1].0 <= to)
        })
    }

    /// `service`'s sets from the one live at `from` to the last one at or before `to`,
    /// for a failure's line on the timeline.
    fn describe(&self, service: &str, from: Instant, to: Instant) -> String {
        let Some(log) = self.0.get(service) else {
            return String::new();
        };
        let first = log.iter().rposition(|(at, _)| *at <= from).unwrap_or(0);
        log[first..]
            .iter()
            .take_while(|(at, _)| *at <= to)
            .map(|(at, set)| format!("t={:.1}s {:?}", t(*at), members(*set)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether one of `backends` (a bit set) was out of `service` at any time between
    /// `from` and `to`.
    fn left_between(&self, service: &str, backends: u8, from: Instant, to: Instant) -> bool {
        let Some(log) = self.0.get(service) else {
            return false;
        };
        log.iter().enumerate().any(|(i, (at, set))| {
            let until = log.get(i + 1).map(|(t, _)| *t);
            !set & backends != 0 && *at <= to && until.is_none_or(|u| u >= from)
        })
    }
}

/// One background client and what its attempts came to.
struct Worker {
    path: Path_,
    kind: Kind,
    service: &'static str,
    target: String,
    requests: u64,
    /// Error kind (or check that failed) → count.
    failures: BTreeMap<String, u64>,
    /// Expected events: a connected UDP flow whose backend left moved (connect-time: the
    /// socket was destroyed and the client saw ECONNABORTED once).
    expected: BTreeMap<String, u64>,
    /// Long-lived flows: answers after an idle gap on the same flow, same backend.
    idle_cycles: u64,
    /// The first failures' timeline lines, repeated at the end where a CI log's tail
    /// shows them.
    first_failures: Vec<String>,
}

impl Worker {
    /// Counts a failure by `why` and puts it on the timeline (stderr) with `detail`.
    fn fail(&mut self, at: Instant, why: String, detail: &str) {
        let line = format!(
            "t={:.1}s FAILED {} {} {}: {why} {detail}",
            t(at),
            path_name(self.path),
            self.kind.name(),
            self.target
        );
        eprintln!("{line}");
        if self.first_failures.len() < 3 {
            self.first_failures.push(line);
        }
        *self.failures.entry(why).or_insert(0) += 1;
    }

    fn expect(&mut self, what: &str) {
        *self.expected.entry(what.to_string()).or_insert(0) += 1;
    }

    fn failed(&self) -> u64 {
        self.failures.values().sum()
    }
}

/// Follows one client's attempts as they come and judges each.
fn follow(client: &Background, worker: &Mutex<Worker>, membership: &Mutex<Membership>) {
    let mut last: Option<Flow> = None;
    for line in client.lines() {
        // A line cut short when the client is stopped is no attempt.
        let Ok(a) = serde_json::from_str::<Attempt>(&line) else {
            continue;
        };
        // The client dates each attempt's end on the machine's monotonic clock: a line
        // read late (a busy machine) must not move the attempt past a membership change
        // that came after it.
        let end = a
            .end_mono_ns
            .map_or_else(Instant::now, proxy_testbed::client::instant_of_monotonic);
        let mut w = worker.lock().unwrap_or_else(|e| e.into_inner());
        judge(&mut w, &a, end, &mut last, membership);
    }
}

fn backend_index(a: &Attempt) -> Option<usize> {
    a.backend.as_deref()?.strip_prefix("backend-")?.parse().ok()
}

/// What a long-lived client's current flow is known by: since when (its last answer, or
/// the failure after which the client connected again), and the backend that answered.
#[derive(Clone, Copy)]
struct Flow {
    since: Instant,
    backend: Option<usize>,
}

impl Flow {
    /// Its backend as a bit set; every backend when it is not known yet.
    fn backends(self) -> u8 {
        self.backend.map_or(0b111, |b| 1 << b)
    }
}

/// Seconds since the soak began, for the timeline on stderr.
fn t(at: Instant) -> f64 {
    at.saturating_duration_since(*BEGAN.get_or_init(Instant::now))
        .as_secs_f64()
}

static BEGAN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn judge(
    w: &mut Worker,
    a: &Attempt,
    end: Instant,
    last: &mut Option<Flow>,
    membership: &Mutex<Membership>,
) {
    w.requests += 1;
    let at = end
        .checked_sub(Duration::from_secs_f64(a.ms / 1e3))
        .unwrap_or(end);
    let long_lived = matches!(w.kind, Kind::KeepAliveTcp | Kind::ConnectedUdp);
    let left = |b: u8, from: Instant| {
        membership
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .left_between(w.service, b, from, end)
    };
    if !a.ok {
        let error = match a.errno {
            Some(n) if a.error.as_deref() == Some("Uncategorized") => format!("errno {n}"),
            _ => a.error.clone().unwrap_or_else(|| "unknown".into()),
        };
        // The agent destroys a connect-time connected UDP socket whose backend left: a
        // receive fails with ECONNABORTED, a send with EDESTADDRREQ (the kernel's
        // udp_abort disconnects the socket too).
        let aborted_as_designed = w.kind == Kind::ConnectedUdp
            && w.path == Path_::ConnectTime
            && matches!(a.errno, Some(libc::ECONNABORTED | libc::EDESTADDRREQ))
            && last.is_some_and(|f| left(f.backends(), f.since));
        // Per packet, the flows of a backend that leaves are cleared (kube-proxy flushes
        // their conntrack entries too): an answer on its way back then finds no flow.
        let lost_in_flight = matches!(w.kind, Kind::DnsUdp | Kind::ConnectedUdp)
            && w.path == Path_::PerPacket
            && matches!(a.errno, Some(libc::EAGAIN | libc::ETIMEDOUT))
            && membership
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .removal_between(
                    w.service,
                    at.checked_sub(Duration::from_secs(1)).unwrap_or(at),
                    end,
                );
        if lost_in_flight {
            w.expect("lost in flight as a backend left (its flows cleared)");
        } else if aborted_as_designed {
            let errno = if a.errno == Some(libc::ECONNABORTED) {
                "ECONNABORTED"
            } else {
                "EDESTADDRREQ"
            };
            w.expect(&format!("destroyed after its backend left ({errno})"));
        } else {
            let flow = last.map_or("-".into(), |f| {
                format!(
                    "t={:.1}s on {:?}",
                    t(f.since),
                    f.backend.map(Testbed::backend_name)
                )
            });
            let sets = last.map_or(String::new(), |f| {
                membership
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .describe(w.service, f.since, end)
            });
            w.fail(
                end,
                error,
                &format!(
                    "(attempt began t={:.1}s; flow since {flow}; {} endpoints since: {sets})",
                    t(at),
                    w.service
                ),
            );
        }
        // The client connects again after a failure: a new flow, backend unknown.
        *last = Some(Flow {
            since: end,
            backend: None,
        });
        return;
    }
    let Some(backend) = backend_index(a) else {
        w.fail(at, format!("unknown backend {:?}", a.backend), "");
        return;
    };
    if a.peer.as_deref() != Some(w.target.as_str()) {
        w.fail(at, format!("peer {:?}, not the ClusterIP", a.peer), "");
        return;
    }
    if w.path == Path_::PerPacket {
        let seen = a.seen_as.as_deref().unwrap_or("");
        if seen != NODE4 && seen != NODE6 {
            w.fail(at, format!("not masqueraded (seen as {seen})"), "");
            return;
        }
    }
    if long_lived
        && let Some(Flow {
            since,
            backend: Some(before),
        }) = *last
    {
        if before != backend {
            if w.kind == Kind::ConnectedUdp && left(1 << before, since) {
                w.expect("moved to a live backend after its backend left");
            } else {
                w.fail(
                    at,
                    format!("flow moved backend-{before} → backend-{backend}"),
                    &format!("(flow since t={:.1}s)", t(since)),
                );
            }
        } else if at.duration_since(since) > Duration::from_secs(30)
            // A UDP flow whose backend left was forgotten: the same backend again is luck.
            && (w.kind == Kind::KeepAliveTcp || !left(1 << backend, since))
        {
            w.idle_cycles += 1;
        }
    }
    *last = Some(Flow {
        since: at,
        backend: Some(backend),
    });
}

/// GET `path` from the agent's metrics/debug listener in the node's namespace (from a
/// thread that enters the namespace, so this process stays where it is).
fn http_get(netns: &str, path: &str) -> Result<String> {
    let netns = PathBuf::from(format!("/run/netns/{netns}"));
    let path = path.to_string();
    thread::spawn(move || -> Result<String> {
        proxy_testbed::client::enter(Some(&netns), None)?;
        let mut s = TcpStream::connect_timeout(&METRICS.parse()?, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        let (head, body) = body.split_once("\r\n\r\n").context("no HTTP header")?;
        if !head.starts_with("HTTP/1.") || !head.contains(" 200 ") {
            bail!("{}", head.lines().next().unwrap_or(""));
        }
        Ok(body.to_string())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the metrics thread panicked"))?
}

/// `proxy_agent_<name> value` lines of the Prometheus text.
fn metric(text: &str, name: &str) -> Option<u64> {
    let full = format!("proxy_agent_{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&full))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// The conntrack fill over the run, from the agents' metrics.
#[derive(Default)]
struct Fill {
    answered_peak: u64,
    answered_capacity: u64,
    new_peak: u64,
    new_capacity: u64,
    /// Collected by agents already killed, plus the current one's count.
    collected_before: u64,
    collected_now: u64,
    samples: u64,
    answered_last: u64,
    new_last: u64,
}

impl Fill {
    fn sample(&mut self, text: &str) {
        let get = |n| metric(text, n).unwrap_or(0);
        // A new agent reports nothing until its collector's first pass.
        if get("conntrack_answered_capacity") == 0 {
            return;
        }
        let answered = get("conntrack_answered_entries");
        let new = get("conntrack_new_entries");
        self.answered_peak = self.answered_peak.max(answered);
        self.new_peak = self.new_peak.max(new);
        self.answered_capacity = get("conntrack_answered_capacity");
        self.new_capacity = get("conntrack_new_capacity");
        self.collected_now = get("conntrack_collected");
        self.answered_last = answered;
        self.new_last = new;
        self.samples += 1;
    }

    /// The agent is about to die: its collected count is final.
    fn agent_gone(&mut self) {
        self.collected_before += std::mem::take(&mut self.collected_now);
    }
}

/// Endpoints of the busy Service on `backends` (IPv4 only).
fn busy_manifest(backends: u8) -> String {
    let mut s = format!(
        "apiVersion: v1
kind: Service
metadata: {{name: busy, namespace: default}}
spec:
  clusterIP: {BUSY_VIP4}
  ports:
  - {{name: http, protocol: TCP, port: {TCP_PORT}, targetPort: {TCP_TARGET}}}
  - {{name: dns, protocol: UDP, port: {UDP_PORT}, targetPort: {UDP_TARGET}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: busy-ipv4
  namespace: default
  labels: {{kubernetes.io/service-name: busy}}
addressType: IPv4
ports:
- {{name: http, protocol: TCP, port: {TCP_TARGET}}}
- {{name: dns, protocol: UDP, port: {UDP_TARGET}}}
endpoints:
"
    );
    for i in members(backends) {
        s.push_str(&format!(
            "- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n",
            Testbed::backend_ip4(i)
        ));
    }
    s
}

fn members(set: u8) -> Vec<usize> {
    (0..3).filter(|i| set & (1 << i) != 0).collect()
}

/// A small xorshift: the churn needs variety, not quality.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A non-empty subset of the three backends, other than `not`.
    fn subset(&mut self, not: u8) -> u8 {
        loop {
            let s = (self.next() % 7 + 1) as u8;
            if s != not {
                return s;
            }
        }
    }
}

struct Soak {
    tb: Testbed,
    agent_args: Vec<String>,
    membership: Arc<Mutex<Membership>>,
    web: u8,
    busy: u8,
    changes: u64,
    restarts: u64,
    /// The last log lines of agents already killed (the testbed keeps the current one's).
    old_logs: String,
    /// Every agent's lines about the connected UDP sockets it destroyed (debug), for a
    /// failed run: which socket went, to which backend, when.
    destroys: String,
    /// The fake API server, with `--source api`.
    api: Option<ApiFeed>,
    /// Which of `EXTRA_VIP4` the objects hold.
    extra: usize,
    /// Faults injected and how each ended.
    faults: FaultLog,
}

/// What the faults came to: per fault, how many, how many the maps converged after, the
/// slowest convergence; and the differences left where they did not.
#[derive(Default)]
struct FaultLog {
    by_fault: BTreeMap<Fault, (u64, u64, Duration)>,
    stale: Vec<String>,
    /// API errors and relists the agents killed so far counted.
    api_errors: u64,
    relists: u64,
}

/// Where the fault schedule is.
enum Phase {
    /// No fault on; the next is due at the schedule's time.
    Quiet,
    /// A lasting fault is on until `until`.
    On { fault: Fault, until: Duration },
    /// The fault is over: the maps must hold what the server holds by `deadline`.
    Converging {
        fault: Fault,
        since: Instant,
        deadline: Instant,
        next_check: Instant,
    },
}

/// This node as the API server has it: both families' addresses.
fn node_manifest() -> String {
    format!(
        "apiVersion: v1
kind: Node
metadata: {{name: {NODE_NAME}, labels: {{kubernetes.io/hostname: {NODE_NAME}}}}}
status:
  addresses:
  - {{type: InternalIP, address: {NODE4}}}
  - {{type: InternalIP, address: \"{NODE6}\"}}
"
    )
}

/// A Service without endpoints on `vip`, TCP 80.
fn extra_manifest(vip: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: extra-{}, namespace: default}}
spec:
  clusterIP: {vip}
  ports:
  - {{name: http, protocol: TCP, port: {TCP_PORT}, targetPort: {TCP_TARGET}}}
",
        vip.replace('.', "-")
    )
}

impl Soak {
    /// The objects as they should be now (name → YAML).
    fn files(&self) -> BTreeMap<&'static str, String> {
        let mut files = web_manifests(&members(self.web), None);
        files.insert("busy.yaml", busy_manifest(self.busy));
        if self.api.is_some() {
            files.insert("extra.yaml", extra_manifest(EXTRA_VIP4[self.extra]));
            // The node's own object, which a restore must keep too.
            files.insert("node.yaml", node_manifest());
        }
        files
    }

    fn frontends(&self) -> usize {
        FRONTENDS + usize::from(self.api.is_some())
    }

    /// What the pinned service map must hold: "frontend/PROTO" → its backends, sorted.
    fn expected_maps(&self) -> BTreeMap<String, Vec<String>> {
        let backends = |set: u8, addr: fn(usize) -> String, port: u16| -> Vec<String> {
            let mut v: Vec<String> = members(set)
                .into_iter()
                .map(|i| target(&addr(i), port))
                .collect();
            v.sort();
            v
        };
        let mut m = BTreeMap::new();
        for (vip, addr) in [
            (VIP4, Testbed::backend_ip4 as fn(usize) -> String),
            (VIP6, Testbed::backend_ip6),
        ] {
            m.insert(
                format!("{}/TCP", target(vip, TCP_PORT)),
                backends(self.web, addr, TCP_TARGET),
            );
            m.insert(
                format!("{}/UDP", target(vip, UDP_PORT)),
                backends(self.web, addr, UDP_TARGET),
            );
        }
        m.insert(format!("{}/TCP", target(EMPTY_VIP4, TCP_PORT)), Vec::new());
        for (port, to, proto) in [(TCP_PORT, TCP_TARGET, "TCP"), (UDP_PORT, UDP_TARGET, "UDP")] {
            m.insert(
                format!("{}/{proto}", target(BUSY_VIP4, port)),
                backends(self.busy, Testbed::backend_ip4, to),
            );
        }
        if self.api.is_some() {
            m.insert(
                format!("{}/TCP", target(EXTRA_VIP4[self.extra], TCP_PORT)),
                Vec::new(),
            );
        }
        m
    }

    /// How the pinned service map differs from what it must hold ("" when it does not).
    fn maps_differ(&self) -> Result<String> {
        let dump = self.tb.dump()?;
        let mut held = BTreeMap::new();
        for row in dump["services"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            let key = format!(
                "{}/{}",
                row["frontend"].as_str().unwrap_or(""),
                row["protocol"].as_str().unwrap_or("")
            );
            let mut backends: Vec<String> = row["backends"]
                .as_array()
                .map(|b| {
                    b.iter()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            backends.sort();
            held.insert(key, backends);
        }
        let expected = self.expected_maps();
        let mut diff = Vec::new();
        for (k, want) in &expected {
            match held.get(k) {
                None => diff.push(format!("{k} missing")),
                Some(got) if got != want => diff.push(format!("{k} has {got:?}, not {want:?}")),
                Some(_) => {}
            }
        }
        for k in held.keys().filter(|k| !expected.contains_key(*k)) {
            diff.push(format!("{k} stale"));
        }
        Ok(diff.join("; "))
    }

    /// Injects `fault` (each also swaps the extra Service, the change it must carry).
    fn inject(&mut self, fault: Fault) -> Result<()> {
        self.extra = (self.extra + 1) % EXTRA_VIP4.len();
        let files = self.files();
        let api = self.api.as_mut().context("faults need the API server")?;
        api.inject(fault);
        match fault {
            Fault::RestoreTooLarge => api.restore(&files, OldVersions::TooLarge)?,
            Fault::RestoreGone => api.restore(&files, OldVersions::Gone)?,
            _ => api.publish(&files)?,
        }
        eprintln!("t={:.1}s API fault: {}", t(Instant::now()), fault.name());
        Ok(())
    }

    fn write_endpoints(&mut self) -> Result<()> {
        let files = self.files();
        // Logged before it is published: the agent can act on a change (destroy a
        // socket, the client print its error, a reader judge it) before `publish` returns,
        // and a judge must never see the effect of a change the log does not hold yet.
        {
            let now = Instant::now();
            let mut m = self.membership.lock().unwrap_or_else(|e| e.into_inner());
            for (svc, set) in [("web", self.web), ("busy", self.busy)] {
                let log = m.0.entry(svc).or_default();
                if log.last().is_none_or(|(_, s)| *s != set) {
                    log.push((now, set));
                }
            }
        }
        match &mut self.api {
            Some(api) => api.publish(&files)?,
            None => self.tb.write_manifests(&files)?,
        }
        self.changes += 1;
        Ok(())
    }

    fn start_agent(&mut self) -> Result<()> {
        let args: Vec<&str> = self.agent_args.iter().map(String::as_str).collect();
        let frontends = self.frontends();
        self.tb
            .start_agent_with(Path_::ConnectTime, frontends, &args)?;
        // Up means serving: the metrics listener answers.
        let deadline = Instant::now() + Duration::from_secs(20);
        while http_get(&self.tb.node_ns(), "/metrics").is_err() {
            if Instant::now() > deadline {
                bail!(
                    "the agent's metrics never answered:\n{}",
                    self.tb.agent_log()
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    fn restart_agent(&mut self, fill: &mut Fill) -> Result<()> {
        if let Ok(text) = http_get(&self.tb.node_ns(), "/metrics") {
            fill.sample(&text);
            self.faults.api_errors += metric_sum(&text, "api_errors_total");
            self.faults.relists += metric_sum(&text, "api_relists_total");
        }
        fill.agent_gone();
        self.tb.kill_agent()?;
        // Only the end of each agent's log: a long run restarts it many times.
        let log = self.tb.agent_log();
        self.destroys.push_str(&destroy_lines(&log));
        let lines: Vec<&str> = log.lines().collect();
        for l in &lines[lines.len().saturating_sub(40)..] {
            self.old_logs.push_str(l);
            self.old_logs.push('\n');
        }
        self.start_agent()?;
        self.restarts += 1;
        eprintln!(
            "t={:.1}s agent killed (-9) and started again",
            t(Instant::now())
        );
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: single-threaded at this point; the harness reads it to find the agent.
    unsafe { std::env::set_var("PROXY_AGENT_BIN", &args.agent) };
    // The agents' log (they inherit it) also names each socket they destroy, which a
    // failure's timeline is read against.
    if std::env::var_os("RUST_LOG").is_none() {
        // SAFETY: single-threaded still.
        unsafe {
            std::env::set_var(
                "RUST_LOG",
                "info,proxy_ebpf=trace,proxy_agent::dataplane::bpf::sockets=debug",
            )
        };
    }
    test_support::require_root("the soak")?;
    // Ctrl-C and SIGTERM end the run early; the testbed is still removed on the way out.
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let run_for = Duration::from_secs_f64(args.minutes * 60.0);
    let tb = Testbed::new(3).context("building the testbed")?;
    tb.disable_offload()?;
    let config = tb.write_file(
        "kube-proxy.yaml",
        "kind: KubeProxyConfiguration\niptables:\n  masqueradeAll: true\n",
    )?;
    let api = match args.source {
        Source::Api => Some(ApiFeed::start_in(&PathBuf::from(format!(
            "/run/netns/{}",
            tb.node_ns()
        )))?),
        Source::Files => None,
    };
    let mut agent_args = vec![
        "--interfaces".to_string(),
        tb.node_interfaces().join(","),
        "--config".into(),
        config.to_string_lossy().into_owned(),
        "--node-ip".into(),
        NODE4.into(),
        "--node-ip".into(),
        NODE6.into(),
    ];
    if let Some(api) = &api {
        let kubeconfig = tb.write_file("kubeconfig", &api.kubeconfig())?;
        agent_args.extend([
            "--source".into(),
            "kube".into(),
            "--kubeconfig".into(),
            kubeconfig.to_string_lossy().into_owned(),
            "--node-name".into(),
            NODE_NAME.into(),
        ]);
    }
    let mut soak = Soak {
        tb,
        agent_args,
        membership: Arc::default(),
        web: 0b111,
        busy: 0b111,
        changes: 0,
        restarts: 0,
        old_logs: String::new(),
        destroys: String::new(),
        api,
        extra: 0,
        faults: FaultLog::default(),
    };
    soak.write_endpoints()?;
    soak.changes = 0;
    soak.start_agent()?;

    let t4 = target(VIP4, TCP_PORT);
    let t6 = target(VIP6, TCP_PORT);
    let u4 = target(VIP4, UDP_PORT);
    let u6 = target(VIP6, UDP_PORT);
    let bt = target(BUSY_VIP4, TCP_PORT);
    let bu = target(BUSY_VIP4, UDP_PORT);
    let forever = "1000000000";
    let short_tcp = ["--proto", "tcp", "--interval-ms", "25"];
    let dns = ["--proto", "udp", "--interval-ms", "50"];
    let keepalive = [
        "--proto",
        "tcp",
        "--reuse-socket",
        "--interval-ms",
        &KEEPALIVE_IDLE_MS.to_string(),
    ]
    .map(str::to_string);
    let connected = [
        "--proto",
        "udp-connected",
        "--reuse-socket",
        "--interval-ms",
        &UDP_IDLE_MS.to_string(),
    ]
    .map(str::to_string);
    let connected_busy = [
        "--proto",
        "udp-connected",
        "--reuse-socket",
        "--interval-ms",
        "1000",
    ];
    let own = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let plan: Vec<(Kind, &'static str, &String, Vec<String>)> = vec![
        (Kind::ShortTcp, "web", &t4, own(&short_tcp)),
        (Kind::ShortTcp, "web", &t6, own(&short_tcp)),
        (Kind::ShortTcp, "busy", &bt, own(&short_tcp)),
        (Kind::DnsUdp, "web", &u4, own(&dns)),
        (Kind::DnsUdp, "web", &u6, own(&dns)),
        (Kind::DnsUdp, "busy", &bu, own(&dns)),
        (Kind::KeepAliveTcp, "web", &t4, keepalive.to_vec()),
        (Kind::KeepAliveTcp, "web", &t4, keepalive.to_vec()),
        (Kind::KeepAliveTcp, "web", &t6, keepalive.to_vec()),
        (Kind::KeepAliveTcp, "web", &t6, keepalive.to_vec()),
        (Kind::ConnectedUdp, "web", &u4, connected.to_vec()),
        (Kind::ConnectedUdp, "web", &u6, connected.to_vec()),
        (Kind::ConnectedUdp, "busy", &bu, own(&connected_busy)),
    ];
    let mut workers: Vec<(Arc<Mutex<Worker>>, thread::JoinHandle<Background>)> = Vec::new();
    let client_ns = soak.tb.client_ns();
    BEGAN.get_or_init(Instant::now);
    let mut kill = Kill(Vec::new());
    for path in [Path_::ConnectTime, Path_::PerPacket] {
        for (kind, service, t, opts) in &plan {
            let mut argv = vec!["--target", t.as_str(), "--count", forever];
            argv.extend(["--timeout-ms", "3000"]);
            argv.extend(opts.iter().map(String::as_str));
            let child = match path {
                Path_::ConnectTime => soak.tb.spawn_client(&argv)?,
                Path_::PerPacket => soak.tb.spawn_client_in(&client_ns, &argv)?,
            };
            let worker = Arc::new(Mutex::new(Worker {
                path,
                kind: *kind,
                service,
                target: (*t).clone(),
                requests: 0,
                failures: BTreeMap::new(),
                expected: BTreeMap::new(),
                idle_cycles: 0,
                first_failures: Vec::new(),
            }));
            let pid = child.id();
            kill.0.push(pid);
            let (w, m) = (worker.clone(), soak.membership.clone());
            let reader = thread::spawn(move || {
                follow(&child, &w, &m);
                child
            });
            workers.push((worker, reader));
        }
    }
    eprintln!(
        "soak: testbed {} (namespaces {}, {}, ...): {} clients on both paths for {:.1} min; \
         endpoints change every {} s, the agent restarts every {} s{}",
        soak.tb.id,
        soak.tb.client_ns(),
        soak.tb.node_ns(),
        workers.len(),
        args.minutes,
        args.churn_secs,
        args.restart_secs,
        if soak.api.is_some() {
            format!(", an API-server fault every {} s", args.fault_secs)
        } else {
            String::new()
        }
    );

    let mut fill = Fill::default();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()));
    let start = *BEGAN.get_or_init(Instant::now);
    let churn = Duration::from_secs(args.churn_secs.max(1));
    let restart = Duration::from_secs(args.restart_secs.max(1));
    let (mut next_churn, mut next_restart, mut next_sample) =
        (churn, restart, Duration::from_secs(5));
    let fault_every = Duration::from_secs(args.fault_secs.max(1));
    let mut next_fault = fault_every / 2;
    let mut schedule = Fault::SCHEDULE.iter().copied().cycle();
    let mut phase = Phase::Quiet;
    let mut step = 0u64;
    let mut error = None;
    while start.elapsed() < run_for && !STOP.load(Ordering::SeqCst) {
        let now = start.elapsed();
        // While a fault is on or its convergence is awaited, no restart and no churn: what
        // reaches the maps then is the fault's own change, checked exactly; endpoint
        // changes the agent learned late would make losses the timeline cannot judge.
        let result = if soak.api.is_some() && !matches!(phase, Phase::Quiet) {
            step_fault(&mut soak, &mut phase, now)
        } else if soak.api.is_some() && now >= next_fault {
            next_fault = now + fault_every;
            let fault = schedule.next().unwrap_or(Fault::WatchDrop);
            soak.faults.by_fault.entry(fault).or_default().0 += 1;
            phase = Phase::On {
                fault,
                until: now + fault.lasts(),
            };
            soak.inject(fault)
        } else if now >= next_restart {
            next_restart += restart;
            soak.restart_agent(&mut fill)
        } else if now >= next_churn {
            next_churn += churn;
            step += 1;
            // The busy Service changes every step; the web Service, which the long-lived
            // flows use, every fourth (so an idle flow usually finds its backend still
            // there, and sometimes not).
            soak.busy = rng.subset(soak.busy);
            if step.is_multiple_of(4) {
                soak.web = rng.subset(soak.web);
            }
            if args.verbose {
                eprintln!(
                    "t={:.1}s endpoints: web {:?}, busy {:?}",
                    t(Instant::now()),
                    members(soak.web),
                    members(soak.busy)
                );
            }
            soak.write_endpoints()
        } else if now >= next_sample {
            next_sample += Duration::from_secs(5);
            if let Ok(text) = http_get(&soak.tb.node_ns(), "/metrics") {
                fill.sample(&text);
            }
            Ok(())
        } else {
            thread::sleep(Duration::from_millis(100));
            Ok(())
        };
        if let Err(e) = result {
            error = Some(e);
            break;
        }
    }
    // A fault still on ends here, and its convergence is awaited like the others'.
    if let Phase::On { fault, .. } = phase
        && let Some(api) = &mut soak.api
    {
        api.end(fault);
        phase = Phase::On {
            fault,
            until: Duration::ZERO,
        };
    }
    while error.is_none() && !matches!(phase, Phase::Quiet) && !STOP.load(Ordering::SeqCst) {
        if let Err(e) = step_fault(&mut soak, &mut phase, start.elapsed()) {
            error = Some(e);
        }
    }
    let ran = start.elapsed();
    // Nothing stale remains: the maps hold what the source holds, at the end as after
    // every fault.
    let final_diff = wait_converged(&soak, Instant::now() + Duration::from_secs(20));
    if let Ok(text) = http_get(&soak.tb.node_ns(), "/metrics") {
        fill.sample(&text);
    }
    let api_metrics = http_get(&soak.tb.node_ns(), "/metrics").unwrap_or_default();
    // Stop the clients; their readers end with their output.
    drop(kill);
    let mut results = Vec::new();
    for (worker, reader) in workers {
        let child = reader
            .join()
            .map_err(|_| anyhow::anyhow!("a reader panicked"))?;
        let _ = child.finish();
        results.push(
            Arc::try_unwrap(worker)
                .ok()
                .context("a reader still holds its worker")?
                .into_inner()
                .unwrap_or_else(|e| e.into_inner()),
        );
    }
    // Give sock_release a moment, then see what the kernel holds.
    thread::sleep(Duration::from_millis(500));
    let dump = soak.tb.dump()?;
    if let Some(e) = error {
        eprintln!("{}", soak.tb.agent_log());
        return Err(e);
    }
    let mut why = Vec::new();
    let mut failed = report(&soak, &results, &fill, &dump, ran, &mut why);
    failed += report_faults(&soak, &api_metrics, final_diff, &mut why);
    if STOP.load(Ordering::SeqCst) {
        bail!("interrupted after {:.0} s", ran.as_secs_f64());
    }
    if failed > 0 {
        let current = soak.tb.agent_log();
        eprintln!("\nThe agents' connected UDP socket destroys:");
        eprint!("{}{}", soak.destroys, destroy_lines(&current));
        let log = format!("{}{}", soak.old_logs, current);
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        eprintln!("\nThe agents' last log lines:");
        for l in tail.iter().rev() {
            eprintln!("{l}");
        }
        // Last, where a CI log's tail shows it: what failed.
        eprintln!("\nWhat failed:");
        for w in &why {
            eprintln!("  {w}");
        }
        bail!("{failed} failures");
    }
    Ok(())
}

/// An agent log's lines about connected UDP sockets destroyed (or not).
fn destroy_lines(log: &str) -> String {
    log.lines()
        .filter(|l| l.contains("connected UDP socket"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// A line of the table.
#[derive(Default)]
struct Row {
    clients: u64,
    requests: u64,
    failed: u64,
    expected: u64,
    idle: u64,
}

fn path_name(path: Path_) -> &'static str {
    match path {
        Path_::ConnectTime => "connect-time",
        Path_::PerPacket => "per-packet",
    }
}

/// Prints the tables; returns the number of failures.
fn report(
    soak: &Soak,
    results: &[Worker],
    fill: &Fill,
    dump: &serde_json::Value,
    ran: Duration,
    why: &mut Vec<String>,
) -> u64 {
    let mins = ran.as_secs() / 60;
    let secs = ran.as_secs() % 60;
    println!(
        "soak: {mins}m{secs:02}s on both paths at once (one agent: cgroup hooks + classifier, \
         masqueradeAll), {} endpoint changes, {} agent restarts (kill -9)\n",
        soak.changes, soak.restarts
    );
    println!(
        "{:<13} {:<30} {:<15} {:>9} {:>7} {:>8} {:>5}",
        "path", "clients", "target", "requests", "failed", "expected", "idle"
    );
    // One row per path, kind and target: the clients of a kind added up.
    let mut rows: BTreeMap<(&str, Kind, &str), Row> = BTreeMap::new();
    for w in results {
        let r = rows
            .entry((path_name(w.path), w.kind, w.target.as_str()))
            .or_default();
        r.clients += 1;
        r.requests += w.requests;
        r.failed += w.failed();
        r.expected += w.expected.values().sum::<u64>();
        r.idle += w.idle_cycles;
    }
    for ((path, kind, t), r) in &rows {
        let clients = if r.clients > 1 {
            format!("{} ×{}", kind.name(), r.clients)
        } else {
            kind.name().to_string()
        };
        let idle = if matches!(kind, Kind::KeepAliveTcp | Kind::ConnectedUdp) {
            r.idle.to_string()
        } else {
            "-".into()
        };
        println!(
            "{path:<13} {clients:<30} {t:<15} {:>9} {:>7} {:>8} {idle:>5}",
            r.requests, r.failed, r.expected
        );
    }
    let total: u64 = results.iter().map(|w| w.requests).sum();
    let mut failed: u64 = results.iter().map(Worker::failed).sum();
    println!(
        "{:<13} {:<30} {:<15} {total:>9} {failed:>7}",
        "total", "", ""
    );
    println!(
        "\nexpected: what the design says happens when a backend leaves. A connected UDP flow \
         moves to a live\nbackend (at connect time the agent destroys the socket: the client \
         sees one error); per packet\na UDP answer still on its way is lost with the flow, as \
         with kube-proxy's conntrack flush.\nidle: answers after an idle gap past the unanswered \
         timeout, on the same flow and backend."
    );

    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    for w in results {
        let path = path_name(w.path);
        for (k, n) in &w.failures {
            *kinds
                .entry(format!("{path} {} {}: {k}", w.kind.name(), w.target))
                .or_insert(0) += n;
        }
        for (k, n) in &w.expected {
            *expected
                .entry(format!("{path} {}: {k}", w.kind.name()))
                .or_insert(0) += n;
        }
    }
    println!(
        "\nfailures by kind:{}",
        if kinds.is_empty() { " none" } else { "" }
    );
    for (k, n) in &kinds {
        println!("  {k}  ×{n}");
        why.push(format!("requests: {k}  ×{n}"));
    }
    for w in results {
        why.extend(w.first_failures.iter().map(|l| format!("  {l}")));
    }
    println!(
        "expected events:{}",
        if expected.is_empty() { " none" } else { "" }
    );
    for (k, n) in &expected {
        println!("  {k}  ×{n}");
    }
    // A run too short for an idle gap would check nothing about the timeouts.
    if ran > Duration::from_millis(KEEPALIVE_IDLE_MS + 10_000) {
        for w in results
            .iter()
            .filter(|w| w.kind == Kind::KeepAliveTcp && w.idle_cycles == 0)
        {
            let line = format!(
                "{} {} {}: no answer after an idle gap",
                path_name(w.path),
                w.kind.name(),
                w.target
            );
            println!("  FAILED: {line}");
            why.push(line);
            failed += 1;
        }
    }

    println!(
        "\nconntrack (per packet), sampled every 5 s: answered-flow entries peak {} of {} \
         (at the end {}), new-flow entries peak {} of {} (at the end {}), {} entries collected",
        fill.answered_peak,
        fill.answered_capacity,
        fill.answered_last,
        fill.new_peak,
        fill.new_capacity,
        fill.new_last,
        fill.collected_before + fill.collected_now
    );
    let counters = &dump["counters"];
    if let Some(map) = counters.as_object() {
        println!("BPF counters (pinned: over every agent of the run):");
        let cells: Vec<String> = map.iter().map(|(k, v)| format!("{k} {v}")).collect();
        for row in cells.chunks(4) {
            let row: Vec<String> = row.iter().map(|c| format!("{c:<26}")).collect();
            println!("  {}", row.concat().trim_end());
        }
    }
    for name in MUST_STAY_ZERO {
        let v = counters[name].as_u64().unwrap_or(0);
        if v > 0 {
            println!("  FAILED: counter {name} = {v}");
            why.push(format!("counter {name} = {v}"));
            failed += 1;
        }
    }
    let sockets = dump["sockets"].as_u64().unwrap_or(0);
    println!(
        "connect-time socket state (SOCK_CONNECTED, SOCK_LB) once the clients stopped: {sockets} entries"
    );
    if sockets > 16 {
        println!("  FAILED: socket state outlives its sockets");
        why.push(format!(
            "socket state outlives its sockets: {sockets} entries"
        ));
        failed += 1;
    }
    failed
}

/// Moves the fault schedule on: ends a lasting fault when due, then checks the maps every
/// half second until they hold what the server holds or the deadline passes.
fn step_fault(soak: &mut Soak, phase: &mut Phase, now: Duration) -> Result<()> {
    match *phase {
        Phase::Quiet => {}
        Phase::On { fault, until } => {
            if now < until {
                thread::sleep(Duration::from_millis(100));
                return Ok(());
            }
            if let Some(api) = &mut soak.api {
                api.end(fault);
            }
            let since = Instant::now();
            *phase = Phase::Converging {
                fault,
                since,
                deadline: since + CONVERGE_WITHIN,
                next_check: since,
            };
        }
        Phase::Converging {
            fault,
            since,
            deadline,
            next_check,
        } => {
            let at = Instant::now();
            if at < next_check {
                thread::sleep(next_check - at);
                return Ok(());
            }
            let diff = soak.maps_differ()?;
            let entry = soak.faults.by_fault.entry(fault).or_default();
            if diff.is_empty() {
                entry.1 += 1;
                entry.2 = entry.2.max(since.elapsed());
                eprintln!(
                    "t={:.1}s the maps hold what the server holds, {:.1} s after the {}",
                    t(Instant::now()),
                    since.elapsed().as_secs_f64(),
                    fault.name()
                );
                *phase = Phase::Quiet;
            } else if at >= deadline {
                eprintln!(
                    "t={:.1}s FAILED stale maps {:.0} s after the {}: {diff}",
                    t(at),
                    CONVERGE_WITHIN.as_secs_f64(),
                    fault.name()
                );
                soak.faults
                    .stale
                    .push(format!("after the {}: {diff}", fault.name()));
                *phase = Phase::Quiet;
            } else if let Phase::Converging { next_check, .. } = phase {
                *next_check = at + Duration::from_millis(500);
            }
        }
    }
    Ok(())
}

/// Waits until the maps hold what the source holds; the difference left at `deadline`.
fn wait_converged(soak: &Soak, deadline: Instant) -> String {
    loop {
        let diff = soak
            .maps_differ()
            .unwrap_or_else(|e| format!("dump failed: {e:#}"));
        if diff.is_empty() || Instant::now() >= deadline {
            return diff;
        }
        thread::sleep(Duration::from_millis(500));
    }
}

/// The sum of every series of `proxy_agent_<name>` (any labels).
fn metric_sum(text: &str, name: &str) -> u64 {
    let full = format!("proxy_agent_{name}");
    text.lines()
        .filter(|l| {
            l.strip_prefix(&full)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Prints the faults and the final check; returns the failures among them.
fn report_faults(soak: &Soak, metrics: &str, final_diff: String, why: &mut Vec<String>) -> u64 {
    let mut failed = 0;
    if let Some(api) = &soak.api {
        let injected: u64 = soak.faults.by_fault.values().map(|f| f.0).sum();
        println!("\nAPI-server faults injected: {injected}");
        println!(
            "  {:<30} {:>8} {:>10} {:>14}",
            "fault", "injected", "converged", "slowest (s)"
        );
        for (fault, (n, ok, slowest)) in &soak.faults.by_fault {
            println!(
                "  {:<30} {n:>8} {ok:>10} {:>14.1}",
                fault.name(),
                slowest.as_secs_f64()
            );
        }
        let s = &api.server;
        let lists: u64 = ["services", "endpointslices", "nodes"]
            .iter()
            .map(|r| s.lists_served(r))
            .sum();
        let codes = |code: u16| -> usize {
            ["services", "endpointslices", "nodes"]
                .iter()
                .map(|r| s.served(r).iter().filter(|x| x.code == code).count())
                .sum()
        };
        println!(
            "  the server served {lists} lists and answered {} requests 504 (RV too large) and \
             {} 410; the agents counted {} API errors and {} relists",
            codes(504),
            codes(410),
            soak.faults.api_errors + metric_sum(metrics, "api_errors_total"),
            soak.faults.relists + metric_sum(metrics, "api_relists_total"),
        );
        for stale in &soak.faults.stale {
            println!("  FAILED: stale maps {stale}");
            why.push(format!("stale maps {stale}"));
            failed += 1;
        }
    }
    if final_diff.is_empty() {
        println!("at the end the maps hold exactly what the source holds");
    } else {
        println!("  FAILED: at the end the maps differ from the source: {final_diff}");
        why.push(format!(
            "at the end the maps differ from the source: {final_diff}"
        ));
        failed += 1;
    }
    failed
}
