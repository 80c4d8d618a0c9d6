//! What an operator sees of a record, and what they may do to it: [`Store::inspect`],
//! [`Store::force_release`](crate::Store::force_release) and [`resolve_unknown`].

use std::time::{Duration, SystemTime};

use crate::Fingerprint;

/// A live record as [`Store::inspect`](crate::Store::inspect) read it. Times come from the
/// store's clock, read by the same call.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{Begin, Fingerprint, IdempotencyKey, MemoryStore, RecordId, RecordState, Scope, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotency_core::Error> {
/// let store = MemoryStore::new();
/// let id = RecordId::new(&Scope::new("acct_1"), &IdempotencyKey::new("order-42").unwrap());
/// assert_eq!(store.inspect(&id).await?, None);
///
/// store.begin(&id, &Fingerprint::of(b"amount=100"), Duration::from_secs(30)).await?;
/// let record = store.inspect(&id).await?.expect("claimed");
/// assert!(matches!(record.state, RecordState::InFlight { .. }));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// In flight or completed, with what each state knows.
    pub state: RecordState,
    /// The fingerprint of the request that claimed the record.
    pub fingerprint: Fingerprint,
    /// When the record was claimed; `None` where the store does not keep it (Redis).
    pub created_at: Option<SystemTime>,
    /// In flight: when the lease ends (in the past for a lease that ran out and nobody took
    /// over yet: its owner may still complete it). Completed: when the outcome is forgotten.
    pub expires_at: SystemTime,
}

/// The state of a live record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// An attempt holds (or held) the lease and has not completed.
    InFlight {
        /// How long the lease has left; zero once it ran out (the owner crashed, or is slow:
        /// the next `begin` takes over).
        lease_remaining: Duration,
    },
    /// The outcome is stored and replays.
    Completed {
        /// The stored HTTP status.
        status: u16,
    },
}

impl Inspection {
    /// An in-flight record: its lease ends at `expires_at`, `lease_remaining` from now.
    pub fn in_flight(
        fingerprint: Fingerprint,
        created_at: Option<SystemTime>,
        expires_at: SystemTime,
        lease_remaining: Duration,
    ) -> Self {
        Self {
            state: RecordState::InFlight { lease_remaining },
            fingerprint,
            created_at,
            expires_at,
        }
    }

    /// A completed record holding an outcome with `status`, kept until `expires_at`.
    pub fn completed(
        fingerprint: Fingerprint,
        created_at: Option<SystemTime>,
        expires_at: SystemTime,
        status: u16,
    ) -> Self {
        Self {
            state: RecordState::Completed { status },
            fingerprint,
            created_at,
            expires_at,
        }
    }

    /// Whether the record is completed.
    pub fn is_completed(&self) -> bool {
        matches!(self.state, RecordState::Completed { .. })
    }
}

/// What [`Store::force_release`](crate::Store::force_release) may delete.
///
/// The default deletes only an in-flight record whose lease has run out (its holder stopped
/// renewing it). It is checked atomically with the delete, so an operator who saw a lease run
/// out cannot delete the live lease of a retry that took the key over in the meantime and is
/// running the operation, nor a record completed since.
///
/// Even then, release only after reconciling the unfinished attempt: its holder may be paused
/// rather than gone, and after a release the next `begin` answers `Execute`, not `TakeOver`,
/// so the "outcome unknown" signal is gone.
///
/// ```
/// use idempotency_core::ReleaseScope;
/// let scope = ReleaseScope::default();
/// assert!(!scope.live && !scope.completed);
/// // A holder known to be stuck: release its live lease too.
/// assert!(ReleaseScope::default().with_live().live);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ReleaseScope {
    /// Also an in-flight record whose lease is live: its holder may still be running the
    /// operation, and the next `begin` runs it again.
    pub live: bool,
    /// Also a completed record: its outcome is forgotten and the key runs again.
    pub completed: bool,
}

impl ReleaseScope {
    /// Live leases too (see [`ReleaseScope::live`]).
    pub fn with_live(mut self) -> Self {
        self.live = true;
        self
    }

    /// Completed records too (see [`ReleaseScope::completed`]).
    pub fn with_completed(mut self) -> Self {
        self.completed = true;
        self
    }
}

/// What [`Store::force_release`](crate::Store::force_release) found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForceReleased {
    /// An in-flight record was deleted: the next `begin` executes, and the old owner's token
    /// is fenced off (its late `complete` answers `LeaseLost`).
    Released,
    /// The record's lease is live and [`ReleaseScope::live`] was not asked: nothing changed.
    /// Its holder renews it while it runs.
    Live,
    /// A completed record was deleted (asked for with [`ReleaseScope::completed`]): the next
    /// `begin` executes the operation again.
    Deleted,
    /// The record is completed and [`ReleaseScope::completed`] was not asked: nothing changed.
    Completed,
    /// There is no live record under this id.
    Absent,
}

/// What [`resolve_unknown`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolved {
    /// The outcome is stored: the key's retries replay it. The attempt's own late
    /// completion is refused.
    Stored,
    /// The record's lease is live: its holder may still be running the operation, or a
    /// retry is being told its outcome is unknown. Nothing changed: look again once the
    /// lease ran out. (Also said of a record under the attempt's fingerprint found after the
    /// resolution's own completion was refused: a retry's, which ran after an operator
    /// released the resolution's lease; the store cannot tell it from the attempt.)
    Live,
    /// The record is completed (now or since it was read): its outcome replays already —
    /// the attempt's, or that of a retry that ran after an operator released the key.
    /// Nothing changed.
    Completed,
    /// There is no live record under this id (now, or since it was read: purged, or
    /// released by an operator). Nothing changed.
    Absent,
    /// Another request's record holds the key: the attempt's was released (or purged) after
    /// it was read, and a request with another fingerprint claimed the key. Nothing changed:
    /// the attempt has no record left to resolve, and the key's retries get that request's
    /// answers.
    Replaced,
}

/// The lease [`resolve_unknown`] holds while it stores the outcome.
const RESOLVING_LEASE: Duration = Duration::from_secs(30);

/// Resolves an attempt whose outcome is unknown (an in-flight record whose lease ran out) as
/// having taken effect, for an operator who reconciled it and found its effect: `outcome`
/// becomes the key's outcome, kept for `retention`, and its retries replay it instead of
/// meeting the outcome-unknown policy or running the operation again. (Found no effect:
/// [`Store::force_release`](crate::Store::force_release) it, and the next request runs.)
///
/// The record is taken over as a retry of the attempt would take it (under its own
/// fingerprint: the store checks that the lease ran out in the same step), then completed.
/// A retry that took the key over since it was read keeps it ([`Resolved::Live`]), and the
/// attempt's late completion is refused.
///
/// Dropped mid-way (an operator's tool that timed out), it runs to its end in a task of its
/// own ([`finish_on_drop`](crate::finish_on_drop)): half done, it would leave its takeover
/// held for its 30 s lease, and then the record read as an attempt whose outcome is unknown
/// again — or, where the key had been released since it was read, a fresh claim read so, an
/// operator's release undone. So it takes the store as an `Arc`. Failing after its claim, it
/// gives the lease back before it answers; that failing too (the store unavailable), in a
/// task of its own, retried until the store answers ([`end_orphan`](crate::end_orphan),
/// [`release_orphan`](crate::release_orphan)). A shutdown waits for neither task unless
/// you use [`resolve_unknown_tracked`], as the layer's admin routes do. (Dropped outside
/// any Tokio runtime, it stops where it is: there is nowhere to run the rest.)
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{resolve_unknown, Begin, Fingerprint, MemoryStore, Outcome, RecordId, Resolved, Store};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() -> Result<(), idempotency_core::Error> {
/// let store = Arc::new(MemoryStore::new());
/// let (id, fp) = (RecordId::from_bytes([7; 32]), Fingerprint::of(b"charge 1000"));
/// store.begin(&id, &fp, Duration::from_secs(1)).await?; // an attempt that crashed
/// tokio::time::advance(Duration::from_secs(2)).await;
/// // The operator found the charge it made:
/// let found = Outcome::new(201).with_body(r#"{"id":"ch_1"}"#);
/// let day = Duration::from_secs(86_400);
/// assert_eq!(resolve_unknown(&store, &id, &found, day).await?, Resolved::Stored);
/// assert_eq!(store.begin(&id, &fp, Duration::from_secs(30)).await?, Begin::Replay(found));
/// # Ok(()) }
/// ```
pub async fn resolve_unknown<S: crate::Store + ?Sized + 'static>(
    store: &std::sync::Arc<S>,
    id: &crate::RecordId,
    outcome: &crate::Outcome,
    retention: Duration,
) -> crate::Result<Resolved> {
    let untracked = tokio_util::task::TaskTracker::new();
    resolve_unknown_tracked(store, id, outcome, retention, &untracked).await
}

/// [`resolve_unknown`], with what it leaves running — its rest when dropped, a give-back
/// retried after a failure — spawned as tasks of `tracker`, so that a graceful shutdown that
/// waits for the tracker waits for them: the process exiting right after a failed
/// resolution would otherwise leave its claim held, then read as an unknown attempt.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{resolve_unknown_tracked, MemoryStore, Outcome, RecordId, Resolved};
/// use tokio_util::task::TaskTracker;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotency_core::Error> {
/// let (store, settling) = (Arc::new(MemoryStore::new()), TaskTracker::new());
/// let (id, found) = (RecordId::from_bytes([7; 32]), Outcome::new(201));
/// let day = Duration::from_secs(86_400);
/// let resolved = resolve_unknown_tracked(&store, &id, &found, day, &settling).await?;
/// assert_eq!(resolved, Resolved::Absent); // no record to resolve
/// settling.close();
/// settling.wait().await; // a shutdown: whatever it left running has ended
/// # Ok(()) }
/// ```
pub async fn resolve_unknown_tracked<S: crate::Store + ?Sized + 'static>(
    store: &std::sync::Arc<S>,
    id: &crate::RecordId,
    outcome: &crate::Outcome,
    retention: Duration,
    tracker: &tokio_util::task::TaskTracker,
) -> crate::Result<Resolved> {
    let (store, id, outcome) = (store.clone(), *id, outcome.clone());
    let settling = tracker.clone();
    let resolution = async move { resolve(store, &id, &outcome, retention, &settling).await };
    crate::finish_on_drop(resolution, |_| Box::pin(async {}))
        .tracked_by(tracker)
        .await
}

/// [`resolve_unknown`]'s steps: read, take over, complete.
async fn resolve<S: crate::Store + ?Sized + 'static>(
    store: std::sync::Arc<S>,
    id: &crate::RecordId,
    outcome: &crate::Outcome,
    retention: Duration,
    settling: &tokio_util::task::TaskTracker,
) -> crate::Result<Resolved> {
    use crate::{Begin, Error};

    let Some(record) = store.inspect(id).await? else {
        return Ok(Resolved::Absent);
    };
    match record.state {
        RecordState::InFlight { lease_remaining } if lease_remaining.is_zero() => {}
        RecordState::InFlight { .. } => return Ok(Resolved::Live),
        RecordState::Completed { .. } => return Ok(Resolved::Completed),
    }
    let token = match store
        .begin(id, &record.fingerprint, RESOLVING_LEASE)
        .await?
    {
        Begin::TakeOver(token) => token,
        // No record since it was read: purged, or released by another operator (found no
        // effect: the key runs again). Stored now, the outcome would answer for an attempt
        // that operator was told is gone, and both would be told they succeeded, which no
        // order of the two gives. The claim goes back.
        Begin::Execute(token) => {
            let released = store.release(id, token);
            let released = crate::panic_as_unavailable(released, "the store's release panicked");
            return match released.await {
                // Released by an operator meanwhile (`live`): gone all the same.
                Ok(()) | Err(Error::LeaseLost) => Ok(Resolved::Absent),
                Err(error) => {
                    // Kept, it would read as an unknown attempt once its lease ran out.
                    give_back_later(&store, *id, &Begin::Execute(token), settling);
                    Err(error)
                }
            };
        }
        Begin::InFlight { .. } => return Ok(Resolved::Live),
        Begin::Replay(_) => return Ok(Resolved::Completed),
        // The attempt's own fingerprint, refused: another request's record, since.
        Begin::Mismatch => return Ok(Resolved::Replaced),
    };
    match store.complete(id, token, outcome, retention).await {
        Ok(()) => Ok(Resolved::Stored),
        // Held past the takeover's lease (a store that answered late) and taken over by a
        // retry since, or released by an operator (`?live=true`): nothing stored. Said as
        // it is now, so that a release is not reported as a live lease to look at again.
        Err(Error::LeaseLost) => Ok(match store.inspect(id).await? {
            None => Resolved::Absent,
            Some(now) if now.fingerprint != record.fingerprint => Resolved::Replaced,
            Some(now) if matches!(now.state, RecordState::Completed { .. }) => Resolved::Completed,
            Some(_) => Resolved::Live,
        }),
        Err(error) => {
            // Not stored: the record is an attempt whose outcome is unknown again now,
            // rather than "in flight" to its retries for a lease (or, the store failing,
            // once a retry in a task of its own lands).
            // (A store whose call panics is one that failed: retried as one.)
            let ended = store.renew(id, token, Duration::ZERO);
            let ended = crate::panic_as_unavailable(ended, "the store's renew panicked").await;
            if let Err(Error::Unavailable(_)) = ended {
                give_back_later(&store, *id, &Begin::TakeOver(token), settling);
            }
            Err(error)
        }
    }
}

/// Gives `grant` back in a task of `settling` ([`give_back_orphan`](crate::give_back_orphan):
/// retried while the store is unavailable), so that the caller hears of the failure now.
/// Outside any runtime the grant is left to run out (its lease, 30 s).
fn give_back_later<S: crate::Store + ?Sized + 'static>(
    store: &std::sync::Arc<S>,
    id: crate::RecordId,
    grant: &crate::Begin,
    settling: &tokio_util::task::TaskTracker,
) {
    let give_back = || {
        let (store, grant) = (store.clone(), grant.clone());
        async move { crate::give_back_orphan(&*store, &id, grant).await }
    };
    if crate::spawn_where_it_survives(settling, None, give_back) == 0 {
        tracing::warn!(record = %id, "no runtime to give a resolution's claim back on; its lease runs out");
    }
}

/// A time given in milliseconds since the Unix epoch (what SQL's `extract(epoch …)` and
/// Redis' `TIME` give), as a [`SystemTime`]; the epoch itself for anything before it.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// let t = idempotency_core::system_time_from_millis(1_500.0);
/// assert_eq!(t, SystemTime::UNIX_EPOCH + Duration::from_millis(1_500));
/// ```
pub fn system_time_from_millis(millis: f64) -> SystemTime {
    if millis <= 0.0 || !millis.is_finite() {
        return SystemTime::UNIX_EPOCH;
    }
    SystemTime::UNIX_EPOCH + Duration::from_secs_f64(millis / 1000.0)
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };

    use super::*;
    use crate::{
        Begin, Error, ForceReleased, LeaseToken, MemoryStore, Outcome, RecordId, Result, Store,
    };

    /// A memory store an operator races: the record is released right after it is read
    /// (`release_after_inspect`), and writes are slow or fail once.
    #[derive(Default)]
    struct Raced {
        inner: MemoryStore,
        release_after_inspect: AtomicBool,
        /// Each `release` and `complete` takes this long (a store a slow round trip away).
        writes_take: Duration,
        /// The next `release` or `complete` fails (`Unavailable`: a connection reset).
        fail_next_write: AtomicBool,
        /// The next `renew` panics (a bug in a store).
        panic_next_renew: AtomicBool,
    }

    impl Raced {
        async fn write(&self) -> Result<()> {
            tokio::time::sleep(self.writes_take).await;
            match self.fail_next_write.swap(false, Ordering::SeqCst) {
                true => Err(Error::unavailable("connection reset")),
                false => Ok(()),
            }
        }
    }

    #[async_trait::async_trait]
    impl Store for Raced {
        async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
            self.inner.begin(id, fp, lease).await
        }
        async fn complete(
            &self,
            id: &RecordId,
            token: LeaseToken,
            outcome: &Outcome,
            retention: Duration,
        ) -> Result<()> {
            self.write().await?;
            self.inner.complete(id, token, outcome, retention).await
        }
        async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
            self.write().await?;
            self.inner.release(id, token).await
        }
        async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
            assert!(
                !self.panic_next_renew.swap(false, Ordering::SeqCst),
                "the store's renew panics on purpose"
            );
            self.inner.renew(id, token, lease).await
        }
        async fn purge_expired(&self, batch: usize) -> Result<u64> {
            self.inner.purge_expired(batch).await
        }
        async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>> {
            let found = self.inner.inspect(id).await?;
            if self.release_after_inspect.swap(false, Ordering::SeqCst) {
                let released = self
                    .inner
                    .force_release(id, ReleaseScope::default())
                    .await?;
                assert_eq!(released, ForceReleased::Released);
            }
            Ok(found)
        }
        async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased> {
            self.inner.force_release(id, scope).await
        }
        fn name(&self) -> &'static str {
            "raced"
        }
    }

    const DAY: Duration = Duration::from_secs(86_400);

    /// An attempt that crashed: its record, its lease run out.
    async fn unknown_attempt(store: &Raced) -> (RecordId, Fingerprint) {
        let (id, fp) = (
            RecordId::from_bytes([7; 32]),
            Fingerprint::of(b"charge 1000"),
        );
        store.begin(&id, &fp, Duration::from_secs(1)).await.unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        (id, fp)
    }

    /// Resolves `id` (as found: a 201), which fails: `Unavailable`, as the store failed.
    async fn resolution_fails(store: &Arc<Raced>, id: &RecordId) {
        let found = Outcome::new(201).with_body("ch_1");
        let resolved = resolve_unknown(store, id, &found, DAY).await;
        assert!(
            matches!(resolved, Err(Error::Unavailable(_))),
            "{resolved:?}"
        );
    }

    /// The next request takes the key over: the record is an attempt whose outcome is
    /// unknown, its lease over.
    async fn taken_over(store: &Raced, id: &RecordId, fp: &Fingerprint) {
        let retry = store.begin(id, fp, Duration::from_secs(30)).await.unwrap();
        assert!(matches!(retry, Begin::TakeOver(_)), "{retry:?}");
    }

    /// Lets the tasks spawned so far run to their end (time is paused: sleeps end at once).
    async fn settle() {
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
    }

    /// Another operator released the attempt (found no effect) between the resolution's read
    /// and its claim; the resolution's caller gave up while its claim was going back. The key
    /// is free, as that operator was told. Before, the claim was held for 30 s and then read
    /// as an unknown attempt: the release undone, the key's retries refused.
    #[tokio::test(start_paused = true)]
    async fn a_resolution_dropped_while_giving_its_claim_back_still_gives_it_back() {
        let store = Arc::new(Raced {
            writes_take: Duration::from_secs(5),
            ..Raced::default()
        });
        let (id, _) = unknown_attempt(&store).await;
        store.release_after_inspect.store(true, Ordering::SeqCst);
        let found = Outcome::new(201).with_body("ch_1");
        let resolution = resolve_unknown(&store, &id, &found, DAY);
        let gave_up = tokio::time::timeout(Duration::from_secs(1), resolution).await;
        assert!(gave_up.is_err(), "still giving the claim back: {gave_up:?}");
        settle().await;
        assert_eq!(store.inspect(&id).await.unwrap(), None);
    }

    /// The same, with the give-back failing (a connection reset): the caller hears of the
    /// failure, and the claim goes back all the same.
    #[tokio::test(start_paused = true)]
    async fn a_resolution_whose_give_back_failed_still_gives_its_claim_back() {
        let store = Arc::new(Raced::default());
        let (id, _) = unknown_attempt(&store).await;
        store.release_after_inspect.store(true, Ordering::SeqCst);
        store.fail_next_write.store(true, Ordering::SeqCst);
        resolution_fails(&store, &id).await;
        settle().await;
        assert_eq!(store.inspect(&id).await.unwrap(), None);
    }

    /// The resolution's caller gave up while the outcome was being stored: it is stored
    /// all the same, and the key's retries replay it. Before, the takeover was left held,
    /// and the record was read as an unknown attempt again once its lease ran out.
    #[tokio::test(start_paused = true)]
    async fn a_resolution_dropped_while_storing_still_stores() {
        let store = Arc::new(Raced {
            writes_take: Duration::from_secs(5),
            ..Raced::default()
        });
        let (id, fp) = unknown_attempt(&store).await;
        let found = Outcome::new(201).with_body("ch_1");
        let resolution = resolve_unknown(&store, &id, &found, DAY);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), resolution)
                .await
                .is_err()
        );
        settle().await;
        let retry = store
            .begin(&id, &fp, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(retry, Begin::Replay(found));
    }

    /// Storing failed (a connection reset): the caller hears of it, and the record is an
    /// attempt whose outcome is unknown again at once, not "in flight" for the resolution's
    /// lease.
    #[tokio::test(start_paused = true)]
    async fn a_resolution_that_could_not_store_leaves_the_attempt_unknown_at_once() {
        let store = Arc::new(Raced::default());
        let (id, fp) = unknown_attempt(&store).await;
        store.fail_next_write.store(true, Ordering::SeqCst);
        resolution_fails(&store, &id).await;
        for _ in 0..4 {
            tokio::task::yield_now().await; // the give-back's task
        }
        taken_over(&store, &id, &fp).await;
    }

    /// Storing failed, and so did ending the takeover (the store's renew panicked): the
    /// caller hears of the failure, and the takeover is ended all the same, by a retry.
    /// Found by review: the panic unwound the resolution, and the key was held for the
    /// resolving lease.
    #[tokio::test(start_paused = true)]
    async fn a_resolution_whose_store_panicked_ending_its_takeover_still_ends_it() {
        let store = Arc::new(Raced::default());
        let (id, fp) = unknown_attempt(&store).await;
        store.fail_next_write.store(true, Ordering::SeqCst);
        store.panic_next_renew.store(true, Ordering::SeqCst);
        resolution_fails(&store, &id).await;
        // Past the give-back's first backoff, well within the resolving lease.
        tokio::time::sleep(Duration::from_secs(1)).await;
        taken_over(&store, &id, &fp).await;
    }
}
