//! A connect-time fuzzer. The kernel runs no `BPF_PROG_TEST_RUN` for cgroup sock_addr
//! programs, so the real connect4/connect6 hooks are driven by real connects: random
//! Services and EndpointSlices (ClusterIPs of both families, TCP and UDP ports, affinity,
//! internal traffic policies, endpoints ready or not, on this node or another) go through
//! the model, the view and the map writer's sock-frontend encoding into private maps
//! (`trace`), and random connects from a pod address — to frontends, to a ClusterIP's
//! other ports, to pods directly, to strangers — run in a throwaway namespace and cgroup
//! carrying only the hooks. What must hold for every connect:
//!
//! - no connect fails but as the design says (refused or denied for a frontend without
//!   endpoints, or for a ClusterIP's unknown port);
//! - a frontend with endpoints for pod traffic sends every connect to one of them, and
//!   to nothing else;
//! - a destination no frontend has is left alone (the socket's peer is what it asked).
//!
//! Root only. Bounded cases by default; `PROXY_FUZZ_CASES` (`cargo xtask fuzz`) runs a
//! 200th as many as the parsers' (each case is a child process and a namespace).

mod support;

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::atomic::{AtomicUsize, Ordering},
};

/// Connects sent to endpoints, refused, and left alone, over the run.
static SEEN: [AtomicUsize; 3] = [
    AtomicUsize::new(0),
    AtomicUsize::new(0),
    AtomicUsize::new(0),
];
/// Cases run again after an ENETUNREACH in the probe (see `check`).
static RETRIED: AtomicUsize = AtomicUsize::new(0);

use proptest::{prelude::*, sample::Index, test_runner::TestCaseError};
use proxy_agent::{
    model::{ClusterModel, FrontendKind, NodeInfo, Protocol, ViewConfig, node_view},
    trace::{
        self,
        scenario::{Case, Node, Packet, Verdict},
    },
};
use serde_json::{Value, json};
use support::fuzz_config_scaled;
use test_support::needs_root;

const VIPS: [&str; 4] = ["10.96.0.10", "10.96.0.11", "fd96::10", "fd96::11"];
/// (port, protocol, target port)
const PORTS: [(u16, &str, u16); 3] = [(80, "TCP", 8080), (53, "UDP", 5353), (443, "TCP", 8443)];
const POD4: &str = "10.244.0.5";
const POD6: &str = "fd00:244::5";

fn endpoint_ip(v6: bool, i: usize) -> String {
    if v6 {
        format!("fd00:244:1::{}", i + 1)
    } else {
        format!("10.244.1.{}", i + 1)
    }
}

/// One Service on one ClusterIP, its ports, affinity and policy, and its slice.
fn service() -> BoxedStrategy<(Value, Value)> {
    (
        0..VIPS.len(),
        prop::collection::btree_set(0..PORTS.len(), 1..=PORTS.len()),
        any::<bool>(),
        any::<bool>(),
        prop::collection::vec(
            (0..6usize, any::<bool>(), any::<bool>(), any::<bool>()),
            0..5,
        ),
    )
        .prop_map(|(vip, ports, affinity, local, endpoints)| {
            let ip = VIPS[vip];
            let v6 = ip.contains(':');
            let name = format!("s{vip}");
            let ports: Vec<_> = ports.into_iter().map(|p| PORTS[p]).collect();
            let mut spec = json!({
                "clusterIP": ip,
                "ports": ports.iter().map(|(port, proto, target)| json!({
                    "name": format!("p{port}"), "port": port, "protocol": proto,
                    "targetPort": target})).collect::<Vec<_>>(),
                "internalTrafficPolicy": if local { "Local" } else { "Cluster" },
            });
            if affinity {
                spec["sessionAffinity"] = json!("ClientIP");
            }
            let service = json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": "default"}, "spec": spec});
            let eps: Vec<_> = endpoints
                .into_iter()
                .map(|(i, ready, terminating, here)| {
                    json!({"addresses": [endpoint_ip(v6, i)],
                           "conditions": {"ready": ready, "serving": ready || terminating,
                                          "terminating": terminating},
                           "nodeName": if here { "node-a" } else { "node-b" }})
                })
                .collect();
            let slice = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{name}-1"), "namespace": "default",
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": if v6 { "IPv6" } else { "IPv4" },
                "ports": ports.iter().map(|(port, proto, target)| json!({
                    "name": format!("p{port}"), "port": target, "protocol": proto}))
                    .collect::<Vec<_>>(),
                "endpoints": eps});
            (service, slice)
        })
        .boxed()
}

/// Where a connect goes.
#[derive(Clone, Debug)]
enum Target {
    /// The `Index`th frontend of the view.
    Frontend(Index),
    /// A ClusterIP, on a port none of its Services has.
    OtherPort(usize, bool),
    /// A pod directly.
    Pod(bool, usize, bool),
    /// An address nothing knows.
    Stranger(u16, bool),
}

fn target() -> BoxedStrategy<Target> {
    prop_oneof![
        4 => any::<Index>().prop_map(Target::Frontend),
        1 => (0..VIPS.len(), any::<bool>()).prop_map(|(v, u)| Target::OtherPort(v, u)),
        1 => (any::<bool>(), 0..6usize, any::<bool>()).prop_map(|(f, i, u)| Target::Pod(f, i, u)),
        1 => (any::<u16>(), any::<bool>()).prop_map(|(n, f)| Target::Stranger(n, f)),
    ]
    .boxed()
}

fn node() -> Node {
    let net = |s: &str| s.parse().expect("cidr");
    Node {
        info: NodeInfo {
            name: "node-a".into(),
            addresses: vec![
                "192.0.2.10".parse().expect("ip"),
                "2001:db8::10".parse().expect("ip"),
            ],
            ..NodeInfo::default()
        },
        view: ViewConfig {
            pod_cidrs: vec![net("10.244.0.0/16"), net("fd00:244::/48")],
            ..ViewConfig::default()
        },
    }
}

fn check(objects: Vec<(Value, Value)>, targets: Vec<Target>) -> Result<(), TestCaseError> {
    let mut model = ClusterModel::default();
    for (svc, slice) in &objects {
        model.add_service(&serde_json::from_value(svc.clone()).expect("a Service"));
        model.add_slice(&serde_json::from_value(slice.clone()).expect("an EndpointSlice"));
    }
    let node = node();
    let (view, _) = node_view(&model, &node.info, &node.view);
    let frontends: Vec<_> = view
        .iter()
        .filter(|(_, st)| st.kind == FrontendKind::ClusterIp)
        .collect();
    let vips: BTreeSet<IpAddr> = frontends.iter().map(|(fe, _)| fe.ip).collect();
    let mut packets = Vec::new();
    for (n, t) in targets.iter().enumerate() {
        let (protocol, dst) = match t {
            Target::Frontend(i) if !frontends.is_empty() => {
                let (fe, _) = frontends[i.index(frontends.len())];
                (fe.protocol, SocketAddr::new(fe.ip, fe.port))
            }
            Target::Frontend(_) => continue,
            Target::OtherPort(v, udp) => (
                if *udp { Protocol::Udp } else { Protocol::Tcp },
                SocketAddr::new(VIPS[*v].parse().expect("ip"), 9999),
            ),
            Target::Pod(v6, i, udp) => (
                if *udp { Protocol::Udp } else { Protocol::Tcp },
                SocketAddr::new(endpoint_ip(*v6, *i).parse().expect("ip"), 8080),
            ),
            Target::Stranger(n, v6) => {
                let ip: IpAddr = if *v6 {
                    format!("fd97::{n:x}").parse().expect("ip")
                } else {
                    format!("10.97.{}.{}", n >> 8, n & 0xff)
                        .parse()
                        .expect("ip")
                };
                (Protocol::Tcp, SocketAddr::new(ip, 80))
            }
        };
        let src = if dst.is_ipv4() { POD4 } else { POD6 };
        packets.push(Packet {
            name: format!("c{n}"),
            protocol,
            src: src.parse().expect("ip"),
            src_port: None,
            dst,
            dsr: None,
            expect: None,
        });
    }
    if packets.is_empty() {
        return Ok(());
    }
    let case = Case {
        id: "fuzz".into(),
        node,
        model,
        packets: packets.clone(),
    };
    let opts = trace::TraceOptions {
        connect_probe: Some(PathBuf::from(env!("CARGO_BIN_EXE_proxy-agent"))),
        skip_tc: true,
    };
    // A connect in the probe's fresh namespace now and then fails ENETUNREACH on an IPv6
    // address it assigned (seen in long runs; `trace --path connect` on the same objects
    // does not repeat it; cause not found): run such a case once more, and count it.
    let mut outcomes = trace::run(std::slice::from_ref(&case), &opts);
    if outcomes
        .as_ref()
        .is_err_and(|e| format!("{e:#}").contains("Network is unreachable"))
    {
        RETRIED.fetch_add(1, Ordering::Relaxed);
        outcomes = trace::run(&[case], &opts);
    }
    let outcomes = outcomes
        .map_err(|e| TestCaseError::fail(format!("a connect failed against the design: {e:#}")))?;
    prop_assert_eq!(
        outcomes.len(),
        packets.len(),
        "every connect has an outcome"
    );
    for (i, o) in outcomes {
        let p = &packets[i];
        let seen = match o.verdict {
            Verdict::Dnat => 0,
            Verdict::Reject | Verdict::Drop => 1,
            Verdict::Accept | Verdict::Local => 2,
            // No packet here carries a direct-server-return option.
            Verdict::Learned => {
                return Err(TestCaseError::fail(format!(
                    "{o:?}: learned without an option"
                )));
            }
        };
        SEEN[seen].fetch_add(1, Ordering::Relaxed);
        let frontend = frontends.iter().find(|(fe, _)| {
            fe.ip == p.dst.ip() && fe.port == p.dst.port() && fe.protocol == p.protocol
        });
        let what = format!(
            "{:?} {} → {:?} {:?}",
            p.protocol, p.dst, o.verdict, o.endpoints
        );
        match frontend {
            Some((_, st)) => {
                // Pods' traffic: the internal set where the policies make one.
                let set = st.internal.as_deref().unwrap_or(&st.backends);
                let allowed: BTreeSet<SocketAddr> = set.endpoints.iter().collect();
                if allowed.is_empty() {
                    prop_assert!(
                        matches!(o.verdict, Verdict::Reject | Verdict::Drop),
                        "{what}: a frontend without endpoints"
                    );
                } else {
                    prop_assert_eq!(
                        o.verdict,
                        Verdict::Dnat,
                        "{}: endpoints {:?}",
                        what,
                        allowed
                    );
                    prop_assert!(
                        !o.endpoints.is_empty() && o.endpoints.iter().all(|e| allowed.contains(e)),
                        "{what}: sent outside {allowed:?}"
                    );
                }
            }
            None => {
                let refused_vip = vips.contains(&p.dst.ip())
                    && matches!(o.verdict, Verdict::Reject | Verdict::Drop);
                prop_assert!(
                    refused_vip || matches!(o.verdict, Verdict::Accept | Verdict::Local),
                    "{what}: no frontend, yet translated or refused"
                );
            }
        }
    }
    Ok(())
}

#[needs_root]
#[test]
fn random_connects_against_random_maps() {
    let mut runner = proptest::test_runner::TestRunner::new(fuzz_config_scaled(16, 200));
    let strategy = (
        prop::collection::vec(service(), 0..5),
        prop::collection::vec(target(), 1..6),
    );
    if let Err(e) = runner.run(&strategy, |(objects, targets)| check(objects, targets)) {
        panic!("{e}");
    }
    let n = |i: usize| SEEN[i].load(Ordering::Relaxed);
    eprintln!(
        "fuzz_connect: {} cases, connects sent to an endpoint {}, refused {}, left alone {}; \
         {} cases run again after an ENETUNREACH",
        runner.config().cases,
        n(0),
        n(1),
        n(2),
        RETRIED.load(Ordering::Relaxed)
    );
    assert!(
        n(0) > 0,
        "no connect was ever translated: the fuzzer checks nothing"
    );
}
