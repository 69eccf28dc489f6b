//! The fake API server's paging, watch and churn, through kube's own client and watcher
//! (the agent's), so the benchmark's stand-in is known to speak as the API server does.

use std::{collections::BTreeSet, time::Duration};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api,
    api::{ListParams, ObjectList},
    runtime::watcher,
};
use serde_json::json;

use crate::fake_apiserver::{
    FakeApiServer, Kind, OldVersions, Options, Population, TRIGGER_TIME, Throttle,
};

const SELECTOR: &str = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name";

/// 1234 Services, every tenth headless (left out by kube-proxy's selector).
fn services(server: &FakeApiServer) -> BTreeSet<String> {
    let population = Population::new(1234, 1);
    let mut expected = BTreeSet::new();
    server.preload(
        Kind::Services,
        (0..1234).map(|i| {
            let mut s = population.service(i);
            if i % 10 == 0 {
                s["metadata"]["labels"]["service.kubernetes.io/headless"] = json!("");
            } else {
                expected.insert(format!("s{i}"));
            }
            s
        }),
    );
    expected
}

async fn page(api: &Api<Service>, token: Option<String>) -> ObjectList<Service> {
    let mut lp = ListParams::default().labels(SELECTOR).limit(500);
    lp.continue_token = token;
    api.list(&lp).await.expect("list page")
}

#[tokio::test]
async fn a_paged_list_returns_every_selected_object_once() {
    let server = FakeApiServer::start().await;
    let expected = services(&server);
    let api: Api<Service> = Api::all(server.client());
    let mut names = Vec::new();
    let mut token = None;
    let mut versions = BTreeSet::new();
    let mut pages = 0;
    loop {
        let list = page(&api, token).await;
        pages += 1;
        assert!(list.items.len() <= 500);
        versions.insert(list.metadata.resource_version.clone());
        names.extend(list.items.iter().filter_map(|s| s.metadata.name.clone()));
        token = list.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            break;
        }
        assert_eq!(list.items.len(), 500, "only the last page is short");
    }
    assert_eq!(pages, expected.len().div_ceil(500));
    assert_eq!(names.len(), expected.len(), "an object served twice");
    assert_eq!(names.into_iter().collect::<BTreeSet<_>>(), expected);
    // One list, one resourceVersion: the first page's.
    assert_eq!(versions.len(), 1, "{versions:?}");
    assert_eq!(server.lists_served("services"), 1);
    assert_eq!(server.pages_served("services"), pages as u64);
    assert_eq!(server.lists_completed("services"), 1);
    assert_eq!(server.label_selector("services"), SELECTOR);
    // No limit: everything at once.
    let all = api.list(&ListParams::default().labels(SELECTOR)).await;
    assert_eq!(all.expect("list").items.len(), expected.len());
}

/// Later pages hold objects as they are then; the list's resourceVersion stays the first
/// page's, so a watch from it replays a change made between pages.
#[tokio::test]
async fn a_change_between_pages_reaches_a_watch_from_the_lists_version() {
    let server = FakeApiServer::start().await;
    services(&server);
    let api: Api<Service> = Api::all(server.client());
    let first = page(&api, None).await;
    let rv = first.metadata.resource_version.clone().expect("rv");
    let served = first.items[0].metadata.name.clone().expect("name");
    let i: usize = served.trim_start_matches('s').parse().expect("index");
    let mut changed = Population::new(1234, 1).service(i);
    changed["metadata"]["labels"]["changed"] = json!("yes");
    server.apply(Kind::Services, changed);
    let second = page(&api, first.metadata.continue_.clone()).await;
    assert_eq!(
        second.metadata.resource_version.as_deref(),
        Some(rv.as_str())
    );
    let params = kube::api::WatchParams::default()
        .labels(SELECTOR)
        .timeout(5);
    let mut stream = api.watch(&params, &rv).await.expect("watch").boxed();
    let event = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
        .await
        .expect("an event in time")
        .expect("a good event")
        .expect("an event");
    match event {
        kube::api::WatchEvent::Modified(s) => {
            assert_eq!(s.metadata.name.as_deref(), Some(served.as_str()));
            assert_eq!(
                s.metadata.labels.unwrap_or_default().get("changed"),
                Some(&"yes".to_string())
            );
        }
        other => panic!("expected MODIFIED, got {other:?}"),
    }
}

#[tokio::test]
async fn an_expired_continue_token_is_410_gone() {
    let server = FakeApiServer::start().await;
    services(&server);
    let api: Api<Service> = Api::all(server.client());
    let first = page(&api, None).await;
    server.expire_history();
    let mut lp = ListParams::default().labels(SELECTOR).limit(500);
    lp.continue_token = first.metadata.continue_;
    match api.list(&lp).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 410, "{e:?}"),
        other => panic!("expected 410 Gone, got {other:?}"),
    }
}

/// kube-runtime's watcher with its defaults (the agent's): the initial list in pages of
/// 500, then a watch.
#[tokio::test]
async fn kubes_watcher_lists_in_pages_then_watches() {
    let server = FakeApiServer::start().await;
    let mut population = Population::new(1234, 3);
    population.load(&server);
    let api: Api<EndpointSlice> = Api::all(server.client());
    let mut events = watcher(api, watcher::Config::default().labels(SELECTOR)).boxed();
    let mut applied = 0;
    loop {
        let e = tokio::time::timeout(Duration::from_secs(10), events.try_next())
            .await
            .expect("the initial list in time")
            .expect("no watcher error")
            .expect("an event");
        match e {
            watcher::Event::InitApply(_) => applied += 1,
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(applied, 1234);
    assert_eq!(server.pages_served("endpointslices"), 3);
    // The churn's change arrives through the watch, stamped.
    let change = population.change(&server);
    let e = tokio::time::timeout(Duration::from_secs(10), events.try_next())
        .await
        .expect("the change in time")
        .expect("no watcher error")
        .expect("an event");
    let watcher::Event::Apply(slice) = e else {
        panic!("expected an Apply, got {e:?}");
    };
    assert_eq!(
        slice.metadata.name.as_deref(),
        Some(format!("s{}-abcde", change.slice).as_str())
    );
    let addresses: Vec<String> = slice
        .endpoints
        .iter()
        .flat_map(|e| e.addresses.clone())
        .collect();
    assert!(
        addresses.contains(&change.address.to_string()),
        "{addresses:?}"
    );
    let stamp = slice
        .metadata
        .annotations
        .unwrap_or_default()
        .get(TRIGGER_TIME)
        .cloned()
        .expect("trigger time");
    let parsed = k8s_openapi::chrono::DateTime::parse_from_rfc3339(&stamp).expect("RFC 3339");
    let made = k8s_openapi::chrono::DateTime::<k8s_openapi::chrono::Utc>::from(change.trigger);
    assert!(
        (made - parsed.to_utc()).num_microseconds() == Some(0),
        "{stamp}"
    );
    assert_eq!(server.watches_served("endpointslices"), 1);
}

/// Periodic bookmarks go to watches that asked for them, and only to those.
#[tokio::test]
async fn bookmarks_only_when_asked() {
    let server = FakeApiServer::try_start(Options {
        bookmark_every: Some(Duration::from_millis(100)),
    })
    .await
    .expect("start");
    let get = |bookmarks: bool| {
        let addr = server.addr;
        async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let path = format!(
                "/api/v1/services?watch=true&resourceVersion=0&timeoutSeconds=1&allowWatchBookmarks={bookmarks}"
            );
            s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
                .await
                .expect("write");
            let mut out = String::new();
            s.read_to_string(&mut out).await.expect("read");
            out
        }
    };
    let (with, without) = tokio::join!(get(true), get(false));
    assert!(with.contains("\"type\":\"BOOKMARK\""), "{with}");
    assert!(!without.contains("BOOKMARK"), "{without}");
}

// The fault injector.

/// A GET over HTTP/1.0 (the answer ends with the connection): status, head, body.
async fn raw_get(server: &FakeApiServer, path: &str, headers: &str) -> (u16, String, Vec<u8>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    s.write_all(format!("GET {path} HTTP/1.0\r\n{headers}\r\n").as_bytes())
        .await
        .expect("write");
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.expect("read");
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let head = String::from_utf8_lossy(&out[..split]).to_lowercase();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status");
    (code, head, out[split + 4..].to_vec())
}

fn web() -> serde_json::Value {
    Population::new(1, 1).service(0)
}

#[tokio::test]
async fn a_410_storm_answers_every_watch_gone_until_cleared() {
    let server = FakeApiServer::start().await;
    server.apply(Kind::Services, web());
    let watch = "/api/v1/services?watch=true&resourceVersion=101&timeoutSeconds=1";
    server.gone_storm(true);
    for _ in 0..2 {
        let (code, _, body) = raw_get(&server, watch, "").await;
        let body = String::from_utf8_lossy(&body).into_owned();
        assert_eq!(code, 200);
        assert!(
            body.contains("\"type\":\"ERROR\"") && body.contains("\"code\":410"),
            "{body}"
        );
    }
    server.clear_faults();
    let (_, _, body) = raw_get(&server, watch, "").await;
    assert!(!String::from_utf8_lossy(&body).contains("ERROR"));
    let codes: Vec<u16> = server.served("services").iter().map(|s| s.code).collect();
    assert_eq!(codes, [200, 200, 200], "an ERROR event is a 200 answer");
}

/// A hung server answers no list and sends nothing on an open watch until it answers
/// again; then the list is served and the watch delivers what happened meanwhile.
#[tokio::test]
async fn a_hung_server_answers_nothing_until_it_answers_again() {
    let server = FakeApiServer::start().await;
    server.apply(Kind::Services, web());
    let api: Api<Service> = Api::all(server.client());
    let rv = api
        .list(&ListParams::default())
        .await
        .expect("list")
        .metadata
        .resource_version
        .expect("rv");
    let watch = format!("/api/v1/services?watch=true&resourceVersion={rv}&timeoutSeconds=2");
    server.hang(true);
    let (s2, w2) = (server.clone(), watch.clone());
    let watching = tokio::spawn(async move { raw_get(&s2, &w2, "").await });
    let api2 = api.clone();
    let listing = tokio::spawn(async move { api2.list(&ListParams::default()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.apply(Kind::Services, Population::new(2, 1).service(1));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !listing.is_finished(),
        "a list answered while the server hangs"
    );
    assert!(
        !watching.is_finished(),
        "a watch answered while the server hangs"
    );
    server.hang(false);
    let list = tokio::time::timeout(Duration::from_secs(5), listing)
        .await
        .expect("the list answered once the server does")
        .expect("join")
        .expect("list");
    assert_eq!(list.items.len(), 2);
    let (code, _, body) = tokio::time::timeout(Duration::from_secs(5), watching)
        .await
        .expect("the watch answered once the server does")
        .expect("join");
    let body = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(code, 200);
    assert!(
        body.contains("\"type\":\"ADDED\"") && body.contains("\"s1\""),
        "{body}"
    );
}

/// After a restore the old resourceVersions are answered as the API server answers them,
/// and a list from "" serves the backup.
#[tokio::test]
async fn a_restore_answers_old_resource_versions_too_large_or_gone() {
    for old in [OldVersions::TooLarge, OldVersions::Gone] {
        let server = FakeApiServer::start().await;
        server.apply(Kind::Services, web());
        let api: Api<Service> = Api::all(server.client());
        let rv = api
            .list(&ListParams::default())
            .await
            .expect("list")
            .metadata
            .resource_version
            .expect("rv");
        let mut other = Population::new(2, 1).service(1);
        other["metadata"]["resourceVersion"] = json!("1");
        server.restore([(Kind::Services, other)], old);
        let (code, _, body) = raw_get(
            &server,
            &format!("/api/v1/services?watch=true&resourceVersion={rv}"),
            "",
        )
        .await;
        let status: serde_json::Value = serde_json::from_slice(&body).expect("a Status");
        match old {
            OldVersions::TooLarge => {
                assert_eq!(code, 504, "{status}");
                assert_eq!(status["reason"], "Timeout");
                assert_eq!(
                    status["details"]["causes"][0]["reason"],
                    "ResourceVersionTooLarge"
                );
                assert!(
                    status["message"]
                        .as_str()
                        .is_some_and(|m| m.starts_with("Too large resource version")),
                    "{status}"
                );
            }
            OldVersions::Gone => {
                assert_eq!(code, 410, "{status}");
                assert_eq!(status["reason"], "Expired");
            }
        }
        let listed = api.list(&ListParams::default()).await.expect("list");
        let names: Vec<_> = listed
            .items
            .iter()
            .filter_map(|s| s.metadata.name.clone())
            .collect();
        assert_eq!(names, ["s1"], "{old:?}");
        // A watch from the new list's version is served.
        let new_rv = listed.metadata.resource_version.expect("rv");
        let (code, _, _) = raw_get(
            &server,
            &format!("/api/v1/services?watch=true&resourceVersion={new_rv}&timeoutSeconds=1"),
            "",
        )
        .await;
        assert_eq!(code, 200, "{old:?}");
    }
}

#[tokio::test]
async fn a_huge_event_is_one_line_of_the_asked_length_then_the_watch_goes_on() {
    let server = FakeApiServer::start().await;
    server.apply(Kind::Services, web());
    let len = 5 * 1024 * 1024 + 7;
    server.huge_event(Kind::Services, len);
    let (code, _, body) = raw_get(
        &server,
        "/api/v1/services?watch=true&resourceVersion=101&timeoutSeconds=1",
        "",
    )
    .await;
    assert_eq!(code, 200);
    let first = body.split(|b| *b == b'\n').next().expect("a line");
    assert_eq!(first.len() + 1, len, "the line and its newline");
    let event: serde_json::Value = serde_json::from_slice(first).expect("JSON");
    assert_eq!(event["type"], "MODIFIED");
    assert_eq!(event["object"]["kind"], "Service");
    assert_eq!(event["object"]["metadata"]["name"], "huge");
    // Once: the next watch has none.
    let (_, _, body) = raw_get(
        &server,
        "/api/v1/services?watch=true&resourceVersion=101&timeoutSeconds=1",
        "",
    )
    .await;
    assert!(body.len() < 1024, "{} bytes", body.len());
}

#[tokio::test]
async fn throttled_requests_get_the_code_and_retry_after_then_are_served() {
    let server = FakeApiServer::start().await;
    server.throttle(
        Kind::Services,
        Throttle {
            code: 429,
            retry_after: Some(Duration::from_millis(1500)),
            times: 2,
        },
    );
    for _ in 0..2 {
        let (code, head, _) = raw_get(&server, "/api/v1/services", "").await;
        assert_eq!(code, 429);
        assert!(head.contains("retry-after: 2"), "rounded up: {head}");
    }
    let (code, _, _) = raw_get(&server, "/api/v1/services", "").await;
    assert_eq!(code, 200);
    let codes: Vec<u16> = server.served("services").iter().map(|s| s.code).collect();
    assert_eq!(codes, [429, 429, 200]);
}

#[tokio::test]
async fn a_required_token_refuses_requests_without_it() {
    let server = FakeApiServer::start().await;
    server.require_token(Some("s3cret"));
    assert_eq!(raw_get(&server, "/version", "").await.0, 401);
    let wrong = "Authorization: Bearer nope\r\n";
    assert_eq!(raw_get(&server, "/api/v1/services", wrong).await.0, 401);
    let right = "Authorization: Bearer s3cret\r\n";
    assert_eq!(raw_get(&server, "/version", right).await.0, 200);
    assert_eq!(server.unauthorized(), 2);
    server.require_token(None);
    assert_eq!(raw_get(&server, "/version", "").await.0, 200);
}

#[tokio::test]
async fn https_is_served_with_the_servers_own_ca_and_other_cas_fail() {
    let server = FakeApiServer::try_start_tls(Options::default())
        .await
        .expect("https");
    assert!(server.url().starts_with("https://127.0.0.1:"));
    assert!(
        server
            .ca_pem()
            .is_some_and(|p| p.starts_with("-----BEGIN CERTIFICATE-----"))
    );
    server.apply(Kind::Services, web());
    let api: Api<Service> = Api::all(server.client());
    assert_eq!(
        api.list(&ListParams::default())
            .await
            .expect("list")
            .items
            .len(),
        1
    );
    assert_eq!(server.tls_failures(), 0);
    let other = FakeApiServer::try_start_tls(Options::default())
        .await
        .expect("https");
    let mut config = server.config();
    config.root_cert = other.config().root_cert;
    let client = kube::Client::try_from(config).expect("client");
    assert!(client.apiserver_version().await.is_err());
    // Counted by the server's side of the handshake, which may end just after the client's.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while server.tls_failures() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no failed handshake counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
