//! `proxy-agent serve`'s core: one copy of the cluster model, fed by a source that
//! watches the API server once, and a mailbox per connected node. Each model change
//! becomes ops (an object set or removed) with a revision; every node's mailbox gets the
//! ops that concern it — every Service and EndpointSlice, its own Node only — so no-op
//! updates and Node heartbeats (equal in the compact model) never leave the server. A
//! bounded history lets a reconnecting node resume from its revision.

pub mod grpc;
pub mod mailbox;

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, Weak},
};

use crate::model::{ClusterModel, NodeInfo, ObjectChange};
use crate::source::Snapshot;
use crate::wire::{convert, v1};

use mailbox::{Mailbox, OpKey, Pending, Whole};

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

/// An op of the history: its revision, the node it is for (`None`: every node).
struct Logged {
    revision: u64,
    node: Option<String>,
    key: OpKey,
    op: Arc<v1::Op>,
}

struct State {
    epoch: String,
    revision: u64,
    /// Ops after this revision are all in `history`.
    history_floor: u64,
    history: VecDeque<Logged>,
    model: ClusterModel,
    nodes: imbl::OrdMap<String, NodeInfo>,
    api_validated: bool,
    ready: bool,
    mailboxes: Vec<Weak<Mailbox>>,
}

/// Counts for the server's metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HubStats {
    pub revision: u64,
    pub nodes_connected: usize,
    pub snapshots_sent: u64,
    pub resumes: u64,
}

pub struct Hub {
    state: Mutex<State>,
    opts: HubOptions,
    stats: Mutex<HubStats>,
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
                nodes: imbl::OrdMap::new(),
                api_validated: false,
                ready: false,
                mailboxes: Vec::new(),
            }),
            opts,
            stats: Mutex::new(HubStats::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> HubStats {
        let mut s = *self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.lock();
        s.revision = st.revision;
        s.nodes_connected = st.mailboxes.iter().filter(|m| m.strong_count() > 0).count();
        s
    }

    pub fn epoch(&self) -> String {
        self.lock().epoch.clone()
    }

    pub fn api_validated(&self) -> bool {
        self.lock().api_validated
    }

    /// Takes the source's latest snapshot: its differences from the model held become
    /// ops, logged and handed to every mailbox they concern.
    pub fn publish(&self, snap: &Snapshot) {
        let mut st = self.lock();
        let mut ops: Vec<Logged> = Vec::new();
        let mut next = |st: &mut State, node: Option<String>, key: OpKey, op: v1::op::Op| {
            st.revision += 1;
            ops.push(Logged {
                revision: st.revision,
                node,
                key,
                op: Arc::new(v1::Op { op: Some(op) }),
            });
        };
        for change in st.model.object_changes(&snap.model) {
            let (key, op) = change_op(change);
            next(&mut st, None, key, op);
        }
        let old_nodes = st.nodes.clone();
        for d in old_nodes.diff(&snap.nodes) {
            use imbl::ordmap::DiffItem;
            match d {
                DiffItem::Remove(name, _) => next(
                    &mut st,
                    Some(name.clone()),
                    OpKey::Node,
                    v1::op::Op::DeleteNode(name.clone()),
                ),
                DiffItem::Add(name, n) | DiffItem::Update { new: (name, n), .. } => next(
                    &mut st,
                    Some(name.clone()),
                    OpKey::Node,
                    v1::op::Op::SetNode(convert::node_to_wire(n)),
                ),
            }
        }
        st.model = snap.model.clone();
        st.nodes = snap.nodes.clone();
        st.api_validated = snap.api_validated;
        let first = !st.ready;
        st.ready = true;
        st.mailboxes.retain(|m| m.strong_count() > 0);
        let revision = st.revision;
        for mb in st.mailboxes.iter().filter_map(Weak::upgrade) {
            let whole = || Whole {
                model: st.model.clone(),
                node: st.nodes.get(&mb.node).cloned(),
            };
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
                .filter(|o| o.node.as_ref().is_none_or(|n| *n == mb.node))
                .map(|o| (o.key.clone(), Arc::clone(&o.op)));
            mb.push(mine, revision, whole);
        }
        st.history.extend(ops);
        while st.history.len() > self.opts.history {
            if let Some(gone) = st.history.pop_front() {
                st.history_floor = gone.revision;
            }
        }
    }

    /// A node's mailbox: resumed from (`epoch`, `revision`) when the history still holds
    /// every op after it, else primed with a snapshot (once the model is complete).
    pub fn subscribe(&self, node: &str, epoch: &str, revision: u64) -> Arc<Mailbox> {
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
                .filter(|o| o.node.as_ref().is_none_or(|n| n == node))
                .map(|o| (o.key.clone(), Arc::clone(&o.op)))
                .collect();
        } else if st.ready {
            pending.snapshot = Some(Whole {
                model: st.model.clone(),
                node: st.nodes.get(node).cloned(),
            });
        }
        {
            let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
            if resumable {
                stats.resumes += 1;
            }
        }
        let mb = Arc::new(Mailbox::new(
            node.to_string(),
            self.opts.pending_bound,
            pending,
        ));
        st.mailboxes.push(Arc::downgrade(&mb));
        if resumable || st.ready {
            mb.notify.notify_one();
        }
        mb
    }

    pub(crate) fn count_snapshot(&self) {
        self.stats
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

/// The ops that build `whole` from nothing.
pub fn snapshot_ops(whole: &Whole) -> Vec<v1::Op> {
    let mut ops: Vec<v1::Op> = Vec::new();
    let empty = ClusterModel::default();
    for change in empty.object_changes(&whole.model) {
        ops.push(v1::Op {
            op: Some(change_op(change).1),
        });
    }
    if let Some(n) = &whole.node {
        ops.push(v1::Op {
            op: Some(v1::op::Op::SetNode(convert::node_to_wire(n))),
        });
    }
    ops
}

/// Feeds the hub from a source until the source stops.
pub async fn follow(
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
