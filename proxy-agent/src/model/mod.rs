//! The cluster-wide model (Services and EndpointSlices as the source reports them) and the
//! pure function that turns it into this node's view: one entry per frontend
//! (VIP, port, protocol) with the backends it leads to. Plain data in, plain data out.

mod view;

pub use view::{Rejection, node_view};

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, SocketAddr},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

/// `namespace/name` of a Kubernetes object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectRef {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ObjectRef {
    /// The reference of an object's metadata; objects without a name get "<unnamed>".
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        Self {
            namespace: meta.namespace.clone().unwrap_or_else(|| "default".into()),
            name: meta.name.clone().unwrap_or_else(|| "<unnamed>".into()),
        }
    }
}

/// Every Service and EndpointSlice the source knows, keyed by reference.
#[derive(Clone, Debug, Default)]
pub struct ClusterModel {
    pub services: BTreeMap<ObjectRef, Service>,
    pub slices: BTreeMap<ObjectRef, EndpointSlice>,
}

/// Transport protocol of a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

/// Where traffic for a Service port arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            SocketAddr::new(self.ip, self.port),
            self.protocol
        )
    }
}

/// What this node does with traffic to one frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendState {
    /// `namespace/name:port` of the Service port, for logs and dumps.
    pub service: String,
    /// Endpoints that take new connections; empty means "reject".
    pub backends: BTreeSet<SocketAddr>,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout_s: Option<u32>,
}

/// This node's desired dataplane state.
pub type NodeView = BTreeMap<Frontend, FrontendState>;
