//! What the watchers told the API-server source, folded into the compact model
//! (`Store`): each kind's first list and relists, this node's Node and (on request) every
//! Node, what could not be read. `run` (the parent) feeds it events and publishes its
//! snapshots.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Resource as _, ResourceExt as _, runtime::watcher};

use crate::model::{ClusterModel, NodeInfo, ObjectRef, ServiceInfo, SliceInfo};
use crate::source::{Snapshot, decoded::Decoded};

/// Which watched resource an event is about.
pub(super) enum Update {
    Service(Box<watcher::Event<Decoded<Service>>>),
    Slice(Box<watcher::Event<Decoded<EndpointSlice>>>),
    Node(Box<watcher::Event<Decoded<Node>>>),
}

/// A relist of one kind: buffered, then swapped in whole when it is complete.
struct Listing<T> {
    relist: Option<Relist<T>>,
    listed: bool,
}

/// What one relist found.
struct Relist<T> {
    fresh: Vec<(ObjectRef, T)>,
    /// Named objects that did not decode: their last readable version stays.
    kept: Vec<ObjectRef>,
    /// Objects that did not decode (by name, else by place in the list), with why.
    unreadable: Vec<(String, String)>,
    /// Items so far, readable or not.
    items: usize,
}

impl<T> Default for Relist<T> {
    fn default() -> Self {
        Self {
            fresh: Vec::new(),
            kept: Vec::new(),
            unreadable: Vec::new(),
            items: 0,
        }
    }
}

impl<T> Default for Listing<T> {
    fn default() -> Self {
        Self {
            relist: None,
            listed: false,
        }
    }
}

impl<T> Listing<T> {
    fn begin(&mut self) {
        self.relist = Some(Relist::default());
    }

    fn current(&mut self) -> &mut Relist<T> {
        self.relist.get_or_insert_with(Relist::default)
    }

    /// One item of the relist: decoded, or what could be read of it and why not.
    fn add(&mut self, item: Result<(ObjectRef, T), (&ObjectMeta, String)>) {
        let relist = self.current();
        relist.items += 1;
        match item {
            Ok(entry) => relist.fresh.push(entry),
            Err((meta, reason)) => {
                let place = relist.items - 1;
                if meta.name.is_some() {
                    relist.kept.push(ObjectRef::of(meta));
                }
                relist.unreadable.push((name_of(meta, Some(place)), reason));
            }
        }
    }

    /// The complete relist, and whether it is the first.
    fn done(&mut self) -> (Relist<T>, bool) {
        let first = !self.listed;
        self.listed = true;
        (self.relist.take().unwrap_or_default(), first)
    }
}

/// The first list's items buffered since the last flush, into the model; they stay
/// `kept` (the list's own, when it is done).
fn flush_first_list<K: Modelled>(
    model: &mut ClusterModel,
    listing: &mut Listing<K::Info>,
    changes: &mut u64,
) {
    if listing.listed {
        return;
    }
    let Some(relist) = listing.relist.as_mut() else {
        return;
    };
    let fresh = std::mem::take(&mut relist.fresh);
    relist.kept.extend(fresh.iter().map(|(r, _)| r.clone()));
    *changes += insert_spread::<K>(model, fresh);
}

/// Inserts `items` (a list's, in key order) in a spread order: a B-tree filled in key
/// order splits each node at its right end and leaves it half empty (`model::compact`).
/// How many changed the model.
fn insert_spread<K: Modelled>(model: &mut ClusterModel, items: Vec<(ObjectRef, K::Info)>) -> u64 {
    let mut changed = 0;
    crate::model::compact::in_spread_order(items, |(r, info)| {
        changed += u64::from(K::insert(model, r, info));
    });
    changed
}

/// How an object that did not decode is named: `namespace/name`, else its place in the
/// list it came in.
fn name_of(meta: &ObjectMeta, place: Option<usize>) -> String {
    match (&meta.name, &meta.namespace, place) {
        // Cluster-scoped (a Node): its name alone.
        (Some(name), None, _) => name.clone(),
        (Some(_), Some(_), _) => ObjectRef::of(meta).to_string(),
        (None, _, Some(i)) => format!("item {i} of the list (its name unreadable)"),
        (None, _, None) => "an object of a watch event (its name unreadable)".to_string(),
    }
}

/// Objects that did not decode, by kind and name: each logged when it is new or its
/// reason changes (not on every relist), and counted in the snapshot.
#[derive(Default)]
struct Unreadable(BTreeMap<(&'static str, String), String>);

impl Unreadable {
    /// One more (or one again); `true` if it is new or its reason is.
    fn note(&mut self, kind: &'static str, name: String, reason: String) -> bool {
        let key = (kind, name);
        if self.0.get(&key) == Some(&reason) {
            return false;
        }
        log_unreadable(kind, &key.1, &reason);
        self.0.insert(key, reason);
        true
    }

    /// `kind`/`name` decoded, or went away; `true` if it was unreadable.
    fn clear(&mut self, kind: &'static str, name: String) -> bool {
        self.0.remove(&(kind, name)).is_some()
    }

    /// A relist of `kind` found exactly these unreadable; `true` if that changed anything.
    fn relisted(&mut self, kind: &'static str, found: Vec<(String, String)>) -> bool {
        let before: BTreeMap<String, String> = self
            .0
            .iter()
            .filter(|((k, _), _)| *k == kind)
            .map(|((_, n), r)| (n.clone(), r.clone()))
            .collect();
        self.0.retain(|(k, _), _| *k != kind);
        for (name, reason) in found {
            if before.get(&name) != Some(&reason) {
                log_unreadable(kind, &name, &reason);
            }
            self.0.insert((kind, name), reason);
        }
        let after = self.0.iter().filter(|((k, _), _)| *k == kind);
        !before.iter().eq(after.map(|((_, n), r)| (n, r)))
    }

    fn len(&self) -> u64 {
        self.0.len() as u64
    }
}

fn log_unreadable(kind: &str, name: &str, reason: &str) {
    tracing::warn!(
        kind,
        object = %name,
        reason = %reason,
        "cannot decode an object; left out (its last readable version, if any, stays)"
    );
}

/// Everything the watchers have told us, in the compact model: objects are parsed once
/// as they arrive, and the model is shared (not copied) with each published snapshot.
#[derive(Default)]
pub(super) struct Store {
    model: ClusterModel,
    services: Listing<ServiceInfo>,
    slices: Listing<SliceInfo>,
    nodes: Listing<NodeInfo>,
    /// This node, from its Node object (only the fields we use: heartbeats and other
    /// status churn compare equal and are dropped).
    node: Option<NodeInfo>,
    node_name: String,
    changes: crate::source::ChangeCounts,
    unreadable: Unreadable,
    /// Every Node (`KubeOptions::all_nodes`), and the relist under way.
    all_nodes: Option<imbl::OrdMap<String, NodeInfo>>,
    relisting_nodes: Option<imbl::OrdMap<String, NodeInfo>>,
    /// Publish without this node's Node (`KubeOptions::without_own_node`).
    without_own_node: bool,
}

impl Store {
    pub fn new(node_name: &str) -> Self {
        Self {
            node_name: node_name.to_string(),
            ..Default::default()
        }
    }

    /// A store that keeps every Node too (`Snapshot::nodes`); it still waits for its
    /// own unless told otherwise (`without_own_node`).
    pub fn with_all_nodes(node_name: &str) -> Self {
        Self {
            all_nodes: Some(Default::default()),
            ..Self::new(node_name)
        }
    }

    /// Publishes without waiting for this node's Node: the server's, which has none.
    pub fn without_own_node(self) -> Self {
        Self {
            without_own_node: true,
            ..self
        }
    }

    /// Every resource has been listed at least once, and this node's Node object exists:
    /// without it there are no node addresses (no NodePorts) and no topology, so nothing
    /// is published rather than an empty node.
    pub fn ready(&self) -> bool {
        // Checked on every watch event: flags only, no words (those are for the periodic
        // log line, `waiting_for`).
        self.services.listed
            && self.slices.listed
            && self.nodes.listed
            && (self.node.is_some() || self.without_own_node)
    }

    /// Puts what the first lists brought since the last call into the model (before a
    /// partial snapshot; `InitDone` puts the rest).
    fn flush_first_lists(&mut self) {
        flush_first_list::<Service>(
            &mut self.model,
            &mut self.services,
            &mut self.changes.services,
        );
        flush_first_list::<EndpointSlice>(
            &mut self.model,
            &mut self.slices,
            &mut self.changes.endpoint_slices,
        );
    }

    /// What publishing still waits for, in words for the log.
    pub fn waiting_for(&self) -> Option<String> {
        let unlisted: Vec<&str> = [
            ("Services", self.services.listed),
            ("EndpointSlices", self.slices.listed),
            ("Nodes", self.nodes.listed),
        ]
        .into_iter()
        .filter(|(_, listed)| !listed)
        .map(|(what, _)| what)
        .collect();
        if !unlisted.is_empty() {
            return Some(format!("the first list of {}", unlisted.join(", ")));
        }
        if self.node.is_none() && !self.without_own_node {
            return Some(format!(
                "the Node object {:?} (NODE_NAME / --node-name / hostnameOverride, else the \
                 host name lowercased)",
                self.node_name
            ));
        }
        None
    }

    /// Applies one watch event; `true` if the model, this node or what is unreadable
    /// changed.
    pub(super) fn apply(&mut self, update: Update) -> bool {
        match update {
            Update::Service(e) => self.apply_service(*e),
            Update::Slice(e) => self.apply_slice(*e),
            Update::Node(e) => {
                let any = self.apply_any_node(&e);
                self.apply_node(*e) || any
            }
        }
    }

    /// Keeps every Node when asked to (heartbeats compare equal in `NodeInfo`); `true`
    /// if one of them changed. An unreadable Node keeps what was known of it.
    fn apply_any_node(&mut self, event: &watcher::Event<Decoded<Node>>) -> bool {
        let Some(all) = self.all_nodes.as_mut() else {
            return false;
        };
        let named = |node: &Node| {
            let name = node.metadata.name.clone().unwrap_or_default();
            let info = node_info(&name, Some(node));
            (name, info)
        };
        match event {
            watcher::Event::Init => {
                self.relisting_nodes = Some(Default::default());
                false
            }
            watcher::Event::InitApply(node) => {
                let relist = self.relisting_nodes.get_or_insert_with(Default::default);
                match node {
                    Decoded::Ok(node) => {
                        let (name, info) = named(node);
                        relist.insert(name, info);
                    }
                    Decoded::Unreadable { meta, .. } => {
                        if let Some(name) = &meta.name
                            && let Some(known) = all.get(name)
                        {
                            relist.insert(name.clone(), known.clone());
                        }
                    }
                }
                false
            }
            watcher::Event::InitDone => {
                let fresh = self.relisting_nodes.take().unwrap_or_default();
                let changed = *all != fresh;
                *all = fresh;
                changed
            }
            watcher::Event::Apply(Decoded::Ok(node)) => {
                let (name, info) = named(node);
                all.insert(name, info.clone()) != Some(info)
            }
            watcher::Event::Apply(Decoded::Unreadable { .. }) => false,
            watcher::Event::Delete(node) => node
                .meta()
                .name
                .as_ref()
                .is_some_and(|n| all.remove(n).is_some()),
        }
    }

    fn apply_service(&mut self, event: watcher::Event<Decoded<Service>>) -> bool {
        apply_to_model(
            &mut self.model,
            &mut self.services,
            &mut self.changes.services,
            &mut self.unreadable,
            event,
        )
    }

    fn apply_slice(&mut self, event: watcher::Event<Decoded<EndpointSlice>>) -> bool {
        apply_to_model(
            &mut self.model,
            &mut self.slices,
            &mut self.changes.endpoint_slices,
            &mut self.unreadable,
            event,
        )
    }

    fn apply_node(&mut self, event: watcher::Event<Decoded<Node>>) -> bool {
        let ours = |meta: &ObjectMeta| meta.name.as_deref() == Some(self.node_name.as_str());
        let next = match event {
            watcher::Event::Init => {
                self.nodes.begin();
                return false;
            }
            watcher::Event::InitApply(node) => {
                match node {
                    Decoded::Ok(node) if ours(&node.metadata) => {
                        let info = node_info(&self.node_name, Some(&node));
                        self.nodes.add(Ok((ObjectRef::of(&node.metadata), info)));
                    }
                    Decoded::Unreadable { meta, reason } if ours(&meta) => {
                        self.nodes.add(Err((&*meta, reason)));
                    }
                    _ => {}
                }
                return false;
            }
            watcher::Event::InitDone => {
                let (relist, first) = self.nodes.done();
                let unreadable = self.unreadable.relisted("Node", relist.unreadable);
                // Our Node unreadable: what we knew of it stays.
                let next = match relist.fresh.into_iter().next() {
                    Some((_, n)) => Some(n),
                    None if !relist.kept.is_empty() => self.node.clone(),
                    None => None,
                };
                if first {
                    self.node = next;
                    return true;
                }
                let changed = self.node != next;
                self.node = next;
                return changed || unreadable;
            }
            watcher::Event::Apply(node) if ours(node.meta()) => match node {
                Decoded::Ok(node) => {
                    let cleared = self.unreadable.clear("Node", name_of(&node.metadata, None));
                    let next = Some(node_info(&self.node_name, Some(&node)));
                    let changed = self.node != next;
                    self.node = next;
                    return changed || cleared;
                }
                Decoded::Unreadable { meta, reason } => {
                    return self.unreadable.note("Node", name_of(&meta, None), reason);
                }
            },
            watcher::Event::Delete(node) if ours(node.meta()) => {
                self.unreadable.clear("Node", name_of(node.meta(), None));
                None
            }
            _ => return false,
        };
        let changed = self.node != next;
        self.node = next;
        changed
    }

    /// A partial snapshot can be published: the first lists are under way and this
    /// node is known (its addresses decide the frontends).
    pub fn partly_ready(&self) -> bool {
        !self.ready() && self.node.is_some()
    }

    /// What the first lists brought so far (`Snapshot::partial`).
    pub fn partial_snapshot(&mut self) -> Snapshot {
        self.flush_first_lists();
        Snapshot {
            partial: true,
            ..self.snapshot()
        }
    }

    /// The model and this node, as the view needs them: the model shared, not copied.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            model: self.model.clone(),
            node: self
                .node
                .clone()
                .unwrap_or_else(|| node_info(&self.node_name, None)),
            changes: self.changes,
            unreadable: self.unreadable.len(),
            api_validated: true,
            nodes: self.all_nodes.clone().unwrap_or_default(),
            partial: false,
        }
    }
}

/// A kind of object the model holds: how it is read, stored and listed.
trait Modelled: kube::Resource {
    type Info;
    const KIND: &'static str;
    fn info(&self) -> Self::Info;
    fn insert(model: &mut ClusterModel, r: ObjectRef, info: Self::Info) -> bool;
    fn remove(model: &mut ClusterModel, r: &ObjectRef) -> bool;
    fn held(model: &ClusterModel) -> Vec<ObjectRef>;
}

impl Modelled for Service {
    type Info = ServiceInfo;
    const KIND: &'static str = "Service";
    fn info(&self) -> ServiceInfo {
        ServiceInfo::from_k8s(self)
    }
    fn insert(model: &mut ClusterModel, r: ObjectRef, info: ServiceInfo) -> bool {
        model.insert_service(r, info)
    }
    fn remove(model: &mut ClusterModel, r: &ObjectRef) -> bool {
        model.remove_service(r)
    }
    fn held(model: &ClusterModel) -> Vec<ObjectRef> {
        model.services().map(|(r, _)| r.clone()).collect()
    }
}

impl Modelled for EndpointSlice {
    type Info = SliceInfo;
    const KIND: &'static str = "EndpointSlice";
    fn info(&self) -> SliceInfo {
        SliceInfo::from_k8s(self)
    }
    fn insert(model: &mut ClusterModel, r: ObjectRef, info: SliceInfo) -> bool {
        model.insert_slice(r, info)
    }
    fn remove(model: &mut ClusterModel, r: &ObjectRef) -> bool {
        model.remove_slice(r)
    }
    fn held(model: &ClusterModel) -> Vec<ObjectRef> {
        model.slices().map(|(k, _)| k.object()).collect()
    }
}

/// Applies one watch event of a modelled kind; `true` if the model (or what is
/// unreadable) changed. Counts the objects that changed into `changes`. A change that
/// nets to nothing we use (status, annotations, bookkeeping metadata) is dropped by the
/// model's insert. An object that does not decode leaves the model as it was (its last
/// readable version stays) and is named in `unreadable`.
fn apply_to_model<K: Modelled>(
    model: &mut ClusterModel,
    listing: &mut Listing<K::Info>,
    changes: &mut u64,
    unreadable: &mut Unreadable,
    event: watcher::Event<Decoded<K>>,
) -> bool {
    match event {
        watcher::Event::Init => {
            listing.begin();
            false
        }
        // The first list goes into the model in batches, before each partial snapshot
        // (`flush_first_list`; it holds none of this kind, so nothing can be gone):
        // partial snapshots show it as it arrives.
        watcher::Event::InitApply(Decoded::Ok(obj)) if !listing.listed => {
            listing.add(Ok((ObjectRef::of(obj.meta()), obj.info())));
            true
        }
        watcher::Event::InitApply(Decoded::Ok(obj)) => {
            listing.add(Ok((ObjectRef::of(obj.meta()), obj.info())));
            false
        }
        watcher::Event::InitApply(Decoded::Unreadable { meta, reason }) => {
            listing.add(Err((&*meta, reason)));
            false
        }
        watcher::Event::InitDone => {
            let (relist, first) = listing.done();
            let unreadable_changed = unreadable.relisted(K::KIND, relist.unreadable);
            let keep: BTreeSet<&ObjectRef> = relist
                .fresh
                .iter()
                .map(|(r, _)| r)
                .chain(&relist.kept)
                .collect();
            let gone: Vec<ObjectRef> = K::held(model)
                .into_iter()
                .filter(|r| !keep.contains(r))
                .collect();
            let mut changed = 0;
            for r in gone {
                changed += u64::from(K::remove(model, &r));
            }
            changed += insert_spread::<K>(model, relist.fresh);
            *changes += changed;
            changed > 0 || first || unreadable_changed
        }
        watcher::Event::Apply(Decoded::Ok(obj)) => {
            let cleared = unreadable.clear(K::KIND, name_of(obj.meta(), None));
            let r = ObjectRef::of(obj.meta());
            let changed = K::insert(model, r, obj.info());
            *changes += u64::from(changed);
            changed || cleared
        }
        watcher::Event::Apply(Decoded::Unreadable { meta, reason }) => {
            unreadable.note(K::KIND, name_of(&meta, None), reason)
        }
        watcher::Event::Delete(obj) => {
            let cleared = unreadable.clear(K::KIND, name_of(obj.meta(), None));
            let r = ObjectRef::of(obj.meta());
            let changed = K::remove(model, &r);
            *changes += u64::from(changed);
            changed || cleared
        }
    }
}

/// Name, labels and addresses of this node; the name alone when its Node object is absent.
pub fn node_info(name: &str, node: Option<&Node>) -> NodeInfo {
    let Some(node) = node else {
        return NodeInfo {
            name: name.to_string(),
            ..Default::default()
        };
    };
    let listed = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten();
    // InternalIPs first: the first of each family is the node's primary address.
    let addresses = ["InternalIP", "ExternalIP"]
        .iter()
        .flat_map(|kind| listed.clone().filter(move |a| a.type_ == *kind))
        .filter_map(|a| crate::model::sloppy::parse_ip(&a.address).ok())
        .fold(Vec::<IpAddr>::new(), |mut all, ip| {
            if !all.contains(&ip) {
                all.push(ip);
            }
            all
        });
    let autoscaler_taint = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == "ToBeDeletedByClusterAutoscaler"));
    NodeInfo {
        name: name.to_string(),
        labels: node.labels().clone(),
        addresses,
        draining: node.metadata.deletion_timestamp.is_some() || autoscaler_taint,
        pod_cidrs: node
            .spec
            .as_ref()
            .and_then(|s| s.pod_cidrs.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|c| crate::model::sloppy::parse_cidr(c).ok())
            .collect(),
    }
}

#[cfg(test)]
mod tests;
