//! What the API client counts for `/metrics`: errors by resource, kind and status, and
//! relists (a bounded set of labels).

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

/// What went wrong talking to the API server, as a metric label: a bounded set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum ApiErrorKind {
    /// A list failed (its page, or the connection).
    List,
    /// A watch could not be opened (the connection).
    WatchStart,
    /// A watch was answered with an error: its request's status, or an ERROR event.
    Watch,
    /// An open watch broke (the connection, a line that does not decode).
    WatchStream,
    /// A watch event over `MAX_EVENT_BYTES`.
    EventTooLarge,
    /// A list page over `MAX_LIST_PAGE_BYTES`.
    ListTooLarge,
    /// A list without a resourceVersion.
    NoResourceVersion,
    /// A 429 or 5xx with Retry-After, sent again after the wait.
    RetryAfter,
}

impl ApiErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::List => "list",
            Self::WatchStart => "watch_start",
            Self::Watch => "watch",
            Self::WatchStream => "watch_stream",
            Self::EventTooLarge => "event_too_large",
            Self::ListTooLarge => "list_too_large",
            Self::NoResourceVersion => "no_resource_version",
            Self::RetryAfter => "retry_after",
        }
    }
}

/// API errors and relists since start, for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ApiCounts {
    /// By resource (`services`, `endpointslices`, `nodes`, `version`, `events`, `other`),
    /// kind and HTTP status (0: there was none, e.g. the connection failed).
    pub errors: BTreeMap<(&'static str, ApiErrorKind, u16), u64>,
    /// Lists after the first, by resource (`services`, `endpointslices`, `nodes`).
    pub relists: BTreeMap<&'static str, u64>,
}

/// A cheap handle on `ApiCounts`; clones share them. The runner's status holds one, the
/// client and the watchers count into it.
#[derive(Clone, Debug, Default)]
pub struct ApiCounters(Arc<Mutex<ApiCounts>>);

impl ApiCounters {
    fn with<R>(&self, f: impl FnOnce(&mut ApiCounts) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn error(&self, resource: &'static str, kind: ApiErrorKind, code: u16) {
        self.with(|c| *c.errors.entry((resource, kind, code)).or_insert(0) += 1);
    }

    /// A resource is watched: its relists show from 0.
    pub fn watching(&self, resource: &'static str) {
        self.with(|c| {
            c.relists.entry(resource).or_insert(0);
        });
    }

    pub fn relist(&self, resource: &'static str) {
        self.with(|c| *c.relists.entry(resource).or_insert(0) += 1);
    }

    pub fn get(&self) -> ApiCounts {
        self.with(|c| c.clone())
    }
}

/// The resource a request path names, as a metric label (a bounded set).
pub fn resource_of(path: &str) -> &'static str {
    match path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default()
    {
        "services" => "services",
        "endpointslices" => "endpointslices",
        "nodes" => "nodes",
        "version" => "version",
        "events" => "events",
        _ => "other",
    }
}
