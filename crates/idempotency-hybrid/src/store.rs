//! `HybridStore`: Redis first, Postgres decides, Postgres alone when Redis is down.

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use idempotency_core::{
    Begin, Error, Fingerprint, LeaseToken, Outcome, RecordId, Result, Store, detached_claim,
};
use idempotency_postgres::PostgresStore;
use idempotency_redis::{Peek, RedisStore};
use tokio::time::Instant;

use crate::breaker::{Breaker, BreakerConfig, BreakerState};

/// A [`Store`] that answers from Redis when it can and decides in Postgres always.
///
/// The algorithm (each step's reason in the comments of [`HybridStore::begin`]):
///
/// 1. `begin` peeks in Redis. A cached outcome replays, a mirrored live lease answers
///    `InFlight`, a different fingerprint answers `Mismatch` — no Postgres round trip.
/// 2. Anything else (absent, evicted, flushed, Redis down) goes to Postgres, whose unique key
///    decides. **Redis is never the reason an operation runs.**
/// 3. What Postgres said is mirrored into Redis, best effort: a granted lease, a replayed
///    outcome (with the TTL Postgres has left, so Redis never outlives the row).
/// 4. `complete` / `release` / `renew` go to Postgres first, fenced; then to Redis.
///
/// A Redis error or timeout never fails a call: the [breaker](BreakerConfig) counts it and,
/// after a few in a row, routes everything to Postgres alone, probing Redis with capped
/// backoff until it answers. A Postgres failure is [`Error::Unavailable`] even when Redis is
/// up: an operation never runs unguarded.
///
/// ```no_run
/// use idempotency_hybrid::HybridStore;
/// use idempotency_postgres::PostgresStore;
/// use idempotency_redis::RedisStore;
///
/// # async fn run() -> Result<(), idempotency_core::Error> {
/// let pg = PostgresStore::builder("postgres://app@127.0.0.1/app").connect().await?;
/// pg.migrate().await?;
/// let redis = RedisStore::builder("redis://127.0.0.1:6379/");
/// let store = HybridStore::connect(pg, redis).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct HybridStore {
    pg: PostgresStore,
    redis: RedisStore,
    mirror_ttl: Duration,
    inner: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    breaker: Breaker,
    /// Mirrors that may be stale: their record was completed or released in Postgres while
    /// Redis could not be told. Fenced deletes run at the next successful Redis call.
    repairs: std::sync::Mutex<std::collections::VecDeque<(RecordId, LeaseToken)>>,
    repairing: tokio::sync::Mutex<()>,
    /// Lease mirrors written after `begin` answered, until they land.
    mirrors: std::sync::Mutex<std::collections::HashMap<LeaseToken, tokio::task::JoinHandle<()>>>,
    redis_hits: AtomicU64,
    redis_misses: AtomicU64,
    redis_errors: AtomicU64,
    fallbacks: AtomicU64,
}

/// A snapshot of the hybrid store's counters, for metrics and health checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HybridMetrics {
    /// `begin`s answered by Redis alone.
    pub redis_hits: u64,
    /// `begin`s Redis could not answer (absent record), sent to Postgres.
    pub redis_misses: u64,
    /// Redis calls that failed or timed out.
    pub redis_errors: u64,
    /// Redis calls skipped or failed, so that Postgres served alone.
    pub fallbacks: u64,
    /// Times the breaker opened.
    pub breaker_opened: u64,
    /// Times the breaker closed again after being open.
    pub breaker_closed: u64,
    /// The breaker's state now.
    pub breaker_state: BreakerState,
}

impl HybridStore {
    /// Builds the store. The Redis side skips the eviction check (eviction costs latency
    /// here, never a second execution) and connects lazily, so the store starts while Redis
    /// is down.
    pub async fn connect(
        pg: PostgresStore,
        redis: idempotency_redis::RedisStoreBuilder,
    ) -> Result<Self> {
        let redis = redis
            .eviction_check(idempotency_redis::EvictionCheck::Skip)
            .connect()
            .await?;
        Ok(Self::new(pg, redis, BreakerConfig::default()))
    }

    /// Builds the store from connected parts.
    pub fn new(pg: PostgresStore, redis: RedisStore, breaker: BreakerConfig) -> Self {
        Self {
            pg,
            redis,
            mirror_ttl: Duration::from_secs(2),
            inner: Arc::new(Shared {
                breaker: Breaker::new(breaker),
                repairs: std::sync::Mutex::new(std::collections::VecDeque::new()),
                repairing: tokio::sync::Mutex::new(()),
                mirrors: std::sync::Mutex::default(),
                redis_hits: AtomicU64::new(0),
                redis_misses: AtomicU64::new(0),
                redis_errors: AtomicU64::new(0),
                fallbacks: AtomicU64::new(0),
            }),
        }
    }

    /// The longest time Redis mirrors a live lease (default 2 s; the lease if shorter).
    /// `Duration::ZERO` turns the mirror off: first requests save a Redis round trip, and
    /// live duplicates are answered by Postgres instead.
    ///
    /// A Redis write whose call timed out may still run later (a paused Redis executes its
    /// queued commands when it resumes), so a mirror can land after Postgres completed or
    /// released the record. It then answers "in flight" until it expires: never a second
    /// execution, but 409s. The cap bounds that; past it, duplicates ask Postgres.
    pub fn with_in_flight_mirror_ttl(mut self, ttl: Duration) -> Self {
        self.mirror_ttl = ttl;
        self
    }

    /// The Postgres side, for the application's transactions
    /// ([`PostgresStore::complete_in`] completes a record of this store too).
    pub fn postgres(&self) -> &PostgresStore {
        &self.pg
    }

    /// The Redis side.
    pub fn redis(&self) -> &RedisStore {
        &self.redis
    }

    /// The counters and the breaker state.
    pub fn metrics(&self) -> HybridMetrics {
        let s = &self.inner;
        HybridMetrics {
            redis_hits: s.redis_hits.load(Ordering::Relaxed),
            redis_misses: s.redis_misses.load(Ordering::Relaxed),
            redis_errors: s.redis_errors.load(Ordering::Relaxed),
            fallbacks: s.fallbacks.load(Ordering::Relaxed),
            breaker_opened: s.breaker.opened.load(Ordering::Relaxed),
            breaker_closed: s.breaker.closed.load(Ordering::Relaxed),
            breaker_state: s.breaker.state(),
        }
    }

    /// Runs a Redis call through the breaker. `None` means "Redis had nothing to say": it is
    /// skipped (breaker open), failed or timed out. Never an error: Redis is an optimisation.
    ///
    /// Cancel-safe: the breaker permit reports nothing when dropped (a dropped probe hands
    /// the probe to the next call), and repairs taken for this call go back in the queue.
    async fn try_redis<T>(&self, call: impl Future<Output = Result<T>>) -> Option<T> {
        let s = &self.inner;
        let Some(permit) = s.breaker.allow() else {
            s.fallbacks.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        // Stale mirrors go first: on this FIFO connection the deletes run after any late
        // write, and before the call reads.
        if !self.repair_mirrors().await {
            s.redis_errors.fetch_add(1, Ordering::Relaxed);
            s.fallbacks.fetch_add(1, Ordering::Relaxed);
            permit.failure();
            return None;
        }
        match call.await {
            Ok(value) => {
                permit.success();
                Some(value)
            }
            Err(Error::Unavailable(error)) => {
                s.redis_errors.fetch_add(1, Ordering::Relaxed);
                s.fallbacks.fetch_add(1, Ordering::Relaxed);
                permit.failure();
                tracing::debug!(%error, "Redis call failed; Postgres serves alone");
                None
            }
            // Redis answered (so it is up) but with something unusable: ignore the answer.
            Err(error) => {
                permit.success();
                s.redis_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "unusable answer from Redis; asking Postgres");
                None
            }
        }
    }
}

/// The most stale mirrors remembered; past it the oldest are dropped and expire by TTL.
const MAX_REPAIRS: usize = 100_000;

impl HybridStore {
    /// Waits for the lease mirror of `token` written after `begin` answered, if it is still
    /// on its way (bounded: its Redis calls, repairs before it included, are).
    async fn mirror_landed(&self, token: &LeaseToken) {
        let pending = self.mirrors().remove(token);
        if let Some(mirroring) = pending {
            let _ = tokio::time::timeout(self.redis.call_budget() * 4, mirroring).await;
        }
    }

    fn mirrors(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<LeaseToken, tokio::task::JoinHandle<()>>>
    {
        self.inner
            .mirrors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers that the mirror of a lease may be stale (see [`Shared::repairs`]).
    fn needs_repair(&self, id: &RecordId, token: LeaseToken) {
        let mut repairs = self
            .inner
            .repairs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if repairs.len() >= MAX_REPAIRS {
            repairs.pop_front();
        }
        repairs.push_back((*id, token));
    }

    /// Deletes mirrors whose lease ended while Redis was unreachable. A mirror write that
    /// timed out may still have run late, when Redis resumed; this runs after it on the same
    /// connection, and is fenced on the token, so it never touches a newer record.
    /// Returns false when Redis failed during the repair. Callers that find repairs pending
    /// wait for the one running them, so no read overtakes the deletes.
    async fn repair_mirrors(&self) -> bool {
        let s = &self.inner;
        let pending_now = || {
            !s.repairs
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_empty()
        };
        if !pending_now() {
            return true;
        }
        let _repairing = s.repairing.lock().await;
        // Whatever this call does not finish (it failed, or it was dropped mid-way) goes back
        // in the queue when `pending` drops.
        let mut pending = Requeue {
            shared: s,
            items: s
                .repairs
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .drain(..)
                .collect(),
        };
        if pending.items.is_empty() {
            return true;
        }
        // Concurrent: the deletes pipeline on the multiplexed connection.
        let results = futures::future::join_all(
            pending
                .items
                .iter()
                .map(|(id, token)| self.redis.release(id, *token)),
        )
        .await;
        let failed: Vec<_> = pending
            .items
            .drain(..)
            .zip(results)
            .filter(|(_, r)| matches!(r, Err(Error::Unavailable(_))))
            .map(|(repair, _)| repair)
            .collect();
        pending.items = failed;
        pending.items.is_empty()
    }

    /// Remembers the mirror of this lease as possibly stale unless the Redis step that
    /// fixes it finishes: failed, skipped or dropped mid-way, it is repaired later.
    fn repair_unless_done(&self, id: &RecordId, token: LeaseToken) -> RepairOnDrop<'_> {
        RepairOnDrop {
            store: self,
            record: Some((*id, token)),
        }
    }
}

/// Repairs taken out of the queue; those still here when it drops go back.
struct Requeue<'a> {
    shared: &'a Shared,
    items: Vec<(RecordId, LeaseToken)>,
}

impl Drop for Requeue<'_> {
    fn drop(&mut self) {
        if !self.items.is_empty() {
            self.shared
                .repairs
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(self.items.drain(..));
        }
    }
}

/// See [`HybridStore::repair_unless_done`].
struct RepairOnDrop<'a> {
    store: &'a HybridStore,
    record: Option<(RecordId, LeaseToken)>,
}

impl RepairOnDrop<'_> {
    fn done(mut self) {
        self.record = None;
    }
}

impl Drop for RepairOnDrop<'_> {
    fn drop(&mut self) {
        if let Some((id, token)) = self.record.take() {
            self.store.needs_repair(&id, token);
        }
    }
}

impl HybridStore {
    /// `begin`'s steps, run to their end by [`detached_claim`].
    async fn claim(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        // 1. Redis holds only what Postgres decided, so whatever it finds is the answer.
        match self.try_redis(self.redis.peek(id, fp)).await {
            Some(Peek::Found(answer)) => {
                self.inner.redis_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(answer);
            }
            Some(Peek::Absent) => {
                self.inner.redis_misses.fetch_add(1, Ordering::Relaxed);
            }
            None => {}
        }
        // 2. Postgres decides. An absent Redis entry (evicted, flushed, restarted) only cost
        //    this round trip: the unique key still refuses a second execution.
        //    (This runs in `begin`'s task already: the claim needs no second one.)
        let (answer, ttl) = self.pg.claim_with_ttl(id, fp, lease).await?;
        // 3. Teach Redis what Postgres said, so the next duplicate stops at step 1.
        match (&answer, ttl) {
            (Begin::Execute(token), _) if !self.mirror_ttl.is_zero() => {
                // After answering: the operation need not wait for its lease's mirror. A
                // `release` of this token waits for it (so its fenced delete runs after the
                // mirror, not before), a `complete` need not (the outcome replaces it, and a
                // mirror that comes later finds the outcome and writes nothing).
                let (this, id, fp, token) = (self.clone(), *id, *fp, *token);
                let mirror = lease.min(self.mirror_ttl);
                // Spawned under the map's lock: the task removes its entry only after it
                // was put there.
                let mut mirrors = self.mirrors();
                let mirroring = tokio::spawn(async move {
                    this.try_redis(this.redis.cache_in_flight(&id, &fp, token, mirror))
                        .await;
                    this.mirrors().remove(&token);
                });
                mirrors.insert(token, mirroring);
            }
            (Begin::Replay(outcome), Some(ttl)) => {
                self.try_redis(self.redis.cache_completed(id, fp, outcome, ttl))
                    .await;
            }
            _ => {}
        }
        Ok(answer)
    }
}

#[async_trait]
impl Store for HybridStore {
    /// Cancel-safe: the steps (in `claim`) run in a task of their own, and a lease granted
    /// after the caller went away is released (see [`detached_claim`]).
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        let (this, releaser, id, fp) = (self.clone(), self.clone(), *id, *fp);
        let claim = async move { this.claim(&id, &fp, lease).await };
        let release = move |token| -> futures::future::BoxFuture<'static, ()> {
            Box::pin(async move { idempotency_core::release_orphan(&releaser, &id, token).await })
        };
        // The caller waits as long as a Postgres-only `begin` would, plus one Redis call.
        let budget = self.pg.call_timeout() + self.redis.call_budget();
        match tokio::time::timeout(budget, detached_claim(claim, release)).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::unavailable(format!(
                "the claim did not settle within {budget:?}"
            ))),
        }
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        // Postgres first: once it has the outcome, a lost Redis write costs one Postgres
        // read later. The Redis copy expires no later than the row: the row's retention
        // started when Postgres ran the statement, which was before `sent` returned.
        let sent = Instant::now();
        let fp = self
            .pg
            .complete_with_fingerprint(id, token, outcome, retention)
            .await?;
        let Some(fp) = fp else {
            // This token had completed it before (the first call's answer was lost, or the
            // application used `complete_in`): `outcome` here was not stored, so it is not
            // cached; the lease's mirror, if any, is dropped so duplicates ask Postgres.
            self.needs_repair(id, token);
            return Ok(());
        };
        let ttl = retention.saturating_sub(sent.elapsed());
        if self.mirror_ttl.is_zero() {
            if ttl.is_zero() {
                return Ok(());
            }
            // No lease mirror to replace: until the outcome lands in Redis a retry finds
            // nothing there and asks Postgres, which replays. So the answer need not wait.
            let (this, id, outcome) = (self.clone(), *id, outcome.clone());
            tokio::spawn(async move {
                this.try_redis(this.redis.cache_completed(&id, &fp, &outcome, ttl))
                    .await;
            });
            return Ok(());
        }
        // The lease's mirror answers "in flight" until the outcome replaces it: wait for that,
        // after the mirror itself if it is still on its way (or it could land after a failed
        // write's repair).
        let repair = self.repair_unless_done(id, token);
        self.mirror_landed(&token).await;
        if !ttl.is_zero()
            && self
                .try_redis(self.redis.cache_completed(id, &fp, outcome, ttl))
                .await
                .is_some()
        {
            repair.done();
        }
        Ok(())
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        self.pg.release(id, token).await?;
        if self.mirror_ttl.is_zero() {
            return Ok(()); // no mirror to drop
        }
        // The lease's mirror may still be on its way: the delete goes after it.
        let repair = self.repair_unless_done(id, token);
        self.mirror_landed(&token).await;
        // Drop the mirrored lease (fenced on the same token); if this fails, duplicates see
        // "in flight" until the repair runs or the mirror's TTL ends, and never execute twice.
        let dropped = self
            .try_redis(async {
                match self.redis.release(id, token).await {
                    Err(Error::LeaseLost) => Ok(()),
                    other => other,
                }
            })
            .await;
        if dropped.is_some() {
            repair.done();
        }
        Ok(())
    }

    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        self.pg.renew(id, token, lease).await?;
        if self.mirror_ttl.is_zero() {
            return Ok(());
        }
        self.try_redis(async {
            match self
                .redis
                .renew(id, token, lease.min(self.mirror_ttl))
                .await
            {
                Err(Error::LeaseLost) => Ok(()),
                other => other,
            }
        })
        .await;
        Ok(())
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64> {
        self.pg.purge_expired(batch).await
    }

    fn name(&self) -> &'static str {
        "hybrid"
    }
}
