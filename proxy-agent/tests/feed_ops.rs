//! The feed's ops give each node the model the server holds: random changes to
//! Services, EndpointSlices (moves between Services included) and Nodes go through the
//! hub, the mailboxes and the wire (encoded and decoded), and the node's state — and the
//! node view built from it — must equal what the server computes in process. Also:
//! resuming from a revision, a node past its bound getting a snapshot, another node's
//! Node never reaching a node, every Node's addresses (peers) reaching the nodes that read
//! them and no other.

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proptest::prelude::*;
use prost::Message as _;
use proxy_agent::{
    feed::server::{Hub, HubOptions, Reads, grpc::parts_of, mailbox::Mailbox},
    feed::wire::{NodeState, Parts, v1},
    model::{ClusterModel, NodeInfo, ObjectRef, ViewConfig, ViewTracker, node_view},
    source::Snapshot,
};
use serde_json::json;

#[derive(Clone, Debug)]
enum Change {
    Service {
        idx: u8,
        port: u16,
        policy_local: bool,
    },
    RemoveService(u8),
    Slice {
        idx: u8,
        service: u8,
        eps: Vec<(u8, bool, u8)>,
        trigger: u32,
    },
    RemoveSlice(u8),
    Node {
        idx: u8,
        zone: u8,
        ip: u8,
    },
    RemoveNode(u8),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        (0u8..4, 79u16..82, any::<bool>()).prop_map(|(idx, port, policy_local)| Change::Service {
            idx,
            port,
            policy_local
        }),
        (0u8..4).prop_map(Change::RemoveService),
        (
            0u8..6,
            0u8..4,
            prop::collection::vec((0u8..6, any::<bool>(), 0u8..3), 0..4),
            0u32..3
        )
            .prop_map(|(idx, service, eps, trigger)| Change::Slice {
                idx,
                service,
                eps,
                trigger
            }),
        (0u8..6).prop_map(Change::RemoveSlice),
        (0u8..3, 0u8..2, 0u8..2).prop_map(|(idx, zone, ip)| Change::Node { idx, zone, ip }),
        (0u8..3).prop_map(Change::RemoveNode),
    ]
}

/// The server's side: the model and Nodes a source would publish.
#[derive(Default)]
struct World {
    snap: Snapshot,
}

impl World {
    fn apply(&mut self, c: &Change) {
        let m = &mut self.snap.model;
        match c {
            Change::Service {
                idx,
                port,
                policy_local,
            } => {
                let svc: Service = serde_json::from_value(json!({
                    "metadata": {"name": format!("s{idx}"), "namespace": "default"},
                    "spec": {"clusterIP": format!("10.96.0.{}", idx + 1), "type": "NodePort",
                             "externalTrafficPolicy": if *policy_local {"Local"} else {"Cluster"},
                             "ports": [{"port": port, "nodePort": 30000 + u32::from(*idx),
                                        "targetPort": 8080}]}
                }))
                .expect("service");
                m.add_service(&svc);
            }
            Change::RemoveService(idx) => {
                m.remove_service(&ObjectRef {
                    namespace: "default".into(),
                    name: format!("s{idx}").into(),
                });
            }
            Change::Slice {
                idx,
                service,
                eps,
                trigger,
            } => {
                let endpoints: Vec<_> = eps
                    .iter()
                    .map(|(ip, ready, node)| {
                        json!({
                            "addresses": [format!("10.1.0.{ip}")],
                            "conditions": {"ready": ready},
                            "nodeName": format!("n{node}"),
                            "hints": {"forZones": [{"name": format!("z{}", node % 2)}]}
                        })
                    })
                    .collect();
                let slice: EndpointSlice = serde_json::from_value(json!({
                    "metadata": {"name": format!("e{idx}"), "namespace": "default",
                                 "labels": {"kubernetes.io/service-name": format!("s{service}")},
                                 "annotations": {"endpoints.kubernetes.io/last-change-trigger-time":
                                                 format!("2026-12-02T05:0{trigger}:00Z")}},
                    "addressType": "IPv4",
                    "ports": [{"port": 8080, "protocol": "TCP"}],
                    "endpoints": endpoints
                }))
                .expect("slice");
                m.add_slice(&slice);
            }
            Change::RemoveSlice(idx) => {
                m.remove_slice(&ObjectRef {
                    namespace: "default".into(),
                    name: format!("e{idx}").into(),
                });
            }
            Change::Node { idx, zone, ip } => {
                let name = format!("n{idx}");
                let mut info = NodeInfo {
                    name: name.clone(),
                    ..Default::default()
                };
                info.labels
                    .insert("topology.kubernetes.io/zone".into(), format!("z{zone}"));
                info.addresses = vec![format!("192.168.0.{}", 10 + ip).parse().expect("ip")];
                self.snap.nodes.insert(name, info);
            }
            Change::RemoveNode(idx) => {
                self.snap.nodes.remove(&format!("n{idx}"));
            }
        }
    }
}

/// Drains a mailbox through the wire: in parts of about `part_bytes` of ops, each
/// encoded as the server's `EncodedBatch`, decoded as the agent's `Batch`, joined,
/// applied once whole.
fn deliver_in(hub: &Hub, mb: &Mailbox, state: &mut NodeState, part_bytes: usize) {
    if let Ok(d) = mb.drain() {
        let mut parts = Parts::default();
        let sent = parts_of(hub, d, &hub.epoch(), part_bytes);
        let count = sent.len();
        for (i, part) in sent.into_iter().enumerate() {
            assert_eq!(
                part.continued,
                i + 1 < count,
                "only the last part ends the batch"
            );
            let decoded = v1::Batch::decode(part.encode_to_vec().as_slice()).expect("decodes");
            match parts.push(decoded) {
                Some(whole) => {
                    assert_eq!(i + 1, count, "a batch applied before its last part");
                    state.apply(&whole).expect("applies");
                }
                None => assert!(i + 1 < count, "the last part left the batch open"),
            }
        }
    }
}

/// In parts small enough that a snapshot of a few objects takes several.
fn deliver(hub: &Hub, mb: &Mailbox, state: &mut NodeState) {
    deliver_in(hub, mb, state, 200);
}

/// Every Node as a node that reads peers holds it: name and addresses.
fn peers_of(world: &World) -> imbl::OrdMap<String, NodeInfo> {
    world
        .snap
        .nodes
        .iter()
        .map(|(name, n)| {
            let peer = NodeInfo {
                name: name.clone(),
                addresses: n.addresses.clone(),
                ..Default::default()
            };
            (name.clone(), peer)
        })
        .collect()
}

const PEERS: Reads = Reads { peers: true };

fn same_as_server(world: &World, node: &str, state: &NodeState) -> Result<(), TestCaseError> {
    prop_assert_eq!(&state.model, &world.snap.model);
    prop_assert_eq!(state.node.as_ref(), world.snap.nodes.get(node));
    let fallback = NodeInfo {
        name: node.into(),
        ..Default::default()
    };
    let server_node = world
        .snap
        .nodes
        .get(node)
        .cloned()
        .unwrap_or(fallback.clone());
    let cfg = ViewConfig::default();
    let (want, _) = node_view(&world.snap.model, &server_node, &cfg);
    let (got, _) = node_view(&state.model, state.node.as_ref().unwrap_or(&fallback), &cfg);
    prop_assert_eq!(got, want);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn ops_on_the_wire_give_the_node_view_computed_in_process(
        changes in prop::collection::vec(change(), 1..40),
        deliver_every in 1usize..5,
        resume_at in 0usize..40,
        part_bytes in prop_oneof![Just(usize::MAX), 1usize..600],
    ) {
        let hub = Hub::new(HubOptions { history: 1000, pending_bound: 1000 });
        let mut world = World::default();
        hub.publish(&world.snap);
        let mut n0 = NodeState::default();
        let mut mb0 = hub.subscribe_reading("n0", "", 0, PEERS);
        let mut n1 = NodeState::default();
        let mb1 = hub.subscribe("n1", "", 0);
        for (i, c) in changes.iter().enumerate() {
            world.apply(c);
            hub.publish(&world.snap);
            if i % deliver_every == 0 {
                deliver_in(&hub, &mb0, &mut n0, part_bytes);
            }
            if i == resume_at {
                // A reconnect: the new stream resumes from what n0 holds.
                drop(mb0);
                mb0 = hub.subscribe_reading("n0", &n0.epoch, n0.revision, PEERS);
            }
        }
        deliver_in(&hub, &mb0, &mut n0, part_bytes);
        deliver(&hub, &mb1, &mut n1);
        same_as_server(&world, "n0", &n0)?;
        same_as_server(&world, "n1", &n1)?;
        prop_assert_eq!(&n0.peers, &peers_of(&world));
        prop_assert!(n1.peers.is_empty(), "a node that reads no peers got some");
    }

    #[test]
    fn a_node_past_its_bound_gets_a_snapshot_and_converges(
        changes in prop::collection::vec(change(), 1..40),
    ) {
        let hub = Hub::new(HubOptions { history: 4, pending_bound: 2 });
        let mut world = World::default();
        hub.publish(&world.snap);
        let mut slow = NodeState::default();
        let mb = hub.subscribe_reading("n2", "", 0, PEERS);
        deliver(&hub, &mb, &mut slow);
        for c in &changes {
            world.apply(c);
            hub.publish(&world.snap);
        }
        deliver(&hub, &mb, &mut slow);
        same_as_server(&world, "n2", &slow)?;
        prop_assert_eq!(&slow.peers, &peers_of(&world));
        // Resuming from far behind a 4-op history: a snapshot, and still the same.
        let mut late = NodeState { epoch: slow.epoch.clone(), revision: 0, ..Default::default() };
        let again = hub.subscribe_reading("n2", &late.epoch, 0, PEERS);
        deliver(&hub, &again, &mut late);
        same_as_server(&world, "n2", &late)?;
        prop_assert_eq!(&late.peers, &peers_of(&world));
    }
}

#[test]
fn node_changes_reach_only_their_node_and_no_ops_reach_nobody() {
    let hub = Hub::new(HubOptions::default());
    let mut world = World::default();
    world.apply(&Change::Service {
        idx: 0,
        port: 80,
        policy_local: false,
    });
    hub.publish(&world.snap);
    let a = hub.subscribe("n0", "", 0);
    let b = hub.subscribe("n1", "", 0);
    let (mut sa, mut sb) = (NodeState::default(), NodeState::default());
    deliver(&hub, &a, &mut sa);
    deliver(&hub, &b, &mut sb);
    world.apply(&Change::Node {
        idx: 0,
        zone: 1,
        ip: 0,
    });
    hub.publish(&world.snap);
    assert!(b.drain().is_err(), "n1 got n0's Node");
    assert!(a.drain().is_ok(), "n0 did not get its Node");
    // The same snapshot again (a heartbeat, a no-op update): nothing for anyone.
    hub.publish(&world.snap);
    assert!(a.drain().is_err() && b.drain().is_err());
}

/// Delivers what a mailbox holds in one batch, and returns its ops.
fn drained_ops(hub: &Hub, mb: &Mailbox, state: &mut NodeState) -> Vec<v1::op::Op> {
    let Ok(d) = mb.drain() else {
        return Vec::new();
    };
    let sent = parts_of(hub, d, &hub.epoch(), usize::MAX);
    assert_eq!(sent.len(), 1);
    let batch = v1::Batch::decode(sent[0].encode_to_vec().as_slice()).expect("decodes");
    state.apply(&batch).expect("applies");
    batch.ops.into_iter().filter_map(|o| o.op).collect()
}

fn peer_addresses(state: &NodeState, node: &str) -> Vec<String> {
    state.peers.get(node).map_or_else(Vec::new, |n| {
        n.addresses.iter().map(ToString::to_string).collect()
    })
}

/// Every Node's addresses reach every node that reads peers — in its snapshot, then as
/// ops when a Node's addresses change or it goes — whichever Node it is; a change of
/// anything else (a label) reaches only that Node's own node; a node that reads no
/// peers (an older agent) never gets one.
#[test]
fn peers_reach_every_node_that_reads_them_and_only_when_addresses_change() {
    let hub = Hub::new(HubOptions::default());
    let mut world = World::default();
    for idx in 0..3 {
        world.apply(&Change::Node {
            idx,
            zone: 0,
            ip: 0,
        });
    }
    hub.publish(&world.snap);
    let a = hub.subscribe_reading("n0", "", 0, PEERS);
    let old = hub.subscribe("n1", "", 0);
    let (mut sa, mut so) = (NodeState::default(), NodeState::default());
    deliver(&hub, &a, &mut sa);
    deliver(&hub, &old, &mut so);
    assert_eq!(sa.peers.keys().collect::<Vec<_>>(), ["n0", "n1", "n2"]);
    assert_eq!(sa.peers["n2"].name, "n2");
    assert!(
        sa.peers["n2"].labels.is_empty(),
        "peers carry addresses only"
    );
    assert_eq!(peer_addresses(&sa, "n2"), ["192.168.0.10"]);
    assert!(
        so.peers.is_empty(),
        "an older agent got peers in its snapshot"
    );

    // n2's address changes: an op for n0 (not n2's own node), none for the older agent.
    world.apply(&Change::Node {
        idx: 2,
        zone: 0,
        ip: 1,
    });
    hub.publish(&world.snap);
    let ops = drained_ops(&hub, &a, &mut sa);
    assert!(
        matches!(&ops[..], [v1::op::Op::SetPeer(n)] if n.name == "n2" && n.labels.is_empty()),
        "{ops:?}"
    );
    assert_eq!(peer_addresses(&sa, "n2"), ["192.168.0.11"]);
    assert!(old.drain().is_err(), "an older agent got a peer op");

    // n2's zone alone changes: nothing for its peers.
    world.apply(&Change::Node {
        idx: 2,
        zone: 1,
        ip: 1,
    });
    hub.publish(&world.snap);
    assert!(a.drain().is_err(), "a label change reached a peer");

    // n1 goes: its peers hear it, by name.
    world.apply(&Change::RemoveNode(1));
    hub.publish(&world.snap);
    let ops = drained_ops(&hub, &a, &mut sa);
    assert!(
        matches!(&ops[..], [v1::op::Op::DeletePeer(n)] if n == "n1"),
        "{ops:?}"
    );
    assert_eq!(sa.peers.keys().collect::<Vec<_>>(), ["n0", "n2"]);
    // The older agent n1 hears of its own Node only.
    let ops = drained_ops(&hub, &old, &mut so);
    assert!(
        matches!(&ops[..], [v1::op::Op::DeleteNode(n)] if n == "n1"),
        "{ops:?}"
    );
    assert!(so.peers.is_empty() && so.node.is_none());
    world.apply(&Change::RemoveNode(0));
    hub.publish(&world.snap);
    deliver(&hub, &a, &mut sa);
    assert_eq!(sa.peers.keys().collect::<Vec<_>>(), ["n2"]);
    assert_eq!(sa.node, None, "its own Node went too");
}

/// An op this version does not know — as a later server's would be — is read as none
/// and skipped: the rest of its batch applies. (An agent older than `set_peer` did the
/// same with the peers' ops until it refused them; it is sent none: `accepts_peers`.)
#[test]
fn an_op_of_a_later_version_is_skipped_and_the_rest_of_its_batch_applies() {
    let hub = Hub::new(HubOptions::default());
    let mut world = World::default();
    world.apply(&Change::Service {
        idx: 0,
        port: 80,
        policy_local: false,
    });
    hub.publish(&world.snap);
    let mb = hub.subscribe("n0", "", 0);
    let mut state = NodeState::default();
    deliver(&hub, &mb, &mut state);
    // Field 99 of `Op`, length-delimited: a oneof member of some later version.
    let unknown = [0x9a, 0x06, 0x03, b'n', b'e', b'w'];
    let op = v1::Op::decode(unknown.as_slice()).expect("decodes");
    assert_eq!(op.op, None, "prost reads an unknown oneof member as none");
    world.apply(&Change::Service {
        idx: 1,
        port: 80,
        policy_local: false,
    });
    hub.publish(&world.snap);
    let Ok(d) = mb.drain() else {
        panic!("no ops for s1")
    };
    let mut batch = v1::Batch::decode(
        parts_of(&hub, d, &hub.epoch(), usize::MAX)[0]
            .encode_to_vec()
            .as_slice(),
    )
    .expect("a batch");
    batch.ops.insert(0, op);
    state.apply(&batch).expect("the unknown op is skipped");
    assert_eq!(&state.model, &world.snap.model);
}

#[test]
fn a_snapshot_goes_in_parts_of_bounded_size_or_whole_to_a_node_that_cannot_join_them() {
    let hub = Hub::new(HubOptions::default());
    let mut world = World::default();
    for idx in 0..4 {
        world.apply(&Change::Service {
            idx,
            port: 80,
            policy_local: false,
        });
        world.apply(&Change::Slice {
            idx,
            service: idx,
            eps: vec![(idx, true, 0), (idx + 1, true, 1)],
            trigger: 0,
        });
    }
    hub.publish(&world.snap);
    let a = hub.subscribe("n0", "", 0);
    let parts = parts_of(&hub, a.drain().expect("a snapshot"), &hub.epoch(), 150);
    assert!(
        parts.len() >= 4,
        "8 objects in parts of 150 bytes: {}",
        parts.len()
    );
    for p in &parts {
        assert!(p.snapshot, "every part says what the batch is");
        let op_bytes: usize = p.ops.iter().map(|o| o.len()).sum();
        let last = p.ops.last().map_or(0, |o| o.len());
        assert!(
            op_bytes - last < 150,
            "a part past its bound before its last op"
        );
    }
    let b = hub.subscribe("n1", "", 0);
    let whole = parts_of(
        &hub,
        b.drain().expect("a snapshot"),
        &hub.epoch(),
        usize::MAX,
    );
    assert_eq!(whole.len(), 1);
    assert!(!whole[0].continued);
    assert_eq!(whole[0].ops.len(), 8);
    // Shared: both nodes' snapshots hold the same bytes, not copies.
    let first_a = &parts[0].ops[0];
    assert_eq!(first_a.as_ptr(), whole[0].ops[0].as_ptr());
}

/// The figures behind where the node view is computed (docs/fanout.md, "Where the node
/// view is computed"): per-node views on the server (a tracker per node) against one
/// model whose ops every node takes. Not a pass/fail test: run it by hand, in release,
/// `FEED_SERVICES=10000 FEED_NODES=300 cargo test --release -p proxy-agent --test feed_ops measure -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check: FEED_SERVICES=N FEED_NODES=M cargo test --release --test feed_ops measure -- --ignored"]
fn measure_where_the_view_is_computed() {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (services, nodes) = (env("FEED_SERVICES", 10_000), env("FEED_NODES", 300));
    let rss = || {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        let pages: u64 = statm
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        pages * 4096 / (1 << 20)
    };
    let mut model = ClusterModel::default();
    let slice_of = |i: usize, round: usize| -> EndpointSlice {
        let eps: Vec<_> = (0..10)
            .map(|e| json!({"addresses": [format!("10.{}.{}.{}", 1 + i / 65536, (i / 256) % 256, (i % 256 + e + round) % 250 + 1)],
                            "nodeName": format!("n{}", (i + e) % nodes)}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": format!("e{i}"), "namespace": "default",
                         "labels": {"kubernetes.io/service-name": format!("s{i}")}},
            "addressType": "IPv4", "ports": [{"port": 8080, "protocol": "TCP"}], "endpoints": eps
        }))
        .expect("slice")
    };
    for i in 0..services {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": format!("s{i}"), "namespace": "default"},
            "spec": {"clusterIP": format!("10.96.{}.{}", i / 250, i % 250 + 1),
                     "ports": [{"port": 80, "targetPort": 8080}]}
        }))
        .expect("service");
        model.add_service(&svc);
        model.add_slice(&slice_of(i, 0));
    }
    let cfg = ViewConfig::default();
    let node = |n: usize| NodeInfo {
        name: format!("n{n}"),
        ..Default::default()
    };
    let changes = 100;
    // A: a tracker per node on the server.
    let before = rss();
    let t = std::time::Instant::now();
    let mut trackers: Vec<ViewTracker> = (0..nodes)
        .map(|n| {
            let mut tr = ViewTracker::new(node(n), cfg.clone());
            tr.rebuild(&model);
            tr
        })
        .collect();
    let build_a = t.elapsed();
    let mem_a = rss().saturating_sub(before);
    let mut m = model.clone();
    let t = std::time::Instant::now();
    let mut frontends_changed = 0;
    for c in 0..changes {
        let i = c * 97 % services;
        m.add_slice(&slice_of(i, c + 1));
        let sref = ObjectRef {
            namespace: "default".into(),
            name: format!("s{i}").into(),
        };
        for tr in &mut trackers {
            frontends_changed += tr.update(&m, [&sref]).frontends.len();
        }
    }
    let per_change_a = t.elapsed() / changes as u32;
    drop(trackers);
    // B: one model, ops to every node's mailbox (encoded per node, as the stream does).
    let hub = Hub::new(HubOptions::default());
    let mut snap = Snapshot {
        model: model.clone(),
        ..Default::default()
    };
    hub.publish(&snap);
    let before = rss();
    let boxes: Vec<_> = (0..nodes)
        .map(|n| hub.subscribe(&format!("n{n}"), "", 0))
        .collect();
    for mb in &boxes {
        let _ = mb.drain();
    }
    let mem_b = rss().saturating_sub(before);
    let t = std::time::Instant::now();
    let mut bytes = 0usize;
    for c in 0..changes {
        let i = c * 97 % services;
        snap.model.add_slice(&slice_of(i, c + 1));
        hub.publish(&snap);
        for mb in &boxes {
            if let Ok(d) = mb.drain() {
                bytes += parts_of(&hub, d, "e", usize::MAX)
                    .iter()
                    .map(|p| p.encode_to_vec().len())
                    .sum::<usize>();
            }
        }
    }
    let per_change_b = t.elapsed() / changes as u32;
    println!(
        "{services} Services x 10 endpoints, {nodes} nodes, {changes} endpoint changes\n\
         A per-node views on the server: build {build_a:?}, +{mem_a} MiB RSS, {per_change_a:?} CPU per change ({} frontends changed per node per change)\n\
         B one model, ops per node:      +{mem_b} MiB RSS for the mailboxes, {per_change_b:?} CPU per change (encode included), {} bytes per change per node",
        frontends_changed as f64 / (changes * nodes) as f64,
        bytes / (changes * nodes)
    );
}
