//! `proxy-agent serve`'s `/metrics` (Prometheus text from the hub's counts) and
//! `/healthz`: 503 while the server has no view to give (before the first full list, and
//! while the API watch has failed past its bound), as its streams refuse nodes then.

use std::sync::Arc;

use super::{Cut, Hub, HubCounts};

/// The server's `/metrics` (Prometheus text) from the hub's counts.
pub fn metrics_text(s: &HubCounts) -> String {
    let series: [(&str, &str, &str, u64); 9] = [
        (
            "proxy_agent_feed_ready",
            "gauge",
            "1 once the source's first full list is in",
            u64::from(s.ready),
        ),
        (
            "proxy_agent_feed_api_lost",
            "gauge",
            "1 while the API server watch has failed past its bound (no stream is served)",
            u64::from(s.api_lost),
        ),
        (
            "proxy_agent_feed_revision",
            "gauge",
            "The server's latest revision",
            s.revision,
        ),
        (
            "proxy_agent_feed_objects",
            "gauge",
            "Services and EndpointSlices held",
            s.objects as u64,
        ),
        (
            "proxy_agent_feed_nodes_connected",
            "gauge",
            "Nodes with an open stream",
            s.nodes_connected as u64,
        ),
        (
            "proxy_agent_feed_snapshots_total",
            "counter",
            "Snapshots sent",
            s.snapshots_sent,
        ),
        (
            "proxy_agent_feed_resumes_total",
            "counter",
            "Streams resumed from a node's revision",
            s.resumes,
        ),
        (
            "proxy_agent_feed_overflows_total",
            "counter",
            "Snapshots given instead of ops to a node past its pending bound",
            s.overflows,
        ),
        (
            "proxy_agent_feed_sent_bytes_total",
            "counter",
            "Bytes of batches handed to the nodes' streams",
            s.bytes_sent,
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in series {
        out.push_str(&format!(
            "# HELP {name} {help}.\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    }
    let cuts = "proxy_agent_feed_cuts_total";
    out.push_str(&format!(
        "# HELP {cuts} Streams and connections refused or cut, by reason.\n# TYPE {cuts} counter\n"
    ));
    for cut in Cut::ALL {
        out.push_str(&format!(
            "{cuts}{{reason=\"{}\"}} {}\n",
            cut.as_str(),
            s.cuts.get(cut)
        ));
    }
    out
}

/// `/metrics`, and `/healthz` answering 503 (and why) while there is no view to give.
pub fn app(hub: Arc<Hub>) -> axum::Router {
    use axum::{http::StatusCode, routing::get};
    let metrics_hub = Arc::clone(&hub);
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let text = metrics_text(&metrics_hub.counts());
                async move { text }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let why = hub.no_view_reason();
                async move {
                    match why {
                        None => (StatusCode::OK, "ok"),
                        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
                    }
                }
            }),
        )
}
