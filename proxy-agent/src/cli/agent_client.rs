//! Asking a running agent over its HTTP endpoint (`dump --view`, `dump --model`, `watch`):
//! one HTTP/1.1 GET on hyper's client connection — the stack kube's client is built on —
//! driven by a current-thread runtime on the calling thread (so inside `--netns` too), with
//! no timeout: `watch` streams for as long as the agent runs.

use anyhow::{Context as _, Result};
use http_body_util::{BodyExt as _, Empty};
use hyper::{
    Request,
    body::{Bytes, Incoming},
    header,
};
use hyper_util::rt::TokioIo;

pub fn fetch(addr: &str, path: &str) -> Result<String> {
    let url = format!("http://{addr}{path}");
    block_on(async {
        let body = get(addr, path).await.map_err(|e| explain(e, addr, &url))?;
        let bytes = body.collect().await?.to_bytes();
        Ok(String::from_utf8(bytes.to_vec())?)
    })
}

pub fn watch(addr: &str) -> Result<()> {
    let url = format!("http://{addr}/debug/watch");
    block_on(async {
        let mut body = get(addr, "/debug/watch")
            .await
            .map_err(|e| explain(e, addr, &url))?;
        // Each line is written and flushed as soon as its newline arrives; a last line
        // without one is written when the stream ends (as `BufRead::lines` reads them).
        let mut pending = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else {
                continue;
            };
            pending.extend_from_slice(&data);
            let mut start = 0;
            while let Some(n) = pending[start..].iter().position(|&b| b == b'\n') {
                write_line(&pending[start..start + n])?;
                start += n + 1;
            }
            pending.drain(..start);
        }
        if !pending.is_empty() {
            write_line(&pending)?;
        }
        Ok(())
    })
}

/// One line, without its `\n` (nor a `\r` before it), as text, flushed (a reader that
/// went away ends the command quietly: `cli::output`).
fn write_line(line: &[u8]) -> Result<()> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let line = std::str::from_utf8(line).context("a line that is not UTF-8")?;
    outln!("{line}");
    Ok(())
}

/// The status of a refused request, kept so a 404 can say what it means.
#[derive(Debug, thiserror::Error)]
#[error("http status: {0}")]
struct Status(u16);

/// What a failed request means, for the person who made it.
fn explain(e: anyhow::Error, addr: &str, url: &str) -> anyhow::Error {
    match e.downcast_ref::<Status>() {
        // The metrics address of an agent that does not serve the object views there.
        Some(Status(404)) => anyhow::anyhow!(
            "{url}: not served there — an agent serves its object views on a loopback \
             metricsBindAddress or on ebpf.debugBindAddress (give that as --debug-addr)"
        ),
        _ => e.context(format!(
            "asking the agent at {url} (is it running, with --debug-addr {addr}?)"
        )),
    }
}

/// `GET path` from `addr` (`HOST:PORT`): the body of the answer, or an error that says
/// what failed (connecting, the exchange, or the status).
async fn get(addr: &str, path: &str) -> Result<Incoming> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    // The connection is driven beside the request; its errors come back through it too.
    tokio::spawn(conn);
    let request = Request::get(path)
        .header(header::HOST, addr)
        .body(Empty::<Bytes>::new())?;
    let response = sender.send_request(request).await?;
    // A status from 400 on is an error, as it always was here; the agent sends no redirect.
    let status = response.status().as_u16();
    if status >= 400 {
        return Err(Status(status).into());
    }
    Ok(response.into_body())
}

fn block_on<T>(work: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(work)
}
