//! The feed's gRPC service: who is asking (`Identity`), their stream (a batch per drain
//! of their mailbox, a keepalive when nothing happens), and the server.

use std::{ops::Bound, pin::Pin, sync::Arc, time::Duration};

use futures::Stream;
use prost::Message as _;
use tonic::{Request, Response, Status};

use std::ops::Not as _;

use super::{
    Cut, Encoded, Hub,
    mailbox::{Drained, Mailbox, OpKey},
};
use crate::feed::wire::v1::{self, node_feed_server::NodeFeed};

use crate::feed::wire::KEEPALIVE;

/// How the server learns who a client is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Identity {
    /// The client certificate's CN `system:node:<name>` in O `system:nodes` (kubelet's).
    ClientCertificate,
    /// No credentials at all: the name in the request is believed (tests, loopback).
    Insecure,
}

pub struct Feed {
    hub: Arc<Hub>,
    identity: Identity,
    window: Duration,
    limits: FeedLimits,
    /// Room for batches in flight to nodes that take them whole, in KiB.
    whole_budget: Arc<tokio::sync::Semaphore>,
    whole_budget_kib: u32,
}

/// What one node, one stream and all the streams together may hold on the server.
#[derive(Clone, Copy, Debug)]
pub struct FeedLimits {
    /// Streams open at once per node identity; more are refused (RESOURCE_EXHAUSTED).
    pub streams_per_node: usize,
    /// Bytes of batches in flight to nodes that take them whole (no `accepts_parts`): a
    /// whole batch (a snapshot: ~3 MiB at 20k Services) stays held until its node reads
    /// it, so these are budgeted together. One batch larger than the budget alone may
    /// take all of it.
    pub whole_budget_bytes: usize,
    /// How long a whole batch waits for room in the budget before its stream is cut
    /// (RESOURCE_EXHAUSTED).
    pub whole_wait: Duration,
}

impl Default for FeedLimits {
    fn default() -> Self {
        Self {
            streams_per_node: 4,
            whole_budget_bytes: 64 << 20,
            whole_wait: Duration::from_secs(10),
        }
    }
}

/// How long a node's stream lets changes gather after the first before it sends them:
/// 1,000 nodes each sent every change of 100 changes/s one message apiece cost the server
/// a core in writes alone; gathered for a few milliseconds they go in fewer messages
/// (measured at 100k Services and 1,000 nodes: docs/fanout.md).
pub const BATCH_WINDOW: Duration = Duration::from_millis(10);

impl Feed {
    pub fn new(hub: Arc<Hub>, identity: Identity) -> Self {
        Self::with_limits(hub, identity, FeedLimits::default())
    }

    pub fn with_limits(hub: Arc<Hub>, identity: Identity, limits: FeedLimits) -> Self {
        let kib = u32::try_from(limits.whole_budget_bytes >> 10)
            .unwrap_or(u32::MAX)
            .max(1);
        Self {
            hub,
            identity,
            window: BATCH_WINDOW,
            limits,
            whole_budget: Arc::new(tokio::sync::Semaphore::new(kib as usize)),
            whole_budget_kib: kib,
        }
    }

    /// Another batch window (zero: every drain sends at once).
    pub fn with_batch_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    pub fn into_server(self) -> v1::node_feed_server::NodeFeedServer<Self> {
        v1::node_feed_server::NodeFeedServer::new(self).max_encoding_message_size(usize::MAX)
    }
}

/// The node a certificate names, as the API server reads a kubelet's client certificate:
/// the Subject's one CN `system:node:<name>`, with `system:nodes` among its O's. A SAN
/// names no one here (a certificate the CA issued for a SAN would otherwise pass as a
/// node), nor does a CN outside the nodes' group. Err: why not, for the refusal.
pub fn node_of_certificate(der: &[u8]) -> Result<String, &'static str> {
    const PREFIX: &str = "system:node:";
    const GROUP: &str = "system:nodes";
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|_| "the certificate does not parse")?;
    let subject = cert.subject();
    let mut cns = subject.iter_common_name();
    let cn = match (cns.next(), cns.next()) {
        (Some(cn), None) => cn
            .as_str()
            .map_err(|_| "the certificate's CN is not text")?,
        (None, _) => return Err("the certificate has no CN system:node:<name>"),
        (Some(_), Some(_)) => return Err("the certificate has more than one CN"),
    };
    let name = cn
        .strip_prefix(PREFIX)
        .filter(|n| !n.is_empty())
        .ok_or("the certificate's CN is not system:node:<name>")?;
    if !subject
        .iter_organization()
        .any(|o| o.as_str().is_ok_and(|o| o == GROUP))
    {
        return Err("the certificate's subject is not in O=system:nodes");
    }
    Ok(name.to_string())
}

type BatchStream = Pin<Box<dyn Stream<Item = Result<v1::EncodedBatch, Status>> + Send>>;

/// The most op bytes in one part of a batch, for a node that joins parts: a snapshot
/// of 100k Services streams in parts of this size, each encoded as the stream takes it,
/// so what a stream holds in flight stays near this (1,000 nodes taking snapshots at
/// once held ~2 GiB with parts of 1 MiB).
pub const PART_BYTES: usize = 64 << 10;

#[tonic::async_trait]
impl NodeFeed for Feed {
    type WatchStream = BatchStream;

    async fn watch(
        &self,
        request: Request<v1::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let node = match self.identity {
            Identity::Insecure => request.get_ref().node_name.clone(),
            Identity::ClientCertificate => {
                let certs = request
                    .peer_certs()
                    .ok_or_else(|| Status::unauthenticated("a client certificate is required"))?;
                let first = certs
                    .first()
                    .ok_or_else(|| Status::unauthenticated("a client certificate is required"))?;
                let named = node_of_certificate(first.as_ref()).map_err(|why| {
                    tracing::warn!(asked = %request.get_ref().node_name, why,
                        "a certificate that names no node");
                    Status::permission_denied(why)
                })?;
                if named != request.get_ref().node_name {
                    tracing::warn!(certificate = %named, asked = %request.get_ref().node_name,
                        "a node asked for another node's view");
                    return Err(Status::permission_denied("a node reads only its own view"));
                }
                named
            }
        };
        if node.is_empty() {
            return Err(Status::invalid_argument("node_name is empty"));
        }
        if let Some(why) = self.hub.no_view_reason() {
            self.hub.count_cut(Cut::NoView);
            tracing::info!(%node, why, "a node asked for its view; there is none to give");
            return Err(crate::feed::wire::no_view_status(why));
        }
        let Some(slot) = self.hub.stream_slot(&node, self.limits.streams_per_node) else {
            self.hub.count_cut(Cut::StreamsPerNode);
            tracing::warn!(%node, max = self.limits.streams_per_node,
                "a node asked for one stream more than it may hold; refused");
            return Err(Status::resource_exhausted(format!(
                "this node has {} streams open already",
                self.limits.streams_per_node
            )));
        };
        let req = request.into_inner();
        let reads = super::Reads {
            peers: req.accepts_peers,
        };
        let mb = self
            .hub
            .subscribe_reading(&node, &req.epoch, req.revision, reads);
        tracing::info!(%node, epoch = %req.epoch, revision = req.revision,
            parts = req.accepts_parts, peers = req.accepts_peers, "node connected");
        let part_bytes = if req.accepts_parts {
            PART_BYTES
        } else {
            usize::MAX
        };
        let epoch = self.hub.epoch();
        let sending = Sending {
            hub: Arc::clone(&self.hub),
            mb,
            epoch,
            part_bytes,
            window: self.window,
            outgoing: None,
            at_once: true,
            budget: req.accepts_parts.not().then(|| WholeBudget {
                room: Arc::clone(&self.whole_budget),
                total_kib: self.whole_budget_kib,
                wait: self.limits.whole_wait,
                held: std::collections::VecDeque::new(),
                pad: false,
            }),
            _slot: slot,
        };
        // After an error (a cut) the stream ends.
        let stream = futures::stream::unfold(Some(sending), |s| async move {
            let mut s = s?;
            match s.next_part().await {
                Ok(batch) => Some((Ok(batch), Some(s))),
                Err(status) => Some((Err(status), None)),
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The budget of whole batches in flight, as one stream draws on it. A message handed to
/// hyper is buffered by h2 whole until its node's window lets it out. A whole batch is
/// followed at once by a padded keepalive (`PADDING`), which hyper takes only once the
/// batch has left; the stream is asked for the message after it only then. So each
/// message's room is held until the stream is asked for the one after the next.
struct WholeBudget {
    room: Arc<tokio::sync::Semaphore>,
    total_kib: u32,
    wait: Duration,
    /// The room of the last messages handed out (`None`: one too small to count).
    held: std::collections::VecDeque<Option<tokio::sync::OwnedSemaphorePermit>>,
    /// The next keepalive is padded (it follows a whole batch).
    pad: bool,
}

/// A keepalive after a whole batch is padded past tonic's yield threshold (32 KiB): tonic
/// asks the stream for more in the same breath after a small message, but after a
/// message that fills its buffer only when hyper polls again, which hyper does only once
/// the message before has left (it waits for send room in between).
const PADDING: usize = 64 << 10;

/// One node's stream: its mailbox drained into batches, each sent in parts.
struct Sending {
    hub: Arc<Hub>,
    mb: Arc<Mailbox>,
    epoch: String,
    part_bytes: usize,
    window: Duration,
    /// The batch being sent, a part at a time.
    outgoing: Option<Outgoing>,
    /// With nothing pending, say so at once (a keepalive) rather than after `KEEPALIVE`:
    /// as a stream's first message, so that a node learns at once that the replica
    /// serves it; after a whole batch, so that its room in the budget is given back as
    /// soon as it has left (`WholeBudget`).
    at_once: bool,
    /// For a node that takes batches whole.
    budget: Option<WholeBudget>,
    _slot: super::StreamSlot,
}

impl Sending {
    /// The next message: a part of the batch being sent, of what is pending, or a
    /// keepalive after `KEEPALIVE`; `Err`: the stream is cut (no view, no room).
    async fn next_part(&mut self) -> Result<v1::EncodedBatch, Status> {
        if let Some(b) = &mut self.budget {
            // All but the last message handed out have left.
            while b.held.len() > 1 {
                b.held.pop_front();
            }
        }
        if self.outgoing.is_none() {
            let at_once = std::mem::replace(&mut self.at_once, false);
            match next_drained(&self.hub, &self.mb, self.window, at_once).await {
                Next::Drained(d) => self.outgoing = Some(Outgoing::new(&self.hub, d)),
                Next::NoView(why) => {
                    self.hub.count_cut(Cut::NoView);
                    tracing::info!(node = %self.mb.node, why, "ending the node's stream");
                    return Err(crate::feed::wire::no_view_status(why));
                }
                Next::Idle(idle_at) => {
                    // A keepalive: no ops, and the revision as of the drain that found
                    // none (a later one might name ops not sent yet).
                    let mut padding = Vec::new();
                    if let Some(b) = &mut self.budget {
                        b.held.push_back(None);
                        if std::mem::take(&mut b.pad) {
                            padding = vec![0; PADDING];
                        }
                    }
                    return Ok(v1::EncodedBatch {
                        snapshot: false,
                        epoch: self.epoch.clone(),
                        revision: idle_at,
                        ops: Vec::new(),
                        api_validated: self.hub.api_validated(),
                        continued: false,
                        padding,
                    });
                }
            }
        }
        let out = self.outgoing.as_mut().expect("set above");
        let part = out.part(&self.hub, &self.epoch, self.part_bytes);
        if !part.continued {
            self.outgoing = None;
        }
        let len = part.encoded_len();
        if let Some(b) = &mut self.budget {
            let mut room = None;
            if len > PART_BYTES {
                // A batch larger than the whole budget takes all of it.
                let want = u32::try_from(len.div_ceil(1024))
                    .unwrap_or(u32::MAX)
                    .min(b.total_kib);
                let asked = Arc::clone(&b.room).acquire_many_owned(want);
                match tokio::time::timeout(b.wait, asked).await {
                    Ok(Ok(permit)) => room = Some(permit),
                    Ok(Err(_)) | Err(_) => {
                        self.hub.count_cut(Cut::WholeBudget);
                        tracing::warn!(node = %self.mb.node, bytes = len,
                            "no room for a whole batch: nodes that take them whole have not \
                             read theirs; cutting the stream");
                        self.outgoing = None;
                        return Err(Status::resource_exhausted(
                            "the server's room for batches sent whole is taken by streams \
                             that do not read; ask with accepts_parts",
                        ));
                    }
                }
                self.at_once = true;
                b.pad = true;
            }
            b.held.push_back(room);
        }
        self.hub.count_sent(len);
        Ok(part)
    }
}

enum Next {
    Drained(Drained),
    /// Nothing pending, everything up to this revision given.
    Idle(u64),
    /// The hub has no view (anymore): why.
    NoView(&'static str),
}

/// What is pending (once `window` has passed since its first op), or the revision as of
/// a drain that found nothing once `KEEPALIVE` has passed (`at_once`: at once), or that
/// the hub has lost its view.
async fn next_drained(hub: &Hub, mb: &Mailbox, window: Duration, at_once: bool) -> Next {
    let deadline = tokio::time::Instant::now() + KEEPALIVE;
    loop {
        if let Some(why) = hub.no_view_reason() {
            return Next::NoView(why);
        }
        if let Some(left) = mb.settle(window) {
            tokio::time::sleep(left).await;
            continue;
        }
        let idle_at = match mb.drain() {
            Err(revision) => revision,
            Ok(d) => return Next::Drained(d),
        };
        if at_once {
            return Next::Idle(idle_at);
        }
        tokio::select! {
            _ = mb.notify.notified() => {}
            _ = tokio::time::sleep_until(deadline) => return Next::Idle(idle_at),
        }
    }
}

/// A drained batch on its way out: the snapshot's objects still to send (walked in key
/// order from where the last part ended), then the rest of its ops.
pub struct Outgoing {
    snapshot: bool,
    revision: u64,
    objects: Option<imbl::OrdMap<OpKey, Encoded>>,
    /// The last object sent.
    after: Option<OpKey>,
    rest: std::vec::IntoIter<Encoded>,
}

impl Outgoing {
    pub fn new(hub: &Hub, drained: Drained) -> Self {
        match drained {
            Drained::Snapshot(whole, after, revision) => {
                hub.count_snapshot();
                // The node's own Node and its peers after the objects (a few per node,
                // not walked in parts as the objects are), then what came after.
                let mut rest: Vec<Encoded> = whole.node.into_iter().collect();
                rest.extend(whole.peers.values().cloned());
                rest.extend(after);
                Self {
                    snapshot: true,
                    revision,
                    objects: Some(whole.objects),
                    after: None,
                    rest: rest.into_iter(),
                }
            }
            Drained::Ops(ops, revision) => Self {
                snapshot: false,
                revision,
                objects: None,
                after: None,
                rest: ops.into_iter(),
            },
        }
    }

    /// The next part: ops up to `part_bytes` (at least one), `continued` while more
    /// remain.
    pub fn part(&mut self, hub: &Hub, epoch: &str, part_bytes: usize) -> v1::EncodedBatch {
        let mut ops: Vec<Encoded> = Vec::new();
        let mut bytes = 0usize;
        let full = |bytes: usize, ops: &Vec<Encoded>| !ops.is_empty() && bytes >= part_bytes;
        if let Some(objects) = &self.objects {
            let from = match self.after.take() {
                Some(k) => Bound::Excluded(k),
                None => Bound::Unbounded,
            };
            let mut last = None;
            for (k, op) in objects.range((from, Bound::Unbounded)) {
                if full(bytes, &ops) {
                    break;
                }
                bytes += op.len();
                ops.push(op.clone());
                last = Some(k);
            }
            match last {
                Some(k) if full(bytes, &ops) => self.after = Some(k.clone()),
                // Every object is out (or none was left): the rest follows.
                _ => self.objects = None,
            }
        }
        if self.objects.is_none() {
            while !full(bytes, &ops) {
                let Some(op) = self.rest.next() else { break };
                bytes += op.len();
                ops.push(op);
            }
        }
        let continued = self.objects.is_some() || self.rest.len() > 0;
        v1::EncodedBatch {
            snapshot: self.snapshot,
            epoch: epoch.to_string(),
            revision: self.revision,
            ops,
            api_validated: hub.api_validated(),
            continued,
            padding: Vec::new(),
        }
    }
}

/// A drained mailbox as the messages that carry it, each at most `part_bytes` of ops
/// (tests and the benchmark; the stream makes them one at a time).
pub fn parts_of(
    hub: &Hub,
    drained: Drained,
    epoch: &str,
    part_bytes: usize,
) -> Vec<v1::EncodedBatch> {
    let mut out = Outgoing::new(hub, drained);
    let mut parts = Vec::new();
    loop {
        let part = out.part(hub, epoch, part_bytes);
        let more = part.continued;
        parts.push(part);
        if !more {
            return parts;
        }
    }
}

/// How long a client may take over its TLS handshake: TLS 1.3 takes one or two round
/// trips, so a node across the world is done well within it, while a peer that only
/// opens connections holds each file descriptor this long at most.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// TLS handshakes under way at once from one peer address; more are closed at once. The
/// handshake is the only time a connection is held for a peer nobody has authenticated.
pub const HANDSHAKES_PER_PEER: usize = 32;

/// Handshakes under way by peer address; a guard counts one until dropped.
#[derive(Clone, Default)]
struct Handshakes(Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>);

struct Handshaking {
    all: Handshakes,
    peer: std::net::IpAddr,
}

impl Handshakes {
    fn begin(&self, peer: std::net::IpAddr, max: usize) -> Option<Handshaking> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(peer).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Handshaking {
            all: self.clone(),
            peer,
        })
    }
}

impl Drop for Handshaking {
    fn drop(&mut self) {
        let mut m = self.all.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.peer);
            }
        }
    }
}

/// Raises this process's soft limit of open files to its hard limit (1,024 by default
/// against usually 524,288 or more): each node's stream is a connection. Returns the
/// limit now in force.
pub fn raise_fd_limit() -> std::io::Result<u64> {
    let (soft, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_err(std::io::Error::from)?;
    if soft < hard {
        nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard)
            .map_err(std::io::Error::from)?;
    }
    Ok(hard.max(soft))
}

/// Serves the feed on `listener` until it fails: in plain text, or with mutual TLS whose
/// files are re-read for each new connection when they change.
pub async fn serve(
    listener: tokio::net::TcpListener,
    feed: Feed,
    tls: Option<Arc<crate::feed::tls::Reloading>>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let hub = Arc::clone(&feed.hub);
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(feed.into_server());
    let Some(tls) = tls else {
        let incoming = futures::stream::unfold(listener, |l| async move {
            let conn = l.accept().await.map(|(s, _)| s);
            Some((conn, l))
        });
        return router
            .serve_with_incoming(incoming)
            .await
            .context("the feed's server");
    };
    // Handshakes run beside the accept loop: a client that stalls in one delays nobody.
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let handshakes = Handshakes::default();
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors (EMFILE) included: wait for some to close.
                    tracing::warn!(error = %e, "accepting a feed connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Some(guard) = handshakes.begin(peer.ip(), HANDSHAKES_PER_PEER) else {
                hub.count_cut(Cut::HandshakesPerPeer);
                tracing::debug!(%peer, max = HANDSHAKES_PER_PEER,
                    "too many TLS handshakes under way from this address; closed");
                drop(tcp);
                continue;
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.config());
            let tx = tx.clone();
            let hub = Arc::clone(&hub);
            tokio::spawn(async move {
                let done = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                drop(guard);
                match done {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok::<_, std::io::Error>(stream)).await;
                    }
                    Ok(Err(e)) => tracing::info!(%peer, error = %e, "TLS handshake refused"),
                    Err(_) => {
                        hub.count_cut(Cut::HandshakeTimeout);
                        tracing::info!(%peer, "TLS handshake timed out");
                    }
                }
            });
        }
    });
    let incoming = futures::stream::unfold(rx, |mut rx| async move {
        let conn = rx.recv().await?;
        Some((conn, rx))
    });
    router
        .serve_with_incoming(incoming)
        .await
        .context("the feed's server")
}
