//! begin + complete per operation, for each store and a hand-written baseline doing the same
//! irreducible I/O with the raw clients.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use idempotency::{
    Begin, Fingerprint, IdempotencyKey, Outcome, RecordId, Scope, Store, hybrid::HybridStore,
    postgres::PostgresStore, redis::RedisStore,
};
use sqlx::PgPool;

use crate::stats::{self, Measured};

/// One operation of a scenario: given a fresh record id, do the work.
#[async_trait::async_trait]
pub(crate) trait Op: Send + Sync {
    async fn run(&self, id: RecordId) -> bool;
}

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

pub(crate) fn outcome() -> Outcome {
    Outcome::new(201)
        .with_header("content-type", "application/json")
        .with_body(
            r#"{"id":"ch_0123456789abcdef","amount":1000,"currency":"eur","status":"succeeded"}"#,
        )
}

/// The framework: `begin` then `complete`.
pub(crate) struct Framework(pub(crate) Arc<dyn Store>);

#[async_trait::async_trait]
impl Op for Framework {
    async fn run(&self, id: RecordId) -> bool {
        let fp = Fingerprint::of(b"bench");
        match self.0.begin(&id, &fp, LEASE).await {
            Ok(Begin::Execute(token)) => self
                .0
                .complete(&id, token, &outcome(), RETENTION)
                .await
                .is_ok(),
            _ => false,
        }
    }
}

/// Memory: insert-if-absent, then overwrite, in a locked map.
pub(crate) struct MemoryBaseline(pub(crate) Mutex<HashMap<RecordId, Vec<u8>>>);

#[async_trait::async_trait]
impl Op for MemoryBaseline {
    async fn run(&self, id: RecordId) -> bool {
        let body = outcome().encode().to_vec();
        {
            let mut m = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if m.contains_key(&id) {
                return false;
            }
            m.insert(id, Vec::new());
        }
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, body);
        true
    }
}

/// Postgres: the claim (insert-on-conflict) and the completion (update), nothing else.
pub(crate) struct PostgresBaseline(pub(crate) PgPool);

#[async_trait::async_trait]
impl Op for PostgresBaseline {
    async fn run(&self, id: RecordId) -> bool {
        postgres_claim_and_complete(&self.0, &id).await
    }
}

/// The raw Redis claim of a baseline: `SET NX PX`, true when this call set the key.
pub(crate) async fn redis_claim(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> bool {
    let claimed: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg("")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(conn)
        .await
        .ok()
        .flatten();
    claimed.is_some()
}

/// The raw Redis cache write of a baseline.
pub(crate) async fn cache_write(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    value: &[u8],
) -> bool {
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("EX")
        .arg(3600)
        .query_async::<()>(conn)
        .await
        .is_ok()
}

/// The raw Postgres claim of a baseline: insert-on-conflict, true when this call inserted.
pub(crate) async fn postgres_claim(pool: &PgPool, id: &RecordId) -> bool {
    let claimed = sqlx::query(
        "INSERT INTO idempotency_keys (record_id, fingerprint, state, lease_token, expires_at)
         VALUES ($1, $2, 0, $3, now() + interval '30 seconds') ON CONFLICT DO NOTHING",
    )
    .bind(&id.as_bytes()[..])
    .bind(&[7u8; 32][..])
    .bind(uuid::Uuid::new_v4())
    .execute(pool)
    .await;
    matches!(claimed, Ok(r) if r.rows_affected() == 1)
}

/// The raw Postgres completion of a baseline: one update.
pub(crate) async fn postgres_complete(pool: &PgPool, id: &RecordId, response: &[u8]) -> bool {
    sqlx::query(
        "UPDATE idempotency_keys SET state = 1, status = 201, response = $2, completed_at = now(),
         expires_at = now() + interval '1 hour' WHERE record_id = $1",
    )
    .bind(&id.as_bytes()[..])
    .bind(response)
    .execute(pool)
    .await
    .is_ok()
}

async fn postgres_claim_and_complete(pool: &PgPool, id: &RecordId) -> bool {
    postgres_claim(pool, id).await && postgres_complete(pool, id, &outcome().encode()).await
}

/// Redis: the claim (`SET NX PX`) and the cache write (`SET EX`).
pub(crate) struct RedisBaseline(pub(crate) redis::aio::MultiplexedConnection);

#[async_trait::async_trait]
impl Op for RedisBaseline {
    async fn run(&self, id: RecordId) -> bool {
        let mut conn = self.0.clone();
        let key = format!("baseline:{{{}}}", id.to_hex());
        if !redis_claim(&mut conn, &key).await {
            return false;
        }
        cache_write(&mut conn, &key, &outcome().encode()).await
    }
}

/// Hybrid: a Redis read (miss), the Postgres claim and completion, the Redis cache write.
pub(crate) struct HybridBaseline(
    pub(crate) redis::aio::MultiplexedConnection,
    pub(crate) PgPool,
);

#[async_trait::async_trait]
impl Op for HybridBaseline {
    async fn run(&self, id: RecordId) -> bool {
        let mut conn = self.0.clone();
        let key = format!("baseline:{{{}}}", id.to_hex());
        let cached: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .ok()
            .flatten();
        if cached.is_some() || !postgres_claim_and_complete(&self.1, &id).await {
            return false;
        }
        cache_write(&mut conn, &key, &outcome().encode()).await
    }
}

fn fresh_id(scope: &Scope, n: u64) -> RecordId {
    RecordId::new(
        scope,
        &IdempotencyKey::new(format!("k{n}")).unwrap_or_else(|e| unreachable!("{e}")),
    )
}

/// `ops` operations one after the other.
pub(crate) async fn sequential(group: &str, name: &str, op: &dyn Op, ops: u64) -> Measured {
    let scope = Scope::new(uuid::Uuid::new_v4().to_string());
    let mut h = stats::histogram();
    let mut errors = 0;
    let started = Instant::now();
    for n in 0..ops {
        let t = Instant::now();
        if op.run(fresh_id(&scope, n)).await {
            stats::record(&mut h, t.elapsed());
        } else {
            errors += 1;
        }
    }
    Measured::new(group, name, &h, errors, started.elapsed())
}

/// `concurrency` workers for `duration`.
pub(crate) async fn concurrent(
    group: &str,
    name: &str,
    op: Arc<dyn Op>,
    concurrency: usize,
    duration: Duration,
) -> Measured {
    let scope = Scope::new(uuid::Uuid::new_v4().to_string());
    let started = Instant::now();
    let workers = (0..concurrency as u64).map(|w| {
        let (op, scope) = (op.clone(), scope.clone());
        tokio::spawn(async move {
            let mut h = stats::histogram();
            let mut errors = 0;
            let mut n = 0u64;
            while started.elapsed() < duration {
                let t = Instant::now();
                if op.run(fresh_id(&scope, w << 40 | n)).await {
                    stats::record(&mut h, t.elapsed());
                } else {
                    errors += 1;
                }
                n += 1;
            }
            (h, errors)
        })
    });
    let mut h = stats::histogram();
    let mut errors = 0;
    for result in futures::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
    {
        let _ = h.add(&result.0);
        errors += result.1;
    }
    Measured::new(group, name, &h, errors, started.elapsed())
}

/// A store's name, the framework over it, and its hand-written baseline.
pub(crate) type Pair = (&'static str, Arc<dyn Op>, Arc<dyn Op>);

/// The four stores and their baselines, ready to run.
pub(crate) struct Subjects {
    pub(crate) memory: Arc<dyn Store>,
    pub(crate) postgres: Arc<PostgresStore>,
    pub(crate) postgres_per_request: Arc<PostgresStore>,
    pub(crate) redis: Arc<RedisStore>,
    pub(crate) hybrid: Arc<HybridStore>,
    pub(crate) hybrid_no_mirror: Arc<HybridStore>,
    pub(crate) pool: PgPool,
    pub(crate) redis_conn: redis::aio::MultiplexedConnection,
}

impl Subjects {
    pub(crate) fn pairs(&self) -> Vec<Pair> {
        vec![
            (
                "memory",
                Arc::new(Framework(self.memory.clone())),
                Arc::new(MemoryBaseline(Mutex::default())),
            ),
            (
                "postgres",
                Arc::new(Framework(self.postgres.clone())),
                Arc::new(PostgresBaseline(self.pool.clone())),
            ),
            (
                "postgres (per-request)",
                Arc::new(Framework(self.postgres_per_request.clone())),
                Arc::new(PostgresBaseline(self.pool.clone())),
            ),
            (
                "redis",
                Arc::new(Framework(self.redis.clone())),
                Arc::new(RedisBaseline(self.redis_conn.clone())),
            ),
            (
                "hybrid",
                Arc::new(Framework(self.hybrid.clone())),
                Arc::new(HybridBaseline(self.redis_conn.clone(), self.pool.clone())),
            ),
            (
                // The baseline has no mirror either: the same I/O as the hybrid baseline.
                "hybrid (no mirror)",
                Arc::new(Framework(self.hybrid_no_mirror.clone())),
                Arc::new(HybridBaseline(self.redis_conn.clone(), self.pool.clone())),
            ),
        ]
    }
}
