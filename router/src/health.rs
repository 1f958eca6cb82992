//! The health checker: `GET {worker}/health` on every worker each `--health-interval`.
//!
//! A 200 marks a worker up; any other status, an error or no answer within
//! [`HEALTH_CHECK_TIMEOUT`] marks it down (routing skips it and its tree is cleared). The
//! first round runs at start-up; until it answers, workers count as up.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{HeaderValue, AUTHORIZATION, HOST};
use hyper::{Request, StatusCode};
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;

use crate::log::info;
use crate::responses::describe_error;
use crate::state::RouterState;
use crate::worker::WorkerUrl;

/// How long a worker may take to answer a health check.
pub const HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest health-check body read (read so the connection can be reused).
const MAX_HEALTH_BODY_BYTES: usize = 64 * 1024;

/// Checks every worker, round after round, until the task is aborted. A round waits for
/// all its checks, so a slow worker delays the next round rather than piling checks up.
pub async fn run_health_checks(state: Arc<RouterState>) {
    let mut ticker = tokio::time::interval(state.config.health_interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let workers = state.pool().workers();
        let mut checks = JoinSet::new();
        for (worker_id, url) in workers {
            let state = Arc::clone(&state);
            checks.spawn(async move {
                let outcome = check(&state, &url).await;
                (worker_id, url, outcome)
            });
        }
        while let Some(joined) = checks.join_next().await {
            let Ok((worker_id, url, outcome)) = joined else {
                continue;
            };
            if state.pool().set_healthy(worker_id, outcome.is_ok()) {
                match outcome {
                    Ok(()) => info!("worker {url} is up"),
                    Err(reason) => info!("worker {url} is down: {reason}"),
                }
            }
        }
    }
}

/// One health check of the worker at `url`: `Ok` on a 200, else why not.
async fn check(state: &RouterState, url: &WorkerUrl) -> Result<(), String> {
    let mut request = Request::new(Full::new(Bytes::new()));
    *request.uri_mut() = url.endpoint("/health")?;
    let host = HeaderValue::from_str(url.authority()).map_err(|error| error.to_string())?;
    request.headers_mut().insert(HOST, host);
    if let Some(api_key) = &state.config.api_key {
        let bearer = HeaderValue::from_str(&format!("Bearer {api_key}"))
            .map_err(|_| "the --api-key is not a valid header value".to_string())?;
        request.headers_mut().insert(AUTHORIZATION, bearer);
    }
    let answer = async {
        let response =
            state.client.request(request).await.map_err(|error| describe_error(&error))?;
        let status = response.status();
        // Read to the end, so the pooled connection can carry the next check.
        let _ = Limited::new(response.into_body(), MAX_HEALTH_BODY_BYTES).collect().await;
        if status == StatusCode::OK {
            Ok(())
        } else {
            Err(format!("GET /health answered {status}"))
        }
    };
    match tokio::time::timeout(HEALTH_CHECK_TIMEOUT, answer).await {
        Ok(outcome) => outcome,
        Err(_elapsed) => Err(format!("no answer to GET /health within {HEALTH_CHECK_TIMEOUT:?}")),
    }
}
