//! The agent's local HTTP endpoint: health, Prometheus metrics, and — in KPNG's spirit —
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
use prometheus_client::{encoding::text::encode, metrics::gauge::Gauge, registry::Registry};
use serde_json::json;

use crate::{dataplane::bpf::MapSet, model::NodeView, sync::Status};

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
    let mut app = Router::new().route("/healthz", get(healthz));
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

async fn healthz(State(s): State<AppState>) -> Response {
    let c = s.status.counters();
    let h = s.status.health(std::time::Instant::now());
    let code = if h.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let rfc3339 = |t: std::time::SystemTime| {
        k8s_openapi::chrono::DateTime::<k8s_openapi::chrono::Utc>::from(t).to_rfc3339()
    };
    (
        code,
        Json(json!({
            "lastUpdated": h.last_updated.map(rfc3339),
            "currentTime": rfc3339(std::time::SystemTime::now()),
            "pendingSeconds": h.pending_for.map(|d| d.as_secs_f64()),
            "syncsOk": c.syncs_ok,
            "syncsFailed": c.syncs_failed,
        })),
    )
        .into_response()
}

async fn model(State(s): State<AppState>) -> Response {
    match s.status.snapshot() {
        Some(snap) => Json(json!({
            "node": snap.node,
            "services": snap.model.services.values().collect::<Vec<_>>(),
            "endpointSlices": snap.model.slices.values().collect::<Vec<_>>(),
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
    let mut registry = Registry::with_prefix("proxy_agent");
    let c = s.status.counters();
    let gauge = |registry: &mut Registry, name: &str, help: &str, v: i64| {
        let g: Gauge = Gauge::default();
        g.set(v);
        registry.register(name, help, g);
    };
    gauge(
        &mut registry,
        "syncs_ok",
        "Successful dataplane syncs",
        c.syncs_ok as i64,
    );
    gauge(
        &mut registry,
        "syncs_failed",
        "Dataplane syncs with a failure",
        c.syncs_failed as i64,
    );
    gauge(
        &mut registry,
        "frontends_failed",
        "Frontends that could not be programmed",
        c.frontends_failed as i64,
    );
    gauge(
        &mut registry,
        "objects_rejected",
        "Invalid objects left out of the view",
        c.objects_rejected as i64,
    );
    gauge(
        &mut registry,
        "udp_sockets_destroyed",
        "Connected UDP sockets destroyed because their backend went away",
        c.udp_sockets_destroyed as i64,
    );
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
        (
            "conntrack_collected",
            "Entries the collector removed (expired flows, orphaned replies)",
            c.conntrack.collected_total,
        ),
    ] {
        gauge(&mut registry, name, help, v as i64);
    }
    gauge(
        &mut registry,
        "interface_attach_failures",
        "Classifier attachments to interfaces that failed",
        c.interface_attach_failures as i64,
    );
    gauge(
        &mut registry,
        "frontends",
        "Frontends in this node's view",
        s.status.view().len() as i64,
    );
    let h = s.status.histograms();
    registry.register(
        "sync_proxy_rules_duration_seconds",
        "Duration of dataplane syncs",
        h.sync,
    );
    registry.register(
        "network_programming_duration_seconds",
        "From an EndpointSlice change (last-change-trigger-time) to this node holding it",
        h.programming,
    );
    let millis: Gauge = Gauge::default();
    millis.set((c.last_sync_seconds * 1e6) as i64);
    registry.register(
        "last_sync_microseconds",
        "Duration of the last sync",
        millis,
    );
    if let Some(dir) = &s.maps_dir
        && let Ok(maps) = MapSet::open_pinned(dir)
        && let Ok(counters) = maps.counters()
    {
        for (name, value) in counters {
            gauge(
                &mut registry,
                &format!("bpf_{name}"),
                "BPF program event counter",
                value as i64,
            );
        }
    }
    let mut out = String::new();
    if encode(&mut out, &registry).is_err() {
        return (StatusCode::INTERNAL_SERVER_ERROR, "encoding metrics failed").into_response();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
