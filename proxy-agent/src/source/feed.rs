//! The server feed: this node's model from `proxy-agent serve` instead of the API server
//! (`--source server=ADDR,…`). Replicas are judged by their data: the agent follows the
//! first replica, in the order given, that delivers a view (a snapshot, or the ops and
//! keepalives of the history it holds); one that answers "no view" (`wire::no_view_status`:
//! never synced, or its API watch lost), or streams without ever giving data, is left for
//! the next. While fed by a later replica the earlier ones are asked again every
//! `PREFER_EVERY`, and the first that has data again is taken back. Batches are applied and
//! published as snapshots as the other sources do; a reconnection resumes from the
//! revision held (a snapshot only when the server cannot resume). While no replica gives
//! data nothing is published: the pinned programs keep serving what they hold, and the
//! link counts as lost (`on_link(false)`: `/healthz` fails past the health timeout).
//! Every Node's addresses (`accepts_peers`) are published as `Snapshot::nodes`.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use anyhow::{Context as _, Result};
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::{
    feed::{
        tls::TlsFiles,
        wire::{KEEPALIVE, NodeState, OpError, Parts, is_no_view, v1},
    },
    model::NodeInfo,
    source::{ChangeCounts, SharedSnapshot, Snapshot},
};

/// A stream that gives no data this long is left (the server sends a keepalive every
/// `KEEPALIVE`; one that sends only keepalives of a history we do not hold, and never a
/// snapshot, has no data to give).
const SILENCE: Duration = Duration::from_secs(KEEPALIVE.as_secs() * 3);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// While a later replica feeds us, how often the earlier ones are asked again.
pub const PREFER_EVERY: Duration = Duration::from_secs(10);
/// How long an earlier replica asked again has to send its first message (a replica of
/// this version sends one at once; an older one within `KEEPALIVE`).
const PROBE_WAIT: Duration = Duration::from_secs(KEEPALIVE.as_secs() + 1);

/// What the feed is told at start.
#[derive(Clone)]
pub struct FeedOptions {
    /// `host:port` of each replica, preferred in this order.
    pub servers: Vec<String>,
    /// This node from flags: used while the server has no Node object of this name.
    pub node: NodeInfo,
    /// Client certificate, key and the CA of the servers; `None`: plain text.
    pub tls: Option<TlsFiles>,
    /// Told `true` when a replica delivers data, `false` when we lost it (the runner's
    /// status times the data's age from it).
    pub on_link: Arc<dyn Fn(bool) + Send + Sync>,
    /// How often the replicas before the one followed are asked again (`PREFER_EVERY`).
    pub prefer_every: Duration,
}

/// Why a replica's stream was left.
#[derive(Debug, thiserror::Error)]
enum Lost {
    #[error("{0:#}")]
    Connect(anyhow::Error),
    #[error("the replica has no synced view ({0})")]
    NoView(String),
    #[error("{}: {}", .0.code(), .0.message())]
    Status(tonic::Status),
    #[error("no data for {SILENCE:?}")]
    Silent,
    #[error("the stream ended")]
    Ended,
    #[error("a batch that cannot be applied: {0}")]
    Apply(#[source] OpError),
}

impl Lost {
    fn of_status(s: tonic::Status) -> Self {
        if is_no_view(&s) {
            Lost::NoView(s.message().to_string())
        } else {
            Lost::Status(s)
        }
    }
}

/// A replica's stream, opened, and the first message already read from it (a probe's).
struct Opened {
    index: usize,
    stream: tonic::Streaming<v1::Batch>,
    first: Option<v1::Batch>,
}

enum StreamEnd {
    ReceiverGone,
    /// Left; `delivered`: it had given data.
    Lost {
        error: Lost,
        delivered: bool,
    },
    /// An earlier replica has data again: followed instead.
    Switch(Box<Opened>),
}

/// Follows the replicas until the receiver is dropped.
pub async fn run(opts: FeedOptions, tx: watch::Sender<Option<SharedSnapshot>>) {
    if opts.servers.is_empty() {
        tracing::error!("no feed server given");
        return;
    }
    let mut state = NodeState::default();
    let mut changes = ChangeCounts::default();
    let mut backoff = BACKOFF_FIRST;
    loop {
        // One pass: each replica in order until one delivers; after a stream is left,
        // the pass goes on from the next one (the earlier ones are asked again while a
        // later one feeds us).
        let mut delivered_any = false;
        let mut index = 0usize;
        let mut switched: Option<Opened> = None;
        while index < opts.servers.len() || switched.is_some() {
            let opened = match switched.take() {
                Some(o) => o,
                None => match open(&opts, index, &state.epoch, state.revision).await {
                    Ok(stream) => Opened {
                        index,
                        stream,
                        first: None,
                    },
                    Err(error) => {
                        report_lost(&opts, index, &error);
                        index += 1;
                        continue;
                    }
                },
            };
            let at = opened.index;
            match read_stream(&opts, opened, &mut state, &mut changes, &tx).await {
                StreamEnd::ReceiverGone => return,
                StreamEnd::Switch(o) => {
                    tracing::info!(from = %opts.servers[at], to = %opts.servers[o.index],
                        "an earlier feed replica has data again; following it");
                    switched = Some(*o);
                    continue;
                }
                StreamEnd::Lost { error, delivered } => {
                    report_lost(&opts, at, &error);
                    delivered_any |= delivered;
                    if delivered {
                        (opts.on_link)(false);
                    }
                }
            }
            index = at + 1;
        }
        (opts.on_link)(false);
        if delivered_any {
            backoff = BACKOFF_FIRST;
        }
        // Jittered, so a server's restart does not bring every node back at once.
        let jitter = rand::random_range(0..=backoff.as_millis() as u64 / 2);
        tokio::time::sleep(backoff + Duration::from_millis(jitter)).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

fn report_lost(opts: &FeedOptions, index: usize, error: &Lost) {
    let server = &opts.servers[index];
    match error {
        Lost::Ended => tracing::warn!(%server, "the feed's stream ended; reconnecting"),
        Lost::NoView(_) => tracing::warn!(%server, error = %error,
            "no feed from this server: it has no data; trying the next replica"),
        _ => tracing::warn!(%server, error = %error, "no feed from this server"),
    }
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

/// Opens replica `index`'s stream, asking to resume from (`epoch`, `revision`).
async fn open(
    opts: &FeedOptions,
    index: usize,
    epoch: &str,
    revision: u64,
) -> Result<tonic::Streaming<v1::Batch>, Lost> {
    let server = &opts.servers[index];
    let ch = channel(opts, server).await.map_err(Lost::Connect)?;
    let mut client =
        v1::node_feed_client::NodeFeedClient::new(ch).max_decoding_message_size(usize::MAX);
    let request = v1::WatchRequest {
        node_name: opts.node.name.clone(),
        epoch: epoch.to_string(),
        revision,
        accepts_parts: true,
        accepts_peers: true,
    };
    Ok(client
        .watch(request)
        .await
        .map_err(Lost::of_status)?
        .into_inner())
}

/// Whether a replica's first message shows it has data for us: a snapshot (or its first
/// part), ops, or a keepalive of the history we hold.
fn shows_data(first: &v1::Batch, epoch: &str, complete: bool) -> bool {
    first.snapshot || !first.ops.is_empty() || (complete && first.epoch == epoch)
}

/// After `after`, asks replicas `0..before` in order for a stream; the first whose first
/// message shows data is returned, open. `None`: none has.
async fn probe_earlier(
    opts: &FeedOptions,
    before: usize,
    after: Duration,
    epoch: String,
    revision: u64,
    complete: bool,
) -> Option<Opened> {
    tokio::time::sleep(after).await;
    for index in 0..before {
        let Ok(mut stream) = open(opts, index, &epoch, revision).await else {
            continue;
        };
        if let Ok(Ok(Some(first))) = tokio::time::timeout(PROBE_WAIT, stream.message()).await
            && shows_data(&first, &epoch, complete)
        {
            return Some(Opened {
                index,
                stream,
                first: Some(first),
            });
        }
    }
    None
}

type Probe<'a> = Pin<Box<dyn Future<Output = Option<Opened>> + Send + 'a>>;

/// The next round of asking the replicas before `index`, after `prefer_every`.
fn probe<'a>(opts: &'a FeedOptions, index: usize, state: &NodeState) -> Probe<'a> {
    Box::pin(probe_earlier(
        opts,
        index,
        jittered(opts.prefer_every),
        state.epoch.clone(),
        state.revision,
        state.complete,
    ))
}

/// Up to a quarter of `every` more, so the nodes' probes spread.
fn jittered(every: Duration) -> Duration {
    every + Duration::from_millis(rand::random_range(0..=every.as_millis() as u64 / 4))
}

/// What the node's state says, as the other sources publish it.
fn snapshot_of(state: &NodeState, opts: &FeedOptions, changes: ChangeCounts) -> Snapshot {
    Snapshot {
        model: state.model.clone(),
        node: state.node.clone().unwrap_or_else(|| opts.node.clone()),
        changes,
        unreadable: 0,
        api_validated: state.api_validated,
        // Every Node's addresses; none from a server older than them.
        nodes: state.peers.clone(),
        partial: false,
    }
}

/// Applies one replica's stream (batches, keepalives) until it ends, and says how.
async fn read_stream(
    opts: &FeedOptions,
    opened: Opened,
    state: &mut NodeState,
    changes: &mut ChangeCounts,
    tx: &watch::Sender<Option<SharedSnapshot>>,
) -> StreamEnd {
    let Opened {
        index,
        mut stream,
        mut first,
    } = opened;
    let server = &opts.servers[index];
    let mut delivered = false;
    let lost = |error, delivered| StreamEnd::Lost { error, delivered };
    let mut parts = Parts::default();
    // Past this without data (or a part of a batch under way), the stream is left.
    let mut deadline = Instant::now() + SILENCE;
    let mut asking = (index > 0).then(|| probe(opts, index, state));
    loop {
        let next = match first.take() {
            Some(b) => Ok(Some(b)),
            None => {
                let probing = asking.is_some() && !parts.pending();
                tokio::select! {
                    m = tokio::time::timeout_at(deadline, stream.message()) => match m {
                        Err(_) => return lost(Lost::Silent, delivered),
                        Ok(m) => m,
                    },
                    found = async { asking.as_mut().expect("probing").await }, if probing => {
                        match found {
                            Some(o) => return StreamEnd::Switch(Box::new(o)),
                            None => {
                                asking = Some(probe(opts, index, state));
                                continue;
                            }
                        }
                    }
                }
            }
        };
        let part = match next {
            Err(s) => return lost(Lost::of_status(s), delivered),
            Ok(None) => return lost(Lost::Ended, delivered),
            Ok(Some(b)) => b,
        };
        // Parts of a large batch (a snapshot) are joined before anything is applied.
        let Some(batch) = parts.push(part) else {
            deadline = Instant::now() + SILENCE;
            continue;
        };
        if !batch.snapshot && batch.ops.is_empty() {
            // A keepalive: data only if it is of the history we hold (then current up to
            // its revision); one of another history (a replica with nothing to give that
            // predates `no_view_status`) is not.
            if state.complete && batch.epoch == state.epoch && batch.revision >= state.revision {
                state.revision = batch.revision;
                deadline = Instant::now() + SILENCE;
                if !delivered {
                    delivered = true;
                    tracing::info!(%server, snapshot = false, revision = batch.revision,
                        "the feed streams");
                }
                (opts.on_link)(true);
            }
            continue;
        }
        let before = state.model.clone();
        if let Err(e) = state.apply(&batch) {
            // Nothing of it applied; the next connection asks for a snapshot.
            state.epoch.clear();
            return lost(Lost::Apply(e), delivered);
        }
        deadline = Instant::now() + SILENCE;
        if !delivered {
            delivered = true;
            tracing::info!(%server, snapshot = batch.snapshot, revision = batch.revision,
                "the feed streams");
        }
        (opts.on_link)(true);
        if batch.snapshot && asking.is_some() {
            // Asked from now on with this replica's history, not the one the round was
            // made with (an earlier replica would resume ours and give no data).
            asking = Some(probe(opts, index, state));
        }
        changes.add(&before.changes_to(&state.model));
        if tx.is_closed() {
            return StreamEnd::ReceiverGone;
        }
        tx.send_replace(Some(Arc::new(snapshot_of(state, opts, *changes))));
    }
}
