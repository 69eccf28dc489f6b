//! The classifier as filters on a clsact qdisc (`--tc-attach clsact`, what kernels
//! before 6.6 get instead of tcx), forced here on a kernel that has tcx: ClusterIP and
//! NodePort traffic, a kill -9 and restart of the agent under a live connection (one
//! filter per hook afterwards, swapped in place), interfaces that appear later, and
//! `cleanup` deleting only our filters. `auto` picks tcx on this kernel and takes over
//! from the filters. Root only; everything happens in the testbed's namespaces.

use std::{collections::BTreeMap, thread, time::Duration};

use proxy_testbed::{
    Path_, TCP_PORT, Testbed, UDP_PORT, VIP4, VIP6, nodeport_manifests, sh, target, web_manifests,
};
use test_support::needs_root;

/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;
/// With the NodePort Service: + its ClusterIP, NodePort and 127.0.0.1:NodePort.
const NODEPORT_FRONTENDS: usize = 8;
const CLSACT: [&str; 2] = ["--tc-attach", "clsact"];

/// A testbed with `backends` backends serving `files`, its agent on the node's
/// interfaces in clsact mode (with `extra` arguments).
fn clsact_testbed(
    backends: usize,
    files: &BTreeMap<&str, String>,
    frontends: usize,
    extra: &[&str],
) -> Testbed {
    let mut tb = Testbed::new(backends).expect("testbed");
    tb.write_manifests(files).expect("manifests");
    let args: Vec<&str> = CLSACT.iter().chain(extra).copied().collect();
    tb.start_agent_with(Path_::PerPacket, frontends, &args)
        .expect("agent");
    tb
}

/// Our filters on `interface`'s `hook`: lines of `tc filter show` naming the program
/// (one per filter; tc prints the program's name on the filter's own line).
fn our_filters(tb: &Testbed, interface: &str, hook: &str) -> usize {
    let program = format!("tc_{hook}");
    tb.tc_filters(interface, hook)
        .expect("tc filter show")
        .lines()
        .filter(|l| l.contains(&program))
        .count()
}

/// Exactly one filter of ours per hook, at our priority, on each of `interfaces`, and no
/// tcx link pinned for them.
fn one_filter_each(tb: &Testbed, interfaces: &[String]) {
    for iface in interfaces {
        for hook in ["ingress", "egress"] {
            let shown = tb.tc_filters(iface, hook).expect("tc filter show");
            assert_eq!(
                our_filters(tb, iface, hook),
                1,
                "{iface} {hook}: expected one filter of ours:\n{shown}\nagent log:\n{}",
                tb.agent_log()
            );
            assert!(shown.contains("pref 20 "), "{iface} {hook}:\n{shown}");
        }
        assert!(
            !tb.classifier_pin(iface).exists() && !tb.egress_pin(iface).exists(),
            "{iface}: a tcx link is pinned in clsact mode"
        );
    }
}

/// Every attempt from `ns` reaches a backend.
fn all_reach(tb: &Testbed, ns: Option<&str>, t: &str, proto: &str) {
    let args = ["--target", t, "--proto", proto, "--count", "10"];
    let attempts = match ns {
        Some(ns) => tb.client_in(ns, &args),
        None => tb.client(&args),
    }
    .expect("client");
    assert_eq!(attempts.len(), 10);
    for a in &attempts {
        assert!(
            a.ok && a.backend.as_deref().unwrap_or("").starts_with("backend-"),
            "{proto} {t}: {a:?}\nagent log:\n{}",
            tb.agent_log()
        );
    }
}

#[needs_root]
#[test]
fn clsact_serves_cluster_ips_and_a_nodeport() {
    let tb = clsact_testbed(
        1,
        &nodeport_manifests(),
        NODEPORT_FRONTENDS,
        &["--node-ip", "10.10.0.1"],
    );
    assert!(tb.agent_log().contains("hook=Clsact"), "{}", tb.agent_log());
    // The start-up line that names what the kernel gave and what was chosen.
    let log = tb.agent_log();
    let chosen = log
        .lines()
        .find(|l| l.contains("kernel features chosen"))
        .unwrap_or_else(|| panic!("no kernel features line:\n{log}"));
    for field in [
        "release=",
        "tc_hook=Some(Clsact)",
        "set_retval=",
        "coarse_clock=",
    ] {
        assert!(chosen.contains(field), "{field} missing from {chosen}");
    }
    one_filter_each(&tb, &tb.node_interfaces());
    for (vip, proto, port) in [
        (VIP4, "tcp", TCP_PORT),
        (VIP6, "tcp", TCP_PORT),
        (VIP4, "udp", UDP_PORT),
        (VIP6, "udp", UDP_PORT),
    ] {
        all_reach(&tb, None, &target(vip, port), proto);
    }
    // The NodePort is masqueraded: the backend sees the node.
    let attempts = tb
        .client(&["--target", "10.10.0.1:30080", "--count", "10"])
        .expect("client");
    assert!(
        attempts
            .iter()
            .all(|a| a.ok && a.seen_as.as_deref().unwrap_or("").starts_with("10.10.0.1")),
        "{attempts:?}\n{}",
        tb.agent_log()
    );
}

/// kill -9 and a new agent while one TCP connection keeps asking: it never fails, and
/// the new agent swaps its programs into the same filters (one per hook afterwards).
#[needs_root]
#[test]
fn clsact_restart_keeps_a_live_connection_and_one_filter() {
    let mut tb = clsact_testbed(2, &web_manifests(&[0, 1], None), FRONTENDS, &[]);
    let t = target(VIP4, TCP_PORT);
    let mut session = tb.spawn_session(&t, 150).expect("client");
    let first = session.first_attempt().expect("first answer");
    thread::sleep(Duration::from_millis(500));
    tb.kill_agent().expect("kill");
    thread::sleep(Duration::from_millis(500));
    tb.start_agent_with(Path_::PerPacket, FRONTENDS, &CLSACT)
        .expect("restart");
    let mut attempts = session.finish().expect("client output");
    attempts.insert(0, first.clone());
    let broken: Vec<_> = attempts
        .iter()
        .filter(|a| !a.ok || a.backend != first.backend)
        .collect();
    assert!(
        broken.is_empty(),
        "the live connection broke across the restart: {broken:?}\n{}",
        tb.agent_log()
    );
    // The old filters serve until the new agent has loaded its programs (seconds, when
    // other tests load theirs too): wait for the swap, do not race it.
    for iface in tb.node_interfaces() {
        tb.wait_for(&format!("{iface}'s filter adopted"), || {
            tb.agent_log()
                .lines()
                .any(|l| l.contains("adopted filter") && l.contains(&iface))
        });
    }
    one_filter_each(&tb, &tb.node_interfaces());
    all_reach(&tb, None, &t, "tcp");
}

#[needs_root]
#[test]
fn clsact_serves_an_interface_created_after_start() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    tb.start_agent_on_with("auto", FRONTENDS, &CLSACT)
        .expect("agent");
    let pod = tb.add_pod(0).expect("pod");
    let veth = tb.pod_interface(0);
    tb.wait_for("the new veth's filters", || {
        our_filters(&tb, &veth, "ingress") == 1 && our_filters(&tb, &veth, "egress") == 1
    });
    one_filter_each(&tb, std::slice::from_ref(&veth));
    all_reach(&tb, Some(&pod), &target(VIP4, TCP_PORT), "tcp");
    all_reach(&tb, Some(&pod), &target(VIP6, TCP_PORT), "tcp");
}

/// `cleanup` deletes our filters and nothing else: a foreign filter on the same clsact
/// qdisc stays (and keeps the qdisc we added), a qdisc someone else added stays, and a
/// qdisc we added that nobody else uses goes.
#[needs_root]
#[test]
fn clsact_cleanup_removes_only_our_filters() {
    let mut tb = Testbed::new(2).expect("testbed");
    tb.write_manifests(&web_manifests(&[0, 1], None))
        .expect("manifests");
    let node = tb.node_ns();
    let [client_if, foreign_if, theirs_if] =
        <[String; 3]>::try_from(tb.node_interfaces()).expect("three node interfaces");
    // Someone else's (empty) clsact qdisc, there before the agent.
    sh(&[
        "ip", "netns", "exec", &node, "tc", "qdisc", "add", "dev", &theirs_if, "clsact",
    ])
    .expect("foreign qdisc");
    tb.start_agent_with(Path_::PerPacket, FRONTENDS, &CLSACT)
        .expect("agent");
    one_filter_each(&tb, &tb.node_interfaces());
    // A foreign filter beside ours on a qdisc the agent added.
    sh(&[
        "ip",
        "netns",
        "exec",
        &node,
        "tc",
        "filter",
        "add",
        "dev",
        &foreign_if,
        "ingress",
        "pref",
        "100",
        "protocol",
        "ip",
        "u32",
        "match",
        "u32",
        "0",
        "0",
        "classid",
        "1:1",
    ])
    .expect("foreign filter");
    let t = target(VIP4, TCP_PORT);
    all_reach(&tb, None, &t, "tcp");

    tb.kill_agent().expect("kill");
    tb.cleanup_agent().expect("cleanup");
    assert!(!tb.pin_dir().exists(), "pin folder removed");
    for iface in tb.node_interfaces() {
        for hook in ["ingress", "egress"] {
            assert_eq!(our_filters(&tb, &iface, hook), 0, "{iface} {hook}");
        }
    }
    let foreign = tb.tc_filters(&foreign_if, "ingress").expect("tc");
    assert!(
        foreign.contains("pref 100 u32"),
        "the foreign filter went: {foreign:?}"
    );
    let qdiscs = |iface: &str| {
        sh(&[
            "ip", "netns", "exec", &node, "tc", "qdisc", "show", "dev", iface,
        ])
        .expect("tc")
    };
    assert!(
        qdiscs(&foreign_if).contains("clsact"),
        "a qdisc in use was deleted"
    );
    assert!(
        qdiscs(&theirs_if).contains("clsact"),
        "someone else's qdisc was deleted"
    );
    assert!(
        !qdiscs(&client_if).contains("clsact"),
        "the qdisc we added is left: {}",
        qdiscs(&client_if)
    );
    let after = tb
        .client(&["--target", &t, "--count", "1", "--timeout-ms", "500"])
        .expect("client");
    assert!(!after[0].ok, "the VIP is still translated: {after:?}");
}

/// On this kernel (tcx since 6.6) `auto` picks tcx; started over an agent that left
/// clsact filters, it pins tcx links and deletes the filters, with no gap for a live
/// connection.
#[needs_root]
#[test]
fn auto_chooses_tcx_here_and_takes_over_from_clsact() {
    let release = proxy_agent::dataplane::bpf::kernel::release().expect("kernel release");
    if release < (6, 6) {
        eprintln!("skipping: kernel {release:?} has no tcx");
        return;
    }
    let mut tb = clsact_testbed(1, &web_manifests(&[0], None), FRONTENDS, &[]);
    one_filter_each(&tb, &tb.node_interfaces());
    let t = target(VIP4, TCP_PORT);
    let mut session = tb.spawn_session(&t, 100).expect("client");
    let first = session.first_attempt().expect("first answer");
    tb.kill_agent().expect("kill");
    tb.start_agent(Path_::PerPacket, FRONTENDS)
        .expect("restart");
    let attempts = session.finish().expect("client output");
    assert!(
        first.ok && attempts.iter().all(|a| a.ok),
        "failed across the switch: {attempts:?}\n{}",
        tb.agent_log()
    );
    assert!(tb.agent_log().contains("hook=Tcx"), "{}", tb.agent_log());
    for iface in tb.node_interfaces() {
        // Attaching follows loading the programs: wait for it rather than race it.
        tb.wait_for(&format!("{iface}'s tcx links"), || {
            tb.classifier_pin(&iface).exists() && tb.egress_pin(&iface).exists()
        });
        for hook in ["ingress", "egress"] {
            tb.wait_for(&format!("{iface} {hook}: the clsact filter gone"), || {
                our_filters(&tb, &iface, hook) == 0
            });
        }
    }
    all_reach(&tb, None, &t, "tcp");
}
