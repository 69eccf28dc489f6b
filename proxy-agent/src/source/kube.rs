//! The API-server source: kube-rs watchers for Services, EndpointSlices and Nodes (this
//! node's, or every one: `KubeOptions::all_nodes`), folded into a `ClusterModel`. Watches recover as client-go's do
//! (`recovery`: a growing backoff, a relist from scratch when a watch is answered with an
//! error or an event is too large); a relist is buffered and swapped in whole. Nothing is
//! published until every resource has been listed once, so a restart never programs a
//! partial view. Objects are decoded one at a time (`decoded`): one that does not decode
//! is named and left out — its last readable version stays — and the rest of its list
//! applies.

mod recovery;
mod store;

use futures::{
    StreamExt as _,
    stream::{BoxStream, SelectAll},
};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{Api, Client, runtime::watcher};
use tokio::sync::watch;

use recovery::Resource;
pub use recovery::{Backoff, STREAK_GAP, WatchHealth};
pub use store::node_info;
use store::{Store, Update};

use super::{api_server::ApiCounters, decoded::Decoded};

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

/// What `run` watches, and how it recovers.
struct Watched<'a> {
    node_name: &'a str,
    label_selector: &'a str,
    all_nodes: bool,
    counters: ApiCounters,
    backoff: Backoff,
    health: WatchHealth,
}

impl Watched<'_> {
    /// Services and EndpointSlices (by the label selector) and Nodes (this one, or all),
    /// each recovering from errors on its own, as one stream of updates.
    fn updates(self, client: Client) -> SelectAll<BoxStream<'static, Update>> {
        let cfg = watcher::Config::default();
        let selected = cfg.clone().labels(self.label_selector);
        let resource = |label, name| Resource { label, name };
        let services = recovery::recovering(
            Api::<Decoded<Service>>::all(client.clone()),
            selected.clone(),
            resource("services", "Services"),
            self.counters.clone(),
            self.backoff.clone(),
            self.health.clone(),
        )
        .map(|e| Update::Service(Box::new(e)));
        let slices = recovery::recovering(
            Api::<Decoded<EndpointSlice>>::all(client.clone()),
            selected,
            resource("endpointslices", "EndpointSlices"),
            self.counters.clone(),
            self.backoff.clone(),
            self.health.clone(),
        )
        .map(|e| Update::Slice(Box::new(e)));
        let node_cfg = if self.all_nodes {
            cfg
        } else {
            cfg.fields(&format!("metadata.name={}", self.node_name))
        };
        let nodes = recovery::recovering(
            Api::<Decoded<Node>>::all(client),
            node_cfg,
            resource("nodes", "Nodes"),
            self.counters,
            self.backoff,
            self.health,
        )
        .map(|e| Update::Node(Box::new(e)));
        let streams: Vec<BoxStream<'static, Update>> =
            vec![services.boxed(), slices.boxed(), nodes.boxed()];
        futures::stream::select_all(streams)
    }
}

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
    let watched = Watched {
        node_name: &node_name,
        label_selector: &label_selector,
        all_nodes,
        counters,
        backoff,
        health,
    };
    let mut updates = watched.updates(client);
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
