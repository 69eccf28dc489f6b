//! `proxy-agent cleanup`: everything the agent pinned, removed — and only that.

use std::{
    fs,
    path::{Path, PathBuf},
};

use crate::error::{Context as _, ErrorKind, Kind as _, Result};
use aya::programs::links::PinnedLink;
use proxy_common::map_names;

use super::{
    attach::{self, links},
    ctnetlink,
    maps::MapSet,
    pin_lock,
    pins::{check_bpffs, links_dir, maps_dir},
};

/// Removes everything the agent pinned under `pin_dir`: links first (which detaches the
/// programs), then the clsact filters of this network namespace (and the qdiscs we added,
/// when nothing else uses them), then the kernel's conntrack entries our flows left
/// (`ctnetlink::forget_translated_flows`), then maps.
pub fn cleanup(pin_dir: &Path) -> Result<CleanupReport> {
    let mut report = CleanupReport::default();
    if !pin_dir.exists() {
        return Ok(report);
    }
    // Only a bpffs holds our pins: anywhere else, nothing is ours to delete.
    check_bpffs(pin_dir).context("refusing to clean up")?;
    // Not under a running agent, which would go on with its programs detached.
    let _lock = pin_lock::lock_within(pin_dir, std::time::Duration::from_secs(2))
        .context("refusing to clean up under a running agent")?;
    let links_dir = links_dir(pin_dir);
    remove_ours(&links_dir, is_our_link, &mut report)?;
    attach::remove_filters(&links_dir)?;
    if let Ok(maps) = MapSet::open_pinned(&maps_dir(pin_dir)) {
        // The kernel releases an unpinned link in deferred work: a packet the classifier
        // still translates meanwhile would leave its entry behind again.
        std::thread::sleep(std::time::Duration::from_millis(250));
        match ctnetlink::forget_translated_flows(&maps) {
            Ok(n) => tracing::info!(
                entries = n,
                "the kernel's conntrack entries of our flows deleted"
            ),
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "the kernel's conntrack entries of our flows left"
            ),
        }
    }
    remove_ours(&maps_dir(pin_dir), is_our_map, &mut report)?;
    // Folders go only when empty: whatever someone else put there stays.
    for dir in [links_dir, maps_dir(pin_dir)] {
        let _ = fs::remove_dir(&dir);
    }
    let _ = fs::remove_dir(pin_dir);
    Ok(report)
}

/// What `cleanup` removed and what it left, and why.
#[derive(Debug, Default)]
pub struct CleanupReport {
    pub removed: usize,
    pub left: Vec<(PathBuf, &'static str)>,
}

/// One of our link pins: the cgroup hooks' and the classifier's, by name, and a link.
fn is_our_link(path: &Path, name: &str) -> Option<&'static str> {
    let named =
        name.starts_with("cgroup_") || links::HOOK_PREFIXES.iter().any(|p| name.starts_with(p));
    if !named {
        return Some("not a name of ours");
    }
    PinnedLink::from_pin(path)
        .is_err()
        .then_some("not a BPF link")
}

/// One of our map pins: a name of our object's maps, and a map.
fn is_our_map(path: &Path, name: &str) -> Option<&'static str> {
    if !map_names::ALL.contains(&name) {
        return Some("not a name of ours");
    }
    aya::maps::MapData::from_pin(path)
        .is_err()
        .then_some("not a BPF map")
}

/// Removes the pins in `dir` that `foreign` finds nothing against (folders are qdisc
/// records: `clsact` owns those); the rest is reported as left.
fn remove_ours(
    dir: &Path,
    foreign: fn(&Path, &str) -> Option<&'static str>,
    report: &mut CleanupReport,
) -> Result<()> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(why) = foreign(&path, &name) {
            report.left.push((path, why));
            continue;
        }
        fs::remove_file(&path)
            .kind_with(ErrorKind::Io, || format!("removing {}", path.display()))?;
        report.removed += 1;
    }
    Ok(())
}
