//! The test client: repeated TCP connections or UDP exchanges to a target, one JSON line
//! per attempt with the backend that answered and the peer address the socket reports.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// One connection (TCP) or request/response (UDP).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Attempt {
    pub seq: u32,
    pub ok: bool,
    /// Identity of the backend that answered.
    pub backend: Option<String>,
    /// The client address the backend saw (masquerade shows here).
    #[serde(default)]
    pub seen_as: Option<String>,
    /// Peer as the application sees it: getpeername (TCP) or the reply's source (UDP).
    pub peer: Option<String>,
    /// Error kind, e.g. "ConnectionRefused" or "TimedOut".
    pub error: Option<String>,
    /// The OS error number behind `error`, when there is one.
    #[serde(default)]
    pub errno: Option<i32>,
    /// Time from start of the attempt to its end, in milliseconds.
    pub ms: f64,
    /// Milliseconds since the client started, at the start of the attempt.
    pub at_ms: f64,
    /// `CLOCK_MONOTONIC` (the clock of `std::time::Instant`) at the end of the attempt, in
    /// nanoseconds: a reader on the same machine dates the end exactly, however late it
    /// reads the line.
    #[serde(default)]
    pub end_mono_ns: Option<u64>,
}

/// `CLOCK_MONOTONIC` now, in nanoseconds (0 if the clock cannot be read).
pub fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The `Instant` of a `monotonic_ns` reading taken in this or another process.
pub fn instant_of_monotonic(ns: u64) -> Instant {
    let (now, now_ns) = (Instant::now(), monotonic_ns());
    now.checked_sub(Duration::from_nanos(now_ns.saturating_sub(ns)))
        .unwrap_or(now)
}

/// Parses the client's output.
pub fn parse_attempts(out: &str) -> Result<Vec<Attempt>> {
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect()
}

/// Options of a client run.
pub struct Run {
    pub target: SocketAddr,
    /// Further targets: an unconnected `reuse` socket sends its attempts to `target` and
    /// these in turn (one socket, several frontends); `churn` connects to them in turn.
    pub more_targets: Vec<SocketAddr>,
    pub udp: bool,
    /// UDP through a connected socket (connect4/6 + recvmsg) instead of sendto.
    pub connected: bool,
    /// TCP connections opened and reset at once, as fast as they go; one summary line
    /// (`seq` = connections made, `error` = the first failure) instead of one per attempt.
    pub churn: bool,
    /// One socket for every attempt: a connected UDP socket (one flow, like a DNS stub
    /// resolver) or one TCP connection asking again and again. After a failed attempt the
    /// socket connects again, as an application that handles errors would.
    pub reuse: bool,
    pub count: u32,
    pub interval: Duration,
    pub timeout: Duration,
}

impl Run {
    /// Where attempt `seq` goes: `target` and `more_targets` in turn.
    fn target_of(&self, seq: u32) -> SocketAddr {
        match seq as usize % (1 + self.more_targets.len()) {
            0 => self.target,
            turn => self.more_targets[turn - 1],
        }
    }
}

/// Runs the attempts, printing each as a JSON line as soon as it ends.
pub fn run(opts: &Run) -> Result<()> {
    if opts.churn {
        return churn(opts);
    }
    let start = Instant::now();
    let mut shared = if opts.reuse {
        Some(Session::open(opts)?)
    } else {
        None
    };
    let stdout = std::io::stdout();
    for seq in 0..opts.count {
        let t0 = Instant::now();
        let at_ms = start.elapsed().as_secs_f64() * 1e3;
        let result = match (opts.udp, opts.connected, &mut shared) {
            (_, _, Some(s)) => s.ask(opts, seq),
            (false, _, None) => tcp_once(opts),
            (true, false, None) => udp_once(opts),
            (true, true, None) => udp_connected_once(opts),
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let end_mono_ns = Some(monotonic_ns());
        let attempt = match result {
            Ok((answer, peer)) => Attempt {
                seq,
                ok: true,
                seen_as: answer.split_whitespace().nth(1).map(str::to_string),
                backend: answer.split_whitespace().next().map(str::to_string),
                peer: Some(peer.to_string()),
                error: None,
                errno: None,
                ms,
                at_ms,
                end_mono_ns,
            },
            Err(e) => Attempt {
                seq,
                ok: false,
                backend: None,
                seen_as: None,
                peer: None,
                error: Some(format!("{:?}", e.kind())),
                errno: e.raw_os_error(),
                ms,
                at_ms,
                end_mono_ns,
            },
        };
        let mut lock = stdout.lock();
        writeln!(lock, "{}", serde_json::to_string(&attempt)?)?;
        lock.flush()?;
        drop(lock);
        if !opts.interval.is_zero() && seq + 1 < opts.count {
            std::thread::sleep(opts.interval);
        }
    }
    Ok(())
}

fn tcp_once(opts: &Run) -> std::io::Result<(String, SocketAddr)> {
    let mut s = TcpStream::connect_timeout(&opts.target, opts.timeout)?;
    s.set_read_timeout(Some(opts.timeout))?;
    let peer = s.peer_addr()?;
    // Nothing to ask: the greeting is the answer, and the echo closes on our FIN.
    s.shutdown(std::net::Shutdown::Write)?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    Ok((buf.trim().to_string(), peer))
}

/// Opens `opts.count` TCP connections one after the other (to the targets in turn), each
/// reset (SO_LINGER 0) as soon as it is up, so no TIME_WAIT piles up; prints one summary
/// attempt.
fn churn(opts: &Run) -> Result<()> {
    use std::os::fd::AsRawFd as _;
    let start = Instant::now();
    let mut made = 0;
    let mut error = None;
    for seq in 0..opts.count {
        match TcpStream::connect_timeout(&opts.target_of(seq), opts.timeout) {
            Ok(s) => {
                let linger = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                // SAFETY: a valid socket and a linger struct of the size we pass.
                unsafe {
                    libc::setsockopt(
                        s.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_LINGER,
                        (&linger as *const libc::linger).cast(),
                        std::mem::size_of::<libc::linger>() as libc::socklen_t,
                    )
                };
                made += 1;
            }
            Err(e) => {
                error.get_or_insert_with(|| format!("{:?}", e.kind()));
            }
        }
    }
    let attempt = Attempt {
        seq: made,
        ok: error.is_none(),
        backend: None,
        seen_as: None,
        peer: None,
        error,
        errno: None,
        ms: start.elapsed().as_secs_f64() * 1e3,
        at_ms: 0.0,
        end_mono_ns: Some(monotonic_ns()),
    };
    println!("{}", serde_json::to_string(&attempt)?);
    Ok(())
}

/// One socket used for every attempt.
enum Session {
    /// Connected: `send`/`recv`; and whether connecting again after a failure failed too
    /// (then the next attempt connects first, and fails with that error if it must: a
    /// send on the unconnected socket would only say EDESTADDRREQ).
    Udp(UdpSocket, bool),
    /// Unconnected: `send_to` each target in turn, `recv_from`.
    UdpTo(UdpSocket),
    /// The connection, and whether its greeting still waits to be read.
    Tcp(BufReader<TcpStream>, bool),
}

impl Session {
    fn open(opts: &Run) -> std::io::Result<Self> {
        if opts.udp && !opts.connected {
            Ok(Self::UdpTo(udp_socket(opts)?))
        } else if opts.udp {
            let s = udp_socket(opts)?;
            s.connect(opts.target)?;
            Ok(Self::Udp(s, false))
        } else {
            let s = TcpStream::connect_timeout(&opts.target, opts.timeout)?;
            s.set_read_timeout(Some(opts.timeout))?;
            Ok(Self::Tcp(BufReader::new(s), true))
        }
    }

    /// One question and its answer; after a failure the next attempt connects again.
    fn ask(&mut self, opts: &Run, seq: u32) -> std::io::Result<(String, SocketAddr)> {
        let result = match self {
            Self::Udp(s, unconnected) => (|| {
                if *unconnected {
                    s.connect(opts.target)?;
                    *unconnected = false;
                }
                exchange(s)
            })(),
            Self::UdpTo(s) => exchange_with(s, opts.target_of(seq)),
            // In a closure, so that a failed write or read reaches the reconnect below.
            Self::Tcp(r, greeting) => (|| {
                if !std::mem::take(greeting) {
                    r.get_mut().write_all(b"who\n")?;
                }
                let mut line = String::new();
                if r.read_line(&mut line)? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                Ok((line.trim().to_string(), r.get_ref().peer_addr()?))
            })(),
        };
        if result.is_err() {
            match self {
                // Connecting the same socket again goes through connect4/6 again.
                Self::Udp(s, unconnected) => {
                    let _ = s.take_error(); // a pending ECONNABORTED belongs to the old flow
                    *unconnected = s.connect(opts.target).is_err();
                }
                // Nothing to redo: every datagram names its target.
                Self::UdpTo(_) => {}
                Self::Tcp(..) => {
                    if let Ok(fresh) = Self::open(opts) {
                        *self = fresh;
                    }
                }
            }
        }
        result
    }
}

/// One request and its answer on a connected UDP socket.
fn exchange(s: &UdpSocket) -> std::io::Result<(String, SocketAddr)> {
    s.send(b"who")?;
    let mut buf = [0u8; 256];
    let n = s.recv(&mut buf)?;
    Ok((
        String::from_utf8_lossy(&buf[..n]).trim().to_string(),
        s.peer_addr()?,
    ))
}

/// A UDP socket of the target's family on an ephemeral port.
fn udp_socket(opts: &Run) -> std::io::Result<UdpSocket> {
    let any: std::net::IpAddr = if opts.target.is_ipv4() {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let s = UdpSocket::bind(SocketAddr::new(any, 0))?;
    s.set_read_timeout(Some(opts.timeout))?;
    Ok(s)
}

fn udp_once(opts: &Run) -> std::io::Result<(String, SocketAddr)> {
    // Unconnected: exercises sendmsg and recvmsg translation.
    exchange_with(&udp_socket(opts)?, opts.target)
}

/// One request to `to` and its answer on an unconnected UDP socket; the peer is the
/// answer's source.
fn exchange_with(s: &UdpSocket, to: SocketAddr) -> std::io::Result<(String, SocketAddr)> {
    s.send_to(b"who", to)?;
    let mut buf = [0u8; 256];
    let (n, from) = s.recv_from(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).trim().to_string(), from))
}

fn udp_connected_once(opts: &Run) -> std::io::Result<(String, SocketAddr)> {
    let s = udp_socket(opts)?;
    s.connect(opts.target)?;
    exchange(&s)
}

/// A `sockaddr_storage` for `addr`, and its length.
pub fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: zeroed sockaddr_storage is a valid value; we fill the family-specific view.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            (
                storage,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            (
                storage,
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

/// Moves this process into `cgroup` (cgroup v2 folder) and this thread into `netns`.
pub fn enter(netns: Option<&std::path::Path>, cgroup: Option<&std::path::Path>) -> Result<()> {
    if let Some(cg) = cgroup {
        std::fs::write(cg.join("cgroup.procs"), std::process::id().to_string())
            .map_err(|e| anyhow::anyhow!("joining cgroup {}: {e}", cg.display()))?;
    }
    if let Some(ns) = netns {
        let f = std::fs::File::open(ns)?;
        if let Err(e) = nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET) {
            bail!("entering {}: {e}", ns.display());
        }
    }
    Ok(())
}
