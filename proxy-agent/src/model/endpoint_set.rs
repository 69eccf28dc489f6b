//! A set of endpoint addresses, sorted and shared: the node view's frontends of one
//! Service port and the dataplane's mirror of what the maps hold point at one copy,
//! instead of each keeping a tree of its own (at 100k Services × 10 endpoints those
//! copies were most of the agent's memory).

use std::{collections::BTreeSet, net::SocketAddr, sync::Arc};

use serde::Serialize;

/// Sorted, without repeats; cloning shares the addresses.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct EndpointSet(Arc<[SocketAddr]>);

impl EndpointSet {
    /// A set holding exactly `addrs` when they are sorted without repeats; `None`
    /// otherwise (a slot order that repeats or reorders endpoints is not a set).
    pub fn from_sorted(addrs: Vec<SocketAddr>) -> Option<Self> {
        addrs
            .windows(2)
            .all(|w| w[0] < w[1])
            .then(|| Self(addrs.into()))
    }

    pub fn iter(&self) -> std::slice::Iter<'_, SocketAddr> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, addr: &SocketAddr) -> bool {
        self.0.binary_search(addr).is_ok()
    }

    pub fn as_slice(&self) -> &[SocketAddr] {
        &self.0
    }

    /// Both are the one shared copy (a cheap equality that may say `false` for equal
    /// sets).
    pub fn shares(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl FromIterator<SocketAddr> for EndpointSet {
    fn from_iter<I: IntoIterator<Item = SocketAddr>>(iter: I) -> Self {
        let mut v: Vec<SocketAddr> = iter.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        Self(v.into())
    }
}

impl From<BTreeSet<SocketAddr>> for EndpointSet {
    fn from(set: BTreeSet<SocketAddr>) -> Self {
        Self(set.into_iter().collect())
    }
}

impl<const N: usize> From<[SocketAddr; N]> for EndpointSet {
    fn from(addrs: [SocketAddr; N]) -> Self {
        addrs.into_iter().collect()
    }
}

impl<'a> IntoIterator for &'a EndpointSet {
    type Item = &'a SocketAddr;
    type IntoIter = std::slice::Iter<'a, SocketAddr>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl std::fmt::Debug for EndpointSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.iter()).finish()
    }
}

impl Serialize for EndpointSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter())
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
        assert_eq!(set.as_slice(), &[sa("10.0.0.1:80"), sa("10.0.0.2:80")]);
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
    fn clones_share_one_copy() {
        let set: EndpointSet = [sa("10.0.0.1:80")].into_iter().collect();
        let other: EndpointSet = [sa("10.0.0.1:80")].into_iter().collect();
        assert!(set.clone().shares(&set));
        assert!(!other.shares(&set));
        assert_eq!(other, set);
    }
}
