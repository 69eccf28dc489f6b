//! Spoofed SYNs at a target, from inside a test namespace: random sources in
//! 198.18.0.0/15 (benchmarking space, routed nowhere), as fast as one raw socket sends
//! them (or `--burst` at once, then `--rate` a second), for a while. Prints
//! `{"sent": N, "seconds": S}`.
use std::{net::SocketAddr, path::PathBuf, time::Instant};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use proxy_agent::{model::Protocol, trace::packet};

#[derive(Parser)]
struct Args {
    #[arg(long)]
    netns: PathBuf,
    #[arg(long)]
    target: SocketAddr,
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// With `--rate`: SYNs sent at once first.
    #[arg(long, default_value_t = 0)]
    burst: u64,
    /// SYNs a second after the burst; 0: as fast as the socket takes them.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let SocketAddr::V4(target) = a.target else {
        bail!("IPv4 targets only");
    };
    proxy_testbed::client::enter(Some(&a.netns), None)?;
    // SAFETY: plain socket creation; the fd is checked and closed by the OwnedFd.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("raw socket (root only)");
    }
    // SAFETY: a fresh, valid fd we own from here on.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    let (dst, dst_len) = proxy_testbed::client::sockaddr(a.target);
    let start = Instant::now();
    let mut sent: u64 = 0;
    let mut seed: u32 = 0x9e37_79b9;
    while start.elapsed().as_secs_f64() < a.seconds {
        // Paced: what is due by now (the burst, then the rate), or a millisecond's rest.
        let batch = if a.rate > 0.0 {
            let due = a.burst + (a.rate * start.elapsed().as_secs_f64()) as u64;
            if due <= sent {
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            (due - sent).min(256)
        } else {
            256
        };
        for _ in 0..batch {
            // xorshift: cheap, and every source differs.
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            let src = std::net::Ipv4Addr::from(0xc612_0000 | (seed >> 15));
            let port = 1024 + (seed & 0x7fff) as u16;
            let frame = packet::build(
                SocketAddr::new(src.into(), port),
                SocketAddr::V4(target),
                Protocol::Tcp,
            );
            let ip = &frame[14..]; // the kernel takes the IP header on
            // SAFETY: `ip` and `dst` are valid for the lengths given.
            let n = unsafe {
                libc::sendto(
                    raw,
                    ip.as_ptr().cast(),
                    ip.len(),
                    0,
                    (&dst as *const libc::sockaddr_storage).cast(),
                    dst_len,
                )
            };
            if n > 0 {
                sent += 1;
            }
        }
    }
    println!(
        "{}",
        serde_json::json!({"sent": sent, "seconds": start.elapsed().as_secs_f64()})
    );
    Ok(())
}
