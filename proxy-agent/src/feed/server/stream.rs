//! What goes on one node's stream: each op encoded once and shared by every node
//! (`Encoded`), and what the node asked to read (`Reads`).

/// An op (`v1::Op`) as it goes on the wire: encoded once, shared by every node.
pub type Encoded = bytes::Bytes;

/// What a node's stream reads beyond the model and its own Node (`WatchRequest`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reads {
    /// Every Node's addresses (`accepts_peers`): an agent older than these ops refuses
    /// a batch that holds one, so only those that ask get them.
    pub peers: bool,
}
