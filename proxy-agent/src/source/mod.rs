//! Where Services and EndpointSlices come from. A source publishes `Snapshot`s of the
//! cluster model (and this node) on a watch channel: `None` until its first complete
//! view, so nothing is programmed from a partial one — except, where asked, snapshots
//! marked `partial` while the first lists arrive, which a dataplane may only stage
//! (`Dataplane::stage`), never serve. It knows nothing of BPF.

pub mod api_server;
pub mod decoded;
pub mod events;
pub mod feed;
pub mod files;
pub mod kube;

use crate::model::{ClusterModel, NodeInfo};

/// What sources publish: shared, so the runner and the debug endpoint hold the same
/// model rather than copies of it.
pub type SharedSnapshot = std::sync::Arc<Snapshot>;

/// The cluster model and this node, as of one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub model: ClusterModel,
    pub node: NodeInfo,
    /// Changes the source has seen up to this snapshot.
    pub changes: ChangeCounts,
    /// Documents or objects the source could not read into the model (malformed YAML, an
    /// object that does not fit its kind): counted with the view's rejections.
    pub unreadable: u64,
    /// The API server validated these objects (the API-server source): the view programs
    /// what it stored without repeating its checks (`ViewConfig::api_validated`).
    pub api_validated: bool,
    /// Every Node of the cluster, by name: the API server's (its own included), the
    /// manifests' `kind: Node`, or the feed's peers (name and addresses only; none from
    /// a feed server older than them).
    pub nodes: imbl::OrdMap<String, NodeInfo>,
    /// What the first lists brought so far, before they are complete: for staging a
    /// first programming only (`KubeOptions::stream_first_list`).
    pub partial: bool,
}

/// Object changes a source has seen since it started, counted as kube-proxy counts them
/// (`sync_proxy_rules_service_changes_total`, `..._endpoint_changes_total`): one per
/// Service or EndpointSlice added, modified or deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ChangeCounts {
    pub services: u64,
    pub endpoint_slices: u64,
}

impl ChangeCounts {
    /// Adds the objects that differ between two versions of the model.
    pub fn add(&mut self, changes: &crate::model::ModelChanges) {
        self.services += changes.service_objects;
        self.endpoint_slices += changes.slices;
    }
}

/// This node's name as kube-proxy finds it: the override (`--node-name`, `NODE_NAME` from
/// the downward API, `hostnameOverride`) or else the host name — trimmed and lowercased,
/// as Node names are.
pub fn node_name(name_override: Option<&str>) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let name = match name_override.map(str::trim).filter(|n| !n.is_empty()) {
        Some(n) => n.to_string(),
        None => nix::unistd::gethostname()
            .context("reading the host name (or pass --node-name / NODE_NAME)")?
            .to_string_lossy()
            .trim()
            .to_string(),
    };
    anyhow::ensure!(
        !name.is_empty(),
        "empty node name: pass --node-name or NODE_NAME"
    );
    Ok(name.to_lowercase())
}

#[cfg(test)]
mod tests {
    #[test]
    fn node_names_are_lowercased_and_trimmed() {
        assert_eq!(
            super::node_name(Some(" Node-A.Example ")).expect("name"),
            "node-a.example"
        );
        let host = super::node_name(None).expect("the host name");
        assert_eq!(host, host.to_lowercase());
        assert_eq!(super::node_name(Some("")).expect("falls back"), host);
    }
}
