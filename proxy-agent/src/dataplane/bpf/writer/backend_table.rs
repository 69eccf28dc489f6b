//! The mirror's backends: each id's backend and how many live slots point at it, found
//! by id or by value. One entry per backend, and an index of ids by value that stores
//! only the id — where two maps keyed each way and a third of reference counts held every
//! backend three times (at 100k Services × 10 endpoints, 140 MiB of hash tables).

use std::hash::BuildHasher as _;

use hashbrown::HashTable;
use proxy_common::Backend;
use rustc_hash::{FxBuildHasher, FxHashMap};

#[derive(Clone, Copy, Debug)]
struct Entry {
    backend: Backend,
    /// Live slots pointing at it.
    refs: u32,
}

#[derive(Debug, Default)]
pub struct BackendTable {
    by_id: FxHashMap<u32, Entry>,
    /// Ids, hashed by their backend's value.
    by_value: HashTable<u32>,
}

fn hash(be: &Backend) -> u64 {
    FxBuildHasher.hash_one(be)
}

impl BackendTable {
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn get(&self, id: u32) -> Option<&Backend> {
        self.by_id.get(&id).map(|e| &e.backend)
    }

    pub fn contains(&self, id: u32) -> bool {
        self.by_id.contains_key(&id)
    }

    /// The id of the backend equal to `be`.
    pub fn id_of(&self, be: &Backend) -> Option<u32> {
        let by_id = &self.by_id;
        self.by_value
            .find(hash(be), |id| {
                by_id.get(id).is_some_and(|e| e.backend == *be)
            })
            .copied()
    }

    /// Adds backend `be` as `id`, with no slot pointing at it; an id already held is
    /// replaced.
    pub fn insert(&mut self, id: u32, be: Backend) {
        self.remove(id);
        self.by_id.insert(
            id,
            Entry {
                backend: be,
                refs: 0,
            },
        );
        let by_id = &self.by_id;
        self.by_value.insert_unique(hash(&be), id, |id| {
            by_id.get(id).map_or(0, |e| hash(&e.backend))
        });
    }

    pub fn remove(&mut self, id: u32) -> Option<Backend> {
        let entry = self.by_id.get(&id)?;
        let h = hash(&entry.backend);
        if let Ok(found) = self.by_value.find_entry(h, |other| *other == id) {
            found.remove();
        }
        self.by_id.remove(&id).map(|e| e.backend)
    }

    /// Live slots pointing at `id`.
    pub fn refs(&self, id: u32) -> u32 {
        self.by_id.get(&id).map_or(0, |e| e.refs)
    }

    /// One more slot points at `id` (a known backend).
    pub fn hold(&mut self, id: u32) {
        if let Some(e) = self.by_id.get_mut(&id) {
            e.refs += 1;
        }
    }

    /// One slot fewer points at `id`; `true` when none does any more.
    pub fn release(&mut self, id: u32) -> bool {
        match self.by_id.get_mut(&id) {
            Some(e) => {
                e.refs = e.refs.saturating_sub(1);
                e.refs == 0
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn be(last: u32, port: u16) -> Backend {
        Backend {
            addr: [last, 0, 0, 0],
            port,
            proto: 6,
            family: 2,
            state: 0,
            _pad: [0; 3],
        }
    }

    #[test]
    fn found_by_id_and_by_value_until_removed() {
        let mut t = BackendTable::default();
        for i in 1..=1000 {
            t.insert(i, be(i, 80));
        }
        assert_eq!(t.len(), 1000);
        assert_eq!(t.id_of(&be(7, 80)), Some(7));
        assert_eq!(t.id_of(&be(7, 81)), None);
        assert_eq!(t.get(7), Some(&be(7, 80)));
        assert_eq!(t.remove(7), Some(be(7, 80)));
        assert_eq!(t.id_of(&be(7, 80)), None);
        assert!(!t.contains(7));
        assert_eq!(t.id_of(&be(8, 80)), Some(8));
        // An id given another backend is found by the new value only.
        t.insert(8, be(9999, 80));
        assert_eq!(t.id_of(&be(8, 80)), None);
        assert_eq!(t.id_of(&be(9999, 80)), Some(8));
        assert_eq!(t.len(), 999);
    }

    #[test]
    fn references_count_down_to_zero() {
        let mut t = BackendTable::default();
        t.insert(3, be(3, 80));
        t.hold(3);
        t.hold(3);
        assert_eq!(t.refs(3), 2);
        assert!(!t.release(3));
        assert!(t.release(3));
        assert!(t.release(3), "stays at zero");
        assert_eq!(t.refs(3), 0);
        assert!(!t.release(4), "an unknown id");
        t.hold(4);
        assert_eq!(t.refs(4), 0, "an unknown id is not counted");
    }
}
