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
mod cleanup;
pub mod codec;
mod ctnetlink;
pub use ctnetlink::refresh_netfilter_flows;
pub mod conntrack_gc;
pub mod kernel;
mod load;
pub mod maps;
mod members;
pub mod netlink;
mod options;
mod pin_lock;
mod pins;
pub mod port_backfill;
pub mod port_filters;
pub mod program_log;
mod programs;
mod sock_filter;
pub mod sock_state;
mod sockets;
pub mod stats;
pub mod writer;

use std::{
    fs,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use crate::error::{Context as _, ErrorKind, Kind as _, Result, fail};
use aya::Ebpf;
use proxy_common::map_names;

pub use self::{
    attach::{
        cgroup::cgroup2_mount,
        follow::InterfaceFollower,
        interfaces::{self, InterfaceSelector},
        links::{self, AttachFailures},
        ownership::{ForeignClassifier, HooksReport, NodeHooks},
        xdp::{XdpMode, XdpSetup, XdpStatus},
    },
    kernel::{Kernel, TcAttachMode, TcHook},
    maps::MapSet,
    options::{
        BpfLogLevel, ConntrackOptions, DEFAULT_PIN_DIR, MapSizes, Options, check_masquerade_ports,
        conntrack_capacities,
    },
    writer::Mirror,
};
pub use self::{
    cleanup::{CleanupReport, cleanup},
    pins::check_bpffs,
    programs::{
        BPF_OBJECT, CGROUP_PROGRAMS, SOCK_RELEASE_PROGRAM, TC_EGRESS_PROGRAM, TC_PROGRAM,
        TC_SCTP_PROGRAM, load_private, load_private_on,
    },
};
use self::{
    pins::{links_dir, maps_dir},
    programs::prepare_sctp,
};
use super::{ApplyReport, Dataplane};
use proxy_model::NodeView;

/// The most endpoints one frontend can have in the maps: each takes at least one of its
/// backend slots (`Dataplane::max_endpoints` of both BPF dataplanes, and `trace`'s view).
pub const MAX_ENDPOINTS: usize = super::layout::MAX_SLOTS;

/// The maps taken from the loaded object, once each is ready for the programs: SCTP's
/// tail call, sock_release's filter armed, netfilter's flows noted and the port filters
/// made new (`made_new`) marked with the ports the tables already use.
fn take_maps(ebpf: &mut Ebpf, made_new: &[&str]) -> Result<MapSet> {
    prepare_sctp(ebpf)?;
    // Before the hooks are swapped in: an older release's hooks may still be making
    // entries nothing counts.
    let filter = sock_filter::arm(ebpf).context("arming sock_release's filter")?;
    tracing::debug!(
        generation = filter.generation,
        "sock_release's filter armed"
    );
    let mut maps = MapSet::take(ebpf)?;
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
    let made_new = |map: &str| made_new.contains(&map);
    let fresh = port_backfill::Fresh {
        reply_ports: made_new(map_names::REPLY_PORTS),
        frontend_ports: made_new(map_names::FRONTEND_PORTS),
    };
    let (reply, frontend) = port_backfill::mark_from_tables(&mut maps, fresh).kind(
        ErrorKind::Load,
        "marking the ports the tables already use in the port filters",
    )?;
    if fresh.reply_ports || fresh.frontend_ports {
        tracing::info!(
            ?fresh,
            reply,
            frontend,
            "port filters made; ports in use marked"
        );
    }
    Ok(maps)
}

/// The interface follower and the classifiers it keeps.
type Following = (
    Option<InterfaceFollower>,
    Option<Arc<Mutex<links::Classifiers>>>,
);

/// The classifiers on the selected interfaces, and the follower that attaches them to
/// interfaces that appear later (none without a TC hook: then our filters and links of
/// interfaces no longer configured go).
fn follow_interfaces(
    opts: &Options,
    kernel: &kernel::Kernel,
    ebpf: &Arc<Mutex<Ebpf>>,
    links_dir: &Path,
) -> Result<Following> {
    Ok(if let Some(hook) = kernel.tc_hook {
        tracing::info!(mode = %opts.tc_attach, ?hook, "classifier hook chosen");
        let classifiers = Arc::new(Mutex::new(links::Classifiers::new(
            Arc::clone(ebpf),
            links::Setup {
                links_dir: links_dir.to_path_buf(),
                selector: opts.interfaces.clone(),
                hook,
                failures: opts.attach_failures.clone(),
                hooks: opts.hooks.clone(),
                ownership: attach::ownership::Ownership::new(&opts.pin_dir),
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
            fail!(
                ErrorKind::Setting,
                "ebpf.xdp is native, and {interface} cannot run it: {why}"
            );
        }
        tracing::info!(mode = %opts.xdp, running = ?opts.xdp_status.running(), "XDP");
        tracing::info!(interfaces = ?watch.attached(), "classifier attached; following interfaces");
        (Some(watch), Some(classifiers))
    } else {
        // Links and filters of interfaces no longer configured: unpinning detaches.
        links::prune_pins(links_dir, |_| false);
        if let Err(e) = attach::remove_filters(links_dir) {
            tracing::warn!(error = format!("{e:#}"), "clsact filters left");
        }
        (None, None)
    })
}

/// The loaded, attached dataplane.
pub struct BpfDataplane {
    /// Kept for the program logger's ring buffer and for attaching the classifier to
    /// interfaces that appear later (shared with the interface watch); programs live on
    /// through their links.
    pub ebpf: Arc<Mutex<Ebpf>>,
    pub maps: MapSet,
    pub mirror: Mirror,
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
            .kind_with(ErrorKind::Io, || format!("creating {}", maps_dir.display()))?;
        fs::create_dir_all(&links_dir).kind_with(ErrorKind::Io, || {
            format!("creating {}", links_dir.display())
        })?;
        let lock = pin_lock::lock(&opts.pin_dir)?;

        let loaded = load::load(opts, &kernel, &maps_dir)?;
        let mut ebpf = loaded.ebpf;
        let maps = take_maps(&mut ebpf, &loaded.made_new)?;
        // The connect-time hooks read `FRONTEND_PORTS` too: swapped in only now, after the
        // ports the tables use are marked (an upgrade that makes the filter new would
        // otherwise leave Services unbalanced until the writer marks their ports again).
        if let Some(cgroup) = &opts.cgroup {
            attach::cgroup::attach_cgroup_programs(&mut ebpf, cgroup, &links_dir)?;
        }
        let mirror = Mirror::adopt(&maps)?;
        let ebpf = Arc::new(Mutex::new(ebpf));

        let (interfaces, classifiers) = follow_interfaces(opts, &kernel, &ebpf, &links_dir)?;
        tracing::info!(
            pin_dir = %opts.pin_dir.display(),
            adopted_frontends = mirror.frontends(),
            "BPF dataplane ready"
        );
        Ok(Self {
            ebpf,
            maps,
            mirror,
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
        changed: &std::collections::BTreeSet<proxy_model::Frontend>,
    ) -> Result<ApplyReport> {
        self.apply_some(view, Some(changed))
    }

    fn stage(
        &mut self,
        view: &NodeView,
        changed: &std::collections::BTreeSet<proxy_model::Frontend>,
    ) -> Result<usize> {
        self.mirror.stage(&mut self.maps, view, changed)
    }

    fn resync(&mut self) -> Result<()> {
        self.check_hooks();
        Ok(())
    }

    fn audit(&mut self, fraction: f64) -> Result<crate::AuditReport> {
        self.mirror.audit_step(&mut self.maps, fraction)
    }

    fn configure(&mut self, node: &proxy_model::NodeSettings) -> Result<()> {
        writer::configure(&mut self.maps, node, &self.conntrack)
    }
}

impl BpfDataplane {
    /// Applies the view (all of it, or the `changed` frontends), then clears what the
    /// endpoints that left need cleared.
    fn apply_some(
        &mut self,
        view: &NodeView,
        changed: Option<&std::collections::BTreeSet<proxy_model::Frontend>>,
    ) -> Result<ApplyReport> {
        let mut report = self.mirror.apply_changes(&mut self.maps, view, changed)?;
        let left = self.mirror.take_left_udp();
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
    pub mirror: &'a mut Mirror,
    pub conntrack: ConntrackOptions,
}

impl<'a> MapsDataplane<'a> {
    /// On `maps`, with the default connection-tracking options.
    pub fn new(maps: &'a mut MapSet, mirror: &'a mut Mirror) -> Self {
        Self {
            maps,
            mirror,
            conntrack: ConntrackOptions::default(),
        }
    }
}

impl Dataplane for MapsDataplane<'_> {
    fn max_endpoints(&self) -> usize {
        MAX_ENDPOINTS
    }

    fn apply(&mut self, view: &NodeView) -> Result<ApplyReport> {
        self.mirror.apply(self.maps, view)
    }

    fn apply_changes(
        &mut self,
        view: &NodeView,
        changed: &std::collections::BTreeSet<proxy_model::Frontend>,
    ) -> Result<ApplyReport> {
        self.mirror.apply_changes(self.maps, view, Some(changed))
    }

    fn stage(
        &mut self,
        view: &NodeView,
        changed: &std::collections::BTreeSet<proxy_model::Frontend>,
    ) -> Result<usize> {
        self.mirror.stage(self.maps, view, changed)
    }

    fn audit(&mut self, fraction: f64) -> Result<crate::AuditReport> {
        self.mirror.audit_step(self.maps, fraction)
    }

    fn configure(&mut self, node: &proxy_model::NodeSettings) -> Result<()> {
        writer::configure(self.maps, node, &self.conntrack)
    }
}
