//! The listener: accepts connections, sends each request to the router's own routes or to
//! the proxy, and shuts down gracefully.
//!
//! Shutdown: when `shutdown` resolves, the listener closes (new connections are refused),
//! idle connections close, and requests in flight (streams included) get up to
//! `--shutdown-timeout` to finish.

use std::convert::Infallible;
use std::future::Future;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::admin;
use crate::config::RouterConfig;
use crate::health::run_health_checks;
use crate::log::{debug, info};
use crate::proxy::forward;
use crate::responses::ResponseBody;
use crate::state::RouterState;

/// Runs the router for `config` until `shutdown` resolves and the requests in flight have
/// finished. Prints `pagedrs-router listening on http://ADDRESS` to stdout once bound.
pub async fn serve(config: RouterConfig, shutdown: impl Future<Output = ()>) -> Result<(), String> {
    let address = (config.host.clone(), config.port);
    let listener = TcpListener::bind(&address)
        .await
        .map_err(|error| format!("cannot listen on {}:{}: {error}", address.0, address.1))?;
    let local_address = listener.local_addr().map_err(|error| error.to_string())?;
    if config.workers.is_empty() {
        info!("no --worker given: add workers with POST /workers");
    }
    let drain_timeout = config.shutdown_timeout;
    let state = Arc::new(RouterState::new(config).map_err(|error| error.to_string())?);
    let health_checks = tokio::spawn(run_health_checks(Arc::clone(&state)));
    println!("pagedrs-router listening on http://{local_address}");
    // Tests and supervisors wait for that line; stdout may be a pipe that buffers.
    let _ = std::io::stdout().flush();

    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(error) => {
                        // Out of file descriptors and the like: pause rather than spin.
                        info!("accept failed: {error}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let state = Arc::clone(&state);
                let service = service_fn(move |request| {
                    let state = Arc::clone(&state);
                    async move { Ok::<_, Infallible>(handle(state, request).await) }
                });
                let connection = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .serve_connection(TokioIo::new(stream), service);
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    if let Err(error) = connection.await {
                        debug!("connection ended: {error}");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    let seconds = drain_timeout.as_secs_f64();
    info!("shutting down: waiting up to {seconds} s for requests in flight");
    if tokio::time::timeout(drain_timeout, graceful.shutdown()).await.is_err() {
        info!("requests still in flight after {seconds} s; closing them");
    }
    health_checks.abort();
    Ok(())
}

/// Sends `request` to the router's own route for its path, or to a worker.
async fn handle(state: Arc<RouterState>, request: Request<Incoming>) -> Response<ResponseBody> {
    match (request.method(), request.uri().path()) {
        (&Method::GET, "/health") => admin::health(&state),
        (&Method::GET, "/metrics") => admin::metrics(&state),
        (_, "/workers") => admin::workers(&state, request).await,
        _ => forward(state, request).await,
    }
}
