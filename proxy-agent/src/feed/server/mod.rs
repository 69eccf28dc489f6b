//! `proxy-agent serve`'s core: one copy of the cluster model, fed by a source that
//! watches the API server once, and a mailbox per connected node. Each model change
//! becomes ops (an object set or removed) with a revision; every node's mailbox gets the
//! ops that concern it — every Service and EndpointSlice, its own Node, and every Node's
//! addresses (its peers) when it reads them — so no-op updates and Node heartbeats (equal
//! in the compact model) never leave the server. A bounded history lets a reconnecting
//! node resume from its revision.
//!
//! Each op is encoded once, when the model changes (`Encoded`): the history, every
//! mailbox and every stream share its bytes, and a snapshot is the map of every
//! object's current op (`State::objects`, a persistent map whose clone is O(1)) walked
//! as the node's stream takes it — never a copy of the model per node.

pub mod grpc;
pub mod http;
pub mod mailbox;
mod stream;

pub use stream::{Encoded, Reads};

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, Weak},
};

use prost::Message as _;

use crate::feed::wire::{convert, v1};
use crate::model::{ClusterModel, NodeInfo, ObjectChange};
use crate::source::Snapshot;

use mailbox::{Mailbox, OpKey, Pending, Whole};

fn encode(op: v1::op::Op) -> Encoded {
    Encoded::from(v1::Op { op: Some(op) }.encode_to_vec())
}

/// How the hub is sized.
#[derive(Clone, Copy, Debug)]
pub struct HubOptions {
    /// Ops kept for resuming: a node further behind gets a snapshot.
    pub history: usize,
    /// Coalesced ops one node may have pending before it gets a snapshot instead.
    pub pending_bound: usize,
}

impl Default for HubOptions {
    fn default() -> Self {
        Self {
            history: 100_000,
            pending_bound: 50_000,
        }
    }
}

/// An op of the history: its revision and the nodes it is for.
struct Logged {
    revision: u64,
    to: Audience,
    key: OpKey,
    op: Encoded,
}

/// Which nodes' streams an op is for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Audience {
    /// Every node: a Service or an EndpointSlice.
    Every,
    /// One node: its own Node.
    Node(String),
    /// Every node that reads peers (`Reads::peers`): a Node's addresses.
    Peers,
}

impl Audience {
    fn reaches(&self, node: &str, reads: Reads) -> bool {
        match self {
            Audience::Every => true,
            Audience::Node(n) => n == node,
            Audience::Peers => reads.peers,
        }
    }
}

struct State {
    epoch: String,
    revision: u64,
    /// Ops after this revision are all in `history`.
    history_floor: u64,
    history: VecDeque<Logged>,
    model: ClusterModel,
    /// Every Service's and EndpointSlice's op as a snapshot sends it.
    objects: imbl::OrdMap<OpKey, Encoded>,
    nodes: imbl::OrdMap<String, NodeInfo>,
    /// Every Node's `set_peer` op, as a snapshot sends it to a node that reads peers.
    peers: imbl::OrdMap<String, Encoded>,
    ready: bool,
    mailboxes: Vec<Weak<Mailbox>>,
}

/// Counts for the server's metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HubCounts {
    pub revision: u64,
    pub nodes_connected: usize,
    pub snapshots_sent: u64,
    pub resumes: u64,
    /// Bytes of batches handed to the nodes' streams.
    pub bytes_sent: u64,
    /// Snapshots given instead of ops to nodes past their bound.
    pub overflows: u64,
    /// Services and EndpointSlices held.
    pub objects: usize,
    /// Whether the source's first full state is in (nodes get snapshots from then on).
    pub ready: bool,
    /// Whether the API watch has been failing past its bound (`Hub::set_api_lost`).
    pub api_lost: bool,
    /// Streams refused or cut, by why.
    pub cuts: CutCounts,
}

/// Why the server refused or cut a stream or a connection (a metric label each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// No synced view: never synced, or the API watch lost past its bound.
    NoView,
    /// A node identity already has its most streams open.
    StreamsPerNode,
    /// A batch sent whole (to a node that does not join parts) waited too long for room
    /// in the budget of whole batches in flight.
    WholeBudget,
    /// A peer address already has its most TLS handshakes under way.
    HandshakesPerPeer,
    /// A TLS handshake not done within its timeout.
    HandshakeTimeout,
}

impl Cut {
    pub const ALL: [Cut; 5] = [
        Cut::NoView,
        Cut::StreamsPerNode,
        Cut::WholeBudget,
        Cut::HandshakesPerPeer,
        Cut::HandshakeTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Cut::NoView => "no_view",
            Cut::StreamsPerNode => "streams_per_node",
            Cut::WholeBudget => "whole_budget",
            Cut::HandshakesPerPeer => "handshakes_per_peer",
            Cut::HandshakeTimeout => "handshake_timeout",
        }
    }
}

/// How many of each `Cut`, in `Cut::ALL`'s order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CutCounts(pub [u64; 5]);

impl CutCounts {
    pub fn get(&self, cut: Cut) -> u64 {
        self.0[cut as usize]
    }
}

pub struct Hub {
    state: Mutex<State>,
    opts: HubOptions,
    counts: Mutex<HubCounts>,
    /// Apart from `counts`: every stream adds to it for every message.
    bytes_sent: std::sync::atomic::AtomicU64,
    /// Apart from `state`: every stream reads it for every message.
    api_validated: std::sync::atomic::AtomicBool,
    /// The API watch has failed past its bound: no stream is served from this view.
    api_lost: std::sync::atomic::AtomicBool,
    cuts: [std::sync::atomic::AtomicU64; 5],
    /// Open streams by node identity.
    streams: Mutex<std::collections::HashMap<String, usize>>,
}

/// A node's open stream, counted against its identity until dropped.
pub struct StreamSlot {
    hub: Weak<Hub>,
    node: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let Some(hub) = self.hub.upgrade() else {
            return;
        };
        let mut streams = hub.streams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = streams.get_mut(&self.node) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                streams.remove(&self.node);
            }
        }
    }
}

impl Hub {
    pub fn new(opts: HubOptions) -> Arc<Self> {
        // A new history on each start: revisions of another run (or replica) never match.
        let epoch = format!("{:016x}{:08x}", rand::random::<u64>(), std::process::id());
        Arc::new(Self {
            state: Mutex::new(State {
                epoch,
                revision: 0,
                history_floor: 0,
                history: VecDeque::new(),
                model: ClusterModel::default(),
                objects: imbl::OrdMap::new(),
                nodes: imbl::OrdMap::new(),
                peers: imbl::OrdMap::new(),
                ready: false,
                mailboxes: Vec::new(),
            }),
            opts,
            counts: Mutex::new(HubCounts::default()),
            bytes_sent: std::sync::atomic::AtomicU64::new(0),
            api_validated: std::sync::atomic::AtomicBool::new(false),
            api_lost: std::sync::atomic::AtomicBool::new(false),
            cuts: Default::default(),
            streams: Mutex::new(Default::default()),
        })
    }

    /// Why there is no view (`None`: there is one).
    pub fn no_view_reason(&self) -> Option<&'static str> {
        if !self.lock().ready {
            Some("waiting for the first full list of the API server")
        } else if self.api_lost.load(std::sync::atomic::Ordering::Relaxed) {
            Some("the API server watch has been failing past its bound")
        } else {
            None
        }
    }

    /// The API watch has been failing past its bound (`lost`), or answers again: while
    /// lost, open streams end and new ones are refused with `wire::no_view_status`, so
    /// that the nodes move to a replica that has data.
    pub fn set_api_lost(&self, lost: bool) {
        let was = self
            .api_lost
            .swap(lost, std::sync::atomic::Ordering::Relaxed);
        if was == lost {
            return;
        }
        if lost {
            tracing::error!(
                "the API server watch has failed past its bound: ending every node's stream \
                 until it answers again"
            );
        } else {
            tracing::info!("the API server watch answers again: serving nodes");
        }
        // Wake every stream: an idle one learns at once.
        for mb in self.lock().mailboxes.iter().filter_map(Weak::upgrade) {
            mb.notify.notify_one();
        }
    }

    /// Counts a refused or cut stream or connection.
    pub fn count_cut(&self, cut: Cut) {
        self.cuts[cut as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A slot for one more stream of `node`, unless it has `max` open already.
    pub fn stream_slot(self: &Arc<Self>, node: &str, max: usize) -> Option<StreamSlot> {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        let n = streams.entry(node.to_string()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(StreamSlot {
            hub: Arc::downgrade(self),
            node: node.to_string(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn counts(&self) -> HubCounts {
        let mut s = *self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.lock();
        s.revision = st.revision;
        s.nodes_connected = st.mailboxes.iter().filter(|m| m.strong_count() > 0).count();
        s.objects = st.objects.len();
        s.ready = st.ready;
        drop(st);
        s.api_lost = self.api_lost.load(std::sync::atomic::Ordering::Relaxed);
        for (i, c) in self.cuts.iter().enumerate() {
            s.cuts.0[i] = c.load(std::sync::atomic::Ordering::Relaxed);
        }
        s.bytes_sent = self.bytes_sent.load(std::sync::atomic::Ordering::Relaxed);
        s
    }

    pub fn epoch(&self) -> String {
        self.lock().epoch.clone()
    }

    pub fn api_validated(&self) -> bool {
        self.api_validated
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Takes the source's latest snapshot: its differences from the model held become
    /// ops, logged and handed to every mailbox they concern.
    pub fn publish(&self, snap: &Snapshot) {
        let mut st = self.lock();
        let mut ops: Vec<Logged> = Vec::new();
        let mut next = |st: &mut State, to: Audience, key: OpKey, op: Encoded| {
            st.revision += 1;
            ops.push(Logged {
                revision: st.revision,
                to,
                key,
                op,
            });
        };
        for change in st.model.object_changes(&snap.model) {
            let (key, op) = change_op(change);
            let set = matches!(op, v1::op::Op::SetService(_) | v1::op::Op::SetSlice(_));
            let op = encode(op);
            if set {
                st.objects.insert(key.clone(), op.clone());
            } else {
                st.objects.remove(&key);
            }
            next(&mut st, Audience::Every, key, op);
        }
        let old_nodes = st.nodes.clone();
        for d in old_nodes.diff(&snap.nodes) {
            use imbl::ordmap::DiffItem;
            let (name, now, addresses_moved) = match d {
                DiffItem::Remove(name, _) => (name, None, true),
                DiffItem::Add(name, n) => (name, Some(n), true),
                DiffItem::Update {
                    old: (_, was),
                    new: (name, n),
                } => (name, Some(n), was.addresses != n.addresses),
            };
            let own = match now {
                Some(n) => encode(v1::op::Op::SetNode(convert::node_to_wire(n))),
                None => encode(v1::op::Op::DeleteNode(name.clone())),
            };
            next(&mut st, Audience::Node(name.clone()), OpKey::Node, own);
            // Its peers hear of a Node only when its addresses change (labels and
            // heartbeats are its own business).
            if addresses_moved {
                let peer = match now {
                    Some(n) => {
                        let op = encode(v1::op::Op::SetPeer(convert::peer_to_wire(n)));
                        st.peers.insert(name.clone(), op.clone());
                        op
                    }
                    None => {
                        st.peers.remove(name);
                        encode(v1::op::Op::DeletePeer(name.clone()))
                    }
                };
                next(&mut st, Audience::Peers, OpKey::Peer(name.clone()), peer);
            }
        }
        st.model = snap.model.clone();
        st.nodes = snap.nodes.clone();
        self.api_validated
            .store(snap.api_validated, std::sync::atomic::Ordering::Relaxed);
        let first = !st.ready;
        st.ready = true;
        st.mailboxes.retain(|m| m.strong_count() > 0);
        let revision = st.revision;
        let mut overflows = 0;
        for mb in st.mailboxes.iter().filter_map(Weak::upgrade) {
            let whole = || st.whole(&mb.node, mb.reads);
            if first {
                // Nodes that connected before the first full list: their snapshot now.
                let mut p = mb.pending.lock().unwrap_or_else(|p| p.into_inner());
                p.revision = revision;
                p.snapshot = Some(whole());
                p.ops.clear();
                drop(p);
                mb.notify.notify_one();
                continue;
            }
            let mine = ops
                .iter()
                .filter(|o| o.to.reaches(&mb.node, mb.reads))
                .map(|o| (o.key.clone(), o.op.clone()));
            if mb.push(mine, revision, whole) {
                overflows += 1;
            }
        }
        if overflows > 0 {
            self.counts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .overflows += overflows;
        }
        st.history.extend(ops);
        while st.history.len() > self.opts.history {
            if let Some(gone) = st.history.pop_front() {
                st.history_floor = gone.revision;
            }
        }
    }

    /// A node's mailbox, for a node that reads no peers (an agent older than them).
    pub fn subscribe(&self, node: &str, epoch: &str, revision: u64) -> Arc<Mailbox> {
        self.subscribe_reading(node, epoch, revision, Reads::default())
    }

    /// A node's mailbox: resumed from (`epoch`, `revision`) when the history still holds
    /// every op after it, else primed with a snapshot (once the model is complete); what
    /// it holds is what the node `reads`.
    pub fn subscribe_reading(
        &self,
        node: &str,
        epoch: &str,
        revision: u64,
        reads: Reads,
    ) -> Arc<Mailbox> {
        let mut st = self.lock();
        let resumable = st.ready
            && epoch == st.epoch
            && revision <= st.revision
            && revision >= st.history_floor;
        let mut pending = Pending {
            revision: st.revision,
            ..Default::default()
        };
        if resumable {
            pending.ops = st
                .history
                .iter()
                .filter(|o| o.revision > revision)
                .filter(|o| o.to.reaches(node, reads))
                .map(|o| (o.key.clone(), o.op.clone()))
                .collect();
        } else if st.ready {
            pending.snapshot = Some(st.whole(node, reads));
        }
        {
            let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            if resumable {
                counts.resumes += 1;
            }
        }
        let mb = Arc::new(Mailbox::new(
            node.to_string(),
            reads,
            self.opts.pending_bound,
            pending,
        ));
        st.mailboxes.push(Arc::downgrade(&mb));
        if resumable || st.ready {
            mb.notify.notify_one();
        }
        mb
    }

    pub(crate) fn count_sent(&self, bytes: usize) {
        self.bytes_sent
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn count_snapshot(&self) {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .snapshots_sent += 1;
    }
}

fn change_op(change: ObjectChange) -> (OpKey, v1::op::Op) {
    use v1::op::Op;
    match change {
        ObjectChange::SetService(r, s) => (
            OpKey::Service(r.clone()),
            Op::SetService(convert::service_to_wire(&r, &s)),
        ),
        ObjectChange::RemoveService(r) => (
            OpKey::Service(r.clone()),
            Op::DeleteService(convert::ref_to_wire(&r)),
        ),
        ObjectChange::SetSlice(r, s) => (
            OpKey::Slice(r.clone()),
            Op::SetSlice(convert::slice_to_wire(&r, &s)),
        ),
        ObjectChange::RemoveSlice(r) => (
            OpKey::Slice(r.clone()),
            Op::DeleteSlice(convert::ref_to_wire(&r)),
        ),
    }
}

impl State {
    /// What a snapshot for `node` sends: every object's op (shared, O(1) to take), the
    /// node's own Node, and every Node's addresses if it reads them (shared too).
    fn whole(&self, node: &str, reads: Reads) -> Whole {
        Whole {
            objects: self.objects.clone(),
            node: self
                .nodes
                .get(node)
                .map(|n| encode(v1::op::Op::SetNode(convert::node_to_wire(n)))),
            peers: if reads.peers {
                self.peers.clone()
            } else {
                imbl::OrdMap::new()
            },
        }
    }
}

/// The ops that build `model` and `node` from nothing (what a snapshot of them sends).
pub fn snapshot_ops(model: &ClusterModel, node: Option<&NodeInfo>) -> Vec<v1::Op> {
    let mut ops: Vec<v1::Op> = Vec::new();
    let empty = ClusterModel::default();
    for change in empty.object_changes(model) {
        ops.push(v1::Op {
            op: Some(change_op(change).1),
        });
    }
    if let Some(n) = node {
        ops.push(v1::Op {
            op: Some(v1::op::Op::SetNode(convert::node_to_wire(n))),
        });
    }
    ops
}

/// Judges the hub's view by the API watch's errors: lost once a streak has lasted `bound`
/// (`WatchHealth`), current again once it ends. Runs while the hub is held elsewhere.
pub async fn judge_view(
    hub: Weak<Hub>,
    health: crate::source::kube::WatchHealth,
    bound: std::time::Duration,
) {
    let every = (bound / 4).clamp(
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(1),
    );
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let Some(hub) = hub.upgrade() else { return };
        let failing = health.failing_for(tokio::time::Instant::now());
        hub.set_api_lost(failing.is_some_and(|d| d >= bound));
    }
}

/// Asks the API server its version every `every` (within `every` too), its answer
/// counted into `health` as resource `version`: a server that hangs or a network that
/// drops everything silently fails this while the watches wait on their timeouts (~5 min).
pub async fn probe_api(
    client: kube::Client,
    health: crate::source::kube::WatchHealth,
    every: std::time::Duration,
) {
    loop {
        match tokio::time::timeout(every, client.apiserver_version()).await {
            Ok(Ok(_)) => health.ok("version"),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "the API server's version probe failed");
                health.error("version", tokio::time::Instant::now());
            }
            Err(_) => health.error("version", tokio::time::Instant::now()),
        }
        tokio::time::sleep(every).await;
    }
}

/// Feeds the hub from a source until the source stops.
pub async fn ingest(
    hub: Arc<Hub>,
    mut source: tokio::sync::watch::Receiver<Option<crate::source::SharedSnapshot>>,
) {
    loop {
        let snap = source.borrow_and_update().clone();
        if let Some(snap) = snap {
            hub.publish(&snap);
        }
        if source.changed().await.is_err() {
            return;
        }
    }
}
