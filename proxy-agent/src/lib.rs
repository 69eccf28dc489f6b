//! proxy-agent: an eBPF service proxy for Kubernetes.
//!
//! `source` → `model` (node view) → `runner` → `dataplane` → BPF maps; the layers and
//! what each may import: `docs/architecture.md`.

pub mod config;
pub mod feed;
pub mod health_check;
pub mod http_server;
pub mod kube_proxy_cleanup;
pub mod metrics;
pub mod runner;
pub mod source;
pub mod trace;

/// The model and the node view: a crate of their own (`proxy-model`), so Cargo holds
/// the wall below the sources, the runner and the dataplane.
pub use proxy_model as model;

/// The dataplane (the `Dataplane` trait, the log and BPF dataplanes): a crate of its own
/// (`proxy-dataplane`), which never names the sources, the runner or the agent's config.
pub use proxy_dataplane as dataplane;
pub use proxy_dataplane::netns;

// Selects rustls' crypto provider (ring) for the API client; nothing to call.
use rustls as _;
