//! The hybrid store of the idempotency framework: Redis first, Postgres decides, Postgres
//! alone whenever Redis is down.
//!
//! [`HybridStore`] answers replays and live duplicates from Redis without touching Postgres,
//! decides every execution in Postgres' key table, writes completions to Postgres first and
//! then caches them in Redis. Losing every Redis key (`FLUSHALL`, eviction, restart) costs
//! latency, never a second execution; a failing Redis is routed around by a circuit breaker
//! ([`BreakerConfig`]) whose state and counters are in [`HybridStore::metrics`].
//!
//! Redis pays for duplicates and costs on every first request. [`CachePolicy::Adaptive`]
//! uses it only while enough recent requests are duplicates, so an API whose clients rarely
//! retry serves first requests at Postgres-only cost and still has Redis for a retry storm.
//!
//! The algorithm is on one screen in [`HybridStore`]'s docs (five steps); its code is the
//! `Store` impl in `store.rs`, each step's reason in its comments.
//!
//! Redis holds copies of one Postgres key table's records, under the Redis store's
//! [prefix](idempotency_redis::RedisStoreBuilder::prefix): hybrid stores of two key tables
//! (two services, staging and production) sharing a Redis need a prefix each, or one
//! replays the other's outcomes.

mod breaker;
mod flagged;
mod home;
mod store;

pub use breaker::{BreakerConfig, BreakerState};
pub use store::{CachePolicy, HybridMetrics, HybridStore};
