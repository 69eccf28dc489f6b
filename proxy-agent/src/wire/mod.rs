//! The node-view feed's wire format (`proto/proxy/nodeview/v1/nodeview.proto`): the
//! generated messages and service, the compact model spelled as messages and read back
//! (`convert`), and a node's state as the ops build it (`NodeState`). Shared by the
//! server (`fanout`) and the agent's feed source (`feed`).

pub mod convert;
mod state;

pub use state::{NodeState, OpError};

/// The generated code of `proxy.nodeview.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("proxy.nodeview.v1");
}
