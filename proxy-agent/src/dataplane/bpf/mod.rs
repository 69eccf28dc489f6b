//! The BPF dataplane: loads the embedded object, pins maps and links under a bpffs folder,
//! attaches the connect-time hooks to a cgroup and the per-packet classifier to
//! interfaces, and writes node views into the maps.
//!
//! Pinned links keep the programs attached when the agent exits or crashes; a new agent
//! swaps its freshly loaded programs into those links atomically (`bpf_link_update`), so
//! traffic never sees a gap. Where the kernel has no tcx, the classifier's clsact filters
//! stay attached the same way and are swapped in place. Each resync checks the links
//! as it re-reads the maps: what was lost is attached again.

pub mod attach;
mod batch;
pub mod codec;
mod ctnetlink;
pub use ctnetlink::refresh_netfilter_flows;
pub mod conntrack_gc;
pub mod kernel;
pub mod maps;
mod members;
pub(crate) mod netlink;
mod options;
mod pin_lock;
pub mod port_filters;
pub mod program_log;
mod sock_filter;
pub mod sock_state;
mod sockets;
pub mod stats;
pub mod writer;

use std::{
    ffi::CString,
    fs,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    programs::{SchedClassifier, links::PinnedLink},
};
use proxy_common::map_names;

pub use self::{
    attach::{
        audit::{ForeignClassifier, HooksReport, NodeHooks},
        cgroup::cgroup2_mount,
        follow::InterfaceFollower,
        interfaces::{self, InterfaceSelector},
        links::{self, AttachFailures},
        xdp::{XdpMode, XdpSetup, XdpStatus},
    },
    kernel::{TcAttachMode, TcHook},
    maps::MapSet,
    options::{
        BpfLogLevel, ConntrackOptions, DEFAULT_PIN_DIR, MapSizes, Options, check_masquerade_ports,
        conntrack_capacities,
    },
    writer::MapState,
};
use super::{ApplyReport, Dataplane};
use crate::model::NodeView;

/// The most endpoints one frontend can have in the maps: each takes at least one of its
/// backend slots (`Dataplane::max_endpoints` of both BPF dataplanes, and `trace`'s view).
pub const MAX_ENDPOINTS: usize = super::layout::MAX_SLOTS;

/// The BPF object built from `proxy-ebpf`, embedded so one binary is all a node needs.
pub static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));

/// The throughput benchmark's packet generator (`proxy-ebpf/src/bench_gen.rs`): never
/// loaded by the agent, embedded so the benchmark needs no second build.
pub static XDP_BENCH_GEN_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdp-bench-gen"));

/// The cgroup sock_addr programs, by name (the name is also the attach point).
pub const CGROUP_PROGRAMS: [&str; 8] = [
    "connect4",
    "connect6",
    "sendmsg4",
    "sendmsg6",
    "recvmsg4",
    "recvmsg6",
    "getpeername4",
    "getpeername6",
];
/// The cgroup sock program that forgets released sockets (`SOCK_LB`), attached beside
/// them.
pub const SOCK_RELEASE_PROGRAM: &str = "sock_release";
/// The per-packet classifier.
pub const TC_PROGRAM: &str = "tc_ingress";
/// Its egress half on the same interfaces: replies and ICMP errors the node itself sends
/// about translated flows (endpoints on the node's own addresses).
pub const TC_EGRESS_PROGRAM: &str = "tc_egress";
/// Its tail call for SCTP checksums.
pub const TC_SCTP_PROGRAM: &str = "tc_sctp_crc";

/// The programs' switch for `bpf_set_retval` (see `kernel`).
const SET_RETVAL_GLOBAL: &str = "SET_RETVAL";

/// bpffs magic number (`statfs.f_type`).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The loaded, attached dataplane.
pub struct BpfDataplane {
    /// Kept for the program logger's ring buffer and for attaching the classifier to
    /// interfaces that appear later (shared with the interface watch); programs live on
    /// through their links.
    pub ebpf: Arc<Mutex<Ebpf>>,
    pub maps: MapSet,
    pub state: MapState,
    /// Where the connect-time hooks are attached (whose sockets may need destroying).
    cgroup: Option<PathBuf>,
    /// Follows interfaces for the classifier, until [`Self::take_interface_follower`].
    interfaces: Option<InterfaceFollower>,
    /// The classifiers the follower keeps (checked at each resync).
    classifiers: Option<Arc<Mutex<links::Classifiers>>>,
    links_dir: PathBuf,
    /// Where repairs of our hooks are counted.
    hooks: NodeHooks,
    /// The flow tables' idle limits and masquerade ports, written with the node settings.
    conntrack: ConntrackOptions,
    /// This agent's hold on the pin folder.
    _lock: pin_lock::PinLock,
}

fn maps_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("maps")
}

fn links_dir(pin_dir: &Path) -> PathBuf {
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
        bail!(
            "statfs {}: {}",
            probe.display(),
            std::io::Error::last_os_error()
        );
    }
    if st.f_type != BPF_FS_MAGIC {
        bail!(
            "{} is not on a BPF filesystem (bpffs): mount one first, e.g. \
             `mount -t bpf bpf /sys/fs/bpf`, or pass --bpffs with a folder on one",
            dir.display()
        );
    }
    Ok(())
}

impl BpfDataplane {
    /// Loads the programs (reusing pinned maps), attaches or re-adopts every link, and
    /// rebuilds the mirror of the maps.
    pub fn start(opts: &Options) -> Result<Self> {
        check_bpffs(&opts.pin_dir)?;
        let kernel = kernel::check(
            opts.cgroup.is_some(),
            (!opts.interfaces.is_empty()).then_some(opts.tc_attach),
        )?;
        let maps_dir = maps_dir(&opts.pin_dir);
        let links_dir = links_dir(&opts.pin_dir);
        fs::create_dir_all(&maps_dir)
            .with_context(|| format!("creating {}", maps_dir.display()))?;
        fs::create_dir_all(&links_dir)
            .with_context(|| format!("creating {}", links_dir.display()))?;
        let lock = pin_lock::lock(&opts.pin_dir)?;

        let mut loader = EbpfLoader::new();
        let pins: Vec<(&str, PathBuf)> = map_names::ALL
            .iter()
            .map(|n| (*n, maps_dir.join(n)))
            .collect();
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        let level = opts.bpf_log_level.code();
        loader.override_global("AYA_LOG_LEVEL", &level, false);
        let set_retval = u8::from(kernel.set_retval);
        loader.override_global(SET_RETVAL_GLOBAL, &set_retval, true);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (name, size) in conntrack_capacities(opts.conntrack.table_entries(cpus)) {
            loader.map_max_entries(name, size);
            warn_if_pinned_size_differs(&maps_dir.join(name), size);
        }
        for (name, size) in opts.map_sizes.capacities() {
            loader.map_max_entries(name, size);
            warn_if_pinned_size_differs(&maps_dir.join(name), size);
        }
        replace_reshaped_counts(&maps_dir);
        let pinned_before: Vec<bool> = pins.iter().map(|(_, p)| p.exists()).collect();
        let mut ebpf = match loader.load(BPF_OBJECT) {
            Ok(ebpf) => ebpf,
            Err(e) => {
                // A pin set this object cannot use (another version's maps) fails midway:
                // the pins this attempt made go again, so nothing half-made is left for
                // the next run to trip on; the older pins stay for their own agent.
                for ((_, path), existed) in pins.iter().zip(pinned_before) {
                    if !existed {
                        let _ = fs::remove_file(path);
                    }
                }
                return Err(anyhow::Error::new(e).context(
                    "loading the BPF object (is this kernel eBPF-capable, are we root? pins of \
                     another version under the pin folder: `proxy-agent cleanup` removes them)",
                ));
            }
        };

        prepare_sctp(&mut ebpf)?;
        // Before the hooks are swapped in: an older release's hooks may still be making
        // entries nothing counts.
        let filter = sock_filter::arm(&mut ebpf).context("arming sock_release's filter")?;
        tracing::debug!(
            generation = filter.generation,
            "sock_release's filter armed"
        );
        let mut maps = MapSet::take(&mut ebpf)?;
        // Before the classifier meets their packets: flows netfilter is translating
        // (kube-proxy's, while migrating) stay with it instead of being dropped as
        // unknown mid-stream segments.
        if let Err(e) = ctnetlink::refresh_netfilter_flows(&mut maps) {
            tracing::warn!(
                error = format!("{e:#}"),
                "the kernel's conntrack table is unreadable: connections kube-proxy translated before this start may break"
            );
        }
        // Port filters new beside older tables (an upgrade): the ports those tables use
        // marked before their packets meet the classifier.
        let made_new = |map: &str| {
            pins.iter()
                .zip(&pinned_before)
                .any(|((name, _), before)| *name == map && !before)
        };
        let fresh = port_filters::Fresh {
            reply_ports: made_new(map_names::REPLY_PORTS),
            frontend_ports: made_new(map_names::FRONTEND_PORTS),
        };
        let (reply, frontend) = port_filters::mark_from_tables(&mut maps, fresh)
            .context("marking the ports the tables already use in the port filters")?;
        if fresh.reply_ports || fresh.frontend_ports {
            tracing::info!(
                ?fresh,
                reply,
                frontend,
                "port filters made; ports in use marked"
            );
        }
        // The connect-time hooks read `FRONTEND_PORTS` too: swapped in only now, after the
        // ports the tables use are marked (an upgrade that makes the filter new would
        // otherwise leave Services unbalanced until the writer marks their ports again).
        if let Some(cgroup) = &opts.cgroup {
            attach::cgroup::attach_cgroup_programs(&mut ebpf, cgroup, &links_dir)?;
        }
        let state = MapState::adopt(&maps)?;
        let ebpf = Arc::new(Mutex::new(ebpf));

        let (interfaces, classifiers) = if let Some(hook) = kernel.tc_hook {
            tracing::info!(mode = %opts.tc_attach, ?hook, "classifier hook chosen");
            let classifiers = Arc::new(Mutex::new(links::Classifiers::new(
                Arc::clone(&ebpf),
                links::Setup {
                    links_dir: links_dir.clone(),
                    selector: opts.interfaces.clone(),
                    hook,
                    failures: opts.attach_failures.clone(),
                    hooks: opts.hooks.clone(),
                    ownership: attach::audit::Ownership::new(&opts.pin_dir),
                    xdp: XdpSetup {
                        mode: opts.xdp,
                        status: opts.xdp_status.clone(),
                    },
                },
            )?));
            let watch = InterfaceFollower::start(Arc::clone(&classifiers))?;
            // What else sits on those hooks, before the agent reports ready.
            attach::follow::lock(&classifiers).check();
            if let Some((interface, why)) = attach::follow::lock(&classifiers).xdp_refused() {
                anyhow::bail!("ebpf.xdp is native, and {interface} cannot run it: {why}");
            }
            tracing::info!(mode = %opts.xdp, running = ?opts.xdp_status.running(), "XDP");
            tracing::info!(interfaces = ?watch.attached(), "classifier attached; following interfaces");
            (Some(watch), Some(classifiers))
        } else {
            // Links and filters of interfaces no longer configured: unpinning detaches.
            links::prune_pins(&links_dir, |_| false);
            if let Err(e) = attach::remove_filters(&links_dir) {
                tracing::warn!(error = format!("{e:#}"), "clsact filters left");
            }
            (None, None)
        };
        tracing::info!(
            pin_dir = %opts.pin_dir.display(),
            adopted_frontends = state.frontends(),
            "BPF dataplane ready"
        );
        Ok(Self {
            ebpf,
            maps,
            state,
            cgroup: opts.cgroup.clone(),
            interfaces,
            classifiers,
            links_dir,
            hooks: opts.hooks.clone(),
            conntrack: opts.conntrack.clone(),
            _lock: lock,
        })
    }

    /// Every hook of ours still attached: the connect-time hooks' pins and links, and the
    /// classifier on every served interface (with what else sits there); what was lost is
    /// attached again, logged and counted.
    fn check_hooks(&mut self) {
        if let Some(cgroup) = &self.cgroup {
            let mut ebpf = self.ebpf.lock().unwrap_or_else(|p| p.into_inner());
            attach::cgroup::repair(&mut ebpf, cgroup, &self.links_dir, &self.hooks);
        }
        if let Some(classifiers) = &self.classifiers {
            attach::follow::lock(classifiers).check();
        }
    }

    /// The watch that attaches the classifier to interfaces as they appear (run it with
    /// [`InterfaceFollower::run`]); `None` without `--interfaces`, or once taken.
    pub fn take_interface_follower(&mut self) -> Option<InterfaceFollower> {
        self.interfaces.take()
    }
}

/// Maps of counts only: the counters (which grow when a release counts something new)
/// and the statistics (keyed per frontend and backend pair since 2026-12-04). An upgraded
/// agent would otherwise refuse an older pin of another shape. Counts are not state
/// traffic depends on, so a pin that is not this object's shape is unpinned (the programs
/// still attached keep theirs until the new ones are swapped in) and a fresh one is made:
/// counts restart. Maps a release no longer has (`BACKEND_STATS`, folded into
/// `LB_STATS`) are unpinned too.
fn replace_reshaped_counts(maps_dir: &Path) {
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
fn warn_if_pinned_size_differs(pin: &Path, wanted: u32) {
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

/// Loads the object with private, unpinned maps and nothing attached: for tests and for
/// tracing packets without touching the live maps. `max_entries` overrides capacities by
/// map name (to exercise full maps).
pub fn load_private(max_entries: &[(&str, u32)]) -> Result<(Ebpf, MapSet)> {
    let mut loader = EbpfLoader::new();
    for (name, size) in max_entries {
        loader.map_max_entries(name, *size);
    }
    let set_retval = u8::from(kernel::has_set_retval());
    loader.override_global(SET_RETVAL_GLOBAL, &set_retval, true);
    let mut ebpf = loader.load(BPF_OBJECT).context("loading the BPF object")?;
    prepare_sctp(&mut ebpf)?;
    let maps = MapSet::take(&mut ebpf)?;
    Ok((ebpf, maps))
}

/// Readies the SCTP checksum tail call before any program can run: the CRC32c shift
/// table, and `tc_sctp_crc` in `TC_TAIL`.
fn prepare_sctp(ebpf: &mut Ebpf) -> Result<()> {
    let map = ebpf
        .map_mut(map_names::SCTP_ZEROS)
        .context("the BPF object has no SCTP_ZEROS map")?;
    let mut table: aya::maps::Array<_, u32> =
        aya::maps::Array::try_from(map).context("SCTP_ZEROS is not an array of u32")?;
    let x8 = proxy_common::crc32c::zeros(1);
    let mut z = proxy_common::crc32c::zeros(0);
    for len in 0..proxy_common::crc32c::TABLE_LEN {
        table
            .set(len, &z, 0)
            .with_context(|| format!("filling SCTP_ZEROS[{len}]"))?;
        z = proxy_common::crc32c::mul(x8, z);
    }
    let prog: &mut SchedClassifier = ebpf
        .program_mut(TC_SCTP_PROGRAM)
        .context("the BPF object has no tc_sctp_crc program")?
        .try_into()?;
    prog.load().context("loading tc_sctp_crc")?;
    let fd = prog.fd()?.try_clone()?;
    let map = ebpf
        .map_mut(map_names::TC_TAIL)
        .context("the BPF object has no TC_TAIL map")?;
    let mut tail = aya::maps::ProgramArray::try_from(map).context("TC_TAIL")?;
    tail.set(proxy_common::TAIL_SCTP_CRC, &fd, 0)
        .context("installing the SCTP checksum tail call")?;
    Ok(())
}

impl Dataplane for BpfDataplane {
    fn max_endpoints(&self) -> usize {
        MAX_ENDPOINTS
    }

    fn apply(&mut self, view: &NodeView) -> Result<ApplyReport> {
        self.apply_some(view, None)
    }

    fn apply_changes(
        &mut self,
        view: &NodeView,
        changed: &std::collections::BTreeSet<crate::model::Frontend>,
    ) -> Result<ApplyReport> {
        self.apply_some(view, Some(changed))
    }

    fn stage(
        &mut self,
        view: &NodeView,
        changed: &std::collections::BTreeSet<crate::model::Frontend>,
    ) -> Result<usize> {
        self.state.stage(&mut self.maps, view, changed)
    }

    fn resync(&mut self) -> Result<()> {
        self.check_hooks();
        Ok(())
    }

    fn audit(&mut self, fraction: f64) -> Result<crate::dataplane::AuditReport> {
        self.state.audit_step(&mut self.maps, fraction)
    }

    fn configure(&mut self, node: &crate::model::NodeSettings) -> Result<()> {
        writer::configure(&mut self.maps, node, &self.conntrack)
    }
}

impl BpfDataplane {
    /// Applies the view (all of it, or the `changed` frontends), then clears what the
    /// endpoints that left need cleared.
    fn apply_some(
        &mut self,
        view: &NodeView,
        changed: Option<&std::collections::BTreeSet<crate::model::Frontend>>,
    ) -> Result<ApplyReport> {
        let mut report = self.state.apply_changes(&mut self.maps, view, changed)?;
        let left = self.state.take_left_udp();
        // The kernel's entries carry no Service: only backends no frontend uses go.
        let gone: Vec<_> = left.iter().filter(|l| l.gone).map(|l| l.backend).collect();
        if !gone.is_empty() {
            match ctnetlink::forget_udp_flows_to(&gone) {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    entries = n,
                    "kernel conntrack: UDP flows of removed backends deleted"
                ),
                Err(e) => tracing::warn!(
                    error = format!("{e:#}"),
                    "kernel conntrack entries of removed backends not deleted"
                ),
            }
        }
        if let Some(cgroup) = &self.cgroup
            && !left.is_empty()
        {
            let cookies = match sock_state::SockState::read(&self.maps) {
                Ok(state) => sockets::cookies_of(&state, &left),
                Err(e) => {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "connect-time socket state not read: no socket destroyed"
                    );
                    Default::default()
                }
            };
            // Failing to reach a socket leaves it as it was; the maps are already right.
            match sockets::destroy(cgroup, &cookies) {
                Ok(n) => report.udp_sockets_destroyed = n,
                Err(e) => tracing::warn!(
                    error = format!("{e:#}"),
                    "connected UDP sockets of removed backends not destroyed"
                ),
            }
        }
        Ok(report)
    }
}

/// The map-writing half of the dataplane, on any set of maps (pinned or private).
pub struct MapsDataplane<'a> {
    pub maps: &'a mut MapSet,
    pub state: &'a mut MapState,
    pub conntrack: ConntrackOptions,
}

impl<'a> MapsDataplane<'a> {
    /// On `maps`, with the default connection-tracking options.
    pub fn new(maps: &'a mut MapSet, state: &'a mut MapState) -> Self {
        Self {
            maps,
            state,
            conntrack: ConntrackOptions::default(),
        }
    }
}

impl Dataplane for MapsDataplane<'_> {
    fn max_endpoints(&self) -> usize {
        MAX_ENDPOINTS
    }

    fn apply(&mut self, view: &NodeView) -> Result<ApplyReport> {
        self.state.apply(self.maps, view)
    }

    fn apply_changes(
        &mut self,
        view: &NodeView,
        changed: &std::collections::BTreeSet<crate::model::Frontend>,
    ) -> Result<ApplyReport> {
        self.state.apply_changes(self.maps, view, Some(changed))
    }

    fn stage(
        &mut self,
        view: &NodeView,
        changed: &std::collections::BTreeSet<crate::model::Frontend>,
    ) -> Result<usize> {
        self.state.stage(self.maps, view, changed)
    }

    fn audit(&mut self, fraction: f64) -> Result<crate::dataplane::AuditReport> {
        self.state.audit_step(self.maps, fraction)
    }

    fn configure(&mut self, node: &crate::model::NodeSettings) -> Result<()> {
        writer::configure(self.maps, node, &self.conntrack)
    }
}

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
        fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        report.removed += 1;
    }
    Ok(())
}
