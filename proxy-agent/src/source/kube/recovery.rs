//! How a watcher recovers from errors, as client-go's reflector does. kube-runtime's
//! watcher cannot be told any of this, so it is wrapped:
//!
//! - **Backoff** grows from 800 ms to 30 s with jitter, and resets only once no error has
//!   come for 2 minutes (client-go's backoff manager). kube's `StreamBackoff` resets on
//!   every good event, and a relist is one, so a 410 on every watch relisted all three
//!   resources about once a second forever.
//! - **Relist from scratch** when a watch is answered with an error (its request's status
//!   or an ERROR event), 429 aside: kube relists only on a 410 event and otherwise opens
//!   the watch again from the same resourceVersion, forever — after an etcd restore the
//!   server answers that one 504 "Too large resource version" (or a 410 on the request),
//!   and deleted Services stayed programmed. A fresh watcher lists from "" (a quorum read).
//! - **A watch event over the cap** (`api_server::EventTooLarge`) also relists: the event is
//!   lost, and watching on from before it would fetch it again.
//! - **A list page over the cap** (`api_server::ListPageTooLarge`) lists again in pages a
//!   tenth the size (down to one object): legal objects can fill a page past it, and only
//!   an object past the cap by itself stays refused.
//!
//! Every error is logged with its whole chain and counted by resource, kind and status;
//! every list after the first is counted as a relist.

use std::{collections::BTreeMap, time::Duration};

use futures::{StreamExt as _, stream::BoxStream};
use kube::{Api, runtime::watcher};
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::source::api_server::{
    ApiCounters, ApiErrorKind, EventTooLarge, ListPageTooLarge, error_chain, find_in_chain,
};
use crate::source::decoded::MAX_LOGGED_ERROR;

/// client-go's reflector backoff: 800 ms doubling to 30 s, reset after 2 quiet minutes.
#[derive(Clone, Debug)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    /// No error for this long resets the delay to `initial`.
    pub reset_after: Duration,
    current: Option<Duration>,
    last_error: Option<Instant>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(800),
            max: Duration::from_secs(30),
            reset_after: Duration::from_secs(120),
            current: None,
            last_error: None,
        }
    }
}

impl Backoff {
    /// A backoff from `initial` doubling to `max` (tests and the fuzzer: milliseconds),
    /// reset after client-go's quiet while.
    pub fn with_delays(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            ..Self::default()
        }
    }

    /// The wait after an error at `now`; `jitter` in [0, 1) takes up to half of it off, so
    /// a thousand nodes do not come back in step.
    pub fn next(&mut self, now: Instant, jitter: f64) -> Duration {
        if self
            .last_error
            .is_some_and(|t| now.saturating_duration_since(t) >= self.reset_after)
        {
            self.current = None;
        }
        let base = match self.current {
            None => self.initial,
            Some(d) => (d * 2).min(self.max),
        };
        self.current = Some(base);
        self.last_error = Some(now);
        base.mul_f64(1.0 - 0.5 * jitter.clamp(0.0, 1.0))
    }
}

/// Whether the API server has been failing us, by resource: a streak of errors per watcher
/// (and the `/version` probe, `"version"`), ended by any event of that watcher (or a good
/// probe). `proxy-agent serve` judges its view by it: a streak that has lasted its bound
/// means the view is no longer current (`fanout::Hub::set_api_lost`).
///
/// A streak is the span from its first error to its latest, the errors each within
/// `STREAK_GAP` of the one before: a watcher that failed twice and then watches on in a
/// quiet cluster (which yields no event) is not counted as failing, while one whose
/// retries keep failing (refused, 401/403, timed out) is, however quiet the cluster.
#[derive(Clone, Debug, Default)]
pub struct WatchHealth(std::sync::Arc<std::sync::Mutex<BTreeMap<&'static str, Streak>>>);

#[derive(Clone, Copy, Debug)]
struct Streak {
    since: Instant,
    last: Instant,
}

/// The longest wait between two errors of one streak: the backoff's cap (30 s) and a
/// connection's timeout (30 s), with room.
pub const STREAK_GAP: Duration = Duration::from_secs(120);

impl WatchHealth {
    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<&'static str, Streak>) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// An error of `resource`'s watcher (or probe) at `now`.
    pub fn error(&self, resource: &'static str, now: Instant) {
        self.with(|m| {
            let s = m.entry(resource).or_insert(Streak {
                since: now,
                last: now,
            });
            if now.saturating_duration_since(s.last) > STREAK_GAP {
                s.since = now;
            }
            s.last = now;
        });
    }

    /// `resource` answered: its streak, if any, is over.
    pub fn ok(&self, resource: &'static str) {
        self.with(|m| {
            m.remove(resource);
        });
    }

    /// How long the longest current streak has lasted (`None`: no resource failing).
    pub fn failing_for(&self, now: Instant) -> Option<Duration> {
        self.with(|m| {
            m.values()
                .filter(|s| now.saturating_duration_since(s.last) <= STREAK_GAP)
                .map(|s| s.last.saturating_duration_since(s.since))
                .max()
        })
    }
}

/// What an error was, and whether to list again from scratch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: ApiErrorKind,
    /// The HTTP status, 0 when there was none.
    pub code: u16,
    pub relist: bool,
    /// The page was too large: list in smaller ones.
    pub smaller_pages: bool,
}

fn status_of(e: &kube::Error) -> u16 {
    match e {
        kube::Error::Api(r) => r.code,
        _ => 0,
    }
}

impl Failure {
    pub fn of(error: &watcher::Error) -> Self {
        // An error answer to a watch means our resourceVersion (or the watch) is no good:
        // list again, as client-go does; 429 only asks us to slow down.
        let answered = |code: u16| Self {
            kind: ApiErrorKind::Watch,
            code,
            relist: code != 429,
            smaller_pages: false,
        };
        let plain = |kind, code, relist| Self {
            kind,
            code,
            relist,
            smaller_pages: false,
        };
        match error {
            watcher::Error::InitialListFailed(e)
                if find_in_chain::<ListPageTooLarge>(e).is_some() =>
            {
                Self {
                    kind: ApiErrorKind::ListTooLarge,
                    code: 0,
                    relist: true,
                    smaller_pages: true,
                }
            }
            // kube-runtime lists again itself.
            watcher::Error::InitialListFailed(e) => plain(ApiErrorKind::List, status_of(e), false),
            watcher::Error::WatchStartFailed(e) => plain(
                ApiErrorKind::WatchStart,
                status_of(e),
                !matches!(status_of(e), 0 | 429),
            ),
            watcher::Error::WatchError(r) => answered(r.code),
            // kube reads the watch request's error answer as a line of the stream.
            watcher::Error::WatchFailed(kube::Error::Api(r)) => answered(r.code),
            watcher::Error::WatchFailed(e) if find_in_chain::<EventTooLarge>(e).is_some() => {
                plain(ApiErrorKind::EventTooLarge, 0, true)
            }
            // A broken connection: kube watches again from where it was, as client-go.
            watcher::Error::WatchFailed(_) => plain(ApiErrorKind::WatchStream, 0, false),
            watcher::Error::NoResourceVersion => plain(ApiErrorKind::NoResourceVersion, 0, false),
        }
    }
}

/// Which resource a watcher follows: the metric label and the word for the log.
#[derive(Clone, Copy, Debug)]
pub struct Resource {
    pub label: &'static str,
    pub name: &'static str,
}

struct Recovering<K: 'static> {
    api: Api<K>,
    config: watcher::Config,
    inner: BoxStream<'static, watcher::Result<watcher::Event<K>>>,
    backoff: Backoff,
    resource: Resource,
    counters: ApiCounters,
    health: WatchHealth,
    listed: bool,
}

/// kube-runtime's watcher for `api`, recovering as the module says: only its events come
/// out; its errors are logged, counted and waited out here.
pub fn recovering<K>(
    api: Api<K>,
    config: watcher::Config,
    resource: Resource,
    counters: ApiCounters,
    backoff: Backoff,
    health: WatchHealth,
) -> BoxStream<'static, watcher::Event<K>>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    counters.watching(resource.label);
    let inner = watcher(api.clone(), config.clone()).boxed();
    let state = Recovering {
        api,
        config,
        inner,
        backoff,
        resource,
        counters,
        health,
        listed: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            match st.inner.next().await? {
                Ok(event) => {
                    st.health.ok(st.resource.label);
                    if matches!(event, watcher::Event::Init) {
                        if st.listed {
                            st.counters.relist(st.resource.label);
                        }
                        st.listed = true;
                    }
                    return Some((event, st));
                }
                Err(e) => {
                    let failure = Failure::of(&e);
                    st.health.error(st.resource.label, Instant::now());
                    st.counters
                        .error(st.resource.label, failure.kind, failure.code);
                    let wait = st.backoff.next(Instant::now(), rand::random::<f64>());
                    if failure.smaller_pages {
                        let page = st.config.page_size.unwrap_or(500);
                        let smaller = (page / 10).max(1);
                        tracing::warn!(
                            page,
                            smaller,
                            "{}: a list page passed the cap; listing in pages of {smaller}",
                            st.resource.name
                        );
                        st.config.page_size = Some(smaller);
                    }
                    if failure.relist {
                        st.inner = watcher(st.api.clone(), st.config.clone()).boxed();
                    }
                    tracing::warn!(
                        // Capped: an error may quote a whole response body (an error page).
                        error = crate::source::decoded::cap(&error_chain(&e), MAX_LOGGED_ERROR),
                        kind = failure.kind.as_str(),
                        code = failure.code,
                        wait_ms = wait.as_millis() as u64,
                        "{}: {} in {wait:.1?}",
                        st.resource.name,
                        if failure.relist {
                            "watch failed; listing again from scratch"
                        } else {
                            "API request failed; retrying"
                        }
                    );
                    tokio::time::sleep(wait).await;
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_streak_counts_only_while_its_errors_keep_coming() {
        let h = WatchHealth::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(h.failing_for(t0), None);
        // Two errors, then a quiet watch: a streak of 1 s, whenever it is asked.
        h.error("services", at(0));
        h.error("services", at(1));
        assert_eq!(h.failing_for(at(100)), Some(Duration::from_secs(1)));
        // Errors that keep coming (the backoff's 30 s apart): the streak grows.
        for s in [31, 61, 91] {
            h.error("services", at(s));
        }
        assert_eq!(h.failing_for(at(95)), Some(Duration::from_secs(91)));
        // No error for longer than the gap: over, and a later one starts afresh.
        assert_eq!(
            h.failing_for(at(91) + STREAK_GAP + Duration::from_secs(1)),
            None
        );
        h.error("services", at(400));
        assert_eq!(h.failing_for(at(400)), Some(Duration::ZERO));
        // An event ends it; another resource's streak is its own.
        h.error("version", at(400));
        h.error("version", at(460));
        h.ok("services");
        assert_eq!(h.failing_for(at(460)), Some(Duration::from_secs(60)));
        h.ok("version");
        assert_eq!(h.failing_for(at(460)), None);
    }

    #[test]
    fn backoff_grows_to_its_cap_and_resets_only_after_a_quiet_while() {
        let mut b = Backoff::default();
        let t0 = Instant::now();
        let ms = |d: Duration| d.as_millis();
        let waits: Vec<u128> = (0..8)
            .map(|i| ms(b.next(t0 + Duration::from_secs(i), 0.0)))
            .collect();
        assert_eq!(
            waits,
            [800, 1600, 3200, 6400, 12800, 25600, 30000, 30000],
            "errors a second apart (a relist in between counts for nothing)"
        );
        // Errors under two minutes apart keep it up.
        assert_eq!(ms(b.next(t0 + Duration::from_secs(100), 0.0)), 30000);
        // Two quiet minutes reset it.
        assert_eq!(ms(b.next(t0 + Duration::from_secs(221), 0.0)), 800);
        // Jitter takes up to half off, never adds.
        assert_eq!(ms(b.next(t0 + Duration::from_secs(222), 0.999_999)), 800);
        assert_eq!(ms(b.next(t0 + Duration::from_secs(223), 0.5)), 2400);
    }

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(kube::core::ErrorResponse {
            status: "Failure".into(),
            message: "m".into(),
            reason: "r".into(),
            code,
        })
    }

    #[test]
    fn an_error_answer_to_a_watch_relists_a_broken_connection_does_not() {
        let f = |e: watcher::Error| {
            let f = Failure::of(&e);
            (f.kind, f.code, f.relist)
        };
        use ApiErrorKind as K;
        // After an etcd restore: 504 ResourceVersionTooLarge, or 410 on the request.
        assert_eq!(
            f(watcher::Error::WatchFailed(api_error(504))),
            (K::Watch, 504, true)
        );
        assert_eq!(
            f(watcher::Error::WatchFailed(api_error(410))),
            (K::Watch, 410, true)
        );
        assert_eq!(
            f(watcher::Error::WatchFailed(api_error(429))),
            (K::Watch, 429, false)
        );
        let gone = kube::core::ErrorResponse {
            status: "Failure".into(),
            message: "too old resource version".into(),
            reason: "Expired".into(),
            code: 410,
        };
        assert_eq!(f(watcher::Error::WatchError(gone)), (K::Watch, 410, true));
        let io = std::io::Error::other(kube::Error::Service(Box::new(EventTooLarge { limit: 16 })));
        assert_eq!(
            f(watcher::Error::WatchFailed(kube::Error::ReadEvents(io))),
            (K::EventTooLarge, 0, true)
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(
            f(watcher::Error::WatchFailed(kube::Error::ReadEvents(reset))),
            (K::WatchStream, 0, false)
        );
        assert_eq!(
            f(watcher::Error::InitialListFailed(api_error(500))),
            (K::List, 500, false)
        );
        // A page past the cap: listed again from scratch, in smaller pages.
        let big =
            watcher::Error::InitialListFailed(kube::Error::Service(Box::new(ListPageTooLarge {
                limit: 16,
            })));
        assert_eq!(f(big), (K::ListTooLarge, 0, true));
        let big =
            watcher::Error::InitialListFailed(kube::Error::Service(Box::new(ListPageTooLarge {
                limit: 16,
            })));
        assert!(Failure::of(&big).smaller_pages);
        assert!(!Failure::of(&watcher::Error::InitialListFailed(api_error(500))).smaller_pages);
    }
}
