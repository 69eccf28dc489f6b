//! Fuzzing, on the stable toolchain, of everything that reads untrusted text: manifest files
//! into the model and this node's view, the API server's answers (list pages and watch
//! lines, mutated, through the agent's own client and source against the fake API
//! server), the config file, scenario files and `--packet` specs. Generated objects (ports 0, negative and past 65535, addresses with leading zeros,
//! IPv6, special and broken ones, "None", random conditions and nodePorts, duplicates,
//! values of the wrong type) and mutated real files. A bounded number of cases per run
//! (`PROXY_FUZZ_CASES` for more: `cargo xtask fuzz`); a failure prints its minimized input.

mod support;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use proptest::{prelude::*, sample::Index, test_runner::TestCaseError};
use proxy_agent::{
    config::{Config, MAX_SYNC_PERIOD, parse_duration},
    model::{
        ClusterModel, FrontendKind, NodeInfo, NodeView, ObjectRef, Rejection, ViewConfig,
        error::ObjectKind, node_view,
    },
    source::files::{self, ManifestError},
    trace,
};
use serde_json::{Map, Value, json};
use support::{fake_apiserver, fuzz_config, fuzz_config_scaled};

/// The longest Go duration: what a duration field may hold at most.
const GO_DURATION_MAX: Duration = Duration::from_nanos(i64::MAX as u64);

// ---- generators ---------------------------------------------------------------------

const NAMESPACES: [&str; 2] = ["default", "x"];
const SERVICE_NAMES: [&str; 4] = ["a", "b", "c", "web"];
/// Objects the isolation property adds: before and after the others in name order (the
/// first Service in that order keeps a contested VIP:port).
const BAD_NAMES: [&str; 2] = ["aaa-bad", "zzz-bad"];

fn select(items: &[&'static str]) -> BoxedStrategy<&'static str> {
    prop::sample::select(items.to_vec()).boxed()
}

fn text(items: &[&'static str]) -> BoxedStrategy<String> {
    select(items).prop_map(String::from).boxed()
}

/// Address text: the few addresses the objects share (so frontends collide and slices
/// match), random ones of both families, IPv4 with leading zeros, special addresses, and
/// garbage.
fn ip_text() -> BoxedStrategy<String> {
    prop_oneof![
        4 => text(&["10.96.0.10", "10.96.0.11", "fd96::10", "10.244.1.5", "10.244.1.6",
                    "fd00:244::5", "192.0.2.10", "2001:db8::10", "203.0.113.7"]),
        2 => any::<[u8; 4]>().prop_map(|o| Ipv4Addr::from(o).to_string()),
        1 => any::<[u8; 4]>()
            .prop_map(|o| format!("{:03}.{:02}.{}.{:04}", o[0], o[1], o[2], o[3])),
        1 => any::<[u8; 16]>().prop_map(|o| Ipv6Addr::from(o).to_string()),
        2 => text(&["127.0.0.1", "127.1.2.3", "0.0.0.0", "255.255.255.255", "224.0.0.1",
                    "239.1.1.1", "169.254.0.1", "::1", "::", "fe80::1", "ff02::1",
                    "::ffff:10.96.0.10", "None", "", " 10.96.0.10", "10.96.0.10 ",
                    "256.1.1.1", "1.2.3", "10.96.0.10/32", "0x0a.0.0.1", "010.096.000.010"]),
        1 => "[0-9a-f.:/ ]{0,24}",
        // Any text but control characters: libyaml refuses those in a file, even in JSON
        // strings (`\u{7f}` unescaped), which the mutated-file properties cover.
        1 => "\\PC{0,12}",
    ]
    .boxed()
}

/// Port numbers as JSON has them: the usual, the edges, and any 64-bit number.
fn port_number() -> BoxedStrategy<i64> {
    prop_oneof![
        4 => prop::sample::select(vec![80i64, 53, 443, 8080, 5353]),
        3 => prop::sample::select(vec![0i64, -1, 1, 22, 65535, 65536, 70000, 30000, 30080,
                                       32767, 32768, i64::from(i32::MAX),
                                       i64::from(i32::MIN), i64::MAX, 1 << 40]),
        1 => any::<i64>(),
        2 => 1..=65535i64,
    ]
    .boxed()
}

/// A value of the wrong type (or of none).
fn garbage() -> BoxedStrategy<Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        "\\PC{0,8}".prop_map(Value::from),
        Just(json!([])),
        Just(json!({})),
        Just(json!([1, "x", null])),
    ]
    .boxed()
}

/// Mostly `s`, now and then a value of the wrong type.
fn or_garbage(s: BoxedStrategy<Value>) -> BoxedStrategy<Value> {
    prop_oneof![14 => s, 1 => garbage()].boxed()
}

fn opt<T: std::fmt::Debug + 'static>(p: f64, s: BoxedStrategy<T>) -> BoxedStrategy<Option<T>> {
    prop::option::weighted(p, s).boxed()
}

/// Inserts the fields that are `Some`.
fn object(fields: Vec<(&str, Option<Value>)>) -> Value {
    let mut m = Map::new();
    for (k, v) in fields {
        if let Some(v) = v {
            m.insert(k.to_string(), v);
        }
    }
    Value::Object(m)
}

fn service_port() -> BoxedStrategy<Value> {
    (
        opt(0.5, text(&["http", "dns", "", "p"])),
        or_garbage(port_number().prop_map(Value::from).boxed()),
        opt(
            0.6,
            or_garbage(
                text(&["TCP", "UDP", "SCTP", "ICMP", "tcp", ""])
                    .prop_map(Value::from)
                    .boxed(),
            ),
        ),
        opt(0.4, or_garbage(port_number().prop_map(Value::from).boxed())),
        opt(
            0.5,
            prop_oneof![
                port_number().prop_map(Value::from),
                text(&["http", "dns", "", "x"]).prop_map(Value::from),
            ]
            .boxed(),
        ),
    )
        .prop_map(|(name, port, protocol, node_port, target)| {
            object(vec![
                ("name", name.map(Value::from)),
                ("port", Some(port)),
                ("protocol", protocol),
                ("nodePort", node_port),
                ("targetPort", target),
            ])
        })
        .boxed()
}

fn service_spec() -> BoxedStrategy<Value> {
    (
        opt(
            0.8,
            text(&[
                "ClusterIP",
                "NodePort",
                "LoadBalancer",
                "ExternalName",
                "Bogus",
            ]),
        ),
        opt(0.8, ip_text()),
        opt(0.3, prop::collection::vec(ip_text(), 0..3).boxed()),
        opt(
            0.9,
            or_garbage(
                prop::collection::vec(service_port(), 0..4)
                    .prop_map(Value::from)
                    .boxed(),
            ),
        ),
        opt(0.2, prop::collection::vec(ip_text(), 0..3).boxed()),
        opt(0.3, text(&["Local", "Cluster", "Bogus"])),
        opt(0.2, text(&["Local", "Cluster"])),
        opt(
            0.2,
            (text(&["ClientIP", "None"]), any::<Option<i32>>()).boxed(),
        ),
        opt(
            0.15,
            prop::collection::vec(
                prop_oneof![ip_text(), Just("10.0.0.0/8".to_string()), "[0-9./]{0,18}"],
                0..3,
            )
            .boxed(),
        ),
    )
        .prop_map(
            |(type_, cip, cips, ports, eips, etp, itp, affinity, ranges)| {
                object(vec![
                    ("type", type_.map(Value::from)),
                    ("clusterIP", cip.map(Value::from)),
                    ("clusterIPs", cips.map(Value::from)),
                    ("ports", ports),
                    ("externalIPs", eips.map(Value::from)),
                    ("externalTrafficPolicy", etp.map(Value::from)),
                    ("internalTrafficPolicy", itp.map(Value::from)),
                    (
                        "sessionAffinity",
                        affinity.as_ref().map(|a| Value::from(a.0.clone())),
                    ),
                    (
                        "sessionAffinityConfig",
                        affinity.map(|a| json!({"clientIP": {"timeoutSeconds": a.1}})),
                    ),
                    ("loadBalancerSourceRanges", ranges.map(Value::from)),
                ])
            },
        )
        .boxed()
}

fn service(names: &'static [&'static str]) -> BoxedStrategy<Value> {
    (
        select(names),
        select(&NAMESPACES),
        prop::bool::weighted(0.05),
        or_garbage(service_spec()),
        opt(
            0.2,
            prop::collection::vec((ip_text(), opt(0.3, text(&["VIP", "Proxy"]))), 0..3).boxed(),
        ),
    )
        .prop_map(|(name, namespace, other_proxy, spec, ingress)| {
            let mut meta = json!({"name": name, "namespace": namespace});
            if other_proxy {
                meta["labels"] = json!({"service.kubernetes.io/service-proxy-name": "other"});
            }
            let mut svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": meta,
                                 "spec": spec});
            if let Some(ingress) = ingress {
                let ingress: Vec<Value> = ingress
                    .into_iter()
                    .map(|(ip, mode)| {
                        object(vec![
                            ("ip", Some(ip.into())),
                            ("ipMode", mode.map(Value::from)),
                        ])
                    })
                    .collect();
                svc["status"] = json!({"loadBalancer": {"ingress": ingress}});
            }
            svc
        })
        .boxed()
}

fn endpoint() -> BoxedStrategy<Value> {
    (
        or_garbage(
            prop::collection::vec(ip_text(), 0..3)
                .prop_map(Value::from)
                .boxed(),
        ),
        opt(
            0.6,
            (
                any::<Option<bool>>(),
                any::<Option<bool>>(),
                any::<Option<bool>>(),
            )
                .boxed(),
        ),
        opt(0.5, text(&["node-a", "node-b"])),
        opt(0.1, text(&["zone-a", "zone-b"])),
    )
        .prop_map(|(addresses, cond, node, zone)| {
            object(vec![
                ("addresses", Some(addresses)),
                (
                    "conditions",
                    cond.map(|(r, s, t)| {
                        object(vec![
                            ("ready", r.map(Value::from)),
                            ("serving", s.map(Value::from)),
                            ("terminating", t.map(Value::from)),
                        ])
                    }),
                ),
                ("nodeName", node.map(Value::from)),
                ("hints", zone.map(|z| json!({"forZones": [{"name": z}]}))),
            ])
        })
        .boxed()
}

fn slice(owners: &'static [&'static str]) -> BoxedStrategy<Value> {
    (
        select(&["1", "2"]),
        select(&NAMESPACES),
        select(owners),
        or_garbage(
            text(&["IPv4", "IPv6", "FQDN", "ipv4"])
                .prop_map(Value::from)
                .boxed(),
        ),
        or_garbage(
            prop::collection::vec(
                (
                    opt(0.5, text(&["http", "dns", "", "p"])),
                    opt(0.9, or_garbage(port_number().prop_map(Value::from).boxed())),
                    opt(0.5, text(&["TCP", "UDP", "SCTP", "ICMP"])),
                )
                    .prop_map(|(name, port, protocol)| {
                        object(vec![
                            ("name", name.map(Value::from)),
                            ("port", port),
                            ("protocol", protocol.map(Value::from)),
                        ])
                    }),
                0..3,
            )
            .prop_map(Value::from)
            .boxed(),
        ),
        prop::collection::vec(endpoint(), 0..5),
    )
        .prop_map(|(n, namespace, owner, family, ports, endpoints)| {
            json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"name": format!("{owner}-{n}"), "namespace": namespace,
                             "labels": {"kubernetes.io/service-name": owner}},
                "addressType": family,
                "ports": ports,
                "endpoints": endpoints,
            })
        })
        .boxed()
}

/// Services and slices of the usual names, and now and then an object of another kind.
fn objects() -> BoxedStrategy<Vec<Value>> {
    prop::collection::vec(
        prop_oneof![
            5 => service(&SERVICE_NAMES),
            5 => slice(&SERVICE_NAMES),
            1 => Just(json!({"apiVersion": "v1", "kind": "Servce", "metadata": {"name": "typo"}})),
            1 => Just(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}})),
        ],
        0..10,
    )
    .boxed()
}

/// How objects are written into a file.
#[derive(Clone, Copy, Debug)]
enum Layout {
    JsonDocuments,
    YamlDocuments,
    List,
}

fn layout() -> BoxedStrategy<Layout> {
    prop_oneof![
        Just(Layout::JsonDocuments),
        Just(Layout::YamlDocuments),
        Just(Layout::List)
    ]
    .boxed()
}

fn render(objects: &[Value], layout: Layout) -> String {
    match layout {
        Layout::JsonDocuments => objects
            .iter()
            .map(|o| format!("{o}\n"))
            .collect::<Vec<_>>()
            .join("---\n"),
        Layout::YamlDocuments => objects
            .iter()
            .map(|o| serde_norway::to_string(o).expect("YAML of JSON"))
            .collect::<Vec<_>>()
            .join("---\n"),
        Layout::List => {
            format!(
                "{}\n",
                json!({"apiVersion": "v1", "kind": "List", "items": objects})
            )
        }
    }
}

/// This node and its settings.
fn setting() -> BoxedStrategy<(NodeInfo, ViewConfig)> {
    (
        prop::sample::select(vec![
            (30000u16, 32767u16),
            (1, 65535),
            (80, 80),
            (30080, 30090),
        ]),
        any::<bool>(),
        prop::sample::select(vec![
            vec![],
            vec!["192.0.2.0/24"],
            vec!["0.0.0.0/0", "::/0"],
            vec!["127.0.0.0/8"],
        ]),
        any::<bool>(),
        prop::bool::weighted(0.2),
    )
        .prop_map(|(range, localhost, npa, primary, named)| {
            let node = NodeInfo {
                name: "node-a".into(),
                addresses: vec![
                    "192.0.2.10".parse().expect("ip"),
                    "2001:db8::10".parse().expect("ip"),
                ],
                ..NodeInfo::default()
            };
            let cfg = ViewConfig {
                node_port_range: range,
                localhost_node_ports: localhost,
                node_port_addresses: npa.iter().map(|n| n.parse().expect("cidr")).collect(),
                node_port_primary: primary,
                service_proxy_name: named.then(|| "other".to_string()),
                // The BPF dataplane's limit, as the runner gives it to the view.
                max_endpoints: proxy_common::MAX_BACKENDS_PER_SERVICE as usize,
                ..ViewConfig::default()
            };
            (node, cfg)
        })
        .boxed()
}

/// Random edits of a file's bytes: flips, YAML's meaningful tokens inserted, ranges
/// deleted or repeated, truncation.
#[derive(Clone, Debug)]
enum Edit {
    Byte(Index, u8),
    Insert(Index, &'static str),
    Delete(Index, usize),
    Repeat(Index, usize, Index),
    Truncate(Index),
}

fn edits() -> BoxedStrategy<Vec<Edit>> {
    let token = select(&[
        "{",
        "[",
        "}",
        "]",
        ":",
        ": ",
        "- ",
        "\n",
        "---\n",
        "&a ",
        "*a",
        "<<: *a\n",
        "!!binary ",
        "!!str ",
        "'",
        "\"",
        "#",
        "  ",
        "\t",
        "null",
        "~",
        "0x1F",
        "-1",
        "1e400",
        "99999999999999999999",
        "None",
        "?",
        "|\n",
        ">-\n",
        "\u{feff}",
        "\u{0}",
        "\\",
        "%YAML 1.1\n",
        "...\n",
    ]);
    prop::collection::vec(
        prop_oneof![
            3 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Edit::Byte(i, b)),
            3 => (any::<Index>(), token).prop_map(|(i, t)| Edit::Insert(i, t)),
            2 => (any::<Index>(), 1..64usize).prop_map(|(i, n)| Edit::Delete(i, n)),
            1 => (any::<Index>(), 1..256usize, any::<Index>())
                .prop_map(|(i, n, to)| Edit::Repeat(i, n, to)),
            1 => any::<Index>().prop_map(Edit::Truncate),
        ],
        1..8,
    )
    .boxed()
}

fn apply(mut bytes: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let at = |i: &Index, len: usize| i.index(len + 1);
        match e {
            Edit::Byte(i, b) if !bytes.is_empty() => {
                let n = i.index(bytes.len());
                bytes[n] = *b;
            }
            Edit::Byte(..) => {}
            Edit::Insert(i, t) => {
                let n = at(i, bytes.len());
                bytes.splice(n..n, t.bytes());
            }
            Edit::Delete(i, len) => {
                let n = at(i, bytes.len());
                let end = (n + len).min(bytes.len());
                bytes.drain(n..end);
            }
            Edit::Repeat(i, len, to) => {
                let n = at(i, bytes.len());
                let end = (n + len).min(bytes.len());
                let piece: Vec<u8> = bytes[n..end].to_vec();
                let to = at(to, bytes.len());
                bytes.splice(to..to, piece);
            }
            Edit::Truncate(i) => {
                let n = at(i, bytes.len());
                bytes.truncate(n);
            }
        }
    }
    bytes
}

fn read(path: &str) -> Vec<u8> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

// ---- what must hold -------------------------------------------------------------------

/// What the API server accepts as a Service VIP: nothing that takes over the node's own
/// traffic (loopback, unspecified) or reaches many hosts (broadcast, multicast,
/// link-local). Written as ranges, apart from the agent's own check.
fn unicast(ip: IpAddr) -> bool {
    const SPECIAL: [&str; 9] = [
        "127.0.0.0/8",
        "0.0.0.0/32",
        "255.255.255.255/32",
        "224.0.0.0/4",
        "169.254.0.0/16",
        "::1/128",
        "::/128",
        "ff00::/8",
        "fe80::/10",
    ];
    !SPECIAL
        .iter()
        .any(|n| n.parse::<ipnet::IpNet>().expect("CIDR").contains(&ip))
}

/// Whether this node must program the Service or refuse it by name: ours, not
/// ExternalName, not headless, with ports (a Service without a spec must be refused).
fn must_be_accounted(svc: &proxy_agent::model::ServiceInfo, cfg: &ViewConfig) -> bool {
    if svc
        .rare
        .proxy_name
        .as_ref()
        .is_some_and(|l| cfg.service_proxy_name.as_deref() != Some(l.as_str()))
        || svc.external_name
    {
        return false;
    }
    if svc.rare.invalid.is_some() {
        return true;
    }
    !svc.ports.is_empty() && !svc.cluster_ips.is_empty()
}

/// The node view of `model`, checked: every frontend a real port and a unicast VIP (or,
/// for NodePorts, a node address in the node-port range), every backend a port and the
/// frontend's family, every refusal named, and every Service this node serves either
/// programmed or refused — never dropped without a word.
fn checked_view(
    model: &ClusterModel,
    node: &NodeInfo,
    cfg: &ViewConfig,
) -> Result<(NodeView, Vec<Rejection>), TestCaseError> {
    let (view, rejected) = node_view(model, node, cfg);
    for (fe, st) in &view {
        prop_assert!(fe.port != 0, "{fe}: port 0 ({})", st.service);
        if st.kind == FrontendKind::NodePort {
            prop_assert!(
                (cfg.node_port_range.0..=cfg.node_port_range.1).contains(&fe.port),
                "{fe}: NodePort outside {:?} ({})",
                cfg.node_port_range,
                st.service
            );
            let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
            prop_assert!(
                node.addresses.contains(&fe.ip) || (cfg.localhost_node_ports && fe.ip == loopback),
                "{fe}: NodePort on an address that is not the node's ({})",
                st.service
            );
        } else {
            prop_assert!(
                unicast(fe.ip),
                "{fe}: {:?} frontend of {} on an address a Service cannot have",
                st.kind,
                st.service
            );
        }
        for set in std::iter::once(&st.backends).chain(st.internal.as_deref()) {
            prop_assert!(set.endpoints.len() <= cfg.max_endpoints);
            for ep in &set.endpoints {
                prop_assert!(ep.port() != 0, "{fe}: backend {ep} with port 0");
                prop_assert_eq!(ep.is_ipv4(), fe.ip.is_ipv4(), "{}: backend {}", fe, ep);
            }
        }
    }
    for r in &rejected {
        prop_assert!(
            matches!(r.kind, ObjectKind::Service | ObjectKind::EndpointSlice),
            "{r:?}"
        );
        prop_assert!(!r.object.name.is_empty() && !r.reason.is_empty(), "{r:?}");
    }
    for (sref, svc) in model.services() {
        if !must_be_accounted(svc, cfg) {
            continue;
        }
        let prefix = format!("{sref}:");
        let programmed = view.values().any(|st| st.service.starts_with(&prefix));
        let refused = rejected
            .iter()
            .any(|r| r.kind == ObjectKind::Service && &r.object == sref);
        prop_assert!(
            programmed || refused,
            "{sref} neither programmed nor refused: {:?}",
            svc
        );
    }
    Ok((view, rejected))
}

/// Every object that did not fit its kind is named: `Service NAME: ...`.
fn check_named(errors: &[ManifestError]) -> Result<(), TestCaseError> {
    for e in errors {
        let ManifestError::Parse { message, .. } = e else {
            return Err(TestCaseError::fail(format!("not a parse error: {e}")));
        };
        prop_assert!(
            message.starts_with("Service ") || message.starts_with("EndpointSlice "),
            "{e}"
        );
    }
    Ok(())
}

fn parse_text(text: &str) -> (ClusterModel, Vec<ManifestError>) {
    let mut model = ClusterModel::default();
    let mut errors = Vec::new();
    files::add_documents(
        &mut model,
        &mut files::Nodes::new(),
        &mut errors,
        Path::new("fuzz.yaml"),
        text,
    );
    (model, errors)
}

/// A file of this test process (the parser reads paths).
fn scratch_file() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("proxy-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir.join(format!("{}.yaml", N.fetch_add(1, Ordering::Relaxed)))
}

fn parse_bytes(bytes: &[u8]) -> files::ParsedFile {
    let path = scratch_file();
    std::fs::write(&path, bytes).expect("write");
    let parsed = files::parse_file(&path);
    let _ = std::fs::remove_file(&path);
    parsed
}

/// An object of `BAD_NAMES` that the API server would refuse as a whole.
fn invalid_object() -> BoxedStrategy<Value> {
    let bad_service = (service(&BAD_NAMES), 0..7u8, ip_text()).prop_map(|(mut svc, how, ip)| {
        // Served by us, so that only its invalidity keeps it out.
        svc["metadata"]["labels"] = json!({});
        if !svc["spec"].is_object() {
            svc["spec"] = json!({});
        }
        let spec = &mut svc["spec"];
        spec["type"] = json!("NodePort");
        if !spec["ports"].is_array() {
            spec["ports"] = json!([{"port": 80}]);
        }
        match how {
            0 => {
                spec["clusterIP"] = json!(format!("not-an-ip{ip}"));
                spec.as_object_mut()
                    .expect("an object")
                    .remove("clusterIPs");
            }
            1 => {
                let special = ["127.0.0.1", "::1", "224.0.0.1", "0.0.0.0"][ip.len() % 4];
                spec["clusterIPs"] = json!([special]);
            }
            // (A nodePort out of range costs only that NodePort: not refused whole.)
            2 => spec["clusterIPs"] = json!(["10.96.7.1", "10.96.7.2"]),
            3 => {
                let p = json!({"port": 80, "protocol": "TCP"});
                spec["ports"] = json!([p.clone(), p]);
            }
            4 => spec["clusterIPs"] = json!(["None", "10.96.0.10"]),
            5 => spec["ports"] = json!("eighty"),
            _ => spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": "x"}}),
        }
        svc
    });
    prop_oneof![4 => bad_service, 1 => slice(&BAD_NAMES)].boxed()
}

// ---- the API server's answers ---------------------------------------------------------

/// One runtime for every case: the fake API server and the agent's source run on it.
fn api_runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    })
}

/// A list page as the API server writes it.
fn list_body(kind: fake_apiserver::Kind, objects: &[Value]) -> Vec<u8> {
    let (list, api) = match kind {
        fake_apiserver::Kind::EndpointSlices => ("EndpointSliceList", "discovery.k8s.io/v1"),
        _ => ("ServiceList", "v1"),
    };
    json!({"kind": list, "apiVersion": api, "metadata": {"resourceVersion": "150"},
           "items": objects})
    .to_string()
    .into_bytes()
}

/// Watch lines about `objects`: added, modified, deleted in turn, a bookmark, and now
/// and then a 410 or 429 ERROR.
fn watch_lines(objects: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, o) in objects.iter().enumerate() {
        let mut o = o.clone();
        o["metadata"]["resourceVersion"] = json!((160 + i).to_string());
        let line = match i % 5 {
            3 => {
                json!({"type": "BOOKMARK", "object": {"kind": o["kind"], "apiVersion": o["apiVersion"],
                        "metadata": {"resourceVersion": (160 + i).to_string()}}})
            }
            4 => json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                        "status": "Failure", "reason": "Expired",
                        "code": if i % 2 == 0 { 410 } else { 429 }}}),
            n => {
                let type_ = ["ADDED", "MODIFIED", "DELETED"][n];
                json!({"type": type_, "object": o})
            }
        };
        out.extend_from_slice(line.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

/// What the source's model must come to hold of the server's objects, by the path the
/// source takes (k8s-openapi's decoding, then the model's), and the objects it may hold
/// any version of: named ones that do not decode keep their last readable version, which
/// a mutated answer may have been.
fn expected_model(
    services: &[Value],
    slices: &[Value],
) -> (ClusterModel, std::collections::BTreeSet<ObjectRef>) {
    let selected = |o: &Value| {
        let labels = &o["metadata"]["labels"];
        labels
            .get("service.kubernetes.io/service-proxy-name")
            .is_none()
            && labels.get("service.kubernetes.io/headless").is_none()
    };
    let mut model = ClusterModel::default();
    let mut any_version = std::collections::BTreeSet::new();
    let reference = |o: &Value| ObjectRef {
        namespace: o["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .into(),
        name: o["metadata"]["name"].as_str().unwrap_or("<unnamed>").into(),
    };
    for o in services.iter().filter(|o| selected(o)) {
        match serde_json::from_value::<k8s_openapi::api::core::v1::Service>(o.clone()) {
            Ok(svc) => {
                model.add_service(&svc);
            }
            Err(_) => {
                any_version.insert(reference(o));
            }
        }
    }
    for o in slices.iter().filter(|o| selected(o)) {
        match serde_json::from_value::<k8s_openapi::api::discovery::v1::EndpointSlice>(o.clone()) {
            Ok(slice) => {
                model.add_slice(&slice);
            }
            Err(_) => {
                any_version.insert(reference(o));
            }
        }
    }
    (model, any_version)
}

/// The model's content, leaving out `any_version`'s objects.
fn comparable(
    model: &ClusterModel,
    any_version: &std::collections::BTreeSet<ObjectRef>,
) -> (Vec<String>, Vec<String>) {
    let services = model
        .services()
        .filter(|(r, _)| !any_version.contains(*r))
        .map(|(r, s)| format!("{r} {s:?}"))
        .collect();
    let slices = model
        .slices()
        .filter(|(k, _)| !any_version.contains(&k.object()))
        .map(|(k, s)| format!("{k:?} {s:?}"))
        .collect();
    (services, slices)
}

/// The objects the server holds once stored (one per namespace/name, the last).
fn stored(objects: Vec<Value>) -> Vec<Value> {
    let mut by_key = std::collections::BTreeMap::new();
    for o in objects {
        let key = format!(
            "{}/{}",
            o["metadata"]["namespace"].as_str().unwrap_or(""),
            o["metadata"]["name"].as_str().unwrap_or("")
        );
        by_key.insert(key, o);
    }
    by_key.into_values().collect()
}

/// Mutated answers — a list page and the head of a watch — reach the agent's own client
/// and source; then a clean relist of every resource. No panic, no stall: the model comes
/// to hold exactly what the server holds.
fn check_api_answers(
    objects: Vec<Value>,
    list_edits: &[Edit],
    watch_edits: &[Edit],
    slices_first: bool,
) -> Result<(), TestCaseError> {
    use fake_apiserver::{FakeApiServer, Kind};
    use proxy_agent::source;
    let (slices, services): (Vec<Value>, Vec<Value>) = objects
        .into_iter()
        .partition(|o| o["kind"] == "EndpointSlice");
    // Objects of other kinds go in as Services: what a broken server might serve.
    let (services, slices) = (stored(services), stored(slices));
    let (target, of_kind) = if slices_first {
        (Kind::EndpointSlices, &slices)
    } else {
        (Kind::Services, &services)
    };
    let (want, any_version) = expected_model(&services, &slices);
    let want = comparable(&want, &any_version);
    let list = apply(list_body(target, of_kind), list_edits);
    let lines = apply(watch_lines(of_kind), watch_edits);
    api_runtime().block_on(async {
        let server = FakeApiServer::start().await;
        server.apply(
            Kind::Nodes,
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
                   "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}}),
        );
        server.preload(Kind::Services, services.clone());
        server.preload(Kind::EndpointSlices, slices.clone());
        server.raw_list(target, list);
        server.raw_watch(target, lines);
        let counters = source::api_server::ApiCounters::default();
        let client = source::api_server::client(server.config(), &counters)
            .map_err(|e| TestCaseError::fail(format!("client: {e:#}")))?;
        let (tx, rx) = tokio::sync::watch::channel(None);
        let running = tokio::spawn(source::kube::run(
            client,
            source::kube::KubeOptions {
                node_name: "node-a".into(),
                label_selector: source::kube::label_selector(None),
                counters,
                backoff: source::kube::Backoff::with_delays(
                    Duration::from_millis(1),
                    Duration::from_millis(20),
                ),
                all_nodes: false,
                without_own_node: false,
                stream_first_list: false,
                health: Default::default(),
            },
            tx,
        ));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while server.raw_pending() > 0 {
            if tokio::time::Instant::now() > deadline {
                running.abort();
                return Err(TestCaseError::fail("the raw answers were never asked for"));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Whatever the mutated answers left, a clean relist of everything must replace it.
        server.expire_history();
        server.break_watches();
        let lists_before =
            server.lists_completed("services") + server.lists_completed("endpointslices");
        let mut got = None;
        loop {
            let relisted = server.lists_completed("services")
                + server.lists_completed("endpointslices")
                >= lists_before + 2;
            if relisted && let Some(snapshot) = rx.borrow().as_ref() {
                let now = comparable(&snapshot.model, &any_version);
                if now == want {
                    break;
                }
                got = Some(now);
            }
            if tokio::time::Instant::now() > deadline {
                running.abort();
                return Err(TestCaseError::fail(format!(
                    "the source never came to hold the server's objects: want {want:?}, \
                     got {got:?} (relisted: {relisted})"
                )));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        running.abort();
        server.shutdown();
        Ok(())
    })
}

proptest! {
    // Each case starts a server and the source: a tenth as many cases as the parsers'.
    #![proptest_config(fuzz_config_scaled(48, 10))]

    /// List pages and watch lines as a broken or hostile API server sends them.
    #[test]
    fn api_server_answers_never_stall_the_source(objects in objects(), list_edits in edits(),
                                                 watch_edits in edits(),
                                                 slices_first in any::<bool>()) {
        check_api_answers(objects, &list_edits, &watch_edits, slices_first)?;
    }
}

// ---- properties -----------------------------------------------------------------------

proptest! {
    #![proptest_config(fuzz_config(512))]

    /// Generated Services and EndpointSlices, of every layout a file may have.
    #[test]
    fn manifests_become_a_valid_view(objects in objects(), layout in layout(),
                                     (node, cfg) in setting()) {
        let (model, errors) = parse_text(&render(&objects, layout));
        check_named(&errors)?;
        checked_view(&model, &node, &cfg)?;
    }

    /// Bad input never corrupts others' entries: adding an object the API server would
    /// refuse (of a Service of its own) leaves the view and every other refusal as they
    /// were, and the object is refused by name.
    #[test]
    fn an_invalid_object_changes_nothing_else(objects in objects(), bad in invalid_object(),
                                              at in any::<Index>(), layout in layout(),
                                              (node, cfg) in setting()) {
        let (model, errors) = parse_text(&render(&objects, layout));
        let (view, rejected) = checked_view(&model, &node, &cfg)?;
        let mut with_bad = objects.clone();
        with_bad.insert(at.index(objects.len() + 1), bad.clone());
        let (model2, errors2) = parse_text(&render(&with_bad, layout));
        check_named(&errors2)?;
        let (view2, rejected2) = checked_view(&model2, &node, &cfg)?;
        prop_assert_eq!(&view, &view2);
        let is_bad = |o: &ObjectRef| BAD_NAMES.iter().any(|b| o.name.starts_with(b));
        let others: Vec<&Rejection> = rejected2.iter().filter(|r| !is_bad(&r.object)).collect();
        prop_assert_eq!(rejected.iter().collect::<Vec<_>>(), others);
        let messages = |es: &[ManifestError]| -> Vec<String> {
            es.iter()
                .map(|e| match e {
                    ManifestError::Parse { message, .. } => message.clone(),
                    other => other.to_string(),
                })
                .filter(|m| !BAD_NAMES.iter().any(|b| m.contains(b)))
                .collect()
        };
        prop_assert_eq!(messages(&errors), messages(&errors2));
        if bad["kind"] == "Service" {
            let named = rejected2.iter().any(|r| is_bad(&r.object))
                || errors2.iter().any(|e| BAD_NAMES.iter().any(|b| e.to_string().contains(b)));
            prop_assert!(named, "{bad} was neither refused nor reported");
        }
    }

    /// Real manifests, mutated: parsed (or refused) without a panic, through the file
    /// reader with its size and depth bounds, into a valid view.
    #[test]
    fn mutated_manifest_files(seed in 0..3usize, generated in objects(), edits in edits(),
                              (node, cfg) in setting()) {
        let base = match seed {
            0 => read("deploy/examples/web.yaml"),
            1 => read("deploy/examples/empty.yaml"),
            _ => render(&generated, Layout::YamlDocuments).into_bytes(),
        };
        let parsed = parse_bytes(&apply(base, &edits));
        for e in &parsed.errors {
            prop_assert!(e.to_string().contains("proxy-fuzz-"), "error without its file: {e}");
        }
        checked_view(&parsed.model, &node, &cfg)?;
    }

    /// The config file: kubeadm's, mutated, and generated ones with random durations.
    #[test]
    fn mutated_config_files(edits in edits()) {
        let bytes = apply(read("proxy-agent/tests/data/kubeadm-kube-proxy-config.conf"), &edits);
        check_config(&String::from_utf8_lossy(&bytes))?;
    }

    #[test]
    fn generated_config_files(cfg in config_text()) {
        check_config(&cfg)?;
    }

    /// Go durations: never a panic; what is accepted fits a Go duration; whole hours,
    /// minutes and seconds read exactly.
    #[test]
    fn durations(s in duration_text(), h in 0u64..3_000_000, m in 0u64..100_000,
                 sec in 0u64..100_000) {
        if let Ok(d) = parse_duration(&s) {
            prop_assert!(d <= GO_DURATION_MAX, "{s:?} read as {d:?}");
        }
        let want = h * 3600 + m * 60 + sec;
        let got = parse_duration(&format!("{h}h{m}m{sec}s"));
        if Duration::from_secs(want) <= Duration::from_secs(9_223_372_036) {
            prop_assert_eq!(got, Ok(Duration::from_secs(want)));
        } else {
            prop_assert!(got.is_err());
        }
    }

    /// Scenario files: generated (objects as above, packets with any ports and
    /// addresses) and the project's own, mutated.
    #[test]
    fn generated_scenarios(file in scenario_file()) {
        check_scenarios(&file.to_string())?;
    }

    #[test]
    fn mutated_scenarios(seed in 0..2usize, edits in edits()) {
        let base = read(["tests/scenarios/kube-proxy-parity.json",
                         "tests/scenarios/shared-examples.json"][seed]);
        check_scenarios(&String::from_utf8_lossy(&apply(base, &edits)))?;
    }

    /// `--packet` specs.
    #[test]
    fn packet_specs(spec in packet_spec()) {
        if let Ok(p) = trace::parse_packet_spec(&spec) {
            prop_assert_eq!(p.src.is_ipv4(), p.dst.is_ipv4(), "{}", spec);
        }
    }
}

fn check_config(text: &str) -> Result<(), TestCaseError> {
    let Ok((cfg, _warnings)) = Config::from_text(text) else {
        return Ok(());
    };
    let ct = &cfg.conntrack;
    for d in [
        ct.tcp_syn,
        ct.tcp_established,
        ct.tcp_close_wait,
        ct.udp,
        ct.udp_stream,
    ] {
        prop_assert!(
            !d.is_zero() && d <= GO_DURATION_MAX,
            "conntrack timeout {d:?}"
        );
    }
    let (lo, hi) = cfg.node_port_range;
    prop_assert!(lo >= 1 && lo <= hi, "nodePortRange {lo}-{hi}");
    let (lo, hi) = ct.masquerade_ports;
    prop_assert!(lo >= 1024 && lo <= hi, "masqueradePortRange {lo}-{hi}");
    if cfg.validate().is_ok() {
        prop_assert!(cfg.sync_period <= MAX_SYNC_PERIOD && cfg.min_sync_period <= MAX_SYNC_PERIOD);
        let (m, n) = (ct.masquerade_ports, cfg.node_port_range);
        prop_assert!(
            m.1 < n.0 || n.1 < m.0,
            "masquerade ports {m:?} overlap NodePorts {n:?}"
        );
    }
    Ok(())
}

fn duration_text() -> BoxedStrategy<String> {
    prop_oneof![
        (
            0u64..100_000,
            select(&["h", "m", "s", "ms", "us", "µs", "ns", "d", ""])
        )
            .prop_map(|(n, u)| format!("{n}{u}")),
        any::<u64>().prop_map(|n| format!("{n}h")),
        (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(h, m, s)| format!("{h}h{m}m{s}s")),
        text(&[
            "0",
            "0s",
            "",
            " ",
            "-1s",
            "1.5h",
            ".5s",
            "5.s",
            ".",
            "1e3s",
            "inf",
            "NaNs",
            "9223372036854775807ns",
            "2562047h47m16.854775807s",
            "2562047h47m16.854775808s",
            "2562047788015215h",
            "99999999999999999999999h",
            "4000000000000000h",
            "1..1s",
            "s",
            "h1",
            "1d",
            "1h-1m",
            "+1s",
            "1h 1m"
        ]),
        "[0-9.hmsuµn]{0,16}",
        any::<f64>().prop_map(|f| format!("{f}s")),
        any::<String>(),
    ]
    .boxed()
}

/// A KubeProxyConfiguration with a random choice of fields, values of the right type
/// mostly and of the wrong one now and then.
fn config_text() -> BoxedStrategy<String> {
    let dur = || {
        opt(
            0.4,
            or_garbage(duration_text().prop_map(Value::from).boxed()),
        )
    };
    let cidr = prop_oneof![
        ip_text(),
        (ip_text(), any::<u8>()).prop_map(|(ip, len)| format!("{ip}/{len}")),
        text(&[
            "10.244.0.0/16",
            "10.244.0.0/16,fd00::/48",
            "primary",
            "all",
            "localhost"
        ]),
    ];
    let range = prop_oneof![
        (any::<u16>(), any::<u16>()).prop_map(|(a, b)| format!("{a}-{b}")),
        (port_number(), port_number()).prop_map(|(a, b)| format!("{a}-{b}")),
        text(&["", "-", "1-", "20000-29999", "30000-32767"]),
    ];
    (
        (
            opt(0.9, text(&["KubeProxyConfiguration", "Other", ""])),
            opt(0.3, cidr.clone().boxed()),
            opt(
                0.3,
                text(&["ClusterCIDR", "NodeCIDR", "BridgeInterface", "x", ""]),
            ),
            dur(),
            dur(),
            dur(),
            dur(),
        ),
        (
            dur(),
            dur(),
            opt(0.3, or_garbage(any::<i64>().prop_map(Value::from).boxed())),
            opt(0.3, or_garbage(any::<i64>().prop_map(Value::from).boxed())),
            opt(0.3, prop::collection::vec(cidr, 0..4).boxed()),
            opt(0.3, range.clone().boxed()),
            opt(0.3, range.boxed()),
            opt(0.2, text(&["auto", "tcx", "clsact", "x"])),
        ),
    )
        .prop_map(
            |((kind, cidr, mode, sync, min_sync, ipt_sync, ipt_min), rest)| {
                let (est, udp, per_core, min, npa, npr, mpr, attach) = rest;
                let c = object(vec![
                    ("kind", kind.map(Value::from)),
                    (
                        "apiVersion",
                        Some("kubeproxy.config.k8s.io/v1alpha1".into()),
                    ),
                    ("clusterCIDR", cidr.map(Value::from)),
                    ("detectLocalMode", mode.map(Value::from)),
                    ("syncPeriod", sync),
                    ("minSyncPeriod", min_sync),
                    (
                        "iptables",
                        Some(object(vec![
                            ("syncPeriod", ipt_sync),
                            ("minSyncPeriod", ipt_min),
                        ])),
                    ),
                    (
                        "conntrack",
                        Some(object(vec![
                            ("tcpEstablishedTimeout", est),
                            ("udpTimeout", udp),
                            ("maxPerCore", per_core),
                            ("min", min),
                        ])),
                    ),
                    ("nodePortAddresses", npa.map(Value::from)),
                    (
                        "ebpf",
                        Some(object(vec![
                            ("nodePortRange", npr.map(Value::from)),
                            ("masqueradePortRange", mpr.map(Value::from)),
                            ("tcAttach", attach.map(Value::from)),
                        ])),
                    ),
                ]);
                serde_norway::to_string(&c).expect("YAML of JSON")
            },
        )
        .boxed()
}

fn check_scenarios(text: &str) -> Result<(), TestCaseError> {
    let Ok(cases) = trace::scenario::parse(text) else {
        return Ok(());
    };
    for case in &cases {
        for p in &case.packets {
            prop_assert!(p.dst.port() != 0, "{}: port 0", p.name);
            prop_assert_eq!(p.src.is_ipv4(), p.dst.is_ipv4(), "{}", p.name);
        }
        checked_view(&case.model, &case.node.info, &case.node.view)?;
    }
    Ok(())
}

fn scenario_packet() -> BoxedStrategy<Value> {
    (
        or_garbage(
            text(&["TCP", "udp", "SCTP", "ICMP", ""])
                .prop_map(Value::from)
                .boxed(),
        ),
        ip_text(),
        opt(0.5, or_garbage(port_number().prop_map(Value::from).boxed())),
        ip_text(),
        or_garbage(port_number().prop_map(Value::from).boxed()),
        opt(
            0.5,
            (
                text(&["dnat", "drop", "reject", "accept", "local", "maybe"]),
                prop::collection::vec(
                    prop_oneof![
                        ip_text(),
                        (ip_text(), port_number()).prop_map(|(ip, p)| format!("{ip}:{p}")),
                    ],
                    0..3,
                ),
                any::<Option<bool>>(),
            )
                .boxed(),
        ),
    )
        .prop_map(|(proto, src, sport, dst, dport, expect)| {
            object(vec![
                ("name", Some("p".into())),
                ("proto", Some(proto)),
                ("src_ip", Some(src.into())),
                ("src_port", sport),
                ("dst_ip", Some(dst.into())),
                ("dst_port", Some(dport)),
                (
                    "expect",
                    expect.map(|(v, eps, m)| {
                        object(vec![
                            ("verdict", Some(v.into())),
                            ("endpoints", Some(eps.into())),
                            ("masquerade", m.map(Value::from)),
                        ])
                    }),
                ),
            ])
        })
        .boxed()
}

fn scenario_node() -> BoxedStrategy<Value> {
    (
        opt(0.5, prop::collection::vec(ip_text(), 0..3).boxed()),
        opt(0.5, prop::collection::vec(ip_text(), 0..3).boxed()),
        opt(0.3, text(&["ClusterCIDR", "None", "x"])),
        any::<Option<bool>>(),
        opt(0.3, prop::collection::vec(ip_text(), 0..2).boxed()),
        any::<Option<bool>>(),
    )
        .prop_map(|(ips, cidrs, detector, masq, npa, localhost)| {
            object(vec![
                ("nodeIPs", ips.map(Value::from)),
                ("clusterCIDRs", cidrs.map(Value::from)),
                ("localDetector", detector.map(Value::from)),
                ("masqueradeAll", masq.map(Value::from)),
                ("nodePortAddresses", npa.map(Value::from)),
                ("localhostNodePorts", localhost.map(Value::from)),
            ])
        })
        .boxed()
}

fn scenario_file() -> BoxedStrategy<Value> {
    let case = (
        scenario_node(),
        prop::collection::vec(service(&SERVICE_NAMES), 0..4),
        prop::collection::vec(slice(&SERVICE_NAMES), 0..4),
        prop::collection::vec(scenario_packet(), 0..4),
    )
        .prop_map(|(node, services, slices, packets)| {
            json!({"id": "c", "node": node,
                   "objects": {"services": services, "endpointslices": slices},
                   "packets": packets})
        });
    (scenario_node(), prop::collection::vec(case, 0..3))
        .prop_map(|(node, cases)| json!({"node": node, "cases": cases}))
        .boxed()
}

fn packet_spec() -> BoxedStrategy<String> {
    prop_oneof![
        (
            text(&["tcp", "UDP", "sctp", "icmp", ""]),
            ip_text(),
            opt(0.5, port_number()),
            text(&["->", " -> ", "=>", "-", ""]),
            ip_text(),
            port_number(),
        )
            .prop_map(|(proto, src, sport, arrow, dst, dport)| {
                let src = match sport {
                    Some(p) if src.contains(':') => format!("[{src}]:{p}"),
                    Some(p) => format!("{src}:{p}"),
                    None => src,
                };
                let dst = if dst.contains(':') {
                    format!("[{dst}]:{dport}")
                } else {
                    format!("{dst}:{dport}")
                };
                format!("{proto} {src} {arrow} {dst}")
            }),
        any::<String>(),
        "[a-z0-9 .:\\[\\]>-]{0,40}",
    ]
    .boxed()
}
