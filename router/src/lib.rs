//! pagedrs-router: an HTTP router in front of OpenAI-compatible workers (pagedrs servers or
//! others) that sends each request to the worker most likely to have its prompt's prefix
//! in its KV cache, while keeping the load balanced.
//!
//! Modules without I/O, tested on their own:
//! - [`prefix_tree`]: the approximate radix tree of keys routed to one worker;
//! - [`policy`]: cache-aware, round-robin and least-load choices over candidate workers;
//! - [`pool`]: the workers' health, loads, trees and counters around the policy;
//! - [`routing_key`]: the text of a request that its worker would cache;
//! - [`config`], [`metrics`], [`worker`].
//!
//! And the I/O around them: [`server`] (listener, graceful shutdown), [`proxy`] (forwarding,
//! retries, streaming), [`admin`] (the router's own routes), [`health`] (the checker).

#![warn(missing_docs)]

pub mod admin;
pub mod config;
pub mod health;
pub mod log;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod prefix_tree;
pub mod proxy;
pub mod responses;
pub mod routing_key;
pub mod server;
pub mod state;
pub mod worker;
