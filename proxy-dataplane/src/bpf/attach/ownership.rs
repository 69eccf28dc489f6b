//! Whose classifiers sit on the hooks we serve. A program is ours when it uses one of our
//! pin folder's maps (this agent loaded it, or the agent before it on the same pins); one
//! named as ours (`tc_ingress`, `tc_egress`) that is not belongs to an agent of another
//! pin folder, found by its maps on the same bpffs: stale when no agent holds that
//! folder's lock, live when one does. What is found, and what was repaired, goes into
//! [`NodeHooks`], which the runner's status reads (`/healthz`, `/metrics`).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use aya::programs::loaded_programs;
use proxy_common::map_names;

use crate::bpf::{
    pin_lock,
    programs::{TC_EGRESS_PROGRAM, TC_PROGRAM},
};

/// The names our classifier programs carry (the kernel keeps 15 bytes: both fit).
pub const CLASSIFIER_NAMES: [&str; 2] = [TC_PROGRAM, TC_EGRESS_PROGRAM];

/// How deep below the bpffs mount pin folders are looked for (`/sys/fs/bpf/<folder>` is 1).
const SEARCH_DEPTH: usize = 3;

/// Whose a classifier is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// It uses our pinned maps.
    Ours,
    /// It uses the maps of another pin folder, and no agent holds that folder: left
    /// behind by an agent that is gone.
    Stale(PathBuf),
    /// It uses the maps of another pin folder whose agent runs.
    Live(PathBuf),
    /// No pin folder on our bpffs holds its maps (another bpffs, or unpinned).
    Unknown,
    /// Its program cannot be read (that takes CAP_SYS_ADMIN): treated as ours, as before
    /// there was a check.
    Unseen,
}

/// Tells our classifiers from other agents'.
pub struct Ownership {
    pin_dir: PathBuf,
    /// Ids of the maps pinned in our folder.
    maps: BTreeSet<u32>,
    /// The bpffs mount our folder is on, where other folders are looked for.
    root: Option<PathBuf>,
    /// The folder found for each foreign program (its maps do not change).
    folders: BTreeMap<u32, PathBuf>,
    /// Whether an unreadable program was logged (once: the cause is the agent's).
    said_unseen: bool,
}

impl Ownership {
    /// Reads the ids of the maps pinned under `pin_dir/maps` (call it once they are).
    pub fn new(pin_dir: &Path) -> Self {
        Self {
            pin_dir: pin_dir.to_path_buf(),
            maps: pinned_map_ids(&pin_dir.join("maps")),
            root: bpffs_mount(pin_dir),
            folders: BTreeMap::new(),
            said_unseen: false,
        }
    }

    /// Whose the program `id`, using the maps `maps`, is.
    pub fn owner(&mut self, id: u32, maps: &[u32]) -> Owner {
        if maps.iter().any(|m| self.maps.contains(m)) {
            return Owner::Ours;
        }
        let folder = match self.folders.get(&id) {
            Some(folder) => folder.clone(),
            None => match self.find_folder(maps) {
                Some(folder) => folder,
                None => return Owner::Unknown,
            },
        };
        match pin_lock::try_lock(&folder) {
            Ok(Some(_free)) => {
                self.folders.insert(id, folder.clone());
                Owner::Stale(folder)
            }
            Ok(None) => {
                self.folders.insert(id, folder.clone());
                Owner::Live(folder)
            }
            // The folder went (cleaned up) since it was found.
            Err(_) => {
                self.folders.remove(&id);
                Owner::Unknown
            }
        }
    }

    /// [`Self::owner`] of a program known by its id alone (a clsact filter's).
    pub fn owner_of_program(&mut self, id: u32) -> Owner {
        let mut unreadable = None;
        let found = loaded_programs().find_map(|p| match p {
            Ok(p) if p.id() == id => Some(p.map_ids()),
            Ok(_) => None,
            Err(e) => {
                unreadable.get_or_insert(e);
                None
            }
        });
        match (found, unreadable) {
            (Some(Ok(Some(maps))), _) => self.owner(id, &maps),
            (Some(Err(e)), _) | (None, Some(e)) => {
                if !self.said_unseen {
                    self.said_unseen = true;
                    tracing::warn!(
                        program_id = id,
                        error = %e,
                        "programs unreadable (CAP_SYS_ADMIN): other agents' classifiers cannot be told from ours"
                    );
                }
                Owner::Unseen
            }
            _ => Owner::Unknown,
        }
    }

    /// The pin folder (below our bpffs mount, not ours) whose pinned maps include one of
    /// `maps`.
    fn find_folder(&self, maps: &[u32]) -> Option<PathBuf> {
        let mut dirs = vec![(self.root.clone()?, 0)];
        while let Some((dir, depth)) = dirs.pop() {
            if dir != self.pin_dir
                && dir.join("maps").is_dir()
                && pinned_map_ids(&dir.join("maps"))
                    .iter()
                    .any(|m| maps.contains(m))
            {
                return Some(dir);
            }
            if depth == SEARCH_DEPTH {
                continue;
            }
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                if entry.file_type().is_ok_and(|t| t.is_dir()) && name != "maps" && name != "links"
                {
                    dirs.push((entry.path(), depth + 1));
                }
            }
        }
        None
    }
}

/// Ids of the maps of ours pinned in `maps_dir`.
fn pinned_map_ids(maps_dir: &Path) -> BTreeSet<u32> {
    map_names::ALL
        .iter()
        .filter_map(|name| {
            let data = aya::maps::MapData::from_pin(maps_dir.join(name)).ok()?;
            Some(data.info().ok()?.id())
        })
        .collect()
}

/// The mount point of the bpffs holding `dir` (the longest one above it).
fn bpffs_mount(dir: &Path) -> Option<PathBuf> {
    let dir = fs::canonicalize(dir).ok()?;
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            post.starts_with("bpf ")
                .then(|| pre.split(' ').nth(4).map(PathBuf::from))?
        })
        .filter(|mount| dir.starts_with(mount))
        .max_by_key(|mount| mount.as_os_str().len())
}

/// A classifier named as ours, on a hook of an interface we serve, that is not ours and
/// was left in place.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ForeignClassifier {
    pub interface: String,
    /// `ingress` or `egress`.
    pub hook: &'static str,
    /// `tcx` or `clsact`.
    pub attach: &'static str,
    pub program: String,
    pub program_id: u32,
    /// The pin folder of its agent, when one on our bpffs holds its maps.
    pub pin_dir: Option<PathBuf>,
    /// Whether an agent holds that folder.
    pub agent_running: bool,
    /// Whether it runs before ours on that hook (its answers win for what it knows).
    pub shadows_ours: bool,
}

impl ForeignClassifier {
    /// Which one it is (what a later check compares).
    pub fn key(&self) -> (&str, &str, &str, u32) {
        (&self.interface, self.hook, self.attach, self.program_id)
    }
}

/// What the checks of the node's hooks found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HooksReport {
    /// Foreign classifiers on the interfaces we serve now (`/healthz` fails while there
    /// is one).
    pub foreign: Vec<ForeignClassifier>,
    /// Stale classifiers of other pin folders (no agent running) detached or adopted.
    pub stale_removed: u64,
    /// Hooks of ours found missing or detached and attached again.
    pub repaired: u64,
}

/// The shared report: the dataplane writes it, the runner's status reads it (clones share
/// it).
#[derive(Clone, Debug, Default)]
pub struct NodeHooks(Arc<Mutex<HooksReport>>);

impl NodeHooks {
    fn with<R>(&self, f: impl FnOnce(&mut HooksReport) -> R) -> R {
        // Plain data: a panic elsewhere while holding it leaves nothing half-made.
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn report(&self) -> HooksReport {
        self.with(|r| r.clone())
    }

    pub fn set_foreign(&self, foreign: Vec<ForeignClassifier>) {
        self.with(|r| r.foreign = foreign);
    }

    pub fn count_stale_removed(&self) {
        self.with(|r| r.stale_removed += 1);
    }

    pub fn count_repaired(&self) {
        self.with(|r| r.repaired += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ownership(maps: &[u32], root: Option<PathBuf>) -> Ownership {
        Ownership {
            pin_dir: PathBuf::from("/nonexistent/ours"),
            maps: maps.iter().copied().collect(),
            root,
            folders: BTreeMap::new(),
            said_unseen: false,
        }
    }

    #[test]
    fn a_program_using_one_of_our_maps_is_ours_and_one_of_no_folder_unknown() {
        let mut o = ownership(&[10, 11], None);
        assert_eq!(o.owner(7, &[3, 11]), Owner::Ours);
        assert_eq!(o.owner(8, &[3, 4]), Owner::Unknown);
        assert_eq!(o.owner(9, &[]), Owner::Unknown);
    }

    #[test]
    fn a_folder_without_our_maps_owns_nothing() {
        // A plain folder tree (not a bpffs): its `maps/` holds no pinned maps.
        let root = std::env::temp_dir().join(format!("audit-{}", std::process::id()));
        fs::create_dir_all(root.join("other/maps")).expect("mkdir");
        let mut o = ownership(&[10], Some(root.clone()));
        assert_eq!(o.owner(8, &[3]), Owner::Unknown);
        fs::remove_dir_all(&root).expect("rm");
    }

    #[test]
    fn the_bpffs_mount_of_a_folder_elsewhere_is_none() {
        assert_eq!(bpffs_mount(Path::new("/nonexistent/pins")), None);
    }
}
