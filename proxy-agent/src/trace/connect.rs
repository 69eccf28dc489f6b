//! The connect-time half of `trace`: real connects, from a throwaway network namespace in
//! a throwaway cgroup carrying only the connect4/connect6 hooks (so `getpeername` shows
//! where the kernel really sent the socket). The probe runs in a child process — the
//! one that joins the cgroup — so nothing else of ours is affected.

use std::{
    collections::BTreeSet,
    io::Write as _,
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    programs::{CgroupAttachMode, CgroupSockAddr},
};
use serde::{Deserialize, Serialize};

/// One connect probe: where to connect, how often.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Probe {
    pub udp: bool,
    pub dst: SocketAddr,
    pub tries: u32,
}

/// What the connects saw.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbeResult {
    /// Peers `getpeername` reported, i.e. where the hooks sent the sockets.
    pub peers: Vec<SocketAddr>,
    /// The first error, as an errno name (`ECONNREFUSED`, `EPERM`, ...).
    pub error: Option<String>,
}

/// A cgroup with the connect hooks of `ebpf` attached; removed on drop.
pub struct HookedCgroup {
    pub path: PathBuf,
}

impl HookedCgroup {
    /// Attaches connect4/connect6 (already loaded) to a fresh child cgroup.
    pub fn new(ebpf: &mut Ebpf, tag: &str) -> Result<Self> {
        let root = crate::dataplane::bpf::cgroup2_mount()?;
        let path = root.join(format!("proxy-trace-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        let dir = std::fs::File::open(&path)?;
        for name in ["connect4", "connect6"] {
            let prog: &mut CgroupSockAddr = ebpf
                .program_mut(name)
                .with_context(|| format!("BPF object has no {name}"))?
                .try_into()?;
            prog.attach(dir.as_fd(), CgroupAttachMode::Single)
                .with_context(|| format!("attaching {name} to {}", path.display()))?;
        }
        Ok(Self { path })
    }
}

impl Drop for HookedCgroup {
    fn drop(&mut self) {
        // Links go with the Ebpf object. The probe's exit leaves the cgroup a moment
        // after it is reaped, so removal may take a few tries.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        tracing::warn!(cgroup = %self.path.display(), "could not remove the trace cgroup");
    }
}

/// Runs `probes` in a child process (`exe trace-probe`) that joins `cgroup` and a fresh
/// network namespace where every address of `listen` is assigned to loopback with a TCP
/// listener on it — so a connect succeeds wherever the hooks send it, and an untranslated
/// one too.
pub fn run_probes(
    exe: &Path,
    cgroup: &Path,
    listen: &BTreeSet<SocketAddr>,
    probes: &[Probe],
) -> Result<Vec<ProbeResult>> {
    let request = serde_json::to_string(&ProbeRequest {
        cgroup: cgroup.to_path_buf(),
        listen: listen.iter().copied().collect(),
        probes: probes.to_vec(),
    })?;
    let mut child = Command::new(exe)
        .arg("trace-probe")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {} trace-probe", exe.display()))?;
    child
        .stdin
        .take()
        .context("probe stdin")?
        .write_all(request.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("connect probe failed ({})", out.status);
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[derive(Serialize, Deserialize)]
struct ProbeRequest {
    cgroup: PathBuf,
    listen: Vec<SocketAddr>,
    probes: Vec<Probe>,
}

/// The child side: reads a request on stdin, prints results on stdout. Call it before
/// any thread starts (it moves the process into another cgroup and netns).
pub fn probe_main() -> Result<()> {
    let request: ProbeRequest = serde_json::from_reader(std::io::stdin())?;
    std::fs::write(
        request.cgroup.join("cgroup.procs"),
        std::process::id().to_string(),
    )
    .context("joining the trace cgroup")?;
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("a fresh netns")?;
    let ip = |args: &[&str]| -> Result<()> {
        let st = Command::new("ip")
            .args(args)
            .stderr(std::process::Stdio::null())
            .status()
            .context("running ip")?;
        if !st.success() {
            bail!("ip {args:?} failed");
        }
        Ok(())
    };
    ip(&["link", "set", "lo", "up"])?;
    let addrs: BTreeSet<IpAddr> = request.listen.iter().map(SocketAddr::ip).collect();
    for a in addrs.iter().filter(|a| !a.is_loopback()) {
        let prefix = if a.is_ipv4() { "32" } else { "128" };
        ip(&[
            "addr",
            "add",
            &format!("{a}/{prefix}"),
            "dev",
            "lo",
            "nodad",
        ])?;
    }
    // Listeners accept (and close) in the background so their backlogs never fill.
    for a in &request.listen {
        if let Ok(l) = TcpListener::bind(a) {
            std::thread::spawn(move || for _ in l.incoming() {});
        }
    }
    let results: Vec<ProbeResult> = request.probes.iter().map(run_probe).collect();
    println!("{}", serde_json::to_string(&results)?);
    Ok(())
}

fn errno_name(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => "ECONNREFUSED".into(),
        Some(libc::EPERM) => "EPERM".into(),
        _ => e.to_string(),
    }
}

fn run_probe(probe: &Probe) -> ProbeResult {
    let mut peers = BTreeSet::new();
    let mut error = None;
    for _ in 0..probe.tries.max(1) {
        let peer = if probe.udp {
            let any: SocketAddr = if probe.dst.is_ipv4() {
                "0.0.0.0:0"
            } else {
                "[::]:0"
            }
            .parse()
            .expect("literal");
            UdpSocket::bind(any).and_then(|s| {
                s.connect(probe.dst)?;
                s.peer_addr()
            })
        } else {
            // Generous: on a loaded machine the listener's backlog can overflow for a
            // moment, and a dropped SYN is retried after a second.
            TcpStream::connect_timeout(&probe.dst, Duration::from_secs(5))
                .and_then(|s| s.peer_addr())
        };
        match peer {
            Ok(p) => {
                peers.insert(p);
            }
            Err(e) => {
                error = Some(errno_name(&e));
                break;
            }
        }
    }
    ProbeResult {
        peers: peers.into_iter().collect(),
        error,
    }
}
