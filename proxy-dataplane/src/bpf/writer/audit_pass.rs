//! Where the audit's current pass is: the frontends still to compare and the maps still
//! to walk (`audit` does the comparing).

use proxy_common::ServiceKey;

use crate::bpf::batch::Walk;

/// Where the current pass is.
#[derive(Debug, Default)]
pub struct AuditPass {
    /// The frontends still to check this pass (taken at its start).
    pub(super) frontends: Vec<ServiceKey>,
    /// The maps still to walk this pass, in order, and the current walk.
    pub(super) walks: Vec<Table>,
    pub(super) walk: Walk,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Table {
    Services,
    Slots,
    Maglev,
    Backends,
    RevNat,
}
