//! `healthCheckNodePort` servers: one HTTP listener per port of an
//! `externalTrafficPolicy: Local` Service, answering as kube-proxy's do — 200 with the
//! number of local endpoints, 503 when there is none — so load balancers send traffic
//! only to nodes that can serve it. Listeners come and go with the Services.

use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock},
};

use axum::{Json, Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::model::HealthCheck;

type Shared = Arc<RwLock<Option<HealthCheck>>>;

/// The running health-check listeners.
#[derive(Default)]
pub struct HealthServers {
    servers: BTreeMap<u16, (Shared, JoinHandle<()>)>,
}

impl HealthServers {
    /// Starts, updates and stops listeners to match `checks`.
    pub fn update(&mut self, checks: &BTreeMap<u16, HealthCheck>) {
        self.servers.retain(|port, (_, task)| {
            let keep = checks.contains_key(port);
            if !keep {
                task.abort();
                tracing::info!(port, "health-check port closed");
            }
            keep
        });
        for (port, check) in checks {
            if let Some((state, _)) = self.servers.get(port) {
                *state.write().unwrap_or_else(|p| p.into_inner()) = Some(check.clone());
                continue;
            }
            let state: Shared = Arc::new(RwLock::new(Some(check.clone())));
            let app = Router::new()
                .fallback(get(answer))
                .with_state(state.clone());
            let port = *port;
            let task = tokio::spawn(async move {
                match tokio::net::TcpListener::bind(("0.0.0.0", port)).await {
                    Ok(listener) => {
                        tracing::info!(port, "health-check port open");
                        let _ = axum::serve(listener, app).await;
                    }
                    // Reported, and retried at the next update only if the port changes:
                    // kube-proxy logs the same way when a port is taken.
                    Err(e) => tracing::error!(port, error = %e, "cannot open health-check port"),
                }
            });
            self.servers.insert(port, (state, task));
        }
    }
}

async fn answer(State(state): State<Shared>) -> impl IntoResponse {
    let check = state.read().unwrap_or_else(|p| p.into_inner()).clone();
    let Some(check) = check else {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({}))).into_response();
    };
    let code = if check.local_endpoints > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "service": {"namespace": check.service.namespace, "name": check.service.name},
        "localEndpoints": check.local_endpoints,
        "serviceProxyHealthy": true,
    });
    (code, Json(body)).into_response()
}
