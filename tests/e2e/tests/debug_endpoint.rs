//! KPNG-style debugging against a running agent: `dump --view`, `dump --model`, `watch`
//! and the metrics endpoint, reached inside the testbed's node namespace. Root only.

use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use proxy_testbed::{Path_, Testbed, agent_bin, sh, web_manifests};
use test_support::needs_root;

fn agent(tb: &Testbed, args: &[&str]) -> String {
    let ns = format!("/run/netns/{}", tb.node_ns());
    let mut argv = vec![
        agent_bin().to_str().expect("utf-8").to_string(),
        "--netns".into(),
        ns,
    ];
    argv.extend(args.iter().map(|s| s.to_string()));
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    sh(&argv).expect("proxy-agent")
}

#[needs_root]
#[test]
fn view_model_watch_and_metrics_from_a_running_agent() {
    let mut tb = Testbed::new(3).expect("testbed");
    tb.write_manifests(&web_manifests(&[0, 1, 2], None))
        .expect("manifests");
    // Map sizes from the config: the pinned maps are created with them.
    let config = tb
        .write_file(
            "config.yaml",
            "kind: KubeProxyConfiguration\nebpf:\n  mapSizes: {services: 2048, backendSlots: \
             4096, backends: 1024}\n",
        )
        .expect("config");
    tb.start_agent_with(
        Path_::ConnectTime,
        5,
        &["--config", config.to_str().expect("utf-8")],
    )
    .expect("agent");
    let maps = tb.pin_dir().join("maps");
    for (map, size) in [
        ("SERVICES", 2048),
        ("REV_NAT", 2048),
        ("BACKEND_SLOTS", 4096),
        ("MEMBERS", 4096),
        ("BACKENDS", 1024),
    ] {
        let pinned = aya::maps::MapData::from_pin(maps.join(map)).expect("pinned map");
        assert_eq!(pinned.info().expect("info").max_entries(), size, "{map}");
    }

    let view = agent(&tb, &["dump", "--view"]);
    let line = view
        .lines()
        .find(|l| l.starts_with("10.96.0.10:80/TCP"))
        .unwrap_or_else(|| panic!("{view}"));
    for b in [
        "10.20.0.2:8080",
        "10.20.1.2:8080",
        "10.20.2.2:8080",
        "ClusterIp",
        "default/web:http",
    ] {
        assert!(line.contains(b), "{b} missing from {line}");
    }
    assert!(
        view.lines()
            .any(|l| l.starts_with("10.96.0.20:80/TCP") && l.contains("none (reject)")),
        "{view}"
    );

    let model: serde_json::Value =
        serde_json::from_str(&agent(&tb, &["dump", "--model"])).expect("json");
    let names: Vec<&str> = model["services"]
        .as_array()
        .expect("services")
        .iter()
        .filter_map(|s| s["object"]["name"].as_str())
        .collect();
    assert_eq!(names, vec!["empty", "web"]);
    assert_eq!(model["endpointSlices"].as_array().map(Vec::len), Some(2));

    // `watch` streams the diff when a backend goes away.
    let mut watch = Command::new(agent_bin())
        .args(["--netns", &format!("/run/netns/{}", tb.node_ns()), "watch"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("watch");
    std::thread::sleep(Duration::from_millis(300));
    tb.write_manifests(&web_manifests(&[0, 1], None))
        .expect("manifests");
    let mut lines = BufReader::new(watch.stdout.take().expect("stdout")).lines();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut minus, mut plus) = (None, None);
    while (minus.is_none() || plus.is_none()) && Instant::now() < deadline {
        let Some(Ok(l)) = lines.next() else { break };
        if l.starts_with("- 10.96.0.10:80/TCP") {
            minus = Some(l);
        } else if l.starts_with("+ 10.96.0.10:80/TCP") {
            plus = Some(l);
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    let (minus, plus) = (minus.expect("a - line"), plus.expect("a + line"));
    assert!(minus.contains("10.20.2.2:8080"), "{minus}");
    assert!(
        !plus.contains("10.20.2.2:8080") && plus.contains("10.20.1.2:8080"),
        "{plus}"
    );

    let node = tb.node_ns();
    // An HTTP GET from inside the node namespace: "STATUS BODY".
    let get = |url: &str| {
        let script = format!(
            "import urllib.request;r=urllib.request.urlopen('{url}');print(r.status, r.read().decode())"
        );
        sh(&["ip", "netns", "exec", &node, "python3", "-c", &script]).expect(url)
    };
    let fetch_metrics = || get("http://127.0.0.1:10249/metrics");
    // Nothing of ours on kubelet's ports (10250, 10248): the debug views are served on
    // the metrics address, as kube-proxy serves its own debug handlers there.
    let listening = sh(&["ip", "netns", "exec", &node, "ss", "-ltnH"]).expect("ss");
    assert!(
        !listening.contains(":10250 ") && !listening.contains(":10248 "),
        "{listening}"
    );
    // /healthz (healthzBindAddress) as kube-proxy answers it, with its clock fields.
    let health = get("http://127.0.0.1:10256/healthz");
    let (code, body) = health.trim().split_once(' ').expect("status and body");
    let body: serde_json::Value = serde_json::from_str(body).expect("json");
    assert_eq!(code, "200", "{health}");
    assert!(
        body["lastUpdated"].is_string() && body["currentTime"].is_string(),
        "{body}"
    );
    assert_eq!(body["nodeEligible"], true, "{body}");
    let live = get("http://127.0.0.1:10256/livez");
    assert!(live.starts_with("200 "), "{live}");
    // Four connections through the connect-time hooks: counted per Service port (its
    // sockets' packets never pass our programs: connections only).
    let attempts = tb
        .client(&[
            "--target",
            "10.96.0.10:80",
            "--proto",
            "tcp",
            "--count",
            "4",
        ])
        .expect("client");
    assert!(attempts.iter().all(|a| a.ok), "{attempts:?}");
    let metrics = fetch_metrics();
    for m in [
        "proxy_agent_service_connections_total{namespace=\"default\",service=\"web\",port=\"http\"} 4",
        "proxy_agent_service_packets_total{namespace=\"default\",service=\"web\",port=\"http\",direction=\"in\"} 0",
    ] {
        assert!(metrics.contains(m), "{m} missing:\n{metrics}");
    }
    let stats = agent(
        &tb,
        &[
            "dump",
            "--stats",
            "--bpffs",
            tb.pin_dir().to_str().expect("utf-8"),
        ],
    );
    let row = stats
        .lines()
        .find(|l| l.starts_with("TCP  10.96.0.10:80 "))
        .unwrap_or_else(|| panic!("no row for the ClusterIP:\n{stats}"));
    let numbers: Vec<&str> = row.split_whitespace().skip(3).collect();
    assert_eq!(numbers, ["4", "0", "0", "0", "0"], "{stats}");
    for m in [
        "proxy_agent_syncs_ok_total",
        "proxy_agent_frontends 5",
        // The fill gauges: maps of the configured sizes.
        "proxy_agent_bpf_map_capacity{map=\"SERVICES\"} 2048",
        "proxy_agent_bpf_map_capacity{map=\"BACKEND_SLOTS\"} 4096",
        "proxy_agent_bpf_events_total{event=\"service_hit\"}",
        // kube-proxy's names, for the dashboards that read them.
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "process_resident_memory_bytes",
    ] {
        assert!(metrics.contains(m), "{m} missing:\n{metrics}");
    }
    // Each map's memory as the kernel charges it, in /metrics and `dump` alike.
    let memory = |name: &str| -> u64 {
        let prefix = format!("proxy_agent_bpf_map_memory_bytes{{map=\"{name}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no memory for {name}:\n{metrics}"))
    };
    let dump: serde_json::Value = serde_json::from_str(&agent(
        &tb,
        &[
            "dump",
            "--json",
            "--bpffs",
            tb.pin_dir().to_str().expect("utf-8"),
        ],
    ))
    .expect("dump --json");
    for name in ["SERVICES", "CONNTRACK"] {
        assert!(memory(name) > 0, "{name}");
        assert_eq!(
            dump["map_memory_bytes"][name].as_u64(),
            Some(memory(name)),
            "{name}: dump and /metrics read the same kernel figure"
        );
    }
    // The answered-flow table (131,072 entries) outweighs the Service map (2,048).
    assert!(memory("CONNTRACK") > memory("SERVICES"));
    // ... holding as many entries as the gauges say.
    {
        let set = proxy_agent::dataplane::bpf::MapSet::open_pinned(&maps).expect("pins");
        for (map, held) in [
            ("SERVICES", set.services.keys().count()),
            ("REV_NAT", set.rev_nat.keys().count()),
            ("BACKEND_SLOTS", set.slots.keys().count()),
            ("MEMBERS", set.members.keys().count()),
            ("BACKENDS", set.backends.keys().count()),
        ] {
            let line = format!("proxy_agent_bpf_map_entries{{map=\"{map}\"}} {held}");
            assert!(metrics.contains(&line), "{line} missing:\n{metrics}");
        }
    }

    // Network programming latency: a slice change the endpoints controller stamped 3 s
    // ago is observed once, at 3 s or more (the manifests so far carried no stamp). The
    // endpoints stay as they are: a change this node needs no sync for counts too.
    let stamp = sh(&["date", "-u", "-d", "-3 seconds", "+%Y-%m-%dT%H:%M:%SZ"]).expect("date");
    let mut files = web_manifests(&[0, 1], None);
    let v4 = files.get_mut("web-ipv4.yaml").expect("IPv4 slice");
    *v4 = v4.replacen(
        "metadata:\n",
        &format!(
            "metadata:\n  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: \"{}\"}}\n",
            stamp.trim()
        ),
        1,
    );
    tb.write_manifests(&files).expect("manifests");
    let deadline = Instant::now() + Duration::from_secs(10);
    let sum = loop {
        let metrics = fetch_metrics();
        let value = |name: &str| {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        };
        let count = value("proxy_agent_network_programming_duration_seconds_count ");
        if count == Some(1.0) {
            // kube-proxy's histogram (its buckets) saw the same change.
            assert_eq!(
                value("kubeproxy_network_programming_duration_seconds_count "),
                Some(1.0),
                "{metrics}"
            );
            break value("proxy_agent_network_programming_duration_seconds_sum ").expect("sum");
        }
        assert!(Instant::now() < deadline, "no latency observed:\n{metrics}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        (3.0..60.0).contains(&sum),
        "network programming latency {sum} s"
    );
    // trace --live: the running node's maps, copied, with the packet's fate.
    let pins = tb.pin_dir();
    let trace_live = |packet: &str| -> serde_json::Value {
        let pins = pins.to_str().expect("utf-8");
        let out = agent(
            &tb,
            &[
                "trace", "--live", "--json", "--bpffs", pins, "--packet", packet,
            ],
        );
        serde_json::from_str(&out).expect("json")
    };
    let traced = trace_live("tcp 10.10.0.2:40000 -> 10.96.0.10:80");
    assert_eq!(traced["verdict"], "dnat", "{traced}");
    let eps: Vec<&str> = traced["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(
        eps,
        vec!["10.20.0.2:8080", "10.20.1.2:8080"],
        "the live view after backend-2 left"
    );
    let refused = trace_live("tcp 10.10.0.2:40000 -> 10.96.0.20:80");
    assert_eq!(refused["verdict"], "reject", "{refused}");
    let _ = tb.kill_agent();
}
