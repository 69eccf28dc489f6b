//! A folder of Kubernetes YAML (or JSON) manifests: the embedded default source.
//! Services, EndpointSlices and Nodes are read; multi-document files and `kind: List` are
//! understood; anything else is skipped.

pub mod follow;

use std::{
    fs,
    path::{Path, PathBuf},
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde::Deserialize as _;
use thiserror::Error;

use crate::model::{ClusterModel, NodeInfo};

/// Every Node the manifests hold, by name (`Snapshot::nodes`).
pub type Nodes = imbl::OrdMap<String, NodeInfo>;

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
/// Objects that fail to parse are reported and left out; the rest are returned (Nodes
/// are not: a one-off view needs none).
pub fn load(dir: &Path) -> Result<(ClusterModel, Vec<ManifestError>), ManifestError> {
    let mut model = ClusterModel::default();
    let mut errors = Vec::new();
    for path in manifest_files(dir)? {
        let parsed = parse_file(&path);
        errors.extend(parsed.errors);
        model.extend(&parsed.model);
    }
    Ok((model, errors))
}

/// The manifest files at `path`: the file itself, or a folder's `.yaml`, `.yml` and
/// `.json` files (symlinks followed, as in kubelet's ConfigMap volumes), sorted.
pub fn manifest_files(path: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = fs::read_dir(path).map_err(|source| ManifestError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
            p.is_file() && matches!(ext, "yaml" | "yml" | "json")
        })
        .collect();
    files.sort();
    Ok(files)
}

/// The largest manifest file read: a bigger one is refused as a whole.
pub const MAX_FILE_BYTES: u64 = 16 << 20;
/// The deepest `[`/`{` nesting accepted: deeper YAML costs the parser quadratic time and
/// no Kubernetes object needs it.
pub const MAX_FLOW_DEPTH: usize = 64;

/// One file's objects and what went wrong reading it.
#[derive(Debug, Default)]
pub struct ParsedFile {
    pub model: ClusterModel,
    pub nodes: Nodes,
    pub errors: Vec<ManifestError>,
    /// The whole file was read and its YAML parsed to the end (objects that do not fit
    /// their kind are errors, but the file is whole); `false` for a file that could not
    /// be read, is too big or too deep, or breaks off — possibly one being written.
    pub complete: bool,
    /// The file holds nothing but white space (truncated, e.g. by `> file`).
    pub empty: bool,
}

/// Reads and parses one manifest file.
pub fn parse_file(path: &Path) -> ParsedFile {
    let mut parsed = ParsedFile::default();
    let refuse = |message: String| ManifestError::Parse {
        path: path.to_path_buf(),
        doc: 0,
        message,
    };
    match fs::metadata(path) {
        Ok(m) if m.len() > MAX_FILE_BYTES => {
            parsed.errors.push(refuse(format!(
                "{} bytes: larger than the {MAX_FILE_BYTES} a manifest file may be",
                m.len()
            )));
            return parsed;
        }
        Ok(_) => {}
        Err(source) => {
            parsed.errors.push(ManifestError::Read {
                path: path.to_path_buf(),
                source,
            });
            return parsed;
        }
    }
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(source) => {
            parsed.errors.push(ManifestError::Read {
                path: path.to_path_buf(),
                source,
            });
            return parsed;
        }
    };
    parsed.empty = text.trim().is_empty();
    if let Some(depth) = flow_depth_beyond(&text, MAX_FLOW_DEPTH) {
        parsed.errors.push(refuse(format!(
            "nested {depth} levels deep: deeper than the {MAX_FLOW_DEPTH} accepted"
        )));
        return parsed;
    }
    parsed.complete = add_documents(
        &mut parsed.model,
        &mut parsed.nodes,
        &mut parsed.errors,
        path,
        &text,
    );
    parsed
}

/// The depth reached when `[`/`{` nesting goes beyond `max` (quotes are not parsed: a
/// bracket inside a string counts too, which only makes the bound stricter).
fn flow_depth_beyond(text: &str, max: usize) -> Option<usize> {
    let mut depth = 0usize;
    for b in text.bytes() {
        match b {
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return Some(depth);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// Parses the documents of one file into `model` and `nodes`; `false` when the YAML
/// breaks off.
pub fn add_documents(
    model: &mut ClusterModel,
    nodes: &mut Nodes,
    errors: &mut Vec<ManifestError>,
    path: &Path,
    text: &str,
) -> bool {
    for (doc, de) in serde_norway::Deserializer::from_str(text).enumerate() {
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
                return false;
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
            if let Err(message) = add_object(model, nodes, item) {
                errors.push(parse_err(message));
            }
        }
    }
    true
}

fn add_object(
    model: &mut ClusterModel,
    nodes: &mut Nodes,
    item: serde_json::Value,
) -> Result<(), String> {
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
            model.add_service(&svc);
        }
        "EndpointSlice" => {
            let slice: EndpointSlice =
                serde_json::from_value(item).map_err(|e| format!("EndpointSlice {name}: {e}"))?;
            model.add_slice(&slice);
        }
        // The cluster's other nodes (DSR believes only them); this node's own settings
        // still come from its flags.
        "Node" => {
            let node: Node =
                serde_json::from_value(item).map_err(|e| format!("Node {name}: {e}"))?;
            let named = node.metadata.name.clone().unwrap_or_default();
            if named.is_empty() {
                return Err("Node without metadata.name".to_string());
            }
            let info = crate::source::kube::node_info(&named, Some(&node));
            nodes.insert(named, info);
        }
        // Said out loud: a typo ("Servce") would otherwise drop a Service without a word.
        _ => tracing::warn!(
            kind,
            name,
            "ignoring an object that is not a Service, an EndpointSlice or a Node"
        ),
    }
    Ok(())
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
        add_documents(
            &mut model,
            &mut Nodes::new(),
            &mut errors,
            Path::new("t.yaml"),
            text,
        );
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(model.service_count(), 1);
        assert_eq!(model.slice_count(), 1);
    }

    #[test]
    fn a_malformed_document_is_reported_and_the_rest_load() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec: {ports: 7}\n---\n\
apiVersion: v1\nkind: Service\nmetadata: {name: good}\nspec: {clusterIP: 10.96.0.1}\n---\n: : [\n";
        let mut model = ClusterModel::default();
        let mut errors = Vec::new();
        add_documents(
            &mut model,
            &mut Nodes::new(),
            &mut errors,
            Path::new("t.yaml"),
            text,
        );
        assert_eq!(model.service_count(), 1);
        assert!(!errors.is_empty(), "{errors:?}");
        let first = errors[0].to_string();
        assert!(
            first.contains("t.yaml document 0") && first.contains("Service bad"),
            "{first}"
        );
    }

    #[test]
    fn nodes_are_read_by_name_and_a_malformed_one_is_reported() {
        let text = "apiVersion: v1\nkind: Node\nmetadata: {name: n1, labels: {topology.kubernetes.io/zone: z1}}\n\
spec: {podCIDRs: [10.244.1.0/24]}\n\
status: {addresses: [{type: ExternalIP, address: 203.0.113.1}, {type: Hostname, address: n1}, {type: InternalIP, address: 192.0.2.1}]}\n\
---\napiVersion: v1\nkind: Node\nmetadata: {name: bad}\nstatus: {addresses: 7}\n\
---\napiVersion: v1\nkind: Node\nmetadata: {labels: {a: b}}\n";
        let mut model = ClusterModel::default();
        let mut nodes = Nodes::new();
        let mut errors = Vec::new();
        add_documents(
            &mut model,
            &mut nodes,
            &mut errors,
            Path::new("t.yaml"),
            text,
        );
        let n1 = nodes.get("n1").expect("n1");
        let addrs: Vec<String> = n1.addresses.iter().map(ToString::to_string).collect();
        assert_eq!(addrs, ["192.0.2.1", "203.0.113.1"], "InternalIP first");
        assert_eq!(n1.zone(), Some("z1"));
        assert_eq!(n1.pod_cidrs.len(), 1);
        assert_eq!(nodes.len(), 1, "{nodes:?}");
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].to_string().contains("Node bad"), "{errors:?}");
        assert!(
            errors[1].to_string().contains("without metadata.name"),
            "{errors:?}"
        );
        assert_eq!(model.service_count(), 0);
    }

    /// The YAML parser's own bounds, below the file's size and flow-depth checks: an alias
    /// bomb (a billion laughs) and block nesting the flow-depth count does not see.
    #[test]
    fn alias_bombs_and_deep_block_nesting_are_refused() {
        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x]\n");
        for i in 1..10 {
            let refs = vec![format!("*a{}", i - 1); 9].join(", ");
            bomb.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
        }
        let deep: String = (0..200)
            .map(|i| format!("{}a:\n", "  ".repeat(i)))
            .collect();
        for (text, needle) in [
            (bomb, "repetition limit exceeded"),
            (deep, "recursion limit exceeded"),
        ] {
            let started = std::time::Instant::now();
            let mut model = ClusterModel::default();
            let mut errors = Vec::new();
            assert!(!add_documents(
                &mut model,
                &mut Nodes::new(),
                &mut errors,
                Path::new("t.yaml"),
                &text
            ));
            assert!(started.elapsed() < std::time::Duration::from_secs(1));
            assert!(errors[0].to_string().contains(needle), "{errors:?}");
        }
    }
}
