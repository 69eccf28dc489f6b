//! Builds the node-view feed's gRPC code from its `.proto` (with a vendored protoc: a fresh
//! machine needs no protobuf-compiler package). The BPF object is proxy-dataplane's.

use std::env;

use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    build_proto()
}

/// The feed's messages and service (`proxy.nodeview.v1`), into OUT_DIR.
fn build_proto() -> anyhow::Result<()> {
    let protoc = protoc_bin_vendored::protoc_bin_path().context("the vendored protoc")?;
    // SAFETY: build scripts are single-threaded at this point.
    unsafe { env::set_var("PROTOC", protoc) };
    let proto = "proto/proxy/nodeview/v1/nodeview.proto";
    println!("cargo::rerun-if-changed={proto}");
    tonic_prost_build::configure()
        // Labels in order: the same Node encodes to the same bytes.
        .btree_map(".")
        .bytes(".proxy.nodeview.v1.EncodedBatch.ops")
        // The server is generated below, streaming EncodedBatch instead of Batch.
        .build_server(false)
        .compile_protos(&[proto], &["proto"])
        .context("compiling the node-view feed's .proto")?;
    // NodeFeed's server as the .proto names it (the same route), writing each op's shared
    // bytes (`EncodedBatch`) where the client reads `Batch`.
    let watch = tonic_build::manual::Method::builder()
        .name("watch")
        .route_name("Watch")
        .input_type("super::WatchRequest")
        .output_type("super::EncodedBatch")
        .codec_path("tonic_prost::ProstCodec")
        .server_streaming()
        .build();
    let service = tonic_build::manual::Service::builder()
        .name("NodeFeed")
        .package("proxy.nodeview.v1")
        .method(watch)
        .build();
    tonic_build::manual::Builder::new()
        .build_client(false)
        .compile(&[service]);
    Ok(())
}
