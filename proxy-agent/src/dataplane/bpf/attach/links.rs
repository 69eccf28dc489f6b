//! The classifier's links, two per served interface, pinned as `links/tc_ingress@<name>`
//! and `links/tc_egress@<name>` (the egress program translates what the node itself
//! sends about translated flows): attached when a wanted interface appears, unpinned when
//! it goes, so a pin always belongs to the device that now has its name. Without tcx the
//! same two programs are filters on the device's clsact qdisc instead (`clsact`).

use std::{
    collections::BTreeMap,
    ffi::CString,
    fs, io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf,
    programs::{
        SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttach},
    },
};

use super::{
    clsact,
    interfaces::{Decision, InterfaceSelector},
    link_events::{Link, LinkChange},
};
use crate::dataplane::bpf::{TC_EGRESS_PROGRAM, TC_PROGRAM, kernel::TcHook};

/// The programs attached to each served interface: name, hook, pin prefix.
const HOOKS: [(&str, TcAttachType, &str); 2] = [
    (TC_PROGRAM, TcAttachType::Ingress, "tc_ingress@"),
    (TC_EGRESS_PROGRAM, TcAttachType::Egress, "tc_egress@"),
];

/// The programs by hook, as clsact filters carry them.
/// The pin-name prefixes of the classifier's links (`cleanup` knows its own by them).
pub const HOOK_PREFIXES: [&str; 2] = [HOOKS[0].2, HOOKS[1].2];

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
}

impl Classifiers {
    /// Loads the classifier into `ebpf` (once; later attachments reuse it).
    pub fn new(
        ebpf: Arc<Mutex<Ebpf>>,
        links_dir: &Path,
        selector: InterfaceSelector,
        hook: TcHook,
        failures: AttachFailures,
    ) -> Result<Self> {
        {
            let mut ebpf = lock(&ebpf);
            for (name, _, _) in HOOKS {
                let prog: &mut SchedClassifier = ebpf
                    .program_mut(name)
                    .with_context(|| format!("BPF object has no {name}"))?
                    .try_into()?;
                prog.load().with_context(|| format!("loading {name}"))?;
            }
        }
        Ok(Self {
            ebpf,
            links_dir: links_dir.to_path_buf(),
            selector,
            hook,
            attached: BTreeMap::new(),
            skipped: BTreeMap::new(),
            dumping: None,
            failures,
        })
    }

    /// A dump of every link starts: what it does not list is gone when it ends.
    pub fn begin_dump(&mut self) {
        self.dumping = Some(BTreeMap::new());
    }

    pub fn handle(&mut self, change: LinkChange) {
        match change {
            LinkChange::Present(link) => self.present(&link),
            LinkChange::Gone(link) => self.gone(&link),
            LinkChange::DumpDone { interrupted: false } => self.end_dump(),
            // Incomplete: nothing is swept; the next dump starts afresh.
            LinkChange::DumpDone { interrupted: true } => {}
        }
    }

    /// Names of the interfaces served now.
    pub fn attached(&self) -> impl Iterator<Item = &str> {
        self.attached.keys().map(String::as_str)
    }

    fn present(&mut self, link: &Link) {
        if let Some(seen) = &mut self.dumping {
            seen.insert(link.name.clone(), link.index);
        }
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
                self.remove_filters(link.index, &link.name, "interface not wanted");
            }
            Decision::Ignore => {}
            Decision::SkipNotEthernet => {
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
            Decision::Attach => match self.attach(link) {
                Ok(how) => {
                    tracing::info!(
                        interface = link.name,
                        ifindex = link.index,
                        how,
                        "classifier attached"
                    );
                    self.attached.insert(link.name.clone(), link.index);
                }
                Err(e) => {
                    // Retried when the device next changes (or at the next dump).
                    self.failures.count();
                    tracing::warn!(
                        interface = link.name,
                        error = format!("{e:#}"),
                        "classifier not attached"
                    );
                }
            },
        }
    }

    fn gone(&mut self, link: &Link) {
        self.skipped.remove(&link.name);
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
        prune_pins(&self.links_dir, |name| self.attached.contains_key(name));
        clsact::prune_records(&self.links_dir, |index| seen.values().any(|i| *i == index));
    }

    /// Both programs on `link` (ingress first); reports how the ingress one got there.
    fn attach(&mut self, link: &Link) -> Result<&'static str> {
        let mut how = "";
        for (program, hook, prefix) in HOOKS {
            let done = self.attach_one(link, program, hook, prefix)?;
            if how.is_empty() {
                how = done;
            }
        }
        Ok(how)
    }

    /// Attaches `program` to `link`'s `hook` the chosen way, then removes what the other
    /// way left there (the mode changed across a restart): both run for that moment, so
    /// there is no gap, and the first one's verdict stands for what it translates.
    fn attach_one(
        &mut self,
        link: &Link,
        program: &str,
        hook: TcAttachType,
        prefix: &str,
    ) -> Result<&'static str> {
        let pin = pin_path(&self.links_dir, prefix, &link.name);
        let mut ebpf = lock(&self.ebpf);
        let prog: &mut SchedClassifier = ebpf
            .program_mut(program)
            .with_context(|| format!("BPF object has no {program}"))?
            .try_into()?;
        match self.hook {
            TcHook::Tcx => {
                let how = attach_tcx(prog, program, hook, link, &pin)?;
                // The tcx link serves already: a filter left over only costs a second look.
                match clsact::remove(link.index, hook, program) {
                    Ok(true) => tracing::info!(
                        interface = link.name,
                        program,
                        "clsact filter replaced by tcx"
                    ),
                    Ok(false) => {}
                    Err(e) => tracing::warn!(
                        interface = link.name,
                        error = format!("{e:#}"),
                        "clsact filter left beside the tcx link"
                    ),
                }
                Ok(how)
            }
            TcHook::Clsact => {
                let how =
                    clsact::attach(prog, program, hook, link.index, &link.name, &self.links_dir)?;
                if pin.exists() {
                    remove_pin(&pin)?;
                    tracing::info!(
                        interface = link.name,
                        program,
                        "tcx link replaced by clsact"
                    );
                }
                Ok(how)
            }
        }
    }

    fn detach(&mut self, name: &str, why: &str) {
        let index = self.attached.remove(name);
        for (_, _, prefix) in HOOKS {
            match remove_pin(&pin_path(&self.links_dir, prefix, name)) {
                Ok(()) => tracing::info!(interface = name, prefix, why, "classifier link unpinned"),
                Err(e) => {
                    self.failures.count();
                    tracing::warn!(interface = name, error = format!("{e:#}"), "stale pin left");
                }
            }
        }
        // A device still there (renamed, or no longer wanted) keeps no filter of ours; one
        // that is gone took them along.
        if let Some(index) = index
            && self.hook == TcHook::Clsact
        {
            self.remove_filters(index, name, why);
        }
    }

    /// Deletes our clsact filters from `index` (and the qdisc, when we added it and it is
    /// unused now).
    fn remove_filters(&mut self, index: u32, name: &str, why: &str) {
        for (program, hook) in FILTERS {
            match clsact::remove(index, hook, program) {
                Ok(true) => tracing::info!(interface = name, program, why, "clsact filter deleted"),
                Ok(false) => {}
                Err(e) => {
                    self.failures.count();
                    tracing::warn!(interface = name, error = format!("{e:#}"), "filter left");
                }
            }
        }
        if let Err(e) = clsact::release_qdisc(&self.links_dir, index) {
            tracing::warn!(
                interface = name,
                error = format!("{e:#}"),
                "clsact qdisc left"
            );
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
    link: &Link,
    pin: &Path,
) -> Result<&'static str> {
    if pin.exists() {
        match pinned_ifindex(pin) {
            Ok(index) if index == link.index => {
                let fd_link: FdLink = PinnedLink::from_pin(pin)
                    .with_context(|| format!("opening pinned link {}", pin.display()))?
                    .into();
                let id = prog
                    .attach_to_link(SchedClassifierLink::try_from(fd_link)?)
                    .with_context(|| format!("replacing {program} on {}", link.name))?;
                // Pinned already: dropping our fd keeps it attached.
                drop(FdLink::try_from(prog.take_link(id)?)?);
                return Ok("adopted pinned link");
            }
            Ok(index) => tracing::info!(
                interface = link.name,
                pinned_ifindex = index,
                ifindex = link.index,
                "pinned link belongs to an earlier device of this name; replacing it"
            ),
            Err(e) => tracing::warn!(
                interface = link.name,
                error = format!("{e:#}"),
                "pinned link unreadable; replacing it"
            ),
        }
        remove_pin(pin)?;
    }
    let id = prog
        .attach(
            link.index,
            TcAttach::Tcx {
                attach_type: hook,
                order: Default::default(),
            },
        )
        .with_context(|| {
            format!(
                "attaching {program} to {} (ifindex {}) (tcx)",
                link.name, link.index
            )
        })?;
    FdLink::try_from(prog.take_link(id)?)?
        .pin(pin)
        .with_context(|| format!("pinning {}", pin.display()))?;
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
        if let Some(name) = HOOKS
            .iter()
            .find_map(|(_, _, prefix)| file.strip_prefix(prefix))
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
            Err(e).with_context(|| format!("removing {}", pin.display()))
        }
        _ => Ok(()),
    }
}

fn lock(ebpf: &Mutex<Ebpf>) -> std::sync::MutexGuard<'_, Ebpf> {
    // A panic elsewhere while holding it leaves the object itself intact.
    ebpf.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The device a pinned tcx link is attached to, from the kernel's fdinfo for the link
/// (`ifindex:`): 0 once its device is gone, however the name is used now.
fn pinned_ifindex(pin: &Path) -> Result<u32> {
    let fd = bpf_obj_get(pin)?;
    let path = format!("/proc/self/fdinfo/{}", fd.as_raw_fd());
    let info = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    info.lines()
        .find_map(|l| l.strip_prefix("ifindex:"))
        .context("no ifindex in the link's fdinfo (not a tcx link?)")?
        .trim()
        .parse()
        .context("parsing the link's ifindex")
}

/// BPF_OBJ_GET: a file descriptor for a pinned object (aya keeps its own private).
fn bpf_obj_get(pin: &Path) -> Result<OwnedFd> {
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        _pad: u32,
    }
    const BPF_OBJ_GET: libc::c_long = 7;
    let path = CString::new(pin.as_os_str().as_encoded_bytes())?;
    let attr = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        // Links are only handed out read-write (flags 0).
        file_flags: 0,
        path_fd: 0,
        _pad: 0,
    };
    // SAFETY: `attr` is a valid bpf_attr prefix for BPF_OBJ_GET and outlives the call;
    // `path` is NUL-terminated and alive.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &attr as *const ObjGetAttr,
            std::mem::size_of::<ObjGetAttr>(),
        )
    };
    if fd < 0 {
        bail!(
            "BPF_OBJ_GET {}: {}",
            pin.display(),
            io::Error::last_os_error()
        );
    }
    // SAFETY: the kernel just gave us this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
