//! Keeps the programs' global BPF functions global: bpf-linker internalizes every symbol
//! it is not told to export, and an internal function is verified inline at each call.
fn main() {
    for symbol in ["proxy_least_loaded"] {
        println!("cargo::rustc-link-arg-bins=--export={symbol}");
    }
}
