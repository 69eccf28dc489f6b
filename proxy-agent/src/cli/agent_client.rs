//! Asking a running agent over its HTTP endpoint (`dump --view`, `dump --model`, `watch`).

use anyhow::{Context as _, Result};

/// What a failed request means, for the person who made it.
fn explain(e: ureq::Error, addr: &str, url: &str) -> anyhow::Error {
    match e {
        // The metrics address of an agent that does not serve the object views there.
        ureq::Error::StatusCode(404) => anyhow::anyhow!(
            "{url}: not served there — an agent serves its object views on a loopback \
             metricsBindAddress or on ebpf.debugBindAddress (give that as --debug-addr)"
        ),
        e => anyhow::Error::new(e).context(format!(
            "asking the agent at {url} (is it running, with --debug-addr {addr}?)"
        )),
    }
}

pub fn fetch(addr: &str, path: &str) -> Result<String> {
    let url = format!("http://{addr}{path}");
    let mut resp = ureq::get(&url).call().map_err(|e| explain(e, addr, &url))?;
    resp.body_mut()
        .read_to_string()
        .with_context(|| format!("reading {url}"))
}

pub fn watch(addr: &str) -> Result<()> {
    use std::io::BufRead as _;
    let url = format!("http://{addr}/debug/watch");
    let resp = ureq::get(&url)
        .config()
        .timeout_global(None)
        .build()
        .call()
        .map_err(|e| explain(e, addr, &url))?;
    let reader = std::io::BufReader::new(resp.into_body().into_reader());
    for line in reader.lines() {
        let line = line.with_context(|| format!("reading {url}"))?;
        outln!("{line}");
    }
    Ok(())
}
