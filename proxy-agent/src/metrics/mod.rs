//! The Prometheus text of `/metrics` (metricsBindAddress): kube-proxy's own metrics under
//! kube-proxy's names and types, so existing dashboards and alerts read this node as they
//! read kube-proxy; the process metrics every Go component exports; and ours, under
//! `proxy_agent_` (conntrack fill, BPF events by kind, interface attachments, traffic
//! per Service port).

mod kube_proxy;
mod ours;
mod process;
mod register;
mod service_stats;

use std::path::Path;

use prometheus_client::{encoding::text::encode, registry::Registry};

use crate::runner::Status;

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
    kube_proxy::kube_proxy(root.sub_registry_with_prefix("kubeproxy"), status);
    process::process(&mut root);
    ours::ours(
        root.sub_registry_with_prefix("proxy_agent"),
        status,
        options.maps_dir,
        options.service_metrics,
    );
    let mut out = String::new();
    encode(&mut out, &root)?;
    Ok(out)
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
