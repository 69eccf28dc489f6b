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

use crate::fake_apiserver::{FakeApiServer, Kind, Options, Population, TRIGGER_TIME};

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
