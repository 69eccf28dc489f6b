//! The agent's lifecycle and what it exposes (issue 25): SIGTERM ends it and the pinned
//! programs serve on; an events endpoint that hangs does not hold up programming; a
//! health or metrics port taken at start is retried; output commands end quietly when
//! their reader goes away; the object views stay off a metrics address that is not
//! loopback. Each against the real binary and real sockets; root only.
//!
//! The agents that talk to the fake API server or find their ports taken run in the
//! host's network namespace with no hook attached (`--cgroup none`, no interfaces) on a
//! private bpffs, every listener on a free loopback port: they touch nothing of the host.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use proxy_testbed::{
    Path_, TCP_PORT, Testbed, UDP_PORT, VIP4, agent_bin,
    fake_apiserver::{FakeApiServer, Kind},
    sh, target, web_manifests,
};
use serde_json::json;
use test_support::needs_root;

/// Frontends the web manifests program: web (2 families × 2 ports) + empty.
const FRONTENDS: usize = 5;

/// How long a SIGTERM may take to end the agent (it took until SIGKILL).
const STOP_WITHIN: Duration = Duration::from_secs(5);

/// Every attempt of `tb`'s client to the web Service, TCP and UDP, answered by a backend.
fn serves(tb: &Testbed, when: &str) {
    for (proto, port) in [("tcp", TCP_PORT), ("udp", UDP_PORT)] {
        let attempts = tb
            .client(&[
                "--target",
                &target(VIP4, port),
                "--proto",
                proto,
                "--count",
                "10",
            ])
            .expect("client");
        assert_eq!(attempts.len(), 10, "{when}");
        assert!(
            attempts.iter().all(|a| a.ok
                && a.backend
                    .as_deref()
                    .is_some_and(|b| b.starts_with("backend-"))),
            "{when}, {proto}: {attempts:?}"
        );
    }
}

/// SIGTERM (a pod stop, a rolling update) ends the agent at once with status 0, and the
/// pinned programs go on serving; the conntrack collector's endless blocking task held
/// the runtime's drop until SIGKILL.
fn sigterm_ends_the_agent(path: Path_) {
    let mut tb = Testbed::new(2).expect("testbed");
    tb.write_manifests(&web_manifests(&[0, 1], None))
        .expect("manifests");
    tb.start_agent(path, FRONTENDS).expect("agent");
    serves(&tb, "with the agent running");
    let started = Instant::now();
    let status = tb.terminate_agent(STOP_WITHIN).expect("SIGTERM");
    let log = tb.agent_log();
    let status = status.unwrap_or_else(|| {
        panic!("{path:?}: the agent was still running {STOP_WITHIN:?} after SIGTERM:\n{log}")
    });
    assert!(status.success(), "{path:?}: exit {status}:\n{log}");
    assert!(log.contains("shutting down"), "{log}");
    eprintln!("{path:?}: exited {:?} after SIGTERM", started.elapsed());
    serves(&tb, "after the agent exited");
}

#[needs_root]
#[test]
fn sigterm_ends_the_agent_and_the_per_packet_programs_serve_on() {
    sigterm_ends_the_agent(Path_::PerPacket);
}

#[needs_root]
#[test]
fn sigterm_ends_the_agent_and_the_connect_time_programs_serve_on() {
    sigterm_ends_the_agent(Path_::ConnectTime);
}

/// A free port on loopback (for an agent of the host's namespace: the defaults may be in
/// use by anything else on this machine).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// An agent in the host's network namespace with no hook attached, on a private bpffs.
struct HostAgent {
    dir: PathBuf,
    bpffs: PathBuf,
    child: Option<Child>,
    mounted: bool,
}

impl HostAgent {
    /// `proxy-agent run --config <config> --cgroup none ... <args>`.
    fn start(name: &str, config: &str, args: &[&str]) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("pxy-{name}-{}", std::process::id()));
        let bpffs = dir.join("bpffs");
        fs::create_dir_all(&bpffs)?;
        let mut agent = HostAgent {
            dir: dir.clone(),
            bpffs: bpffs.clone(),
            child: None,
            mounted: false,
        };
        sh(&[
            "mount",
            "-t",
            "bpf",
            "bpf",
            bpffs.to_str().context("utf-8")?,
        ])?;
        agent.mounted = true;
        let config_path = dir.join("config.yaml");
        fs::write(&config_path, config)?;
        let log = fs::File::create(dir.join("agent.log"))?;
        let child = Command::new(agent_bin())
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .arg("--bpffs")
            .arg(agent.pin_dir())
            .args(["--cgroup", "none", "--min-sync-ms", "20"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting proxy-agent")?;
        agent.child = Some(child);
        Ok(agent)
    }

    fn pin_dir(&self) -> PathBuf {
        self.bpffs.join("agent")
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// How many frontends the pinned maps hold (`None` before there are maps).
    fn frontends(&self) -> Option<usize> {
        let pins = self.pin_dir();
        let out = sh(&[
            agent_bin().to_str()?,
            "dump",
            "--json",
            "--bpffs",
            pins.to_str()?,
        ])
        .ok()?;
        let dump: serde_json::Value = serde_json::from_str(&out).ok()?;
        dump["services"].as_array().map(Vec::len)
    }

    /// Waits up to `within` for `cond`, failing the test if the agent exits first.
    fn wait_for(&mut self, what: &str, within: Duration, cond: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + within;
        while !cond(self) {
            if let Some(child) = &mut self.child
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("the agent exited ({status}) before {what}:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {within:?}; agent log:\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for HostAgent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = Command::new(agent_bin())
            .args(["cleanup", "--bpffs"])
            .arg(self.pin_dir())
            .stderr(Stdio::null())
            .status();
        if self.mounted {
            let _ = sh(&["umount", self.bpffs.to_str().unwrap_or("")]);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// `GET path` on `127.0.0.1:port`: the status code and body (`None`: nothing answered).
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Some((code, body))
}

/// Listeners on loopback, `healthz` and `metrics`, in a KubeProxyConfiguration.
fn listeners_config(healthz: u16, metrics: u16) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         healthzBindAddress: 127.0.0.1:{healthz}\nmetricsBindAddress: 127.0.0.1:{metrics}\n"
    )
}

/// The "Starting" Event was POSTed before any list or watch: an events endpoint that did
/// not answer left a fresh node unprogrammed for the client's 295 s timeout. Now it is
/// sent beside the source, gives up after its own timeout, and is logged and counted.
#[needs_root]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_events_endpoint_that_hangs_does_not_hold_up_programming() {
    let server = FakeApiServer::start().await;
    server.hold_events();
    server.apply(
        Kind::Services,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "web", "namespace": "default"},
               "spec": {"clusterIP": "10.96.0.10",
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}}),
    );
    server.apply(
        Kind::EndpointSlices,
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "web-1", "namespace": "default",
                            "labels": {"kubernetes.io/service-name": "web"}},
               "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
               "endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": true}}]}),
    );
    server.apply(
        Kind::Nodes,
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
               "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}}),
    );
    let kubeconfig =
        std::env::temp_dir().join(format!("pxy-events-{}.kubeconfig", std::process::id()));
    fs::write(&kubeconfig, server.kubeconfig()).expect("kubeconfig");
    let metrics = free_port();
    let config = listeners_config(free_port(), metrics);
    // The agent's checks block (commands, sleeps): off the runtime the fake server runs on.
    let server2 = server.clone();
    let kubeconfig2 = kubeconfig.clone();
    tokio::task::spawn_blocking(move || {
        let mut agent = HostAgent::start(
            "events",
            &config,
            &[
                "--source",
                "kube",
                "--kubeconfig",
                kubeconfig2.to_str().expect("utf-8"),
                "--node-name",
                "node-a",
            ],
        )
        .expect("agent");
        // Promptly: the lists take milliseconds; the POST would hold it for 295 s.
        agent.wait_for("the node programmed", Duration::from_secs(15), |a| {
            a.frontends() == Some(1)
        });
        // The POST did come, and still hangs.
        agent.wait_for("the event POSTed", Duration::from_secs(10), |_| {
            server2.event_posts() >= 1
        });
        assert!(server2.events().is_empty(), "{:?}", server2.events());
        // Given up after its own timeout: logged and counted.
        agent.wait_for(
            "the failed event counted",
            proxy_agent::source::events::PUBLISH_TIMEOUT + Duration::from_secs(15),
            |_| {
                get(metrics, "/metrics")
                    .is_some_and(|(_, m)| m.contains("proxy_agent_events_failed_total 1\n"))
            },
        );
        assert!(agent.log().contains("no Starting event"), "{}", agent.log());
    })
    .await
    .expect("the checks");
    let _ = fs::remove_file(&kubeconfig);
}

/// A health or metrics port another process holds at start is opened once it is free
/// (kube-proxy retries; the agent gave up at once, for good).
#[needs_root]
#[test]
fn a_health_or_metrics_port_taken_at_start_is_retried() {
    let healthz_squatter = TcpListener::bind("127.0.0.1:0").expect("bind");
    let metrics_squatter = TcpListener::bind("127.0.0.1:0").expect("bind");
    let healthz = healthz_squatter.local_addr().expect("addr").port();
    let metrics = metrics_squatter.local_addr().expect("addr").port();
    let manifests =
        std::env::temp_dir().join(format!("pxy-ports-{}-manifests", std::process::id()));
    fs::create_dir_all(&manifests).expect("manifests folder");
    for (name, text) in web_manifests(&[0], None) {
        fs::write(manifests.join(name), text).expect("manifest");
    }
    let mut agent = HostAgent::start(
        "ports",
        &listeners_config(healthz, metrics),
        &["--manifests", manifests.to_str().expect("utf-8")],
    )
    .expect("agent");
    agent.wait_for("the frontends programmed", Duration::from_secs(20), |a| {
        a.frontends() == Some(FRONTENDS)
    });
    // Both binds failed (the log names each address).
    agent.wait_for("both binds failed", Duration::from_secs(10), |a| {
        let log = a.log();
        log.contains(&format!("127.0.0.1:{healthz}"))
            && log.contains(&format!("127.0.0.1:{metrics}"))
    });
    drop(healthz_squatter);
    drop(metrics_squatter);
    // The retry comes every 5 s.
    agent.wait_for("/healthz answering", Duration::from_secs(15), |_| {
        get(healthz, "/healthz").is_some_and(|(code, _)| code == 200)
    });
    agent.wait_for("/metrics answering", Duration::from_secs(15), |_| {
        get(metrics, "/metrics").is_some_and(|(code, m)| code == 200 && m.contains("proxy_agent_"))
    });
    let log = agent.log();
    for what in ["healthz address", "metrics address"] {
        assert!(
            log.contains(&format!("cannot open {what}; retrying")),
            "{log}"
        );
    }
    let _ = fs::remove_dir_all(&manifests);
}

/// `GET url` from namespace `ns`: the status code and, unless `streaming`, the body.
fn get_in(ns: &str, url: &str, streaming: bool) -> (u16, String) {
    let read = if streaming { "b''" } else { "r.read()" };
    let script = format!(
        "import urllib.request,urllib.error\n\
         try:\n    r=urllib.request.urlopen('{url}',timeout=5);print(r.status);print({read}.decode())\n\
         except urllib.error.HTTPError as e:\n    print(e.code);print(e.read().decode())\n"
    );
    let out = sh(&["ip", "netns", "exec", ns, "python3", "-c", &script]).expect(url);
    let (code, body) = out.split_once('\n').unwrap_or((&out, ""));
    (code.trim().parse().expect("status code"), body.to_string())
}

/// `proxy-agent --netns <node> ARGS`: its exit status, stdout and stderr.
fn agent_in_node(tb: &Testbed, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(agent_bin())
        .arg("--netns")
        .arg(format!("/run/netns/{}", tb.node_ns()))
        .args(args)
        .output()
        .expect("proxy-agent");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `metricsBindAddress: 0.0.0.0:10249` (common, for scraping) served every Service and
/// EndpointSlice to anyone who could reach the node. The object views now stay off a
/// metrics address that is not loopback, and `ebpf.debugBindAddress` serves them; with
/// the defaults (metrics on 127.0.0.1) `dump --view`, `dump --model` and `watch` work as
/// before (`debug_endpoint.rs`).
#[needs_root]
#[test]
fn object_views_stay_off_a_metrics_address_that_is_not_loopback() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    let config = tb
        .write_file(
            "config.yaml",
            "kind: KubeProxyConfiguration\nmetricsBindAddress: 0.0.0.0:10249\n\
             ebpf:\n  debugBindAddress: 127.0.0.1:10251\n",
        )
        .expect("config");
    tb.start_agent_with(
        Path_::ConnectTime,
        FRONTENDS,
        &["--config", config.to_str().expect("utf-8")],
    )
    .expect("agent");
    let client = tb.client_ns();
    // From another host (the client namespace, through the node's address).
    let (code, metrics) = get_in(&client, "http://10.10.0.1:10249/metrics", false);
    assert_eq!(code, 200, "{metrics}");
    assert!(metrics.contains("proxy_agent_frontends 5"), "{metrics}");
    for path in ["/debug/model", "/debug/view", "/debug/watch"] {
        let (code, body) = get_in(
            &client,
            &format!("http://10.10.0.1:10249{path}"),
            path == "/debug/watch",
        );
        assert_eq!(code, 404, "{path}: {body}");
        assert!(
            !body.contains(VIP4) && !body.contains("web"),
            "{path} names objects: {body}"
        );
    }
    // `dump --view` at the metrics address says where to ask instead.
    let (ok, _, err) = agent_in_node(&tb, &["dump", "--view"]);
    assert!(!ok && err.contains("debugBindAddress"), "{err}");
    // The opt-in debug address serves them.
    let (ok, view, err) =
        agent_in_node(&tb, &["dump", "--view", "--debug-addr", "127.0.0.1:10251"]);
    assert!(ok, "{err}");
    assert!(
        view.lines().any(|l| l.starts_with("10.96.0.10:80/TCP")),
        "{view}"
    );
    let (ok, model, err) =
        agent_in_node(&tb, &["dump", "--model", "--debug-addr", "127.0.0.1:10251"]);
    assert!(ok, "{err}");
    let model: serde_json::Value = serde_json::from_str(&model).expect("json");
    assert_eq!(
        model["services"].as_array().map(Vec::len),
        Some(2),
        "{model}"
    );
    let _ = tb.kill_agent();
}

/// Per-Service series name every Service to whoever scrapes them, and kube-proxy's
/// metrics have none: on a metrics address that is not loopback they are left out unless
/// `ebpf.serviceMetrics` asks for them; the loopback and debug addresses have them.
#[needs_root]
#[test]
fn per_service_series_stay_off_a_metrics_address_that_is_not_loopback_unless_asked() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    let series = "proxy_agent_service_connections_total{namespace=\"default\",service=\"web\"";
    for opted_in in [false, true] {
        let config = tb
            .write_file(
                "config.yaml",
                &format!(
                    "kind: KubeProxyConfiguration\nmetricsBindAddress: 0.0.0.0:10249\n\
                     ebpf:\n  debugBindAddress: 127.0.0.1:10251\n  serviceMetrics: {opted_in}\n"
                ),
            )
            .expect("config");
        tb.start_agent_with(
            Path_::ConnectTime,
            FRONTENDS,
            &["--config", config.to_str().expect("utf-8")],
        )
        .expect("agent");
        // Connections through the ClusterIP: the counts the series would carry.
        let attempts = tb
            .client(&[
                "--target",
                "10.96.0.10:80",
                "--proto",
                "tcp",
                "--count",
                "3",
            ])
            .expect("client");
        assert!(attempts.iter().all(|a| a.ok), "{attempts:?}");
        let (code, open) = get_in(&tb.client_ns(), "http://10.10.0.1:10249/metrics", false);
        assert_eq!(code, 200, "{open}");
        assert!(open.contains("proxy_agent_frontends 5"), "{open}");
        assert_eq!(
            open.contains(series),
            opted_in,
            "serviceMetrics: {opted_in}, from another host:\n{open}"
        );
        if !opted_in {
            assert!(!open.contains("service=\"web\""), "{open}");
        }
        let (code, debug) = get_in(&tb.node_ns(), "http://127.0.0.1:10251/metrics", false);
        assert_eq!(code, 200, "{debug}");
        assert!(debug.contains(series), "the debug address:\n{debug}");
        tb.kill_agent().expect("kill");
    }
}

/// `proxy-agent dump | head` panicked on the broken pipe (`println!`): with its reader
/// gone before it writes, `dump` of the pins ends quietly, status 0.
#[needs_root]
#[test]
fn dump_into_a_closed_pipe_ends_quietly() {
    let mut tb = Testbed::new(1).expect("testbed");
    tb.write_manifests(&web_manifests(&[0], None))
        .expect("manifests");
    tb.start_agent(Path_::ConnectTime, FRONTENDS)
        .expect("agent");
    let pins = tb.pin_dir();
    for json in [false, true] {
        let mut cmd = Command::new(agent_bin());
        cmd.args(["dump", "--bpffs"]).arg(&pins);
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dump");
        // The reader goes away before anything is written.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("dump");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && !err.contains("panicked"),
            "dump (json: {json}) into a closed pipe: {}\n{err}",
            out.status
        );
    }
    let _ = tb.kill_agent();
}
