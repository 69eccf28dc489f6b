//! A cap on one watch event, as client-go's (16 MiB: its decoder's frame limit). kube reads
//! a watch as lines with no limit, so a 400 MB line grew the agent by 442 MB. Here a watch
//! answer's body fails, with `EventTooLarge`, as soon as a line passes the cap: kube's
//! line reader has then buffered at most the cap and one chunk, and the watcher restarts
//! that watch from a fresh list (`kube::recovery`).

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
pub struct EventCapLayer(pub usize);

impl<S> tower::Layer<S> for EventCapLayer {
    type Service = EventCap<S>;
    fn layer(&self, inner: S) -> EventCap<S> {
        EventCap {
            inner,
            limit: self.0,
        }
    }
}

#[derive(Clone)]
pub struct EventCap<S> {
    inner: S,
    limit: usize,
}

impl<S, ReqB, B> tower::Service<Request<ReqB>> for EventCap<S>
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
        let limit = is_watch(&request).then_some(self.limit);
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|inner| Capped {
                inner,
                limit,
                line: 0,
                failed: false,
            }))
        })
    }
}

/// A body whose lines may not pass `limit` bytes (no limit: passed through).
pub struct Capped<B> {
    inner: B,
    limit: Option<usize>,
    /// Bytes of the line under way, since the last newline.
    line: usize,
    failed: bool,
}

impl<B> Capped<B> {
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
        if let (Some(limit), Some(data)) = (this.limit, frame.data_ref())
            && !this.fits(data, limit)
        {
            this.failed = true;
            return Poll::Ready(Some(Err(Box::new(EventTooLarge { limit }))));
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
            limit: Some(limit),
            line: 0,
            failed: false,
        }
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
