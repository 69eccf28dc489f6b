//! Why a Service is refused as a whole, typed (the text is for people). Apart from
//! `error`, which the schedule's settings use: this one names a protocol.

use serde::Serialize;

use crate::{error::AddrError, frontend::Protocol};

/// Why a Service is refused as a whole.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    #[error("no spec")]
    NoSpec,
    #[error("port {port}/{protocol} given twice")]
    PortTwice { port: u16, protocol: Protocol },
    #[error("invalid clusterIP {ip:?}: {reason}")]
    InvalidClusterIp { ip: String, reason: AddrError },
    #[error(
        "clusterIP {0:?}: not a unicast address a Service can have (loopback, unspecified, \
         broadcast, multicast and link-local are not)"
    )]
    NotUnicast(String),
    #[error("clusterIPs: {0} twice")]
    ClusterIpTwice(String),
    #[error("clusterIPs: two addresses of one family")]
    TwoOfOneFamily,
    /// As the node-view feed's server judged it (the wire carries the reason's text).
    #[error("{0}")]
    Reported(String),
}

/// As its text: the debug views show why, the feed carries the text.
impl Serialize for ServiceError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}
