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
//! ```
//! use std::time::Duration;
//! use idempotency::{Begin, Fingerprint, IdempotencyKey, MemoryStore, Outcome, RecordId, Scope, Store};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotency::Error> {
//! let store = MemoryStore::new();
//! let id = RecordId::new(&Scope::new("acct_1"), &IdempotencyKey::new("charge-1").unwrap());
//! let fp = Fingerprint::of(br#"{"amount":1000}"#);
//! match store.begin(&id, &fp, Duration::from_secs(30)).await? {
//!     Begin::Execute(token) => {
//!         let outcome = Outcome::new(201).with_body("ch_1"); // charge the card once
//!         store.complete(&id, token, &outcome, Duration::from_secs(86_400)).await?;
//!     }
//!     Begin::TakeOver(token) => {
//!         // An earlier attempt's lease ran out before it stored an outcome: it may have
//!         // charged. Look for its charge by the record id; found, store it as the outcome
//!         // (not found: charge, as for `Execute`).
//!         let found = Outcome::new(201).with_body("ch_1");
//!         store.complete(&id, token, &found, Duration::from_secs(86_400)).await?;
//!     }
//!     Begin::Replay(outcome) => println!("already charged: {:?}", outcome.body),
//!     Begin::InFlight { retry_after } => println!("retry in {retry_after:?}"),
//!     Begin::Mismatch => println!("key reused for another request"),
//! }
//! # Ok(()) }
//! ```
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
