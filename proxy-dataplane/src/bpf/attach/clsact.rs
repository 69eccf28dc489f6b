//! The classifier as `bpf` filters on a clsact qdisc, for kernels without tcx (before
//! 6.6). A netlink filter cannot be pinned, so it is found again by where it sits: our
//! filters hold a fixed priority and handle on each hook and carry the program's name.
//! A restarted agent changes the filter on that very priority and handle, which swaps the
//! program in place (`cls_bpf_change` replaces it under RCU: no packet sees no filter),
//! and `cleanup` deletes exactly those. A filter there whose program uses another pin
//! folder's maps is another agent's: taken over only when that agent is gone (`audit`). A clsact qdisc the agent added itself is
//! recorded as the bpffs folder `links/clsact@<ifindex>@<name>` and deleted again only
//! when no filter of anyone is left on it: other users of the qdisc keep it.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use super::ownership::{Owner, Ownership};

use crate::error::{Context as _, Error, ErrorKind, Kind as _, Result, fail};
use aya::programs::{
    SchedClassifier, TcAttachType,
    tc::{self, NlOptions, SchedClassifierLink, TcAttach},
};
use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkPayload};
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};
use netlink_sys::protocols::NETLINK_ROUTE;

use crate::bpf::netlink::Channel;

/// Our filters' priority on both hooks: below the 49152 tc picks for a filter added
/// without one, so ours runs before those, and clear of Cilium's 1.
pub const PRIORITY: u16 = 20;
/// Our filters' handle within that priority.
pub const HANDLE: u32 = 1;
/// ETH_P_ALL: the filters see every protocol.
const ETH_P_ALL: u16 = 0x0003;
/// Prefix of the records of clsact qdiscs the agent added.
const RECORD_PREFIX: &str = "clsact@";

/// One filter on a clsact hook, as rtnetlink lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    /// `bpf`, `u32`, `flower`, ...
    pub kind: String,
    /// A `bpf` filter's program name.
    pub name: Option<String>,
    /// A `bpf` filter's program id.
    pub id: Option<u32>,
}

impl Filter {
    /// At our place with our name (whose program it runs is `audit`'s question).
    pub fn is_ours(&self, program: &str) -> bool {
        self.at_our_place() && self.kind == "bpf" && self.name.as_deref() == Some(program)
    }

    pub fn at_our_place(&self) -> bool {
        self.priority == PRIORITY && self.handle == HANDLE
    }
}

fn parent(hook: TcAttachType) -> TcHandle {
    TcHandle {
        major: u16::MAX,
        minor: match hook {
            TcAttachType::Ingress => TcHandle::MIN_INGRESS,
            TcAttachType::Egress => TcHandle::MIN_EGRESS,
        },
    }
}

pub fn hook_name(hook: TcAttachType) -> &'static str {
    match hook {
        TcAttachType::Ingress => "ingress",
        TcAttachType::Egress => "egress",
    }
}

fn channel() -> Result<Channel> {
    Channel::open(NETLINK_ROUTE, "route netlink")
}

/// Sends a dump request and collects the answers `each` picks.
fn dump<T>(
    request: RouteNetlinkMessage,
    mut each: impl FnMut(RouteNetlinkMessage) -> Option<T>,
) -> Result<Vec<T>> {
    let mut ch = channel()?;
    let seq = ch.send(NLM_F_REQUEST | NLM_F_DUMP, None, request)?;
    let mut found = Vec::new();
    ch.receive::<RouteNetlinkMessage>(seq, |payload| match payload {
        NetlinkPayload::InnerMessage(m) => {
            found.extend(each(m));
            Ok(false)
        }
        NetlinkPayload::Error(e) if e.code.is_some() => {
            Err(Error::new(ErrorKind::Netlink, e.to_string()))
        }
        NetlinkPayload::Done(_) | NetlinkPayload::Error(_) => Ok(true),
        _ => Ok(false),
    })?;
    Ok(found)
}

/// Every filter on `ifindex`'s clsact `hook` (none without the qdisc or the device).
pub fn filters(ifindex: u32, hook: TcAttachType) -> Result<Vec<Filter>> {
    let mut request = TcMessage::with_index(ifindex as i32);
    request.header.parent = parent(hook);
    dump(RouteNetlinkMessage::GetTrafficFilter(request), |m| {
        let RouteNetlinkMessage::NewTrafficFilter(m) = m else {
            return None;
        };
        let mut filter = Filter {
            priority: (m.header.info >> 16) as u16,
            handle: m.header.handle.into(),
            kind: String::new(),
            name: None,
            id: None,
        };
        for attr in m.attributes {
            match attr {
                TcAttribute::Kind(k) => filter.kind = k,
                TcAttribute::Options(opts) => {
                    for o in opts {
                        match o {
                            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => filter.name = Some(n),
                            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => filter.id = Some(id),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        // The first answer per priority is its chain's header (handle 0), not a filter.
        (filter.handle != 0).then_some(filter)
    })
    .with_context(|| {
        format!(
            "listing the {} filters of ifindex {ifindex}",
            hook_name(hook)
        )
    })
}

/// Whether `ifindex` has a clsact qdisc.
pub fn has_clsact(ifindex: u32) -> Result<bool> {
    let found = dump(
        RouteNetlinkMessage::GetQueueDiscipline(TcMessage::default()),
        |m| match m {
            RouteNetlinkMessage::NewQueueDiscipline(m)
                if m.header.index == ifindex as i32
                    && m.attributes.contains(&TcAttribute::Kind("clsact".into())) =>
            {
                Some(())
            }
            _ => None,
        },
    )
    .context("listing qdiscs")?;
    Ok(!found.is_empty())
}

/// The filter at our priority and handle on `ifindex`'s `hook`, if any.
pub fn at_our_place(ifindex: u32, hook: TcAttachType) -> Result<Option<Filter>> {
    Ok(filters(ifindex, hook)?
        .into_iter()
        .find(Filter::at_our_place))
}

/// Puts `prog` on `ifindex`'s clsact `hook` at our priority and handle: a filter of ours
/// there gets the program swapped in (also one a stale agent of another pin folder left:
/// its folder is returned with how it went); otherwise a new filter is added (and the
/// qdisc with it, recorded under `links_dir`, when the device has none). Someone else's
/// filter at our place (another program, or the filter of an agent that runs) is left
/// alone and reported.
pub fn attach(
    prog: &mut SchedClassifier,
    program: &str,
    hook: TcAttachType,
    ifindex: u32,
    name: &str,
    links_dir: &Path,
    ownership: &mut Ownership,
) -> Result<(&'static str, Option<PathBuf>)> {
    let at = at_our_place(ifindex, hook)?;
    let owner = match &at {
        Some(f) if f.is_ours(program) => {
            f.id.map_or(Owner::Unknown, |id| ownership.owner_of_program(id))
        }
        _ => Owner::Unknown,
    };
    let options = NlOptions {
        priority: PRIORITY,
        handle: tc::TcHandle::from(HANDLE),
        classid: None,
    };
    let how = match at {
        Some(f) if f.is_ours(program) => {
            let stale = match owner {
                Owner::Ours | Owner::Unseen => None,
                Owner::Stale(folder) => Some(folder),
                Owner::Live(folder) => fail!(
                    ErrorKind::Netlink,
                    "{name}: the clsact {} hook's {program} filter (program {}) belongs to \
                     the agent of {}, which is running; not touched (one agent per interface)",
                    hook_name(hook),
                    f.id.unwrap_or_default(),
                    folder.display()
                ),
                Owner::Unknown => fail!(
                    ErrorKind::Netlink,
                    "{name}: the clsact {} hook's {program} filter (program {}) uses no maps \
                     of ours nor of a pin folder on our bpffs; not touched (if no agent uses \
                     it: `tc filter del dev {name} {} pref {PRIORITY}`)",
                    hook_name(hook),
                    f.id.unwrap_or_default(),
                    hook_name(hook)
                ),
            };
            let link = SchedClassifierLink::attached(
                ifindex,
                hook.into(),
                options.priority,
                options.handle,
                None,
            )?;
            let id = prog
                .attach_to_link(link)
                .kind_with(ErrorKind::Netlink, || {
                    format!("replacing {program}'s filter on {name}")
                })?;
            // The filter outlives us: aya would delete it when its link value drops.
            std::mem::forget(prog.take_link(id)?);
            return Ok(match stale {
                None => ("adopted filter", None),
                Some(folder) => ("adopted a stale agent's filter", Some(folder)),
            });
        }
        Some(f) => fail!(
            ErrorKind::Netlink,
            "{name}: the clsact {} hook has a foreign filter at priority {PRIORITY} \
             handle {HANDLE} ({} {}); not touched",
            hook_name(hook),
            f.kind,
            f.name.as_deref().unwrap_or("-")
        ),
        None => {
            if !has_clsact(ifindex)? {
                tc::qdisc_add_clsact(ifindex).kind_with(ErrorKind::Netlink, || {
                    format!("adding a clsact qdisc to {name}")
                })?;
                record(links_dir, ifindex, name)?;
                tracing::info!(interface = name, "clsact qdisc added");
            }
            let id = prog
                .attach(
                    ifindex,
                    TcAttach::Netlink {
                        parent: hook.into(),
                        options,
                    },
                )
                .kind_with(ErrorKind::Netlink, || {
                    format!(
                        "attaching {program} to {name} (ifindex {ifindex}) (clsact {})",
                        hook_name(hook)
                    )
                })?;
            std::mem::forget(prog.take_link(id)?);
            "new filter"
        }
    };
    Ok((how, None))
}

/// Deletes our filter for `program` from `ifindex`'s `hook`, if there is one; reports
/// whether there was.
pub fn remove(ifindex: u32, hook: TcAttachType, program: &str) -> Result<bool> {
    if !filters(ifindex, hook)?.iter().any(|f| f.is_ours(program)) {
        return Ok(false);
    }
    let mut request = TcMessage::with_index(ifindex as i32);
    request.header.parent = parent(hook);
    request.header.handle = TcHandle::from(HANDLE);
    request.header.info = (u32::from(PRIORITY) << 16) | u32::from(ETH_P_ALL.to_be());
    channel()?
        .act(0, None, RouteNetlinkMessage::DelTrafficFilter(request))
        .with_context(|| {
            format!(
                "deleting {program}'s filter from ifindex {ifindex} ({})",
                hook_name(hook)
            )
        })?;
    Ok(true)
}

fn record_path(links_dir: &Path, ifindex: u32, name: &str) -> PathBuf {
    links_dir.join(format!("{RECORD_PREFIX}{ifindex}@{name}"))
}

/// Notes that we added `ifindex`'s clsact qdisc (a folder: bpffs holds no plain files).
fn record(links_dir: &Path, ifindex: u32, name: &str) -> Result<()> {
    let path = record_path(links_dir, ifindex, name);
    match fs::create_dir(&path) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            Err(e).kind_with(ErrorKind::Io, || format!("recording {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// The recorded qdiscs: (ifindex, record folder).
fn records(links_dir: &Path) -> Vec<(u32, PathBuf)> {
    let Ok(entries) = fs::read_dir(links_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            let index = file.strip_prefix(RECORD_PREFIX)?.split('@').next()?.parse();
            Some((index.ok()?, e.path()))
        })
        .collect()
}

/// Forgets the records of devices `exists` does not know (their qdisc went with them).
pub fn prune_records(links_dir: &Path, exists: impl Fn(u32) -> bool) {
    for (index, path) in records(links_dir) {
        if !exists(index) {
            let _ = fs::remove_dir(&path);
        }
    }
}

/// Deletes the qdisc we added to `ifindex` once no filter is left on it (another user's
/// filters keep it), and its record.
pub fn release_qdisc(links_dir: &Path, ifindex: u32) -> Result<()> {
    for (index, path) in records(links_dir) {
        if index != ifindex {
            continue;
        }
        let used = !filters(ifindex, TcAttachType::Ingress)?.is_empty()
            || !filters(ifindex, TcAttachType::Egress)?.is_empty();
        if used {
            tracing::info!(ifindex, "clsact qdisc kept: other filters use it");
        } else if has_clsact(ifindex)? {
            let mut request = TcMessage::with_index(ifindex as i32);
            request.header.parent = TcHandle::CLSACT;
            request.header.handle = TcHandle {
                major: u16::MAX,
                minor: 0,
            };
            channel()?
                .act(0, None, RouteNetlinkMessage::DelQueueDiscipline(request))
                .with_context(|| format!("deleting the clsact qdisc of ifindex {ifindex}"))?;
            tracing::info!(ifindex, "clsact qdisc deleted");
        }
        fs::remove_dir(&path)
            .kind_with(ErrorKind::Io, || format!("removing {}", path.display()))?;
    }
    Ok(())
}

/// Removes our filters (`programs`: name per hook) from every device of this network
/// namespace in `ifindexes`, then the qdiscs we added that nobody else uses.
pub fn remove_everywhere(
    links_dir: &Path,
    ifindexes: &[u32],
    programs: &[(&str, TcAttachType)],
) -> Result<usize> {
    let mut removed = 0;
    for &index in ifindexes {
        for &(program, hook) in programs {
            if remove(index, hook, program)? {
                removed += 1;
            }
        }
        release_qdisc(links_dir, index)?;
    }
    prune_records(links_dir, |i| ifindexes.contains(&i));
    Ok(removed)
}
