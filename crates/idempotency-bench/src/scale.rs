//! Scale: `begin` with a large key table, and a purge of many expired rows under load.
//!
//! On a Postgres of its own (the table is filled to millions of rows): `begin` latency with
//! 10 k rows, then with the full table; then the writers' latency while a batched purge
//! deletes the expired rows, against the same writers just before. The same on the memory
//! store (`--scale-memory`): its purge takes the lock every request waits on.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use idempotency::{
    Begin, Fingerprint, IdempotencyKey, MemoryStore, Purger, RecordId, Scope, Store,
    postgres::PostgresStore,
};
use idempotency_test::services;

use crate::{
    report::Ratio,
    stats::{self, Measured},
    store_level::outcome,
};

/// How big and how long.
#[derive(Debug, Clone, Copy)]
pub struct ScaleSettings {
    /// Rows in the table for the large measurement (default 10 M).
    pub rows: u64,
    /// How many of them are expired, for the purge (default 1 M).
    pub expired: u64,
    /// Concurrent writers.
    pub concurrency: usize,
    /// Each latency measurement.
    pub duration: Duration,
    /// Rows per purge statement.
    pub purge_batch: usize,
    /// The purger's pause after each batch, in multiples of the batch's time.
    pub purge_pause: f64,
}

impl Default for ScaleSettings {
    fn default() -> Self {
        Self {
            rows: 10_000_000,
            expired: 1_000_000,
            concurrency: 16,
            duration: Duration::from_secs(5),
            purge_batch: 100,
            purge_pause: 2.0,
        }
    }
}

/// Inserts rows `from..to` (completed; those below `expired` already past their retention),
/// in statements of at most 1 M rows.
async fn fill(pool: &sqlx::PgPool, from: u64, to: u64, expired: u64) -> Result<(), sqlx::Error> {
    let mut at = from;
    while at < to {
        let end = (at + 1_000_000).min(to);
        sqlx::query(
            "INSERT INTO idempotency_keys
                 (record_id, fingerprint, state, lease_token, status, response,
                  created_at, completed_at, expires_at)
             SELECT sha256(('scale-' || i)::bytea), sha256('fp'::bytea), 1, gen_random_uuid(),
                    201, '\\x01c9'::bytea, now(), now(),
                    CASE WHEN i < $3 THEN now() - interval '1 day' ELSE now() + interval '1 day' END
             FROM generate_series($1::int8, $2::int8 - 1) AS i",
        )
        .bind(i64::try_from(at).unwrap_or(i64::MAX))
        .bind(i64::try_from(end).unwrap_or(i64::MAX))
        .bind(i64::try_from(expired).unwrap_or(i64::MAX))
        .execute(pool)
        .await?;
        at = end;
    }
    sqlx::query("VACUUM (ANALYZE, PARALLEL 0) idempotency_keys")
        .execute(pool)
        .await?;
    Ok(())
}

/// Writers doing `begin` + `complete` on new keys until `stop` (or `duration`): the `begin`
/// latency and the whole operation's. `cycle`: each writer's keys repeat after this many (a
/// repeat's `begin` replays and is counted as one operation), so that a store without I/O
/// (the memory store, a million calls a second) does not fill its memory while measured.
async fn writers(
    store: Arc<dyn Store>,
    group: &str,
    concurrency: usize,
    duration: Duration,
    stop: Arc<AtomicBool>,
    cycle: Option<u64>,
) -> (Measured, Measured) {
    let scope = Scope::new(uuid::Uuid::new_v4().to_string());
    let started = Instant::now();
    let workers = (0..concurrency as u64).map(|w| {
        let (store, scope, stop) = (store.clone(), scope.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut begins, mut ops, mut errors) = (stats::histogram(), stats::histogram(), 0);
            let mut n = 0u64;
            let fp = Fingerprint::of(b"scale");
            while started.elapsed() < duration && !stop.load(Ordering::Relaxed) {
                let key = IdempotencyKey::new(format!("w{w}-{}", cycle.map_or(n, |c| n % c)))
                    .unwrap_or_else(|e| unreachable!("{e}"));
                let id = RecordId::new(&scope, &key);
                n += 1;
                let t = Instant::now();
                let token = match store.begin(&id, &fp, Duration::from_secs(30)).await {
                    Ok(Begin::Execute(token)) => token,
                    Ok(Begin::Replay(_)) if cycle.is_some() => {
                        stats::record(&mut begins, t.elapsed());
                        stats::record(&mut ops, t.elapsed());
                        // A store without I/O never yields: let the purge and the other
                        // writers run.
                        tokio::task::yield_now().await;
                        continue;
                    }
                    _ => {
                        errors += 1;
                        continue;
                    }
                };
                stats::record(&mut begins, t.elapsed());
                match store
                    .complete(&id, token, &outcome(), Duration::from_secs(3600))
                    .await
                {
                    Ok(()) => stats::record(&mut ops, t.elapsed()),
                    Err(_) => errors += 1,
                }
            }
            (begins, ops, errors)
        })
    });
    let (mut begins, mut ops, mut errors) = (stats::histogram(), stats::histogram(), 0);
    for (b, o, e) in futures::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
    {
        let _ = begins.add(&b);
        let _ = ops.add(&o);
        errors += e;
    }
    let elapsed = started.elapsed();
    (
        Measured::new(group, "begin", &begins, errors, elapsed),
        Measured::new(group, "begin + complete", &ops, errors, elapsed),
    )
}

/// Completes records `from..to` through the store's own calls (those below `expired` kept
/// a millisecond, the others a day).
async fn fill_memory(store: &MemoryStore, from: u64, to: u64, expired: u64) -> Result<(), Error> {
    let (scope, fp) = (Scope::new("scale"), Fingerprint::of(b"fp"));
    for i in from..to {
        let key = IdempotencyKey::new(format!("scale-{i}"))?;
        let id = RecordId::new(&scope, &key);
        let Begin::Execute(token) = store.begin(&id, &fp, Duration::from_secs(30)).await? else {
            return Err(format!("scale-{i} was not new").into());
        };
        let retention = if i < expired {
            Duration::from_millis(1)
        } else {
            Duration::from_secs(24 * 3600)
        };
        store.complete(&id, token, &outcome(), retention).await?;
    }
    tokio::time::sleep(Duration::from_millis(2)).await; // the expired ones are now
    Ok(())
}

type Error = Box<dyn std::error::Error>;

/// Runs the scale scenarios on Postgres; returns what was measured and the ratios the
/// targets name.
pub async fn run(settings: ScaleSettings) -> Result<(Vec<Measured>, Vec<Ratio>), Error> {
    if services::skipping() {
        return Err("service-backed benchmarks were opted out".into());
    }
    let pg = services::start_postgres().await;
    let store = Arc::new(
        PostgresStore::builder(pg.url())
            .max_connections(32)
            .statement_timeout(Duration::from_secs(600))
            .call_timeout(Duration::from_secs(600))
            .connect()
            .await?,
    );
    store.migrate().await?;
    let pool = store.pool().clone();
    measure(settings, store, None, async |from, to, expired| {
        Ok(fill(&pool, from, to, expired).await?)
    })
    .await
}

/// The same scenarios on the memory store (`settings.rows` records, filled through its
/// own calls).
pub async fn run_memory(settings: ScaleSettings) -> Result<(Vec<Measured>, Vec<Ratio>), Error> {
    let store = Arc::new(MemoryStore::new());
    let filled = store.clone();
    measure(settings, store, Some(1000), async |from, to, expired| {
        fill_memory(&filled, from, to, expired).await
    })
    .await
}

async fn measure(
    settings: ScaleSettings,
    store: Arc<dyn Store>,
    cycle: Option<u64>,
    fill: impl AsyncFn(u64, u64, u64) -> Result<(), Error>,
) -> Result<(Vec<Measured>, Vec<Ratio>), Error> {
    let (c, d) = (settings.concurrency, settings.duration);
    let never = Arc::new(AtomicBool::new(false));
    let mut measured = Vec::new();

    let small = 10_000.min(settings.rows);
    fill(0, small, 0).await?;
    let (small_begin, _) =
        writers(store.clone(), "scale 10k rows", c, d, never.clone(), cycle).await;
    measured.push(small_begin.clone());

    let t = Instant::now();
    // The expired rows are the first `expired` of the rest.
    fill(small, settings.rows, small + settings.expired).await?;
    let fill_s = t.elapsed().as_secs_f64();
    let label = format!("scale {} rows", settings.rows);
    let (large_begin, before) = writers(store.clone(), &label, c, d, never.clone(), cycle).await;
    measured.push(large_begin.clone());
    let mut before = before;
    before.group = "purge: writers before".into();
    measured.push(before.clone());

    // The purge, batch after batch, while the writers run; they stop when it is done.
    let stop = Arc::new(AtomicBool::new(false));
    let during = tokio::spawn(writers(
        store.clone(),
        "purge: writers during",
        c,
        Duration::from_secs(3600),
        stop.clone(),
        cycle,
    ));
    // The library's purger, as an application runs it: small batches, each followed by a
    // pause in proportion to its time.
    let t = Instant::now();
    let purged = Purger::new(store.clone())
        .batch(settings.purge_batch)
        .pause(settings.purge_pause)
        .run_once()
        .await?;
    let purge_s = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let (_, during) = during.await?;
    measured.push(during.clone());

    let ratio = |a: &Measured, b: &Measured| a.p99_us as f64 / b.p99_us.max(1) as f64;
    let ratios = vec![
        Ratio::new(
            format!(
                "scale: begin p99 at {} rows / at {small} rows",
                settings.rows
            ),
            ratio(&large_begin, &small_begin),
        ),
        Ratio::new(
            format!(
                "purge: writers' p99 during / before ({purged} rows purged in {purge_s:.1} s, {} per batch, pause {}x)",
                settings.purge_batch, settings.purge_pause
            ),
            ratio(&during, &before),
        ),
        Ratio::new("scale: seconds to fill the table (not a ratio)", fill_s),
    ];
    Ok((measured, ratios))
}
