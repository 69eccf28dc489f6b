//! One endpoint as the model reads it (`EndpointInfo`) and the node name it is on
//! (`NodeName`, interned): the leaf that both a slice's object (`objects`) and its
//! compact endpoint list (`slice_endpoints`) build on.

use std::{
    net::IpAddr,
    num::NonZeroU32,
    sync::{OnceLock, RwLock},
};

use serde::Serialize;

/// One endpoint: its first address (kube-proxy uses only that one) and conditions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct EndpointInfo {
    pub ip: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node: Option<NodeName>,
}

impl EndpointInfo {
    pub fn is_on(&self, node: &str) -> bool {
        self.node.is_some_and(|n| n.as_str() == node)
    }
}

/// An endpoint's `nodeName`, interned as a 4-byte index (a million endpoints repeat a
/// cluster's few node names: 16 MiB less than a shared `Arc<str>` each at 100k Services ×
/// 10 endpoints). Equal names have equal indices.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeName(NonZeroU32);

/// The node names interned so far (never shrinks, as `intern`'s table).
#[derive(Default)]
struct NodeNames {
    /// By index; 0 is no name's (a `NodeName` is never 0).
    by_index: Vec<&'static str>,
    by_name: std::collections::HashMap<&'static str, NonZeroU32>,
}

fn node_names() -> &'static RwLock<NodeNames> {
    static NAMES: OnceLock<RwLock<NodeNames>> = OnceLock::new();
    NAMES.get_or_init(|| {
        RwLock::new(NodeNames {
            by_index: vec![""],
            ..Default::default()
        })
    })
}

impl NodeName {
    pub fn new(name: &str) -> Self {
        let table = node_names();
        if let Some(&i) = table
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_name
            .get(name)
        {
            return NodeName(i);
        }
        let mut t = table.write().unwrap_or_else(|p| p.into_inner());
        if let Some(&i) = t.by_name.get(name) {
            return NodeName(i);
        }
        let i = u32::try_from(t.by_index.len())
            .ok()
            .and_then(NonZeroU32::new)
            .unwrap_or(NonZeroU32::MAX);
        // Leaked once per distinct name: bounded by the cluster's node names.
        let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
        t.by_index.push(leaked);
        t.by_name.insert(leaked, i);
        NodeName(i)
    }

    pub fn as_str(self) -> &'static str {
        let t = node_names().read().unwrap_or_else(|p| p.into_inner());
        t.by_index.get(self.0.get() as usize).copied().unwrap_or("")
    }
}

impl std::fmt::Debug for NodeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl Serialize for NodeName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}
