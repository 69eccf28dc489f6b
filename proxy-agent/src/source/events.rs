//! Events on this node's Node object, as kube-proxy records them: "Starting" when the proxy
//! starts (kube-proxy's birth cry, which `kubectl describe node` shows).

use std::time::Duration;

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// How long recording an event may take. kube-proxy's event broadcaster never holds the
/// proxy up; an events endpoint that does not answer would otherwise hold this call for
/// the client's whole read timeout (295 s).
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

/// Records the "Starting" event on the Node `node_name`, giving up after
/// `PUBLISH_TIMEOUT`. Events are for people, not for proxying: the caller runs this beside
/// the source, never before it, and only logs and counts a failure.
pub async fn announce_start(client: kube::Client, node_name: &str) -> Result<()> {
    let reporter = Reporter {
        controller: "proxy-agent".into(),
        instance: Some(node_name.to_string()),
    };
    // kube-proxy's reference: the Node by name, its name standing in for the UID.
    let node = ObjectReference {
        kind: Some("Node".into()),
        api_version: Some("v1".into()),
        name: Some(node_name.to_string()),
        uid: Some(node_name.to_string()),
        ..Default::default()
    };
    let event = Event {
        type_: EventType::Normal,
        reason: "Starting".into(),
        note: Some(format!(
            "Starting proxy-agent {}.",
            env!("CARGO_PKG_VERSION")
        )),
        action: "StartProxyAgent".into(),
        secondary: None,
    };
    let recorder = Recorder::new(client, reporter);
    let what = || format!("recording the Starting event on Node {node_name}");
    tokio::time::timeout(PUBLISH_TIMEOUT, recorder.publish(&event, &node))
        .await
        .map_err(|_| anyhow::anyhow!("no answer in {PUBLISH_TIMEOUT:?}"))
        .with_context(what)?
        .with_context(what)
}
