//! Where Services and EndpointSlices come from. A source publishes `Snapshot`s of the
//! cluster model (and this node) on a watch channel: `None` until its first complete
//! view, so nothing is programmed from a partial one. It knows nothing of BPF.

pub mod api_server;
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
}
