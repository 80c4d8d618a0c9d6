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
mod scale;
mod stats;
mod store_level;

use std::{sync::Arc, time::Duration};

use hdrhistogram::Histogram;

use idempotency::{
    MemoryStore, Store,
    hybrid::{BreakerConfig, CachePolicy, HybridStore},
    postgres::{GroupCommit, PostgresStore},
    redis::RedisStore,
};
use idempotency_test::services;

pub use fault::Bucket;
pub use report::{Ratio, Report};
pub use scale::{ScaleSettings, run as run_scale, run_memory as run_scale_memory};
pub use stats::{Measured, Round};

use crate::{
    http_level::Keys,
    store_level::{Subjects, concurrent, sequential},
};

/// How long and how hard to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Run only the groups whose name starts with one of these (all when empty).
    pub only: Vec<String>,
    /// Concurrent workers or connections.
    pub concurrency: usize,
    /// Duration of each concurrent scenario.
    pub duration: Duration,
    /// Operations of each sequential scenario.
    pub sequential_ops: u64,
    /// Each of the three phases of the fault timeline (before, paused, after).
    pub fault_phase: Duration,
    /// Rounds of each side-by-side group (A B B A, each slot a quarter of `duration`).
    pub rounds: usize,
}

impl Settings {
    fn runs(&self, group: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| group.starts_with(o.as_str()))
    }

    /// The default run: C = 16, 5 s per scenario.
    pub fn full() -> Self {
        Self {
            only: Vec::new(),
            concurrency: 16,
            duration: Duration::from_secs(5),
            sequential_ops: 2000,
            fault_phase: Duration::from_secs(2),
            rounds: 5,
        }
    }

    /// A few seconds in all: what CI runs so the harness never rots.
    pub fn smoke() -> Self {
        Self {
            only: Vec::new(),
            concurrency: 4,
            duration: Duration::from_millis(300),
            sequential_ops: 20,
            fault_phase: Duration::from_millis(400),
            rounds: 2,
        }
    }
}

async fn redis_store(url: &str, prefix: &str) -> Result<RedisStore, idempotency::Error> {
    RedisStore::builder(url).prefix(prefix).connect().await
}

/// Drives the servers one after another in the order given (A B B A, so that a drift of the
/// shared machine hits both sides alike), each for `each`, and all of it `rounds` times over.
/// Returns one [`Measured`] per server, over all its slots, with each round's figures kept:
/// the ratios the targets name are taken round by round and their median reported, since a
/// single A B B A still moves ±15 % between runs on this shared machine.
async fn side_by_side(
    group: &str,
    order: &[(&str, std::net::SocketAddr)],
    keys: Keys,
    connections: usize,
    each: Duration,
    rounds: usize,
) -> Vec<Measured> {
    struct Server<'a> {
        name: &'a str,
        total: Histogram<u64>,
        errors: u64,
        elapsed: Duration,
        rounds: Vec<Round>,
    }
    let mut servers: Vec<Server<'_>> = Vec::new();
    for &(name, _) in order {
        if !servers.iter().any(|s| s.name == name) {
            servers.push(Server {
                name,
                total: stats::histogram(),
                errors: 0,
                elapsed: Duration::ZERO,
                rounds: Vec::new(),
            });
        }
    }
    for _ in 0..rounds.max(1) {
        let mut this_round: Vec<(Histogram<u64>, Duration)> = servers
            .iter()
            .map(|_| (stats::histogram(), Duration::ZERO))
            .collect();
        for &(name, addr) in order {
            let _window = http_level::Window::open(group, name);
            let (h, errors, elapsed) = http_level::drive_raw(addr, keys, connections, each).await;
            let i = servers
                .iter()
                .position(|s| s.name == name)
                .unwrap_or_else(|| unreachable!("every name was added above"));
            let server = &mut servers[i];
            let _ = server.total.add(&h);
            server.errors += errors;
            server.elapsed += elapsed;
            let _ = this_round[i].0.add(&h);
            this_round[i].1 += elapsed;
        }
        for (server, (h, elapsed)) in servers.iter_mut().zip(&this_round) {
            server.rounds.push(Round::new(h, *elapsed));
        }
    }
    servers
        .into_iter()
        .map(|s| Measured {
            rounds: s.rounds,
            ..Measured::new(group, s.name, &s.total, s.errors, s.elapsed)
        })
        .collect()
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
    let per_request = PostgresStore::builder(pg.url())
        .max_connections(64)
        .per_request()
        .connect()
        .await?;
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let hybrid_redis = redis_store(redis.url(), &format!("bh{run_id}")).await?;
    // Its own store (and so its own estimate of how many requests are duplicates).
    let hybrid_adaptive = HybridStore::new(
        postgres.clone(),
        hybrid_redis.clone(),
        BreakerConfig::default(),
    )
    .with_cache_policy(CachePolicy::Adaptive {
        min_duplicate_share: 0.1,
    });
    let subjects = Subjects {
        memory: Arc::new(MemoryStore::new()),
        postgres: Arc::new(postgres.clone()),
        postgres_per_request: Arc::new(per_request),
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
    let (slot, r) = (d / 4, settings.rounds.max(1));
    let mut measured = Vec::new();

    if settings.runs("store-seq") {
        for (store, framework, baseline) in subjects.pairs() {
            let ops = settings.sequential_ops;
            measured.push(sequential("store-seq", store, &*framework, ops).await);
            let name = format!("baseline {store}");
            measured.push(sequential("store-seq", &name, &*baseline, ops).await);
        }
    }
    if settings.runs("store-conc") {
        for (store, framework, baseline) in subjects.pairs() {
            measured.push(concurrent("store-conc", store, framework, c, d).await);
            let name = format!("baseline {store}");
            measured.push(concurrent("store-conc", &name, baseline, c, d).await);
        }
    }

    let memory: Arc<dyn Store> = subjects.memory.clone();
    let pg_store: Arc<dyn Store> = subjects.postgres.clone();
    let pg_per_request: Arc<dyn Store> = subjects.postgres_per_request.clone();
    let redis_store: Arc<dyn Store> = subjects.redis.clone();
    let hybrid: Arc<dyn Store> = subjects.hybrid.clone();
    let hybrid_no_mirror: Arc<dyn Store> = subjects.hybrid_no_mirror.clone();
    let hybrid_adaptive: Arc<dyn Store> = Arc::new(hybrid_adaptive);
    let (conn, pool) = (subjects.redis_conn.clone(), subjects.pool.clone());
    let servers = [
        ("no idempotency", http_level::plain()),
        ("layer memory", http_level::layered(memory)),
        ("layer postgres", http_level::layered(pg_store.clone())),
        (
            "layer postgres (per-request)",
            http_level::layered(pg_per_request.clone()),
        ),
        ("layer redis", http_level::layered(redis_store.clone())),
        (
            "hand-written redis",
            http_level::handwritten_redis_only(conn.clone(), pool.clone()),
        ),
        ("layer hybrid", http_level::layered(hybrid.clone())),
        (
            "layer hybrid (no mirror)",
            http_level::layered(hybrid_no_mirror),
        ),
        (
            "layer hybrid (adaptive)",
            http_level::layered(hybrid_adaptive.clone()),
        ),
        (
            "hand-written hybrid",
            http_level::handwritten_hybrid(conn.clone(), pool.clone()),
        ),
    ];
    if settings.runs("http-first") {
        for (name, router) in servers {
            let addr = http_level::serve(router).await;
            measured.push(http_level::drive("http-first", name, addr, Keys::Unique, c, d).await);
        }
        // One connection: what group commit costs a lone request (nothing, it should be).
        // Run A B B A in rounds, a quarter as long each: a drift of the shared machine hits both alike.
        let a = http_level::serve(http_level::layered(pg_store.clone())).await;
        let b = http_level::serve(http_level::layered(pg_per_request.clone())).await;
        let runs = [
            ("layer postgres", a),
            ("layer postgres (per-request)", b),
            ("layer postgres (per-request)", b),
            ("layer postgres", a),
        ];
        measured.extend(side_by_side("http-first-c1", &runs, Keys::Unique, 1, slot, r).await);
        // The hybrid against Postgres alone, side by side: A B C C B A in rounds, a quarter as long each.
        // In the group above they run a minute apart, on a table that has grown in between,
        // and the shared machine drifts.
        // Redis alone against its hand-written baseline, the same way: A B B A.
        let pg_addr = http_level::serve(http_level::layered(pg_store.clone())).await;
        let hybrid_addr = http_level::serve(http_level::layered(hybrid.clone())).await;
        let adaptive_addr = http_level::serve(http_level::layered(hybrid_adaptive.clone())).await;
        let redis_addr = http_level::serve(http_level::layered(redis_store.clone())).await;
        let hand_addr = http_level::serve(http_level::handwritten_redis_only(
            conn.clone(),
            pool.clone(),
        ))
        .await;
        // With the fenced hand-written one between them (A B C C B A): what fencing costs on
        // its own, and the framework beyond it.
        let fenced_addr = http_level::serve(http_level::handwritten_redis_only_fenced(
            conn.clone(),
            pool.clone(),
        ))
        .await;
        let runs = [
            ("layer postgres", pg_addr),
            ("layer hybrid", hybrid_addr),
            ("layer hybrid (adaptive)", adaptive_addr),
            ("layer hybrid (adaptive)", adaptive_addr),
            ("layer hybrid", hybrid_addr),
            ("layer postgres", pg_addr),
            ("layer redis", redis_addr),
            ("hand-written redis (fenced)", fenced_addr),
            ("hand-written redis", hand_addr),
            ("hand-written redis", hand_addr),
            ("hand-written redis (fenced)", fenced_addr),
            ("layer redis", redis_addr),
        ];
        measured.extend(side_by_side("http-first-abba", &runs, Keys::Unique, c, slot, r).await);
    }
    if settings.runs("http-first-gc") {
        // Group commit with two batches of a kind in flight against the default one, and the
        // per-request store: A B C C B A in rounds, a quarter as long each. Whether a second statement in
        // flight uses the database better than one larger batch, on this machine.
        let two = PostgresStore::builder(pg.url())
            .max_connections(64)
            .group_commit(GroupCommit::default().concurrency(2))
            .connect()
            .await?;
        let one_addr = http_level::serve(http_level::layered(pg_store.clone())).await;
        let two_addr = http_level::serve(http_level::layered(Arc::new(two))).await;
        let per_request_addr = http_level::serve(http_level::layered(pg_per_request)).await;
        let runs = [
            ("layer postgres", one_addr),
            ("layer postgres (2 in flight)", two_addr),
            ("layer postgres (per-request)", per_request_addr),
            ("layer postgres (per-request)", per_request_addr),
            ("layer postgres (2 in flight)", two_addr),
            ("layer postgres", one_addr),
        ];
        measured.extend(side_by_side("http-first-gc", &runs, Keys::Unique, c, slot, r).await);
    }
    let replays = [
        ("layer hybrid", http_level::layered(hybrid)),
        (
            "layer hybrid (adaptive)",
            http_level::layered(hybrid_adaptive),
        ),
        ("layer postgres", http_level::layered(pg_store)),
        ("layer redis", http_level::layered(redis_store)),
        (
            "hand-written single GET",
            http_level::single_get_replay(conn.clone(), pool.clone()),
        ),
        (
            "hand-written replay (checked)",
            http_level::checked_replay_server(conn, pool),
        ),
    ];
    if settings.runs("http-replay") {
        let mut served = Vec::new();
        for (name, router) in replays {
            let addr = http_level::serve(router).await;
            measured
                .push(http_level::drive("http-replay", name, addr, Keys::PerClient, c, d).await);
            served.push((name, addr));
        }
        // The hybrid against the single `GET`, side by side, as for first requests; with the
        // checked replay between them (A B C C B A): what checking the request costs on its
        // own, and the framework beyond it.
        let addr = |wanted: &str| served.iter().find(|(name, _)| *name == wanted).map(|s| s.1);
        if let (Some(a), Some(b), Some(checked)) = (
            addr("layer hybrid"),
            addr("hand-written single GET"),
            addr("hand-written replay (checked)"),
        ) {
            let runs = [
                ("layer hybrid", a),
                ("hand-written replay (checked)", checked),
                ("hand-written single GET", b),
                ("hand-written single GET", b),
                ("hand-written replay (checked)", checked),
                ("layer hybrid", a),
            ];
            measured
                .extend(side_by_side("http-replay-abba", &runs, Keys::PerClient, c, slot, r).await);
        }
    }

    // The fault timeline needs a Redis it may pause: a dedicated container.
    let timeline = if services::skipping()
        || std::env::var_os("IDEMPOTENCY_TEST_REDIS_URL").is_some()
        || !settings.runs("fault")
    {
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
    let batches = postgres.group_commit_stats();
    Ok(Report {
        settings: serde_json::json!({
            "concurrency": c,
            "duration_ms": d.as_millis() as u64,
            "sequential_ops": settings.sequential_ops,
            "fault_phase_ms": settings.fault_phase.as_millis() as u64,
            "side_by_side_rounds": r,
            "side_by_side_slot_ms": slot.as_millis() as u64,
            "group_commit_calls": batches.calls,
            "group_commit_statements": batches.statements,
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        }),
        measured,
        ratios,
        timeline,
    })
}
