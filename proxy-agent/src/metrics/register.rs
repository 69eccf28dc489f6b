//! Registering one value under a name: the helpers every family of metrics uses.

use std::sync::atomic::AtomicU64;

use prometheus_client::{
    metrics::{counter::Counter, gauge::Gauge},
    registry::Registry,
};

/// A metric's labels, in order.
pub type Labels = Vec<(String, String)>;

pub fn counter(registry: &mut Registry, name: &str, help: &str, v: u64) {
    let c: Counter = Counter::default();
    c.inc_by(v);
    registry.register(name, help, c);
}

pub fn gauge(registry: &mut Registry, name: &str, help: &str, v: i64) {
    let g: Gauge = Gauge::default();
    g.set(v);
    registry.register(name, help, g);
}

pub fn gauge_f64(registry: &mut Registry, name: &str, help: &str, v: f64) {
    let g: Gauge<f64, AtomicU64> = Gauge::default();
    g.set(v);
    registry.register(name, help, g);
}
