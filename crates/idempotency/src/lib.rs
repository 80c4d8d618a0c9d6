//! An operation runs once per idempotency key, even when a gateway retries, a client
//! disconnects, a worker crashes or Redis dies.
//!
//! This is the crate applications depend on. It re-exports the core types and, behind
//! features, the backends:
//!
//! ## Features
#![doc = document_features::document_features!()]
//!
//! Each backend module re-exports the client crate it is built on —
//! `idempotency::postgres::sqlx` and `idempotency::redis::redis` — so an application that
//! brings its own pool (`PostgresStore::from_pool`) or connection
//! (`RedisStore::from_connection_manager`) builds it with the same version.
//!
//! Over HTTP, put `idempotency::tower::IdempotencyLayer` (feature `tower`) in front of the
//! routes that create things. Elsewhere (a message consumer, a job), run the operation
//! through an [`Executor`]: it claims the key, renews the lease while the operation runs,
//! stops the operation if the lease is lost, and stores the outcome; every retry gets it.
//!
//! ```
//! use std::sync::Arc;
//! use idempotency::{Executor, Fingerprint, IdempotencyKey, MemoryStore, Scope};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let executor = Executor::new(Arc::new(MemoryStore::new()));
//! let (scope, key) = (Scope::new("acct_1"), IdempotencyKey::new("charge-1").unwrap());
//! let request = Fingerprint::of(br#"{"amount":1000}"#);
//! for _ in 0..2 {
//!     let charged = executor
//!         .run(&scope, &key, &request, || async {
//!             Ok::<_, std::io::Error>("ch_1".to_owned()) // charge the card: once
//!         })
//!         .await
//!         .expect("ran, or replayed");
//!     assert_eq!(charged.value, "ch_1");
//! }
//! executor.drain().await; // at shutdown: what runs left to settle is settled
//! # }
//! ```
//!
//! The [`Store`] trait underneath is for building such drivers, not for calling around an
//! effect by hand: a raw `begin` … `complete` neither renews its lease nor stops when the
//! lease is lost, so a slow attempt and the retry that took its key over both run.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use idempotency_core::*;

/// The Postgres store: the guarantee (see the `idempotency-postgres` crate).
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres {
    pub use idempotency_postgres::*;
}

/// The Redis store: the fast path (see the `idempotency-redis` crate).
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis {
    pub use idempotency_redis::*;
}

/// The hybrid store: Redis first, Postgres decides (see the `idempotency-hybrid` crate).
#[cfg(feature = "hybrid")]
#[cfg_attr(docsrs, doc(cfg(feature = "hybrid")))]
pub mod hybrid {
    pub use idempotency_hybrid::*;
}

/// The tower/axum middleware speaking the IETF Idempotency-Key draft (see the
/// `idempotency-tower` crate).
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod tower {
    pub use idempotency_tower::*;
}
