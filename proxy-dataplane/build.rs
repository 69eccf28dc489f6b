//! Builds the BPF programs (`proxy-ebpf`) so the dataplane can embed them.

fn main() -> anyhow::Result<()> {
    bpf_build::build("proxy-ebpf", "proxy-ebpf")
}
