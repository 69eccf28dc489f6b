//! How a Service's traffic from outside the node reaches a backend on another node
//! (`ebpf.loadBalancer.mode`, overridden per Service by `LB_MODE_ANNOTATION`), with
//! Cilium's names: `snat` (masquerade, as kube-proxy), `dsr` (direct server return: the
//! client's address is kept and the backend's node answers as the frontend), `hybrid`
//! (DSR for TCP, SNAT for UDP and SCTP, whose replies may come from other sources).

use std::{fmt, str::FromStr};

use serde::Serialize;

use super::frontend::Protocol;

/// The per-Service override of the node's mode.
pub const LB_MODE_ANNOTATION: &str = "ebpf.proxy.k8s.io/lb-mode";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LbMode {
    #[default]
    Snat,
    Dsr,
    Hybrid,
}

impl LbMode {
    pub const ALL: [LbMode; 3] = [LbMode::Snat, LbMode::Dsr, LbMode::Hybrid];

    /// Whether an external frontend of `protocol` returns directly.
    pub fn direct_return(self, protocol: Protocol) -> bool {
        match self {
            LbMode::Snat => false,
            LbMode::Dsr => true,
            LbMode::Hybrid => protocol == Protocol::Tcp,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            LbMode::Snat => "snat",
            LbMode::Dsr => "dsr",
            LbMode::Hybrid => "hybrid",
        }
    }
}

impl fmt::Display for LbMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LbMode {
    type Err = crate::error::SettingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| crate::error::SettingError::UnknownLbMode(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_and_says_which_protocols_return_directly() {
        assert_eq!(" dsr ".parse::<LbMode>(), Ok(LbMode::Dsr));
        assert!("DSR-ish".parse::<LbMode>().is_err());
        assert!(LbMode::Dsr.direct_return(Protocol::Udp));
        assert!(LbMode::Hybrid.direct_return(Protocol::Tcp));
        assert!(!LbMode::Hybrid.direct_return(Protocol::Udp));
        assert!(!LbMode::Snat.direct_return(Protocol::Tcp));
    }
}
