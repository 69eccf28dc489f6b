//! The Prometheus text of `/metrics` (metricsBindAddress): kube-proxy's own metrics under
//! kube-proxy's names and types, so existing dashboards and alerts read this node as they
//! read kube-proxy; the process metrics every Go component exports; and ours, under
//! `proxy_agent_` (conntrack fill, BPF events by kind, interface attachments, traffic
//! per Service port).

mod register;
mod service_stats;

use self::register::{Labels, counter, gauge, gauge_f64};

use std::{path::Path, sync::atomic::AtomicU64};

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::{dataplane::bpf::MapSet, runner::Status};

/// What `render_with` reads and includes.
#[derive(Clone, Copy, Debug, Default)]
pub struct RenderOptions<'a> {
    /// Pinned maps, for the BPF counters.
    pub maps_dir: Option<&'a Path>,
    /// The per-Service series (`proxy_agent_service_*`, labelled by namespace, Service and
    /// port): off on an address the whole network reaches (`http_server`).
    pub service_metrics: bool,
}

/// Renders every metric as of now, the per-Service series included.
pub fn render(status: &Status, maps_dir: Option<&Path>) -> Result<String, std::fmt::Error> {
    render_with(
        status,
        RenderOptions {
            maps_dir,
            service_metrics: true,
        },
    )
}

/// Renders the metrics `options` says.
pub fn render_with(status: &Status, options: RenderOptions<'_>) -> Result<String, std::fmt::Error> {
    let mut root = Registry::default();
    kube_proxy(root.sub_registry_with_prefix("kubeproxy"), status);
    process(&mut root);
    ours(
        root.sub_registry_with_prefix("proxy_agent"),
        status,
        options,
    );
    let mut out = String::new();
    encode(&mut out, &root)?;
    Ok(out)
}

/// kube-proxy's metrics, by its names, types and buckets.
fn kube_proxy(r: &mut Registry, status: &Status) {
    let c = status.counters();
    let h = status.histograms();
    r.register(
        "sync_proxy_rules_duration_seconds",
        "SyncProxyRules latency in seconds",
        h.sync,
    );
    r.register(
        "network_programming_duration_seconds",
        "In Cluster Network Programming Latency in seconds",
        h.programming_kube,
    );
    if let Some(t) = status.health(std::time::Instant::now()).last_updated {
        let secs = t
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        gauge_f64(
            r,
            "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            secs,
        );
    }
    counter(
        r,
        "sync_proxy_rules_service_changes",
        "Cumulative proxy rules Service changes",
        c.changes_seen.services,
    );
    counter(
        r,
        "sync_proxy_rules_endpoint_changes",
        "Cumulative proxy rules Endpoint changes",
        c.changes_seen.endpoint_slices,
    );
    gauge(
        r,
        "sync_proxy_rules_service_changes_pending",
        "Pending proxy rules Service changes",
        c.changes_seen
            .services
            .saturating_sub(c.changes_synced.services) as i64,
    );
    gauge(
        r,
        "sync_proxy_rules_endpoint_changes_pending",
        "Pending proxy rules Endpoint changes",
        c.changes_seen
            .endpoint_slices
            .saturating_sub(c.changes_synced.endpoint_slices) as i64,
    );
    let no_local = Family::<Labels, Gauge>::default();
    for ((policy, family), n) in &c.no_local_endpoints {
        no_local
            .get_or_create(&vec![
                ("traffic_policy".into(), (*policy).into()),
                ("address_family".into(), (*family).into()),
            ])
            .set(*n as i64);
    }
    r.register(
        "sync_proxy_rules_no_local_endpoints_total",
        "Number of services with a Local traffic policy and no endpoints",
        no_local,
    );
    for (name, help, answers) in [
        (
            "proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            &c.healthz_answers,
        ),
        (
            "proxy_livez",
            "Cumulative proxy livez HTTP status",
            &c.livez_answers,
        ),
    ] {
        let family = Family::<Labels, Counter>::default();
        for (code, n) in answers {
            family
                .get_or_create(&vec![("code".into(), code.to_string())])
                .inc_by(*n);
        }
        r.register(name, help, family);
    }
}

/// `process_*`, as client_golang's process collector exports them (Linux /proc).
fn process(r: &mut Registry) {
    let Ok(me) = procfs::process::Process::myself() else {
        return;
    };
    if let Ok(stat) = me.stat() {
        let ticks = procfs::ticks_per_second() as f64;
        let cpu: Counter<f64, AtomicU64> = Counter::default();
        cpu.inc_by((stat.utime + stat.stime) as f64 / ticks);
        r.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            cpu,
        );
        gauge(
            r,
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            (stat.rss * procfs::page_size()) as i64,
        );
        gauge(
            r,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            stat.vsize as i64,
        );
        if let Ok(boot) = procfs::boot_time_secs() {
            gauge_f64(
                r,
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                boot as f64 + stat.starttime as f64 / ticks,
            );
        }
    }
    if let Ok(n) = me.fd_count() {
        gauge(
            r,
            "process_open_fds",
            "Number of open file descriptors",
            n as i64,
        );
    }
    if let Ok(limits) = me.limits()
        && let procfs::process::LimitValue::Value(max) = limits.max_open_files.soft_limit
    {
        gauge(
            r,
            "process_max_fds",
            "Maximum number of open file descriptors",
            max as i64,
        );
    }
}

/// Ours: what kube-proxy has no name for.
fn ours(r: &mut Registry, status: &Status, options: RenderOptions<'_>) {
    let c = status.counters();
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
    if let Some(dir) = options.maps_dir
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
            Ok(totals) if options.service_metrics => {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxys_names_and_types() {
        let status = Status::default();
        status.count_health_answer(false, 200);
        status.count_health_answer(true, 503);
        let text = render(&status, None).expect("render");
        for line in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_network_programming_duration_seconds histogram",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\"} 0",
            "# TYPE kubeproxy_sync_proxy_rules_service_changes counter",
            "kubeproxy_sync_proxy_rules_service_changes_total 0",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 0",
            "kubeproxy_sync_proxy_rules_service_changes_pending 0",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
            "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
            "kubeproxy_proxy_livez_total{code=\"503\"} 1",
            "# TYPE process_cpu_seconds counter",
            "process_resident_memory_bytes ",
            "process_start_time_seconds ",
            "process_open_fds ",
            "proxy_agent_syncs_ok_total 0",
            "proxy_agent_conntrack_answered_entries 0",
            "proxy_agent_foreign_classifiers 0",
            "proxy_agent_hooks_repaired_total 0",
            "proxy_agent_stale_classifiers_removed_total 0",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        assert_eq!(
            crate::runner::latency::kube_proxy_programming_buckets().len(),
            2 + 59 + 12 + 7
        );
    }

    #[test]
    fn api_errors_by_resource_kind_and_code_and_relists_by_resource() {
        use crate::source::api_server::ApiErrorKind;
        let status = Status::default();
        let api = status.api_counters();
        api.watching("services");
        api.relist("nodes");
        api.error("services", ApiErrorKind::Watch, 504);
        api.error("services", ApiErrorKind::Watch, 504);
        api.error("endpointslices", ApiErrorKind::WatchStream, 0);
        let text = render(&status, None).expect("render");
        for line in [
            "# TYPE proxy_agent_api_errors counter",
            "proxy_agent_api_errors_total{resource=\"services\",kind=\"watch\",code=\"504\"} 2",
            "proxy_agent_api_errors_total{resource=\"endpointslices\",kind=\"watch_stream\",code=\"none\"} 1",
            "proxy_agent_api_relists_total{resource=\"services\"} 0",
            "proxy_agent_api_relists_total{resource=\"nodes\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
    }
}
