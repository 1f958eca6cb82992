//! Forwarding one request to a worker and streaming its answer back.
//!
//! - The request body is read whole (it is needed for the routing key, and again for a
//!   retry); the response body is streamed frame by frame as the worker sends it, so SSE
//!   passes through unbuffered.
//! - A failure before the response head (connection refused or reset, the worker marked down
//!   while we wait) is retried on another healthy worker, up to `--max-retries` times. A
//!   refused connection marks the worker down at once. Any status the worker answers,
//!   503 included, is passed back as-is.
//! - Once the head is back, a failure ends the stream: an event stream (SSE) with a last
//!   `data: {"error": ...}` event, as a worker ends a stream that failed; any other body cut.
//!   A worker silent for `--request-timeout` mid-stream counts as a failure, so nothing hangs.
//! - A client that goes away drops the upstream request with it, so the worker sees the
//!   disconnect and can abort the generation.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderMap, HeaderValue, CONNECTION, CONTENT_TYPE, EXPECT, HOST};
use hyper::http::request::Parts;
use hyper::{Method, Request, Response, StatusCode};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use crate::log::{debug, info};
use crate::pool::Dispatch;
use crate::responses::{describe_error, error_response, BoxError, ResponseBody};
use crate::routing_key::routing_key;
use crate::state::RouterState;
use crate::worker::{WorkerId, WorkerUrl};

/// The largest request body the router reads, as the pagedrs server's default limit.
pub const MAX_REQUEST_BYTES: usize = 32 * 1024 * 1024;

/// Headers that concern one connection only (RFC 9110 section 7.6.1), never forwarded.
const HOP_BY_HOP_HEADERS: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// How one attempt at a worker ended.
enum Attempt {
    /// The worker sent its response head.
    Answered(Response<Incoming>),
    /// It failed before answering (the reason, for logs and the final error); retryable.
    Failed(String),
    /// It did not answer within `--request-timeout`; not retried, as it may still be working.
    TimedOut,
}

/// Forwards `request` to a worker chosen by the policy and returns the worker's answer
/// (or the router's error when no worker could answer).
pub async fn forward(
    state: Arc<RouterState>,
    request: Request<Incoming>,
) -> Response<ResponseBody> {
    let (parts, body) = request.into_parts();
    let body = match Limited::new(body, MAX_REQUEST_BYTES).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is larger than the router's limit of {MAX_REQUEST_BYTES} bytes"),
            );
        }
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                format!("could not read the request body: {}", describe_error(&*error)),
            );
        }
    };
    let key: Vec<char> =
        request_key(&parts, &body).map(|key| key.chars().collect()).unwrap_or_default();
    let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let headers = forwardable_headers(&parts.headers);
    let mut tried: Vec<WorkerId> = Vec::new();
    let mut last_failure: Option<String> = None;
    for attempt in 0..=state.config.max_retries {
        let Some(dispatch) = state.pool().route(&key, &tried) else {
            let message = match &last_failure {
                Some(failure) => format!("no healthy worker left to try ({failure})"),
                None => "no healthy worker".to_string(),
            };
            return error_response(StatusCode::SERVICE_UNAVAILABLE, message);
        };
        let in_flight = InFlightGuard { state: Arc::clone(&state), worker_id: dispatch.worker_id };
        if attempt > 0 {
            state.pool().record_retry();
        }
        tried.push(dispatch.worker_id);
        debug!(
            "{} {path_and_query} -> {} ({}, {} of {} key chars matched, attempt {})",
            parts.method,
            dispatch.url,
            dispatch.reason.as_str(),
            dispatch.num_matched_chars,
            key.len(),
            attempt + 1
        );
        let request =
            upstream_request(&dispatch.url, &parts.method, path_and_query, &headers, body.clone());
        match send(&state, dispatch, request).await {
            Attempt::Answered(response) => {
                return stream_back(response, in_flight, state.config.request_timeout);
            }
            Attempt::Failed(failure) => {
                debug!("{path_and_query} failed before an answer: {failure}");
                last_failure = Some(failure);
            }
            Attempt::TimedOut => {
                return error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "the worker did not answer within {} s (--request-timeout)",
                        state.config.request_timeout.as_secs_f64()
                    ),
                );
            }
        }
    }
    error_response(
        StatusCode::BAD_GATEWAY,
        format!(
            "{} workers failed before answering; the last: {}",
            tried.len(),
            last_failure.unwrap_or_default()
        ),
    )
}

/// The routing key of a request, if its path has one and its body is JSON (a body that is
/// not is forwarded all the same: the worker answers the error).
fn request_key(parts: &Parts, body: &Bytes) -> Option<String> {
    if parts.method != Method::POST {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    routing_key(parts.uri.path(), &value, body)
}

/// The request to send to `url`: the client's method, path, query and end-to-end headers,
/// with `Host` set for the worker.
fn upstream_request(
    url: &WorkerUrl,
    method: &Method,
    path_and_query: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, String> {
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = method.clone();
    *request.uri_mut() = url.endpoint(path_and_query)?;
    *request.headers_mut() = headers.clone();
    let host = HeaderValue::from_str(url.authority()).map_err(|error| error.to_string())?;
    request.headers_mut().insert(HOST, host);
    Ok(request)
}

/// Sends `request` to the dispatched worker and waits for its response head, giving up when
/// the worker is marked down meanwhile.
async fn send(
    state: &RouterState,
    dispatch: Dispatch,
    request: Result<Request<Full<Bytes>>, String>,
) -> Attempt {
    let Dispatch { worker_id, url, mut healthy, .. } = dispatch;
    let request = match request {
        Ok(request) => request,
        Err(error) => return Attempt::Failed(format!("{url}: {error}")),
    };
    let response =
        tokio::time::timeout(state.config.request_timeout, state.client.request(request));
    tokio::select! {
        answer = response => match answer {
            Ok(Ok(response)) => Attempt::Answered(response),
            Ok(Err(error)) => {
                let reason = describe_error(&error);
                if error.is_connect() && state.pool().set_healthy(worker_id, false) {
                    info!("worker {url} is down: {reason}");
                }
                Attempt::Failed(format!("{url}: {reason}"))
            }
            Err(_elapsed) => Attempt::TimedOut,
        },
        () = marked_down(&mut healthy) => Attempt::Failed(format!("{url} was marked down")),
    }
}

/// Resolves when the worker is marked down; never, if it is removed (its requests finish).
async fn marked_down(healthy: &mut watch::Receiver<bool>) {
    if healthy.wait_for(|&is_healthy| !is_healthy).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The worker's response with its end-to-end headers and its body streamed through.
fn stream_back(
    response: Response<Incoming>,
    in_flight: InFlightGuard,
    idle_timeout: Duration,
) -> Response<ResponseBody> {
    let (mut parts, upstream) = response.into_parts();
    parts.headers = forwardable_headers(&parts.headers);
    let event_stream = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"));
    let body = UpstreamBody {
        upstream,
        idle_deadline: Box::pin(tokio::time::sleep(idle_timeout)),
        idle_timeout,
        event_stream,
        ended: false,
        _in_flight: in_flight,
    };
    Response::from_parts(parts, body.boxed_unsync())
}

/// `headers` without hop-by-hop ones (those listed in `Connection` too), `Host` (set per
/// worker) and `Expect`. `Content-Length` stays: the body is forwarded byte for byte.
///
/// NOTE: `Expect: 100-continue` was settled between the client and the router, which has
/// read the whole body by now; forwarded, it would make the worker wait for nothing.
fn forwardable_headers(headers: &HeaderMap) -> HeaderMap {
    let connection_listed: Vec<String> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            !HOP_BY_HOP_HEADERS.contains(&name)
                && !connection_listed.iter().any(|listed| listed == name)
                && name != HOST.as_str()
                && name != EXPECT.as_str()
        })
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

/// Counts a request in flight on its worker from `route` until dropped (when the response
/// body ends, fails or is dropped with a disconnected client).
struct InFlightGuard {
    /// The state holding the pool.
    state: Arc<RouterState>,
    /// The worker the request went to.
    worker_id: WorkerId,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if let Err(error) = self.state.pool().finish(self.worker_id) {
            info!("bug: {error}");
        }
    }
}

/// A worker's response body on its way to the client, frame by frame.
struct UpstreamBody {
    /// The worker's body.
    upstream: Incoming,
    /// When the worker will have been silent for `idle_timeout`; reset by each frame.
    idle_deadline: Pin<Box<Sleep>>,
    /// The longest silence allowed between frames.
    idle_timeout: Duration,
    /// Whether the body is an event stream (SSE), which ends a failure with an error event.
    event_stream: bool,
    /// Whether the body ended with an error event: nothing follows it.
    ended: bool,
    /// Keeps the request counted in flight until the body is dropped.
    _in_flight: InFlightGuard,
}

impl UpstreamBody {
    /// How a failure mid-body reaches the client: an event stream gets a last error event
    /// and ends; any other body fails (the client sees it cut).
    fn failed(&mut self, error: BoxError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if !self.event_stream {
            return Poll::Ready(Some(Err(error)));
        }
        self.ended = true;
        let event = serde_json::json!({"error": {
            "message": format!("the worker failed mid-stream: {error}"),
            "type": "bad_gateway",
            "code": 502,
        }});
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!("data: {event}\n\n"))))))
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.upstream).poll_frame(context) {
            Poll::Ready(Some(Err(error))) => this.failed(error.into()),
            Poll::Ready(frame) => {
                this.idle_deadline.as_mut().reset(Instant::now() + this.idle_timeout);
                Poll::Ready(frame.map(|result| result.map_err(BoxError::from)))
            }
            Poll::Pending => match this.idle_deadline.as_mut().poll(context) {
                Poll::Ready(()) => this.failed(
                    format!(
                        "the worker sent nothing for {} s (--request-timeout)",
                        this.idle_timeout.as_secs_f64()
                    )
                    .into(),
                ),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.upstream.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.upstream.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_listed_headers_are_not_forwarded() {
        let mut headers = HeaderMap::new();
        headers.insert("connection", HeaderValue::from_static("keep-alive, X-Trace"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        headers.insert("x-trace", HeaderValue::from_static("1"));
        headers.insert("host", HeaderValue::from_static("router:8000"));
        headers.insert("expect", HeaderValue::from_static("100-continue"));
        headers.insert("authorization", HeaderValue::from_static("Bearer k"));
        headers.append("accept", HeaderValue::from_static("text/event-stream"));
        headers.append("accept", HeaderValue::from_static("application/json"));
        headers.insert("content-length", HeaderValue::from_static("12"));
        let forwarded = forwardable_headers(&headers);
        let mut names: Vec<&str> = forwarded.keys().map(|name| name.as_str()).collect();
        names.sort();
        assert_eq!(names, ["accept", "authorization", "content-length"]);
        assert_eq!(forwarded.get_all("accept").iter().count(), 2);
    }

    #[test]
    fn only_post_bodies_that_are_json_have_a_key() {
        let parts = |method: Method, path: &str| {
            Request::builder().method(method).uri(path).body(()).unwrap().into_parts().0
        };
        let body = Bytes::from_static(br#"{"prompt": "hi"}"#);
        assert_eq!(request_key(&parts(Method::POST, "/v1/completions"), &body), Some("hi".into()));
        assert_eq!(request_key(&parts(Method::GET, "/v1/completions"), &body), None);
        let not_json = Bytes::from_static(b"prompt=hi");
        assert_eq!(request_key(&parts(Method::POST, "/v1/completions"), &not_json), None);
    }
}
