//! The file source as operators change files: a slow in-place rewrite, a replaced folder,
//! kubelet's `..data` symlink swap, a single file replaced twice — each published, none
//! publishing an empty or partial state on the way, none leaving the source deaf.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use proxy_agent::source::{SharedSnapshot, files::follow};
use tokio::sync::watch;

fn services(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| {
            format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: {n}, namespace: default}}\n\
                 spec: {{clusterIP: 10.96.0.10, ports: [{{port: 80}}]}}\n---\n"
            )
        })
        .collect()
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("file-source-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}

/// Starts the source on `path`; the receiver sees every published snapshot.
fn start(path: &Path) -> watch::Receiver<Option<SharedSnapshot>> {
    let (tx, rx) = watch::channel(None);
    let path = path.to_path_buf();
    tokio::spawn(async move { follow::run(path, Default::default(), tx).await });
    rx
}

fn names(rx: &watch::Receiver<Option<SharedSnapshot>>) -> Vec<String> {
    rx.borrow()
        .as_ref()
        .map(|s| {
            s.model
                .services()
                .map(|(k, _)| k.name.to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until the published services are `want`; fails if any snapshot on the way has
/// fewer than `floor` services (an outage).
async fn until(rx: &mut watch::Receiver<Option<SharedSnapshot>>, want: &[&str], floor: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = names(rx);
        if now == want {
            return;
        }
        if rx.borrow().is_some() {
            assert!(
                now.len() >= floor,
                "an outage on the way to {want:?}: {now:?}"
            );
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            panic!("timed out waiting for {want:?}, have {now:?}");
        }
    }
}

#[tokio::test]
async fn a_slow_rewrite_in_place_is_no_outage() {
    let dir = temp("slow");
    let file = dir.join("many.yaml");
    std::fs::write(&file, services(&["a", "b", "c"])).expect("write");
    let mut rx = start(&dir);
    until(&mut rx, &["a", "b", "c"], 0).await;
    // `(sleep 1; cat new) > many.yaml`: truncated now, written a second later.
    let f = std::fs::File::create(&file).expect("truncate");
    tokio::time::sleep(Duration::from_secs(1)).await;
    std::io::Write::write_all(&mut &f, services(&["a", "b", "c", "d"]).as_bytes()).expect("write");
    drop(f);
    until(&mut rx, &["a", "b", "c", "d"], 3).await;
    std::fs::remove_dir_all(&dir).expect("rm");
}

#[tokio::test]
async fn a_replaced_folder_and_a_swapped_data_symlink_are_followed() {
    let root = temp("replace");
    let dir = root.join("manifests");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("a.yaml"), services(&["a"])).expect("write");
    let mut rx = start(&dir);
    until(&mut rx, &["a"], 0).await;
    // mv DIR DIR.old; mkdir DIR; cp ... DIR/
    std::fs::rename(&dir, root.join("manifests.old")).expect("mv");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("a.yaml"), services(&["a", "b"])).expect("write");
    until(&mut rx, &["a", "b"], 0).await;
    // Later changes in the new folder are seen too.
    std::fs::write(dir.join("c.yaml"), services(&["c"])).expect("write");
    until(&mut rx, &["a", "b", "c"], 0).await;

    // kubelet's ConfigMap volume: files are symlinks through `..data`, swapped atomically.
    let cm = root.join("configmap");
    std::fs::create_dir_all(cm.join("..v1")).expect("mkdir");
    std::fs::write(cm.join("..v1/web.yaml"), services(&["x"])).expect("write");
    std::os::unix::fs::symlink("..v1", cm.join("..data")).expect("symlink");
    std::os::unix::fs::symlink("..data/web.yaml", cm.join("web.yaml")).expect("symlink");
    let mut rx = start(&cm);
    until(&mut rx, &["x"], 0).await;
    std::fs::create_dir_all(cm.join("..v2")).expect("mkdir");
    std::fs::write(cm.join("..v2/web.yaml"), services(&["x", "y"])).expect("write");
    std::os::unix::fs::symlink("..v2", cm.join("..data_tmp")).expect("symlink");
    std::fs::rename(cm.join("..data_tmp"), cm.join("..data")).expect("swap");
    until(&mut rx, &["x", "y"], 1).await;
    std::fs::remove_dir_all(&root).expect("rm");
}

#[tokio::test]
async fn a_single_file_replaced_twice_is_followed() {
    let dir = temp("single");
    let file = dir.join("web.yaml");
    std::fs::write(&file, services(&["a"])).expect("write");
    let mut rx = start(&file);
    until(&mut rx, &["a"], 0).await;
    for (i, want) in [["a", "b"], ["a", "c"]].iter().enumerate() {
        let tmp = dir.join(format!("web.yaml.tmp{i}"));
        std::fs::write(&tmp, services(want)).expect("write");
        std::fs::rename(&tmp, &file).expect("replace");
        until(&mut rx, want, 1).await;
    }
    std::fs::remove_dir_all(&dir).expect("rm");
}

#[tokio::test]
async fn a_missing_path_is_an_error() {
    let (tx, _rx) = watch::channel(None);
    let err = follow::run(
        PathBuf::from("/nonexistent/manifests"),
        Default::default(),
        tx,
    )
    .await
    .expect_err("missing");
    assert!(err.to_string().contains("no such file or folder"), "{err}");
}

/// `objects_rejected` counts what the file source could not read, not only what the view
/// refused.
#[tokio::test]
async fn unreadable_documents_are_counted_as_rejected() {
    struct Nothing;
    impl proxy_agent::dataplane::Dataplane for Nothing {
        fn apply(
            &mut self,
            _view: &proxy_agent::model::NodeView,
        ) -> proxy_agent::dataplane::error::Result<proxy_agent::dataplane::ApplyReport> {
            Ok(Default::default())
        }
    }
    let dir = temp("unreadable");
    std::fs::write(
        dir.join("web.yaml"),
        format!(
            "{}apiVersion: v1\nkind: Service\nmetadata: {{name: bad}}\nspec: {{ports: 7}}\n",
            services(&["a"])
        ),
    )
    .expect("write");
    let rx = start(&dir);
    let status = proxy_agent::runner::Status::default();
    let st = status.clone();
    tokio::spawn(async move {
        let mut dp = Nothing;
        let timing = proxy_agent::runner::Timing {
            min_interval: Duration::from_millis(10),
            resync: Duration::from_secs(600),
            retry: Duration::from_millis(100),
        };
        let _ = proxy_agent::runner::run(
            rx,
            Default::default(),
            &mut dp,
            timing,
            st,
            std::future::pending(),
        )
        .await;
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while status.counters().objects_rejected == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the unreadable Service was not counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    std::fs::remove_dir_all(&dir).expect("rm");
}

fn node(name: &str, internal: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {name}}}\n\
         status: {{addresses: [{{type: ExternalIP, address: 203.0.113.9}}, \
         {{type: InternalIP, address: {internal}}}]}}\n---\n"
    )
}

/// Waits until a published snapshot satisfies `done`.
async fn until_snapshot(
    rx: &mut watch::Receiver<Option<SharedSnapshot>>,
    what: &str,
    done: impl Fn(&proxy_agent::source::Snapshot) -> bool,
) -> SharedSnapshot {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(s) = rx.borrow_and_update().clone()
            && done(&s)
        {
            return s;
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            panic!("timed out waiting for {what}");
        }
    }
}

fn addresses(s: &proxy_agent::source::Snapshot, node: &str) -> Vec<String> {
    s.nodes
        .get(node)
        .map(|n| n.addresses.iter().map(ToString::to_string).collect())
        .unwrap_or_default()
}

/// The cluster's Nodes come from the manifests (every one, by name, InternalIP first); a
/// change to nothing but a Node's address is published; a Node that does not read is
/// counted unreadable, as a Service would be.
#[tokio::test]
async fn nodes_in_the_manifests_are_published_and_followed() {
    let dir = temp("nodes");
    std::fs::write(dir.join("services.yaml"), services(&["a"])).expect("write");
    let nodes = dir.join("nodes.yaml");
    std::fs::write(
        &nodes,
        format!("{}{}", node("n1", "192.0.2.1"), node("n2", "192.0.2.2")),
    )
    .expect("write");
    let mut rx = start(&dir);
    let first = until_snapshot(&mut rx, "two Nodes", |s| s.nodes.len() == 2).await;
    assert_eq!(addresses(&first, "n1"), ["192.0.2.1", "203.0.113.9"]);
    assert_eq!(first.nodes["n2"].name, "n2");
    assert_eq!(first.node.name, "", "this node still comes from its flags");
    assert_eq!(first.unreadable, 0);

    // Only n2's address changes: the model is the same, the snapshot is not.
    std::fs::write(
        &nodes,
        format!("{}{}", node("n1", "192.0.2.1"), node("n2", "192.0.2.22")),
    )
    .expect("write");
    let moved = until_snapshot(&mut rx, "n2's new address", |s| {
        addresses(s, "n2").first().map(String::as_str) == Some("192.0.2.22")
    })
    .await;
    assert_eq!(moved.model, first.model);
    assert_eq!(moved.changes, first.changes, "no Service or slice changed");

    // n1 goes, n2 breaks: one Node left out and counted, n2's last reading gone with it.
    std::fs::write(
        &nodes,
        "apiVersion: v1\nkind: Node\nmetadata: {name: n2}\nstatus: {addresses: 7}\n",
    )
    .expect("write");
    let broken = until_snapshot(&mut rx, "the broken Node counted", |s| s.unreadable == 1).await;
    assert!(broken.nodes.is_empty(), "{:?}", broken.nodes);
    std::fs::remove_dir_all(&dir).expect("rm");
}
