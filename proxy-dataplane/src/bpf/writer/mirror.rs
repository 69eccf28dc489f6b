//! The agent's mirror of the maps: what each frontend looks like in them, the backends by
//! id, the ids in use. The writer's modules keep it (`generation`, `ids`, `adopt`,
//! `audit`); the mirror itself knows none of them.

use std::collections::HashSet;

use proxy_common::{Backend, ServiceKey, ServiceValue};
use proxy_model::{EndpointSet, schedule::Schedule};
use rustc_hash::FxHashMap;

use super::{audit_pass::AuditPass, backend_table, dsr_permits};
use crate::bpf::members;

/// A UDP endpoint that left one frontend (kube-proxy clears such flows per Service port:
/// the same pod may still serve another Service).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeftUdp {
    /// The frontend it left.
    pub key: ServiceKey,
    pub rev_nat_id: u32,
    pub backend_id: u32,
    pub backend: Backend,
    /// No frontend uses the backend any more.
    pub gone: bool,
}

/// What one frontend looks like in the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Programmed {
    pub(super) value: ServiceValue,
    pub(super) backend_ids: Box<[u32]>,
    /// The endpoints `backend_ids` stand for, in slot order: a sync compares these (one
    /// run of memory) instead of looking up every endpoint's id (a cache miss each, which
    /// made a one-change sync at 10k Services cost milliseconds). The view's own copy,
    /// shared: usually `==` finds the one pointer and compares nothing else.
    pub(super) endpoints: EndpointSet,
    /// `backend_ids` are exactly what `endpoints` and `schedule` make (false for an
    /// adopted set whose slots did not all resolve).
    pub(super) complete: bool,
    /// The schedule `backend_ids` were laid out for (adopted: the scheduler only).
    pub(super) schedule: Schedule,
    /// What few frontends have (a Maglev table, weights, source ranges), apart: 8 bytes
    /// here instead of three vectors' 72 in every frontend's entry.
    pub(super) extras: Option<Box<Extras>>,
    /// The last sync whose view held this frontend (`Mirror::epoch`).
    pub(super) seen: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Extras {
    /// `sh`/`mh`: the Maglev table (indexes into `backend_ids`) in `MAGLEV`.
    pub(super) table: Box<[u16]>,
    /// (backend id, weight) in `WEIGHTS`, by id, for `SVC_F_WEIGHTED` entries: what the
    /// maps hold, so an adopted entry compares as a written one does.
    pub(super) weights: Box<[(u32, u32)]>,
    pub(super) ranges: Box<[ipnet::IpNet]>,
}

impl Extras {
    /// `None` when all three are empty.
    pub(super) fn of(
        table: Vec<u16>,
        weights: Vec<(u32, u32)>,
        ranges: Vec<ipnet::IpNet>,
    ) -> Option<Box<Self>> {
        if table.is_empty() && weights.is_empty() && ranges.is_empty() {
            return None;
        }
        Some(Box::new(Self {
            table: table.into(),
            weights: weights.into(),
            ranges: ranges.into(),
        }))
    }
}

impl Programmed {
    pub(super) fn table(&self) -> &[u16] {
        self.extras.as_ref().map_or(&[], |e| &e.table)
    }

    pub(super) fn weights(&self) -> &[(u32, u32)] {
        self.extras.as_ref().map_or(&[], |e| &e.weights)
    }

    pub(super) fn ranges(&self) -> &[ipnet::IpNet] {
        self.extras.as_ref().map_or(&[], |e| &e.ranges)
    }
}

/// The agent's mirror of the maps' service, slot and backend entries.
#[derive(Debug, Default)]
pub struct Mirror {
    pub(super) services: FxHashMap<ServiceKey, Programmed>,
    /// Each backend by id and by value, with how many live slots point at it; a backend
    /// is deleted at zero. Keeps each sync proportional to what changed, not to the
    /// number of backends.
    pub(super) backends: backend_table::BackendTable,
    /// Live slots in all (the sum of the backends' references), for the fill gauges.
    pub(super) live_slots: u64,
    /// Backends whose count dropped to zero (or were never used) since the last sweep.
    pub(super) maybe_unused: HashSet<u32>,
    pub(super) used_service_ids: HashSet<u32>,
    /// Counts syncs: frontends not `seen` in the current one are removed.
    pub(super) epoch: u64,
    /// UDP endpoints that left a frontend since `take_left_udp` last ran.
    pub(super) left_udp: Vec<LeftUdp>,
    /// `MEMBERS` changes adoption found necessary, written by the next apply.
    pub(super) members_fix: members::Reconcile,
    pub(super) next_service_id: u32,
    pub(super) next_backend_id: u32,
    /// Where the audit's current pass is.
    pub(super) audit: AuditPass,
    /// A first programming in batches failed: the retry goes one by one (and says which
    /// frontends do not fit).
    pub(super) bulk_failed: bool,
    /// Frontends staged ahead of a first programming (`stage`): everything written but
    /// the service entry, which the next apply writes.
    pub(super) unflipped: HashSet<ServiceKey>,
    /// Direct server return's permits (`DSR_PERMITS`).
    pub(super) dsr: dsr_permits::DsrPermits,
}
