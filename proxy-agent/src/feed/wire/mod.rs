//! The node-view feed's wire format (`proto/proxy/nodeview/v1/nodeview.proto`): the
//! generated messages and service (`v1`), the compact model spelled as messages and read
//! back (`convert`), a node's state as the ops build it (`NodeState`). Shared by the
//! server (`feed::server`) and the agent's feed source (`source::feed`).

pub mod convert;
mod parts;
mod state;
/// The generated code of `proxy.nodeview.v1`.
#[allow(
    clippy::all,
    missing_docs,
    reason = "code generated from the .proto by build.rs"
)]
pub mod v1;

/// How often an idle stream says it is alive (and at which revision): the agent counts
/// its data as current while these arrive.
pub const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(5);

pub use state::{NodeState, OpError};

/// The metadata key of the status a replica without a synced view answers with
/// (`no_view_status`): `proxy-view: none`.
pub const NO_VIEW_KEY: &str = "proxy-view";

/// What a replica with no synced view of the API server (never synced, or its watch lost
/// past its bound) answers a `Watch` with, or ends an open stream with: UNAVAILABLE, which
/// every agent (this version's and older ones) takes as "try the next replica", marked
/// `proxy-view: none` so that it reads as "no data here", not "down".
pub fn no_view_status(why: &str) -> tonic::Status {
    let mut meta = tonic::metadata::MetadataMap::new();
    meta.insert(
        NO_VIEW_KEY,
        tonic::metadata::MetadataValue::from_static("none"),
    );
    tonic::Status::with_metadata(
        tonic::Code::Unavailable,
        format!("this replica has no synced view: {why}"),
        meta,
    )
}

/// Whether `status` is a replica's `no_view_status`.
pub fn is_no_view(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable
        && status
            .metadata()
            .get(NO_VIEW_KEY)
            .is_some_and(|v| v.as_bytes() == b"none")
}

pub use parts::Parts;
