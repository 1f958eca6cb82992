//! The router binary in front of stub workers on 127.0.0.1: streaming, retries, run-time
//! worker changes, cache-aware affinity, errors and graceful shutdown.

mod helpers;

use helpers::{
    full_stream_text, metric, read_until, within, RouterProcess, StubWorker, TestClient,
    NUM_STREAM_CHUNKS,
};
use http_body_util::BodyExt;
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use std::io::Write;

/// A streaming completion request.
fn stream_request() -> Value {
    json!({ "model": "m", "prompt": "Tell me a story", "stream": true })
}

/// Which worker answered an echoed request (`worker` in the stub's JSON).
async fn answered_by(client: &TestClient, router: &RouterProcess, prompt: &str) -> String {
    let url = format!("{}/v1/completions", router.url);
    let (status, body) = client.json(Method::POST, &url, Some(json!({ "prompt": prompt }))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["worker"].as_str().expect("the stub names itself").to_string()
}

/// The router's `/metrics` text.
async fn metrics_text(client: &TestClient, router: &RouterProcess) -> String {
    client.text(Method::GET, &format!("{}/metrics", router.url), None).await.1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_passes_through_chunk_by_chunk_in_order() {
    let worker = StubWorker::start("A").await;
    let router = RouterProcess::start(&["--worker", &worker.url]).await;
    let client = TestClient::new();
    let url = format!("{}/v1/completions", router.url);
    let response = client.send(Method::POST, &url, Some(stream_request()), &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let mut text = String::new();
    // The worker sends each chunk only when told: had the router buffered the stream, the
    // next chunk would never be read here.
    for i in 0..NUM_STREAM_CHUNKS {
        worker.release_chunks(1);
        read_until(&mut body, &mut text, &format!("data: A chunk {i}\n\n")).await;
    }
    worker.release_chunks(1);
    read_until(&mut body, &mut text, "data: [DONE]\n\n").await;
    assert!(within("the end of the stream", body.frame()).await.is_none());
    assert_eq!(text, full_stream_text("A"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_is_seen_by_the_worker_and_ends_the_load() {
    let worker = StubWorker::start("A").await;
    let router = RouterProcess::start(&["--worker", &worker.url]).await;
    let client = TestClient::new();
    let url = format!("{}/v1/completions", router.url);
    let response = client.send(Method::POST, &url, Some(stream_request()), &[]).await;
    let mut body = response.into_body();
    worker.release_chunks(1);
    read_until(&mut body, &mut String::new(), "data: A chunk 0\n\n").await;
    drop(body);
    worker.request_abandoned().await;
    let in_flight = format!("pagedrs_router_in_flight{{worker=\"{}\"}}", worker.url);
    within("the load to drop to 0", async {
        while metric(&metrics_text(&client, &router).await, &in_flight) != 0.0 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_before_the_answer_is_seen_by_the_worker() {
    let worker = StubWorker::start("A").await;
    let router = RouterProcess::start(&["--worker", &worker.url]).await;
    let address = router.url.trim_start_matches("http://").to_string();
    // A plain socket, so leaving is exactly closing it.
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    let request = "POST /v1/held HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
                   content-length: 2\r\n\r\n{}";
    stream.write_all(request.as_bytes()).unwrap();
    worker.held_request_arrived().await;
    drop(stream);
    worker.request_abandoned().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_requests_are_retried_on_the_other() {
    let worker_a = StubWorker::start("A").await;
    let worker_b = StubWorker::start("B").await;
    let router = RouterProcess::start(&[
        "--worker",
        &worker_b.url,
        "--policy",
        "round_robin",
        "--health-interval",
        "600",
    ])
    .await;
    let client = TestClient::new();
    // Once B has had the start-up check, that round is past listing workers: A, added now,
    // is not checked again for 600 s, so only a request can find it dead.
    within("the start-up health check", async {
        while worker_b.num_health_checks() == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    let workers_url = format!("{}/workers", router.url);
    let (status, _) =
        client.json(Method::POST, &workers_url, Some(json!({ "url": worker_a.url }))).await;
    assert_eq!(status, StatusCode::CREATED);
    let mut answers = vec![
        answered_by(&client, &router, "one").await,
        answered_by(&client, &router, "two").await,
    ];
    answers.sort();
    assert_eq!(answers, ["A", "B"], "both workers answer while alive");

    worker_a.kill();
    for prompt in ["three", "four", "five", "six"] {
        assert_eq!(answered_by(&client, &router, prompt).await, "B");
    }
    let metrics = metrics_text(&client, &router).await;
    assert!(metric(&metrics, "pagedrs_router_retries_total") >= 1.0, "{metrics}");
    let healthy_a = format!("pagedrs_router_worker_healthy{{worker=\"{}\"}}", worker_a.url);
    assert_eq!(metric(&metrics, &healthy_a), 0.0, "a refused connection marks A down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_are_added_and_removed_at_run_time() {
    let worker_a = StubWorker::start("A").await;
    let worker_b = StubWorker::start("B").await;
    let router =
        RouterProcess::start(&["--worker", &worker_a.url, "--policy", "round_robin"]).await;
    let client = TestClient::new();
    let workers_url = format!("{}/workers", router.url);

    let (status, body) =
        client.json(Method::POST, &workers_url, Some(json!({ "url": worker_b.url }))).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let urls: Vec<&str> =
        body["workers"].as_array().unwrap().iter().map(|w| w["url"].as_str().unwrap()).collect();
    assert_eq!(urls, [worker_a.url.as_str(), worker_b.url.as_str()]);
    let mut answers: Vec<String> = Vec::new();
    for prompt in ["1", "2", "3", "4"] {
        answers.push(answered_by(&client, &router, prompt).await);
    }
    assert_eq!(answers, ["A", "B", "A", "B"]);

    let (status, body) =
        client.json(Method::DELETE, &workers_url, Some(json!({ "url": worker_a.url }))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for prompt in ["5", "6", "7"] {
        assert_eq!(answered_by(&client, &router, prompt).await, "B");
    }
    let (status, body) = client.json(Method::GET, &workers_url, None).await;
    assert_eq!(status, StatusCode::OK);
    let workers = body["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 1);
    assert_eq!(workers[0]["url"], worker_b.url.as_str());
    assert_eq!(workers[0]["requests_routed"], 5);
    for field in ["healthy", "in_flight", "tree_chars"] {
        assert!(workers[0].get(field).is_some(), "{field} in {body}");
    }

    let (status, body) =
        client.json(Method::DELETE, &workers_url, Some(json!({ "url": worker_a.url }))).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    let (status, body) =
        client.json(Method::POST, &workers_url, Some(json!({ "url": worker_b.url }))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let (status, body) = client.json(Method::POST, &workers_url, Some(json!({ "uri": "x" }))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("\"url\""), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_routing_keeps_a_shared_prefix_on_one_worker() {
    let worker_a = StubWorker::start("A").await;
    let worker_b = StubWorker::start("B").await;
    let router =
        RouterProcess::start(&["--worker", &worker_a.url, "--worker", &worker_b.url]).await;
    let client = TestClient::new();
    let system = "You are a meticulous assistant who answers in full sentences. ";
    let first = answered_by(&client, &router, &format!("{system}What is Rust?")).await;
    let second = answered_by(&client, &router, &format!("{system}What is Go?")).await;
    assert_eq!(second, first, "a shared prefix stays with its worker");
    let other = answered_by(&client, &router, "Completely different words here").await;
    assert_ne!(other, first, "a miss goes to the emptier tree");
    let metrics = metrics_text(&client, &router).await;
    assert_eq!(
        metric(&metrics, "pagedrs_router_routing_decisions_total{reason=\"cache_hit\"}"),
        1.0
    );
    assert_eq!(
        metric(&metrics, "pagedrs_router_routing_decisions_total{reason=\"cache_miss\"}"),
        2.0
    );

    // Headers pass through; Host names the worker.
    let url = format!("{}/v1/models?verbose=1", router.url);
    let response =
        client.send(Method::GET, &url, None, &[("authorization", "Bearer client-key")]).await;
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let echo: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(echo["authorization"], "Bearer client-key");
    assert_eq!(echo["path"], "/v1/models?verbose=1");
    let worker_url = if echo["worker"] == "A" { &worker_a.url } else { &worker_b.url };
    assert_eq!(format!("http://{}", echo["host"].as_str().unwrap()), *worker_url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_503_is_passed_back_without_a_retry() {
    let worker_a = StubWorker::start("A").await;
    let worker_b = StubWorker::start("B").await;
    let router =
        RouterProcess::start(&["--worker", &worker_a.url, "--worker", &worker_b.url]).await;
    let client = TestClient::new();
    let url = format!("{}/v1/overloaded", router.url);
    let (status, body) = client.json(Method::POST, &url, Some(json!({}))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["error"]["message"], "busy", "the worker's own answer");
    let metrics = metrics_text(&client, &router).await;
    assert_eq!(metric(&metrics, "pagedrs_router_retries_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_live_worker_the_router_answers_503_in_the_openai_shape() {
    let dead_url = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let router = RouterProcess::start(&["--worker", &dead_url]).await;
    let client = TestClient::new();
    let url = format!("{}/v1/completions", router.url);
    let (status, body) = client.json(Method::POST, &url, Some(json!({ "prompt": "hi" }))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["type"], "service_unavailable");
    assert_eq!(body["error"]["code"], 503);
    let (status, body) = client.json(Method::GET, &format!("{}/health", router.url), None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["workers"][0]["healthy"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_stream_in_flight_finish_then_exits_zero() {
    let worker = StubWorker::start("A").await;
    let mut router = RouterProcess::start(&["--worker", &worker.url]).await;
    let client = TestClient::new();
    let url = format!("{}/v1/completions", router.url);
    let response = client.send(Method::POST, &url, Some(stream_request()), &[]).await;
    let mut body = response.into_body();
    let mut text = String::new();
    worker.release_chunks(1);
    read_until(&mut body, &mut text, "data: A chunk 0\n\n").await;

    router.terminate();
    let address = router.url.trim_start_matches("http://").to_string();
    within("the router to stop accepting", async {
        while tokio::net::TcpStream::connect(&address).await.is_ok() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    worker.release_chunks(NUM_STREAM_CHUNKS);
    read_until(&mut body, &mut text, "data: [DONE]\n\n").await;
    assert_eq!(text, full_stream_text("A"));
    assert!(within("the end of the stream", body.frame()).await.is_none());
    let status = router.wait_for_exit().await;
    assert!(status.success(), "{status:?}");
}
