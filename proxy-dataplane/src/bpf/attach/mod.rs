//! Hooking the programs to the kernel: the connect-time hooks on a cgroup, the
//! classifier on interfaces (tcx links or clsact filters) and the XDP program beside it
//! (`ebpf.xdp`), now and as they appear, each
//! adopted from its pin so an agent restart swaps programs without a gap; checked again
//! at each resync, with whatever else sits on those hooks (`audit`).

pub mod cgroup;
mod clsact;
pub mod device_events;
pub mod follow;
pub mod interfaces;
pub mod link_update;
pub mod links;
mod masters;
pub mod ownership;
pub mod xdp;

use std::path::Path;

use crate::error::Result;

/// Deletes our clsact filters from every device of this network namespace, and the
/// clsact qdiscs we added that nothing else uses.
pub fn remove_filters(links_dir: &Path) -> Result<()> {
    let indexes: Vec<u32> = device_events::list()?.iter().map(|l| l.index).collect();
    let removed = clsact::remove_everywhere(links_dir, &indexes, &links::FILTERS)?;
    if removed > 0 {
        tracing::info!(filters = removed, "clsact filters deleted");
    }
    Ok(())
}
