//! The classifier follows interfaces: a pod whose veth appears after the agent started is
//! served through the per-packet path, its link is pinned, and the pin goes with the
//! interface. The agent runs inside the testbed's node namespace, so `auto` and globs
//! only ever see the testbed's own interfaces. Root only: each test says so and skips
//! otherwise.

use std::{thread, time::Duration};

use proxy_testbed::{TCP_PORT, Testbed, VIP4, VIP6, ip, target, web_manifests};
use test_support::needs_root;

/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;

/// Every attempt from `ns` to the ClusterIP (both families) is answered by a backend:
/// the node has no route to the ClusterIPs, so only the classifier on the pod's veth
/// (DNAT on the way in) gets them anywhere.
fn reaches_cluster_ip(tb: &Testbed, ns: &str) {
    for vip in [VIP4, VIP6] {
        let t = target(vip, TCP_PORT);
        let attempts = tb
            .client_in(
                ns,
                &["--target", &t, "--count", "10", "--timeout-ms", "1000"],
            )
            .expect("client");
        assert_eq!(attempts.len(), 10);
        for a in &attempts {
            assert!(a.ok, "{ns} -> {t}: {a:?}\nagent log:\n{}", tb.agent_log());
            assert!(a.backend.as_deref().unwrap_or("").starts_with("backend-"));
        }
    }
}

fn new_pod_interface_is_served(interfaces: &str) {
    let mut tb = Testbed::new(2).expect("testbed");
    tb.write_manifests(&web_manifests(&[0, 1], None))
        .expect("manifests");
    tb.start_agent_on(interfaces, FRONTENDS).expect("agent");
    for iface in tb.node_interfaces() {
        assert!(
            tb.classifier_pin(&iface).exists() && tb.egress_pin(&iface).exists(),
            "{iface} not served at start (ingress and egress):\n{}",
            tb.agent_log()
        );
    }
    assert!(
        !tb.classifier_pin("lo").exists(),
        "loopback got the classifier"
    );

    // A pod appears after the agent is up.
    let pod = tb.add_pod(0).expect("pod");
    let veth = tb.pod_interface(0);
    let (pin, egress) = (tb.classifier_pin(&veth), tb.egress_pin(&veth));
    tb.wait_for("the new veth's pinned links", || {
        pin.exists() && egress.exists()
    });
    reaches_cluster_ip(&tb, &pod);

    // The interface goes: so does its pin (the kernel detached the link with it).
    ip(&tb.node_ns(), &format!("link del {veth}")).expect("deleting the veth");
    tb.wait_for("the pins to go with the veth", || {
        !pin.exists() && !egress.exists()
    });

    // Back under the same name (a new ifindex): a fresh link, and traffic flows again.
    tb.add_pod_link(0).expect("re-creating the veth");
    tb.wait_for("the re-created veth's pinned links", || {
        pin.exists() && egress.exists()
    });
    reaches_cluster_ip(&tb, &pod);
    let attached = tb
        .agent_log()
        .lines()
        .filter(|l| l.contains("how=\"new link\"") && l.contains(&veth))
        .count();
    assert_eq!(
        attached,
        2,
        "expected two attachments of {veth}:\n{}",
        tb.agent_log()
    );
}

#[needs_root]
#[test]
fn auto_serves_a_pod_interface_created_after_start() {
    new_pod_interface_is_served("auto");
}

#[needs_root]
#[test]
fn pattern_serves_a_pod_interface_created_after_start() {
    // c<id> (the client side), b<i><id> (backends) and p<i><id> (new pods).
    new_pod_interface_is_served("c*,b*,p*");
}

/// While the agent is down, a pod's veth is deleted and re-created under the same name:
/// the restarted agent finds that pin's link on the old (gone) device and replaces it,
/// and adopts the still-valid pins of the other interfaces.
#[needs_root]
#[test]
fn restart_replaces_the_pin_of_an_interface_recreated_while_down() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    let pod = tb.add_pod(0).expect("pod");
    tb.start_agent_on("auto", FRONTENDS).expect("agent");
    let veth = tb.pod_interface(0);
    reaches_cluster_ip(&tb, &pod);

    tb.kill_agent().expect("kill");
    ip(&tb.node_ns(), &format!("link del {veth}")).expect("deleting the veth");
    tb.add_pod_link(0).expect("re-creating the veth");
    assert!(
        tb.classifier_pin(&veth).exists(),
        "the stale pin is gone already"
    );

    tb.start_agent_on("auto", FRONTENDS).expect("agent");
    tb.wait_for("the restarted agent's classifiers", || {
        tb.agent_log().contains("following interfaces")
    });
    let log = tb.agent_log();
    assert!(
        log.lines()
            .any(|l| l.contains("earlier device of this name") && l.contains(&veth)),
        "stale pin not recognised:\n{log}"
    );
    for iface in tb.node_interfaces() {
        assert!(
            log.lines()
                .any(|l| l.contains("adopted pinned link") && l.contains(&iface)),
            "{iface}'s live pin not adopted:\n{log}"
        );
    }
    reaches_cluster_ip(&tb, &pod);
}

/// An interface no pattern names is left alone (and so cannot reach the ClusterIP); a
/// matching device without an Ethernet header (tun, L3) is skipped with a log line.
#[needs_root]
#[test]
fn unmatched_and_non_ethernet_interfaces_are_left_out() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    tb.start_agent_on("c*,b*,t*", FRONTENDS).expect("agent");
    let tun = format!("t{}", tb.id);
    ip(&tb.node_ns(), &format!("tuntap add dev {tun} mode tun")).expect("tun device");
    tb.wait_for("the tun device's skip line", || {
        tb.agent_log()
            .lines()
            .any(|l| l.contains("no Ethernet header") && l.contains(&tun))
    });
    assert!(
        !tb.classifier_pin(&tun).exists(),
        "tun device got the classifier"
    );

    let pod = tb.add_pod(0).expect("pod");
    thread::sleep(Duration::from_millis(300));
    assert!(
        !tb.classifier_pin(&tb.pod_interface(0)).exists(),
        "an unmatched interface got the classifier"
    );
    let attempts = tb
        .client_in(
            &pod,
            &[
                "--target",
                &target(VIP4, TCP_PORT),
                "--count",
                "3",
                "--timeout-ms",
                "300",
            ],
        )
        .expect("client");
    assert!(
        attempts.iter().all(|a| !a.ok),
        "the ClusterIP was reached without the classifier: {attempts:?}"
    );
}

/// `GET url` from inside the node's namespace (the agent's metrics listen there).
fn get_in_node(tb: &Testbed, url: &str) -> String {
    tb.get_in_node(url).expect(url)
}

fn attach_failures(tb: &Testbed) -> u64 {
    let metrics = get_in_node(tb, "http://127.0.0.1:10249/metrics");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("proxy_agent_interface_attach_failures_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no attach failure metric:\n{metrics}"))
}

/// An attachment that fails (here: something that is not a link squats on the pin's
/// path) is logged with the interface and counted, the other interfaces are served, and
/// the next change of the device retries it.
#[needs_root]
#[test]
fn attach_failure_is_logged_counted_and_retried() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    tb.start_agent_on("auto", FRONTENDS).expect("agent");
    assert_eq!(attach_failures(&tb), 0);
    let veth = tb.pod_interface(0);
    let squatter = tb.classifier_pin(&veth);
    std::fs::create_dir(&squatter).expect("squatting the pin path");

    let pod = tb.add_pod(0).expect("pod");
    tb.wait_for("the failure's log line", || {
        tb.agent_log()
            .lines()
            .any(|l| l.contains("classifier not attached") && l.contains(&veth))
    });
    assert!(attach_failures(&tb) >= 1, "{}", tb.agent_log());

    std::fs::remove_dir(&squatter).expect("freeing the pin path");
    ip(&tb.node_ns(), &format!("link set {veth} mtu 1400")).expect("changing the veth");
    tb.wait_for("the retried attachment", || squatter.exists());
    reaches_cluster_ip(&tb, &pod);
}
