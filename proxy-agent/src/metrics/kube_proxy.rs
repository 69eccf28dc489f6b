//! kube-proxy's own metrics under its names, types and buckets, so existing dashboards
//! and alerts read this node as they read kube-proxy.

use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::register::{Labels, counter, gauge, gauge_f64};
use crate::runner::Status;

/// kube-proxy's metrics, by its names, types and buckets.
pub fn kube_proxy(r: &mut Registry, status: &Status) {
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
