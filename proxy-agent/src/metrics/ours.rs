//! Ours, under `proxy_agent_`: what kube-proxy has no name for — the runner's and the
//! dataplane's counts, the flow tables, the interfaces, the BPF programs' events and
//! maps, the API client's errors, and the per-Service traffic.

use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use std::path::Path;

use super::{
    register::{Labels, counter, gauge},
    service_stats,
};
use crate::{
    dataplane::{ErrorKind, bpf::MapSet},
    runner::{Status, status::Counters},
};

/// Ours: what kube-proxy has no name for.
/// `maps_dir`: the pinned maps, for the BPF counters; `service_metrics`: the per-Service
/// series too.
pub fn ours(r: &mut Registry, status: &Status, maps_dir: Option<&Path>, service_metrics: bool) {
    let c = status.counters();
    runner_counts(r, &c);
    flow_tables(r, &c);
    interfaces(r, status, &c);
    programming(r, status, &c);
    bpf(r, status, maps_dir, service_metrics);
    api(r, &c);
    dataplane_errors(r, &c);
    map_entries(r, &c);
}

/// The runner's and the dataplane's counts since start.
fn runner_counts(r: &mut Registry, c: &Counters) {
    for (name, help, v) in [
        ("syncs_ok", "Successful dataplane syncs", c.syncs_ok),
        (
            "syncs_failed",
            "Dataplane syncs with a failure",
            c.syncs_failed,
        ),
        (
            "frontends_failed",
            "Frontends that could not be programmed",
            c.frontends_failed,
        ),
        (
            "frontends_refused",
            "Frontends the dataplane can never hold as their Service asks (more backend \
             slots than a frontend has): left as they were, not retried",
            c.frontends_refused,
        ),
        (
            "frontends_adjusted",
            "Frontends programmed otherwise than their Service asks (wrr weights scaled \
             down to fit a frontend's backend slots)",
            c.frontends_adjusted,
        ),
        (
            "objects_rejected",
            "Invalid objects left out of the view",
            c.objects_rejected,
        ),
        (
            "udp_sockets_destroyed",
            "Connected UDP sockets destroyed because their backend went away",
            c.udp_sockets_destroyed,
        ),
        (
            "audit_passes",
            "Passes of the audit that compares the dataplane with what was programmed",
            c.audit_passes,
        ),
        (
            "audit_frontends_repaired",
            "Frontends the audit found lost or changed in the dataplane, written again",
            c.audit_repaired,
        ),
        (
            "audit_entries_removed",
            "Dataplane entries the audit found no programmed frontend owns, removed",
            c.audit_removed,
        ),
        (
            "interface_attach_failures",
            "Classifier attachments to interfaces that failed",
            c.interface_attach_failures,
        ),
        (
            "events_failed",
            "Events (the Starting event) the API server did not record",
            c.events_failed,
        ),
        (
            "hooks_repaired",
            "Hooks of ours found lost (pin deleted, link detached, filter deleted) and \
             attached again",
            c.hooks_repaired,
        ),
        (
            "stale_classifiers_removed",
            "Classifiers of other pin folders whose agent is gone, taken off our interfaces",
            c.stale_classifiers_removed,
        ),
        (
            "conntrack_collected",
            "Entries the collector removed (expired flows, orphaned replies)",
            c.conntrack.collected_total,
        ),
        (
            "conntrack_evicted",
            "Entries of live answered flows the collector removed to keep 10% of the answered table free, the idlest first",
            c.conntrack.evicted_total,
        ),
    ] {
        counter(r, name, help, v);
    }
}

/// The flow tables' fill.
fn flow_tables(r: &mut Registry, c: &Counters) {
    for (name, help, v) in [
        (
            "conntrack_answered_entries",
            "Entries (two per flow) in the table of answered flows",
            c.conntrack.answered,
        ),
        (
            "conntrack_answered_capacity",
            "Capacity of the table of answered flows",
            c.conntrack.answered_capacity,
        ),
        (
            "conntrack_new_entries",
            "Entries in the table of flows not answered yet (LRU)",
            c.conntrack.new,
        ),
        (
            "conntrack_new_capacity",
            "Capacity of the table of flows not answered yet",
            c.conntrack.new_capacity,
        ),
    ] {
        gauge(r, name, help, v as i64);
    }
}

/// Whose classifiers sit on our interfaces, and where XDP runs.
fn interfaces(r: &mut Registry, status: &Status, c: &Counters) {
    gauge(
        r,
        "foreign_classifiers",
        "Classifiers of other agents on the interfaces we serve, left in place (/healthz \
         fails while there is one)",
        c.foreign_classifiers as i64,
    );
    let xdp = status.xdp();
    let attached = Family::<Labels, Gauge>::default();
    for (interface, how) in xdp.running() {
        // One series per served interface: bounded by the node's devices.
        attached
            .get_or_create(&vec![
                ("interface".into(), interface),
                ("mode".into(), how.as_str().to_string()),
            ])
            .set(1);
    }
    r.register(
        "xdp_attached",
        "Interfaces running the XDP program, by mode (native: in the driver; generic:          after the skb is made)",
        attached,
    );
    counter(
        r,
        "xdp_generic_fallbacks",
        "Interfaces where ebpf.xdp: best-effort found no native XDP and ran generic",
        xdp.fallbacks(),
    );
}

/// The view's size and how long programming it takes.
fn programming(r: &mut Registry, status: &Status, c: &Counters) {
    gauge(
        r,
        "frontends",
        "Frontends in this node's view",
        status.view().len() as i64,
    );
    let h = status.histograms();
    r.register(
        "network_programming_duration_seconds",
        "From an EndpointSlice change (last-change-trigger-time) to this node holding it, \
         in buckets from 1 ms",
        h.programming,
    );
    gauge(
        r,
        "last_sync_microseconds",
        "Duration of the last sync",
        (c.last_sync_seconds * 1e6) as i64,
    );
}

/// The BPF programs' events, the maps' capacity and memory, the per-Service traffic
/// (from the pinned maps, when there are).
fn bpf(r: &mut Registry, status: &Status, maps_dir: Option<&Path>, service_metrics: bool) {
    if let Some(dir) = maps_dir
        && let Ok(maps) = MapSet::open_pinned(dir)
        && let Ok(counters) = maps.counters()
    {
        let events = Family::<Labels, Counter>::default();
        for (name, value) in counters {
            events
                .get_or_create(&vec![("event".into(), name.to_string())])
                .inc_by(value);
        }
        r.register(
            "bpf_events",
            "Events counted by the BPF programs (translations, drops by reason, conntrack)",
            events,
        );
        let capacity = Family::<Labels, Gauge>::default();
        for (name, max) in maps.service_capacities() {
            capacity
                .get_or_create(&vec![("map".into(), name.to_string())])
                .set(i64::from(max));
        }
        r.register(
            "bpf_map_capacity",
            "Capacity of the service-side BPF maps (ebpf.mapSizes)",
            capacity,
        );
        let memory = Family::<Labels, Gauge>::default();
        for (name, bytes) in crate::dataplane::bpf::maps::memory(dir) {
            memory
                .get_or_create(&vec![("map".into(), name.to_string())])
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        r.register(
            "bpf_map_memory_bytes",
            "Memory of each pinned BPF map as the kernel charges it (fdinfo memlock)",
            memory,
        );
        match crate::dataplane::bpf::stats::frontend_totals(&maps) {
            Ok(totals) if service_metrics => {
                // One exporter per process: what its scrapes showed, per Service port.
                static HIGH_WATER: std::sync::Mutex<service_stats::HighWater> =
                    std::sync::Mutex::new(service_stats::HighWater::new());
                let mut high = HIGH_WATER.lock().unwrap_or_else(|e| e.into_inner());
                service_stats::register(r, &totals, &status.view(), &mut high);
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = format!("{e:#}"), "no Service statistics"),
        }
    }
}

/// The API client's errors and relists.
/// Dataplane calls that failed, by call and kind: every kind of `apply` from zero, so a
/// rate is defined before the first failure.
fn dataplane_errors(r: &mut Registry, c: &Counters) {
    let errors = Family::<Labels, Counter>::default();
    let labels = |call: &str, kind: ErrorKind| {
        vec![
            ("call".into(), call.to_string()),
            ("kind".into(), kind.name().to_string()),
        ]
    };
    for kind in ErrorKind::ALL {
        let _ = errors.get_or_create(&labels("apply", kind));
    }
    for ((call, kind), n) in &c.dataplane_errors {
        errors.get_or_create(&labels(call, *kind)).inc_by(*n);
    }
    r.register(
        "dataplane_errors",
        "Dataplane calls that failed, by call (apply, stage, configure, resync, audit) \
         and kind (load, attach, map, netlink, kernel, setting, io)",
        errors,
    );
}

fn api(r: &mut Registry, c: &Counters) {
    let api_errors = Family::<Labels, Counter>::default();
    for ((resource, kind, code), n) in &c.api.errors {
        let code = match code {
            0 => "none".to_string(),
            c => c.to_string(),
        };
        api_errors
            .get_or_create(&vec![
                ("resource".into(), resource.to_string()),
                ("kind".into(), kind.as_str().to_string()),
                ("code".into(), code),
            ])
            .inc_by(*n);
    }
    r.register(
        "api_errors",
        "API requests that failed, by resource, kind (list, watch_start, watch, \
         watch_stream, event_too_large, list_too_large, no_resource_version, retry_after) and HTTP status \
         (none: no answer)",
        api_errors,
    );
    let relists = Family::<Labels, Counter>::default();
    for (resource, n) in &c.api.relists {
        relists
            .get_or_create(&vec![("resource".into(), resource.to_string())])
            .inc_by(*n);
    }
    r.register(
        "api_relists",
        "Lists of a resource after its first: a watch that could not go on (410 Gone, an \
         error answer, an event over 16 MiB)",
        relists,
    );
}

/// Entries in the service-side maps, as the writer's mirror counts them.
fn map_entries(r: &mut Registry, c: &Counters) {
    let entries = Family::<Labels, Gauge>::default();
    for (name, n) in [
        ("SERVICES", c.maps.services),
        ("REV_NAT", c.maps.services),
        ("BACKEND_SLOTS", c.maps.backend_slots),
        ("MEMBERS", c.maps.backend_slots),
        ("BACKENDS", c.maps.backends),
    ] {
        entries
            .get_or_create(&vec![("map".into(), name.to_string())])
            .set(n as i64);
    }
    r.register(
        "bpf_map_entries",
        "Entries in the service-side BPF maps, as of the last sync (a full map refuses \
         the frontends that do not fit: proxy_agent_frontends_failed)",
        entries,
    );
}
