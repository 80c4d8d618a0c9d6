//! A store whose `begin` answers late: how an answer looks to a caller whose future was held
//! without being polled, or whose runtime was starved, after the store had decided. Its
//! `release` and `complete` can be made slow too, to see who waits for a lease being given
//! back or an outcome being stored, and its `purge_expired`, to see how a purger paces itself.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use idempotency_core::{
    Begin, Fingerprint, ForceReleased, Inspection, LeaseToken, Outcome, RecordId, ReleaseScope,
    Result, Store,
};

/// A key to give back just before a `begin`, and perhaps to claim again then.
#[derive(Debug, Clone, Copy)]
struct HandOver {
    /// Before which `begin` from the time it was set (counting from 1); counted down.
    at: u64,
    id: RecordId,
    /// The lease to release; `None`: whatever holds the key, released by an operator.
    token: Option<LeaseToken>,
    /// The fingerprint the key is then claimed under (on the inner store, for 30 s).
    then: Option<Fingerprint>,
}

/// Wraps a store; its `begin` decides at once and answers `delay` later, and its `release`
/// and `complete` wait their own delays (none unless set) before they write. Every other
/// call goes straight through.
#[derive(Debug)]
pub struct LateBegin<S> {
    inner: S,
    delay_ms: AtomicU64,
    release_delay_ms: AtomicU64,
    complete_delay_ms: AtomicU64,
    purge_delay_ms: AtomicU64,
    /// When each `purge_expired` started.
    purge_starts: std::sync::Mutex<Vec<tokio::time::Instant>>,
    drains: AtomicU64,
    /// How many of the next `release` calls fail (`Unavailable`, nothing released).
    failing_releases: AtomicU64,
    /// How many of the next `release` calls release, then answer `Unavailable`.
    lost_release_answers: AtomicU64,
    /// How many of the next `renew` calls fail (`Unavailable`, nothing renewed).
    failing_renewals: AtomicU64,
    /// Whether every other `renew` fails (see [`LateBegin::fail_every_other_renewal`]),
    /// and how many were asked.
    alternating_renewals: std::sync::atomic::AtomicBool,
    renewals: AtomicU64,
    /// How many of the next `complete` calls answer `LeaseLost` (nothing stored).
    lost_completes: AtomicU64,
    /// How many of the next `complete` calls fail (`Unavailable`, nothing stored).
    failing_completes: AtomicU64,
    /// How many of the next `complete` calls panic (nothing stored).
    panicking_completes: AtomicU64,
    /// How many of the next `renew` calls panic (nothing renewed).
    panicking_renewals: AtomicU64,
    /// How many of the next `inspect` calls fail (`Unavailable`).
    failing_inspects: AtomicU64,
    /// How many of the next `purge_expired` calls panic (nothing purged).
    panicking_purges: AtomicU64,
    /// A lease released on the inner store just before the `begin` calls count down to 0,
    /// and the fingerprint the key is then claimed under, if any.
    release_before: std::sync::Mutex<Vec<HandOver>>,
    /// The task the last `complete` wrote from.
    complete_task: std::sync::Mutex<Option<tokio::task::Id>>,
}

impl<S: Store> LateBegin<S> {
    /// `inner`, whose `begin` answers `delay` after it decided.
    pub fn new(inner: S, delay: Duration) -> Self {
        let this = Self {
            inner,
            delay_ms: AtomicU64::new(0),
            release_delay_ms: AtomicU64::new(0),
            complete_delay_ms: AtomicU64::new(0),
            purge_delay_ms: AtomicU64::new(0),
            purge_starts: std::sync::Mutex::default(),
            drains: AtomicU64::new(0),
            failing_releases: AtomicU64::new(0),
            lost_release_answers: AtomicU64::new(0),
            failing_renewals: AtomicU64::new(0),
            alternating_renewals: std::sync::atomic::AtomicBool::new(false),
            renewals: AtomicU64::new(0),
            lost_completes: AtomicU64::new(0),
            failing_completes: AtomicU64::new(0),
            panicking_completes: AtomicU64::new(0),
            panicking_renewals: AtomicU64::new(0),
            failing_inspects: AtomicU64::new(0),
            panicking_purges: AtomicU64::new(0),
            release_before: std::sync::Mutex::new(Vec::new()),
            complete_task: std::sync::Mutex::new(None),
        };
        this.set_delay(delay);
        this
    }

    /// Changes the delay of the next answers.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms.store(millis(delay), Ordering::SeqCst);
    }

    /// Makes the next `release` calls wait `delay` before they release.
    pub fn set_release_delay(&self, delay: Duration) {
        self.release_delay_ms.store(millis(delay), Ordering::SeqCst);
    }

    /// Makes the next `n` `release` calls fail with `Unavailable`, releasing nothing (a
    /// store blip).
    pub fn fail_releases(&self, n: u64) {
        self.failing_releases.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` `release` calls release, then answer `Unavailable` (the answer
    /// lost on its way back).
    pub fn lose_release_answers(&self, n: u64) {
        self.lost_release_answers.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` `renew` calls fail with `Unavailable`, renewing nothing (a store
    /// unreachable from this process only).
    pub fn fail_renewals(&self, n: u64) {
        self.failing_renewals.store(n, Ordering::SeqCst);
    }

    /// Makes every other `renew` call from now fail with `Unavailable`, the first one
    /// included (a flaky path to the store).
    pub fn fail_every_other_renewal(&self) {
        self.renewals.store(0, Ordering::SeqCst);
        self.alternating_renewals.store(true, Ordering::SeqCst);
    }

    /// Makes the next `n` `complete` calls answer `LeaseLost`, storing nothing (another
    /// attempt took the key over, or an operator released it, while the operation ran).
    pub fn lose_completes(&self, n: u64) {
        self.lost_completes.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` `complete` calls fail with `Unavailable`, storing nothing (a store
    /// down for a while).
    pub fn fail_completes(&self, n: u64) {
        self.failing_completes.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` `inspect` calls fail with `Unavailable` (a store blip).
    pub fn fail_inspects(&self, n: u64) {
        self.failing_inspects.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` `renew` calls panic, renewing nothing (a store with a bug).
    pub fn panic_renewals(&self, n: u64) {
        self.panicking_renewals.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` `purge_expired` calls panic, purging nothing (a store with a bug).
    pub fn panic_purges(&self, n: u64) {
        self.panicking_purges.store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` `complete` calls panic, storing nothing (a store with a bug).
    pub fn panic_completes(&self, n: u64) {
        self.panicking_completes.store(n, Ordering::SeqCst);
    }

    /// Releases `token`'s lease on `id`, on the inner store, just before the `n`-th `begin`
    /// from now (counting from 1) runs: another attempt that gave its key back between two
    /// asks of one request.
    pub fn release_before_begin(&self, n: u64, id: RecordId, token: LeaseToken) {
        self.hand_over(HandOver {
            at: n,
            id,
            token: Some(token),
            then: None,
        });
    }

    /// The same, and the key is then claimed (on the inner store, for 30 s) under `fp`:
    /// another attempt gave the key back and a third claimed it, between two asks of one
    /// request.
    pub fn hand_over_before_begin(&self, n: u64, id: RecordId, token: LeaseToken, fp: Fingerprint) {
        self.hand_over(HandOver {
            at: n,
            id,
            token: Some(token),
            then: Some(fp),
        });
    }

    /// The same for whatever attempt holds the key then (its lease released as an operator
    /// would): for a holder whose token the test does not know.
    pub fn take_key_before_begin(&self, n: u64, id: RecordId, fp: Fingerprint) {
        self.hand_over(HandOver {
            at: n,
            id,
            token: None,
            then: Some(fp),
        });
    }

    fn hand_over(&self, hand_over: HandOver) {
        self.release_before
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(hand_over);
    }

    /// Makes the next `purge_expired` calls take `delay` before they purge (a statement's
    /// time).
    pub fn set_purge_delay(&self, delay: Duration) {
        self.purge_delay_ms.store(millis(delay), Ordering::SeqCst);
    }

    /// When each `purge_expired` call started, in order.
    pub fn purge_starts(&self) -> Vec<tokio::time::Instant> {
        self.purge_starts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Makes the next `complete` calls wait `delay` before they store the outcome.
    pub fn set_complete_delay(&self, delay: Duration) {
        self.complete_delay_ms
            .store(millis(delay), Ordering::SeqCst);
    }

    /// The task the last `complete` stored its outcome from (after its delay), if any.
    pub fn last_complete_task(&self) -> Option<tokio::task::Id> {
        *self
            .complete_task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many times `drain` was called (a graceful shutdown must reach the store's).
    pub fn drains(&self) -> u64 {
        self.drains.load(Ordering::SeqCst)
    }

    /// The wrapped store, answering at once.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

fn millis(delay: Duration) -> u64 {
    u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)
}

/// Counts one injected failure down: whether this call fails.
fn take_one(failing: &AtomicU64) -> bool {
    failing
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

async fn wait(delay_ms: &AtomicU64) {
    tokio::time::sleep(Duration::from_millis(delay_ms.load(Ordering::SeqCst))).await;
}

#[async_trait::async_trait]
impl<S: Store> Store for LateBegin<S> {
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        let due: Vec<HandOver> = {
            let mut set = self
                .release_before
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let due = set.iter().filter(|h| h.at == 1).copied().collect();
            set.retain(|h| h.at > 1);
            for hand_over in set.iter_mut() {
                hand_over.at -= 1;
            }
            due
        };
        for HandOver {
            id, token, then, ..
        } in due
        {
            let _ = match token {
                Some(token) => self.inner.release(&id, token).await,
                None => {
                    let scope = ReleaseScope::default().with_live();
                    self.inner.force_release(&id, scope).await.map(|_| ())
                }
            };
            if let Some(fp) = then {
                let _ = self.inner.begin(&id, &fp, Duration::from_secs(30)).await;
            }
        }
        let answer = self.inner.begin(id, fp, lease).await;
        wait(&self.delay_ms).await;
        answer
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        wait(&self.complete_delay_ms).await;
        *self
            .complete_task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = tokio::task::try_id();
        if take_one(&self.lost_completes) {
            return Err(idempotency_core::Error::LeaseLost);
        }
        if take_one(&self.failing_completes) {
            return Err(idempotency_core::Error::unavailable(
                "a complete failed (injected)",
            ));
        }
        assert!(
            !take_one(&self.panicking_completes),
            "a complete panicked (injected)"
        );
        self.inner.complete(id, token, outcome, retention).await
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        wait(&self.release_delay_ms).await;
        if take_one(&self.failing_releases) {
            return Err(idempotency_core::Error::unavailable(
                "a release failed (injected)",
            ));
        }
        let released = self.inner.release(id, token).await;
        if released.is_ok() && take_one(&self.lost_release_answers) {
            return Err(idempotency_core::Error::unavailable(
                "a release's answer was lost (injected)",
            ));
        }
        released
    }

    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        let alternate = self.alternating_renewals.load(Ordering::SeqCst)
            && self
                .renewals
                .fetch_add(1, Ordering::SeqCst)
                .is_multiple_of(2);
        if take_one(&self.failing_renewals) || alternate {
            return Err(idempotency_core::Error::unavailable(
                "a renewal failed (injected)",
            ));
        }
        assert!(
            !take_one(&self.panicking_renewals),
            "a renewal panicked (injected)"
        );
        self.inner.renew(id, token, lease).await
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64> {
        self.purge_starts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(tokio::time::Instant::now());
        wait(&self.purge_delay_ms).await;
        assert!(
            !take_one(&self.panicking_purges),
            "a purge panicked (injected)"
        );
        self.inner.purge_expired(batch).await
    }

    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>> {
        if take_one(&self.failing_inspects) {
            return Err(idempotency_core::Error::unavailable(
                "an inspect failed (injected)",
            ));
        }
        self.inner.inspect(id).await
    }

    async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased> {
        self.inner.force_release(id, scope).await
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn drain(&self) {
        self.inner.drain().await;
        self.drains.fetch_add(1, Ordering::SeqCst);
    }
}
