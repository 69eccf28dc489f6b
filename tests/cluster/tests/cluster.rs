//! The cluster in a box (`proxy_cluster::cluster`) is a real one: the EndpointSlice controller
//! turns a Service and a Pod made Ready here (standing in for the kubelet) into a slice;
//! ServiceAccount tokens authenticate and RBAC decides; the API server restarts on its
//! data. Needs the binaries (`cargo xtask cluster --build-only`), not root: everything
//! listens on 127.0.0.1.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::{
    core::v1::{Node, Pod, Service, ServiceAccount},
    discovery::v1::EndpointSlice,
    rbac::v1::{Role, RoleBinding},
};
use kube::{
    Api,
    api::{ListParams, Patch, PatchParams, PostParams},
};
use proxy_cluster::cluster::{
    Cluster, ClusterOptions, eventually, kubeconfig_client, require_binaries,
};
use serde_json::json;
use test_support::needs_root;

const NS: &str = "smoke";
const POD_IP: &str = "10.244.1.5";
/// The Ready condition's transition time the test writes: far from any time the cluster
/// makes, so finding it on the slice shows the controller took it from the Pod.
const READY_SINCE: &str = "2020-01-02T03:04:05Z";

/// A fresh cluster (the test fails without the binaries).
async fn cluster(test: &str) -> Result<Cluster> {
    Cluster::start(ClusterOptions::new(require_binaries(test))).await
}

fn object<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Result<T> {
    Ok(serde_json::from_value(value)?)
}

async fn slices_of(api: &Api<EndpointSlice>, service: &str) -> Result<Vec<EndpointSlice>> {
    let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={service}"));
    Ok(api.list(&lp).await?.items)
}

#[tokio::test]
async fn endpointslice_controller_writes_the_slice_of_a_ready_pod() -> Result<()> {
    let cluster = cluster("endpointslice_controller_writes_the_slice_of_a_ready_pod").await?;
    let client = cluster.client().await?;
    cluster.create_namespace(NS).await?;

    // The controller skips Pods whose Node it does not know.
    let node: Node = object(json!({"metadata": {"name": "node-a"}}))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await?;
    let svc: Service = object(json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    }))?;
    let svc = Api::<Service>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await?;
    let cluster_ip = svc.spec.and_then(|s| s.cluster_ip).unwrap_or_default();
    assert!(
        cluster_ip.starts_with("10.96."),
        "ClusterIP {cluster_ip} from the range"
    );

    // The controller's first sync of the Service (an empty slice) comes before the Pod,
    // so the slice's trigger time is the Pod's, not the Service's creation.
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    eventually("the Service's first slice", || async {
        Ok((!slices_of(&slices, "web").await?.is_empty()).then_some(()))
    })
    .await?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pod: Pod = object(json!({
        "metadata": {"name": "web-0", "labels": {"app": "web"}},
        "spec": {"nodeName": "node-a",
                 "containers": [{"name": "web", "image": "example.invalid/web",
                                 "ports": [{"name": "http", "containerPort": 8080}]}]},
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    // What the kubelet would report once the container is up and its probe passes.
    let status = json!({"status": {
        "phase": "Running",
        "podIP": POD_IP,
        "podIPs": [{"ip": POD_IP}],
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": READY_SINCE}],
    }});
    pods.patch_status("web-0", &PatchParams::default(), &Patch::Merge(&status))
        .await?;

    let slice = eventually("a slice with the Pod's address", || async {
        Ok(slices_of(&slices, "web").await?.into_iter().find(|s| {
            s.endpoints
                .iter()
                .any(|e| e.addresses.iter().any(|a| a == POD_IP))
        }))
    })
    .await
    .with_context(|| cluster.log_tail("kube-controller-manager"))?;
    let endpoint = slice
        .endpoints
        .iter()
        .find(|e| e.addresses.iter().any(|a| a == POD_IP))
        .context("endpoint")?;
    let conditions = endpoint.conditions.clone().unwrap_or_default();
    assert_eq!(conditions.ready, Some(true), "{endpoint:?}");
    assert_eq!(conditions.serving, Some(true), "{endpoint:?}");
    assert_eq!(conditions.terminating, Some(false), "{endpoint:?}");
    assert_eq!(endpoint.node_name.as_deref(), Some("node-a"));
    assert_eq!(slice.address_type, "IPv4");
    let port = &slice.ports.as_ref().context("ports")?[0];
    assert_eq!(
        (port.name.as_deref(), port.port),
        (Some("http"), Some(8080))
    );
    let labels = slice.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("endpointslice.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("endpointslice-controller.k8s.io")
    );
    let annotations = slice.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get("endpoints.kubernetes.io/last-change-trigger-time")
            .map(String::as_str),
        Some(READY_SINCE),
        "{annotations:?}"
    );
    Ok(())
}

#[tokio::test]
async fn service_account_tokens_meet_rbac_and_survive_an_apiserver_restart() -> Result<()> {
    let mut cluster =
        cluster("service_account_tokens_meet_rbac_and_survive_an_apiserver_restart").await?;
    let admin = cluster.client().await?;
    cluster.create_namespace(NS).await?;
    let sa: ServiceAccount = object(json!({"metadata": {"name": "reader"}}))?;
    Api::<ServiceAccount>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &sa)
        .await?;
    let kubeconfig = cluster.service_account_kubeconfig(NS, "reader").await?;
    let reader = kubeconfig_client(&kubeconfig).await?;
    let services: Api<Service> = Api::namespaced(reader.clone(), NS);

    // Authenticated (not 401) but granted nothing.
    match services.list(&ListParams::default()).await {
        Err(kube::Error::Api(e)) if e.code == 403 => {}
        other => bail!("expected 403 Forbidden before the grant, got {other:?}"),
    }
    let role: Role = object(json!({
        "metadata": {"name": "services-reader"},
        "rules": [{"apiGroups": [""], "resources": ["services"], "verbs": ["list"]}],
    }))?;
    Api::<Role>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &role)
        .await?;
    let binding: RoleBinding = object(json!({
        "metadata": {"name": "reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "services-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": NS}],
    }))?;
    Api::<RoleBinding>::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &binding)
        .await?;
    eventually("the grant to take effect", || async {
        Ok(services.list(&ListParams::default()).await.ok().map(|_| ()))
    })
    .await?;

    // Same port, same etcd, same signing key: the old token and the objects are still good.
    cluster.restart_apiserver().await?;
    let list = services.list(&ListParams::default()).await?;
    assert!(list.items.is_empty());
    assert!(
        Api::<Role>::namespaced(admin, NS)
            .get_opt("services-reader")
            .await?
            .is_some()
    );
    Ok(())
}

/// A network namespace of the test's own, deleted on drop.
struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = proxy_testbed::sh(&["ip", "netns", "del", &self.0]);
    }
}

/// `/readyz` through the admin kubeconfig, from a thread inside `netns`.
fn readyz_from(netns: &Path, kubeconfig: &Path) -> Result<String> {
    let (netns, kubeconfig) = (netns.to_path_buf(), kubeconfig.to_path_buf());
    std::thread::spawn(move || -> Result<String> {
        proxy_testbed::client::enter(Some(&netns), None)?;
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(async {
                let client = kubeconfig_client(&kubeconfig).await?;
                let req = http::Request::get("/readyz").body(Vec::new())?;
                Ok(client.request_text(req).await?)
            })
    })
    .join()
    .map_err(|_| anyhow::anyhow!("readyz thread panicked"))?
}

#[needs_root]
#[tokio::test]
async fn the_api_server_is_reachable_from_a_testbed_namespace() -> Result<()> {
    const TEST: &str = "the_api_server_is_reachable_from_a_testbed_namespace";
    let mut cluster = cluster(TEST).await?;
    let ns = Netns(format!("pxyclu{}", std::process::id()));
    proxy_testbed::sh(&["ip", "netns", "add", &ns.0])?;
    proxy_testbed::ip(&ns.0, "link set lo up")?;
    let path = PathBuf::from(format!("/run/netns/{}", ns.0));
    let kubeconfig = cluster.admin_kubeconfig().to_path_buf();
    assert!(
        readyz_from(&path, &kubeconfig).is_err(),
        "its loopback is not ours"
    );

    let relay = cluster.expose_in_netns(&path)?;
    assert_eq!(readyz_from(&path, &kubeconfig)?, "ok");
    // The relay dials anew for each connection: a restarted API server is found again.
    cluster.restart_apiserver().await?;
    assert_eq!(readyz_from(&path, &kubeconfig)?, "ok");
    drop(relay);
    assert!(readyz_from(&path, &kubeconfig).is_err(), "relay stopped");
    Ok(())
}

#[tokio::test]
async fn a_component_that_fails_to_start_is_reported_with_its_log() -> Result<()> {
    let bin_dir = require_binaries("a_component_that_fails_to_start_is_reported_with_its_log");
    let opts = ClusterOptions {
        apiserver_args: vec!["--no-such-flag".into()],
        ..ClusterOptions::new(bin_dir)
    };
    let Err(e) = Cluster::start(opts).await else {
        bail!("started with an unknown flag");
    };
    let text = format!("{e:#}");
    assert!(text.contains("kube-apiserver exited"), "{text}");
    assert!(
        text.contains("no-such-flag"),
        "the log's last lines: {text}"
    );
    Ok(())
}
