//! The Postgres store of the idempotency framework: the guarantee.
//!
//! One table, `idempotency_keys`, keyed by the record id. Its primary key decides every race
//! (`INSERT … ON CONFLICT DO NOTHING`), its lease columns recover the keys of crashed workers,
//! and every time comes from Postgres' clock (`clock_timestamp()`), so clock skew between
//! application hosts cannot expire a lease early.
//!
//! - [`PostgresStore`] implements [`Store`](idempotency_core::Store);
//! - [`PostgresStore::complete_in`] completes a record inside the application's own
//!   transaction: the business effect and the stored outcome commit together;
//!   [`PostgresStore::commit_claim`] does the same for an operation of
//!   [`Executor::run_with_claim`](idempotency_core::Executor::run_with_claim), and commits
//!   ([`PostgresStore::complete_claim_in`] leaves the commit to the caller);
//! - [`migrator`] embeds the migrations (`_idempotency_migrations` table);
//! - purge expired rows with [`idempotency_core::Purger`] (small batches, `SKIP LOCKED`, paced
//!   so that live statements keep their latency);
//! - [`StateMachine`]: guarded status transitions with a version column (optimistic locking).
//!
//! ## Behind a connection pooler
//!
//! The store's statements are prepared (sqlx's named statements, cached per connection).
//! A transaction-mode pooler must track them across its server connections (PgBouncer 1.21
//! or later with `max_prepared_statements` above 0), or run in session mode: one that hands
//! a prepared name to another server connection can run a statement under another's name
//! there (two of the store's fenced writes take the same parameter types), a release done as
//! an expiry. The settings the store sends in its startup packet (`statement_timeout`, the
//! isolation level) are lost where a pooler ignores `options` (PgBouncer's
//! `ignore_startup_parameters`): set them on the role instead.
//!
//! ## Features
#![doc = document_features::document_features!()]
#![cfg_attr(docsrs, feature(doc_cfg))]
//!
//! ```no_run
//! use std::{sync::Arc, time::Duration};
//! use idempotency_core::{Purger, Store};
//! use idempotency_postgres::PostgresStore;
//!
//! # async fn run() -> Result<(), idempotency_core::Error> {
//! let store = PostgresStore::builder("postgres://app@127.0.0.1/app").connect().await?;
//! store.migrate().await?;
//! let store = Arc::new(store);
//! // Every minute: 100 rows per statement, each followed by twice its time of rest.
//! let purger = Purger::new(store.clone()).every(Duration::from_secs(60)).spawn();
//! // ... serve traffic with `store` ...
//! purger.shutdown().await;
//! # Ok(()) }
//! ```

mod batch;
mod checkout;
mod store;
mod table;
mod transitions;

pub use batch::{GroupCommit, GroupCommitStats};
pub use store::{CommitClaimError, PostgresStore, PostgresStoreBuilder, migrator};
pub use transitions::{StateMachine, StateMachineBuilder, Transition, TransitionError};

/// Whether a statement that failed with `error` may have committed its write all the same:
/// the rule this store's group-commit batches follow (its per-request claim is more cautious
/// still: it takes every error for one that may have committed), for an application's writes
/// beside it (a handler's insert of the charge it made). Answer such a failure as one whose effect may
/// have happened (the HTTP layer's `MaybeApplied`), never as "nothing was written": the key
/// is then kept for the outcome-unknown policy, not given back to a retry that writes again.
///
/// `false` only when the statement never left the pool (a pool timeout, a closed pool), or
/// when Postgres refused it before or while it ran and rolled it back: a lock or statement
/// timeout, a deadlock, a serialization failure, a data exception (class 22), an integrity
/// violation (class 23), a statement the transaction's state refused (class 25: a read-only
/// server or role, `25006`), no such table or a syntax or permission error (class 42), a
/// limit (54000). Anything else may come after the commit: the connection broke, the server shut
/// down, or a pooler answered for a server connection that broke after the statement ran
/// (PgBouncer's `08P01`).
///
/// ```
/// use idempotency_postgres::{may_have_committed, sqlx};
/// assert!(!may_have_committed(&sqlx::Error::PoolTimedOut));
/// let broke = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
/// assert!(may_have_committed(&sqlx::Error::Io(broke)));
/// ```
pub fn may_have_committed(error: &sqlx::Error) -> bool {
    batch::in_doubt(error)
}

/// The `sqlx` crate this store is built on, so an application's own pool (for
/// [`PostgresStore::from_pool`]) is of the same version.
pub use sqlx;
