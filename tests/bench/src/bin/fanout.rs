//! `cargo xtask bench`'s fan-out figures, both sides of KPNG's split against one fake API
//! server holding N Services × 10-endpoint slices, changed at a steady rate:
//!
//! - **fan-out**: the release `proxy-agent serve --source kube` (a child process: its CPU
//!   and RSS are its own) watches the API server and feeds `--nodes` light nodes in this
//!   process (tonic clients that read the stream as the server writes it, leave a
//!   snapshot's parts undecoded, and note when each EndpointSlice change, by its trigger
//!   time, arrived). Reported: p50/p99 from trigger time to the last node holding it,
//!   server CPU (share of one core) and RSS, bytes per change per node, and the watches
//!   the API server served.
//! - **direct**: the same churn with `--nodes` direct watchers, as every agent watches in
//!   the DaemonSet's default mode (Services, EndpointSlices, its Node): the API server's
//!   watches per kind and the bytes of EndpointSlice events per change per node.
//!
//! Loopback only.

use std::{
    collections::BTreeMap,
    fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use prost::Message as _;
use proxy_agent::feed::{server::grpc, wire::v1};
use proxy_bench::churn::{cpu_seconds, free_port, http_get, memory_mib};
use proxy_testbed::fake_apiserver::{FakeApiServer, Options, Population};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

#[derive(Parser)]
struct Args {
    /// The agent binary (a release build: these are its figures).
    #[arg(long, default_value = "target/release/proxy-agent")]
    agent: PathBuf,
    #[arg(long, default_value_t = 1000)]
    services: usize,
    #[arg(long, default_value_t = 100)]
    nodes: usize,
    #[arg(long, default_value_t = 100)]
    changes_per_s: u32,
    #[arg(long, default_value_t = 10)]
    seconds: u32,
    /// The server's batch window (`serve --batch-window-ms`).
    #[arg(long, default_value_t = grpc::BATCH_WINDOW.as_millis() as u64)]
    batch_window_ms: u64,
    /// Churn windows of `--seconds` each, on the same server and nodes (medians reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Leave out the direct watchers' side.
    #[arg(long)]
    no_direct: bool,
    /// The small form (`cargo xtask bench --quick`).
    #[arg(long)]
    quick: bool,
    /// Where fanout-<services>.json goes.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    if a.quick {
        (a.services, a.nodes, a.changes_per_s, a.seconds) = (1000, 100, 50, 5);
    }
    tokio::runtime::Runtime::new()?.block_on(drive(a))
}

/// Set when the driver ends the server: errors after it are the run's end.
static ENDED: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
struct Seen {
    /// trigger time (ns) → latest arrival at any node, and how many nodes had it.
    arrivals: BTreeMap<i64, (SystemTime, usize)>,
    bytes_after_snapshot: usize,
    snapshots: usize,
}

/// One light node: its stream read as the server writes it (`EncodedBatch`, the same
/// bytes as `Batch`, its ops kept as slices of the received buffer), a snapshot's parts
/// counted and dropped undecoded, every later op decoded for its trigger time.
async fn light_node(
    port: u16,
    n: usize,
    seen: Arc<Mutex<Seen>>,
    ready: tokio::sync::mpsc::Sender<()>,
) -> Result<()> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
        .connect()
        .await
        .context("connect")?;
    let mut grpc = tonic::client::Grpc::new(ch).max_decoding_message_size(usize::MAX);
    grpc.ready().await.context("ready")?;
    let codec = tonic_prost::ProstCodec::<v1::WatchRequest, v1::EncodedBatch>::default();
    let path = http::uri::PathAndQuery::from_static("/proxy.nodeview.v1.NodeFeed/Watch");
    let req = v1::WatchRequest {
        node_name: format!("n{n}"),
        accepts_parts: true,
        ..Default::default()
    };
    let mut stream = grpc
        .server_streaming(tonic::Request::new(req), path, codec)
        .await
        .context("watch")?
        .into_inner();
    while let Some(batch) = stream.message().await? {
        let now = SystemTime::now();
        let mut s = seen.lock().unwrap_or_else(|p| p.into_inner());
        if batch.snapshot {
            if !batch.continued {
                s.snapshots += 1;
                let _ = ready.try_send(());
            }
            continue;
        }
        s.bytes_after_snapshot += batch.encoded_len();
        for op in &batch.ops {
            if let Ok(v1::Op {
                op: Some(v1::op::Op::SetSlice(sl)),
            }) = v1::Op::decode(op.clone())
                && let Some(t) = sl.trigger_time_unix_nanos
            {
                let e = s.arrivals.entry(t).or_insert((now, 0));
                e.0 = e.0.max(now);
                e.1 += 1;
            }
        }
    }
    Ok(())
}

/// `proxy-agent serve` against the fake API server, killed on drop.
struct Server {
    child: Child,
    dir: PathBuf,
    feed_port: u16,
    metrics: String,
}

impl Server {
    fn start(a: &Args, api: &FakeApiServer) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("fanout-bench-{}", std::process::id()));
        fs::create_dir_all(&dir)?;
        let kubeconfig = dir.join("kubeconfig");
        fs::write(&kubeconfig, api.kubeconfig())?;
        let feed_port = free_port()?;
        let metrics = format!("127.0.0.1:{}", free_port()?);
        let log = fs::File::create(dir.join("serve.log"))?;
        let child = Command::new(&a.agent)
            .args(["serve", "--source", "kube", "--insecure"])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--listen", &format!("127.0.0.1:{feed_port}")])
            .args(["--metrics-address", &metrics])
            .args(["--batch-window-ms", &a.batch_window_ms.to_string()])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} serve", a.agent.display()))?;
        Ok(Self {
            child,
            dir,
            feed_port,
            metrics,
        })
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("serve.log")).unwrap_or_default()
    }

    /// Waits for `/healthz` (the first full list in the hub).
    async fn ready(&mut self, within: Duration) -> Result<Duration> {
        let t = Instant::now();
        while http_get(&self.metrics, "/healthz").await.is_err() {
            if let Some(status) = self.child.try_wait()? {
                bail!("serve exited ({status}):\n{}", self.log());
            }
            if t.elapsed() > within {
                bail!("serve not ready in {within:?}:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(t.elapsed())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Makes `changes_per_s` changes for `seconds`; samples `pid`'s RSS meanwhile.
/// Returns the changes' trigger times (ns), CPU seconds and the largest RSS (MiB).
async fn churn(
    a: &Args,
    api: &FakeApiServer,
    population: &mut Population,
    pid: Option<u32>,
) -> Result<(Vec<i64>, f64, f64, f64)> {
    let total = (a.changes_per_s * a.seconds) as usize;
    let cpu0 = pid.map(cpu_seconds).transpose()?.unwrap_or(0.0);
    let start = tokio::time::Instant::now();
    let mut triggers = Vec::with_capacity(total);
    let mut rss_max = 0.0f64;
    for c in 0..total {
        tokio::time::sleep_until(
            start + Duration::from_secs_f64(c as f64 / f64::from(a.changes_per_s)),
        )
        .await;
        let change = population.change(api);
        // The annotation holds microseconds: the trigger as the wire carries it.
        let micros = change
            .trigger
            .duration_since(SystemTime::UNIX_EPOCH)?
            .as_micros() as i64;
        triggers.push(micros * 1000);
        if c % 20 == 0
            && let Some(pid) = pid
        {
            rss_max = rss_max.max(memory_mib(pid)?.0);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = pid.map(cpu_seconds).transpose()?.unwrap_or(0.0) - cpu0;
    Ok((triggers, cpu, wall, rss_max))
}

/// One churn window's figures.
struct Round {
    p50_ms: f64,
    p99_ms: f64,
    cpu_percent: f64,
    /// This process's: the nodes' clients and the fake API server, on the same cores.
    driver_cpu_percent: f64,
    bytes_per_change_per_node: f64,
}

struct FanOut {
    /// Churn windows one after another on the same connected nodes.
    rounds: Vec<Round>,
    rss_mib: f64,
    ready_s: f64,
    snapshots_s: f64,
    api_watches: BTreeMap<String, u64>,
}

const RESOURCES: [&str; 3] = ["services", "endpointslices", "nodes"];

async fn fan_out(a: &Args, api: &FakeApiServer, population: &mut Population) -> Result<FanOut> {
    let watches_before: Vec<u64> = RESOURCES.iter().map(|r| api.watches_served(r)).collect();
    let mut server = Server::start(a, api)?;
    let pid = server.child.id();
    let ready = server.ready(Duration::from_secs(600)).await?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(a.nodes);
    // In waves, as nodes come up over a rollout.
    const WAVE: usize = 100;
    let t = Instant::now();
    for n in 0..a.nodes {
        if n >= WAVE && n % WAVE == 0 {
            for _ in 0..WAVE {
                ready_rx.recv().await.context("a node got no snapshot")?;
            }
        }
        let seen = Arc::clone(&seen);
        let ready = ready_tx.clone();
        let port = server.feed_port;
        tokio::spawn(async move {
            if let Err(e) = light_node(port, n, seen, ready).await
                && !ENDED.load(Ordering::Relaxed)
            {
                eprintln!("node n{n}: {e:#}");
            }
        });
    }
    let waited = a.nodes.saturating_sub(1) / WAVE * WAVE;
    for _ in waited..a.nodes {
        ready_rx.recv().await.context("a node got no snapshot")?;
    }
    let snapshots = t.elapsed();
    let mut rounds = Vec::new();
    let mut rss = 0.0f64;
    for _ in 0..a.rounds.max(1) {
        let bytes_before = seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .bytes_after_snapshot;
        let own_before = cpu_seconds(std::process::id())?;
        let (triggers, cpu, wall, rss_max) = churn(a, api, population, Some(pid)).await?;
        let own = cpu_seconds(std::process::id())? - own_before;
        // Let the last changes arrive.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        rss = rss.max(memory_mib(pid)?.0).max(rss_max);
        let s = seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut complete: Vec<f64> = triggers
            .iter()
            .filter_map(|t| {
                let (last, n) = s.arrivals.get(t)?;
                let sent = SystemTime::UNIX_EPOCH + Duration::from_nanos(*t as u64);
                (*n == a.nodes)
                    .then(|| last.duration_since(sent).unwrap_or_default().as_secs_f64() * 1e3)
            })
            .collect();
        if complete.len() < triggers.len() {
            bail!(
                "{} of {} changes reached every node ({} snapshots)",
                complete.len(),
                triggers.len(),
                s.snapshots
            );
        }
        complete.sort_by(f64::total_cmp);
        let pct = |p: f64| complete[((complete.len() - 1) as f64 * p) as usize];
        let round = Round {
            p50_ms: pct(0.5),
            p99_ms: pct(0.99),
            cpu_percent: cpu / wall * 100.0,
            driver_cpu_percent: own / wall * 100.0,
            bytes_per_change_per_node: (s.bytes_after_snapshot - bytes_before) as f64
                / (triggers.len() * a.nodes) as f64,
        };
        println!(
            "  round {}: p50 {:.1} ms, p99 {:.1} ms, server CPU {:.1}% (nodes and API server {:.1}%), {:.0} bytes per change per node",
            rounds.len() + 1,
            round.p50_ms,
            round.p99_ms,
            round.cpu_percent,
            round.driver_cpu_percent,
            round.bytes_per_change_per_node
        );
        rounds.push(round);
    }
    ENDED.store(true, Ordering::Relaxed);
    drop(server);
    Ok(FanOut {
        rounds,
        rss_mib: rss,
        ready_s: ready.as_secs_f64(),
        snapshots_s: snapshots.as_secs_f64(),
        api_watches: RESOURCES
            .iter()
            .zip(watches_before)
            .map(|(r, before)| (r.to_string(), api.watches_served(r) - before))
            .collect(),
    })
}

/// The median of `f` over `rounds` and its range.
fn spread(rounds: &[Round], f: impl Fn(&Round) -> f64) -> (f64, f64, f64) {
    let mut v: Vec<f64> = rounds.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// A watch as an agent in direct mode holds it, from `rv`, its bytes counted.
async fn raw_watch(addr: String, path: String, bytes: Arc<AtomicU64>) -> Result<()> {
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
}

struct Direct {
    api_watches: BTreeMap<String, u64>,
    slice_bytes_per_change_per_node: f64,
}

async fn direct(a: &Args, api: &FakeApiServer, population: &mut Population) -> Result<Direct> {
    let addr = api.addr.to_string();
    let list = http_get(&addr, "/api/v1/services?limit=1").await?;
    let list: serde_json::Value = serde_json::from_str(&list)?;
    let rv = list["metadata"]["resourceVersion"]
        .as_str()
        .context("no resourceVersion")?
        .to_string();
    let before: Vec<u64> = RESOURCES.iter().map(|r| api.watches_served(r)).collect();
    let slice_bytes = Arc::new(AtomicU64::new(0));
    let other_bytes = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for n in 0..a.nodes {
        for (path, bytes) in [
            (
                format!(
                    "/api/v1/services?watch=true&resourceVersion={rv}&allowWatchBookmarks=true"
                ),
                &other_bytes,
            ),
            (
                format!(
                    "/apis/discovery.k8s.io/v1/endpointslices?watch=true&resourceVersion={rv}&allowWatchBookmarks=true"
                ),
                &slice_bytes,
            ),
            (
                format!(
                    "/api/v1/nodes?watch=true&resourceVersion={rv}&fieldSelector=metadata.name%3Dn{n}"
                ),
                &other_bytes,
            ),
        ] {
            tasks.push(tokio::spawn(raw_watch(
                addr.clone(),
                path,
                Arc::clone(bytes),
            )));
        }
    }
    let t = Instant::now();
    while RESOURCES
        .iter()
        .zip(&before)
        .any(|(r, b)| api.watches_served(r) - b < a.nodes as u64)
    {
        if t.elapsed() > Duration::from_secs(60) {
            bail!("the direct watchers did not all start");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let start_bytes = slice_bytes.load(Ordering::Relaxed);
    let (triggers, ..) = churn(a, api, population, None).await?;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let sent = slice_bytes.load(Ordering::Relaxed) - start_bytes;
    for t in tasks {
        t.abort();
    }
    Ok(Direct {
        api_watches: RESOURCES
            .iter()
            .zip(before)
            .map(|(r, b)| (r.to_string(), api.watches_served(r) - b))
            .collect(),
        slice_bytes_per_change_per_node: sent as f64 / (triggers.len() * a.nodes) as f64,
    })
}

async fn drive(a: Args) -> Result<()> {
    let api = FakeApiServer::try_start(Options {
        bookmark_every: Some(Duration::from_secs(60)),
    })
    .await?;
    let loadavg = fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string();
    let mut population = Population::new(a.services, 10);
    population.load(&api);
    let f = fan_out(&a, &api, &mut population).await?;
    let p50 = spread(&f.rounds, |r| r.p50_ms);
    let p99 = spread(&f.rounds, |r| r.p99_ms);
    let cpu = spread(&f.rounds, |r| r.cpu_percent);
    let bytes = spread(&f.rounds, |r| r.bytes_per_change_per_node);
    let driver = spread(&f.rounds, |r| r.driver_cpu_percent);
    println!(
        "fan-out: {} Services x 10 endpoints, {} nodes, {} changes/s, {} rounds of {} s (batch window {} ms), load {}\n\
         serve ready {:.1} s after start, every node's snapshot {:.1} s later\n\
         trigger -> every node (medians, range): p50 {:.1} ms ({:.1}-{:.1}), p99 {:.1} ms ({:.1}-{:.1}); \
         server CPU {:.1}% of a core ({:.1}-{:.1}), RSS {:.0} MiB; {:.0} bytes per change per node; \
         API server watches {:?}; the nodes' clients and the API server beside it {:.0}% of a core",
        a.services,
        a.nodes,
        a.changes_per_s,
        f.rounds.len(),
        a.seconds,
        a.batch_window_ms,
        loadavg,
        f.ready_s,
        f.snapshots_s,
        p50.0,
        p50.1,
        p50.2,
        p99.0,
        p99.1,
        p99.2,
        cpu.0,
        cpu.1,
        cpu.2,
        f.rss_mib,
        bytes.0,
        f.api_watches,
        driver.0,
    );
    let d = if a.no_direct {
        None
    } else {
        let d = direct(&a, &api, &mut population).await?;
        println!(
            "direct: {} watchers: API server watches {:?}; {:.0} bytes of EndpointSlice events \
             per change per node ({:.1}x the fan-out's)",
            a.nodes,
            d.api_watches,
            d.slice_bytes_per_change_per_node,
            d.slice_bytes_per_change_per_node / bytes.0
        );
        Some(d)
    };
    api.shutdown();
    if let Some(dir) = a.out {
        fs::create_dir_all(&dir)?;
        let json = serde_json::json!({
            "services": a.services, "nodes": a.nodes, "changes_per_s": a.changes_per_s,
            "seconds": a.seconds, "batch_window_ms": a.batch_window_ms,
            "rounds": f.rounds.len(), "loadavg": loadavg,
            "p50_ms": p50.0, "p50_ms_range": [p50.1, p50.2],
            "p99_ms": p99.0, "p99_ms_range": [p99.1, p99.2],
            "server_cpu_percent": cpu.0, "server_cpu_percent_range": [cpu.1, cpu.2],
            "server_rss_mib": f.rss_mib,
            "nodes_and_api_server_cpu_percent": driver.0,
            "bytes_per_change_per_node": bytes.0,
            "serve_ready_s": f.ready_s, "snapshots_s": f.snapshots_s,
            "api_watches_fanout": f.api_watches,
            "api_watches_direct": d.as_ref().map(|d| &d.api_watches),
            "direct_slice_bytes_per_change_per_node": d.as_ref().map(|d| d.slice_bytes_per_change_per_node),
        });
        fs::write(
            dir.join(format!("fanout-{}.json", a.services)),
            serde_json::to_string_pretty(&json)?,
        )?;
    }
    Ok(())
}
