//! A fake Kubernetes API server on loopback: list (paged, as kube-rs's watcher and
//! client-go ask: `limit`/`continue`) and watch for Services, EndpointSlices and Nodes,
//! with the failure modes a watcher must survive — a broken watch, an expired
//! resourceVersion (410 Gone), bookmarks, and a list held back — and, for benchmarks, a
//! population of N Services and their EndpointSlices with a churn of endpoint changes.
//!
//! It is also a fault injector, for the API client's hostile-input tests: a 410 storm
//! (every watch answered Gone at once), an etcd restore (objects replaced, old
//! resourceVersions answered 504 "Too large resource version" or 410 on the watch request
//! itself), a huge watch event streamed in small chunks (the server never holds it),
//! 429/5xx answers with Retry-After, a bearer token that must match (and may rotate), and
//! HTTPS with its own CA (`try_start_tls`) so a client with the wrong one fails its
//! handshake, a server that hangs (`hang`), and raw answers — any bytes as a list or at
//! the head of a watch (`raw_list`, `raw_watch`: the fuzzer's). It can listen on a socket
//! the caller bound (`try_start_on`: loopback inside a test's network namespace). Every list and watch request is logged with its time and answer (`served`).
//!
//! One source file for proxy-agent's integration tests (included by path) and the test
//! crates (the e2e suite, the benchmarks). Objects are serialised once when stored, so a list of 100k
//! slices is a copy of bytes, not 100k JSON trees built per request.

use std::{
    collections::{BTreeMap, VecDeque},
    convert::Infallible,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, SystemTime},
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Path, Query, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::get,
};
use serde_json::{Value, json};
use tokio::sync::{Notify, broadcast};

/// Which collection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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

    fn kind(self) -> &'static str {
        match self {
            Kind::Services => "Service",
            Kind::EndpointSlices => "EndpointSlice",
            Kind::Nodes => "Node",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlices => "discovery.k8s.io/v1",
            _ => "v1",
        }
    }
}

/// One stored version of an object: what selectors look at, and its JSON (with its
/// resourceVersion) serialised once.
#[derive(Debug)]
struct Stored {
    name: String,
    labels: BTreeMap<String, String>,
    json: Bytes,
}

impl Stored {
    fn new(object: &Value) -> Self {
        let labels = object["metadata"]["labels"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            name: object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            labels,
            json: Bytes::from(object.to_string()),
        }
    }
}

#[derive(Clone, Debug)]
struct Event {
    kind: Kind,
    rv: u64,
    type_: &'static str,
    object: Arc<Stored>,
}

impl Event {
    /// The watch stream's line: `{"type":..,"object":..}` and a newline.
    fn line(&self) -> Bytes {
        let mut out = Vec::with_capacity(self.object.json.len() + 32);
        out.extend_from_slice(b"{\"type\":\"");
        out.extend_from_slice(self.type_.as_bytes());
        out.extend_from_slice(b"\",\"object\":");
        out.extend_from_slice(&self.object.json);
        out.extend_from_slice(b"}\n");
        Bytes::from(out)
    }
}

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(Kind, String), Arc<Stored>>,
    /// Every event, oldest first (resourceVersions ascending), since the last expiry.
    history: VecDeque<Event>,
    /// Watches and continued lists asking for a resourceVersion older than this get
    /// 410 Gone.
    expired_before: u64,
    held: Vec<Kind>,
    /// Lists begun (first pages), pages served and lists completed (last pages), per
    /// resource.
    lists_served: BTreeMap<String, u64>,
    pages_served: BTreeMap<String, u64>,
    lists_completed: BTreeMap<String, u64>,
    watches_served: BTreeMap<String, u64>,
    /// The label selector of the last list per resource.
    label_selectors: BTreeMap<String, String>,
    /// events.k8s.io Events created, as posted.
    events: Vec<Value>,
    /// Event POSTs received (answered or held).
    event_posts: u64,
    /// Event POSTs are held (never answered) until `release_events`.
    events_held: bool,
    faults: Faults,
    /// Every list (first page) and watch request, in order.
    served: Vec<Served>,
    /// Requests refused for want of the right token.
    unauthorized: u64,
}

/// The faults in force (`FakeApiServer`'s fault methods set them).
#[derive(Default)]
struct Faults {
    /// Every watch is answered at once with a 410 Gone ERROR event.
    gone_storm: bool,
    /// A watch from an expired resourceVersion gets an HTTP 410 answer to its request
    /// rather than an ERROR event in an open stream.
    gone_on_request: bool,
    /// Huge events to stream first on the next watch of a kind: (kind, line length).
    huge: Vec<(Kind, usize)>,
    /// Answers to give the next requests of a kind instead of serving them.
    throttles: Vec<(Kind, Throttle)>,
    /// The bearer token every request must carry.
    token: Option<String>,
    /// A server that hangs: requests are held unanswered and open watches send nothing
    /// until `hang(false)`.
    hung: bool,
    /// Bodies to answer the next list (first page) of a kind with, verbatim.
    raw_lists: Vec<(Kind, Bytes)>,
    /// Bytes to stream first, verbatim, on the next watch of a kind.
    raw_watches: Vec<(Kind, Bytes)>,
}

/// An error answer the server gives before serving: `times` requests (lists and watches)
/// of the kind get `code` with a `Retry-After` of `retry_after` (whole seconds, rounded up;
/// none if `None`).
#[derive(Clone, Debug)]
pub struct Throttle {
    pub code: u16,
    pub retry_after: Option<Duration>,
    pub times: u32,
}

/// How a server restored from an etcd backup answers the resourceVersions clients hold
/// from before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OldVersions {
    /// The backup's resourceVersions are lower: a client's is "too large", and its watch
    /// gets 504 Timeout, cause ResourceVersionTooLarge, as the API server answers.
    TooLarge,
    /// Its history is gone: a watch request from before gets an HTTP 410 answer (not an
    /// ERROR event in the stream).
    Gone,
}

/// One list or watch request, as served.
#[derive(Clone, Debug)]
pub struct Served {
    pub at: std::time::Instant,
    pub resource: String,
    pub watch: bool,
    /// The HTTP status answered (200 for a list or watch served).
    pub code: u16,
}

struct Shared {
    store: Mutex<Store>,
    events: broadcast::Sender<Event>,
    breaks: broadcast::Sender<()>,
    released: Notify,
    /// The accept loop, ended by `shutdown`.
    serving: Mutex<Option<tokio::task::JoinHandle<()>>>,
    options: Options,
    /// The CA that signed the serving certificate, when serving HTTPS.
    ca: Option<rcgen::Certificate>,
    /// TLS handshakes that failed (a client that does not trust our CA).
    tls_failures: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // A panic elsewhere while holding the lock leaves plain data: carry on.
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// How the server behaves beyond the API's defaults.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Sends a BOOKMARK this often on every watch that asked for bookmarks
    /// (`allowWatchBookmarks=true`), as the API server does about once a minute.
    pub bookmark_every: Option<Duration>,
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

/// Watch events buffered per subscriber before a slow watch is cut (it then resumes from
/// its last resourceVersion, as a client does after any broken watch).
const WATCH_BUFFER: usize = 16 * 1024;

impl FakeApiServer {
    /// Starts the server on a free loopback port (panics if it cannot: for tests).
    pub async fn start() -> Self {
        Self::try_start(Options::default())
            .await
            .expect("start the fake API server")
    }

    /// Starts the server on a free loopback port.
    pub async fn try_start(options: Options) -> anyhow::Result<Self> {
        Self::start_with(options, None, None).await
    }

    /// Starts the server on `listener`, bound by the caller (a loopback socket made in a
    /// test's network namespace, which an agent started there can reach).
    pub async fn try_start_on(
        options: Options,
        listener: std::net::TcpListener,
    ) -> anyhow::Result<Self> {
        Self::start_with(options, None, Some(listener)).await
    }

    /// Starts the server on a free loopback port, serving HTTPS with a certificate of its
    /// own CA (`ca_pem`) for 127.0.0.1 and localhost: `client` trusts that CA, a client
    /// that does not fails its handshake (counted by `tls_failures`).
    pub async fn try_start_tls(options: Options) -> anyhow::Result<Self> {
        Self::start_with(options, Some(Pki::new()?), None).await
    }

    async fn start_with(
        options: Options,
        pki: Option<Pki>,
        listener: Option<std::net::TcpListener>,
    ) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let (events, _) = broadcast::channel(WATCH_BUFFER);
        let (breaks, _) = broadcast::channel(16);
        let (ca, tls) = match pki {
            Some(p) => (Some(p.ca), Some(p.acceptor)),
            None => (None, None),
        };
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                rv: 100,
                ..Default::default()
            }),
            events,
            breaks,
            released: Notify::new(),
            serving: Mutex::new(None),
            options,
            ca,
            tls_failures: Default::default(),
        });
        let app = Router::new()
            .route("/version", get(handle_version))
            .route("/api/v1/{resource}", get(handle_core))
            .route(
                "/apis/discovery.k8s.io/v1/{resource}",
                get(handle_discovery),
            )
            .route(
                "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                axum::routing::post(handle_event),
            )
            .layer(axum::middleware::from_fn_with_state(
                shared.clone(),
                authorize,
            ))
            .with_state(shared.clone());
        let listener = match listener {
            Some(l) => {
                l.set_nonblocking(true).context("a non-blocking listener")?;
                tokio::net::TcpListener::from_std(l).context("the given listener")?
            }
            None => tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .context("binding the fake API server on loopback")?,
        };
        let addr = listener.local_addr().context("its address")?;
        let serving = match tls {
            None => tokio::spawn(async move {
                use axum::serve::ListenerExt as _;
                // As the real API server (Go's net package sets TCP_NODELAY): without it,
                // a small watch event waits behind the client's delayed ACK (Nagle), and
                // the churn's latencies gained ~35 ms of the stand-in's own.
                let listener = listener.tap_io(|tcp| {
                    let _ = tcp.set_nodelay(true);
                });
                let _ = axum::serve(listener, app).await;
            }),
            Some(acceptor) => tokio::spawn(serve_tls(listener, acceptor, app, shared.clone())),
        };
        *shared
            .serving
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(serving);
        Ok(Self { shared, addr })
    }

    /// The server's URL: `http://` or, from `try_start_tls`, `https://`.
    pub fn url(&self) -> String {
        let scheme = if self.shared.ca.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    /// The CA of an HTTPS server, PEM-encoded.
    pub fn ca_pem(&self) -> Option<String> {
        self.shared.ca.as_ref().map(rcgen::Certificate::pem)
    }

    /// A kube client configuration for this server: no credentials; an HTTPS server's CA
    /// as the only root.
    pub fn config(&self) -> kube::Config {
        let mut config = kube::Config::new(self.url().parse().expect("url"));
        if let Some(ca) = &self.shared.ca {
            config.root_cert = Some(vec![ca.der().to_vec()]);
        }
        config
    }

    /// TLS handshakes that failed so far.
    pub fn tls_failures(&self) -> u64 {
        self.shared
            .tls_failures
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A kube client for this server (panics if it cannot: for tests).
    pub fn client(&self) -> kube::Client {
        kube::Client::try_from(self.config()).expect("client")
    }

    /// A kubeconfig naming this server (plain HTTP, no credentials).
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: 'http://{}'}}\n\
             contexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.addr
        )
    }

    fn store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        f(&mut self.shared.lock())
    }

    fn record(&self, kind: Kind, type_: &'static str, mut object: Value) -> u64 {
        let mut s = self.shared.lock();
        s.rv += 1;
        let rv = s.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let k = (kind, key(&object));
        let stored = Arc::new(Stored::new(&object));
        if type_ == "DELETED" {
            s.objects.remove(&k);
        } else {
            s.objects.insert(k, stored.clone());
        }
        let e = Event {
            kind,
            rv,
            type_,
            object: stored,
        };
        s.history.push_back(e.clone());
        // Sent under the lock: a watch that subscribes under it sees each event once,
        // from its backlog or live.
        let _ = self.shared.events.send(e);
        rv
    }

    /// Creates or replaces an object (ADDED or MODIFIED to watchers); returns its new
    /// resourceVersion.
    pub fn apply(&self, kind: Kind, object: Value) -> u64 {
        let exists = self.store(|s| s.objects.contains_key(&(kind, key(&object))));
        self.record(kind, if exists { "MODIFIED" } else { "ADDED" }, object)
    }

    /// Stores objects without telling anyone and without history: a cluster that
    /// already holds them when the first client comes (much faster than `apply` for
    /// 100k objects).
    pub fn preload(&self, kind: Kind, objects: impl IntoIterator<Item = Value>) {
        // Serialised outside the lock.
        let stored: Vec<(String, Value)> = objects.into_iter().map(|o| (key(&o), o)).collect();
        let mut s = self.shared.lock();
        for (k, mut object) in stored {
            s.rv += 1;
            object["metadata"]["resourceVersion"] = json!(s.rv.to_string());
            s.objects.insert((kind, k), Arc::new(Stored::new(&object)));
        }
        // Nobody watched those changes: a watch from before them must relist.
        s.expired_before = s.rv;
        s.history.clear();
    }

    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) {
        if let Some(object) = self.stored_value(kind, namespace, name) {
            self.record(kind, "DELETED", object);
        }
    }

    /// The stored object, parsed back.
    fn stored_value(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let stored = self.store(|s| {
            s.objects
                .get(&(kind, format!("{namespace}/{name}")))
                .cloned()
        })?;
        serde_json::from_slice(&stored.json).ok()
    }

    /// Changes objects without telling anyone (as if during a watch outage).
    pub fn delete_silently(&self, kind: Kind, namespace: &str, name: &str) {
        self.store(|s| {
            s.rv += 1;
            s.objects.remove(&(kind, format!("{namespace}/{name}")));
        });
    }

    /// Sends a BOOKMARK with the current resourceVersion to every watch that asked for
    /// bookmarks.
    pub fn bookmark(&self) {
        let s = self.shared.lock();
        for kind in [Kind::Services, Kind::EndpointSlices, Kind::Nodes] {
            let _ = self.shared.events.send(bookmark_event(kind, s.rv));
        }
    }

    /// Stops accepting connections and ends every watch: what it holds is freed once the
    /// last handle goes (a benchmark runs one server per size).
    pub fn shutdown(&self) {
        let serving = self
            .shared
            .serving
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(serving) = serving {
            serving.abort();
        }
        self.break_watches();
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

    /// Holds every Event POST unanswered (an events endpoint that hangs) until
    /// `release_events`.
    pub fn hold_events(&self) {
        self.store(|s| s.events_held = true);
    }

    pub fn release_events(&self) {
        self.store(|s| s.events_held = false);
        self.shared.released.notify_waiters();
    }

    /// How many Event POSTs arrived, answered or held.
    pub fn event_posts(&self) -> u64 {
        self.store(|s| s.event_posts)
    }

    /// The Events posted so far.
    pub fn events(&self) -> Vec<Value> {
        self.store(|s| s.events.clone())
    }

    /// The label selector the last list of `resource` asked for ("" for none).
    pub fn label_selector(&self, resource: &str) -> String {
        self.store(|s| s.label_selectors.get(resource).cloned().unwrap_or_default())
    }

    /// How many lists of `resource` (e.g. "services") were begun (a paged list is one).
    pub fn lists_served(&self, resource: &str) -> u64 {
        self.store(|s| s.lists_served.get(resource).copied().unwrap_or(0))
    }

    /// How many list pages of `resource` were served.
    pub fn pages_served(&self, resource: &str) -> u64 {
        self.store(|s| s.pages_served.get(resource).copied().unwrap_or(0))
    }

    /// How many lists of `resource` were served to their last page.
    pub fn lists_completed(&self, resource: &str) -> u64 {
        self.store(|s| s.lists_completed.get(resource).copied().unwrap_or(0))
    }

    /// How many watches of `resource` were opened.
    pub fn watches_served(&self, resource: &str) -> u64 {
        self.store(|s| s.watches_served.get(resource).copied().unwrap_or(0))
    }

    /// Every list (first page) and watch request of `resource`, in order, with its answer.
    pub fn served(&self, resource: &str) -> Vec<Served> {
        self.store(|s| {
            s.served
                .iter()
                .filter(|r| r.resource == resource)
                .cloned()
                .collect()
        })
    }

    /// Requests refused for a missing or wrong bearer token.
    pub fn unauthorized(&self) -> u64 {
        self.store(|s| s.unauthorized)
    }

    // Faults.

    /// A 410 storm: while on, every watch is answered at once with a 410 Gone ERROR
    /// event, so a client relists and is sent back again (open watches are broken).
    pub fn gone_storm(&self, on: bool) {
        self.store(|s| s.faults.gone_storm = on);
        if on {
            self.break_watches();
        }
    }

    /// An etcd restore: every object replaced by `backup`, the history gone, the server
    /// restarted (watches broken). Clients then hold resourceVersions from before, which
    /// the server answers as `old` says; a list from "" (a quorum read) is served.
    pub fn restore(&self, backup: impl IntoIterator<Item = (Kind, Value)>, old: OldVersions) {
        let backup: Vec<(Kind, String, Value)> = backup
            .into_iter()
            .map(|(kind, o)| (kind, key(&o), o))
            .collect();
        self.store(|s| {
            let before = s.rv;
            s.objects.clear();
            s.history.clear();
            match old {
                // The backup's counter is behind every resourceVersion handed out since.
                OldVersions::TooLarge => {
                    s.rv = before / 2;
                    s.expired_before = 0;
                }
                OldVersions::Gone => {
                    s.rv = before + 1;
                    s.expired_before = s.rv;
                    s.faults.gone_on_request = true;
                }
            }
            for (kind, k, mut object) in backup {
                s.rv += 1;
                object["metadata"]["resourceVersion"] = json!(s.rv.to_string());
                s.objects.insert((kind, k), Arc::new(Stored::new(&object)));
            }
        });
        self.break_watches();
    }

    /// Streams one MODIFIED event of `kind` whose line is `bytes` long (an annotation of
    /// filler) first on the next watch of `kind`, then serves that watch as usual; open
    /// watches are broken so that one comes. The object is not stored, and the line is
    /// made in 64 KiB chunks as it is sent: the server never holds it.
    pub fn huge_event(&self, kind: Kind, bytes: usize) {
        self.store(|s| s.faults.huge.push((kind, bytes)));
        self.break_watches();
    }

    /// Answers the next `throttle.times` requests (lists and watches) of `kind` with its
    /// code and Retry-After instead of serving them.
    pub fn throttle(&self, kind: Kind, throttle: Throttle) {
        self.store(|s| s.faults.throttles.push((kind, throttle)));
    }

    /// Requires `Authorization: Bearer TOKEN` on every request (401 otherwise); `None`
    /// accepts any. Changing it is a token rotation.
    pub fn require_token(&self, token: Option<&str>) {
        self.store(|s| s.faults.token = token.map(str::to_string));
    }

    /// A server that hangs (`on`) or answers again: while it hangs, every list, watch and
    /// Event request waits unanswered and open watches send nothing (what happened
    /// meanwhile follows once it answers again). Connections stay open, as with an API
    /// server stuck behind a load balancer that still accepts.
    pub fn hang(&self, on: bool) {
        self.store(|s| s.faults.hung = on);
        if !on {
            self.shared.released.notify_waiters();
        }
    }

    /// Answers the next list of `kind` (its first page) with `body` verbatim, status 200:
    /// whatever bytes a broken or hostile server might send (the fuzzer's mutated lists).
    pub fn raw_list(&self, kind: Kind, body: impl Into<Bytes>) {
        self.store(|s| s.faults.raw_lists.push((kind, body.into())));
    }

    /// Streams `bytes` verbatim first on the next watch of `kind` (garbage lines, lines
    /// cut short, events of any shape), then serves that watch as usual; open watches are
    /// broken so that one comes.
    pub fn raw_watch(&self, kind: Kind, bytes: impl Into<Bytes>) {
        self.store(|s| s.faults.raw_watches.push((kind, bytes.into())));
        self.break_watches();
    }

    /// Raw answers queued and not yet sent.
    pub fn raw_pending(&self) -> usize {
        self.store(|s| s.faults.raw_lists.len() + s.faults.raw_watches.len())
    }

    /// Ends the storm and drops pending throttles and huge events (the token stays).
    pub fn clear_faults(&self) {
        self.store(|s| {
            s.faults.gone_storm = false;
            s.faults.hung = false;
            s.faults.throttles.clear();
            s.faults.huge.clear();
            s.faults.raw_lists.clear();
            s.faults.raw_watches.clear();
        });
        self.shared.released.notify_waiters();
    }
}

impl Shared {
    /// Returns once the server no longer hangs (at once when it does not).
    async fn while_hung(&self) {
        loop {
            // Registered before the flag is read, so a release in between is not missed.
            let released = self.released.notified();
            if !self.lock().faults.hung {
                return;
            }
            released.await;
        }
    }
}

fn bookmark_event(kind: Kind, rv: u64) -> Event {
    let object = json!({"kind": kind.kind(), "apiVersion": kind.api_version(),
                        "metadata": {"resourceVersion": rv.to_string()}});
    Event {
        kind,
        rv,
        type_: "BOOKMARK",
        object: Arc::new(Stored::new(&object)),
    }
}

async fn handle_version() -> Response {
    axum::Json(
        json!({"major": "1", "minor": "34", "gitVersion": "v1.34.0-fake",
                      "gitCommit": "", "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z",
                      "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"}),
    )
    .into_response()
}

async fn handle_event(
    State(shared): State<Arc<Shared>>,
    axum::Json(event): axum::Json<Value>,
) -> Response {
    shared.lock().event_posts += 1;
    shared.while_hung().await;
    loop {
        // Registered before the flag is read, so a release in between is not missed.
        let released = shared.released.notified();
        if !shared.lock().events_held {
            break;
        }
        released.await;
    }
    shared.lock().events.push(event.clone());
    (StatusCode::CREATED, axum::Json(event)).into_response()
}

async fn handle_core(
    State(shared): State<Arc<Shared>>,
    Path(resource): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let kind = match resource.as_str() {
        "services" => Kind::Services,
        "nodes" => Kind::Nodes,
        _ => return (StatusCode::NOT_FOUND, "").into_response(),
    };
    handle(shared, kind, resource, q).await
}

async fn handle_discovery(
    State(shared): State<Arc<Shared>>,
    Path(resource): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    if resource != "endpointslices" {
        return (StatusCode::NOT_FOUND, "").into_response();
    }
    handle(shared, Kind::EndpointSlices, resource, q).await
}

/// The field selector `metadata.name=` and label selectors made of `key`, `!key` and
/// `key=value` terms, as the API server applies them.
fn matches_selector(obj: &Stored, q: &BTreeMap<String, String>) -> bool {
    let labels_match = q.get("labelSelector").is_none_or(|sel| {
        sel.split(',').filter(|t| !t.is_empty()).all(|term| {
            if let Some(key) = term.strip_prefix('!') {
                !obj.labels.contains_key(key)
            } else if let Some((k, v)) = term.split_once('=') {
                obj.labels.get(k).map(String::as_str) == Some(v)
            } else {
                obj.labels.contains_key(term)
            }
        })
    });
    labels_match
        && match q
            .get("fieldSelector")
            .and_then(|f| f.strip_prefix("metadata.name="))
        {
            Some(name) => obj.name == name,
            None => true,
        }
}

/// A `Status` answer, as the API server sends errors.
fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": reason, "code": code.as_u16()});
    (code, axum::Json(body)).into_response()
}

/// The API server's answer to a resourceVersion newer than it has
/// (`storage.NewTooLargeResourceVersionError`): 504 Timeout, cause
/// ResourceVersionTooLarge.
fn too_large(requested: u64, current: u64) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": format!("Too large resource version: {requested}, current: {current}"),
                      "reason": "Timeout", "code": 504,
                      "details": {"causes": [{"reason": "ResourceVersionTooLarge",
                                              "message": "Too large resource version"}],
                                  "retryAfterSeconds": 1}});
    (StatusCode::GATEWAY_TIMEOUT, axum::Json(body)).into_response()
}

/// Refuses a request without the required bearer token, as the API server does (401).
async fn authorize(
    State(shared): State<Arc<Shared>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let wanted = shared.lock().faults.token.clone();
    if let Some(token) = wanted {
        let given = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if given != Some(format!("Bearer {token}").as_str()) {
            shared.lock().unauthorized += 1;
            return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
        }
    }
    next.run(request).await
}

/// The first raw answer queued for `kind`, taken off the queue.
fn take_raw(queue: &mut Vec<(Kind, Bytes)>, kind: Kind) -> Option<Bytes> {
    let i = queue.iter().position(|(k, _)| *k == kind)?;
    Some(queue.remove(i).1)
}

/// The throttle answer due for this request of `kind`, if any (logged as served).
fn throttled(shared: &Shared, kind: Kind, resource: &str, watch: bool) -> Option<Response> {
    let mut s = shared.lock();
    let i = s.faults.throttles.iter().position(|(k, _)| *k == kind)?;
    let throttle = s.faults.throttles[i].1.clone();
    if throttle.times <= 1 {
        s.faults.throttles.remove(i);
    } else {
        s.faults.throttles[i].1.times -= 1;
    }
    if throttle.times == 0 {
        return None;
    }
    s.served.push(Served {
        at: std::time::Instant::now(),
        resource: resource.to_string(),
        watch,
        code: throttle.code,
    });
    drop(s);
    let code = StatusCode::from_u16(throttle.code).unwrap_or(StatusCode::TOO_MANY_REQUESTS);
    let reason = if code == StatusCode::TOO_MANY_REQUESTS {
        "TooManyRequests"
    } else {
        "InternalError"
    };
    let mut answer = status(code, reason, "the server is throttling this client");
    if let Some(after) = throttle.retry_after {
        let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        answer.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(secs),
        );
    }
    Some(answer)
}

/// A continue token: the resourceVersion of the list's first page and the last key
/// served. Later pages hold the objects as they are then (not a snapshot, unlike etcd);
/// the list's resourceVersion stays the first page's, so a watch from it replays every
/// change made since and nothing is lost.
fn continue_token(rv: u64, last_key: &str) -> String {
    format!("{rv}:{last_key}")
}

fn parse_continue(token: &str) -> Option<(u64, String)> {
    let (rv, key) = token.split_once(':')?;
    Some((rv.parse().ok()?, key.to_string()))
}

async fn handle(
    shared: Arc<Shared>,
    kind: Kind,
    resource: String,
    q: BTreeMap<String, String>,
) -> Response {
    shared.while_hung().await;
    let is_watch = q.get("watch").map(String::as_str) == Some("true");
    let first_page = q.get("continue").is_none_or(String::is_empty);
    if (is_watch || first_page)
        && let Some(answer) = throttled(&shared, kind, &resource, is_watch)
    {
        return answer;
    }
    if is_watch {
        return watch(shared, kind, resource, q);
    }
    if first_page && let Some(body) = take_raw(&mut shared.lock().faults.raw_lists, kind) {
        return (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
    }
    loop {
        let held = shared.lock().held.contains(&kind);
        if !held {
            break;
        }
        shared.released.notified().await;
    }
    let limit: Option<usize> = match q.get("limit").map(|l| l.parse()) {
        None => None,
        Some(Ok(0)) => None,
        Some(Ok(l)) => Some(l),
        Some(Err(_)) => return status(StatusCode::BAD_REQUEST, "BadRequest", "invalid limit"),
    };
    let resume = match q.get("continue").filter(|c| !c.is_empty()) {
        None => None,
        Some(token) => match parse_continue(token) {
            Some(r) => Some(r),
            None => {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "invalid continue token",
                );
            }
        },
    };
    let (rv, items, next) = {
        let mut s = shared.lock();
        if let Some((rv, _)) = &resume
            && *rv < s.expired_before
        {
            return status(
                StatusCode::GONE,
                "Expired",
                "the provided continue parameter is too old to display a consistent list \
                 result; you can start a new list without the continue parameter",
            );
        }
        if resume.is_none()
            && let Some(asked) = q.get("resourceVersion").and_then(|v| v.parse::<u64>().ok())
            && asked > s.rv
        {
            let current = s.rv;
            s.served.push(Served {
                at: std::time::Instant::now(),
                resource: resource.clone(),
                watch: false,
                code: 504,
            });
            return too_large(asked, current);
        }
        *s.pages_served.entry(resource.clone()).or_insert(0) += 1;
        if resume.is_none() {
            let selector = q.get("labelSelector").cloned().unwrap_or_default();
            s.label_selectors.insert(resource.clone(), selector);
            *s.lists_served.entry(resource.clone()).or_insert(0) += 1;
            s.served.push(Served {
                at: std::time::Instant::now(),
                resource: resource.clone(),
                watch: false,
                code: 200,
            });
        }
        let rv = resume.as_ref().map_or(s.rv, |(rv, _)| *rv);
        let from = match &resume {
            Some((_, last)) => std::ops::Bound::Excluded((kind, last.clone())),
            None => std::ops::Bound::Included((kind, String::new())),
        };
        let mut matching = s
            .objects
            .range((from, std::ops::Bound::Unbounded))
            .take_while(|((k, _), _)| *k == kind)
            .filter(|(_, o)| matches_selector(o, &q));
        let mut items: Vec<(String, Arc<Stored>)> = Vec::new();
        let mut more = false;
        for ((_, k), o) in matching.by_ref() {
            if limit.is_some_and(|l| items.len() >= l) {
                more = true;
                break;
            }
            items.push((k.clone(), o.clone()));
        }
        let next = more
            .then(|| items.last().map(|(k, _)| continue_token(rv, k)))
            .flatten();
        if next.is_none() {
            *s.lists_completed.entry(resource).or_insert(0) += 1;
        }
        (rv, items, next)
    };
    // The body is built outside the lock, from the stored bytes.
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if let Some(next) = next {
        metadata["continue"] = json!(next);
    }
    let size: usize = items.iter().map(|(_, o)| o.json.len() + 1).sum();
    let mut body = Vec::with_capacity(size + 256);
    body.extend_from_slice(
        format!(
            "{{\"kind\":\"{}\",\"apiVersion\":\"{}\",\"metadata\":{metadata},\"items\":[",
            kind.list_kind(),
            kind.api_version()
        )
        .as_bytes(),
    );
    for (i, (_, o)) in items.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(&o.json);
    }
    body.extend_from_slice(b"]}");
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

fn watch(
    shared: Arc<Shared>,
    kind: Kind,
    resource: String,
    q: BTreeMap<String, String>,
) -> Response {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map(Duration::from_secs);
    let (backlog, answer, huge, raw, events, breaks) = {
        let mut s = shared.lock();
        *s.watches_served.entry(resource.clone()).or_insert(0) += 1;
        let answer = if s.faults.gone_storm {
            WatchAnswer::GoneEvent
        } else if from > s.rv {
            WatchAnswer::TooLarge(s.rv)
        } else if from < s.expired_before {
            if s.faults.gone_on_request {
                WatchAnswer::GoneRequest
            } else {
                WatchAnswer::GoneEvent
            }
        } else {
            WatchAnswer::Stream
        };
        let huge = match answer {
            WatchAnswer::Stream => s
                .faults
                .huge
                .iter()
                .position(|(k, _)| *k == kind)
                .map(|i| s.faults.huge.remove(i).1),
            _ => None,
        };
        let code = match answer {
            WatchAnswer::TooLarge(_) => 504,
            WatchAnswer::GoneRequest => 410,
            WatchAnswer::GoneEvent | WatchAnswer::Stream => 200,
        };
        s.served.push(Served {
            at: std::time::Instant::now(),
            resource,
            watch: true,
            code,
        });
        let start = s.history.partition_point(|e| e.rv <= from);
        let backlog: Vec<Event> = s
            .history
            .range(start..)
            .filter(|e| e.kind == kind)
            .cloned()
            .collect();
        let huge = huge.map(|len| (len, s.rv));
        let raw = match answer {
            WatchAnswer::Stream => take_raw(&mut s.faults.raw_watches, kind),
            _ => None,
        };
        // Subscribed under the lock: no event falls between the backlog and the stream.
        (
            backlog,
            answer,
            huge,
            raw,
            shared.events.subscribe(),
            shared.breaks.subscribe(),
        )
    };
    match answer {
        WatchAnswer::Stream => {}
        WatchAnswer::TooLarge(current) => return too_large(from, current),
        WatchAnswer::GoneRequest => {
            return status(StatusCode::GONE, "Expired", "too old resource version");
        }
        WatchAnswer::GoneEvent => {
            let status = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "message": "too old resource version", "reason": "Expired", "code": 410}});
            return Response::new(Body::from(format!("{status}\n")));
        }
    }
    let huge = futures::StreamExt::chain(
        futures::stream::iter(raw.map(Ok::<_, Infallible>)),
        futures::StreamExt::flatten(futures::stream::iter(
            huge.map(|(len, rv)| huge_line(kind, rv, len)),
        )),
    );
    let first: Vec<Result<Bytes, Infallible>> = backlog
        .iter()
        .filter(|e| matches_selector(&e.object, &q))
        .map(|e| Ok(e.line()))
        .collect();
    let live = futures::stream::unfold(
        Live {
            kind,
            from,
            q,
            bookmarks,
            deadline: timeout.map(|t| tokio::time::Instant::now() + t),
            tick: shared
                .options
                .bookmark_every
                .filter(|_| bookmarks)
                .map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every)),
            events,
            breaks,
            shared,
        },
        Live::next,
    );
    let stream = futures::StreamExt::chain(
        futures::StreamExt::chain(huge, futures::stream::iter(first)),
        live,
    );
    Response::new(Body::from_stream(stream))
}

/// How a watch request is answered.
#[derive(Clone, Copy)]
enum WatchAnswer {
    Stream,
    /// A 410 Gone ERROR event, then the end of the stream.
    GoneEvent,
    /// An HTTP 410 answer to the request.
    GoneRequest,
    /// 504 ResourceVersionTooLarge; the server's current resourceVersion.
    TooLarge(u64),
}

/// One MODIFIED event line of `len` bytes, made in 64 KiB chunks as it is sent.
fn huge_line(
    kind: Kind,
    rv: u64,
    len: usize,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> + use<> {
    static FILLER: [u8; 64 * 1024] = [b'x'; 64 * 1024];
    let head = format!(
        "{{\"type\":\"MODIFIED\",\"object\":{{\"apiVersion\":\"{}\",\"kind\":\"{}\",\
         \"metadata\":{{\"name\":\"huge\",\"namespace\":\"default\",\"resourceVersion\":\"{rv}\",\
         \"annotations\":{{\"filler\":\"",
        kind.api_version(),
        kind.kind()
    );
    let tail: &'static [u8] = b"\"}}}}\n";
    let filler = len.saturating_sub(head.len() + tail.len());
    let (whole, rest) = (filler / FILLER.len(), filler % FILLER.len());
    let chunks = std::iter::once(Bytes::from(head))
        .chain((0..whole).map(|_| Bytes::from_static(&FILLER)))
        .chain(std::iter::once(Bytes::from_static(&FILLER[..rest])))
        .chain(std::iter::once(Bytes::from_static(tail)))
        .map(Ok);
    futures::stream::iter(chunks)
}

/// The serving certificate and its CA, made for one server.
struct Pki {
    ca: rcgen::Certificate,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl Pki {
    fn new() -> anyhow::Result<Self> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
            SanType,
        };
        use tokio_rustls::rustls::{self, pki_types::PrivateKeyDer};
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        // A name of its own: another server's CA is then an unknown issuer, not a
        // namesake whose signature fails.
        static SERVERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SERVERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ca_params.distinguished_name.push(
            DnType::CommonName,
            format!("fake-apiserver-ca-{}-{n}", std::process::id()),
        );
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate()?;
        let ca = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let mut params = CertificateParams::new(vec!["localhost".to_string()])?;
        params
            .subject_alt_names
            .push(SanType::IpAddress(Ipv4Addr::LOCALHOST.into()));
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )?;
        Ok(Self {
            ca,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        })
    }
}

/// The HTTPS accept loop: a handshake per connection, then HTTP/1.1 to the router.
async fn serve_tls(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    shared: Arc<Shared>,
) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true); // as over plain HTTP, above
        let (acceptor, app, shared) = (acceptor.clone(), app.clone(), shared.clone());
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                shared
                    .tls_failures
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return;
            };
            let service = hyper_util::service::TowerToHyperService::new(app);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                .await;
        });
    }
}

/// An open watch after its backlog: live events of its kind that match its selectors,
/// bookmarks if asked, until `timeoutSeconds` or a break.
struct Live {
    kind: Kind,
    from: u64,
    q: BTreeMap<String, String>,
    bookmarks: bool,
    deadline: Option<tokio::time::Instant>,
    tick: Option<tokio::time::Interval>,
    events: broadcast::Receiver<Event>,
    breaks: broadcast::Receiver<()>,
    shared: Arc<Shared>,
}

impl Live {
    async fn next(mut self) -> Option<(Result<Bytes, Infallible>, Self)> {
        loop {
            let deadline = self.deadline;
            let timed_out = async move {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            let tick = self.tick.as_mut();
            let ticked = async move {
                match tick {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending().await,
                }
            };
            let line = tokio::select! {
                // A break first: a watch broken (a restore, a restart) sends nothing after.
                biased;
                _ = self.breaks.recv() => return None,
                () = timed_out => return None,
                () = ticked => {
                    let rv = self.shared.lock().rv;
                    bookmark_event(self.kind, rv).line()
                }
                e = self.events.recv() => match e {
                    Ok(e) if e.kind != self.kind => continue,
                    Ok(e) if e.type_ == "BOOKMARK" => {
                        if !self.bookmarks {
                            continue;
                        }
                        e.line()
                    }
                    Ok(e) if e.rv > self.from && matches_selector(&e.object, &self.q) => e.line(),
                    Ok(_) => continue,
                    // Lagged or closed: the client resumes from its last resourceVersion.
                    Err(_) => return None,
                },
            };
            // A hung server sends nothing; a break while it hangs is seen after.
            self.shared.while_hung().await;
            return Some((Ok(line), self));
        }
    }
}

/// A cluster of `services` ClusterIP Services (TCP 80 → 8080), each with one
/// EndpointSlice of `endpoints` ready endpoints, and the churn a rollout makes: one
/// endpoint's address replaced by a fresh one, the slice stamped with the time of the
/// change (`endpoints.kubernetes.io/last-change-trigger-time`), as the EndpointSlice
/// controller does.
///
/// Addresses: Service `i` is 172.16.0.0 + i (up to 2^20 Services); initial endpoints are
/// 10.0.0.0 + k; fresh ones start at [`Population::FRESH_BASE`], so any address in a view
/// at or above it was written by a change.
pub struct Population {
    services: usize,
    endpoints: usize,
    /// Endpoint `j` of slice `i` at `i * endpoints + j`.
    addresses: Vec<u32>,
    changes: u64,
}

/// One change the churn made.
#[derive(Clone, Debug)]
pub struct Change {
    pub seq: u64,
    /// The slice's index.
    pub slice: usize,
    /// The fresh endpoint address.
    pub address: Ipv4Addr,
    /// When the change was made: the slice's trigger time.
    pub trigger: SystemTime,
}

/// The trigger-time annotation.
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

impl Population {
    /// The first fresh address (10.128.0.0).
    pub const FRESH_BASE: Ipv4Addr = Ipv4Addr::new(10, 128, 0, 0);
    /// How many nodes the endpoints' `nodeName`s spread over (the bench's node is none of
    /// them: every endpoint is remote).
    const NODES: usize = 50;

    pub fn new(services: usize, endpoints: usize) -> Self {
        let base = u32::from(Ipv4Addr::new(10, 0, 0, 0));
        Self {
            services,
            endpoints,
            addresses: (0..services * endpoints).map(|k| base + k as u32).collect(),
            changes: 0,
        }
    }

    /// Whether `ip` is one a change wrote (10.128.0.0/9).
    pub fn is_fresh(ip: Ipv4Addr) -> bool {
        u32::from(ip) >= u32::from(Self::FRESH_BASE)
            && u32::from(ip) <= u32::from(Ipv4Addr::new(10, 255, 255, 255))
    }

    pub fn services(&self) -> usize {
        self.services
    }

    /// Service `i`'s ClusterIP.
    pub fn cluster_ip(i: usize) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(Ipv4Addr::new(172, 16, 0, 0)) + i as u32)
    }

    pub fn service(&self, i: usize) -> Value {
        let ip = Self::cluster_ip(i).to_string();
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": format!("s{i}"), "namespace": "default", "uid": format!("svc-uid-{i}"),
                            "labels": {"app": format!("s{i}")}},
               "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                        "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                        "selector": {"app": format!("s{i}")}, "sessionAffinity": "None",
                        "internalTrafficPolicy": "Cluster",
                        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}})
    }

    /// Slice `i` as it is now; `trigger` stamps it.
    pub fn slice(&self, i: usize, trigger: Option<SystemTime>) -> Value {
        let endpoints: Vec<Value> = (0..self.endpoints)
            .map(|j| {
                let k = i * self.endpoints + j;
                json!({"addresses": [Ipv4Addr::from(self.addresses[k]).to_string()],
                       "conditions": {"ready": true, "serving": true, "terminating": false},
                       "nodeName": format!("node-{}", k % Self::NODES),
                       "targetRef": {"kind": "Pod", "namespace": "default", "name": format!("s{i}-pod-{j}")}})
            })
            .collect();
        let mut metadata = json!({"name": format!("s{i}-abcde"), "namespace": "default",
            "generateName": format!("s{i}-"),
            "labels": {"kubernetes.io/service-name": format!("s{i}"),
                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}});
        if let Some(t) = trigger {
            metadata["annotations"] = json!({ TRIGGER_TIME: rfc3339(t) });
        }
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": metadata,
               "addressType": "IPv4",
               "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
               "endpoints": endpoints})
    }

    /// Puts every Service and slice into `server` (no history: clients list them).
    pub fn load(&self, server: &FakeApiServer) {
        server.preload(Kind::Services, (0..self.services).map(|i| self.service(i)));
        server.preload(
            Kind::EndpointSlices,
            (0..self.services).map(|i| self.slice(i, None)),
        );
    }

    /// Makes the next change in `server`: slices in an order spread over the key space,
    /// each endpoint of a slice in turn, every address fresh.
    pub fn change(&mut self, server: &FakeApiServer) -> Change {
        let seq = self.changes;
        self.changes += 1;
        let n = self.services as u64;
        // A stride coprime with n visits every slice once per n changes.
        let stride = [7919u64, 7907, 7901, 1]
            .into_iter()
            .find(|s| gcd(*s, n) == 1)
            .unwrap_or(1);
        let slice = ((seq * stride) % n) as usize;
        let j = ((seq / n) % self.endpoints as u64) as usize;
        let address = Ipv4Addr::from(u32::from(Self::FRESH_BASE) + seq as u32);
        self.addresses[slice * self.endpoints + j] = u32::from(address);
        let trigger = SystemTime::now();
        server.apply(Kind::EndpointSlices, self.slice(slice, Some(trigger)));
        Change {
            seq,
            slice,
            address,
            trigger,
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// RFC 3339 in UTC with microseconds, as the EndpointSlice controller writes times.
pub fn rfc3339(t: SystemTime) -> String {
    k8s_openapi::chrono::DateTime::<k8s_openapi::chrono::Utc>::from(t)
        .to_rfc3339_opts(k8s_openapi::chrono::SecondsFormat::Micros, true)
}

/// The node object for `name`, with one InternalIP.
pub fn node(name: &str, ip: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
           "status": {"addresses": [{"type": "InternalIP", "address": ip}]}})
}

impl FakeApiServer {
    /// Makes `per_second` changes a second for `duration` (catching up if it falls
    /// behind), handing each to `made` as it is made.
    pub async fn churn(
        &self,
        population: &mut Population,
        per_second: f64,
        duration: Duration,
        mut made: impl FnMut(Change),
    ) {
        let total = (per_second * duration.as_secs_f64()).round() as u64;
        if total == 0 || population.services == 0 {
            return;
        }
        let period = Duration::from_secs_f64(1.0 / per_second);
        let mut tick = tokio::time::interval(period);
        for _ in 0..total {
            tick.tick().await;
            made(population.change(self));
        }
    }
}
