//! The agent's HTTP server (kube-proxy's healthz and metrics addresses): health, Prometheus
//! metrics, and — in KPNG's spirit, on a loopback metrics address or the debug address —
//! the global model, this node's view, a live stream of view diffs, and the per-Service
//! series.

use std::{convert::Infallible, net::SocketAddr, path::PathBuf};

use anyhow::{Context as _, Result};
use axum::{
    Json, Router,
    body::Body,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use serde_json::json;

use crate::{model::NodeView, runner::Status};

#[derive(Clone)]
struct AppState {
    status: Status,
    /// Pinned maps, read per scrape for the BPF counters.
    maps_dir: Option<PathBuf>,
    /// Whether `/metrics` has the per-Service series.
    service_metrics: bool,
}

/// What one listening address serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    /// kube-proxy's healthzBindAddress: `/healthz`, `/livez`.
    Healthz,
    /// kube-proxy's metricsBindAddress: `/metrics`, `/healthz`, `/livez` and — on a
    /// loopback address only — the object views `/debug/model`, `/debug/view`,
    /// `/debug/watch`.
    Metrics,
    /// An extra debug endpoint (`ebpf.debugBindAddress`, off by default): the same,
    /// object views included wherever it listens (opting in is the operator's choice).
    Debug,
}

impl Endpoints {
    /// Whether `/metrics` on `addr` has the per-Service series (`proxy_agent_service_*`,
    /// labelled by namespace, Service and port): where the object views are served, or
    /// everywhere when the operator asks (`ebpf.serviceMetrics`). kube-proxy's metrics
    /// name no Service: on `0.0.0.0` they would list every Service's name to anyone who
    /// reaches the node, and their cardinality grows with the cluster.
    pub fn serves_service_metrics(self, addr: &SocketAddr, opted_in: bool) -> bool {
        self != Endpoints::Healthz && (opted_in || self.serves_objects(addr))
    }

    /// Whether the object views — every Service and EndpointSlice of the cluster — are
    /// served on `addr`. kube-proxy serves no objects on its metrics address, and
    /// `metricsBindAddress: 0.0.0.0:10249` is common (for scraping): there they would be
    /// open to anyone who reaches the node, so the metrics address serves them only when
    /// it is loopback (the default, 127.0.0.1:10249, where `dump --view` asks).
    pub fn serves_objects(self, addr: &SocketAddr) -> bool {
        match self {
            Endpoints::Healthz => false,
            Endpoints::Metrics => addr.ip().is_loopback(),
            Endpoints::Debug => true,
        }
    }

    /// What the logs call this address.
    fn name(self) -> &'static str {
        match self {
            Endpoints::Healthz => "healthz address",
            Endpoints::Metrics => "metrics address",
            Endpoints::Debug => "debug address",
        }
    }
}

/// The object views' paths.
pub const OBJECT_VIEWS: [&str; 3] = ["/debug/model", "/debug/view", "/debug/watch"];

/// Serves `endpoints` on `addr` until the process ends; a port that cannot be opened (taken
/// by another process) is tried again every few seconds, as kube-proxy does. Fails only
/// on an address that does not parse.
pub async fn serve(
    addr: &str,
    endpoints: Endpoints,
    status: Status,
    maps_dir: Option<PathBuf>,
    service_metrics_everywhere: bool,
) -> Result<()> {
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("listen address {addr:?} ({})", endpoints.name()))?;
    let service_metrics = endpoints.serves_service_metrics(&addr, service_metrics_everywhere);
    let mut app = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez));
    if endpoints != Endpoints::Healthz {
        app = app
            .route("/metrics", get(metrics))
            .route("/proxyMode", get(proxy_mode));
        if endpoints.serves_objects(&addr) {
            app = app
                .route("/debug/model", get(model))
                .route("/debug/view", get(view))
                .route("/debug/watch", get(watch));
        } else {
            tracing::info!(
                %addr,
                service_metrics,
                "the metrics address is not loopback: the object views ({}) are not served \
                 there (ebpf.debugBindAddress serves them), nor the per-Service series \
                 unless ebpf.serviceMetrics is set",
                OBJECT_VIEWS.join(", ")
            );
            for path in OBJECT_VIEWS {
                app = app.route(path, get(objects_not_here));
            }
        }
    }
    let app = app.with_state(AppState {
        status,
        maps_dir,
        service_metrics,
    });
    crate::health_check::serve_retrying(addr, app, endpoints.name()).await;
    Ok(())
}

/// The object views asked for on a metrics address that is not loopback.
async fn objects_not_here() -> Response {
    (
        StatusCode::NOT_FOUND,
        "the object views are served on a loopback metricsBindAddress or on \
         ebpf.debugBindAddress only\n",
    )
        .into_response()
}

/// kube-proxy's `/healthz`: the proxy is healthy and the node is not draining (and, ours,
/// no other agent's classifier shares our interfaces).
async fn healthz(State(s): State<AppState>) -> Response {
    health_answer(&s.status, false)
}

/// kube-proxy's `/livez`: the proxy alone (a draining node is still alive).
/// kube-proxy's `/proxyMode` on its metrics address (what Kubernetes' e2e specs and
/// tooling ask a node's proxy): ours is neither iptables, ipvs nor nftables.
pub const PROXY_MODE: &str = "ebpf";

async fn proxy_mode() -> &'static str {
    PROXY_MODE
}

async fn livez(State(s): State<AppState>) -> Response {
    health_answer(&s.status, true)
}

fn health_answer(status: &Status, livez: bool) -> Response {
    let c = status.counters();
    let h = status.health(std::time::Instant::now());
    let ok = if livez { h.healthy } else { h.serving() };
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    status.count_health_answer(livez, code.as_u16());
    let rfc3339 = |t: std::time::SystemTime| {
        k8s_openapi::chrono::DateTime::<k8s_openapi::chrono::Utc>::from(t).to_rfc3339()
    };
    let mut body = json!({
        "lastUpdated": h.last_updated.map(rfc3339),
        "currentTime": rfc3339(std::time::SystemTime::now()),
        "pendingSeconds": h.pending_for.map(|d| d.as_secs_f64()),
        "syncsOk": c.syncs_ok,
        "syncsFailed": c.syncs_failed,
    });
    if !livez {
        body["nodeEligible"] = json!(h.node_eligible);
    }
    if !h.foreign_classifiers.is_empty() {
        body["foreignClassifiers"] = json!(h.foreign_classifiers);
    }
    (code, Json(body)).into_response()
}

async fn model(State(s): State<AppState>) -> Response {
    match s.status.snapshot() {
        Some(snap) => Json(json!({
            "node": snap.node,
            "services": snap.model.services()
                .map(|(r, svc)| json!({"object": r, "service": svc}))
                .collect::<Vec<_>>(),
            "endpointSlices": snap.model.slices()
                .map(|(k, slice)| json!({"object": k.object(), "slice": slice}))
                .collect::<Vec<_>>(),
        }))
        .into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "no complete model yet\n").into_response(),
    }
}

/// The view as a list (frontends as strings make readable JSON keys).
pub fn view_json(view: &NodeView) -> serde_json::Value {
    view.iter()
        .map(|(fe, st)| json!({"frontend": fe.to_string(), "state": st}))
        .collect()
}

async fn view(State(s): State<AppState>) -> Response {
    Json(view_json(&s.status.view())).into_response()
}

async fn watch(State(s): State<AppState>) -> Response {
    let rx = s.status.subscribe();
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let line = match rx.recv().await {
            Ok(line) => format!("{line}\n"),
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                format!("# {n} lines dropped (slow reader)\n")
            }
            Err(_) => return None,
        };
        Some((Ok::<_, Infallible>(line), rx))
    });
    (
        [(header::CONTENT_TYPE, "text/plain")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    let options = crate::metrics::RenderOptions {
        maps_dir: s.maps_dir.as_deref(),
        service_metrics: s.service_metrics,
    };
    match crate::metrics::render_with(&s.status, options) {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "encoding metrics failed").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_views_only_on_a_loopback_metrics_address_or_the_debug_address() {
        let sa = |s: &str| s.parse::<SocketAddr>().expect("address");
        for (addr, metrics) in [
            ("127.0.0.1:10249", true),
            ("127.0.0.53:10249", true),
            ("[::1]:10249", true),
            ("0.0.0.0:10249", false),
            ("[::]:10249", false),
            ("10.0.0.5:10249", false),
            ("[fd00::5]:10249", false),
        ] {
            let addr = sa(addr);
            assert_eq!(Endpoints::Metrics.serves_objects(&addr), metrics, "{addr}");
            assert!(Endpoints::Debug.serves_objects(&addr), "{addr}");
            assert!(!Endpoints::Healthz.serves_objects(&addr), "{addr}");
            // Per-Service series where the objects are, or everywhere when asked.
            assert_eq!(
                Endpoints::Metrics.serves_service_metrics(&addr, false),
                metrics,
                "{addr}"
            );
            assert!(Endpoints::Metrics.serves_service_metrics(&addr, true));
            assert!(Endpoints::Debug.serves_service_metrics(&addr, false));
            assert!(!Endpoints::Healthz.serves_service_metrics(&addr, true));
        }
    }
}
