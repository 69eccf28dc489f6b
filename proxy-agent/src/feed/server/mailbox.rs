//! One node's pending changes: coalesced by object (a Service changed ten times while
//! the node was not reading is sent once, as it is now), bounded (past the bound the
//! node gets a fresh snapshot instead), drained whenever its stream can take more.

use std::collections::BTreeMap;

use super::stream::{Encoded, Reads};
use crate::model::ObjectRef;

/// What one op is about: a later op on the same key replaces an earlier one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum OpKey {
    Service(ObjectRef),
    Slice(ObjectRef),
    Node,
    /// A Node's addresses, by name (`set_peer` / `delete_peer`).
    Peer(String),
}

/// The whole state a snapshot sends: every object's op (a persistent map: taking it
/// copies nothing), the node's own Node, and every Node's `set_peer` (empty for a node
/// that reads no peers).
#[derive(Clone, Debug)]
pub struct Whole {
    pub objects: imbl::OrdMap<OpKey, Encoded>,
    pub node: Option<Encoded>,
    pub peers: imbl::OrdMap<String, Encoded>,
}

#[derive(Debug, Default)]
pub struct Pending {
    /// A snapshot not yet sent; `ops` follow it.
    pub snapshot: Option<Whole>,
    pub ops: BTreeMap<OpKey, Encoded>,
    /// The server's revision this node has been given everything up to.
    pub revision: u64,
    /// When the oldest op not yet drained arrived.
    pub since: Option<std::time::Instant>,
}

/// What a drain hands the stream.
pub enum Drained {
    Snapshot(Whole, Vec<Encoded>, u64),
    Ops(Vec<Encoded>, u64),
}

/// A node's mailbox; the hub writes, the node's stream reads.
pub struct Mailbox {
    pub node: String,
    /// What the node reads beyond the model and its own Node.
    pub reads: Reads,
    pub pending: std::sync::Mutex<Pending>,
    pub notify: tokio::sync::Notify,
    /// The most coalesced ops held before the node gets a snapshot instead.
    pub bound: usize,
}

impl Mailbox {
    pub fn new(node: String, reads: Reads, bound: usize, pending: Pending) -> Self {
        Self {
            node,
            reads,
            pending: std::sync::Mutex::new(pending),
            notify: tokio::sync::Notify::new(),
            bound,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds ops up to `revision`; `whole` is the state after them, taken only when the
    /// bound is passed (then `true`: the node gets a snapshot instead). Never blocks on
    /// the node.
    pub fn push(
        &self,
        ops: impl IntoIterator<Item = (OpKey, Encoded)>,
        revision: u64,
        whole: impl FnOnce() -> Whole,
    ) -> bool {
        let mut p = self.lock();
        p.revision = revision;
        let before = p.ops.len();
        p.ops.extend(ops);
        if p.ops.len() > before {
            p.since.get_or_insert_with(std::time::Instant::now);
        }
        let overflowed = p.ops.len() > self.bound;
        if overflowed {
            p.ops.clear();
            p.snapshot = Some(whole());
        }
        drop(p);
        self.notify.notify_one();
        overflowed
    }

    /// Everything pending, unless no op is (a revision that moved on through
    /// other nodes' changes alone is sent with the next op or keepalive).
    /// `Err(revision)`: nothing pending, and everything up to `revision` given.
    pub fn drain(&self) -> Result<Drained, u64> {
        let mut p = self.lock();
        p.since = None;
        let ops: Vec<Encoded> = std::mem::take(&mut p.ops).into_values().collect();
        if let Some(whole) = p.snapshot.take() {
            return Ok(Drained::Snapshot(whole, ops, p.revision));
        }
        if ops.is_empty() {
            return Err(p.revision);
        }
        Ok(Drained::Ops(ops, p.revision))
    }

    /// How long to wait before draining, so that ops arriving within `window` of the
    /// first one pending go in one message (`None`: drain now — nothing pending, a
    /// snapshot, or the window has passed).
    pub fn settle(&self, window: std::time::Duration) -> Option<std::time::Duration> {
        let p = self.lock();
        if p.snapshot.is_some() {
            return None;
        }
        let age = p.since?.elapsed();
        window.checked_sub(age).filter(|left| !left.is_zero())
    }

    /// The revision this node has been given everything up to.
    pub fn revision(&self) -> u64 {
        self.lock().revision
    }
}
