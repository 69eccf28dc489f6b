//! A folder of Kubernetes YAML (or JSON) manifests: the embedded default source.
//! Multi-document files and `kind: List` are understood; anything else is skipped.

use std::{
    fs,
    path::{Path, PathBuf},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde::Deserialize as _;
use thiserror::Error;

use crate::model::{ClusterModel, ObjectRef};

/// A manifest that could not be used, with where it came from.
#[derive(Debug, Error)]
pub enum ManifestError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} document {doc}: {message}")]
    Parse {
        path: PathBuf,
        doc: usize,
        message: String,
    },
}

/// Reads every `*.yaml`, `*.yml` and `*.json` file of `dir` (or the one file `dir` names).
/// Objects that fail to parse are reported and left out; the rest are returned.
pub fn load(dir: &Path) -> Result<(ClusterModel, Vec<ManifestError>), ManifestError> {
    let mut files = Vec::new();
    if dir.is_file() {
        files.push(dir.to_path_buf());
    } else {
        let entries = fs::read_dir(dir).map_err(|source| ManifestError::Read {
            path: dir.to_path_buf(),
            source,
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if path.is_file() && matches!(ext, "yaml" | "yml" | "json") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut model = ClusterModel::default();
    let mut errors = Vec::new();
    for path in files {
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(source) => {
                errors.push(ManifestError::Read { path, source });
                continue;
            }
        };
        add_documents(&mut model, &mut errors, &path, &text);
    }
    Ok((model, errors))
}

/// Parses the documents of one file into `model`.
pub fn add_documents(
    model: &mut ClusterModel,
    errors: &mut Vec<ManifestError>,
    path: &Path,
    text: &str,
) {
    for (doc, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let parse_err = |message: String| ManifestError::Parse {
            path: path.to_path_buf(),
            doc,
            message,
        };
        let value = match serde_json::Value::deserialize(de) {
            Ok(serde_json::Value::Null) => continue,
            Ok(v) => v,
            Err(e) => {
                // A YAML syntax error: nothing after it in this file can be trusted (and
                // the document iterator would repeat the error forever).
                errors.push(parse_err(e.to_string()));
                break;
            }
        };
        let items = match value.get("kind").and_then(|k| k.as_str()) {
            Some(k) if k.ends_with("List") => value
                .get("items")
                .and_then(|i| i.as_array())
                .cloned()
                .unwrap_or_default(),
            _ => vec![value],
        };
        for item in items {
            if let Err(message) = add_object(model, item) {
                errors.push(parse_err(message));
            }
        }
    }
}

fn add_object(model: &mut ClusterModel, item: serde_json::Value) -> Result<(), String> {
    let kind = item
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    let name = item
        .pointer("/metadata/name")
        .and_then(|n| n.as_str())
        .unwrap_or("<unnamed>")
        .to_string();
    match kind.as_str() {
        "Service" => {
            let svc: Service =
                serde_json::from_value(item).map_err(|e| format!("Service {name}: {e}"))?;
            model.services.insert(ObjectRef::of(&svc.metadata), svc);
        }
        "EndpointSlice" => {
            let slice: EndpointSlice =
                serde_json::from_value(item).map_err(|e| format!("EndpointSlice {name}: {e}"))?;
            model.slices.insert(ObjectRef::of(&slice.metadata), slice);
        }
        _ => tracing::debug!(
            kind,
            name,
            "ignoring object of a kind the proxy does not use"
        ),
    }
    Ok(())
}

/// Publishes the folder's contents now and whenever a file in it changes (bursts of
/// events are read once). An unreadable folder keeps the last published snapshot.
pub async fn run(
    dir: PathBuf,
    node: crate::model::NodeInfo,
    tx: tokio::sync::watch::Sender<Option<super::SharedSnapshot>>,
) -> anyhow::Result<()> {
    use notify::Watcher as _;
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        // Our own reads raise access events: reacting to them would reload forever.
        if ev.is_ok_and(|e| !matches!(e.kind, notify::EventKind::Access(_))) {
            let _ = events_tx.send(());
        }
    })?;
    watcher.watch(&dir, notify::RecursiveMode::NonRecursive)?;
    let mut changes = super::ChangeCounts::default();
    loop {
        match load(&dir) {
            Ok((model, errors)) => {
                for e in &errors {
                    tracing::warn!(error = %e, "skipping manifest");
                }
                let previous = tx.borrow().clone();
                let empty = ClusterModel::default();
                changes.add_differences(previous.as_ref().map_or(&empty, |p| &p.model), &model);
                let snapshot = super::Snapshot {
                    model,
                    node: node.clone(),
                    changes,
                };
                tx.send_if_modified(|current| {
                    let changed = current
                        .as_ref()
                        .is_none_or(|c| c.model != snapshot.model || c.node != snapshot.node);
                    if changed {
                        *current = Some(std::sync::Arc::new(snapshot));
                    }
                    changed
                });
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot read manifests; keeping the current state")
            }
        }
        if events.recv().await.is_none() {
            return Ok(());
        }
        while events.try_recv().is_ok() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_document_and_list_files() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: x}\nspec: {clusterIP: 10.96.0.1}\n\
---\napiVersion: v1\nkind: List\nitems:\n- apiVersion: discovery.k8s.io/v1\n  kind: EndpointSlice\n  metadata: {name: a-1, namespace: x}\n  addressType: IPv4\n  endpoints: []\n\
---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: ignored}\n---\n";
        let mut model = ClusterModel::default();
        let mut errors = Vec::new();
        add_documents(&mut model, &mut errors, Path::new("t.yaml"), text);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(model.services.len(), 1);
        assert_eq!(model.slices.len(), 1);
    }

    #[test]
    fn a_malformed_document_is_reported_and_the_rest_load() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec: {ports: 7}\n---\n\
apiVersion: v1\nkind: Service\nmetadata: {name: good}\nspec: {clusterIP: 10.96.0.1}\n---\n: : [\n";
        let mut model = ClusterModel::default();
        let mut errors = Vec::new();
        add_documents(&mut model, &mut errors, Path::new("t.yaml"), text);
        assert_eq!(model.services.len(), 1);
        assert!(!errors.is_empty(), "{errors:?}");
        let first = errors[0].to_string();
        assert!(
            first.contains("t.yaml document 0") && first.contains("Service bad"),
            "{first}"
        );
    }
}
