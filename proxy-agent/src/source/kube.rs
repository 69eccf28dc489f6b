//! The API-server source: kube-rs watchers for Services, EndpointSlices and this node's
//! Node object, folded into a `ClusterModel`. Watches restart with backoff and relist on
//! errors (410 Gone included, by kube-runtime); a relist is buffered and swapped in whole.
//! Nothing is published until every resource has been listed once, so a restart never
//! programs a partial view.

use std::{collections::BTreeMap, net::IpAddr};

use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, Resource, ResourceExt as _,
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::sync::watch;

use super::Snapshot;
use crate::model::{ClusterModel, NodeInfo, ObjectRef};

/// Which watched resource an event is about.
enum Update {
    Service(Box<watcher::Event<Service>>),
    Slice(Box<watcher::Event<EndpointSlice>>),
    Node(Box<watcher::Event<Node>>),
}

/// Objects of one kind, with the buffer a relist fills before it replaces them.
struct Kind<K> {
    objects: BTreeMap<ObjectRef, K>,
    relist: Option<BTreeMap<ObjectRef, K>>,
    listed: bool,
}

impl<K> Default for Kind<K> {
    fn default() -> Self {
        Self {
            objects: BTreeMap::new(),
            relist: None,
            listed: false,
        }
    }
}

impl<K: Resource + Clone + PartialEq> Kind<K> {
    /// Applies one watch event; `true` if what the model holds changed.
    fn apply(&mut self, event: watcher::Event<K>) -> bool {
        match event {
            watcher::Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(obj) => {
                let key = ObjectRef::of(obj.meta());
                self.relist
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key, strip(obj));
                false
            }
            watcher::Event::InitDone => {
                let fresh = self.relist.take().unwrap_or_default();
                let changed = fresh != self.objects || !self.listed;
                self.objects = fresh;
                self.listed = true;
                changed
            }
            watcher::Event::Apply(obj) => {
                let key = ObjectRef::of(obj.meta());
                let obj = strip(obj);
                // A change that nets to nothing (only bookkeeping metadata moved) is dropped.
                if self.objects.get(&key) == Some(&obj) {
                    return false;
                }
                self.objects.insert(key, obj);
                true
            }
            watcher::Event::Delete(obj) => {
                self.objects.remove(&ObjectRef::of(obj.meta())).is_some()
            }
        }
    }
}

/// Drops metadata that changes without changing meaning, so no-op updates compare equal.
fn strip<K: Resource>(mut obj: K) -> K {
    let meta = obj.meta_mut();
    meta.resource_version = None;
    meta.managed_fields = None;
    meta.generation = None;
    obj
}

/// Everything the watchers have told us.
#[derive(Default)]
pub struct Store {
    services: Kind<Service>,
    slices: Kind<EndpointSlice>,
    nodes: Kind<Node>,
    node_name: String,
}

impl Store {
    pub fn new(node_name: &str) -> Self {
        Self {
            node_name: node_name.to_string(),
            ..Default::default()
        }
    }

    /// Every resource has been listed at least once.
    pub fn ready(&self) -> bool {
        self.services.listed && self.slices.listed && self.nodes.listed
    }

    fn apply(&mut self, update: Update) -> bool {
        match update {
            Update::Service(e) => self.services.apply(*e),
            Update::Slice(e) => self.slices.apply(*e),
            Update::Node(e) => self.nodes.apply(*e),
        }
    }

    /// The model and this node, as the view needs them.
    pub fn snapshot(&self) -> Snapshot {
        let node = self
            .nodes
            .objects
            .values()
            .find(|n| n.name_any() == self.node_name);
        Snapshot {
            model: ClusterModel {
                services: self.services.objects.clone(),
                slices: self.slices.objects.clone(),
            },
            node: node_info(&self.node_name, node),
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
    let addresses = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse::<IpAddr>().ok())
        .collect();
    NodeInfo {
        name: name.to_string(),
        labels: node.labels().clone(),
        addresses,
    }
}

/// Watches the API server and publishes a snapshot after the first full list of every
/// resource, then after every change. Runs until the receiver is dropped.
pub async fn run(
    client: Client,
    node_name: String,
    tx: watch::Sender<Option<super::SharedSnapshot>>,
) {
    let cfg = watcher::Config::default();
    let services = watcher(Api::<Service>::all(client.clone()), cfg.clone())
        .default_backoff()
        .map(|e| e.map(|e| Update::Service(Box::new(e))));
    let slices = watcher(Api::<EndpointSlice>::all(client.clone()), cfg.clone())
        .default_backoff()
        .map(|e| e.map(|e| Update::Slice(Box::new(e))));
    let node_cfg = cfg.fields(&format!("metadata.name={node_name}"));
    let nodes = watcher(Api::<Node>::all(client), node_cfg)
        .default_backoff()
        .map(|e| e.map(|e| Update::Node(Box::new(e))));
    let streams: Vec<BoxStream<'static, Result<Update, watcher::Error>>> =
        vec![services.boxed(), slices.boxed(), nodes.boxed()];
    let mut updates = futures::stream::select_all(streams);
    let mut store = Store::new(&node_name);
    while let Some(update) = updates.next().await {
        match update {
            Ok(update) => {
                let changed = store.apply(update);
                if store.ready()
                    && (changed || tx.borrow().is_none())
                    && tx
                        .send(Some(std::sync::Arc::new(store.snapshot())))
                        .is_err()
                {
                    return;
                }
            }
            // The backoff wrapper retries; the error is worth a line, not a stop.
            Err(e) => tracing::warn!(error = %e, "watch failed; retrying with backoff"),
        }
    }
}
