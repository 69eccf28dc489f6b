//! The multi-node testbed: two node namespaces and an external client on a bridge
//! namespace (the "LAN"), a pod namespace behind each node (node B's behind a bridge, as
//! the bridge CNI plugin makes it), one agent per node (its own
//! pins, no cgroup hooks, the classifier on every node interface). Nothing routes out of
//! the testbed: nodes know each other's pod networks and nothing else.
//!
//! ```text
//!   client 192.168.50.100 ─┐
//!   node-a 192.168.50.10  ─┼─ br0 (bridge ns)        node-a ── pod-a 10.244.1.2
//!   node-b 192.168.50.11  ─┘                          node-b ── pod-b 10.244.2.2
//! ```
//!
//! Every address has an IPv6 twin (`fd00:50::100`, `fd00:50::10`, `fd00:50::11`;
//! `fd00:244:1::2`, `fd00:244:2::2`); the agents are given the nodes' IPv6 addresses only
//! with `dual_stack` (so IPv4 tests count the frontends they always did).

use std::{
    collections::BTreeMap,
    fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{Attempt, Background, add_namespace, agent_bin, client, helper_bin, ip, sh};

pub const NODE_A: &str = "192.168.50.10";
pub const NODE_B: &str = "192.168.50.11";
pub const CLIENT: &str = "192.168.50.100";
pub const POD_A: &str = "10.244.1.2";
pub const POD_B: &str = "10.244.2.2";
pub const NODE_A6: &str = "fd00:50::10";
pub const NODE_B6: &str = "fd00:50::11";
pub const CLIENT6: &str = "fd00:50::100";
pub const POD_A6: &str = "fd00:244:1::2";
pub const POD_B6: &str = "fd00:244:2::2";
/// Addresses "load balancers" send to node A (routed there from the client).
pub const LB_IPS: [&str; 3] = ["203.0.113.50", "203.0.113.51", "203.0.113.7"];

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// One node: its namespace, interfaces, agent.
struct Node {
    ns: String,
    interfaces: Vec<String>,
    agent: Option<Child>,
}

pub struct MultiNode {
    pub id: String,
    root: PathBuf,
    namespaces: Vec<String>,
    nodes: BTreeMap<&'static str, Node>,
    echoes: Vec<Child>,
    /// `proxy-agent serve` replicas, by index (`None`: killed).
    servers: Vec<Option<Child>>,
    manifests: PathBuf,
    bpffs: PathBuf,
    /// The agents' extra arguments (`start_agents_with`), kept for a restart.
    agent_args: Vec<String>,
    /// Each agent is given its node's IPv6 address too (`dual_stack`).
    dual_stack: bool,
}

impl MultiNode {
    pub fn new() -> Result<Self> {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let id = format!("{:04x}{n:x}", std::process::id() & 0xffff);
        let root = std::env::temp_dir().join(format!("pxm-{id}"));
        let mut tb = MultiNode {
            manifests: root.join("manifests"),
            bpffs: root.join("bpffs"),
            agent_args: Vec::new(),
            dual_stack: false,
            root,
            id,
            namespaces: Vec::new(),
            nodes: BTreeMap::new(),
            echoes: Vec::new(),
            servers: Vec::new(),
        };
        tb.build()
            .with_context(|| format!("building multi-node testbed {}", tb.id))?;
        Ok(tb)
    }

    fn ns(&self, name: &str) -> String {
        format!("pxm{}{name}", self.id)
    }

    fn add_ns(&mut self, name: &str) -> Result<String> {
        let ns = self.ns(name);
        add_namespace(&ns)?;
        self.namespaces.push(ns.clone());
        Ok(ns)
    }

    fn build(&mut self) -> Result<()> {
        fs::create_dir_all(&self.manifests)?;
        // The cluster's Nodes, as `kubectl get nodes -o yaml` gives them: each agent
        // learns the other's addresses (direct server return's entry nodes) from here.
        let node = |name: &str, v4: &str, v6: &str, pods: &str| {
            format!(
                "---\napiVersion: v1\nkind: Node\nmetadata: {{name: {name}}}\nspec: {{podCIDRs: [\"{pods}\"]}}\nstatus: {{addresses: [{{type: InternalIP, address: \"{v4}\"}}, {{type: InternalIP, address: \"{v6}\"}}]}}\n"
            )
        };
        fs::write(
            self.manifests.join("nodes.yaml"),
            node("node-a", NODE_A, NODE_A6, "10.244.1.0/24")
                + &node("node-b", NODE_B, NODE_B6, "10.244.2.0/24"),
        )?;
        fs::create_dir_all(&self.bpffs)?;
        sh(&[
            "mount",
            "-t",
            "bpf",
            "bpf",
            self.bpffs.to_str().context("utf-8")?,
        ])?;
        let lan = self.add_ns("lan")?;
        ip(&lan, "link add br0 type bridge")?;
        ip(&lan, "link set br0 up")?;
        let client_ns = self.add_ns("cl")?;
        // The client's LAN port; "load balancers" deliver their IPs to node A.
        self.add_lan_port(&lan, "c", &client_ns, CLIENT, CLIENT6)?;
        for lb in LB_IPS {
            ip(&client_ns, &format!("route add {lb}/32 via {NODE_A}"))?;
        }
        // Each node's addresses, its pod network, and the other node's, in both families.
        struct Net {
            name: &'static str,
            addr: &'static str,
            pod_net: &'static str,
            pod: &'static str,
            other_net: &'static str,
            other: &'static str,
            addr6: &'static str,
            pod_net6: &'static str,
            pod6: &'static str,
            other_net6: &'static str,
            other6: &'static str,
        }
        let nets = [
            Net {
                name: "a",
                addr: NODE_A,
                pod_net: "10.244.1",
                pod: POD_A,
                other_net: "10.244.2.0/24",
                other: NODE_B,
                addr6: NODE_A6,
                pod_net6: "fd00:244:1",
                pod6: POD_A6,
                other_net6: "fd00:244:2::/64",
                other6: NODE_B6,
            },
            Net {
                name: "b",
                addr: NODE_B,
                pod_net: "10.244.2",
                pod: POD_B,
                other_net: "10.244.1.0/24",
                other: NODE_A,
                addr6: NODE_B6,
                pod_net6: "fd00:244:2",
                pod6: POD_B6,
                other_net6: "fd00:244:1::/64",
                other6: NODE_A6,
            },
        ];
        for Net {
            name,
            addr,
            pod_net,
            pod,
            other_net,
            other,
            addr6,
            pod_net6,
            pod6,
            other_net6,
            other6,
        } in nets
        {
            let node_ns = self.add_ns(&format!("n{name}"))?;
            for (k, v) in [
                ("net.ipv6.conf.all.forwarding", "1"),
                ("net.ipv4.ip_forward", "1"),
                ("net.ipv4.conf.all.rp_filter", "0"),
                ("net.ipv4.conf.default.rp_filter", "0"),
            ] {
                sh(&[
                    "ip",
                    "netns",
                    "exec",
                    &node_ns,
                    "sysctl",
                    "-qw",
                    &format!("{k}={v}"),
                ])?;
            }
            self.add_lan_port(&lan, name, &node_ns, addr, addr6)?;
            ip(&node_ns, &format!("route add {other_net} via {other}"))?;
            ip(&node_ns, &format!("-6 route add {other_net6} via {other6}"))?;
            // The pod behind this node.
            let pod_ns = self.add_ns(&format!("p{name}"))?;
            let pod_if = format!("p{name}{}", self.id);
            ip(
                &node_ns,
                &format!("link add {pod_if} type veth peer name eth0 netns {pod_ns}"),
            )?;
            // Node A's pod on a point-to-point veth; node B's behind a bridge, as the
            // bridge CNI plugin makes it (the classifier serves the bridge's port).
            let gateway = if name == "b" {
                let br = format!("b{name}{}", self.id);
                ip(&node_ns, &format!("link add {br} type bridge"))?;
                ip(&node_ns, &format!("link set {pod_if} master {br}"))?;
                ip(&node_ns, &format!("link set {br} up"))?;
                br
            } else {
                pod_if.clone()
            };
            ip(&node_ns, &format!("addr add {pod_net}.1/24 dev {gateway}"))?;
            ip(
                &node_ns,
                &format!("-6 addr add {pod_net6}::1/64 dev {gateway} nodad"),
            )?;
            ip(&node_ns, &format!("link set {pod_if} up"))?;
            ip(&pod_ns, &format!("addr add {pod}/24 dev eth0"))?;
            ip(&pod_ns, &format!("-6 addr add {pod6}/64 dev eth0 nodad"))?;
            ip(&pod_ns, "link set eth0 up")?;
            ip(&pod_ns, &format!("route add default via {pod_net}.1"))?;
            ip(&pod_ns, &format!("-6 route add default via {pod_net6}::1"))?;
            let echo = Command::new("ip")
                .args(["netns", "exec", &pod_ns])
                .arg(helper_bin("e2e-echo"))
                .args([
                    "--id",
                    &format!("pod-{name}"),
                    "--tcp",
                    "8080",
                    "--udp",
                    "5353",
                ])
                .stdout(Stdio::null())
                .spawn()
                .context("starting an echo pod")?;
            self.echoes.push(echo);
            let key = if name == "a" { "node-a" } else { "node-b" };
            self.nodes.insert(
                key,
                Node {
                    ns: node_ns,
                    interfaces: vec![format!("l{name}{}", self.id), pod_if],
                    agent: None,
                },
            );
        }
        // Wait for both pods, from the client through the nodes' plain routing... the
        // client has no route to pods; ask from each node instead.
        for (node, pod) in [("node-a", POD_A), ("node-b", POD_B)] {
            let ns = self.nodes[node].ns.clone();
            self.wait(&ns, &format!("{pod}:8080"))?;
        }
        for (node, pod) in [("node-a", POD_B6), ("node-b", POD_A6)] {
            let ns = self.nodes[node].ns.clone();
            self.wait(&ns, &format!("[{pod}]:8080"))?;
        }
        Ok(())
    }

    /// A veth from `peer_ns` (`eth0`, `addr`/24 and `addr6`/64) into the LAN bridge.
    fn add_lan_port(
        &self,
        lan: &str,
        name: &str,
        peer_ns: &str,
        addr: &str,
        addr6: &str,
    ) -> Result<()> {
        let lan_if = format!("b{name}{}", self.id);
        let peer_if = if name == "c" {
            "eth0".to_string()
        } else {
            format!("l{name}{}", self.id)
        };
        ip(
            lan,
            &format!("link add {lan_if} type veth peer name {peer_if} netns {peer_ns}"),
        )?;
        ip(lan, &format!("link set {lan_if} master br0"))?;
        ip(lan, &format!("link set {lan_if} up"))?;
        ip(peer_ns, &format!("addr add {addr}/24 dev {peer_if}"))?;
        ip(
            peer_ns,
            &format!("-6 addr add {addr6}/64 dev {peer_if} nodad"),
        )?;
        ip(peer_ns, &format!("link set {peer_if} up"))?;
        Ok(())
    }

    fn wait(&self, ns: &str, target: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self
                .client_in(
                    ns,
                    &["--target", target, "--count", "1", "--timeout-ms", "300"],
                )
                .is_ok_and(|a| a.first().is_some_and(|a| a.ok))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{target} did not come up in {ns}");
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Writes the manifests both agents read.
    pub fn write_manifests(&self, yaml: &str) -> Result<()> {
        let tmp = self.manifests.join(".services.tmp");
        fs::write(&tmp, yaml)?;
        fs::rename(tmp, self.manifests.join("services.yaml"))?;
        Ok(())
    }

    /// The agents started from now on are given their nodes' IPv6 addresses as well:
    /// NodePorts on both families.
    pub fn dual_stack(&mut self) {
        self.dual_stack = true;
    }

    /// Starts both agents; returns once each has programmed `frontends` frontends.
    pub fn start_agents(&mut self, frontends: usize) -> Result<()> {
        self.start_agents_with(frontends, &[])
    }

    /// Every veth end of the testbed with GRO on (NAPI, which native XDP needs on the
    /// end that receives what a program redirects or sends back) and checksum offload
    /// off (packets with full checksums, which XDP's rewrites keep right).
    pub fn prepare_for_xdp(&self) -> Result<()> {
        let mut ends: Vec<(String, String)> = vec![(self.ns("cl"), "eth0".into())];
        for name in ["c", "a", "b"] {
            ends.push((self.ns("lan"), format!("b{name}{}", self.id)));
        }
        for node in self.nodes.values() {
            for i in &node.interfaces {
                ends.push((node.ns.clone(), i.clone()));
            }
        }
        for pod in ["pa", "pb"] {
            ends.push((self.ns(pod), "eth0".into()));
        }
        for (ns, dev) in ends {
            sh(&[
                "ip", "netns", "exec", &ns, "ethtool", "-K", &dev, "tx", "off", "gro", "on",
            ])?;
        }
        Ok(())
    }

    /// Starts a `proxy-agent serve` replica (number `idx`) on the manifests, in node
    /// `node`'s namespace, listening on that node's address; returns the address.
    pub fn start_server(&mut self, idx: usize, node: &str) -> Result<String> {
        let addr = match node {
            "node-a" => NODE_A,
            "node-b" => NODE_B,
            other => bail!("no node {other}"),
        };
        let listen = format!("{addr}:{}", 10270 + idx);
        let ns = self.nodes.get(node).context("node")?.ns.clone();
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join(format!("server{idx}.log")))?;
        let child = Command::new(agent_bin())
            .arg("--netns")
            .arg(format!("/run/netns/{ns}"))
            .args([
                "serve",
                "--source",
                "files",
                "--insecure",
                "--listen",
                &listen,
                "--metrics-address",
                &format!("{addr}:{}", 10280 + idx),
            ])
            .arg("--manifests")
            .arg(&self.manifests)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting a server")?;
        if self.servers.len() <= idx {
            self.servers.resize_with(idx + 1, || None);
        }
        self.servers[idx] = Some(child);
        Ok(listen)
    }

    /// kill -9 of server `idx`.
    pub fn kill_server(&mut self, idx: usize) {
        if let Some(mut s) = self.servers.get_mut(idx).and_then(Option::take) {
            let _ = s.kill();
            let _ = s.wait();
        }
    }

    /// Stops node `node`'s process group as SIGSTOP does (a stuck consumer) or lets it
    /// go on (`stopped` false).
    pub fn pause_agent(&self, node: &str, stopped: bool) -> Result<()> {
        let agent = self
            .nodes
            .get(node)
            .and_then(|n| n.agent.as_ref())
            .context("no agent")?;
        let sig = if stopped { "-STOP" } else { "-CONT" };
        sh(&["kill", sig, &agent.id().to_string()])?;
        Ok(())
    }

    /// Cuts (`cut`) or heals the LAN between node `node` and the server at `server`
    /// (`addr:port`, as `start_server` returns it): the bridge drops that TCP port's
    /// packets both ways, silently, as a partition does; neither end is told, and every
    /// other path (traffic, the other node's feed) is untouched. The rule lives in the
    /// LAN namespace, so it goes with the testbed.
    pub fn partition(&self, node: &str, server: &str, cut: bool) -> Result<()> {
        let node_ip = match node {
            "node-a" => NODE_A,
            "node-b" => NODE_B,
            other => bail!("no node {other}"),
        };
        let (server_ip, port) = server.rsplit_once(':').context("server is addr:port")?;
        let lan = self.ns("lan");
        if !cut {
            sh(&[
                "ip", "netns", "exec", &lan, "nft", "delete", "table", "bridge", "pxpart",
            ])?;
            return Ok(());
        }
        let rules = format!(
            "table bridge pxpart {{\n chain cut {{\n  type filter hook forward priority 0; policy accept;\n  \
             ip saddr {node_ip} ip daddr {server_ip} tcp dport {port} drop\n  \
             ip saddr {server_ip} ip daddr {node_ip} tcp sport {port} drop\n }}\n}}\n"
        );
        let file = self.root.join("partition.nft");
        fs::write(&file, rules)?;
        sh(&[
            "ip",
            "netns",
            "exec",
            &lan,
            "nft",
            "-f",
            file.to_str().context("utf-8")?,
        ])
        .context("the partition's nft rules")?;
        Ok(())
    }

    pub fn server_log(&self, idx: usize) -> String {
        fs::read_to_string(self.root.join(format!("server{idx}.log"))).unwrap_or_default()
    }

    /// The frontends in node `node`'s pinned service map.
    pub fn frontends(&self, node: &str) -> Option<usize> {
        self.dump(node).ok()?["services"].as_array().map(Vec::len)
    }

    /// Waits until node `node` holds `frontends` frontends.
    pub fn wait_frontends(&self, node: &str, frontends: usize, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        while self.frontends(node) != Some(frontends) {
            if Instant::now() > deadline {
                bail!(
                    "{node} holds {:?} frontends, not {frontends}:\n{}",
                    self.frontends(node),
                    self.log(node)
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// An XDP program that only passes (`xdp_pass`, native) on the LAN bridge's ports,
    /// the veth peers of the nodes' uplinks: frames a node's native XDP sends back out
    /// (`XDP_TX`) into a veth whose peer has only GRO's NAPI arrive late or not at all
    /// (seen on 6.18: the client's connections time out), with an XDP program there
    /// they are received at once. Attached while the returned object lives.
    pub fn pass_on_lan_ports(&self) -> Result<aya::Ebpf> {
        let lan = format!("/run/netns/{}", self.ns("lan"));
        let id = self.id.clone();
        std::thread::spawn(move || -> Result<aya::Ebpf> {
            let f = std::fs::File::open(&lan)?;
            nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let (mut ebpf, _maps) = proxy_agent::dataplane::bpf::load_private(&[])?;
            let prog: &mut aya::programs::Xdp = ebpf
                .program_mut("xdp_pass")
                .context("the object has no xdp_pass")?
                .try_into()?;
            prog.load()?;
            for name in ["c", "a", "b"] {
                let idx = nix::net::if_::if_nametoindex(format!("b{name}{id}").as_str())?;
                prog.attach(idx, aya::programs::XdpMode::Driver)?;
            }
            Ok(ebpf)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("attaching xdp_pass panicked"))?
    }

    /// `proxy-agent dump --json` of `node`'s pins.
    pub fn dump(&self, node: &str) -> Result<serde_json::Value> {
        let pins = self.bpffs.join(node);
        let out = sh(&[
            agent_bin().to_str().context("utf-8")?,
            "dump",
            "--json",
            "--bpffs",
            pins.to_str().context("utf-8")?,
        ])?;
        Ok(serde_json::from_str(&out)?)
    }

    /// One of `node`'s BPF counters, summed over CPUs.
    pub fn counter(&self, node: &str, name: &str) -> u64 {
        self.dump(node).expect("dump")["counters"][name]
            .as_u64()
            .unwrap_or_else(|| panic!("counter {name}"))
    }

    /// `start_agents` with more arguments for `proxy-agent run` (both agents); with a
    /// `--source` among them, the agents read no manifests.
    pub fn start_agents_with(&mut self, frontends: usize, extra: &[&str]) -> Result<()> {
        self.agent_args = extra.iter().map(|a| a.to_string()).collect();
        for name in ["node-a", "node-b"] {
            self.spawn_agent(name)?;
        }
        for name in ["node-a", "node-b"] {
            self.wait_frontends(name, frontends, Duration::from_secs(20))?;
        }
        Ok(())
    }

    /// Kills node `node`'s agent (SIGKILL: no goodbye) and starts it again with the same
    /// arguments; its pins (maps, links) carry the dataplane across.
    pub fn restart_agent(&mut self, node: &str, frontends: usize) -> Result<()> {
        let n = self.nodes.get_mut(node).context("node")?;
        if let Some(mut a) = n.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        let name = if node == "node-a" { "node-a" } else { "node-b" };
        self.spawn_agent(name)?;
        self.wait_frontends(node, frontends, Duration::from_secs(20))
    }

    fn spawn_agent(&mut self, name: &'static str) -> Result<()> {
        let manifests = self.manifests.display().to_string();
        let extra = self.agent_args.clone();
        let source: Vec<&str> = if extra.iter().any(|a| a == "--source") {
            Vec::new()
        } else {
            vec!["--manifests", &manifests]
        };
        let config = self.root.join("config.yaml");
        fs::write(
            &config,
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16,fd00:244::/48\nminSyncPeriod: 20ms\n",
        )?;
        let (addr, addr6) = if name == "node-a" {
            (NODE_A, NODE_A6)
        } else {
            (NODE_B, NODE_B6)
        };
        let node_ip6: &[&str] = if self.dual_stack {
            &["--node-ip", addr6]
        } else {
            &[]
        };
        let pins = self.bpffs.join(name);
        // Appended to, so a restart keeps the first life's lines.
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join(format!("{name}.log")))?;
        let node = self.nodes.get_mut(name).context("node")?;
        let agent = Command::new(agent_bin())
            .arg("--netns")
            .arg(format!("/run/netns/{}", node.ns))
            .arg("run")
            .arg("--config")
            .arg(&config)
            .args(&source)
            .arg("--bpffs")
            .arg(&pins)
            .args([
                "--cgroup",
                "none",
                "--interfaces",
                &node.interfaces.join(","),
                "--node-name",
                name,
                "--node-ip",
                addr,
            ])
            .args(node_ip6)
            .args(&extra)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting an agent")?;
        node.agent = Some(agent);
        Ok(())
    }

    /// Runs `nft` in the LAN (bridge) namespace: rules that watch the wire between the
    /// nodes and the client.
    pub fn lan_nft(&self, args: &[&str]) -> Result<String> {
        let mut cmd = vec!["ip", "netns", "exec"];
        let lan = self.ns("lan");
        cmd.push(&lan);
        cmd.push("nft");
        cmd.extend_from_slice(args);
        sh(&cmd)
    }

    /// The LAN bridge's port towards `who` (`"a"`, `"b"`: the nodes; `"c"`: the client).
    pub fn lan_port(&self, who: &str) -> String {
        format!("b{who}{}", self.id)
    }

    pub fn log(&self, node: &str) -> String {
        fs::read_to_string(self.root.join(format!("{node}.log"))).unwrap_or_default()
    }

    fn client_in(&self, ns: &str, args: &[&str]) -> Result<Vec<Attempt>> {
        let out = Command::new(helper_bin("e2e-client"))
            .arg("--netns")
            .arg(format!("/run/netns/{ns}"))
            .args(args)
            .output()
            .context("running e2e-client")?;
        if !out.status.success() {
            bail!(
                "e2e-client {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        client::parse_attempts(&String::from_utf8_lossy(&out.stdout))
    }

    /// The external client, in the background.
    pub fn spawn_client(&self, args: &[&str]) -> Result<Background> {
        let mut cmd = Command::new(helper_bin("e2e-client"));
        cmd.arg("--netns")
            .arg(format!("/run/netns/{}", self.ns("cl")))
            .args(args);
        Background::spawn(cmd)
    }

    /// The external client.
    pub fn client(&self, args: &[&str]) -> Result<Vec<Attempt>> {
        self.client_in(&self.ns("cl"), args)
    }

    /// A pod (`"a"` or `"b"`).
    pub fn from_pod(&self, pod: &str, args: &[&str]) -> Result<Vec<Attempt>> {
        self.client_in(&self.ns(&format!("p{pod}")), args)
    }

    /// A command run in the external client's namespace: its standard output.
    pub fn in_client(&self, cmd: &[&str]) -> Result<String> {
        let ns = self.ns("cl");
        let mut args = vec!["ip", "netns", "exec", ns.as_str()];
        args.extend_from_slice(cmd);
        sh(&args)
    }

    /// A command run in node `node`'s namespace: its standard output.
    pub fn in_node(&self, node: &str, cmd: &[&str]) -> Result<String> {
        let ns = &self
            .nodes
            .get(node)
            .with_context(|| format!("no node {node}"))?
            .ns;
        let mut args = vec!["ip", "netns", "exec", ns.as_str()];
        args.extend_from_slice(cmd);
        sh(&args)
    }

    /// A Python script run in pod `pod`'s namespace (`"a"` or `"b"`): its standard
    /// output. (A pod with `CAP_NET_RAW`, as containers have by default.)
    pub fn pod_python(&self, pod: &str, script: &str) -> Result<String> {
        let ns = self.ns(&format!("p{pod}"));
        sh(&["ip", "netns", "exec", &ns, "python3", "-c", script])
    }

    /// The MAC of node `node`'s end of its pod's veth: where the pod's frames go.
    pub fn pod_gateway_mac(&self, node: &str) -> Result<String> {
        let pod_if = self
            .nodes
            .get(node)
            .and_then(|n| n.interfaces.get(1))
            .with_context(|| format!("no pod interface on {node}"))?;
        Ok(self
            .in_node(node, &["cat", &format!("/sys/class/net/{pod_if}/address")])?
            .trim()
            .to_string())
    }

    /// The MAC address of node `node`'s interface on the LAN.
    pub fn uplink_mac(&self, node: &str) -> Result<String> {
        let uplink = self
            .nodes
            .get(node)
            .and_then(|n| n.interfaces.first())
            .with_context(|| format!("no uplink on {node}"))?;
        Ok(self
            .in_node(node, &["cat", &format!("/sys/class/net/{uplink}/address")])?
            .trim()
            .to_string())
    }

    /// A Python script run in the external client's namespace: its standard output.
    pub fn client_python(&self, script: &str) -> Result<String> {
        self.in_client(&["python3", "-c", script])
    }

    /// An HTTP GET from the external client: status code and body.
    pub fn http_get(&self, url: &str) -> Result<(u16, String)> {
        let script = format!(
            "import urllib.request,urllib.error\ntry:\n r=urllib.request.urlopen('{url}',timeout=3);print(r.status);print(r.read().decode())\nexcept urllib.error.HTTPError as e:\n print(e.code);print(e.read().decode())"
        );
        let out = self.client_python(&script)?;
        let (code, body) = out.split_once('\n').unwrap_or((out.as_str(), ""));
        Ok((
            code.trim().parse().context("status code")?,
            body.to_string(),
        ))
    }
}

impl Drop for MultiNode {
    fn drop(&mut self) {
        for node in self.nodes.values_mut() {
            if let Some(mut a) = node.agent.take() {
                let _ = a.kill();
                let _ = a.wait();
            }
        }
        for e in &mut self.echoes {
            let _ = e.kill();
            let _ = e.wait();
        }
        for s in self.servers.iter_mut().filter_map(Option::take) {
            let mut s = s;
            let _ = s.kill();
            let _ = s.wait();
        }
        for name in ["node-a", "node-b"] {
            let _ = Command::new(agent_bin())
                .args(["cleanup", "--bpffs"])
                .arg(self.bpffs.join(name))
                .stderr(Stdio::null())
                .status();
        }
        for ns in self.namespaces.drain(..) {
            let _ = sh(&["ip", "netns", "del", &ns]);
        }
        let _ = sh(&["umount", self.bpffs.to_str().unwrap_or("")]);
        let _ = fs::remove_dir_all(&self.root);
    }
}
