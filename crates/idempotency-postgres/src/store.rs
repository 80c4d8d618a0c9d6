//! `PostgresStore`: the record state machine in one table, every race decided by Postgres.

use std::{future::Future, sync::Arc, time::Duration};

use async_trait::async_trait;
use idempotency_core::{
    Begin, Error, Fingerprint, LeaseToken, Outcome, RecordId, Result, Store, detached_claim,
};
use sqlx::{
    PgConnection, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};

use crate::batch::{Batches, BeginJob, CompleteJob, FenceJob, GroupCommit, GroupCommitStats};

/// How many times `begin` re-runs when the row it saw vanished or was taken over between two
/// statements. Each retry means another client made progress, so the loop cannot spin long.
const MAX_BEGIN_ROUNDS: usize = 8;

/// A [`Store`] on one Postgres table, `idempotency_keys` (see `migrations/`).
///
/// The table's primary key is the record id, so exactly one `INSERT` per key can succeed: the
/// guarantee does not depend on any cache or clock outside Postgres. No transaction stays open
/// while the operation runs: `begin` commits its claim, the operation runs, then `complete` /
/// `release` fence on the lease token in their own statements. A pool of N connections
/// therefore serves any number of in-flight operations.
///
/// Round trips on the common path: `begin` 1 (insert, or conflict and read the live row, in
/// one statement), `complete` 1, `release` 1, `renew` 1. A race with a concurrent insert
/// costs one more read; taking over an expired lease one more compare-and-set.
///
/// ```no_run
/// use idempotency_postgres::PostgresStore;
///
/// # async fn run() -> Result<(), idempotency_core::Error> {
/// let store = PostgresStore::builder("postgres://app@127.0.0.1/app")
///     .max_connections(16)
///     .connect()
///     .await?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    call_timeout: Duration,
    /// Group commit (`None`: one statement per call, the per-request store).
    batches: Option<Arc<Batches>>,
}

/// Configures and connects a [`PostgresStore`].
#[derive(Debug, Clone)]
pub struct PostgresStoreBuilder {
    url: String,
    max_connections: u32,
    acquire_timeout: Duration,
    statement_timeout: Duration,
    call_timeout: Duration,
    group_commit: Option<GroupCommit>,
}

impl PostgresStoreBuilder {
    /// Group-commit settings (on by default, see [`GroupCommit`]). The batches run on a pool
    /// of their own, `concurrency` × 4 connections at most, beside the `max_connections` of
    /// the per-request statements.
    pub fn group_commit(mut self, settings: GroupCommit) -> Self {
        self.group_commit = Some(settings);
        self
    }

    /// One statement per call, no group commit: the per-request store (a benchmark's
    /// baseline, or a database that must not see array statements).
    pub fn per_request(mut self) -> Self {
        self.group_commit = None;
        self
    }

    /// Pool size (default 10).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// How long a call waits for a pooled connection (default 2 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Postgres `statement_timeout` for the store's connections (default 2 s).
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// The hard budget of one store call, connection included (default 3 s). Past it the call
    /// returns [`Error::Unavailable`]: a hung database costs at most this, never a hang.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Builds the pool. Connections open lazily, so this succeeds while the database is down;
    /// the first call then reports [`Error::Unavailable`].
    pub async fn connect(self) -> Result<PostgresStore> {
        let options: PgConnectOptions = self
            .url
            .parse()
            .map_err(|e| Error::Config(format!("invalid Postgres URL: {e}")))?;
        // The statements assume READ COMMITTED (a conflicting insert waits, then re-reads;
        // a takeover re-checks the row it waited on). Pin it, so a server whose default is
        // SERIALIZABLE does not turn ordinary races into serialization failures.
        let options = options.options([
            (
                "statement_timeout",
                self.statement_timeout.as_millis().to_string(),
            ),
            ("default_transaction_isolation", "read committed".to_owned()),
        ]);
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .connect_lazy_with(options.clone());
        // The batches' own connections wait on a row lock only briefly: a key another
        // transaction holds gives its batch back to the per-request path instead of stalling
        // every other call in it.
        let statement_timeout = self.statement_timeout;
        let batches = self.group_commit.map(|mut settings| {
            // A lock wait must end as a lock timeout (the batch goes per-request), never as
            // the statement timeout (which fails every call in it).
            settings.lock_timeout = settings.lock_timeout.min(statement_timeout / 2);
            // And one plan per statement, by key: a batch statement's custom plan (chosen
            // while its estimate beats the generic one's, which it always does for a short
            // array) is planned anew on every execution, and planning costs more than the
            // batch. The generic plan is made once per connection, maybe on a table still
            // empty, where a sequential scan looks cheapest and would then be kept while the
            // table grows; these connections run nothing but key lookups, so scans and hash
            // joins are ruled out.
            let options = options.options([
                (
                    "lock_timeout",
                    settings.lock_timeout.as_millis().max(1).to_string(),
                ),
                ("plan_cache_mode", "force_generic_plan".to_owned()),
                ("enable_seqscan", "off".to_owned()),
                ("enable_hashjoin", "off".to_owned()),
                ("enable_mergejoin", "off".to_owned()),
            ]);
            let pool = PgPoolOptions::new()
                .max_connections(u32::try_from(settings.concurrency.max(1) * 4).unwrap_or(u32::MAX))
                .acquire_timeout(self.acquire_timeout)
                .connect_lazy_with(options);
            Arc::new(Batches::new(pool, settings))
        });
        Ok(PostgresStore {
            pool,
            call_timeout: self.call_timeout,
            batches,
        })
    }
}

/// The embedded migrations (the top-level `migrations/` directory), recorded in their own
/// table `_idempotency_migrations` so they never collide with the application's.
pub fn migrator() -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("../../migrations");
    migrator.dangerous_set_table_name("_idempotency_migrations");
    migrator
}

/// Whether a statement failed only because it raced another under a stricter isolation
/// level than the store assumes (a pool the application configured): run it again.
pub(crate) fn is_serialization_race(error: &Error) -> bool {
    matches!(error, Error::Unavailable(source)
        if source.downcast_ref::<sqlx::Error>().is_some_and(|e| matches!(e,
            sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")))))
}

fn db_error(error: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &error {
        // undefined_table: the migrations have not run. No retry will fix that.
        if db.code().as_deref() == Some("42P01") {
            return Error::Config(format!(
                "{db}: run PostgresStore::migrate (or idempotency_postgres::migrator()) first"
            ));
        }
    }
    Error::unavailable(error)
}

/// A lease or retention in milliseconds, capped at 100 years: longer is "for good" in
/// practice, and past Postgres' range the arithmetic would fail the statement.
pub(crate) fn millis(d: Duration) -> i64 {
    const CAP_MS: u128 = 100 * 366 * 86_400 * 1_000;
    i64::try_from(d.as_millis().min(CAP_MS)).unwrap_or(i64::MAX)
}

/// What `BEGIN_SQL` returns: inserted, or the live row's columns.
type BeginRow = (
    bool,
    Option<Vec<u8>>,
    Option<i16>,
    Option<Vec<u8>>,
    Option<f64>,
);

/// The live row as `begin` reads it.
pub(crate) type RowView = (Vec<u8>, i16, Option<Vec<u8>>, f64);

/// What one claim statement (per request or batched) found.
#[derive(Debug)]
pub(crate) enum Round {
    /// Inserted with the statement's token; this many ms of lease left.
    Granted(f64),
    /// The live (or expired) row.
    Row(RowView),
    /// A conflict with a row the statement's snapshot cannot see: read it again.
    Hidden,
}

pub(crate) fn fingerprint(bytes: Vec<u8>) -> Result<Fingerprint> {
    let bytes: [u8; 32] = bytes
        .try_into()
        .map_err(|_| Error::Corrupt("fingerprint is not 32 bytes".into()))?;
    Ok(Fingerprint::from_bytes(bytes))
}

// Every expiry is computed with `clock_timestamp()`, not `now()` (the start of the
// transaction: a statement inside a long caller transaction, `complete_in`, would store a
// retention that is partly over already). That is not enough for a claim that waited on a row
// lock: Postgres computes an UPDATE's new values before it waits for a row that another
// transaction only locked, so the lease written after the wait may be over already. Claims
// therefore return the lease actually left (`RETURNING`, evaluated after the write), and a
// grant that waited is re-armed by a fenced renew before it is handed out (`fresh_grant`).

/// Claims the key, or reads the live row, in one statement. The second SELECT runs in the
/// statement's snapshot, so it sees rows committed before the statement started (the usual
/// replay) but not a row whose concurrent insert made ours conflict: that case returns no
/// row and `begin` reads again in a new statement.
const BEGIN_SQL: &str = "
WITH ins AS (
    INSERT INTO idempotency_keys (record_id, fingerprint, state, lease_token, expires_at)
    VALUES ($1, $2, 0, $3, clock_timestamp() + $4 * interval '1 millisecond')
    ON CONFLICT (record_id) DO NOTHING
    RETURNING expires_at
)
SELECT true, NULL::bytea, NULL::smallint, NULL::bytea,
       (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8 FROM ins
UNION ALL
SELECT false, fingerprint, state, response,
       (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8
FROM idempotency_keys WHERE record_id = $1 AND NOT EXISTS (SELECT 1 FROM ins)";

const READ_SQL: &str = "
SELECT fingerprint, state, response, (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8
FROM idempotency_keys WHERE record_id = $1";

/// Compare-and-set takeover of an expired row. Under READ COMMITTED a concurrent takeover
/// blocks on the row lock, re-checks `expires_at <= clock_timestamp()` against the new
/// version and updates nothing: exactly one taker wins. A late `complete` of the old owner
/// that committed first makes the row live again, and the takeover updates nothing.
const TAKEOVER_SQL: &str = "
UPDATE idempotency_keys
SET fingerprint = $2, state = 0, lease_token = $3,
    expires_at = clock_timestamp() + $4 * interval '1 millisecond',
    status = NULL, response = NULL, created_at = clock_timestamp(), completed_at = NULL
WHERE record_id = $1 AND expires_at <= clock_timestamp()
RETURNING (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8";

/// Re-arms a lease just granted whose write waited on a lock (see `fresh_grant`).
const REARM_SQL: &str = "
UPDATE idempotency_keys SET expires_at = clock_timestamp() + $3 * interval '1 millisecond'
WHERE record_id = $1 AND lease_token = $2 AND state = 0
RETURNING (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8";

/// Every write below is fenced: the token must own the in-flight row. Its lease may have run
/// out: a takeover replaces the token, so a row still carrying it was taken by nobody, and a
/// late completion is better than a second execution. Completing again with the same token
/// (the first answer was lost) returns the row's fingerprint and changes nothing.
const COMPLETE_SQL: &str = "
WITH done AS (
    UPDATE idempotency_keys
    SET state = 1, status = $3, response = $4, completed_at = clock_timestamp(),
        expires_at = clock_timestamp() + $5 * interval '1 millisecond'
    WHERE record_id = $1 AND lease_token = $2 AND state = 0
    RETURNING fingerprint
)
SELECT fingerprint, true FROM done
UNION ALL
SELECT fingerprint, false FROM idempotency_keys
WHERE record_id = $1 AND lease_token = $2 AND state = 1 AND NOT EXISTS (SELECT 1 FROM done)";

/// Whether this token completed the row already (see `complete_returning`).
const COMPLETED_BY_SQL: &str = "
SELECT fingerprint, false FROM idempotency_keys
WHERE record_id = $1 AND lease_token = $2 AND state = 1";

const RELEASE_SQL: &str = "
DELETE FROM idempotency_keys WHERE record_id = $1 AND lease_token = $2 AND state = 0";

const RENEW_SQL: &str = "
UPDATE idempotency_keys SET expires_at = clock_timestamp() + $3 * interval '1 millisecond'
WHERE record_id = $1 AND lease_token = $2 AND state = 0";

/// Bounded and `SKIP LOCKED`: two purgers split the work, and rows a live `begin` or
/// `complete` is updating are skipped rather than waited on. (`now()` here, not
/// `clock_timestamp()`: a volatile bound would keep the index on `expires_at` out of use.)
/// An expired lease is left alone for `$2` ms (`LATE_COMPLETION_GRACE`), for its owner's
/// late completion.
const PURGE_SQL: &str = "
DELETE FROM idempotency_keys WHERE record_id IN (
    SELECT record_id FROM idempotency_keys
    WHERE expires_at < now()
      AND (state = 1 OR expires_at < now() - $2 * interval '1 millisecond')
    LIMIT $1 FOR UPDATE SKIP LOCKED
)";

impl PostgresStore {
    /// Starts configuring a store for `url`.
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.into(),
            max_connections: 10,
            acquire_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(3),
            group_commit: Some(GroupCommit::default()),
        }
    }

    /// A store on an existing pool (the application's own, for example), with group commit
    /// on that same pool. Configure the pool's acquire timeout yourself; the call budget is
    /// 3 s. The pool's connections carry no `lock_timeout` unless you set one, so a key
    /// another transaction holds can stall its batch up to the `statement_timeout`: prefer
    /// [`PostgresStore::builder`], whose batches run on connections that give up early.
    pub fn from_pool(pool: PgPool) -> Self {
        let batches = Arc::new(Batches::new(pool.clone(), GroupCommit::default()));
        Self {
            pool,
            call_timeout: Duration::from_secs(3),
            batches: Some(batches),
        }
    }

    /// How many calls and statements the group commit has served so far (zeros for a
    /// per-request store).
    ///
    /// ```no_run
    /// # async fn run(store: idempotency_postgres::PostgresStore) {
    /// let stats = store.group_commit_stats();
    /// println!("mean batch: {:.1}", stats.calls as f64 / stats.statements.max(1) as f64);
    /// # }
    /// ```
    pub fn group_commit_stats(&self) -> GroupCommitStats {
        self.batches
            .as_deref()
            .map(Batches::stats)
            .unwrap_or_default()
    }

    pub(crate) fn batches(&self) -> Option<&Batches> {
        self.batches.as_deref()
    }

    pub(crate) fn group_commit_settings(&self) -> GroupCommit {
        self.batches
            .as_deref()
            .map(|b| b.settings)
            .unwrap_or_default()
    }

    pub(crate) fn batch_pool(&self) -> PgPool {
        self.batches
            .as_deref()
            .map_or_else(|| self.pool.clone(), |b| b.pool.clone())
    }

    /// The pool, for the application's own queries and transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the embedded migrations. Safe to run twice and from several processes at once
    /// (a Postgres advisory lock serialises them).
    pub async fn migrate(&self) -> Result<()> {
        migrator().run(&self.pool).await.map_err(Error::unavailable)
    }

    async fn timed<T>(&self, call: impl Future<Output = Result<T>>) -> Result<T> {
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(Error::unavailable(format!(
                "Postgres did not answer within {:?}",
                self.call_timeout
            ))),
        }
    }

    /// Completes the record inside the caller's transaction, so the application's own writes
    /// and the stored outcome commit or roll back together.
    ///
    /// Use it when the operation's effect lives in the same database: a crash between "charge
    /// row written" and "outcome stored" is then impossible, because both are one commit. If
    /// the transaction rolls back, the record stays in flight until its lease expires (or the
    /// caller releases it) and a retry executes again, finding no business row.
    ///
    /// The row stays locked until the transaction ends; a concurrent `begin` on the same key
    /// sees it in flight meanwhile. The retention counts from when the row is written
    /// (`clock_timestamp()`), not from the start of the caller's transaction.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use idempotency_core::{LeaseToken, Outcome, RecordId};
    /// # use idempotency_postgres::PostgresStore;
    /// # async fn run(store: &PostgresStore, id: RecordId, token: LeaseToken) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = store.pool().begin().await?;
    /// sqlx::query("INSERT INTO charges (id, record_id, amount) VALUES ('ch_1', $1, 1000)")
    ///     .bind(&id.as_bytes()[..])
    ///     .execute(&mut *tx)
    ///     .await?;
    /// let outcome = Outcome::new(201).with_body(r#"{"id":"ch_1"}"#);
    /// PostgresStore::complete_in(&mut tx, &id, token, &outcome, Duration::from_secs(86_400)).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete_in(
        conn: &mut PgConnection,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        Self::complete_returning(conn, id, token, outcome, retention)
            .await
            .map(|_| ())
    }

    /// Completes and returns the record's fingerprint (one statement): what a cache in front
    /// of Postgres needs to store the outcome under. `None` when this token had completed the
    /// record already: `outcome` was not stored (the first one stands), so must not be cached.
    pub async fn complete_with_fingerprint(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<Option<Fingerprint>> {
        let job = || CompleteJob {
            id: *id,
            token,
            status: outcome.status as i16,
            response: outcome.encode().to_vec(),
            retention,
        };
        self.timed(async {
            if let Some(batches) = &self.batches
                && let Some(answer) = batches.complete.call(self, |b| &b.complete, job()).await?
            {
                return Ok(answer);
            }
            self.complete_statement(&job(), &self.pool).await
        })
        .await
    }

    /// The per-request `complete`.
    pub(crate) async fn complete_statement(
        &self,
        job: &CompleteJob,
        pool: &PgPool,
    ) -> Result<Option<Fingerprint>> {
        let mut conn = pool.acquire().await.map_err(db_error)?;
        Self::complete_encoded(&mut conn, job).await
    }

    async fn complete_returning(
        conn: &mut PgConnection,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<Option<Fingerprint>> {
        let job = CompleteJob {
            id: *id,
            token,
            status: outcome.status as i16,
            response: outcome.encode().to_vec(),
            retention,
        };
        Self::complete_encoded(conn, &job).await
    }

    async fn complete_encoded(
        conn: &mut PgConnection,
        job: &CompleteJob,
    ) -> Result<Option<Fingerprint>> {
        let (id, token) = (&job.id, job.token);
        let row: Option<(Vec<u8>, bool)> = sqlx::query_as(COMPLETE_SQL)
            .bind(&id.as_bytes()[..])
            .bind(token.as_uuid())
            .bind(job.status)
            .bind(&job.response[..])
            .bind(millis(job.retention))
            .fetch_optional(&mut *conn)
            .await
            .map_err(db_error)?;
        let (fp, fresh) = match row {
            Some(row) => row,
            // A concurrent `complete` by this same token (a retry racing a call that was given
            // up but still held the row lock) committed while this statement waited: its
            // snapshot cannot see that. Look again in a new statement before saying LeaseLost.
            None => sqlx::query_as::<_, (Vec<u8>, bool)>(COMPLETED_BY_SQL)
                .bind(&id.as_bytes()[..])
                .bind(token.as_uuid())
                .fetch_optional(&mut *conn)
                .await
                .map_err(db_error)?
                .ok_or(Error::LeaseLost)?,
        };
        let fp = fingerprint(fp)?;
        Ok(fresh.then_some(fp))
    }

    /// Reads a live row's answer, with how long the row still lives; `None` when it expired.
    fn decide(fp: &Fingerprint, row: RowView) -> Result<Option<(Begin, Option<Duration>)>> {
        let (stored_fp, state, response, remaining_ms) = row;
        if remaining_ms <= 0.0 {
            return Ok(None); // expired: take it over
        }
        let remaining = Duration::from_millis(remaining_ms.ceil() as u64);
        if stored_fp != fp.as_bytes() {
            return Ok(Some((Begin::Mismatch, None)));
        }
        if state == 1 {
            let response =
                response.ok_or_else(|| Error::Corrupt("completed row without response".into()))?;
            let outcome = Outcome::decode(&response).map_err(|e| Error::Corrupt(e.to_string()))?;
            return Ok(Some((Begin::Replay(outcome), Some(remaining))));
        }
        Ok(Some((
            Begin::InFlight {
                retry_after: remaining,
            },
            Some(remaining),
        )))
    }

    /// [`Store::begin`], plus how long the record lives from now on Postgres' clock: the
    /// lease for `Execute`, the rest of the lease for `InFlight`, the rest of the retention for
    /// `Replay` (`None` for `Mismatch`). A cache in front of Postgres uses it so its copy never
    /// outlives the row.
    pub async fn begin_with_ttl(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
    ) -> Result<(Begin, Option<Duration>)> {
        // The claim runs in its own task: if this call is dropped or runs out of budget after
        // the INSERT committed, the lease it granted is released instead of sitting claimed
        // by nobody until it expires.
        let (this, releaser, id, fp) = (self.clone(), self.clone(), *id, *fp);
        let claim = async move { this.claim_with_ttl(&id, &fp, lease).await };
        let release = move |token| -> futures::future::BoxFuture<'static, ()> {
            Box::pin(async move { idempotency_core::release_orphan(&releaser, &id, token).await })
        };
        self.timed(detached_claim(claim, release)).await
    }

    /// [`PostgresStore::begin_with_ttl`] without a task of its own, for a store that already
    /// runs its claim in one (the hybrid store's `begin` is a [`detached_claim`] around Redis
    /// and this): one hand-off per claim instead of two.
    ///
    /// Not cancel-safe by itself: dropped after the claim committed, it leaves the lease
    /// claimed by nobody until it expires. Run it to its end, as `detached_claim` does. Its
    /// own bound is generous (four call timeouts: it only has to end); a statement it gave
    /// up on may still commit, so every token it may have written is then released.
    pub async fn claim_with_ttl(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
    ) -> Result<(Begin, Option<Duration>)> {
        let budget = self.call_timeout * 4;
        let tokens: [LeaseToken; MAX_BEGIN_ROUNDS] =
            std::array::from_fn(|_| LeaseToken::generate());
        match tokio::time::timeout(budget, self.claim(id, fp, lease, &tokens)).await {
            Ok(answer) => answer,
            Err(_) => {
                let (late, id) = (self.clone(), *id);
                tokio::spawn(async move {
                    // Once the server has had time to finish or cancel the statement.
                    tokio::time::sleep(late.call_timeout).await;
                    for token in tokens {
                        idempotency_core::release_orphan(&late, &id, token).await;
                    }
                });
                Err(Error::unavailable("Postgres claim did not settle"))
            }
        }
    }

    /// The hard budget of one call (see [`PostgresStoreBuilder::call_timeout`]).
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// The claim, round by round until the record's state settles the answer: the first
    /// round through a batch when group commit is on, the others (rare: a race, a takeover)
    /// on the per-request path, each with a token of its own.
    async fn claim(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        tokens: &[LeaseToken],
    ) -> Result<(Begin, Option<Duration>)> {
        for (round, token) in tokens.iter().enumerate() {
            let job = BeginJob::new(id, fp, *token, lease);
            let found = match (&self.batches, round) {
                // `None`: the batch gave the call back (a lock, a race): next round.
                (Some(batches), 0) => batches.begin.call(self, |b| &b.begin, job).await,
                _ => self.begin_statement(&job, &self.pool).await.map(Some),
            };
            let settled = match found {
                Ok(Some(found)) => self.follow(id, fp, lease, *token, found).await,
                other => other.map(|_| None),
            };
            match settled {
                Ok(Some(decision)) => return Ok(decision),
                Ok(None) => {}
                // Another transaction won the race; under READ COMMITTED this cannot happen,
                // under a pool configured SERIALIZABLE it can: the next round reads the winner.
                Err(error) if is_serialization_race(&error) => {}
                Err(error) => return Err(error),
            }
        }
        Err(Error::unavailable(
            "begin did not settle: the record changed on every read",
        ))
    }

    /// The per-request claim statement: insert, or read the live row.
    pub(crate) async fn begin_statement(&self, job: &BeginJob, pool: &PgPool) -> Result<Round> {
        let row: Option<BeginRow> = claim_query(BEGIN_SQL, &job.id, &job.fp, job.token, job.lease)
            .fetch_optional(pool)
            .await
            .map_err(db_error)?;
        match row {
            Some((true, _, _, _, Some(left))) => Ok(Round::Granted(left)),
            Some((false, Some(f), Some(s), r, Some(ms))) => Ok(Round::Row((f, s, r, ms))),
            Some(_) => Err(Error::Corrupt("unexpected begin row".into())),
            None => Ok(Round::Hidden),
        }
    }

    /// Settles one round: hands out a fresh grant, answers from the live row, or takes an
    /// expired one over. `None` when the row changed between two statements and the next
    /// round must look again.
    async fn follow(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        token: LeaseToken,
        round: Round,
    ) -> Result<Option<(Begin, Option<Duration>)>> {
        let view = match round {
            Round::Granted(left) => return self.fresh_grant(id, token, lease, left).await,
            Round::Row(view) => Some(view),
            // Conflict with a row our snapshot cannot see: read it in a new statement.
            Round::Hidden => sqlx::query_as::<_, RowView>(READ_SQL)
                .bind(&id.as_bytes()[..])
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?,
        };
        let Some(view) = view else {
            return Ok(None); // released or purged in between: insert again
        };
        if let Some(decision) = Self::decide(fp, view)? {
            return Ok(Some(decision));
        }
        let taken: Option<(f64,)> = claim_query(TAKEOVER_SQL, id, fp, token, lease)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        if let Some((left,)) = taken {
            tracing::info!(record = %id, "took over an expired idempotency lease");
            return self.fresh_grant(id, token, lease, left).await;
        }
        // Another attempt took it over first (or the owner completed late): its row decides,
        // in the next round.
        Ok(None)
    }
}

impl PostgresStore {
    /// Hands out a lease only while most of it is left. A claim whose write waited on a row
    /// lock may have written a lease that is (nearly) over: another `begin` could take it
    /// over at once and run the operation a second time. Such a grant is re-armed by a
    /// fenced renew; if another attempt took the row meanwhile, the next round reads it.
    async fn fresh_grant(
        &self,
        id: &RecordId,
        token: LeaseToken,
        lease: Duration,
        mut left_ms: f64,
    ) -> Result<Option<(Begin, Option<Duration>)>> {
        let half = lease.as_secs_f64() * 500.0;
        for _ in 0..2 {
            if left_ms >= half {
                return Ok(Some((Begin::Execute(token), Some(lease))));
            }
            tracing::info!(record = %id, left_ms, "a claim waited on a lock: re-arming its lease");
            let rearmed: Option<(f64,)> = sqlx::query_as(REARM_SQL)
                .bind(&id.as_bytes()[..])
                .bind(token.as_uuid())
                .bind(millis(lease))
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?;
            match rearmed {
                Some((left,)) => left_ms = left,
                None => return Ok(None), // taken over meanwhile: look again
            }
        }
        // Still waiting on locks: give this grant back, and the next round looks again.
        sqlx::query(RELEASE_SQL)
            .bind(&id.as_bytes()[..])
            .bind(token.as_uuid())
            .execute(&self.pool)
            .await
            .map_err(db_error)?;
        Ok(None)
    }
}

impl PostgresStore {
    /// The per-request `release`: whether the token owned the in-flight row.
    pub(crate) async fn release_statement(&self, job: &FenceJob, pool: &PgPool) -> Result<bool> {
        let done = sqlx::query(RELEASE_SQL)
            .bind(&job.id.as_bytes()[..])
            .bind(job.token.as_uuid())
            .execute(pool)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    /// The per-request `renew`: whether the token owned the in-flight row.
    pub(crate) async fn renew_statement(&self, job: &FenceJob, pool: &PgPool) -> Result<bool> {
        let done = sqlx::query(RENEW_SQL)
            .bind(&job.id.as_bytes()[..])
            .bind(job.token.as_uuid())
            .bind(millis(job.lease))
            .execute(pool)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }
}

/// A claim statement (`BEGIN_SQL`, `TAKEOVER_SQL`) with its four parameters bound.
fn claim_query<'q, O>(
    sql: &'static str,
    id: &'q RecordId,
    fp: &'q Fingerprint,
    token: LeaseToken,
    lease: Duration,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>
where
    O: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
    sqlx::query_as(sql)
        .bind(&id.as_bytes()[..])
        .bind(&fp.as_bytes()[..])
        .bind(token.as_uuid())
        .bind(millis(lease))
}

fn fenced(owned: bool) -> Result<()> {
    if owned { Ok(()) } else { Err(Error::LeaseLost) }
}

#[async_trait]
impl Store for PostgresStore {
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        Ok(self.begin_with_ttl(id, fp, lease).await?.0)
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        self.complete_with_fingerprint(id, token, outcome, retention)
            .await
            .map(|_| ())
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        let job = || FenceJob {
            id: *id,
            token,
            lease: Duration::ZERO,
        };
        self.timed(async {
            if let Some(batches) = &self.batches
                && let Some(done) = batches.release.call(self, |b| &b.release, job()).await?
            {
                return fenced(done);
            }
            fenced(self.release_statement(&job(), &self.pool).await?)
        })
        .await
    }

    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        let job = || FenceJob {
            id: *id,
            token,
            lease,
        };
        self.timed(async {
            if let Some(batches) = &self.batches
                && let Some(done) = batches.renew.call(self, |b| &b.renew, job()).await?
            {
                return fenced(done);
            }
            fenced(self.renew_statement(&job(), &self.pool).await?)
        })
        .await
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64> {
        self.timed(async {
            let done = sqlx::query(PURGE_SQL)
                .bind(i64::try_from(batch).unwrap_or(i64::MAX))
                .bind(millis(idempotency_core::LATE_COMPLETION_GRACE))
                .execute(&self.pool)
                .await
                .map_err(db_error)?;
            Ok(done.rows_affected())
        })
        .await
    }

    fn name(&self) -> &'static str {
        "postgres"
    }
}
