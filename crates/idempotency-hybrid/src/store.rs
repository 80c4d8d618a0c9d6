//! `HybridStore`: Redis first, Postgres decides, Postgres alone when Redis is down.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use futures::FutureExt;
use idempotency_core::{
    Begin, Error, Fingerprint, ForceReleased, Inspection, LeaseToken, Outcome, RecordId,
    ReleaseScope, Result, Store, detached_begin,
};
use idempotency_postgres::PostgresStore;
use idempotency_redis::{Peek, RedisStore, Replaced};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    breaker::{Breaker, BreakerConfig, BreakerState},
    flagged::{Flagged, Guard},
    home::Home,
};

/// A [`Store`] that answers from Redis when it can and decides in Postgres always.
///
/// The algorithm (each step's reason in the comments of [`HybridStore::begin`]):
///
/// 1. `begin` peeks in Redis. A cached outcome replays, a mirrored live lease answers
///    `InFlight`, a different fingerprint than a cached outcome's answers `Mismatch` — no
///    Postgres round trip. (A mirror that may be stale never answers `Mismatch`: another
///    request under a mirrored key asks Postgres.)
/// 2. Anything else (absent, evicted, flushed, Redis down) goes to Postgres, whose unique key
///    decides. **Redis is never the reason an operation runs.**
/// 3. What Postgres said is mirrored into Redis, best effort: a granted lease, a replayed
///    outcome (with the TTL Postgres has left, so Redis never outlives the row).
/// 4. `complete` / `release` / `renew` go to Postgres first, fenced; then to Redis (a
///    renewal's mirror is extended after it answers: a stalled Redis must not delay the next
///    renewal past the lease).
///
/// Under [`CachePolicy::Adaptive`], steps 1 and 3 (and the outcome's copy in 4) run only
/// while duplicates are common enough for Redis to pay; otherwise the store is Postgres alone.
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

/// When the hybrid store uses Redis for a `begin` and for what it decided
/// ([`HybridStore::with_cache_policy`]).
///
/// Redis pays off for duplicates (a replay or a live duplicate answered without Postgres)
/// and costs on every first request (a `GET` that finds nothing, the lease's mirror, the
/// outcome's copy). Which wins depends on how many requests are retries.
///
/// ```
/// use idempotency_hybrid::CachePolicy;
/// // Use Redis only while at least one `begin` in ten is a duplicate.
/// let policy = CachePolicy::Adaptive { min_duplicate_share: 0.1 };
/// # let _ = policy;
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum CachePolicy {
    /// Every `begin` asks Redis first; every decision is copied there (the default). Replays
    /// of any key completed while Redis was up are answered by Redis, even while Postgres is
    /// down.
    Always,
    /// Redis is read and written only while at least this share (between 0 and 1; 0 or NaN
    /// is `Always`, above 1 is never) of recent `begin`s were duplicates (replays, live
    /// duplicates, mismatches; a moving average over about the last 64, whoever answered
    /// them). Below it, first requests cost exactly what they cost on
    /// Postgres alone; a surge of retries turns Redis back on within a few of them, and each
    /// key's first replay then teaches Redis its outcome. The cost: a key completed while
    /// Redis was off is answered by Postgres until its first replay, so it has no copy in
    /// Redis to survive a Postgres outage. (A key copied while Redis was on does: a claim
    /// Postgres cannot answer, made without asking Redis, asks it then, within the claim's
    /// budget — a Postgres that hangs spends it — unless the share is above 1.)
    Adaptive {
        /// Between 0 (always use Redis) and 1.
        min_duplicate_share: f64,
    },
}

#[derive(Debug)]
struct Shared {
    breaker: Breaker,
    /// Mirrors that may be stale: their record was completed or released in Postgres while
    /// Redis could not be told. Fenced deletes run at the next successful Redis call.
    /// Published: nothing queued or taken. A Redis call then skips the repair step, its lock
    /// and its timer.
    repairs: Flagged<Repairs>,
    repairing: tokio::sync::Mutex<()>,
    /// What this process writes to Redis after answering — a lease's mirror (after
    /// `begin`), an outcome's copy (after `complete`, or after a replay Postgres answered,
    /// under a token of its own) — by token, with the record, until it lands.
    mirrors: std::sync::Mutex<Mirrors>,
    redis_hits: AtomicU64,
    redis_misses: AtomicU64,
    redis_errors: AtomicU64,
    fallbacks: AtomicU64,
    /// `begin`s that did not ask Redis: duplicates were rare ([`CachePolicy::Adaptive`]).
    redis_skipped: AtomicU64,
    duplicates: DuplicateShare,
    /// The policy, for every clone: the least share of duplicates, in units of 1/65536, at
    /// which Redis is used; 0 is [`CachePolicy::Always`].
    min_duplicates: AtomicU32,
    /// Under `Adaptive`, the leases whose mirror may be in Redis, until when (see
    /// [`HybridStore::may_be_mirrored`]).
    mirrored: std::sync::Mutex<Mirrored>,
    /// Claims and writes left running in the background: see [`Store::drain`].
    settling: tokio_util::task::TaskTracker,
    /// Where the work a call leaves running runs (see [`HybridStore::spawn`]).
    home: Home,
    /// This process's operators' releases: a completion's copy finding its lease's mirror
    /// gone is written only if none of its record was under way at its Postgres write or
    /// began since.
    releases: Releases,
}

/// Operators' releases in this process, by the first byte of their record's id (uniform:
/// a SHA-256): for each of the 256 stripes, how many began, and how many are under way.
/// A release holds off the mirrors and copies of its stripe's records only — 1/256 of the
/// keys, its own among them — not of every key for the ~11 s its second delete waits. A
/// count per stripe, not per record, still tells a release that began and ended since (a
/// set of the records under way would not) and never grows.
#[derive(Debug)]
struct Releases {
    stripes: Box<[Stripe; 256]>,
}

impl Default for Releases {
    fn default() -> Self {
        Self {
            stripes: Box::new(std::array::from_fn(|_| Stripe::default())),
        }
    }
}

#[derive(Debug, Default)]
struct Stripe {
    begun: AtomicU64,
    under_way: AtomicU64,
}

/// What [`Releases::seen`] saw of a record's stripe: releases begun, and whether one was
/// under way.
#[derive(Debug, Clone, Copy)]
struct ReleasesSeen {
    stripe: u8,
    begun: u64,
    under_way: bool,
}

impl Releases {
    fn stripe(&self, stripe: u8) -> &Stripe {
        &self.stripes[usize::from(stripe)]
    }

    /// A release of `id` begins; it is under way until the guard drops.
    fn begin(shared: &Arc<Shared>, id: &RecordId) -> Releasing {
        let stripe = id.as_bytes()[0];
        let releases = shared.releases.stripe(stripe);
        releases.under_way.fetch_add(1, Ordering::SeqCst);
        releases.begun.fetch_add(1, Ordering::SeqCst);
        Releasing(shared.clone(), stripe)
    }

    fn seen(&self, id: &RecordId) -> ReleasesSeen {
        let stripe = id.as_bytes()[0];
        let releases = self.stripe(stripe);
        // `begun` first (`begin` counts in the other order): a release that begins between
        // the two reads is seen under way.
        let begun = releases.begun.load(Ordering::SeqCst);
        ReleasesSeen {
            stripe,
            under_way: releases.under_way.load(Ordering::SeqCst) > 0,
            begun,
        }
    }

    /// Whether no release of the record's stripe was under way when `seen`, nor began since.
    fn none_since(&self, seen: ReleasesSeen) -> bool {
        !seen.under_way && self.stripe(seen.stripe).begun.load(Ordering::SeqCst) == seen.begun
    }
}

/// When Postgres was asked for what a copy copies, and the operators' releases seen just
/// before (see [`HybridStore::copy_after_answering`]).
#[derive(Debug, Clone, Copy)]
struct Asked {
    at: Instant,
    releases: ReleasesSeen,
}

/// A release under way (of a record of the stripe), until dropped.
struct Releasing(Arc<Shared>, u8);

impl Drop for Releasing {
    fn drop(&mut self) {
        let stripe = self.0.releases.stripe(self.1);
        stripe.under_way.fetch_sub(1, Ordering::SeqCst);
    }
}

/// See [`Shared::mirrors`]: by token and kind, so that a lease's mirror and its outcome's
/// copy never replace each other.
type Mirrors = std::collections::HashMap<(LeaseToken, Written), Pending>;

/// What a write made after answering puts in Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Written {
    /// A live lease's mirror, after `begin`.
    Mirror,
    /// A completed outcome's copy, after `complete` or a replay Postgres answered.
    Copy,
}

/// A write made after answering, until it lands: its record, a way to cancel it, and its end,
/// which any number of callers wait for (the lease's owner and an operator's release both
/// do; neither takes it from the other).
#[derive(Clone)]
struct Pending {
    record: RecordId,
    abort: tokio::task::AbortHandle,
    landed: futures::future::Shared<futures::future::BoxFuture<'static, ()>>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("record", &self.record)
            .finish_non_exhaustive()
    }
}

/// Leases mirrored under [`CachePolicy::Adaptive`], each with the instant past which its
/// mirror is surely gone from Redis (its TTL, plus the time a late write may take to land).
/// Entries go at the lease's `complete` or `release`, or once past that instant: pruned when
/// the map has doubled since the last pruning, so it holds about two mirror TTLs of leases.
#[derive(Debug, Default)]
struct Mirrored {
    until: std::collections::HashMap<LeaseToken, Instant>,
    prune_at: usize,
}

impl Mirrored {
    fn insert(&mut self, token: LeaseToken, until: Instant) {
        if self.until.len() >= self.prune_at {
            let now = Instant::now();
            self.until.retain(|_, until| *until > now);
            self.prune_at = self.until.len() * 2 + 1024;
        }
        self.until.insert(token, until);
    }
}

/// The share of recent `begin`s that were duplicates: an exponential moving average with
/// weight 1/64, in units of 1/65536. Updates race without a lock; a lost one only shifts the
/// average by a step, which the policy tolerates.
#[derive(Debug)]
struct DuplicateShare(AtomicU32);

impl DuplicateShare {
    const ONE: u32 = 1 << 16;

    /// Starts at "every `begin` a duplicate": Redis is in use until measured otherwise.
    fn new() -> Self {
        Self(AtomicU32::new(Self::ONE))
    }

    fn observe(&self, duplicate: bool) {
        let old = u64::from(self.0.load(Ordering::Relaxed));
        // A duplicate weighs a hair over one, so that a run of them reaches one exactly:
        // rounded down, the average stopped up to 63 steps short of it, and
        // `Adaptive { min_duplicate_share: 1.0 }` never used Redis again after one first
        // request. A run of first requests still reaches zero.
        let sample = if duplicate {
            u64::from(Self::ONE) + 63
        } else {
            0
        };
        let new = ((old * 63 + sample) / 64).min(u64::from(Self::ONE));
        // Written only when it moves: at a steady share the cache line stays shared by the
        // cores instead of bouncing between them on every `begin`.
        if new != old {
            self.0
                .store(u32::try_from(new).unwrap_or(Self::ONE), Ordering::Relaxed);
        }
    }

    fn at_least(&self, share: u32) -> bool {
        self.0.load(Ordering::Relaxed) >= share
    }
}

/// A snapshot of the hybrid store's counters, for metrics and health checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HybridMetrics {
    /// `begin`s answered by Redis alone.
    pub redis_hits: u64,
    /// `begin`s Redis could not answer (absent record), sent to Postgres.
    pub redis_misses: u64,
    /// Redis calls that failed or timed out.
    pub redis_errors: u64,
    /// Redis calls skipped or failed, so that Postgres served alone.
    pub fallbacks: u64,
    /// `begin`s that did not ask Redis because duplicates were rare
    /// ([`CachePolicy::Adaptive`]).
    pub redis_skipped: u64,
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
    /// is down (a single Redis: a Redis Cluster's client connects to its nodes at once, and
    /// fails while they are all down).
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
        let call_budget = redis.call_budget();
        Self {
            pg,
            redis,
            mirror_ttl: Duration::from_secs(2),
            inner: Arc::new(Shared {
                // A probe unanswered for four call budgets (its repairs' and its own, twice
                // over) is held without being polled: the next call probes instead. A call
                // given up after a fifth of a budget unanswered is a failure: callers that
                // give up sooner than the budget (hang-ups, outer timeouts) must still open
                // the breaker on a Redis that hangs.
                breaker: Breaker::new(breaker, call_budget * 4, call_budget / 5),
                repairs: Flagged::new(Repairs::default(), Repairs::is_empty),
                repairing: tokio::sync::Mutex::new(()),
                mirrors: std::sync::Mutex::default(),
                redis_hits: AtomicU64::new(0),
                redis_misses: AtomicU64::new(0),
                redis_errors: AtomicU64::new(0),
                fallbacks: AtomicU64::new(0),
                redis_skipped: AtomicU64::new(0),
                duplicates: DuplicateShare::new(),
                min_duplicates: AtomicU32::new(0),
                mirrored: std::sync::Mutex::default(),
                settling: tokio_util::task::TaskTracker::new(),
                home: Home::here(),
                releases: Releases::default(),
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

    /// When Redis is used at all (default [`CachePolicy::Always`]). Whatever the policy,
    /// Postgres decides every execution: the policy moves only latency and load. It is the
    /// store's: clones share it (set it before serving).
    ///
    /// ```no_run
    /// use idempotency_hybrid::{CachePolicy, HybridStore};
    /// # async fn run(store: HybridStore) {
    /// // A payments API where retries are rare: first requests at Postgres-only cost, and
    /// // Redis takes over when a retry storm comes.
    /// let store = store.with_cache_policy(CachePolicy::Adaptive { min_duplicate_share: 0.1 });
    /// # let _ = store;
    /// # }
    /// ```
    pub fn with_cache_policy(self, policy: CachePolicy) -> Self {
        let min = match policy {
            CachePolicy::Always => 0,
            // `as` saturates: NaN is 0 (always), above 1 beyond any share (never).
            CachePolicy::Adaptive {
                min_duplicate_share,
            } => (min_duplicate_share * f64::from(DuplicateShare::ONE)).ceil() as u32,
        };
        self.inner.min_duplicates.store(min, Ordering::Relaxed);
        self
    }

    /// Whether the policy is `Always` (or `Adaptive` at share 0, the same thing).
    fn always(&self) -> bool {
        self.inner.min_duplicates.load(Ordering::Relaxed) == 0
    }

    /// Whether the policy never uses Redis (`Adaptive` above a share of 1).
    fn never_caches(&self) -> bool {
        self.inner.min_duplicates.load(Ordering::Relaxed) > DuplicateShare::ONE
    }

    /// Whether Redis is read and written now, by the policy.
    fn caching(&self) -> bool {
        let min = self.inner.min_duplicates.load(Ordering::Relaxed);
        min == 0 || self.inner.duplicates.at_least(min)
    }

    /// Whether Redis may hold a mirror of this lease, which `complete`, `release` and
    /// `renew` must then replace, delete or extend. Under [`CachePolicy::Always`] every lease
    /// is mirrored (when mirrors are on); under `Adaptive` only those granted while caching,
    /// until their mirror's TTL is surely over.
    fn may_be_mirrored(&self, token: &LeaseToken) -> bool {
        !self.mirror_ttl.is_zero()
            && (self.always()
                || self
                    .mirrored()
                    .until
                    .get(token)
                    .is_some_and(|until| *until > Instant::now()))
    }

    /// Notes (under `Adaptive`) that a mirror of this lease, living `ttl` from now, may be
    /// in Redis; a write of it may land up to four call budgets late.
    fn note_mirror(&self, token: LeaseToken, ttl: Duration) {
        if !self.always() {
            let until = Instant::now() + ttl + self.redis.call_budget() * 4;
            self.mirrored().insert(token, until);
        }
    }

    /// The lease is over (completed or released): no mirror of it to follow any more.
    fn forget_mirror(&self, token: &LeaseToken) {
        if !self.always() {
            self.mirrored().until.remove(token);
        }
    }

    fn mirrored(&self) -> std::sync::MutexGuard<'_, Mirrored> {
        self.inner
            .mirrored
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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

    /// Describes the hybrid store's metrics (help texts) to the installed `metrics`
    /// recorder. The store counts through the facade — `idempotency_redis_hits_total`,
    /// `idempotency_redis_misses_total`, `idempotency_redis_errors_total`,
    /// `idempotency_redis_fallbacks_total`, `idempotency_redis_skipped_total`,
    /// `idempotency_breaker_opened_total`,
    /// `idempotency_breaker_closed_total` and the gauge `idempotency_breaker_state{state}` —
    /// and here, for [`HybridStore::metrics`].
    pub fn describe_metrics() {
        metrics::describe_counter!(
            "idempotency_redis_hits_total",
            "begin calls answered by Redis alone."
        );
        metrics::describe_counter!(
            "idempotency_redis_misses_total",
            "begin calls Redis could not answer."
        );
        metrics::describe_counter!(
            "idempotency_redis_errors_total",
            "Redis calls that failed or timed out."
        );
        metrics::describe_counter!(
            "idempotency_redis_skipped_total",
            "begin calls that did not ask Redis: duplicates were rare (CachePolicy::Adaptive)."
        );
        metrics::describe_counter!(
            "idempotency_redis_fallbacks_total",
            "Calls served by Postgres alone."
        );
        crate::breaker::Breaker::describe();
    }

    /// The counters and the breaker state.
    pub fn metrics(&self) -> HybridMetrics {
        let s = &self.inner;
        HybridMetrics {
            redis_hits: s.redis_hits.load(Ordering::Relaxed),
            redis_misses: s.redis_misses.load(Ordering::Relaxed),
            redis_errors: s.redis_errors.load(Ordering::Relaxed),
            fallbacks: s.fallbacks.load(Ordering::Relaxed),
            redis_skipped: s.redis_skipped.load(Ordering::Relaxed),
            breaker_opened: s.breaker.opened.load(Ordering::Relaxed),
            breaker_closed: s.breaker.closed.load(Ordering::Relaxed),
            breaker_state: s.breaker.state(),
        }
    }

    /// Deletes whatever Redis holds for `id` (an operator's release): queued as a repair
    /// (once: a try that failed puts its deletes back), run by the repair step every Redis
    /// call takes first. `Some` once Redis took it and every repair queued before it.
    async fn forget_in_redis(&self, id: &RecordId) -> Option<()> {
        {
            let mut repairs = self.inner.repairs();
            if !repairs.queue.contains(&(*id, None)) {
                repairs.push((*id, None));
            }
        }
        self.try_redis(|| async { Ok(()) }).await
    }

    /// Runs a Redis call through the breaker. `None` means "Redis had nothing to say": it is
    /// skipped (breaker open), failed or timed out. Never an error: Redis is an optimisation.
    ///
    /// Pending repairs run first, within one call budget: a call never queues behind other
    /// calls' repairs longer than that (under load with Redis hung, the queue would outgrow
    /// every caller's budget). What the breaker hears is what Redis did: a caller that only
    /// waited for another's repairs reports nothing, and one whose deletes were answered
    /// reports success even when the backlog outlasted its budget, so a long backlog left by
    /// an outage drains, across calls, on a healthy Redis instead of keeping it off.
    ///
    /// Cancel-safe: the breaker permit reports nothing when dropped, and repairs taken for
    /// this call go back in the queue. The call that would probe a half-open breaker goes on
    /// without Redis, and a write of its own probes it (`RedisStore::probe_write`).
    ///
    /// `call` makes the Redis call's future once the repairs are done: held across them as a
    /// future, it would be stored twice in this one (an `async fn`'s argument stays beside
    /// what it awaits).
    async fn try_redis<T, F>(&self, call: impl FnOnce() -> F) -> Option<T>
    where
        F: Future<Output = Result<T>>,
    {
        let s = &self.inner;
        let Some(mut permit) = s.breaker.allow() else {
            s.fallback();
            return None;
        };
        if permit.is_probe() {
            // Probed in a task of its own, with a whole budget, while this call goes on
            // without Redis: probed in this call's future, a caller that gave up sooner (a
            // client's hang-up, an outer timeout shorter than the budget) answered nothing,
            // the next call probed again at once, and every call waited on a Redis that was
            // gone until its caller gave up.
            let (this, probe) = (self.clone(), permit.detach());
            self.spawn(async move {
                // A write, then the stale-mirror repairs a probing call runs first (an
                // operator's second delete among them), which would otherwise wait for a
                // call after the breaker closed.
                let mut ok = this.redis.probe_write().await.is_ok();
                if ok && !this.inner.repairs.holds() {
                    let deadline = tokio::time::Instant::now() + this.redis.call_budget();
                    let (repaired, progress) = this.repairs_by(deadline, |_| {}).await;
                    // Read as a call's repairs are (`try_redis` below).
                    ok = match repaired {
                        Some(true) => true,
                        None if progress.answered > 0 => true,
                        // Waited for another caller's repairs, or took them over too late
                        // for Redis to answer in time: no news of Redis, no answer (the next
                        // probe goes out past the probe limit).
                        None if !progress.held
                            || progress.unanswered.is_none_or(|since| {
                                since.elapsed() < this.inner.breaker.slow()
                            }) =>
                        {
                            return;
                        }
                        Some(false) | None => false,
                    };
                }
                if !ok {
                    this.inner.redis_errors.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("idempotency_redis_errors_total").increment(1);
                }
                probe.answered(&this.inner.breaker, ok);
            });
            s.fallback();
            return None;
        }
        // Nothing to repair (the usual case): no lock, no task, no timer.
        let (repaired, progress) = if s.repairs.holds() {
            (Some(true), RepairProgress::default())
        } else {
            // Its deletes are this call's Redis calls once they go out: given up while Redis
            // leaves them unanswered, that counts against the breaker (waiting for the
            // repairs' lock does not).
            let deadline = tokio::time::Instant::now() + self.redis.call_budget();
            self.repairs_by(deadline, |since| permit.calling_since(since))
                .await
        };
        match repaired {
            Some(true) => {}
            None if progress.answered > 0 => {
                permit.success();
                s.fallback();
                return None;
            }
            None if !progress.held => {
                permit.no_news(); // waited for another caller's repairs: no news of Redis
                s.fallback();
                return None;
            }
            // Its deletes unanswered when the budget ran out: a failure only if Redis has said
            // nothing of them for the breaker's slow time, as for a caller that gave up. A
            // caller handed the lock as its budget ran out (callers that arrived together,
            // queued behind one draining a backlog) sent its deletes a moment ago: counted as
            // failures, they opened the breaker on a healthy Redis, again after each probe,
            // until the backlog was gone.
            None if !permit.unanswered_past_slow() => {
                permit.no_news();
                s.fallback();
                return None;
            }
            Some(false) | None => {
                s.redis_failed(permit, "repairing stale mirrors failed or timed out");
                return None;
            }
        }
        // The call has a budget of its own (the store's).
        permit.calling();
        match call().await {
            Ok(value) => {
                permit.success();
                Some(value)
            }
            Err(Error::Unavailable(error)) => {
                s.redis_failed(permit, &error.to_string());
                None
            }
            // Redis answered (so it is up) but with something unusable: ignore the answer.
            Err(error) => {
                permit.success();
                s.redis_errors.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("idempotency_redis_errors_total").increment(1);
                tracing::warn!(%error, "unusable answer from Redis; asking Postgres");
                None
            }
        }
    }
}

impl Shared {
    fn repairs(&self) -> Guard<'_, Repairs> {
        self.repairs.lock()
    }

    fn fallback(&self) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("idempotency_redis_fallbacks_total").increment(1);
    }

    fn redis_failed(&self, permit: crate::breaker::Permit<'_>, error: &str) {
        self.redis_errors.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("idempotency_redis_errors_total").increment(1);
        self.fallback();
        permit.failure();
        tracing::debug!(%error, "Redis call failed; Postgres serves alone");
    }
}

/// A Redis copy that may be stale: the lease mirror of this token, or (`None`, after an
/// operator's `force_release`) whatever Redis holds for the record.
type Repair = (RecordId, Option<LeaseToken>);

/// Stale mirrors to delete (see [`Shared::repairs`]).
#[derive(Debug, Default)]
struct Repairs {
    queue: std::collections::VecDeque<Repair>,
    /// Taken by the caller running them and not answered yet: reads wait for these too.
    taken: usize,
    /// When the deletes now unanswered first went out, by whichever caller: a holder of the
    /// lock given up before they were answered leaves them to the next, whose wait for
    /// Redis began then, not when it got the lock (see `repair_mirrors`).
    unanswered_since: Option<tokio::time::Instant>,
}

impl Repairs {
    /// Nothing queued, nothing taken and unanswered.
    fn is_empty(&self) -> bool {
        self.queue.is_empty() && self.taken == 0
    }

    fn push(&mut self, repair: Repair) {
        if self.queue.len() >= MAX_REPAIRS {
            // The oldest mirror repair goes (a mirror expires by its TTL); an operator's
            // forget stays: the cached outcome it deletes would replay for its retention.
            match self.queue.iter().position(|(_, token)| token.is_some()) {
                Some(oldest) => {
                    self.queue.remove(oldest);
                }
                None => {
                    self.queue.pop_front();
                }
            }
        }
        self.queue.push_back(repair);
    }
}

/// What a call's repair step got done before its budget ran out.
#[derive(Debug, Default, Clone)]
struct RepairProgress {
    /// It ran repairs (rather than only waiting for another caller's).
    held: bool,
    /// Deletes Redis answered.
    answered: usize,
    /// Since when Redis has left the deletes it holds unanswered (see `repair_mirrors`).
    unanswered: Option<tokio::time::Instant>,
}

/// The most stale mirrors remembered; past it the oldest are dropped and expire by TTL.
const MAX_REPAIRS: usize = 100_000;

/// How long an operator's second delete of a record's Redis copy is tried (see
/// `force_release`): as long as the layer tries a write to a store that is down.
const SECOND_DELETE_TRIED_FOR: Duration = Duration::from_secs(3600);

/// Stale-mirror deletes sent together (pipelined), and forgotten together once done.
const REPAIR_CHUNK: usize = 256;

impl HybridStore {
    /// Notes the releases of `id`'s stripe under way or begun, then the time: to be called
    /// right before Postgres is asked for what a copy will copy.
    fn asking(&self, id: &RecordId) -> Asked {
        let releases = self.inner.releases.seen(id);
        Asked {
            at: Instant::now(),
            releases,
        }
    }

    /// Waits for the lease mirror of `token` written after `begin` answered, if it is still
    /// on its way: at most the budgets of its repairs and its call, with margin.
    ///
    /// A mirror not done by then — or when this wait is dropped — is cancelled: the caller
    /// goes on to replace or delete it, and a mirror written after that would answer "in
    /// flight" for a key whose lease is over. If its `SET` was already sent, the caller's
    /// later commands follow it on the same connection.
    async fn mirror_landed(&self, token: &LeaseToken) {
        self.landed((*token, Written::Mirror)).await;
    }

    /// Waits for one write made after answering, as [`mirror_landed`](Self::mirror_landed)
    /// describes, then forgets it.
    async fn landed(&self, write: (LeaseToken, Written)) {
        let Some(pending) = self.mirrors().get(&write).cloned() else {
            return;
        };
        // Dropped here, or done: the write is cancelled (if still running) and forgotten. A
        // cancelled task does not remove its own entry, and nothing else would.
        let _forget = Forget {
            store: self,
            write,
            abort: pending.abort.clone(),
        };
        let wait = self.redis.call_budget() * 4;
        if tokio::time::timeout(wait, pending.landed.clone())
            .await
            .is_err()
        {
            // An abort takes effect between polls: wait out the poll under way, so a SET
            // it sent is queued before whatever the caller sends next.
            pending.abort.abort();
            pending.landed.await;
        }
    }

    /// Spawns `task`, which a call leaves running (a write after answering, the repairs, a
    /// probe, an operator's second delete), on a runtime that runs it whoever calls, tracked
    /// for [`drain`](Store::drain): the multi-thread runtime the store was made on while it
    /// runs, else a background one ([`Home`]). Spawned on the caller's runtime, it ran only
    /// while that runtime was driven: a second, current-thread runtime left idle once its
    /// `block_on` returned (a sync worker's, between jobs) kept a lease's mirror there
    /// unrun, and the `complete` that waits for it (and, past its budget, for its
    /// cancellation) waited for good; repairs there kept their lock from every other call,
    /// and an operator's release kept outcomes from being copied to Redis.
    fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.inner.home.spawn(&self.inner.settling, task)
    }

    /// Spawns `write`, made after answering, noted under `token` and `kind` with its record
    /// until it lands (see [`Shared::mirrors`]).
    fn write_after_answering(
        &self,
        record: RecordId,
        token: LeaseToken,
        kind: Written,
        write: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        use futures::FutureExt as _;
        let this = self.clone();
        // Spawned under the map's lock: the task removes its entry only after it was put
        // there.
        let mut mirrors = self.mirrors();
        let task = self.spawn(async move {
            write.await;
            this.mirrors().remove(&(token, kind));
        });
        let abort = task.abort_handle();
        let landed = async move {
            let _ = task.await;
        }
        .boxed()
        .shared();
        mirrors.insert(
            (token, kind),
            Pending {
                record,
                abort,
                landed,
            },
        );
    }

    /// Copies a completed outcome into Redis after answering ([`write_after_answering`]
    /// under `token`), for a record Postgres was asked about at `asked.at`. Not sent from a task
    /// that started more than a Postgres call budget after that (a starved runtime): an
    /// operator's release of the record and its second delete, which allow for writes on
    /// their way by that much, may be over, and the copy would replay a deleted record; and
    /// it lands by [`copy_deadline`](Self::copy_deadline) or deletes the key.
    ///
    /// Nor when an operator's release in this process of a record of the same stripe (see
    /// [`Releases`]), this one's among them, was under way as Postgres was asked
    /// (`asked.releases`) or began since: Postgres may have read the record just
    /// before the release deleted it, and the release, which waits for the writes on their
    /// way when it deletes in Redis, may have looked before this one was noted. Landing
    /// after its delete, the copy would replay the deleted record until the second delete.
    /// A release that begins after this check waits for the copy (noted before it runs).
    ///
    /// [`write_after_answering`]: Self::write_after_answering
    fn copy_after_answering(
        &self,
        id: RecordId,
        token: LeaseToken,
        fp: Fingerprint,
        outcome: &Outcome,
        expires: Instant,
        asked: Asked,
    ) {
        let (this, outcome) = (self.clone(), outcome.clone());
        self.write_after_answering(id, token, Written::Copy, async move {
            if asked.at.elapsed() <= this.pg.call_timeout()
                && this.inner.releases.none_since(asked.releases)
            {
                let by = this.copy_deadline(asked.at);
                this.try_redis(|| {
                    this.redis
                        .cache_completed_within(&id, &fp, &outcome, expires, by)
                })
                .await;
            }
        });
    }

    /// The latest a copy may land (one made after answering, or the one a `complete` makes
    /// after its write), counted from `from`, the moment Postgres was asked for what it
    /// copies: one Postgres call budget for the answer, one
    /// Redis budget for the repairs run first, four for the copy itself (what a copy sent at
    /// once is allowed anyway). A copy can only harm a release whose delete committed after
    /// `from`, so within one Postgres budget of the release's ask; the release deletes the
    /// key again two Postgres budgets and ten Redis budgets after its ask. A copy landing by
    /// this deadline lands before that, however late its task started or its repairs ran.
    fn copy_deadline(&self, from: Instant) -> Instant {
        from + self.pg.call_timeout() + self.redis.call_budget() * 5
    }

    /// Waits for every write to `id`'s record this process makes after answering (a lease's
    /// mirror, an outcome's copy), as [`mirror_landed`](Self::mirror_landed) does for one.
    ///
    /// Such a write runs the queued repairs first, an operator's delete among them, and
    /// then writes: an operator's release right after a claim or a completion found the
    /// mirror or the copy back in Redis, and retries were told "in flight", `Mismatch`, or
    /// replayed the deleted outcome until the second delete.
    async fn writes_landed(&self, id: &RecordId) {
        let writes: Vec<_> = self
            .mirrors()
            .iter()
            .filter(|(_, pending)| pending.record == *id)
            .map(|(write, _)| *write)
            .collect();
        for write in writes {
            self.landed(write).await;
        }
    }

    fn mirrors(&self) -> std::sync::MutexGuard<'_, Mirrors> {
        self.inner
            .mirrors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers that the mirror of a lease may be stale (see [`Shared::repairs`]).
    fn needs_repair(&self, id: &RecordId, token: LeaseToken) {
        self.inner.repairs().push((*id, Some(token)));
    }

    /// Deletes mirrors whose lease ended while Redis was unreachable. A mirror write that
    /// timed out may still have run late, when Redis resumed; this runs after it on the same
    /// connection, and is fenced on the token, so it never touches a newer record.
    /// Returns false when Redis failed a delete. Callers that find repairs pending (queued,
    /// or taken and not yet answered) wait for the one running them, so no read overtakes
    /// the deletes.
    ///
    /// The repairs queued when this caller got its turn, in pipelined chunks; each delete is
    /// forgotten as soon as Redis answers it, so a backlog drains across calls even when no
    /// single call's budget covers it.
    /// `progress` is told, as each chunk of deletes goes out, since when Redis has left the
    /// deletes it holds unanswered (that chunk's, or those a caller given up on before it
    /// left in the queue), and `None` once a chunk is answered.
    ///
    /// Run by [`repairs_by`](Self::repairs_by), in a task of its own.
    async fn repair_mirrors(
        &self,
        progress: &tokio::sync::watch::Sender<RepairProgress>,
        deadline: tokio::time::Instant,
    ) -> bool {
        let s = &self.inner;
        // `try_redis` skipped the call when the flag said so; this one sees the queue itself.
        if s.repairs().is_empty() {
            return true;
        }
        let _repairing = s.repairing.lock().await;
        if tokio::time::Instant::now() >= deadline {
            // Handed the lock once its budget ran out (queued behind a caller draining a
            // backlog): whatever it sent would go unread, and count against Redis as it went
            // on unanswered while each caller queued behind it took its turn. It holds no
            // repairs, and its timeout ends it.
            return std::future::pending().await;
        }
        progress.send_modify(|p| p.held = true);
        let mut left = s.repairs().queue.len();
        while left > 0 {
            // Whatever this chunk does not finish (failed, or dropped mid-way) goes back in
            // the queue when `pending` drops.
            let (mut pending, since) = {
                let mut repairs = s.repairs();
                let n = left.min(REPAIR_CHUNK).min(repairs.queue.len());
                let items: Vec<_> = repairs.queue.drain(..n).collect();
                repairs.taken += items.len();
                let since = *repairs
                    .unanswered_since
                    .get_or_insert_with(tokio::time::Instant::now);
                let pending = Requeue {
                    shared: s,
                    done: vec![false; items.len()],
                    items,
                };
                (pending, since)
            };
            if pending.items.is_empty() {
                break;
            }
            progress.send_modify(|p| p.unanswered = Some(since));
            left -= pending.items.len();
            // Concurrent: the deletes pipeline on the multiplexed connection.
            let mut deletes: futures::stream::FuturesUnordered<_> = pending
                .items
                .iter()
                .copied()
                .enumerate()
                .map(|(i, (id, token))| async move {
                    let deleted = match token {
                        Some(token) => self.redis.release(&id, token).await,
                        // One round trip, unbounded: a late delete of a copy is a miss.
                        None => self.redis.delete_record(&id).await,
                    };
                    (i, deleted)
                })
                .collect();
            let mut failed = false;
            while let Some((i, result)) = futures::StreamExt::next(&mut deletes).await {
                if matches!(result, Err(Error::Unavailable(_))) {
                    failed = true;
                } else {
                    pending.done[i] = true;
                    // News of Redis: what is still out of this chunk counts from here (a
                    // holder given up mid-chunk leaves the next one this, not the chunk's
                    // start, which on a healthy Redis draining a long chunk is a while ago).
                    let now = tokio::time::Instant::now();
                    s.repairs().unanswered_since = Some(now);
                    progress.send_modify(|p| {
                        p.answered += 1;
                        p.unanswered = Some(now);
                    });
                }
            }
            if failed {
                return false;
            }
            s.repairs().unanswered_since = None;
            progress.send_modify(|p| p.unanswered = None);
        }
        true
    }

    /// Runs the queued repairs ([`repair_mirrors`](Self::repair_mirrors)) until `deadline`,
    /// in a task of its own; `None` when the deadline passed first. `unanswered` hears the
    /// task's news of Redis as it comes (see `repair_mirrors`), so a caller given up
    /// mid-way reports what it waited for.
    ///
    /// Run in the caller's future, a caller polled once and then held without a poll (a
    /// future parked in a `select!` arm, a request on a starved task) kept the repairs'
    /// lock, and every other Redis call waited a whole budget for it and went to Postgres
    /// for as long as that future lived: nothing the breaker heard. The task ends at
    /// `deadline` however its caller is polled, and is aborted when the caller drops this
    /// (what it had taken goes back in the queue), so repairs still run only within their
    /// callers' budgets.
    async fn repairs_by(
        &self,
        deadline: tokio::time::Instant,
        mut unanswered: impl FnMut(Option<tokio::time::Instant>),
    ) -> (Option<bool>, RepairProgress) {
        use futures::future::Either;
        let (progress, mut seen) = tokio::sync::watch::channel(RepairProgress::default());
        let this = self.clone();
        let mut task = tokio_util::task::AbortOnDropHandle::new(self.spawn(async move {
            let repairs = this.repair_mirrors(&progress, deadline);
            tokio::time::timeout_at(deadline, repairs).await.ok()
        }));
        let repaired = {
            let follow = std::pin::pin!(async {
                while seen.changed().await.is_ok() {
                    unanswered(seen.borrow_and_update().unanswered);
                }
                std::future::pending::<std::convert::Infallible>().await
            });
            let ended = futures::future::select(&mut task, follow);
            match tokio::time::timeout_at(deadline, ended).await {
                Ok(Either::Left((Ok(ended), _))) => ended,
                // Its runtime shut down before it ran: nothing sent, no news of Redis.
                Ok(Either::Left((Err(error), _))) if error.is_cancelled() => None,
                // A panic is a failed repair.
                Ok(Either::Left((Err(_), _))) => Some(false),
                Ok(Either::Right((never, _))) => match never {},
                Err(_) => None,
            }
        };
        let progress = seen.borrow().clone();
        unanswered(progress.unanswered);
        (repaired, progress)
    }

    /// Deletes the token's lease mirror now, after a mirror write still on its way (fenced
    /// on the token in Redis: another attempt's mirror and a cached outcome stay). If this
    /// fails or is dropped, duplicates see "in flight" until the repair runs or the mirror's
    /// TTL ends, and never execute twice.
    async fn drop_mirror(&self, id: &RecordId, token: LeaseToken) {
        let repair = self.repair_unless_done(id, token);
        self.mirror_landed(&token).await;
        let dropped = self
            .try_redis(|| async {
                match self.redis.release(id, token).await {
                    Err(Error::LeaseLost) => Ok(()),
                    other => other,
                }
            })
            .await;
        if dropped.is_some() {
            repair.done();
        }
        self.forget_mirror(&token);
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

/// A write made after answering, cancelled and forgotten when this drops (see
/// [`HybridStore::landed`]); a task already done is left as it is.
struct Forget<'a> {
    store: &'a HybridStore,
    write: (LeaseToken, Written),
    abort: tokio::task::AbortHandle,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.abort.abort();
        self.store.mirrors().remove(&self.write);
    }
}

/// Repairs taken out of the queue; those not done when it drops go back.
struct Requeue<'a> {
    shared: &'a Shared,
    items: Vec<Repair>,
    done: Vec<bool>,
}

impl Drop for Requeue<'_> {
    fn drop(&mut self) {
        let mut repairs = self.shared.repairs();
        repairs.taken -= self.items.len();
        for (repair, done) in self.items.drain(..).zip(&self.done) {
            if !done {
                repairs.push(repair);
            }
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
    /// `begin`'s first step. Redis holds only what Postgres decided, so whatever it finds is
    /// the answer; `None`: Postgres decides. Unless duplicates are too rare for the peek to
    /// pay (the policy).
    ///
    /// A read, bounded by the Redis budgets (the repairs' and the call's): dropped at any
    /// await it claimed nothing, so it runs in the caller's future, before the claim's
    /// detached task and its timer (a replay answered here makes neither).
    async fn peek(&self, id: &RecordId, fp: &Fingerprint) -> Option<Begin> {
        if !self.caching() {
            self.inner.redis_skipped.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("idempotency_redis_skipped_total").increment(1);
            return None;
        }
        self.ask_redis(id, fp).await
    }

    /// The peek's Redis read, whatever the policy.
    async fn ask_redis(&self, id: &RecordId, fp: &Fingerprint) -> Option<Begin> {
        match self.try_redis(|| self.redis.peek(id, fp)).await {
            Some(Peek::Found(answer)) => {
                self.inner.redis_hits.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("idempotency_redis_hits_total").increment(1);
                self.inner.duplicates.observe(true);
                Some(answer)
            }
            // Absent, or anything a later Redis store may report: Postgres decides.
            Some(_) => {
                self.inner.redis_misses.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("idempotency_redis_misses_total").increment(1);
                None
            }
            None => None,
        }
    }

    /// `begin`'s claim, after a [`peek`](Self::peek) that did not answer, run to its end by
    /// [`detached_claim`](idempotency_core::detached_claim).
    ///
    /// `caller_gone`: see [`PostgresStore::claim_with_ttl`].
    async fn claim(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        caller_gone: &CancellationToken,
    ) -> Result<Begin> {
        let caching = self.caching();
        // 2. Postgres decides. An absent Redis entry (evicted, flushed, restarted) only cost
        //    this round trip: the unique key still refuses a second execution.
        //    (This runs inside `begin`'s `detached_claim` already: it needs no second one.)
        let asked = self.asking(id);
        let (answer, ttl) = self.pg.claim_with_ttl(id, fp, lease, caller_gone).await?;
        let first = matches!(answer, Begin::Execute(_) | Begin::TakeOver(_));
        self.inner.duplicates.observe(!first);
        // 3. Teach Redis what Postgres said, so the next duplicate stops at step 1.
        match (&answer, ttl) {
            // A lease under a millisecond is zero to Postgres, over at once: mirrored, it
            // would say "in flight" for 1 ms (Redis rounds a TTL up).
            (Begin::Execute(token) | Begin::TakeOver(token), left)
                if caching && !self.mirror_ttl.is_zero() && lease.as_millis() > 0 =>
            {
                // After answering: the operation need not wait for its lease's mirror. A
                // `release` of this token waits for it (so its fenced delete runs after the
                // mirror, not before), and so does a `complete`, whose outcome replaces that
                // mirror (`replace_mirror` is fenced on it).
                let (this, id, fp, token) = (self.clone(), *id, *fp, *token);
                // No longer than what is left of the lease (less than asked after a lock
                // wait), counted from before Postgres was asked: a mirror must not say "in
                // flight" past the row's lease. (A millisecond at least: Redis refuses a TTL
                // of zero.)
                let mirror = left
                    .unwrap_or(lease)
                    .min(lease)
                    .min(self.mirror_ttl)
                    .max(Duration::from_millis(1));
                self.note_mirror(token, mirror);
                self.write_after_answering(id, token, Written::Mirror, async move {
                    // Not after an operator's release in this process of a record of its
                    // stripe began (as for a copy: see `copy_after_answering`): it may have
                    // released this very grant,
                    // and have looked for the writes on their way before this one was
                    // noted; landing after its delete, the mirror would say "in flight"
                    // for a lease that is over. Duplicates then ask Postgres.
                    //
                    // Its TTL counts from when it is sent, not from when Postgres was asked:
                    // less what the task waited to run (a busy runtime) and its repairs took,
                    // or a mirror written late says "in flight" past the row's lease. (A
                    // lease all but over is not mirrored.)
                    let left = || mirror.saturating_sub(asked.at.elapsed());
                    if this.inner.releases.none_since(asked.releases) && !left().is_zero() {
                        let cache = || {
                            let ttl = left().max(Duration::from_millis(1));
                            this.redis.cache_in_flight(&id, &fp, token, ttl)
                        };
                        this.try_redis(cache).await;
                    }
                });
            }
            // Not a replay answered later than one Postgres call budget (a slow server or
            // network): the row it read may have been deleted since by an operator's release,
            // whose second delete allows for a read answered within one budget only. Copied
            // after it, the deleted record would replay from Redis for its whole retention.
            (Begin::Replay(outcome), Some(ttl))
                if self.caching() && asked.at.elapsed() <= self.pg.call_timeout() =>
            {
                // The row's retention, counted from before Postgres read it: never later.
                let expires = until(asked.at, ttl);
                // After answering: the retry has its answer from Postgres, and a slow Redis
                // must not hold it up (awaited here, the copy's budget came on top of a slow
                // Postgres read and could turn the replay into `Unavailable`). Until the copy
                // lands a duplicate asks Postgres again, which replays. Noted with the
                // record under a token of its own, so that an operator's release waits for
                // it (a copy is fenced by its deadline, not by a lease).
                self.copy_after_answering(
                    *id,
                    LeaseToken::generate(),
                    *fp,
                    outcome,
                    expires,
                    asked,
                );
            }
            _ => {}
        }
        Ok(answer)
    }
}

/// `ttl` after `from` (a retention kept for good is a century): from before the row was read
/// or written, never later than the row's expiry.
fn until(from: Instant, ttl: Duration) -> Instant {
    from + ttl.min(idempotency_core::FOR_GOOD)
}

#[async_trait]
impl Store for HybridStore {
    /// Cancel-safe: the Redis peek claims nothing; the claim (Postgres, then Redis is told)
    /// runs to its end even if the caller goes away (in a task of its own then), and a lease
    /// granted after that is released (see [`detached_claim`](idempotency_core::detached_claim)).
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        idempotency_core::observe(self.name(), "begin", async {
            // The caller waits as long as a Postgres-only `begin` would, plus the Redis step
            // (its repairs' budget and its call's).
            let budget = self.pg.call_timeout() + self.redis.call_budget() * 2;
            let deadline = Instant::now() + budget;
            let skipped = !self.caching();
            // A panic is a failed store call, as in the claim's guard: `Unavailable`.
            match AssertUnwindSafe(self.peek(id, fp)).catch_unwind().await {
                Ok(Some(answer)) => return Ok(answer),
                Ok(None) => {}
                Err(_) => return Err(Error::unavailable("the Redis step panicked")),
            }
            // No claim is started that its caller will not wait for.
            if Instant::now() >= deadline {
                return Err(Error::unavailable(format!(
                    "the Redis step took the claim's whole budget ({budget:?})"
                )));
            }
            let (this, id, fp) = (self.clone(), *id, *fp);
            let gone = CancellationToken::new();
            let watched = gone.clone();
            let claim = async move { this.claim(&id, &fp, lease, &watched).await };
            let claim = detached_begin(self.clone(), id, claim)
                .tracked_by(&self.inner.settling)
                .cancels_when_orphaned(gone);
            let answer = match tokio::time::timeout_at(deadline, claim).await {
                Ok(answer) => answer,
                Err(_) => Err(Error::unavailable(format!(
                    "the claim did not settle within {budget:?}"
                ))),
            };
            match answer {
                // Postgres could not answer, and Redis was not asked (duplicates were rare,
                // [`CachePolicy::Adaptive`]): what Redis holds still answers — an outcome
                // copied while duplicates were common, replayed through a Postgres outage
                // as under `Always`, rather than `Unavailable` to every retry of it (whose
                // answers, never observed, would not turn Redis back on either). Redis holds
                // only what Postgres decided.
                // Within the same budget (a Postgres that refused at once leaves it whole; one
                // that hung spent it), and never under a policy that turned Redis off for good.
                Err(Error::Unavailable(error))
                    if skipped && !self.never_caches() && Instant::now() < deadline =>
                {
                    let asked = AssertUnwindSafe(self.ask_redis(&id, &fp)).catch_unwind();
                    match tokio::time::timeout_at(deadline, asked).await {
                        Ok(Ok(Some(answer))) => Ok(answer),
                        Ok(Ok(None) | Err(_)) | Err(_) => Err(Error::Unavailable(error)),
                    }
                }
                answer => answer,
            }
        })
        .await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        idempotency_core::observe(self.name(), "complete", async {
            // Postgres first: once it has the outcome, a lost Redis write costs one Postgres
            // read later. The Redis copy expires no later than the row: the row's retention
            // started when Postgres ran the statement, which was before `sent` returned.
            let asked = self.asking(id);
            let (sent, releases) = (asked.at, asked.releases);
            let fp = self
                .pg
                .complete_with_fingerprint(id, token, outcome, retention)
                .await?;
            let Some(fp) = fp else {
                // This token had completed it before (the first call's answer was lost, or the
                // application used `complete_in`, as `Executor::run_with_claim` does):
                // `outcome` here was not stored, so it is not cached; the lease's mirror, if
                // any, is dropped now, so duplicates ask Postgres (left to the repair queue,
                // it answered "in flight" until its TTL or this process's next Redis call).
                // Under `Always` only a mirror TTL of zero says no mirror: nothing to repair.
                if self.may_be_mirrored(&token) {
                    self.drop_mirror(id, token).await;
                } else {
                    self.forget_mirror(&token);
                }
                return Ok(());
            };
            // The instant the row expires, or a little before: the copy's end, however late
            // it reaches Redis (see `RedisStore::cache_completed`).
            let expires = until(sent, retention);
            if !self.may_be_mirrored(&token) {
                if expires <= Instant::now() || !self.caching() {
                    return Ok(());
                }
                // No lease mirror to replace: until the outcome lands in Redis a retry finds
                // nothing there and asks Postgres, which replays. So the answer need not wait.
                // Noted with the record, so that an operator's release waits for it.
                self.copy_after_answering(*id, token, fp, outcome, expires, asked);
                return Ok(());
            }
            // The lease's mirror answers "in flight" until the outcome replaces it (or, past
            // the row's expiry, the mirror is deleted): wait for that, after the mirror itself
            // if it is still on its way (or it could land after a failed write's repair).
            let repair = self.repair_unless_done(id, token);
            self.mirror_landed(&token).await;
            // The outcome replaces this lease's mirror, and nothing else: an operator's
            // release between the Postgres write and here deleted the mirror (this copy is
            // not among the writes it waits for), and a copy landing after that delete would
            // replay the released record until its second delete. Landed by the bound
            // counted from the write, or the mirror deleted instead: this future may have
            // been held since the write (a frozen process, a caller that stopped polling it).
            let by = self.copy_deadline(sent);
            let replaced = self
                .try_redis(|| {
                    self.redis
                        .replace_mirror(id, token, &fp, outcome, expires, by)
                })
                .await;
            let written = match replaced {
                Some(Replaced::Written) => true,
                // No mirror there: it ran out (an operation longer than the mirror's TTL),
                // or never landed, or a release deleted it. Copied all the same unless an
                // operator's release in this process of a record of its stripe was under way
                // at the write or began since (a release elsewhere is what the second delete is for, as for any
                // copy on its way).
                Some(Replaced::Absent) => {
                    // Noted with the record before the check: a release that begins after
                    // the check waits for it (`writes_landed`), one that began before is seen.
                    let copied = Arc::new(AtomicBool::new(false));
                    let (this, fp, outcome, id, done) =
                        (self.clone(), fp, outcome.clone(), *id, copied.clone());
                    self.write_after_answering(id, token, Written::Copy, async move {
                        if this.inner.releases.none_since(releases) {
                            let written = this
                                .try_redis(|| {
                                    this.redis
                                        .cache_completed_within(&id, &fp, &outcome, expires, by)
                                })
                                .await;
                            done.store(written == Some(true), Ordering::Release);
                        }
                    });
                    self.landed((token, Written::Copy)).await;
                    copied.load(Ordering::Acquire)
                }
                _ => false,
            };
            // Only an outcome written replaces the mirror for good: otherwise a mirror write
            // stranded in an abandoned connection could still land on the empty key, so the
            // mirror's (fenced) repair stays queued.
            if written {
                repair.done();
            }
            self.forget_mirror(&token);
            Ok(())
        })
        .await
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        idempotency_core::observe(self.name(), "release", async {
            // `LeaseLost` still drops the mirror: the token holds nothing in Postgres (it
            // completed the record in the application's transaction, `complete_in`, or another
            // attempt or an operator took the key), so its mirror is stale either way, and
            // would tell retries "in flight" until its TTL. (The delete is fenced on the
            // token: another attempt's mirror stays.)
            let released = self.pg.release(id, token).await;
            if let Err(error) = &released
                && !matches!(error, Error::LeaseLost)
            {
                return released;
            }
            if !self.may_be_mirrored(&token) {
                return released; // no mirror to drop
            }
            self.drop_mirror(id, token).await;
            released
        })
        .await
    }

    /// Answers once Postgres renewed the lease; the mirror in Redis is extended after
    /// answering (see below).
    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        idempotency_core::observe(self.name(), "renew", async {
            let asked = Instant::now();
            let renewed = self.pg.renew(id, token, lease).await;
            // An end (`renew` for zero, how a taken-over lease is given back) refused with
            // `LeaseLost` still drops the mirror, as a release does: the token holds nothing
            // in Postgres (it completed the record in the application's transaction, or
            // another attempt took the key), so its mirror is stale either way.
            if let Err(error) = renewed {
                if lease.is_zero()
                    && matches!(error, Error::LeaseLost)
                    && self.may_be_mirrored(&token)
                {
                    self.drop_mirror(id, token).await;
                }
                return Err(error);
            }
            if !self.may_be_mirrored(&token) {
                return Ok(());
            }
            if lease.is_zero() {
                // The lease ends now (an unfinished attempt kept for the next `begin` to take
                // over): its mirror goes, after a write of it still on its way, which would
                // otherwise land after the renew and say "in flight" for its TTL.
                self.drop_mirror(id, token).await;
                return Ok(());
            }
            // Noted before the call: a renew whose answer is lost may still have run.
            self.note_mirror(token, lease.min(self.mirror_ttl));
            // After answering: a renewal held up by a stalled Redis (one budget for the
            // repairs, one for the call) came after the lease it renewed had run out when
            // the lease was short, and a retry elsewhere took the key over and ran the
            // operation a second time. Landing late, the extension is harmless: fenced on
            // this token and on a live lease, it touches no released key, no other
            // attempt's mirror and no outcome. Its TTL counts from the Postgres ask, so the
            // mirror says "in flight" no longer than the row's lease plus what holds the
            // extension up once sent (the repairs run first, a Redis paused then resumed):
            // 409s for at most the mirror's TTL, never a second run.
            let (this, id) = (self.clone(), *id);
            self.spawn(async move {
                let left = lease.min(this.mirror_ttl).saturating_sub(asked.elapsed());
                if left < Duration::from_millis(1) {
                    return; // Redis refuses a TTL of zero, and the mirror ends by itself.
                }
                this.try_redis(|| async {
                    match this.redis.renew(&id, token, left).await {
                        Err(Error::LeaseLost) => Ok(()),
                        other => other,
                    }
                })
                .await;
            });
            Ok(())
        })
        .await
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64> {
        self.pg.purge_expired(batch).await
    }

    /// Postgres decides, so Postgres is read.
    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>> {
        idempotency_core::observe(self.name(), "inspect", self.pg.inspect(id)).await
    }

    /// Postgres decides; whatever Redis holds for the record is deleted after it (and, for a
    /// completed record, before it too: see below): a lease mirror would answer "in
    /// flight", a cached outcome would replay a deleted record.
    ///
    /// The Redis delete goes through the repair queue, so it runs before this process reads
    /// Redis again; it is queued before the Postgres call too (an early delete only costs a
    /// cache miss), so a call dropped or failed after Postgres committed still leaves it
    /// queued. A copy already on its way to Redis — the outcome of a `complete`, or of a
    /// replay, that read Postgres before the delete — could land after it: the delete runs
    /// again once every such write is over (two Postgres call timeouts and ten Redis budgets
    /// later: one for the delete to commit, one for a read just before it to be answered,
    /// and the copy's deadline), and is tried until Redis takes it (for up to an hour;
    /// `drain` waits for it).
    ///
    /// With [`ReleaseScope::completed`], Redis is told first, and while it cannot be a
    /// completed record is kept and the answer is `Unavailable`: its copy would replay it for
    /// its retention from every gateway. Any other answer is given as it is while Redis is
    /// unreachable (an in-flight record released: a lease's mirror lives no longer than the
    /// lease; no record at all), the delete left queued in this process: an error would
    /// invite a repeat, which would release a request that ran under the key since.
    async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased> {
        idempotency_core::observe(self.name(), "force_release", async {
            // A completed record's copy in Redis replays it for its whole retention, from
            // every gateway, without asking Postgres: Redis is told before Postgres forgets
            // it, and a completed record is kept while Redis cannot be. Deleted in Postgres
            // first, the answer could only be "released, but Redis still replays it, in
            // every process, unless this one lives until Redis is back" — and an operator
            // who repeated the call then deleted the record of a request that ran since,
            // which ran again. Asked directly, not through the breaker: an operator's call
            // is rare, and a breaker half-open (its probe goes in a task of its own) or a
            // backlog of repairs would refuse it while Redis is up. Failed, the delete is
            // queued below with the rest.
            let mut scope = scope;
            let mut redis_refused = None;
            if scope.completed
                && let Err(error) = self.redis.delete_record(id).await
            {
                redis_refused = Some(error);
                scope.completed = false;
            }
            // From before Postgres is asked until the end (or a drop): a completion that
            // wrote its row before this delete and finds its mirror gone after it must not
            // copy its outcome back.
            // Held by the second delete: a delete given up on here (a budget run out, this
            // future dropped) may still commit, up to then.
            let releasing = Releases::begin(&self.inner, id);
            self.inner.repairs().push((*id, None));
            // The second delete is scheduled before Postgres is asked: a call that fails or
            // is dropped once its delete has been sent may have deleted the row all the
            // same, and the copy in Redis (or one on its way) would then replay it. Only an
            // answer that Postgres kept the record calls it off, and ends the hold on the
            // mirrors and copies of the record's stripe at once: nothing was deleted.
            let (keep, kept) = tokio::sync::oneshot::channel::<()>();
            let (again, forget) = (self.clone(), *id);
            // Every copy that could still land is over by then: its Postgres delete commits
            // within one call timeout of now (it carries that bound, by the database's clock), a read just before it is answered within
            // another (a replay answered later is not copied), and a copy sent then lands
            // within four budgets or deletes the key (`RedisStore::cache_completed`); the
            // rest covers a completion's wait for its lease's mirror and the repairs a call
            // runs first. Counted from the ask: a call given up never says when it committed.
            let writes_over = self.pg.call_timeout() * 2 + self.redis.call_budget() * 10;
            // Tracked: a process that exits after an operator's release (the admin CLI)
            // waits for it with `drain`.
            self.spawn(async move {
                let _releasing = releasing;
                // A call dropped or failed before Postgres answered drops `keep` unsent: that
                // branch is then off, and the wait goes on.
                tokio::select! {
                    _ = tokio::time::sleep(writes_over) => {}
                    Ok(()) = kept => return,
                }
                // Until Redis takes it: tried once, a blip as it went out left it queued in
                // this process, and a process that made no Redis call after (the admin CLI
                // exits; one whose caching is off makes none) left a copy that landed late
                // replaying the released record for its retention. Bounded as the layer's
                // writes to a store that is down are (an hour); `drain` waits for it.
                let given_up_at = tokio::time::Instant::now() + SECOND_DELETE_TRIED_FOR;
                let mut pause = again.redis.call_budget().max(Duration::from_millis(50));
                loop {
                    if again.forget_in_redis(&forget).await.is_some() {
                        return;
                    }
                    if tokio::time::Instant::now() >= given_up_at {
                        tracing::error!(record = %forget, "an operator's release could not delete the record's copy in Redis for an hour: it may replay the released record until its retention ends");
                        return;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            });
            let found = self.pg.force_release(id, scope).await?;
            if matches!(found, ForceReleased::Completed | ForceReleased::Live) {
                // Kept in Postgres. The delete queued above still drops its copy in Redis:
                // one cache miss, never an answer Postgres would not give. Sent now, not at
                // this process's next Redis call: the admin CLI makes none, and a copy left
                // from before a release whose second delete never got through (a record
                // since made again while Redis was down) would replay the old outcome.
                let _ = keep.send(());
                match &redis_refused {
                    Some(error) if found == ForceReleased::Completed => {
                        return Err(Error::unavailable(format!(
                            "the record is completed, and Redis could not be told ({error}): \
                             nothing was released (its copy there would go on replaying it); \
                             call again once Redis answers this process"
                        )));
                    }
                    Some(_) => {}
                    None => {
                        self.forget_in_redis(id).await;
                    }
                }
                return Ok(found);
            }
            // A mirror or a copy this process was still writing would land after the delete.
            self.writes_landed(id).await;
            // Directly first, as the first delete: a breaker still open or half-open while
            // Redis answers would leave a copy written back in between to the breaker's next
            // probe. Failing that, queued with the repairs this process runs first.
            // (Not when the first delete failed in this call: a Redis that hangs would hold
            // the answer of a committed release a budget longer, and a client that gives up
            // meanwhile repeats it.)
            let forgot = match redis_refused {
                None if self.redis.delete_record(id).await.is_ok() => Some(()),
                _ => self.forget_in_redis(id).await,
            };
            if forgot.is_none() {
                // Said as it is all the same (released, deleted, or no record at all): an
                // error would invite the call again, and a repeat (with `completed`)
                // releases whatever request ran under the key since, which runs again. What
                // Redis may still hold is a lease's mirror (over with the lease) or a copy
                // (one sent just now, or left by a release cut short); the second delete
                // above is tried until Redis takes it.
                tracing::warn!(record = %id, ?found, "Redis could not be told of an operator's release: the record's copy there is deleted once Redis answers this process");
            }
            Ok(found)
        })
        .await
    }

    fn name(&self) -> &'static str {
        "hybrid"
    }

    fn begin_settles_when_dropped(&self) -> bool {
        // `begin` wraps its claim in `detached_begin`, tracked by `settling`.
        true
    }

    /// Waits for the claims this store stopped waiting for to settle (with the release of
    /// what they granted), for the second delete of an operator's release (below) and for
    /// what it writes to Redis after answering (each within its Redis budgets), then for the
    /// Postgres and Redis stores' own background writes.
    ///
    /// An operator's release (`force_release` of a record that is then gone) deletes its
    /// copy in Redis at once and again once every copy that was on its way has landed (two
    /// Postgres call timeouts and ten Redis budgets later), that second delete tried until
    /// Redis takes it; cut short, a copy on its way would replay an outcome Postgres no
    /// longer has until its TTL. A process that exits right after a release (an admin
    /// command) calls `drain` first, bounded (with Redis down the second delete is tried for
    /// up to an hour): a `drain` cut short is worth a warning that Redis may still hold the
    /// released record's copy.
    async fn drain(&self) {
        self.inner.settling.close();
        self.inner.settling.wait().await;
        self.pg.drain().await;
        self.redis.drain().await;
    }
}

#[cfg(test)]
mod tests {
    use super::DuplicateShare;

    /// The average reaches one again after a run of duplicates, and falls under any share
    /// above zero after a run of first requests.
    #[test]
    fn the_duplicate_share_reaches_both_ends() {
        let share = DuplicateShare::new();
        share.observe(false);
        assert!(!share.at_least(DuplicateShare::ONE));
        for _ in 0..2_000 {
            share.observe(true);
        }
        assert!(share.at_least(DuplicateShare::ONE), "{share:?}");
        for _ in 0..2_000 {
            share.observe(false);
        }
        assert!(!share.at_least(1), "{share:?}");
    }
}
