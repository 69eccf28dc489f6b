//! The dataplane's partial apply (only the frontends that changed) leaves the maps as
//! the full apply (every frontend compared) does: after each of hundreds of random view
//! changes, two private map sets — one fed changes, one fed whole views — hold the same
//! entries, value for value (ids aside), with no slot, backend, reverse-NAT, member or
//! source-range entry left behind. Root: it loads the BPF maps.

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use proxy_agent::{
    dataplane::bpf::{self, MapSet, Mirror},
    model::schedule::{Schedule, Scheduler},
    model::{BackendSet, Frontend, FrontendKind, FrontendState, NodeView, Protocol, WhenEmpty},
};
use proxy_common::BackendSlotKey;
use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
use test_support::needs_root;

fn random_set(rng: &mut StdRng) -> BackendSet {
    BackendSet {
        endpoints: (0..rng.random_range(0..5))
            .map(|_| {
                SocketAddr::new(
                    IpAddr::from([10, 244, 0, rng.random_range(1..10)]),
                    8080 + rng.random_range(0..2),
                )
            })
            .collect(),
        when_empty: if rng.random_bool(0.5) {
            WhenEmpty::Drop
        } else {
            WhenEmpty::Reject
        },
    }
}

fn random_state(rng: &mut StdRng) -> FrontendState {
    let kind = if rng.random_bool(0.5) {
        FrontendKind::ClusterIp
    } else {
        FrontendKind::NodePort
    };
    let external_local = kind == FrontendKind::NodePort && rng.random_bool(0.5);
    // Drawn in the fields' order, as before: a seed still gives the same states.
    FrontendState::builder(format!("ns/svc-{}:http", rng.random_range(0..4)), kind)
        .backend_set(random_set(rng))
        .internal(external_local.then(|| random_set(rng)))
        .affinity(rng.random_bool(0.3).then_some(10_800))
        .external_local(external_local)
        .source_ranges(if rng.random_bool(0.2) {
            vec!["198.51.100.0/24".parse().expect("cidr")]
        } else {
            Vec::new()
        })
        .schedule(random_schedule(rng))
        .build()
}

/// Random scheduler (expanded layouts and weights among them), small Maglev tables.
fn random_schedule(rng: &mut StdRng) -> Schedule {
    let scheduler = Scheduler::ALL[rng.random_range(0..Scheduler::ALL.len())];
    let weights: BTreeMap<IpAddr, u32> = (0..rng.random_range(0..3))
        .map(|_| {
            (
                IpAddr::from([10, 244, 0, rng.random_range(1..10)]),
                rng.random_range(0..4),
            )
        })
        .collect();
    Schedule::new(scheduler, weights.into(), 251)
}

fn random_frontend(rng: &mut StdRng) -> Frontend {
    Frontend {
        ip: IpAddr::from([10, 96, 0, rng.random_range(1..10)]),
        port: 80,
        protocol: if rng.random_bool(0.7) {
            Protocol::Tcp
        } else {
            Protocol::Udp
        },
    }
}

/// One service-map entry: flags, affinity timeout, scheduler, reverse-NAT target,
/// backends (bytes).
type Entry = (u16, u32, u8, Vec<u8>, Vec<Vec<u8>>);

/// What the maps hold, without the agent's ids: per service-map key, its flags,
/// affinity, reverse-NAT target and backends in slot order; plus the table sizes that
/// would show a leak.
#[derive(Debug, PartialEq, Eq)]
struct Contents {
    services: BTreeMap<Vec<u8>, Entry>,
    slots: usize,
    backends: BTreeSet<Vec<u8>>,
    rev_nat: usize,
    members: usize,
    source_ranges: usize,
    weights: usize,
    maglev_chunks: usize,
}

fn contents(maps: &MapSet) -> Contents {
    let bytes = |v: &[u8]| v.to_vec();
    let mut services = BTreeMap::new();
    for entry in maps.services.iter() {
        let (key, value) = entry.expect("service entry");
        let backends = (0..u32::from(value.count))
            .map(|slot| {
                let slot = maps
                    .slots
                    .get(
                        &BackendSlotKey {
                            service_id: value.id,
                            rev: value.rev,
                            slot,
                        },
                        0,
                    )
                    .expect("slot of a live set");
                let be = maps.backends.get(&slot.backend_id, 0).expect("backend");
                bytes(bytemuck::bytes_of(&be))
            })
            .collect();
        let rev = maps.rev_nat.get(&value.rev_nat_id, 0).expect("rev nat");
        services.insert(
            bytes(bytemuck::bytes_of(&key)),
            (
                value.flags,
                value.affinity_timeout_s,
                value.scheduler,
                bytes(bytemuck::bytes_of(&rev)),
                backends,
            ),
        );
    }
    Contents {
        services,
        slots: maps.slots.keys().count(),
        backends: maps
            .backends
            .iter()
            .map(|e| bytes(bytemuck::bytes_of(&e.expect("backend").1)))
            .collect(),
        rev_nat: maps.rev_nat.keys().count(),
        members: maps.members.keys().count(),
        source_ranges: maps.source_ranges.keys().count(),
        weights: maps.weights.keys().count(),
        maglev_chunks: maps.maglev.keys().count(),
    }
}

#[needs_root]
#[test]
fn applying_only_the_changed_frontends_leaves_the_maps_as_a_full_apply() {
    let (_a_obj, mut a_maps) = bpf::load_private(&[]).expect("load");
    let (_b_obj, mut b_maps) = bpf::load_private(&[]).expect("load");
    let mut a = Mirror::adopt(&a_maps).expect("adopt");
    let mut b = Mirror::adopt(&b_maps).expect("adopt");
    let mut rng = StdRng::seed_from_u64(7);
    let mut view = NodeView::new();
    let mut applied = NodeView::new();
    for step in 0..400 {
        for _ in 0..rng.random_range(1..4) {
            let fe = random_frontend(&mut rng);
            if rng.random_bool(0.25) {
                view.remove(&fe);
            } else {
                view.insert(fe, random_state(&mut rng));
            }
        }
        let changed = applied.changed_frontends(&view);
        let ra = a
            .apply_changes(&mut a_maps, &view, Some(&changed))
            .expect("partial apply");
        let rb = b.apply(&mut b_maps, &view).expect("full apply");
        assert!(ra.failed.is_empty() && rb.failed.is_empty());
        assert_eq!(
            (ra.frontends_written, ra.frontends_removed),
            (rb.frontends_written, rb.frontends_removed),
            "step {step}: the same writes"
        );
        let (ca, cb) = (contents(&a_maps), contents(&b_maps));
        assert_eq!(ca, cb, "step {step}");
        let slots: usize = ca.services.values().map(|s| s.4.len()).sum();
        assert_eq!(ca.slots, slots, "step {step}: no slot left behind");
        assert_eq!(ca.rev_nat, ca.services.len(), "step {step}: reverse NAT");
        let chunks: usize = a_maps
            .services
            .iter()
            .filter_map(Result::ok)
            .map(|(_, v)| usize::from(v.table_len).div_ceil(proxy_common::MAGLEV_CHUNK as usize))
            .sum();
        assert_eq!(
            ca.maglev_chunks, chunks,
            "step {step}: no Maglev chunk left behind"
        );
        applied = view.clone();
    }
    assert!(
        !view.is_empty(),
        "the sequence ends with frontends programmed"
    );
}

/// Adoption (the mirror read back from the maps, in batch reads) is exact: a fresh
/// mirror over maps a random history wrote rewrites nothing for the same view; a slot
/// torn away (an agent killed mid-write) gets its frontend, and only it, rewritten.
#[needs_root]
#[test]
fn adopting_the_maps_rewrites_only_a_torn_set() {
    let (_obj, mut maps) = bpf::load_private(&[]).expect("load");
    let mut state = Mirror::adopt(&maps).expect("adopt");
    let mut rng = StdRng::seed_from_u64(11);
    let mut view = NodeView::new();
    for _ in 0..300 {
        let fe = random_frontend(&mut rng);
        if rng.random_bool(0.2) {
            view.remove(&fe);
        } else {
            view.insert(fe, random_state(&mut rng));
        }
        state.apply(&mut maps, &view).expect("apply");
    }
    let before = contents(&maps);
    let mut adopted = Mirror::adopt(&maps).expect("adopt");
    assert_eq!(adopted.frontends(), state.frontends());
    let report = adopted.apply(&mut maps, &view).expect("apply over adopted");
    assert_eq!(
        (report.frontends_written, report.frontends_removed),
        (0, 0),
        "an exact adoption writes nothing"
    );
    assert_eq!(contents(&maps), before);

    // Tear one frontend's slot set.
    let (_, value) = maps
        .services
        .iter()
        .filter_map(Result::ok)
        .find(|(_, v)| v.count > 1)
        .expect("a frontend with two slots or more");
    maps.slots
        .remove(&BackendSlotKey {
            service_id: value.id,
            rev: value.rev,
            slot: 1,
        })
        .expect("remove a slot");
    let mut adopted = Mirror::adopt(&maps).expect("adopt a torn set");
    let report = adopted.apply(&mut maps, &view).expect("apply");
    assert_eq!(report.frontends_written, 1, "only the torn frontend");
    let after = contents(&maps);
    assert_eq!(after, before, "the torn set is whole again");
}

/// The audit puts the maps back as programmed, a step at a time: a deleted service
/// entry, an overwritten slot and a deleted backend get their frontends written again;
/// a service entry, slots and a backend nobody programmed are removed; one pass ends
/// within about 1/fraction steps, and a second pass finds nothing.
#[needs_root]
#[test]
fn the_audit_repairs_lost_entries_and_removes_strays() {
    use proxy_common::{Backend, BackendSlot, ServiceKey};
    let (_obj, mut maps) = bpf::load_private(&[]).expect("load");
    let mut state = Mirror::adopt(&maps).expect("adopt");
    let mut rng = StdRng::seed_from_u64(5);
    let mut view = NodeView::new();
    for _ in 0..200 {
        view.insert(random_frontend(&mut rng), random_state(&mut rng));
    }
    state.apply(&mut maps, &view).expect("apply");
    let before = contents(&maps);
    let entries: Vec<(ServiceKey, proxy_common::ServiceValue)> =
        maps.services.iter().filter_map(Result::ok).collect();
    let with_slots: Vec<_> = entries.iter().filter(|(_, v)| v.count > 0).collect();
    assert!(with_slots.len() >= 3, "enough frontends with backends");
    // A backend of a third frontend that the first two do not use (else repairing them
    // would bring it back first). Read before the damage: the overwritten slot would
    // hide the first two's real backends (a flake when map order put one of them on a
    // later frontend).
    let ids_of = |v: &proxy_common::ServiceValue| -> Vec<u32> {
        (0..u32::from(v.count))
            .filter_map(|slot| {
                let k = BackendSlotKey {
                    service_id: v.id,
                    rev: v.rev,
                    slot,
                };
                maps.slots.get(&k, 0).ok().map(|s| s.backend_id)
            })
            .collect()
    };
    let taken: Vec<u32> = ids_of(&with_slots[0].1)
        .into_iter()
        .chain(ids_of(&with_slots[1].1))
        .collect();
    let lost_backend = with_slots[2..]
        .iter()
        .flat_map(|(_, v)| ids_of(v))
        .find(|id| !taken.contains(id))
        .expect("a backend only later frontends use");
    // Lost: a service entry; changed: a slot pointing elsewhere; lost: a backend.
    maps.services
        .remove(&with_slots[0].0)
        .expect("remove entry");
    let slot_key = BackendSlotKey {
        service_id: with_slots[1].1.id,
        rev: with_slots[1].1.rev,
        slot: 0,
    };
    maps.slots
        .insert(
            &slot_key,
            &BackendSlot {
                backend_id: 999_999,
            },
            0,
        )
        .expect("overwrite slot");
    maps.backends.remove(&lost_backend).expect("remove backend");
    // Strays: an entry, its slots, a backend.
    let stray = ServiceKey {
        addr: [u32::from_be_bytes([10, 99, 99, 99]).to_be(), 0, 0, 0],
        ..with_slots[0].0
    };
    maps.services
        .insert(
            &stray,
            &proxy_common::ServiceValue {
                id: 777_777,
                rev: 1,
                count: 2,
                ..with_slots[0].1
            },
            0,
        )
        .expect("stray entry");
    for slot in 0..2 {
        maps.slots
            .insert(
                &BackendSlotKey {
                    service_id: 777_777,
                    rev: 1,
                    slot,
                },
                &BackendSlot {
                    backend_id: 888_888,
                },
                0,
            )
            .expect("stray slot");
    }
    maps.backends
        .insert(&888_888, &Backend::default(), 0)
        .expect("stray backend");

    let (mut repaired, mut removed, mut steps) = (0, 0, 0);
    loop {
        let r = state.audit_step(&mut maps, 0.05).expect("audit step");
        repaired += r.repaired;
        removed += r.removed;
        steps += 1;
        if r.pass_done {
            break;
        }
        assert!(steps < 100, "a pass at 5% a step ends within 100 steps");
    }
    assert!(repaired >= 3, "three frontends written again: {repaired}");
    // The stray entry, its two slots, its backend; the rewritten frontends' old
    // generations are the writer's own to remove.
    assert_eq!(removed, 4, "strays removed");
    let after = contents(&maps);
    assert_eq!(
        after.services, before.services,
        "every frontend as programmed"
    );
    assert_eq!(after.backends, before.backends);
    assert_eq!(after.slots, before.slots, "no slot left behind");
    assert_eq!(after.maglev_chunks, before.maglev_chunks);
    // Nothing further to find.
    loop {
        let r = state.audit_step(&mut maps, 0.5).expect("audit step");
        assert_eq!((r.repaired, r.removed), (0, 0), "a clean pass");
        if r.pass_done {
            break;
        }
    }
    // And the writer still agrees with a fresh adoption.
    let mut adopted = Mirror::adopt(&maps).expect("adopt");
    let report = adopted.apply(&mut maps, &view).expect("apply");
    assert_eq!((report.frontends_written, report.frontends_removed), (0, 0));
}

/// One audit step compares at most 256 frontends, whatever share it is asked for: with
/// every service entry deleted, a step asked for all 300 repairs 256, the next the rest,
/// and the maps end as programmed.
#[needs_root]
#[test]
fn an_audit_step_compares_at_most_256_frontends() {
    let view = many_frontends(2);
    let (_obj, mut maps) = bpf::load_private(&[]).expect("load");
    let mut state = Mirror::adopt(&maps).expect("adopt");
    state.apply(&mut maps, &view).expect("apply");
    let before = contents(&maps);
    let keys: Vec<proxy_common::ServiceKey> = maps.services.keys().filter_map(Result::ok).collect();
    assert_eq!(keys.len(), 300);
    for k in &keys {
        maps.services.remove(k).expect("delete a service entry");
    }
    let first = state.audit_step(&mut maps, 1.0).expect("audit step");
    assert_eq!(first.repaired, 256, "{first:?}");
    let second = state.audit_step(&mut maps, 1.0).expect("audit step");
    assert_eq!(second.repaired, 44, "{second:?}");
    let mut steps = 2;
    while !state
        .audit_step(&mut maps, 1.0)
        .expect("audit step")
        .pass_done
    {
        steps += 1;
        assert!(steps < 50, "the pass ends");
    }
    assert_eq!(contents(&maps), before);
}

/// 300 frontends, each with `n` endpoints of its own.
fn many_frontends(n: u8) -> NodeView {
    let mut view = NodeView::new();
    for i in 0..300u32 {
        let fe = Frontend {
            ip: IpAddr::from([10, 96, (i >> 8) as u8, i as u8]),
            port: 80,
            protocol: Protocol::Tcp,
        };
        let endpoints = (0..n)
            .map(|j| {
                SocketAddr::new(
                    IpAddr::from([10, 244, (i >> 4) as u8, (i as u8) << 4 | j]),
                    8080,
                )
            })
            .collect();
        let st = FrontendState::builder(format!("ns/s{i}:http"), FrontendKind::ClusterIp)
            .backend_set(BackendSet {
                endpoints,
                when_empty: WhenEmpty::Reject,
            })
            .schedule(if i % 3 == 0 {
                Schedule::new(Scheduler::Mh, Default::default(), 251)
            } else {
                Schedule::default()
            })
            .build();
        view.insert(fe, st);
    }
    view
}

/// The first programming of an empty node goes in batches and leaves the maps as
/// entry-by-entry writes do.
#[needs_root]
#[test]
fn a_first_programming_in_batches_writes_what_one_by_one_writes() {
    let view = many_frontends(5);
    let (_a_obj, mut a_maps) = bpf::load_private(&[]).expect("load");
    let (_b_obj, mut b_maps) = bpf::load_private(&[]).expect("load");
    let mut a = Mirror::adopt(&a_maps).expect("adopt");
    let mut b = Mirror::adopt(&b_maps).expect("adopt");
    let ra = a.apply(&mut a_maps, &view).expect("in batches");
    // Naming the changed frontends: entry by entry.
    let all: BTreeSet<Frontend> = view.keys().copied().collect();
    let rb = b
        .apply_changes(&mut b_maps, &view, Some(&all))
        .expect("one by one");
    assert_eq!(ra.frontends_written, 300);
    assert_eq!(rb.frontends_written, 300);
    assert_eq!(contents(&a_maps), contents(&b_maps));
    // And the batch-written maps adopt exactly.
    let mut adopted = Mirror::adopt(&a_maps).expect("adopt");
    let r = adopted.apply(&mut a_maps, &view).expect("again");
    assert_eq!((r.frontends_written, r.frontends_removed), (0, 0));
}

/// A first programming larger than the slot map: the batch stops, the mirror is read
/// back, and the next apply writes what fits one by one and names what does not; no
/// service entry points at slots that are not there.
#[needs_root]
#[test]
fn a_first_programming_that_does_not_fit_fails_whole_frontends_only() {
    let view = many_frontends(5);
    let (_obj, mut maps) =
        bpf::load_private(&[(proxy_common::map_names::BACKEND_SLOTS, 1_000)]).expect("load");
    let mut state = Mirror::adopt(&maps).expect("adopt");
    let err = state
        .apply(&mut maps, &view)
        .expect_err("1,500 slots do not fit in 1,000");
    assert!(format!("{err:#}").contains("in batches"), "{err:#}");
    let left = contents(&maps);
    assert_eq!(
        (left.slots, left.backends.len(), left.services.len()),
        (0, 0, 0),
        "taken back"
    );
    let report = state.apply(&mut maps, &view).expect("one by one");
    assert!(
        !report.failed.is_empty(),
        "the frontends that do not fit are named"
    );
    assert!(report.failed.len() < 300, "{}", report.failed.len());
    for (_, v) in maps.services.iter().filter_map(Result::ok) {
        for slot in 0..u32::from(v.count) {
            let k = BackendSlotKey {
                service_id: v.id,
                rev: v.rev,
                slot,
            };
            assert!(
                maps.slots.get(&k, 0).is_ok(),
                "entry {v:?} lacks slot {slot}"
            );
        }
    }
}

/// One UDP frontend with `endpoints` (10.244.0.N:53).
fn udp_view(endpoints: &[u8]) -> NodeView {
    let mut view = NodeView::new();
    let fe = Frontend {
        ip: IpAddr::from([10, 96, 0, 10]),
        port: 53,
        protocol: Protocol::Udp,
    };
    let st = FrontendState::builder("ns/dns:dns", FrontendKind::ClusterIp)
        .backend_set(BackendSet {
            endpoints: endpoints
                .iter()
                .map(|n| SocketAddr::new(IpAddr::from([10, 244, 0, *n]), 53))
                .collect(),
            when_empty: WhenEmpty::Reject,
        })
        .build();
    view.insert(fe, st);
    view
}

/// The endpoints that left a UDP frontend are reported once (their connected sockets are
/// destroyed); one that is back by the time they are taken is not: its sockets have a
/// live backend again.
#[needs_root]
#[test]
fn an_endpoint_that_left_a_udp_frontend_is_reported_unless_it_is_back() {
    let (_obj, mut maps) = bpf::load_private(&[]).expect("load");
    let mut state = Mirror::adopt(&maps).expect("adopt");
    state.apply(&mut maps, &udp_view(&[2, 3])).expect("apply");
    assert!(state.take_left_udp().is_empty());

    state.apply(&mut maps, &udp_view(&[2])).expect("apply");
    let left = state.take_left_udp();
    let addrs: Vec<[u32; 4]> = left.iter().map(|l| l.backend.addr).collect();
    assert_eq!(
        addrs,
        vec![[u32::from_ne_bytes([10, 244, 0, 3]), 0, 0, 0]],
        "{left:?}"
    );
    assert!(state.take_left_udp().is_empty(), "reported once");

    // Leaves, and is back before the records are taken (a sync in between failed).
    state.apply(&mut maps, &udp_view(&[3])).expect("apply");
    state.apply(&mut maps, &udp_view(&[2, 3])).expect("apply");
    let left = state.take_left_udp();
    assert!(left.is_empty(), "both are members again: {left:?}");
}

/// The first programming staged while the lists arrive: partial views (first a third of
/// the frontends with half their endpoints, then two thirds with all of them, and one
/// frontend the final view no longer has, and one whose Service came without endpoints
/// yet, which waits for the apply) write no service entry at all; the apply of
/// the whole view then leaves the maps exactly as an apply without staging, with nothing
/// left behind, and a later stage (something is live now) writes nothing.
#[needs_root]
#[test]
fn a_first_programming_staged_ahead_serves_nothing_early_and_ends_as_one_apply() {
    let mut full = many_frontends(6);
    let keys: Vec<Frontend> = full.keys().copied().collect();
    let waiting = Frontend {
        ip: IpAddr::from([10, 97, 0, 2]),
        port: 80,
        protocol: Protocol::Tcp,
    };
    let waiting_state = |endpoints: &[SocketAddr]| {
        FrontendState::builder("ns/waiting:http", FrontendKind::ClusterIp)
            .backends(endpoints.iter().copied())
            .build()
    };
    full.insert(
        waiting,
        waiting_state(&[SocketAddr::from(([10, 245, 0, 2], 80))]),
    );
    let mut first = NodeView::new();
    for fe in &keys[..100] {
        let mut st = full.get(fe).expect("frontend").clone();
        let half: Vec<SocketAddr> = st.backends.endpoints.iter().take(3).collect();
        st.backends.endpoints = half.into_iter().collect();
        first.insert(*fe, st);
    }
    let gone = Frontend {
        ip: IpAddr::from([10, 97, 0, 1]),
        port: 53,
        protocol: Protocol::Udp,
    };
    let gone_state = FrontendState::builder("ns/gone:dns", FrontendKind::ClusterIp)
        .backend_set(BackendSet {
            endpoints: [SocketAddr::from(([10, 245, 0, 1], 53))]
                .into_iter()
                .collect(),
            when_empty: WhenEmpty::Reject,
        })
        .build();
    first.insert(gone, gone_state);
    first.insert(waiting, waiting_state(&[]));
    let mut second = first.clone();
    for fe in &keys[..200] {
        second.insert(*fe, full.get(fe).expect("frontend").clone());
    }

    let (_a_obj, mut a_maps) = bpf::load_private(&[]).expect("load");
    let (_b_obj, mut b_maps) = bpf::load_private(&[]).expect("load");
    let mut a = Mirror::adopt(&a_maps).expect("adopt");
    let mut b = Mirror::adopt(&b_maps).expect("adopt");
    let mut staged_view = NodeView::new();
    for partial in [&first, &second] {
        let changed = staged_view.changed_frontends(partial);
        let staged = a.stage(&mut a_maps, partial, &changed).expect("stage");
        assert!(staged > 0, "something staged");
        let with_endpoints = changed.iter().filter(|fe| **fe != waiting).count();
        assert_eq!(
            staged, with_endpoints,
            "all but the frontend with no endpoint yet"
        );
        staged_view = partial.clone();
        assert_eq!(
            a_maps.services.keys().count(),
            0,
            "no service entry before the lists are complete"
        );
        assert!(a_maps.slots.keys().count() > 0, "slots written ahead");
        assert!(a_maps.backends.keys().count() > 0, "backends written ahead");
    }
    let ra = a.apply(&mut a_maps, &full).expect("apply after staging");
    let rb = b.apply(&mut b_maps, &full).expect("plain apply");
    assert!(ra.failed.is_empty() && rb.failed.is_empty());
    assert_eq!(ra.frontends_removed, 1, "the staged frontend the view lost");
    let (ca, cb) = (contents(&a_maps), contents(&b_maps));
    assert_eq!(ca.services.len(), 301);
    assert_eq!(ca, cb, "as an apply without staging: nothing left behind");
    assert!(
        a.take_left_udp().is_empty(),
        "a staged frontend served no flow: nothing to clear"
    );
    // Live now: a partial view must not touch it.
    let changed: BTreeSet<Frontend> = keys[..10].iter().copied().collect();
    assert_eq!(a.stage(&mut a_maps, &first, &changed).expect("stage"), 0);
    assert_eq!(contents(&a_maps), cb);
    // And the maps adopt exactly.
    let mut adopted = Mirror::adopt(&a_maps).expect("adopt");
    let r = adopted.apply(&mut a_maps, &full).expect("again");
    assert_eq!((r.frontends_written, r.frontends_removed), (0, 0));
}

/// An agent killed while it staged: the next one adopts maps with no service entry, stages
/// again (reusing the ids the dead one used) and its first apply still leaves the maps as
/// a plain apply does — memberships included — once its audit has removed what the dead
/// agent staged and nobody names.
#[needs_root]
#[test]
fn an_agent_killed_while_staging_leaves_nothing_its_successor_keeps() {
    let full = many_frontends(4);
    let mut half = NodeView::new();
    for (fe, st) in full.iter().take(150) {
        half.insert(*fe, st.clone());
    }
    let (_a_obj, mut a_maps) = bpf::load_private(&[]).expect("load");
    let (_b_obj, mut b_maps) = bpf::load_private(&[]).expect("load");
    let mut dead = Mirror::adopt(&a_maps).expect("adopt");
    let all_of_half: BTreeSet<Frontend> = half.keys().copied().collect();
    dead.stage(&mut a_maps, &half, &all_of_half).expect("stage");
    drop(dead);
    let mut next = Mirror::adopt(&a_maps).expect("adopt");
    let all: BTreeSet<Frontend> = full.keys().copied().collect();
    assert!(next.stage(&mut a_maps, &full, &all).expect("stage") > 0);
    next.apply(&mut a_maps, &full).expect("apply");
    for _ in 0..200 {
        if next.audit_step(&mut a_maps, 0.05).expect("audit").pass_done {
            break;
        }
    }
    let mut plain = Mirror::adopt(&b_maps).expect("adopt");
    plain.apply(&mut b_maps, &full).expect("apply");
    assert_eq!(contents(&a_maps), contents(&b_maps));
}
