//! Benchmarks of the idempotency framework beside hand-written baselines.
//!
//! Run with: `cargo run --release -p idempotency-bench` (services from
//! `IDEMPOTENCY_TEST_POSTGRES_URL` / `IDEMPOTENCY_TEST_REDIS_URL`, or containers started by the
//! test harness). Prints a Markdown table and writes `target/bench/results.json`,
//! `throughput.png` and `fault_timeline.png`.
//!
//! Numbers are ratios measured in one run on one machine: absolute numbers drift on shared
//! machines, ratios hold.

mod fault;
mod http_level;
mod report;
mod stats;
mod store_level;

use std::{sync::Arc, time::Duration};

use idempotency::{
    MemoryStore, Store,
    hybrid::{BreakerConfig, HybridStore},
    postgres::PostgresStore,
    redis::RedisStore,
};
use idempotency_test::services;

pub use fault::Bucket;
pub use report::Report;
pub use stats::Measured;

use crate::{
    http_level::Keys,
    store_level::{Subjects, concurrent, sequential},
};

/// How long and how hard to run.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Concurrent workers or connections.
    pub concurrency: usize,
    /// Duration of each concurrent scenario.
    pub duration: Duration,
    /// Operations of each sequential scenario.
    pub sequential_ops: u64,
    /// Each of the three phases of the fault timeline (before, paused, after).
    pub fault_phase: Duration,
}

impl Settings {
    /// The default run: C = 32, 5 s per scenario.
    pub fn full() -> Self {
        Self {
            concurrency: 32,
            duration: Duration::from_secs(5),
            sequential_ops: 2000,
            fault_phase: Duration::from_secs(2),
        }
    }

    /// A few seconds in all: what CI runs so the harness never rots.
    pub fn smoke() -> Self {
        Self {
            concurrency: 4,
            duration: Duration::from_millis(300),
            sequential_ops: 20,
            fault_phase: Duration::from_millis(400),
        }
    }
}

async fn redis_store(url: &str, prefix: &str) -> Result<RedisStore, idempotency::Error> {
    RedisStore::builder(url).prefix(prefix).connect().await
}

/// Runs every scenario and returns the report.
pub async fn run(settings: Settings) -> Result<Report, Box<dyn std::error::Error>> {
    let pg = services::postgres()
        .await
        .ok_or("service-backed benchmarks were opted out (IDEMPOTENCY_TEST_SKIP_SERVICES)")?;
    let redis = services::redis()
        .await
        .ok_or("service-backed benchmarks were opted out")?;
    let postgres = PostgresStore::builder(pg.url())
        .max_connections(64)
        .connect()
        .await?;
    postgres.migrate().await?;
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let hybrid_redis = redis_store(redis.url(), &format!("bh{run_id}")).await?;
    let subjects = Subjects {
        memory: Arc::new(MemoryStore::new()),
        postgres: Arc::new(postgres.clone()),
        redis: Arc::new(redis_store(redis.url(), &format!("br{run_id}")).await?),
        hybrid: Arc::new(HybridStore::new(
            postgres.clone(),
            hybrid_redis.clone(),
            BreakerConfig::default(),
        )),
        hybrid_no_mirror: Arc::new(
            HybridStore::new(postgres.clone(), hybrid_redis, BreakerConfig::default())
                .with_in_flight_mirror_ttl(Duration::ZERO),
        ),
        pool: postgres.pool().clone(),
        redis_conn: redis::Client::open(redis.url())?
            .get_multiplexed_async_connection()
            .await?,
    };
    let (c, d) = (settings.concurrency, settings.duration);
    let mut measured = Vec::new();

    for (store, framework, baseline) in subjects.pairs() {
        measured.push(sequential("store-seq", store, &*framework, settings.sequential_ops).await);
        measured.push(
            sequential(
                "store-seq",
                &format!("baseline {store}"),
                &*baseline,
                settings.sequential_ops,
            )
            .await,
        );
    }
    for (store, framework, baseline) in subjects.pairs() {
        measured.push(concurrent("store-conc", store, framework, c, d).await);
        measured.push(concurrent("store-conc", &format!("baseline {store}"), baseline, c, d).await);
    }

    let memory: Arc<dyn Store> = subjects.memory.clone();
    let pg_store: Arc<dyn Store> = subjects.postgres.clone();
    let hybrid: Arc<dyn Store> = subjects.hybrid.clone();
    let hybrid_no_mirror: Arc<dyn Store> = subjects.hybrid_no_mirror.clone();
    let servers = [
        ("no idempotency", http_level::plain()),
        ("layer memory", http_level::layered(memory)),
        ("layer postgres", http_level::layered(pg_store.clone())),
        ("layer hybrid", http_level::layered(hybrid.clone())),
        (
            "layer hybrid (no mirror)",
            http_level::layered(hybrid_no_mirror),
        ),
        (
            "hand-written hybrid",
            http_level::handwritten_hybrid(subjects.redis_conn.clone(), subjects.pool.clone()),
        ),
    ];
    for (name, router) in servers {
        let addr = http_level::serve(router).await;
        measured.push(http_level::drive("http-first", name, addr, Keys::Unique, c, d).await);
    }
    let replays = [
        ("layer hybrid", http_level::layered(hybrid)),
        ("layer postgres", http_level::layered(pg_store)),
        (
            "hand-written single GET",
            http_level::single_get_replay(subjects.redis_conn.clone(), subjects.pool.clone()),
        ),
    ];
    for (name, router) in replays {
        let addr = http_level::serve(router).await;
        measured.push(http_level::drive("http-replay", name, addr, Keys::PerClient, c, d).await);
    }

    // The fault timeline needs a Redis it may pause: a dedicated container.
    let timeline =
        if services::skipping() || std::env::var_os("IDEMPOTENCY_TEST_REDIS_URL").is_some() {
            Vec::new()
        } else {
            let own = services::start_redis(services::RedisOptions::default()).await;
            let redis = RedisStore::builder(own.url())
                .prefix("fault")
                .call_budget(Duration::from_millis(150))
                .connect_timeout(Duration::from_millis(100))
                .response_timeout(Duration::from_millis(100))
                .connect()
                .await?;
            let store = Arc::new(HybridStore::new(
                postgres.clone(),
                redis,
                BreakerConfig::default(),
            ));
            fault::timeline(store, &own, c, settings.fault_phase).await
        };

    let ratios = report::ratios(&measured);
    Ok(Report {
        settings: serde_json::json!({
            "concurrency": c,
            "duration_ms": d.as_millis() as u64,
            "sequential_ops": settings.sequential_ops,
            "fault_phase_ms": settings.fault_phase.as_millis() as u64,
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        }),
        measured,
        ratios,
        timeline,
    })
}
