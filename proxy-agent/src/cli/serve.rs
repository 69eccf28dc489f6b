//! `proxy-agent serve`: watch once, serve every node its part (KPNG's split): the
//! source (the API server, or files for tests), the hub, and the feed's gRPC server.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;
use proxy_agent::{
    fanout::{self, Hub, HubOptions, grpc},
    source,
    wire::tls::{Reloading, TlsFiles},
};

#[derive(Args)]
pub struct ServeArgs {
    /// Where Services, EndpointSlices and Nodes come from: `kube` or `files`.
    #[arg(long, default_value = "kube")]
    source: String,
    /// Folder of manifests (`--source files`), re-read on change.
    #[arg(long, default_value = "deploy/examples")]
    manifests: PathBuf,
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    #[arg(long, env = "PROXY_AGENT_API_SERVER")]
    api_server: Option<String>,
    /// Where the feed listens.
    #[arg(long, default_value = "0.0.0.0:10270")]
    listen: String,
    /// The server's certificate and key, and the CA of the nodes' client certificates
    /// (re-read when they change).
    #[arg(long, requires_all = ["tls_key", "client_ca"])]
    tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<PathBuf>,
    /// Serve without credentials, believing the node names asked for (tests only).
    #[arg(long, conflicts_with = "tls_cert")]
    insecure: bool,
    /// Ops kept to resume from.
    #[arg(long, default_value_t = HubOptions::default().history)]
    history: usize,
    /// Coalesced ops one node may have pending before it gets a snapshot instead.
    #[arg(long, default_value_t = HubOptions::default().pending_bound)]
    pending_bound: usize,
    /// How long a node's stream lets changes gather after the first before sending them
    /// (fewer, larger messages to every node; 0: each at once).
    #[arg(long, default_value_t = grpc::BATCH_WINDOW.as_millis() as u64)]
    batch_window_ms: u64,
    /// `/metrics` and `/healthz` (ready once the first full list is in); empty: off.
    #[arg(long, default_value = "0.0.0.0:10271")]
    metrics_address: String,
}

/// The server's `/metrics` (Prometheus text) from the hub's counts.
fn metrics_text(s: &fanout::HubStats) -> String {
    let series: [(&str, &str, &str, u64); 8] = [
        (
            "proxy_agent_feed_ready",
            "gauge",
            "1 once the source's first full list is in",
            u64::from(s.ready),
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
    out
}

/// `/metrics`, and `/healthz` answering 503 until the first full list is in.
fn http_app(hub: std::sync::Arc<Hub>) -> axum::Router {
    use axum::{http::StatusCode, routing::get};
    let metrics_hub = std::sync::Arc::clone(&hub);
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let text = metrics_text(&metrics_hub.stats());
                async move { text }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let ready = hub.stats().ready;
                async move {
                    if ready {
                        (StatusCode::OK, "ok")
                    } else {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "waiting for the first full list",
                        )
                    }
                }
            }),
        )
}

pub async fn serve(args: ServeArgs) -> Result<()> {
    let (identity, tls) = match (&args.tls_cert, args.insecure) {
        (Some(cert), _) => {
            let files = TlsFiles {
                cert: cert.clone(),
                key: args.tls_key.clone().unwrap_or_default(),
                ca: args.client_ca.clone().unwrap_or_default(),
            };
            let tls = Reloading::new(files).context("the feed's TLS files")?;
            (
                grpc::Identity::ClientCertificate,
                Some(std::sync::Arc::new(tls)),
            )
        }
        (None, true) => (grpc::Identity::Insecure, None),
        (None, false) => anyhow::bail!("pass --tls-cert/--tls-key/--client-ca, or --insecure"),
    };
    let hub = Hub::new(HubOptions {
        history: args.history.max(1),
        pending_bound: args.pending_bound.max(1),
    });
    let (tx, rx) = tokio::sync::watch::channel(None);
    match args.source.as_str() {
        "files" => {
            anyhow::ensure!(
                args.manifests.exists(),
                "--manifests {}: no such file or folder",
                args.manifests.display()
            );
            let dir = args.manifests.clone();
            let node = proxy_agent::model::NodeInfo {
                name: "proxy-agent-serve".into(),
                ..Default::default()
            };
            tokio::spawn(async move {
                if let Err(e) = source::files::follow::run(dir, node, tx).await {
                    tracing::error!(error = format!("{e:#}"), "file source stopped");
                }
            });
        }
        "kube" => {
            let api = source::api_server::ApiServerOptions {
                kubeconfig: args.kubeconfig.as_ref().map(|p| p.display().to_string()),
                api_server: args.api_server.clone(),
            };
            let config = source::api_server::client_config(&api).await?;
            let url = config.cluster_url.to_string();
            let counters = source::api_server::ApiCounters::default();
            let client = source::api_server::client(config, &counters)?;
            let opts = source::kube::KubeOptions {
                node_name: std::env::var("NODE_NAME")
                    .unwrap_or_else(|_| "proxy-agent-serve".into()),
                label_selector: source::kube::label_selector(None),
                counters,
                all_nodes: true,
                ..Default::default()
            };
            tokio::spawn(async move {
                source::api_server::wait_reachable(&client, &url).await;
                source::kube::run(client, opts, tx).await
            });
        }
        other => anyhow::bail!("--source {other:?}: expected kube or files"),
    }
    tokio::spawn(fanout::follow(std::sync::Arc::clone(&hub), rx));
    if !args.metrics_address.is_empty() {
        let addr: std::net::SocketAddr = args
            .metrics_address
            .parse()
            .with_context(|| format!("--metrics-address {:?}", args.metrics_address))?;
        let app = http_app(std::sync::Arc::clone(&hub));
        tokio::spawn(proxy_agent::health_check::serve_retrying(
            addr,
            app,
            "metrics address",
        ));
    }
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    tracing::info!(listen = %args.listen, tls = tls.is_some(), "serving node views");
    let feed = grpc::Feed::new(hub, identity)
        .with_batch_window(std::time::Duration::from_millis(args.batch_window_ms));
    grpc::serve(listener, feed, tls).await
}
