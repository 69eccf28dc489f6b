//! Brings the maps to a node view with minimal writes. The agent's mirror of the maps is
//! rebuilt from the maps themselves on start (adoption), so a restarted agent only writes
//! what changed while it was away.
//!
//! Order matters for live traffic: backends first, then a frontend's new slot set under a
//! new generation, then the frontend entry flip, then the old slots; removed frontends go
//! before the backends they used.

use std::{
    collections::{BTreeSet, HashSet},
    net::SocketAddr,
};

use crate::error::{Context as _, Error, ErrorKind, Result};
use proxy_common::{
    Backend, CtValue, PROTO_UDP, SCOPE_INTERNAL, SVC_F_AFFINITY, SVC_F_DROP_NO_BACKENDS, SVC_F_DSR,
    SVC_F_EXT_LOCAL, SVC_F_EXTERNAL, SVC_F_SOURCE_RANGES, SVC_F_TWO_SCOPES, SVC_F_WEIGHTED,
    ServiceKey,
};

use super::{maps::MapSet, members, stats::Ended};

mod adopt;
mod audit;
mod audit_pass;
mod backend_table;
mod dsr_permits;
mod generation;
mod ids;
mod mirror;
mod node;

use self::generation::*;
use self::mirror::Programmed;
pub use self::mirror::{LeftUdp, Mirror};
pub use self::node::configure;
pub use super::codec::service_key;
use super::codec::{self, *};
use super::maps::remove_ignoring_absent;
use crate::{
    layout::MAX_SLOTS,
    report::{ApplyReport, FrontendIssue, Issue},
};
use proxy_model::{
    BackendSet, EndpointSet, Frontend, FrontendKind, FrontendState, NodeView, WhenEmpty,
    schedule::Schedule,
};

/// Frontends from which a first programming is written in batches (below, one syscall
/// per entry costs little).
const BULK_MIN: usize = 256;

/// What writing one frontend did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wrote {
    /// It was programmed as it is.
    Nothing,
    Entry,
    /// Written with its `wrr` weights scaled down to fit a frontend's slots.
    Scaled {
        wanted: usize,
        slots: usize,
    },
}

/// A frontend whose layout has more backend slots than a frontend holds: it can never be
/// written as it is, so it is refused, not retried.
#[derive(Debug, thiserror::Error)]
#[error("{slots} backend slots exceed the {MAX_SLOTS} per frontend")]
pub struct TooManySlots {
    pub slots: usize,
}

impl From<TooManySlots> for Error {
    fn from(too_many: TooManySlots) -> Self {
        Error::transparent(ErrorKind::Map, too_many)
    }
}

/// One service-map entry the view asks for.
struct Desired<'a> {
    frontend: &'a Frontend,
    state: &'a FrontendState,
    set: &'a BackendSet,
    flags: u16,
    /// Source ranges (external scope only: pods and the node are not filtered).
    ranges: &'a [ipnet::IpNet],
}

/// The service-map entries of a view: the external (or only) scope of each frontend, and
/// an internal scope where internal traffic uses other backends.
fn desired_entries<'a>(
    frontends: impl Iterator<Item = (&'a Frontend, &'a FrontendState)>,
) -> Vec<(ServiceKey, Desired<'a>)> {
    let mut out = Vec::with_capacity(frontends.size_hint().0);
    for (fe, st) in frontends {
        let affinity = if st.affinity_timeout_s.is_some() {
            SVC_F_AFFINITY
        } else {
            0
        };
        let flags = |set: &BackendSet| {
            affinity
                | match set.when_empty {
                    WhenEmpty::Drop => SVC_F_DROP_NO_BACKENDS,
                    WhenEmpty::Reject => 0,
                }
        };
        let key = service_key(fe);
        let two = if st.internal.is_some() {
            SVC_F_TWO_SCOPES
        } else {
            0
        };
        let external = if st.kind == FrontendKind::ClusterIp {
            0
        } else {
            SVC_F_EXTERNAL
        } | if st.external_local {
            SVC_F_EXT_LOCAL
        } else {
            0
        };
        let ranges = if st.source_ranges.is_empty() {
            0
        } else {
            SVC_F_SOURCE_RANGES
        } | if st.dsr { SVC_F_DSR } else { 0 };
        out.push((
            key,
            Desired {
                frontend: fe,
                state: st,
                set: &st.backends,
                flags: flags(&st.backends) | two | external | ranges,
                ranges: &st.source_ranges,
            },
        ));
        if let Some(internal) = &st.internal {
            let key = ServiceKey {
                scope: SCOPE_INTERNAL,
                ..key
            };
            out.push((
                key,
                Desired {
                    frontend: fe,
                    state: st,
                    set: internal,
                    flags: flags(internal) | external,
                    ranges: &[],
                },
            ));
        }
    }
    out
}

impl Mirror {
    /// Number of frontends programmed.
    pub fn frontends(&self) -> usize {
        self.services.len()
    }

    /// How full the service-side maps are.
    pub fn fill(&self) -> crate::MapFill {
        crate::MapFill {
            services: self.services.len() as u64,
            backend_slots: self.live_slots,
            backends: self.backends.len() as u64,
        }
    }

    /// Nothing is live: no service entry was written (a fresh node, or only `stage`s so
    /// far), so a whole view can go in batches and a partial one can be staged.
    fn nothing_live(&self) -> bool {
        self.services.len() == self.unflipped.len() && !self.bulk_failed
    }

    /// A first programming ahead of its end, while the first lists are still arriving:
    /// writes, in batches, everything the service entries of `view`'s `changed`
    /// frontends will point to (backends, slots, Maglev tables, weights, memberships,
    /// reverse-NAT entries, source ranges), but not the entries themselves, so no packet
    /// and no connect reaches any of it yet and a partial view is never served. The next
    /// `apply` compares everything as usual and writes the service entries. Only where
    /// nothing is live: a restarted agent's adopted maps serve traffic, and a partial view
    /// must not touch them. Returns the frontends staged (0: not staged). A frontend that
    /// cannot be staged is left to the apply, which reports it.
    pub fn stage(
        &mut self,
        maps: &mut MapSet,
        view: &NodeView,
        changed: &BTreeSet<Frontend>,
    ) -> Result<usize> {
        if !self.nothing_live() {
            return Ok(0);
        }
        // A frontend with no endpoint yet (its Service listed, its slices not yet) waits
        // for the first apply: staged now, most would be written again a page later.
        let desired = desired_entries(
            changed
                .iter()
                .filter_map(|fe| Some((fe, view.get(fe)?)))
                .filter(|(_, st)| {
                    !st.backends.endpoints.is_empty()
                        || st
                            .internal
                            .as_ref()
                            .is_some_and(|i| !i.endpoints.is_empty())
                }),
        );
        // Before any write: the memberships an earlier agent left (one killed while it
        // staged) go now, not after ours reuse their ids.
        self.members_fix.apply(maps)?;
        maps.staged = Some(Default::default());
        maps.withhold_services = true;
        let mut staged = 0;
        for (key, d) in &desired {
            match self.write_frontend(maps, *key, d) {
                Ok(Wrote::Nothing) => {}
                Ok(_) => staged += 1,
                Err(e) => tracing::debug!(frontend = %d.frontend, error = format!("{e:#}"),
                    "not staged; the first apply writes it"),
            }
        }
        maps.withhold_services = false;
        if let Err(e) = maps.flush_staged() {
            // As a failed first programming: read back what the kernel holds (no service
            // entry), and let the apply go one by one.
            *self = Mirror {
                bulk_failed: true,
                ..Mirror::adopt(maps)?
            };
            return Err(e.context("staging the first programming stopped"));
        }
        Ok(staged)
    }

    /// Applies `view`, comparing every frontend. A frontend that cannot be written (a
    /// full map) keeps its previous entries and is reported; the others still apply.
    pub fn apply(&mut self, maps: &mut MapSet, view: &NodeView) -> Result<ApplyReport> {
        self.apply_changes(maps, view, None)
    }

    /// Applies `view`; with `changed`, only those frontends are compared and written
    /// (the ones that differ from the view of the last successful apply), so a sync
    /// costs what changed, not what exists.
    pub fn apply_changes(
        &mut self,
        maps: &mut MapSet,
        view: &NodeView,
        changed: Option<&BTreeSet<Frontend>>,
    ) -> Result<ApplyReport> {
        let mut report = ApplyReport::default();
        let desired = match changed {
            None => desired_entries(view.iter()),
            Some(changed) => {
                desired_entries(changed.iter().filter_map(|fe| Some((fe, view.get(fe)?))))
            }
        };
        self.members_fix.apply(maps)?;
        // The first programming of an empty node is written in batches.
        let bulk = changed.is_none() && self.nothing_live() && desired.len() >= BULK_MIN;
        if bulk {
            maps.staged = Some(Default::default());
        }

        self.epoch += 1;
        // 1. Entries that are new or changed; staged ones the view still has flipped.
        self.write_desired(maps, &desired, &mut report);
        self.flip_staged(maps, &desired, &mut report);
        if bulk && let Err(e) = maps.flush_staged() {
            // What the kernel took is unknown here: read it back, and let the next
            // apply write the rest one by one (naming what does not fit).
            maps.staged = None;
            *self = Mirror {
                bulk_failed: true,
                ..Mirror::adopt(maps)?
            };
            return Err(e.context("the first programming, in batches, stopped"));
        }
        // 2. Frontends (or scopes of them) no longer wanted.
        report.frontends_removed = self.remove_stale(maps, changed)?;
        // 3. Backends no frontend uses any more.
        report.backends_removed = self.remove_unused_backends(maps)?;
        // 4. UDP flows of endpoints that left their frontend.
        self.clear_left_udp_flows(maps)?;
        // 5. Direct server return's permits, after the frontends they name.
        self.dsr.sync(maps, view, changed)?;
        report.fill = Some(self.fill());
        Ok(report)
    }

    /// Step 1 of an apply: writes each desired frontend that differs from the mirror;
    /// what cannot be written as the view gives it is reported, the rest still written.
    fn write_desired(
        &mut self,
        maps: &mut MapSet,
        desired: &[(ServiceKey, Desired<'_>)],
        report: &mut ApplyReport,
    ) {
        for (key, d) in desired {
            let written = self.write_frontend(maps, *key, d);
            // Still wanted, even if rewriting it failed (it keeps its old entries).
            if let Some(p) = self.services.get_mut(key) {
                p.seen = self.epoch;
            }
            let issue = |issue| FrontendIssue {
                frontend: *d.frontend,
                service: d.state.service.clone(),
                issue,
            };
            match written {
                Ok(Wrote::Entry) => report.frontends_written += 1,
                Ok(Wrote::Scaled { wanted, slots }) => {
                    report.frontends_written += 1;
                    report.adjusted.push(issue(Issue::WeightsScaled {
                        wanted,
                        written: slots,
                        max: MAX_SLOTS,
                    }));
                }
                Ok(Wrote::Nothing) => {}
                Err(e) => match e.downcast_ref::<TooManySlots>() {
                    Some(too_many) => report.refused.push(issue(Issue::TooManySlots {
                        slots: too_many.slots,
                        max: MAX_SLOTS,
                    })),
                    None => {
                        let (fe, svc) = (d.frontend, &d.state.service);
                        tracing::error!(frontend = %fe, service = %svc, error = format!("{e:#}"),
                            "could not program frontend; its previous entries stay");
                        report
                            .failed
                            .push(issue(Issue::WriteFailed(format!("{e:#}"))));
                    }
                },
            }
        }
    }

    /// Staged frontends the view still has, found unchanged by `write_desired`: their
    /// service entries now. (Those the view no longer has are removed, never seen.)
    fn flip_staged(
        &mut self,
        maps: &mut MapSet,
        desired: &[(ServiceKey, Desired<'_>)],
        report: &mut ApplyReport,
    ) {
        let wanted: Vec<ServiceKey> = self
            .unflipped
            .iter()
            .filter(|k| self.services.get(k).is_some_and(|p| p.seen == self.epoch))
            .copied()
            .collect();
        for key in wanted {
            let Some(p) = self.services.get(&key) else {
                continue;
            };
            match maps.put_service(&key, &p.value) {
                Ok(()) => {
                    self.unflipped.remove(&key);
                }
                Err(e) => {
                    // Seen this epoch: the view has it, so `desired` names it (else the
                    // key says which frontend, without its Service).
                    let (frontend, service) = match desired.iter().find(|(k, _)| *k == key) {
                        Some((_, d)) => (*d.frontend, d.state.service.clone()),
                        None => (codec::frontend_of(&key), String::new()),
                    };
                    report.failed.push(FrontendIssue {
                        frontend,
                        service,
                        issue: Issue::WriteFailed(format!("writing service entry: {e}")),
                    });
                }
            }
        }
    }

    /// Step 2: removes the frontends (or scopes of them) the view no longer has — of
    /// `changed` only, when given. Returns how many.
    fn remove_stale(
        &mut self,
        maps: &mut MapSet,
        changed: Option<&BTreeSet<Frontend>>,
    ) -> Result<usize> {
        let stale: Vec<ServiceKey> = match changed {
            None => self
                .services
                .iter()
                .filter(|(_, p)| p.seen != self.epoch)
                .map(|(k, _)| *k)
                .collect(),
            Some(changed) => changed
                .iter()
                .flat_map(|fe| {
                    let key = service_key(fe);
                    [
                        key,
                        ServiceKey {
                            scope: SCOPE_INTERNAL,
                            ..key
                        },
                    ]
                })
                .filter(|k| self.services.get(k).is_some_and(|p| p.seen != self.epoch))
                .collect(),
        };
        let removed = stale.len();
        for key in stale {
            self.remove_frontend(maps, key)?;
        }
        Ok(removed)
    }

    /// Step 3: removes the backends no frontend uses any more. Returns how many.
    fn remove_unused_backends(&mut self, maps: &mut MapSet) -> Result<usize> {
        let candidates: Vec<u32> = self.maybe_unused.drain().collect();
        // A first programming or a big change leaves a big, empty set behind.
        self.maybe_unused.shrink_to(64);
        let mut removed = HashSet::new();
        for id in candidates {
            if self.backends.refs(id) > 0 {
                continue;
            }
            remove_ignoring_absent(maps.backends.remove(&id))?;
            self.backends.remove(id);
            removed.insert(id);
        }
        for left in &mut self.left_udp {
            left.gone |= removed.contains(&left.backend_id);
        }
        Ok(removed.len())
    }

    /// Step 4: UDP flows of endpoints that left their frontend: their entries go now, so
    /// a UDP client (which never closes its flow) is rebalanced on its next packet, even
    /// if the pod still serves another Service or a new backend later reuses the id.
    /// TCP flows stay: a terminating pod finishes them.
    fn clear_left_udp_flows(&mut self, maps: &mut MapSet) -> Result<()> {
        let pairs: HashSet<(u32, u32)> = self
            .left_udp
            .iter()
            .map(|l| (l.rev_nat_id, l.backend_id))
            .collect();
        if !pairs.is_empty() {
            let mut cleared = 0;
            // The answered flows' counts (the unanswered count in `LB_STATS`).
            let mut ended = Ended::default();
            let is_stale = |v: &CtValue| pairs.contains(&(v.rev_nat_id, v.backend_id));
            for table in [&mut maps.conntrack, &mut maps.conntrack_new] {
                let stale: Vec<_> = table
                    .iter()
                    .filter_map(Result::ok)
                    .filter(|(k, v)| k.proto == PROTO_UDP && is_stale(v))
                    .map(|(k, _)| k)
                    .collect();
                for key in &stale {
                    // Read again: since the walk the programs may have replaced the flow
                    // on this tuple (its backend id deleted a step earlier) with a new
                    // one, which must not go too.
                    if let Ok(v) = table.get(key, 0)
                        && is_stale(&v)
                    {
                        cleared += ended.remove(table, key, &v)?;
                    }
                }
            }
            super::stats::fold_ended(maps, ended)
                .context("keeping the counts of the cleared flows")?;
            if cleared > 0 {
                tracing::debug!(entries = cleared, "flows of removed backends cleared");
            }
        }
        Ok(())
    }

    /// Removes one service-map entry with its slots, reverse-NAT entry, members and
    /// source ranges; its backends go when no other frontend uses them.
    fn remove_frontend(&mut self, maps: &mut MapSet, key: ServiceKey) -> Result<()> {
        let Some(old) = self.services.remove(&key) else {
            return Ok(());
        };
        // A staged frontend served nothing: no flow or socket can have used it.
        if !self.unflipped.remove(&key) {
            self.note_left(key, &old, &[]);
        }
        self.release(&old.backend_ids);
        remove_ignoring_absent(maps.services.remove(&key))?;
        // The entry's own count: a torn adopted set lost some of its ids, not its slots.
        remove_generation(maps, &old.value, usize::from(old.value.count))?;
        remove_ignoring_absent(maps.rev_nat.remove(&old.value.rev_nat_id))?;
        members::leave(maps, old.value.id, &old.backend_ids, &[])?;
        if old.value.flags & SVC_F_WEIGHTED != 0 {
            forget_weights(maps, old.value.id, old.backend_ids.iter())?;
        }
        for net in old.ranges() {
            remove_ignoring_absent(maps.source_ranges.remove(&range_key(old.value.id, net)))?;
        }
        self.used_service_ids.remove(&old.value.id);
        Ok(())
    }

    /// The UDP endpoints that left a frontend since the last call (their connected
    /// sockets and kernel conntrack entries may need clearing), less those whose address
    /// the frontend has by now, under any id: one back since (a record kept past a
    /// failed sync) must not cost a socket its live backend.
    pub fn take_left_udp(&mut self) -> Vec<LeftUdp> {
        let mut left = std::mem::take(&mut self.left_udp);
        let same_endpoint = |a: &Backend, b: &Backend| {
            (a.addr, a.port, a.family, a.proto) == (b.addr, b.port, b.family, b.proto)
        };
        left.retain(|l| {
            self.services.get(&l.key).is_none_or(|p| {
                !p.backend_ids.iter().any(|id| {
                    self.backends
                        .get(*id)
                        .is_some_and(|b| same_endpoint(b, &l.backend))
                })
            })
        });
        left
    }

    /// Records the UDP endpoints of `old` (frontend `key`) that `now` no longer has.
    fn note_left(&mut self, key: ServiceKey, old: &Programmed, now: &[u32]) {
        if key.proto != PROTO_UDP {
            return;
        }
        for id in old.backend_ids.iter().filter(|id| !now.contains(id)) {
            if let Some(backend) = self.backends.get(*id) {
                self.left_udp.push(LeftUdp {
                    key,
                    rev_nat_id: old.value.rev_nat_id,
                    backend_id: *id,
                    backend: *backend,
                    gone: false,
                });
            }
        }
    }

    /// Writes one frontend if it differs from what is programmed. A layout of more slots
    /// than a frontend has is refused (`TooManySlots`) before anything is written.
    fn write_frontend(
        &mut self,
        maps: &mut MapSet,
        key: ServiceKey,
        d: &Desired<'_>,
    ) -> Result<Wrote> {
        let timeout = d.state.affinity_timeout_s.unwrap_or(0);
        let schedule = &d.state.schedule;
        // Fast path, the common case at scale: nothing about this entry changed.
        if let Some(old) = self.services.get(&key)
            && old.value.flags & !SVC_F_WEIGHTED == d.flags
            && old.value.affinity_timeout_s == timeout
            && old.ranges() == d.ranges
            && old.complete
            && old.schedule == *schedule
            && old.endpoints == d.set.endpoints
        {
            return Ok(Wrote::Nothing);
        }
        let endpoints: Vec<SocketAddr> = d.set.endpoints.iter().collect();
        let weighted = schedule.weighted(&endpoints);
        let flags = d.flags | if weighted { SVC_F_WEIGHTED } else { 0 };
        // The scheduler's slot layout (each endpoint once, by weight, or a Maglev
        // table), as backend ids; each endpoint's id is looked up once.
        let mut id_of: Vec<Option<u32>> = vec![None; endpoints.len()];
        let layout = crate::layout::layout(schedule, &endpoints, d.frontend.ip);
        let count = u16::try_from(layout.slots.len()).map_err(|_| TooManySlots {
            slots: layout.slots.len(),
        })?;
        let mut backend_ids = Vec::with_capacity(layout.slots.len());
        for &i in &layout.slots {
            let i = i as usize;
            let id = match id_of[i] {
                Some(id) => id,
                None => {
                    let id = self
                        .ensure_backend(maps, backend_value(endpoints[i], d.frontend.protocol))?;
                    id_of[i] = Some(id);
                    id
                }
            };
            backend_ids.push(id);
        }
        let mut weights: Vec<(u32, u32)> = if weighted {
            endpoints
                .iter()
                .zip(&id_of)
                .filter_map(|(sa, id)| Some(((*id)?, schedule.weight(sa.ip()))))
                .collect()
        } else {
            Vec::new()
        };
        weights.sort_unstable();
        let scheduler = codec::scheduler_code(schedule.scheduler);
        let old = self.services.get(&key).cloned();
        if let Some(old) = &old
            && *old.backend_ids == *backend_ids
            && old.value.flags == flags
            && old.value.affinity_timeout_s == timeout
            && old.value.scheduler == scheduler
            && old.weights() == weights
            && old.table() == layout.table
            && old.ranges() == d.ranges
        {
            self.remember_endpoints(key, &d.set.endpoints, schedule);
            return Ok(Wrote::Nothing);
        }
        let id = match &old {
            Some(o) => o.value.id,
            None => self.allocate_service_id(),
        };
        let written = self.write_generation(
            maps,
            key,
            old.as_ref(),
            Generation {
                id,
                backend_ids,
                flags,
                timeout,
                count,
                scheduler,
                weights,
                table: layout.table,
            },
            d.ranges,
        );
        if written.is_err() && old.is_none() {
            self.used_service_ids.remove(&id);
        }
        written?;
        self.remember_endpoints(key, &d.set.endpoints, schedule);
        Ok(match layout.scaled_from {
            Some(wanted) => Wrote::Scaled {
                wanted,
                slots: usize::from(count),
            },
            None => Wrote::Entry,
        })
    }

    fn remember_endpoints(
        &mut self,
        key: ServiceKey,
        endpoints: &EndpointSet,
        schedule: &Schedule,
    ) {
        if let Some(p) = self.services.get_mut(&key) {
            p.endpoints = endpoints.clone();
            p.complete = true;
            if p.schedule != *schedule {
                p.schedule = schedule.clone();
            }
        }
    }
}
