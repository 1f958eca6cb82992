//! Loopback fixtures: tiny hyper workers that say who answered, the router binary in front
//! of them, and an HTTP client. Every wait is bounded by [`within`], so a broken router
//! fails a test instead of hanging it.

use std::convert::Infallible;
use std::future::Future;
use std::io::{BufRead, BufReader};
use std::pin::Pin;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

/// The longest any single wait in a test may take before the test fails.
pub const WAIT_LIMIT: Duration = Duration::from_secs(20);

/// Chunks a stub worker's stream sends (then `data: [DONE]`).
pub const NUM_STREAM_CHUNKS: usize = 4;

/// `future`'s output, or a panic naming `what` if it takes longer than [`WAIT_LIMIT`].
pub async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(WAIT_LIMIT, future)
        .await
        .unwrap_or_else(|_| panic!("waited over {WAIT_LIMIT:?} for {what}"))
}

/// A response body fed through a channel, as a worker streaming tokens produces it.
struct ChannelBody {
    /// The chunks still to come; closed when the stream ends.
    receiver: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.receiver.poll_recv(context).map(|chunk| chunk.map(|bytes| Ok(Frame::data(bytes))))
    }
}

/// The parts of a stub worker its request handlers share.
struct StubShared {
    /// The worker's name, echoed in every answer.
    name: &'static str,
    /// Each permit lets a stream send one more chunk, so a test decides when chunks go.
    chunk_permits: Arc<Semaphore>,
    /// Notified when a client went away before its answer ended.
    request_abandoned: Arc<Notify>,
    /// Notified when a `POST /v1/held` request has arrived.
    held_request_arrived: Notify,
    /// `GET /health` requests answered.
    num_health_checks: AtomicUsize,
}

/// A tiny OpenAI-ish worker on 127.0.0.1:
/// - `GET /health`: 200;
/// - `POST /v1/completions` with `"stream": true`: an SSE stream of [`NUM_STREAM_CHUNKS`]
///   chunks `data: NAME chunk I`, each sent once the test adds a permit;
/// - `POST /v1/held`: an echo (below), sent once the test adds a permit;
/// - `POST /v1/overloaded`: 503, as a full worker answers;
/// - anything else: JSON naming the worker, with the method, path, `Host` and
///   `Authorization` it received.
pub struct StubWorker {
    /// Its base URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// What its handlers share.
    shared: Arc<StubShared>,
    /// The accept loop; it owns every connection, so aborting it closes them all.
    accept_task: JoinHandle<()>,
}

impl StubWorker {
    /// Starts a worker named `name` on a free port.
    pub async fn start(name: &'static str) -> StubWorker {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shared = Arc::new(StubShared {
            name,
            chunk_permits: Arc::new(Semaphore::new(0)),
            request_abandoned: Arc::new(Notify::new()),
            held_request_arrived: Notify::new(),
            num_health_checks: AtomicUsize::new(0),
        });
        let accept_shared = Arc::clone(&shared);
        let accept_task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                while connections.try_join_next().is_some() {}
                let shared = Arc::clone(&accept_shared);
                let service = service_fn(move |request| {
                    let shared = Arc::clone(&shared);
                    async move { Ok::<_, Infallible>(stub_answer(&shared, request).await) }
                });
                connections
                    .spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
            }
        });
        StubWorker { url, shared, accept_task }
    }

    /// Lets streams send `num_chunks` more chunks.
    pub fn release_chunks(&self, num_chunks: usize) {
        self.shared.chunk_permits.add_permits(num_chunks);
    }

    /// Waits until a client has gone away before its answer ended.
    pub async fn request_abandoned(&self) {
        within("the worker to see the disconnect", self.shared.request_abandoned.notified()).await;
    }

    /// Waits until a `POST /v1/held` request has arrived.
    pub async fn held_request_arrived(&self) {
        within("the held request to arrive", self.shared.held_request_arrived.notified()).await;
    }

    /// `GET /health` requests answered so far.
    pub fn num_health_checks(&self) -> usize {
        self.shared.num_health_checks.load(Ordering::SeqCst)
    }

    /// Kills the worker: its port refuses connections and its open connections close.
    pub fn kill(&self) {
        self.accept_task.abort();
    }
}

impl Drop for StubWorker {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

/// The stub's answer to `request` (see [`StubWorker`]).
async fn stub_answer(shared: &StubShared, request: Request<Incoming>) -> Response<ChannelBody> {
    let method = request.method().clone();
    let path = request.uri().path_and_query().map_or("/", |pq| pq.as_str()).to_string();
    let header = |name: &str| {
        request.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string()
    };
    let (host, authorization) = (header("host"), header("authorization"));
    let body = request.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let wants_stream = serde_json::from_slice::<Value>(&body)
        .is_ok_and(|value| value.get("stream") == Some(&Value::Bool(true)));
    match (method.clone(), path.as_str()) {
        (Method::GET, "/health") => {
            shared.num_health_checks.fetch_add(1, Ordering::SeqCst);
            channel_response(StatusCode::OK, "text/plain", vec![Bytes::new()])
        }
        (Method::POST, "/v1/completions") if wants_stream => stream_response(shared),
        (Method::POST, "/v1/held") => {
            let abandoned = NotifyOnDrop { notify: Arc::clone(&shared.request_abandoned) };
            shared.held_request_arrived.notify_one();
            shared.chunk_permits.acquire().await.expect("never closed").forget();
            std::mem::forget(abandoned);
            echo_response(shared, &method, &path, &host, &authorization)
        }
        (Method::POST, "/v1/overloaded") => {
            let error = json!({ "error": { "message": "busy", "code": 503 } });
            channel_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "application/json",
                vec![error.to_string().into()],
            )
        }
        _ => echo_response(shared, &method, &path, &host, &authorization),
    }
}

/// Notifies when dropped: a handler future dropped before it answered means hyper saw the
/// client go away. Forgotten once the answer is ready.
struct NotifyOnDrop {
    /// Whom to tell.
    notify: Arc<Notify>,
}

impl Drop for NotifyOnDrop {
    fn drop(&mut self) {
        self.notify.notify_one();
    }
}

/// JSON naming the worker, with what it received.
fn echo_response(
    shared: &StubShared,
    method: &Method,
    path: &str,
    host: &str,
    authorization: &str,
) -> Response<ChannelBody> {
    let echo = json!({
        "worker": shared.name,
        "method": method.as_str(),
        "path": path,
        "host": host,
        "authorization": authorization,
    });
    channel_response(StatusCode::OK, "application/json", vec![echo.to_string().into()])
}

/// A response sending `chunks` at once.
fn channel_response(
    status: StatusCode,
    content_type: &str,
    chunks: Vec<Bytes>,
) -> Response<ChannelBody> {
    let (sender, receiver) = mpsc::channel(chunks.len().max(1));
    for chunk in chunks {
        sender.try_send(chunk).expect("the channel has room for every chunk");
    }
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(ChannelBody { receiver })
        .unwrap()
}

/// An SSE stream whose chunks go one per permit; notices a reader that went away.
fn stream_response(shared: &StubShared) -> Response<ChannelBody> {
    let (sender, receiver) = mpsc::channel(1);
    let (name, permits, abandoned) =
        (shared.name, Arc::clone(&shared.chunk_permits), Arc::clone(&shared.request_abandoned));
    tokio::spawn(async move {
        let chunks = (0..NUM_STREAM_CHUNKS)
            .map(|i| format!("data: {name} chunk {i}\n\n"))
            .chain(["data: [DONE]\n\n".to_string()]);
        for chunk in chunks {
            tokio::select! {
                permit = permits.acquire() => permit.expect("never closed").forget(),
                () = sender.closed() => {
                    abandoned.notify_one();
                    return;
                }
            }
            if sender.send(chunk.into()).await.is_err() {
                abandoned.notify_one();
                return;
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(ChannelBody { receiver })
        .unwrap()
}

/// The expected text of a whole stream from worker `name`.
pub fn full_stream_text(name: &str) -> String {
    let mut text: String =
        (0..NUM_STREAM_CHUNKS).map(|i| format!("data: {name} chunk {i}\n\n")).collect();
    text.push_str("data: [DONE]\n\n");
    text
}

/// The router binary, running in front of test workers; killed when dropped.
pub struct RouterProcess {
    /// Its base URL, from the line it prints once listening.
    pub url: String,
    /// The process; taken by [`RouterProcess::wait_for_exit`].
    child: Option<Child>,
}

impl RouterProcess {
    /// Starts `pagedrs-router --host 127.0.0.1 --port 0` with `args` and waits for its
    /// `listening on` line.
    pub async fn start(args: &[&str]) -> RouterProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pagedrs-router"))
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start pagedrs-router");
        // Through the test's own stderr, which the harness shows only when the test fails
        // (a thread spawned by the test thread inherits its output capture).
        let stderr = child.stderr.take().expect("stderr is piped");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{line}");
            }
        });
        let stdout = child.stdout.take().expect("stdout is piped");
        let read_line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            BufReader::new(stdout).read_line(&mut line).map(|_| line)
        });
        let line = within("the router's listening line", read_line).await.unwrap().unwrap();
        let url = line
            .trim()
            .strip_prefix("pagedrs-router listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        RouterProcess { url, child: Some(child) }
    }

    /// Sends the router SIGTERM.
    pub fn terminate(&self) {
        let pid = self.child.as_ref().expect("still running").id().to_string();
        let status = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(status.success(), "kill -TERM {pid} failed");
    }

    /// Waits for the router to exit and returns how it did.
    pub async fn wait_for_exit(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("still running");
        let wait = tokio::task::spawn_blocking(move || child.wait());
        within("the router to exit", wait).await.unwrap().unwrap()
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// An HTTP/1.1 client for the tests.
pub struct TestClient {
    /// The pooled hyper client.
    client: Client<HttpConnector, Full<Bytes>>,
}

impl TestClient {
    /// A new client with its own connection pool.
    pub fn new() -> TestClient {
        TestClient { client: Client::builder(TokioExecutor::new()).build_http() }
    }

    /// Sends `method url` with `body` (JSON if given) and `headers`; returns the response
    /// once its head is in.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> Response<Incoming> {
        let mut builder = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let body = match body {
            Some(value) => {
                builder = builder.header("content-type", "application/json");
                Full::new(Bytes::from(value.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let request = builder.body(body).unwrap();
        within(url, self.client.request(request)).await.expect("the router answers")
    }

    /// Sends a request and reads the whole answer as JSON.
    pub async fn json(
        &self,
        method: Method,
        url: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let (status, text) = self.text(method, url, body).await;
        let value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, value)
    }

    /// Sends a request and reads the whole answer as text.
    pub async fn text(
        &self,
        method: Method,
        url: &str,
        body: Option<Value>,
    ) -> (StatusCode, String) {
        let response = self.send(method, url, body, &[]).await;
        let status = response.status();
        let bytes =
            within("a whole body", response.into_body().collect()).await.unwrap().to_bytes();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }
}

/// Reads frames from `body`, appending them to `text`, until `text` ends with `suffix`.
pub async fn read_until(body: &mut Incoming, text: &mut String, suffix: &str) {
    while !text.ends_with(suffix) {
        let frame = within(suffix, body.frame()).await;
        let frame = frame.unwrap_or_else(|| panic!("the stream ended before {suffix:?}: {text:?}"));
        if let Ok(data) = frame.expect("the stream is intact").into_data() {
            text.push_str(std::str::from_utf8(&data).unwrap());
        }
    }
}

/// The value of the sample `name` (e.g. `pagedrs_router_retries_total` or
/// `pagedrs_router_in_flight{worker="..."}`) in a Prometheus text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
        .parse()
        .unwrap()
}
