//! The vocabulary and protocol of the idempotency framework.
//!
//! A client sends one `Idempotency-Key` per logical operation. The first request with a key
//! executes and its [`Outcome`] is stored; every retry with the same key gets the stored
//! outcome instead of executing again. This crate holds what every backend and front end
//! shares:
//!
//! - [`IdempotencyKey`], [`Scope`] and [`RecordId`]: what names a record;
//! - [`Fingerprint`]: what makes two requests "the same";
//! - [`Outcome`]: what a replay returns, with the binary encoding every store uses;
//! - [`Store`]: the record state machine (`begin` → `Execute` / `Replay` / `InFlight` /
//!   `Mismatch`, then `complete` or `release`, fenced by a [`LeaseToken`]);
//! - [`Policy`]: lease, retention and which statuses are stored;
//! - [`Inspection`] and [`ForceReleased`]: what an operator sees of a record and may do to
//!   it ([`Store::inspect`], [`Store::force_release`]);
//! - [`MemoryStore`]: the in-process store (single process only);
//! - [`Purger`] and [`spawn_purger`]: paced, batched deletion of expired records for any store;
//! - [`Executor`]: run any async operation once per key (queue consumers, jobs).
//!
//! Backends live in their own crates (`idempotency-postgres`, `idempotency-redis`, …); most
//! applications depend on the `idempotency` facade instead of this crate.

mod detach;
mod executor;
mod fingerprint;
mod handover;
mod inspect;
mod key;
mod memory;
mod observe;
mod outcome;
mod policy;
mod purge;
mod store;

pub use detach::{
    FinishOnDrop, GrantsLease, detached_begin, detached_claim, end_orphan, finish_on_drop,
    give_back_orphan, panic_as_unavailable, release_orphan, spawn_where_it_survives, within_lease,
    within_lease_with,
};
pub use executor::{
    Claim, Completion, Executed, Executor, RunError, accepted_in_transaction, complete_late,
    complete_or_keep_trying, complete_retrying, completing_in_transaction,
};
pub use fingerprint::{Fingerprint, FingerprintBuilder};
pub use handover::{FinishInAnyCase, HANDOVER_AFTER, finish_in_any_case};
pub use inspect::{
    ForceReleased, Inspection, RecordState, ReleaseScope, Resolved, resolve_unknown,
    resolve_unknown_tracked, system_time_from_millis,
};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN, RecordId, Scope};
pub use memory::MemoryStore;
pub use observe::{Answer, Observed, observe};
pub use outcome::{DecodeError, OUTCOME_NOT_STORED, Outcome};
pub use policy::{Policy, default_cacheable};
pub use purge::{PurgeHandle, Purger, spawn_purger};
pub use store::{
    Begin, BoxError, Error, FOR_GOOD, LATE_COMPLETION_GRACE, LeaseToken, Result, Store,
    UNKNOWN_OUTCOME_RETENTION,
};
