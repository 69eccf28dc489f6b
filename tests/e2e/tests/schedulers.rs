//! IPVS's schedulers end to end, on both paths: a client namespace connects to a
//! ClusterIP whose Service names a scheduler in its annotation, and the spread over the
//! three backend namespaces is the scheduler's, not chance's. Root only: each test says so
//! and skips otherwise.

use std::collections::BTreeMap;

use proxy_testbed::{Path_, TCP_PORT, Testbed, VIP4, spread, target, web_manifests};
use test_support::needs_root;

/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;
const CONNECTIONS: usize = 300;

/// The web manifests with `annotations` on the web Service.
fn testbed(path: Path_, annotations: &str) -> Testbed {
    let mut tb = Testbed::new(3).expect("testbed");
    let mut files = web_manifests(&[0, 1, 2], None);
    for text in files.values_mut() {
        *text = text.replace(
            "metadata: {name: web, namespace: default}",
            &format!("metadata: {{name: web, namespace: default, annotations: {{{annotations}}}}}"),
        );
    }
    assert!(
        files
            .values()
            .any(|t| t.contains("ebpf.proxy.k8s.io/scheduler")),
        "the web Service's metadata moved: update this test"
    );
    tb.write_manifests(&files).expect("manifests");
    tb.start_agent(path, FRONTENDS).expect("agent");
    // `dump` shows the scheduler the programs read.
    let name = annotations
        .split(',')
        .find_map(|a| a.trim().strip_prefix("ebpf.proxy.k8s.io/scheduler:"))
        .map(str::trim);
    if let Some(name) = name {
        let dump = tb.dump().expect("dump");
        let frontend = target(VIP4, TCP_PORT);
        let row = dump["services"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["frontend"] == frontend.as_str()))
            .cloned();
        assert_eq!(
            row.as_ref().map(|r| &r["scheduler"]),
            Some(&serde_json::json!(name)),
            "{row:?}"
        );
    }
    tb
}

/// Where `CONNECTIONS` short TCP connections to the IPv4 ClusterIP went, by backend.
fn connect(tb: &Testbed, path: Path_) -> BTreeMap<String, usize> {
    let n = CONNECTIONS.to_string();
    let attempts = tb
        .client(&["--target", &target(VIP4, TCP_PORT), "--count", &n])
        .expect("client");
    assert!(
        attempts.iter().all(|a| a.ok),
        "{path:?}: a connection failed\n{}",
        tb.agent_log()
    );
    let s = spread(&attempts);
    eprintln!("{path:?}: {s:?}");
    s
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Round robin: each CPU walks the backends in turn, so per CPU the counts differ by at
/// most one, and in all by at most the number of CPUs. Chance spreads 300 connections
/// over three backends far wider (a standard deviation of 8 each).
fn round_robin(path: Path_) {
    let tb = testbed(path, "ebpf.proxy.k8s.io/scheduler: rr");
    let s = connect(&tb, path);
    assert_eq!(s.len(), 3, "{s:?}");
    let (min, max) = (s.values().min(), s.values().max());
    let spread = max.unwrap_or(&0) - min.unwrap_or(&0);
    assert!(spread <= cpus(), "{path:?}: rr spread {s:?} is not in turn");
}

#[needs_root]
#[test]
fn connect_time_round_robin_takes_backends_in_turn() {
    round_robin(Path_::ConnectTime);
}

#[needs_root]
#[test]
fn per_packet_round_robin_takes_backends_in_turn() {
    round_robin(Path_::PerPacket);
}

/// Weighted round robin 3:1:2 by endpoint address: the shares follow the weights (each
/// CPU's walk is off by at most a backend's weight).
fn weighted(path: Path_) {
    let weights = format!(
        "{}=3,{}=1,{}=2",
        Testbed::backend_ip4(0),
        Testbed::backend_ip4(1),
        Testbed::backend_ip4(2)
    );
    let tb = testbed(
        path,
        &format!("ebpf.proxy.k8s.io/scheduler: wrr, ebpf.proxy.k8s.io/weights: \"{weights}\""),
    );
    let s = connect(&tb, path);
    for (i, w) in [3usize, 1, 2].into_iter().enumerate() {
        let got = s.get(&Testbed::backend_name(i)).copied().unwrap_or(0);
        let want = CONNECTIONS * w / 6;
        assert!(
            got.abs_diff(want) <= cpus() * w,
            "{path:?}: backend {i} (weight {w}) got {got} of {CONNECTIONS}, want {want}: {s:?}"
        );
    }
}

#[needs_root]
#[test]
fn connect_time_weighted_round_robin_follows_weights() {
    weighted(Path_::ConnectTime);
}

#[needs_root]
#[test]
fn per_packet_weighted_round_robin_follows_weights() {
    weighted(Path_::PerPacket);
}

/// Source hashing: one client is one backend, every time; Maglev hashing of the flow
/// (address and port) spreads one client's connections over every backend.
fn hashing(path: Path_) {
    let tb = testbed(path, "ebpf.proxy.k8s.io/scheduler: sh");
    let s = connect(&tb, path);
    assert_eq!(
        s.len(),
        1,
        "{path:?}: sh sends one client to one backend: {s:?}"
    );
    drop(tb);
    let tb = testbed(path, "ebpf.proxy.k8s.io/scheduler: mh");
    let s = connect(&tb, path);
    match path {
        // Each connection has its own source port: flows spread.
        Path_::PerPacket => assert_eq!(s.len(), 3, "mh spreads flows: {s:?}"),
        // At connect time the port is not chosen yet: the client's namespace is hashed,
        // as sh does.
        Path_::ConnectTime => assert_eq!(s.len(), 1, "mh at connect time: {s:?}"),
    }
}

#[needs_root]
#[test]
fn connect_time_hashing_schedulers() {
    hashing(Path_::ConnectTime);
}

#[needs_root]
#[test]
fn per_packet_hashing_schedulers() {
    hashing(Path_::PerPacket);
}

/// Least connection: every new connection counts at once on its backend, so a burst of
/// connections fills the backends evenly (the collector's recount, every 10 s, lowers
/// them all again to what is really open).
fn least_connection(path: Path_) {
    let tb = testbed(path, "ebpf.proxy.k8s.io/scheduler: lc");
    let s = connect(&tb, path);
    assert_eq!(s.len(), 3, "{s:?}");
    let (min, max) = (s.values().min(), s.values().max());
    let spread = max.unwrap_or(&0) - min.unwrap_or(&0);
    assert!(spread <= 3, "{path:?}: lc spread {s:?} is not even");
}

#[needs_root]
#[test]
fn connect_time_least_connection_fills_evenly() {
    least_connection(Path_::ConnectTime);
}

#[needs_root]
#[test]
fn per_packet_least_connection_fills_evenly() {
    least_connection(Path_::PerPacket);
}
