//! Retry-After, as client-go's `rest.Request` honours it: a GET answered 429 Too Many
//! Requests or 5xx with a `Retry-After` of N seconds is sent again after N seconds, up to
//! 10 times, before its error reaches the caller. kube's client drops the header (its
//! `ErrorResponse` has no headers), so the watcher only knew its own backoff and came back
//! as soon as that ran out, whatever the server asked.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use http::{Method, Request, Response, StatusCode, header::RETRY_AFTER};
use tower::{BoxError, Service, ServiceExt as _};

use super::counters::{ApiCounters, ApiErrorKind, resource_of};

/// client-go's `maxRetries` for a request.
pub const MAX_RETRIES: u32 = 10;
/// The longest wait taken from one answer (a hostile `Retry-After: 99999999` would park
/// the agent for years).
pub const MAX_WAIT: Duration = Duration::from_secs(300);

/// How long the server asked us to wait: whole seconds (client-go reads no HTTP dates),
/// on a 429 or 5xx answer only.
pub fn requested_wait<B>(response: &Response<B>) -> Option<Duration> {
    let status = response.status();
    if status != StatusCode::TOO_MANY_REQUESTS && !status.is_server_error() {
        return None;
    }
    let secs: u64 = response
        .headers()
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(secs).min(MAX_WAIT))
}

#[derive(Clone)]
pub struct RetryAfterLayer(pub ApiCounters);

impl<S> tower::Layer<S> for RetryAfterLayer {
    type Service = RetryAfter<S>;
    fn layer(&self, inner: S) -> RetryAfter<S> {
        RetryAfter {
            // Shared with each request's future, which may send it again: kube's stack is
            // a `BoxService`, which cannot be cloned. Held only to dispatch, not for the
            // answer.
            inner: Arc::new(tokio::sync::Mutex::new(inner)),
            counters: self.0.clone(),
        }
    }
}

pub struct RetryAfter<S> {
    inner: Arc<tokio::sync::Mutex<S>>,
    counters: ApiCounters,
}

impl<S> Clone for RetryAfter<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            counters: self.counters.clone(),
        }
    }
}

impl<S, B> Service<Request<kube::client::Body>> for RetryAfter<S>
where
    S: Service<Request<kube::client::Body>, Response = Response<B>, Error = BoxError>
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Readiness is awaited per request, under the lock.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<kube::client::Body>) -> Self::Future {
        let inner = self.inner.clone();
        let counters = self.counters.clone();
        Box::pin(async move {
            let send = |request| {
                let inner = inner.clone();
                async move {
                    let answer = {
                        let mut svc = inner.lock().await;
                        svc.ready().await?.call(request)
                    };
                    answer.await
                }
            };
            if request.method() != Method::GET {
                return send(request).await;
            }
            let (parts, body) = request.into_parts();
            let resource = resource_of(parts.uri.path());
            let mut response = send(Request::from_parts(parts.clone(), body)).await?;
            for attempt in 1..=MAX_RETRIES {
                let Some(wait) = requested_wait(&response) else {
                    break;
                };
                counters.error(
                    resource,
                    ApiErrorKind::RetryAfter,
                    response.status().as_u16(),
                );
                tracing::info!(
                    resource,
                    code = response.status().as_u16(),
                    wait_s = wait.as_secs(),
                    attempt,
                    "the API server asked us to come back later (Retry-After); waiting"
                );
                drop(response);
                tokio::time::sleep(wait).await;
                // A GET: no body to keep.
                response = send(Request::from_parts(
                    parts.clone(),
                    kube::client::Body::empty(),
                ))
                .await?;
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(code: u16, retry_after: Option<&str>) -> Response<()> {
        let mut r = Response::builder().status(code);
        if let Some(v) = retry_after {
            r = r.header(RETRY_AFTER, v);
        }
        r.body(()).unwrap()
    }

    #[test]
    fn only_429_and_5xx_with_whole_seconds_ask_to_wait() {
        assert_eq!(
            requested_wait(&answer(429, Some("3"))),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            requested_wait(&answer(503, Some(" 1 "))),
            Some(Duration::from_secs(1))
        );
        assert_eq!(requested_wait(&answer(404, Some("3"))), None);
        assert_eq!(requested_wait(&answer(200, Some("3"))), None);
        assert_eq!(requested_wait(&answer(429, None)), None);
        assert_eq!(
            requested_wait(&answer(429, Some("Wed, 21 Oct 2015 07:28:00 GMT"))),
            None
        );
        assert_eq!(
            requested_wait(&answer(429, Some("99999999999"))),
            Some(MAX_WAIT)
        );
    }
}
