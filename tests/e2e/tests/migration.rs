//! Migration from kube-proxy and back, step by step as `docs/migration.md` gives them, in
//! namespace testbeds with kube-proxy-shaped rules loaded first (`proxy_testbed::kube_proxy`):
//! the agent serving beside kube-proxy's rules (our hooks run before netfilter), live
//! connections kube-proxy translated outliving the agent's start and `cleanup
//! --kube-proxy`, what that cleanup removes and leaves, and the way back. Root only;
//! rules, interfaces and programs live in the testbed's namespaces.

use std::{
    collections::BTreeMap,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use proxy_testbed::{
    Attempt, Path_, TCP_PORT, Testbed, VIP4, VIP6, agent_bin,
    kube_proxy::{self, NodeChains},
    sh, target, web_manifests,
};
use test_support::needs_root;

/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;

/// `iptables-restore`-like tool `tool` loads `text` into the node's namespace.
fn load(tb: &Testbed, tool: &str, args: &[&str], name: &str, text: &str) {
    let file = tb.write_file(name, text).expect("rules file");
    kube_proxy::restore(&tb.node_ns(), tool, args, &file).expect(tool);
}

/// kube-proxy's iptables rules in the node's namespace (through `tool`, an
/// iptables-restore of some backend and family): `vip:80` DNATed to `backends` (port
/// 8080), and the filter/mangle chains kube-proxy and kubelet add.
fn load_kube_proxy_iptables(
    tb: &Testbed,
    tool: &str,
    vip: &str,
    backends: &[String],
    opts: NodeChains,
) {
    let eps = backends.iter().map(|ip| target(ip, 8080)).collect();
    let svcs = vec![(vip.to_string(), eps)];
    load(
        tb,
        tool,
        &[],
        "nat.rules",
        &kube_proxy::iptables_rules(&svcs),
    );
    load(
        tb,
        tool,
        &["--noflush"],
        "node.rules",
        &kube_proxy::iptables_node_chains(opts),
    );
}

/// kube-proxy's rules (iptables, the host's default backend) sending `VIP4:80` to
/// backends `backends`; with `tcpBeLiberal` unless `drop_invalid`: kube-proxy then sets
/// `nf_conntrack_tcp_be_liberal` and leaves out its INVALID drop.
fn kube_proxy_serves(tb: &Testbed, backends: &[usize], drop_invalid: bool) {
    if !drop_invalid {
        in_node(
            tb,
            &[
                "sysctl",
                "-qw",
                "net.netfilter.nf_conntrack_tcp_be_liberal=1",
            ],
        );
    }
    let ips: Vec<String> = backends.iter().map(|&i| Testbed::backend_ip4(i)).collect();
    let opts = NodeChains {
        v6: false,
        drop_invalid,
    };
    load_kube_proxy_iptables(tb, "iptables-restore", VIP4, &ips, opts);
}

/// Backends that answered `attempts`, failures by their error.
fn answered(attempts: &[Attempt]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for a in attempts {
        let who = if a.ok {
            a.backend.clone().unwrap_or_default()
        } else {
            format!("failed ({})", a.error.as_deref().unwrap_or("?"))
        };
        *m.entry(who).or_insert(0) += 1;
    }
    m
}

/// `n` new connections to `VIP4:80` from the client namespace (outside the testbed's
/// cgroup unless the agent runs the connect-time path): who answered.
fn new_connections(tb: &Testbed, n: u32) -> BTreeMap<String, usize> {
    let t = target(VIP4, TCP_PORT);
    let attempts = tb
        .client(&[
            "--target",
            &t,
            "--count",
            &n.to_string(),
            "--timeout-ms",
            "1000",
        ])
        .expect("client");
    answered(&attempts)
}

fn only(backends: &[&str], n: usize, got: &BTreeMap<String, usize>) -> bool {
    got.values().sum::<usize>() == n && got.keys().all(|k| backends.contains(&k.as_str()))
}

/// `proxy-agent cleanup --kube-proxy` in the node's namespace: (exit code, report).
fn cleanup_kube_proxy(tb: &Testbed) -> (i32, String) {
    let out = Command::new(agent_bin())
        .arg("--netns")
        .arg(format!("/run/netns/{}", tb.node_ns()))
        .args(["cleanup", "--kube-proxy"])
        .output()
        .expect("proxy-agent cleanup --kube-proxy");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.code().unwrap_or(-1), report)
}

/// A command's output in the node's namespace.
fn in_node(tb: &Testbed, args: &[&str]) -> String {
    let mut argv = vec!["ip", "netns", "exec"];
    let ns = tb.node_ns();
    argv.push(&ns);
    argv.extend(args);
    sh(&argv).expect("command in the node's namespace")
}

/// Chain names of a save dump.
fn chains(save: &str) -> Vec<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// docs/migration.md, "Remove kube-proxy's leftovers": every backend and family, both
/// nftables tables and kube-ipvs0 loaded as kube-proxy (and kubelet, and a CNI) leave
/// them; `cleanup --kube-proxy` removes kube-proxy's and nothing else, says why it left
/// what it left, and a second run finds nothing to do.
#[needs_root]
#[test]
fn cleanup_removes_kube_proxys_leftovers_and_nothing_else() {
    let tb = Testbed::new(0).expect("testbed");
    let v4 = NodeChains {
        v6: false,
        drop_invalid: true,
    };
    let v6 = NodeChains {
        v6: true,
        drop_invalid: true,
    };
    let b4 = [Testbed::backend_ip4(0)];
    let b6 = [Testbed::backend_ip6(0)];
    let mut saves = vec![("iptables-nft-save", "iptables-nft-restore")];
    load_kube_proxy_iptables(&tb, "iptables-nft-restore", VIP4, &b4, v4);
    load_kube_proxy_iptables(&tb, "ip6tables-nft-restore", VIP6, &b6, v6);
    saves.push(("ip6tables-nft-save", "ip6tables-nft-restore"));
    // The legacy backend where this host has it (kube-proxy's image may pick either).
    if kube_proxy_has("iptables-legacy-restore") {
        load_kube_proxy_iptables(&tb, "iptables-legacy-restore", VIP4, &b4, v4);
        saves.push(("iptables-legacy-save", "iptables-legacy-restore"));
    }
    // Someone else's: a filter chain jumped to from FORWARD, and a CNI's nat chain
    // jumping to kube-proxy's KUBE-MARK-MASQ (which must then stay).
    let others = "*filter\n:MINE - [0:0]\n-A FORWARD -j MINE\n-A MINE -j ACCEPT\nCOMMIT\n*nat\n:CNI-HOSTPORT-MASQ - [0:0]\n-A CNI-HOSTPORT-MASQ -j KUBE-MARK-MASQ\nCOMMIT\n";
    load(
        &tb,
        "iptables-nft-restore",
        &["--noflush"],
        "others.rules",
        others,
    );
    // kube-proxy's nftables mode, both families, and someone else's table.
    let nft4 = kube_proxy::nft_rules(&[(VIP4.to_string(), vec![target(&b4[0], 8080)])]);
    let nft6 = kube_proxy::nft_rules(&[(VIP6.to_string(), vec![target(&b6[0], 8080)])]);
    load(&tb, "nft", &["-f"], "kube-proxy4.nft", &nft4);
    load(&tb, "nft", &["-f"], "kube-proxy6.nft", &nft6);
    load(
        &tb,
        "nft",
        &["-f"],
        "mine.nft",
        "table inet mine {\n chain c { type filter hook forward priority 0; }\n}\n",
    );
    // A kube-ipvs0 that is not a dummy (this kernel has no dummy driver): left, as
    // kube-proxy leaves it.
    in_node(
        &tb,
        &[
            "ip",
            "link",
            "add",
            "kube-ipvs0",
            "type",
            "veth",
            "peer",
            "name",
            "kpx0",
        ],
    );

    let (code, report) = cleanup_kube_proxy(&tb);
    eprintln!("{report}");
    assert_eq!(code, 0, "cleanup failed:\n{report}");
    for (save, _) in &saves {
        let dump = in_node(&tb, &[save]);
        let left = chains(&dump);
        let kube: Vec<&String> = left.iter().filter(|c| c.starts_with("KUBE-")).collect();
        for c in &kube {
            let kubelets = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY", "KUBE-FIREWALL"];
            let pinned = *save == "iptables-nft-save" && c.as_str() == "KUBE-MARK-MASQ";
            assert!(
                kubelets.contains(&c.as_str()) || pinned,
                "{save}: kube-proxy's chain {c} is still there:\n{dump}"
            );
        }
        assert!(
            kube.iter().any(|c| c.as_str() == "KUBE-KUBELET-CANARY"),
            "{save}: kubelet's chains must stay:\n{dump}"
        );
        assert!(
            !dump.contains("kubernetes service portals") && !dump.contains("KUBE-SVC-"),
            "{save}: jumps or Service chains left:\n{dump}"
        );
    }
    let nft_save = in_node(&tb, &["iptables-nft-save"]);
    assert!(nft_save.contains("-A FORWARD -j MINE") && nft_save.contains(":MINE"));
    assert!(nft_save.contains("-A CNI-HOSTPORT-MASQ -j KUBE-MARK-MASQ"));
    assert!(
        report.contains("nat chain KUBE-MARK-MASQ: still jumped to from chain CNI-HOSTPORT-MASQ")
    );
    assert!(report.contains("chain KUBE-FIREWALL: kubelet's"));
    let tables = in_node(&tb, &["nft", "list", "tables"]);
    assert!(!tables.contains("kube-proxy"), "{tables}");
    assert!(tables.contains("table inet mine"), "{tables}");
    assert!(report.contains("removed  nftables         table ip kube-proxy"));
    assert!(report.contains("removed  nftables         table ip6 kube-proxy"));
    assert!(report.contains("no IPVS in this kernel"), "{report}");
    assert!(
        report.contains("device kube-ipvs0: a veth device"),
        "{report}"
    );
    assert!(in_node(&tb, &["ip", "link", "show", "kube-ipvs0"]).contains("kube-ipvs0"));

    let (code, again) = cleanup_kube_proxy(&tb);
    assert_eq!(code, 0);
    assert!(
        again.contains("\n0 removed,"),
        "a second run found more:\n{again}"
    );
}

fn kube_proxy_has(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// docs/migration.md, steps 2–4 (kube-proxy → the agent): kube-proxy's rules serve the
/// ClusterIP (to backend 2; ours say backends 0 and 1) and a keep-alive connection
/// through them is open; the agent starts on the node's interfaces: new connections are
/// ours (the classifier translates before netfilter sees the packet), the live
/// connection goes on through netfilter's conntrack entry (the agent left its flow to
/// netfilter: `netfilter_pass`, no `ct_invalid`); `cleanup --kube-proxy` removes the
/// rules and the connection still goes on (the kernel's conntrack entry keeps its DNAT).
#[needs_root]
#[test]
fn migration_keeps_connections_kube_proxy_opened() {
    let mut tb = Testbed::new(3).expect("testbed");
    tb.write_manifests(&web_manifests(&[0, 1], None))
        .expect("manifests");
    kube_proxy_serves(&tb, &[2], false);
    // So netfilter forgets the live connection soon after it closes (end of the test).
    in_node(
        &tb,
        &[
            "sysctl",
            "-qw",
            "net.netfilter.nf_conntrack_tcp_timeout_time_wait=1",
        ],
    );
    let before = new_connections(&tb, 5);
    assert!(
        only(&["backend-2"], 5, &before),
        "kube-proxy's rules: {before:?}"
    );
    // 20 ms apart for ~8 s: across the agent's start and the cleanup.
    let t = target(VIP4, TCP_PORT);
    let mut session = tb.spawn_session(&t, 400).expect("client");
    let first = session.first_attempt().expect("first answer");
    assert_eq!(first.backend.as_deref(), Some("backend-2"));

    tb.start_agent(Path_::PerPacket, FRONTENDS).expect("agent");
    let with_agent = new_connections(&tb, 20);
    assert!(
        only(&["backend-0", "backend-1"], 20, &with_agent),
        "new connections beside kube-proxy's rules: {with_agent:?}\n{}",
        tb.agent_log()
    );
    let (code, report) = cleanup_kube_proxy(&tb);
    assert_eq!(code, 0, "{report}");
    let after = new_connections(&tb, 20);
    assert!(only(&["backend-0", "backend-1"], 20, &after), "{after:?}");

    let session = session.finish().expect("session");
    let got = answered(&session);
    // (`first_attempt` took the first answer.)
    assert_eq!(
        got,
        BTreeMap::from([("backend-2".to_string(), 399)]),
        "the connection kube-proxy opened, across the agent's start and the cleanup"
    );
    let counters = &tb.dump().expect("dump")["counters"];
    assert_eq!(counters["ct_invalid"], 0, "{counters}");
    assert!(counters["netfilter_pass"].as_u64() > Some(0), "{counters}");
    // Once the connection is closed and netfilter forgets it, the agent's mirror of it
    // goes too (followed every 10 s while it holds anything).
    // (It may also hold the closed connections of `before`, until the next refresh.)
    assert!(tb.dump().expect("dump")["netfilter_flows"].as_u64() >= Some(1));
    let deadline = Instant::now() + Duration::from_secs(30);
    while tb.dump().expect("dump")["netfilter_flows"] != 0 {
        assert!(
            Instant::now() < deadline,
            "NETFILTER_FLOWS still holds the closed flow"
        );
        thread::sleep(Duration::from_millis(500));
    }
}

/// kube-proxy's iptables mode without `tcpBeLiberal` drops what netfilter marks INVALID
/// in FORWARD, and netfilter sees the per-packet path's flows half-translated (the
/// client's packets after our DNAT, the replies after our reverse NAT, two flows it never
/// sees answered): their replies are INVALID, so every new per-packet connection fails
/// while that rule is there. docs/migration.md step 1 sets `conntrack.tcpBeLiberal` first.
/// The connect-time path is not affected (the socket itself is aimed at the backend).
#[needs_root]
#[test]
fn kube_proxys_invalid_drop_rule_stops_the_per_packet_path() {
    let mut tb = Testbed::new(3).expect("testbed");
    tb.write_manifests(&web_manifests(&[0, 1], None))
        .expect("manifests");
    kube_proxy_serves(&tb, &[2], true);
    tb.start_agent(Path_::PerPacket, FRONTENDS).expect("agent");
    let t = target(VIP4, TCP_PORT);
    let failed = tb
        .client(&["--target", &t, "--count", "3", "--timeout-ms", "1000"])
        .expect("client");
    assert!(failed.iter().all(|a| !a.ok), "{:?}", answered(&failed));
    let drops = in_node(&tb, &["iptables", "-L", "KUBE-FORWARD", "-v", "-n", "-x"]);
    let invalid = drops
        .lines()
        .find(|l| l.contains("ctstate INVALID"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok());
    assert!(
        invalid > Some(0),
        "the INVALID rule dropped nothing:\n{drops}"
    );
    let (code, report) = cleanup_kube_proxy(&tb);
    assert_eq!(code, 0, "{report}");
    let after = new_connections(&tb, 10);
    assert!(only(&["backend-0", "backend-1"], 10, &after), "{after:?}");
}

/// docs/migration.md, "Back to kube-proxy", up to the cleanup: the agent serves
/// (`ours`), a keep-alive connection is open through the per-packet path; the agent is
/// stopped (its pinned programs keep serving, new connections included) and kube-proxy's
/// rules come back (`kube_proxys`); then `proxy-agent cleanup` detaches the programs and
/// kube-proxy serves new connections. Returns the live connection's attempts after its
/// first one, the backend that answered that one, and when the cleanup ran (ms after
/// the connection started).
fn roll_back(ours: &[usize], kube_proxys: &[usize]) -> (Vec<Attempt>, String, f64) {
    let mut tb = Testbed::new(3).expect("testbed");
    tb.write_manifests(&web_manifests(ours, None))
        .expect("manifests");
    tb.start_agent(Path_::PerPacket, FRONTENDS).expect("agent");
    let t = target(VIP4, TCP_PORT);
    let started = Instant::now();
    let mut session = tb
        .spawn_client(&[
            "--target",
            &t,
            "--reuse-socket",
            "--count",
            "150",
            "--interval-ms",
            "20",
            "--timeout-ms",
            "500",
        ])
        .expect("client");
    let first = session.first_attempt().expect("first answer");
    let ours_names: Vec<String> = ours.iter().map(|&i| Testbed::backend_name(i)).collect();
    let ours_names: Vec<&str> = ours_names.iter().map(String::as_str).collect();
    let theirs: Vec<String> = kube_proxys
        .iter()
        .map(|&i| Testbed::backend_name(i))
        .collect();
    let theirs: Vec<&str> = theirs.iter().map(String::as_str).collect();
    let answered_first = first.backend.clone().expect("a backend");
    assert!(ours_names.contains(&answered_first.as_str()));

    tb.kill_agent().expect("stop the agent");
    kube_proxy_serves(&tb, kube_proxys, false);
    let pinned = new_connections(&tb, 10);
    assert!(
        only(&ours_names, 10, &pinned),
        "the pinned programs serve until cleanup: {pinned:?}"
    );
    thread::sleep(Duration::from_millis(300));
    let cleanup_at = started.elapsed().as_secs_f64() * 1e3;
    tb.cleanup_agent().expect("proxy-agent cleanup");
    if ours != kube_proxys {
        let after = new_connections(&tb, 10);
        assert!(only(&theirs, 10, &after), "kube-proxy serves: {after:?}");
    }
    thread::sleep(Duration::from_millis(1000));
    let attempts = session.stop().expect("session");
    eprintln!(
        "live connection: {:?}; cleanup at {cleanup_at:.0} ms",
        answered(&attempts)
    );
    (attempts, answered_first, cleanup_at)
}

/// The connection the per-packet path was translating is reset at the cleanup (not
/// stalled: `cleanup` deleted the kernel's entries our translated packets had left), and
/// the client's next connection goes through kube-proxy's rules to `theirs`.
fn assert_reset_then_kube_proxys(session: &[Attempt], first: &str, cleanup_at: f64, theirs: &str) {
    let cut = session
        .iter()
        .position(|a| !a.ok)
        .expect("the connection only our conntrack translated survived the cleanup");
    assert!(
        session[..cut]
            .iter()
            .all(|a| a.backend.as_deref() == Some(first))
    );
    let failed = &session[cut];
    assert!(
        failed.at_ms + failed.ms > cleanup_at,
        "failed before the cleanup"
    );
    assert_eq!(
        failed.error.as_deref(),
        Some("ConnectionReset"),
        "reset, not stalled: {failed:?}"
    );
    assert!(
        session.len() > cut + 1
            && session[cut + 1..]
                .iter()
                .all(|a| a.ok && a.backend.as_deref() == Some(theirs)),
        "reconnected through kube-proxy's rules: {:?}",
        answered(&session[cut + 1..])
    );
}

/// The way back with kube-proxy's rules choosing another backend (as they mostly will,
/// with several).
#[needs_root]
#[test]
fn rollback_resets_a_connection_kube_proxy_sends_elsewhere() {
    let (session, first, cleanup_at) = roll_back(&[0, 1], &[2]);
    assert_reset_then_kube_proxys(&session, &first, cleanup_at, "backend-2");
}

/// The way back with kube-proxy's rules choosing the very backend the connection has (one
/// endpoint): reset all the same — the connection is not handed over to netfilter.
#[needs_root]
#[test]
fn rollback_resets_a_connection_even_to_the_same_backend() {
    let (session, first, cleanup_at) = roll_back(&[0], &[0]);
    assert_eq!(first, "backend-0");
    assert_reset_then_kube_proxys(&session, &first, cleanup_at, "backend-0");
}
