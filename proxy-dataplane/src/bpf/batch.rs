//! Whole-map reads and bulk writes with the kernel's batch commands
//! (`BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_UPDATE_BATCH`, Linux 5.6+): thousands of entries per
//! syscall instead of one (a lookup) or two (an iteration step) per entry, which made
//! adopting or re-reading 100k Services' million slots take seconds. aya has no batch
//! calls, so this speaks the `bpf(2)` ABI itself; a kernel or map type without them
//! falls back to aya's per-entry calls.

use std::{
    io,
    mem::{size_of, zeroed},
    os::fd::{AsFd as _, AsRawFd as _},
};

use aya::{
    Pod,
    maps::{Array, HashMap, IterableMap as _, MapData},
};

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// Entries per batch call (read or written): large enough that a million entries take a few
/// hundred calls, small enough for a short-lived buffer.
const BATCH: u32 = 8192;

/// `union bpf_attr`'s `batch` member (linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix of the size passed; the kernel reads
    // and writes only the buffers it names, which the callers size for `count` entries.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            size_of::<BatchAttr>() as libc::c_uint,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The kernel has no batch command for this map (or at all): use the per-entry calls.
pub fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        // ENOTSUPP (524) is the kernel's own, not in libc.
        Some(libc::EINVAL | 524 | libc::EOPNOTSUPP)
    )
}

fn raw_fd(map: &MapData) -> u32 {
    map.fd().as_fd().as_raw_fd() as u32
}

/// Every entry of a (non-per-CPU) hash map.
pub fn read_all<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> io::Result<Vec<(K, V)>> {
    match read_batched(map.map()) {
        Err(e) if unsupported(&e) => map
            .iter()
            .map(|r| r.map_err(|e| io::Error::other(e.to_string())))
            .collect(),
        r => r,
    }
}

/// Every slot of an array map, by index.
pub fn read_array<V: Pod>(map: &Array<MapData, V>) -> io::Result<Vec<(u32, V)>> {
    match read_batched(map.map()) {
        Err(e) if unsupported(&e) => map
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.map(|v| (i as u32, v))
                    .map_err(|e| io::Error::other(e.to_string()))
            })
            .collect(),
        r => r,
    }
}

fn read_batched<K: Pod, V: Pod>(map: &MapData) -> io::Result<Vec<(K, V)>> {
    let mut walk = Walk::default();
    let mut out = Vec::new();
    while !walk.done {
        out.extend(walk.next::<K, V>(map, BATCH)?);
    }
    Ok(out)
}

/// A walk over a map in batches that resumes where it stopped, so a long read can be
/// spread over time (the audit reads a little between applies). Entries written or
/// removed meanwhile may be seen or missed, as with any walk of a live hash map.
#[derive(Debug, Default)]
pub struct Walk {
    /// The kernel's position after the last batch (a hash map's bucket number).
    token: Vec<u8>,
    started: bool,
    pub done: bool,
}

impl Walk {
    /// Up to `max` (at least one bucket's worth of) further entries; `done` once none
    /// are left.
    pub fn next<K: Pod, V: Pod>(&mut self, map: &MapData, max: u32) -> io::Result<Vec<(K, V)>> {
        let size = size_of::<K>().max(8);
        if self.token.len() != size {
            self.token = vec![0u8; size];
        }
        let mut next = vec![0u8; size];
        let mut chunk = max.max(1) as usize;
        loop {
            if self.done {
                return Ok(Vec::new());
            }
            // SAFETY: `Pod` types are plain bytes for which all-zero is a valid value.
            let mut keys: Vec<K> = vec![unsafe { zeroed() }; chunk];
            let mut values: Vec<V> = vec![unsafe { zeroed() }; chunk];
            let mut attr = BatchAttr {
                in_batch: if self.started {
                    self.token.as_ptr() as u64
                } else {
                    0
                },
                out_batch: next.as_mut_ptr() as u64,
                keys: keys.as_mut_ptr() as u64,
                values: values.as_mut_ptr() as u64,
                count: chunk as u32,
                map_fd: raw_fd(map),
                ..Default::default()
            };
            let r = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
            let n = attr.count as usize;
            match r.as_ref().map_err(io::Error::raw_os_error) {
                Ok(()) => {}
                // The walk is over; this call's entries are the last.
                Err(Some(libc::ENOENT)) => self.done = true,
                // One bucket holds more entries than the buffer: a larger one, same place.
                Err(Some(libc::ENOSPC)) if n == 0 => {
                    chunk *= 2;
                    continue;
                }
                Err(_) => return r.map(|()| Vec::new()),
            }
            std::mem::swap(&mut self.token, &mut next);
            self.started = true;
            return Ok(keys.into_iter().zip(values).take(n).collect());
        }
    }
}

/// Writes `entries` (`BPF_ANY`); returns how many the kernel took before an error, with
/// the error. Per entry where batches are unsupported.
pub fn write_all<K: Pod, V: Pod>(
    map: &mut HashMap<MapData, K, V>,
    entries: &[(K, V)],
) -> Result<(), (usize, io::Error)> {
    let mut done = 0;
    while done < entries.len() {
        let part = &entries[done..(done + BATCH as usize).min(entries.len())];
        let keys: Vec<K> = part.iter().map(|(k, _)| *k).collect();
        let values: Vec<V> = part.iter().map(|(_, v)| *v).collect();
        let mut attr = BatchAttr {
            keys: keys.as_ptr() as u64,
            values: values.as_ptr() as u64,
            count: part.len() as u32,
            map_fd: raw_fd(map.map()),
            ..Default::default()
        };
        match bpf(BPF_MAP_UPDATE_BATCH, &mut attr) {
            Ok(()) => done += part.len(),
            Err(e) if unsupported(&e) && attr.count == 0 => {
                for (k, v) in part {
                    map.insert(k, v, 0)
                        .map_err(|e| (done, io::Error::other(e.to_string())))?;
                    done += 1;
                }
            }
            Err(e) => return Err((done + attr.count as usize, e)),
        }
    }
    Ok(())
}

/// Writes held back to be made in batches (the first programming of an empty node:
/// 100k Services are millions of entries, one syscall each otherwise). Flushed in the
/// writer's order: backends, slots, Maglev chunks, weights, members, reverse NAT, and
/// the service entries last, so no entry is visible before what it points to.
#[derive(Debug, Default)]
pub struct Staged {
    pub backends: Vec<(u32, proxy_common::Backend)>,
    pub slots: Vec<(proxy_common::BackendSlotKey, proxy_common::BackendSlot)>,
    pub maglev: Vec<(proxy_common::BackendSlotKey, proxy_common::MaglevChunk)>,
    pub weights: Vec<(proxy_common::MemberKey, u32)>,
    pub members: Vec<(proxy_common::MemberKey, u64)>,
    pub rev_nat: Vec<(u32, proxy_common::RevNatValue)>,
    pub services: Vec<(proxy_common::ServiceKey, proxy_common::ServiceValue)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test_support::needs_root]
    #[test]
    fn writes_and_reads_back_more_entries_than_one_call_carries() {
        let mut m = HashMap::<MapData, u32, u64>::create(40_000, 0).expect("a private map");
        let entries: Vec<(u32, u64)> = (0..30_000u32).map(|k| (k, u64::from(k) * 3)).collect();
        write_all(&mut m, &entries).expect("write");
        // The batch command itself (not the per-entry fallback) on this kernel.
        let mut read: Vec<(u32, u64)> = read_batched(m.map()).expect("read");
        read.sort_unstable();
        assert_eq!(read, entries);
        // Agrees with aya's own walk.
        assert_eq!(m.keys().count(), 30_000);
    }

    #[test_support::needs_root]
    #[test]
    fn a_full_map_reports_how_many_entries_it_took() {
        let mut m = HashMap::<MapData, u32, u64>::create(100, 0).expect("a private map");
        let entries: Vec<(u32, u64)> = (0..150u32).map(|k| (k, 1)).collect();
        let (taken, e) = write_all(&mut m, &entries).expect_err("the map holds 100");
        assert_eq!(taken, 100, "{e}");
        assert_eq!(e.raw_os_error(), Some(libc::E2BIG), "{e}");
        assert_eq!(read_all(&m).expect("read").len(), 100);
    }
}
