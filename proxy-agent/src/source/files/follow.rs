//! The file source at work: publishes the manifests at a path now and whenever they
//! change, as an operator edits them — by hand, by `kubectl get -o yaml > file` (which
//! truncates first and writes later), by replacing the folder, or by kubelet swapping a
//! ConfigMap volume's `..data` symlink.
//!
//! - A burst of events is read once, after the files have been quiet for `QUIET`.
//! - Each file keeps its last good reading while it is empty or breaks off mid-YAML (a
//!   writer at work): its Services stay programmed until it is whole again or removed.
//! - The path's parent is watched too, and the watch is re-armed when the path becomes
//!   another folder or file; a periodic check catches what no event announced.

use std::{
    collections::BTreeMap,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use notify::Watcher as _;
use tokio::sync::{mpsc, watch};

use crate::model::{ClusterModel, NodeInfo};
use crate::source::{ChangeCounts, SharedSnapshot, Snapshot, files};

/// How long the files must be quiet before a burst of changes is read.
const QUIET: Duration = Duration::from_millis(300);
/// How often the path's identity is checked without an event.
const RECHECK: Duration = Duration::from_secs(2);

/// Watches `path` (a folder or a file) and publishes its objects. Fails at once when the
/// path does not exist; afterwards, errors are logged and the last good state kept.
pub async fn run(
    path: PathBuf,
    node: NodeInfo,
    tx: watch::Sender<Option<SharedSnapshot>>,
) -> Result<()> {
    if !path.exists() {
        bail!("--manifests {}: no such file or folder", path.display());
    }
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let mut watcher = Armed::new(&path, events_tx)?;
    let mut cache = FileCache::default();
    let mut changes = ChangeCounts::default();
    loop {
        match cache.reload(&path) {
            Ok((reading, unreadable)) => publish(&tx, reading, unreadable, &node, &mut changes),
            Err(e) => tracing::error!(
                error = format!("{e:#}"),
                "cannot read manifests; keeping the current state"
            ),
        }
        // Wait for a change, or for the path to have become something else.
        loop {
            tokio::select! {
                ev = events.recv() => {
                    if ev.is_none() {
                        return Ok(());
                    }
                    break;
                }
                _ = tokio::time::sleep(RECHECK) => {
                    if watcher.stale(&path) {
                        break;
                    }
                }
            }
        }
        // Debounce: read once the burst is over.
        while tokio::time::timeout(QUIET, events.recv())
            .await
            .is_ok_and(|e| e.is_some())
        {}
        if watcher.stale(&path) {
            tracing::info!(path = %path.display(), "manifest path replaced; watching the new one");
            if let Err(e) = watcher.rearm(&path) {
                tracing::error!(error = format!("{e:#}"), "cannot watch the manifests");
            }
        }
    }
}

fn publish(
    tx: &watch::Sender<Option<SharedSnapshot>>,
    reading: Reading,
    unreadable: u64,
    node: &NodeInfo,
    changes: &mut ChangeCounts,
) {
    // The fresh reading folded into the last published model: what did not change stays
    // shared, so the runner's diff is of the changes alone.
    let mut next = tx
        .borrow()
        .as_ref()
        .map(|p| p.model.clone())
        .unwrap_or_default();
    let before = next.clone();
    next.replace_with(&reading.model);
    let diff = before.changes_to(&next);
    changes.add(&diff);
    let model_changed = diff.service_objects + diff.slices > 0;
    let snapshot = Snapshot {
        model: next,
        node: node.clone(),
        changes: *changes,
        unreadable,
        // No API server has seen these files: the view checks what it would.
        api_validated: false,
        nodes: reading.nodes,
        partial: false,
    };
    tx.send_if_modified(|current| {
        let changed = current.as_ref().is_none_or(|c| {
            model_changed
                || c.node != snapshot.node
                || c.nodes != snapshot.nodes
                || c.unreadable != unreadable
        });
        if changed {
            *current = Some(Arc::new(snapshot));
        }
        changed
    });
}

/// The watcher and the identity (device, inode) of what it watches.
struct Armed {
    watcher: notify::RecommendedWatcher,
    identity: Option<(u64, u64)>,
}

fn identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl Armed {
    fn new(path: &Path, events: mpsc::UnboundedSender<()>) -> Result<Self> {
        let watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
            // Our own reads raise access events: reacting to them would reload forever.
            if ev.is_ok_and(|e| !matches!(e.kind, notify::EventKind::Access(_))) {
                let _ = events.send(());
            }
        })?;
        let mut armed = Self {
            watcher,
            identity: None,
        };
        armed.rearm(path)?;
        Ok(armed)
    }

    /// Watches the path (a folder's entries, or a file) and its parent (a replaced
    /// folder or file shows up there).
    fn rearm(&mut self, path: &Path) -> Result<()> {
        for p in [path.to_path_buf(), parent(path)] {
            let _ = self.watcher.unwatch(&p);
            self.watcher
                .watch(&p, notify::RecursiveMode::NonRecursive)
                .with_context(|| format!("watching {}", p.display()))?;
        }
        self.identity = identity(path);
        Ok(())
    }

    /// The path is no longer what is watched (replaced, or gone and back).
    fn stale(&self, path: &Path) -> bool {
        identity(path) != self.identity
    }
}

fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// What the files hold: the cluster model and every Node, by name.
#[derive(Clone, Debug, Default)]
struct Reading {
    model: ClusterModel,
    nodes: files::Nodes,
}

/// The last good reading of each file. A reading replaces it when whole and not empty
/// (an empty file is a truncated one about to be written; removing a file is how its
/// objects are removed).
#[derive(Default)]
struct FileCache {
    files: BTreeMap<PathBuf, Reading>,
}

impl FileCache {
    /// Reads every file again; a file that is empty or breaks off keeps its last good
    /// reading (a writer at work), a removed file's objects go.
    fn reload(&mut self, path: &Path) -> Result<(Reading, u64)> {
        let paths = files::manifest_files(path)?;
        let mut fresh = BTreeMap::new();
        let mut unreadable = 0;
        for file in paths {
            let parsed = files::parse_file(&file);
            unreadable += parsed.errors.len() as u64;
            let kept = self.files.remove(&file);
            let reading = match (parsed.complete && !parsed.empty, kept) {
                (true, _) | (false, None) => {
                    for e in &parsed.errors {
                        tracing::warn!(error = %e, "skipping manifest");
                    }
                    Reading {
                        model: parsed.model,
                        nodes: parsed.nodes,
                    }
                }
                (false, Some(kept)) => {
                    let why = parsed
                        .errors
                        .first()
                        .map_or_else(|| "empty".to_string(), ToString::to_string);
                    tracing::warn!(
                        file = %file.display(),
                        reason = why,
                        services = kept.model.service_count(),
                        "manifest file incomplete (being written?); keeping its last good reading"
                    );
                    kept
                }
            };
            fresh.insert(file, reading);
        }
        self.files = fresh;
        let mut all = Reading::default();
        for r in self.files.values() {
            all.model.extend(&r.model);
            // A Node in two files: the later file's (files are read in name order).
            all.nodes.extend(r.nodes.clone());
        }
        Ok((all, unreadable))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n\
             spec: {{clusterIP: 10.96.0.10, ports: [{{port: 80}}]}}\n---\n"
        )
    }

    #[test]
    fn empty_and_broken_files_keep_their_last_good_reading() {
        let dir = std::env::temp_dir().join(format!("file-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let file = dir.join("many.yaml");
        std::fs::write(
            &file,
            (0..3)
                .map(|i| service(&format!("s{i}")))
                .collect::<String>(),
        )
        .expect("write");
        let mut cache = FileCache::default();
        assert_eq!(
            cache.reload(&dir).expect("reload").0.model.service_count(),
            3
        );
        // Truncated (`> file` before the writer writes): kept.
        std::fs::write(&file, "").expect("truncate");
        assert_eq!(
            cache.reload(&dir).expect("reload").0.model.service_count(),
            3
        );
        // Half written, breaking off mid-YAML: kept.
        std::fs::write(
            &file,
            format!(
                "{}apiVersion: v1\nkind: Service\nmetadata: {{name: [",
                service("s0")
            ),
        )
        .expect("write");
        assert_eq!(
            cache.reload(&dir).expect("reload").0.model.service_count(),
            3
        );
        // Whole again, with fewer objects: that is the new content.
        std::fs::write(&file, service("s0")).expect("write");
        assert_eq!(
            cache.reload(&dir).expect("reload").0.model.service_count(),
            1
        );
        // Removed: its objects go.
        std::fs::remove_file(&file).expect("rm");
        assert!(cache.reload(&dir).expect("reload").0.model.service_count() == 0);
        // A new broken file with no earlier reading loads what it can.
        std::fs::write(&file, format!("{}: : [\n", service("s9"))).expect("write");
        assert_eq!(
            cache.reload(&dir).expect("reload").0.model.service_count(),
            1
        );
        std::fs::remove_dir_all(&dir).expect("rm");
    }

    #[test]
    fn too_big_or_too_deep_files_are_refused_with_a_reason() {
        let dir = std::env::temp_dir().join(format!("file-shape-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let deep = dir.join("deep.yaml");
        std::fs::write(
            &deep,
            format!("a: {}{}\n", "[".repeat(10_000), "]".repeat(10_000)),
        )
        .expect("write");
        let started = std::time::Instant::now();
        let parsed = files::parse_file(&deep);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "took {:?}",
            started.elapsed()
        );
        assert!(!parsed.complete);
        assert!(
            parsed.errors[0].to_string().contains("levels deep"),
            "{:?}",
            parsed.errors
        );
        let big = dir.join("big.yaml");
        let f = std::fs::File::create(&big).expect("create");
        f.set_len(files::MAX_FILE_BYTES + 1).expect("sparse file");
        let parsed = files::parse_file(&big);
        assert!(
            parsed.errors[0].to_string().contains("larger than"),
            "{:?}",
            parsed.errors
        );
        std::fs::remove_dir_all(&dir).expect("rm");
    }
}
