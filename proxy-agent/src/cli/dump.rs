//! `proxy-agent dump`: what the pinned maps hold (works while the agent is down), traffic
//! per frontend and backend, or a running agent's view.

use std::path::Path;

use anyhow::{Context as _, Result};
use proxy_agent::dataplane::bpf::{self, MapSet};

/// `dump --model`: the running agent's cluster-wide model, as it serves it.
pub fn dump_model(addr: &str) -> Result<()> {
    outln!("{}", super::agent_client::fetch(addr, "/debug/model")?);
    Ok(())
}

pub fn dump_view(addr: &str, json: bool) -> Result<()> {
    let body = super::agent_client::fetch(addr, "/debug/view")?;
    if json {
        outln!("{body}");
        return Ok(());
    }
    let entries: Vec<serde_json::Value> = serde_json::from_str(&body).context("agent's view")?;
    outln!(
        "{:<30} {:<13} {:<28} BACKENDS",
        "FRONTEND",
        "KIND",
        "SERVICE"
    );
    for e in entries {
        let st = &e["state"];
        let set = |b: &serde_json::Value| {
            let eps: Vec<&str> = b["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str())
                .collect();
            if eps.is_empty() {
                format!(
                    "none ({})",
                    b["when_empty"].as_str().unwrap_or("?").to_lowercase()
                )
            } else {
                eps.join(" ")
            }
        };
        let mut backends = set(&st["backends"]);
        if !st["internal"].is_null() {
            backends.push_str(&format!("  | internal: {}", set(&st["internal"])));
        }
        outln!(
            "{:<30} {:<13} {:<28} {}",
            e["frontend"].as_str().unwrap_or(""),
            st["kind"].as_str().unwrap_or(""),
            st["service"].as_str().unwrap_or(""),
            backends
        );
    }
    Ok(())
}

fn open_pins(bpffs: &Path) -> Result<MapSet> {
    MapSet::open_pinned(&bpffs.join("maps"))
        .with_context(|| format!("is an agent's state pinned under {}?", bpffs.display()))
}

/// `dump --stats`: every frontend's and backend's counts, as `ipvsadm -Ln --stats`.
pub fn dump_stats(bpffs: &Path, json: bool, exact: bool) -> Result<()> {
    let rows = bpf::stats::read(&open_pins(bpffs)?)?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        out!("{}", bpf::stats::render_table(&rows, exact));
    }
    Ok(())
}

/// `dump`: every frontend with its backends, the counters, and what the tables and hooks
/// hold, as text or JSON.
pub fn dump(bpffs: &Path, json: bool) -> Result<()> {
    let maps = open_pins(bpffs)?;
    let rows = service_rows(&maps)?;
    let state = State::read(&maps, bpffs)?;
    if json {
        print_json(&rows, &state)
    } else {
        print_text(&rows, &state)
    }
}

/// Each service entry with its backends, as `dump` shows it.
fn service_rows(maps: &MapSet) -> Result<Vec<serde_json::Value>> {
    let mut rows = Vec::new();
    for entry in maps.services.iter() {
        let (key, value) = entry?;
        let mut backends = Vec::new();
        for slot in 0..u32::from(value.count) {
            let slot_key = proxy_common::BackendSlotKey {
                service_id: value.id,
                rev: value.rev,
                slot,
            };
            if let Ok(s) = maps.slots.get(&slot_key, 0)
                && let Ok(b) = maps.backends.get(&s.backend_id, 0)
            {
                backends
                    .push(proxy_common::addr::socket_addr(b.addr, b.family, b.port).to_string());
            }
        }
        rows.push(serde_json::json!({
            "frontend": proxy_common::addr::socket_addr(key.addr, key.family, key.port).to_string(),
            "protocol": match key.proto {
                proxy_common::PROTO_UDP => "UDP",
                proxy_common::PROTO_SCTP => "SCTP",
                _ => "TCP",
            },
            "id": value.id,
            "rev": value.rev,
            "affinity_timeout_s": value.affinity_timeout_s,
            // An unknown code (a newer release's pins): null.
            "scheduler": bpf::codec::scheduler_of_code(value.scheduler).map(|s| s.name()),
            "backends": backends,
        }));
    }
    Ok(rows)
}

/// What the tables and hooks hold besides the services.
struct State {
    counters: Vec<(&'static str, u64)>,
    /// Live sockets the connect-time hooks remember (in a slot or an entry: both go when
    /// a socket closes), and how many of them in a `SOCK_LB` entry.
    sockets: usize,
    sock_lb: usize,
    /// sock_release's filter: the generation, whether uncounted entries may be left, and
    /// the entries counted (the socket entries made under this generation).
    filter: proxy_common::SockLbFilter,
    counted: u64,
    /// Per-packet flows (two entries each): answered, and not answered yet.
    answered: usize,
    new: usize,
    /// Flows netfilter translated before the classifier was attached (kube-proxy's).
    netfilter: usize,
    /// Direct server return's (frontend, backend) pairs this node believes an option for.
    dsr_permits: usize,
    /// Which interfaces run the XDP program, and in which mode (by their pinned links).
    xdp: std::collections::BTreeMap<String, bpf::attach::xdp::Running>,
    /// Each map's memory as the kernel charges it (fdinfo memlock).
    memory: Vec<(&'static str, u64)>,
}

impl State {
    fn read(maps: &MapSet, bpffs: &Path) -> Result<Self> {
        let sock = bpf::sock_state::SockState::read(maps)?;
        Ok(Self {
            counters: maps.counters()?,
            sockets: sock.sockets(),
            sock_lb: sock.entries.len(),
            filter: maps.sock_lb_filter.get(&0, 0).unwrap_or_default(),
            counted: maps
                .sock_lb_counts
                .iter()
                .filter_map(Result::ok)
                .map(u64::from)
                .sum(),
            answered: maps.conntrack.keys().filter(Result::is_ok).count(),
            new: maps.conntrack_new.keys().filter(Result::is_ok).count(),
            netfilter: maps.netfilter_flows.keys().filter(Result::is_ok).count(),
            dsr_permits: maps.dsr_permits.keys().filter(Result::is_ok).count(),
            xdp: bpf::attach::xdp::pinned(&bpffs.join("links")),
            memory: bpf::maps::memory(&bpffs.join("maps")),
        })
    }
}

fn print_json(rows: &[serde_json::Value], state: &State) -> Result<()> {
    let by_name = |pairs: &[(&str, u64)]| -> serde_json::Map<String, serde_json::Value> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).into()))
            .collect()
    };
    outln!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "services": rows,
            "counters": by_name(&state.counters),
            "sockets": state.sockets,
            "sock_lb_entries": state.sock_lb,
            "socket_filter": {
                "generation": state.filter.generation,
                "uncounted": state.filter.uncounted != 0,
                "counted": state.counted,
            },
            "conntrack": {"answered": state.answered, "new": state.new},
            "netfilter_flows": state.netfilter,
            "dsr_permits": state.dsr_permits,
            "xdp": state.xdp,
            "map_memory_bytes": by_name(&state.memory),
        }))?
    );
    Ok(())
}

fn print_text(rows: &[serde_json::Value], state: &State) -> Result<()> {
    let State {
        counters,
        sockets,
        sock_lb,
        filter,
        counted,
        answered,
        new,
        netfilter,
        dsr_permits,
        xdp,
        memory,
    } = state;
    outln!(
        "{:<28} {:<5} {:>5} {:>4} {:<6}  BACKENDS",
        "FRONTEND",
        "PROTO",
        "ID",
        "REV",
        "SCHED"
    );
    for r in rows {
        outln!(
            "{:<28} {:<5} {:>5} {:>4} {:<6}  {}",
            r["frontend"].as_str().unwrap_or(""),
            r["protocol"].as_str().unwrap_or(""),
            r["id"].as_u64().unwrap_or(0),
            r["rev"].as_u64().unwrap_or(0),
            r["scheduler"].as_str().unwrap_or("?"),
            r["backends"]
                .as_array()
                .map(|b| b
                    .iter()
                    .filter_map(|v| v.as_str())
                    .collect::<Vec<_>>()
                    .join(" "))
                .unwrap_or_default()
        );
    }
    outln!("\nsockets tracked: {sockets} ({sock_lb} in SOCK_LB)");
    outln!(
        "sock_release filter: generation {}, {counted} counted{}",
        filter.generation,
        if filter.uncounted != 0 {
            " (entries of another generation may be left: every release looks up)"
        } else {
            ""
        }
    );
    outln!("conntrack entries: {answered} answered, {new} new (two per flow)");
    outln!("flows left to netfilter (translated before the classifier): {netfilter}");
    outln!("direct server return pairs believed (DSR_PERMITS): {dsr_permits}");
    if xdp.is_empty() {
        outln!("XDP: off");
    }
    for (interface, how) in xdp {
        outln!("XDP on {interface}: {}", how.as_str());
    }
    outln!("");
    for (name, value) in counters {
        outln!("{name:<24} {value}");
    }
    let total: u64 = memory.iter().map(|(_, b)| b).sum();
    outln!("\nBPF map memory (kernel's memlock), {total} bytes in all:");
    for (name, bytes) in memory {
        outln!("{name:<24} {bytes}");
    }
    Ok(())
}
