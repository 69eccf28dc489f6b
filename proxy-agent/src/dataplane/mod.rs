//! Applies a node view to a dataplane. Nothing here imports Kubernetes types.

pub mod bpf;
pub mod layout;
pub mod log;

use std::collections::BTreeSet;

use crate::model::{Frontend, NodeSettings, NodeView};

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

    /// The most endpoints one frontend can have here (the view refuses larger sets).
    fn max_endpoints(&self) -> usize {
        usize::MAX
    }

    /// Tells the dataplane who this node is (addresses, pod network, masquerade).
    fn configure(&mut self, _node: &NodeSettings) -> anyhow::Result<()> {
        Ok(())
    }

    /// Forgets what it believes it programmed and re-reads the real state, so the next
    /// apply repairs any drift.
    fn resync(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
}
