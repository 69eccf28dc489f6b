//! `proxy-agent serve`: watch once, serve every node its part (KPNG's split): the
//! source (the API server, or files for tests), the hub, and the feed's gRPC server.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::Args;
use proxy_agent::{
    feed::server::{self, Hub, HubOptions, grpc},
    feed::tls::{Reloading, TlsFiles},
    source::{self, SharedSnapshot},
};

use super::source::{SourceArgs, kube_client, spawn_files};

#[derive(Args)]
pub struct ServeArgs {
    /// Where Services, EndpointSlices and Nodes come from: `kube` or `files`.
    #[arg(long, default_value = "kube")]
    source: String,
    #[command(flatten)]
    from: SourceArgs,
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
    /// `/metrics` and `/healthz` (ready once the first full list is in, and while the API
    /// watch has not failed past `--api-lost-after-s`); empty: off.
    #[arg(long, default_value = "0.0.0.0:10271")]
    metrics_address: String,
    /// How long the API server watch may fail (errors that keep coming, or the version
    /// probe unanswered) before this replica says it has no view: `/healthz` 503, every
    /// node's stream ended and new ones refused until it answers again.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    api_lost_after_s: u64,
    /// Streams one node identity may hold open at once.
    #[arg(long, default_value_t = grpc::FeedLimits::default().streams_per_node as u64,
        value_parser = clap::value_parser!(u64).range(1..=1024))]
    streams_per_node: u64,
    /// MiB of batches in flight to nodes that take them whole (agents that do not join
    /// parts): past it, such a stream waits, then is cut.
    #[arg(long, default_value_t = (grpc::FeedLimits::default().whole_budget_bytes >> 20) as u64,
        value_parser = clap::value_parser!(u64).range(1..=65536))]
    whole_budget_mib: u64,
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
    match grpc::raise_fd_limit() {
        Ok(limit) => tracing::info!(limit, "open files allowed"),
        Err(e) => tracing::warn!(error = %e, "could not raise the limit of open files"),
    }
    let hub = Hub::new(HubOptions {
        history: args.history.max(1),
        pending_bound: args.pending_bound.max(1),
    });
    let rx = start_source(&args, &hub).await?;
    tokio::spawn(server::ingest(std::sync::Arc::clone(&hub), rx));
    if !args.metrics_address.is_empty() {
        let addr: std::net::SocketAddr = args
            .metrics_address
            .parse()
            .with_context(|| format!("--metrics-address {:?}", args.metrics_address))?;
        let app = server::http::app(std::sync::Arc::clone(&hub));
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
    let limits = grpc::FeedLimits {
        streams_per_node: usize::try_from(args.streams_per_node).unwrap_or(usize::MAX),
        whole_budget_bytes: usize::try_from(args.whole_budget_mib << 20).unwrap_or(usize::MAX),
        ..Default::default()
    };
    let feed = grpc::Feed::with_limits(hub, identity, limits)
        .with_batch_window(std::time::Duration::from_millis(args.batch_window_ms));
    grpc::serve(listener, feed, tls).await
}

/// The source `--source` names, under way: its snapshots, for the hub.
async fn start_source(
    args: &ServeArgs,
    hub: &std::sync::Arc<Hub>,
) -> Result<tokio::sync::watch::Receiver<Option<SharedSnapshot>>> {
    let (tx, rx) = tokio::sync::watch::channel(None);
    match args.source.as_str() {
        "files" => {
            let node = proxy_agent::model::NodeInfo {
                name: "proxy-agent-serve".into(),
                ..Default::default()
            };
            spawn_files(args.from.existing_manifests()?, node, tx);
        }
        "kube" => start_kube(args, hub, tx).await?,
        other => anyhow::bail!("--source {other:?}: expected kube or files"),
    }
    Ok(rx)
}

/// `--source kube`: the API server's watches, once it answers, with the judge of the
/// view and the probe of the API server that keep this replica honest about it.
async fn start_kube(
    args: &ServeArgs,
    hub: &std::sync::Arc<Hub>,
    tx: tokio::sync::watch::Sender<Option<SharedSnapshot>>,
) -> Result<()> {
    let api = source::api_server::ApiServerOptions {
        kubeconfig: args
            .from
            .kubeconfig
            .as_ref()
            .map(|p| p.display().to_string()),
        api_server: args.from.api_server.clone(),
    };
    let counters = source::api_server::ApiCounters::default();
    let (client, url) = kube_client(&api, &counters).await?;
    let opts = source::kube::KubeOptions {
        node_name: std::env::var("NODE_NAME").unwrap_or_else(|_| "proxy-agent-serve".into()),
        label_selector: source::kube::label_selector(None),
        counters,
        all_nodes: true,
        without_own_node: true,
        ..Default::default()
    };
    let bound = std::time::Duration::from_secs(args.api_lost_after_s);
    tokio::spawn(server::judge_view(
        std::sync::Arc::downgrade(hub),
        opts.health.clone(),
        bound,
    ));
    // Asked six times within the bound (every 1–10 s): a hung API server is seen
    // well before the watches time out.
    let every = (bound / 6).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(10),
    );
    tokio::spawn(server::probe_api(
        client.clone(),
        opts.health.clone(),
        every,
    ));
    tokio::spawn(async move {
        source::api_server::wait_reachable(&client, &url).await;
        source::kube::run(client, opts, tx).await
    });
    Ok(())
}
