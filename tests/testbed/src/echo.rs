//! An echo backend: answers every TCP connection and UDP datagram with its identity and
//! the client address it saw, on IPv4 and IPv6.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    thread,
};

use anyhow::{Context as _, Result};

/// Serves forever on `tcp` and `udp` ports of every address, v4 and v6.
pub fn serve(id: &str, tcp: u16, udp: u16) -> Result<()> {
    let mut threads = Vec::new();
    for ip in [
        std::net::IpAddr::from(Ipv4Addr::UNSPECIFIED),
        Ipv6Addr::UNSPECIFIED.into(),
    ] {
        let listener = bind_tcp(SocketAddr::new(ip, tcp))?;
        let name = id.to_string();
        threads.push(thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let name = name.clone();
                thread::spawn(move || converse(&name, stream));
            }
        }));
        let sock = bind_udp(SocketAddr::new(ip, udp))?;
        let name = id.to_string();
        threads.push(thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while let Ok((_, from)) = sock.recv_from(&mut buf) {
                let _ = sock.send_to(format!("{name} {}", from.ip()).as_bytes(), from);
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// Greets with identity and client address, then greets again for every line the
/// client sends, until it closes: one connection can ask many times.
fn converse(name: &str, mut stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map(|p| p.ip().to_string())
        .unwrap_or_default();
    let greeting = format!("{name} {peer}\n");
    let Ok(reader) = stream.try_clone() else {
        return;
    };
    if stream.write_all(greeting.as_bytes()).is_err() {
        return;
    }
    for line in BufReader::new(reader).lines() {
        if line.is_err() || stream.write_all(greeting.as_bytes()).is_err() {
            return;
        }
    }
}

/// IPv6 sockets are v6-only so the v4 ones can bind beside them.
fn bind_tcp(addr: SocketAddr) -> Result<TcpListener> {
    let sock = socket(addr, libc::SOCK_STREAM)?;
    // SAFETY: `sock` is a valid socket fd owned by the returned listener.
    unsafe {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&sock);
        if libc::listen(fd, 1024) != 0 {
            return Err(std::io::Error::last_os_error()).context("listen");
        }
    }
    Ok(TcpListener::from(sock))
}

fn bind_udp(addr: SocketAddr) -> Result<UdpSocket> {
    Ok(UdpSocket::from(socket(addr, libc::SOCK_DGRAM)?))
}

fn socket(addr: SocketAddr, ty: i32) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket syscalls on a fd we own; sockaddr buffers are sized correctly.
    unsafe {
        let fd = libc::socket(domain, ty | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("socket");
        }
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let one: libc::c_int = 1;
        let sz = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const i32).cast(),
            sz,
        );
        if addr.is_ipv6() {
            libc::setsockopt(
                fd,
                libc::IPPROTO_IPV6,
                libc::IPV6_V6ONLY,
                (&one as *const i32).cast(),
                sz,
            );
        }
        let (storage, len) = crate::client::sockaddr(addr);
        if libc::bind(fd, (&storage as *const libc::sockaddr_storage).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("bind {addr}"));
        }
        Ok(owned)
    }
}
