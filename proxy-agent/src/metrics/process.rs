//! The process metrics every Go component exports (`process_*`).

use std::sync::atomic::AtomicU64;

use prometheus_client::{metrics::counter::Counter, registry::Registry};

use super::register::{gauge, gauge_f64};

/// `process_*`, as client_golang's process collector exports them (Linux /proc).
pub fn process(r: &mut Registry) {
    let Ok(me) = procfs::process::Process::myself() else {
        return;
    };
    if let Ok(stat) = me.stat() {
        let ticks = procfs::ticks_per_second() as f64;
        let cpu: Counter<f64, AtomicU64> = Counter::default();
        cpu.inc_by((stat.utime + stat.stime) as f64 / ticks);
        r.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            cpu,
        );
        gauge(
            r,
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            (stat.rss * procfs::page_size()) as i64,
        );
        gauge(
            r,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            stat.vsize as i64,
        );
        if let Ok(boot) = procfs::boot_time_secs() {
            gauge_f64(
                r,
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                boot as f64 + stat.starttime as f64 / ticks,
            );
        }
    }
    if let Ok(n) = me.fd_count() {
        gauge(
            r,
            "process_open_fds",
            "Number of open file descriptors",
            n as i64,
        );
    }
    if let Ok(limits) = me.limits()
        && let procfs::process::LimitValue::Value(max) = limits.max_open_files.soft_limit
    {
        gauge(
            r,
            "process_max_fds",
            "Maximum number of open file descriptors",
            max as i64,
        );
    }
}
