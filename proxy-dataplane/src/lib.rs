//! proxy-dataplane: applies a node view to a dataplane — the `Dataplane` trait, the log
//! dataplane, and the BPF one (load, attach, pin, write maps, collect flows). It names the
//! model below it and the map ABI (`proxy-common`), never the sources, the runner or the
//! agent's config; nothing here imports Kubernetes types.

pub mod bpf;
pub mod error;
pub mod layout;
pub mod log;
pub mod netns;
mod report;

pub use error::{Error, ErrorKind};
pub use report::{ApplyReport, AuditReport, FrontendIssue, Issue, MapFill};

use std::collections::BTreeSet;

use proxy_model::{Frontend, NodeSettings, NodeView};

/// A dataplane: brings itself to the desired view with as few changes as it can.
pub trait Dataplane {
    /// Brings the dataplane to `view`, comparing every frontend.
    fn apply(&mut self, view: &NodeView) -> error::Result<ApplyReport>;

    /// Brings the dataplane to `view` where only `changed` frontends differ from the view
    /// of the last successful apply: a dataplane that can, touches only those.
    fn apply_changes(
        &mut self,
        view: &NodeView,
        changed: &BTreeSet<Frontend>,
    ) -> error::Result<ApplyReport> {
        let _ = changed;
        self.apply(view)
    }

    /// The first programming ahead of its end, while the first lists still arrive: a
    /// dataplane that can writes what the `changed` frontends of this partial `view` will
    /// need, none of it reachable yet, so the first `apply` has less left to do. Nothing
    /// is served from a partial view. Returns how many frontends it staged.
    fn stage(&mut self, view: &NodeView, changed: &BTreeSet<Frontend>) -> error::Result<usize> {
        let _ = (view, changed);
        Ok(0)
    }

    /// The most endpoints one frontend can have here (the view refuses larger sets).
    fn max_endpoints(&self) -> usize {
        usize::MAX
    }

    /// Tells the dataplane who this node is (addresses, pod network, masquerade).
    fn configure(&mut self, _node: &NodeSettings) -> error::Result<()> {
        Ok(())
    }

    /// The periodic check of what is not a map entry (hooks, links): re-attaches what
    /// went missing.
    fn resync(&mut self) -> error::Result<()> {
        Ok(())
    }

    /// One step of the audit: compares about `fraction` of what is programmed with the
    /// kernel and repairs what differs. Cheap by design: it runs between changes.
    fn audit(&mut self, fraction: f64) -> error::Result<AuditReport> {
        let _ = fraction;
        Ok(AuditReport {
            pass_done: true,
            ..AuditReport::default()
        })
    }
}
