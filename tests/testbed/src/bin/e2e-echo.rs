//! Echo backend for the testbed: answers with its identity over TCP and UDP.
use clap::Parser;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    id: String,
    #[arg(long)]
    tcp: u16,
    #[arg(long)]
    udp: u16,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    proxy_testbed::echo::serve(&a.id, a.tcp, a.udp)
}
