//! Network programming latency, as kube-proxy reports it: from the moment the endpoints
//! controller saw a change (the EndpointSlice's `last-change-trigger-time` annotation) to
//! the moment this node's dataplane holds it. (The model reads the annotation:
//! `objects::TRIGGER_TIME`; `ClusterModel::changes_to` finds the new ones.)

use std::time::{Duration, SystemTime};

use prometheus_client::metrics::histogram::Histogram;

/// How long ago `t` was; zero for a clock that ran ahead of ours.
pub fn since(t: SystemTime, now: SystemTime) -> Duration {
    now.duration_since(t).unwrap_or_default()
}

/// kube-proxy's network programming buckets: 0.25 s to 5 min.
pub fn kube_proxy_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

/// A histogram with kube-proxy's network programming buckets.
pub fn kube_proxy_programming_histogram() -> Histogram {
    Histogram::new(kube_proxy_programming_buckets())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::discovery::v1::EndpointSlice, apimachinery::pkg::apis::meta::v1::ObjectMeta,
        chrono::DateTime,
    };

    use super::*;
    use crate::model::{ClusterModel, objects::TRIGGER_TIME};

    fn add(m: &mut ClusterModel, name: &str, t: Option<&str>) {
        let slice = EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some("default".into()),
                annotations: t.map(|t| BTreeMap::from([(TRIGGER_TIME.into(), t.into())])),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: Vec::new(),
            ports: None,
        };
        m.add_slice(&slice);
    }

    #[test]
    fn each_change_counts_once() {
        let t1 = "2026-11-29T12:00:00Z";
        let t2 = "2026-11-29T12:00:05.5Z";
        let mut prev = ClusterModel::default();
        add(&mut prev, "a", Some(t1));
        add(&mut prev, "b", Some(t1));
        add(&mut prev, "c", None);
        let mut next = prev.clone();
        add(&mut next, "a", Some(t1)); // unchanged: already counted
        add(&mut next, "b", Some(t2)); // changed again
        add(&mut next, "c", None); // no annotation (written by hand)
        add(&mut next, "d", Some(t2)); // new
        add(&mut next, "e", Some("soon")); // malformed: ignored
        let got = prev.changes_to(&next).triggers;
        let want = SystemTime::from(DateTime::parse_from_rfc3339(t2).expect("rfc3339"));
        assert_eq!(got, vec![want, want]);
        let later = want + Duration::from_millis(1500);
        assert_eq!(since(want, later), Duration::from_millis(1500));
        assert_eq!(since(later, want), Duration::ZERO);
    }
}
