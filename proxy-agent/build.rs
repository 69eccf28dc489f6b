//! Builds the BPF object with the pinned nightly (via aya-build) so the agent can embed it,
//! and the node-view feed's gRPC code from its `.proto` (with a vendored protoc: a fresh
//! machine needs no protobuf-compiler package).

use std::{env, path::PathBuf};

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// Keep in step with xtask's NIGHTLY.
const NIGHTLY: &str = "nightly-2026-10-29";

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir.parent().context("workspace root")?;
    // bpf-linker lives in the project-local tools folder (`cargo xtask setup`).
    let tools_bin = root.join(".tools/bin");
    if !tools_bin.join("bpf-linker").exists() {
        return Err(anyhow!(
            "bpf-linker not found in {}: run `cargo xtask setup` first",
            tools_bin.display()
        ));
    }
    let mut paths = vec![tools_bin];
    paths.extend(env::split_paths(&env::var_os("PATH").unwrap_or_default()));
    // SAFETY: build scripts are single-threaded at this point.
    unsafe { env::set_var("PATH", env::join_paths(paths)?) };
    build_proto()?;
    println!("cargo::rerun-if-changed=../proxy-common/src");
    let ebpf_dir = root.join("proxy-ebpf");
    let ebpf_dir = ebpf_dir.to_str().context("utf-8 path")?;
    aya_build::build_ebpf(
        [Package {
            name: "proxy-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        Toolchain::Custom(NIGHTLY),
    )
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
