//! Least privilege, checked: the agent runs with exactly the capabilities the DaemonSet
//! gives its container — read from `deploy/daemonset.yaml` (`drop: [ALL]` plus `add`),
//! never copied here — and both paths work: connect-time ClusterIPs through the testbed's
//! cgroup, a connected UDP socket of a pod process owned by another uid destroyed when
//! its backend leaves, per-packet ClusterIPs and a masqueraded NodePort. Then, for each
//! capability of that set, the agent runs without it and a named feature fails.
//!
//! The agent is put in the node's namespace by `nsenter` and exec'd by util-linux
//! `setpriv` with the bounding set cut to those capabilities (root's permitted and
//! effective sets after exec are its bounding set), as a DaemonSet's agent starts in the
//! host's namespace (hostNetwork) with the container's set; `/proc/<pid>/status` of the
//! running agent shows it has no other. Root only; everything happens in the testbed's
//! namespaces, cgroup and bpffs.

use std::{process::Command, thread, time::Duration};

use proxy_testbed::{
    Attempt, Background, Path_, Testbed, UDP_PORT, VIP4, helper_bin, nodeport_manifests, target,
    web_manifests,
};
use test_support::needs_root;

/// Capability numbers (`linux/capability.h`) of the names a manifest may use.
const CAPS: [(&str, u32); 6] = [
    ("NET_ADMIN", 12),
    ("SYS_PTRACE", 19),
    ("SYS_ADMIN", 21),
    ("SYS_RESOURCE", 24),
    ("PERFMON", 38),
    ("BPF", 39),
];
/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;
/// With the NodePort Service: + its ClusterIP, NodePort and 127.0.0.1:NodePort.
const NODEPORT_FRONTENDS: usize = 8;
/// The uid of the pod process whose socket the agent must find (not the agent's).
const POD_UID: &str = "65534";

/// The agent container's capabilities in deploy/daemonset.yaml: it drops ALL, so its
/// set is exactly `add`.
fn daemonset_caps() -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/daemonset.yaml");
    let text = std::fs::read_to_string(path).expect("read daemonset.yaml");
    let ds: serde_json::Value = serde_norway::from_str(&text).expect("valid YAML");
    let sc = &ds["spec"]["template"]["spec"]["containers"][0]["securityContext"];
    assert_eq!(
        sc["capabilities"]["drop"],
        serde_json::json!(["ALL"]),
        "the agent container must drop ALL, else the runtime's defaults come on top: {sc}"
    );
    sc["capabilities"]["add"]
        .as_array()
        .expect("capabilities.add")
        .iter()
        .map(|c| c.as_str().expect("a name").to_string())
        .collect()
}

fn mask(caps: &[String]) -> u64 {
    caps.iter()
        .map(|c| {
            let n = CAPS
                .iter()
                .find(|(name, _)| name == c)
                .unwrap_or_else(|| panic!("capability {c} unknown to this test"))
                .1;
            1u64 << n
        })
        .fold(0, |a, b| a | b)
}

/// `setpriv` keeping only `caps` (and no inheritable ones) for what it execs.
fn setpriv(caps: &[String]) -> Vec<String> {
    let keep: String = caps
        .iter()
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();
    vec![
        "setpriv".into(),
        "--inh-caps=-all".into(),
        format!("--bounding-set=-all{keep}"),
        "--".into(),
    ]
}

/// The capability sets of a running process, from `/proc/<pid>/status`.
fn cap_sets(pid: u32) -> (u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let field = |name: &str| {
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("{name} in {status}"));
        u64::from_str_radix(line.trim(), 16).expect("hex")
    };
    (field("CapEff:"), field("CapPrm:"), field("CapBnd:"))
}

/// What works with a capability set.
#[derive(Debug, Default)]
struct Outcome {
    /// The connect-time agent's start error (its log), if it did not start.
    connect_start: Option<String>,
    /// TCP and UDP to the ClusterIP through the cgroup hooks.
    connect_serves: bool,
    /// A connected UDP socket of a process of another uid, in the testbed's cgroup and
    /// another network namespace, destroyed when its backend leaves (it then moves).
    stale_udp_destroyed: bool,
    /// The per-packet agent's start error, if it did not start.
    packet_start: Option<String>,
    /// TCP and UDP to the ClusterIP and TCP to a masqueraded NodePort, per packet.
    packet_serves: bool,
    /// The agents' logs.
    logs: String,
}

fn all_ok(attempts: &[Attempt]) -> bool {
    !attempts.is_empty() && attempts.iter().all(|a| a.ok)
}

/// Both paths with the agent holding exactly `caps`; with `own_pids`, the agent also
/// gets a PID namespace of its own (as a pod without `hostPID`).
fn run_with(caps: &[String], own_pids: bool) -> Outcome {
    let mut wrapper = setpriv(caps);
    if own_pids {
        let unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"];
        wrapper.splice(0..0, unshare.map(String::from));
    }
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut out = Outcome::default();

    let mut tb = Testbed::new(3).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    match tb.start_agent_wrapped(&wrapper, Path_::ConnectTime, FRONTENDS, &[]) {
        Err(e) => out.connect_start = Some(format!("{e:#}")),
        Ok(()) => {
            // (With its own PID namespace, the pid is unshare's, the agent's parent.)
            if !own_pids {
                let pid = tb.agent_pid().expect("agent pid");
                assert_eq!(
                    cap_sets(pid),
                    (mask(caps), mask(caps), mask(caps)),
                    "the agent's capabilities (effective, permitted, bounding) for {caps:?}"
                );
            }
            out.connect_serves = ["tcp", "udp"].iter().all(|proto| {
                let port = if *proto == "tcp" { 80 } else { UDP_PORT };
                tb.client(&[
                    "--target",
                    &target(VIP4, port),
                    "--proto",
                    proto,
                    "--count",
                    "5",
                ])
                .is_ok_and(|a| all_ok(&a))
            });
            out.stale_udp_destroyed = stale_udp_moves(&mut tb);
            out.logs += &tb.agent_log();
        }
    }
    drop(tb);

    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&nodeport_manifests())
        .expect("manifests");
    match tb.start_agent_wrapped(
        &wrapper,
        Path_::PerPacket,
        NODEPORT_FRONTENDS,
        &["--node-ip", "10.10.0.1"],
    ) {
        Err(e) => out.packet_start = Some(format!("{e:#}")),
        Ok(()) => {
            out.packet_serves = [
                (target(VIP4, 80), "tcp"),
                (target(VIP4, UDP_PORT), "udp"),
                ("10.10.0.1:30080".to_string(), "tcp"),
            ]
            .iter()
            .all(|(t, proto)| {
                tb.client(&["--target", t, "--proto", proto, "--count", "5"])
                    .is_ok_and(|a| all_ok(&a))
            });
            out.logs += &tb.agent_log();
        }
    }
    out
}

/// A connected UDP socket of a process running as `POD_UID` in the client's namespace
/// and the testbed's cgroup, on backend-0 when backend-0 leaves the Service: true when
/// the agent destroyed it and it moved to a live backend.
fn stale_udp_moves(tb: &mut Testbed) -> bool {
    let mut session = spawn_pod_client(
        tb,
        &[
            "--target",
            &target(VIP4, UDP_PORT),
            "--proto",
            "udp-connected",
            "--reuse-socket",
            "--count",
            "100",
            "--interval-ms",
            "25",
            "--timeout-ms",
            "300",
        ],
    );
    let first = session.first_attempt().expect("first answer");
    assert_eq!(first.backend.as_deref(), Some("backend-0"), "{first:?}");
    thread::sleep(Duration::from_millis(300));
    tb.write_manifests(&web_manifests(&[1, 2], None))
        .expect("manifests");
    let attempts = session.finish().expect("client output");
    let late: Vec<_> = attempts
        .iter()
        .filter(|a| a.at_ms > first.at_ms + 1800.0)
        .collect();
    assert!(!late.is_empty(), "{attempts:?}");
    late.iter()
        .all(|a| a.ok && a.backend.as_deref() != Some("backend-0"))
        && tb.agent_log().contains("udp_sockets_destroyed=1")
}

/// `e2e-client ARGS` as a pod's process would run: in the client's namespace and the
/// testbed's cgroup, as `POD_UID` without capabilities.
fn spawn_pod_client(tb: &Testbed, args: &[&str]) -> Background {
    let procs = tb.cgroup_path().join("cgroup.procs");
    let script = format!(
        "echo $$ > {} && exec nsenter --net=/run/netns/{} setpriv --reuid={POD_UID} \
         --regid={POD_UID} --clear-groups --inh-caps=-all --bounding-set=-all -- {} \"$@\"",
        procs.display(),
        tb.client_ns(),
        helper_bin("e2e-client").display(),
    );
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &script, "pod-client"]).args(args);
    Background::spawn(cmd).expect("starting the pod's client")
}

/// The DaemonSet's capabilities, when this test can run (util-linux's tools; root is
/// `#[needs_root]`'s).
fn setup(test: &str) -> Option<Vec<String>> {
    tools_present(test).then(daemonset_caps)
}

/// Both paths serve, but the stale connected UDP socket stays on its removed backend.
fn serves_but_stale_stays(o: &Outcome) -> bool {
    o.connect_start.is_none()
        && o.packet_start.is_none()
        && o.connect_serves
        && o.packet_serves
        && !o.stale_udp_destroyed
}

fn tools_present(test: &str) -> bool {
    let ok = ["setpriv", "nsenter"].iter().all(|t| {
        Command::new(t)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !ok {
        eprintln!("SKIP {test}: needs util-linux's setpriv and nsenter");
    }
    ok
}

/// Whether `o` shows the feature that needs `cap` failing. A capability the manifest adds
/// without an entry here fails the test: nothing shows it is needed.
fn fails_without(cap: &str, o: &Outcome) -> bool {
    let refused = |start: &Option<String>| {
        start
            .as_deref()
            .is_some_and(|e| e.contains("failed to create map") && e.contains("not permitted"))
    };
    match cap {
        // bpf(): CAP_BPF, or CAP_SYS_ADMIN, which the kernel accepts in its place (and in
        // CAP_PERFMON's): no maps, no programs, on either path. Also setns into the pods'
        // network namespaces (the stale-socket walk).
        "SYS_ADMIN" => refused(&o.connect_start) && refused(&o.packet_start),
        // sock_diag's SOCK_DESTROY and conntrack's netlink dump/delete: both paths serve,
        // but a stale connected UDP socket stays on its removed backend.
        "NET_ADMIN" => {
            serves_but_stale_stays(o)
                && o.logs.contains("SOCK_DESTROY refused")
                && o.logs.contains("conntrack dump failed")
        }
        // /proc/<pid>/ns/net of a process of another uid (and with capabilities the agent
        // lacks): its namespace is not visited, the socket stays.
        "SYS_PTRACE" => serves_but_stale_stays(o),
        _ => panic!("no test shows that {cap} is needed: add one, or drop it from the manifest"),
    }
}

fn assert_everything_works(caps: &[String], o: &Outcome) {
    assert!(
        o.connect_start.is_none()
            && o.packet_start.is_none()
            && o.connect_serves
            && o.packet_serves
            && o.stale_udp_destroyed,
        "with {caps:?}: {o:#?}"
    );
}

#[needs_root]
#[test]
fn daemonset_capabilities_serve_both_paths() {
    let Some(caps) = setup("daemonset_capabilities_serve_both_paths") else {
        return;
    };
    assert_everything_works(&caps, &run_with(&caps, false));
}

#[needs_root]
#[test]
fn each_daemonset_capability_is_needed() {
    let Some(caps) = setup("each_daemonset_capability_is_needed") else {
        return;
    };
    for cap in &caps {
        let less: Vec<String> = caps.iter().filter(|c| *c != cap).cloned().collect();
        let o = run_with(&less, false);
        assert!(fails_without(cap, &o), "without {cap}: {o:#?}");
    }
}

/// CAP_BPF and CAP_PERFMON would add nothing beside CAP_SYS_ADMIN (the kernel's
/// bpf_capable() and perfmon_capable() accept it: `daemonset_capabilities_serve_both_paths`
/// runs without them), and cannot replace it: with them instead of CAP_SYS_ADMIN both
/// paths serve, but setns into a pod's network namespace fails and its stale connected
/// UDP socket stays.
#[needs_root]
#[test]
fn bpf_and_perfmon_cannot_replace_sys_admin() {
    let Some(caps) = setup("bpf_and_perfmon_cannot_replace_sys_admin") else {
        return;
    };
    for redundant in ["BPF", "PERFMON"] {
        assert!(
            !caps.iter().any(|c| c == redundant),
            "{redundant}: {caps:?}"
        );
    }
    let mut swapped: Vec<String> = caps.into_iter().filter(|c| c != "SYS_ADMIN").collect();
    swapped.extend(["BPF".to_string(), "PERFMON".to_string()]);
    let o = run_with(&swapped, false);
    assert!(serves_but_stale_stays(&o), "with {swapped:?}: {o:#?}");
}

/// Without hostPID the agent sees no pod process: the cgroup's pids are not in its PID
/// namespace, so the pods' network namespaces are never found and their stale connected
/// UDP sockets stay; serving works.
#[needs_root]
#[test]
fn host_pid_is_needed_for_stale_udp_sockets() {
    let Some(caps) = setup("host_pid_is_needed_for_stale_udp_sockets") else {
        return;
    };
    let o = run_with(&caps, true);
    assert!(
        serves_but_stale_stays(&o),
        "in its own PID namespace: {o:#?}"
    );
}
