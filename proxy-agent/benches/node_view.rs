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
    model::{ClusterModel, NodeInfo, ObjectRef, ViewConfig, node_view},
};
use serde_json::json;

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

fn model(services: usize, endpoints: usize) -> ClusterModel {
    let mut m = ClusterModel::default();
    for i in 0..services {
        let name = format!("svc-{i}");
        let ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
        let svc: Service = serde_json::from_value(json!({"metadata": {"name": name, "namespace": "bench"},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}))
        .expect("service");
        let eps: Vec<_> = (0..endpoints)
            .map(|e| json!({"addresses": [format!("10.{}.{}.{}", 100 + e, i / 250, i % 250 + 1)], "conditions": {"ready": true}, "nodeName": format!("node-{e}")}))
            .collect();
        let slice: EndpointSlice = serde_json::from_value(
            json!({"metadata": {"name": format!("{name}-1"), "namespace": "bench",
            "labels": {"kubernetes.io/service-name": name}}, "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": eps}),
        )
        .expect("slice");
        m.services.insert(ObjectRef::of(&svc.metadata), svc);
        m.slices.insert(ObjectRef::of(&slice.metadata), slice);
    }
    m
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let services: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10_000);
    let endpoints = 10;
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

    let t = Instant::now();
    let (view, _) = node_view(&m, &node, &cfg);
    let t_view = ms(t);
    let rss_view = rss_kib();
    println!(
        "node view: {services} Services x {endpoints} endpoints -> {} frontends",
        view.len()
    );
    println!("  build model (parse)      {t_model:>9.1} ms");
    println!("  build node view          {t_view:>9.1} ms");

    // One endpoint changes in one Service.
    let key = ObjectRef {
        namespace: "bench".into(),
        name: format!("svc-{}-1", services / 2),
    };
    if let Some(slice) = m.slices.get_mut(&key) {
        slice.endpoints[0].addresses = vec!["10.99.99.99".into()];
    }
    let t = Instant::now();
    let (view2, _) = node_view(&m, &node, &cfg);
    let t_view2 = ms(t);
    let changed = view.iter().filter(|(f, s)| view2.get(f) != Some(s)).count();
    println!("  rebuild after 1 change   {t_view2:>9.1} ms ({changed} frontend changed)");

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("  (BPF map diff skipped: loading maps needs root)");
    } else {
        let (_ebpf, mut maps) = bpf::load_private(&[]).expect("load BPF object");
        let mut state = bpf::MapState::adopt(&maps).expect("adopt");
        let t = Instant::now();
        let r = bpf::MapsDataplane {
            maps: &mut maps,
            state: &mut state,
        }
        .apply(&view)
        .expect("apply");
        let t_full = ms(t);
        let t = Instant::now();
        let r2 = bpf::MapsDataplane {
            maps: &mut maps,
            state: &mut state,
        }
        .apply(&view2)
        .expect("apply");
        let t_one = ms(t);
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
    println!("memory (agent process RSS):");
    println!(
        "  start                    {:>9.1} MiB",
        rss0 as f64 / 1024.0
    );
    println!(
        "  + model                  {:>9.1} MiB",
        rss_model as f64 / 1024.0
    );
    println!(
        "  + view                   {:>9.1} MiB",
        rss_view as f64 / 1024.0
    );
    println!(
        "  end                      {:>9.1} MiB",
        rss_kib() as f64 / 1024.0
    );
}
