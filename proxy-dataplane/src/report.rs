//! What an apply and an audit step did, and what they could not: typed, so the runner
//! branches on the kind and counts it; the text (`Display`) is for the log.

use std::fmt;

use proxy_model::Frontend;

/// What one apply changed, and what it could not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub frontends_written: usize,
    pub frontends_removed: usize,
    pub backends_written: usize,
    pub backends_removed: usize,
    /// Connected UDP sockets destroyed because their backend went away.
    pub udp_sockets_destroyed: usize,
    /// Frontends left as they were because writing them failed (full map, ...): the
    /// runner retries them, and `/healthz` fails while they wait.
    pub failed: Vec<FrontendIssue>,
    /// Frontends this dataplane can never hold as the view gives them (more backend slots
    /// than a frontend has): left as they were and not retried — one Service never makes
    /// the node unhealthy.
    pub refused: Vec<FrontendIssue>,
    /// Frontends programmed otherwise than the view says (`wrr` weights scaled down to
    /// fit a frontend's slots).
    pub adjusted: Vec<FrontendIssue>,
    /// How full the service-side maps are after the apply (dataplanes with maps).
    pub fill: Option<MapFill>,
}

/// Entries in the service-side maps, as the agent's mirror of them counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MapFill {
    /// `SERVICES` (one per frontend and scope; `REV_NAT` holds as many).
    pub services: u64,
    /// `BACKEND_SLOTS` of the live generations (`MEMBERS` holds as many).
    pub backend_slots: u64,
    pub backends: u64,
}

/// A frontend an apply left otherwise than the view gives it, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendIssue {
    pub frontend: Frontend,
    /// Its Service (`namespace/name`).
    pub service: String,
    pub issue: Issue,
}

/// What happened to a frontend an apply could not program as the view gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Issue {
    /// More backend slots than a frontend has: refused, not retried.
    TooManySlots { slots: usize, max: usize },
    /// `wrr` weights scaled down to fit a frontend's slots: programmed, adjusted.
    WeightsScaled {
        wanted: usize,
        written: usize,
        max: usize,
    },
    /// Writing failed (a full map, a refused write); its previous entries stay and the
    /// runner retries. The error chain, as the kernel and the writer told it.
    WriteFailed(String),
}

impl fmt::Display for Issue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooManySlots { slots, max } => {
                write!(f, "{slots} backend slots exceed the {max} per frontend")
            }
            Self::WeightsScaled {
                wanted,
                written,
                max,
            } => write!(
                f,
                "wrr weights scaled down to fit the {max} backend slots of a frontend \
                 ({wanted} slots wanted, {written} written)"
            ),
            Self::WriteFailed(chain) => f.write_str(chain),
        }
    }
}

impl fmt::Display for FrontendIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.frontend, self.service, self.issue)
    }
}

/// What one audit step found and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// Frontends whose entries differed from what was programmed, written again.
    pub repaired: usize,
    /// Entries no programmed frontend owns, removed.
    pub removed: usize,
    /// This step ended a pass (everything programmed, and every entry, seen once).
    pub pass_done: bool,
}
