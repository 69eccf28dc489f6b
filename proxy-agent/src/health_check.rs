//! `healthCheckNodePort` servers: one HTTP listener per port of an
//! `externalTrafficPolicy: Local` Service, answering as kube-proxy's do — 200 with the
//! number of local endpoints, 503 when there is none or the proxy itself is unhealthy —
//! so load balancers send traffic only to nodes that can serve it. They listen on both
//! families (or on the node addresses `nodePortAddresses` names), retry a port that cannot
//! be opened, and come and go with the Services.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, RwLock},
    time::Duration,
};

use axum::{Json, Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::model::HealthCheck;

/// Whether the proxy itself is healthy now (a listener answers 503 when it is not).
pub type ProxyHealthy = Arc<dyn Fn() -> bool + Send + Sync>;

/// How long a listener that could not open waits before trying again.
const LISTEN_RETRY: Duration = Duration::from_secs(5);

#[derive(Clone)]
struct Shared {
    check: Arc<RwLock<HealthCheck>>,
    healthy: ProxyHealthy,
}

struct Server {
    check: Arc<RwLock<HealthCheck>>,
    /// Where it listens (`None`: every address of both families).
    addresses: Option<Vec<IpAddr>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The running health-check listeners.
pub struct HealthServers {
    servers: BTreeMap<u16, Server>,
    healthy: ProxyHealthy,
}

impl HealthServers {
    pub fn new(healthy: ProxyHealthy) -> Self {
        Self {
            servers: BTreeMap::new(),
            healthy,
        }
    }

    /// Starts, updates and stops listeners to match `checks`, on `addresses` (`None`:
    /// every address).
    pub fn update(&mut self, checks: &BTreeMap<u16, HealthCheck>, addresses: Option<&[IpAddr]>) {
        let addresses = addresses.map(<[IpAddr]>::to_vec);
        self.servers.retain(|port, server| {
            let keep = checks.contains_key(port) && server.addresses == addresses;
            if !keep {
                tracing::info!(port, "health-check port closed");
            }
            keep
        });
        for (port, check) in checks {
            if let Some(server) = self.servers.get(port) {
                *server.check.write().unwrap_or_else(|p| p.into_inner()) = check.clone();
                continue;
            }
            let shared = Shared {
                check: Arc::new(RwLock::new(check.clone())),
                healthy: Arc::clone(&self.healthy),
            };
            let app = Router::new()
                .fallback(get(answer))
                .with_state(shared.clone());
            let binds: Vec<SocketAddr> = match &addresses {
                // [::] takes IPv4 too (bindv6only=0); 0.0.0.0 if IPv6 is off.
                None => vec![SocketAddr::from((Ipv6Addr::UNSPECIFIED, *port))],
                Some(ips) => ips.iter().map(|ip| SocketAddr::new(*ip, *port)).collect(),
            };
            let tasks = binds
                .into_iter()
                .map(|addr| tokio::spawn(serve_retrying(addr, app.clone(), "health-check port")))
                .collect();
            self.servers.insert(
                *port,
                Server {
                    check: shared.check,
                    addresses: addresses.clone(),
                    tasks,
                },
            );
        }
    }
}

/// Serves `app` on `addr` until the task is dropped, opening the port again every
/// `LISTEN_RETRY` while it cannot be opened (another process holds it) or after the
/// server fails, each time logged with `what` — the healthCheckNodePort listeners and the
/// agent's own health and metrics addresses alike (kube-proxy logs and retries both when
/// a port is taken).
pub async fn serve_retrying(addr: SocketAddr, app: Router, what: &'static str) {
    loop {
        match bind(addr).await {
            Ok(listener) => {
                tracing::info!(%addr, "{what} open");
                if let Err(e) = axum::serve(listener, app.clone()).await {
                    tracing::error!(%addr, error = %e, "{what} failed; opening it again");
                }
            }
            Err(e) => tracing::error!(
                %addr,
                error = %e,
                retry_in = ?LISTEN_RETRY,
                "cannot open {what}; retrying"
            ),
        }
        tokio::time::sleep(LISTEN_RETRY).await;
    }
}

async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind(addr).await {
        Err(e) if addr.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) => {
            let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, addr.port()));
            tracing::debug!(error = %e, "no IPv6 wildcard; listening on IPv4 only");
            tokio::net::TcpListener::bind(v4).await
        }
        other => other,
    }
}

async fn answer(State(shared): State<Shared>) -> impl IntoResponse {
    let check = shared
        .check
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let healthy = (shared.healthy)();
    let code = if check.local_endpoints > 0 && healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "service": {"namespace": check.service.namespace, "name": check.service.name},
        "localEndpoints": check.local_endpoints,
        "serviceProxyHealthy": healthy,
    });
    (code, Json(body))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::{model::ObjectRef, runner::Status};

    /// The status code of `GET /` on `addr`, or `None` if nothing answers.
    async fn status_code(addr: SocketAddr) -> Option<u16> {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        out.split_whitespace().nth(1)?.parse().ok()
    }

    async fn eventually(addr: SocketAddr, want: u16) {
        let deadline = tokio::time::Instant::now() + LISTEN_RETRY * 3;
        loop {
            let got = status_code(addr).await;
            if got == Some(want) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{addr}: wanted {want}, got {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn check(local_endpoints: usize) -> BTreeMap<u16, HealthCheck> {
        let service = ObjectRef {
            namespace: "default".into(),
            name: "web".into(),
        };
        let port = 0; // replaced by the caller
        [(
            port,
            HealthCheck {
                service,
                local_endpoints,
            },
        )]
        .into()
    }

    fn on(port: u16, checks: BTreeMap<u16, HealthCheck>) -> BTreeMap<u16, HealthCheck> {
        checks.into_values().map(|c| (port, c)).collect()
    }

    #[tokio::test]
    async fn answers_on_both_families_retries_a_taken_port_and_fails_when_unhealthy() {
        // A port someone else holds: the server retries until it is free.
        let squatter = std::net::TcpListener::bind("[::]:0").expect("bind");
        let port = squatter.local_addr().expect("addr").port();
        let status = Status::default();
        // The probe the runner gives the listeners: its own health.
        let mut servers = HealthServers::new(status.health_probe());
        servers.update(&on(port, check(1)), None);
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(squatter);
        let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
        eventually(v4, 200).await;
        eventually(v6, 200).await;

        // No local endpoint: 503.
        servers.update(&on(port, check(0)), None);
        eventually(v4, 503).await;

        // The proxy itself unhealthy (a change pending for too long): 503 with endpoints.
        servers.update(&on(port, check(2)), None);
        eventually(v6, 200).await;
        status.set_health_timeout(Duration::from_millis(1));
        status.queued(std::time::Instant::now() - Duration::from_secs(1));
        eventually(v6, 503).await;
        status.updated();
        eventually(v6, 200).await;

        // nodePortAddresses: only the addresses it names.
        servers.update(
            &on(port, check(1)),
            Some(&[IpAddr::V4(Ipv4Addr::LOCALHOST)]),
        );
        eventually(v4, 200).await;
        assert_eq!(
            status_code(v6).await,
            None,
            "listening beyond nodePortAddresses"
        );

        // The Service goes: the port closes.
        servers.update(&BTreeMap::new(), None);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(status_code(v4).await, None);
    }
}
