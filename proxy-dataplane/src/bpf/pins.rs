//! The pin folder: where maps and links are pinned, that it is a bpffs, and the pins an
//! earlier release left in another shape.

use std::{
    ffi::CString,
    fs,
    path::{Path, PathBuf},
};

use crate::error::{ErrorKind, Result, fail};
use proxy_common::map_names;

/// bpffs magic number (`statfs.f_type`).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

pub(super) fn maps_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("maps")
}

pub(super) fn links_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

/// Fails with a clear message unless `dir` (or its nearest existing parent) is on a bpffs.
pub fn check_bpffs(dir: &Path) -> Result<()> {
    let mut probe = dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    let c = CString::new(probe.as_os_str().as_encoded_bytes())?;
    // SAFETY: statfs writes into the zeroed struct we pass; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        fail!(
            ErrorKind::Io,
            "statfs {}: {}",
            probe.display(),
            std::io::Error::last_os_error()
        );
    }
    if st.f_type != BPF_FS_MAGIC {
        fail!(
            ErrorKind::Io,
            "{} is not on a BPF filesystem (bpffs): mount one first, e.g. \
             `mount -t bpf bpf /sys/fs/bpf`, or pass --bpffs with a folder on one",
            dir.display()
        );
    }
    Ok(())
}

/// Maps of counts only: the counters (which grow when a release counts something new)
/// and the statistics (keyed per frontend and backend pair since 2026-12-04). An upgraded
/// agent would otherwise refuse an older pin of another shape. Counts are not state
/// traffic depends on, so a pin that is not this object's shape is unpinned (the programs
/// still attached keep theirs until the new ones are swapped in) and a fresh one is made:
/// counts restart. Maps a release no longer has (`BACKEND_STATS`, folded into
/// `LB_STATS`) are unpinned too.
pub(super) fn replace_reshaped_counts(maps_dir: &Path) {
    use std::mem::size_of;
    let shapes = [
        (
            map_names::COUNTERS,
            size_of::<u32>(),
            size_of::<u64>(),
            Some(proxy_common::counter::COUNT),
        ),
        (
            map_names::LB_STATS,
            size_of::<proxy_common::StatsKey>(),
            size_of::<proxy_common::LbStats>(),
            None,
        ),
    ];
    for (name, key_size, value_size, entries) in shapes {
        let pin = maps_dir.join(name);
        let Ok(data) = aya::maps::MapData::from_pin(&pin) else {
            continue;
        };
        let Ok(info) = data.info() else { continue };
        let ours = entries.is_none_or(|n| info.max_entries() == n)
            && info.value_size() == value_size as u32
            && info.key_size() == key_size as u32;
        if !ours {
            unpin(&pin, "changed shape with this release; counts start over");
        }
    }
    for retired in RETIRED_MAPS {
        let pin = maps_dir.join(retired);
        if pin.exists() {
            unpin(&pin, "is no longer used by this release");
        }
    }
}

/// Maps earlier releases pinned that this one does not have.
const RETIRED_MAPS: [&str; 1] = ["BACKEND_STATS"];

fn unpin(pin: &Path, why: &str) {
    match fs::remove_file(pin) {
        Ok(()) => tracing::info!(map = %pin.display(), "{why}"),
        Err(e) => tracing::warn!(error = %e, map = %pin.display(), "cannot unpin ({why})"),
    }
}

/// A pinned map keeps the size it was created with (its entries are live flows): a new
/// size takes effect after `proxy-agent cleanup`.
pub(super) fn warn_if_pinned_size_differs(pin: &Path, wanted: u32) {
    let Ok(data) = aya::maps::MapData::from_pin(pin) else {
        return;
    };
    if let Ok(info) = data.info()
        && info.max_entries() != wanted
    {
        tracing::warn!(
            map = %pin.display(),
            pinned = info.max_entries(),
            wanted,
            "pinned map keeps its size; run `proxy-agent cleanup` to resize"
        );
    }
}
