//! proxy-agent: an eBPF service proxy for Kubernetes.
//!
//! `source` → `model` (node view) → `sync` → `dataplane` → BPF maps.

pub mod config;
pub mod dataplane;
pub mod debug;
pub mod health;
pub mod kube_proxy_cleanup;
pub mod metrics;
pub mod model;
pub mod netns;
pub mod source;
pub mod sync;
pub mod trace;

// Selects rustls' crypto provider (ring) for the API client; nothing to call.
use rustls as _;
