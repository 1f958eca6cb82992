//! What every request handler shares: the settings, the worker pool and the HTTP client.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::RouterConfig;
use crate::policy::Policy;
use crate::pool::{PoolError, WorkerPool};

/// How long connecting to a worker may take before it counts as refused.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an idle pooled connection to a worker is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The pooled HTTP/1.1 client the router talks to workers with.
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// The router's shared state.
#[derive(Debug)]
pub struct RouterState {
    /// The settings it was started with.
    pub config: RouterConfig,
    /// The workers and the routing policy; held only for short, non-blocking updates.
    pool: Mutex<WorkerPool>,
    /// Connections to workers, pooled per worker.
    pub client: UpstreamClient,
}

impl RouterState {
    /// The state for `config`, with its workers registered (healthy until checked).
    pub fn new(config: RouterConfig) -> Result<RouterState, PoolError> {
        let policy = Policy::new(config.policy, config.thresholds);
        let mut pool = WorkerPool::new(policy, config.max_tree_chars);
        for url in &config.workers {
            pool.add(url.clone())?;
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            .build(connector);
        Ok(RouterState { config, pool: Mutex::new(pool), client })
    }

    /// The pool, locked. A panic elsewhere while it was held leaves counters that are at
    /// worst slightly off, so the router keeps serving rather than failing every request.
    pub fn pool(&self) -> MutexGuard<'_, WorkerPool> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
