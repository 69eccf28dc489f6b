//! The per-packet path with traffic shaped like a real cluster's, at the default
//! conntrack timeouts: keep-alive connections and UDP flows idle past every unanswered
//! timeout, 100,000 short connections through one masqueraded NodePort, and a client
//! reconnecting from the same port after its backend left. Root only: each test says so
//! and skips otherwise. (Namespaces, veths and pins are the testbed's own.)

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use proxy_testbed::{
    Path_, TCP_PORT, Testbed, UDP_PORT, VIP4, VIP6, nodeport_manifests, sh, target, web_manifests,
};
use test_support::needs_root;

/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;

/// `masqueradeAll`, so every flow leaves the node with the node's address.
const MASQUERADE_ALL: &str = "kind: KubeProxyConfiguration\niptables:\n  masqueradeAll: true\n";

fn per_packet(backends: &[usize], masquerade: bool) -> Testbed {
    let mut tb = Testbed::new(3).expect("testbed");
    tb.write_manifests(&web_manifests(backends, None))
        .expect("manifests");
    let config = tb
        .write_file("kube-proxy.yaml", MASQUERADE_ALL)
        .expect("config");
    let config = config.to_string_lossy().into_owned();
    let extra: Vec<&str> = if masquerade {
        vec![
            "--config",
            &config,
            "--node-ip",
            "10.10.0.1",
            "--node-ip",
            "fd10::1",
        ]
    } else {
        Vec::new()
    };
    tb.start_agent_with(Path_::PerPacket, FRONTENDS, &extra)
        .expect("agent");
    tb
}

/// One keep-alive TCP connection per family asks, idles 65 s (past the 60 s unanswered
/// TCP limit), and asks again; one connected UDP flow per family asks, idles 35 s (past
/// the 30 s unanswered UDP limit), and asks again. Every answer comes back translated,
/// from the same backend.
fn idle_flows_outlive_the_unanswered_timeouts(masquerade: bool) {
    let tb = per_packet(&[0, 1, 2], masquerade);
    let mut clients = Vec::new();
    for (vip, proto, port, idle_ms) in [
        (VIP4, "tcp", TCP_PORT, "65000"),
        (VIP6, "tcp", TCP_PORT, "65000"),
        (VIP4, "udp-connected", UDP_PORT, "35000"),
        (VIP6, "udp-connected", UDP_PORT, "35000"),
    ] {
        let t = target(vip, port);
        let child = tb
            .spawn_client(&[
                "--target",
                &t,
                "--proto",
                proto,
                "--reuse-socket",
                "--count",
                "2",
                "--interval-ms",
                idle_ms,
            ])
            .expect("client");
        clients.push((t, proto, child));
    }
    // While the flows idle, the collector (every 10 s) reports what the table holds: the
    // four answered flows, two entries each, none collected.
    thread::sleep(Duration::from_secs(25));
    let metrics = metrics(&tb);
    let gauge = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"))
    };
    assert!(
        gauge("proxy_agent_conntrack_answered_entries ") >= 8,
        "{metrics}"
    );
    // conntrack.min (131,072), or maxPerCore × CPUs on a bigger machine.
    assert!(gauge("proxy_agent_conntrack_answered_capacity ") >= 131_072);
    assert!(gauge("proxy_agent_conntrack_new_capacity ") >= 1_024);
    for (t, proto, child) in clients {
        let attempts = child.finish().expect("client output");
        assert_eq!(attempts.len(), 2, "{proto} {t}: {attempts:?}");
        assert!(
            attempts.iter().all(|a| a.ok),
            "{proto} {t} (masquerade {masquerade}): the idle flow died: {attempts:?}\n{}",
            tb.agent_log()
        );
        assert_eq!(
            attempts[0].backend, attempts[1].backend,
            "{proto} {t}: the flow changed backend"
        );
        assert!(
            attempts[1].at_ms - attempts[0].at_ms > 30_000.0,
            "{proto} {t}: the flow did not idle"
        );
        if masquerade {
            let seen = attempts[1].seen_as.as_deref().unwrap_or("");
            assert!(
                seen.contains("10.10.0.1") || seen.contains("fd10::1"),
                "{proto} {t}: not masqueraded, the backend saw {seen}"
            );
        }
    }
}

#[needs_root]
#[test]
fn per_packet_idle_flows_outlive_the_unanswered_timeouts() {
    idle_flows_outlive_the_unanswered_timeouts(false);
}

#[needs_root]
#[test]
fn per_packet_idle_masqueraded_flows_outlive_the_unanswered_timeouts() {
    idle_flows_outlive_the_unanswered_timeouts(true);
}

/// The agent's `/metrics`, fetched from inside the node namespace.
fn metrics(tb: &Testbed) -> String {
    tb.get_in_node("http://127.0.0.1:10249/metrics")
        .expect("metrics")
}

/// 100,000 connections, one after another, from one client through a masqueraded
/// NodePort to one backend: ten times more than the 10,000 masquerade ports, so ports
/// of closed flows must be given back. None fails; a port is short at most once in
/// 10,000 new flows (and that SYN's retransmission gets one).
#[needs_root]
#[test]
fn per_packet_100k_short_connections_through_a_masqueraded_nodeport() {
    const CONNECTIONS: u32 = 100_000;
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&nodeport_manifests())
        .expect("manifests");
    // web (4) + empty + the NodePort Service: ClusterIP, NodePort, 127.0.0.1:NodePort.
    tb.start_agent_with(Path_::PerPacket, 8, &["--node-ip", "10.10.0.1"])
        .expect("agent");
    // The client is one host opening 100k connections in a minute: let it reuse its own
    // TIME_WAIT ports, as a busy client (or a NAT in front of it) does.
    let client_ns = tb.client_ns();
    for (k, v) in [
        ("net.ipv4.tcp_tw_reuse", "1"),
        ("net.ipv4.ip_local_port_range", "1024 65535"),
    ] {
        sh(&[
            "ip",
            "netns",
            "exec",
            &client_ns,
            "sysctl",
            "-qw",
            &format!("{k}={v}"),
        ])
        .expect("client sysctl");
    }
    let started = Instant::now();
    let attempts = tb
        .client(&[
            "--target",
            "10.10.0.1:30080",
            "--count",
            &CONNECTIONS.to_string(),
        ])
        .expect("client");
    let took = started.elapsed();
    let failed: Vec<_> = attempts.iter().filter(|a| !a.ok).collect();
    eprintln!(
        "{} connections in {:.1} s through the masqueraded NodePort, {} failed",
        attempts.len(),
        took.as_secs_f64(),
        failed.len()
    );
    let dump = tb.dump().expect("dump");
    eprintln!("counters: {}", dump["counters"]);
    for f in failed.iter().take(10) {
        eprintln!("failed: {f:?}");
    }
    assert_eq!(attempts.len(), CONNECTIONS as usize);
    assert!(
        failed.is_empty(),
        "{} failed, first {:?}\n{}",
        failed.len(),
        failed.first(),
        tb.agent_log()
    );
    assert!(
        attempts
            .iter()
            .all(|a| a.seen_as.as_deref().unwrap_or("").starts_with("10.10.0.1")),
        "every connection reached the backend masqueraded"
    );
    // A closed flow holds its port for a second, so the 10,000 ports carry ~10,000 new
    // flows a second to one backend: a client this fast (6k/s here, in bursts more)
    // briefly finds 32 random tries taken a few times; each such SYN is dropped and its
    // retransmission (none failed, above) finds a port. Rare, never a run-out.
    let exhausted = tb.counter("snat_ports_exhausted");
    eprintln!("masquerade port shortages: {exhausted} of {CONNECTIONS} new flows");
    assert!(
        exhausted <= u64::from(CONNECTIONS) / 10_000,
        "{exhausted} new flows found no masquerade port"
    );
    // What the table holds afterwards: at most one closed flow per masquerade port (a
    // port's new flow takes its old one's entries), not 100k.
    let answered = dump["conntrack"]["answered"]
        .as_u64()
        .expect("conntrack fill");
    eprintln!("conntrack after the run: {}", dump["conntrack"]);
    assert!(answered <= 2 * 10_000, "{answered} entries left");
    // Every new flow was masqueraded. The client's 100k connects cycle through its ~28k
    // ephemeral ports, and a connect that reuses a port whose previous flow is still
    // closing continues that flow (its backend and masquerade port) instead of opening a
    // new one: seen once in 100k, in one of three full runs (2026-12-02). Tolerated as
    // the port shortages are, and printed.
    let snat = tb.counter("snat");
    eprintln!("masqueraded new flows: {snat} of {CONNECTIONS} connections");
    assert!(
        snat >= u64::from(CONNECTIONS) - u64::from(CONNECTIONS) / 10_000,
        "{snat} of {CONNECTIONS} connections were masqueraded as new flows"
    );
    assert!(
        tb.counter("ct_reused") > 0,
        "100k flows on 10k ports: closed flows' ports were reused"
    );
}

/// Spoofed SYNs flood a masqueraded NodePort from the client namespace (random sources
/// that nothing routes back to; the backend answers every one) while ten keep-alive
/// connections ask ten times a second: none of them fails, and none of the flood reaches
/// the table of established flows.
#[needs_root]
#[test]
fn per_packet_syn_flood_keeps_established_flows() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&nodeport_manifests())
        .expect("manifests");
    tb.start_agent_with(Path_::PerPacket, 8, &["--node-ip", "10.10.0.1"])
        .expect("agent");
    let np = "10.10.0.1:30080";
    let clients: Vec<_> = (0..10)
        .map(|_| {
            tb.spawn_client(&[
                "--target",
                np,
                "--reuse-socket",
                "--count",
                "100",
                "--interval-ms",
                "100",
            ])
            .expect("client")
        })
        .collect();
    thread::sleep(Duration::from_secs(1));
    let flood = tb.spawn_synflood(np, 7.0).expect("flood");
    let out = flood.wait_with_output().expect("flood output");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("flood report");
    let rate = report["sent"].as_f64().unwrap_or(0.0) / report["seconds"].as_f64().unwrap_or(1.0);
    let dump = tb.dump().expect("dump");
    let mut failed = 0;
    for child in clients {
        let attempts = child.finish().expect("client output");
        assert_eq!(attempts.len(), 100);
        failed += attempts.iter().filter(|a| !a.ok).count();
    }
    eprintln!(
        "SYN flood: {:.0} spoofed SYNs/s for {:.1} s; 10 keep-alive connections, 1,000 \
         requests, {failed} failed; conntrack {}",
        rate, report["seconds"], dump["conntrack"]
    );
    assert!(rate > 1_000.0, "the flood ran: {report}");
    assert_eq!(failed, 0, "{}", tb.agent_log());
    let answered = dump["conntrack"]["answered"].as_u64().expect("fill");
    assert!(
        answered <= 2 * 10 + 10,
        "only the keep-alive flows are established: {answered} entries"
    );
}

/// Half-open SYNs cannot hold a masqueraded NodePort's ports (issue 42, item 6). With the
/// range shrunk to 256 ports, 2,000 spoofed SYNs at once (each answered by the backend,
/// never acknowledged) take every port, and 50 more a second follow — today's ~4 a
/// second would keep 256 ports held for the 60 s an unanswered flow lives. New
/// connections from a real client, one every half second from the moment the range is
/// full: the first waits two SYN retransmissions (a second apart: one while every port
/// is under a second old; one because the backend still holds the flooding flow's
/// half-open socket on the reclaimed tuple, which the client's RST clears), the others
/// get a port at once. Measured ~2.04 s, then 9–17 ms (docs/datapath.md).
#[needs_root]
#[test]
fn per_packet_syn_flood_delays_new_masqueraded_connections_a_second_at_most() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&nodeport_manifests())
        .expect("manifests");
    let config = tb
        .write_file(
            "kube-proxy.yaml",
            "kind: KubeProxyConfiguration\nebpf: {masqueradePortRange: 20000-20255}\n",
        )
        .expect("config");
    let config = config.to_string_lossy().into_owned();
    tb.start_agent_with(
        Path_::PerPacket,
        8,
        &["--config", &config, "--node-ip", "10.10.0.1"],
    )
    .expect("agent");
    let np = "10.10.0.1:30080";
    let before = tb.client(&["--target", np]).expect("client");
    assert!(before[0].ok, "the NodePort answers: {before:?}");
    let flood = tb
        .spawn_synflood_paced(np, 9.0, 2_000, 50.0)
        .expect("flood");
    tb.wait_for_within(
        Duration::from_secs(3),
        "the flood to fill the range",
        || tb.counter("snat_ports_exhausted") > 0,
    );
    let attempts = tb
        .client(&[
            "--target",
            np,
            "--count",
            "8",
            "--interval-ms",
            "500",
            "--timeout-ms",
            "10000",
        ])
        .expect("client");
    let out = flood.wait_with_output().expect("flood output");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("flood report");
    let delays: Vec<String> = attempts
        .iter()
        .map(|a| format!("{:.0}{}", a.ms, if a.ok { "" } else { " (failed)" }))
        .collect();
    let (reclaimed, exhausted) = (
        tb.counter("snat_port_reclaimed"),
        tb.counter("snat_ports_exhausted"),
    );
    eprintln!(
        "SYN flood on 256 masquerade ports: {report}; 8 new connections during it took \
         [{}] ms; snat_port_reclaimed {reclaimed}, snat_ports_exhausted {exhausted}",
        delays.join(", ")
    );
    assert!(
        attempts.iter().all(|a| a.ok),
        "every new connection succeeded: {attempts:?}"
    );
    let worst = attempts.iter().map(|a| a.ms).fold(0.0, f64::max);
    assert!(
        worst < 2_500.0,
        "a new connection waited {worst:.0} ms: more than two SYN retransmissions"
    );
    assert!(reclaimed > 0, "half-open flows' ports were taken");
}

/// A client reconnects from the same source port after its backend left the Service:
/// once after a graceful close (the flow in TIME_WAIT), once after a reset (CLOSE). The
/// new connections reach a live backend, not the removed one.
#[needs_root]
#[test]
fn per_packet_reconnect_from_the_same_port_reaches_a_live_backend() {
    let tb = per_packet(&[0], false);
    sh(&[
        "ip",
        "netns",
        "exec",
        &tb.client_ns(),
        "sysctl",
        "-qw",
        "net.ipv4.tcp_tw_reuse=1",
    ])
    .expect("client sysctl");
    let script = format!(
        r#"
import socket, struct, sys, time
VIP = ("{VIP4}", {TCP_PORT})
def connect(port, reset):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.10.0.2", port))
    s.settimeout(3)
    s.connect(VIP)
    who = s.recv(200).decode().split()[0]
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    else:
        s.shutdown(socket.SHUT_WR)
        while s.recv(200):
            pass
    s.close()
    return who
print(connect(41000, False), connect(41001, True), flush=True)
sys.stdin.readline()
time.sleep(1.2)  # TIME_WAIT reuse needs the old one a second old
print(connect(41000, False), connect(41001, True), flush=True)
"#
    );
    let mut child = Command::new("ip")
        .args(["netns", "exec", &tb.client_ns(), "python3", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 client");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    out.read_line(&mut first).expect("first answers");
    assert_eq!(first.trim(), "backend-0 backend-0", "{}", tb.agent_log());
    tb.write_manifests(&web_manifests(&[1, 2], None))
        .expect("manifests");
    thread::sleep(Duration::from_millis(1500)); // the file source notices and syncs
    child
        .stdin
        .as_mut()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("go");
    let mut second = String::new();
    out.read_line(&mut second).expect("second answers");
    let _ = child.wait();
    let who: Vec<&str> = second.split_whitespace().collect();
    assert_eq!(
        who.len(),
        2,
        "both reconnects answered: {second:?}\n{}",
        tb.agent_log()
    );
    assert!(
        who.iter().all(|w| *w == "backend-1" || *w == "backend-2"),
        "a reconnect from the same port went to the removed backend: {who:?}"
    );
}
