//! The soak's objects served by the fake API server instead of files, and the API-server
//! faults injected on a schedule while traffic runs: watch drops, 410 storms, etcd
//! restores (old resourceVersions "too large" or gone) and a server that hangs.

use std::{collections::BTreeMap, path::Path, time::Duration};

use anyhow::{Context as _, Result, bail};
use proxy_testbed::fake_apiserver::{FakeApiServer, Kind, OldVersions, Options};
use serde_json::Value;

/// One fault of the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// Every open watch ends; the agent watches again from where it was.
    WatchDrop,
    /// Every watch answered 410 Gone for a while: relists, with the backoff growing.
    GoneStorm,
    /// An etcd restore whose resourceVersions are behind the agent's: 504 "Too large".
    RestoreTooLarge,
    /// An etcd restore whose history is gone: the watch request answered 410.
    RestoreGone,
    /// The server accepts and answers nothing for a while.
    Hang,
}

impl Fault {
    /// The order faults come in, round and round.
    pub const SCHEDULE: [Fault; 5] = [
        Fault::WatchDrop,
        Fault::GoneStorm,
        Fault::RestoreTooLarge,
        Fault::Hang,
        Fault::RestoreGone,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::WatchDrop => "watch drop",
            Fault::GoneStorm => "410 storm (5 s)",
            Fault::RestoreTooLarge => "etcd restore, RV too large",
            Fault::RestoreGone => "etcd restore, RV gone (410)",
            Fault::Hang => "server hangs (10 s)",
        }
    }

    /// How long the fault stays on before the server behaves again (0: a moment).
    pub fn lasts(self) -> Duration {
        match self {
            Fault::GoneStorm => Duration::from_secs(5),
            Fault::Hang => Duration::from_secs(10),
            _ => Duration::ZERO,
        }
    }
}

/// The fake API server, listening on loopback inside a network namespace (where the agent
/// runs), on a runtime of its own, and the objects it was last given.
pub struct ApiFeed {
    pub server: FakeApiServer,
    /// What the server holds, by kind and namespace/name: changes are published as diffs.
    published: BTreeMap<(Kind, String), Value>,
    // Kept last: dropped after the server handle.
    _runtime: tokio::runtime::Runtime,
}

impl ApiFeed {
    /// Starts the server on a loopback port of `netns` (a path such as /run/netns/NAME).
    pub fn start_in(netns: &Path) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("the fake API server's runtime")?;
        let ns = netns.to_path_buf();
        // Bound from a thread in the namespace: the socket stays there, this process not.
        let listener = std::thread::spawn(move || -> Result<std::net::TcpListener> {
            proxy_testbed::client::enter(Some(&ns), None)?;
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the binding thread panicked"))?
        .with_context(|| format!("binding loopback in {}", netns.display()))?;
        let server = runtime.block_on(FakeApiServer::try_start_on(Options::default(), listener))?;
        Ok(Self {
            server,
            published: BTreeMap::new(),
            _runtime: runtime,
        })
    }

    /// Makes the server hold exactly the objects of `files` (name → YAML documents): new
    /// and changed ones applied, missing ones deleted, unchanged ones left alone.
    pub fn publish(&mut self, files: &BTreeMap<&str, String>) -> Result<()> {
        let wanted = objects(files)?;
        for (key, object) in &wanted {
            if self.published.get(key) != Some(object) {
                self.server.apply(key.0, object.clone());
            }
        }
        for (kind, name) in self.published.keys() {
            if !wanted.contains_key(&(*kind, name.clone())) {
                let (ns, name) = name.split_once('/').unwrap_or(("", name));
                self.server.delete(*kind, ns, name);
            }
        }
        self.published = wanted;
        Ok(())
    }

    /// Restores the server from a "backup" holding exactly the objects of `files`; old
    /// resourceVersions are then answered as `old` says.
    pub fn restore(&mut self, files: &BTreeMap<&str, String>, old: OldVersions) -> Result<()> {
        let backup = objects(files)?;
        self.server
            .restore(backup.iter().map(|((kind, _), o)| (*kind, o.clone())), old);
        self.published = backup;
        Ok(())
    }

    /// Turns `fault` on (or, for a moment's fault, makes it happen).
    pub fn inject(&mut self, fault: Fault) {
        match fault {
            Fault::WatchDrop => self.server.break_watches(),
            Fault::GoneStorm => self.server.gone_storm(true),
            Fault::Hang => self.server.hang(true),
            // The caller restores, with the objects the backup should hold.
            Fault::RestoreTooLarge | Fault::RestoreGone => {}
        }
    }

    /// Ends a lasting fault.
    pub fn end(&mut self, fault: Fault) {
        match fault {
            Fault::GoneStorm => self.server.gone_storm(false),
            Fault::Hang => self.server.hang(false),
            _ => {}
        }
    }

    /// A kubeconfig naming the server.
    pub fn kubeconfig(&self) -> String {
        self.server.kubeconfig()
    }
}

/// The objects of YAML `files`, by kind and namespace/name.
fn objects(files: &BTreeMap<&str, String>) -> Result<BTreeMap<(Kind, String), Value>> {
    let mut out = BTreeMap::new();
    for (file, text) in files {
        for doc in serde_norway::Deserializer::from_str(text) {
            let object: Value = serde::Deserialize::deserialize(doc)
                .with_context(|| format!("a document of {file}"))?;
            if object.is_null() {
                continue;
            }
            let kind = match object["kind"].as_str() {
                Some("Service") => Kind::Services,
                Some("EndpointSlice") => Kind::EndpointSlices,
                Some("Node") => Kind::Nodes,
                other => bail!("{file}: a document of kind {other:?}"),
            };
            let ns = object["metadata"]["namespace"].as_str().unwrap_or("");
            let name = object["metadata"]["name"].as_str().unwrap_or("");
            out.insert((kind, format!("{ns}/{name}")), object);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_are_read_from_every_document_by_kind_and_name() {
        let files = BTreeMap::from([(
            "a.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {name: web-1, namespace: default}\n"
                .to_string(),
        )]);
        let got = objects(&files).expect("objects");
        let keys: Vec<_> = got.keys().cloned().collect();
        assert_eq!(
            keys,
            [
                (Kind::Services, "default/web".to_string()),
                (Kind::EndpointSlices, "default/web-1".to_string())
            ]
        );
        let bad = BTreeMap::from([("b.yaml", "kind: Servce\n".to_string())]);
        assert!(objects(&bad).is_err());
    }
}
