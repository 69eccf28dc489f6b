//! proxy-dataplane: applies a node view to a dataplane — the `Dataplane` trait, the log
//! dataplane, and the BPF one (load, attach, pin, write maps, collect flows). It names the
//! model below it and the map ABI (`proxy-common`), never the sources, the runner or the
//! agent's config; nothing here imports Kubernetes types.

pub mod bpf;
pub mod layout;
pub mod log;
pub mod netns;

use std::collections::BTreeSet;

use proxy_model::{Frontend, NodeSettings, NodeView};

/// What one apply changed, and what it could not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub frontends_written: usize,
    pub frontends_removed: usize,
    pub backends_written: usize,
    pub backends_removed: usize,
    /// Connected UDP sockets destroyed because their backend went away.
    pub udp_sockets_destroyed: usize,
    /// Frontends left as they were because writing them failed (full map, ...): the
    /// runner retries them, and `/healthz` fails while they wait.
    pub failed: Vec<String>,
    /// Frontends this dataplane can never hold as the view gives them (more backend slots
    /// than a frontend has), each `frontend (service): why`: left as they were and not
    /// retried — one Service never makes the node unhealthy.
    pub refused: Vec<String>,
    /// Frontends programmed otherwise than the view says, each `frontend (service): how`
    /// (`wrr` weights scaled down to fit a frontend's slots).
    pub adjusted: Vec<String>,
    /// How full the service-side maps are after the apply (dataplanes with maps).
    pub fill: Option<MapFill>,
}

/// Entries in the service-side maps, as the agent's mirror of them counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MapFill {
    /// `SERVICES` (one per frontend and scope; `REV_NAT` holds as many).
    pub services: u64,
    /// `BACKEND_SLOTS` of the live generations (`MEMBERS` holds as many).
    pub backend_slots: u64,
    pub backends: u64,
}

/// A dataplane: brings itself to the desired view with as few changes as it can.
pub trait Dataplane {
    /// Brings the dataplane to `view`, comparing every frontend.
    fn apply(&mut self, view: &NodeView) -> anyhow::Result<ApplyReport>;

    /// Brings the dataplane to `view` where only `changed` frontends differ from the view
    /// of the last successful apply: a dataplane that can, touches only those.
    fn apply_changes(
        &mut self,
        view: &NodeView,
        changed: &BTreeSet<Frontend>,
    ) -> anyhow::Result<ApplyReport> {
        let _ = changed;
        self.apply(view)
    }

    /// The first programming ahead of its end, while the first lists still arrive: a
    /// dataplane that can writes what the `changed` frontends of this partial `view` will
    /// need, none of it reachable yet, so the first `apply` has less left to do. Nothing
    /// is served from a partial view. Returns how many frontends it staged.
    fn stage(&mut self, view: &NodeView, changed: &BTreeSet<Frontend>) -> anyhow::Result<usize> {
        let _ = (view, changed);
        Ok(0)
    }

    /// The most endpoints one frontend can have here (the view refuses larger sets).
    fn max_endpoints(&self) -> usize {
        usize::MAX
    }

    /// Tells the dataplane who this node is (addresses, pod network, masquerade).
    fn configure(&mut self, _node: &NodeSettings) -> anyhow::Result<()> {
        Ok(())
    }

    /// The periodic check of what is not a map entry (hooks, links): re-attaches what
    /// went missing.
    fn resync(&mut self) -> anyhow::Result<()> {
        Ok(())
    }

    /// One step of the audit: compares about `fraction` of what is programmed with the
    /// kernel and repairs what differs. Cheap by design: it runs between changes.
    fn audit(&mut self, fraction: f64) -> anyhow::Result<AuditReport> {
        let _ = fraction;
        Ok(AuditReport {
            pass_done: true,
            ..AuditReport::default()
        })
    }
}

/// What one audit step found and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// Frontends whose entries differed from what was programmed, written again.
    pub repaired: usize,
    /// Entries no programmed frontend owns, removed.
    pub removed: usize,
    /// This step ended a pass (everything programmed, and every entry, seen once).
    pub pass_done: bool,
}
