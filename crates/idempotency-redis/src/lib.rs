//! The Redis store of the idempotency framework: the fast path.
//!
//! [`RedisStore`] implements [`Store`](idempotency_core::Store) with atomic operations of
//! one round trip (two for a claim that finds a live lease): a claim is a plain `SET NX GET`; the writes fenced on the lease token are Lua
//! scripts (`EVALSHA` with reload on `NOSCRIPT`). A record is one string at
//! `{prefix}:{<record id hex>}` (state, fingerprint, token, outcome); the braces are a cluster
//! hash tag. Lease and retention are TTLs kept by Redis, so no application clock is involved
//! (but for the hybrid's outcome copies, also bounded by their row's expiry).
//! Records of the earlier hash layout are still served until they expire.
//!
//! On its own, Redis is a best-effort guarantee: a record lost to eviction, `FLUSHALL`, a
//! restart without persistence or a failover executes again. The store refuses an evicting
//! `maxmemory-policy` at start for that reason; for payments put Postgres behind it with the
//! hybrid store, which also uses [`RedisStore::peek`], [`RedisStore::cache_in_flight`] and
//! [`RedisStore::cache_completed`].
//!
//! It needs Redis 7.0 or later (or a server that speaks it, such as Valkey): the claim is
//! `SET … NX GET`, and the completion a script with flags. An older server is refused at
//! connect, unless [`EvictionCheck::Skip`] asks nothing of it.
//!
//! ## Features
#![doc = document_features::document_features!()]
#![cfg_attr(docsrs, feature(doc_cfg))]
//!
//! ```no_run
//! use idempotency_redis::RedisStore;
//!
//! # async fn run() -> Result<(), idempotency_core::Error> {
//! let store = RedisStore::builder("redis://127.0.0.1:6379/").connect().await?;
//! # Ok(()) }
//! ```

mod scripts;
mod store;

pub use store::{EvictionCheck, Peek, RedisStore, RedisStoreBuilder, Replaced};

/// The `redis` crate this store is built on, so an application's own client (for
/// [`RedisStore::from_connection_manager`]) is of the same version.
pub use redis;
