//! The `Store` trait: the record state machine every backend implements.

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use uuid::Uuid;

use crate::{Fingerprint, ForceReleased, Inspection, Outcome, RecordId, ReleaseScope};

/// The least time an expired lease that nobody took over stays in any store, so that its
/// owner's late `complete` or `release` is still accepted and a retry is told
/// [`Begin::TakeOver`]: Redis keeps it this long past its lease (its record layout counts
/// on it). The stores that purge keep it longer, [`UNKNOWN_OUTCOME_RETENTION`]. A `begin`
/// takes it over at once regardless.
pub const LATE_COMPLETION_GRACE: Duration = Duration::from_secs(3600);

/// How long the purges of the memory and the Postgres stores keep by default (see
/// [`MemoryStore::with_unknown_outcome_retention`](crate::MemoryStore::with_unknown_outcome_retention)
/// and `PostgresStoreBuilder::unknown_outcome_retention`) the record of an attempt
/// whose outcome is unknown (its lease ran out unfinished and nobody took it over), counted
/// from when its lease ran out: a day, as long as [`Policy`](crate::Policy) keeps an
/// outcome by default. A crash mid-charge is then remembered as long as a charge would
/// have been: a retry the next morning is still told [`Begin::TakeOver`] (the HTTP layer's
/// `Reject` and `Reconcile` act on it), not `Execute`, which would charge again. Past it,
/// [`Store::purge_expired`] removes the record. Policies that keep outcomes longer should
/// have the Postgres store keep these as long.
///
/// ```
/// use idempotency_core::{Policy, UNKNOWN_OUTCOME_RETENTION};
///
/// assert_eq!(UNKNOWN_OUTCOME_RETENTION, Policy::default().retention());
/// ```
pub const UNKNOWN_OUTCOME_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The longest lease or retention a store keeps: 100 years. A longer one (up to
/// `Duration::MAX`, "for good") is kept this long, which in practice is the same; every
/// store caps at it rather than overflow its clock or its database's arithmetic.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{Policy, FOR_GOOD};
///
/// let policy = Policy::default().with_retention(Duration::MAX);
/// assert_eq!(policy.retention(), FOR_GOOD);
/// ```
pub const FOR_GOOD: Duration = Duration::from_secs(100 * 366 * 86_400);

/// A boxed error from a backend client.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong talking to a store.
///
/// The HTTP layer maps `Unavailable` to 503 (the operation does not run unguarded), a
/// `LeaseLost` while the handler runs to 503 too (it is stopped; another attempt holds the
/// key), and a `Corrupt` record to 500; a `LeaseLost` when storing the handler's response
/// passes that response through, unstored.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store could not be reached or did not answer within its budget. Nothing is known
    /// to have changed; the caller must not run the operation.
    #[error("idempotency store unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// The token no longer owns the record: its lease expired and another attempt took over
    /// (or completed). Nothing was changed.
    #[error("lease lost: the record is owned by another attempt or no longer exists")]
    LeaseLost,
    /// The store returned a record this version cannot read.
    #[error("corrupt idempotency record: {0}")]
    Corrupt(String),
    /// The store refused its configuration (for example an evicting Redis).
    #[error("invalid idempotency store configuration: {0}")]
    Config(String),
}

impl Error {
    /// Wraps a backend error as [`Error::Unavailable`].
    pub fn unavailable(source: impl Into<BoxError>) -> Self {
        Self::Unavailable(source.into())
    }
}

/// Proof of ownership of an in-flight record: the fencing token.
///
/// Every `begin` that returns `Execute` mints a new random token; `complete`, `release` and
/// `renew` succeed only while the record still carries it. A worker that stalled past its
/// lease therefore cannot overwrite the outcome of the attempt that took over.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(Uuid);

impl LeaseToken {
    /// A fresh random token.
    pub fn generate() -> Self {
        Self(Uuid::new_v4())
    }

    /// Wraps a token read back from a store.
    pub fn from_uuid(uuid: Uuid) -> Self {
        Self(uuid)
    }

    /// The token as a UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({})", self.0)
    }
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The answer of [`Store::begin`]: exactly one of five.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// The caller owns the key and must run the operation, then `complete` or `release`.
    Execute(LeaseToken),
    /// As `Execute`, but the key was taken over from an earlier attempt whose lease ran out
    /// before it completed (it crashed, hung, or lost its connection): **that attempt's
    /// outcome is unknown**, and it may have had its effect (was the card charged?). Check
    /// before running the operation again, then `complete` or `release` as for `Execute`.
    ///
    /// Reported while the expired lease's record exists: on Postgres and in memory until a
    /// purge past [`UNKNOWN_OUTCOME_RETENTION`] (a day; configurable on Postgres) after the
    /// lease ran out, on Redis for [`LATE_COMPLETION_GRACE`] (an hour). A key retried once
    /// its record is gone answers `Execute`. A completed record past its retention, or a
    /// released one, is a fresh start: `Execute`.
    TakeOver(LeaseToken),
    /// The operation completed earlier with the same fingerprint: return this outcome.
    Replay(Outcome),
    /// Another attempt holds a live lease; try again after about `retry_after`.
    InFlight {
        /// The lease's remaining time, as the store's clock sees it.
        retry_after: Duration,
    },
    /// The key was used with a different fingerprint (in flight or completed).
    Mismatch,
}

impl Begin {
    /// The token of the lease this answer grants: `Execute` and `TakeOver`.
    ///
    /// ```
    /// use idempotency_core::{Begin, LeaseToken};
    /// let token = LeaseToken::generate();
    /// assert_eq!(Begin::TakeOver(token).lease_token(), Some(token));
    /// assert_eq!(Begin::Mismatch.lease_token(), None);
    /// ```
    pub fn lease_token(&self) -> Option<LeaseToken> {
        match self {
            Begin::Execute(token) | Begin::TakeOver(token) => Some(*token),
            _ => None,
        }
    }
}

/// A place that records, per record id, whether an operation ran and what it returned.
///
/// The state machine every implementation follows (`docs/design.md`):
///
/// ```text
/// absent/expired --begin--> InFlight{token, lease_until} --complete(token)--> Completed{outcome}
///                                |  \--release(token)--> absent
///                                \--lease expired, begin--> InFlight{new token}
/// ```
///
/// - `begin` on an absent record, or on a completed record past its retention, claims it and
///   returns `Execute` with a new token; on a record whose lease expired (not completed), it
///   takes it over and returns `TakeOver` with a new token.
/// - On a live record with another fingerprint it returns `Mismatch`; with the same
///   fingerprint `Replay` when completed and `InFlight` while leased. An unfinished record
///   whose lease ran out is taken over by the same fingerprint only; another fingerprint is
///   `Mismatch` as long as the record exists (Redis: up to [`LATE_COMPLETION_GRACE`] past
///   the lease; Postgres and memory: until the purge removes it,
///   [`UNKNOWN_OUTCOME_RETENTION`] past the lease).
/// - `complete`, `release` and `renew` succeed only while the token owns the record, and
///   otherwise return [`Error::LeaseLost`] and change nothing. A token owns an in-flight
///   record until another `begin` takes it over — **even after its lease ran out**: a late
///   `complete` from a slow owner is accepted as long as nobody took over (and while
///   the record is kept, at least [`LATE_COMPLETION_GRACE`]), so a store blip never causes
///   a second execution. Once another attempt took over, the old token is fenced off for
///   good.
/// - `complete` is idempotent for its token: repeating it after a lost answer returns `Ok`
///   and keeps the first outcome.
/// - Times come from the store's own clock, never the caller's, read when the write happens.
///
/// # Cancellation
///
/// Every future of this trait may be dropped at any await (a client hang-up, an outer
/// timeout, a `select!`). Implementations guarantee:
///
/// - **`begin`**: dropped, or answered `Unavailable`, it leaves no claim behind that nobody
///   holds: a lease it granted meanwhile is released, one it took over is ended (see
///   [`detached_begin`](crate::detached_begin), which does both).
/// - **`complete`**, **`release`**, **`renew`**: dropped or `Unavailable`, the write may or
///   may not have happened; the caller still holds the token and repeats the call
///   (`complete` is idempotent, a repeated `release` answers `LeaseLost` once it landed).
///   If nobody repeats it, the lease expires and the key is answerable again.
///
/// The trait is object safe: applications pick a store at run time and hold an
/// `Arc<dyn Store>`.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{Begin, Fingerprint, IdempotencyKey, MemoryStore, Outcome, RecordId, Scope, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotency_core::Error> {
/// let store = MemoryStore::new();
/// let id = RecordId::new(&Scope::new("acct_1"), &IdempotencyKey::new("order-42").unwrap());
/// let fp = Fingerprint::of(b"amount=100");
/// let lease = Duration::from_secs(30);
///
/// let Begin::Execute(token) = store.begin(&id, &fp, lease).await? else { unreachable!() };
/// // ... run the operation once: an operation that may outlast its lease needs renewals,
/// // and must stop when one answers `LeaseLost` (a retry took the key over and runs it).
/// // `Executor` and the HTTP layer do both; a bare `begin` ... `complete` does neither.
/// store.complete(&id, token, &Outcome::new(201).with_body("ch_1"), Duration::from_secs(3600)).await?;
///
/// // A retry gets the stored outcome instead of running again.
/// let Begin::Replay(outcome) = store.begin(&id, &fp, lease).await? else { unreachable!() };
/// assert_eq!(outcome.body, "ch_1");
/// # Ok(()) }
/// ```
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims the record, or says why not. See the trait docs for the state machine.
    ///
    /// A granted lease runs from when the store decided, some time after the call: count it
    /// from before the call, and do not act on a grant read with half of it or less left.
    /// [`within_lease`](crate::within_lease) does that (called in a Tokio runtime, which
    /// gives such a grant back in a task of its own); the executor and the layer use
    /// [`within_lease_with`](crate::within_lease_with), which their `drain` waits for.
    async fn begin(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Begin>;

    /// Stores the outcome and keeps it for `retention` (from when the write lands, store
    /// clock), if `token` still owns the record; `Ok` again if `token` already completed it
    /// and the record is still kept (past its retention, or once purged, the record is gone
    /// and a store may answer `LeaseLost`: the Redis store does, its key having expired).
    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()>;

    /// Gives the key up without an outcome (an uncacheable result, an error, a panic), so the
    /// next `begin` executes, if `token` still owns the record.
    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()>;

    /// Extends the lease to `lease` from now (store clock), if `token` still owns the record.
    /// A `lease` of zero ends it now and keeps the record: the next `begin` takes it over
    /// (`TakeOver`: its outcome is unknown), as after a crash, without waiting for it to run
    /// out ([`end_orphan`](crate::end_orphan)).
    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()>;

    /// Deletes up to `batch` records that are past their retention, or whose lease expired
    /// unfinished more than [`UNKNOWN_OUTCOME_RETENTION`] ago (or the Postgres store's own
    /// setting); returns how many. Stores whose records expire
    /// by themselves return 0.
    async fn purge_expired(&self, batch: usize) -> Result<u64>;

    /// Reads the live record under `id` for an operator: `None` when there is none (never
    /// claimed, released, or past its retention). An in-flight record whose lease ran out is
    /// still reported (lease remaining zero) until a `begin` takes it over or the purge
    /// removes it: that is the record of an attempt whose outcome is unknown.
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>>;

    /// Deletes the record under `id` for an operator, within `scope`: by default
    /// ([`ReleaseScope::default`]) only an in-flight record whose lease has run out, checked
    /// atomically with the delete, so a retry that took the key over meanwhile keeps its live
    /// lease ([`ForceReleased::Live`]). Fencing-safe: the token that
    /// owned a deleted record no longer owns anything, so its late `complete`, `renew` or
    /// `release` answers [`Error::LeaseLost`] and changes nothing. The answer says what was
    /// found.
    ///
    /// Fencing covers the store, not the world: a holder still running its operation goes on
    /// running it, and the next `begin` executes it again. Release a live lease
    /// ([`ReleaseScope::with_live`]) only when its holder is known to be stuck.
    async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased>;

    /// A short name for logs, health checks and metrics (`memory`, `postgres`, …).
    fn name(&self) -> &'static str;

    /// Whether this store's `begin` settles a claim whose caller went away by itself, as the
    /// stores of this workspace do, and [`drain`](Store::drain) waits until it has: either
    /// the claim runs to its end in a task of its own and a lease it granted is released
    /// (the store wraps its claim in [`detached_begin`](crate::detached_begin): Postgres, the
    /// hybrid), or it is cancelled so that whatever it wrote, or writes late, is undone (the
    /// Redis store's cancel script), or `begin` never awaits (the in-memory store). A caller that would otherwise wrap every `begin` itself — the
    /// layer, the [`Executor`](crate::Executor) — then calls it directly, saving a box, a
    /// runtime handle and a tracker per request.
    ///
    /// The default, `false`, is always safe: the caller wraps the call. Answer `true` only
    /// for a store that passes the conformance suite's cancellation cases (`idempotency-test`).
    ///
    /// ```
    /// use idempotency_core::{MemoryStore, Store};
    ///
    /// // `begin` never awaits: dropped, it either did nothing or finished.
    /// assert!(MemoryStore::new().begin_settles_when_dropped());
    /// ```
    fn begin_settles_when_dropped(&self) -> bool {
        false
    }

    /// Waits until the writes this store started in the background, in tasks of its own,
    /// have landed: the rest of a claim whose caller stopped waiting (its own call budget,
    /// a dropped future) and the release of a lease that claim granted, or the cancel of
    /// such a claim, which may still run. `IdempotencyLayer::drain` and
    /// [`Executor::drain`](crate::Executor::drain) call it after their own, so a graceful
    /// shutdown does not cut those writes short (a lease left claimed by nobody until it runs
    /// out). Calls in progress are not waited for, only what they left running
    /// ([`FinishOnDrop::tracked_by`](crate::FinishOnDrop::tracked_by)): call it once every
    /// user of the store has stopped. Bound it by your shutdown deadline: releases are
    /// retried while the store is unavailable, for up to an hour
    /// ([`LATE_COMPLETION_GRACE`](crate::LATE_COMPLETION_GRACE)).
    ///
    /// The default has nothing to wait for: a store whose calls all finish in their caller's
    /// future. A store that wraps another must forward it. Writes a store makes only to
    /// answer faster (the hybrid store's Redis copies) are not waited for.
    async fn drain(&self) {}
}

#[async_trait]
impl<S: Store + ?Sized> Store for Arc<S> {
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        (**self).begin(id, fp, lease).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        (**self).complete(id, token, outcome, retention).await
    }
    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        (**self).release(id, token).await
    }
    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        (**self).renew(id, token, lease).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64> {
        (**self).purge_expired(batch).await
    }
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>> {
        (**self).inspect(id).await
    }
    async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased> {
        (**self).force_release(id, scope).await
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn begin_settles_when_dropped(&self) -> bool {
        (**self).begin_settles_when_dropped()
    }
    async fn drain(&self) {
        (**self).drain().await;
    }
}
