//! The hybrid store: conformance, then fault injection into real containers.
//!
//! The load driver runs 8 workers over 500 keys, each key attempted 3 to 5 times (every tenth
//! key's attempts back to back, so they race), and records every execution in a side-effect
//! table in Postgres. A fault is injected when a quarter of the attempts are done and cleared
//! at 60 % (or after 1.5 s). Afterwards: no key executed twice, every key replays its own
//! outcome, and — for Redis faults — no request failed. Then the store must return to the
//! Redis fast path (the hit counter rises again).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use idempotency_core::{
    Begin, Error, Fingerprint, IdempotencyKey, Inspection, Outcome, RecordId, RecordState,
    ReleaseScope, Scope, Store,
};
use idempotency_hybrid::{BreakerConfig, BreakerState, HybridStore};
use idempotency_postgres::PostgresStore;
use idempotency_redis::RedisStore;
use idempotency_test::{
    block_on,
    conformance::fresh_id,
    services::{self, RedisOptions, Service},
};
use sqlx::PgPool;
use tokio::sync::{Mutex, OnceCell};

/// [`pg_store`] with the default waits (2 s for a connection, 3 s a call) for the stores
/// the hybrid's conformance suite runs on (the shared one serves a few mirror tests too,
/// none of which times a Postgres call): the suite's 64 racing `begin`s of one key reach
/// Postgres whenever Redis does not answer them (no lease mirror, Redis off, or the race
/// ahead of the mirror). A batch sent each repeat of a key on a connection of its own then,
/// so most of them waited for one of the 20: waited for 500 ms, in calls of 1 s, a busy host
/// answered some of them `Unavailable` (a pool timeout, a claim out of its budget). Repeats
/// are answered from their batch now when their first claim's row answers them (not behind
/// an expired row); the default waits stay, for a slow host.
async fn conformance_pg_store(url: &str) -> PostgresStore {
    let pg = PostgresStore::builder(url)
        .max_connections(20)
        .connect()
        .await
        .expect("postgres store");
    pg.migrate().await.expect("migrate");
    pg
}

async fn pg_store(url: &str) -> PostgresStore {
    let pg = PostgresStore::builder(url)
        .max_connections(20)
        .acquire_timeout(Duration::from_millis(500))
        .call_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect("postgres store");
    pg.migrate().await.expect("migrate");
    pg
}

async fn hybrid(pg: PostgresStore, redis_url: &str) -> HybridStore {
    hybrid_with_prefix(pg, redis_url, &idempotency_test::unique("h")).await
}

/// [`hybrid`] with its Redis keys under `prefix`: two stores on one Redis, as two processes.
async fn hybrid_with_prefix(pg: PostgresStore, redis_url: &str, prefix: &str) -> HybridStore {
    let redis = redis_behind(redis_url, prefix).await;
    HybridStore::new(pg, redis, BreakerConfig::default())
}

/// The Redis store of [`hybrid_with_prefix`]: short budgets, no eviction check.
async fn redis_behind(redis_url: &str, prefix: &str) -> RedisStore {
    RedisStore::builder(redis_url)
        .prefix(prefix)
        .connect_timeout(Duration::from_millis(100))
        .response_timeout(Duration::from_millis(100))
        .call_budget(Duration::from_millis(150))
        .eviction_check(idempotency_redis::EvictionCheck::Skip)
        .connect()
        .await
        .expect("redis store")
}

/// A hybrid store on a Redis of its own (to pause, stop or flush) and the shared Postgres.
async fn dedicated_hybrid() -> (Service, HybridStore) {
    let redis = services::start_redis(RedisOptions::default()).await;
    let pg = services::postgres().await.expect("postgres");
    let store = hybrid(pg_store(pg.url()).await, redis.url()).await;
    (redis, store)
}

async fn shared_store() -> Option<Arc<HybridStore>> {
    static STORE: OnceCell<Arc<HybridStore>> = OnceCell::const_new();
    let pg = services::postgres().await?;
    let redis = services::redis().await?;
    Some(
        STORE
            .get_or_init(|| async {
                Arc::new(hybrid(conformance_pg_store(pg.url()).await, redis.url()).await)
            })
            .await
            .clone(),
    )
}

idempotency_test::conformance_tests!(async { shared_store().await.map(|s| s as Arc<dyn Store>) });

/// The suite again without the lease mirror: outcomes are then cached in Redis after
/// `complete` answered, and a retry that comes first must be replayed by Postgres.
mod no_mirror {
    use super::*;

    async fn store() -> Option<Arc<HybridStore>> {
        static STORE: OnceCell<Arc<HybridStore>> = OnceCell::const_new();
        let pg = services::postgres().await?;
        let redis = services::redis().await?;
        Some(
            STORE
                .get_or_init(|| async {
                    let store = hybrid(conformance_pg_store(pg.url()).await, redis.url()).await;
                    Arc::new(store.with_in_flight_mirror_ttl(Duration::ZERO))
                })
                .await
                .clone(),
        )
    }

    idempotency_test::conformance_tests!(async { store().await.map(|s| s as Arc<dyn Store>) });
}

/// The suite under `CachePolicy::Adaptive`, twice: once with a share no workload reaches
/// (Redis is never read nor written: every path that skips it), once at 0.1 (the suite's
/// own mix of first requests and duplicates turns Redis off and on as it runs, so leases
/// granted in one mode are completed, released and renewed in the other).
mod adaptive {
    use super::*;
    use idempotency_hybrid::CachePolicy;

    async fn store(share: f64) -> Option<Arc<HybridStore>> {
        let pg = services::postgres().await?;
        let redis = services::redis().await?;
        let store = hybrid(conformance_pg_store(pg.url()).await, redis.url()).await;
        Some(Arc::new(store.with_cache_policy(CachePolicy::Adaptive {
            min_duplicate_share: share,
        })))
    }

    mod never {
        use super::*;

        async fn shared() -> Option<Arc<HybridStore>> {
            static STORE: OnceCell<Option<Arc<HybridStore>>> = OnceCell::const_new();
            STORE.get_or_init(|| store(2.0)).await.clone()
        }

        idempotency_test::conformance_tests!(async { shared().await.map(|s| s as Arc<dyn Store>) });
    }

    mod switching {
        use super::*;

        async fn shared() -> Option<Arc<HybridStore>> {
            static STORE: OnceCell<Option<Arc<HybridStore>>> = OnceCell::const_new();
            STORE.get_or_init(|| store(0.1)).await.clone()
        }

        idempotency_test::conformance_tests!(async { shared().await.map(|s| s as Arc<dyn Store>) });
    }

    /// An outcome copied to Redis while duplicates were common still replays through a
    /// Postgres outage once they have become rare (Redis no longer asked first), as under
    /// `Always`. Before, every retry of it was `Unavailable` for as long as Postgres was down
    /// (and, never answered, did not count as the duplicates that would turn Redis back on).
    #[test]
    fn an_outcome_copied_while_caching_replays_through_a_postgres_outage() {
        block_on(async {
            if services::skipping() {
                return;
            }
            let _serial = SERIAL.lock().await;
            let pg = services::start_postgres().await;
            let redis = services::redis().await.expect("redis");
            let store = hybrid(pg_store(pg.url()).await, redis.url())
                .await
                .with_cache_policy(CachePolicy::Adaptive {
                    min_duplicate_share: 0.1,
                });
            let fp = idempotency_test::conformance::fp("a");
            let outcome = Outcome::new(201).with_body("charged");
            let first_request = || async {
                let id = idempotency_test::conformance::fresh_id();
                let token = idempotency_test::conformance::execute(&store, &id, &fp, LEASE).await;
                store
                    .complete(&id, token, &outcome, RETENTION)
                    .await
                    .expect("complete");
                id
            };
            // Redis is in use at first: the outcome is copied there.
            let charged = first_request().await;
            assert_eq!(
                store.redis().peek(&charged, &fp).await.expect("peek"),
                idempotency_redis::Peek::Found(Begin::Replay(outcome.clone()))
            );
            for _ in 0..200 {
                first_request().await;
            }
            let before = store.metrics().redis_skipped;
            first_request().await;
            assert!(
                store.metrics().redis_skipped > before,
                "first requests never turned Redis off: {:?}",
                store.metrics()
            );

            pg.stop().await;
            assert_eq!(
                store.begin(&charged, &fp, LEASE).await.expect("a replay"),
                Begin::Replay(outcome.clone())
            );
            // A key Redis knows nothing of waits for Postgres, as before.
            let new = idempotency_test::conformance::fresh_id();
            assert!(matches!(
                store.begin(&new, &fp, LEASE).await,
                Err(Error::Unavailable(_))
            ));
        });
    }

    /// First requests alone turn Redis off (they cost what they cost on Postgres alone); a
    /// burst of retries turns it back on, and the retries are then answered by Redis.
    #[test]
    fn redis_follows_the_share_of_duplicates() {
        block_on(async {
            let Some(store) = store(0.1).await else {
                return;
            };
            let fp = idempotency_test::conformance::fp("a");
            let outcome = Outcome::new(201).with_body("done");
            let first_request = || async {
                let id = idempotency_test::conformance::fresh_id();
                let token = idempotency_test::conformance::execute(&*store, &id, &fp, LEASE).await;
                store
                    .complete(&id, token, &outcome, LEASE)
                    .await
                    .expect("complete");
                id
            };
            let mut ids = Vec::new();
            for _ in 0..200 {
                ids.push(first_request().await);
            }
            let cold = store.metrics();
            assert!(
                cold.redis_skipped > 0,
                "first requests never turned Redis off: {cold:?}"
            );
            first_request().await;
            let m = store.metrics();
            assert_eq!(
                (m.redis_skipped, m.redis_hits + m.redis_misses),
                (cold.redis_skipped + 1, cold.redis_hits + cold.redis_misses),
                "a first request among first requests asked Redis"
            );
            // A retry storm: every key retried three times.
            for _ in 0..3 {
                for id in &ids {
                    assert_eq!(
                        store.begin(id, &fp, LEASE).await.expect("retry"),
                        Begin::Replay(outcome.clone())
                    );
                }
            }
            let storm = store.metrics();
            assert!(
                storm.redis_hits >= cold.redis_hits + ids.len() as u64,
                "the retries were not answered by Redis: {storm:?}"
            );
        });
    }
}

/// Waits (5 s at most) until Redis mirrors the live lease of `id`.
async fn mirror_landed(store: &HybridStore, id: &RecordId, fp: &Fingerprint) {
    for _ in 0..500 {
        if matches!(
            store.redis().peek(id, fp).await,
            Ok(idempotency_redis::Peek::Found(Begin::InFlight { .. }))
        ) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the lease was never mirrored: {:?}", store.metrics());
}

/// The lease's mirror is written after `begin` answered; a `release` right after must still
/// delete it (its delete waits for the mirror), or the next attempt would be told "in
/// flight" by a stale mirror instead of executing.
#[test]
fn a_release_right_after_begin_leaves_no_stale_mirror() {
    block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let fp = Fingerprint::of(b"a");
        for _ in 0..200 {
            let id = idempotency_test::conformance::fresh_id();
            let token = idempotency_test::conformance::execute(
                &*store,
                &id,
                &fp,
                idempotency_test::conformance::LONG,
            )
            .await;
            store.release(&id, token).await.expect("release");
            let again = store
                .begin(&id, &fp, idempotency_test::conformance::LONG)
                .await
                .expect("begin");
            assert!(
                matches!(again, Begin::Execute(_)),
                "after a release: {again:?}"
            );
        }
    });
}

/// A lease's mirror written late (its task ran long after `begin` answered: a busy runtime)
/// lives no longer than the row's lease: a retry after the lease ran out takes the key over.
/// Before, the mirror's TTL was the whole lease counted from when it landed, and the retry
/// was told "in flight" by Redis for as long as the mirror was late.
#[test]
fn a_mirror_written_late_ends_with_its_lease() {
    let urls = block_on(async {
        let pg = services::postgres().await?;
        let redis = services::redis().await?;
        Some((pg.url().to_owned(), redis.url().to_owned()))
    });
    let Some((pg, redis)) = urls else {
        return;
    };
    // One worker: while the test's task blocks it, the mirror's task cannot run.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let lease = Duration::from_secs(2);
        // Made on this runtime: its tasks run on its one worker.
        let store = hybrid(pg_store(&pg).await, &redis)
            .await
            .with_in_flight_mirror_ttl(lease);
        let (id, fp) = (
            idempotency_test::conformance::fresh_id(),
            Fingerprint::of(b"late mirror"),
        );
        // On the worker, so that blocking it holds up the mirror's task spawned meanwhile.
        let test = tokio::spawn(async move {
            let answered = std::time::Instant::now();
            let Begin::Execute(_) = store.begin(&id, &fp, lease).await.expect("begin") else {
                panic!("a fresh key executes")
            };
            // Busy elsewhere for most of the lease; then the mirror is written.
            std::thread::sleep(Duration::from_millis(1_500));
            mirror_landed(&store, &id, &fp).await;
            // The attempt crashed: nobody renews. Past its lease, a retry takes the key over.
            let past = answered + lease + Duration::from_millis(300);
            tokio::time::sleep(past.saturating_duration_since(std::time::Instant::now())).await;
            let retry = store.begin(&id, &fp, lease).await.expect("retry");
            assert!(
                matches!(retry, Begin::TakeOver(_)),
                "past the lease: {retry:?}"
            );
        });
        test.await.expect("the test's task");
    });
}

/// Claims a fresh record (its lease mirrored) and completes it in a committed application
/// transaction (`complete_in`, as `Executor::run_with_claim` does); returns the token.
async fn completed_in_a_transaction(
    store: &HybridStore,
    id: &RecordId,
    fp: &Fingerprint,
) -> idempotency_core::LeaseToken {
    use idempotency_test::conformance::LONG;
    let token = idempotency_test::conformance::execute(store, id, fp, LONG).await;
    mirror_landed(store, id, fp).await;
    let pg = store.postgres();
    let mut tx = pg.pool().begin().await.expect("tx");
    pg.complete_in(&mut tx, id, token, &Outcome::new(201), LONG)
        .await
        .expect("complete_in");
    tx.commit().await.expect("commit");
    token
}

/// After the application completed the record in its own transaction (`complete_in`, as
/// `Executor::run_with_claim` does), the calls that follow from the token find it completed:
/// the executor's own `complete` (answered `Ok`), or its release after a panic, an error or a
/// drop past the commit (refused, `LeaseLost`). Both must drop the lease's mirror at once:
/// the release left it, and the complete left it to the repair queue, so retries were told
/// "in flight" until its TTL (or this process's next Redis call) although the outcome was
/// stored.
#[test]
fn a_transactional_completion_leaves_no_lease_mirror_behind() {
    block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let lease = idempotency_test::conformance::LONG;
        for release in [true, false] {
            let (id, fp) = (fresh_id(), Fingerprint::of(b"a"));
            let token = completed_in_a_transaction(&store, &id, &fp).await;
            if release {
                let released = store.release(&id, token).await;
                assert!(matches!(released, Err(Error::LeaseLost)), "{released:?}");
            } else {
                store
                    .complete(&id, token, &Outcome::new(201), lease)
                    .await
                    .expect("the executor's complete finds it stored");
            }
            // Asked of Redis directly, as another process's `begin` would first.
            let peeked = store.redis().peek(&id, &fp).await;
            assert!(
                !matches!(
                    peeked,
                    Ok(idempotency_redis::Peek::Found(Begin::InFlight { .. }))
                ),
                "a stale mirror (release: {release}): {peeked:?}"
            );
            let again = store.begin(&id, &fp, lease).await.expect("begin");
            assert!(
                matches!(again, Begin::Replay(ref o) if o.status == 201),
                "release: {release}: {again:?}"
            );
        }
    });
}

/// A lease ended right after `begin` (`renew(token, 0)`: an abandoned takeover, a panicked
/// handler under `Reject`) must take its mirror along even while the mirror's write is still
/// on its way, or the next attempt is told "in flight" by it for its TTL instead of taking
/// the unfinished attempt over. (The conformance case
/// `a_lease_renewed_for_zero_ends_now_and_keeps_its_record` met this now and then.)
#[test]
fn a_lease_ended_right_after_begin_leaves_no_stale_mirror() {
    block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let fp = Fingerprint::of(b"a");
        let lease = idempotency_test::conformance::LONG;
        for _ in 0..100 {
            let id = fresh_id();
            let mut token = idempotency_test::conformance::execute(&*store, &id, &fp, lease).await;
            // Ended after an `Execute`, then after a `TakeOver`.
            for _ in 0..2 {
                store
                    .renew(&id, token, Duration::ZERO)
                    .await
                    .expect("renew for zero");
                match store.begin(&id, &fp, lease).await.expect("begin") {
                    Begin::TakeOver(taken) => token = taken,
                    other => panic!("after the lease ended: {other:?}"),
                }
            }
        }
    });
}

/// A lease's mirror can outlive its lease in Postgres (its delete failed, or another
/// process released the key): another request under the key must then be decided by
/// Postgres, not told 422 by a mirror that may be stale. (A stale mirror of the same request
/// costs a 409 until its TTL, as documented.)
#[test]
fn a_stale_mirror_never_answers_mismatch() {
    block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let id = idempotency_test::conformance::fresh_id();
        let (a, b) = (Fingerprint::of(b"a"), Fingerprint::of(b"b"));
        let long = idempotency_test::conformance::LONG;
        let token = idempotency_test::conformance::execute(&*store, &id, &a, long).await;
        mirror_landed(&store, &id, &a).await;
        // Released in Postgres alone: the mirror stays, as after a failed delete.
        store.postgres().release(&id, token).await.expect("release");
        let other = store.begin(&id, &b, long).await.expect("begin");
        assert!(matches!(other, Begin::Execute(_)), "{other:?}");
    });
}

/// An operator's release deletes the record's copy in Redis twice: at once, and again once
/// every copy that was on its way (a replay's, written after it answered) has landed. A
/// process that exits right after (the admin CLI) waits for the second with `drain`; the
/// second ran in an untracked task, so `drain` returned at once, and a copy on its way
/// outlived the record: retries replayed an outcome Postgres no longer had.
#[test]
fn drain_waits_for_the_second_delete_of_an_operators_release() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        let redis = services::redis().await.expect("redis");
        let store = hybrid(pg_store(pg.url()).await, redis.url()).await;
        let id = idempotency_test::conformance::fresh_id();
        let fp = Fingerprint::of(b"a");
        let long = idempotency_test::conformance::LONG;
        let token = idempotency_test::conformance::execute(&store, &id, &fp, long).await;
        let outcome = Outcome::new(201).with_body("charged");
        store
            .complete(&id, token, &outcome, long)
            .await
            .expect("complete");
        let released = store
            .force_release(&id, ReleaseScope::default().with_completed())
            .await
            .expect("release");
        assert_eq!(released, idempotency_core::ForceReleased::Deleted);
        // A replay's copy that was on its way lands after the first delete.
        store
            .redis()
            .cache_completed(&id, &fp, &outcome, tokio::time::Instant::now() + long)
            .await
            .expect("late copy");
        store.drain().await;
        let left = store.redis().peek(&id, &fp).await.expect("peek");
        assert!(
            matches!(left, idempotency_redis::Peek::Absent),
            "the copy outlived the record: {left:?}"
        );
    });
}

/// An operator's release that Postgres answers by keeping the record (here a live lease,
/// released only with `with_live`) deleted nothing: the calls after it mirror and copy to
/// Redis as before. Before, every release held off this process's mirrors and copies for the
/// whole wait of its second delete (about 11 s): every key completed meanwhile had no copy,
/// and its retries went to Postgres (503, were Postgres down).
#[test]
fn a_release_that_kept_the_record_leaves_the_copies_on() {
    block_on(async {
        let Some((store, _, kept)) = released(false, ReleaseScope::default()).await else {
            return;
        };
        assert_eq!(kept, idempotency_core::ForceReleased::Live);
        completes_with_a_copy(&store, &fresh_id()).await;
    });
}

/// A hybrid store, and a record claimed on it (and completed, if `complete`) that an operator
/// then released with `scope`: the store, the record and the release's answer.
async fn released(
    complete: bool,
    scope: ReleaseScope,
) -> Option<(HybridStore, RecordId, idempotency_core::ForceReleased)> {
    let pg = services::postgres().await?;
    let redis = services::redis().await.expect("redis");
    let store = hybrid(pg_store(pg.url()).await, redis.url()).await;
    let (fp, long) = (Fingerprint::of(b"a"), idempotency_test::conformance::LONG);
    let id = fresh_id();
    let token = idempotency_test::conformance::execute(&store, &id, &fp, long).await;
    if complete {
        store
            .complete(&id, token, &Outcome::new(201), long)
            .await
            .expect("complete");
    }
    let answer = store.force_release(&id, scope).await.expect("release");
    Some((store, id, answer))
}

/// Claims and completes `id`, and checks that the outcome was copied to Redis.
async fn completes_with_a_copy(store: &HybridStore, id: &RecordId) {
    let (fp, long) = (Fingerprint::of(b"a"), idempotency_test::conformance::LONG);
    let token = idempotency_test::conformance::execute(store, id, &fp, long).await;
    let outcome = Outcome::new(201).with_body("charged");
    store
        .complete(id, token, &outcome, long)
        .await
        .expect("complete");
    let copy = store.redis().peek(id, &fp).await.expect("peek");
    assert_eq!(
        copy,
        idempotency_redis::Peek::Found(Begin::Replay(outcome)),
        "the outcome copied to Redis"
    );
}

/// A release that deleted its record holds off the mirrors and copies of that record (and of
/// the records whose id shares its first byte) until its second delete, not of every key: a
/// record completed meanwhile is copied to Redis, and its retries are answered there. Before,
/// the hold was process-wide: for the ~11 s of the second delete's wait every key completed
/// in this process had no copy, and its retries went to Postgres (503, were Postgres down).
#[test]
fn a_release_that_deleted_leaves_the_other_records_copies_on() {
    block_on(async {
        let scope = ReleaseScope::default().with_completed();
        let Some((store, released, deleted)) = released(true, scope).await else {
            return;
        };
        assert_eq!(deleted, idempotency_core::ForceReleased::Deleted);
        let (fp, long) = (Fingerprint::of(b"a"), idempotency_test::conformance::LONG);
        // Another record, whose id does not share the released one's first byte.
        let id = std::iter::repeat_with(fresh_id)
            .find(|id| id.as_bytes()[0] != released.as_bytes()[0])
            .expect("an id");
        completes_with_a_copy(&store, &id).await;
        // The released record itself, claimed and completed again, is not copied while
        // the release's second delete is to come.
        let token = idempotency_test::conformance::execute(&store, &released, &fp, long).await;
        store
            .complete(&released, token, &Outcome::new(202), long)
            .await
            .expect("complete again");
        let copy = store.redis().peek(&released, &fp).await.expect("peek");
        assert_eq!(
            copy,
            idempotency_redis::Peek::Absent,
            "copied during the hold"
        );
    });
}

/// With the lease mirror off (a TTL of zero) no lease has a mirror, so a completion that
/// finds its token completed it before (as `Executor::run_with_claim`'s confirmation does)
/// has nothing in Redis to repair. It queued a repair all the same: one more script in Redis
/// before this process's next call there, and, while Redis was down, one more entry in the
/// backlog per such completion.
#[test]
fn without_mirrors_a_repeated_completion_queues_no_repair() {
    block_on(async {
        let Some(pg) = services::postgres().await else {
            return;
        };
        let redis = services::start_redis(RedisOptions::default()).await;
        let store = hybrid(pg_store(pg.url()).await, redis.url())
            .await
            .with_in_flight_mirror_ttl(Duration::ZERO);
        let (fp, long) = (Fingerprint::of(b"a"), idempotency_test::conformance::LONG);
        let id = fresh_id();
        let token = idempotency_test::conformance::execute(&store, &id, &fp, long).await;
        let outcome = Outcome::new(201);
        store
            .complete(&id, token, &outcome, long)
            .await
            .expect("complete");
        store.drain().await; // the outcome's copy written
        let mut conn = services::command_stats_from_now(redis.url()).await;
        store
            .complete(&id, token, &outcome, long)
            .await
            .expect("completed before");
        // The next call that reaches Redis runs whatever repairs are queued first.
        idempotency_test::conformance::execute(&store, &fresh_id(), &fp, long).await;
        store.drain().await;
        assert_eq!(
            services::script_calls(&mut conn, &["calls"]).await,
            0,
            "a script ran"
        );
    });
}

/// Found by the differential case (`answers_as_the_model_store`): an operator's release
/// right after a claim or a completion (a lease released live, an outcome deleted) left
/// Redis holding what that call wrote after answering — the lease's mirror, or the outcome's
/// copy — because the write ran the release's queued delete first and then wrote. The next
/// request was told "in flight", or `Mismatch` for another body, or replayed the deleted
/// outcome, until the second delete seconds later. The release now waits for this
/// process's writes to the record before its delete.
#[test]
fn an_operators_release_right_after_a_call_leaves_nothing_in_redis() {
    block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let long = idempotency_test::conformance::LONG;
        let (a, b) = (Fingerprint::of(b"a"), Fingerprint::of(b"b"));
        for round in 0..20 {
            let id = fresh_id();
            idempotency_test::conformance::execute(&*store, &id, &a, long).await;
            let released = store
                .force_release(&id, ReleaseScope::default().with_live())
                .await
                .expect("release");
            assert_eq!(released, idempotency_core::ForceReleased::Released);
            let next = store.begin(&id, &a, long).await.expect("begin");
            assert!(
                matches!(next, Begin::Execute(_)),
                "round {round}: after a released lease: {next:?}"
            );

            let id = fresh_id();
            let token = idempotency_test::conformance::execute(&*store, &id, &a, long).await;
            store
                .complete(&id, token, &Outcome::new(201).with_body("charged"), long)
                .await
                .expect("complete");
            let deleted = store
                .force_release(&id, ReleaseScope::default().with_completed())
                .await
                .expect("release");
            assert_eq!(deleted, idempotency_core::ForceReleased::Deleted);
            for body in [&b, &a] {
                let next = store.begin(&id, body, long).await.expect("begin");
                assert!(
                    matches!(next, Begin::Execute(_)),
                    "round {round}: after a deleted outcome: {next:?}"
                );
                store
                    .force_release(&id, ReleaseScope::default().with_live())
                    .await
                    .expect("release");
            }
        }
    });
}

#[test]
fn replays_and_live_duplicates_are_answered_by_redis_alone() {
    block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let id = idempotency_test::conformance::fresh_id();
        let fp = Fingerprint::of(b"a");
        let Begin::Execute(token) = store
            .begin(&id, &fp, Duration::from_secs(30))
            .await
            .expect("begin")
        else {
            panic!("expected Execute")
        };
        // The lease's mirror is written after `begin` answered: wait until it is there.
        mirror_landed(&store, &id, &fp).await;
        let before = store.metrics().redis_hits;
        assert!(matches!(
            store
                .begin(&id, &fp, Duration::from_secs(30))
                .await
                .expect("begin"),
            Begin::InFlight { .. }
        ));
        store
            .complete(&id, token, &Outcome::new(201), Duration::from_secs(60))
            .await
            .expect("complete");
        assert_eq!(
            store
                .begin(&id, &fp, Duration::from_secs(30))
                .await
                .expect("begin"),
            Begin::Replay(Outcome::new(201))
        );
        // Both answers came from Redis: the shared store's counters may rise from other tests,
        // but by at least these two.
        assert!(store.metrics().redis_hits >= before + 2);
    });
}

// ---------------------------------------------------------------------------------------
// The load driver.

const KEYS: usize = 500;
const WORKERS: usize = 8;
const LEASE: Duration = Duration::from_secs(3);
const RETENTION: Duration = Duration::from_secs(600);

#[derive(Default, Debug)]
struct Stats {
    executed: AtomicU64,
    replayed: AtomicU64,
    /// Replays answered to an attempt whose own operation had failed: its transaction's
    /// commit may have landed with the answer lost (Postgres stopped mid-commit), and this
    /// replay is then its own execution.
    replayed_after_a_failure: AtomicU64,
    in_flight: AtomicU64,
    unavailable: AtomicU64,
    done: AtomicUsize,
}

struct Run {
    store: Arc<HybridStore>,
    effects: String,
    pool: PgPool,
    scope: Scope,
    /// Use the transactional completion (effect and outcome in one commit). Needed when
    /// Postgres itself may die mid-operation: otherwise "did my effect commit?" is unknown.
    transactional: bool,
}

fn record(scope: &Scope, key: usize) -> (RecordId, Fingerprint) {
    let key = IdempotencyKey::new(format!("key-{key}")).expect("key");
    (
        RecordId::new(scope, &key),
        Fingerprint::of(format!("charge {key:?}").as_bytes()),
    )
}

fn schedule() -> Vec<usize> {
    let attempts = |k: usize| 3 + k % 3;
    let mut queue = Vec::new();
    // Every tenth key: all attempts back to back, so several workers race on it.
    for k in (0..KEYS).step_by(10) {
        queue.extend(std::iter::repeat_n(k, attempts(k)));
    }
    for round in 0..5 {
        for k in (0..KEYS).filter(|k| k % 10 != 0 && attempts(*k) > round) {
            queue.push(k);
        }
    }
    queue
}

impl Run {
    async fn new(store: HybridStore, transactional: bool) -> Self {
        let pool = store.postgres().pool().clone();
        let effects = idempotency_test::unique("effects");
        // No unique constraint: a second execution must show up as a second row.
        let ddl = format!(
            "CREATE TABLE {effects} (record_id bytea NOT NULL, at timestamptz NOT NULL DEFAULT now())"
        );
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(&pool)
            .await
            .expect("effects table");
        Self {
            store: Arc::new(store),
            effects,
            pool,
            scope: Scope::new(uuid::Uuid::new_v4().to_string()),
            transactional,
        }
    }

    /// The operation: "charge the card" (a row in the effects table), then store the outcome.
    async fn operate(
        &self,
        id: &RecordId,
        key: usize,
        token: idempotency_core::LeaseToken,
        stats: &Stats,
    ) -> bool {
        tokio::time::sleep(Duration::from_millis(3)).await;
        let insert = format!("INSERT INTO {} (record_id) VALUES ($1)", self.effects);
        let outcome = Outcome::new(201).with_body(format!("charge for key-{key}"));
        if self.transactional {
            let result: Result<(), Box<dyn std::error::Error + Send + Sync>> = async {
                let mut tx = self.pool.begin().await?;
                sqlx::query(sqlx::AssertSqlSafe(insert))
                    .bind(&id.as_bytes()[..])
                    .execute(&mut *tx)
                    .await?;
                self.store
                    .postgres()
                    .complete_in(&mut tx, id, token, &outcome, RETENTION)
                    .await?;
                tx.commit().await?;
                Ok(())
            }
            .await;
            if result.is_err() {
                // Effect and outcome committed together or not at all; the retry decides.
                stats.unavailable.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            return true;
        }
        sqlx::query(sqlx::AssertSqlSafe(insert))
            .bind(&id.as_bytes()[..])
            .execute(&self.pool)
            .await
            .expect("effect (Postgres is up in this scenario)");
        loop {
            match self.store.complete(id, token, &outcome, RETENTION).await {
                Ok(()) => return true,
                Err(Error::Unavailable(_)) => {
                    stats.unavailable.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("complete failed: {error} (the outcome would be lost)"),
            }
        }
    }

    /// One client request, retried by the client on 409 and 503 like a careful SDK.
    async fn attempt(&self, key: usize, stats: &Stats) {
        let (id, fp) = record(&self.scope, key);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut failed = false;
        loop {
            assert!(Instant::now() < deadline, "key-{key} never settled");
            match self.store.begin(&id, &fp, LEASE).await {
                // A takeover runs like a fresh claim: this scenario checks the store under
                // faults, not the policy for unknown outcomes.
                Ok(Begin::Execute(token) | Begin::TakeOver(token)) => {
                    if self.operate(&id, key, token, stats).await {
                        stats.executed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    failed = true;
                }
                Ok(Begin::Replay(outcome)) => {
                    assert_eq!(
                        outcome.body,
                        format!("charge for key-{key}"),
                        "replayed another key's outcome"
                    );
                    stats.replayed.fetch_add(1, Ordering::Relaxed);
                    if failed {
                        stats
                            .replayed_after_a_failure
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    return;
                }
                Ok(Begin::InFlight { .. }) => {
                    stats.in_flight.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Ok(Begin::Mismatch) => panic!("mismatch for key-{key}"),
                Err(Error::Unavailable(_)) => {
                    stats.unavailable.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("begin failed: {error}"),
            }
        }
    }

    async fn drive(self: &Arc<Self>, stats: &Arc<Stats>) -> tokio::task::JoinHandle<()> {
        let queue = Arc::new(schedule());
        let next = Arc::new(AtomicUsize::new(0));
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                let (run, stats, queue, next) =
                    (self.clone(), stats.clone(), queue.clone(), next.clone());
                tokio::spawn(async move {
                    while let Some(&key) = queue.get(next.fetch_add(1, Ordering::Relaxed)) {
                        run.attempt(key, &stats).await;
                        stats.done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        tokio::spawn(async move {
            for worker in workers {
                worker.await.expect("worker panicked");
            }
        })
    }

    /// Every key executed exactly once and replays its own outcome.
    async fn verify(&self) -> (usize, usize) {
        let sql = format!(
            "SELECT record_id, count(*) FROM {} GROUP BY record_id",
            self.effects
        );
        let rows: Vec<(Vec<u8>, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .expect("effects");
        let counts: HashMap<Vec<u8>, i64> = rows.into_iter().collect();
        let twice = counts.values().filter(|n| **n > 1).count();
        let mut lost = 0;
        for key in 0..KEYS {
            let (id, fp) = record(&self.scope, key);
            assert_eq!(
                counts.get(id.as_bytes().as_slice()).copied().unwrap_or(0),
                1,
                "key-{key} executions"
            );
            match self.store.begin(&id, &fp, LEASE).await.expect("begin") {
                Begin::Replay(o) if o.body == format!("charge for key-{key}") => {}
                other => {
                    lost += 1;
                    eprintln!("key-{key}: no stored outcome ({other:?})");
                }
            }
        }
        (twice, lost)
    }

    /// Waits until Redis answers again (a hit with the breaker closed), replaying a few
    /// completed keys if the driver has finished, and returns how long that took.
    async fn recovers_fast_path(&self, since: Instant, hits_at_clear: u64) -> Duration {
        for round in 0..400 {
            let m = self.store.metrics();
            if m.redis_hits > hits_at_clear && m.breaker_state == BreakerState::Closed {
                return since.elapsed();
            }
            // The same few keys again and again: the first visit after a Redis restart is a
            // miss that re-warms the key, the next one a hit.
            let (id, fp) = record(&self.scope, round % 10);
            self.store.begin(&id, &fp, LEASE).await.expect("begin");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "the store never returned to the Redis fast path: {:?}",
            self.store.metrics()
        );
    }
}

/// Fault scenarios run one at a time: they share two cores and measure recovery.
static SERIAL: Mutex<()> = Mutex::const_new(());

enum Fault {
    RedisStopped,
    RedisPaused,
    Flushall,
    Evicting,
    RedisRestartedEmpty,
    PostgresStopped,
}

async fn scenario(fault: Fault) {
    if services::skipping() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let redis = services::start_redis(RedisOptions::default()).await;
    let own_pg: Option<Service> = match fault {
        Fault::PostgresStopped => Some(services::start_postgres().await),
        _ => None,
    };
    let pg_url = match &own_pg {
        Some(pg) => pg.url().to_owned(),
        None => services::postgres()
            .await
            .expect("postgres")
            .url()
            .to_owned(),
    };
    let store = hybrid(pg_store(&pg_url).await, redis.url()).await;
    let run = Arc::new(Run::new(store, matches!(fault, Fault::PostgresStopped)).await);
    let stats = Arc::new(Stats::default());
    let total = schedule().len();
    let driver = run.drive(&stats).await;

    while stats.done.load(Ordering::Relaxed) < total / 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let injected = Instant::now();
    let admin = || async {
        let client = redis::Client::open(redis.url()).expect("client");
        client
            .get_multiplexed_async_connection()
            .await
            .expect("admin connection")
    };
    match fault {
        Fault::RedisStopped => redis.stop().await,
        Fault::RedisPaused => redis.pause().await,
        Fault::Flushall => {
            let _: () = redis::cmd("FLUSHALL")
                .query_async(&mut admin().await)
                .await
                .expect("flushall");
        }
        Fault::Evicting => {
            let mut conn = admin().await;
            let info: String = redis::cmd("INFO")
                .arg("memory")
                .query_async(&mut conn)
                .await
                .expect("info");
            let used: u64 = info
                .lines()
                .find_map(|l| l.strip_prefix("used_memory:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("used_memory");
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory-policy")
                .arg("allkeys-lru")
                .query_async(&mut conn)
                .await
                .expect("policy");
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(used + 64 * 1024)
                .query_async(&mut conn)
                .await
                .expect("maxmemory");
        }
        Fault::RedisRestartedEmpty => {
            redis.stop().await;
            redis.start().await;
        }
        Fault::PostgresStopped => {
            own_pg.as_ref().expect("own postgres").stop().await;
            // Deterministic evidence, whatever the load happens to be doing at this moment:
            // a begin while Postgres is down answers Unavailable, never Execute.
            let (id, fp) = record(&Scope::new("down-probe"), 0);
            match run.store.begin(&id, &fp, LEASE).await {
                Err(Error::Unavailable(_)) => {
                    stats.unavailable.fetch_add(1, Ordering::Relaxed);
                }
                other => panic!("a begin while Postgres is down answered {other:?}"),
            }
        }
    }
    let paused_latency = if matches!(fault, Fault::RedisPaused) {
        // Latency of requests while Redis hangs: the first pay the Redis budget, then the
        // breaker opens and they cost what Postgres costs.
        let (id, fp) = record(&Scope::new("probe"), 0);
        let mut samples = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            let _ = run.store.begin(&id, &fp, LEASE).await;
            samples.push(t.elapsed());
        }
        Some(samples)
    } else {
        None
    };
    while stats.done.load(Ordering::Relaxed) < total * 6 / 10
        && injected.elapsed() < Duration::from_millis(1500)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let cleared = Instant::now();
    let hits_at_clear = run.store.metrics().redis_hits;
    let run_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let run = run.clone();
        let run_done = run_done.clone();
        tokio::spawn(async move {
            // Poll the counters while the driver goes on: recovery is the first Redis hit
            // with the breaker closed after the fault cleared.
            loop {
                let m = run.store.metrics();
                if m.redis_hits > hits_at_clear && m.breaker_state == BreakerState::Closed {
                    return Some(cleared.elapsed());
                }
                if run_done.load(Ordering::Relaxed) {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    match fault {
        Fault::RedisStopped => redis.start().await,
        Fault::RedisPaused => redis.unpause().await,
        Fault::PostgresStopped => own_pg.as_ref().expect("own postgres").start().await,
        Fault::Flushall | Fault::Evicting | Fault::RedisRestartedEmpty => {}
    }
    driver.await.expect("driver");
    run_done.store(true, Ordering::Relaxed);
    let fault_window = cleared.duration_since(injected);

    let recovery = match watcher.await.expect("watcher") {
        Some(recovery) => recovery,
        None => run.recovers_fast_path(cleared, hits_at_clear).await,
    };
    let (twice, lost) = run.verify().await;
    let m = run.store.metrics();
    eprintln!(
        "fault window {fault_window:.2?}: executed={} replayed={} in_flight_answers={} unavailable={} \
         twice={twice} lost={lost} recovery_to_redis={recovery:.2?} metrics={m:?}",
        stats.executed.load(Ordering::Relaxed),
        stats.replayed.load(Ordering::Relaxed),
        stats.in_flight.load(Ordering::Relaxed),
        stats.unavailable.load(Ordering::Relaxed),
    );
    if let Some(samples) = paused_latency {
        eprintln!("latency of 20 sequential begins right after the pause: {samples:.1?}");
    }
    assert_eq!(twice, 0, "keys executed twice");
    assert_eq!(lost, 0, "keys with a lost outcome");
    // Every key's effect is there once (`verify`). Each was counted executed, except where
    // a commit's answer was lost: its attempt then met its own outcome as a replay.
    let executed = stats.executed.load(Ordering::Relaxed);
    let after_a_failure = stats.replayed_after_a_failure.load(Ordering::Relaxed);
    assert!(
        executed <= KEYS as u64 && KEYS as u64 <= executed + after_a_failure,
        "executed={executed} replayed after a failure={after_a_failure}"
    );
    match fault {
        Fault::PostgresStopped => {
            assert!(
                stats.unavailable.load(Ordering::Relaxed) > 0,
                "Postgres down must answer Unavailable"
            );
        }
        _ => assert_eq!(
            stats.unavailable.load(Ordering::Relaxed),
            0,
            "requests failed because of Redis"
        ),
    }
    match fault {
        Fault::RedisStopped | Fault::RedisPaused => {
            assert!(m.breaker_opened >= 1, "the breaker opened: {m:?}");
            assert!(m.fallbacks > 0, "{m:?}");
        }
        Fault::Evicting => {
            let info: String = redis::cmd("INFO")
                .arg("stats")
                .query_async(&mut admin().await)
                .await
                .expect("info");
            let evicted: u64 = info
                .lines()
                .find_map(|l| l.strip_prefix("evicted_keys:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("evicted_keys");
            eprintln!("evicted keys: {evicted}");
            assert!(evicted > 0, "the scenario evicted nothing");
        }
        _ => {}
    }
}

#[test]
fn fault_redis_stopped_then_started() {
    block_on(scenario(Fault::RedisStopped));
}

#[test]
fn fault_redis_paused_then_unpaused() {
    block_on(scenario(Fault::RedisPaused));
}

#[test]
fn fault_flushall_mid_run() {
    block_on(scenario(Fault::Flushall));
}

#[test]
fn fault_redis_evicting_at_maxmemory() {
    block_on(scenario(Fault::Evicting));
}

#[test]
fn fault_redis_restarted_empty_with_live_leases() {
    block_on(scenario(Fault::RedisRestartedEmpty));
}

#[test]
fn fault_postgres_stopped() {
    block_on(scenario(Fault::PostgresStopped));
}

/// The interleaving behind a once-seen flake, forced: a mirror write that timed out while
/// Redis hung lands when it resumes, after Postgres completed the record and while the breaker
/// skipped the completion's Redis write. The first answer after recovery must be the replay,
/// not a stale "in flight".
#[test]
fn a_late_mirror_write_never_answers_after_completion() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let (redis, store) = dedicated_hybrid().await;
        let fp = Fingerprint::of(b"late");
        let (a, b) = (
            idempotency_test::conformance::fresh_id(),
            idempotency_test::conformance::fresh_id(),
        );

        load_scripts(&store, &fp).await;

        redis.pause().await;
        // Peek and mirror of A time out (2 failures); the mirror command waits in Redis.
        let Begin::Execute(token) = store.begin(&a, &fp, LEASE).await.expect("begin a") else {
            panic!("execute a")
        };
        // B's peek is the third failure: the breaker opens. (A's mirror runs in a task of its
        // own: on a loaded machine its failure can land after B's. Wait for it; it must.)
        store.begin(&b, &fp, LEASE).await.expect("begin b");
        for _ in 0..200 {
            if store.metrics().breaker_state == BreakerState::Open {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(store.metrics().breaker_state, BreakerState::Open);
        // Completed in Postgres; the Redis write is skipped by the open breaker.
        store
            .complete(&a, token, &Outcome::new(201).with_body("a"), RETENTION)
            .await
            .expect("complete");
        redis.unpause().await; // A's stale mirror lands now
        tokio::time::sleep(Duration::from_millis(400)).await; // past the breaker's first backoff
        {
            let client = redis::Client::open(redis.url()).expect("client");
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("conn");
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("*")
                .query_async(&mut conn)
                .await
                .expect("keys");
            assert!(
                keys.contains(&store.redis().key(&a)),
                "the late mirror write landed: {keys:?}"
            );
        }

        for _ in 0..3 {
            assert_eq!(
                store.begin(&a, &fp, LEASE).await.expect("begin"),
                Begin::Replay(Outcome::new(201).with_body("a")),
                "{:?}",
                store.metrics()
            );
        }
        // The probe answers in a task of its own: closed once it has, not at once.
        assert!(breaker_closes(&store).await, "{:?}", store.metrics());
    });
}

/// An outcome's copy sent when its row has expired (a short retention that ran out while
/// the completion waited for the lease's mirror to land) writes nothing and deletes what the
/// key holds: the lease's mirror would otherwise answer "in flight" for a record that is
/// over. (The first version of the bounded copy wrote nothing and left the mirror, and the
/// hybrid took the mirror for replaced.)
#[test]
fn a_copy_too_late_to_write_deletes_the_leases_mirror() {
    block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let (id, fp) = (fresh_id(), Fingerprint::of(b"too late"));
        let Begin::Execute(_) = store.begin(&id, &fp, LEASE).await.expect("begin") else {
            panic!("execute")
        };
        mirror_landed(&store, &id, &fp).await;
        let written = store
            .redis()
            .cache_completed(&id, &fp, &Outcome::new(201), tokio::time::Instant::now())
            .await
            .expect("the copy's call");
        assert!(!written, "a copy past its row's expiry was written");
        let left = store.redis().peek(&id, &fp).await.expect("peek");
        assert!(
            matches!(left, idempotency_redis::Peek::Absent),
            "the lease's mirror outlived the record: {left:?}"
        );
    });
}

/// Runs a key to its end, so that Redis knows the scripts before a test stalls it: a late
/// `EVALSHA` of an unknown script would just fail.
async fn load_scripts(store: &HybridStore, fp: &Fingerprint) {
    let warm = fresh_id();
    let Begin::Execute(t) = store.begin(&warm, fp, LEASE).await.expect("warm") else {
        panic!("warm")
    };
    store
        .complete(&warm, t, &Outcome::new(201), RETENTION)
        .await
        .expect("warm complete");
}

/// An outcome's copy that reaches Redis late (sent while Redis was stalled, run when it
/// resumed) expires with its row, not a whole retention after it landed: past the row's
/// expiry the key is free, so the same request runs again instead of replaying a record
/// Postgres no longer holds (before, the copy replayed until its TTL, counted from landing).
#[test]
fn an_outcome_copy_that_lands_late_expires_with_its_row() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let (redis, store) = dedicated_hybrid().await;
        let fp = Fingerprint::of(b"late copy");
        load_scripts(&store, &fp).await;

        let id = fresh_id();
        let Begin::Execute(token) = store.begin(&id, &fp, LEASE).await.expect("begin") else {
            panic!("execute")
        };
        mirror_landed(&store, &id, &fp).await;
        let retention = Duration::from_secs(2);
        redis.pause().await;
        let stalled = Instant::now();
        // Postgres stores the outcome; its copy waits in the stalled Redis (one failure:
        // the breaker stays closed).
        store
            .complete(&id, token, &Outcome::new(201).with_body("first"), retention)
            .await
            .expect("complete");
        tokio::time::sleep_until((stalled + retention + Duration::from_millis(500)).into()).await;
        redis.unpause().await;
        // The store's connection runs the stalled copy before this read.
        let copy = store.redis().peek(&id, &fp).await.expect("peek");
        assert!(
            matches!(copy, idempotency_redis::Peek::Absent),
            "a copy outlived its row: {copy:?}"
        );
        assert!(
            matches!(
                store.begin(&id, &fp, LEASE).await.expect("begin again"),
                Begin::Execute(_)
            ),
            "the key is free once its row expired: {:?}",
            store.metrics()
        );
    });
}

/// Sends `CLIENT PAUSE <ms> WRITE` on a connection of its own: Redis keeps answering reads
/// (the peek) while every write (mirrors, repairs, probes that write) waits.
async fn pause_writes(url: &str, ms: u64) {
    let client = redis::Client::open(url).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("conn");
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("WRITE")
        .query_async(&mut conn)
        .await
        .expect("CLIENT PAUSE");
}

/// Calls `begin` on fresh keys until the breaker closes (each call may be the probe).
async fn breaker_closes(store: &HybridStore) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let id = idempotency_test::conformance::fresh_id();
        if let Ok(Begin::Execute(token)) = store.begin(&id, &Fingerprint::of(b"p"), LEASE).await {
            let _ = store.release(&id, token).await;
        }
        if store.metrics().breaker_state == BreakerState::Closed {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The reported defect: a probe cancelled by a client hang-up left the breaker half-open for
/// good, and the fast path never came back. Later, a probe cancelled that way was handed to
/// the next call at once, and each one waited on the stalled Redis until its caller gave up.
/// Now no caller holds the probe: the call that finds the open period over (here a `renew`,
/// with Redis writes paused) goes on without Redis and is answered, a write of the breaker's
/// own probes Redis, and the breaker closes once Redis answers writes again.
#[test]
fn a_cancelled_breaker_probe_does_not_keep_redis_off() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let (redis, store) = dedicated_hybrid().await;
        let fp = Fingerprint::of(b"probe");
        assert!(breaker_closes(&store).await, "Redis answers at the start");

        pause_writes(redis.url(), 2_000).await;
        // Mirror writes time out: three failures open the breaker.
        let owned = idempotency_test::conformance::fresh_id();
        let Begin::Execute(token) = store.begin(&owned, &fp, LEASE).await.expect("begin") else {
            panic!("execute")
        };
        while store.metrics().breaker_state != BreakerState::Open {
            let id = idempotency_test::conformance::fresh_id();
            store.begin(&id, &fp, LEASE).await.expect("begin");
        }
        tokio::time::sleep(Duration::from_millis(400)).await; // past the first backoff
        // Paused again from now: opening the breaker can take longer than the first pause on
        // a loaded machine.
        pause_writes(redis.url(), 2_000).await;
        // The next Redis call would be the probe: answered by Postgres, though its caller
        // gives up long before the pause ends.
        tokio::time::timeout(Duration::from_secs(1), store.renew(&owned, token, LEASE))
            .await
            .expect("the call is not held by the probe")
            .expect("renewed");
        assert_ne!(store.metrics().breaker_state, BreakerState::Closed);
        tokio::time::sleep(Duration::from_millis(2_000)).await; // the pause ends
        assert!(
            breaker_closes(&store).await,
            "the breaker must close once Redis answers: {:?}",
            store.metrics()
        );
    });
}

/// The cancellation sweep on the hybrid with Redis stalled: writes paused for a second at a
/// time (reads still answering, as in the reported hang-up-mid-claim defect), while every
/// operation is dropped at each of its polls. Afterwards the breaker closes again.
#[test]
fn cancellation_sweep_with_redis_writes_stalled() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let (redis, store) = dedicated_hybrid().await;
        let store = Arc::new(store);
        let url = redis.url().to_owned();
        let stalls = tokio::spawn(async move {
            loop {
                pause_writes(&url, 1_000).await;
                tokio::time::sleep(Duration::from_millis(1_500)).await;
            }
        });
        // A sweep whose operation completes at its first poll dropped nothing by chance
        // (a preempted thread on a loaded machine): run it again, as the stores' own sweep.
        let report = idempotency_test::conformance::sweep_every_operation(&*store).await;
        stalls.abort();
        println!(
            "sweep with Redis writes stalled: {report:?}, {:?}",
            store.metrics()
        );
        assert!(report.never_dropped().is_empty(), "{report:?}");
        tokio::time::sleep(Duration::from_millis(1_000)).await; // the last pause ends
        assert!(
            breaker_closes(&store).await,
            "the breaker must close once Redis answers: {:?}",
            store.metrics()
        );
    });
}

/// `clients` concurrent clients run first requests on `ids`, one after another each, and
/// complete them with the id as body. With `every_begin_executes`, any other answer (an
/// `Unavailable` included) fails the test; without, such keys are skipped.
async fn first_requests(
    store: &Arc<HybridStore>,
    ids: &[RecordId],
    fp: &Fingerprint,
    clients: usize,
    every_begin_executes: bool,
) {
    let clients = ids.chunks(ids.len().div_ceil(clients)).map(|chunk| {
        let (store, chunk, fp) = (store.clone(), chunk.to_vec(), *fp);
        tokio::spawn(async move {
            for id in chunk {
                match store.begin(&id, &fp, LEASE).await {
                    Ok(Begin::Execute(token)) => {
                        let outcome = Outcome::new(201).with_body(id.to_hex());
                        store
                            .complete(&id, token, &outcome, RETENTION)
                            .await
                            .expect("complete");
                    }
                    other if every_begin_executes => panic!("a first begin answered {other:?}"),
                    _ => {}
                }
            }
        })
    });
    for client in futures::future::join_all(clients).await {
        client.expect("client");
    }
}

/// The defect CI run 19 found: while Redis hung, every Redis call first waited its turn to
/// run the queue of stale-mirror repairs, a full budget per turn, and each completion Redis
/// was not told about added to that queue. Under load the queue grew: begins behind it
/// outlived their own budget (a hung Redis failed requests), and a lease mirror queued there
/// outlived the `complete` that waited for it, landing once Redis resumed and answering "in
/// flight" for a completed key. One budget now covers the repairs and the call, and a mirror
/// its `complete` stopped waiting for is cancelled.
#[test]
fn a_hung_redis_queues_no_call_behind_the_repairs() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let redis = services::start_redis(RedisOptions::default()).await;
        let pg = services::postgres().await.expect("postgres");
        let store = {
            let store = hybrid(pg_store(pg.url()).await, redis.url()).await;
            // The breaker never opens: every call meets the hung Redis.
            let config = BreakerConfig::default().failure_threshold(u32::MAX);
            Arc::new(HybridStore::new(
                store.postgres().clone(),
                store.redis().clone(),
                config,
            ))
        };
        let fp = Fingerprint::of(b"queued");
        let outcome = |id: &RecordId| Outcome::new(201).with_body(id.to_hex());

        redis.pause().await;
        // Twenty-four clients, each running first requests one after another: every completion
        // leaves a repair behind, so repairs are pending whenever a call starts.
        let ids: Vec<RecordId> = (0..96)
            .map(|_| idempotency_test::conformance::fresh_id())
            .collect();
        first_requests(&store, &ids, &fp, 24, true).await;

        redis.unpause().await;
        tokio::time::sleep(Duration::from_millis(300)).await; // queued commands run
        // No lease mirror is left in Redis for a completed key: a record there is an outcome.
        let mut conn = redis::Client::open(redis.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("conn");
        for id in &ids {
            let value: Option<Vec<u8>> = redis::cmd("GET")
                .arg(store.redis().key(id))
                .query_async(&mut conn)
                .await
                .expect("get");
            assert_ne!(
                value.as_deref().and_then(<[u8]>::first),
                Some(&b'm'),
                "a lease mirror landed after its key completed"
            );
        }
        // Every retry replays at once, and the second from Redis alone.
        let hits = store.metrics().redis_hits;
        for id in ids.iter().chain(&ids) {
            assert_eq!(
                store.begin(id, &fp, LEASE).await.expect("retry"),
                Begin::Replay(outcome(id)),
                "{:?}",
                store.metrics()
            );
        }
        assert!(
            store.metrics().redis_hits >= hits + ids.len() as u64,
            "Redis answered the second retries: {:?}",
            store.metrics()
        );
    });
}

/// A caller polled once, as it ran the stale-mirror repairs, then held without a poll (a
/// future parked in a `select!` arm, a request whose task is starved): it held the repairs'
/// lock, and every other Redis call waited a whole budget for it and went to Postgres, for as
/// long as that future lived. The breaker heard nothing (they only waited), so nothing
/// turned Redis back on. Now the repairs run in a task of their own, which ends at its
/// caller's deadline however that caller is polled.
#[test]
fn a_caller_held_without_a_poll_mid_repairs_keeps_no_call_from_redis() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let (_redis, store) = store_with_a_repair_queued(b"held").await;
        let fp = Fingerprint::of(b"held");
        // Polled once: it takes the repairs' lock and sends the delete. Then held.
        let id = fresh_id();
        let mut held = Box::pin(store.begin(&id, &fp, LEASE));
        assert!(futures::poll!(held.as_mut()).is_pending());
        first_requests_use_redis(&store, &fp, "behind a caller held mid-repairs").await;
        // Polled again, the held caller is answered too.
        assert!(matches!(held.await, Ok(Begin::Execute(_))));
    });
}

/// The same with the caller on a second runtime, current-thread, left idle once its
/// `block_on` returned (a sync worker's between two jobs): a caller there that gave up
/// mid-repairs left their task queued on it, unrun, holding the repairs' lock, so every
/// other call waited a budget and went to Postgres for as long as that thread ran nothing
/// else. The store runs the work it leaves behind where it was made.
#[test]
fn a_caller_on_a_runtime_left_idle_mid_repairs_keeps_no_call_from_redis() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let (redis, store) = store_with_a_repair_queued(b"idle repairs").await;
        let fp = Fingerprint::of(b"idle repairs");
        // The repairs' deletes wait on Redis; the caller gives up meanwhile.
        pause_writes(redis.url(), 400).await;
        let (gave_up, _idle) = on_an_idle_runtime({
            let (store, id) = (store.clone(), fresh_id());
            move |rt| {
                rt.block_on(async {
                    let begin = store.begin(&id, &fp, LEASE);
                    tokio::time::timeout(Duration::from_millis(50), begin).await
                })
                .is_err()
            }
        })
        .await;
        assert!(gave_up, "the caller gives up while Redis holds the deletes");
        tokio::time::sleep(Duration::from_millis(500)).await; // the pause is over
        first_requests_use_redis(&store, &fp, "behind repairs left on an idle runtime").await;
    });
}

/// A claim answered on a runtime left idle once its `block_on` returned: the lease's mirror,
/// written after answering, was spawned there and never ran, and the `complete` (on the
/// main runtime) that waits for it, and cancels it past its budget, waited for the
/// cancelled task to end: for good, since nothing ran that runtime again.
#[test]
fn a_claim_answered_on_a_runtime_left_idle_can_be_completed() {
    block_on(async {
        if services::skipping() {
            return;
        }
        // A store of its own, its connections made here first: a connection a runtime
        // makes is driven by that runtime, and a shared store's would then stall for every
        // test while this one keeps its runtime idle.
        let _serial = SERIAL.lock().await;
        let (_redis, store) = dedicated_hybrid().await;
        let fp = Fingerprint::of(b"idle claim");
        load_scripts(&store, &fp).await;
        a_claim_on_an_idle_runtime_completes(&store, &fp).await;
    });
}

/// Claims a fresh key on a runtime left idle once its `block_on` returned, then completes it
/// here and replays it.
async fn a_claim_on_an_idle_runtime_completes(store: &HybridStore, fp: &Fingerprint) {
    let id = fresh_id();
    let (begun, _idle) = on_an_idle_runtime({
        let (store, fp) = (store.clone(), *fp);
        move |rt| rt.block_on(store.begin(&id, &fp, LEASE))
    })
    .await;
    let Ok(Begin::Execute(token)) = begun else {
        panic!("a fresh key: {begun:?}")
    };
    let outcome = Outcome::new(201).with_body("idle");
    // Far past every budget the complete waits on: it is waiting for good.
    let completed = tokio::time::timeout(
        Duration::from_secs(10),
        store.complete(&id, token, &outcome, RETENTION),
    )
    .await;
    assert!(
        matches!(completed, Ok(Ok(()))),
        "the complete waited on a task nobody runs: {completed:?}"
    );
    assert_eq!(
        store.begin(&id, fp, LEASE).await.expect("retry"),
        Begin::Replay(outcome)
    );
}

/// A store made on a runtime that has since shut down (built in a setup `block_on`, then
/// used from the application's runtime): what its calls leave running (the copies written to
/// Redis after answering, the stale-mirror repairs, the breaker's probe, an operator's
/// second delete) was spawned there, and a runtime that has shut down drops what is spawned
/// on it unrun. Outcomes were then never copied to Redis, and an operator's release
/// answered `Unavailable` on every try, its repair never run.
#[test]
fn a_store_made_on_a_runtime_since_shut_down_runs_what_its_calls_leave() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let (_redis, store) = made_on_a_runtime_since_shut_down().await;
        let (id, fp) = (fresh_id(), Fingerprint::of(b"made elsewhere"));
        let Ok(Begin::Execute(token)) = store.begin(&id, &fp, LEASE).await else {
            panic!("a fresh key")
        };
        let outcome = Outcome::new(201).with_body("elsewhere");
        store
            .complete(&id, token, &outcome, RETENTION)
            .await
            .expect("complete");
        store.drain().await;
        let copied = store.redis().peek(&id, &fp).await.expect("peek");
        assert!(
            matches!(&copied, idempotency_redis::Peek::Found(Begin::Replay(o)) if *o == outcome),
            "the outcome never reached Redis: {copied:?}"
        );
        let released = store
            .force_release(&id, ReleaseScope::default().with_completed())
            .await;
        assert!(
            matches!(released, Ok(idempotency_core::ForceReleased::Deleted)),
            "{released:?}"
        );
        store.drain().await;
        let left = store.redis().peek(&id, &fp).await.expect("peek");
        assert!(
            matches!(left, idempotency_redis::Peek::Absent),
            "the released outcome is still replayed from Redis: {left:?}"
        );
        first_requests_use_redis(&store, &fp, "made on a runtime since shut down").await;
    });
}

/// A claim answered on a runtime left idle (a sync worker's, between jobs) by a store made on a
/// runtime that has since shut down: the lease's mirror, written after answering, must run
/// somewhere that runs. Spawned on the caller's idle runtime, it never ran, and the
/// `complete` that waits for it (and past its budget for its cancellation) waited for good.
#[test]
fn a_claim_answered_on_an_idle_runtime_by_a_store_whose_own_has_shut_down_can_be_completed() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let (_redis, store) = made_on_a_runtime_since_shut_down().await;
        let fp = Fingerprint::of(b"idle, home gone");
        first_requests_use_redis(&store, &fp, "made on a runtime since shut down").await;
        a_claim_on_an_idle_runtime_completes(&store, &fp).await;
        let drained = tokio::time::timeout(Duration::from_secs(10), store.drain()).await;
        assert!(drained.is_ok(), "drain waited on a task nobody runs");
    });
}

/// A store made on a current-thread runtime that is kept but left idle (a setup runtime kept
/// in `main` while the application serves from another): what its calls leave running was
/// spawned there, never ran, and the `complete` waiting for a lease's mirror waited for good.
#[test]
fn a_store_made_on_a_runtime_left_idle_runs_what_its_calls_leave() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        // Its parts connected here: only the store is made on the idle runtime.
        let (_redis, parts) = dedicated_hybrid().await;
        let (store, _idle) = on_an_idle_runtime(move |rt| {
            rt.block_on(async {
                HybridStore::new(
                    parts.postgres().clone(),
                    parts.redis().clone(),
                    BreakerConfig::default(),
                )
            })
        })
        .await;
        let fp = Fingerprint::of(b"made on an idle runtime");
        let calls = async {
            load_scripts(&store, &fp).await;
            a_claim_on_an_idle_runtime_completes(&store, &fp).await;
            store.drain().await;
        };
        let ended = tokio::time::timeout(Duration::from_secs(30), calls).await;
        assert!(ended.is_ok(), "a call waited on a task nobody runs");
    });
}

/// A hybrid store on a Redis of its own, made on a multi-thread runtime that has shut down
/// since (a setup `Runtime::new().block_on(..)` on a thread of its own, then dropped). Its
/// parts are connected here: only the store is made there (connections a dead runtime made
/// fail once each, as the client libraries find them gone, which is not what this tests).
async fn made_on_a_runtime_since_shut_down() -> (Service, HybridStore) {
    let (redis, parts) = dedicated_hybrid().await;
    let store = std::thread::spawn(move || {
        let setup = tokio::runtime::Runtime::new().expect("runtime");
        setup.block_on(async {
            HybridStore::new(
                parts.postgres().clone(),
                parts.redis().clone(),
                BreakerConfig::default(),
            )
        })
    })
    .join()
    .expect("the setup thread");
    (redis, store)
}

/// Five first requests, each asking Redis first, none sent to Postgres alone for want of it.
async fn first_requests_use_redis(store: &HybridStore, fp: &Fingerprint, behind: &str) {
    let before = store.metrics();
    for _ in 0..5 {
        let begun = store.begin(&fresh_id(), fp, LEASE).await;
        assert!(matches!(begun, Ok(Begin::Execute(_))), "{begun:?}");
    }
    let after = store.metrics();
    assert_eq!(
        after.fallbacks, before.fallbacks,
        "calls went to Postgres alone {behind}: {after:?}"
    );
    assert!(after.redis_misses >= before.redis_misses + 5, "{after:?}");
}

/// A hybrid store whose breaker never opens, on a Redis of its own, with one stale-mirror
/// repair queued: a first request completed while Redis was paused.
async fn store_with_a_repair_queued(fp: &[u8]) -> (Service, Arc<HybridStore>) {
    let redis = services::start_redis(RedisOptions::default()).await;
    let pg = services::postgres().await.expect("postgres");
    let store = {
        let store = hybrid(pg_store(pg.url()).await, redis.url()).await;
        let config = BreakerConfig::default().failure_threshold(u32::MAX);
        Arc::new(HybridStore::new(
            store.postgres().clone(),
            store.redis().clone(),
            config,
        ))
    };
    redis.pause().await;
    first_requests(&store, &[fresh_id()], &Fingerprint::of(fp), 1, true).await;
    redis.unpause().await;
    (redis, store)
}

/// Runs `work` on a current-thread runtime of its own, on a thread of its own, then keeps
/// that runtime alive and idle (a sync worker's between two jobs: what was spawned on it
/// waits for its next `block_on`) until the returned guard drops.
async fn on_an_idle_runtime<T: Send + 'static>(
    work: impl FnOnce(&tokio::runtime::Runtime) -> T + Send + 'static,
) -> (T, IdleRuntime) {
    let (done, result) = tokio::sync::oneshot::channel();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let _ = done.send(work(&rt));
        let _ = stopped.recv();
    });
    let result = result.await.expect("the work on the idle runtime");
    (
        result,
        IdleRuntime {
            stop: Some(stop),
            thread: Some(thread),
        },
    )
}

/// See [`on_an_idle_runtime`]: dropped, the runtime is dropped with what it never ran.
struct IdleRuntime {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for IdleRuntime {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A hybrid store on a Redis of its own whose calls have `budget`, with `n` stale-mirror
/// repairs queued (completions made while that Redis was stopped: their ids), Redis started
/// again, the breaker still open.
async fn repair_backlog(
    budget: Duration,
    n: usize,
    fp: &Fingerprint,
) -> (Service, Arc<HybridStore>, Vec<RecordId>) {
    let redis = services::start_redis(RedisOptions::default()).await;
    let pg = services::postgres().await.expect("postgres");
    let fast = RedisStore::builder(redis.url())
        .prefix(idempotency_test::unique("h"))
        .connect_timeout(budget)
        .response_timeout(budget)
        .call_budget(budget)
        .eviction_check(idempotency_redis::EvictionCheck::Skip)
        .connect()
        .await
        .expect("redis store");
    let store = Arc::new(HybridStore::new(
        pg_store(pg.url()).await,
        fast,
        BreakerConfig::default(),
    ));
    assert!(breaker_closes(&store).await, "Redis answers at the start");
    redis.stop().await;
    // Completions while Redis is down: each leaves a repair behind.
    let ids: Vec<RecordId> = (0..n)
        .map(|_| idempotency_test::conformance::fresh_id())
        .collect();
    first_requests(&store, &ids, fp, 16, false).await;
    assert_ne!(store.metrics().breaker_state, BreakerState::Closed);
    redis.start().await;
    (redis, store, ids)
}

/// After a long outage, stale-mirror repairs pile up (every completion Redis could not be
/// told about). With Redis back and healthy, that backlog must drain and the breaker close,
/// with the default breaker, under steady load, even when one call's budget cannot cover the
/// whole backlog.
#[test]
fn a_repair_backlog_drains_once_redis_is_back() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let fp = Fingerprint::of(b"backlog");
        // A short call budget: one call clears about 2,000 repairs on this machine, a third
        // of the backlog.
        let (_redis, store, ids) = repair_backlog(Duration::from_millis(30), 6_000, &fp).await;
        // Steady load on completed keys: replays, from Postgres until Redis is back in use.
        // A bound on liveness, not a timing: the outage left the breaker's backoff at its
        // longest (5 s), and on a slow host a probe of a 30 ms budget may fail and wait that
        // again (about 6 s of the bound's 60 here; 20 s was too little for a slower CI host).
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut round = 0;
        while store.metrics().breaker_state != BreakerState::Closed
            || store.metrics().redis_hits == 0
        {
            assert!(
                Instant::now() < deadline,
                "the backlog kept Redis off: {:?}",
                store.metrics()
            );
            let wave = ids[(round % 20) * 16..][..16].to_vec();
            round += 1;
            futures::future::join_all(wave.iter().map(|id| store.begin(id, &fp, LEASE))).await;
        }
    });
}

/// Callers that arrive together once a probe closed the breaker over a repair backlog queue on
/// the repairs' lock; each is handed it as the one before runs out of budget, sends its
/// deletes, and runs out of budget itself a moment later. Redis answers them: that is no
/// failure. Before, each such caller counted as one, and the breaker opened again on a healthy
/// Redis (after every probe, until the backlog was gone).
#[test]
fn callers_handed_a_repair_backlog_as_their_budget_ends_do_not_open_the_breaker() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let fp = Fingerprint::of(b"handed");
        // A short call budget: one call clears a part of the backlog only (about 7,000). Not
        // shorter: a fifth of it, past which a caller's deletes left unanswered count as a
        // failure, must stay well above what this debug build takes to send a chunk.
        let (_redis, store, _) = repair_backlog(Duration::from_millis(100), 24_000, &fp).await;
        // Until the breaker's own probe closes it, calls go to Postgres; none drains the
        // backlog but the probe (a budget's worth). A bound on liveness (see above: the
        // breaker's backoff is at its longest, and a probe may fail on a slow host).
        let deadline = Instant::now() + Duration::from_secs(60);
        while store.metrics().breaker_state != BreakerState::Closed {
            assert!(Instant::now() < deadline, "{:?}", store.metrics());
            let id = idempotency_test::conformance::fresh_id();
            let _ = store.begin(&id, &fp, LEASE).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let opened = store.metrics().breaker_opened;
        // Sixteen callers at once, on the backlog left.
        let wave: Vec<RecordId> = (0..16)
            .map(|_| idempotency_test::conformance::fresh_id())
            .collect();
        futures::future::join_all(wave.iter().map(|id| store.begin(id, &fp, LEASE))).await;
        assert_eq!(
            store.metrics().breaker_opened,
            opened,
            "a healthy Redis was switched off: {:?}",
            store.metrics()
        );
    });
}

/// An operator's `force_release` of a completed record while Redis is unreachable changes
/// nothing and says so (`Unavailable`): Redis still holds the outcome, which would replay the
/// record from every gateway. Postgres deleted it first before, answered `Unavailable` all the
/// same, and the operator's call made again (as that answer invited) found the record of the
/// request that had run under the key since and deleted it: the key ran a third time. An
/// in-flight record is released while Redis is down, whatever the scope asked, and the answer
/// says so: its mirror is deleted once Redis is back. And once Redis answers, the release
/// goes through at once, the breaker still open (a call through it would have been refused).
#[test]
fn a_completed_record_is_not_released_while_redis_cannot_be_told() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let _serial = SERIAL.lock().await;
        let redis = services::start_redis(RedisOptions::default()).await;
        let pg = services::postgres().await.expect("postgres");
        let behind = redis_behind(redis.url(), &idempotency_test::unique("h")).await;
        // Open for 5 s once it opens: still open when the release below is asked, Redis back.
        let breaker =
            BreakerConfig::default().backoff(Duration::from_secs(5), Duration::from_secs(5));
        // Mirrors that outlast the test: only the release's delete removes one.
        let long = Duration::from_secs(60);
        let store = HybridStore::new(pg_store(pg.url()).await, behind, breaker)
            .with_in_flight_mirror_ttl(long);
        let (id, fp) = (
            idempotency_test::conformance::fresh_id(),
            Fingerprint::of(b"forget"),
        );
        let Begin::Execute(token) = store.begin(&id, &fp, LEASE).await.expect("begin") else {
            panic!("a fresh key executes")
        };
        let outcome = Outcome::new(201).with_body("charged");
        store
            .complete(&id, token, &outcome, RETENTION)
            .await
            .expect("complete");
        assert!(matches!(
            store.redis().peek(&id, &fp).await,
            Ok(idempotency_redis::Peek::Found(Begin::Replay(_)))
        ));
        let (held, held_fp) = (
            idempotency_test::conformance::fresh_id(),
            Fingerprint::of(b"held"),
        );
        let Begin::Execute(_) = store.begin(&held, &held_fp, long).await.expect("begin") else {
            panic!("a fresh key executes")
        };
        mirror_landed(&store, &held, &held_fp).await;

        redis.pause().await;
        while store.metrics().breaker_state != BreakerState::Open {
            let probe = idempotency_test::conformance::fresh_id();
            let _ = store.begin(&probe, &Fingerprint::of(b"p"), LEASE).await;
        }
        for _ in 0..2 {
            let answer = store
                .force_release(&id, ReleaseScope::default().with_completed())
                .await;
            assert!(
                matches!(answer, Err(Error::Unavailable(_))),
                "Redis still holds the copy: {answer:?}"
            );
            assert!(
                matches!(
                    store.postgres().inspect(&id).await.expect("inspect"),
                    Some(Inspection {
                        state: RecordState::Completed { status: 201 },
                        ..
                    })
                ),
                "nothing was released"
            );
            let retry = store.begin(&id, &fp, LEASE).await.expect("begin");
            assert!(
                matches!(retry, Begin::Replay(_)),
                "a retry ran the key again: {retry:?}"
            );
        }
        assert_eq!(
            store
                .force_release(&held, ReleaseScope::default().with_live().with_completed())
                .await
                .expect("an in-flight record is released while Redis is down"),
            idempotency_core::ForceReleased::Released
        );
        // No record: said so (an error would invite a repeat, which would delete the record
        // of a request run under the key since), its copy's delete left queued.
        let none = store
            .force_release(
                &idempotency_test::conformance::fresh_id(),
                ReleaseScope::default().with_completed(),
            )
            .await;
        assert_eq!(none.ok(), Some(idempotency_core::ForceReleased::Absent));
        redis.unpause().await;
        assert_eq!(store.metrics().breaker_state, BreakerState::Open);
        assert_eq!(
            store
                .force_release(&id, ReleaseScope::default().with_completed())
                .await
                .expect("released once Redis answers"),
            idempotency_core::ForceReleased::Deleted
        );
        assert!(
            matches!(
                store.redis().peek(&id, &fp).await,
                Ok(idempotency_redis::Peek::Absent)
            ),
            "the copy is gone"
        );

        assert!(breaker_closes(&store).await, "{:?}", store.metrics());
        assert!(
            matches!(
                store.redis().peek(&held, &held_fp).await,
                Ok(idempotency_redis::Peek::Absent)
            ),
            "the released lease's mirror was deleted once Redis answered again"
        );
        assert!(matches!(
            store.begin(&held, &held_fp, LEASE).await.expect("begin"),
            Begin::Execute(_)
        ));
        assert!(matches!(
            store.begin(&id, &fp, LEASE).await.expect("begin"),
            Begin::Execute(_)
        ));
    });
}

/// Whether Redis holds `key` (read on a connection of the test's own, not the store's).
async fn exists(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async(conn)
        .await
        .expect("exists")
}

/// Postgres, Redis, and a Redis key prefix of its own (for two stores on one Redis, as two
/// processes); `None` when the services are skipped.
async fn two_services() -> Option<(&'static Service, &'static Service, String)> {
    if services::skipping() {
        return None;
    }
    let pg = services::postgres().await.expect("postgres");
    let redis = services::redis().await.expect("redis");
    Some((pg, redis, idempotency_test::unique("h")))
}

/// A connection of its own to the Redis at `url`, behind every store's back.
async fn direct_redis(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection")
}

/// A transaction on `pool` that holds `id`'s row locked (`FOR UPDATE`) until it ends.
async fn row_locked<'p>(pool: &'p PgPool, id: &RecordId) -> sqlx::Transaction<'p, sqlx::Postgres> {
    let mut tx = pool.begin().await.expect("tx");
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE record_id = $1 FOR UPDATE")
        .bind(&id.as_bytes()[..])
        .execute(&mut *tx)
        .await
        .expect("lock the row");
    tx
}

/// A record `store` completed on a fresh key, whose Redis copy (on the Redis at
/// `redis_url`) is then deleted behind the store's back, as an eviction would.
async fn completed_then_evicted(
    redis_url: &str,
    store: &HybridStore,
    fp: &Fingerprint,
) -> RecordId {
    completed_with_then_evicted(redis_url, store, fp, &Outcome::new(201)).await
}

/// [`completed_then_evicted`] with `outcome`.
async fn completed_with_then_evicted(
    redis_url: &str,
    store: &HybridStore,
    fp: &Fingerprint,
    outcome: &Outcome,
) -> RecordId {
    let id = fresh_id();
    let Begin::Execute(token) = store
        .begin(&id, fp, idempotency_test::conformance::LONG)
        .await
        .expect("begin")
    else {
        panic!("a fresh key")
    };
    store
        .complete(&id, token, outcome, Duration::from_secs(3600))
        .await
        .expect("complete");
    store.drain().await;
    let mut conn = direct_redis(redis_url).await;
    let evicted: i64 = redis::cmd("DEL")
        .arg(store.redis().key(&id))
        .query_async(&mut conn)
        .await
        .expect("del");
    assert_eq!(evicted, 1, "no copy to evict");
    id
}

/// A replay Postgres answered slowly (here its reply took 3 s on the network; so too a slow
/// server), read before an operator's release of the record, is not copied into Redis after
/// the release's second delete: it replayed there for the record's whole retention, and the
/// key never ran again. The release's second delete allows for writes on their way by one
/// Postgres call budget; a claim answered later than that is not copied.
#[test]
fn a_replay_answered_after_an_operators_release_is_not_copied_to_redis() {
    use idempotency_test::{conformance::LONG, relay};

    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        let relay = idempotency_test::relay::delaying_relay(relay::upstream(pg.url())).await;
        let slow_url = relay::through(pg.url(), relay.port);
        let prefix = idempotency_test::unique("h");
        // Per request: a group-commit batch gives up after two call budgets, sooner than
        // the release's second delete; a single statement is bounded only by the claim's four.
        let slow_pg = PostgresStore::builder(&slow_url)
            .per_request()
            .call_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("postgres store");
        let gateway = hybrid_with_prefix(slow_pg, redis.url(), &prefix).await;
        let operator = hybrid_with_prefix(pg_store(pg.url()).await, redis.url(), &prefix).await;
        let fp = Fingerprint::of(b"charge");
        // Its copy is evicted: the next claim asks Postgres, whose reply comes late.
        let id = completed_then_evicted(redis.url(), &gateway, &fp).await;
        relay.delay_replies(Duration::from_millis(3200));
        let slow = released_while_read(&gateway, &operator, id, fp).await;
        let gave_up = slow.await.expect("task");
        assert!(matches!(gave_up, Err(Error::Unavailable(_))), "{gave_up:?}");
        operator.drain().await; // the release's second delete
        gateway.drain().await; // the slow claim, to its end
        relay.delay_replies(Duration::ZERO);
        let again = operator.begin(&id, &fp, LONG).await.expect("begin");
        assert!(
            matches!(again, Begin::Execute(_)),
            "a deleted record replayed: {again:?}"
        );
    });
}

/// A replay Postgres read just before an operator's release in the same process deleted the
/// record, and answered after that release had deleted its copy in Redis, must not copy
/// the deleted outcome back. The release waits for this process's writes on their way, but
/// this copy was not on its way yet when it looked. Before, it landed after the release's
/// delete, and every retry replayed the deleted record until the release's second delete,
/// seconds later (found by running the linearizability check on the hybrid store).
#[test]
fn a_replay_read_before_this_processs_release_is_not_copied_after_it() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::redis().await.expect("redis");
        let (relay, store) = hybrid_behind_a_delaying_relay(redis.url()).await;
        let fp = Fingerprint::of(b"charge");
        let body = idempotency_test::unique("released-outcome");
        let outcome = Outcome::new(201).with_body(body.clone());
        // Its copy is evicted: the next claim asks Postgres.
        let id = completed_with_then_evicted(redis.url(), &store, &fp, &outcome).await;
        // Only the reply that carries the outcome is held back, within the claim's budget:
        // the release's statements pass at once.
        relay.delay_replies_containing(Duration::from_millis(800), body.as_bytes());
        let reading = released_while_read(&store, &store, id, fp).await;
        let read = reading.await.expect("task").expect("begin");
        assert_eq!(read, Begin::Replay(outcome), "read before the release");
        free_once_writes_landed(&store, id, fp, "a deleted record replayed").await;
    });
}

/// The same for a lease: a claim Postgres granted just before an operator's release in
/// the same process released it, answered after that release had deleted in Redis, must
/// not write its lease's mirror: landing after the delete, it said "in flight" for a lease
/// that was over, to every retry, for the mirror's TTL (found by running the
/// linearizability check on the hybrid store).
#[test]
fn a_grant_made_before_this_processs_release_is_not_mirrored_after_it() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::redis().await.expect("redis");
        let (relay, store) = hybrid_behind_a_delaying_relay(redis.url()).await;
        let (id, fp) = (fresh_id(), Fingerprint::of(b"charge"));
        // Only a grant's reply is held back, within the claim's budget: a row of five
        // columns (inserted, three nulls, the lease left: 35 bytes with its length). The
        // release's rows have one or two.
        relay.delay_replies_containing(Duration::from_millis(800), b"D\x00\x00\x00\x23\x00\x05");
        let scope = ReleaseScope::default().with_live();
        let claiming = released_while_claimed(&store, &store, id, fp, scope).await;
        let granted = claiming.await.expect("task").expect("begin");
        assert!(matches!(granted, Begin::Execute(_)), "{granted:?}");
        relay.delay_replies(Duration::ZERO);
        free_once_writes_landed(&store, id, fp, "a released lease is in flight").await;
    });
}

/// A hybrid claim whose Postgres reply hangs after the commit, under a lease longer than
/// the hybrid's budget and shorter than the Postgres claim's own bound (four budgets): once
/// the caller is gone, the grant is looked for and given back, so a retry after the lease
/// ran out runs as new. The hybrid did not tell the Postgres claim that its caller was gone:
/// the grant was looked for only at that bound, after the lease, and the retry took the key
/// over as an attempt whose outcome is unknown, for an operation that never ran.
#[test]
fn a_hung_grant_under_a_short_lease_is_given_back_once_the_hybrids_caller_is_gone() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let redis = services::redis().await.expect("redis");
        let pg = services::postgres().await.expect("postgres");
        let shared = pg_store(pg.url()).await;
        let (relay, store) = hybrid_behind_a_delaying_relay(redis.url()).await;
        let (id, fp) = (fresh_id(), Fingerprint::of(b"charge"));
        let lease = Duration::from_secs(5);
        let started = tokio::time::Instant::now();
        relay.delay_replies_containing(Duration::from_secs(15), b"SELECT ");
        let begin = store.begin(&id, &fp, lease).await;
        relay.delay_replies_containing(Duration::ZERO, b"SELECT ");
        assert!(matches!(begin, Err(Error::Unavailable(_))), "{begin:?}");
        // The lease over (5 s), the Postgres claim's bound (8 s) not yet.
        tokio::time::sleep_until(started + Duration::from_millis(6_000)).await;
        let retry = shared
            .begin(&id, &fp, idempotency_test::conformance::LONG)
            .await
            .expect("retry");
        assert!(
            matches!(retry, Begin::Execute(_)),
            "an operation that never ran reads as an unknown outcome: {retry:?}"
        );
    });
}

/// Once a write made after answering would have landed (300 ms, well before the release's
/// second delete), the key is free: the next `begin` executes; `what` says what it found
/// instead.
async fn free_once_writes_landed(store: &HybridStore, id: RecordId, fp: Fingerprint, what: &str) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = store
        .begin(&id, &fp, idempotency_test::conformance::LONG)
        .await
        .expect("begin");
    assert!(matches!(again, Begin::Execute(_)), "{what}: {again:?}");
}

/// A hybrid store on the shared Redis at `redis_url` and, per request with a 2 s budget,
/// on the shared Postgres through a relay that can hold its replies back.
async fn hybrid_behind_a_delaying_relay(
    redis_url: &str,
) -> (idempotency_test::relay::DelayingRelay, HybridStore) {
    use idempotency_test::relay;

    let pg = services::postgres().await.expect("postgres");
    let relay = relay::delaying_relay(relay::upstream(pg.url())).await;
    let store = hybrid(
        PostgresStore::builder(relay::through(pg.url(), relay.port))
            .per_request()
            .call_timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("postgres store"),
        redis_url,
    )
    .await;
    store.postgres().migrate().await.expect("migrate");
    (relay, store)
}

/// Starts a `begin` of `id` on `reader` (a task), and once its row was read (200 ms later),
/// deletes the completed record with an operator's release on `operator`.
async fn released_while_read(
    reader: &HybridStore,
    operator: &HybridStore,
    id: RecordId,
    fp: Fingerprint,
) -> tokio::task::JoinHandle<idempotency_core::Result<Begin>> {
    let scope = ReleaseScope::default().with_completed();
    released_while_claimed(reader, operator, id, fp, scope).await
}

/// Starts a `begin` of `id` on `reader` (a task), and once its statement ran (200 ms later),
/// releases the record in `scope` with an operator's release on `operator`, which must
/// find it: a completed record deleted, or a live lease released.
async fn released_while_claimed(
    reader: &HybridStore,
    operator: &HybridStore,
    id: RecordId,
    fp: Fingerprint,
    scope: ReleaseScope,
) -> tokio::task::JoinHandle<idempotency_core::Result<Begin>> {
    let reading = {
        let reader = reader.clone();
        tokio::spawn(async move {
            reader
                .begin(&id, &fp, idempotency_test::conformance::LONG)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await; // the statement ran
    let released = operator.force_release(&id, scope).await.expect("release");
    assert!(
        matches!(
            released,
            idempotency_core::ForceReleased::Deleted | idempotency_core::ForceReleased::Released
        ),
        "{released:?}"
    );
    reading
}

/// An outcome's copy held up on its way to Redis (a partition TCP retransmits across once
/// it heals, a stalled host) past an operator's release and its second delete, from
/// another process: it must not land. Every copy carries a deadline (four Redis call
/// budgets after it was sent, by Redis' clock): past it, it writes nothing. Before, it
/// landed and replayed the released record's outcome until the row's retention would have
/// ended, in every process.
#[test]
fn a_copy_held_up_past_an_operators_release_does_not_land() {
    use idempotency_test::{conformance::LONG, relay};

    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        let relay = relay::delaying_relay(relay::upstream(redis.url())).await;
        let prefix = idempotency_test::unique("h");
        let gateway = hybrid_with_prefix(
            pg_store(pg.url()).await,
            &relay::through(redis.url(), relay.port),
            &prefix,
        )
        .await;
        let operator = hybrid_with_prefix(pg_store(pg.url()).await, redis.url(), &prefix).await;
        let (id, fp) = (fresh_id(), Fingerprint::of(b"held up"));
        load_scripts(&gateway, &fp).await;
        let Begin::Execute(token) = gateway.begin(&id, &fp, LONG).await.expect("begin") else {
            panic!("a fresh key")
        };
        mirror_landed(&gateway, &id, &fp).await;
        // The gateway's copy leaves now and reaches Redis in 4 s: the call gives up first.
        relay.delay_requests(Duration::from_secs(4));
        let sent = Instant::now();
        gateway
            .complete(&id, token, &Outcome::new(201), Duration::from_secs(3600))
            .await
            .expect("complete");
        let released = operator
            .force_release(&id, ReleaseScope::default().with_completed())
            .await
            .expect("release");
        assert_eq!(released, idempotency_core::ForceReleased::Deleted);
        operator.drain().await; // the release's second delete (2.2 s on)
        relay.delay_requests(Duration::ZERO);
        tokio::time::sleep_until((sent + Duration::from_millis(4_500)).into()).await;
        let again = operator.begin(&id, &fp, LONG).await.expect("begin");
        assert!(
            matches!(again, Begin::Execute(_)),
            "a released record replayed from a late copy: {again:?}"
        );
    });
}

/// An operator's second delete (the one that catches a copy landing after the release) is
/// tried until Redis takes it, not once: a copy that landed after the first delete, in a
/// process whose Redis blipped as the second went out, replayed the released record for its
/// whole retention — from every gateway, though Postgres had no row — when that process made
/// no Redis call after (the admin CLI exits; a process whose caching is off makes none).
#[test]
fn an_operators_second_delete_is_tried_until_redis_takes_it() {
    use idempotency_test::{conformance::LONG, relay};

    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        let relay = relay::stalling_relay(relay::upstream(redis.url())).await;
        let prefix = idempotency_test::unique("h");
        let gateway = hybrid_with_prefix(pg_store(pg.url()).await, redis.url(), &prefix).await;
        let operator = hybrid_with_prefix(
            pg_store(pg.url()).await,
            &relay::through(redis.url(), relay.port),
            &prefix,
        )
        .await;
        let (id, fp) = (fresh_id(), Fingerprint::of(b"second delete"));
        let Begin::Execute(token) = gateway.begin(&id, &fp, LONG).await.expect("begin") else {
            panic!("a fresh key")
        };
        gateway
            .complete(&id, token, &Outcome::new(201), Duration::from_secs(3600))
            .await
            .expect("complete");
        let mut direct = redis::Client::open(redis.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        let key = gateway.redis().key(&id);
        let copy: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut direct)
            .await
            .expect("get");
        let copy = copy.expect("the outcome's copy");
        let released = operator
            .force_release(&id, ReleaseScope::default().with_completed())
            .await
            .expect("release");
        assert_eq!(released, idempotency_core::ForceReleased::Deleted);
        // A copy on its way (a replay another gateway answered from Postgres just before)
        // lands after the first delete; the operator's Redis goes down before the second.
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(&copy)
            .arg("PX")
            .arg(3_600_000)
            .query_async(&mut direct)
            .await
            .expect("set");
        relay.cut_off();
        // The second delete goes out 3.5 s after the release (two Postgres call timeouts, ten
        // Redis budgets), and fails.
        tokio::time::sleep(Duration::from_secs(5)).await;
        relay.fail_over();
        let drained = tokio::time::timeout(Duration::from_secs(30), operator.drain()).await;
        assert!(drained.is_ok(), "the second delete never got through");
        let left: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut direct)
            .await
            .expect("get");
        assert!(
            left.is_none(),
            "the released record's copy is still in Redis"
        );
        let again = gateway.begin(&id, &fp, LONG).await.expect("begin");
        assert!(
            matches!(again, Begin::Execute(_)),
            "a released record replayed from a late copy: {again:?}"
        );
    });
}

/// A replay Postgres answered does not wait for its copy into Redis. Awaited, the copy's
/// budget came on top of a slow Postgres read, and a slow Redis (here its requests arrive
/// 1 s late, inside the 3 s budget) held the answer up by that much, or past the claim's
/// deadline into a 503 for a retry whose answer Postgres had given. The copy lands after.
#[test]
fn a_replay_postgres_answered_does_not_wait_for_its_copy() {
    use idempotency_test::{conformance::LONG, relay};

    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        let pg_relay = relay::delaying_relay(relay::upstream(pg.url())).await;
        let redis_relay = relay::delaying_relay(relay::upstream(redis.url())).await;
        let slow_pg = PostgresStore::builder(relay::through(pg.url(), pg_relay.port))
            .per_request()
            .call_timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("postgres store");
        slow_pg.migrate().await.expect("migrate");
        let slow_redis = RedisStore::builder(relay::through(redis.url(), redis_relay.port))
            .prefix(idempotency_test::unique("h"))
            .response_timeout(Duration::from_secs(3))
            .call_budget(Duration::from_secs(3))
            .eviction_check(idempotency_redis::EvictionCheck::Skip)
            .connect()
            .await
            .expect("redis store");
        let gateway = HybridStore::new(slow_pg, slow_redis, BreakerConfig::default());
        let fp = Fingerprint::of(b"slow copy");
        // Its copy is evicted: the next claim asks Postgres, which replays.
        let id = completed_then_evicted(redis.url(), &gateway, &fp).await;
        let mut direct = redis::Client::open(redis.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        let key = gateway.redis().key(&id);

        // Postgres answers 2 s late; once the peek has missed, Redis hears of requests 1 s
        // late: only the copy is slow.
        pg_relay.delay_replies(Duration::from_secs(2));
        let misses = gateway.metrics().redis_misses;
        let replay = {
            let gateway = gateway.clone();
            tokio::spawn(async move { gateway.begin(&id, &fp, LONG).await })
        };
        let mut peeked = false;
        for _ in 0..500 {
            if gateway.metrics().redis_misses > misses {
                peeked = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            peeked,
            "the claim never asked Redis: {:?}",
            gateway.metrics()
        );
        redis_relay.delay_requests(Duration::from_secs(1));
        let answer = replay.await.expect("task").expect("begin");
        assert!(matches!(answer, Begin::Replay(_)), "{answer:?}");
        assert!(
            !exists(&mut direct, &key).await,
            "the replay was answered only once Redis had its copy"
        );
        let mut landed = false;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            landed = exists(&mut direct, &key).await;
            if landed {
                break;
            }
        }
        assert!(landed, "the copy never landed: {:?}", gateway.metrics());
        redis_relay.delay_requests(Duration::ZERO);
        pg_relay.delay_replies(Duration::ZERO);
        assert!(matches!(
            gateway.begin(&id, &fp, LONG).await.expect("begin"),
            Begin::Replay(_)
        ));
        assert!(
            gateway.metrics().redis_hits > 0,
            "the retry after the copy landed was not answered by Redis: {:?}",
            gateway.metrics()
        );
    });
}

/// A copy whose task starts late (a starved runtime: here a thread that blocks for
/// longer than a Postgres call budget before the task first runs) is not sent: an
/// operator's release of the record and its second delete, which allow for copies on their
/// way by one Postgres call budget after the read, may be over by then, and the copy would
/// replay the deleted record from Redis for its whole retention. The bound was checked only
/// when the task was spawned.
#[test]
fn a_copy_whose_task_starts_late_is_not_sent() {
    use idempotency_test::conformance::LONG;

    let Some((pg_url, redis_url)) = block_on(async {
        if services::skipping() {
            return None;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        Some((pg.url().to_owned(), redis.url().to_owned()))
    }) else {
        return;
    };
    // One thread: a task spawned there runs only when the test's own future yields.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let gateway = hybrid(pg_store(&pg_url).await, &redis_url).await;
        let fp = Fingerprint::of(b"late task");
        let id = completed_then_evicted(&redis_url, &gateway, &fp).await;
        let answer = gateway.begin(&id, &fp, LONG).await.expect("begin");
        assert!(matches!(answer, Begin::Replay(_)), "{answer:?}");
        // The runtime is starved past the Postgres call budget (1 s) before the copy runs.
        std::thread::sleep(gateway.postgres().call_timeout() + Duration::from_millis(200));
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut direct = redis::Client::open(redis_url.as_str())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        assert!(
            !exists(&mut direct, &gateway.redis().key(&id)).await,
            "a replay's copy sent past its bound landed"
        );

        // So too an outcome's copy after `complete`, when no lease mirror waits for it.
        let gateway = hybrid(pg_store(&pg_url).await, &redis_url)
            .await
            .with_in_flight_mirror_ttl(Duration::ZERO);
        let id = fresh_id();
        let Begin::Execute(token) = gateway.begin(&id, &fp, LONG).await.expect("begin") else {
            panic!("a fresh key")
        };
        gateway
            .complete(&id, token, &Outcome::new(201), RETENTION)
            .await
            .expect("complete");
        std::thread::sleep(gateway.postgres().call_timeout() + Duration::from_millis(200));
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !exists(&mut direct, &gateway.redis().key(&id)).await,
            "an outcome's copy sent past its bound landed"
        );
    });
}

/// A `complete` of a fresh claim whose Postgres write committed while its future was held
/// (polled until it waited on a row lock, then not again), still to be polled; its lease's
/// mirror had landed in Redis. The gateway's Postgres store works per request (the
/// completion is one statement, sent from the caller's future), with a 1 s call budget.
struct HeldCompletion {
    gateway: HybridStore,
    id: RecordId,
    fp: Fingerprint,
    completing:
        std::pin::Pin<Box<dyn std::future::Future<Output = idempotency_core::Result<()>> + Send>>,
}

async fn held_completion(pg: &Service, redis: &Service, prefix: &str) -> HeldCompletion {
    use idempotency_test::conformance::LONG;

    let gateway_pg = PostgresStore::builder(pg.url())
        .call_timeout(Duration::from_secs(1))
        .per_request()
        .connect()
        .await
        .expect("postgres store");
    gateway_pg.migrate().await.expect("migrate");
    let gateway = hybrid_with_prefix(gateway_pg, redis.url(), prefix).await;
    let fp = Fingerprint::of(b"held completion");
    let id = fresh_id();
    let Begin::Execute(token) = gateway.begin(&id, &fp, LONG).await.expect("begin") else {
        panic!("a fresh key")
    };
    mirror_landed(&gateway, &id, &fp).await;

    // The completion is sent and waits on a row lock another transaction holds.
    let direct = PgPool::connect(pg.url()).await.expect("pool");
    let blocker = row_locked(&direct, &id).await;
    let completing = {
        let gateway = gateway.clone();
        let outcome = Outcome::new(201).with_body("held");
        Box::pin(async move { gateway.complete(&id, token, &outcome, RETENTION).await })
    };
    let mut held = HeldCompletion {
        gateway,
        id,
        fp,
        completing,
    };
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut held.completing)
            .await
            .is_err(),
        "the completion waits on the lock"
    );
    // The lock goes, and the write commits while the future is held.
    blocker.commit().await.expect("commit");
    let state = "SELECT state FROM idempotency_keys WHERE record_id = $1";
    while sqlx::query_scalar::<_, i16>(state)
        .bind(&id.as_bytes()[..])
        .fetch_one(&direct)
        .await
        .expect("read the row")
        == 0
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held
}

/// A `complete` future held between its Postgres write and its outcome's copy (a frozen
/// process, a caller that stopped polling it) sends no copy past the bound counted from the
/// write: an operator may have deleted the record meanwhile, and its second delete be over,
/// so the copy would replay the deleted record from Redis for its whole retention. The
/// copy made in the call (a lease mirror waited for it) had a bound only from its sending.
#[test]
fn a_completion_held_after_its_write_does_not_copy_a_record_deleted_meanwhile() {
    use idempotency_test::conformance::LONG;

    block_on(async {
        let Some((pg, redis, prefix)) = two_services().await else {
            return;
        };
        let held = held_completion(pg, redis, &prefix).await;
        let (gateway, id) = (&held.gateway, held.id);
        // An operator deletes the outcome, and its deletes are over.
        let operator = hybrid_with_prefix(pg_store(pg.url()).await, redis.url(), &prefix).await;
        let released = operator
            .force_release(&id, ReleaseScope::default().with_completed())
            .await
            .expect("release");
        assert_eq!(released, idempotency_core::ForceReleased::Deleted);
        // Held past the copy's bound: a Postgres call budget and five Redis budgets.
        tokio::time::sleep(gateway.postgres().call_timeout() + Duration::from_secs(1)).await;
        held.completing.await.expect("complete");

        let mut conn = direct_redis(redis.url()).await;
        assert!(
            !exists(&mut conn, &gateway.redis().key(&id)).await,
            "a copy sent past its bound landed"
        );
        let answer = gateway.begin(&id, &held.fp, LONG).await.expect("begin");
        assert!(matches!(answer, Begin::Execute(_)), "{answer:?}");
    });
}

/// An operator's release in the same process, between a `complete`'s Postgres write and its
/// outcome's copy: the release does not wait for that copy (it is sent from the call, not
/// from a task of its own), and a copy that landed after the release's delete replayed the
/// released record until the second delete, seconds later. The copy now replaces only its
/// own lease's mirror, which the release deleted.
#[test]
fn a_release_between_a_completions_write_and_its_copy_is_not_undone() {
    use idempotency_test::conformance::LONG;

    block_on(async {
        let Some((pg, redis, prefix)) = two_services().await else {
            return;
        };
        let held = held_completion(pg, redis, &prefix).await;
        let (gateway, id) = (&held.gateway, held.id);
        let released = gateway
            .force_release(&id, ReleaseScope::default().with_completed())
            .await
            .expect("release");
        assert_eq!(released, idempotency_core::ForceReleased::Deleted);
        // At once: well within the copy's bound.
        held.completing.await.expect("complete");

        let mut conn = direct_redis(redis.url()).await;
        assert!(
            !exists(&mut conn, &gateway.redis().key(&id)).await,
            "the copy landed after the release"
        );
        let answer = gateway.begin(&id, &held.fp, LONG).await.expect("begin");
        assert!(matches!(answer, Begin::Execute(_)), "{answer:?}");
    });
}

/// An operation longer than its lease's mirror lives (2 s by default, renewals extend only
/// a mirror still there) finds no mirror to replace when it completes: its outcome is copied
/// all the same, so Redis replays it (and does while Postgres is down). With the copy fenced
/// on the mirror alone, nothing was copied.
#[test]
fn a_completion_whose_mirror_ran_out_is_still_copied() {
    use idempotency_test::conformance::LONG;

    block_on(async {
        let Some((pg, redis, prefix)) = two_services().await else {
            return;
        };
        let gateway = hybrid_with_prefix(pg_store(pg.url()).await, redis.url(), &prefix)
            .await
            .with_in_flight_mirror_ttl(Duration::from_millis(200));
        let (id, fp) = (fresh_id(), Fingerprint::of(b"long operation"));
        let Begin::Execute(token) = gateway.begin(&id, &fp, LONG).await.expect("begin") else {
            panic!("a fresh key")
        };
        mirror_landed(&gateway, &id, &fp).await;
        let mut conn = direct_redis(redis.url()).await;
        while exists(&mut conn, &gateway.redis().key(&id)).await {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let outcome = Outcome::new(201).with_body("long");
        gateway
            .complete(&id, token, &outcome, RETENTION)
            .await
            .expect("complete");
        assert_eq!(
            gateway.redis().peek(&id, &fp).await.expect("peek"),
            idempotency_redis::Peek::Found(Begin::Replay(outcome)),
            "the outcome is in Redis"
        );
    });
}

/// A copy past its bound deletes the lease's mirror instead of replacing it with the
/// outcome, and leaves the mirror's repair queued: a mirror write stranded in a connection
/// the client gave up on can still land after that delete (no outcome is there for its
/// `SET NX` to fail on), and would answer "in flight" for a completed record until its TTL.
/// Before, the repair was called off as if the outcome had been written.
#[test]
fn a_copy_that_deleted_instead_of_writing_keeps_the_mirrors_repair() {
    use idempotency_test::conformance::LONG;

    block_on(async {
        let Some((pg, redis, prefix)) = two_services().await else {
            return;
        };
        let held = held_completion(pg, redis, &prefix).await;
        let (gateway, id) = (&held.gateway, held.id);
        let mut conn = direct_redis(redis.url()).await;
        let key = gateway.redis().key(&id);
        let mirror: Vec<u8> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("the mirror");
        tokio::time::sleep(gateway.postgres().call_timeout() + Duration::from_secs(1)).await;
        held.completing.await.expect("complete");
        assert!(!exists(&mut conn, &key).await, "deleted, not copied");

        // The stranded mirror write lands now.
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(mirror)
            .arg("PX")
            .arg(60_000)
            .query_async(&mut conn)
            .await
            .expect("set");
        // The store's next Redis call runs the queued repairs first.
        let other = gateway.begin(&fresh_id(), &held.fp, LONG).await;
        assert!(matches!(other, Ok(Begin::Execute(_))), "{other:?}");
        assert!(
            !exists(&mut conn, &key).await,
            "the stale mirror was repaired"
        );
        let answer = gateway.begin(&id, &held.fp, LONG).await.expect("begin");
        assert!(matches!(answer, Begin::Replay(_)), "{answer:?}");
    });
}

/// The second delete of an operator's release counts from when its Postgres delete may
/// have committed, not from when it was asked: a delete that waited on a row lock (here
/// 3.3 s of a 4 s budget) left a gateway that read the row just before it time to hear
/// back late (2.8 s, within its 3 s budget) and copy its replay after the second delete,
/// and the released record replayed from Redis.
#[test]
fn a_release_whose_delete_committed_late_still_outlasts_the_copies() {
    use idempotency_test::{conformance::LONG, relay};

    block_on(async {
        let Some((pg, redis, prefix)) = two_services().await else {
            return;
        };
        // The gateway's replies come late, and its pool sends nothing before a call (no
        // ping of an idle connection): the claim is its one round trip.
        let gateway_pg = relay::delaying_relay(relay::upstream(pg.url())).await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .test_before_acquire(false)
            .connect_lazy(&relay::through(pg.url(), gateway_pg.port))
            .expect("pool");
        let gateway_store = PostgresStore::from_pool(pool);
        gateway_store.migrate().await.expect("migrate");
        let gateway = hybrid_with_prefix(gateway_store, redis.url(), &prefix).await;
        let budget = Duration::from_secs(4);
        let operator_store = PostgresStore::builder(pg.url())
            .statement_timeout(budget)
            .call_timeout(budget)
            .connect()
            .await
            .expect("postgres store");
        let operator = hybrid_with_prefix(operator_store, redis.url(), &prefix).await;
        let fp = Fingerprint::of(b"late delete");
        // The copy is evicted: the gateway's next claim reads Postgres.
        let id = completed_then_evicted(redis.url(), &gateway, &fp).await;

        // The operator's delete waits on a lock another transaction holds on the row.
        let direct = PgPool::connect(pg.url()).await.expect("pool");
        let blocker = row_locked(&direct, &id).await;
        let release = {
            let operator = operator.clone();
            tokio::spawn(async move {
                operator
                    .force_release(&id, ReleaseScope::default().with_completed())
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(3_000)).await;
        // Reads the row (a lock does not hide it from readers) just before the delete
        // commits; hears back 2.8 s later.
        gateway_pg.delay_replies(Duration::from_millis(2_800));
        let replay = {
            let gateway = gateway.clone();
            tokio::spawn(async move { gateway.begin(&id, &fp, LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        blocker.commit().await.expect("unlock");
        let replay = replay.await.expect("task").expect("begin");
        assert!(matches!(replay, Begin::Replay(_)), "{replay:?}");
        let released = release.await.expect("task").expect("release");
        assert_eq!(released, idempotency_core::ForceReleased::Deleted);
        operator.drain().await; // the second delete
        gateway.drain().await;
        gateway_pg.delay_replies(Duration::ZERO);
        let again = operator.begin(&id, &fp, LONG).await.expect("begin");
        assert!(
            matches!(again, Begin::Execute(_)),
            "a released record replayed from a late copy: {again:?}"
        );
    });
}

/// An operator's `force_release` given up (dropped, as an admin request whose client hung
/// up) after Postgres deleted the record: its copy in Redis must still be deleted. The old
/// code scheduled both of its Redis deletes only once Postgres had answered, so the dropped
/// call left the copy, and every retry of the key replayed the outcome Postgres had
/// forgotten, for the copy's whole TTL.
#[test]
fn an_operators_release_given_up_after_postgres_deleted_still_deletes_the_copy() {
    use idempotency_test::relay;

    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        let relay = relay::delaying_relay(relay::upstream(pg.url())).await;
        let prefix = idempotency_test::unique("h");
        let gateway = hybrid_with_prefix(pg_store(pg.url()).await, redis.url(), &prefix).await;
        let slow_pg = PostgresStore::builder(relay::through(pg.url(), relay.port))
            .per_request()
            .max_connections(1)
            .call_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("postgres store");
        let operator = hybrid_with_prefix(slow_pg, redis.url(), &prefix).await;
        let (id, fp) = (fresh_id(), Fingerprint::of(b"charge"));
        let Begin::Execute(token) = gateway.begin(&id, &fp, LEASE).await.expect("begin") else {
            panic!("a fresh key")
        };
        gateway
            .complete(&id, token, &Outcome::new(201), RETENTION)
            .await
            .expect("complete");
        gateway.drain().await;
        assert!(matches!(
            gateway.redis().peek(&id, &fp).await,
            Ok(idempotency_redis::Peek::Found(Begin::Replay(_)))
        ));
        // The release's statements prepared on the operator's one connection, so that the
        // delete below leaves at once and only its answer is held back. (A release that
        // keeps the record, so that it schedules nothing of its own.)
        let kept = operator
            .force_release(&id, ReleaseScope::default())
            .await
            .expect("release of live leases only");
        assert_eq!(kept, idempotency_core::ForceReleased::Completed);
        // Back in the pool (sqlx checks a connection as it returns) before replies are held.
        tokio::time::sleep(Duration::from_millis(200)).await;

        // The commit's answer only (the release reads the row and deletes it in one
        // transaction): the delete has committed, and the call is given up before it hears.
        relay.delay_replies_containing(Duration::from_millis(1500), b"COMMIT");
        let given_up = tokio::time::timeout(
            Duration::from_millis(300),
            operator.force_release(&id, ReleaseScope::default().with_completed()),
        )
        .await;
        assert!(given_up.is_err(), "{given_up:?}");
        tokio::time::sleep(Duration::from_millis(1700)).await;
        relay.delay_replies(Duration::ZERO);
        assert_eq!(
            gateway.postgres().inspect(&id).await.expect("inspect"),
            None,
            "Postgres deleted the record"
        );
        operator.drain().await; // as the admin CLI does before it exits
        let again = gateway.begin(&id, &fp, LEASE).await.expect("begin");
        assert!(
            matches!(again, Begin::Execute(_)),
            "a released record replayed from Redis: {again:?}"
        );
    });
}

/// Budgets set to the largest duration (a "no limit" setting: Tokio's timers take it) are
/// capped, not a panic: the stores' deadlines and the hybrid's sums of budgets overflowed
/// (`Duration` arithmetic and `Instant + Duration` panic), in `HybridStore::new` and then in
/// every `begin`.
#[test]
fn budgets_of_the_largest_duration_do_not_panic() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        let pg = PostgresStore::builder(pg.url())
            .call_timeout(Duration::MAX)
            .statement_timeout(Duration::MAX)
            .connect()
            .await
            .expect("postgres store");
        pg.migrate().await.expect("migrate");
        let redis = RedisStore::builder(redis.url())
            .prefix(idempotency_test::unique("h"))
            .call_budget(Duration::MAX)
            .eviction_check(idempotency_redis::EvictionCheck::Skip)
            .connect()
            .await
            .expect("redis store");
        let store = HybridStore::new(pg, redis, BreakerConfig::default());
        let (id, fp) = (fresh_id(), Fingerprint::of(b"charge"));
        let Begin::Execute(token) = store.begin(&id, &fp, LEASE).await.expect("begin") else {
            panic!("a fresh key")
        };
        store
            .complete(&id, token, &Outcome::new(201), RETENTION)
            .await
            .expect("complete");
        assert_eq!(
            store.begin(&id, &fp, LEASE).await.expect("begin"),
            Begin::Replay(Outcome::new(201))
        );
        let released = store
            .force_release(&id, ReleaseScope::default().with_completed())
            .await
            .expect("release");
        assert_eq!(released, idempotency_core::ForceReleased::Deleted);
    });
}

/// Redis gone without a trace (its host vanished: nothing answers, nothing resets), and
/// callers that give up sooner than a Redis call's budget (a client's hang-up, an outer
/// timeout): every call is still answered, by Postgres, and the breaker backs off. Before,
/// the first call after each open period probed Redis in its own future; given up, the probe
/// answered nothing, the breaker handed the probe to the next call at once, and every call
/// then waited on the dead Redis until its caller gave up, though Postgres was fine.
#[test]
fn callers_that_give_up_sooner_than_redis_are_still_answered_by_postgres() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let (store, relay) = behind_a_stalling_relay(Duration::from_secs(2)).await;
        let fp = Fingerprint::of(b"charge");
        relay.vanish();
        // Three calls that wait out their Redis budget open the breaker.
        let opening = (0..3).map(|_| {
            let store = store.clone();
            async move { store.begin(&fresh_id(), &fp, LEASE).await }
        });
        for begun in futures::future::join_all(opening).await {
            assert!(matches!(begun, Ok(Begin::Execute(_))), "{begun:?}");
        }
        assert_eq!(store.metrics().breaker_state, BreakerState::Open);
        // Callers with half a Redis budget of patience, over several open periods.
        let mut unanswered = 0;
        for _ in 0..12 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            match tokio::time::timeout(Duration::from_secs(1), store.begin(&fresh_id(), &fp, LEASE))
                .await
            {
                Ok(begun) => assert!(matches!(begun, Ok(Begin::Execute(_))), "{begun:?}"),
                Err(_) => unanswered += 1,
            }
        }
        assert_eq!(unanswered, 0, "calls left waiting on a Redis that is gone");
        assert!(store.metrics().breaker_opened >= 2, "the breaker backs off");
    });
}

/// A Redis that hangs while the breaker is closed, met only by callers that give up well
/// before its budget (clients hanging up, an outer timeout shorter than it): the calls they
/// gave up on after a fifth of a budget count as failures, the breaker opens, and the next
/// callers are answered by Postgres. Before, a dropped call counted for nothing: the breaker stayed
/// closed with no failure counted, and every call waited on the hung Redis until its caller
/// gave up, though Postgres was fine.
#[test]
fn a_hung_redis_whose_callers_all_give_up_first_still_opens_the_breaker() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let store = hung_redis_behind(|_| async {}).await;
        let answered = impatient_callers(&store).await;
        assert_eq!(
            answered.iter().filter(|a| !**a).count(),
            3,
            "the breaker's threshold of calls given up, then Postgres answers: {answered:?}"
        );
        assert_ne!(store.metrics().breaker_state, BreakerState::Closed);
    });
}

/// The same with stale-mirror repairs queued (here by an operator's release that gave up on
/// a Redis gone meanwhile): each caller that takes the repairs' lock sends their deletes
/// before its own call, and gives up while Redis leaves them unanswered. Those count against
/// the breaker too. Before, only a caller's own call counted: every caller spent its
/// patience on the repairs, none counted, and the breaker stayed closed for good.
#[test]
fn a_hung_redis_with_repairs_queued_still_opens_the_breaker() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let store = hung_redis_with_repairs_queued().await;
        let answered = impatient_callers(&store).await;
        let unanswered = answered.iter().filter(|a| !**a).count();
        assert!(unanswered <= 3, "{answered:?}");
        assert!(answered[5..].iter().all(|a| *a), "{answered:?}");
        assert_ne!(store.metrics().breaker_state, BreakerState::Closed);
    });
}

/// The same with callers that overlap (100 ms apart, 600 ms of patience each): the lock on
/// the repairs passes from one caller given up to the next, each holding it for about the
/// gap between arrivals. The wait for Redis counts from when the deletes first went out,
/// whoever sent them. Counted from each caller's own taking of the lock, only the first
/// caller ever counted, and the breaker stayed closed for good.
#[test]
fn a_hung_redis_with_repairs_queued_opens_the_breaker_under_overlapping_callers() {
    block_on(async {
        if services::skipping() {
            return;
        }
        let store = hung_redis_with_repairs_queued().await;
        let mut callers = Vec::new();
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let store = store.clone();
            callers.push(tokio::spawn(async move {
                let (id, fp) = (fresh_id(), Fingerprint::of(b"charge"));
                let call = store.begin(&id, &fp, LEASE);
                tokio::time::timeout(Duration::from_millis(600), call)
                    .await
                    .is_ok()
            }));
        }
        let mut answered = Vec::new();
        for caller in callers {
            answered.push(caller.await.expect("caller"));
        }
        assert!(answered[30..].iter().all(|a| *a), "{answered:?}");
        assert_ne!(store.metrics().breaker_state, BreakerState::Closed);
    });
}

/// A hybrid store (Redis budget 2 s) connected and healthy, nothing left running in the
/// background to report, whose Redis then hangs; `then` runs on it once it does.
async fn hung_redis_behind<F: std::future::Future<Output = ()>>(
    then: impl FnOnce(HybridStore) -> F,
) -> HybridStore {
    let (store, relay) = behind_a_stalling_relay(Duration::from_secs(2)).await;
    let fp = Fingerprint::of(b"charge");
    assert!(matches!(
        store.begin(&fresh_id(), &fp, LEASE).await,
        Ok(Begin::Execute(_))
    ));
    tokio::time::sleep(Duration::from_millis(200)).await; // the lease's mirror
    store.drain().await;
    relay.vanish();
    then(store.clone()).await;
    store
}

/// [`hung_redis_behind`], with stale-mirror repairs queued: an operator's release given up
/// on the hung Redis leaves its delete of the record's copy in the queue.
async fn hung_redis_with_repairs_queued() -> HybridStore {
    hung_redis_behind(|store| async move {
        let (scope, released) = (ReleaseScope::default(), fresh_id());
        let release = store.force_release(&released, scope);
        let gave_up = tokio::time::timeout(Duration::from_millis(600), release).await;
        assert!(gave_up.is_err(), "the release waits on the hung Redis");
    })
    .await
}

/// Ten callers, 300 ms apart, each with under a third of a Redis budget (600 ms) of
/// patience: whether each was answered (by `Execute`).
async fn impatient_callers(store: &HybridStore) -> Vec<bool> {
    let fp = Fingerprint::of(b"charge");
    let mut answered = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let id = fresh_id();
        let call = store.begin(&id, &fp, LEASE);
        match tokio::time::timeout(Duration::from_millis(600), call).await {
            Ok(begun) => {
                assert!(matches!(begun, Ok(Begin::Execute(_))), "{begun:?}");
                answered.push(true);
            }
            Err(_) => answered.push(false),
        }
    }
    answered
}

/// An operator's release deletes the record's copy in Redis in one round trip: a Redis whose
/// answers take more than half a call's budget still has it deleted at once. Before, the
/// delete was the Redis store's own release (its clock read, then its delete: two round
/// trips within the repair's one budget), so it timed out, counted against the breaker, and
/// the release answered `Unavailable`.
#[test]
fn an_operators_release_deletes_the_copy_in_one_round_trip() {
    use idempotency_test::relay;

    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        let relay = relay::delaying_relay(relay::upstream(redis.url())).await;
        let through = relay::through(redis.url(), relay.port);
        let store = hybrid_within(pg.url(), &through, Duration::from_millis(500)).await;
        let (id, fp) = (fresh_id(), Fingerprint::of(b"charge"));
        let Begin::Execute(token) = store.begin(&id, &fp, LEASE).await.expect("begin") else {
            panic!("a fresh key")
        };
        store
            .complete(&id, token, &Outcome::new(201), RETENTION)
            .await
            .expect("complete");
        store.drain().await;
        relay.delay_replies(Duration::from_millis(300));
        let released = store
            .force_release(&id, ReleaseScope::default().with_completed())
            .await;
        assert!(
            matches!(released, Ok(idempotency_core::ForceReleased::Deleted)),
            "{released:?}"
        );
        relay.delay_replies(Duration::ZERO);
        assert!(matches!(
            store.redis().peek(&id, &fp).await,
            Ok(idempotency_redis::Peek::Absent)
        ));
    });
}

/// A hybrid store on the shared Postgres and the Redis at `redis_url` (through a relay),
/// whose Redis calls, and connects, each have `budget`.
/// A hybrid store with Redis calls of `budget`, its Redis reached through a stalling relay
/// (a reconnect waits as long as a call once the relay's host vanished: it accepts nothing).
async fn behind_a_stalling_relay(
    budget: Duration,
) -> (HybridStore, idempotency_test::relay::StallingRelay) {
    use idempotency_test::relay;
    let pg = services::postgres().await.expect("postgres");
    let redis = services::redis().await.expect("redis");
    let relay = relay::stalling_relay(relay::upstream(redis.url())).await;
    let through = relay::through(redis.url(), relay.port);
    (hybrid_within(pg.url(), &through, budget).await, relay)
}

async fn hybrid_within(pg_url: &str, redis_url: &str, budget: Duration) -> HybridStore {
    let redis = RedisStore::builder(redis_url)
        .prefix(idempotency_test::unique("h"))
        .call_budget(budget)
        .connect_timeout(budget)
        .eviction_check(idempotency_redis::EvictionCheck::Skip)
        .connect()
        .await
        .expect("redis store");
    HybridStore::new(pg_store(pg_url).await, redis, BreakerConfig::default())
}

/// A renewal answers once Postgres renewed the lease: the mirror's extension in Redis does not
/// hold it up. Awaited, a Redis that stalled (here its requests arrive 3 s late, past the
/// 500 ms budget) held each renewal a budget longer than the lease it renewed (400 ms), the
/// next renewal came after the row's lease had run out, and a retry on another gateway took
/// the key over and ran the operation a second time while the first still ran.
#[test]
fn a_renewal_does_not_wait_for_a_stalled_redis() {
    use idempotency_core::{Executor, IdempotencyKey, Policy, Scope};
    use idempotency_test::relay;

    block_on(async {
        if services::skipping() {
            return;
        }
        let pg = services::postgres().await.expect("postgres");
        let redis = services::redis().await.expect("redis");
        let relay = relay::delaying_relay(relay::upstream(redis.url())).await;
        let store = Arc::new(
            hybrid_within(
                pg.url(),
                &relay::through(redis.url(), relay.port),
                Duration::from_millis(500),
            )
            .await,
        );
        let other_gateway = pg_store(pg.url()).await;
        let executor = Executor::new(store.clone())
            .with_policy(Policy::default().with_lease(Duration::from_millis(400)));
        let (scope, key) = (
            Scope::new("renewals"),
            IdempotencyKey::new(idempotency_test::unique("k")).unwrap(),
        );
        let (id, fp) = (RecordId::new(&scope, &key), Fingerprint::of(b"charge"));
        let runs = Arc::new(AtomicUsize::new(0));
        let (started, mut running) = tokio::sync::oneshot::channel();
        let run = {
            let runs = runs.clone();
            let (executor, scope, key) = (executor.clone(), scope.clone(), key.clone());
            tokio::spawn(async move {
                executor
                    .run(&scope, &key, &fp, || async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        let _ = started.send(());
                        tokio::time::sleep(Duration::from_millis(1_800)).await;
                        Ok::<_, std::io::Error>(String::from("charged"))
                    })
                    .await
            })
        };
        (&mut running).await.expect("the operation started");
        // Redis stalls while the operation runs; retries arrive on a gateway without it.
        relay.delay_requests(Duration::from_secs(3));
        let mut answers = Vec::new();
        while !run.is_finished() {
            match other_gateway.begin(&id, &fp, Duration::from_secs(30)).await {
                Ok(Begin::InFlight { .. }) | Err(_) => {}
                Ok(other) => {
                    answers.push(format!("{other:?}"));
                    if let Begin::TakeOver(token) | Begin::Execute(token) = other {
                        runs.fetch_add(1, Ordering::SeqCst); // the retry runs it
                        other_gateway
                            .complete(&id, token, &Outcome::new(200), LONG_RETENTION)
                            .await
                            .expect("the retry's outcome");
                    }
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        relay.delay_requests(Duration::ZERO);
        let first = run.await.expect("the run's task");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "the operation ran twice; the other gateway was answered {answers:?}, the first \
             run {first:?}"
        );
        assert!(first.is_ok(), "{first:?}");
    });
}

const LONG_RETENTION: Duration = Duration::from_secs(3600);

/// An end (`renew` for zero, how the executor gives back a taken-over lease) refused with
/// `LeaseLost`, because the token completed the record in the application's transaction,
/// drops the lease's mirror, as a release does: the retry is replayed the outcome at once.
/// The mirror stayed, and answered "in flight" until its TTL.
#[test]
fn an_end_refused_after_a_completion_in_a_transaction_drops_the_mirror() {
    block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let id = idempotency_test::conformance::fresh_id();
        let fp = Fingerprint::of(b"a");
        let long = idempotency_test::conformance::LONG;
        let token = idempotency_test::conformance::execute(&*store, &id, &fp, long).await;
        mirror_landed(&store, &id, &fp).await;
        // Completed in the application's transaction: Postgres alone knows.
        store
            .postgres()
            .complete(&id, token, &Outcome::new(201), long)
            .await
            .expect("complete");
        let ended = store.renew(&id, token, Duration::ZERO).await;
        assert!(matches!(ended, Err(Error::LeaseLost)), "{ended:?}");
        let retry = store.begin(&id, &fp, long).await.expect("begin");
        assert!(matches!(retry, Begin::Replay(_)), "{retry:?}");
    });
}
