//! Why the model refuses what it reads, typed: callers branch on the kind and a metric can
//! label it; the text (`Display`) is for people. Each is what the API server would refuse
//! too, or a setting the model does not know.

use std::fmt;

use thiserror::Error;

/// An address or CIDR that does not parse, even as kube-proxy's sloppy parser reads one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum AddrError {
    #[error("not an IP address")]
    NotAnAddress,
    #[error("not a CIDR (ADDRESS/LENGTH)")]
    NoPrefixLength,
    #[error("not a CIDR")]
    NotACidr,
    #[error("invalid prefix length")]
    InvalidPrefixLength,
    /// A number, but no prefix length of the family (ipnet's `PrefixLenError`).
    #[error("invalid IP prefix length")]
    PrefixLengthOutOfRange,
}

/// Why one Service port cannot be programmed (the Service's other ports still are).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PortError {
    #[error("port {0} out of range 1-65535")]
    OutOfRange(i32),
    #[error("port {port}: unsupported protocol {protocol:?}")]
    UnsupportedProtocol { port: u16, protocol: String },
    /// As the node-view feed's server judged it (the wire carries the reason's text).
    #[error("{0}")]
    Reported(String),
}

/// As its text: the debug views show why, the feed carries the text.
impl serde::Serialize for PortError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Why the API server refuses an address as an endpoint (Kubernetes' `ValidateEndpointIP`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum SpecialIp {
    #[error("may not be unspecified")]
    Unspecified,
    #[error("may not be in the loopback range (127.0.0.0/8, ::1/128)")]
    Loopback,
    #[error("may not be in the link-local range (169.254.0.0/16, fe80::/10)")]
    LinkLocal,
    #[error("may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)")]
    LinkLocalMulticast,
}

/// A setting the model reads (an annotation, a config field) that it does not know.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SettingError {
    #[error(
        "unknown scheduler {0:?} (one of random, rr, wrr, lc, wlc, lblc, lblcr, sh, dh, sed, \
         nq, mh)"
    )]
    UnknownScheduler(String),
    #[error("unknown load-balancer mode {0:?} (one of snat, dsr, hybrid)")]
    UnknownLbMode(String),
    #[error(
        "maglevTableSize {len}: must be one of {allowed:?} (primes, as Maglev's permutation \
         needs)"
    )]
    MaglevTableLen { len: u32, allowed: &'static [u32] },
}

/// The kind of object a rejection is about (a metric label and a log field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    Service,
    EndpointSlice,
    Node,
}

impl ObjectKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Service => "Service",
            Self::EndpointSlice => "EndpointSlice",
            Self::Node => "Node",
        }
    }
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
