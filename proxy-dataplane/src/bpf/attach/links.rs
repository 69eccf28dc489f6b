//! The classifier's links, two per served interface, pinned as `links/tc_ingress@<name>`
//! and `links/tc_egress@<name>` (the egress program translates what the node itself
//! sends about translated flows): attached when a wanted interface appears, unpinned when
//! it goes, so a pin always belongs to the device that now has its name. Without tcx the
//! same two programs are filters on the device's clsact qdisc instead (`clsact`).
//!
//! Each check (at start, and at every resync) makes sure every served interface still
//! runs our programs on both hooks — a pin deleted by hand, a link detached, a filter
//! deleted: attached again, logged and counted — and looks at what else sits there: a
//! classifier named as ours from another pin folder whose agent is gone is detached (tcx)
//! or adopted (clsact); one whose agent runs, or whose folder is not found, is left in
//! place and reported (`audit`), and `/healthz` fails while it is there.

use std::{
    collections::BTreeMap,
    fs, io,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::error::{ErrorKind, Kind as _, Result, fail};
use aya::{
    Ebpf,
    programs::{
        SchedClassifier, TcAttachType, Xdp,
        links::FdLink,
        tc::{SchedClassifierLink, TcAttach},
    },
};

use super::{
    clsact,
    device_events::{Device, DeviceChange},
    interfaces::{Decision, InterfaceSelector},
    link_update,
    ownership::{CLASSIFIER_NAMES, ForeignClassifier, NodeHooks, Owner, Ownership},
    xdp::{self, NativeRefused, XDP_PROGRAM, XdpMode, XdpSetup},
};
use crate::bpf::{
    kernel::{self, TcHook},
    pin_lock,
    programs::{TC_EGRESS_PROGRAM, TC_PROGRAM},
};

mod resync;

/// The programs attached to each served interface: name, hook, pin prefix.
const HOOKS: [(&str, TcAttachType, &str); 2] = [
    (TC_PROGRAM, TcAttachType::Ingress, "tc_ingress@"),
    (TC_EGRESS_PROGRAM, TcAttachType::Egress, "tc_egress@"),
];

/// The programs by hook, as clsact filters carry them.
/// The pin-name prefixes of the classifier's links and the XDP program's (`cleanup`
/// knows its own by them).
pub const HOOK_PREFIXES: [&str; 4] = [
    HOOKS[0].2,
    HOOKS[1].2,
    xdp::PREFIXES[0].0,
    xdp::PREFIXES[1].0,
];

pub const FILTERS: [(&str, TcAttachType); 2] = [
    (TC_PROGRAM, TcAttachType::Ingress),
    (TC_EGRESS_PROGRAM, TcAttachType::Egress),
];

/// Attach failures so far (a metric): shared between the dataplane and the endpoints.
#[derive(Clone, Debug, Default)]
pub struct AttachFailures(Arc<AtomicU64>);

impl AttachFailures {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn count(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the classifiers are given at start.
pub struct Setup {
    pub links_dir: PathBuf,
    pub selector: InterfaceSelector,
    pub hook: TcHook,
    /// Counts failed attachments.
    pub failures: AttachFailures,
    /// Where foreign classifiers and repairs are reported.
    pub hooks: NodeHooks,
    /// Tells our classifiers from other agents'.
    pub ownership: Ownership,
    /// Whether and how the XDP program runs beside the classifier.
    pub xdp: XdpSetup,
}

/// The classifier's links, kept in step with the interfaces rtnetlink reports.
pub struct Classifiers {
    /// Holds the loaded classifier (shared with the dataplane, which owns the object).
    ebpf: Arc<Mutex<Ebpf>>,
    links_dir: PathBuf,
    selector: InterfaceSelector,
    hook: TcHook,
    /// Served interfaces: name → ifindex of the device the pinned link is on.
    attached: BTreeMap<String, u32>,
    /// Matching devices left out (no Ethernet header), so each is logged once.
    skipped: BTreeMap<String, u32>,
    /// Devices seen by the dump under way, if one is: name → ifindex.
    dumping: Option<BTreeMap<String, u32>>,
    failures: AttachFailures,
    /// Wanted interfaces whose attachment failed: tried again at each check.
    failed: BTreeMap<String, Device>,
    /// Our programs' ids, by name.
    ids: BTreeMap<&'static str, u32>,
    /// Whether the kernel has tcx (its hooks are looked at in clsact mode too).
    tcx: bool,
    ownership: Ownership,
    /// Foreign classifiers left in place, by interface (published to `hooks`).
    foreign: BTreeMap<String, Vec<ForeignClassifier>>,
    hooks: NodeHooks,
    /// Whether an unreadable tcx hook was logged (once: the cause is the agent's).
    said_unreadable: bool,
    xdp: XdpSetup,
    /// Interfaces where `native` XDP could not attach, with why (the agent refuses to
    /// start on those present at start).
    xdp_refused: BTreeMap<String, String>,
}

impl Classifiers {
    /// Loads the classifier into `ebpf` (once; later attachments reuse it).
    pub fn new(ebpf: Arc<Mutex<Ebpf>>, setup: Setup) -> Result<Self> {
        let mut ids = BTreeMap::new();
        {
            let mut ebpf = lock(&ebpf);
            for (name, _, _) in HOOKS {
                let prog: &mut SchedClassifier = ebpf
                    .program_mut(name)
                    .kind_with(ErrorKind::Load, || format!("BPF object has no {name}"))?
                    .try_into()?;
                prog.load()
                    .kind_with(ErrorKind::Load, || format!("loading {name}"))?;
                ids.insert(
                    name,
                    prog.info()
                        .kind_with(ErrorKind::Attach, || format!("reading {name}'s id"))?
                        .id(),
                );
            }
        }
        if setup.xdp.mode != XdpMode::Off {
            let mut ebpf = lock(&ebpf);
            let prog: &mut Xdp = ebpf
                .program_mut(XDP_PROGRAM)
                .kind_with(ErrorKind::Load, || {
                    format!("BPF object has no {XDP_PROGRAM}")
                })?
                .try_into()?;
            prog.load()
                .kind_with(ErrorKind::Load, || format!("loading {XDP_PROGRAM}"))?;
        }
        let Setup {
            links_dir,
            selector,
            hook,
            failures,
            hooks,
            ownership,
            xdp,
        } = setup;
        Ok(Self {
            ebpf,
            links_dir,
            selector,
            hook,
            attached: BTreeMap::new(),
            skipped: BTreeMap::new(),
            dumping: None,
            failures,
            failed: BTreeMap::new(),
            ids,
            tcx: hook == TcHook::Tcx || kernel::tcx_supported().unwrap_or(false),
            ownership,
            foreign: BTreeMap::new(),
            hooks,
            said_unreadable: false,
            xdp,
            xdp_refused: BTreeMap::new(),
        })
    }

    /// An interface where `native` XDP could not attach, and why.
    pub fn xdp_refused(&self) -> Option<(&str, &str)> {
        self.xdp_refused
            .iter()
            .next()
            .map(|(n, why)| (n.as_str(), why.as_str()))
    }

    /// A dump of every link starts: what it does not list is gone when it ends.
    pub fn begin_dump(&mut self) {
        self.dumping = Some(BTreeMap::new());
    }

    pub fn handle(&mut self, change: DeviceChange) {
        match change {
            DeviceChange::Present(link) => self.present(&link),
            DeviceChange::Gone(link) => self.gone(&link),
            DeviceChange::DumpDone { interrupted: false } => self.end_dump(),
            // Incomplete: nothing is swept; the next dump starts afresh.
            DeviceChange::DumpDone { interrupted: true } => {}
        }
    }

    /// Names of the interfaces served now.
    pub fn attached(&self) -> impl Iterator<Item = &str> {
        self.attached.keys().map(String::as_str)
    }

    fn present(&mut self, link: &Device) {
        if let Some(seen) = &mut self.dumping {
            seen.insert(link.name.clone(), link.index);
        }
        super::masters::present(&self.ebpf, link);
        // A renamed device: its old name's link goes (the new name decides afresh).
        let renamed: Vec<String> = self
            .attached
            .iter()
            .filter(|(name, index)| **index == link.index && **name != link.name)
            .map(|(name, _)| name.clone())
            .collect();
        for old in renamed {
            self.detach(&old, "interface renamed");
        }
        match self.selector.decide(&link.name, link.kind) {
            // A filter of ours left on a device no longer wanted (the configuration changed
            // while the agent was down): looked for at dumps, not on every link change.
            Decision::Ignore if self.hook == TcHook::Clsact && self.dumping.is_some() => {
                self.forget_failed(&link.name);
                self.remove_filters(link.index, &link.name, "interface not wanted");
            }
            Decision::Ignore => self.forget_failed(&link.name),
            Decision::SkipNotEthernet => {
                self.forget_failed(&link.name);
                if self.skipped.insert(link.name.clone(), link.index) != Some(link.index) {
                    tracing::info!(
                        interface = link.name,
                        link_type = ?link.kind,
                        "interface skipped: no Ethernet header, which the classifier needs"
                    );
                }
                if self.attached.contains_key(&link.name) || self.pinned(&link.name) {
                    self.detach(&link.name, "interface has no Ethernet header");
                }
            }
            Decision::Attach if self.attached.get(&link.name) == Some(&link.index) => {}
            Decision::Attach => {
                self.attach_logged(link);
                self.inspect_hooks(&link.name, link.index);
            }
        }
    }

    /// Attaches both programs to `link`, logging how (or why not: then it is tried again
    /// at the next check, or when the device next changes).
    fn attach_logged(&mut self, link: &Device) {
        match self.attach(link) {
            Ok(how) => {
                tracing::info!(
                    interface = link.name,
                    ifindex = link.index,
                    how,
                    "classifier attached"
                );
                self.attached.insert(link.name.clone(), link.index);
                self.failed.remove(&link.name);
            }
            Err(e) => {
                self.failures.count();
                tracing::warn!(
                    interface = link.name,
                    error = format!("{e:#}"),
                    "classifier not attached"
                );
                self.failed.insert(link.name.clone(), link.clone());
            }
        }
    }

    fn forget_failed(&mut self, name: &str) {
        self.failed.remove(name);
        self.set_foreign(name, Vec::new());
    }

    fn gone(&mut self, link: &Device) {
        super::masters::gone(&self.ebpf, link.index);
        self.skipped.remove(&link.name);
        self.forget_failed(&link.name);
        // Its qdisc went with it.
        clsact::prune_records(&self.links_dir, |index| index != link.index);
        // The kernel detached the link with the device; its pin would only be stale.
        if self.attached.get(&link.name) == Some(&link.index)
            || (!self.attached.contains_key(&link.name) && self.pinned(&link.name))
        {
            self.detach(&link.name, "interface gone");
        }
    }

    fn end_dump(&mut self) {
        let Some(seen) = self.dumping.take() else {
            return;
        };
        let vanished: Vec<String> = self
            .attached
            .keys()
            .filter(|n| !seen.contains_key(*n))
            .cloned()
            .collect();
        for name in vanished {
            self.detach(&name, "interface gone");
        }
        self.skipped.retain(|n, _| seen.contains_key(n));
        let unseen: Vec<String> = self
            .failed
            .keys()
            .filter(|n| !seen.contains_key(*n))
            .cloned()
            .collect();
        for name in unseen {
            self.forget_failed(&name);
        }
        prune_pins(&self.links_dir, |name| self.attached.contains_key(name));
        clsact::prune_records(&self.links_dir, |index| seen.values().any(|i| *i == index));
        super::masters::sweep(&self.ebpf, |index| seen.values().any(|i| *i == index));
    }

    /// Both programs on `link` (ingress first), then XDP (which passes to them what it
    /// cannot finish); reports how the ingress one got there.
    fn attach(&mut self, link: &Device) -> Result<&'static str> {
        let mut how = "";
        for (program, hook, prefix) in HOOKS {
            let done = self.attach_one(&link.name, link.index, program, hook, prefix)?;
            if how.is_empty() {
                how = done;
            }
        }
        self.attach_xdp(link)?;
        Ok(how)
    }

    fn attach_xdp(&mut self, link: &Device) -> Result<()> {
        if self.xdp.mode == XdpMode::Off {
            xdp::detach(&self.xdp, &self.links_dir, &link.name);
            return Ok(());
        }
        let mut ebpf = lock(&self.ebpf);
        let prog: &mut Xdp = ebpf
            .program_mut(XDP_PROGRAM)
            .kind_with(ErrorKind::Load, || {
                format!("BPF object has no {XDP_PROGRAM}")
            })?
            .try_into()?;
        match xdp::attach(prog, &self.xdp, &self.links_dir, &link.name, link.index) {
            Ok(_) => {
                self.xdp_refused.remove(&link.name);
                Ok(())
            }
            Err(e) => {
                if let Some(refused) = e.downcast_ref::<NativeRefused>() {
                    self.xdp_refused
                        .insert(link.name.clone(), refused.to_string());
                }
                Err(e)
            }
        }
    }

    /// Attaches `program` to the `hook` of interface `name` (`index`) the chosen way, then
    /// removes what the other way left there (the mode changed across a restart): both
    /// run for that moment, so there is no gap, and the first one's verdict stands for
    /// what it translates.
    fn attach_one(
        &mut self,
        name: &str,
        index: u32,
        program: &'static str,
        hook: TcAttachType,
        prefix: &str,
    ) -> Result<&'static str> {
        let pin = pin_path(&self.links_dir, prefix, name);
        let mut ebpf = lock(&self.ebpf);
        let prog: &mut SchedClassifier = ebpf
            .program_mut(program)
            .kind_with(ErrorKind::Load, || format!("BPF object has no {program}"))?
            .try_into()?;
        match self.hook {
            TcHook::Tcx => {
                let how = attach_tcx(prog, program, hook, name, index, &pin)?;
                drop(ebpf);
                // The tcx link serves already: a filter left over only costs a second
                // look. Only ours, or a gone agent's, goes; a running agent's stays
                // (the audit reports it).
                let leftover = clsact::at_our_place(index, hook).map(|f| {
                    f.filter(|f| f.is_ours(program)).map(|f| {
                        f.id.map_or(Owner::Unknown, |id| self.ownership.owner_of_program(id))
                    })
                });
                let removed = match leftover {
                    Ok(Some(Owner::Ours | Owner::Unseen | Owner::Stale(_))) => {
                        clsact::remove(index, hook, program)
                    }
                    Ok(_) => Ok(false),
                    Err(e) => Err(e),
                };
                match removed {
                    Ok(true) => {
                        tracing::info!(interface = name, program, "clsact filter replaced by tcx")
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(
                        interface = name,
                        error = format!("{e:#}"),
                        "clsact filter left beside the tcx link"
                    ),
                }
                Ok(how)
            }
            TcHook::Clsact => {
                let (how, stale) = clsact::attach(
                    prog,
                    program,
                    hook,
                    index,
                    name,
                    &self.links_dir,
                    &mut self.ownership,
                )?;
                drop(ebpf);
                if let Some(folder) = stale {
                    self.took_stale(name, hook, "clsact", program, &folder, "adopted");
                }
                if pin.exists() {
                    remove_pin(&pin)?;
                    tracing::info!(interface = name, program, "tcx link replaced by clsact");
                }
                Ok(how)
            }
        }
    }

    /// Whether any of `name`'s links is pinned.
    fn pinned(&self, name: &str) -> bool {
        HOOKS
            .iter()
            .any(|(_, _, prefix)| pin_path(&self.links_dir, prefix, name).exists())
    }
}

/// Adopts a pinned tcx link still on this very device (swapping in our program), else
/// attaches a fresh one and pins it.
fn attach_tcx(
    prog: &mut SchedClassifier,
    program: &str,
    hook: TcAttachType,
    name: &str,
    index: u32,
    pin: &Path,
) -> Result<&'static str> {
    if pin.exists() {
        if let Some(fd_link) =
            link_update::pinned_on_device(pin, index, name, link_update::DeviceLink::Tcx)?
        {
            let id = prog
                .attach_to_link(SchedClassifierLink::try_from(fd_link)?)
                .kind_with(ErrorKind::Attach, || {
                    format!("replacing {program} on {name}")
                })?;
            // Pinned already: dropping our fd keeps it attached.
            drop(FdLink::try_from(prog.take_link(id)?)?);
            return Ok("adopted pinned link");
        }
        remove_pin(pin)?;
    }
    let id = prog
        .attach(
            index,
            TcAttach::Tcx {
                attach_type: hook,
                order: Default::default(),
            },
        )
        .kind_with(ErrorKind::Attach, || {
            format!("attaching {program} to {name} (ifindex {index}) (tcx)")
        })?;
    FdLink::try_from(prog.take_link(id)?)?
        .pin(pin)
        .kind_with(ErrorKind::Attach, || format!("pinning {}", pin.display()))?;
    Ok("new link")
}

fn pin_path(links_dir: &Path, prefix: &str, name: &str) -> PathBuf {
    links_dir.join(format!("{prefix}{name}"))
}

/// Unpins every classifier link whose interface `keep` does not want (unpinning the
/// last reference detaches it).
pub fn prune_pins(links_dir: &Path, keep: impl Fn(&str) -> bool) {
    let Ok(entries) = fs::read_dir(links_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        if let Some(name) = HOOK_PREFIXES
            .iter()
            .find_map(|prefix| file.strip_prefix(prefix))
            && !keep(name)
        {
            match remove_pin(&entry.path()) {
                Ok(()) => tracing::info!(
                    interface = name,
                    "classifier link unpinned: interface absent or no longer wanted"
                ),
                Err(e) => tracing::warn!(error = format!("{e:#}"), "stale pin left"),
            }
        }
    }
}

fn remove_pin(pin: &Path) -> Result<()> {
    match fs::remove_file(pin) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(e).kind_with(ErrorKind::Attach, || format!("removing {}", pin.display()))
        }
        _ => Ok(()),
    }
}

fn lock(ebpf: &Mutex<Ebpf>) -> std::sync::MutexGuard<'_, Ebpf> {
    // A panic elsewhere while holding it leaves the object itself intact.
    ebpf.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Unpins the classifier links in `folder`'s `links/` that run program `id` on device
/// `index`, holding the folder's lock meanwhile (its agent is gone: one starting now
/// waits for us).
fn unpin_stale(folder: &Path, id: u32, index: u32) -> Result<usize> {
    let Some(_lock) = pin_lock::try_lock(folder)? else {
        fail!(ErrorKind::Attach, "its agent started meanwhile");
    };
    let links = folder.join("links");
    let mut removed = 0;
    for entry in fs::read_dir(&links)
        .kind_with(ErrorKind::Attach, || format!("reading {}", links.display()))?
    {
        let path = entry?.path();
        let ours_by_name = path
            .file_name()
            .and_then(|f| f.to_str())
            .is_some_and(|f| HOOK_PREFIXES.iter().any(|p| f.starts_with(p)));
        let runs =
            |key, value: u32| link_update::pinned_field(&path, key).ok() == Some(u64::from(value));
        if ours_by_name && runs("prog_id", id) && runs("ifindex", index) {
            remove_pin(&path)?;
            removed += 1;
        }
    }
    if removed == 0 {
        fail!(
            ErrorKind::Attach,
            "no link of program {id} on ifindex {index} is pinned in {}",
            links.display()
        );
    }
    Ok(removed)
}
