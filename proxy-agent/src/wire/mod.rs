//! The node-view feed's wire format (`proto/proxy/nodeview/v1/nodeview.proto`): the
//! generated messages and service, the compact model spelled as messages and read back
//! (`convert`), a node's state as the ops build it (`NodeState`), and the mutual TLS
//! both ends use (`tls`). Shared by the
//! server (`fanout`) and the agent's feed source (`feed`).

pub mod convert;
mod state;
pub mod tls;

/// How often an idle stream says it is alive (and at which revision): the agent counts
/// its data as current while these arrive.
pub const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(5);

pub use state::{NodeState, OpError};

/// The generated code of `proxy.nodeview.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("proxy.nodeview.v1");
    // The server of `NodeFeed` (build.rs): it streams `EncodedBatch`.
    include!(concat!(env!("OUT_DIR"), "/proxy.nodeview.v1.NodeFeed.rs"));
}

mod parts;
pub use parts::Parts;
