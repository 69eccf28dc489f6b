//! Events on this node's Node object, as kube-proxy records them: "Starting" when the proxy
//! starts (kube-proxy's birth cry, which `kubectl describe node` shows).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// Records the "Starting" event on the Node `node_name`; a failure is logged, never fatal
/// (events are for people, not for proxying).
pub async fn announce_start(client: kube::Client, node_name: &str) {
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
    if let Err(e) = Recorder::new(client, reporter).publish(&event, &node).await {
        tracing::warn!(
            error = super::api_server::error_chain(&e),
            node = node_name,
            "cannot record the Starting event"
        );
    }
}
