//! The API-server source: kube-rs watchers for Services, EndpointSlices and this node's
//! Node object, folded into a `ClusterModel`. Watches restart with backoff and relist on
//! errors (410 Gone included, by kube-runtime); a relist is buffered and swapped in whole.
//! Nothing is published until every resource has been listed once, so a restart never
//! programs a partial view.

use std::{collections::BTreeSet, net::IpAddr};

use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, ResourceExt as _,
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::sync::watch;

use super::Snapshot;
use crate::model::{ClusterModel, NodeInfo, ObjectRef, ServiceInfo, SliceInfo};

/// Which watched resource an event is about.
enum Update {
    Service(Box<watcher::Event<Service>>),
    Slice(Box<watcher::Event<EndpointSlice>>),
    Node(Box<watcher::Event<Node>>),
}

/// A relist of one kind: buffered, then swapped in whole when it is complete.
struct Listing<T> {
    relist: Option<Vec<(ObjectRef, T)>>,
    listed: bool,
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
        self.relist = Some(Vec::new());
    }

    fn add(&mut self, r: ObjectRef, obj: T) {
        self.relist.get_or_insert_with(Vec::new).push((r, obj));
    }

    /// The complete relist; `first` is true the first time.
    fn done(&mut self) -> (Vec<(ObjectRef, T)>, bool) {
        let first = !self.listed;
        self.listed = true;
        (self.relist.take().unwrap_or_default(), first)
    }
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
}

impl Store {
    pub fn new(node_name: &str) -> Self {
        Self {
            node_name: node_name.to_string(),
            ..Default::default()
        }
    }

    /// Every resource has been listed at least once, and this node's Node object exists:
    /// without it there are no node addresses (no NodePorts) and no topology, so nothing
    /// is published rather than an empty node.
    pub fn ready(&self) -> bool {
        // Checked on every watch event: flags only, no words (those are for the periodic
        // log line, `waiting_for`).
        self.services.listed && self.slices.listed && self.nodes.listed && self.node.is_some()
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
        if self.node.is_none() {
            return Some(format!(
                "the Node object {:?} (NODE_NAME / --node-name / hostnameOverride, else the \
                 host name lowercased)",
                self.node_name
            ));
        }
        None
    }

    /// Applies one watch event; `true` if the model or this node changed.
    fn apply(&mut self, update: Update) -> bool {
        match update {
            Update::Service(e) => self.apply_service(*e),
            Update::Slice(e) => self.apply_slice(*e),
            Update::Node(e) => self.apply_node(*e),
        }
    }

    fn apply_service(&mut self, event: watcher::Event<Service>) -> bool {
        apply_to_model(
            &mut self.model,
            &mut self.services,
            &mut self.changes.services,
            event,
        )
    }

    fn apply_slice(&mut self, event: watcher::Event<EndpointSlice>) -> bool {
        apply_to_model(
            &mut self.model,
            &mut self.slices,
            &mut self.changes.endpoint_slices,
            event,
        )
    }

    fn apply_node(&mut self, event: watcher::Event<Node>) -> bool {
        let ours = |node: &Node| node.name_any() == self.node_name;
        let next = match event {
            watcher::Event::Init => {
                self.nodes.begin();
                return false;
            }
            watcher::Event::InitApply(node) => {
                if ours(&node) {
                    let info = node_info(&self.node_name, Some(&node));
                    self.nodes.add(ObjectRef::of(&node.metadata), info);
                }
                return false;
            }
            watcher::Event::InitDone => {
                let (fresh, first) = self.nodes.done();
                let next = fresh.into_iter().next().map(|(_, n)| n);
                if first {
                    self.node = next;
                    return true;
                }
                next
            }
            watcher::Event::Apply(node) if ours(&node) => {
                Some(node_info(&self.node_name, Some(&node)))
            }
            watcher::Event::Delete(node) if ours(&node) => None,
            _ => return false,
        };
        let changed = self.node != next;
        self.node = next;
        changed
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
            // The API server validated every object; kube-rs reports what fails to decode.
            unreadable: 0,
            api_validated: true,
        }
    }
}

/// A kind of object the model holds: how it is read, stored and listed.
trait Modelled: kube::Resource {
    type Info;
    fn info(&self) -> Self::Info;
    fn insert(model: &mut ClusterModel, r: ObjectRef, info: Self::Info) -> bool;
    fn remove(model: &mut ClusterModel, r: &ObjectRef) -> bool;
    fn held(model: &ClusterModel) -> Vec<ObjectRef>;
}

impl Modelled for Service {
    type Info = ServiceInfo;
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

/// Applies one watch event of a modelled kind; `true` if the model changed. Counts the
/// objects that changed into `changes`. A change that nets to nothing we use (status,
/// annotations, bookkeeping metadata) is dropped by the model's insert.
fn apply_to_model<K: Modelled>(
    model: &mut ClusterModel,
    listing: &mut Listing<K::Info>,
    changes: &mut u64,
    event: watcher::Event<K>,
) -> bool {
    let changed = match event {
        watcher::Event::Init => {
            listing.begin();
            return false;
        }
        watcher::Event::InitApply(obj) => {
            listing.add(ObjectRef::of(obj.meta()), obj.info());
            return false;
        }
        watcher::Event::InitDone => {
            let (fresh, first) = listing.done();
            let keep: BTreeSet<&ObjectRef> = fresh.iter().map(|(r, _)| r).collect();
            let gone: Vec<ObjectRef> = K::held(model)
                .into_iter()
                .filter(|r| !keep.contains(r))
                .collect();
            let mut changed = 0;
            for r in gone {
                changed += u64::from(K::remove(model, &r));
            }
            for (r, info) in fresh {
                changed += u64::from(K::insert(model, r, info));
            }
            *changes += changed;
            return changed > 0 || first;
        }
        watcher::Event::Apply(obj) => K::insert(model, ObjectRef::of(obj.meta()), obj.info()),
        watcher::Event::Delete(obj) => K::remove(model, &ObjectRef::of(obj.meta())),
    };
    *changes += u64::from(changed);
    changed
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

/// Watches the API server and publishes a snapshot after the first full list of every
/// resource, then after every change. Runs until the receiver is dropped.
pub async fn run(
    client: Client,
    node_name: String,
    label_selector: String,
    tx: watch::Sender<Option<super::SharedSnapshot>>,
) {
    let cfg = watcher::Config::default();
    let selected = cfg.clone().labels(&label_selector);
    let services = watcher(Api::<Service>::all(client.clone()), selected.clone())
        .default_backoff()
        .map(|e| e.map(|e| Update::Service(Box::new(e))));
    let slices = watcher(Api::<EndpointSlice>::all(client.clone()), selected)
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
    let mut waiting = tokio::time::interval_at(
        tokio::time::Instant::now() + WAITING_LOG_INTERVAL,
        WAITING_LOG_INTERVAL,
    );
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
        let Some(update) = update else { return };
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

#[cfg(test)]
mod tests {
    use super::*;

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
