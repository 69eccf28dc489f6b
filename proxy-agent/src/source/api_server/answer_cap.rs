//! Caps on what one answer may hold. A watch event is capped as client-go caps it (16 MiB:
//! its decoder's frame limit): kube reads a watch as lines with no limit, so a 400 MB line
//! grew the agent by 442 MB. Here a watch answer's body fails, with `EventTooLarge`, as
//! soon as a line passes the cap: kube's line reader has then buffered at most the cap and
//! one chunk, and the watcher restarts that watch from a fresh list (`kube::recovery`).
//!
//! Any other answer (a list page) fails with `ListPageTooLarge` once its body passes 64
//! MiB: kube reads a page whole, then parses it, with no limit. 500 objects of a legal
//! size can pass that (EndpointSlices of 1,000 endpoints are ~250 KB), so the watcher
//! lists again in smaller pages (`kube::recovery`); only one object past the cap stays
//! refused.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use tower::BoxError;

/// client-go's limit on one watch event.
pub const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// The limit on one list page's body (any answer but a watch's).
pub const MAX_LIST_PAGE_BYTES: usize = 64 * 1024 * 1024;

/// A list page longer than the cap.
#[derive(Debug, thiserror::Error)]
#[error("a list page over {limit} bytes; it is not read")]
pub struct ListPageTooLarge {
    pub limit: usize,
}

/// The caps the client's answers are held to.
#[derive(Clone, Copy, Debug)]
pub struct AnswerCaps {
    /// One watch event's line.
    pub event_bytes: usize,
    /// One list page's (any other answer's) body.
    pub list_page_bytes: usize,
}

impl Default for AnswerCaps {
    fn default() -> Self {
        Self {
            event_bytes: MAX_EVENT_BYTES,
            list_page_bytes: MAX_LIST_PAGE_BYTES,
        }
    }
}

/// A watch event line longer than the cap.
#[derive(Debug, thiserror::Error)]
#[error("a watch event over {limit} bytes (client-go's limit); the watch is dropped")]
pub struct EventTooLarge {
    pub limit: usize,
}

/// Whether a request is a watch (`watch=true` or `watch=1` in its query).
fn is_watch<B>(request: &Request<B>) -> bool {
    request
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1")
}

#[derive(Clone, Copy)]
pub struct AnswerCapLayer(pub AnswerCaps);

impl<S> tower::Layer<S> for AnswerCapLayer {
    type Service = AnswerCap<S>;
    fn layer(&self, inner: S) -> AnswerCap<S> {
        AnswerCap {
            inner,
            caps: self.0,
        }
    }
}

#[derive(Clone)]
pub struct AnswerCap<S> {
    inner: S,
    caps: AnswerCaps,
}

/// What a body is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cap {
    /// Each line (a watch event).
    Line(usize),
    /// The whole body (a list page).
    Body(usize),
}

impl<S, ReqB, B> tower::Service<Request<ReqB>> for AnswerCap<S>
where
    S: tower::Service<Request<ReqB>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Response = Response<Capped<B>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Response<Capped<B>>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let cap = if is_watch(&request) {
            Cap::Line(self.caps.event_bytes)
        } else {
            Cap::Body(self.caps.list_page_bytes)
        };
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|inner| Capped {
                inner,
                cap,
                line: 0,
                failed: false,
            }))
        })
    }
}

/// A body held to its cap.
pub struct Capped<B> {
    inner: B,
    cap: Cap,
    /// Bytes of the line under way, since the last newline (`Cap::Line`), or of the body
    /// so far (`Cap::Body`).
    line: usize,
    failed: bool,
}

impl<B> Capped<B> {
    /// Counts `data` into the body; `false` once it passes `limit`.
    fn body_fits(&mut self, data: &[u8], limit: usize) -> bool {
        self.line = self.line.saturating_add(data.len());
        self.line <= limit
    }

    /// Counts `data` into the line under way; `false` once a line passes the limit.
    fn fits(&mut self, data: &[u8], limit: usize) -> bool {
        let mut rest = data;
        while let Some(newline) = rest.iter().position(|b| *b == b'\n') {
            if self.line + newline > limit {
                return false;
            }
            self.line = 0;
            rest = &rest[newline + 1..];
        }
        self.line += rest.len();
        self.line <= limit
    }
}

impl<B> Body for Capped<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(Some(Ok(frame))) => frame,
        };
        // A cheap clone (a reference count): `fits` needs `this` mutably.
        if let Some(data) = frame.data_ref().cloned() {
            let cap = this.cap;
            let error: Option<BoxError> = match cap {
                Cap::Line(limit) if !this.fits(&data, limit) => {
                    Some(Box::new(EventTooLarge { limit }))
                }
                Cap::Body(limit) if !this.body_fits(&data, limit) => {
                    Some(Box::new(ListPageTooLarge { limit }))
                }
                _ => None,
            };
            if let Some(e) = error {
                this.failed = true;
                return Poll::Ready(Some(Err(e)));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capped(limit: usize) -> Capped<()> {
        Capped {
            inner: (),
            cap: Cap::Line(limit),
            line: 0,
            failed: false,
        }
    }

    #[test]
    fn a_list_page_may_hold_its_cap_across_chunks_and_no_more() {
        let mut c = capped(10);
        assert!(c.body_fits(b"0123\n", 10));
        assert!(
            c.body_fits(b"56789", 10),
            "exactly the cap, newlines counted"
        );
        assert!(!c.body_fits(b"x", 10), "one byte past it");
    }

    #[test]
    fn a_line_may_span_chunks_up_to_the_limit_and_no_further() {
        let mut c = capped(10);
        assert!(c.fits(b"01234", 10));
        assert!(c.fits(b"56789\n0123456789\n", 10), "exactly the limit");
        assert!(c.fits(b"012", 10));
        assert!(!c.fits(b"45678901", 10), "11 bytes across two chunks");
        let mut c = capped(10);
        assert!(
            !c.fits(b"short\n01234567890\nshort\n", 10),
            "inside one chunk"
        );
        let mut c = capped(10);
        assert!(c.fits(&[b'\n'; 100], 10), "many empty lines");
    }

    #[test]
    fn only_watches_are_capped() {
        let r = |uri: &str| Request::get(uri).body(()).unwrap();
        assert!(is_watch(&r(
            "/api/v1/services?watch=true&resourceVersion=5"
        )));
        assert!(is_watch(&r("/api/v1/services?resourceVersion=5&watch=1")));
        assert!(!is_watch(&r("/api/v1/services?limit=500")));
        assert!(!is_watch(&r("/api/v1/services?watched=true")));
    }
}
