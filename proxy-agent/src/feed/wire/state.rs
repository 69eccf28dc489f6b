//! A node's state as the feed's ops build it: the cluster model, its own Node (when the
//! server has one), every Node's addresses (its peers, from a server that sends them),
//! and where in the server's history it stands. The agent applies each
//! batch here; the property test applies the same ops and compares with the model the
//! server holds.

use crate::model::{ClusterModel, NodeInfo};

use super::{
    convert::{self, DecodeError},
    v1,
};

/// A batch that cannot be applied: the state is left as it was before the batch.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OpError {
    #[error("op {index}: {source}")]
    Decode {
        index: usize,
        #[source]
        source: DecodeError,
    },
    #[error("a batch of epoch {got:?} on a stream of epoch {held:?} that is not a snapshot")]
    Epoch { held: String, got: String },
    #[error("revision {got} does not follow {held}")]
    Revision { held: u64, got: u64 },
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeState {
    pub model: ClusterModel,
    /// This node's Node object, as the server has it.
    pub node: Option<NodeInfo>,
    /// Every Node by name, with its name and addresses only (`set_peer`); empty from a
    /// server older than them.
    pub peers: imbl::OrdMap<String, NodeInfo>,
    pub epoch: String,
    pub revision: u64,
    pub api_validated: bool,
    /// Whether a snapshot has been applied (nothing is programmed before).
    pub complete: bool,
}

impl NodeState {
    /// Applies one batch, all or nothing.
    pub fn apply(&mut self, batch: &v1::Batch) -> Result<(), OpError> {
        if !batch.snapshot {
            if batch.epoch != self.epoch {
                return Err(OpError::Epoch {
                    held: self.epoch.clone(),
                    got: batch.epoch.clone(),
                });
            }
            if batch.revision < self.revision {
                return Err(OpError::Revision {
                    held: self.revision,
                    got: batch.revision,
                });
            }
        }
        let mut next = if batch.snapshot {
            Self::default()
        } else {
            self.clone()
        };
        for (index, op) in batch.ops.iter().enumerate() {
            next.apply_op(op)
                .map_err(|source| OpError::Decode { index, source })?;
        }
        next.epoch = batch.epoch.clone();
        next.revision = batch.revision;
        next.api_validated = batch.api_validated;
        next.complete = true;
        if batch.snapshot {
            // Changing only what differs keeps the model one lineage with the one the
            // runner holds: its diff (and what is re-programmed) stays proportional.
            let fresh = std::mem::take(&mut next.model);
            next.model = std::mem::take(&mut self.model);
            next.model.replace_with(&fresh);
        }
        *self = next;
        Ok(())
    }

    fn apply_op(&mut self, op: &v1::Op) -> Result<(), DecodeError> {
        use v1::op::Op;
        // An op of a later version (prost reads a oneof member it does not know as none)
        // is skipped, not refused: one that matters is sent only to nodes that ask.
        let Some(op) = op.op.as_ref() else {
            return Ok(());
        };
        match op {
            Op::SetService(s) => {
                let (r, info) = convert::service_from_wire(s)?;
                self.model.insert_service(r, info);
            }
            Op::DeleteService(r) => {
                self.model.remove_service(&convert::ref_from_wire(Some(r))?);
            }
            Op::SetSlice(s) => {
                let (r, info) = convert::slice_from_wire(s)?;
                self.model.insert_slice(r, info);
            }
            Op::DeleteSlice(r) => {
                self.model.remove_slice(&convert::ref_from_wire(Some(r))?);
            }
            Op::SetNode(n) => self.node = Some(convert::node_from_wire(n)?),
            Op::DeleteNode(_) => self.node = None,
            Op::SetPeer(n) => {
                let peer = convert::peer_from_wire(n)?;
                self.peers.insert(peer.name.clone(), peer);
            }
            Op::DeletePeer(name) => {
                self.peers.remove(name);
            }
        }
        Ok(())
    }
}
