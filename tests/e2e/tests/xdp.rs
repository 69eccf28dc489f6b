//! The XDP program end to end, native XDP on the testbed's veths: a client namespace
//! reaches a Service's ClusterIP from outside the cluster (TCP and UDP, both families,
//! random, maglev and affinity), its packets translated and redirected at XDP — the
//! counters say XDP sent them, not TC — and a connection XDP opened keeps going while
//! the agent restarts with `--xdp off` and again with `native`. Root only.
//!
//! veth runs native XDP when the receiving end has NAPI: its own XDP program, or GRO
//! turned on (`veth_gro_requested`); every end here gets GRO, so frames redirected into
//! a backend's veth are received, and checksum offload off, so the client's packets carry
//! full checksums (at XDP a partial one cannot be told apart).

use std::{thread, time::Duration};

use proxy_testbed::{
    Path_, TCP_PORT, Testbed, UDP_PORT, VIP4, VIP6, spread, target, web_manifests,
};
use test_support::needs_root;

const FRONTENDS: usize = 5;

fn testbed(annotations: &str, affinity: Option<u32>) -> Testbed {
    let tb = Testbed::new(2).expect("testbed");
    let mut files = web_manifests(&[0, 1], affinity);
    if !annotations.is_empty() {
        for text in files.values_mut() {
            *text = text.replace(
                "metadata: {name: web, namespace: default}",
                &format!(
                    "metadata: {{name: web, namespace: default, annotations: {{{annotations}}}}}"
                ),
            );
        }
    }
    tb.write_manifests(&files).expect("manifests");
    tb.disable_offload().expect("offload off");
    gro_on(&tb);
    tb
}

fn gro_on(tb: &Testbed) {
    let mut ends: Vec<(String, String)> = tb
        .node_interfaces()
        .into_iter()
        .map(|i| (tb.node_ns(), i))
        .collect();
    ends.push((tb.client_ns(), "eth0".into()));
    ends.extend((0..tb.backends).map(|i| (tb.backend_ns(i), "eth0".to_string())));
    for (ns, dev) in ends {
        let ok = std::process::Command::new("ip")
            .args(["netns", "exec", &ns, "ethtool", "-K", &dev, "gro", "on"])
            .status()
            .expect("ethtool");
        assert!(ok.success(), "gro on {ns}/{dev}");
    }
}

fn start(tb: &mut Testbed, mode: &str) {
    tb.start_agent_with(Path_::PerPacket, FRONTENDS, &["--xdp", mode])
        .expect("agent");
}

fn sent_at_xdp(tb: &Testbed) -> u64 {
    tb.counter("xdp_redirect") + tb.counter("xdp_tx")
}

type Spread = std::collections::BTreeMap<String, usize>;

/// Every attempt of `count` to each of the four targets succeeds; returns each target's
/// spread over the backends.
fn reach_all(tb: &Testbed, count: u32) -> Vec<Spread> {
    let mut all = Vec::new();
    for (vip, port, proto) in [
        (VIP4, TCP_PORT, "tcp"),
        (VIP6, TCP_PORT, "tcp"),
        (VIP4, UDP_PORT, "udp"),
        (VIP6, UDP_PORT, "udp"),
    ] {
        let attempts = tb
            .client(&[
                "--target",
                &target(vip, port),
                "--proto",
                proto,
                "--count",
                &count.to_string(),
            ])
            .expect("client");
        assert!(
            attempts.iter().all(|a| a.ok),
            "{vip}:{port}/{proto} failed: {:?}\n{}",
            attempts.iter().filter(|a| !a.ok).collect::<Vec<_>>(),
            tb.agent_log()
        );
        all.push(spread(&attempts));
    }
    all
}

fn union(spreads: &[Spread]) -> Spread {
    let mut out = Spread::new();
    for s in spreads {
        for (k, v) in s {
            *out.entry(k.clone()).or_default() += v;
        }
    }
    out
}

fn served_at_xdp(annotations: &str, affinity: Option<u32>) -> Vec<Spread> {
    let mut tb = testbed(annotations, affinity);
    start(&mut tb, "native");
    let dump = tb.dump().expect("dump");
    let client_if = &tb.node_interfaces()[0];
    assert_eq!(
        dump["xdp"][client_if], "native",
        "dump names the mode: {dump}"
    );
    let s = reach_all(&tb, 20);
    // Each connection's packets from the client, and each reply from a backend.
    assert!(
        sent_at_xdp(&tb) >= 80,
        "XDP sent {} packets: TC did the work\n{}",
        sent_at_xdp(&tb),
        tb.agent_log()
    );
    s
}

#[needs_root]
#[test]
fn native_xdp_serves_tcp_udp_v4_v6_with_random() {
    let s = union(&served_at_xdp("", None));
    assert_eq!(s.len(), 2, "both backends: {s:?}");
}

#[needs_root]
#[test]
fn native_xdp_serves_tcp_udp_v4_v6_with_maglev() {
    let s = union(&served_at_xdp("ebpf.proxy.k8s.io/scheduler: mh", None));
    // The scheduler's own spread is schedulers.rs's: here, that XDP serves it.
    assert!(!s.is_empty(), "{s:?}");
}

#[needs_root]
#[test]
fn native_xdp_keeps_affinity() {
    for s in served_at_xdp("", Some(60)) {
        assert_eq!(
            s.len(),
            1,
            "one client, one backend per frontend while affinity lasts: {s:?}"
        );
    }
}

/// A connection opened at XDP outlives two restarts: one that takes XDP off (TC carries
/// the same conntrack entry on) and one that puts it back (XDP takes it over again).
#[needs_root]
#[test]
fn flow_opened_at_xdp_survives_switching_xdp_off_and_back() {
    let mut tb = testbed("", None);
    start(&mut tb, "native");
    let session = tb
        .spawn_session(&target(VIP4, TCP_PORT), 400)
        .expect("session");
    thread::sleep(Duration::from_millis(600));
    let at_xdp = sent_at_xdp(&tb);
    assert!(at_xdp > 0, "the session runs at XDP\n{}", tb.agent_log());
    for mode in ["off", "native"] {
        tb.kill_agent().expect("kill");
        start(&mut tb, mode);
        let off = mode == "off";
        assert_eq!(
            tb.dump().expect("dump")["xdp"]
                .as_object()
                .is_none_or(|o| o.is_empty()),
            off,
            "xdp pins follow --xdp {mode}"
        );
        thread::sleep(Duration::from_millis(600));
    }
    let attempts = session.finish().expect("session output");
    let failed: Vec<_> = attempts.iter().filter(|a| !a.ok).collect();
    assert!(failed.is_empty(), "the connection broke: {failed:?}");
    assert!(sent_at_xdp(&tb) > at_xdp, "back at XDP after native again");
}

/// The mode the kernel runs the program in on `dev` of the node (`ip link`'s `xdp` or
/// `xdpgeneric`), if any.
fn kernel_mode(tb: &Testbed, dev: &str) -> Option<&'static str> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &tb.node_ns(), "ip", "link", "show", dev])
        .output()
        .expect("ip");
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.contains(&"xdpgeneric") {
        Some("generic")
    } else if words.contains(&"xdp") {
        Some("native")
    } else {
        None
    }
}

/// A restart asked for another XDP mode runs in it: the earlier run's link of the other
/// mode makes way (a device runs one mode at a time). `best-effort` after `generic` stayed
/// generic — the agent's own generic link refused native — with a warning that blamed
/// the veth driver; `generic` after `native` did not start.
#[needs_root]
#[test]
fn a_restart_lands_in_the_xdp_mode_asked_for() {
    let mut tb = testbed("", None);
    for (mode, runs) in [
        ("generic", "generic"),
        ("best-effort", "native"),
        ("generic", "generic"),
        ("native", "native"),
    ] {
        tb.kill_agent().expect("kill");
        start(&mut tb, mode);
        let log = tb.agent_log();
        let dump = tb.dump().expect("dump");
        for dev in tb.node_interfaces() {
            assert_eq!(dump["xdp"][&dev], runs, "--xdp {mode}: {dump}\n{log}");
            assert_eq!(
                kernel_mode(&tb, &dev),
                Some(runs),
                "--xdp {mode}: the kernel runs {dev} so\n{log}"
            );
            let other = if runs == "native" {
                "generic"
            } else {
                "native"
            };
            let stale = tb
                .pin_dir()
                .join("links")
                .join(format!("xdp-{other}@{dev}"));
            assert!(!stale.exists(), "{} left pinned", stale.display());
        }
        assert!(
            !log.contains("running generic XDP"),
            "--xdp {mode} fell back:\n{log}"
        );
    }
    let before = sent_at_xdp(&tb);
    reach_all(&tb, 5);
    assert!(
        sent_at_xdp(&tb) > before,
        "translated at XDP after the restarts"
    );
}

/// An interface that appears after start (a pod's veth, `--interfaces auto`) gets the XDP
/// program too, and its traffic is translated there.
#[needs_root]
#[test]
fn an_interface_that_appears_after_start_runs_xdp() {
    let mut tb = testbed("", None);
    tb.start_agent_on_with("auto", FRONTENDS, &["--xdp", "native"])
        .expect("agent");
    let pod = tb.add_pod(0).expect("pod");
    let veth = tb.pod_interface(0);
    let pin = tb
        .pin_dir()
        .join("links")
        .join(format!("xdp-native@{veth}"));
    tb.wait_for("the new veth's XDP link", || pin.exists());
    for (ns, dev) in [(tb.node_ns(), veth.clone()), (pod.clone(), "eth0".into())] {
        for feature in [["tx", "off"], ["gro", "on"]] {
            let ok = std::process::Command::new("ip")
                .args(["netns", "exec", &ns, "ethtool", "-K", &dev])
                .args(feature)
                .status()
                .expect("ethtool");
            assert!(ok.success(), "{feature:?} on {ns}/{dev}");
        }
    }
    let before = sent_at_xdp(&tb);
    for vip in [VIP4, VIP6] {
        let attempts = tb
            .client_in(&pod, &["--target", &target(vip, TCP_PORT), "--count", "10"])
            .expect("client");
        assert!(
            attempts.iter().all(|a| a.ok),
            "{vip}: {attempts:?}\n{}",
            tb.agent_log()
        );
    }
    assert!(
        sent_at_xdp(&tb) >= before + 40,
        "the new veth's packets went through XDP: {} -> {}",
        before,
        sent_at_xdp(&tb)
    );
}

/// The XDP links are pinned: with the agent killed the program goes on translating at
/// XDP; `proxy-agent cleanup` takes it off (no XDP program left on the interface).
#[needs_root]
#[test]
fn xdp_outlives_the_agent_and_cleanup_takes_it_off() {
    let mut tb = testbed("", None);
    start(&mut tb, "native");
    let client_if = tb.node_interfaces()[0].clone();
    let xdp_on = |tb: &Testbed| {
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &tb.node_ns(),
                "ip",
                "-d",
                "link",
                "show",
                &client_if,
            ])
            .output()
            .expect("ip");
        String::from_utf8_lossy(&out.stdout).contains("prog/xdp")
    };
    assert!(xdp_on(&tb), "native XDP on {client_if}");
    tb.kill_agent().expect("kill");
    let before = sent_at_xdp(&tb);
    reach_all(&tb, 5);
    assert!(
        sent_at_xdp(&tb) > before,
        "still translated at XDP with the agent gone"
    );
    tb.cleanup_agent().expect("cleanup");
    assert!(!xdp_on(&tb), "cleanup took our XDP program off {client_if}");
}
