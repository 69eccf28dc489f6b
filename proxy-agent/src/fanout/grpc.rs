//! The feed's gRPC service: who is asking (`Identity`), their stream (a batch per drain
//! of their mailbox, a keepalive when nothing happens), and the server.

use std::{pin::Pin, sync::Arc, time::Duration};

use futures::Stream;
use tonic::{Request, Response, Status};

use super::{Hub, mailbox::Drained, snapshot_ops};
use crate::wire::v1::{self, node_feed_server::NodeFeed};

use crate::wire::KEEPALIVE;

/// How the server learns who a client is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Identity {
    /// The client certificate's `system:node:<name>` (CN or a DNS/URI SAN).
    ClientCertificate,
    /// No credentials at all: the name in the request is believed (tests, loopback).
    Insecure,
}

pub struct Feed {
    hub: Arc<Hub>,
    identity: Identity,
}

impl Feed {
    pub fn new(hub: Arc<Hub>, identity: Identity) -> Self {
        Self { hub, identity }
    }

    pub fn into_server(self) -> v1::node_feed_server::NodeFeedServer<Self> {
        v1::node_feed_server::NodeFeedServer::new(self).max_encoding_message_size(usize::MAX)
    }
}

/// The node a certificate names: `system:node:<name>` as kubelet's client certificates
/// spell it.
pub fn node_of_certificate(der: &[u8]) -> Option<String> {
    const PREFIX: &str = "system:node:";
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let from_cn = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok())
        .find_map(|cn| cn.strip_prefix(PREFIX).map(str::to_string));
    if from_cn.is_some() {
        return from_cn;
    }
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::DNSName(s)
        | x509_parser::extensions::GeneralName::URI(s) => {
            s.strip_prefix(PREFIX).map(str::to_string)
        }
        _ => None,
    })
}

type BatchStream = Pin<Box<dyn Stream<Item = Result<v1::Batch, Status>> + Send>>;

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
                let named = node_of_certificate(first.as_ref()).ok_or_else(|| {
                    Status::permission_denied("the certificate names no system:node:<name>")
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
        tracing::info!(%node, epoch = %req.epoch, revision = req.revision, "node connected");
        let hub = Arc::clone(&self.hub);
        let epoch = hub.epoch();
        let stream = futures::stream::unfold((hub, mb, epoch), |(hub, mb, epoch)| async move {
            let batch = next_batch(&hub, &mb, &epoch).await;
            Some((Ok(batch), (hub, mb, epoch)))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The next batch for one node: what is pending, or a keepalive after `KEEPALIVE`.
async fn next_batch(hub: &Hub, mb: &super::mailbox::Mailbox, epoch: &str) -> v1::Batch {
    let deadline = tokio::time::Instant::now() + KEEPALIVE;
    loop {
        let idle_at = match mb.drain() {
            Err(revision) => revision,
            Ok(d) => return batch_of(hub, d, epoch),
        };
        tokio::select! {
            _ = mb.notify.notified() => {}
            _ = tokio::time::sleep_until(deadline) => {
                // A keepalive: no ops, and the revision as of the drain that found none
                // (a later one might name ops not sent yet).
                return v1::Batch {
                    snapshot: false,
                    epoch: epoch.to_string(),
                    revision: idle_at,
                    ops: Vec::new(),
                    api_validated: hub.api_validated(),
                };
            }
        }
    }
}

/// A drained mailbox as the batch that carries it.
pub fn batch_of(hub: &Hub, drained: Drained, epoch: &str) -> v1::Batch {
    let api_validated = hub.api_validated();
    match drained {
        Drained::Snapshot(whole, after, revision) => {
            hub.count_snapshot();
            let mut ops = snapshot_ops(&whole);
            ops.extend(after.iter().map(|o| (**o).clone()));
            v1::Batch {
                snapshot: true,
                epoch: epoch.to_string(),
                revision,
                ops,
                api_validated,
            }
        }
        Drained::Ops(ops, revision) => v1::Batch {
            snapshot: false,
            epoch: epoch.to_string(),
            revision,
            ops: ops.iter().map(|o| (**o).clone()).collect(),
            api_validated,
        },
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
