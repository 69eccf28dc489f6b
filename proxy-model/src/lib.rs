//! The cluster-wide model (Services and EndpointSlices as the source reports them) and the
//! pure function that turns it, plus this node's identity and settings, into this node's
//! view: one entry per frontend (VIP, port, protocol) with the backends each kind of
//! traffic leads to. Plain data in, plain data out.

mod cluster;
pub mod compact;
mod endpoint;
mod endpoint_set;
mod endpoints;
pub mod error;
mod frontend;
pub mod frontend_builder;
pub mod lb_mode;
mod narrow;
mod node;
pub mod objects;
pub mod schedule;
pub mod service_error;
mod slice_endpoints;
pub mod sloppy;
mod tracker;
mod view;

pub use endpoint_set::EndpointSet;
pub use objects::{ServiceInfo, SliceInfo};

pub use cluster::*;
pub use frontend::*;
pub use node::*;
pub use tracker::{ViewChanges, ViewTracker, node_view};
pub use view::{HealthCheck, Rejection, health_check_addresses};
