//! The agent's HTTP server (kube-proxy's healthz and metrics addresses): health, Prometheus
//! metrics, and — as kube-proxy serves its debug handlers there, in KPNG's spirit —
//! the global model, this node's view, and a live stream of view diffs.

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
}

/// What one listening address serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    /// kube-proxy's healthzBindAddress: `/healthz`.
    Healthz,
    /// kube-proxy's metricsBindAddress: `/metrics`, `/healthz` and — as kube-proxy serves
    /// its own debug handlers there — `/debug/model`, `/debug/view`, `/debug/watch`.
    Metrics,
    /// An extra debug endpoint (`ebpf.debugBindAddress`, off by default): the same.
    Debug,
}

/// Serves `endpoints` on `addr` until the process ends.
pub async fn serve(
    addr: &str,
    endpoints: Endpoints,
    status: Status,
    maps_dir: Option<PathBuf>,
) -> Result<()> {
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("listen address {addr:?}"))?;
    let mut app = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez));
    if endpoints != Endpoints::Healthz {
        app = app
            .route("/metrics", get(metrics))
            .route("/debug/model", get(model))
            .route("/debug/view", get(view))
            .route("/debug/watch", get(watch));
    }
    let app = app.with_state(AppState { status, maps_dir });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the debug endpoint on {addr}"))?;
    tracing::info!(%addr, ?endpoints, "listening");
    axum::serve(listener, app).await?;
    Ok(())
}

/// kube-proxy's `/healthz`: the proxy is healthy and the node is not draining (and, ours,
/// no other agent's classifier shares our interfaces).
async fn healthz(State(s): State<AppState>) -> Response {
    health_answer(&s.status, false)
}

/// kube-proxy's `/livez`: the proxy alone (a draining node is still alive).
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
    match crate::metrics::render(&s.status, s.maps_dir.as_deref()) {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "encoding metrics failed").into_response(),
    }
}
