//! The connect-time hooks on a cgroup v2 folder: the sock_addr programs and
//! `sock_release`, each adopted from its pinned link (swapped in place) or attached and
//! pinned; checked again at each resync (a pin deleted or a link detached: attached
//! again); and where cgroup v2 is mounted.

use std::{fs, os::fd::AsFd as _, path::Path};

use crate::error::{ErrorKind, Kind as _, Result};
use aya::{
    Ebpf,
    programs::{
        CgroupAttachMode, CgroupSock, CgroupSockAddr,
        cgroup_sock_addr::CgroupSockAddrLink,
        links::{FdLink, PinnedLink},
    },
};

use super::{link_update, ownership::NodeHooks};
use crate::bpf::programs::{CGROUP_PROGRAMS, SOCK_RELEASE_PROGRAM};

/// The cgroup v2 mount point, from /proc/self/mountinfo (`/sys/fs/cgroup` on most hosts).
pub fn cgroup2_mount() -> crate::error::Result<std::path::PathBuf> {
    let info =
        std::fs::read_to_string("/proc/self/mountinfo").kind(ErrorKind::Io, "reading mountinfo")?;
    info.lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            post.starts_with("cgroup2 ")
                .then(|| pre.split(' ').nth(4).map(std::path::PathBuf::from))?
        })
        .kind(
            ErrorKind::Attach,
            "no cgroup2 mount found: pass --cgroup PATH or --cgroup none",
        )
}

pub fn attach_cgroup_programs(ebpf: &mut Ebpf, cgroup: &Path, links_dir: &Path) -> Result<()> {
    let cgroup_file = fs::File::open(cgroup).kind_with(ErrorKind::Attach, || {
        format!("opening cgroup {}", cgroup.display())
    })?;
    for name in CGROUP_PROGRAMS {
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .kind_with(ErrorKind::Load, || {
                format!("BPF object has no program {name}")
            })?
            .try_into()?;
        prog.load()
            .kind_with(ErrorKind::Load, || format!("loading {name}"))?;
        let pin = links_dir.join(format!("cgroup_{name}"));
        let link_id = if pin.exists() {
            // Adopt: swap this program into the pinned link, no gap in between.
            let fd_link: FdLink = PinnedLink::from_pin(&pin)
                .kind_with(ErrorKind::Attach, || {
                    format!("opening pinned link {}", pin.display())
                })?
                .into();
            let link = CgroupSockAddrLink::try_from(fd_link)?;
            prog.attach_to_link(link).kind_with(ErrorKind::Attach, || {
                format!("replacing the program of {}", pin.display())
            })?
        } else {
            attach_sock_addr(prog, name, &cgroup_file, cgroup, &pin)?;
            continue;
        };
        // The link is pinned already; dropping our fd keeps it attached.
        let link = prog.take_link(link_id)?;
        drop(FdLink::try_from(link)?);
    }
    attach_sock_release(ebpf, &cgroup_file, cgroup, links_dir)
}

/// Attaches the loaded sock_addr program `name` to `cgroup` with a new link, pinned at
/// `pin`.
fn attach_sock_addr(
    prog: &mut CgroupSockAddr,
    name: &str,
    cgroup_file: &fs::File,
    cgroup: &Path,
    pin: &Path,
) -> Result<()> {
    let id = prog
        // Links are always multi-attach; the kernel rejects explicit flags for them.
        .attach(cgroup_file.as_fd(), CgroupAttachMode::Single)
        .kind_with(ErrorKind::Attach, || {
            format!(
                "attaching {name} to {} (needs cgroup bpf links, Linux 5.7{})",
                cgroup.display(),
                if name.starts_with("getpeername") {
                    ", and the getpeername hooks, Linux 5.8"
                } else {
                    ""
                }
            )
        })?;
    FdLink::try_from(prog.take_link(id)?)?
        .pin(pin)
        .kind_with(ErrorKind::Attach, || format!("pinning {}", pin.display()))?;
    Ok(())
}

/// Why the hook pinned at `pin` no longer works, if it does not: the pin is gone (which
/// detached it), or its link is detached from the cgroup (`cgroup_id` 0: the cgroup was
/// removed, or someone detached it).
fn lost(pin: &Path) -> Option<&'static str> {
    if !pin.exists() {
        return Some("its pinned link is gone");
    }
    match link_update::pinned_field(pin, "cgroup_id") {
        Ok(0) => Some("its link is detached"),
        Ok(_) => None,
        Err(_) => Some("its pin is not a readable link"),
    }
}

/// The resync's check of the connect-time hooks: each one whose pin is gone or whose link
/// is detached is attached again (the programs are loaded already), logged and counted.
pub fn repair(ebpf: &mut Ebpf, cgroup: &Path, links_dir: &Path, hooks: &NodeHooks) {
    let names = CGROUP_PROGRAMS.iter().chain([&SOCK_RELEASE_PROGRAM]);
    let lost: Vec<(&str, &str)> = names
        .filter_map(|name| Some((*name, lost(&links_dir.join(format!("cgroup_{name}")))?)))
        .collect();
    if lost.is_empty() {
        return;
    }
    let cgroup_file = match fs::File::open(cgroup) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(cgroup = %cgroup.display(), error = %e, "connect-time hooks lost; the cgroup is unreadable");
            return;
        }
    };
    for (name, why) in lost {
        let pin = links_dir.join(format!("cgroup_{name}"));
        let done = reattach(ebpf, name, &cgroup_file, cgroup, &pin);
        match done {
            Ok(()) => {
                hooks.count_repaired();
                tracing::warn!(
                    program = name,
                    cgroup = %cgroup.display(),
                    why,
                    "connect-time hook was lost; attached again"
                );
            }
            Err(e) => tracing::warn!(
                program = name,
                why,
                error = format!("{e:#}"),
                "connect-time hook was lost and is not attached again"
            ),
        }
    }
}

/// Attaches the loaded program `name` again with a new link pinned at `pin` (whatever is
/// pinned there goes first).
fn reattach(
    ebpf: &mut Ebpf,
    name: &str,
    cgroup_file: &fs::File,
    cgroup: &Path,
    pin: &Path,
) -> Result<()> {
    if pin.exists() {
        fs::remove_file(pin)
            .kind_with(ErrorKind::Attach, || format!("removing {}", pin.display()))?;
    }
    if name == SOCK_RELEASE_PROGRAM {
        let prog: &mut CgroupSock = ebpf
            .program_mut(name)
            .kind_with(ErrorKind::Load, || {
                format!("BPF object has no program {name}")
            })?
            .try_into()?;
        return attach_sock_release_link(prog, cgroup_file, cgroup, pin);
    }
    let prog: &mut CgroupSockAddr = ebpf
        .program_mut(name)
        .kind_with(ErrorKind::Load, || {
            format!("BPF object has no program {name}")
        })?
        .try_into()?;
    attach_sock_addr(prog, name, cgroup_file, cgroup, pin)
}

/// Attaches `sock_release` (or swaps it into its pinned link): without it, `SOCK_LB` would
/// keep the entries of closed sockets.
fn attach_sock_release(
    ebpf: &mut Ebpf,
    cgroup_file: &fs::File,
    cgroup: &Path,
    links_dir: &Path,
) -> Result<()> {
    let prog: &mut CgroupSock = ebpf
        .program_mut(SOCK_RELEASE_PROGRAM)
        .kind_with(ErrorKind::Load, || {
            format!("BPF object has no program {SOCK_RELEASE_PROGRAM}")
        })?
        .try_into()?;
    prog.load().kind_with(ErrorKind::Load, || {
        format!("loading {SOCK_RELEASE_PROGRAM}")
    })?;
    let pin = links_dir.join(format!("cgroup_{SOCK_RELEASE_PROGRAM}"));
    if pin.exists() {
        return link_update::replace_program(&pin, prog.fd()?.as_fd());
    }
    attach_sock_release_link(prog, cgroup_file, cgroup, &pin)
}

/// Attaches the loaded `sock_release` to `cgroup` with a new link, pinned at `pin`.
fn attach_sock_release_link(
    prog: &mut CgroupSock,
    cgroup_file: &fs::File,
    cgroup: &Path,
    pin: &Path,
) -> Result<()> {
    let id = prog
        .attach(cgroup_file.as_fd(), CgroupAttachMode::Single)
        .kind_with(ErrorKind::Attach, || {
            format!(
                "attaching {SOCK_RELEASE_PROGRAM} to {} (needs the cgroup sock_release hook, \
                 Linux 5.9)",
                cgroup.display()
            )
        })?;
    FdLink::try_from(prog.take_link(id)?)?
        .pin(pin)
        .kind_with(ErrorKind::Attach, || format!("pinning {}", pin.display()))?;
    Ok(())
}
