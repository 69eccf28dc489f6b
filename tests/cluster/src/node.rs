//! Real nodes in the box: per node a network namespace, a cgroup subtree, containerd
//! (runc, CNI bridge + host-local + loopback) and a kubelet that registers with the box's
//! API server and runs Pods. Nothing touches the machine's real interfaces or its root
//! cgroup; everything is removed on drop.
//!
//! The wiring, for box number K (unique on the machine while it runs):
//!
//! ```text
//!  root netns: pxbK (10.250.K.1/24) ── hub netns pxb-K-hub: bridge ── eth0 of each node
//!  node i netns pxb-K-nI: eth0 10.250.K.(10+i), Pods on cni0 in 10.251.K.(128 i)/25
//! ```
//!
//! The API server (on the root namespace's loopback) reaches kubelets at their node IPs
//! over the veth; kubelets and host-network Pods reach it at 127.0.0.1 in their namespace
//! through a relay ([`Cluster::expose_in_netns`]). The nodes have no default route, and
//! the root namespace routes only the box's two ranges to the veth, so no packet of the
//! box can leave it. containerd and the kubelet share one mount namespace of their own
//! (a slave of the machine's): the kubelet's volume mounts are visible to runc, and vanish
//! with the processes. In it, the six kernel sysctls the kubelet would otherwise set
//! machine-wide (`vm.overcommit_memory`, `kernel.panic_on_oops`, …) are covered by files
//! holding the values it wants, so it reads them as set and writes nothing.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::Api;
use proxy_testbed::{add_namespace, ip, sh};
use serde_json::json;

use crate::{
    cluster::{Cluster, NetnsRelay, eventually},
    images,
};

/// Debian's containernetworking-plugins.
const CNI_BIN_DIR: &str = "/usr/lib/cni";
/// The cgroup v1 hierarchies the kubelet manages (cgroupfs driver), and v2's, if mounted.
const CGROUP_V1: [&str; 9] = [
    "cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd",
];
/// What the kubelet wants of these (pkg/kubelet/cm setupKernelTunables); each is shown to
/// it, in its own mount namespace, by a file holding that value.
const KERNEL_TUNABLES: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];
/// The label deploy/daemonset.yaml's nodeSelector wants.
pub const EBPF_LABEL: &str = "proxy.example.dev/ebpf=true";
const NODE_READY_TIMEOUT: Duration = Duration::from_secs(180);

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The binaries a node needs beyond the control plane's (`cargo xtask cluster --nodes N`
/// builds them), and the Debian programs (`cargo xtask setup` installs them).
const NODE_BINARIES: [&str; 3] = ["kubelet", "kube-scheduler", "agnhost"];
const NODE_PROGRAMS: [&str; 6] = [
    "/usr/bin/containerd",
    "/usr/sbin/runc",
    "/usr/bin/ctr",
    "/usr/lib/cni/bridge",
    "/bin/busybox",
    "/usr/bin/nc.openbsd",
];

/// For tests: a box with `count` nodes, every image imported (the agent's from
/// [`crate::agent_bin`]); fails without the binaries.
pub async fn start_box(test: &str, count: usize) -> Result<(Nodes, Cluster)> {
    let bin_dir = require_node_binaries(test);
    let cluster = Cluster::start(crate::cluster::ClusterOptions::with_nodes(&bin_dir)).await?;
    let images = images::for_box(
        &bin_dir,
        &proxy_testbed::agent_bin(),
        &cluster.dir().join("images"),
    )?;
    let opts = NodesOptions {
        count,
        bin_dir,
        images,
        service_cidr: "10.96.0.0/16".into(),
    };
    let nodes = Nodes::start(&cluster, opts).await?;
    Ok((nodes, cluster))
}

impl Nodes {
    /// The Pod range of the whole box (every node's range is in it).
    pub fn cluster_pod_cidr(&self) -> String {
        format!("10.251.{}.0/24", self.k)
    }
}

/// For tests: the binaries' folder, with the nodes' binaries in it and the runtime
/// installed. Without them the test fails, saying how to get them (never a silent pass).
pub fn require_node_binaries(test: &str) -> PathBuf {
    let dir = crate::cluster::require_binaries(test);
    if let Some(missing) = NODE_BINARIES.iter().find(|b| !dir.join(b).is_file()) {
        panic!(
            "{test} needs {missing} in {} (build it: `cargo xtask cluster --nodes 1 --build-only`)",
            dir.display()
        );
    }
    if let Some(missing) = NODE_PROGRAMS.iter().find(|p| !Path::new(p).exists()) {
        panic!("{test} needs {missing} (install it: `cargo xtask setup`)");
    }
    dir
}

/// What [`Nodes::start`] builds.
#[derive(Clone, Debug)]
pub struct NodesOptions {
    /// 1 or 2.
    pub count: usize,
    /// Folder holding kubelet (the cluster's `bin_dir`).
    pub bin_dir: PathBuf,
    /// docker-archive tarballs imported into each node's containerd.
    pub images: Vec<PathBuf>,
    /// The Service range, routed to each node's eth0 (the proxy intercepts it there).
    pub service_cidr: String,
}

/// The box's nodes and their network. Dropping it stops kubelets, containers and
/// containerd, and removes namespaces, cgroups and folders.
pub struct Nodes {
    k: u8,
    dir: PathBuf,
    hub: String,
    root_veth: String,
    cgroup: String,
    nodes: Vec<Node>,
    /// The Pods' nameserver (`clusterDNS`), on the root namespace's end of the box network.
    dns: Option<crate::dns::Dns>,
}

/// One node: its namespace, folder, processes.
pub struct Node {
    pub name: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    pub pod_cidr: String,
    dir: PathBuf,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    _relay: Option<NetnsRelay>,
}

impl Node {
    /// `/run/netns/NAME`, for `setns` and the agent's `--netns`.
    pub fn netns_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.netns)
    }

    /// Whether `ip` is in this node's Pod range.
    pub fn holds_pod_ip(&self, ip: Ipv4Addr) -> bool {
        let Some((net, len)) = self.pod_cidr.split_once('/') else {
            return false;
        };
        let (Ok(net), Ok(len)) = (net.parse::<Ipv4Addr>(), len.parse::<u32>()) else {
            return false;
        };
        let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
        u32::from(ip) & mask == u32::from(net) & mask
    }

    /// This node's folder (containerd's and the kubelet's state, logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `ctr` against this node's containerd (namespace k8s.io).
    pub fn ctr(&self, args: &[&str]) -> Result<String> {
        let sock = self.dir.join("containerd/containerd.sock");
        let sock = sock.to_string_lossy();
        let mut argv = vec!["ctr", "--address", &sock, "-n", "k8s.io"];
        argv.extend_from_slice(args);
        sh(&argv)
    }
}

impl Nodes {
    /// Builds the network, starts containerd and a kubelet per node, imports the images,
    /// and returns once every Node is Ready.
    pub async fn start(cluster: &Cluster, opts: NodesOptions) -> Result<Self> {
        if !(1..=2).contains(&opts.count) {
            bail!("a box has 1 or 2 nodes, not {}", opts.count);
        }
        let k = free_box_number()?;
        let dir = cluster.dir().join("nodes");
        fs::create_dir_all(&dir)?;
        let mut nodes = Nodes {
            k,
            hub: format!("pxb-{k}-hub"),
            root_veth: format!("pxb{k}"),
            cgroup: format!("pxy-box-{k}-{}", std::process::id()),
            dir,
            nodes: Vec::new(),
            dns: None,
        };
        // On error `nodes` is dropped, which removes what was made.
        nodes.build_network(&opts)?;
        nodes.dns = Some(crate::dns::Dns::start(
            nodes.outside_ip(),
            cluster.client().await?,
        )?);
        for i in 0..opts.count {
            let node = nodes.start_node(cluster, &opts, i)?;
            nodes.nodes.push(node);
        }
        nodes.wait_ready(cluster).await?;
        Ok(nodes)
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node network's address in the root namespace (what reaches NodePorts from
    /// outside every node).
    pub fn outside_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 250, self.k, 1)
    }

    /// The cgroup (v1 and v2 alike) under which every node's subtree lives, relative to
    /// the hierarchy roots.
    pub fn cgroup(&self) -> &str {
        &self.cgroup
    }

    /// The cgroup v2 path of node `node`'s subtree (what the agent's `--cgroup` hooks).
    pub fn cgroup_v2_path_of(&self, node: &str) -> PathBuf {
        cgroup_v2_root().join(&self.cgroup).join(node)
    }

    /// Starts `program ARGS` on node `i` as a host process would run there: in its network
    /// namespace, its `system` cgroup and containerd's mount namespace (kube-proxy, say).
    /// Stopped when the box is (it is in the node's cgroup).
    pub fn spawn_on_node(
        &self,
        cluster: &Cluster,
        i: usize,
        log: &str,
        program: &Path,
        args: &[String],
    ) -> Result<Child> {
        let node = self.nodes.get(i).context("no such node")?;
        let pid = node
            .containerd
            .as_ref()
            .map(Child::id)
            .context("containerd of the node is not running")?;
        let mut cmd = Command::new("sh");
        cmd.arg(node.dir.join("launch.sh"))
            .arg(format!("join:{pid}"))
            .arg(&node.netns)
            .arg(format!("{}/{}/system", self.cgroup, node.name))
            .arg(node.dir.join("sysctl"))
            .arg(node.dir.join("container-logs"))
            .arg(program)
            .args(args);
        cluster.spawn_logged(log, cmd)
    }

    /// How many processes run in node `i`'s Pod cgroups (`kubepods` under its
    /// cgroupRoot), in every hierarchy the kubelet manages: the smallest count.
    pub fn pod_processes(&self, i: usize) -> usize {
        hierarchies(&format!("{}/{}/kubepods", self.cgroup, node_name(i)))
            .iter()
            .filter(|h| {
                !h.starts_with(cgroup_v2_root()) || !Path::new("/sys/fs/cgroup/cpu").exists()
            })
            .map(|h| {
                let mut pids = Vec::new();
                collect_pids(h, &mut pids);
                pids.len()
            })
            .min()
            .unwrap_or(0)
    }

    fn build_network(&mut self, opts: &NodesOptions) -> Result<()> {
        let k = self.k;
        add_namespace(&self.hub)?;
        ip(&self.hub, "link add br0 type bridge")?;
        ip(&self.hub, "link set br0 up")?;
        // The root namespace's end: the API server's way to the kubelets, and "outside
        // the nodes" for NodePorts.
        sh(&[
            "ip",
            "link",
            "add",
            &self.root_veth,
            "type",
            "veth",
            "peer",
            "name",
            "up0",
            "netns",
            &self.hub,
        ])?;
        ip(&self.hub, "link set up0 master br0 up")?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("10.250.{k}.1/24"),
            "dev",
            &self.root_veth,
        ])?;
        sh(&["ip", "link", "set", &self.root_veth, "up"])?;
        for i in 0..opts.count {
            let ns = self.netns(i);
            add_namespace(&ns)?;
            sh(&[
                "ip",
                "link",
                "add",
                &format!("n{i}"),
                "netns",
                &self.hub,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &ns,
            ])?;
            ip(&self.hub, &format!("link set n{i} master br0 up"))?;
            ip(&ns, &format!("addr add {}/24 dev eth0", node_ip(k, i)))?;
            ip(&ns, "link set eth0 up")?;
            // Pods route through the node (cni0 is their gateway).
            sh(&[
                "ip",
                "netns",
                "exec",
                &ns,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ])?;
            // Connections from the node itself to ClusterIPs need a route to be made at
            // all; the proxy translates them before they would use it.
            ip(&ns, &format!("route add {} dev eth0", opts.service_cidr))?;
            for j in (0..opts.count).filter(|&j| j != i) {
                ip(
                    &ns,
                    &format!("route add {} via {}", pod_cidr(k, j), node_ip(k, j)),
                )?;
            }
            sh(&[
                "ip",
                "route",
                "add",
                &pod_cidr(k, i),
                "via",
                &node_ip(k, i).to_string(),
                "dev",
                &self.root_veth,
            ])?;
        }
        Ok(())
    }

    fn netns(&self, i: usize) -> String {
        format!("pxb-{}-n{i}", self.k)
    }

    fn start_node(&self, cluster: &Cluster, opts: &NodesOptions, i: usize) -> Result<Node> {
        let name = node_name(i);
        let dir = self.dir.join(&name);
        for sub in [
            "containerd",
            "cni",
            "ipam",
            "kubelet",
            "pod-logs",
            "container-logs",
            "sysctl",
            "netns",
        ] {
            fs::create_dir_all(dir.join(sub))?;
        }
        let mut node = Node {
            netns: self.netns(i),
            ip: node_ip(self.k, i),
            pod_cidr: pod_cidr(self.k, i),
            name,
            dir,
            containerd: None,
            kubelet: None,
            _relay: None,
        };
        let cgroup = format!("{}/{}", self.cgroup, node.name);
        make_cgroups(&cgroup)?;
        node._relay = Some(cluster.expose_in_netns(&node.netns_path())?);
        self.write_configs(cluster, &node, &cgroup)?;

        let launch = node.dir.join("launch.sh");
        fs::write(&launch, LAUNCH_SH)?;
        let mut containerd = Command::new("sh");
        containerd
            .arg(&launch)
            .arg("new")
            .arg(&node.netns)
            .arg(format!("{cgroup}/system"))
            .arg(node.dir.join("sysctl"))
            .arg(node.dir.join("container-logs"))
            .arg("containerd")
            .arg("--config")
            .arg(node.dir.join("containerd/config.toml"));
        let log = format!("{}-containerd", node.name);
        node.containerd = Some(cluster.spawn_logged(&log, containerd)?);
        let sock = node.dir.join("containerd/containerd.sock");
        let deadline = Instant::now() + Duration::from_secs(30);
        while node.ctr(&["version"]).is_err() {
            if let Some(status) = node
                .containerd
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "containerd of {} exited: {status}\n{}",
                    node.name,
                    cluster.log_tail(&log)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "containerd of {} not up at {}\n{}",
                    node.name,
                    sock.display(),
                    cluster.log_tail(&log)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        for image in &opts.images {
            node.ctr(&["images", "import", &image.to_string_lossy()])
                .with_context(|| format!("importing {} into {}", image.display(), node.name))?;
        }

        let pid = node
            .containerd
            .as_ref()
            .map(Child::id)
            .context("containerd started")?;
        let kubeconfig = node.dir.join("kubelet.kubeconfig");
        cluster.write_client_kubeconfig(
            &kubeconfig,
            &format!("system:node:{}", node.name),
            &["system:nodes"],
        )?;
        let mut kubelet = Command::new("sh");
        kubelet
            .arg(&launch)
            .arg(format!("join:{pid}"))
            .arg(&node.netns)
            .arg(format!("{cgroup}/system"))
            .arg(node.dir.join("sysctl"))
            .arg(node.dir.join("container-logs"))
            .arg(opts.bin_dir.join("kubelet"))
            .arg(format!(
                "--config={}",
                node.dir.join("kubelet.yaml").display()
            ))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--root-dir={}", node.dir.join("kubelet").display()))
            .arg(format!("--hostname-override={}", node.name))
            .arg(format!("--node-ip={}", node.ip))
            .arg(format!("--node-labels={EBPF_LABEL}"))
            .arg("--v=2");
        node.kubelet = Some(cluster.spawn_logged(&format!("{}-kubelet", node.name), kubelet)?);
        Ok(node)
    }

    fn write_configs(&self, cluster: &Cluster, node: &Node, cgroup: &str) -> Result<()> {
        let d = &node.dir;
        for (file, value) in KERNEL_TUNABLES {
            fs::write(
                d.join("sysctl").join(file.replace('/', ".")),
                format!("{value}\n"),
            )?;
        }
        let containerd = CONTAINERD_TOML
            .replace("@DIR@", &d.join("containerd").to_string_lossy())
            .replace("@RUNC_ROOT@", &d.join("runc").to_string_lossy())
            .replace("@CNI_CONF@", &d.join("cni").to_string_lossy())
            .replace("@CNI_BIN@", CNI_BIN_DIR)
            .replace("@PAUSE@", images::PAUSE);
        fs::write(d.join("containerd/config.toml"), containerd)?;
        let cni = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "box",
            "plugins": [{
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": false,
                // A Pod reaching itself through its Service: the reply goes back out of
                // the port it came in by.
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": d.join("ipam"),
                },
            }],
        });
        fs::write(
            d.join("cni/10-box.conflist"),
            serde_json::to_vec_pretty(&cni)?,
        )?;
        fs::write(
            d.join("resolv.conf"),
            "nameserver 127.0.0.1\noptions ndots:5\n",
        )?;
        let kubelet = KUBELET_YAML
            .replace("@CGROUP@", &format!("/{cgroup}"))
            .replace(
                "@SOCK@",
                &d.join("containerd/containerd.sock").to_string_lossy(),
            )
            .replace("@IP@", &node.ip.to_string())
            .replace("@CA@", &cluster.ca_file().to_string_lossy())
            .replace("@RESOLV@", &d.join("resolv.conf").to_string_lossy())
            .replace("@PODLOGS@", &d.join("pod-logs").to_string_lossy())
            .replace("@DNS@", &self.outside_ip().to_string());
        fs::write(d.join("kubelet.yaml"), kubelet)?;
        Ok(())
    }

    async fn wait_ready(&mut self, cluster: &Cluster) -> Result<()> {
        let api: Api<NodeObject> = Api::all(cluster.client().await?);
        let deadline = Instant::now() + NODE_READY_TIMEOUT;
        for node in &mut self.nodes {
            let log = format!("{}-kubelet", node.name);
            loop {
                let ready = api.get_opt(&node.name).await?.is_some_and(|n| {
                    n.status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                });
                if ready {
                    break;
                }
                if let Some(status) = node
                    .kubelet
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten())
                {
                    bail!(
                        "kubelet of {} exited: {status}\n{}",
                        node.name,
                        cluster.log_tail(&log)
                    );
                }
                if Instant::now() > deadline {
                    bail!(
                        "node {} not Ready after {NODE_READY_TIMEOUT:?}\n{}",
                        node.name,
                        cluster.log_tail(&log)
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Ok(())
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        // The kubelets first (they would restart containers), then every process left in
        // the box's cgroups: containers, shims (which outlive containerd), containerd.
        for node in &mut self.nodes {
            if let Some(child) = node.kubelet.take() {
                crate::cluster::stop_child(child);
            }
        }
        kill_cgroup_tree(&self.cgroup);
        for node in &mut self.nodes {
            if let Some(mut child) = node.containerd.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            node._relay = None;
        }
        remove_cgroups(&self.cgroup);
        self.dns = None;
        for i in 0..self.nodes.len().max(2) {
            let _ = sh(&["ip", "netns", "del", &self.netns(i)]);
        }
        let _ = sh(&["ip", "netns", "del", &self.hub]);
        let _ = sh(&["ip", "link", "del", &self.root_veth]);
    }
}

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

fn node_ip(k: u8, i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 250, k, 10 + i as u8)
}

fn pod_cidr(k: u8, i: usize) -> String {
    format!("10.251.{k}.{}/25", 128 * i)
}

/// A box number whose two ranges nothing in the root namespace routes yet.
fn free_box_number() -> Result<u8> {
    let routes = sh(&["ip", "-4", "route", "show"])?;
    let start = (std::process::id() + COUNTER.fetch_add(1, Ordering::Relaxed) * 7) % 200;
    (0..200)
        .map(|n| ((start + n) % 200 + 20) as u8)
        .find(|k| {
            !routes.contains(&format!("10.250.{k}.")) && !routes.contains(&format!("10.251.{k}."))
        })
        .context("no free 10.250.K.0/24 for the box's node network")
}

fn cgroup_v2_root() -> PathBuf {
    if Path::new("/sys/fs/cgroup/unified/cgroup.procs").exists() {
        PathBuf::from("/sys/fs/cgroup/unified")
    } else {
        PathBuf::from("/sys/fs/cgroup")
    }
}

/// Every hierarchy's folder for `rel` (v1 controllers, and v2).
fn hierarchies(rel: &str) -> Vec<PathBuf> {
    let v1 = Path::new("/sys/fs/cgroup/cpu").exists();
    let mut roots: Vec<PathBuf> = if v1 {
        CGROUP_V1
            .iter()
            .map(|c| Path::new("/sys/fs/cgroup").join(c))
            .collect()
    } else {
        Vec::new()
    };
    roots.push(cgroup_v2_root());
    roots.into_iter().map(|r| r.join(rel)).collect()
}

fn make_cgroups(rel: &str) -> Result<()> {
    for sub in ["", "/system"] {
        for dir in hierarchies(&format!("{rel}{sub}")) {
            fs::create_dir_all(&dir)
                .with_context(|| format!("creating cgroup {}", dir.display()))?;
        }
    }
    // cpuset v1: a new group has no CPUs or memory nodes until given its parent's.
    let cpuset = Path::new("/sys/fs/cgroup/cpuset");
    if cpuset.exists() {
        let mut path = cpuset.to_path_buf();
        for part in format!("{rel}/system").split('/') {
            let parent = path.clone();
            path.push(part);
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let value = fs::read_to_string(parent.join(file)).unwrap_or_default();
                let _ = fs::write(path.join(file), value.trim());
            }
        }
    }
    Ok(())
}

/// SIGKILLs every process under `rel` until none is left (a shim may fork as it dies).
fn kill_cgroup_tree(rel: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut pids = Vec::new();
        for root in hierarchies(rel) {
            collect_pids(&root, &mut pids);
        }
        if pids.is_empty() || Instant::now() > deadline {
            return;
        }
        for pid in pids {
            // SAFETY: kill(2) with a pid read from our own cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn collect_pids(dir: &Path, pids: &mut Vec<i32>) {
    if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
        pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                collect_pids(&entry.path(), pids);
            }
        }
    }
}

/// Removes `rel`'s cgroups, deepest first, in every hierarchy.
fn remove_cgroups(rel: &str) {
    fn remove(dir: &Path) {
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    remove(&entry.path());
                }
            }
        }
        let _ = fs::remove_dir(dir);
    }
    for root in hierarchies(rel) {
        remove(&root);
    }
}

/// Starts a node process: into its cgroup (every hierarchy), its network namespace, and
/// either a new mount namespace (`new`: containerd) or containerd's (`join:PID`: the
/// kubelet), where the kernel tunables are covered and /var/log/containers is the node's.
const LAUNCH_SH: &str = r#"set -e
mode=$1 netns=$2 cgroup=$3 sysctl=$4 logs=$5; shift 5
for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
  [ -f "$h$cgroup/cgroup.procs" ] && echo $$ > "$h$cgroup/cgroup.procs"
done
case $mode in
new)
  mkdir -p /var/log/containers /run/netns
  exec nsenter --net=/run/netns/$netns unshare --mount --propagation slave sh -c '
    set -e
    # Shared among this namespace and the containers (mountPropagation), still a slave
    # of the machine mounts: nothing mounted here reaches them.
    mount --make-rshared /
    for f in "$0"/*; do mount --bind "$f" /proc/sys/$(basename "$f" | tr . /); done
    mount --bind "$1" /var/log/containers
    # The Pod network namespaces (containerd names them /var/run/netns/cni-*): the
    # folder of the node, gone with it even if containerd never tears them down.
    mount --bind "$(dirname "$0")/netns" /run/netns
    shift; exec "$@"' "$sysctl" "$logs" "$@" ;;
join:*)
  exec nsenter --mount=/proc/${mode#join:}/ns/mnt --net=/run/netns/$netns "$@" ;;
esac
"#;

const CONTAINERD_TOML: &str = r#"version = 2
root = "@DIR@/root"
state = "@DIR@/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "@DIR@/containerd.sock"
[ttrpc]
  address = "@DIR@/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "@DIR@/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "@PAUSE@"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  # This machine's processes may not lower their OOM score (no CAP_SYS_RESOURCE): the
  # kubelet's -998 for sandboxes, -997 for node-critical Pods become ours.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "@RUNC_ROOT@"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "@CNI_BIN@"
    conf_dir = "@CNI_CONF@"
"#;

/// Only cluster-CA certificates (the API server's) may talk to it; no image GC (the
/// images were imported, there is nothing to pull them back from); evictions only when
/// nearly full (a shared disk).
const KUBELET_YAML: &str = r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: "@CGROUP@"
containerRuntimeEndpoint: "unix://@SOCK@"
address: "@IP@"
port: 10250
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "@CA@"}
authorization: {mode: AlwaysAllow}
failSwapOn: false
resolvConf: "@RESOLV@"
clusterDomain: cluster.local
clusterDNS: ["@DNS@"]
podLogsDir: "@PODLOGS@"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%", "nodefs.inodesFree": "1%"}
serializeImagePulls: false
"#;

/// An agnhost Pod on `node` running `args`.
pub fn agnhost_pod(name: &str, node: &str, args: &[&str], restart: &str) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": restart,
            "containers": [{
                "name": "c",
                "image": images::AGNHOST,
                "imagePullPolicy": "Never",
                "command": args,
            }],
        },
    }))?)
}

/// Waits until Pod `name` is Ready (or, for a run-once Pod, Succeeded); returns it.
pub async fn wait_pod(pods: &Api<Pod>, name: &str, phase: &str) -> Result<Pod> {
    eventually(&format!("Pod {name} {phase}"), || async {
        let pod = pods.get(name).await?;
        let status = pod.status.clone().unwrap_or_default();
        let ready = status
            .conditions
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let done = status.phase.as_deref() == Some(phase);
        Ok((done && (phase != "Running" || ready)).then_some(pod))
    })
    .await
}

/// `GET path` over HTTP/1.0 to `addr`; the body.
pub fn http_get(addr: &str, path: &str) -> Result<String> {
    let mut conn = TcpStream::connect_timeout(&addr.parse()?, Duration::from_secs(3))
        .with_context(|| format!("connecting to {addr}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(conn, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n")?;
    let mut text = String::new();
    conn.read_to_string(&mut text)?;
    Ok(text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string())
}
