//! `pagedrs-router`: parses the command line, runs the router until SIGTERM or SIGINT, and
//! exits 0 once the requests in flight have finished (2 on a bad command line, 1 when it
//! cannot start).

use std::process::ExitCode;

use pagedrs_router::config::{parse_args, usage, Command};
use pagedrs_router::server::serve;

fn main() -> ExitCode {
    let config = match parse_args(std::env::args().skip(1)) {
        Ok(Command::Run(config)) => config,
        Ok(Command::Help) => {
            print!("{}", usage());
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("pagedrs-router: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("pagedrs-router: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config, shutdown_signal())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pagedrs-router: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut terminate), Ok(mut interrupt)) =
        (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        eprintln!("pagedrs-router: cannot listen for signals; stop it with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
}
