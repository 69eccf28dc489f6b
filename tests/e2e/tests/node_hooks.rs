//! The node's hooks in hostile hands (issue 25, "The node"): a classifier pin deleted by
//! hand, a link detached, a clsact filter deleted, a connect-time hook's pin deleted or
//! its link detached are all attached again at the next resync, logged and counted; a
//! second agent of another pin folder on the same interfaces is found and reported, and
//! `/healthz` fails while its classifier is there; once that agent is gone its
//! classifier is taken off (tcx) or adopted (clsact) and traffic follows the live agent.
//! Root only; everything happens in the testbed's namespaces, cgroup and bpffs.

use std::collections::BTreeSet;

use proxy_testbed::{Path_, TCP_PORT, Testbed, VIP4, VIP6, sh, target, web_manifests};
use test_support::needs_root;

/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;
/// A resync every second, so a test waits for one in seconds.
const RESYNC: [&str; 2] = ["--resync-s", "1"];
const CLSACT: [&str; 2] = ["--tc-attach", "clsact"];
/// The testbed's own agent's endpoints (kube-proxy's default ports).
const HEALTHZ: &str = "http://127.0.0.1:10256/healthz";
const METRICS: &str = "http://127.0.0.1:10249/metrics";

/// The backends answering 10 TCP attempts at the IPv4 ClusterIP through the per-packet
/// path (each attempt must be answered).
fn answering(tb: &Testbed, log: &str) -> BTreeSet<String> {
    let t = target(VIP4, TCP_PORT);
    let attempts = tb
        .client_in(
            &tb.client_ns(),
            &["--target", &t, "--count", "10", "--timeout-ms", "1000"],
        )
        .expect("client");
    attempts
        .iter()
        .map(|a| {
            assert!(a.ok, "{t}: {a:?}\nlog:\n{log}");
            a.backend.clone().unwrap_or_default()
        })
        .collect()
}

/// A testbed of `backends` backends whose agent (per packet, a resync every second)
/// serves the web manifests with backend 0 only, checked by traffic.
fn serving_backend_0(backends: usize) -> Testbed {
    let mut tb = Testbed::new(backends).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    tb.start_agent_with(Path_::PerPacket, FRONTENDS, &RESYNC)
        .expect("agent");
    assert_eq!(answering(&tb, &tb.agent_log()), only(0));
    tb
}

fn only(backend: usize) -> BTreeSet<String> {
    BTreeSet::from([Testbed::backend_name(backend)])
}

/// `/healthz` at `url`: its code and body.
fn healthz(tb: &Testbed, url: &str) -> (u16, serde_json::Value) {
    let (code, body) = tb.http_in_node(url).expect(url);
    (code, serde_json::from_str(&body).unwrap_or_default())
}

/// A metric's value in the Prometheus text at `url`.
fn metric(tb: &Testbed, url: &str, name: &str) -> u64 {
    let text = tb.get_in_node(url).expect(url);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name}:\n{text}"))
}

/// A log line holding every one of `words`.
fn logged(log: &str, words: &[&str]) -> bool {
    log.lines().any(|l| words.iter().all(|w| l.contains(w)))
}

/// Our filters for `program` on `interface`'s `hook` (`tc filter show` lines naming it).
fn our_filters(tb: &Testbed, interface: &str, hook: &str) -> usize {
    let program = format!("tc_{hook}");
    tb.tc_filters(interface, hook)
        .expect("tc filter show")
        .lines()
        .filter(|l| l.contains(&program))
        .count()
}

/// A classifier pin deleted by hand (which detaches the link) and a link detached under
/// its pin (`bpftool link detach`): at the next resync both are attached again, logged
/// and counted, and the ClusterIP is translated again.
#[needs_root]
#[test]
fn lost_classifier_links_are_attached_again_at_the_next_resync() {
    let tb = serving_backend_0(1);
    let [client_if, backend_if] =
        <[String; 2]>::try_from(tb.node_interfaces()).expect("two node interfaces");

    let deleted = tb.classifier_pin(&client_if);
    std::fs::remove_file(&deleted).expect("deleting the pin");
    let detached = tb.egress_pin(&backend_if);
    sh(&[
        "bpftool",
        "link",
        "detach",
        "pinned",
        detached.to_str().expect("utf-8"),
    ])
    .expect("detaching the link");

    tb.wait_for("the deleted pin back", || deleted.exists());
    tb.wait_for("both repairs logged", || {
        let log = tb.agent_log();
        logged(
            &log,
            &[
                "attached again",
                &client_if,
                "tc_ingress",
                "pinned link is gone",
            ],
        ) && logged(
            &log,
            &[
                "attached again",
                &backend_if,
                "tc_egress",
                "link is detached",
            ],
        )
    });
    assert_eq!(metric(&tb, METRICS, "proxy_agent_hooks_repaired_total"), 2);
    assert_eq!(answering(&tb, &tb.agent_log()), only(0));
    let (code, body) = healthz(&tb, HEALTHZ);
    assert_eq!(code, 200, "{body}");
}

/// The connect-time hooks: a pin deleted (`connect4`) and a link detached under its pin
/// (`connect6`) are attached again at the next resync, and connections are translated.
#[needs_root]
#[test]
fn lost_connect_time_hooks_are_attached_again_at_the_next_resync() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    tb.start_agent_with(Path_::ConnectTime, FRONTENDS, &RESYNC)
        .expect("agent");
    let links = tb.pin_dir().join("links");
    let (deleted, detached) = (links.join("cgroup_connect4"), links.join("cgroup_connect6"));
    std::fs::remove_file(&deleted).expect("deleting the pin");
    sh(&[
        "bpftool",
        "link",
        "detach",
        "pinned",
        detached.to_str().expect("utf-8"),
    ])
    .expect("detaching the link");

    tb.wait_for("the deleted pin back", || deleted.exists());
    tb.wait_for("both repairs logged", || {
        let log = tb.agent_log();
        logged(
            &log,
            &["connect-time hook was lost; attached again", "connect4"],
        ) && logged(
            &log,
            &["connect-time hook was lost; attached again", "connect6"],
        )
    });
    assert_eq!(metric(&tb, METRICS, "proxy_agent_hooks_repaired_total"), 2);
    for vip in [VIP4, VIP6] {
        let t = target(vip, TCP_PORT);
        let attempts = tb
            .client(&["--target", &t, "--count", "5"])
            .expect("client");
        assert!(
            attempts.iter().all(|a| a.ok),
            "{t}: {attempts:?}\n{}",
            tb.agent_log()
        );
    }
}

/// clsact mode: our filter deleted by hand (`tc filter del`) is added again at the next
/// resync.
#[needs_root]
#[test]
fn a_deleted_clsact_filter_is_added_again_at_the_next_resync() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    let args: Vec<&str> = CLSACT.iter().chain(&RESYNC).copied().collect();
    tb.start_agent_with(Path_::PerPacket, FRONTENDS, &args)
        .expect("agent");
    let client_if = tb.node_interfaces()[0].clone();
    sh(&[
        "ip",
        "netns",
        "exec",
        &tb.node_ns(),
        "tc",
        "filter",
        "del",
        "dev",
        &client_if,
        "ingress",
        "pref",
        "20",
    ])
    .expect("deleting our filter");
    assert_eq!(our_filters(&tb, &client_if, "ingress"), 0);
    tb.wait_for("the filter back", || {
        our_filters(&tb, &client_if, "ingress") == 1
    });
    assert!(
        logged(
            &tb.agent_log(),
            &["attached again", &client_if, "filter is gone"]
        ),
        "{}",
        tb.agent_log()
    );
    assert_eq!(metric(&tb, METRICS, "proxy_agent_hooks_repaired_total"), 1);
    assert_eq!(answering(&tb, &tb.agent_log()), only(0));
}

/// A second agent (another pin folder, backend 1) on the interfaces the first serves
/// (backend 0), tcx: the first one's links run first and win. Both agents log the other's
/// classifiers (interface, program id, pin folder) and fail `/healthz` while they are
/// there. Once the first is dead, the second takes its stale links off at the next
/// resync: healthy again, and the ClusterIP goes to the live agent's backend.
#[needs_root]
#[test]
fn a_second_agents_classifier_is_reported_and_a_dead_ones_taken_off() {
    let mut tb = serving_backend_0(2);
    tb.start_other_agent("second", &web_manifests(&[1], None), FRONTENDS, &RESYNC)
        .expect("second agent");
    let second = format!("http://{}/healthz", tb.other_addresses("second").0);
    let second_metrics = format!("http://{}/metrics", tb.other_addresses("second").1);
    let interfaces = tb.node_interfaces();
    let client_if = interfaces[0].clone();
    let first_pins = tb.pin_dir().display().to_string();

    // The second sees the first's classifiers from its start: they run first.
    let (code, body) = healthz(&tb, &second);
    assert_eq!(code, 503, "{body}\n{}", tb.other_log("second"));
    let foreign = body["foreignClassifiers"].as_array().expect("listed");
    assert_eq!(foreign.len(), 2 * interfaces.len(), "{body}");
    assert!(
        foreign.iter().all(|f| f["pinDir"] == first_pins.as_str()
            && f["agentRunning"] == true
            && f["shadowsOurs"] == true
            && f["attach"] == "tcx"),
        "{body}"
    );
    let log = tb.other_log("second");
    assert!(
        logged(
            &log,
            &[
                "foreign classifier is on an interface we serve",
                &client_if,
                "program_id=",
                &first_pins
            ]
        ),
        "{log}"
    );
    assert_eq!(
        metric(&tb, &second_metrics, "proxy_agent_foreign_classifiers"),
        2 * interfaces.len() as u64
    );
    // The first one wins, as before; but it no longer calls itself healthy either.
    assert_eq!(answering(&tb, &log), only(0));
    tb.wait_for("the first agent to see the second", || {
        healthz(&tb, HEALTHZ).0 == 503
    });

    // The first dies; its pinned links would go on translating to its backends.
    tb.kill_agent().expect("kill");
    tb.wait_for("the second healthy again", || {
        healthz(&tb, &second).0 == 200
    });
    let log = tb.other_log("second");
    for iface in &interfaces {
        assert!(
            logged(
                &log,
                &[
                    "no agent holds it",
                    "taken off",
                    iface,
                    &first_pins,
                    "detached"
                ]
            ),
            "{iface}:\n{log}"
        );
        assert!(!tb.classifier_pin(iface).exists() && !tb.egress_pin(iface).exists());
    }
    assert_eq!(
        metric(
            &tb,
            &second_metrics,
            "proxy_agent_stale_classifiers_removed_total"
        ),
        2 * interfaces.len() as u64
    );
    assert_eq!(
        metric(&tb, &second_metrics, "proxy_agent_foreign_classifiers"),
        0
    );
    assert_eq!(answering(&tb, &log), only(1));
}

/// The same in clsact mode, where both agents' filters want one place: the second agent
/// refuses to take over the filter of a running agent (logged, `/healthz` failing, the
/// first one's traffic untouched); once the first is dead, it adopts that filter (its
/// program swapped in) at the next resync and the ClusterIP follows it.
#[needs_root]
#[test]
fn clsact_a_running_agents_filter_is_refused_and_a_dead_ones_adopted() {
    let mut tb = Testbed::new(2).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    let args: Vec<&str> = CLSACT.iter().chain(&RESYNC).copied().collect();
    tb.start_agent_with(Path_::PerPacket, FRONTENDS, &args)
        .expect("first agent");
    tb.start_other_agent("second", &web_manifests(&[1], None), FRONTENDS, &args)
        .expect("second agent");
    let second = format!("http://{}/healthz", tb.other_addresses("second").0);
    let interfaces = tb.node_interfaces();
    let first_pins = tb.pin_dir().display().to_string();

    let (code, body) = healthz(&tb, &second);
    assert_eq!(code, 503, "{body}\n{}", tb.other_log("second"));
    let foreign = body["foreignClassifiers"].as_array().expect("listed");
    assert!(
        foreign.len() == 2 * interfaces.len()
            && foreign
                .iter()
                .all(|f| f["attach"] == "clsact" && f["agentRunning"] == true),
        "{body}"
    );
    let log = tb.other_log("second");
    assert!(
        logged(
            &log,
            &[
                "classifier not attached",
                &interfaces[0],
                "which is running; not touched"
            ]
        ),
        "{log}"
    );
    // The first agent's filters and traffic are untouched, and it sees nothing of ours.
    assert_eq!(answering(&tb, &log), only(0));
    let (code, body) = healthz(&tb, HEALTHZ);
    assert_eq!(code, 200, "{body}\n{}", tb.agent_log());

    tb.kill_agent().expect("kill");
    tb.wait_for("the second healthy again", || {
        healthz(&tb, &second).0 == 200
    });
    let log = tb.other_log("second");
    for iface in &interfaces {
        assert!(
            logged(
                &log,
                &[
                    "no agent holds it",
                    "taken off",
                    iface,
                    &first_pins,
                    "adopted"
                ]
            ),
            "{iface}:\n{log}"
        );
        for hook in ["ingress", "egress"] {
            assert_eq!(our_filters(&tb, iface, hook), 1, "{iface} {hook}");
        }
    }
    let second_metrics = format!("http://{}/metrics", tb.other_addresses("second").1);
    assert_eq!(
        metric(
            &tb,
            &second_metrics,
            "proxy_agent_stale_classifiers_removed_total"
        ),
        2 * interfaces.len() as u64
    );
    assert_eq!(answering(&tb, &log), only(1));
}

/// Service map entries deleted by hand while the agent runs (what an operator's stray
/// `bpftool map delete` or another tool does): the audit finds them within one resync
/// period and writes their frontends again, logged and counted; a stray entry written by
/// hand is removed; the ClusterIP is translated again.
#[needs_root]
#[test]
fn map_entries_lost_or_added_by_hand_are_repaired_by_the_audit() {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common::{ServiceKey, ServiceValue, map_names::SERVICES};
    let tb = serving_backend_0(1);

    let pinned = MapData::from_pin(tb.pin_dir().join("maps").join(SERVICES)).expect("pin");
    let mut services: HashMap<MapData, ServiceKey, ServiceValue> =
        HashMap::try_from(Map::HashMap(pinned)).expect("the service map");
    let entries: Vec<(ServiceKey, ServiceValue)> = services.iter().filter_map(Result::ok).collect();
    assert_eq!(entries.len(), FRONTENDS, "{entries:?}");
    for (k, _) in &entries {
        services.remove(k).expect("delete an entry");
    }
    let stray = ServiceKey {
        port: 9999u16.to_be(),
        ..entries[0].0
    };
    services
        .insert(&stray, &entries[0].1, 0)
        .expect("a stray entry");

    tb.wait_for("every frontend back", || {
        services.keys().filter_map(Result::ok).count() == FRONTENDS
            && services.get(&stray, 0).is_err()
    });
    let log = tb.agent_log();
    assert!(
        logged(&log, &["the audit found the dataplane drifted"]),
        "{log}"
    );
    assert_eq!(
        metric(&tb, METRICS, "proxy_agent_audit_frontends_repaired_total"),
        FRONTENDS as u64
    );
    assert!(metric(&tb, METRICS, "proxy_agent_audit_entries_removed_total") >= 1);
    assert!(metric(&tb, METRICS, "proxy_agent_audit_passes_total") >= 1);
    assert_eq!(answering(&tb, &tb.agent_log()), only(0));
}
