//! Fuzzing the feed's wire messages as an agent reads them: random bytes, and mutations
//! of real batches (a snapshot of Services and EndpointSlices with every field set),
//! decoded and applied to a node's state. Nothing may panic; a batch refused leaves the
//! state as it was; one accepted leaves a state whose own snapshot reads back the same.
//! A bounded number of cases per run (`PROXY_FUZZ_CASES` for more: `cargo xtask fuzz`).

mod support;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proptest::prelude::*;
use prost::Message as _;
use proxy_agent::{
    feed::server::snapshot_ops,
    feed::wire::{NodeState, Parts, v1},
    model::{ClusterModel, NodeInfo},
};
use serde_json::json;

/// A state with something in it, and a snapshot batch that builds it.
fn seed_batch() -> (NodeState, Vec<u8>) {
    let mut model = ClusterModel::default();
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "default",
                     "annotations": {"ebpf.proxy.k8s.io/scheduler": "mh",
                                     "ebpf.proxy.k8s.io/weights": "10.1.0.1=3",
                                     "ebpf.proxy.k8s.io/lb-mode": "hybrid"}},
        "spec": {"clusterIPs": ["10.96.0.10", "fd96::10"], "type": "LoadBalancer",
                 "externalIPs": ["203.0.113.7"], "loadBalancerSourceRanges": ["10.0.0.0/8"],
                 "sessionAffinity": "ClientIP", "externalTrafficPolicy": "Local",
                 "healthCheckNodePort": 32000,
                 "ports": [{"name": "http", "port": 80, "targetPort": "web", "nodePort": 30080},
                           {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}
    }))
    .expect("service");
    model.add_service(&svc);
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": "web-1", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "web"},
                     "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-02T05:00:00Z"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}, {"name": "dns", "port": 5353, "protocol": "UDP"}],
        "endpoints": [{"addresses": ["10.1.0.1"], "nodeName": "n1",
                       "conditions": {"ready": false, "serving": true, "terminating": true},
                       "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "n1"}]}},
                      {"addresses": ["not-an-ip"]}]
    }))
    .expect("slice");
    model.add_slice(&slice);
    let mut node = NodeInfo {
        name: "n1".into(),
        addresses: vec!["192.168.0.1".parse().expect("ip")],
        pod_cidrs: vec!["10.1.0.0/24".parse().expect("cidr")],
        ..Default::default()
    };
    node.labels
        .insert("topology.kubernetes.io/zone".into(), "z1".into());
    let batch = v1::Batch {
        snapshot: true,
        epoch: "e".into(),
        revision: 7,
        ops: snapshot_ops(&model, Some(&node)),
        api_validated: true,
        continued: false,
    };
    let mut state = NodeState::default();
    state.apply(&batch).expect("the seed applies");
    (state, batch.encode_to_vec())
}

fn read_and_apply(state: &NodeState, bytes: &[u8]) {
    let Ok(batch) = v1::Batch::decode(bytes) else {
        return;
    };
    let mut next = state.clone();
    match next.apply(&batch) {
        Err(_) => assert_eq!(&next, state, "a refused batch changed the state"),
        Ok(()) => {
            // What was accepted is the state: its own snapshot builds it again.
            let again = v1::Batch {
                snapshot: true,
                epoch: next.epoch.clone(),
                revision: next.revision,
                ops: snapshot_ops(&next.model, next.node.as_ref()),
                api_validated: next.api_validated,
                continued: false,
            };
            let mut rebuilt = NodeState::default();
            rebuilt
                .apply(&v1::Batch::decode(again.encode_to_vec().as_slice()).expect("decodes"))
                .expect("its own snapshot applies");
            assert_eq!(rebuilt.model, next.model);
            assert_eq!(rebuilt.node, next.node);
        }
    }
}

proptest! {
    #![proptest_config(support::fuzz_config(256))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let (state, _) = seed_batch();
        read_and_apply(&state, &bytes);
        read_and_apply(&NodeState::default(), &bytes);
    }

    #[test]
    fn mutated_batches_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..8),
        incremental in any::<bool>(),
    ) {
        let (state, mut bytes) = seed_batch();
        if incremental {
            // The same ops as a change after the snapshot (byte 0x08 0x01 is `snapshot: true`).
            if let Some(pos) = bytes.windows(2).position(|w| w == [0x08, 0x01]) {
                bytes.drain(pos..pos + 2);
            }
        }
        for (at, b, kind) in edits {
            if bytes.is_empty() {
                break;
            }
            let i = at.index(bytes.len());
            match kind {
                0 => bytes[i] = b,
                1 => bytes.insert(i, b),
                _ => bytes.truncate(i),
            }
        }
        read_and_apply(&state, &bytes);
    }

    #[test]
    fn parts_of_a_batch_join_into_it_and_stray_parts_never_panic(
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
        strays in prop::collection::vec((any::<bool>(), any::<bool>(), 0u64..3, prop::collection::vec(any::<u8>(), 0..64)), 0..6),
    ) {
        let (_, bytes) = seed_batch();
        let whole = v1::Batch::decode(bytes.as_slice()).expect("the seed decodes");
        // The seed split at random op boundaries, as the server sends it.
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(whole.ops.len())).collect();
        at.sort_unstable();
        at.dedup();
        let mut parts = Parts::default();
        let mut from = 0;
        let mut joined = None;
        for end in at.into_iter().chain([whole.ops.len()]) {
            let end = end.max(from);
            let part = v1::Batch {
                ops: whole.ops[from..end].to_vec(),
                continued: end < whole.ops.len(),
                ..whole.clone()
            };
            from = end;
            let bytes = part.encode_to_vec();
            prop_assert!(joined.is_none(), "joined before the last part");
            joined = parts.push(v1::Batch::decode(bytes.as_slice()).expect("a part decodes"));
        }
        prop_assert_eq!(joined.as_ref(), Some(&whole));
        // Stray parts (any flags, revisions, garbage ops) never panic, and whatever they
        // join is refused or applied whole by the state.
        for (snapshot, continued, revision, junk) in strays {
            let part = v1::Batch {
                snapshot,
                continued,
                revision,
                epoch: "e".into(),
                ops: v1::Batch::decode(junk.as_slice()).map(|b| b.ops).unwrap_or_default(),
                api_validated: false,
            };
            if let Some(batch) = parts.push(part) {
                let mut state = NodeState::default();
                let before = state.clone();
                if state.apply(&batch).is_err() {
                    prop_assert_eq!(state, before);
                }
            }
        }
    }
}
