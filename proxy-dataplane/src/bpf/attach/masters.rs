//! Which device each interface is a port of (rtnetlink's `IFLA_MASTER`: a bridge, a
//! bond), in `IF_MASTERS`. The programs' reverse-path checks (`route::arrived_by_route`)
//! take a packet that came in on a bridge's port as having come in on the bridge — where
//! the kernel's own `rp_filter` sees it — so a pod behind a bridge answers by its route.

use std::sync::Mutex;

use crate::error::{ErrorKind, Kind as _, Result};
use aya::{Ebpf, maps::HashMap};
use proxy_common::map_names::IF_MASTERS;

use super::device_events::Device;

/// Records `link`'s master (or that it has none).
pub fn present(ebpf: &Mutex<Ebpf>, link: &Device) {
    let result = with_map(ebpf, |map| match link.master {
        Some(master) => map.insert(&link.index, &master, 0).map_err(Into::into),
        None => remove(map, link.index),
    });
    if let Err(e) = result {
        tracing::warn!(interface = %link.name, error = format!("{e:#}"),
            "the interface's master device not recorded (IF_MASTERS)");
    }
}

/// Forgets device `index` (gone).
pub fn gone(ebpf: &Mutex<Ebpf>, index: u32) {
    if let Err(e) = with_map(ebpf, |map| remove(map, index)) {
        tracing::warn!(
            ifindex = index,
            error = format!("{e:#}"),
            "a gone interface's IF_MASTERS entry not removed"
        );
    }
}

/// Forgets the devices `keep` says are gone (a device's entry goes with it).
pub fn sweep(ebpf: &Mutex<Ebpf>, keep: impl Fn(u32) -> bool) {
    let result = with_map(ebpf, |map| {
        let stale: Vec<u32> = map
            .keys()
            .filter_map(Result::ok)
            .filter(|i| !keep(*i))
            .collect();
        stale.into_iter().try_for_each(|i| remove(map, i))
    });
    if let Err(e) = result {
        tracing::warn!(
            error = format!("{e:#}"),
            "stale IF_MASTERS entries not removed"
        );
    }
}

fn remove(map: &mut HashMap<&mut aya::maps::MapData, u32, u32>, index: u32) -> Result<()> {
    match map.remove(&index) {
        Err(e) if !crate::bpf::maps::is_absent(&e) => Err(e.into()),
        _ => Ok(()),
    }
}

fn with_map(
    ebpf: &Mutex<Ebpf>,
    f: impl FnOnce(&mut HashMap<&mut aya::maps::MapData, u32, u32>) -> Result<()>,
) -> Result<()> {
    let mut ebpf = ebpf.lock().unwrap_or_else(|p| p.into_inner());
    let map = ebpf.map_mut(IF_MASTERS).kind_with(ErrorKind::Load, || {
        format!("BPF object has no {IF_MASTERS}")
    })?;
    let mut map = HashMap::try_from(map)?;
    f(&mut map)
}
