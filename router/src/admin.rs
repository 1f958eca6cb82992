//! The router's own routes: `GET /health`, `GET /metrics`, and `GET`/`POST`/`DELETE
//! /workers` to list, add and remove workers at run time.

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW};
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::json;

use crate::log::info;
use crate::metrics;
use crate::pool::PoolError;
use crate::responses::{error_response, json_response, text_response, ResponseBody};
use crate::state::RouterState;
use crate::worker::WorkerUrl;

/// The largest body `POST`/`DELETE /workers` reads.
const MAX_ADMIN_BODY_BYTES: usize = 64 * 1024;

/// The body of `POST` and `DELETE /workers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerChange {
    /// The worker's base URL, e.g. `http://10.0.0.5:8000`.
    url: String,
}

/// `GET /health`: 200 if any worker is healthy, else 503; the body lists the workers.
pub fn health(state: &RouterState) -> Response<ResponseBody> {
    let workers = state.pool().snapshot().workers;
    let (status, label) = if workers.iter().any(|worker| worker.healthy) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no healthy worker")
    };
    let workers: Vec<serde_json::Value> = workers
        .into_iter()
        .map(|worker| json!({ "url": worker.url, "healthy": worker.healthy }))
        .collect();
    json_response(status, &json!({ "status": label, "workers": workers }))
}

/// `GET /metrics`: the counters in the Prometheus text format.
pub fn metrics(state: &RouterState) -> Response<ResponseBody> {
    let text = metrics::render(&state.pool().snapshot());
    text_response(StatusCode::OK, metrics::CONTENT_TYPE, text)
}

/// `/workers`: `GET` lists them, `POST {"url": ...}` adds one, `DELETE {"url": ...}` removes
/// one (its requests in flight run to their end). Each answers with the list.
pub async fn workers(state: &RouterState, request: Request<Incoming>) -> Response<ResponseBody> {
    let method = request.method().clone();
    if method == Method::GET {
        return worker_list(state, StatusCode::OK);
    }
    if method != Method::POST && method != Method::DELETE {
        let mut response = error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("/workers takes GET, POST or DELETE, not {method}"),
        );
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, POST, DELETE"));
        return response;
    }
    let url = match read_worker_url(request).await {
        Ok(url) => url,
        Err(message) => return error_response(StatusCode::BAD_REQUEST, message),
    };
    let outcome = if method == Method::POST {
        state.pool().add(url.clone()).map(|_| StatusCode::CREATED)
    } else {
        state.pool().remove(&url).map(|_| StatusCode::OK)
    };
    match outcome {
        Ok(status) => {
            let verb = if method == Method::POST { "added" } else { "removed" };
            info!("worker {url} {verb}");
            worker_list(state, status)
        }
        Err(error @ PoolError::AlreadyRegistered(_)) => {
            error_response(StatusCode::CONFLICT, error.to_string())
        }
        Err(error) => error_response(StatusCode::NOT_FOUND, error.to_string()),
    }
}

/// Every worker with its health, load, tree size and request count.
fn worker_list(state: &RouterState, status: StatusCode) -> Response<ResponseBody> {
    json_response(status, &json!({ "workers": state.pool().snapshot().workers }))
}

/// The worker URL in the JSON body of `request`, or a message saying what is wrong.
async fn read_worker_url(request: Request<Incoming>) -> Result<WorkerUrl, String> {
    let body = Limited::new(request.into_body(), MAX_ADMIN_BODY_BYTES)
        .collect()
        .await
        .map_err(|error| format!("could not read the body: {error}"))?
        .to_bytes();
    let change: WorkerChange = serde_json::from_slice(&body).map_err(|error| {
        format!("the body must be JSON like {{\"url\": \"http://host:port\"}}: {error}")
    })?;
    WorkerUrl::parse(&change.url)
}
