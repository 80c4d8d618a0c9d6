//! Test support for the idempotency workspace (not published).
//!
//! - [`services`]: real Postgres and Redis (containers or user-given URLs), with handles to
//!   stop, start, pause and unpause them for fault injection;
//! - [`conformance`]: the store conformance suite and [`conformance_tests!`], which every store
//!   runs;
//! - [`differential`] and [`linearizable`]: the model's store carried over to every store,
//!   one call at a time and with calls that overlap;
//! - [`http`]: an HTTP/1.1 client (hyper) whose dropped requests hang up;
//! - [`relay`]: a TCP relay that loses one reply, for "it landed but the answer was lost";
//! - [`stores`]: stores built once per binary on the shared services;
//! - [`tls`]: a CA made at test time, for the TLS-enabled services;
//! - [`block_on`]: runs a test on the binary's one shared runtime.
//!
//! Service-backed tests share one runtime per test binary because connection pools and the
//! Docker client spawn tasks on the runtime that created them; a pool created under one
//! `#[tokio::test]` runtime breaks when that runtime shuts down and the next test reuses it.

pub mod conformance;
pub mod differential;
pub mod http;
pub mod late;
pub mod linearizable;
pub mod relay;
pub mod services;
pub mod stores;
pub mod tls;

use std::{future::Future, sync::OnceLock};

pub use idempotency_core::Store;

/// The runtime every test of a binary runs on.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .expect("building the test runtime")
    })
}

/// A runtime of one worker, apart from the shared one: to shut down under a call (an
/// application's worker runtime at its shutdown drops its tasks unrun).
pub fn doomed_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("building a runtime")
}

/// Runs a test body on the shared runtime. Several tests may call it at once.
pub fn block_on<F: Future>(future: F) -> F::Output {
    runtime().block_on(future)
}

/// A unique name for per-test isolation (key prefixes, scopes, table names).
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}
