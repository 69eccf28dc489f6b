//! Network programming latency, as kube-proxy reports it: from the moment the endpoints
//! controller saw a change (the EndpointSlice's `last-change-trigger-time` annotation) to
//! the moment this node's dataplane holds it.

use std::time::{Duration, SystemTime};

use k8s_openapi::chrono::DateTime;

use crate::model::ClusterModel;

/// Set by the endpoints controllers on every EndpointSlice they write.
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// The trigger times of the EndpointSlices whose trigger time is new in `next`
/// (a new slice, or a new change to one): each change is counted once.
pub fn new_triggers(prev: &ClusterModel, next: &ClusterModel) -> Vec<SystemTime> {
    next.slices
        .iter()
        .filter_map(|(key, slice)| {
            let t = trigger(slice)?;
            let before = prev.slices.get(key).and_then(trigger);
            (before != Some(t)).then_some(t)
        })
        .filter_map(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(SystemTime::from)
        .collect()
}

fn trigger(slice: &k8s_openapi::api::discovery::v1::EndpointSlice) -> Option<&str> {
    slice
        .metadata
        .annotations
        .as_ref()?
        .get(TRIGGER_TIME)
        .map(String::as_str)
}

/// How long ago `t` was; zero for a clock that ran ahead of ours.
pub fn since(t: SystemTime, now: SystemTime) -> Duration {
    now.duration_since(t).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::discovery::v1::EndpointSlice, apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;
    use crate::model::ObjectRef;

    fn model(slices: &[(&str, Option<&str>)]) -> ClusterModel {
        let mut m = ClusterModel::default();
        for (name, t) in slices {
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
            m.slices.insert(ObjectRef::of(&slice.metadata), slice);
        }
        m
    }

    #[test]
    fn each_change_counts_once() {
        let t1 = "2026-11-29T12:00:00Z";
        let t2 = "2026-11-29T12:00:05.5Z";
        let prev = model(&[("a", Some(t1)), ("b", Some(t1)), ("c", None)]);
        let next = model(&[
            ("a", Some(t1)),     // unchanged: already counted
            ("b", Some(t2)),     // changed again
            ("c", None),         // no annotation (written by hand)
            ("d", Some(t2)),     // new
            ("e", Some("soon")), // malformed: ignored
        ]);
        let got = new_triggers(&prev, &next);
        let want = SystemTime::from(DateTime::parse_from_rfc3339(t2).expect("rfc3339"));
        assert_eq!(got, vec![want, want]);
        let later = want + Duration::from_millis(1500);
        assert_eq!(since(want, later), Duration::from_millis(1500));
        assert_eq!(since(later, want), Duration::ZERO);
    }
}
