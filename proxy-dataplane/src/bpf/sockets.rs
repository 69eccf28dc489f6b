//! Connected UDP sockets that the connect-time path aimed at a backend which is gone.
//!
//! connect4/6 rewrite a connected UDP socket's destination to a backend once; the kernel
//! then sends straight there, so removing the backend from the maps does not move the
//! socket (kube-proxy's equivalent is flushing the UDP conntrack entries). Such sockets
//! are destroyed with sock_diag's SOCK_DESTROY: the application sees ECONNABORTED and
//! connects again — through the hooks, to a live backend.
//!
//! Which sockets: those the hooks remember (`SOCK_CONNECTED`, `SOCK_LB`; by cookie) as
//! connected to a removed backend
//! on a Service's behalf — never a socket that connected to the pod address itself.
//! Where: sock_diag only sees its own network namespace, so the namespaces of the
//! processes in the hooked cgroup are visited, each from a short-lived thread.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use super::{netlink::Channel, sock_state::SockState, writer::LeftUdp};
use crate::error::{Context as _, Error, ErrorKind, Kind as _, Result, fail};
use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkPayload};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, AF_INET6, IPPROTO_UDP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::protocols::NETLINK_SOCK_DIAG;

/// sock_diag's destroy request (`linux/sock_diag.h`).
const SOCK_DESTROY: u16 = 21;

/// The sockets that connect-time balancing connected, on behalf of a frontend, to an
/// endpoint that has left that frontend: by cookie, the backend each is connected to.
/// (Unconnected sockets need nothing: their next datagram is balanced again.)
pub fn cookies_of(sockets: &SockState, left: &[LeftUdp]) -> HashMap<u64, SocketAddr> {
    let left: HashSet<_> = left
        .iter()
        .map(|l| {
            (
                l.rev_nat_id,
                l.backend.addr,
                l.backend.port,
                l.backend.family,
            )
        })
        .collect();
    if left.is_empty() {
        return HashMap::new();
    }
    sockets
        .connected()
        // Bindings hold the backend's own form, also for IPv6 sockets that named an IPv4
        // frontend as ::ffff:a.b.c.d (those are found below among the IPv6 sockets).
        .filter(|(_, b)| left.contains(&(b.rev_nat_id, b.addr, b.port, b.family)))
        .map(|(cookie, b)| {
            (
                cookie,
                proxy_common::addr::socket_addr(b.addr, b.family, b.port),
            )
        })
        .collect()
}

/// Whether a socket sock_diag found connected to `peer` is still connected to `backend`,
/// the peer its binding named when the bindings were read: one that connected again
/// since (to a live backend) stays. An IPv6 socket shows an IPv4 backend mapped.
fn still_connected_to(peer: SocketAddr, backend: SocketAddr) -> bool {
    peer.port() == backend.port() && peer.ip().to_canonical() == backend.ip().to_canonical()
}

/// Destroys the connected UDP sockets with these cookies in the network namespaces of
/// the processes under `cgroup`. Returns how many were destroyed.
pub fn destroy(cgroup: &Path, cookies: &HashMap<u64, SocketAddr>) -> Result<usize> {
    if cookies.is_empty() {
        return Ok(0);
    }
    let mut destroyed = 0;
    for netns in namespaces_under(cgroup)? {
        let cookies = cookies.clone();
        let path = netns.clone();
        let joined = std::thread::Builder::new()
            .name("sock-destroy".into())
            .spawn(move || destroy_in(&path, &cookies))
            .kind(ErrorKind::Io, "starting the socket-destroy thread")?
            .join();
        match joined {
            Ok(Ok(n)) => destroyed += n,
            // A process may exit while we look: its namespace is simply skipped.
            Ok(Err(e)) => tracing::debug!(
                netns = %netns.display(),
                error = format!("{e:#}"),
                "sockets of this namespace not checked"
            ),
            Err(_) => fail!(ErrorKind::Netlink, "the socket-destroy thread panicked"),
        }
    }
    Ok(destroyed)
}

/// One `/proc/<pid>/ns/net` per distinct network namespace of the processes in the
/// cgroup subtree.
fn namespaces_under(cgroup: &Path) -> Result<Vec<PathBuf>> {
    let mut seen = HashMap::new();
    let mut dirs = vec![cgroup.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let procs = dir.join("cgroup.procs");
        let text = match std::fs::read_to_string(&procs) {
            Ok(t) => t,
            // A child cgroup removed while we walk.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(e).kind_with(ErrorKind::Io, || format!("reading {}", procs.display()));
            }
        };
        for pid in text.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let ns = PathBuf::from(format!("/proc/{pid}/ns/net"));
            if let Ok(meta) = std::fs::metadata(&ns) {
                seen.entry((meta.dev(), meta.ino())).or_insert(ns);
            }
        }
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(e).kind_with(ErrorKind::Io, || format!("listing {}", dir.display()));
            }
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(entry.path());
            }
        }
    }
    Ok(seen.into_values().collect())
}

/// In the calling thread (which it moves into the namespace at `netns`): finds the
/// connected UDP sockets with one of `cookies`, still connected to the backend that
/// left, and destroys them.
fn destroy_in(netns: &Path, cookies: &HashMap<u64, SocketAddr>) -> Result<usize> {
    crate::netns::enter(netns)?;
    let mut diag = Diag::open()?;
    let mut destroyed = 0;
    for family in [AF_INET, AF_INET6] {
        for id in diag.connected_udp(family)? {
            let peer = SocketAddr::new(id.destination_address, id.destination_port);
            let (local_port, cookie) = (id.source_port, cookie(&id));
            let Some(backend) = cookies.get(&cookie) else {
                continue;
            };
            if !still_connected_to(peer, *backend) {
                tracing::debug!(
                    %peer,
                    left = %backend,
                    cookie,
                    "connected UDP socket kept: it connected again since"
                );
                continue;
            }
            match diag.destroy(family, id) {
                Ok(()) => {
                    destroyed += 1;
                    tracing::debug!(
                        backend = %peer,
                        local_port,
                        cookie,
                        "connected UDP socket of a removed backend destroyed"
                    );
                }
                Err(e) => tracing::warn!(
                    backend = %peer,
                    error = format!("{e:#}"),
                    "could not destroy a connected UDP socket of a removed backend"
                ),
            }
        }
    }
    Ok(destroyed)
}

/// The kernel's socket cookie, from inet_diag's two host-order words (low word first).
fn cookie(id: &SocketId) -> u64 {
    let c = id.cookie;
    let lo = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
    let hi = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]);
    u64::from(lo) | (u64::from(hi) << 32)
}

/// sock_diag requests in the current thread's network namespace.
struct Diag(Channel);

impl Diag {
    fn open() -> Result<Self> {
        Ok(Self(Channel::open(NETLINK_SOCK_DIAG, "sock_diag")?))
    }

    /// Connected (ESTABLISHED) UDP sockets of one family.
    fn connected_udp(&mut self, family: u8) -> Result<Vec<SocketId>> {
        let seq = self.0.send(
            NLM_F_REQUEST | NLM_F_DUMP,
            None,
            SockDiagMessage::InetRequest(InetRequest {
                family,
                protocol: IPPROTO_UDP,
                extensions: ExtensionFlags::empty(),
                states: StateFlags::ESTABLISHED,
                socket_id: if family == AF_INET {
                    SocketId::new_v4()
                } else {
                    SocketId::new_v6()
                },
            }),
        )?;
        let mut found = Vec::new();
        self.0.receive(seq, |payload| match payload {
            NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                found.push(r.header.socket_id.clone());
                Ok(false)
            }
            NetlinkPayload::Done(_) => Ok(true),
            NetlinkPayload::Error(e) => Err(Error::new(
                ErrorKind::Netlink,
                format!("sock_diag dump failed: {e}"),
            )),
            _ => Ok(false),
        })?;
        Ok(found)
    }

    fn destroy(&mut self, family: u8, socket_id: SocketId) -> Result<()> {
        self.0
            .act(
                0,
                Some(SOCK_DESTROY),
                SockDiagMessage::InetRequest(InetRequest {
                    family,
                    protocol: IPPROTO_UDP,
                    extensions: ExtensionFlags::empty(),
                    states: StateFlags::all(),
                    socket_id,
                }),
            )
            .context("SOCK_DESTROY refused")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    #[test]
    fn a_socket_still_at_the_left_backend_goes() {
        assert!(still_connected_to(at("10.244.1.2:53"), at("10.244.1.2:53")));
        assert!(still_connected_to(at("[fd00::2]:53"), at("[fd00::2]:53")));
    }

    #[test]
    fn an_ipv6_socket_at_an_ipv4_backend_shows_it_mapped() {
        assert!(still_connected_to(
            at("[::ffff:10.244.1.2]:53"),
            at("10.244.1.2:53")
        ));
    }

    /// Connected again between reading the bindings and the destroy: to a live backend.
    #[test]
    fn a_socket_that_connected_again_since_stays() {
        assert!(!still_connected_to(
            at("10.244.1.3:53"),
            at("10.244.1.2:53")
        ));
        assert!(!still_connected_to(
            at("10.244.1.2:54"),
            at("10.244.1.2:53")
        ));
    }
}
