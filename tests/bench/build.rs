//! Builds the benchmark's packet generator front (`bench-ebpf`) for `bench::gen_object`.

fn main() -> anyhow::Result<()> {
    bpf_build::build("bench-ebpf", "bench-ebpf")
}
