//! Asking a running agent over its HTTP endpoint (`dump --view`, `dump --model`, `watch`).

use anyhow::{Context as _, Result};

pub fn fetch(addr: &str, path: &str) -> Result<String> {
    let url = format!("http://{addr}{path}");
    let mut resp = ureq::get(&url).call().with_context(|| {
        format!("asking the agent at {url} (is it running, with --debug-addr {addr}?)")
    })?;
    Ok(resp.body_mut().read_to_string()?)
}

pub fn watch(addr: &str) -> Result<()> {
    use std::io::BufRead as _;
    let url = format!("http://{addr}/debug/watch");
    let resp = ureq::get(&url)
        .config()
        .timeout_global(None)
        .build()
        .call()
        .with_context(|| format!("asking the agent at {url}"))?;
    let reader = std::io::BufReader::new(resp.into_body().into_reader());
    for line in reader.lines() {
        let line = line.with_context(|| format!("reading {url}"))?;
        outln!("{line}");
    }
    Ok(())
}
