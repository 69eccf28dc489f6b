//! The generated code of `proxy.nodeview.v1` (build.rs, from the `.proto`).

tonic::include_proto!("proxy.nodeview.v1");
// The server of `NodeFeed` (build.rs): it streams `EncodedBatch`.
include!(concat!(env!("OUT_DIR"), "/proxy.nodeview.v1.NodeFeed.rs"));
