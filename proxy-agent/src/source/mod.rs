//! Where Services and EndpointSlices come from. A source produces a `ClusterModel`;
//! it knows nothing of BPF.

pub mod files;
