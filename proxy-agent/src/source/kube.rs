//! The API-server source: kube-rs watchers for Services, EndpointSlices and Nodes (this
//! node's, or every one: `KubeOptions::all_nodes`), folded into a `ClusterModel`. Watches recover as client-go's do
//! (`recovery`: a growing backoff, a relist from scratch when a watch is answered with an
//! error or an event is too large); a relist is buffered and swapped in whole. Nothing is
//! published until every resource has been listed once, so a restart never programs a
//! partial view. Objects are decoded one at a time (`decoded`): one that does not decode
//! is named and left out — its last readable version stays — and the rest of its list
//! applies.

mod recovery;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Api, Client, Resource as _, ResourceExt as _, runtime::watcher};
use tokio::sync::watch;

use recovery::Resource;
pub use recovery::{Backoff, STREAK_GAP, WatchHealth};

use super::{Snapshot, api_server::ApiCounters, decoded::Decoded};
use crate::model::{ClusterModel, NodeInfo, ObjectRef, ServiceInfo, SliceInfo};

/// Which watched resource an event is about.
enum Update {
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
pub struct Store {
    model: ClusterModel,
    services: Listing<ServiceInfo>,
    slices: Listing<SliceInfo>,
    nodes: Listing<NodeInfo>,
    /// This node, from its Node object (only the fields we use: heartbeats and other
    /// status churn compare equal and are dropped).
    node: Option<NodeInfo>,
    node_name: String,
    changes: super::ChangeCounts,
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
    fn apply(&mut self, update: Update) -> bool {
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

/// The longest watch error logged (the rest is cut).
pub(super) const MAX_LOGGED_ERROR: usize = 1024;

/// How often a source that cannot publish yet says what it waits for.
const WAITING_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// The server-side label selector for Services and EndpointSlices, as kube-proxy's: no
/// headless Service (nothing to proxy) and none that names a service proxy — unless we
/// have a name, then those labelled with it are ours too (the model keeps only those;
/// "unlabelled or ours" cannot be said in one selector).
pub fn label_selector(service_proxy_name: Option<&str>) -> String {
    const HEADLESS: &str = "!service.kubernetes.io/headless";
    match service_proxy_name {
        None => format!("{HEADLESS},!service.kubernetes.io/service-proxy-name"),
        Some(_) => HEADLESS.to_string(),
    }
}

/// What the API-server source watches and how.
#[derive(Clone, Debug, Default)]
pub struct KubeOptions {
    pub node_name: String,
    /// For Services and EndpointSlices (`label_selector`).
    pub label_selector: String,
    /// Where API errors and relists are counted (the runner's status holds it).
    pub counters: ApiCounters,
    /// Each watcher's backoff after an error.
    pub backoff: Backoff,
    /// Watch every Node, not only this one, into `Snapshot::nodes`: the server's view,
    /// and an agent's peers (DSR believes only the cluster's nodes).
    pub all_nodes: bool,
    /// Publish without waiting for this node's Node (`proxy-agent serve`, which is no
    /// node).
    pub without_own_node: bool,
    /// Publish partial snapshots (`Snapshot::partial`, at most every
    /// `PARTIAL_INTERVAL`) while the first lists arrive, for a runner that stages them.
    pub stream_first_list: bool,
    /// Where each watcher's run of errors is kept (`proxy-agent serve` judges its view
    /// by it).
    pub health: WatchHealth,
}

/// How often a partial snapshot is published during the first lists: each one is a
/// view update and a batch of map writes, so not per page.
const PARTIAL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);

/// Watches the API server and publishes a snapshot after the first full list of every
/// resource, then after every change. Runs until the receiver is dropped.
pub async fn run(
    client: Client,
    opts: KubeOptions,
    tx: watch::Sender<Option<super::SharedSnapshot>>,
) {
    let KubeOptions {
        node_name,
        label_selector,
        counters,
        backoff,
        all_nodes,
        without_own_node,
        stream_first_list,
        health,
    } = opts;
    let cfg = watcher::Config::default();
    let selected = cfg.clone().labels(&label_selector);
    let follow = |label, name| Resource { label, name };
    let services = recovery::recovering(
        Api::<Decoded<Service>>::all(client.clone()),
        selected.clone(),
        follow("services", "Services"),
        counters.clone(),
        backoff.clone(),
        health.clone(),
    )
    .map(|e| Update::Service(Box::new(e)));
    let slices = recovery::recovering(
        Api::<Decoded<EndpointSlice>>::all(client.clone()),
        selected,
        follow("endpointslices", "EndpointSlices"),
        counters.clone(),
        backoff.clone(),
        health.clone(),
    )
    .map(|e| Update::Slice(Box::new(e)));
    let node_cfg = if all_nodes {
        cfg
    } else {
        cfg.fields(&format!("metadata.name={node_name}"))
    };
    let nodes = recovery::recovering(
        Api::<Decoded<Node>>::all(client),
        node_cfg,
        follow("nodes", "Nodes"),
        counters,
        backoff,
        health,
    )
    .map(|e| Update::Node(Box::new(e)));
    let streams: Vec<BoxStream<'static, Update>> =
        vec![services.boxed(), slices.boxed(), nodes.boxed()];
    let mut updates = futures::stream::select_all(streams);
    let mut store = if all_nodes {
        Store::with_all_nodes(&node_name)
    } else {
        Store::new(&node_name)
    };
    if without_own_node {
        store = store.without_own_node();
    }
    let mut waiting = tokio::time::interval_at(
        tokio::time::Instant::now() + WAITING_LOG_INTERVAL,
        WAITING_LOG_INTERVAL,
    );
    let started = std::time::Instant::now();
    // The first lists changed the model since the last partial snapshot.
    let mut unpublished = false;
    let mut last_partial = started;
    loop {
        let update = tokio::select! {
            update = updates.next() => update,
            _ = waiting.tick() => {
                if let Some(what) = store.waiting_for() {
                    tracing::warn!(node = %node_name, "not programming yet: waiting for {what}");
                }
                continue;
            }
        };
        // Errors are logged, counted and waited out by `recovery`.
        let Some(update) = update else { return };
        let changed = store.apply(update);
        let nothing_complete = tx.borrow().as_ref().is_none_or(|s| s.partial);
        if stream_first_list && nothing_complete && !store.ready() {
            unpublished |= changed;
            if unpublished && store.partly_ready() && last_partial.elapsed() >= PARTIAL_INTERVAL {
                unpublished = false;
                last_partial = std::time::Instant::now();
                if tx
                    .send(Some(std::sync::Arc::new(store.partial_snapshot())))
                    .is_err()
                {
                    return;
                }
            }
            continue;
        }
        if store.ready() && nothing_complete {
            tracing::info!(
                took_ms = started.elapsed().as_millis() as u64,
                "Services, EndpointSlices and the Node listed"
            );
        }
        if store.ready()
            && (changed || nothing_complete)
            && tx
                .send(Some(std::sync::Arc::new(store.snapshot())))
                .is_err()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
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
}
