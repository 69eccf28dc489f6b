//! `Testbed`: a client namespace, a node namespace that routes, backend namespaces with
//! echo servers, a cgroup and a bpffs, and the agent under test; removed on drop.

use std::{
    collections::BTreeMap,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    Attempt, Background, Path_, TCP_TARGET, UDP_TARGET, add_namespace, agent_bin, cgroup_root,
    client, helper_bin, ip, sh,
};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A client namespace, a node namespace that routes, and backend namespaces.
pub struct Testbed {
    pub id: String,
    pub backends: usize,
    root: PathBuf,
    bpffs: PathBuf,
    cgroup: PathBuf,
    manifests: PathBuf,
    namespaces: Vec<String>,
    echoes: Vec<Child>,
    agent: Option<Child>,
    agent_path: Option<Path_>,
    /// Other agents beside the testbed's own, by name (`start_other_agent`).
    others: Vec<(String, Option<Child>)>,
}

impl Testbed {
    /// Builds the topology with `backends` backend namespaces, each running an echo server.
    pub fn new(backends: usize) -> Result<Self> {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let id = format!("{:05x}{n:x}", std::process::id() & 0xfffff);
        let root = std::env::temp_dir().join(format!("pxy-{id}"));
        let mut tb = Testbed {
            bpffs: root.join("bpffs"),
            cgroup: cgroup_root()?.join(format!("pxy-{id}")),
            manifests: root.join("manifests"),
            root,
            id,
            backends,
            namespaces: Vec::new(),
            echoes: Vec::new(),
            agent: None,
            agent_path: None,
            others: Vec::new(),
        };
        tb.build()
            .with_context(|| format!("building testbed {}", tb.id))?;
        Ok(tb)
    }

    pub fn node_ns(&self) -> String {
        format!("pxy{}n", self.id)
    }

    pub fn client_ns(&self) -> String {
        format!("pxy{}c", self.id)
    }

    /// The testbed's cgroup (the connect-time hooks' attach point).
    pub fn cgroup_path(&self) -> &Path {
        &self.cgroup
    }

    /// Backend `i`'s namespace.
    pub fn backend_ns(&self, i: usize) -> String {
        format!("pxy{}b{i}", self.id)
    }

    /// Identity an echo backend answers with.
    pub fn backend_name(i: usize) -> String {
        format!("backend-{i}")
    }

    /// Backend pod addresses.
    pub fn backend_ip4(i: usize) -> String {
        format!("10.20.{i}.2")
    }

    pub fn backend_ip6(i: usize) -> String {
        format!("fd20:{i}::2")
    }

    /// The node's interfaces (client side first), where the classifier goes.
    pub fn node_interfaces(&self) -> Vec<String> {
        let mut v = vec![format!("c{}", self.id)];
        v.extend((0..self.backends).map(|i| format!("b{i}{}", self.id)));
        v
    }

    fn build(&mut self) -> Result<()> {
        fs::create_dir_all(&self.bpffs)?;
        fs::create_dir_all(&self.manifests)?;
        sh(&["mount", "-t", "bpf", "bpf", path_str(&self.bpffs)?])?;
        fs::create_dir_all(&self.cgroup)
            .with_context(|| format!("creating cgroup {}", self.cgroup.display()))?;
        let node = self.node_ns();
        let client = self.client_ns();
        for ns in [node.clone(), client.clone()] {
            self.add_namespace(&ns)?;
        }
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            sh(&[
                "ip",
                "netns",
                "exec",
                &node,
                "sysctl",
                "-qw",
                &format!("{k}={v}"),
            ])?;
        }
        let c_if = format!("c{}", self.id);
        self.link(
            &node,
            &c_if,
            &client,
            ("10.10.0.1", "fd10::1"),
            ("10.10.0.2", "fd10::2"),
        )?;
        for i in 0..self.backends {
            let ns = self.backend_ns(i);
            self.add_namespace(&ns)?;
            let b_if = format!("b{i}{}", self.id);
            let (n4, n6) = (format!("10.20.{i}.1"), format!("fd20:{i}::1"));
            let (b4, b6) = (Self::backend_ip4(i), Self::backend_ip6(i));
            self.link(&node, &b_if, &ns, (&n4, &n6), (&b4, &b6))?;
            let echo = Command::new("ip")
                .args(["netns", "exec", &ns])
                .arg(helper_bin("e2e-echo"))
                .args(["--id", &Self::backend_name(i)])
                .args([
                    "--tcp",
                    &TCP_TARGET.to_string(),
                    "--udp",
                    &UDP_TARGET.to_string(),
                ])
                .stdout(Stdio::null())
                .spawn()
                .context("starting an echo backend")?;
            self.echoes.push(echo);
        }
        for i in 0..self.backends {
            self.wait_tcp(&format!("{}:{TCP_TARGET}", Self::backend_ip4(i)))?;
        }
        Ok(())
    }

    fn add_namespace(&mut self, ns: &str) -> Result<()> {
        add_namespace(ns)?;
        self.namespaces.push(ns.to_string());
        Ok(())
    }

    /// A veth pair from the node (`node_if`) to `peer_ns` (`eth0`), addressed, with the
    /// peer's default routes pointing at the node. Nothing routes out of the testbed.
    fn link(
        &self,
        node: &str,
        node_if: &str,
        peer_ns: &str,
        (n4, n6): (&str, &str),
        (p4, p6): (&str, &str),
    ) -> Result<()> {
        ip(
            node,
            &format!("link add {node_if} type veth peer name eth0 netns {peer_ns}"),
        )?;
        for (ns, dev, a4, a6) in [(node, node_if, n4, n6), (peer_ns, "eth0", p4, p6)] {
            ip(ns, &format!("addr add {a4}/24 dev {dev}"))?;
            ip(ns, &format!("addr add {a6}/64 dev {dev} nodad"))?;
            ip(ns, &format!("link set {dev} up"))?;
        }
        ip(peer_ns, &format!("route add default via {n4}"))?;
        ip(peer_ns, &format!("-6 route add default via {n6}"))?;
        Ok(())
    }

    /// Turns checksum offload off on every veth end, so the NAT's checksum updates are
    /// what the receivers verify.
    pub fn disable_offload(&self) -> Result<()> {
        let mut ends: Vec<(String, String)> = self
            .node_interfaces()
            .into_iter()
            .map(|i| (self.node_ns(), i))
            .collect();
        ends.push((self.client_ns(), "eth0".into()));
        ends.extend((0..self.backends).map(|i| (self.backend_ns(i), "eth0".to_string())));
        for (ns, dev) in ends {
            sh(&[
                "ip", "netns", "exec", &ns, "ethtool", "-K", &dev, "tx", "off", "rx", "off",
            ])?;
        }
        Ok(())
    }

    fn wait_tcp(&self, target: &str) -> Result<()> {
        let deadline = Instant::now() + crate::patience(Duration::from_secs(10));
        loop {
            let out = self.client_raw(&[
                "--target",
                target,
                "--proto",
                "tcp",
                "--count",
                "1",
                "--timeout-ms",
                "300",
            ]);
            if let Ok(attempts) = out
                && attempts.first().is_some_and(|a| a.ok)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("backend {target} did not come up");
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Writes the manifests folder: replaces every file with `files` (name → YAML).
    pub fn write_manifests(&self, files: &BTreeMap<&str, String>) -> Result<()> {
        for entry in fs::read_dir(&self.manifests)? {
            let path = entry?.path();
            if !files.contains_key(path.file_name().and_then(|f| f.to_str()).unwrap_or("")) {
                fs::remove_file(path)?;
            }
        }
        for (name, text) in files {
            // Write then rename, so the agent never reads half a file.
            let tmp = self.manifests.join(format!(".{name}.tmp"));
            fs::File::create(&tmp)?.write_all(text.as_bytes())?;
            fs::rename(&tmp, self.manifests.join(name))?;
        }
        Ok(())
    }

    /// Copies every manifest file of `dir` into the testbed's manifests folder.
    pub fn copy_manifests(&self, dir: &Path) -> Result<()> {
        let mut files = BTreeMap::new();
        let mut names = Vec::new();
        for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = entry?.path();
            if path.is_file() {
                names.push((
                    path.file_name()
                        .and_then(|f| f.to_str())
                        .unwrap_or("x")
                        .to_string(),
                    fs::read_to_string(&path)?,
                ));
            }
        }
        for (name, text) in &names {
            files.insert(name.as_str(), text.clone());
        }
        self.write_manifests(&files)
    }

    /// Writes `text` as a file in the testbed's own folder; returns its path.
    pub fn write_file(&self, name: &str, text: &str) -> Result<PathBuf> {
        let path = self.root.join(name);
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    pub fn pin_dir(&self) -> PathBuf {
        self.bpffs.join("agent")
    }

    /// Starts the agent for `path`; returns once it has programmed `frontends` frontends.
    pub fn start_agent(&mut self, path: Path_, frontends: usize) -> Result<()> {
        self.start_agent_with(path, frontends, &[])
    }

    /// `start_agent` with more arguments for `proxy-agent run` (`--config`, `--node-ip`).
    pub fn start_agent_with(
        &mut self,
        path: Path_,
        frontends: usize,
        extra: &[&str],
    ) -> Result<()> {
        let args = self.path_args(path, extra);
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        self.spawn_agent(&args, path, frontends)
    }

    /// The agent's arguments that choose `path`'s hooks (the testbed's cgroup, or the
    /// node's interfaces), then `extra`.
    fn path_args(&self, path: Path_, extra: &[&str]) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = match path {
            Path_::ConnectTime => vec!["--cgroup".into(), self.cgroup.clone().into()],
            Path_::PerPacket => vec![
                "--cgroup".into(),
                "none".into(),
                "--interfaces".into(),
                self.node_interfaces().join(",").into(),
            ],
        };
        args.extend(extra.iter().map(Into::into));
        args
    }

    /// `start_agent_with`, but the agent is exec'd by `wrapper` (a command that ends by
    /// exec'ing its arguments, e.g. `setpriv --bounding-set=...`) after `nsenter` has put
    /// it in the node's namespace: unlike `--netns`, the agent itself then needs no
    /// CAP_SYS_ADMIN to get there (a DaemonSet's agent starts in the host's namespace).
    pub fn start_agent_wrapped(
        &mut self,
        wrapper: &[&str],
        path: Path_,
        frontends: usize,
        extra: &[&str],
    ) -> Result<()> {
        let args = self.path_args(path, extra);
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.node_ns()))
            .args(wrapper)
            .arg(agent_bin());
        self.spawn_run(cmd, &args, path, frontends)
    }

    /// Starts the agent for the per-packet path with `--interfaces interfaces` (names,
    /// globs or `auto`: the agent runs in the node's namespace, so these only ever name
    /// the testbed's own interfaces).
    pub fn start_agent_on(&mut self, interfaces: &str, frontends: usize) -> Result<()> {
        self.start_agent_on_with(interfaces, frontends, &[])
    }

    /// `start_agent_on` with more arguments for `proxy-agent run` (`--tc-attach`).
    pub fn start_agent_on_with(
        &mut self,
        interfaces: &str,
        frontends: usize,
        extra: &[&str],
    ) -> Result<()> {
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "--cgroup".as_ref(),
            "none".as_ref(),
            "--interfaces".as_ref(),
            interfaces.as_ref(),
        ];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        self.spawn_agent(&args, Path_::PerPacket, frontends)
    }

    /// Starts `proxy-agent ARGV...` as given (a DaemonSet's command line), in the node's
    /// namespace with `env` added; returns once it has programmed `frontends` frontends.
    /// `path` says which path the testbed's client exercises.
    pub fn start_agent_argv(
        &mut self,
        argv: &[String],
        env: &[(String, String)],
        path: Path_,
        frontends: usize,
    ) -> Result<()> {
        let mut cmd = self.agent_command();
        cmd.args(argv).envs(env.iter().map(|(k, v)| (k, v)));
        self.spawn(cmd, path, frontends)
    }

    /// `proxy-agent --netns <node>`, to which the subcommand is added.
    fn agent_command(&self) -> Command {
        let mut cmd = Command::new(agent_bin());
        cmd.arg("--netns")
            .arg(format!("/run/netns/{}", self.node_ns()));
        cmd
    }

    /// Starts `cmd` as the testbed's agent, its output in `agent.log`.
    fn spawn(&mut self, mut cmd: Command, path: Path_, frontends: usize) -> Result<()> {
        let log = fs::File::create(self.root.join("agent.log"))?;
        cmd.stdout(log.try_clone()?).stderr(log);
        self.agent = Some(cmd.spawn().context("starting proxy-agent")?);
        self.agent_path = Some(path);
        self.wait_frontends(frontends)?;
        // A restarted agent finds the frontends already pinned: wait for its own
        // attachments too (its last start-up line), or the test would look at them early.
        let deadline = Instant::now() + crate::patience(Duration::from_secs(20));
        while !self.agent_log().contains("BPF dataplane ready") {
            if Instant::now() > deadline {
                bail!(
                    "agent did not get ready:
{}",
                    self.agent_log()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn spawn_agent(
        &mut self,
        args: &[&std::ffi::OsStr],
        path: Path_,
        frontends: usize,
    ) -> Result<()> {
        let cmd = self.agent_command();
        self.spawn_run(cmd, args, path, frontends)
    }

    /// `cmd run` with the testbed's manifests, pins and `args`, as the testbed's agent.
    fn spawn_run(
        &mut self,
        mut cmd: Command,
        args: &[impl AsRef<std::ffi::OsStr>],
        path: Path_,
        frontends: usize,
    ) -> Result<()> {
        cmd.arg("run")
            .arg("--manifests")
            .arg(&self.manifests)
            .arg("--bpffs")
            .arg(self.pin_dir())
            .args(["--min-sync-ms", "20", "--bpf-log-level", "debug"])
            .args(args);
        self.spawn(cmd, path, frontends)
    }

    /// Where the other agent `name` pins (beside the testbed's own, on the same bpffs).
    pub fn other_pin_dir(&self, name: &str) -> PathBuf {
        self.bpffs.join(name)
    }

    /// The other agent `name`'s `/healthz` and `/metrics` addresses (127.0.0.1, in the node's
    /// namespace), clear of the testbed's own agent's.
    pub fn other_addresses(&self, name: &str) -> (String, String) {
        let k = self
            .others
            .iter()
            .position(|(n, _)| n == name)
            .unwrap_or(self.others.len());
        (
            format!("127.0.0.1:{}", 10300 + k),
            format!("127.0.0.1:{}", 10400 + k),
        )
    }

    /// Starts another agent in the node's namespace, as a second installation would: its
    /// own pin folder (`other_pin_dir`), manifests (`files`), log and ports, on the
    /// node's interfaces (the per-packet path) with `extra` arguments; returns once it has
    /// programmed `frontends` frontends. Killed, and its pins cleaned up, with the testbed.
    pub fn start_other_agent(
        &mut self,
        name: &str,
        files: &BTreeMap<&str, String>,
        frontends: usize,
        extra: &[&str],
    ) -> Result<()> {
        let manifests = self.root.join(format!("{name}-manifests"));
        fs::create_dir_all(&manifests)?;
        for (file, text) in files {
            fs::write(manifests.join(file), text)?;
        }
        let (healthz, metrics) = self.other_addresses(name);
        let config = self.write_file(
            &format!("{name}.yaml"),
            &format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                 healthzBindAddress: {healthz}\nmetricsBindAddress: {metrics}\n"
            ),
        )?;
        let pin_dir = self.other_pin_dir(name);
        let mut cmd = self.agent_command();
        cmd.arg("run")
            .arg("--manifests")
            .arg(&manifests)
            .arg("--bpffs")
            .arg(&pin_dir)
            .arg("--config")
            .arg(&config)
            .args(["--min-sync-ms", "20", "--bpf-log-level", "debug"])
            .args(self.path_args(Path_::PerPacket, extra));
        let log = fs::File::create(self.root.join(format!("{name}.log")))?;
        cmd.stdout(log.try_clone()?).stderr(log);
        let child = cmd.spawn().context("starting the other proxy-agent")?;
        self.others.retain(|(n, _)| n != name);
        self.others.push((name.to_string(), Some(child)));
        let deadline = Instant::now() + crate::patience(Duration::from_secs(30));
        loop {
            let ready = self.other_log(name).contains("BPF dataplane ready");
            let programmed = self
                .dump_of(&pin_dir)
                .is_ok_and(|d| d["services"].as_array().map(Vec::len) == Some(frontends));
            if ready && programmed {
                return Ok(());
            }
            if let Some((_, Some(child))) = self.others.iter_mut().find(|(n, _)| n == name)
                && let Some(status) = child.try_wait()?
            {
                bail!("agent {name} exited ({status}):\n{}", self.other_log(name));
            }
            if Instant::now() > deadline {
                bail!("agent {name} did not get ready:\n{}", self.other_log(name));
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Everything the other agent `name` logged so far.
    pub fn other_log(&self, name: &str) -> String {
        fs::read_to_string(self.root.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Kills the other agent `name` without letting it clean up (as a crash would).
    pub fn kill_other_agent(&mut self, name: &str) -> Result<()> {
        if let Some((_, child)) = self.others.iter_mut().find(|(n, _)| n == name)
            && let Some(mut child) = child.take()
        {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// `GET url` from inside the node's namespace: the status code and the body, whatever
    /// the code (`get_in_node` fails on anything but a success).
    pub fn http_in_node(&self, url: &str) -> Result<(u16, String)> {
        let script = format!(
            "import urllib.request, urllib.error\n\
             try:\n    r = urllib.request.urlopen('{url}'); print(r.status, r.read().decode())\n\
             except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())"
        );
        let out = sh(&[
            "ip",
            "netns",
            "exec",
            &self.node_ns(),
            "python3",
            "-c",
            &script,
        ])?;
        let (code, body) = out.trim().split_once(' ').unwrap_or((out.trim(), ""));
        Ok((
            code.parse().with_context(|| format!("{url}: {out}"))?,
            body.to_string(),
        ))
    }

    /// A pod added to the node after the fact: namespace `pxy<id>p<i>` (removed with the
    /// testbed) behind the node's veth `p<i><id>`, at 10.30.<i>.2 / fd30:<i>::2.
    pub fn add_pod(&mut self, i: usize) -> Result<String> {
        let ns = self.pod_ns(i);
        self.add_namespace(&ns)?;
        self.add_pod_link(i)?;
        Ok(ns)
    }

    /// (Re)creates the veth of pod `i` (see [`Self::add_pod`]).
    pub fn add_pod_link(&self, i: usize) -> Result<()> {
        self.link(
            &self.node_ns(),
            &self.pod_interface(i),
            &self.pod_ns(i),
            (&format!("10.30.{i}.1"), &format!("fd30:{i}::1")),
            (&format!("10.30.{i}.2"), &format!("fd30:{i}::2")),
        )
    }

    pub fn pod_ns(&self, i: usize) -> String {
        format!("pxy{}p{i}", self.id)
    }

    /// The node's end of pod `i`'s veth.
    pub fn pod_interface(&self, i: usize) -> String {
        format!("p{i}{}", self.id)
    }

    /// Where the agent pins the classifier's link for `interface`.
    pub fn classifier_pin(&self, interface: &str) -> PathBuf {
        self.pin_dir()
            .join("links")
            .join(format!("tc_ingress@{interface}"))
    }

    /// Where the agent pins the egress half's link for `interface`.
    pub fn egress_pin(&self, interface: &str) -> PathBuf {
        self.pin_dir()
            .join("links")
            .join(format!("tc_egress@{interface}"))
    }

    /// One TCP connection asking `count` times, 20 ms apart, in the background (a live
    /// connection for restarts and backend changes to keep).
    pub fn spawn_session(&self, target: &str, count: u32) -> Result<Background> {
        self.spawn_client(&[
            "--target",
            target,
            "--reuse-socket",
            "--count",
            &count.to_string(),
            "--interval-ms",
            "20",
        ])
    }

    /// Waits up to 10 s for `cond`; fails naming `what`, with the agent's log.
    pub fn wait_for(&self, what: &str, cond: impl Fn() -> bool) {
        self.wait_for_within(Duration::from_secs(10), what, cond);
    }

    /// `wait_for`, up to `within`.
    pub fn wait_for_within(&self, within: Duration, what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + crate::patience(within);
        while !cond() {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\nagent log:\n{}",
                self.agent_log()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// `tc filter show dev <interface> <hook>` in the node's namespace (hook: `ingress`
    /// or `egress`).
    pub fn tc_filters(&self, interface: &str, hook: &str) -> Result<String> {
        sh(&[
            "ip",
            "netns",
            "exec",
            &self.node_ns(),
            "tc",
            "filter",
            "show",
            "dev",
            interface,
            hook,
        ])
    }

    /// `proxy-agent cleanup` of this testbed's pins, in the node's namespace (where the
    /// agent's clsact filters are).
    pub fn cleanup_agent(&self) -> Result<String> {
        sh(&[
            path_str(&agent_bin())?,
            "--netns",
            &format!("/run/netns/{}", self.node_ns()),
            "cleanup",
            "--bpffs",
            path_str(&self.pin_dir())?,
        ])
    }

    /// Runs the client in namespace `ns` (no cgroup: the per-packet path).
    pub fn client_in(&self, ns: &str, args: &[&str]) -> Result<Vec<Attempt>> {
        let mut cmd = Command::new(helper_bin("e2e-client"));
        cmd.arg("--netns")
            .arg(format!("/run/netns/{ns}"))
            .args(args);
        attempts_of(cmd, args)
    }

    /// Starts the client in the background in namespace `ns`, outside the testbed's
    /// cgroup (so only the per-packet path sees its traffic, whatever the agent runs).
    pub fn spawn_client_in(&self, ns: &str, args: &[&str]) -> Result<Background> {
        let mut cmd = Command::new(helper_bin("e2e-client"));
        cmd.arg("--netns")
            .arg(format!("/run/netns/{ns}"))
            .args(args);
        Background::spawn(cmd)
    }

    /// The running agent's process id.
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.as_ref().map(Child::id)
    }

    /// Everything the agent logged so far.
    pub fn agent_log(&self) -> String {
        fs::read_to_string(self.root.join("agent.log")).unwrap_or_default()
    }

    /// Waits until the pinned service map holds exactly `n` frontends.
    pub fn wait_frontends(&mut self, n: usize) -> Result<()> {
        let deadline = Instant::now() + crate::patience(Duration::from_secs(20));
        loop {
            if let Some(agent) = &mut self.agent
                && let Some(status) = agent.try_wait()?
            {
                bail!("agent exited ({status}):\n{}", self.agent_log());
            }
            if let Ok(dump) = self.dump()
                && dump["services"].as_array().map(Vec::len) == Some(n)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("agent did not program {n} frontends:\n{}", self.agent_log());
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// One of the BPF counters (`proxy_common::counter::NAMES`), summed over CPUs.
    pub fn counter(&self, name: &str) -> u64 {
        self.dump().expect("dump")["counters"][name]
            .as_u64()
            .unwrap_or_else(|| panic!("counter {name}"))
    }

    /// `proxy-agent dump --json` of this testbed's pins.
    pub fn dump(&self) -> Result<serde_json::Value> {
        self.dump_of(&self.pin_dir())
    }

    /// `proxy-agent dump --json` of the pins in `pin_dir`.
    fn dump_of(&self, pin_dir: &Path) -> Result<serde_json::Value> {
        let out = sh(&[
            path_str(&agent_bin())?,
            "dump",
            "--json",
            "--bpffs",
            path_str(pin_dir)?,
        ])?;
        Ok(serde_json::from_str(&out)?)
    }

    /// Kills the agent without letting it clean up (as a crash would).
    pub fn kill_agent(&mut self) -> Result<()> {
        if let Some(mut agent) = self.agent.take() {
            agent.kill()?;
            agent.wait()?;
        }
        Ok(())
    }

    /// Sends the agent SIGTERM (as the kubelet stops a pod) and waits up to `within` for
    /// it to exit: its exit status, or `None` if it was still running then (it is killed).
    pub fn terminate_agent(&mut self, within: Duration) -> Result<Option<ExitStatus>> {
        let Some(mut agent) = self.agent.take() else {
            bail!("no agent is running");
        };
        let pid = libc::pid_t::try_from(agent.id()).context("pid")?;
        // SAFETY: kill has no memory preconditions; the pid is our child's, not reaped yet.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            return Err(std::io::Error::last_os_error()).context("sending SIGTERM");
        }
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = agent.try_wait()? {
                return Ok(Some(status));
            }
            thread::sleep(Duration::from_millis(20));
        }
        agent.kill()?;
        agent.wait()?;
        Ok(None)
    }

    /// Runs the client in the client namespace (and, for the connect-time path, in the
    /// testbed's cgroup) and returns every attempt.
    pub fn client(&self, args: &[&str]) -> Result<Vec<Attempt>> {
        self.client_raw(args)
    }

    fn client_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(helper_bin("e2e-client"));
        cmd.arg("--netns")
            .arg(format!("/run/netns/{}", self.client_ns()));
        if self.agent_path == Some(Path_::ConnectTime) {
            cmd.arg("--cgroup").arg(&self.cgroup);
        }
        cmd.args(args);
        cmd
    }

    fn client_raw(&self, args: &[&str]) -> Result<Vec<Attempt>> {
        attempts_of(self.client_command(args), args)
    }

    /// Starts the client in the background (for "while a client loops" tests).
    pub fn spawn_client(&self, args: &[&str]) -> Result<Background> {
        Background::spawn(self.client_command(args))
    }

    /// `GET url` from inside the node's namespace (the agent's endpoints listen there):
    /// the body.
    pub fn get_in_node(&self, url: &str) -> Result<String> {
        let script =
            format!("import urllib.request;print(urllib.request.urlopen('{url}').read().decode())");
        sh(&[
            "ip",
            "netns",
            "exec",
            &self.node_ns(),
            "python3",
            "-c",
            &script,
        ])
    }

    /// Floods `target` with spoofed SYNs from the client namespace for `seconds`
    /// (`e2e-synflood`; its output is one JSON line with what it sent).
    pub fn spawn_synflood(&self, target: &str, seconds: f64) -> Result<Child> {
        self.spawn_synflood_paced(target, seconds, 0, 0.0)
    }

    /// `spawn_synflood`, paced: `burst` SYNs at once, then `rate` a second (0: as fast
    /// as it can, as `spawn_synflood`).
    pub fn spawn_synflood_paced(
        &self,
        target: &str,
        seconds: f64,
        burst: u64,
        rate: f64,
    ) -> Result<Child> {
        Command::new(helper_bin("e2e-synflood"))
            .arg("--netns")
            .arg(format!("/run/netns/{}", self.client_ns()))
            .args(["--target", target, "--seconds", &seconds.to_string()])
            .args(["--burst", &burst.to_string(), "--rate", &rate.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .context("starting e2e-synflood")
    }

    /// Keeps `child` (a server a test started in one of the testbed's namespaces) until
    /// the testbed is dropped, which kills it.
    pub fn keep(&mut self, child: Child) {
        self.echoes.push(child);
    }

    /// Starts an echo server (identity `id`) in namespace `ns`, kept until the drop.
    pub fn start_echo(&mut self, ns: &str, id: &str, tcp: u16, udp: u16) -> Result<()> {
        let echo = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(helper_bin("e2e-echo"))
            .args([
                "--id",
                id,
                "--tcp",
                &tcp.to_string(),
                "--udp",
                &udp.to_string(),
            ])
            .stdout(Stdio::null())
            .spawn()
            .context("starting an echo server")?;
        self.keep(echo);
        Ok(())
    }

    /// Stops backend `i`'s echo server.
    pub fn stop_backend(&mut self, i: usize) -> Result<()> {
        let echo = &mut self.echoes[i];
        echo.kill()?;
        echo.wait()?;
        Ok(())
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            let _ = agent.kill();
            let _ = agent.wait();
        }
        let others: Vec<PathBuf> = self
            .others
            .iter_mut()
            .map(|(name, child)| {
                if let Some(mut child) = child.take() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                self.bpffs.join(name.as_str())
            })
            .collect();
        for echo in &mut self.echoes {
            let _ = echo.kill();
            let _ = echo.wait();
        }
        // In the node's namespace, where clsact filters would be; outside it when it was
        // never made (the pins are all there is then).
        let node_ns = PathBuf::from(format!("/run/netns/{}", self.node_ns()));
        for pin_dir in others.into_iter().chain([self.pin_dir()]) {
            let mut cleanup = Command::new(agent_bin());
            if node_ns.exists() {
                cleanup.arg("--netns").arg(&node_ns);
            }
            let _ = cleanup
                .args(["cleanup", "--bpffs"])
                .arg(pin_dir)
                .stderr(Stdio::null())
                .status();
        }
        for ns in self.namespaces.drain(..) {
            let _ = sh(&["ip", "netns", "del", &ns]);
        }
        let _ = sh(&["umount", path_str(&self.bpffs).unwrap_or("")]);
        // A cgroup can only be removed once its processes are gone.
        for _ in 0..50 {
            if fs::remove_dir(&self.cgroup).is_ok() || !self.cgroup.exists() {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().context("non-UTF-8 path")
}

/// Runs an `e2e-client` command to its end: its attempts, or its stderr as the error.
fn attempts_of(mut cmd: Command, args: &[&str]) -> Result<Vec<Attempt>> {
    let out = cmd.output().context("running e2e-client")?;
    if !out.status.success() {
        bail!(
            "e2e-client {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    client::parse_attempts(&String::from_utf8_lossy(&out.stdout))
}
