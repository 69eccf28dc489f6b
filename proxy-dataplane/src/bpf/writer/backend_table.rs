//! The mirror's backends: each id's backend and how many live slots point at it, found
//! by id or by value. The entries sit in one dense array, in pages, and two tables of
//! 4-byte positions find them by id and by value. A hash map of entries keyed by id
//! held each entry in a bucket of its own, at a power-of-two number of buckets: at
//! 100k Services × 10 endpoints 66 MiB for a million backends, where the array takes
//! 32 MiB and each table 10.

use std::hash::BuildHasher as _;

use hashbrown::HashTable;
use proxy_common::Backend;
use rustc_hash::FxBuildHasher;

#[derive(Clone, Copy, Debug)]
struct Entry {
    id: u32,
    /// Live slots pointing at it.
    refs: u32,
    backend: Backend,
}

/// Entries per page: a page is allocated whole (2 MiB), so the array never holds room
/// for twice its entries as a doubling vector would after its last growth.
const PAGE: usize = 1 << 16;

/// The entries, dense: a removed entry's place takes the last one.
#[derive(Debug, Default)]
struct Entries {
    pages: Vec<Vec<Entry>>,
    len: usize,
}

impl Entries {
    fn get(&self, pos: u32) -> &Entry {
        let pos = pos as usize;
        &self.pages[pos / PAGE][pos % PAGE]
    }

    fn get_mut(&mut self, pos: u32) -> &mut Entry {
        let pos = pos as usize;
        &mut self.pages[pos / PAGE][pos % PAGE]
    }

    /// Appends `e`; its position.
    fn push(&mut self, e: Entry) -> u32 {
        // Every page full (removals free a page when it empties): a new one.
        if self.pages.len() == self.len / PAGE {
            self.pages.push(Vec::with_capacity(PAGE));
        }
        let pos = self.len;
        self.pages[pos / PAGE].push(e);
        self.len += 1;
        pos as u32
    }

    /// Removes the entry at `pos`: the last entry moves there. The moved entry, if any.
    fn swap_remove(&mut self, pos: u32) -> Option<(Entry, Option<Entry>)> {
        let last = self.len.checked_sub(1)?;
        let page = self.pages.get_mut(last / PAGE)?;
        let last_entry = page.pop()?;
        if page.is_empty() {
            self.pages.pop();
        }
        self.len = last;
        if pos as usize == last {
            return Some((last_entry, None));
        }
        let removed = std::mem::replace(self.get_mut(pos), last_entry);
        Some((removed, Some(last_entry)))
    }
}

#[derive(Debug, Default)]
pub struct BackendTable {
    entries: Entries,
    /// Positions in `entries`, hashed by their entry's id.
    by_id: HashTable<u32>,
    /// Positions in `entries`, hashed by their entry's backend.
    by_value: HashTable<u32>,
}

fn hash_backend(be: &Backend) -> u64 {
    FxBuildHasher.hash_one(be)
}

fn hash_id(id: u32) -> u64 {
    FxBuildHasher.hash_one(id)
}

impl BackendTable {
    pub fn len(&self) -> usize {
        self.entries.len
    }

    fn position(&self, id: u32) -> Option<u32> {
        let entries = &self.entries;
        self.by_id
            .find(hash_id(id), |p| entries.get(*p).id == id)
            .copied()
    }

    fn entry_mut(&mut self, id: u32) -> Option<&mut Entry> {
        let pos = self.position(id)?;
        Some(self.entries.get_mut(pos))
    }

    pub fn get(&self, id: u32) -> Option<&Backend> {
        self.position(id).map(|p| &self.entries.get(p).backend)
    }

    pub fn contains(&self, id: u32) -> bool {
        self.position(id).is_some()
    }

    /// The id of the backend equal to `be`.
    pub fn id_of(&self, be: &Backend) -> Option<u32> {
        let entries = &self.entries;
        self.by_value
            .find(hash_backend(be), |p| entries.get(*p).backend == *be)
            .map(|p| entries.get(*p).id)
    }

    /// Adds backend `be` as `id`, with no slot pointing at it; an id already held is
    /// replaced.
    pub fn insert(&mut self, id: u32, be: Backend) {
        self.remove(id);
        let pos = self.entries.push(Entry {
            id,
            refs: 0,
            backend: be,
        });
        let entries = &self.entries;
        self.by_id
            .insert_unique(hash_id(id), pos, |p| hash_id(entries.get(*p).id));
        self.by_value.insert_unique(hash_backend(&be), pos, |p| {
            hash_backend(&entries.get(*p).backend)
        });
    }

    pub fn remove(&mut self, id: u32) -> Option<Backend> {
        let pos = self.position(id)?;
        let be = self.entries.get(pos).backend;
        // Both tables forget `pos` first; then the last entry moves into it, and its
        // own positions are rewritten.
        if let Ok(found) = self.by_id.find_entry(hash_id(id), |p| *p == pos) {
            found.remove();
        }
        if let Ok(found) = self.by_value.find_entry(hash_backend(&be), |p| *p == pos) {
            found.remove();
        }
        let last = (self.entries.len - 1) as u32;
        let (removed, moved) = self.entries.swap_remove(pos)?;
        if let Some(moved) = moved {
            if let Some(p) = self.by_id.find_mut(hash_id(moved.id), |p| *p == last) {
                *p = pos;
            }
            if let Some(p) = self
                .by_value
                .find_mut(hash_backend(&moved.backend), |p| *p == last)
            {
                *p = pos;
            }
        }
        Some(removed.backend)
    }

    /// Live slots pointing at `id`.
    pub fn refs(&self, id: u32) -> u32 {
        self.position(id).map_or(0, |p| self.entries.get(p).refs)
    }

    /// One more slot points at `id` (a known backend).
    pub fn hold(&mut self, id: u32) {
        if let Some(e) = self.entry_mut(id) {
            e.refs += 1;
        }
    }

    /// One slot fewer points at `id`; `true` when none does any more.
    pub fn release(&mut self, id: u32) -> bool {
        match self.entry_mut(id) {
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

    /// Random inserts, replacements, removals and references against a plain map: the
    /// moves that keep the entries dense never lose or misplace one.
    #[test]
    fn matches_a_plain_map_through_random_changes() {
        use std::collections::HashMap;
        let mut t = BackendTable::default();
        let mut plain: HashMap<u32, (Backend, u32)> = HashMap::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |n: u32| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % u64::from(n)) as u32
        };
        // Enough entries to span pages.
        for step in 0..400_000 {
            let id = next(150_000) + 1;
            match next(10) {
                0..=4 => {
                    let b = be(next(1_000_000), 80 + (step % 3) as u16);
                    // Values stay unique, as the writer keeps them (one id per backend).
                    if t.id_of(&b).is_none() {
                        t.insert(id, b);
                        plain.insert(id, (b, 0));
                    }
                }
                5..=6 => assert_eq!(t.remove(id), plain.remove(&id).map(|(b, _)| b)),
                7..=8 => {
                    t.hold(id);
                    if let Some((_, refs)) = plain.get_mut(&id) {
                        *refs += 1;
                    }
                }
                _ => {
                    let gone = t.release(id);
                    let expected = plain.get_mut(&id).is_some_and(|(_, refs)| {
                        *refs = refs.saturating_sub(1);
                        *refs == 0
                    });
                    assert_eq!(gone, expected);
                }
            }
        }
        assert_eq!(t.len(), plain.len());
        assert!(t.len() > PAGE, "spans pages: {}", t.len());
        for (id, (b, refs)) in &plain {
            assert_eq!(t.get(*id), Some(b));
            assert_eq!(t.id_of(b), Some(*id));
            assert_eq!(t.refs(*id), *refs);
        }
        for id in plain.keys().copied().collect::<Vec<_>>() {
            assert!(t.remove(id).is_some());
        }
        assert_eq!(t.len(), 0);
        assert!(t.entries.pages.is_empty(), "empty pages are freed");
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
