//! A small fake Kubernetes API server on loopback: list and watch for Services,
//! EndpointSlices and Nodes, with the failure modes a watcher must survive — a broken
//! watch, an expired resourceVersion (410 Gone), bookmarks, and a list held back.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use axum::{
    Router,
    body::Body,
    extract::{Path, Query, State},
    response::{IntoResponse, Response},
    routing::get,
};
use serde_json::{Value, json};
use tokio::sync::{Notify, broadcast};

/// Which collection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Services,
    EndpointSlices,
    Nodes,
}

impl Kind {
    fn list_kind(self) -> &'static str {
        match self {
            Kind::Services => "ServiceList",
            Kind::EndpointSlices => "EndpointSliceList",
            Kind::Nodes => "NodeList",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlices => "discovery.k8s.io/v1",
            _ => "v1",
        }
    }
}

#[derive(Clone, Debug)]
struct Event {
    kind: Kind,
    rv: u64,
    type_: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(Kind, String), Value>,
    history: Vec<Event>,
    /// Watches asking for a resourceVersion older than this get 410 Gone.
    expired_before: u64,
    held: Vec<Kind>,
    lists_served: BTreeMap<String, u64>,
    /// The label selector of the last list per resource.
    label_selectors: BTreeMap<String, String>,
    /// events.k8s.io Events created, as posted.
    events: Vec<Value>,
}

struct Shared {
    store: Mutex<Store>,
    events: broadcast::Sender<Event>,
    breaks: broadcast::Sender<()>,
    released: Notify,
}

/// Handle to the running server.
#[derive(Clone)]
pub struct FakeApiServer {
    shared: Arc<Shared>,
    pub addr: SocketAddr,
}

fn key(obj: &Value) -> String {
    let ns = obj["metadata"]["namespace"].as_str().unwrap_or("");
    let name = obj["metadata"]["name"].as_str().unwrap_or("");
    format!("{ns}/{name}")
}

impl FakeApiServer {
    pub async fn start() -> Self {
        let (events, _) = broadcast::channel(1024);
        let (breaks, _) = broadcast::channel(16);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                rv: 100,
                ..Default::default()
            }),
            events,
            breaks,
            released: Notify::new(),
        });
        let app = Router::new()
            .route("/api/v1/{resource}", get(handle_core))
            .route(
                "/apis/discovery.k8s.io/v1/{resource}",
                get(handle_discovery),
            )
            .route(
                "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                axum::routing::post(handle_event),
            )
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { shared, addr }
    }

    /// A kube client for this server.
    pub fn client(&self) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().expect("url");
        let config = kube::Config::new(url);
        kube::Client::try_from(config).expect("client")
    }

    fn store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        f(&mut self.shared.store.lock().expect("lock"))
    }

    fn record(&self, kind: Kind, type_: &'static str, mut object: Value) {
        let event = self.store(|s| {
            s.rv += 1;
            object["metadata"]["resourceVersion"] = json!(s.rv.to_string());
            let k = (kind, key(&object));
            if type_ == "DELETED" {
                s.objects.remove(&k);
            } else {
                s.objects.insert(k, object.clone());
            }
            let e = Event {
                kind,
                rv: s.rv,
                type_,
                object,
            };
            s.history.push(e.clone());
            e
        });
        let _ = self.shared.events.send(event);
    }

    /// Creates or replaces an object (ADDED or MODIFIED to watchers).
    pub fn apply(&self, kind: Kind, object: Value) {
        let exists = self.store(|s| s.objects.contains_key(&(kind, key(&object))));
        self.record(kind, if exists { "MODIFIED" } else { "ADDED" }, object);
    }

    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) {
        let object = self.store(|s| {
            s.objects
                .get(&(kind, format!("{namespace}/{name}")))
                .cloned()
        });
        if let Some(object) = object {
            self.record(kind, "DELETED", object);
        }
    }

    /// Changes objects without telling anyone (as if during a watch outage).
    pub fn delete_silently(&self, kind: Kind, namespace: &str, name: &str) {
        self.store(|s| {
            s.rv += 1;
            s.objects.remove(&(kind, format!("{namespace}/{name}")));
        });
    }

    /// Sends a BOOKMARK with the current resourceVersion to every watch.
    pub fn bookmark(&self) {
        let rv = self.store(|s| s.rv);
        for kind in [Kind::Services, Kind::EndpointSlices, Kind::Nodes] {
            let object = json!({"kind": kind.list_kind().trim_end_matches("List"), "apiVersion": kind.api_version(),
                                "metadata": {"resourceVersion": rv.to_string()}});
            let _ = self.shared.events.send(Event {
                kind,
                rv,
                type_: "BOOKMARK",
                object,
            });
        }
    }

    /// Ends every open watch stream (the client must reconnect).
    pub fn break_watches(&self) {
        let _ = self.shared.breaks.send(());
    }

    /// Makes every resourceVersion so far too old: reconnecting watches get 410 Gone.
    pub fn expire_history(&self) {
        self.store(|s| {
            s.expired_before = s.rv + 1;
            s.history.clear();
        });
    }

    /// Holds list requests for `kind` until `release`.
    pub fn hold_lists(&self, kind: Kind) {
        self.store(|s| s.held.push(kind));
    }

    pub fn release_lists(&self) {
        self.store(|s| s.held.clear());
        self.shared.released.notify_waiters();
    }

    /// The Events posted so far.
    pub fn events(&self) -> Vec<Value> {
        self.store(|s| s.events.clone())
    }

    /// The label selector the last list of `resource` asked for ("" for none).
    pub fn label_selector(&self, resource: &str) -> String {
        self.store(|s| s.label_selectors.get(resource).cloned().unwrap_or_default())
    }

    /// How many list requests for `resource` (e.g. "services") were served.
    pub fn lists_served(&self, resource: &str) -> u64 {
        self.store(|s| s.lists_served.get(resource).copied().unwrap_or(0))
    }
}

async fn handle_event(
    State(shared): State<Arc<Shared>>,
    axum::Json(event): axum::Json<Value>,
) -> Response {
    shared
        .store
        .lock()
        .expect("lock")
        .events
        .push(event.clone());
    (axum::http::StatusCode::CREATED, axum::Json(event)).into_response()
}

async fn handle_core(
    State(shared): State<Arc<Shared>>,
    Path(resource): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let kind = match resource.as_str() {
        "services" => Kind::Services,
        "nodes" => Kind::Nodes,
        _ => return (axum::http::StatusCode::NOT_FOUND, "").into_response(),
    };
    handle(shared, kind, resource, q).await
}

async fn handle_discovery(
    State(shared): State<Arc<Shared>>,
    Path(resource): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    if resource != "endpointslices" {
        return (axum::http::StatusCode::NOT_FOUND, "").into_response();
    }
    handle(shared, Kind::EndpointSlices, resource, q).await
}

/// The field selector `metadata.name=` and label selectors made of `key`, `!key` and
/// `key=value` terms, as the API server applies them.
fn matches_selector(obj: &Value, q: &BTreeMap<String, String>) -> bool {
    let labels = &obj["metadata"]["labels"];
    let labels_match = q.get("labelSelector").is_none_or(|sel| {
        sel.split(',').filter(|t| !t.is_empty()).all(|term| {
            if let Some(key) = term.strip_prefix('!') {
                labels.get(key).is_none()
            } else if let Some((k, v)) = term.split_once('=') {
                labels.get(k).and_then(Value::as_str) == Some(v)
            } else {
                labels.get(term).is_some()
            }
        })
    });
    labels_match
        && match q
            .get("fieldSelector")
            .and_then(|f| f.strip_prefix("metadata.name="))
        {
            Some(name) => obj["metadata"]["name"].as_str() == Some(name),
            None => true,
        }
}

async fn handle(
    shared: Arc<Shared>,
    kind: Kind,
    resource: String,
    q: BTreeMap<String, String>,
) -> Response {
    if q.get("watch").map(String::as_str) == Some("true") {
        return watch(shared, kind, q);
    }
    loop {
        let held = shared.store.lock().expect("lock").held.contains(&kind);
        if !held {
            break;
        }
        shared.released.notified().await;
    }
    let mut s = shared.store.lock().expect("lock");
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    s.label_selectors.insert(resource.clone(), selector);
    *s.lists_served.entry(resource).or_insert(0) += 1;
    let items: Vec<Value> = s
        .objects
        .iter()
        .filter(|((k, _), o)| *k == kind && matches_selector(o, &q))
        .map(|(_, o)| o.clone())
        .collect();
    let body = json!({"kind": kind.list_kind(), "apiVersion": kind.api_version(),
                      "metadata": {"resourceVersion": s.rv.to_string()}, "items": items});
    axum::Json(body).into_response()
}

fn watch(shared: Arc<Shared>, kind: Kind, q: BTreeMap<String, String>) -> Response {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (backlog, gone) = {
        let s = shared.store.lock().expect("lock");
        let gone = from < s.expired_before;
        let backlog: Vec<Event> = s
            .history
            .iter()
            .filter(|e| e.kind == kind && e.rv > from)
            .cloned()
            .collect();
        (backlog, gone)
    };
    if gone {
        let status = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": "too old resource version", "reason": "Expired", "code": 410}});
        return Response::new(Body::from(format!("{status}\n")));
    }
    let events = shared.events.subscribe();
    let breaks = shared.breaks.subscribe();
    let line = |e: &Event| {
        axum::body::Bytes::from(format!(
            "{}\n",
            json!({"type": e.type_, "object": e.object})
        ))
    };
    let first: Vec<Result<axum::body::Bytes, Infallible>> = backlog
        .iter()
        .filter(|e| matches_selector(&e.object, &q))
        .map(|e| Ok(line(e)))
        .collect();
    let live = futures::stream::unfold(
        (events, breaks, q),
        move |(mut events, mut breaks, q)| async move {
            loop {
                tokio::select! {
                    _ = breaks.recv() => return None,
                    e = events.recv() => match e {
                        Ok(e) if e.kind == kind && (e.type_ == "BOOKMARK" || matches_selector(&e.object, &q)) => {
                            let l = Ok::<_, Infallible>(axum::body::Bytes::from(format!("{}\n", json!({"type": e.type_, "object": e.object}))));
                            return Some((l, (events, breaks, q)));
                        }
                        Ok(_) => continue,
                        Err(_) => return None,
                    },
                }
            }
        },
    );
    let stream = futures::StreamExt::chain(futures::stream::iter(first), live);
    Response::new(Body::from_stream(stream))
}
