//! A set of endpoint addresses, sorted and shared: the node view's frontends of one
//! Service port and the dataplane's mirror of what the maps hold point at one copy,
//! instead of each keeping a tree of its own (at 100k Services × 10 endpoints those
//! copies were most of the agent's memory). IPv4 sets, the common case, keep 6 bytes per
//! address instead of a `SocketAddr`'s 32.

use std::{
    net::{SocketAddr, SocketAddrV4},
    sync::Arc,
};

use serde::Serialize;

use super::narrow::{self, Narrow};

/// Sorted, without repeats; cloning shares the addresses.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct EndpointSet(Addrs);

/// `V4` exactly when every address is IPv4 (the empty set too), so equal sets are equal
/// in representation.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Addrs {
    V4(Arc<[SocketAddrV4]>),
    Any(Arc<[SocketAddr]>),
}

impl Default for EndpointSet {
    fn default() -> Self {
        Self(Addrs::V4(Arc::from([])))
    }
}

impl EndpointSet {
    /// `addrs`, sorted without repeats.
    fn from_set(addrs: Vec<SocketAddr>) -> Self {
        Self(match narrow::narrowed(&addrs) {
            Some(v4) => Addrs::V4(v4.into()),
            None => Addrs::Any(addrs.into()),
        })
    }

    /// A set holding exactly `addrs` when they are sorted without repeats; `None`
    /// otherwise (a slot order that repeats or reorders endpoints is not a set).
    pub fn from_sorted(addrs: Vec<SocketAddr>) -> Option<Self> {
        addrs
            .windows(2)
            .all(|w| w[0] < w[1])
            .then(|| Self::from_set(addrs))
    }

    pub fn iter(&self) -> Iter<'_> {
        match &self.0 {
            Addrs::V4(a) => Iter::Narrow(a.iter()),
            Addrs::Any(a) => Iter::Wide(a.iter()),
        }
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Addrs::V4(a) => a.len(),
            Addrs::Any(a) => a.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, addr: &SocketAddr) -> bool {
        match (&self.0, addr) {
            (Addrs::V4(a), SocketAddr::V4(addr)) => a.binary_search(addr).is_ok(),
            (Addrs::V4(_), SocketAddr::V6(_)) => false,
            (Addrs::Any(a), addr) => a.binary_search(addr).is_ok(),
        }
    }

    /// Both are the one shared copy. (`==` checks this first by itself: `Arc`'s equality
    /// compares pointers before contents for `Eq` types.)
    #[cfg(test)]
    fn shares(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Addrs::V4(a), Addrs::V4(b)) => Arc::ptr_eq(a, b),
            (Addrs::Any(a), Addrs::Any(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// The addresses of a set, in order.
pub type Iter<'a> = narrow::Iter<'a, SocketAddrV4>;

impl Narrow for SocketAddrV4 {
    type Wide = SocketAddr;

    fn narrow(wide: &SocketAddr) -> Option<Self> {
        match wide {
            SocketAddr::V4(a) => Some(*a),
            SocketAddr::V6(_) => None,
        }
    }

    fn widen(self) -> SocketAddr {
        SocketAddr::V4(self)
    }
}

impl FromIterator<SocketAddr> for EndpointSet {
    fn from_iter<I: IntoIterator<Item = SocketAddr>>(iter: I) -> Self {
        let mut v: Vec<SocketAddr> = iter.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        Self::from_set(v)
    }
}

impl<const N: usize> From<[SocketAddr; N]> for EndpointSet {
    fn from(addrs: [SocketAddr; N]) -> Self {
        addrs.into_iter().collect()
    }
}

impl<'a> IntoIterator for &'a EndpointSet {
    type Item = SocketAddr;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl std::fmt::Debug for EndpointSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl Serialize for EndpointSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    #[test]
    fn collecting_sorts_and_drops_repeats() {
        let set: EndpointSet = [sa("10.0.0.2:80"), sa("10.0.0.1:80"), sa("10.0.0.2:80")]
            .into_iter()
            .collect();
        assert_eq!(
            set.iter().collect::<Vec<_>>(),
            [sa("10.0.0.1:80"), sa("10.0.0.2:80")]
        );
        assert!(set.contains(&sa("10.0.0.2:80")));
        assert!(!set.contains(&sa("10.0.0.3:80")));
    }

    #[test]
    fn only_a_sorted_list_without_repeats_is_a_set() {
        let (a, b) = (sa("10.0.0.1:80"), sa("10.0.0.2:80"));
        assert!(EndpointSet::from_sorted(vec![a, b]).is_some());
        assert!(EndpointSet::from_sorted(vec![b, a]).is_none());
        assert!(EndpointSet::from_sorted(vec![a, a]).is_none());
        assert!(EndpointSet::from_sorted(vec![]).is_some());
    }

    #[test]
    fn both_families_keep_their_order() {
        let (a, b, c) = (sa("10.0.0.1:80"), sa("[fd00::1]:80"), sa("10.0.0.2:80"));
        let mixed: EndpointSet = [b, c, a].into_iter().collect();
        assert_eq!(mixed.iter().collect::<Vec<_>>(), [a, c, b]);
        assert!(mixed.contains(&b) && mixed.contains(&a));
        let v6: EndpointSet = [b].into_iter().collect();
        assert!(v6.contains(&b) && !v6.contains(&a));
        let v4: EndpointSet = [a].into_iter().collect();
        assert!(!v4.contains(&b));
        assert_eq!(EndpointSet::from_sorted(vec![a, c, b]), Some(mixed));
        assert_eq!(EndpointSet::default(), [].into_iter().collect());
    }

    #[test]
    fn clones_share_one_copy() {
        let set: EndpointSet = [sa("10.0.0.1:80")].into_iter().collect();
        let other: EndpointSet = [sa("10.0.0.1:80")].into_iter().collect();
        assert!(set.clone().shares(&set));
        assert!(!other.shares(&set));
        assert_eq!(other, set);
    }
}
