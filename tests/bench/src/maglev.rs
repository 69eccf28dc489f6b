//! How long a Maglev table takes to rebuild (issue 14): the table alone, in user space
//! (`Schedule::layout` for `mh`), and one endpoint change of an `mh` frontend applied to
//! private maps through `Mirror::apply` (the new table and slots written as a new
//! generation, the flip, the old ones removed): what an operator waits for.

use std::{
    hint::black_box,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use proxy_agent::{
    dataplane::bpf::{self, MapSet, Mirror},
    model::NodeView,
    model::schedule::{DEFAULT_MAGLEV_TABLE_LEN, MAGLEV_TABLE_LENS, Schedule, Scheduler},
};

use super::{BACKEND_PORT, cluster_ip, median};

/// The table lengths measured: IPVS's default and the largest accepted.
pub const TABLE_LENS: [u32; 2] = [
    DEFAULT_MAGLEV_TABLE_LEN,
    MAGLEV_TABLE_LENS[MAGLEV_TABLE_LENS.len() - 1],
];

/// One backend count at one table length.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MaglevRebuild {
    pub backends: usize,
    /// The length configured, and the entries of the table built (`MAGLEV`, in chunks
    /// of 16): the next accepted length that holds every backend when they outnumber it.
    pub table_len: u32,
    pub entries: usize,
    /// Median milliseconds to compute the table, in user space.
    pub table_ms: f64,
    /// Milliseconds to program the frontend into maps holding nothing else.
    pub program_ms: f64,
    /// Median milliseconds to apply one endpoint change (one removed, or put back).
    pub one_change_ms: f64,
}

fn vip() -> IpAddr {
    IpAddr::from(Ipv4Addr::new(10, 96, 2, 1))
}

/// `n` endpoints from 10.60.0.1 up, sorted (as the agent passes them).
fn endpoints(n: usize) -> Vec<SocketAddr> {
    (0..n as u32)
        .map(|i| SocketAddr::from((Ipv4Addr::from(0x0a3c_0001 + i), BACKEND_PORT)))
        .collect()
}

/// Each of `backend_counts` at each of `TABLE_LENS`; the medians over `reps` runs.
pub fn rebuild_times(backend_counts: &[usize], reps: u32) -> Result<Vec<MaglevRebuild>> {
    let reps = reps.max(1);
    let (_ebpf, mut maps) = bpf::load_private(&[])?;
    let mut state = Mirror::adopt(&maps)?;
    let mut out = Vec::new();
    for &n in backend_counts {
        let all = endpoints(n);
        for table_len in TABLE_LENS {
            let schedule = Schedule::new(Scheduler::Mh, Default::default(), table_len);
            let mut table_ms = Vec::new();
            let mut entries = 0;
            for _ in 0..reps {
                let t = Instant::now();
                entries = black_box(proxy_agent::dataplane::layout::layout(
                    &schedule,
                    black_box(&all),
                    vip(),
                ))
                .table
                .len();
                table_ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            let fewer = &all[1..];
            let what = format!("{n} backends, table {table_len}");
            let program_ms = timed_apply(&mut state, &mut maps, all.iter(), &schedule)
                .with_context(|| format!("programming {what}"))?;
            let mut change_ms = Vec::new();
            for r in 0..reps {
                // One endpoint leaves, then comes back: each a change of one endpoint.
                let eps = if r % 2 == 0 { fewer } else { &all[..] };
                change_ms.push(
                    timed_apply(&mut state, &mut maps, eps.iter(), &schedule)
                        .with_context(|| format!("one endpoint change, {what}"))?,
                );
            }
            // Maps empty again for the next size (not timed).
            state
                .apply(&mut maps, &NodeView::new())
                .context("removing the frontend")?;
            out.push(MaglevRebuild {
                backends: n,
                table_len,
                entries,
                table_ms: median(&mut table_ms),
                program_ms,
                one_change_ms: median(&mut change_ms),
            });
        }
    }
    Ok(out)
}

/// Milliseconds `Mirror::apply` takes to give the one frontend `endpoints`; it must
/// write it (a frontend left as it was, or failed, would time something else).
fn timed_apply<'e>(
    state: &mut Mirror,
    maps: &mut MapSet,
    endpoints: impl Iterator<Item = &'e SocketAddr>,
    schedule: &Schedule,
) -> Result<f64> {
    let mut view = NodeView::new();
    let (fe, st) = cluster_ip(vip(), endpoints.copied().collect(), schedule.clone());
    view.insert(fe, st);
    let t = Instant::now();
    let report = state.apply(maps, &view)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if report.frontends_written != 1 || !report.failed.is_empty() {
        bail!("the frontend was not written: {report:?}");
    }
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_distinct_and_sorted() {
        let eps = endpoints(10_000);
        assert!(eps.windows(2).all(|w| w[0] < w[1]));
    }
}
