//! Per-Service-port traffic (`proxy_agent_service_*`): the programs' per-frontend counts
//! summed over every frontend of a Service port — ClusterIPs, NodePorts on each node
//! address, external and load-balancer IPs, both families and both scopes — so the series
//! follow Service ports, never addresses or endpoints.

use std::collections::BTreeMap;

use prometheus_client::{
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

use super::register::Labels;
use crate::{
    dataplane::bpf::stats::Totals,
    model::{Frontend, NodeView},
};

/// The counts last exported per Service port, so a scrape never shows less than the one
/// before: a read may miss a flow's counts once while they move from its conntrack
/// entries to `LB_STATS` (or a removed backend's into its frontend's), and Prometheus
/// takes any decrease for a counter reset. A Service port gone from the view starts
/// over.
#[derive(Debug, Default)]
pub(super) struct HighWater(BTreeMap<String, Totals>);

impl HighWater {
    pub(super) const fn new() -> Self {
        HighWater(BTreeMap::new())
    }

    /// `now`, each count raised to what was last exported; remembered for the next.
    fn hold(&mut self, now: BTreeMap<&str, Totals>) -> BTreeMap<String, Totals> {
        let next: BTreeMap<String, Totals> = now
            .into_iter()
            .map(|(service, t)| {
                let held = match self.0.get(service) {
                    Some(h) => Totals {
                        conns: t.conns.max(h.conns),
                        packets_in: t.packets_in.max(h.packets_in),
                        packets_out: t.packets_out.max(h.packets_out),
                        bytes_in: t.bytes_in.max(h.bytes_in),
                        bytes_out: t.bytes_out.max(h.bytes_out),
                    },
                    None => t,
                };
                (service.to_string(), held)
            })
            .collect();
        self.0.clone_from(&next);
        next
    }
}

/// Registers the three counter families from per-frontend totals. Frontends not in
/// `view` (removed, their counts not yet collected) are left out.
pub(super) fn register(
    r: &mut Registry,
    totals: &BTreeMap<Frontend, Totals>,
    view: &NodeView,
    high: &mut HighWater,
) {
    let conns = Family::<Labels, Counter>::default();
    let packets = Family::<Labels, Counter>::default();
    let bytes = Family::<Labels, Counter>::default();
    for (service, t) in high.hold(by_service_port(totals, view)) {
        let labels = service_port_labels(&service);
        conns.get_or_create(&labels).inc_by(t.conns);
        for (direction, p, b) in [
            ("in", t.packets_in, t.bytes_in),
            ("out", t.packets_out, t.bytes_out),
        ] {
            let mut labels = labels.clone();
            labels.push(("direction".into(), direction.into()));
            packets.get_or_create(&labels).inc_by(p);
            bytes.get_or_create(&labels).inc_by(b);
        }
    }
    r.register(
        "service_connections",
        "New connections to a Service port (per-packet and connect-time paths)",
        conns,
    );
    r.register(
        "service_packets",
        "Packets of a Service port's flows, client to backend (in) and back (out); \
         per-packet path only",
        packets,
    );
    r.register(
        "service_bytes",
        "Bytes (with link-layer headers) of a Service port's flows, client to backend (in) \
         and back (out); per-packet path only",
        bytes,
    );
}

/// Totals per Service port (`FrontendState::service`).
fn by_service_port<'v>(
    totals: &BTreeMap<Frontend, Totals>,
    view: &'v NodeView,
) -> BTreeMap<&'v str, Totals> {
    let mut out: BTreeMap<&str, Totals> = BTreeMap::new();
    for (frontend, t) in totals {
        if let Some(state) = view.get(frontend) {
            *out.entry(state.service.as_str()).or_default() += *t;
        }
    }
    out
}

/// `namespace/name:port` as labels (`port`: the port's name, or its number when it has
/// none). Kubernetes names hold neither `/` nor `:`, so the split is exact.
fn service_port_labels(service: &str) -> Labels {
    let (namespace, rest) = service.split_once('/').unwrap_or(("", service));
    let (name, port) = rest.rsplit_once(':').unwrap_or((rest, ""));
    vec![
        ("namespace".into(), namespace.into()),
        ("service".into(), name.into()),
        ("port".into(), port.into()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{FrontendKind, FrontendState, Protocol};

    fn frontend(ip: &str, port: u16) -> Frontend {
        Frontend {
            ip: ip.parse().expect("ip"),
            port,
            protocol: Protocol::Tcp,
        }
    }

    fn state(service: &str, kind: FrontendKind) -> FrontendState {
        FrontendState::builder(service, kind).build()
    }

    fn totals(conns: u64, bytes_in: u64) -> Totals {
        Totals {
            conns,
            packets_in: conns,
            bytes_in,
            ..Totals::default()
        }
    }

    /// A Service port's ClusterIP and NodePort make one series; another port its own;
    /// a frontend the view no longer has, none.
    #[test]
    fn one_series_per_service_port() {
        let view = NodeView::from([
            (
                frontend("10.96.0.10", 80),
                state("shop/web:http", FrontendKind::ClusterIp),
            ),
            (
                frontend("192.0.2.10", 30080),
                state("shop/web:http", FrontendKind::NodePort),
            ),
            (
                frontend("10.96.0.10", 443),
                state("shop/web:443", FrontendKind::ClusterIp),
            ),
        ]);
        let per_frontend = BTreeMap::from([
            (frontend("10.96.0.10", 80), totals(2, 200)),
            (frontend("192.0.2.10", 30080), totals(1, 60)),
            (frontend("10.96.0.10", 443), totals(5, 500)),
            (frontend("10.96.0.99", 53), totals(9, 900)),
        ]);
        let text = render(&per_frontend, &view, &mut HighWater::new());
        for line in [
            "# TYPE proxy_agent_service_connections counter",
            "proxy_agent_service_connections_total{namespace=\"shop\",service=\"web\",port=\"http\"} 3",
            "proxy_agent_service_connections_total{namespace=\"shop\",service=\"web\",port=\"443\"} 5",
            "proxy_agent_service_packets_total{namespace=\"shop\",service=\"web\",port=\"http\",direction=\"in\"} 3",
            "proxy_agent_service_packets_total{namespace=\"shop\",service=\"web\",port=\"http\",direction=\"out\"} 0",
            "proxy_agent_service_bytes_total{namespace=\"shop\",service=\"web\",port=\"http\",direction=\"in\"} 260",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        assert!(!text.contains("900"), "a frontend out of the view:\n{text}");
    }

    fn render(
        per_frontend: &BTreeMap<Frontend, Totals>,
        view: &NodeView,
        high: &mut HighWater,
    ) -> String {
        let mut r = Registry::default();
        register(
            r.sub_registry_with_prefix("proxy_agent"),
            per_frontend,
            view,
            high,
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).expect("encode");
        text
    }

    /// A read that misses counts on the move shows what the scrape before showed, never
    /// less; the counts go on from there. A Service port that left the view starts over.
    #[test]
    fn a_scrape_never_shows_less_than_the_one_before() {
        let view = NodeView::from([(
            frontend("10.96.0.10", 80),
            state("shop/web:http", FrontendKind::ClusterIp),
        )]);
        let at =
            |conns, bytes| BTreeMap::from([(frontend("10.96.0.10", 80), totals(conns, bytes))]);
        // The value of the first series line `is` picks.
        let value = |text: &str, is: &dyn Fn(&str) -> bool| {
            text.lines()
                .find(|l| is(l))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<u64>().ok())
                .expect("the series")
        };
        let conns = |text: &str| {
            value(text, &|l| {
                l.starts_with("proxy_agent_service_connections_total{")
            })
        };
        let bytes_in = |text: &str| {
            value(text, &|l| {
                l.starts_with("proxy_agent_service_bytes_total{") && l.contains("\"in\"")
            })
        };
        let mut high = HighWater::new();
        let first = render(&at(5, 500), &view, &mut high);
        assert_eq!((conns(&first), bytes_in(&first)), (5, 500));
        let dip = render(&at(5, 300), &view, &mut high);
        assert_eq!((conns(&dip), bytes_in(&dip)), (5, 500), "held:\n{dip}");
        let on = render(&at(6, 700), &view, &mut high);
        assert_eq!((conns(&on), bytes_in(&on)), (6, 700));
        // Gone from the view, then back with fresh counts.
        render(&BTreeMap::new(), &NodeView::new(), &mut high);
        let again = render(&at(1, 10), &view, &mut high);
        assert_eq!((conns(&again), bytes_in(&again)), (1, 10), "started over");
    }

    #[test]
    fn labels_of_odd_service_strings_keep_the_text() {
        let get = |s| {
            service_port_labels(s)
                .into_iter()
                .map(|(_, v)| v)
                .collect::<Vec<_>>()
        };
        assert_eq!(get("ns/name:53"), ["ns", "name", "53"]);
        assert_eq!(get("name"), ["", "name", ""]);
    }
}
