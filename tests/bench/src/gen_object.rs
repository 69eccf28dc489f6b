//! The throughput benchmark's packet generator front (`bench-ebpf`), built by this
//! crate's build.rs and embedded here: the agent never carries it.

/// The object: `xdp_bench_gen` and `tc_bench_gen`, each tail-calling its contender.
pub static BENCH_GEN_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/bench-ebpf"));
