//! The feed's mutual TLS, from PEM files re-read when they change (cert-manager or a
//! Secret volume rotates them): the server's certificate and key, and the CA that signs
//! the nodes' client certificates. Each new connection takes the files as they are.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::SystemTime,
};

use anyhow::{Context as _, Result};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};

/// Where the PEM files are.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA the peer's certificate must chain to.
    pub ca: PathBuf,
}

impl TlsFiles {
    fn stamps(&self) -> [Option<SystemTime>; 3] {
        let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        [m(&self.cert), m(&self.key), m(&self.ca)]
    }

    pub fn certs(&self) -> Result<Vec<CertificateDer<'static>>> {
        CertificateDer::pem_file_iter(&self.cert)
            .with_context(|| format!("reading {}", self.cert.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("parsing {}", self.cert.display()))
    }

    pub fn key(&self) -> Result<PrivateKeyDer<'static>> {
        PrivateKeyDer::from_pem_file(&self.key)
            .with_context(|| format!("reading the key {}", self.key.display()))
    }

    pub fn roots(&self) -> Result<rustls::RootCertStore> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(&self.ca)
            .with_context(|| format!("reading {}", self.ca.display()))?
        {
            roots
                .add(c.with_context(|| format!("parsing {}", self.ca.display()))?)
                .context("a CA certificate rustls refuses")?;
        }
        Ok(roots)
    }

    /// A server configuration that requires a client certificate signed by the CA.
    pub fn server_config(&self) -> Result<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(self.roots()?),
            Arc::clone(&provider),
        )
        .build()
        .context("the client-certificate verifier")?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS versions")?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.certs()?, self.key()?)
            .context("the server certificate and key")?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(cfg)
    }
}

/// The server's TLS configuration, rebuilt when a file changes.
pub struct Reloading {
    files: TlsFiles,
    current: Mutex<(Arc<rustls::ServerConfig>, [Option<SystemTime>; 3])>,
}

impl Reloading {
    pub fn new(files: TlsFiles) -> Result<Self> {
        let stamps = files.stamps();
        let cfg = Arc::new(files.server_config()?);
        Ok(Self {
            files,
            current: Mutex::new((cfg, stamps)),
        })
    }

    /// The configuration for a new connection: the files as they are now, or the last
    /// good configuration while they do not load (a rotation half written).
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let stamps = self.files.stamps();
        if stamps != cur.1 {
            match self.files.server_config() {
                Ok(cfg) => {
                    tracing::info!(cert = %self.files.cert.display(), "TLS files reloaded");
                    *cur = (Arc::new(cfg), stamps);
                }
                Err(e) => tracing::warn!(
                    error = format!("{e:#}"),
                    "TLS files changed but do not load; keeping the previous ones"
                ),
            }
        }
        Arc::clone(&cur.0)
    }
}
