//! The programs' aya-log records, pumped into the agent's `tracing` output.

/// Forwards aya-log records from the programs to our tracing output.
pub fn spawn(ebpf: &mut aya::Ebpf) {
    let logger = match aya_log::EbpfLogger::init(ebpf) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "BPF program logs unavailable");
            return;
        }
    };
    // SAFETY: the logger owns its ring-buffer fd; flushing neither closes nor replaces it.
    let fd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let Ok(mut fd) = fd else {
        tracing::warn!("BPF program logs unavailable: cannot poll the ring buffer");
        return;
    };
    tokio::spawn(async move {
        loop {
            let Ok(mut guard) = fd.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}
