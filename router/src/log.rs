//! Logging to stderr without a logging crate.
//!
//! - `info!` always prints: start-up, workers going up or down, shutdown.
//! - `debug!` prints only when `PAGEDRS_ROUTER_LOG=debug`: one line per routing decision.
//!
//! The environment variable is read once; its message is not even formatted when debug
//! logging is off, so a routing decision costs nothing extra in production.

use std::sync::OnceLock;

/// The environment variable that turns on debug logging when set to `debug`.
pub const LOG_ENV_VAR: &str = "PAGEDRS_ROUTER_LOG";

/// Whether debug lines are printed (`PAGEDRS_ROUTER_LOG=debug`), read once per process.
pub fn debug_enabled() -> bool {
    static DEBUG_ENABLED: OnceLock<bool> = OnceLock::new();
    *DEBUG_ENABLED.get_or_init(|| {
        std::env::var(LOG_ENV_VAR).is_ok_and(|level| level.eq_ignore_ascii_case("debug"))
    })
}

/// Prints one line to stderr, prefixed with the program name.
macro_rules! info {
    ($($arg:tt)*) => {
        eprintln!("pagedrs-router: {}", format_args!($($arg)*))
    };
}

/// Prints one line to stderr when debug logging is on (see [`debug_enabled`]).
macro_rules! debug {
    ($($arg:tt)*) => {
        if $crate::log::debug_enabled() {
            eprintln!("pagedrs-router: debug: {}", format_args!($($arg)*))
        }
    };
}

pub(crate) use debug;
pub(crate) use info;
