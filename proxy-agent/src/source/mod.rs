//! Where Services and EndpointSlices come from. A source publishes `Snapshot`s of the
//! cluster model (and this node) on a watch channel: `None` until its first complete
//! view, so nothing is programmed from a partial one. It knows nothing of BPF.

pub mod files;
pub mod kube;

use crate::model::{ClusterModel, NodeInfo};

/// The cluster model and this node, as of one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub model: ClusterModel,
    pub node: NodeInfo,
}
