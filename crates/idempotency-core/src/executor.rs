//! Run any async operation once per key (a crash before its result was stored aside, which
//! the retry is told of): queue consumers, jobs, RPC handlers.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::FutureExt;
use serde::{Serialize, de::DeserializeOwned};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::{
    Begin, Error, Fingerprint, IdempotencyKey, LeaseToken, Outcome, Policy, RecordId, Scope, Store,
    detached_begin, give_back_orphan, panic_as_unavailable,
};

/// What [`Executor::run`] returns when the operation's result is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executed<T> {
    /// The operation's result: from this run, or stored by an earlier one.
    pub value: T,
    /// Whether it was replayed from the store rather than run now.
    pub replayed: bool,
}

/// Why [`Executor::run`] has no result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError<E> {
    /// Another attempt is running it now: retry after the delay (a consumer delays or NACKs
    /// the message instead of acknowledging it).
    #[error("another attempt holds the key; retry in {retry_after:?}")]
    InFlight {
        /// The rest of the other attempt's lease.
        retry_after: Duration,
    },
    /// The key was used with a different fingerprint: a different operation.
    #[error("the key was used for a different operation")]
    Mismatch,
    /// The operation failed; the key was released, so a redelivery runs it again (unless
    /// the operation had committed its result itself: [`Executor::run_with_claim`]).
    #[error("the operation failed and was released for a retry")]
    Failed(#[source] E),
    /// The operation panicked; the key was released (unless the operation had committed its
    /// result itself: [`Executor::run_with_claim`]).
    #[error("the operation panicked and was released for a retry")]
    Panicked,
    /// **The operation was stopped at its await: its lease was lost** while it ran — a
    /// renewal found the key taken over by another attempt (this one's renewals had failed
    /// for a whole lease) or released by an operator. Running on would have its effect run
    /// by two attempts at once; what it did before it stopped may have taken place. The
    /// other attempt decides the key: treat it like [`RunError::InFlight`] (a consumer leaves
    /// the message for a redelivery, which replays).
    #[error("the operation was stopped: its lease was lost to another attempt")]
    LeaseLost,
    /// **The operation ran; its outcome was not stored.** Storing it failed for a whole
    /// lease of retries (the store is down), or another attempt took the key over first.
    /// Do not treat this as "nothing happened": the effect took place. A store that was
    /// down is written again in the background ([`complete_late`], counted by
    /// [`Executor::drain`]) until it takes the outcome; a redelivery before that lands, or
    /// after another attempt took over, runs the operation again unless the effect itself
    /// is idempotent (a unique constraint on the record id), so alert on it, and prefer to
    /// acknowledge the message.
    #[error("the operation ran; its outcome was not stored: {0}")]
    NotStored(#[source] Error),
    /// **The operation returned `Ok`, but the result it stored in its own transaction did
    /// not commit** ([`Executor::run_with_claim`]): it had told the executor that the store
    /// accepted its completion ([`Claim::accepted`]), yet the record is not completed by
    /// it: the store still held its lease in flight, or (its lease having run out) another
    /// attempt took the key over. The transaction rolled back after the completion — a
    /// statement after it failed, and Postgres answers the `COMMIT` of a failed transaction
    /// with a rollback that sqlx reports as success; a retry after a rollback returned `Ok`
    /// without completing again — or it was never committed. Nothing it wrote took effect;
    /// the executor stored nothing, and released the key if it still held it, so a
    /// redelivery runs the operation again (or finds the other attempt's). The operation has
    /// a bug: make the completion its transaction's last statement
    /// (`PostgresStore::commit_claim` commits right after it), and return `Ok` only once one
    /// committed. (A retention shorter than the confirmation took, two leases at most, could
    /// let a committed record be forgotten and the key claimed anew meanwhile, which reads
    /// the same: keep the retention far longer than the lease.)
    #[error(
        "the operation returned Ok, but the result it stored in its transaction did not commit; nothing was stored"
    )]
    NotCommitted,
    /// **Whether the operation's transaction committed is not known**
    /// ([`Executor::run_with_claim`]): it returned `Ok` after the store accepted the result
    /// it stored in its own transaction, and the store could not be reached for a whole
    /// lease to confirm that the transaction committed, or the record was gone (a release
    /// of the executor's own that landed unseen, or a committed record forgotten). The
    /// executor stores nothing of its own: if it committed, the key replays its result; if
    /// it did not, the key is released (the release goes on in the background, counted by
    /// [`Executor::drain`]) or its lease runs out. Redeliver (leave the message pending):
    /// the redelivery replays the result, or runs the operation again if nothing committed.
    #[error("whether the operation's transaction committed is not known: {0}")]
    Unconfirmed(#[source] Error),
    /// The store failed before the operation ran (unavailable: **nothing ran**), a stored
    /// result does not decode, or the run was polled outside a Tokio runtime
    /// ([`Error::Config`]; nothing ran).
    #[error(transparent)]
    Store(Error),
}

/// Runs operations once per (scope, key, fingerprint), over any [`Store`]: a repeat replays
/// the stored result, and a repeat while the operation runs is told so. The one exception is
/// a crash (or a process frozen past its lease) before the result was stored: the attempt
/// after it runs the operation again, and is told so ([`Claim::took_over`]) — see below.
///
/// The operation's `Ok` value is serialised (JSON) into the store and returned to every repeat;
/// an `Err` releases the key so a later delivery runs again (after a takeover the lease is
/// ended and the record kept instead, so that delivery is told too). Return `Ok` for every result that
/// must not run twice — business failures included ("card declined" is a result) — and `Err`
/// only for transient failures. While the operation runs its lease is renewed, by a task of
/// its own, so also while the caller holds the future without polling it (the key then stays
/// in flight). That task starts at the operation's first await: an operation that answers at
/// once pays for no task, and a first step that blocks its thread for longer than a lease
/// (`block_in_place`, a blocking client called before any await) is not renewed meanwhile,
/// so a redelivery may take the key over and run it too. Run blocking work through
/// `spawn_blocking(..).await`, which awaits at once. Once it returned `Ok` its outcome is stored whatever the caller does
/// ([`finish_in_any_case`](crate::finish_in_any_case)); a panic releases it. A crash leaves the lease to expire, after which a
/// redelivery runs again: make the effect itself idempotent (a unique constraint on the
/// record id), or store the result in the effect's own transaction
/// ([`Executor::run_with_claim`] with `PostgresStore::commit_claim`), where that window
/// matters. (An operation that stored its own result is confirmed instead of stored:
/// dropped then, its lease is released, which the store refuses once the result committed.)
///
/// Runs need a Tokio runtime with its timer (renewals and writes that outlive the caller are
/// its tasks): polled outside one, a run claims nothing and answers [`RunError::Store`] with
/// [`Error::Config`].
///
/// A renewal answered `LeaseLost` (another attempt took the key over, or an operator released
/// it) stops the operation at its await: [`RunError::LeaseLost`]. A renewal that merely fails
/// does not (the late completion is accepted while nobody took over).
///
/// A failing `complete` is retried, renewing the lease, for up to one lease (the store
/// accepts a late completion as long as nobody took over); if it still fails the answer is
/// [`RunError::NotStored`] — "it ran" — never an error that reads as "nothing ran".
///
/// # Cancellation
///
/// Dropping the future of [`Executor::run`] (a `select!`, a timeout, a shutdown) never leaves
/// the key claimed by nobody: dropped while the operation runs, the operation is cancelled at
/// its await point and the key released, as for an `Err`; dropped after the operation
/// returned `Ok`, its outcome is still stored, by a task of its own (so too if the future is
/// held without polling while the outcome is written). At shutdown,
/// [`Executor::drain`] waits for those tasks.
///
/// Released means the next delivery runs the operation again: an effect the operation had
/// already made when it was dropped (a row committed by itself) is made twice. Drop runs
/// only between messages, or make the effect safe to cut: commit it with its result
/// ([`Executor::run_with_claim`]), or key it by the record id under a unique constraint.
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{Executor, Fingerprint, IdempotencyKey, MemoryStore, Scope};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let executor = Executor::new(Arc::new(MemoryStore::new()));
/// let scope = Scope::new("charges-consumer");
/// let message_id = IdempotencyKey::new("msg-42").unwrap();
/// let payload = br#"{"amount":100}"#;
/// for _ in 0..2 {
///     let done = executor
///         .run(&scope, &message_id, &Fingerprint::of(payload), || async {
///             Ok::<_, std::io::Error>(format!("charged {}", 100)) // the effect, once
///         })
///         .await
///         .unwrap();
///     assert_eq!(done.value, "charged 100");
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Executor<S: ?Sized> {
    store: Arc<S>,
    policy: Policy,
    /// What runs left to settle in tasks of their own; shared by clones. See
    /// [`Executor::drain`].
    settling: TaskTracker,
}

impl<S: Store + ?Sized> Executor<S> {
    /// An executor with the default [`Policy`] (30 s lease, 24 h retention).
    pub fn new(store: Arc<S>) -> Self {
        Self {
            store,
            policy: Policy::default(),
            settling: TaskTracker::new(),
        }
    }

    /// Waits until every lease that runs of this executor (and its clones) left to settle in
    /// a task of their own has settled: the outcome of a run dropped after its operation
    /// succeeded is stored (so too one answered [`RunError::NotStored`] while the store was
    /// down: written until the store is back, so bound the wait), the lease of one dropped
    /// while its operation ran (or while it claimed) is given back. Call it at shutdown, once
    /// no run is left (each ended or was dropped), before the process exits.
    ///
    /// Cut short by the exit, an outcome that was not stored comes back as an attempt whose
    /// outcome is unknown, and a redelivery runs the operation again; a lease not given back
    /// holds the key until it runs out. Then it waits for the store's own background writes
    /// ([`Store::drain`]), including those other users of the same store left. Not waited
    /// for: runs still in progress (end or drop them first).
    ///
    /// A store that is unavailable is retried (a release, and an outcome until the store
    /// takes it, for up to an hour: [`complete_late`]), so bound the wait by your shutdown
    /// deadline:
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotency_core::{Executor, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let executor = Executor::new(Arc::new(MemoryStore::new()));
    /// // … stop consuming; drop or finish the runs in progress …
    /// let drained = tokio::time::timeout(Duration::from_secs(20), executor.drain()).await;
    /// assert!(drained.is_ok());
    /// # }
    /// ```
    pub async fn drain(&self) {
        // Closed, the tracker's `wait` ends once it is empty; runs still track what they
        // leave behind after that.
        self.settling.close();
        self.settling.wait().await;
        self.store.drain().await;
    }

    /// Replaces the policy (lease and retention; the cache rule does not apply here).
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Runs `op` unless it already ran for this key; see the type's docs.
    pub async fn run<T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        op: F,
    ) -> Result<Executed<T>, RunError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_with_claim(scope, key, fingerprint, |_claim| op())
            .await
    }

    /// [`Executor::run`], handing the operation its [`Claim`], so that it can store its own
    /// result **in the transaction of its effect**: the effect and the stored result then
    /// commit together, and no crash, panic or lost answer between them can run the effect
    /// twice.
    ///
    /// With Postgres, the operation writes its rows and ends its transaction with
    /// `PostgresStore::commit_claim(tx, &claim, &value)` (the completion, then the commit).
    /// Then:
    ///
    /// - committed, the key replays `value` whatever happens next (a crash, a panic, a
    ///   dropped future, an `Err` returned after the commit: the executor's own release is
    ///   fenced to a key still in flight);
    /// - rolled back (or never committed), nothing took effect and the key is released as
    ///   for any `Err`;
    /// - if another attempt took the key over meanwhile, `complete_claim_in` answers
    ///   `LeaseLost` and the transaction rolls back: the takeover's effect is the only one.
    ///
    /// Return `Ok(value)` with the value stored, after the commit. The executor then confirms
    /// that the commit took place: it gives the lease back, which the store refuses for a
    /// completed record. A release that goes through means the completion never committed
    /// (a transaction that rolled back after it, or was never committed): nothing is stored,
    /// the key is free for a retry, and the run answers [`RunError::NotCommitted`]. A store
    /// that cannot be reached to confirm it answers [`RunError::Unconfirmed`] (redeliver).
    /// To confirm a refused release, it completes with the claim's token, which the store
    /// then accepts (the record no longer in flight under the token) only for a record this
    /// token completed (a completion is idempotent for its token): it never stores the
    /// value on a record whose transaction rolled back. So once
    /// the store accepted a completion, return `Ok` only for a transaction that committed
    /// one: a transaction retried after a rollback that decides on another result (a
    /// decline) completes with that result too.
    /// Once the store accepted the operation's completion ([`Claim::accepted`], which
    /// `complete_claim_in` calls), a renewal answered `LeaseLost` stops the operation only if
    /// the record is not completed (read with `Store::inspect`): most often that answer is the
    /// operation's own commit. Before that, a `LeaseLost` stops it as in [`Executor::run`].
    /// The lease is renewed until the operation returns, so a transaction that rolled back can
    /// be retried on it.
    ///
    /// After a commit, an `Err` or a panic reports [`RunError::Failed`] or
    /// [`RunError::Panicked`], but the key is not released (the release is fenced to a
    /// record still in flight): it replays the committed value.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotency_core::{Executor, Fingerprint, IdempotencyKey, MemoryStore, Scope};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let executor = Executor::new(Arc::new(MemoryStore::new()));
    /// let key = IdempotencyKey::new("msg-42").unwrap();
    /// let done = executor
    ///     .run_with_claim(&Scope::new("charges"), &key, &Fingerprint::of(b"100"), |claim| async move {
    ///         // With Postgres: write the charge and `complete_claim_in(&mut tx, &claim, &v)`
    ///         // in one transaction. Here: the record the claim holds.
    ///         Ok::<_, std::io::Error>(claim.id().to_string())
    ///     })
    ///     .await
    ///     .unwrap();
    /// assert!(!done.replayed);
    /// # }
    /// ```
    pub async fn run_with_claim<T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        op: F,
    ) -> Result<Executed<T>, RunError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(Claim<T>) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        // Renewals, the outcome's write and a give-back run in tasks, on timers, when they
        // must: without a runtime (or one without its timer) they could not, and an operation
        // that ran would be left to a retry that runs it again. So nothing is claimed then.
        // (Making a timer outside one panics: caught, that is the probe.)
        let timers = || std::panic::catch_unwind(|| drop(tokio::time::sleep(Duration::ZERO)));
        // The runtime the run starts on: its renewals, its writes and give-backs run there,
        // even once a plain thread polls the run (a claim answered there has no runtime).
        let home = match tokio::runtime::Handle::try_current() {
            Ok(home) if timers().is_ok() => home,
            _ => {
                return Err(RunError::Store(Error::Config(
                    "the executor runs inside a Tokio runtime with its timer enabled (its \
                     renewals and writes are tasks on timers)"
                        .into(),
                )));
            }
        };
        let id = RecordId::new(scope, key);
        let lease = self.policy.lease();
        // The lease counts from the ask, not from the answer (see `within_lease`).
        let asked = Instant::now();
        // `drain` counts what this leaves running in the background, not the claim itself:
        // clones share the tracker, and a drain must not wait for other runs' claims.
        let answer = self.claim(id, *fingerprint, lease).await;
        let answer = crate::within_lease_with(&id, asked, lease, answer, |grant| {
            let store = self.store.clone();
            let give_back = async move { give_back_orphan(&*store, &id, grant).await };
            self.settling.spawn_on(give_back, &home);
        });
        let (token, took_over) = match answer {
            Ok(Begin::Execute(token)) => (token, false),
            Ok(Begin::TakeOver(token)) => {
                // An earlier attempt's lease ran out before it stored a result: it may have
                // had its effect. The executor runs the operation again (an effect keyed by
                // the record id, under a unique constraint, makes that safe; the operation
                // is told, `Claim::took_over`); say so.
                tracing::warn!(record = %id, "an earlier attempt's outcome is unknown (its lease ran out); running again");
                (token, true)
            }
            Ok(Begin::Replay(outcome)) if outcome.is_not_stored() => {
                return Err(RunError::Store(Error::Corrupt(
                    "the operation ran, but its result was refused by the store; a marker says so in its place".into(),
                )));
            }
            Ok(Begin::Replay(outcome)) => {
                let value = serde_json::from_slice(&outcome.body).map_err(|e| {
                    RunError::Store(Error::Corrupt(format!(
                        "stored result does not decode: {e}"
                    )))
                })?;
                return Ok(Executed {
                    value,
                    replayed: true,
                });
            }
            Ok(Begin::InFlight { retry_after }) => return Err(RunError::InFlight { retry_after }),
            Ok(Begin::Mismatch) => return Err(RunError::Mismatch),
            Err(error) => return Err(RunError::Store(error)),
        };

        // From here the lease is ours: if this future is dropped, the guard gives it back (or,
        // once the result is known, stores it) in a task of its own.
        let mut guard = LeaseGuard {
            store: self.store.clone(),
            settling: self.settling.clone(),
            runtime: home.clone(),
            id,
            token,
            took_over,
            settled: false,
            renewing: None,
        };
        let claim = Claim {
            id,
            token,
            took_over,
            retention: self.policy.retention(),
            accepted: Arc::new(AtomicBool::new(false)),
            completing: Arc::new(AtomicBool::new(false)),
            result: std::marker::PhantomData,
        };
        let (accepted, completing) = (claim.accepted.clone(), claim.completing.clone());
        // Found by its token while it runs: a completion written by the store's own call
        // (`PostgresStore::complete_in` with the claim's id and token) ends the hold too,
        // and its acceptance is the claim's.
        let _writes_own_completion = Completing::register(id, token, &completing, &accepted);
        // The renewals' task is made only once the operation has to wait: one that answers
        // in its first step needs none (the layer does the same with its timer).
        // A closure that panics before it returns its future panics as its future would.
        let operation = match std::panic::catch_unwind(AssertUnwindSafe(|| op(claim))) {
            Ok(operation) => {
                futures::future::Either::Left(AssertUnwindSafe(operation).catch_unwind())
            }
            Err(panic) => futures::future::Either::Right(std::future::ready(Err(panic))),
        };
        tokio::pin!(operation);
        // Not even its first step once the lease may have run out (the process was frozen
        // since the claim): it waits for a renewal, below.
        let first = if Instant::now() < asked + self.policy.surely_held() {
            futures::poll!(&mut operation)
        } else {
            std::task::Poll::Pending
        };
        let result = match first {
            std::task::Poll::Ready(result) => result,
            std::task::Poll::Pending => {
                let (renewing, mut lease) = renew_in_a_task(
                    &home,
                    self.store.clone(),
                    id,
                    token,
                    &self.policy,
                    asked,
                    accepted.clone(),
                );
                guard.renewing = Some(renewing);
                let mut ended = false;
                loop {
                    let held = *lease.borrow_and_update();
                    let alive_until = match held {
                        Held::Lost => {
                            guard.stop_renewing();
                            // The token is fenced off already (or the store cannot renew
                            // it, and past its lease it runs out): nothing to release.
                            guard.settled = true;
                            tracing::warn!(record = %id, "the lease was lost while the operation ran; stopping it");
                            return Err(RunError::LeaseLost);
                        }
                        // Not once the operation writes its own completion: that write is
                        // fenced on the token in the effect's transaction (a takeover makes
                        // it fail, and the transaction roll back), and once written it holds
                        // the record's row lock, on which the renewals wait: held there, the
                        // operation would never commit, nor the lock go.
                        // Also once the renewals' task ended unexpectedly (its runtime shut
                        // down): the lease it last vouched for still bounds the operation.
                        Held::Until(until) if !completing.load(Ordering::SeqCst) => Some(until),
                        // The record is this run's, completed: the operation goes on.
                        Held::Until(_) | Held::Settled => None,
                    };
                    if alive_until.is_some_and(|until| Instant::now() >= until) {
                        if ended {
                            // No renewal will come: past the lease another attempt may hold
                            // the key, so the operation stops here, as a dropped run would.
                            tracing::error!(record = %id, "the lease's renewals stopped (their runtime shut down?) and the lease ran out; stopping the operation");
                            guard.release().await;
                            return Err(RunError::LeaseLost);
                        }
                        // Past it another attempt may hold the key: the operation is not
                        // polled until the renewals' task (its tick is due by then) says.
                        ended = lease.changed().await.is_err();
                        continue;
                    }
                    // An operation that ends in the same poll as the loss is reported as run
                    // (its outcome's write then finds the key lost: `NotStored`).
                    tokio::select! {
                        biased;
                        result = gated(alive_until, &mut operation) => break result,
                        changed = lease.changed(), if !ended => ended = changed.is_err(),
                        () = sleep_until_some(alive_until, ended) => {}
                    }
                }
            }
        };
        guard.stop_renewing();
        match result {
            Err(_panic) => {
                guard.release().await;
                Err(RunError::Panicked)
            }
            Ok(Err(error)) => {
                guard.release().await;
                Err(RunError::Failed(error))
            }
            Ok(Ok(value)) => {
                // An operation that stored its result in its own transaction: confirm that
                // the transaction committed; store nothing of its own. The confirmation
                // releases a lease it finds still held, so it too finishes in any case.
                if accepted.load(Ordering::SeqCst) {
                    let outcome = stored_form(&value)
                        .map_err(|e| Error::Corrupt(format!("the result does not serialise: {e}")));
                    let (store, policy, tracker) = (
                        self.store.clone(),
                        self.policy.clone(),
                        self.settling.clone(),
                    );
                    let settling = self.settling.token();
                    // Settled first: nothing from here may unwind into a release.
                    guard.settled = true;
                    let confirm = guard.finish(async move {
                        let _settling = settling;
                        let lease = (id, token, took_over);
                        confirm_commit(store, &tracker, lease, outcome, &policy).await
                    });
                    return match confirm.await {
                        Confirmed::Committed => Ok(Executed {
                            value,
                            replayed: false,
                        }),
                        Confirmed::NotCommitted => {
                            tracing::error!(record = %id, "the operation returned Ok, but the result it stored in its transaction did not commit");
                            Err(RunError::NotCommitted)
                        }
                        Confirmed::Unknown(error) => Err(RunError::Unconfirmed(error)),
                    };
                }
                // The operation ran: whatever happens now, the key must not run it again. A
                // result that does not serialise is stored as a marker that replays as
                // `Corrupt` (never released: a redelivery would run the effect twice).
                // (A `Serialize` that panics counts as one that fails: the guard must not
                // unwind into a release.)
                let (outcome, unserialisable) = match stored_form(&value) {
                    Ok(outcome) => (outcome, None),
                    Err(e) => (
                        Outcome::new(500).with_body(UNSERIALISABLE),
                        Some(format!("the result does not serialise: {e}")),
                    ),
                };
                // Stored in this future while its caller polls it; dropped, or held without
                // polling (the lease is no longer renewed), the write goes on in a task of
                // its own, counted by `drain`.
                // Not stored within a lease (the store stayed down): the answer says so, and
                // the write goes on in a task of its own until the store takes it.
                let (store, policy, settling, tracker) = (
                    self.store.clone(),
                    self.policy.clone(),
                    self.settling.token(),
                    self.settling.clone(),
                );
                // Settled first: nothing from here may unwind into a release.
                guard.settled = true;
                let write = guard.finish(async move {
                    let _settling = settling;
                    complete_or_keep_trying(store, &tracker, id, token, &outcome, &policy).await
                });
                write.await.map_err(RunError::NotStored)?;
                if let Some(why) = unserialisable {
                    return Err(RunError::NotStored(Error::Corrupt(why)));
                }
                Ok(Executed {
                    value,
                    replayed: false,
                })
            }
        }
    }
}

impl<S: Store + ?Sized> Executor<S> {
    /// `begin`, run to its end even if `run`'s future is dropped meanwhile: a lease granted
    /// then is given back, the rest counted by `drain`. A store that does this itself
    /// ([`Store::begin_settles_when_dropped`]) is called directly (the stores of this
    /// workspace also answer a panicking claim with `Unavailable`); over any other `Store`
    /// the claim is wrapped here, and a `begin` that panics answers `Unavailable`, as in the
    /// HTTP layer: a lease it may have taken expires by itself.
    async fn claim(
        &self,
        id: RecordId,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> crate::Result<Begin> {
        if self.store.begin_settles_when_dropped() {
            return self.store.begin(&id, &fingerprint, lease).await;
        }
        let store = self.store.clone();
        let claim = async move { store.begin(&id, &fingerprint, lease).await };
        detached_begin(self.store.clone(), id, claim)
            .tracked_by(&self.settling)
            .await
    }
}

/// The stored body of a result that did not serialise; it does not decode as JSON.
const UNSERIALISABLE: &[u8] = b"\x00unserialisable result";

/// The outcome an operation's result is stored as: status 200, the result as JSON (what a
/// replay decodes). A `Serialize` that panics counts as one that fails: the caller must not
/// unwind into a release after the effect.
fn stored_form<T: Serialize>(value: &T) -> Result<Outcome, serde_json::Error> {
    std::panic::catch_unwind(AssertUnwindSafe(|| serde_json::to_vec(value)))
        .unwrap_or_else(|_| Err(serde::ser::Error::custom("serialising the result panicked")))
        .map(|body| Outcome::new(200).with_body(body))
}

/// The lease an operation of [`Executor::run_with_claim`] runs under: what it needs to
/// store its own result in the transaction of its effect (`PostgresStore::complete_claim_in`
/// takes it whole). Typed by the operation's result, so the value stored is of the type a
/// replay decodes.
pub struct Claim<T> {
    id: RecordId,
    token: LeaseToken,
    /// The store answered `TakeOver`: an earlier attempt may have had its effect.
    took_over: bool,
    retention: Duration,
    /// Set once the store accepted the operation's own completion ([`Claim::accepted`]).
    accepted: Arc<AtomicBool>,
    /// Set once the operation asked for its completion ([`Claim::completion`]): it writes
    /// it in its own transaction, fenced on the token.
    completing: Arc<AtomicBool>,
    result: std::marker::PhantomData<fn() -> T>,
}

impl<T> Clone for Claim<T> {
    fn clone(&self) -> Self {
        Self {
            id: self.id,
            token: self.token,
            took_over: self.took_over,
            retention: self.retention,
            accepted: self.accepted.clone(),
            completing: self.completing.clone(),
            result: std::marker::PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for Claim<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("id", &self.id)
            .field("token", &self.token)
            .field("took_over", &self.took_over)
            .field("retention", &self.retention)
            .field("accepted", &self.accepted.load(Ordering::SeqCst))
            .finish()
    }
}

/// What an operation stores, and under which lease, to complete its record itself:
/// [`Claim::completion`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Completion {
    /// The record the operation holds.
    pub id: RecordId,
    /// Its lease: the store fences the completion on it.
    pub token: LeaseToken,
    /// The result in its stored form, as [`Executor::run`] stores (and replays) it.
    pub outcome: Outcome,
    /// How long it is kept: the executor's policy.
    pub retention: Duration,
}

impl<T: Serialize> Claim<T> {
    /// The record this run holds.
    pub fn id(&self) -> &RecordId {
        &self.id
    }

    /// The lease this run holds; every write the store accepts for this run is fenced on it.
    pub fn token(&self) -> LeaseToken {
        self.token
    }

    /// Whether this run took the key over from an earlier attempt whose lease ran out before
    /// it stored a result (a crash, a process frozen past its lease): that attempt **may have
    /// had its effect**. The executor runs the operation all the same; an operation whose
    /// effect is not idempotent by itself looks for it first (by [`Claim::id`], which the
    /// earlier attempt had too) and returns what it finds instead of applying it again. A
    /// run that took over and then fails (`Err`, a panic, a drop) ends its lease and keeps
    /// the record rather than releasing it, so the next attempt is told too.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotency_core::{Begin, Claim, Executor, Fingerprint, IdempotencyKey, MemoryStore, RecordId, Scope, Store};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = Arc::new(MemoryStore::new());
    /// let (scope, key, fp) = (Scope::new("s"), IdempotencyKey::new("k").unwrap(), Fingerprint::of(b""));
    /// // An attempt that claimed the key and crashed: its lease ends unfinished.
    /// let Ok(Begin::Execute(_)) = store.begin(&RecordId::new(&scope, &key), &fp, Duration::ZERO).await else { panic!() };
    /// let ran = Executor::new(store)
    ///     .run_with_claim(&scope, &key, &fp, |claim: Claim<bool>| async move {
    ///         Ok::<_, std::io::Error>(claim.took_over())
    ///     })
    ///     .await
    ///     .unwrap();
    /// assert!(ran.value, "the operation is told it took over");
    /// # }
    /// ```
    pub fn took_over(&self) -> bool {
        self.took_over
    }

    /// How long the executor's policy keeps a result.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// The completion that stores `value` as the executor would, for a store call the
    /// operation makes itself (`PostgresStore::complete_in` in its own transaction; once the
    /// store accepted it, call [`Claim::accepted`]). `PostgresStore::complete_claim_in` does
    /// both.
    ///
    /// Ask for it right before that store call: from here the operation is no longer held
    /// when its lease may have run out (see [`Policy::surely_held`](crate::Policy::surely_held)),
    /// because the write is fenced on the token in the effect's transaction, and, once
    /// made, holds the record's row lock, on which the renewals wait. Effects outside that
    /// transaction made after this call are not held either. (`PostgresStore::complete_in`
    /// called with the claim's id and token ends the hold itself, before its write:
    /// [`completing_in_transaction`].)
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] when `value` does not serialise: return before committing, and the
    /// key is released.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use idempotency_core::{Claim, Executor, Fingerprint, IdempotencyKey, MemoryStore, Scope};
    /// # use std::sync::Arc;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # let executor = Executor::new(Arc::new(MemoryStore::new()));
    /// # let key = IdempotencyKey::new("k").unwrap();
    /// executor
    ///     .run_with_claim(&Scope::new("s"), &key, &Fingerprint::of(b""), |claim: Claim<String>| async move {
    ///         let completion = claim.completion(&"charged".to_owned()).unwrap();
    ///         assert_eq!(completion.outcome.body, br#""charged""#[..]);
    ///         Ok::<_, std::io::Error>("charged".to_owned())
    ///     })
    ///     .await
    ///     .unwrap();
    /// # }
    /// ```
    pub fn completion(&self, value: &T) -> crate::Result<Completion> {
        self.completing.store(true, Ordering::SeqCst);
        let outcome = stored_form(value)
            .map_err(|e| Error::Corrupt(format!("the result does not serialise: {e}")))?;
        Ok(Completion {
            id: self.id,
            token: self.token,
            outcome,
            retention: self.retention,
        })
    }

    /// Tells the executor that the store **accepted** the operation's own completion, fenced
    /// on this claim's token, in a transaction that has not ended: from here a renewal
    /// answered `LeaseLost` is most often that transaction's commit (seen by a renewal that
    /// waited on its row lock), so the executor reads the record before it stops the
    /// operation, and leaves a completed one to finish. Call it right after the store's call
    /// returned `Ok` (`PostgresStore::complete_claim_in` does), then commit or return; never
    /// before: until the store accepted, a `LeaseLost` is a takeover, and the operation must
    /// stop. The lease is still renewed meanwhile, so a transaction that rolls back can be
    /// retried on it. It stays set: an operation that returns `Ok` afterwards has its commit
    /// confirmed, and the executor stores no value of its own, so return `Ok` only once a
    /// transaction with a completion committed ([`RunError::NotCommitted`] otherwise).
    ///
    pub fn accepted(&self) {
        self.accepted.store(true, Ordering::SeqCst);
    }
}

/// The runs of [`Executor::run_with_claim`] in this process, by record and token: whether
/// each one's operation is writing its own completion ([`completing_in_transaction`]), and
/// whether the store accepted it ([`accepted_in_transaction`]).
static COMPLETING: std::sync::LazyLock<std::sync::Mutex<Runs>> =
    std::sync::LazyLock::new(Default::default);

type Runs = std::collections::HashMap<(RecordId, LeaseToken), Flags>;

/// A run's [`Claim::completion`] and [`Claim::accepted`] flags.
#[derive(Clone)]
struct Flags {
    completing: Arc<AtomicBool>,
    accepted: Arc<AtomicBool>,
}

/// A run's entry in [`COMPLETING`], removed when the run ends (or its future is dropped).
struct Completing {
    key: (RecordId, LeaseToken),
    flags: Flags,
}

impl Completing {
    fn register(
        id: RecordId,
        token: LeaseToken,
        completing: &Arc<AtomicBool>,
        accepted: &Arc<AtomicBool>,
    ) -> Self {
        let key = (id, token);
        let flags = Flags {
            completing: completing.clone(),
            accepted: accepted.clone(),
        };
        COMPLETING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key, flags.clone());
        Self { key, flags }
    }

    /// Sets one flag of the run holding `token` on `id`, if one in this process does.
    fn set(id: &RecordId, token: LeaseToken, flag: fn(&Flags) -> &AtomicBool) {
        if let Some(flags) = COMPLETING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(*id, token))
        {
            flag(flags).store(true, Ordering::SeqCst);
        }
    }
}

impl Drop for Completing {
    fn drop(&mut self) {
        let mut runs = COMPLETING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Only its own: a store that deals tokens in sequence (a memory store with a manual
        // clock) can grant another run the same pair once this one's record is gone.
        if runs
            .get(&self.key)
            .is_some_and(|f| Arc::ptr_eq(&f.completing, &self.flags.completing))
        {
            runs.remove(&self.key);
        }
    }
}

/// Says that the operation holding `token` on record `id` writes its own completion now, in
/// the transaction of its effect: if one of this process's [`Executor::run_with_claim`] runs
/// holds it, that operation is no longer held when its lease may have run out, as after
/// [`Claim::completion`]. The write is fenced on the token (a takeover makes it fail, and the
/// transaction roll back), and once made it holds the record's row lock, on which the
/// renewals wait: held for want of their answer, the operation would never commit, and the
/// key would stay locked.
///
/// For stores whose completion joins the caller's transaction: `PostgresStore::complete_in`
/// calls it before its write, so an operation that completes with the claim's id and token
/// instead of [`Claim::completion`] is not held either. Any other: nothing happens.
///
/// ```
/// use idempotency_core::{IdempotencyKey, LeaseToken, RecordId, Scope, completing_in_transaction};
/// let id = RecordId::new(&Scope::new("charges"), &IdempotencyKey::new("k1").unwrap());
/// completing_in_transaction(&id, LeaseToken::generate()); // no run holds it: nothing happens
/// ```
pub fn completing_in_transaction(id: &RecordId, token: LeaseToken) {
    Completing::set(id, token, |flags| &flags.completing);
}

/// Says that the store **accepted** the completion the operation holding `token` on record
/// `id` wrote in its own transaction, as [`Claim::accepted`] does: the run then confirms
/// that the transaction committed instead of storing the operation's result itself (a
/// transaction that rolled back stores nothing: [`RunError::NotCommitted`]), and a renewal
/// answered `LeaseLost` is read against the record (most often, it is that commit).
///
/// `PostgresStore::complete_in` calls it once its write was accepted, so an operation that
/// completes with the claim's id and token is confirmed like one that calls
/// [`Claim::accepted`]: otherwise a transaction that rolled back after the completion (a
/// later statement failed; Postgres answers its `COMMIT` with a rollback) would have the
/// result stored all the same, and replayed for a charge that never committed. No run of
/// this process holds it: nothing happens.
///
/// ```
/// use idempotency_core::{IdempotencyKey, LeaseToken, RecordId, Scope, accepted_in_transaction};
/// let id = RecordId::new(&Scope::new("charges"), &IdempotencyKey::new("k1").unwrap());
/// accepted_in_transaction(&id, LeaseToken::generate()); // no run holds it: nothing happens
/// ```
pub fn accepted_in_transaction(id: &RecordId, token: LeaseToken) {
    Completing::set(id, token, |flags| &flags.accepted);
}

/// Renews the lease of a running operation until aborted, in a task of its own. The
/// operation runs in its caller's future (it may borrow from it), but its renewals must not
/// depend on that future being polled: a caller that holds it while busy elsewhere (an outer
/// `select!` awaiting another branch's body) would let the lease lapse, and a redelivery
/// would take the key over and run the operation a second time. Held like that, the key
/// stays in flight instead, until the future is polled to its end or dropped.
///
/// The receiver hears when a renewal answered `LeaseLost`: the key is another attempt's (or
/// an operator released it), and the operation must stop. A store that is merely
/// unavailable is no such answer: a late completion is still accepted while nobody took
/// over, so the operation goes on and the renewals keep trying.
///
/// Once `accepted` is set, the store took the operation's own completion in a transaction
/// that holds the record's row lock until it ends. The renewals go on (they wait on that
/// lock): the transaction may still roll back, and the operation retry it, on its lease. A
/// `LeaseLost` then is most often that transaction's commit, so the record is read before
/// the operation is stopped: completed, it is left to finish (a completion of another
/// attempt, after a rollback of this one's, is refused by the operation's next fenced
/// completion); anything else stops it, and no answer is asked again at the next tick.
fn renew_in_a_task<S: Store + ?Sized>(
    home: &tokio::runtime::Handle,
    store: Arc<S>,
    id: RecordId,
    token: LeaseToken,
    policy: &Policy,
    asked: Instant,
    accepted: Arc<AtomicBool>,
) -> (tokio::task::AbortHandle, tokio::sync::watch::Receiver<Held>) {
    let (lease, every, sure) = (policy.lease(), policy.renew_every(), policy.surely_held());
    let (held, on_held) = tokio::sync::watch::channel(Held::Until(asked + sure));
    let task = home.spawn(async move {
        // The end of the lease last vouched for.
        let mut until = asked + sure;
        // On the schedule the store counts the lease by, from the ask: after a slow claim
        // (up to half a lease, see `within_lease`) as many renewals are left before the lease
        // runs out as after a quick one. One already due fires at once.
        let mut renew = tokio::time::interval_at(asked + every, every);
        // When to renew out of the schedule: at the gate, once the renewals since the last
        // that answered failed (the operation is held there until one answers), then again
        // after a pause while none does — as the layer's `confirm` does. On the schedule
        // alone the operation waited at the gate for the next tick, a sixth of a lease.
        let mut at_gate = asked + sure;
        let after_a_pause = || Instant::now() + every.min(Duration::from_secs(1));
        loop {
            tokio::select! {
                biased;
                _ = renew.tick() => {}
                () = tokio::time::sleep_until(at_gate) => {}
            }
            // A store call that panics is a failed call, not the end of the task: a task
            // that unwound would renew nothing more, and the lease would lapse while the
            // operation still ran (the operation's own `select!` takes a dropped channel for
            // no news, not for a loss).
            let renewing = Instant::now();
            let renewed =
                panic_as_unavailable(store.renew(&id, token, lease), "the store's renew panicked")
                    .await;
            match renewed {
                // The store counts the renewed lease from later than it was asked.
                Ok(()) => {
                    until = renewing + sure;
                    // Answered so late that the lease it vouches for may be over already (a
                    // store slower than a lease): asked again after a pause, not at once.
                    at_gate = until.max(after_a_pause());
                    held.send_replace(Held::Until(until));
                    continue;
                }
                Err(Error::LeaseLost) if !accepted.load(Ordering::SeqCst) => {
                    held.send_replace(Held::Lost);
                    return;
                }
                // Most often the operation's own commit: read the record. A read that fails
                // says nothing (stopped on it, a run that committed would answer `LeaseLost`):
                // read again at the next tick; the operation, completing, is not held
                // meanwhile, and its commit is confirmed once it returns.
                Err(Error::LeaseLost) => {
                    match AssertUnwindSafe(store.inspect(&id)).catch_unwind().await {
                        Ok(Ok(Some(crate::Inspection {
                            state: crate::RecordState::Completed { .. },
                            ..
                        }))) => {
                            held.send_replace(Held::Settled);
                            return;
                        }
                        Ok(Ok(_)) => {
                            held.send_replace(Held::Lost);
                            return;
                        }
                        Ok(Err(error)) => {
                            tracing::warn!(%error, record = %id, "could not read the record after a lost renewal");
                        }
                        Err(_panic) => {
                            tracing::warn!(record = %id, "the store's inspect panicked after a lost renewal");
                        }
                    }
                }
                // Not a store out of reach but one that cannot renew (a record it cannot
                // read, its table gone): once the lease it last renewed is over, no renewal
                // may come, and another attempt may hold the key. Stopped as a lost lease
                // then, not left to wait at the gate for ever. (Before that, it may be a
                // blip: a table swapped, a pooler's stale search path. The operation goes
                // on, and the next tick asks again.)
                Err(error @ (Error::Corrupt(_) | Error::Config(_)))
                    if !accepted.load(Ordering::SeqCst) && Instant::now() >= until =>
                {
                    tracing::error!(%error, record = %id, "the store cannot renew the lease; stopping the operation");
                    held.send_replace(Held::Lost);
                    return;
                }
                Err(error) => tracing::warn!(%error, record = %id, "could not renew the lease"),
            }
            // Unanswered (or not this run's to say): past the gate, asked again after a
            // pause, not at once in a loop.
            if Instant::now() >= at_gate {
                at_gate = after_a_pause();
            }
        }
    });
    (task.abort_handle(), on_held)
}

/// What the renewals of a running operation say of its lease.
#[derive(Debug, Clone, Copy)]
enum Held {
    /// This run's, surely until then ([`Policy::surely_held`] after the lease or its last
    /// renewal was asked for). Past it another attempt may hold the key, so the operation is
    /// not polled again until a renewal says: a process frozen past its lease (SIGSTOP, a
    /// paused VM whose guest clock saw the pause, a starved host) wakes with its operation
    /// and its overdue renewal both ready, and the operation must not go first.
    Until(Instant),
    /// Another attempt's now (or an operator released it): the operation stops.
    Lost,
    /// The record is completed by this run's own transaction (`complete_claim_in`): nothing
    /// left to renew, and the operation finishes.
    Settled,
}

/// `work`, not polled from `alive_until` on (`None`: always polled): the caller selects on a
/// timer for that instant beside it. (A named future: a `poll_fn` closure over the
/// operation trips the compiler's `Send` inference for the spawned tasks that run it.)
fn gated<F: Future + Unpin>(alive_until: Option<Instant>, work: &mut F) -> Gated<'_, F> {
    Gated { alive_until, work }
}

struct Gated<'a, F> {
    alive_until: Option<Instant>,
    work: &'a mut F,
}

impl<F: Future + Unpin> Future for Gated<'_, F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        if self
            .alive_until
            .is_some_and(|until| Instant::now() >= until)
        {
            return std::task::Poll::Pending;
        }
        std::pin::Pin::new(&mut *self.work).poll(cx)
    }
}

/// Sleeps until `until`, or for ever. Off any runtime (a run polled to its end by a plain
/// thread, its operation still pending) no timer can be made — making one panics, and the
/// unwinding run's lease guard gave the key back after its effect may have run: for ever
/// then too, while the renewals' task, on the runtime the run started on, wakes the loop
/// with its next word on the lease (past `until` the gate holds the operation all the same).
/// Once that task is gone (`renewals_ended`: its runtime shut down) nothing would wake it:
/// that is a panic, as a run finished after its runtime shut down is, not a wait for ever.
async fn sleep_until_some(until: Option<Instant>, renewals_ended: bool) {
    match until {
        Some(until) if tokio::runtime::Handle::try_current().is_ok() => {
            tokio::time::sleep_until(until).await;
        }
        Some(_) if renewals_ended => panic!(
            "a run polled outside any runtime after the runtime it started on shut down: \
             nothing can time its lease"
        ),
        _ => std::future::pending().await,
    }
}

/// The lease an [`Executor::run`] holds, settled on drop if the future was dropped first.
struct LeaseGuard<S: Store + ?Sized> {
    store: Arc<S>,
    /// The executor's, so its `drain` waits for what a drop leaves to settle.
    settling: TaskTracker,
    /// The runtime the run started on: a future dropped, or polled, outside any runtime's
    /// context (held by a plain thread) still has its lease released, its outcome stored,
    /// there.
    runtime: tokio::runtime::Handle,
    id: RecordId,
    token: LeaseToken,
    /// The lease was taken over from an earlier attempt whose outcome is unknown: given
    /// back, it is ended and its record kept (renewed for zero), not released (deleted),
    /// so that the next attempt is told too (`Claim::took_over`). Released, the record of
    /// that attempt was gone, and an operation that failed looking for its effect left the
    /// next delivery to apply it again, unwarned.
    took_over: bool,
    /// Released, or its outcome handed to a write that finishes in any case.
    settled: bool,
    /// The renewals, if the operation had to wait; stopped once it ended (or its future was
    /// dropped). A renewal cut off mid-call may still land; it is fenced on the token and the
    /// in-flight state, so after the release or the completion it changes nothing (after an
    /// end, which keeps the record in flight, it may hold the key for one more lease).
    renewing: Option<tokio::task::AbortHandle>,
}

impl<S: Store + ?Sized> LeaseGuard<S> {
    fn stop_renewing(&mut self) {
        if let Some(renewing) = self.renewing.take() {
            renewing.abort();
        }
    }

    /// Releases the lease; one that fails is retried in a task of its own (counted by
    /// `drain`): left to run out, it would hold the key for a lease and then come back as an
    /// attempt whose outcome is unknown.
    ///
    /// The release finishes in any case, as an outcome's write does: a caller that holds
    /// the run's future without polling it (or drops it) does not keep the key in flight.
    /// [`finish_in_any_case`](crate::finish_in_any_case), on the runtime the run started on when this poll has no
    /// runtime context (a plain thread polling the run to its end): there it would panic
    /// (the operation has run by then; see `finish_in_any_case_or_on`).
    fn finish<F>(&self, work: F) -> crate::FinishInAnyCase<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        crate::handover::finish_in_any_case_or_on(Some(&self.runtime), work)
    }

    /// Gives the lease back: released, or ended and kept after a takeover (see `took_over`).
    async fn release(&mut self) {
        let (store, id, token, took_over) =
            (self.store.clone(), self.id, self.token, self.took_over);
        let (tracker, settling) = (self.settling.clone(), self.settling.token());
        self.settled = true;
        self.finish(async move {
            let _settling = settling;
            let given_back = if took_over {
                let end = store.renew(&id, token, Duration::ZERO);
                panic_as_unavailable(end, "the store's renew panicked").await
            } else {
                panic_as_unavailable(store.release(&id, token), "the store's release panicked")
                    .await
            };
            if let Err(error) = given_back
                && !matches!(error, Error::LeaseLost)
            {
                tracing::warn!(%error, record = %id, "could not give the lease back; retrying");
                tracker.spawn(give_back(store, id, token, took_over));
            }
        })
        .await;
    }
}

impl<S: Store + ?Sized> Drop for LeaseGuard<S> {
    fn drop(&mut self) {
        self.stop_renewing();
        if self.settled {
            return;
        }
        // On the runtime dropping it and on the one the run started on: the first may be
        // shutting down, or a current-thread runtime never driven again, and drop the task
        // unrun (the key then held by nobody for a lease). The give-back is fenced on the
        // token: a second copy changes nothing.
        let (store, id, token, took_over) = (&self.store, self.id, self.token, self.took_over);
        crate::spawn_where_it_survives(&self.settling, Some(&self.runtime), || {
            give_back(store.clone(), id, token, took_over)
        });
    }
}

/// Gives a lease back, retrying an unavailable store: ended and kept when it was taken over
/// ([`crate::end_orphan`]), else released ([`crate::release_orphan`]).
async fn give_back<S: Store + ?Sized>(
    store: Arc<S>,
    id: RecordId,
    token: LeaseToken,
    took_over: bool,
) {
    if took_over {
        crate::end_orphan(&*store, &id, token).await;
    } else {
        crate::release_orphan(&*store, &id, token).await;
    }
}

/// What [`confirm_commit`] found.
enum Confirmed {
    /// The record is completed by the claim's token.
    Committed,
    /// The claim's completion did not commit: the lease was still held (now released), or
    /// another attempt's record is there.
    NotCommitted,
    /// The store could not say: unreachable, or the record is gone.
    Unknown(Error),
}

/// For an operation that returned `Ok` after the store accepted the result it stored in its
/// own transaction ([`Claim::accepted`]): whether that transaction committed. It stores
/// nothing of its own.
///
/// First it gives the lease back. A store releases only a record in flight under this
/// token, so a release that goes through means the completion never committed, and the key
/// is free for a retry. A refusal (`LeaseLost`) says only that the record is not in flight
/// under this token any more — completed, taken over, or deleted (by this run's own earlier
/// release whose answer was lost, or once past its retention) — and never will be again. So
/// then it completes with this token, which a store accepts, the record being no longer in
/// flight under it, only for a record this token completed (`Ok`: committed): nothing can
/// store this value on a record whose transaction rolled back. Refused again, the record
/// read next tells: another attempt's record means this completion did not commit; no
/// record at all cannot be told from a committed one forgotten, and is `Unknown`. The
/// lease is renewed between tries, so that no retry takes the key over while the store is
/// unreachable; one unreachable for a whole lease is `Unknown`, the release going on in the
/// background ([`release_orphan`](crate::release_orphan), tracked by `tracker`), right
/// whenever it lands.
///
/// After a takeover (`took_over`) the lease is ended and its record kept (renewed for zero)
/// instead of released: every store fences that renewal as it fences the release (it goes
/// through only for a record still in flight under the token), and the next attempt is
/// still told of the earlier one.
async fn confirm_commit<S: Store + ?Sized>(
    store: Arc<S>,
    tracker: &TaskTracker,
    (id, token, took_over): (RecordId, LeaseToken, bool),
    outcome: Result<Outcome, Error>,
    policy: &Policy,
) -> Confirmed {
    let give_up = Instant::now() + policy.lease();
    let mut backoff = Duration::from_millis(50);
    loop {
        let released = if took_over {
            let end = store.renew(&id, token, Duration::ZERO);
            panic_as_unavailable(end, "the store's renew panicked").await
        } else {
            panic_as_unavailable(store.release(&id, token), "the store's release panicked").await
        };
        match released {
            Ok(()) => return Confirmed::NotCommitted,
            Err(Error::LeaseLost) => break,
            Err(Error::Unavailable(error)) if Instant::now() + backoff < give_up => {
                tracing::warn!(%error, record = %id, "confirming the operation's commit failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                // Keeps the key from a retry meanwhile. Only the release's answer decides:
                // it is the call that acts on what it finds.
                let _ = panic_as_unavailable(
                    store.renew(&id, token, policy.lease()),
                    "the store's renew panicked",
                )
                .await;
            }
            Err(error) => {
                tracker.spawn(give_back(store.clone(), id, token, took_over));
                return Confirmed::Unknown(error);
            }
        }
    }
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(error) => return Confirmed::Unknown(error),
    };
    match complete_retrying(&*store, &id, token, &outcome, policy).await {
        Ok(()) => Confirmed::Committed,
        Err(Error::LeaseLost) => {
            match panic_as_unavailable(store.inspect(&id), "the store's inspect panicked").await {
                Ok(Some(_)) => Confirmed::NotCommitted,
                Ok(None) => Confirmed::Unknown(Error::LeaseLost),
                Err(error) => Confirmed::Unknown(error),
            }
        }
        Err(error) => Confirmed::Unknown(error),
    }
}

/// Stores `outcome` for `token`, retrying an unavailable store with backoff (renewing the
/// lease between tries) for up to one lease of `policy`: a store blip must not lose the
/// outcome of an operation that ran, since the retry would run it again.
///
/// `Ok` once stored (also when an earlier try had landed without its answer arriving: the
/// store's `complete` is idempotent for its token). `Err(LeaseLost)` when another attempt
/// took the key over; the last `Unavailable` when the store stayed down for the whole lease.
/// The HTTP layer and [`Executor`] both complete through it.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{complete_retrying, Begin, Fingerprint, IdempotencyKey, MemoryStore, Outcome, Policy, RecordId, Scope, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// let id = RecordId::new(&Scope::new("s"), &IdempotencyKey::new("k").unwrap());
/// let Ok(Begin::Execute(token)) = store.begin(&id, &Fingerprint::of(b""), Duration::from_secs(30)).await else { panic!() };
/// complete_retrying(&store, &id, token, &Outcome::new(201), &Policy::default()).await.unwrap();
/// # }
/// ```
pub async fn complete_retrying<S: Store + ?Sized>(
    store: &S,
    id: &RecordId,
    token: LeaseToken,
    outcome: &Outcome,
    policy: &Policy,
) -> Result<(), Error> {
    let give_up = Instant::now() + policy.lease();
    let mut backoff = Duration::from_millis(50);
    loop {
        match panic_as_unavailable(
            store.complete(id, token, outcome, policy.retention()),
            "the store's complete panicked",
        )
        .await
        {
            Ok(()) => return Ok(()),
            Err(Error::Unavailable(error)) if Instant::now() + backoff < give_up => {
                tracing::warn!(%error, record = %id, "storing the outcome failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                // Keeps the lease ours meanwhile; a late completion is accepted anyway as
                // long as nobody took over, so a failed renewal is no reason to stop.
                let _ = panic_as_unavailable(
                    store.renew(id, token, policy.lease()),
                    "the store's renew panicked",
                )
                .await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// [`complete_retrying`], and if it did not store the outcome (the store stayed unavailable
/// for the whole lease, or answered another error than `LeaseLost`), [`complete_late`] in a
/// task of `tracker` (whose `drain` then waits for it); returns what `complete_retrying`
/// answered. What the executor and the HTTP layer do with an outcome.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{complete_or_keep_trying, Begin, Fingerprint, MemoryStore, Outcome, Policy, RecordId, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let (store, tracker) = (Arc::new(MemoryStore::new()), tokio_util::task::TaskTracker::new());
/// let (id, fp, policy) = (RecordId::from_bytes([8; 32]), Fingerprint::of(b"body"), Policy::default());
/// let Ok(Begin::Execute(token)) = store.begin(&id, &fp, policy.lease()).await else { panic!() };
/// let stored = complete_or_keep_trying(store.clone(), &tracker, id, token, &Outcome::new(201), &policy).await;
/// assert!(stored.is_ok());
/// # }
/// ```
pub async fn complete_or_keep_trying<S: Store + ?Sized>(
    store: Arc<S>,
    tracker: &TaskTracker,
    id: RecordId,
    token: LeaseToken,
    outcome: &Outcome,
    policy: &Policy,
) -> Result<(), Error> {
    let stored = complete_retrying(&*store, &id, token, outcome, policy).await;
    // Left to a task: the write of an outcome the store did not take within the lease (and,
    // should it refuse it for good, the marker in its place: see `complete_late`).
    if !matches!(stored, Ok(()) | Err(Error::LeaseLost)) {
        // Copied only here: the common path stores it at once.
        let (outcome, retention, lease) = (outcome.clone(), policy.retention(), policy.lease());
        tracker.spawn(async move {
            complete_late(&*store, &id, token, &outcome, retention, lease).await;
        });
    }
    stored
}

/// Stores an outcome that [`complete_retrying`] could not store within its lease (the store
/// stayed unavailable), for as long as a late completion is accepted everywhere
/// ([`LATE_COMPLETION_GRACE`](crate::LATE_COMPLETION_GRACE)): the operation ran, and until
/// its outcome is stored, a retry after the lease takes the key over and runs it again.
///
/// Tries about every second (each try waits out the store's own call budget while it is
/// unreachable, and the tries of many tasks are spread by their tokens): a retry that
/// reaches the store as it comes back can still win that race. Between tries it renews the
/// lease, so a retry that lands first answers "in flight" where it can. A store that takes
/// the renewal but refuses the outcome three times, over a whole lease, is up and
/// refuses this outcome (too large, a constraint), as is one that answers `Config` or
/// `Corrupt` so (each such answer counts as a refusal): the task then stores
/// [`Outcome::not_stored`]'s marker in its place, which every retry replays, rather than
/// hold the key for an hour and leave it to run the operation again after that. (Not sooner: a store may take
/// renewals and refuse outcomes for a while for reasons of its own, such as the Postgres
/// store's group commit, whose completes and renewals run in separate batches, a full
/// queue of one refusing while the other runs.) Returns whether `outcome` was stored:
/// `false` when the store answered that the token no longer owns the record (`LeaseLost`:
/// another attempt took over), when the marker was stored instead, when even the marker
/// was refused, or when the grace ran out. Run it in a task of its own, tracked by the
/// `drain` of whoever spawned it.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{complete_late, Begin, Fingerprint, MemoryStore, Outcome, RecordId, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// let (id, fp) = (RecordId::from_bytes([9; 32]), Fingerprint::of(b"body"));
/// let Ok(Begin::Execute(token)) = store.begin(&id, &fp, Duration::from_secs(30)).await else { panic!() };
/// let outcome = Outcome::new(201);
/// assert!(complete_late(&store, &id, token, &outcome, Duration::from_secs(60), Duration::from_secs(30)).await);
/// assert_eq!(store.begin(&id, &fp, Duration::from_secs(30)).await.unwrap(), Begin::Replay(outcome));
/// # }
/// ```
pub async fn complete_late<S: Store + ?Sized>(
    store: &S,
    id: &RecordId,
    token: LeaseToken,
    outcome: &Outcome,
    retention: Duration,
    lease: Duration,
) -> bool {
    let give_up = Instant::now() + crate::LATE_COMPLETION_GRACE;
    // Spread over a second by the token, so the tasks of one outage do not try in step.
    let spread = Duration::from_millis(u64::from(token.as_uuid().as_bytes()[0]) * 4);
    let mut backoff = Duration::from_millis(100);
    // Refusals by a store that was up (its renewal went through, or it answered what it
    // refused: `Config`, `Corrupt`), and since the first.
    let (mut refused, mut refused_since) = (0, Instant::now());
    // What is being stored: the outcome, or the marker in its place once it was refused.
    let (given, mut outcome) = (outcome, std::borrow::Cow::Borrowed(outcome));
    loop {
        // Once the marker is what is stored, the outcome is still tried first: a store that
        // refused it only while its table was away (a `Config` answer counts as a refusal)
        // takes it as soon as it is back, and the marker would hide it for the retention.
        if outcome.is_not_stored()
            && !given.is_not_stored()
            && panic_as_unavailable(
                store.complete(id, token, given, retention),
                "the store's complete panicked",
            )
            .await
            .is_ok()
        {
            tracing::info!(record = %id, "the outcome was stored late, once the store took it");
            return true;
        }
        let error = match panic_as_unavailable(
            store.complete(id, token, &outcome, retention),
            "the store's complete panicked",
        )
        .await
        {
            Ok(()) if outcome.is_not_stored() && !given.is_not_stored() => {
                tracing::error!(record = %id, "the outcome was refused; a marker is stored in its place, and retries are answered that it was not stored");
                return false;
            }
            Ok(()) => {
                tracing::info!(record = %id, "the outcome was stored late, once the store was back");
                return true;
            }
            Err(Error::LeaseLost) => {
                tracing::error!(record = %id, "the outcome was not stored: another attempt took the key over meanwhile");
                return false;
            }
            Err(error) if Instant::now() + backoff >= give_up => {
                tracing::error!(%error, record = %id, "the outcome could not be stored within the grace; a retry after the lease runs the operation again");
                return false;
            }
            Err(error) => error,
        };
        // The store answered, and refused: counted as a refusal whatever the renewal says
        // (a store that cannot read its table renews nothing either).
        let answered = matches!(error, Error::Config(_) | Error::Corrupt(_));
        // Only a lease still ours is renewed (fenced on the token).
        let renewed =
            panic_as_unavailable(store.renew(id, token, lease), "the store's renew panicked")
                .await
                .is_ok();
        if answered || renewed {
            if refused == 0 {
                refused_since = Instant::now();
            }
            refused += 1;
            if refused >= 3 && refused_since.elapsed() >= lease {
                if outcome.is_not_stored() {
                    tracing::error!(%error, record = %id, "the store is up but refuses even the marker; a retry after the lease runs the operation again");
                    return false;
                }
                tracing::error!(%error, record = %id, "the store is up but refuses this outcome; storing a marker in its place");
                outcome = std::borrow::Cow::Owned(Outcome::not_stored());
                refused = 0;
            }
        }
        // A failed renewal does not restart the count: renewals that fail now and then
        // would otherwise hold a key whose outcome is refused for good for the whole grace.
        tracing::debug!(%error, record = %id, "storing the outcome late; retrying");
        tokio::time::sleep(backoff + spread.min(backoff)).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::MemoryStore;

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::new(k).unwrap()
    }

    /// A run that took the key over from an attempt whose outcome is unknown, and failed
    /// (or panicked, or was dropped), leaves the key taken over for the next: its lease is
    /// ended and the record kept, so the next attempt is told too (`Claim::took_over`). It
    /// was released (deleted): an operation that failed looking for the earlier attempt's
    /// effect left the next delivery to apply it again, unwarned.
    #[tokio::test]
    async fn a_failed_run_after_a_takeover_leaves_the_next_one_told() {
        let store = Arc::new(MemoryStore::new());
        let executor = Executor::new(store.clone());
        let (scope, fp) = (Scope::new("s"), Fingerprint::of(b"charge"));
        for failure in ["err", "panic", "drop"] {
            let key = IdempotencyKey::new(format!("k-{failure}")).unwrap();
            let id = RecordId::new(&scope, &key);
            // An attempt that crashed: its lease ended unfinished.
            let Ok(Begin::Execute(_)) = store.begin(&id, &fp, Duration::ZERO).await else {
                panic!("a fresh key")
            };
            let run = executor.run_with_claim(&scope, &key, &fp, |claim: Claim<bool>| async move {
                assert!(claim.took_over());
                match failure {
                    "err" => Err(std::io::Error::other("the ledger is down")),
                    "panic" => panic!("looking for the earlier effect"),
                    _ => std::future::pending().await,
                }
            });
            match failure {
                "drop" => {
                    let gave_up = tokio::time::timeout(Duration::from_millis(50), run).await;
                    assert!(gave_up.is_err());
                    executor.drain().await;
                }
                _ => assert!(run.await.is_err()),
            }
            let next = executor
                .run_with_claim(&scope, &key, &fp, |claim: Claim<bool>| async move {
                    Ok::<_, std::io::Error>(claim.took_over())
                })
                .await
                .expect("the next run");
            assert!(
                next.value,
                "{failure}: the next run is told of the earlier attempt"
            );
        }
    }

    /// The same for a run whose own transaction did not commit (`NotCommitted`): the
    /// confirmation ends the taken-over lease rather than release it.
    #[tokio::test]
    async fn a_takeover_whose_transaction_did_not_commit_leaves_the_next_one_told() {
        let store = Arc::new(MemoryStore::new());
        let executor = Executor::new(store.clone());
        let (scope, key, fp) = (Scope::new("s"), key("k"), Fingerprint::of(b"charge"));
        let id = RecordId::new(&scope, &key);
        let Ok(Begin::Execute(_)) = store.begin(&id, &fp, Duration::ZERO).await else {
            panic!("a fresh key")
        };
        // Says its completion was accepted, but stored nothing: a transaction rolled back.
        let run = executor
            .run_with_claim(&scope, &key, &fp, |claim: Claim<bool>| async move {
                assert!(claim.took_over());
                claim.accepted();
                Ok::<_, std::io::Error>(true)
            })
            .await;
        assert!(matches!(run, Err(RunError::NotCommitted)), "{run:?}");
        let next = executor
            .run_with_claim(&scope, &key, &fp, |claim: Claim<bool>| async move {
                Ok::<_, std::io::Error>(claim.took_over())
            })
            .await
            .expect("the next run");
        assert!(next.value, "the next run is told of the earlier attempt");
    }

    /// A run whose caller holds its future without polling it (busy in another branch of a
    /// `select!`) keeps its lease: a redelivery meanwhile finds the key in flight. Before,
    /// the renewals ran in that future, the lease lapsed, and the redelivery took the key
    /// over and ran the operation a second time.
    #[tokio::test(start_paused = true)]
    async fn a_run_held_without_polling_keeps_its_lease() {
        a_waiting_run_keeps_its_lease(MemoryStore::new(), false).await;
    }

    /// Runs an operation that waits, for three leases — its future held without polling, or
    /// `polled` — then checks that a redelivery meanwhile found the key in flight and that
    /// the operation ran once, its own outcome answered.
    async fn a_waiting_run_keeps_its_lease<S: Store + 'static>(store: S, polled: bool) {
        let lease = Duration::from_secs(3);
        let executor =
            Executor::new(Arc::new(store)).with_policy(Policy::default().with_lease(lease));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let runs = AtomicUsize::new(0);
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let first = executor.run(&scope, &k, &fp, || async {
            runs.fetch_add(1, Ordering::SeqCst);
            let _ = wait.await;
            Ok::<_, &str>(1u32)
        });
        tokio::pin!(first);
        assert!(
            futures::poll!(&mut first).is_pending(),
            "the operation waits"
        );
        if polled {
            let _ = tokio::time::timeout(lease * 3, &mut first).await;
        } else {
            tokio::time::sleep(lease * 3).await;
        }
        let redelivered = executor
            .run(&scope, &k, &fp, || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, &str>(2u32)
            })
            .await;
        assert!(
            matches!(redelivered, Err(RunError::InFlight { .. })),
            "{redelivered:?}"
        );
        go.send(()).unwrap();
        let done = first.await.unwrap();
        assert_eq!((done.value, done.replayed), (1, false));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// The memory store with faults: its first `renew` panics (a store's bug, a bad
    /// dependency: what the executor makes of a store that unwinds) unless that panic is
    /// marked spent; its `begin` and `release` may be slow; it may refuse large outcomes, or
    /// renewals and completions as a store whose table is gone, or fail its first completion.
    #[derive(Default)]
    struct FaultyMemory {
        inner: MemoryStore,
        renew_has_panicked: std::sync::atomic::AtomicBool,
        /// How long each `release` takes (a store a round trip away).
        release_takes: Duration,
        /// Outcomes with a longer body are refused (`Unavailable`), as a store refuses
        /// what is too large for it, while it takes everything else.
        refuse_bodies_over: Option<usize>,
        /// How many renewals, then completions, are refused with a configuration error (its
        /// table dropped, or swapped for a moment).
        renewals_refused: AtomicUsize,
        completes_refused: AtomicUsize,
        /// Until then, both are refused so (its table away for a while).
        away_until: Option<Instant>,
        /// How long each `begin` takes (a store a round trip away).
        begin_takes: Duration,
        /// The first `complete` fails (`Unavailable`, a connection reset) after this long.
        complete_fails_after: Option<Duration>,
        complete_failed: std::sync::atomic::AtomicBool,
    }

    impl FaultyMemory {
        fn away(&self) -> bool {
            self.away_until.is_some_and(|until| Instant::now() < until)
        }
    }

    const GONE: &str = "relation \"idempotency_keys\" does not exist";

    /// Takes one from `left`, if any is left.
    fn take_one(left: &AtomicUsize) -> bool {
        left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    #[async_trait::async_trait]
    impl Store for FaultyMemory {
        async fn begin(
            &self,
            id: &RecordId,
            fp: &Fingerprint,
            lease: Duration,
        ) -> crate::Result<Begin> {
            if !self.begin_takes.is_zero() {
                tokio::time::sleep(self.begin_takes).await;
            }
            self.inner.begin(id, fp, lease).await
        }
        async fn complete(
            &self,
            id: &RecordId,
            token: LeaseToken,
            outcome: &Outcome,
            retention: Duration,
        ) -> crate::Result<()> {
            if let Some(after) = self.complete_fails_after
                && !self.complete_failed.swap(true, Ordering::SeqCst)
            {
                tokio::time::sleep(after).await;
                return Err(Error::unavailable("connection reset"));
            }
            if take_one(&self.completes_refused) || self.away() {
                return Err(Error::Config(GONE.into()));
            }
            if self
                .refuse_bodies_over
                .is_some_and(|most| outcome.body.len() > most)
            {
                return Err(Error::unavailable("value too long for the column"));
            }
            self.inner.complete(id, token, outcome, retention).await
        }
        async fn release(&self, id: &RecordId, token: LeaseToken) -> crate::Result<()> {
            tokio::time::sleep(self.release_takes).await;
            self.inner.release(id, token).await
        }
        async fn renew(
            &self,
            id: &RecordId,
            token: LeaseToken,
            lease: Duration,
        ) -> crate::Result<()> {
            assert!(
                self.renew_has_panicked.swap(true, Ordering::SeqCst),
                "the store's renew panics"
            );
            if take_one(&self.renewals_refused) || self.away() {
                return Err(Error::Config(GONE.into()));
            }
            self.inner.renew(id, token, lease).await
        }
        async fn purge_expired(&self, batch: usize) -> crate::Result<u64> {
            self.inner.purge_expired(batch).await
        }
        async fn inspect(&self, id: &RecordId) -> crate::Result<Option<crate::Inspection>> {
            self.inner.inspect(id).await
        }
        async fn force_release(
            &self,
            id: &RecordId,
            scope: crate::ReleaseScope,
        ) -> crate::Result<crate::ForceReleased> {
            self.inner.force_release(id, scope).await
        }
        fn name(&self) -> &'static str {
            "renew-panics-once"
        }
    }

    /// A renewal that panics is one renewal failed, not the end of them. Before, the panic
    /// ended the renewals' task: the lease lapsed while the operation still ran, and a
    /// redelivery took the key over and ran it a second time.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_panics_does_not_end_the_renewals() {
        // Polled meanwhile, as a running operation is.
        a_waiting_run_keeps_its_lease(FaultyMemory::default(), true).await;
    }

    /// A store that cannot renew at all (it answers a configuration error: its table was
    /// dropped) stops the run at the end of its lease with `LeaseLost`. Before, the run
    /// waited at the lease's end for a renewal that never came, for ever.
    #[tokio::test(start_paused = true)]
    async fn a_store_that_cannot_renew_stops_the_run() {
        let store = FaultyMemory {
            renew_has_panicked: true.into(),
            renewals_refused: usize::MAX.into(),
            ..FaultyMemory::default()
        };
        let executor = Executor::new(Arc::new(store))
            .with_policy(Policy::default().with_lease(Duration::from_secs(1)));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let run = executor.run(&scope, &k, &fp, || async {
            std::future::pending::<()>().await;
            Ok::<_, &str>(1u32)
        });
        let ran = tokio::time::timeout(Duration::from_secs(600), run).await;
        assert!(matches!(ran, Ok(Err(RunError::LeaseLost))), "{ran:?}");
    }

    /// A renewal refused once with a configuration error (a table swapped for a moment, a
    /// pooler's stale search path) is a blip while the lease lives: the operation goes on and
    /// completes once. (A first version of the fix above stopped it at the first such
    /// answer, leaving its lease to run out: the retry ran it again.)
    #[tokio::test(start_paused = true)]
    async fn a_renewal_refused_once_does_not_stop_the_run() {
        let store = FaultyMemory {
            renew_has_panicked: true.into(),
            renewals_refused: 1.into(),
            ..FaultyMemory::default()
        };
        let executor = Executor::new(Arc::new(store))
            .with_policy(Policy::default().with_lease(Duration::from_secs(3)));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let ran = executor
            .run(&scope, &k, &fp, || async {
                tokio::time::sleep(Duration::from_secs(2)).await;
                Ok::<_, &str>(1u32)
            })
            .await;
        assert!(
            matches!(
                ran,
                Ok(Executed {
                    value: 1,
                    replayed: false
                })
            ),
            "{ran:?}"
        );
    }

    /// A completion refused once with a configuration error is stored late, as itself: the
    /// retry replays it. (A first version of the marker stored the marker at once, and the
    /// retry was told the outcome was not stored.)
    #[tokio::test(start_paused = true)]
    async fn a_completion_refused_once_is_stored_late() {
        let store = FaultyMemory {
            renew_has_panicked: true.into(),
            completes_refused: 1.into(),
            ..FaultyMemory::default()
        };
        stored_late_and_replayed(store, Duration::from_secs(1)).await;
    }

    /// Runs an operation on `store` whose outcome it does not take at once (`NotStored`),
    /// waits for the late write, and expects the retry to replay that outcome.
    async fn stored_late_and_replayed(store: FaultyMemory, lease: Duration) {
        let executor =
            Executor::new(Arc::new(store)).with_policy(Policy::default().with_lease(lease));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let first = executor
            .run(&scope, &k, &fp, || async { Ok::<_, &str>(7u32) })
            .await;
        assert!(
            matches!(first, Err(RunError::NotStored(Error::Config(_)))),
            "{first:?}"
        );
        executor.drain().await;
        let again = executor
            .run(&scope, &k, &fp, || async { Ok::<_, &str>(8u32) })
            .await;
        assert!(
            matches!(
                again,
                Ok(Executed {
                    value: 7,
                    replayed: true
                })
            ),
            "{again:?}"
        );
    }

    /// A store whose table is away for longer than a lease (completions and renewals both
    /// answered `Config`) takes the outcome itself once it is back, not the not-stored marker
    /// the late write switched to meanwhile: the retry replays the value. (Before, the next
    /// write after the table came back was the marker's.)
    #[tokio::test(start_paused = true)]
    async fn an_outcome_refused_while_the_table_was_away_is_stored_once_it_is_back() {
        let lease = Duration::from_secs(1);
        let store = FaultyMemory {
            renew_has_panicked: true.into(),
            away_until: Some(Instant::now() + lease * 3),
            ..FaultyMemory::default()
        };
        stored_late_and_replayed(store, lease).await;
    }

    /// An outcome the store refuses for good while it takes renewals (too large for it) is
    /// replaced by the not-stored marker, which every retry is answered. Before, the late
    /// write gave up and left the lease to run out, and the retry ran the operation again.
    #[tokio::test(start_paused = true)]
    async fn an_outcome_refused_for_good_leaves_a_marker_not_a_second_run() {
        let store = FaultyMemory {
            renew_has_panicked: true.into(),
            refuse_bodies_over: Some(512),
            ..FaultyMemory::default()
        };
        let executor = Executor::new(Arc::new(store))
            .with_policy(Policy::default().with_lease(Duration::from_secs(1)));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let runs = AtomicUsize::new(0);
        let first = executor
            .run(&scope, &k, &fp, || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, &str>("x".repeat(4000))
            })
            .await;
        assert!(matches!(first, Err(RunError::NotStored(_))), "{first:?}");
        executor.drain().await;
        tokio::time::sleep(Duration::from_secs(5)).await; // past the lease
        let again = executor
            .run(&scope, &k, &fp, || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, &str>(String::new())
            })
            .await;
        assert!(
            matches!(&again, Err(RunError::Store(Error::Corrupt(_)))),
            "{again:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// A run whose operation failed, held without polling while it gives its lease back
    /// (its caller busy elsewhere), still gives it back: the release is handed over like an
    /// outcome's write. Before, it waited for the caller's next poll, and a redelivery
    /// meanwhile found the key in flight for nobody. (Real time: the hand-over's standby
    /// thread runs on the wall clock.)
    #[tokio::test]
    async fn a_failed_run_held_without_polling_still_gives_its_lease_back() {
        let store = FaultyMemory {
            release_takes: Duration::from_millis(20),
            ..FaultyMemory::default()
        };
        let executor = Executor::new(Arc::new(store))
            .with_policy(Policy::default().with_lease(Duration::from_secs(60)));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let failed = executor.run(&scope, &k, &fp, || async { Err::<u32, _>("declined") });
        tokio::pin!(failed);
        assert!(
            futures::poll!(&mut failed).is_pending(),
            "the release is under way"
        );
        tokio::time::sleep(crate::HANDOVER_AFTER * 10).await;
        let redelivered = executor
            .run(&scope, &k, &fp, || async { Ok::<_, &str>(2u32) })
            .await;
        assert!(
            matches!(&redelivered, Ok(done) if done.value == 2 && !done.replayed),
            "{redelivered:?}"
        );
        assert!(matches!(failed.await, Err(RunError::Failed("declined"))));
    }

    /// A lease of zero is refused, not acted on (what `Policy::with_lease` documents): the
    /// operation never runs, the call is a store error, and its grant is given back, so the
    /// key is free for a run with a real lease.
    #[tokio::test]
    async fn a_zero_lease_runs_nothing_and_gives_its_grant_back() {
        let store = Arc::new(MemoryStore::new());
        let zero =
            Executor::new(store.clone()).with_policy(Policy::default().with_lease(Duration::ZERO));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = ran.clone();
        let refused = zero
            .run(&scope, &k, &fp, || async move {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, &str>(1u32)
            })
            .await;
        assert!(
            matches!(&refused, Err(RunError::Store(Error::Unavailable(_)))),
            "{refused:?}"
        );
        assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 0);
        zero.drain().await;
        let real = Executor::new(store).with_policy(Policy::default());
        let done = real
            .run(&scope, &k, &fp, || async { Ok::<_, &str>(2u32) })
            .await;
        assert!(
            matches!(&done, Ok(done) if done.value == 2 && !done.replayed),
            "{done:?}"
        );
    }

    /// A run dropped outside the runtime's context (a future held by a plain thread, dropped
    /// there) still gives its lease back, on the runtime it ran on. Before, the guard found no
    /// runtime and left the lease to run out: a redelivery found the key in flight for nobody.
    /// A runtime of its own, for tests that poll a run from outside any runtime.
    fn one_worker() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// A runtime, an executor on the memory store with a minute's lease, and a request.
    fn outside_rig() -> (
        tokio::runtime::Runtime,
        Executor<MemoryStore>,
        (Scope, Fingerprint, IdempotencyKey),
    ) {
        let executor = Executor::new(Arc::new(MemoryStore::new()))
            .with_policy(Policy::default().with_lease(Duration::from_secs(60)));
        let request = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        (one_worker(), executor, request)
    }

    #[test]
    fn a_run_dropped_outside_the_runtime_still_gives_its_lease_back() {
        given_back_once(|run| drop(run)); // here, outside the runtime
    }

    /// A run polled once on its runtime (its operation waits), then dropped by `drop_it`:
    /// a redelivery runs the operation again once the executor drained.
    fn given_back_once(
        drop_it: impl for<'a> FnOnce(std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'a>>),
    ) {
        let (runtime, executor, (scope, fp, k)) = outside_rig();
        let mut run: std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> = Box::pin(async {
            let _ = executor
                .run(&scope, &k, &fp, || async {
                    std::future::pending::<()>().await;
                    Ok::<_, &str>(1u32)
                })
                .await;
        });
        runtime.block_on(async {
            assert!(futures::poll!(&mut run).is_pending(), "the operation waits");
        });
        drop_it(run);
        let redelivered = runtime.block_on(async {
            executor.drain().await;
            executor
                .run(&scope, &k, &fp, || async { Ok::<_, &str>(2u32) })
                .await
        });
        assert!(
            matches!(&redelivered, Ok(done) if done.value == 2 && !done.replayed),
            "{redelivered:?}"
        );
    }

    /// A run dropped inside another runtime that is never driven again (a current-thread
    /// runtime between two `block_on`s, then dropped) still gives its lease back, on the
    /// runtime it ran on. Before, the give-back went only to the runtime dropping it, which
    /// dropped it unrun: the redelivery found the key in flight for nobody.
    #[test]
    fn a_run_dropped_on_a_runtime_that_never_runs_again_still_gives_its_lease_back() {
        given_back_once(|run| {
            let other = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            other.block_on(async move { drop(run) });
            drop(other); // with whatever was spawned on it, unrun
        });
    }

    /// A run started on a runtime and polled to its end by a plain thread stores its
    /// outcome (on the runtime it started on). Before, storing it panicked for want of a
    /// runtime context, and the unwinding lease guard released the key after the operation
    /// had run: the redelivery ran it again.
    #[test]
    fn a_run_finished_outside_the_runtime_stores_its_outcome() {
        let (runtime, executor, request) = outside_rig();
        finished_by_a_plain_thread(&runtime, &executor, &request, None);
    }

    /// The same when the operation is still waiting as the plain thread takes the run over:
    /// the run's wait for its lease's end makes no timer there. Before, making it panicked,
    /// and the unwinding run gave the key back: the redelivery ran the operation again.
    #[test]
    fn a_run_still_pending_when_a_plain_thread_takes_it_over_stores_its_outcome() {
        let (runtime, _, request) = outside_rig();
        // A short lease: its renewals move it while the plain thread waits, and each wakes
        // the run's loop there to wait again.
        let executor = Executor::new(Arc::new(MemoryStore::new()))
            .with_policy(Policy::default().with_lease(Duration::from_millis(300)));
        let go_after = Some(Duration::from_millis(700));
        finished_by_a_plain_thread(&runtime, &executor, &request, go_after);
    }

    /// A run started on `runtime` whose operation waits is polled to its end by a plain
    /// thread; the operation is let go before (`None`), or that long after the thread began
    /// polling. It stores its outcome once: a redelivery on the runtime replays it.
    fn finished_by_a_plain_thread(
        runtime: &tokio::runtime::Runtime,
        executor: &Executor<MemoryStore>,
        (scope, fp, k): &(Scope, Fingerprint, IdempotencyKey),
        go_after: Option<Duration>,
    ) {
        let runs = Arc::new(AtomicUsize::new(0));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let counted = runs.clone();
        let mut run = Box::pin(executor.run(scope, k, fp, || async move {
            let _ = wait.await;
            Ok::<_, &str>(counted.fetch_add(1, Ordering::SeqCst) as u32 + 1)
        }));
        runtime.block_on(async {
            assert!(futures::poll!(&mut run).is_pending(), "the operation waits");
        });
        let sender = std::thread::spawn(move || {
            if let Some(after) = go_after {
                std::thread::sleep(after);
            }
            let _ = go.send(());
        });
        if go_after.is_none() {
            sender.join().unwrap(); // let go before the plain thread polls
        }
        finished_here_and_replayed(runtime, executor, (scope, fp, k), run, &runs, "");
    }

    /// Polls `run`, started on `runtime`, to its end here (outside the runtime): it answers
    /// its operation's first value, stored once — a redelivery on the runtime replays it, and
    /// `runs` counted one run of the operation.
    fn finished_here_and_replayed<S: Store + ?Sized + 'static>(
        runtime: &tokio::runtime::Runtime,
        executor: &Executor<S>,
        (scope, fp, k): (&Scope, &Fingerprint, &IdempotencyKey),
        mut run: std::pin::Pin<
            Box<impl Future<Output = Result<Executed<u32>, RunError<&'static str>>>>,
        >,
        runs: &Arc<AtomicUsize>,
        case: &str,
    ) {
        let finished =
            std::panic::catch_unwind(AssertUnwindSafe(|| futures::executor::block_on(&mut run)));
        assert!(
            matches!(&finished, Ok(Ok(done)) if done.value == 1 && !done.replayed),
            "{case}: {:?}",
            finished.as_ref().map_err(|_| "panicked")
        );
        drop(run);
        let counted = runs.clone();
        let redelivered = runtime.block_on(async {
            executor.drain().await;
            executor
                .run(scope, k, fp, || async move {
                    Ok::<_, &str>(counted.fetch_add(1, Ordering::SeqCst) as u32 + 1)
                })
                .await
        });
        assert!(
            matches!(&redelivered, Ok(done) if done.value == 1 && done.replayed),
            "{case}: {redelivered:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{case}");
    }

    /// A run polled once on its runtime, then to its end by a plain thread, on a store a
    /// round trip away: its claim still waits at the hand-off (its grant then arrives on the
    /// plain thread), or the write of its outcome does (and fails once there). Its outcome
    /// is stored once, on the runtime it started on: a redelivery replays it. Before, the
    /// run's guard took its runtime from the poll that saw the grant, which had none: an
    /// operation that answered at once panicked storing its outcome (the key then held for
    /// nobody, the operation run again after the lease), one that waited panicked starting
    /// its renewals; and a write whose first try failed there panicked making its retry's
    /// timer.
    #[test]
    fn a_run_handed_to_a_plain_thread_mid_claim_or_mid_write_stores_its_outcome() {
        // A store a round trip away (whose renewals do not panic).
        let claim_waits = || FaultyMemory {
            begin_takes: Duration::from_millis(200),
            renew_has_panicked: true.into(),
            ..FaultyMemory::default()
        };
        let write_fails = || FaultyMemory {
            complete_fails_after: Some(Duration::from_millis(20)),
            renew_has_panicked: true.into(),
            ..FaultyMemory::default()
        };
        for (case, store, waits) in [
            (
                "claim pending, operation answers at once",
                claim_waits(),
                false,
            ),
            ("claim pending, operation waits", claim_waits(), true),
            ("write pending, fails once", write_fails(), false),
        ] {
            let runtime = one_worker();
            let executor = Executor::new(Arc::new(store))
                .with_policy(Policy::default().with_lease(Duration::from_secs(60)));
            let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
            let runs = Arc::new(AtomicUsize::new(0));
            let counted = runs.clone();
            let mut run = Box::pin(executor.run(&scope, &k, &fp, || async move {
                if waits {
                    tokio::task::yield_now().await;
                }
                Ok::<_, &str>(counted.fetch_add(1, Ordering::SeqCst) as u32 + 1)
            }));
            runtime.block_on(async {
                assert!(
                    futures::poll!(&mut run).is_pending(),
                    "{case}: the store waits"
                );
            });
            finished_here_and_replayed(&runtime, &executor, (&scope, &fp, &k), run, &runs, case);
        }
    }

    /// A run polled to its end by a plain thread after the runtime it started on shut down
    /// panics: its outcome's write had nowhere to run. Before, the write's task was dropped
    /// unrun and the run waited for it for ever.
    #[test]
    fn a_run_finished_after_its_runtime_shut_down_does_not_wait_for_ever() {
        let (runtime, executor, (scope, fp, k)) = outside_rig();
        // Leaked: the run is finished on a thread of its own, which a hang must not hold.
        let (executor, scope, fp, k) = (
            &*Box::leak(Box::new(executor)),
            &*Box::leak(Box::new(scope)),
            &*Box::leak(Box::new(fp)),
            &*Box::leak(Box::new(k)),
        );
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let mut run = Box::pin(executor.run(scope, k, fp, || async move {
            let _ = wait.await;
            Ok::<_, &str>(1u32)
        }));
        runtime.block_on(async {
            assert!(futures::poll!(&mut run).is_pending(), "the operation waits");
        });
        go.send(()).unwrap();
        drop(runtime);
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
                futures::executor::block_on(&mut run)
            }));
            let why = ran
                .err()
                .and_then(|panic| panic.downcast_ref::<&str>().copied());
            let _ = done.send(why.map(str::to_owned));
        });
        let panicked = finished.recv_timeout(Duration::from_secs(60));
        assert!(
            matches!(&panicked, Ok(Some(why)) if why.contains("runtime dropped this work")),
            "a panic, not a wait for ever: {panicked:?}"
        );
    }

    /// The same while its operation still waits: nothing outside a runtime can time the
    /// lease, and no renewal will wake the run. A panic, not a wait for ever.
    #[test]
    fn a_run_still_pending_after_its_runtime_shut_down_does_not_wait_for_ever() {
        let (runtime, _, (scope, fp, k)) = outside_rig();
        let executor = Executor::new(Arc::new(MemoryStore::new()))
            .with_policy(Policy::default().with_lease(Duration::from_millis(300)));
        let (executor, scope, fp, k) = (
            &*Box::leak(Box::new(executor)),
            &*Box::leak(Box::new(scope)),
            &*Box::leak(Box::new(fp)),
            &*Box::leak(Box::new(k)),
        );
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let mut run = Box::pin(executor.run(scope, k, fp, || async move {
            let _ = wait.await;
            Ok::<_, &str>(1u32)
        }));
        runtime.block_on(async {
            assert!(futures::poll!(&mut run).is_pending(), "the operation waits");
        });
        drop(runtime);
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
                futures::executor::block_on(&mut run)
            }));
            let why = ran
                .err()
                .and_then(|panic| panic.downcast_ref::<&str>().copied());
            let _ = done.send(why.map(str::to_owned));
        });
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            let _ = go.send(());
        });
        let panicked = finished.recv_timeout(Duration::from_secs(10));
        assert!(
            matches!(&panicked, Ok(Some(why)) if why.contains("nothing can time its lease")),
            "a panic, not a wait for ever: {panicked:?}"
        );
    }

    /// A run whose renewals stopped for good (their task was on a runtime that shut down;
    /// the run went on on another) stops its operation when the lease it holds runs out, as
    /// it does when a renewal finds the lease lost. Before, the operation went on ungated,
    /// beside the attempt that took the key over.
    #[test]
    fn a_run_whose_renewals_stopped_stops_at_the_end_of_its_lease() {
        let (first, second) = (one_worker(), one_worker());
        let store = Arc::new(MemoryStore::new());
        let lease = Duration::from_millis(300);
        let executor =
            Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let runs = Arc::new(AtomicUsize::new(0));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let counted = runs.clone();
        let mut run = Box::pin(executor.run(&scope, &k, &fp, || async move {
            let _ = wait.await;
            counted.fetch_add(1, Ordering::SeqCst);
            Ok::<_, &str>(1u32)
        }));
        first.block_on(async {
            assert!(futures::poll!(&mut run).is_pending(), "the operation waits");
        });
        drop(first); // the renewals' task with it
        let (ran, taken_over) = second.block_on(async {
            let id = RecordId::new(&scope, &k);
            let other = tokio::spawn(async move {
                // Past the lease another attempt takes the key, then this one's operation
                // is let go.
                tokio::time::sleep(lease + Duration::from_millis(100)).await;
                let answer = store.begin(&id, &fp, Duration::from_secs(60)).await;
                let _ = go.send(());
                answer
            });
            let ran = (&mut run).await;
            (ran, other.await.unwrap())
        });
        assert!(
            matches!(taken_over, Ok(Begin::Execute(_) | Begin::TakeOver(_))),
            "{taken_over:?}"
        );
        assert!(matches!(ran, Err(RunError::LeaseLost)), "{ran:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the operation was stopped");
    }

    #[tokio::test]
    async fn repeats_replay_and_errors_release() {
        let executor = Executor::new(Arc::new(MemoryStore::new()));
        let scope = Scope::new("t");
        let runs = AtomicUsize::new(0);
        let fp = Fingerprint::of(b"p");
        let failed: Result<Executed<u32>, _> = executor
            .run(&scope, &key("k"), &fp, || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<u32, _>("transient")
            })
            .await;
        assert!(matches!(failed, Err(RunError::Failed("transient"))));
        for expected_replay in [false, true, true] {
            let done = executor
                .run(&scope, &key("k"), &fp, || async {
                    Ok::<_, &str>(runs.fetch_add(1, Ordering::SeqCst) as u32)
                })
                .await
                .unwrap();
            assert_eq!((done.value, done.replayed), (1, expected_replay));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        let other = executor
            .run(&scope, &key("k"), &Fingerprint::of(b"other"), || async {
                Ok::<u32, &str>(9)
            })
            .await;
        assert!(matches!(other, Err(RunError::Mismatch)));
    }

    #[tokio::test]
    async fn a_panic_releases_the_key() {
        let executor = Executor::new(Arc::new(MemoryStore::new()));
        let scope = Scope::new("t");
        let fp = Fingerprint::of(b"p");
        let panicked: Result<Executed<u32>, RunError<()>> = executor
            .run(&scope, &key("k"), &fp, || async { panic!("boom") })
            .await;
        assert!(matches!(panicked, Err(RunError::Panicked)));
        let done = executor
            .run(&scope, &key("k"), &fp, || async { Ok::<u32, ()>(7) })
            .await
            .unwrap();
        assert_eq!(done.value, 7);
    }

    /// A closure that panics before it returns its future is a panicking operation too: the
    /// key is released and the run answers `Panicked`, it does not unwind into its caller.
    #[tokio::test]
    async fn a_closure_that_panics_before_its_future_releases_the_key() {
        let executor = Executor::new(Arc::new(MemoryStore::new()));
        let scope = Scope::new("t");
        let fp = Fingerprint::of(b"p");
        let k = key("k");
        let run = executor.run(
            &scope,
            &k,
            &fp,
            || -> std::future::Ready<Result<u32, ()>> { panic!("boom before the future") },
        );
        let panicked = AssertUnwindSafe(run).catch_unwind().await;
        assert!(
            matches!(panicked, Ok(Err(RunError::Panicked))),
            "the panic reached the caller"
        );
        executor.drain().await;
        let done = executor
            .run(&scope, &key("k"), &fp, || async { Ok::<u32, ()>(7) })
            .await
            .unwrap();
        assert_eq!((done.value, done.replayed), (7, false));
    }

    /// A run is stopped when its key is taken, whether it only asked for its completion (the
    /// store has not accepted it: the statement failed, or has not run) or the store accepted
    /// it in a transaction that then rolled back: the record read after the `LeaseLost` is not
    /// completed. (It once sufficed to ask; then, to have been accepted.)
    #[tokio::test(start_paused = true)]
    async fn a_run_is_stopped_when_its_key_is_taken_unless_its_record_is_completed() {
        for accepted in [false, true] {
            let store = Arc::new(MemoryStore::new());
            let lease = Duration::from_secs(3);
            let executor =
                Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease));
            let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
            let (asked, on_asked) = tokio::sync::oneshot::channel();
            let run = executor.run_with_claim(&scope, &k, &fp, |claim| async move {
                let _completion = claim.completion(&1u32).unwrap();
                if accepted {
                    claim.accepted(); // … and its transaction rolled back
                }
                let _ = asked.send(());
                std::future::pending::<()>().await; // a stalled statement
                Ok::<_, &str>(1u32)
            });
            let operator = async {
                on_asked.await.unwrap();
                let id = RecordId::new(&scope, &k);
                let live = crate::ReleaseScope::default().with_live();
                store.force_release(&id, live).await.unwrap();
            };
            // Bounded: a run that is not stopped waits for ever.
            let (stopped, ()) = tokio::join!(tokio::time::timeout(lease * 10, run), operator);
            assert!(
                matches!(stopped, Ok(Err(RunError::LeaseLost))),
                "accepted: {accepted}: {stopped:?}"
            );
        }
    }

    /// An operation stalled past its lease with the whole process (SIGSTOP, a paused VM; here
    /// the runtime's one thread blocks) while a redelivery takes the key over does not go on
    /// with its effect when it wakes: it is not polled until a renewal says the lease is still
    /// this run's, and that renewal says it is lost. Before, the operation was polled first
    /// (the `select!` is biased to it) and ran its effect beside the attempt that took over.
    #[test]
    fn an_operation_stalled_past_its_lease_does_not_resume_after_a_takeover() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = Arc::new(MemoryStore::new());
            let lease = Duration::from_millis(600);
            let executor = Arc::new(
                Executor::new(store.clone()).with_policy(Policy::default().with_lease(lease)),
            );
            let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
            let effects = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let run = {
                let (executor, scope, k, effects) =
                    (executor.clone(), scope.clone(), k.clone(), effects.clone());
                tokio::spawn(async move {
                    executor
                        .run(&scope, &k, &fp, || async move {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            effects.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, ()>(1u32)
                        })
                        .await
                })
            };
            tokio::time::sleep(Duration::from_millis(50)).await; // asleep before its effect
            std::thread::sleep(lease + Duration::from_millis(300)); // frozen past the lease
            let id = RecordId::new(&scope, &k);
            let taken = store.begin(&id, &fp, lease).now_or_never().unwrap();
            assert!(matches!(taken, Ok(Begin::TakeOver(_))), "{taken:?}");
            let stopped = run.await.unwrap();
            assert!(matches!(stopped, Err(RunError::LeaseLost)), "{stopped:?}");
            assert_eq!(
                effects.load(Ordering::SeqCst),
                0,
                "the operation ran its effect after the key was taken over"
            );
        });
    }

    /// A lease of a few milliseconds (tests use them) still runs its operation: the margin
    /// its holder counts on is at most half the lease. With the full margin (a sixth of the
    /// lease and 5 ms) nothing would be left: the operation was never polled, and the run never returned.
    #[tokio::test]
    async fn an_operation_on_a_tiny_lease_runs() {
        let executor = Executor::new(Arc::new(MemoryStore::new()))
            .with_policy(Policy::default().with_lease(Duration::from_millis(4)));
        let (scope, k, fp) = (Scope::new("t"), key("tiny"), Fingerprint::of(b"p"));
        let run = executor.run(&scope, &k, &fp, || async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Ok::<_, ()>(1u32)
        });
        let done = tokio::time::timeout(Duration::from_secs(5), run).await;
        assert!(matches!(done, Ok(Ok(_))), "{done:?}");
    }

    /// An operation that stored its own result (as `complete_claim_in` does, in the effect's
    /// transaction) and then panicked or failed: the key keeps that result, and the
    /// redelivery replays it; when it returns `Ok`, the executor confirms the commit (its
    /// release refused, its completion with the same token accepted).
    #[tokio::test]
    async fn a_result_the_operation_stored_itself_replays() {
        let store = Arc::new(MemoryStore::new());
        let executor = Executor::new(store.clone());
        let (scope, fp) = (Scope::new("t"), Fingerprint::of(b"p"));
        for (k, ends) in [("panics", 0), ("fails", 1), ("returns", 2)] {
            let done = executor
                .run_with_claim(&scope, &key(k), &fp, |claim| {
                    let store = store.clone();
                    async move {
                        let c = claim.completion(&format!("stored by {k}")).unwrap();
                        store
                            .complete(&c.id, c.token, &c.outcome, c.retention)
                            .await
                            .unwrap();
                        claim.accepted();
                        match ends {
                            0 => panic!("after storing"),
                            1 => Err("after storing"),
                            _ => Ok(format!("stored by {k}")),
                        }
                    }
                })
                .await;
            match (ends, &done) {
                (0, Err(RunError::Panicked)) | (1, Err(RunError::Failed(_))) => {}
                (2, Ok(done)) => assert!(!done.replayed),
                _ => panic!("{k}: {done:?}"),
            }
            let again = executor
                .run(&scope, &key(k), &fp, || async {
                    Ok::<_, &str>("ran again".to_owned())
                })
                .await
                .unwrap();
            assert!(again.replayed, "{k}");
            assert_eq!(again.value, format!("stored by {k}"));
        }
    }

    /// An operation that told the executor its store accepted its own completion
    /// ([`Claim::accepted`]) and returned `Ok`, though that completion never committed: its
    /// transaction rolled back afterwards (with Postgres, silently: a statement that failed
    /// after the completion turns the `COMMIT` into a rollback that sqlx reports as
    /// success). The executor stores nothing, releases the key, says so (`NotCommitted`),
    /// and the redelivery runs. Before, it stored the value itself: every redelivery
    /// replayed a result whose effect had never taken place.
    #[tokio::test]
    async fn a_result_accepted_in_a_transaction_that_rolled_back_is_not_stored() {
        let executor = Executor::new(Arc::new(MemoryStore::new()));
        let (scope, fp, k) = (Scope::new("t"), Fingerprint::of(b"p"), key("k"));
        let first = executor
            .run_with_claim(&scope, &k, &fp, |claim| async move {
                let _completion = claim.completion(&"charged".to_owned()).unwrap();
                claim.accepted(); // … and then its transaction rolled back
                Ok::<_, &str>("charged".to_owned())
            })
            .await;
        assert!(matches!(first, Err(RunError::NotCommitted)), "{first:?}");
        let again = executor
            .run(&scope, &k, &fp, || async {
                Ok::<_, &str>("charged on the redelivery".to_owned())
            })
            .await
            .unwrap();
        assert_eq!(
            (again.value.as_str(), again.replayed),
            ("charged on the redelivery", false)
        );
    }
}

#[cfg(test)]
mod unserialisable {
    use std::collections::HashMap;

    use super::*;
    use crate::MemoryStore;

    /// A result that does not serialise after the operation ran must not release the key:
    /// the redelivery would run the effect a second time.
    #[tokio::test]
    async fn a_result_that_does_not_serialise_is_never_run_again() {
        let executor = Executor::new(Arc::new(MemoryStore::new()));
        let (scope, key) = (Scope::new("t"), IdempotencyKey::new("k").unwrap());
        let fp = Fingerprint::of(b"p");
        let runs = std::sync::atomic::AtomicUsize::new(0);
        let op = || async {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            // JSON object keys must be strings: a map keyed by tuples does not serialise.
            Ok::<_, ()>(HashMap::from([((1u8, 2u8), 3u8)]))
        };
        let first = executor.run(&scope, &key, &fp, op).await;
        assert!(
            matches!(first, Err(RunError::NotStored(Error::Corrupt(_)))),
            "{first:?}"
        );
        let second = executor.run(&scope, &key, &fp, op).await;
        assert!(
            matches!(second, Err(RunError::Store(Error::Corrupt(_)))),
            "{second:?}"
        );
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
