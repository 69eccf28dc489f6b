//! proxy-agent: an eBPF service proxy for Kubernetes.
//!
//! `source` → `model` (node view) → `sync` → `dataplane` → BPF maps.

pub mod dataplane;
pub mod model;
pub mod netns;
pub mod source;
pub mod sync;
