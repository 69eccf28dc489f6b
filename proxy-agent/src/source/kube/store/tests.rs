//! The store's tests: first lists and relists, unreadable objects, Nodes.

use super::*;

fn svc(name: &str, ports: serde_json::Value) -> watcher::Event<Decoded<Service>> {
    let obj = serde_json::json!({"metadata": {"name": name, "namespace": "ns"},
                                 "spec": {"clusterIP": "10.96.0.1", "ports": ports}});
    watcher::Event::Apply(serde_json::from_value(obj).expect("any JSON decodes"))
}

/// As a relist brings them: Init, one InitApply per item, InitDone.
fn relist(store: &mut Store, items: Vec<watcher::Event<Decoded<Service>>>) -> bool {
    let mut changed = store.apply(Update::Service(Box::new(watcher::Event::Init)));
    for item in items {
        let watcher::Event::Apply(obj) = item else {
            unreachable!()
        };
        changed |= store.apply(Update::Service(Box::new(watcher::Event::InitApply(obj))));
    }
    changed | store.apply(Update::Service(Box::new(watcher::Event::InitDone)))
}

/// The first list of a kind goes into the model in batches, one before each partial
/// snapshot (which show it as it arrives, once this node is known); a later relist is
/// buffered and swapped in whole at its end, removing what it no longer holds.
#[test]
fn the_first_list_arrives_in_batches_and_a_relist_is_swapped_in_whole() {
    let item = |name: &str| {
        let watcher::Event::Apply(obj) = svc(name, serde_json::json!([{"port": 80}])) else {
            unreachable!()
        };
        Update::Service(Box::new(watcher::Event::InitApply(obj)))
    };
    let init = || Update::Service(Box::new(watcher::Event::Init));
    let done = || Update::Service(Box::new(watcher::Event::InitDone));
    let mut store = Store::new("node-a");
    store.apply(init());
    assert!(
        store.apply(item("a")),
        "a first-list item changes the model"
    );
    assert!(store.apply(item("b")));
    assert_eq!(store.model.service_count(), 0, "kept for the next batch");
    assert!(!store.partly_ready(), "this node is not known yet");
    let node = serde_json::json!({"metadata": {"name": "node-a"}});
    let node: Node = serde_json::from_value(node).expect("a Node");
    store.apply(Update::Node(Box::new(watcher::Event::Init)));
    store.apply(Update::Node(Box::new(watcher::Event::InitApply(
        Decoded::Ok(node),
    ))));
    store.apply(Update::Node(Box::new(watcher::Event::InitDone)));
    assert!(store.partly_ready());
    let partial = store.partial_snapshot();
    assert!(partial.partial);
    assert_eq!(partial.model.service_count(), 2);
    assert!(store.apply(item("c")));
    assert!(store.apply(done()), "the end of a first list");
    assert_eq!(store.model.service_count(), 3, "the last batch at the end");
    assert_eq!(store.changes.services, 3, "each object counted once");
    // Again without c, to go on as before.
    store.apply(init());
    store.apply(item("a"));
    store.apply(item("b"));
    store.apply(done());
    assert_eq!(store.model.service_count(), 2);
    assert_eq!(store.changes.services, 4, "c's removal counted too");
    // A relist: buffered, so the model is whole until it ends.
    store.apply(init());
    assert!(!store.apply(item("b")));
    assert_eq!(
        store.model.service_count(),
        2,
        "a is still there mid-relist"
    );
    assert!(store.apply(done()));
    assert_eq!(store.model.service_count(), 1, "a is gone with the relist");
    assert!(
        store.partly_ready(),
        "the EndpointSlices are still to be listed"
    );
    store.apply(Update::Slice(Box::new(watcher::Event::Init)));
    store.apply(Update::Slice(Box::new(watcher::Event::InitDone)));
    assert!(
        store.ready() && !store.partly_ready(),
        "every first list ended"
    );
}

/// An object that does not decode is named once, however often it is relisted; its
/// last readable version stays in the model until it decodes again or goes away.
#[test]
fn unreadable_objects_are_named_once_and_keep_their_last_readable_version() {
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || CaptureWriter(writer.clone()))
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let named = || {
        String::from_utf8_lossy(&log.lock().expect("lock"))
            .matches("cannot decode")
            .count()
    };
    let good = || svc("a", serde_json::json!([{"port": 80}]));
    let bad = || svc("a", serde_json::json!(7));
    let mut store = Store::new("node-a");
    let a = ObjectRef {
        namespace: "ns".into(),
        name: "a".into(),
    };
    assert!(relist(
        &mut store,
        vec![good(), svc("b", serde_json::json!("x"))]
    ));
    assert_eq!(
        (store.model.service_count(), store.unreadable.len()),
        (1, 1)
    );
    assert_eq!(named(), 1);
    // The same relist again: nothing new, nothing logged.
    assert!(!relist(
        &mut store,
        vec![good(), svc("b", serde_json::json!("x"))]
    ));
    assert_eq!(named(), 1);
    // `a` becomes unreadable in a relist: its last readable version stays.
    assert!(relist(&mut store, vec![bad()]));
    assert!(store.model.service(&a).is_some_and(|s| s.ports.len() == 1));
    assert_eq!(store.unreadable.len(), 1, "b went away, a is unreadable");
    assert_eq!(named(), 2);
    // Decodable again in a watch event: applied, and no longer unreadable.
    let fixed = svc("a", serde_json::json!([{"port": 81}]));
    assert!(store.apply(Update::Service(Box::new(fixed))));
    assert_eq!(store.unreadable.len(), 0);
    assert!(store.apply(Update::Service(Box::new(bad()))));
    assert_eq!((store.unreadable.len(), named()), (1, 3));
    assert!(
        !store.apply(Update::Service(Box::new(bad()))),
        "the same again changes nothing"
    );
    let Decoded::Ok(gone) = serde_json::from_value::<Decoded<Service>>(
        serde_json::json!({"metadata": {"name": "a", "namespace": "ns"}}),
    )
    .expect("decodes") else {
        panic!("a Service")
    };
    let deleted = watcher::Event::Delete(Decoded::Ok(gone));
    assert!(store.apply(Update::Service(Box::new(deleted))));
    assert_eq!(
        (store.model.service_count(), store.unreadable.len()),
        (0, 0)
    );
    assert_eq!(store.snapshot().unreadable, 0);
}

fn node_event(name: &str, ip: &str) -> Decoded<Node> {
    let node = serde_json::json!({"metadata": {"name": name},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]}});
    Decoded::Ok(serde_json::from_value(node).expect("a Node"))
}

fn listed_services_and_slices(store: &mut Store) {
    store.apply(Update::Service(Box::new(watcher::Event::Init)));
    store.apply(Update::Service(Box::new(watcher::Event::InitDone)));
    store.apply(Update::Slice(Box::new(watcher::Event::Init)));
    store.apply(Update::Slice(Box::new(watcher::Event::InitDone)));
}

fn addresses(snap: &Snapshot) -> Vec<(String, String)> {
    snap.nodes
        .values()
        .map(|n| (n.name.clone(), n.addresses[0].to_string()))
        .collect()
}

/// The agent watching every Node (its peers): every Node is kept and published, yet
/// nothing is until its own Node exists, which alone is `Snapshot::node`.
#[test]
fn an_agent_keeps_every_node_and_is_ready_only_with_its_own() {
    let node = |e| Update::Node(Box::new(e));
    let mut store = Store::with_all_nodes("node-a");
    listed_services_and_slices(&mut store);
    store.apply(node(watcher::Event::Init));
    store.apply(node(watcher::Event::InitApply(node_event(
        "node-b",
        "192.0.2.11",
    ))));
    assert!(store.apply(node(watcher::Event::InitDone)));
    assert!(!store.ready(), "another node's Node does not make this one");
    assert!(
        store.waiting_for().is_some_and(|w| w.contains("node-a")),
        "{:?}",
        store.waiting_for()
    );
    assert!(store.apply(node(watcher::Event::Apply(node_event(
        "node-a",
        "192.0.2.10"
    )))));
    assert!(store.ready());
    let snap = store.snapshot();
    assert_eq!(snap.node.name, "node-a");
    assert_eq!(snap.node.addresses[0].to_string(), "192.0.2.10");
    assert_eq!(
        addresses(&snap),
        [
            ("node-a".into(), "192.0.2.10".into()),
            ("node-b".into(), "192.0.2.11".into())
        ]
    );
    // Another node's address alone is a change; its heartbeat (the same) is not.
    assert!(store.apply(node(watcher::Event::Apply(node_event(
        "node-b",
        "192.0.2.12"
    )))));
    assert!(!store.apply(node(watcher::Event::Apply(node_event(
        "node-b",
        "192.0.2.12"
    )))));
    assert_eq!(addresses(&store.snapshot())[1].1, "192.0.2.12");
    assert!(store.apply(node(watcher::Event::Delete(node_event(
        "node-b",
        "192.0.2.12"
    )))));
    assert_eq!(store.snapshot().nodes.len(), 1);
    assert_eq!(store.snapshot().node.name, "node-a");
    // Its own Node gone: not ready again (the agent's rule, all Nodes or not).
    store.apply(node(watcher::Event::Delete(node_event(
        "node-a",
        "192.0.2.10",
    ))));
    assert!(!store.ready());
    // The server's store publishes without any Node of its own.
    let mut server = Store::with_all_nodes("proxy-agent-serve").without_own_node();
    listed_services_and_slices(&mut server);
    server.apply(node(watcher::Event::Init));
    server.apply(node(watcher::Event::InitApply(node_event(
        "node-b",
        "192.0.2.11",
    ))));
    server.apply(node(watcher::Event::InitDone));
    assert!(server.ready());
    assert_eq!(server.snapshot().nodes.len(), 1);
}

struct CaptureWriter(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CaptureWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn node_info_orders_internal_addresses_first_and_reads_pod_cidrs_and_draining() {
    let node: Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "node-a", "deletionTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {"podCIDRs": ["10.244.3.0/24", "fd00:244:3::/64"]},
        "status": {"addresses": [
            {"type": "ExternalIP", "address": "203.0.113.7"},
            {"type": "Hostname", "address": "node-a"},
            {"type": "InternalIP", "address": "192.0.2.10"},
            {"type": "InternalIP", "address": "2001:db8::10"},
        ]},
    }))
    .expect("node");
    let info = node_info("node-a", Some(&node));
    let addrs: Vec<String> = info.addresses.iter().map(ToString::to_string).collect();
    assert_eq!(addrs, ["192.0.2.10", "2001:db8::10", "203.0.113.7"]);
    assert_eq!(info.primary_addresses(), info.addresses[..2]);
    assert_eq!(info.pod_cidrs.len(), 2);
    assert!(info.draining, "a deletion timestamp drains the node");
}
