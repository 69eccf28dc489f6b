//! A slice's endpoints as the model keeps them: an IPv4 slice (the common case) in 12
//! bytes an endpoint instead of `EndpointInfo`'s 24 (an `IpAddr` takes 17 for 4). At
//! 100k Services × 10 endpoints that is 11 MiB of the agent's heap. Read by value:
//! `iter` and `get` hand out `EndpointInfo`s.

use std::net::{IpAddr, Ipv4Addr};

use serde::{Serialize, ser::SerializeSeq};

use super::{
    endpoint::{EndpointInfo, NodeName},
    narrow::{self, Narrow},
};

/// A slice's endpoints, in the slice's order.
#[derive(Clone, PartialEq, Eq)]
pub struct SliceEndpoints(Stored);

/// `V4` exactly when every endpoint is IPv4 (the empty list too), so equal lists are
/// equal in representation.
#[derive(Clone, PartialEq, Eq)]
enum Stored {
    V4(Box<[V4Endpoint]>),
    Any(Box<[EndpointInfo]>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub struct V4Endpoint {
    ip: [u8; 4],
    conditions: u8,
    node: Option<NodeName>,
}

const READY: u8 = 1;
const SERVING: u8 = 2;
const TERMINATING: u8 = 4;

impl Narrow for V4Endpoint {
    type Wide = EndpointInfo;

    fn narrow(ep: &EndpointInfo) -> Option<Self> {
        let IpAddr::V4(ip) = ep.ip else {
            return None;
        };
        let bit = |on: bool, b: u8| if on { b } else { 0 };
        Some(Self {
            ip: ip.octets(),
            conditions: bit(ep.ready, READY)
                | bit(ep.serving, SERVING)
                | bit(ep.terminating, TERMINATING),
            node: ep.node,
        })
    }

    fn widen(self) -> EndpointInfo {
        EndpointInfo {
            ip: IpAddr::V4(Ipv4Addr::from(self.ip)),
            ready: self.conditions & READY != 0,
            serving: self.conditions & SERVING != 0,
            terminating: self.conditions & TERMINATING != 0,
            node: self.node,
        }
    }
}

impl Default for SliceEndpoints {
    fn default() -> Self {
        Self(Stored::V4(Box::default()))
    }
}

impl From<Vec<EndpointInfo>> for SliceEndpoints {
    fn from(eps: Vec<EndpointInfo>) -> Self {
        Self(match narrow::narrowed(&eps) {
            Some(v4) => Stored::V4(v4.into()),
            None => Stored::Any(eps.into()),
        })
    }
}

impl FromIterator<EndpointInfo> for SliceEndpoints {
    fn from_iter<I: IntoIterator<Item = EndpointInfo>>(iter: I) -> Self {
        Self::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl SliceEndpoints {
    pub fn len(&self) -> usize {
        match &self.0 {
            Stored::V4(e) => e.len(),
            Stored::Any(e) => e.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> Option<EndpointInfo> {
        match &self.0 {
            Stored::V4(e) => e.get(i).map(|n| n.widen()),
            Stored::Any(e) => e.get(i).copied(),
        }
    }

    pub fn iter(&self) -> Iter<'_> {
        match &self.0 {
            Stored::V4(e) => Iter::Narrow(e.iter()),
            Stored::Any(e) => Iter::Wide(e.iter()),
        }
    }
}

/// The endpoints by value, in order.
pub type Iter<'a> = narrow::Iter<'a, V4Endpoint>;

impl std::fmt::Debug for SliceEndpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// As a list of endpoints, the shape `/debug/model` has always shown.
impl Serialize for SliceEndpoints {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.len()))?;
        for ep in self.iter() {
            seq.serialize_element(&ep)?;
        }
        seq.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(
        ip: &str,
        ready: bool,
        serving: bool,
        terminating: bool,
        node: Option<&str>,
    ) -> EndpointInfo {
        EndpointInfo {
            ip: ip.parse().expect("an address"),
            ready,
            serving,
            terminating,
            node: node.map(NodeName::new),
        }
    }

    #[test]
    fn every_endpoint_reads_back_as_written_in_either_form() {
        let v4 = vec![
            ep("10.0.0.1", true, true, false, Some("node-a")),
            ep("10.0.0.2", false, true, true, None),
            ep("10.0.0.3", false, false, false, Some("node-b")),
            ep("255.255.255.254", true, false, true, Some("node-a")),
        ];
        let mut mixed = v4.clone();
        mixed.push(ep("fd00::1", true, true, false, Some("node-c")));
        for list in [v4, mixed, Vec::new()] {
            let stored = SliceEndpoints::from(list.clone());
            assert_eq!(stored.len(), list.len());
            assert_eq!(stored.iter().collect::<Vec<_>>(), list);
            assert_eq!(stored.get(list.len()), None);
            assert_eq!(
                serde_json::to_value(&stored).expect("serializes"),
                serde_json::to_value(&list).expect("serializes")
            );
        }
    }

    #[test]
    fn an_ipv4_endpoint_takes_half_the_room() {
        assert_eq!(std::mem::size_of::<V4Endpoint>(), 12);
        assert_eq!(std::mem::size_of::<EndpointInfo>(), 24);
        let one = SliceEndpoints::from(vec![ep("10.0.0.1", true, true, false, None)]);
        assert!(matches!(one.0, Stored::V4(_)));
        assert_eq!(
            one,
            SliceEndpoints::from_iter(one.iter()),
            "the same list, the same form"
        );
    }
}
