//! Control-plane scale: builds the node view for 10k Services × 10 endpoints, programs it
//! into private BPF maps (as root), then changes one endpoint and measures the rebuild and
//! the minimal diff. Prints times and the process's memory. Not a test: figures only.
//!
//! `cargo xtask bench` runs it; `cargo bench -p proxy-agent --bench node_view -- 1000`
//! picks another size.

use std::time::Instant;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_agent::{
    dataplane::{Dataplane, bpf},
    model::{ClusterModel, NodeInfo, ViewConfig, ViewTracker, compact, node_view},
};
use serde_json::json;

/// Counts the bytes live on the heap, to tell what the data holds from what the
/// allocator keeps (RSS). Over jemalloc, the agent's allocator.
struct Counting;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

// SAFETY: every call is forwarded to jemalloc unchanged; only a counter is added.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the caller's contract is jemalloc's.
        unsafe { tikv_jemallocator::Jemalloc.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        LIVE.fetch_sub(l.size(), std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the caller's contract is jemalloc's.
        unsafe { tikv_jemallocator::Jemalloc.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live_mib() -> f64 {
    LIVE.load(std::sync::atomic::Ordering::Relaxed) as f64 / (1 << 20) as f64
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Service `i`'s EndpointSlice; `moved` replaces its first endpoint's address.
fn slice(i: usize, endpoints: usize, moved: Option<&str>) -> EndpointSlice {
    let eps: Vec<_> = (0..endpoints)
        .map(|e| {
            let addr = match (e, moved) {
                (0, Some(a)) => a.to_string(),
                // 10.128.0.0/9: room for 2^20 Services per endpoint index.
                _ => std::net::Ipv4Addr::from(0x0a80_0000 + ((e as u32) << 20) + i as u32)
                    .to_string(),
            };
            json!({"addresses": [addr], "conditions": {"ready": true}, "nodeName": format!("node-{e}")})
        })
        .collect();
    serde_json::from_value(
        json!({"metadata": {"name": format!("svc-{i}-1"), "namespace": "bench",
        "labels": {"kubernetes.io/service-name": format!("svc-{i}")}}, "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": eps}),
    )
    .expect("slice")
}

/// Objects a partial snapshot takes in at once while the first lists arrive (at 100k the
/// kube source's 250 ms batches held a few thousand of each kind).
const BATCH: usize = 5_000;

/// The model as the kube source builds it from its first lists: sorted by name, as the
/// API server lists them, a batch at a time, each in a spread order (`model::compact`).
fn model(services: usize, endpoints: usize) -> ClusterModel {
    let mut m = ClusterModel::default();
    let mut order: Vec<usize> = (0..services).collect();
    order.sort_by_cached_key(|i| format!("svc-{i}"));
    for batch in order.chunks(BATCH) {
        let items: Vec<(Service, EndpointSlice)> = batch
            .iter()
            .map(|&i| {
                let name = format!("svc-{i}");
                // 10.96.0.0/12, one ClusterIP each (a million of them fit).
                let ip = std::net::Ipv4Addr::from(0x0a60_0001 + i as u32).to_string();
                let svc: Service = serde_json::from_value(json!({"metadata": {"name": name, "namespace": "bench"},
                    "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}))
                .expect("service");
                (svc, slice(i, endpoints, None))
            })
            .collect();
        compact::in_spread_order(items, |(svc, slice)| {
            m.add_service(&svc);
            m.add_slice(&slice);
        });
    }
    m
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    // Positional: Services [10,000], then endpoints per Service [10].
    let mut numbers = std::env::args().skip(1).filter_map(|a| a.parse().ok());
    let services: usize = numbers.next().unwrap_or(10_000);
    let endpoints: usize = numbers.next().unwrap_or(10);
    let node = NodeInfo {
        name: "node-0".into(),
        ..Default::default()
    };
    let cfg = ViewConfig::default();
    let rss0 = rss_kib();
    let t = Instant::now();
    let mut m = model(services, endpoints);
    let t_model = ms(t);
    let rss_model = rss_kib();
    let live_model = live_mib();

    let t = Instant::now();
    let mut tracker = ViewTracker::new(node.clone(), cfg.clone());
    tracker.rebuild(&m);
    // As the runner does once its first programming is applied.
    tracker.compact();
    let view = tracker.view().clone();
    let t_view = ms(t);
    let rss_view = rss_kib();
    let live_view = live_mib();
    println!(
        "node view: {services} Services x {endpoints} endpoints -> {} frontends",
        view.len()
    );
    println!("  build model (parse)      {t_model:>9.1} ms");
    println!("  build node view          {t_view:>9.1} ms");

    // One endpoint changes in one Service: the model diff, that Service's part of the
    // view, and (below) that frontend's map entries.
    let before = m.clone();
    m.add_slice(&slice(services / 2, endpoints, Some("10.99.99.99")));
    let t = Instant::now();
    let model_changes = before.changes_to(&m);
    let changes = tracker.update(&m, &model_changes.services);
    let view2 = tracker.view().clone();
    let t_view2 = ms(t);
    println!(
        "  update after 1 change    {t_view2:>9.3} ms ({} frontend changed)",
        changes.frontends.len()
    );
    let t = Instant::now();
    let (rebuilt, _) = node_view(&m, &node, &cfg);
    let t_rebuild = ms(t);
    assert_eq!(rebuilt, view2, "the updated view is the rebuilt one");
    println!("  full rebuild (resync)    {t_rebuild:>9.1} ms");
    // The agent keeps one view: the rebuilt copy is not part of its memory.
    drop(rebuilt);

    // The process with the dataplane's mirror of the maps too (RSS KiB, heap MiB).
    let mut with_mirror: Option<(u64, f64)> = None;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("  (BPF map diff skipped: loading maps needs root)");
    } else {
        let (_ebpf, mut maps) = bpf::load_private(&[]).expect("load BPF object");
        let mut state = bpf::Mirror::adopt(&maps).expect("adopt");
        let t = Instant::now();
        let r = bpf::MapsDataplane::new(&mut maps, &mut state)
            .apply(&view)
            .expect("apply");
        let t_full = ms(t);
        let t = Instant::now();
        let r2 = bpf::MapsDataplane::new(&mut maps, &mut state)
            .apply_changes(&view2, &changes.frontends)
            .expect("apply");
        let t_one = ms(t);
        with_mirror = Some((rss_kib(), live_mib()));
        println!(
            "  program all into maps    {t_full:>9.1} ms ({} entries written)",
            r.frontends_written
        );
        println!(
            "  diff + apply 1 change    {t_one:>9.3} ms ({} entry written)",
            r2.frontends_written
        );
        println!("  one change / full        {:>9.5}x", t_one / t_full);
    }
    println!("memory (agent process RSS; heap in use):");
    println!(
        "  start                    {:>9.1} MiB",
        rss0 as f64 / 1024.0
    );
    println!(
        "  + model                  {:>9.1} MiB; {live_model:.1} MiB",
        rss_model as f64 / 1024.0
    );
    println!(
        "  + view                   {:>9.1} MiB; {live_view:.1} MiB",
        rss_view as f64 / 1024.0
    );
    if let Some((rss, live)) = with_mirror {
        println!(
            "  + the maps' mirror       {:>9.1} MiB; {live:.1} MiB",
            rss as f64 / 1024.0
        );
    }
}
