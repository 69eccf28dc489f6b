//! `cargo xtask bench`'s fan-out figures: one `proxy-agent serve` hub and gRPC server (a
//! child process, so its CPU and RSS are its own) and N light clients in this process,
//! each a node that decodes its stream and notes when each EndpointSlice change (by its
//! trigger time) arrived. The server changes `--changes-per-s` slices of its
//! `--services` × 10-endpoint model for `--seconds`; reported: p50/p99 from trigger to
//! the last node holding it, server CPU (share of one core) and RSS, bytes per change
//! per node. Loopback only.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    net::IpAddr,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use prost::Message as _;
use proxy_agent::{
    fanout::{Hub, HubOptions, grpc},
    model::{
        ObjectRef, Protocol,
        objects::{EndpointInfo, PortInfo, ServiceInfo, SliceInfo, SlicePort, TargetPort},
    },
    source::Snapshot,
    wire::v1,
};

#[derive(Parser)]
struct Args {
    /// Run as the server (internal).
    #[arg(long, hide = true)]
    serve: bool,
    #[arg(long, default_value_t = 1000)]
    services: usize,
    #[arg(long, default_value_t = 100)]
    nodes: usize,
    #[arg(long, default_value_t = 100)]
    changes_per_s: u32,
    #[arg(long, default_value_t = 10)]
    seconds: u32,
    /// The small form (`cargo xtask bench --quick`).
    #[arg(long)]
    quick: bool,
    /// Where fanout.json goes.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    if a.quick {
        (a.services, a.nodes, a.changes_per_s, a.seconds) = (1000, 100, 50, 5);
    }
    let rt = tokio::runtime::Runtime::new()?;
    if a.serve {
        return rt.block_on(serve(a));
    }
    rt.block_on(drive(a))
}

fn ip(i: usize, base: u8) -> IpAddr {
    IpAddr::from([base, (i >> 16) as u8, (i >> 8) as u8, i as u8])
}

fn slice(i: usize, round: usize, nodes: usize, trigger: Option<SystemTime>) -> SliceInfo {
    SliceInfo {
        service: Some(format!("s{i}")),
        ipv4: Some(true),
        ports: vec![SlicePort {
            name: String::new(),
            protocol: Some(Protocol::Tcp),
            port: Some(8080),
        }],
        endpoints: (0..10)
            .map(|e| EndpointInfo {
                ip: ip(i * 16 + (e + round) % 16, 10),
                ready: true,
                serving: true,
                terminating: false,
                node: Some(proxy_agent::model::objects::intern(&format!(
                    "n{}",
                    (i + e) % nodes
                ))),
                hints: None,
            })
            .collect(),
        bad_addresses: Vec::new(),
        trigger_time: trigger,
    }
}

async fn serve(a: Args) -> Result<()> {
    let hub = Hub::new(HubOptions::default());
    let mut snap = Snapshot::default();
    let r = |name: String| ObjectRef {
        namespace: "bench".into(),
        name,
    };
    for i in 0..a.services {
        let svc = ServiceInfo {
            cluster_ips: vec![ip(i, 172)],
            ports: vec![PortInfo {
                name: String::new(),
                display: "80".into(),
                port: Ok((80, Protocol::Tcp)),
                node_port: None,
                target_port: TargetPort::Number(8080),
            }],
            ..Default::default()
        };
        snap.model.insert_service(r(format!("s{i}")), svc);
        snap.model
            .insert_slice(r(format!("e{i}")), slice(i, 0, a.nodes, None));
    }
    hub.publish(&snap);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("PORT {}", listener.local_addr()?.port());
    let feed = grpc::Feed::new(Arc::clone(&hub), grpc::Identity::Insecure);
    tokio::spawn(grpc::serve(listener, feed, None));
    // Changes start when the driver says every node has its snapshot.
    let mut line = String::new();
    let stdin = std::io::stdin();
    tokio::task::block_in_place(|| stdin.lock().read_line(&mut line))?;
    let total = a.changes_per_s * a.seconds;
    let start = tokio::time::Instant::now();
    for c in 0..total as usize {
        tokio::time::sleep_until(
            start + Duration::from_secs_f64(c as f64 / f64::from(a.changes_per_s)),
        )
        .await;
        let i = c * 7919 % a.services;
        snap.model.insert_slice(
            r(format!("e{i}")),
            slice(i, c + 1, a.nodes, Some(SystemTime::now())),
        );
        hub.publish(&snap);
    }
    println!("DONE");
    tokio::task::block_in_place(|| stdin.lock().read_line(&mut line))?;
    Ok(())
}

/// utime + stime of a process, in seconds, and its RSS in MiB.
fn usage(pid: u32) -> Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').context("stat")?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0);
    Ok((ticks / 100.0, rss / 1024))
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
                let t = SystemTime::UNIX_EPOCH + Duration::from_nanos(t as u64);
                let e = s.arrivals.entry(t).or_insert((now, 0));
                e.0 = e.0.max(now);
                e.1 += 1;
            }
        }
    }
    Ok(())
}

#[derive(Default)]
struct Seen {
    /// trigger time → latest arrival at any node (and how many nodes had it).
    arrivals: BTreeMap<SystemTime, (SystemTime, usize)>,
    bytes_after_snapshot: usize,
    snapshots: usize,
}

async fn drive(a: Args) -> Result<()> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--serve", "--services", &a.services.to_string()])
        .args(["--nodes", &a.nodes.to_string()])
        .args(["--changes-per-s", &a.changes_per_s.to_string()])
        .args(["--seconds", &a.seconds.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the server")?;
    let pid = child.id();
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .strip_prefix("PORT ")
        .context("no port")?
        .parse()?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(a.nodes);
    // In waves, as nodes come up over a rollout (the server streams each snapshot in
    // parts from shared bytes, so a wave costs it its parts in flight, not copies).
    const WAVE: usize = 100;
    for n in 0..a.nodes {
        if n >= WAVE && n % WAVE == 0 {
            for _ in 0..WAVE {
                ready_rx.recv().await.context("a node got no snapshot")?;
            }
        }
        let seen = Arc::clone(&seen);
        let ready = ready_tx.clone();
        tokio::spawn(async move {
            if let Err(e) = light_node(port, n, seen, ready).await {
                eprintln!("node n{n}: {e:#}");
            }
        });
    }
    let waited = a.nodes.saturating_sub(1) / WAVE * WAVE;
    for _ in waited..a.nodes {
        ready_rx.recv().await.context("a node got no snapshot")?;
    }
    let mut stdin = child.stdin.take().context("stdin")?;
    let (cpu0, _) = usage(pid)?;
    let t0 = Instant::now();
    writeln!(stdin, "GO")?;
    let mut rss_max = 0;
    let reader = tokio::task::spawn_blocking(move || {
        let mut l = String::new();
        let _ = out.read_line(&mut l);
        l
    });
    tokio::pin!(reader);
    loop {
        tokio::select! {
            done = &mut reader => { done?; break; }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                rss_max = rss_max.max(usage(pid)?.1);
            }
        }
    }
    let (cpu1, rss) = usage(pid)?;
    let wall = t0.elapsed().as_secs_f64();
    // Let the last changes arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = writeln!(stdin, "END");
    let _ = child.wait();
    let s = seen.lock().unwrap_or_else(|p| p.into_inner());
    let total = (a.changes_per_s * a.seconds) as usize;
    let complete: Vec<f64> = s
        .arrivals
        .iter()
        .filter(|(_, (_, n))| *n == a.nodes)
        .map(|(t, (last, _))| last.duration_since(*t).unwrap_or_default().as_secs_f64() * 1e3)
        .collect();
    if complete.len() < total {
        bail!(
            "{} of {total} changes reached every node ({} snapshots)",
            complete.len(),
            s.snapshots
        );
    }
    let mut sorted = complete.clone();
    sorted.sort_by(f64::total_cmp);
    let pct = |p: f64| sorted[((sorted.len() - 1) as f64 * p) as usize];
    let bytes = s.bytes_after_snapshot as f64 / (total * a.nodes) as f64;
    let cpu = (cpu1 - cpu0) / wall * 100.0;
    println!(
        "fan-out: {} Services x 10 endpoints, {} nodes, {} changes/s for {} s\n\
         trigger -> every node: p50 {:.1} ms, p99 {:.1} ms; server CPU {cpu:.1}% of a core, \
         RSS {rss} MiB (max {}); {bytes:.0} bytes per change per node",
        a.services,
        a.nodes,
        a.changes_per_s,
        a.seconds,
        pct(0.5),
        pct(0.99),
        rss_max.max(rss)
    );
    if let Some(dir) = a.out {
        std::fs::create_dir_all(&dir)?;
        let json = serde_json::json!({
            "services": a.services, "nodes": a.nodes, "changes_per_s": a.changes_per_s,
            "seconds": a.seconds, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "server_cpu_percent": cpu, "server_rss_mib": rss_max.max(rss),
            "bytes_per_change_per_node": bytes,
        });
        std::fs::write(
            dir.join("fanout.json"),
            serde_json::to_string_pretty(&json)?,
        )?;
    }
    Ok(())
}
