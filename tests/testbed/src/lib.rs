//! What the e2e suite (`proxy-e2e`), the benchmarks (`proxy-bench`) and the cluster in a
//! box (`proxy-cluster`) share: a namespace testbed (client → node → backend pods) and the
//! two-node one (`multinode`), echo backends that answer with their identity, a client that
//! reports every attempt, the agent under test, kube-proxy-shaped rules (`kube_proxy`) and
//! a fake API server (`fake_apiserver`, proxy-agent's tests include it too). Its binaries
//! are the helpers the testbeds spawn (`e2e-echo`, `e2e-client`, `e2e-synflood`) and the
//! demo (`cargo xtask demo`). Everything lives in namespaces, a cgroup and a bpffs mount the
//! testbed creates, with unique names, and is removed on drop — also when a test fails.

mod background;
pub mod client;
pub mod echo;
pub mod fake_apiserver;
#[cfg(test)]
mod fake_apiserver_tests;
pub mod kube_proxy;
pub mod multinode;
mod testbed;

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::Command,
};

use anyhow::{Context as _, Result, bail};

pub use background::Background;
pub use client::Attempt;
pub use testbed::Testbed;

/// ClusterIPs used by the testbed's manifests. They exist only inside the testbed.
pub const VIP4: &str = "10.96.0.10";
/// `VIP4` as an IPv6 socket names it (`::ffff:a.b.c.d`, as dual-stack applications do).
pub const VIP4_MAPPED: &str = "::ffff:10.96.0.10";
pub const VIP6: &str = "fd96::10";
/// A Service without endpoints.
pub const EMPTY_VIP4: &str = "10.96.0.20";
pub const TCP_PORT: u16 = 80;
pub const TCP_TARGET: u16 = 8080;
pub const UDP_PORT: u16 = 53;
pub const UDP_TARGET: u16 = 5353;

/// A wait's limit, stretched by `PROXY_TEST_TIME_SCALE` (a whole number, default 1): in a
/// software-emulated guest (`cargo xtask kernels`) the verifier alone takes minutes.
pub fn patience(limit: std::time::Duration) -> std::time::Duration {
    let scale = std::env::var("PROXY_TEST_TIME_SCALE")
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .filter(|&s| s >= 1)
        .unwrap_or(1);
    limit * scale
}

/// Runs a command, failing with its stderr.
pub fn sh(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("spawning {args:?}"))?;
    if !out.status.success() {
        bail!("{args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A namespace with loopback up and without IPv6 duplicate address detection, whose
/// tentative link-local addresses would stall neighbour discovery for a second or two.
pub fn add_namespace(ns: &str) -> Result<()> {
    sh(&["ip", "netns", "add", ns])?;
    sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
    for key in [
        "net.ipv6.conf.all.accept_dad",
        "net.ipv6.conf.default.accept_dad",
    ] {
        sh(&[
            "ip",
            "netns",
            "exec",
            ns,
            "sysctl",
            "-qw",
            &format!("{key}=0"),
        ])?;
    }
    Ok(())
}

/// `ip -n NS ARGS...`, with ARGS split on spaces.
pub fn ip(ns: &str, args: &str) -> Result<String> {
    let mut argv = vec!["ip", "-n", ns];
    argv.extend(args.split_whitespace());
    sh(&argv)
}

/// Which datapath the agent under test uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path_ {
    /// cgroup connect/sendmsg/recvmsg/getpeername hooks on the testbed's cgroup.
    ConnectTime,
    /// TC classifier on the node's interfaces.
    PerPacket,
}

/// Where the agent binary is: `PROXY_AGENT_BIN`, else next to the test binary.
pub fn agent_bin() -> PathBuf {
    std::env::var_os("PROXY_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| helper_bin("proxy-agent"))
}

/// Binaries of the workspace's target folder (this crate's e2e-echo, e2e-client and
/// e2e-synflood; proxy-agent), found from the running executable (which may sit in
/// `deps/`). Panics, naming the command that builds them, when one is not there: `cargo
/// test` builds a package's binaries only for that package's own integration tests, so
/// the e2e suite's, the benchmarks' and the box's find this crate's only once built
/// (`cargo xtask test` and `cargo xtask build` build them first).
pub fn helper_bin(name: &str) -> PathBuf {
    let mut p = std::env::current_exe().unwrap_or_default();
    p.pop();
    if p.ends_with("deps") {
        p.pop();
    }
    let bin = p.join(name);
    if !bin.exists() {
        let release = if p.ends_with("release") {
            " --release"
        } else {
            ""
        };
        panic!(
            "{} is missing: build it with `cargo build{release} -p proxy-agent -p proxy-testbed --bins`",
            bin.display()
        );
    }
    bin
}

/// The web manifests plus a NodePort Service (eTP Cluster: masqueraded) on 10.96.0.30,
/// NodePort 30080, with backend 0 as its one endpoint.
pub fn nodeport_manifests() -> BTreeMap<&'static str, String> {
    let mut files = web_manifests(&[0], None);
    files.insert(
        "nodeport.yaml",
        "apiVersion: v1
kind: Service
metadata: {name: np, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.30
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: np-ipv4
  namespace: default
  labels: {kubernetes.io/service-name: np}
addressType: IPv4
ports:
- {name: http, protocol: TCP, port: 8080}
endpoints:
- addresses: [\"10.30.0.2\"]
  conditions: {ready: true}
"
        .replace("10.30.0.2", &Testbed::backend_ip4(0)),
    );
    files
}

/// The cgroup v2 mount (`/sys/fs/cgroup/unified` here, `/sys/fs/cgroup` on most hosts).
pub fn cgroup_root() -> Result<PathBuf> {
    Ok(proxy_agent::dataplane::bpf::cgroup2_mount()?)
}

/// Manifests for the testbed's "web" Service: dual-stack ClusterIPs, TCP 80→8080 and
/// UDP 53→"dns" (a named targetPort resolved through the slices' ports), endpoints on the
/// given backends, optional ClientIP affinity; plus an "empty" Service with no endpoints.
pub fn web_manifests(
    backends: &[usize],
    affinity_timeout: Option<u32>,
) -> BTreeMap<&'static str, String> {
    let affinity = match affinity_timeout {
        Some(t) => format!(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {t}\n"
        ),
        None => String::new(),
    };
    let service = format!(
        "apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: ClusterIP
  ipFamilies: [IPv4, IPv6]
  clusterIP: {VIP4}
  clusterIPs: [{VIP4}, {VIP6}]
{affinity}  ports:
  - {{name: http, protocol: TCP, port: {TCP_PORT}, targetPort: {TCP_TARGET}}}
  - {{name: dns, protocol: UDP, port: {UDP_PORT}, targetPort: dns}}
---
apiVersion: v1
kind: Service
metadata: {{name: empty, namespace: default}}
spec:
  clusterIP: {EMPTY_VIP4}
  ports:
  - {{name: http, protocol: TCP, port: {TCP_PORT}, targetPort: {TCP_TARGET}}}
"
    );
    let slice = |family: &str, addr: fn(usize) -> String| {
        let mut s = format!(
            "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-{}
  namespace: default
  labels: {{kubernetes.io/service-name: web}}
addressType: {family}
ports:
- {{name: http, protocol: TCP, port: {TCP_TARGET}}}
- {{name: dns, protocol: UDP, port: {UDP_TARGET}}}
endpoints:
",
            family.to_lowercase()
        );
        for &i in backends {
            s.push_str(&format!(
                "- addresses: [\"{}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n",
                addr(i)
            ));
        }
        if backends.is_empty() {
            s.push_str("  []\n");
        }
        s
    };
    let mut files = BTreeMap::new();
    files.insert("services.yaml", service);
    files.insert("web-ipv4.yaml", slice("IPv4", Testbed::backend_ip4));
    files.insert("web-ipv6.yaml", slice("IPv6", Testbed::backend_ip6));
    files
}

/// `ip:port` as the client takes it.
pub fn target(ip: &str, port: u16) -> String {
    let ip: IpAddr = ip.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]));
    SocketAddr::new(ip, port).to_string()
}

/// Counts attempts per backend identity.
pub fn spread(attempts: &[Attempt]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for a in attempts.iter().filter(|a| a.ok) {
        *m.entry(a.backend.clone().unwrap_or_default()).or_insert(0) += 1;
    }
    m
}

/// Pearson's chi-square statistic of `counts` against a uniform spread over `k` buckets.
pub fn chi_square_uniform(counts: &BTreeMap<String, usize>, k: usize) -> f64 {
    let total: usize = counts.values().sum();
    let expected = total as f64 / k as f64;
    let observed: Vec<f64> = (0..k)
        .map(|i| *counts.get(&Testbed::backend_name(i)).unwrap_or(&0) as f64)
        .collect();
    observed
        .iter()
        .map(|o| (o - expected).powi(2) / expected)
        .sum()
}

/// A metric's value from the Prometheus text (`name` followed by a space).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_read_by_their_exact_name() {
        let text = "proxy_agent_frontends_failed_total 3\nproxy_agent_frontends 10000\n";
        assert_eq!(metric(text, "proxy_agent_frontends"), Some(10000.0));
        assert_eq!(
            metric(text, "proxy_agent_frontends_failed_total"),
            Some(3.0)
        );
        assert_eq!(metric(text, "proxy_agent_front"), None);
    }
}
