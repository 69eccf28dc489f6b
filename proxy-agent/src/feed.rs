//! The server feed: this node's model from `proxy-agent serve` instead of the API server
//! (`--source server=ADDR,…`). Connects to any replica, applies its batches and
//! publishes snapshots as the other sources do; reconnects with backoff, resuming from
//! the revision it holds (a snapshot only when the server cannot resume). While no
//! server answers nothing is published: the pinned programs keep serving what they hold.

use std::{sync::Arc, time::Duration};

use anyhow::{Context as _, Result};
use tokio::sync::watch;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::{
    model::NodeInfo,
    source::{ChangeCounts, SharedSnapshot, Snapshot},
    wire::{KEEPALIVE, NodeState, Parts, tls::TlsFiles, v1},
};

/// A stream silent this long is taken as lost (the server sends keepalives).
const SILENCE: Duration = Duration::from_secs(KEEPALIVE.as_secs() * 3);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// What the feed is told at start.
#[derive(Clone)]
pub struct FeedOptions {
    /// `host:port` of each replica, tried in turn.
    pub servers: Vec<String>,
    /// This node from flags: used while the server has no Node object of this name.
    pub node: NodeInfo,
    /// Client certificate, key and the CA of the servers; `None`: plain text.
    pub tls: Option<TlsFiles>,
    /// Told `true` when a server streams to us, `false` when we lost it (the runner's
    /// status times the data's age from it).
    pub on_link: Arc<dyn Fn(bool) + Send + Sync>,
}

/// Follows the servers until the receiver is dropped.
pub async fn run(opts: FeedOptions, tx: watch::Sender<Option<SharedSnapshot>>) {
    let mut state = NodeState::default();
    let mut changes = ChangeCounts::default();
    let mut backoff = BACKOFF_FIRST;
    let mut next = 0usize;
    loop {
        if opts.servers.is_empty() {
            tracing::error!("no feed server given");
            return;
        }
        let server = opts.servers[next % opts.servers.len()].clone();
        next += 1;
        match follow(&opts, &server, &mut state, &mut changes, &tx).await {
            Ok(Streamed::ReceiverGone) => return,
            Ok(Streamed::Ended { delivered }) => {
                tracing::warn!(%server, "the feed's stream ended; reconnecting");
                if delivered {
                    backoff = BACKOFF_FIRST;
                }
            }
            Err((e, delivered)) => {
                tracing::warn!(%server, error = format!("{e:#}"), "no feed from this server");
                if delivered {
                    backoff = BACKOFF_FIRST;
                }
            }
        }
        (opts.on_link)(false);
        // Jittered, so a server's restart does not bring every node back at once.
        let jitter = rand::random_range(0..=backoff.as_millis() as u64 / 2);
        tokio::time::sleep(backoff + Duration::from_millis(jitter)).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

enum Streamed {
    ReceiverGone,
    /// The server closed the stream; `delivered`: it had sent something.
    Ended {
        delivered: bool,
    },
}

async fn channel(opts: &FeedOptions, server: &str) -> Result<tonic::transport::Channel> {
    let scheme = if opts.tls.is_some() { "https" } else { "http" };
    let mut ep = Endpoint::from_shared(format!("{scheme}://{server}"))
        .with_context(|| format!("feed server {server:?}"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10));
    if let Some(files) = &opts.tls {
        // Read at each connection: rotated files are taken on the next one.
        let read = |p: &std::path::Path| {
            std::fs::read(p).with_context(|| format!("reading {}", p.display()))
        };
        let host = server
            .rsplit_once(':')
            .map_or(server, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(&files.ca)?))
            .identity(Identity::from_pem(read(&files.cert)?, read(&files.key)?))
            .domain_name(host.to_string());
        ep = ep.tls_config(tls).context("the feed's TLS settings")?;
    }
    ep.connect()
        .await
        .with_context(|| format!("connecting to {server}"))
}

async fn follow(
    opts: &FeedOptions,
    server: &str,
    state: &mut NodeState,
    changes: &mut ChangeCounts,
    tx: &watch::Sender<Option<SharedSnapshot>>,
) -> Result<Streamed, (anyhow::Error, bool)> {
    let mut delivered = false;
    let ch = channel(opts, server).await.map_err(|e| (e, false))?;
    let mut client =
        v1::node_feed_client::NodeFeedClient::new(ch).max_decoding_message_size(usize::MAX);
    let request = v1::WatchRequest {
        node_name: opts.node.name.clone(),
        epoch: state.epoch.clone(),
        revision: state.revision,
        accepts_parts: true,
    };
    let mut stream = client
        .watch(request)
        .await
        .map_err(|s| (anyhow::anyhow!("{}: {}", s.code(), s.message()), false))?
        .into_inner();
    let mut parts = Parts::default();
    loop {
        let part = match tokio::time::timeout(SILENCE, stream.message()).await {
            Err(_) => {
                return Err((anyhow::anyhow!("silent for {SILENCE:?}"), delivered));
            }
            Ok(Err(s)) => {
                return Err((anyhow::anyhow!("{}: {}", s.code(), s.message()), delivered));
            }
            Ok(Ok(None)) => return Ok(Streamed::Ended { delivered }),
            Ok(Ok(Some(b))) => b,
        };
        // Parts of a large batch (a snapshot) are joined before anything is applied.
        let Some(batch) = parts.push(part) else {
            continue;
        };
        if !delivered {
            delivered = true;
            (opts.on_link)(true);
            tracing::info!(%server, snapshot = batch.snapshot, revision = batch.revision,
                "the feed streams");
        }
        if !batch.snapshot && batch.ops.is_empty() {
            // A keepalive: the data is current up to its revision.
            if state.complete && batch.epoch == state.epoch && batch.revision >= state.revision {
                state.revision = batch.revision;
            }
            (opts.on_link)(true);
            continue;
        }
        let before = state.model.clone();
        if let Err(e) = state.apply(&batch) {
            // Nothing of it applied; the next connection asks for a snapshot.
            state.epoch.clear();
            return Err((
                anyhow::Error::new(e).context("a batch that cannot be applied"),
                delivered,
            ));
        }
        changes.add(&before.changes_to(&state.model));
        let snapshot = Snapshot {
            model: state.model.clone(),
            node: state.node.clone().unwrap_or_else(|| opts.node.clone()),
            changes: *changes,
            unreadable: 0,
            api_validated: state.api_validated,
            nodes: Default::default(),
            partial: false,
        };
        if tx.is_closed() {
            return Ok(Streamed::ReceiverGone);
        }
        tx.send_replace(Some(Arc::new(snapshot)));
    }
}
