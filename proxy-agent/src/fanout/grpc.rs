//! The feed's gRPC service: who is asking (`Identity`), their stream (a batch per drain
//! of their mailbox, a keepalive when nothing happens), and the server.

use std::{ops::Bound, pin::Pin, sync::Arc, time::Duration};

use futures::Stream;
use prost::Message as _;
use tonic::{Request, Response, Status};

use super::{
    Encoded, Hub,
    mailbox::{Drained, Mailbox, OpKey},
};
use crate::wire::v1::{self, node_feed_server::NodeFeed};

use crate::wire::KEEPALIVE;

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
}

/// How long a node's stream lets changes gather after the first before it sends them:
/// 1,000 nodes each sent every change of 100 changes/s one message apiece cost the server
/// a core in writes alone; gathered for a few milliseconds they go in fewer messages
/// (measured at 100k Services and 1,000 nodes: docs/fanout.md).
pub const BATCH_WINDOW: Duration = Duration::from_millis(10);

impl Feed {
    pub fn new(hub: Arc<Hub>, identity: Identity) -> Self {
        Self {
            hub,
            identity,
            window: BATCH_WINDOW,
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
        let req = request.into_inner();
        let mb = self.hub.subscribe(&node, &req.epoch, req.revision);
        tracing::info!(%node, epoch = %req.epoch, revision = req.revision,
            parts = req.accepts_parts, "node connected");
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
        };
        let stream = futures::stream::unfold(sending, |mut s| async move {
            let batch = s.next_part().await;
            Some((Ok(batch), s))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// One node's stream: its mailbox drained into batches, each sent in parts.
struct Sending {
    hub: Arc<Hub>,
    mb: Arc<Mailbox>,
    epoch: String,
    part_bytes: usize,
    window: Duration,
    /// The batch being sent, a part at a time.
    outgoing: Option<Outgoing>,
}

impl Sending {
    /// The next message: a part of the batch being sent, of what is pending, or a
    /// keepalive after `KEEPALIVE`.
    async fn next_part(&mut self) -> v1::EncodedBatch {
        if self.outgoing.is_none() {
            match next_drained(&self.mb, self.window).await {
                Ok(d) => self.outgoing = Some(Outgoing::new(&self.hub, d)),
                Err(idle_at) => {
                    // A keepalive: no ops, and the revision as of the drain that found
                    // none (a later one might name ops not sent yet).
                    return v1::EncodedBatch {
                        snapshot: false,
                        epoch: self.epoch.clone(),
                        revision: idle_at,
                        ops: Vec::new(),
                        api_validated: self.hub.api_validated(),
                        continued: false,
                    };
                }
            }
        }
        let out = self.outgoing.as_mut().expect("set above");
        let part = out.part(&self.hub, &self.epoch, self.part_bytes);
        if !part.continued {
            self.outgoing = None;
        }
        self.hub.count_sent(part.encoded_len());
        part
    }
}

/// What is pending (once `window` has passed since its first op), or (`Err`) the
/// revision as of a drain that found nothing once `KEEPALIVE` has passed.
async fn next_drained(mb: &Mailbox, window: Duration) -> Result<Drained, u64> {
    let deadline = tokio::time::Instant::now() + KEEPALIVE;
    loop {
        if let Some(left) = mb.settle(window) {
            tokio::time::sleep(left).await;
            continue;
        }
        let idle_at = match mb.drain() {
            Err(revision) => revision,
            Ok(d) => return Ok(d),
        };
        tokio::select! {
            _ = mb.notify.notified() => {}
            _ = tokio::time::sleep_until(deadline) => return Err(idle_at),
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
                let mut rest: Vec<Encoded> = whole.node.into_iter().collect();
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

/// How long a client may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the feed on `listener` until it fails: in plain text, or with mutual TLS whose
/// files are re-read for each new connection when they change.
pub async fn serve(
    listener: tokio::net::TcpListener,
    feed: Feed,
    tls: Option<Arc<crate::wire::tls::Reloading>>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
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
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a feed connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.config());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok::<_, std::io::Error>(stream)).await;
                    }
                    Ok(Err(e)) => tracing::info!(%peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::info!(%peer, "TLS handshake timed out"),
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
