//! `PostgresStore`: the record state machine in one table, every race decided by Postgres.

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use futures::FutureExt;
use idempotency_core::{
    Begin, Error, Fingerprint, ForceReleased, Inspection, LeaseToken, Outcome, RecordId,
    ReleaseScope, Result, Store, detached_begin, system_time_from_millis,
};
use sqlx::{
    PgConnection, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions, PgSslMode},
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{
    batch::{Batches, BeginJob, CompleteJob, FenceJob, GroupCommit, GroupCommitStats, OnWire},
    checkout::{ALL_OUT_WAIT, BatchPool, Checkout, QueryAsOnPool, QueryOnPool, Source},
    table::{Statements, Table, quoted},
};

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
    /// The sessions' `statement_timeout`, when the builder set it (`None` on an
    /// application's pool): how late a statement given up may still commit.
    statement_timeout: Option<Duration>,
    /// How long the purge keeps an attempt whose outcome is unknown.
    unknown_outcome_retention: Duration,
    /// Shared: a store is cloned per call (claims and batches own one), and the names are
    /// strings.
    table: Arc<Table>,
    /// The statements, for `table`.
    pub(crate) sql: Statements,
    /// Group commit (`None`: one statement per call, the per-request store).
    batches: Option<Arc<Batches>>,
    /// Writes left running in the background (shared by clones): see [`Store::drain`].
    settling: tokio_util::task::TaskTracker,
    /// The runtime the store was made on, if any: where the grants of a claim dropped
    /// unfinished (its caller's runtime shut down mid-statement) are given back.
    home: Option<tokio::runtime::Handle>,
    /// Grants being looked for to give back (shared by clones): see
    /// [`PostgresStore::grants_in_doubt`].
    in_doubt: Arc<AtomicUsize>,
}

/// Configures and connects a [`PostgresStore`].
#[derive(Debug, Clone)]
pub struct PostgresStoreBuilder {
    url: String,
    max_connections: u32,
    acquire_timeout: Duration,
    statement_timeout: Duration,
    call_timeout: Duration,
    unknown_outcome_retention: Duration,
    group_commit: Option<GroupCommit>,
    table: String,
}

/// A connection is handed out unchecked while both it and its pool were in use less than
/// this long ago; otherwise it is pinged first, and replaced if the ping fails (HikariCP's
/// `aliveBypassWindowMs`, same value). sqlx's default pings on every acquire: a round trip
/// before every statement, for nothing under load, since sqlx pings each connection as it
/// returns to the pool too.
///
/// The pool's own clock is kept because sqlx's housekeeping (every ten minutes) takes each
/// idle connection out and puts it back, which restarts the connection's idle time without
/// using it: a quiet service would otherwise skip the check for half a second after each
/// sweep.
///
/// What is lost: when the server dies less than this long after the pool was last used (a
/// crash or failover under load), each pooled connection fails its next call
/// (`Unavailable`; for a group-commit connection, every call in its batch) instead of being
/// replaced first. Nothing runs twice: claims in doubt are given back, and completions are
/// retried.
const ALIVE_BYPASS: Duration = Duration::from_millis(500);

fn pool_options() -> PgPoolOptions {
    // When a connection last came back from a caller, in ms since `base`. Only callers'
    // connections come back through `after_release`; the housekeeping's do not.
    let base = std::time::Instant::now();
    let last_use = Arc::new(AtomicU64::new(0));
    let since_base = move || u64::try_from(base.elapsed().as_millis()).unwrap_or(u64::MAX);
    let used = last_use.clone();
    PgPoolOptions::new()
        .test_before_acquire(false)
        // A claim or an outcome acknowledged by a commit the server has not flushed is lost
        // in a crash of the server, and the retry runs the operation again: a server or
        // role tuned for speed (`synchronous_commit = off`) must not weaken the guarantee.
        // Raised to `local` (flushed on this server), not further: whether commits wait for
        // standbys (`on`, `remote_write`, `remote_apply`) is the operator's choice, which
        // also decides whether a failover can lose them (see the design notes).
        // Set on the session in any case, even to what it is: a session's own setting
        // outranks the server's, so an operator's later `ALTER SYSTEM SET synchronous_commit
        // = off` and reload does not reach the pooled connections.
        .after_connect(|conn, _| {
            Box::pin(async move {
                let level: String = sqlx::query_scalar("SHOW synchronous_commit")
                    .fetch_one(&mut *conn)
                    .await?;
                let level = match level.as_str() {
                    "on" | "remote_write" | "remote_apply" | "local" => level,
                    _ => "local".to_owned(),
                };
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SET synchronous_commit = {level}"
                )))
                .execute(&mut *conn)
                .await?;
                Ok(())
            })
        })
        .after_release(move |_, _| {
            used.store(since_base(), Ordering::Relaxed);
            Box::pin(async { Ok(true) })
        })
        .before_acquire(move |conn, meta| {
            let pool_idle = since_base().saturating_sub(last_use.load(Ordering::Relaxed));
            let quiet =
                meta.idle_for >= ALIVE_BYPASS || Duration::from_millis(pool_idle) >= ALIVE_BYPASS;
            Box::pin(async move {
                if quiet {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

impl PostgresStoreBuilder {
    /// The key table (default `idempotency_keys`), optionally schema-qualified:
    /// `"payments.idempotency_keys"`. Lowercase letters, digits and `_`; anything else is an
    /// [`Error::Config`] at [`connect`](Self::connect). [`PostgresStore::migrate`] creates it
    /// (and its schema) and records its migrations in `<table>_migrations` beside it.
    ///
    /// ```no_run
    /// use idempotency_postgres::PostgresStore;
    ///
    /// # async fn run() -> Result<(), idempotency_core::Error> {
    /// let store = PostgresStore::builder("postgres://app@127.0.0.1/app")
    ///     .table("payments.charge_keys")
    ///     .connect()
    ///     .await?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

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

    /// Postgres `statement_timeout` for the store's connections (default 2 s), between a
    /// millisecond (Postgres reads zero as none) and a day.
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout.clamp(Duration::from_millis(1), LONGEST_BUDGET);
        self
    }

    /// The hard budget of one store call, connection included (default 3 s). Past it the call
    /// returns [`Error::Unavailable`]: a hung database costs at most this, never a hang. At
    /// most a day.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout.min(LONGEST_BUDGET);
        self
    }

    /// How long [`purge_expired`](Store::purge_expired) keeps the record of an attempt
    /// whose outcome is unknown (its lease ran out unfinished and nobody took it over),
    /// counted from when its lease ran out (default
    /// [`UNKNOWN_OUTCOME_RETENTION`](idempotency_core::UNKNOWN_OUTCOME_RETENTION), a day).
    /// Until it is purged a retry is told [`Begin::TakeOver`], which the HTTP layer's
    /// `OutcomeUnknown::Reject` and `Reconcile` act on; once purged, the retry runs as new.
    /// **Set it to at least the longest retention your policies keep outcomes for**: a
    /// crash is then remembered as long as a charge would have been. Never less than
    /// [`LATE_COMPLETION_GRACE`](idempotency_core::LATE_COMPLETION_GRACE) (an hour, what a
    /// shorter setting is raised to): the owner of a lease that ran out may still complete
    /// it until then (the executor and the HTTP layer keep trying that long), and a record
    /// purged before would refuse that completion and let a retry run as new. Capped at
    /// [`FOR_GOOD`](idempotency_core::FOR_GOOD).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idempotency_postgres::PostgresStore;
    ///
    /// # async fn run() -> Result<(), idempotency_core::Error> {
    /// let week = Duration::from_secs(7 * 86_400); // the policies' retention
    /// let store = PostgresStore::builder("postgres://app@127.0.0.1/app")
    ///     .unknown_outcome_retention(week)
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn unknown_outcome_retention(mut self, keep: Duration) -> Self {
        self.unknown_outcome_retention = unknown_outcome_retention(keep);
        self
    }

    /// Builds the pool. Connections open lazily, so this succeeds while the database is down;
    /// the first call then reports [`Error::Unavailable`].
    pub async fn connect(self) -> Result<PostgresStore> {
        let table = Table::parse(&self.table)?;
        let options: PgConnectOptions = self
            .url
            .parse()
            .map_err(|e| Error::Config(format!("invalid Postgres URL: {e}")))?;
        // A URL that requires TLS must not wait for the first call to learn that this build
        // cannot speak it.
        if !cfg!(feature = "tls-rustls")
            && matches!(
                options.get_ssl_mode(),
                PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull
            )
        {
            return Err(Error::Config(
                "the Postgres URL requires TLS (sslmode): enable the `tls-rustls` feature".into(),
            ));
        }
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
        let pool = pool_options()
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
            let pool = pool_options()
                .max_connections(u32::try_from(settings.concurrency.max(1) * 4).unwrap_or(u32::MAX))
                .acquire_timeout(self.acquire_timeout)
                .connect_lazy_with(options);
            Arc::new(Batches::new(pool, true, settings))
        });
        Ok(PostgresStore {
            pool,
            call_timeout: self.call_timeout,
            statement_timeout: Some(self.statement_timeout),
            unknown_outcome_retention: self.unknown_outcome_retention,
            sql: Statements::for_table(&table, ALL_SQL),
            table: Arc::new(table),
            batches,
            settling: tokio_util::task::TaskTracker::new(),
            home: tokio::runtime::Handle::try_current().ok(),
            in_doubt: Arc::default(),
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

/// Whether a claim statement that failed with `error` may have written its token, and so
/// must be looked for (see [`PostgresStore::grants_in_doubt`]): not when the database refused
/// it before it could commit (a lock or statement timeout, a race, no such table; see
/// `batch::in_doubt`).
fn may_have_written(error: &Error) -> bool {
    match error {
        Error::Unavailable(source) => source
            .downcast_ref::<sqlx::Error>()
            .is_none_or(crate::batch::in_doubt),
        Error::Config(_) => false,
        _ => true,
    }
}

fn db_error(error: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &error {
        // undefined_table: the migrations have not run. No retry will fix that.
        if db.code().as_deref() == Some("42P01") {
            return Error::Config(format!(
                "{db}: run the store's migrate() (or apply its migrator()) first"
            ));
        }
    }
    Error::unavailable(error)
}

/// Why [`PostgresStore::commit_claim`] did not commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommitClaimError {
    /// The completion failed, or was refused ([`Error::LeaseLost`]: another attempt took the
    /// key over, or this claim's result committed already); the transaction rolled back.
    #[error(transparent)]
    Store(#[from] Error),
    /// The `COMMIT` failed, with the database's error (its SQLSTATE tells a deferred
    /// constraint, class 23, from a serialization failure, 40001). Lost with the connection,
    /// its answer may hide a commit that landed: the executor's release, fenced to a record
    /// in flight, then leaves the result to replay.
    #[error("the transaction did not commit: {0}")]
    Commit(#[source] sqlx::Error),
}

impl From<CommitClaimError> for Error {
    /// The store's error as it is; a failed `COMMIT` as [`Error::Unavailable`] (one whose
    /// answer was lost may have landed all the same).
    fn from(error: CommitClaimError) -> Self {
        match error {
            CommitClaimError::Store(error) => error,
            CommitClaimError::Commit(error) => db_error(error),
        }
    }
}

/// A lease or retention in milliseconds, capped at [`FOR_GOOD`](idempotency_core::FOR_GOOD):
/// past Postgres' range the arithmetic would fail the statement.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.min(idempotency_core::FOR_GOOD).as_millis()).unwrap_or(i64::MAX)
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

/// Compare-and-set takeover of an expired row: a completed one past its retention, or a
/// lease that ran out unfinished for the same request (another request under the key is a
/// mismatch: it must not inherit an unknown outcome). Under READ COMMITTED a concurrent takeover
/// blocks on the row lock, re-checks `expires_at <= clock_timestamp()` against the new
/// version and updates nothing: exactly one taker wins. A late `complete` of the old owner
/// that committed first makes the row live again, and the takeover updates nothing.
///
/// `$5` is the state the caller read, which decides whether the grant is a new run or one
/// after an unfinished attempt (`TakeOver`): a row that changed state since (another attempt
/// took a completed row over and died unfinished) is not taken, and the next round reads it.
const TAKEOVER_SQL: &str = "
UPDATE idempotency_keys
SET fingerprint = $2, state = 0, lease_token = $3,
    expires_at = clock_timestamp() + $4 * interval '1 millisecond',
    status = NULL, response = NULL, created_at = clock_timestamp(), completed_at = NULL
WHERE record_id = $1 AND expires_at <= clock_timestamp() AND (state = 1 OR fingerprint = $2)
  AND state = $5
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

/// Ends the token's lease now and keeps its row: an unfinished attempt (see `Begin::TakeOver`)
/// whose record must stay for the next `begin` to report.
const EXPIRE_SQL: &str = "
UPDATE idempotency_keys SET expires_at = clock_timestamp()
WHERE record_id = $1 AND lease_token = $2 AND state = 0";

/// The longest budget a setting takes (a longer one, `Duration::MAX` for "no limit", is
/// this): the deadlines and sums of budgets built on it stay far from overflowing.
const LONGEST_BUDGET: Duration = Duration::from_secs(86_400);

/// An unknown outcome's retention as set: at least the late completions' grace, at most
/// for good.
fn unknown_outcome_retention(keep: Duration) -> Duration {
    keep.clamp(
        idempotency_core::LATE_COMPLETION_GRACE,
        idempotency_core::FOR_GOOD,
    )
}

const RENEW_SQL: &str = "
UPDATE idempotency_keys SET expires_at = clock_timestamp() + $3 * interval '1 millisecond'
WHERE record_id = $1 AND lease_token = $2 AND state = 0";

/// Bounded and `SKIP LOCKED`: two purgers split the work, and rows a live `begin` or
/// `complete` is updating are skipped rather than waited on. (`now()` here, not
/// `clock_timestamp()`: a volatile bound would keep the index on `expires_at` out of use.)
/// An expired lease is left alone for `$2` ms (the store's `unknown_outcome_retention`): a
/// retry is told its outcome is unknown, and its owner's late completion is accepted.
const PURGE_SQL: &str = "
DELETE FROM idempotency_keys WHERE record_id IN (
    SELECT record_id FROM idempotency_keys
    WHERE expires_at < now()
      AND (state = 1 OR expires_at < now() - $2 * interval '1 millisecond')
    LIMIT $1 FOR UPDATE SKIP LOCKED
)";

/// The operator's read of a record: its state and times, by the database's clock.
const INSPECT_SQL: &str = "
SELECT state, fingerprint, status,
       (extract(epoch FROM created_at) * 1000)::float8,
       (extract(epoch FROM expires_at) * 1000)::float8,
       (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::float8
FROM idempotency_keys WHERE record_id = $1";

/// The operator's release reads the row under its lock: its state, and whether its lease or
/// retention is over (by the database's clock). Nothing can change the row until the
/// release's transaction ends: a concurrent `complete` or takeover that holds the lock first
/// is waited for, and the newest row is read.
const LOCK_ROW_SQL: &str = "
SELECT state, expires_at <= clock_timestamp() FROM idempotency_keys
WHERE record_id = $1 FOR UPDATE";

/// The operator's release deletes the row it locked (`LOCK_ROW_SQL`), its scope covering
/// it: an in-flight row whose lease ran out, any in-flight row with live leases in scope (its
/// token goes with the row, so the owner's late writes find nothing to update), a live
/// completed row with completed records in scope.
///
/// Only until `$2` (seconds since the epoch, by the database's clock): the end of the call's
/// budget. A delete that reaches Postgres later (its bytes held up by the network after the
/// call gave up) deletes nothing, and the commit after it must arrive by then too: the
/// transaction may stay idle only until then, after which the server ends the session and
/// the delete rolls back. So the release's commit reaches Postgres within its budget or
/// not at all, as the hybrid store's second delete of the record's copy in Redis counts on
/// (a commit that then waits on a synchronous standby becomes visible when that wait ends).
/// While the transaction lives the row stays locked: no record made since can be taken by
/// it. (Nothing deleted, the transaction is rolled back: no shorter idle time then.)
const DELETE_LOCKED_SQL: &str = "
WITH deleted AS (
    DELETE FROM idempotency_keys
    WHERE record_id = $1 AND clock_timestamp() < to_timestamp($2)
    RETURNING 1
)
SELECT n,
       CASE WHEN n > 0 THEN set_config(
           'idle_in_transaction_session_timeout',
           greatest(1, ceil((extract(epoch FROM to_timestamp($2))
                             - extract(epoch FROM clock_timestamp())) * 1000))::bigint::text,
           true) ELSE '' END
FROM (SELECT count(*) AS n FROM deleted) AS d";

/// The database's clock, in seconds since the epoch: what an operator's release is bounded
/// by (`DELETE_LOCKED_SQL`). And, for the release's transaction, the longest it may stay
/// idle (`$1`, in milliseconds: what is left of the call's budget): a connection that hangs
/// mid-transaction holds the row's lock, and every claim of the key waits on it, until the
/// server ends the session.
const CLOCK_SQL: &str = "
SELECT extract(epoch FROM clock_timestamp())::float8,
       set_config('idle_in_transaction_session_timeout', $1, true)";

/// Every statement on the key table, rewritten for another table at connect.
pub(crate) const ALL_SQL: &[&str] = &[
    BEGIN_SQL,
    READ_SQL,
    TAKEOVER_SQL,
    REARM_SQL,
    COMPLETE_SQL,
    COMPLETED_BY_SQL,
    RELEASE_SQL,
    RENEW_SQL,
    EXPIRE_SQL,
    PURGE_SQL,
    INSPECT_SQL,
    LOCK_ROW_SQL,
    DELETE_LOCKED_SQL,
    crate::batch::BEGIN_BATCH_SQL,
    crate::batch::COMPLETE_BATCH_SQL,
    crate::batch::RELEASE_BATCH_SQL,
    crate::batch::RENEW_BATCH_SQL,
];

impl PostgresStore {
    /// Starts configuring a store for `url`.
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.into(),
            max_connections: 10,
            acquire_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(3),
            unknown_outcome_retention: idempotency_core::UNKNOWN_OUTCOME_RETENTION,
            group_commit: Some(GroupCommit::default()),
            table: "idempotency_keys".to_owned(),
        }
    }

    /// A store on an existing pool (the application's own, for example), with group commit
    /// on that same pool. Configure the pool's acquire timeout yourself; the call budget is
    /// 3 s. The pool's connections carry no `lock_timeout` unless you set one, so a key
    /// another transaction holds can stall its batch up to the `statement_timeout`: prefer
    /// [`PostgresStore::builder`], whose batches run on connections that give up early. Set
    /// a `statement_timeout` on the pool's connections (the builder's is 2 s): a call that
    /// runs out of its budget closes its connection, and without one the server keeps the
    /// backend waiting on its lock while the pool opens another. And commit durably
    /// (`synchronous_commit` not `off`): the builder's connections raise `off` to `local`,
    /// the application's keep theirs, and a commit acknowledged but lost in a crash runs its
    /// operation again on the retry.
    pub fn from_pool(pool: PgPool) -> Self {
        let batches = Arc::new(Batches::new(pool.clone(), false, GroupCommit::default()));
        Self {
            pool,
            call_timeout: Duration::from_secs(3),
            statement_timeout: None,
            unknown_outcome_retention: idempotency_core::UNKNOWN_OUTCOME_RETENTION,
            table: Arc::default(),
            sql: Statements::default(),
            batches: Some(batches),
            settling: tokio_util::task::TaskTracker::new(),
            home: tokio::runtime::Handle::try_current().ok(),
            in_doubt: Arc::default(),
        }
    }

    /// This store on another key table than `idempotency_keys` (see
    /// [`PostgresStoreBuilder::table`]), for a store made with [`PostgresStore::from_pool`].
    pub fn with_table(mut self, table: &str) -> Result<Self> {
        self.table = Arc::new(Table::parse(table)?);
        self.sql = Statements::for_table(&self.table, ALL_SQL);
        // Queues of its own: a batch runs the statements of the store that started it, so
        // sharing the original's would run this store's calls on the other table.
        self.batches = self
            .batches
            .as_deref()
            .map(|b| Arc::new(Batches::new(b.pool.clone(), b.own_pool, b.settings)));
        Ok(self)
    }

    /// This store with another [`PostgresStoreBuilder::unknown_outcome_retention`], for a
    /// store made with [`PostgresStore::from_pool`].
    pub fn with_unknown_outcome_retention(mut self, keep: Duration) -> Self {
        self.unknown_outcome_retention = unknown_outcome_retention(keep);
        self
    }

    /// The key table, as the statements name it (`"schema"."table"` or `"table"`).
    pub fn table(&self) -> String {
        self.table.qualified()
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

    /// How many grants this store is still looking for, to give them back: the leases that
    /// claims given up (out of budget, failed after their statement was sent, dropped
    /// mid-statement) may have written unseen (a claim still running whose caller left is
    /// counted once it gives up). Each is looked for again and again for up to
    /// 70 minutes, since a statement held up (by a lock, a network that heals) can still
    /// commit that late; a grant found is given back, one never written is looked for to the
    /// end. Claims that never reached Postgres are not counted: they wrote nothing. A number
    /// for a gauge: it rises during an outage that cut claims off mid-statement, and falls
    /// as their grants are found or their looks end.
    ///
    /// ```no_run
    /// # async fn run(store: idempotency_postgres::PostgresStore) {
    /// println!("grants being looked for: {}", store.grants_in_doubt());
    /// # }
    /// ```
    pub fn grants_in_doubt(&self) -> usize {
        self.in_doubt.load(Ordering::Relaxed)
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

    pub(crate) fn batch_pool(&self) -> BatchPool {
        match self.batches.as_deref() {
            Some(batches) => BatchPool {
                pool: batches.pool.clone(),
                all_out_wait: batches.own_pool.then_some(ALL_OUT_WAIT),
            },
            None => BatchPool {
                pool: self.pool.clone(),
                all_out_wait: None,
            },
        }
    }

    /// The pool, for the application's own queries and transactions. Built by
    /// [`PostgresStore::builder`], it pings a connection before handing it out only when the
    /// connection or the pool sat idle for 500 ms or more (sqlx's default pings every time):
    /// after a crash or failover under load, each pooled connection fails its next call
    /// instead of being replaced first. Its sessions carry the store's settings: the
    /// builder's `statement_timeout` (2 s by default: a longer statement of the application's
    /// is cancelled, `57014`) and `READ COMMITTED` as the default isolation. An application
    /// whose queries need more time or another level sets them in its transaction (`SET
    /// LOCAL statement_timeout`, `SET TRANSACTION ISOLATION LEVEL`), or brings its own pool
    /// ([`PostgresStore::from_pool`]).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the embedded migrations to this store's table. Safe to run twice and from
    /// several processes at once (a Postgres advisory lock serialises them). A table in a
    /// schema that does not exist yet gets its schema (which needs the database's CREATE
    /// privilege; an existing schema needs none).
    pub async fn migrate(&self) -> Result<()> {
        if let Some(schema) = self.table.schema() {
            let (exists,): (bool,) =
                sqlx::query_as("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                    .bind(schema)
                    .fetch_one_on(&self.pool)
                    .await
                    .map_err(Error::unavailable)?;
            if !exists {
                let create = format!("CREATE SCHEMA IF NOT EXISTS {}", quoted(schema));
                sqlx::query(sqlx::AssertSqlSafe(create))
                    .execute_on(&self.pool)
                    .await
                    .map_err(Error::unavailable)?;
            }
        }
        self.migrator()
            .run(&self.pool)
            .await
            .map_err(Error::unavailable)
    }

    /// The embedded migrations written for this store's table: [`migrator()`] for the
    /// default one; for another, the same migrations on that table, recorded in
    /// `<table>_migrations` (its schema must exist: [`PostgresStore::migrate`] creates it).
    pub fn migrator(&self) -> sqlx::migrate::Migrator {
        let embedded = migrator();
        if self.table.is_default() {
            return embedded;
        }
        let migrations = embedded
            .iter()
            .map(|m| {
                sqlx::migrate::Migration::new(
                    m.version,
                    m.description.clone(),
                    m.migration_type,
                    sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(
                        self.table.rewrite(m.sql.as_str()),
                    )),
                    m.no_tx,
                )
            })
            .collect();
        let mut migrator = sqlx::migrate::Migrator::with_migrations(migrations);
        migrator.dangerous_set_table_name(self.table.migrations_table());
        migrator
    }

    /// `call` within the call budget. Not an `async fn`: that would hold `call` twice (its
    /// argument and the timeout around it), and a statement's future is kilobytes.
    fn timed<T>(&self, call: impl Future<Output = Result<T>>) -> impl Future<Output = Result<T>> {
        let budget = self.call_timeout;
        tokio::time::timeout(budget, call).map(move |answer| {
            answer.unwrap_or_else(|_| {
                Err(Error::unavailable(format!(
                    "Postgres did not answer within {budget:?}"
                )))
            })
        })
    }

    /// Completes the record inside the caller's transaction, so the application's own writes
    /// and the stored outcome commit or roll back together.
    ///
    /// Use it when the operation's effect lives in the same database: a crash between "charge
    /// row written" and "outcome stored" is then impossible, because both are one commit. If
    /// the transaction rolls back, the record stays in flight until its lease expires (or the
    /// caller releases it) and a retry executes again, finding no business row.
    ///
    /// It answers [`Error::LeaseLost`] — roll back — when the token no longer holds the
    /// record in flight: another attempt took it over, an operator released it, or this token
    /// completed it already (a transaction retried after its commit's answer was lost: the
    /// effect committed then, and must not commit twice).
    ///
    /// The row stays locked until the transaction ends; a concurrent `begin` on the same key
    /// waits on it meanwhile, then answers the row as it was when its statement began: in
    /// flight (a 409). Its retry replays (committed), or finds the record in flight until
    /// its lease ends (rolled back).
    /// Under `REPEATABLE READ` or `SERIALIZABLE`, complete first (before the effect's
    /// statements): a renewal of the lease committed after the transaction's snapshot makes
    /// the completion fail with a serialization error (`Unavailable`). The retention counts from when the row is written
    /// (`clock_timestamp()`), not from the start of the caller's transaction.
    ///
    /// Called with the id and token of an [`Executor::run_with_claim`] claim, it tells that
    /// run (in this process) what [`Claim::completion`] and [`Claim::accepted`] would: the run
    /// is no longer held for want of a renewal, and once the write was accepted it confirms
    /// the commit instead of storing its result (a transaction that rolls back after it stores
    /// nothing). So never roll the completion back on its own (a savepoint) while the effect
    /// commits: the run would find no completion, release the key, and a retry run the
    /// effect again. See [`idempotency_core::completing_in_transaction`] and
    /// [`idempotency_core::accepted_in_transaction`].
    ///
    /// [`Executor::run_with_claim`]: idempotency_core::Executor::run_with_claim
    /// [`Claim::completion`]: idempotency_core::Claim::completion
    /// [`Claim::accepted`]: idempotency_core::Claim::accepted
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
    /// store.complete_in(&mut tx, &id, token, &outcome, Duration::from_secs(86_400)).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        // Before the write: once it holds the row lock, an `Executor::run_with_claim`
        // operation held for want of a renewal's answer (the renewals wait on that lock)
        // would never commit.
        idempotency_core::completing_in_transaction(id, token);
        let job = CompleteJob {
            id: *id,
            token,
            status: outcome.status as i16,
            response: outcome.encode().to_vec(),
            retention,
        };
        match self.complete_encoded(conn, &job).await? {
            Some(_) => {
                // With no await before the caller's commit can follow: a run of this
                // process holding the token confirms that commit instead of storing its
                // result (a transaction that rolls back later must store nothing).
                idempotency_core::accepted_in_transaction(id, token);
                Ok(())
            }
            // This token completed the record before, in a transaction that committed: the
            // caller is retrying a transaction whose commit answer it lost. Its effect is in
            // that commit already, so this one must roll back, not commit it a second time
            // (`Store::complete`, which writes no effect, answers `Ok` here instead).
            None => Err(Error::LeaseLost),
        }
    }

    /// Stores the result of an [`Executor::run_with_claim`] operation inside the operation's
    /// own transaction: its effect and its stored result commit or roll back together, so a
    /// crash, a panic or a lost commit answer between them never runs the effect twice (a
    /// redelivery replays `value`).
    ///
    /// `value` is stored as the executor stores a result (see [`Claim::completion`]), with
    /// the executor's retention; return that same value once committed. It answers
    /// [`Error::LeaseLost`] when another attempt took the key over, or when this claim
    /// completed it already (a retried transaction whose first commit landed): roll back,
    /// and the effect that committed is the only one. The row stays locked until the
    /// transaction ends, so commit (or return) right after; the executor keeps the lease
    /// renewed meanwhile, and reads a `LeaseLost` renewal against the record (see
    /// [`Claim::accepted`]). The isolation-level advice of [`PostgresStore::complete_in`]
    /// applies.
    ///
    /// Make it the transaction's last statement ([`commit_claim`](Self::commit_claim) does
    /// both): a statement that fails later in the transaction, even one whose error is
    /// ignored, aborts it, and Postgres answers the `COMMIT` with a rollback that sqlx
    /// reports as success. The executor then finds the record still in flight, stores
    /// nothing and releases the key ([`RunError::NotCommitted`]), so a redelivery runs the
    /// operation again; but the operation had told its own caller it succeeded.
    ///
    /// [`RunError::NotCommitted`]: idempotency_core::RunError::NotCommitted
    ///
    /// [`Executor::run_with_claim`]: idempotency_core::Executor::run_with_claim
    /// [`Claim::completion`]: idempotency_core::Claim::completion
    /// [`Claim::accepted`]: idempotency_core::Claim::accepted
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Scope};
    /// # use idempotency_postgres::PostgresStore;
    /// # async fn run(store: Arc<PostgresStore>, message_id: IdempotencyKey) -> Result<(), Box<dyn std::error::Error>> {
    /// let executor = Executor::new(store.clone());
    /// let charged = executor
    ///     .run_with_claim(&Scope::new("charges"), &message_id, &Fingerprint::of(b"1000"), |claim| {
    ///         let store = store.clone();
    ///         async move {
    ///             let mut tx = store.pool().begin().await?;
    ///             sqlx::query("INSERT INTO charges (amount) VALUES (1000)")
    ///                 .execute(&mut *tx)
    ///                 .await?;
    ///             let charge = "ch_1".to_owned();
    ///             store.complete_claim_in(&mut tx, &claim, &charge).await?;
    ///             tx.commit().await?;
    ///             Ok::<_, Box<dyn std::error::Error + Send + Sync>>(charge)
    ///         }
    ///     })
    ///     .await
    ///     .map_err(|e| e.to_string())?;
    /// assert_eq!(charged.value, "ch_1"); // `charged.replayed` on a redelivery
    /// # Ok(()) }
    /// ```
    pub async fn complete_claim_in<T: serde::Serialize>(
        &self,
        conn: &mut PgConnection,
        claim: &idempotency_core::Claim<T>,
        value: &T,
    ) -> Result<()> {
        let completion = claim.completion(value)?;
        self.complete_in(
            conn,
            &completion.id,
            completion.token,
            &completion.outcome,
            completion.retention,
        )
        .await?;
        // No await between the acceptance and this: the commit (after which a renewal finds
        // the record completed) cannot come first.
        claim.accepted();
        Ok(())
    }

    /// [`complete_claim_in`](Self::complete_claim_in), then commits the transaction: the
    /// result is stored as the transaction's last statement, as it must be, and nothing can
    /// run between it and the `COMMIT`. The way to end an [`Executor::run_with_claim`]
    /// operation's transaction. (Commit before the operation returns in any case: the
    /// executor confirms the commit once it returned, and a transaction still open then
    /// holds the row its confirmation waits on.)
    ///
    /// Answers [`CommitClaimError::Store`] as `complete_claim_in` does (a refused completion
    /// rolls the transaction back), or [`CommitClaimError::Commit`] with the database's error
    /// when the `COMMIT` failed (a deferred constraint, a serialization failure, the
    /// connection lost with its answer): return the error, and the executor releases the
    /// key, fenced to a record still in flight, so a commit that landed all the same keeps
    /// its result and replays it. Both convert into the store's [`Error`] (`?` into a
    /// function that returns it; a failed `COMMIT` is then `Unavailable`), and into a boxed
    /// error.
    ///
    /// [`Executor::run_with_claim`]: idempotency_core::Executor::run_with_claim
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use idempotency_core::{Executor, Fingerprint, IdempotencyKey, Scope};
    /// # use idempotency_postgres::PostgresStore;
    /// # async fn run(store: Arc<PostgresStore>, message_id: IdempotencyKey) -> Result<(), Box<dyn std::error::Error>> {
    /// let executor = Executor::new(store.clone());
    /// let charged = executor
    ///     .run_with_claim(&Scope::new("charges"), &message_id, &Fingerprint::of(b"1000"), |claim| {
    ///         let store = store.clone();
    ///         async move {
    ///             let mut tx = store.pool().begin().await?;
    ///             sqlx::query("INSERT INTO charges (amount) VALUES (1000)")
    ///                 .execute(&mut *tx)
    ///                 .await?;
    ///             let charge = "ch_1".to_owned();
    ///             store.commit_claim(tx, &claim, &charge).await?;
    ///             Ok::<_, Box<dyn std::error::Error + Send + Sync>>(charge)
    ///         }
    ///     })
    ///     .await
    ///     .map_err(|e| e.to_string())?;
    /// assert_eq!(charged.value, "ch_1");
    /// # Ok(()) }
    /// ```
    pub async fn commit_claim<T: serde::Serialize>(
        &self,
        mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
        claim: &idempotency_core::Claim<T>,
        value: &T,
    ) -> std::result::Result<(), CommitClaimError> {
        self.complete_claim_in(&mut tx, claim, value).await?;
        tx.commit().await.map_err(CommitClaimError::Commit)
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
            // Boxed: the pool's and the statement's state are kilobytes, which the batched
            // call (the common path) would otherwise carry inline and copy on every move.
            Box::pin(self.complete_statement(&job(), &self.pool)).await
        })
        .await
    }

    /// The per-request `complete`.
    pub(crate) async fn complete_statement(
        &self,
        job: &CompleteJob,
        pool: &impl Source,
    ) -> Result<Option<Fingerprint>> {
        let mut checkout = Checkout::acquire(pool).await.map_err(db_error)?;
        let completed = self.complete_encoded(checkout.conn(), job).await;
        checkout.finished();
        completed
    }

    async fn complete_encoded(
        &self,
        conn: &mut PgConnection,
        job: &CompleteJob,
    ) -> Result<Option<Fingerprint>> {
        let (id, token) = (&job.id, job.token);
        let row: Option<(Vec<u8>, bool)> = sqlx::query_as(self.sql.get(COMPLETE_SQL))
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
            None => sqlx::query_as::<_, (Vec<u8>, bool)>(self.sql.get(COMPLETED_BY_SQL))
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

    /// Whether `row` is one a claim with `fp` takes over rather than answers from: its lease
    /// or its retention is over (another request's lapsed lease answers `Mismatch`).
    pub(crate) fn takes_over(fp: &Fingerprint, row: &RowView) -> bool {
        let (stored_fp, state, _, remaining_ms) = row;
        *remaining_ms <= 0.0 && (*state == 1 || stored_fp[..] == fp.as_bytes()[..])
    }

    /// Reads a live row's answer, with how long the row still lives; `None` when it expired.
    fn decide(fp: &Fingerprint, row: RowView) -> Result<Option<(Begin, Option<Duration>)>> {
        if Self::takes_over(fp, &row) {
            return Ok(None); // expired: take it over
        }
        let (stored_fp, state, response, remaining_ms) = row;
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
    /// lease left for `Execute` (less than asked after a lock wait), the rest of the lease
    /// for `InFlight`, the rest of the retention for `Replay` (`None` for `Mismatch`). A
    /// cache in front of Postgres uses it so its copy never outlives the row.
    pub async fn begin_with_ttl(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
    ) -> Result<(Begin, Option<Duration>)> {
        // The claim runs to its end even if this call is dropped or runs out of budget: a
        // lease granted after that is released instead of sitting claimed by nobody until it
        // expires.
        let (this, id, fp) = (self.clone(), *id, *fp);
        let gone = CancellationToken::new();
        let watched = gone.clone();
        let claim = async move { this.claim_with_ttl(&id, &fp, lease, &watched).await };
        let claim = detached_begin(self.clone(), id, claim)
            .tracked_by(&self.settling)
            .cancels_when_orphaned(gone);
        self.timed(claim).await
    }

    /// [`PostgresStore::begin_with_ttl`] without its
    /// [`detached_claim`](idempotency_core::detached_claim), for a store whose `begin` already
    /// wraps its claim in one (the hybrid store's wraps Redis and this): one wrapper per claim
    /// instead of two.
    ///
    /// Not cancel-safe by itself: dropped after the claim committed, it leaves the lease
    /// claimed by nobody until it expires. Run it to its end, as `detached_claim` does. Its
    /// own bound is generous (four call timeouts: it only has to end); a statement it gave
    /// up on may still commit, so every token it may have written is then released (or,
    /// for a takeover of an unfinished lease, ended and kept).
    ///
    /// `caller_gone` is cancelled once nobody waits for the answer (see
    /// [`FinishOnDrop::cancels_when_orphaned`](idempotency_core::FinishOnDrop::cancels_when_orphaned)):
    /// the grants of the statements sent by then whose reply has not come are looked for
    /// at once, on another connection, and given back, and the claim starts no new write
    /// (a round's claim statement not sent yet never is; a takeover or re-arm already
    /// waiting for a connection is). The round under way's grant, not found, is looked for
    /// again every third of `lease` (at most every call budget) while the claim waits, and
    /// once more shortly before its lease runs out: it may commit later (a lock wait, a
    /// takeover that waited for a connection). A reply
    /// that hangs (one connection's bytes held back) is otherwise waited for until the
    /// bound above, and a lease shorter than that runs out first: a retry would take the
    /// key over as an attempt whose outcome is unknown, for an operation that never ran.
    pub async fn claim_with_ttl(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        caller_gone: &CancellationToken,
    ) -> Result<(Begin, Option<Duration>)> {
        let budget = self.call_timeout * 4;
        let tokens: [LeaseToken; MAX_BEGIN_ROUNDS] =
            std::array::from_fn(|_| LeaseToken::generate());
        let rounds = Rounds::default();
        // Dropped before it settles (a runtime shutting down drops its tasks, this claim's
        // `detached_begin` task among them, mid-statement), the tokens it sent are given back
        // on the store's own runtime: the statement still commits, and its grant would be
        // held by nobody (`InFlight` for a lease, then an unknown outcome).
        let mut dropped = ClaimDropped {
            store: self,
            id: *id,
            rounds: &rounds,
            armed: true,
        };
        let claim = tokio::time::timeout(budget, self.claim(id, fp, lease, &tokens, &rounds));
        let looked = async {
            caller_gone.cancelled().await;
            self.look_for_orphaned_grants(id, lease, &rounds).await;
            std::future::pending::<std::convert::Infallible>().await
        };
        // The claim's answer ends it; the look only runs alongside.
        let answer = tokio::select! {
            biased;
            answer = claim => answer,
            never = looked => match never {},
        };
        dropped.armed = false;
        match answer {
            Ok(Err(error)) => {
                // An error is not "nothing happened": the connection can break after the
                // server committed a grant. Left, that lease would run out unfinished and
                // the retry would hear `TakeOver` (outcome unknown) for an operation that
                // never ran.
                // Unless its caller's going away found and gave it back already.
                if let Some(token) = rounds.take_in_doubt()
                    && !rounds.given_back(token)
                {
                    self.settle_orphans_later(*id, vec![token], &rounds.takeovers);
                }
                Err(error)
            }
            Ok(answer) => answer,
            Err(_) => {
                self.settle_orphans_later(*id, rounds.give_up(), &rounds.takeovers);
                Err(Error::unavailable("Postgres claim did not settle"))
            }
        }
    }

    /// Gives back the grants a claim still running may have made and nobody will take (its
    /// caller is gone): those of the statements sent so far; a statement not sent yet
    /// (waiting for a connection, or in a batch's queue) never will be. A fresh grant found
    /// is deleted for good (no statement of the claim inserts its token again) and not
    /// looked for once the claim gives up; a taken-over one is ended and kept, and, if a
    /// re-arm of it was on its way (which can still write it), ended again at each of the
    /// looks below and looked for again at the give-up.
    ///
    /// Not found (its statement not committed yet: a lock wait, a takeover that waited for
    /// a connection), the grant of the round under way is looked for again every third of
    /// the lease (at most every budget) while the claim waits, and once more a tenth of the
    /// lease (at least 100 ms) before it runs out, counted from when the round's claim
    /// statement was sent, or from before its takeover waited for a connection: one
    /// committing late is mostly given back before then, and a retry runs as new (a best
    /// effort: a grant committing in that last tenth, or a look that waits for a
    /// connection, can still come after). Looked for once only, it was found at the claim's
    /// give-up (four budgets for a round on the per-request path), and a retry after a
    /// shorter lease heard `TakeOver` for an operation that never ran. The claim's answer
    /// ends the looks (it gives back what it got), as does its give-up (its own looks take
    /// over). These looks are not counted in [`grants_in_doubt`](Self::grants_in_doubt),
    /// which counts the grants of claims given up.
    async fn look_for_orphaned_grants(&self, id: &RecordId, lease: Duration, rounds: &Rounds) {
        // First: no round begins and no takeover is sent from here on, and a round's
        // statement not sent yet is given up, so the tokens read below are all a statement
        // of this claim may still write, and each is given back the right way (a takeover
        // read as a fresh grant would be deleted, and the unfinished attempt it took over
        // forgotten: the next `begin` would answer `Execute`).
        rounds.abandon();
        let (mut looking, under_way): (Vec<_>, _) = {
            let wires = rounds
                .wires
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let sent = wires
                .iter()
                .filter(|(_, wire)| wire.drop_unsent())
                .cloned()
                .collect();
            (sent, wires.last().cloned())
        };
        let takeovers = rounds
            .takeovers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        // A taken-over grant ended while a re-arm of it was on its way may be re-armed after
        // all: it is looked for again, here and at the give-up. (No re-arm begins once the
        // claim is abandoned.)
        let rearming = rounds.rearming.load(Ordering::Acquire);
        let gap = (lease / 3).min(self.call_timeout).max(MIN_LOOK_GAP);
        // And once more shortly before that round's lease runs out, counted from when its
        // last statement (a takeover's, or its claim's) was sent — or earlier: a lock wait
        // spends the lease (its expiry is set when the statement starts), so a grant
        // committing late may have less left than a gap. (A lease too long for the clock
        // has no such look.)
        let takeover_sent = *rounds
            .takeover_sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let last_look = under_way.as_ref().and_then(|(token, wire)| {
            let since = match takeover_sent {
                Some((took, at)) if took == *token => Some(at),
                _ => wire.sent_at(),
            }?;
            last_look_before_expiry(since, lease)
        });
        let under_way = under_way.map(|(token, _)| token);
        loop {
            let looks = looking
                .iter()
                .map(|(token, _)| self.give_back_once(id, *token, takeovers.contains(token)));
            let found = futures::future::join_all(looks).await;
            let mut left = Vec::new();
            for ((token, wire), look) in looking.into_iter().zip(found) {
                let for_good = !takeovers.contains(&token) || !rearming;
                let settled = look == Look::Settled && for_good;
                if settled && wire.give_up() {
                    tracing::info!(record = %id, %token, "gave back a grant whose reply had not come, its caller gone");
                }
                // Only the round under way may still write its token: every earlier round's
                // statements were answered before the next round began.
                if !settled && Some(token) == under_way {
                    left.push((token, wire));
                }
            }
            if left.is_empty() {
                return;
            }
            looking = left;
            let now = Instant::now();
            let next = match last_look {
                Some(at) if at > now && at < now + gap => at,
                _ => now + gap,
            };
            tokio::time::sleep_until(next).await;
        }
    }

    /// Gives back the grants a claim nobody will answer may have made, once the server has
    /// had time to finish or cancel its statement: released, or ended and kept when they
    /// took an unfinished lease over. Fenced on each token, so a token never written
    /// changes nothing.
    fn settle_orphans_later(
        &self,
        id: RecordId,
        tokens: Vec<LeaseToken>,
        takeovers: &std::sync::Mutex<Vec<LeaseToken>>,
    ) {
        let takeovers = takeovers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        // Read when the claim is given up: its rounds are over by then.
        let grants: Vec<_> = tokens
            .into_iter()
            .map(|token| (id, token, takeovers.contains(&token)))
            .collect();
        self.give_back_later(&grants);
    }

    /// Gives back grants nobody holds (`true`: taken over from an unfinished attempt, so
    /// ended and kept — deleted, that attempt would be forgotten and the next `begin` would
    /// answer `Execute`), at once and one budget from now. A grant not found then may be one whose
    /// statement has not committed yet: it waits on a lock, its commit on a replica, its
    /// bytes on a network that heals (a kernel retransmits a closed socket's unsent bytes for
    /// about 15 minutes). It is looked for again [`LATER_LOOKS`] from then, and every budget
    /// while the store cannot be reached: left, nobody would hold it, and the key would
    /// answer `InFlight` for the lease, then `TakeOver`, an outcome reported unknown for an
    /// operation that never ran.
    ///
    /// `drain` waits for the first two looks only: most tokens given back were never written,
    /// and a shutdown must not wait for the later looks of each claim that timed out. They
    /// are a best effort a shutdown may cut short.
    ///
    /// The looks run on the caller's runtime and, when the store was made on another, on
    /// that one too ([`spawn_where_it_survives`](idempotency_core::spawn_where_it_survives)):
    /// a worker runtime shutting down drops its tasks, this one's among them (a claim
    /// dropped mid-statement as its runtime shut down; a give-back waiting out its budget).
    pub(crate) fn give_back_later(&self, grants: &[(RecordId, LeaseToken, bool)]) {
        if grants.is_empty() {
            return;
        }
        let gave_up = tokio::time::Instant::now();
        // One count for the copies on both runtimes: a grant settled by either is found.
        let looking = Looking::new(&self.in_doubt, grants);
        let looks = || {
            let looking = looking.clone();
            Self::give_back_looks(self.clone(), grants.to_vec(), gave_up, looking)
        };
        if idempotency_core::spawn_where_it_survives(&self.settling, self.home.as_ref(), looks) == 0
        {
            tracing::warn!(
                "grants to give back outside any Tokio runtime: they expire by themselves"
            );
        }
    }

    /// [`give_back_later`](Self::give_back_later)'s rounds.
    async fn give_back_looks(
        late: Self,
        grants: Vec<(RecordId, LeaseToken, bool)>,
        gave_up: tokio::time::Instant,
        looking: Arc<Looking>,
    ) {
        // At once, then once the server has had time to finish or cancel the statement: a
        // reply lost after the commit (a connection reset) left a grant whose lease may end
        // within that budget (a lease shorter than it), and a retry in between took it over
        // as an attempt whose outcome is unknown for an operation that never ran.
        let (left, _) = late.give_back_round(grants, 0).await;
        looking.left(&left);
        if left.is_empty() {
            return;
        }
        let (mut left, mut unreachable) = late.give_back_round(left, 1).await;
        looking.left(&left);
        if left.is_empty() {
            return;
        }
        let horizon = late.latest_commits()[2];
        tokio::spawn(async move {
            for budgets in LATER_LOOKS {
                // While the store cannot be reached, every budget until it answers: a claim
                // whose reply an outage lost committed before it, and its grant's lease runs
                // out meanwhile. Looked for on the schedule alone (4, then 16 budgets on),
                // it was found long after the store was back, and a retry in between took
                // the key over as an attempt whose outcome is unknown (a 409 under
                // `Reject`, a question to the reconcile hook) for an operation that never
                // ran.
                while unreachable && gave_up.elapsed() < horizon {
                    // A budget of zero (a store that cannot serve anyway) does not spin.
                    tokio::time::sleep(MIN_LOOK_GAP.saturating_sub(late.call_timeout)).await;
                    (left, unreachable) = late.give_back_round(left, 1).await;
                    looking.left(&left);
                    if left.is_empty() {
                        return;
                    }
                }
                (left, unreachable) = late.give_back_round(left, budgets).await;
                looking.left(&left);
                if left.is_empty() {
                    return;
                }
            }
            // A small budget ends those looks early (1,365 budgets of 250 ms are under six
            // minutes): looks at the latest a statement may still commit, counted from
            // the give-up, follow, where the budgets' looks ended before them.
            for at in late.latest_commits() {
                let Some(wait) = at.checked_sub(gave_up.elapsed()) else {
                    continue;
                };
                tokio::time::sleep(wait).await;
                (left, _) = late.give_back_round(left, 0).await;
                looking.left(&left);
                if left.is_empty() {
                    return;
                }
            }
        });
    }

    /// How long after a claim was given up its statement may still commit: once its lock
    /// wait ends (the sessions' `statement_timeout`, a minute when unknown), once a network
    /// that heals delivers the bytes a kernel retransmits for about 15 minutes, and a
    /// commit that waits on a standby, for which an hour and more is allowed.
    fn latest_commits(&self) -> [Duration; 3] {
        let lock_wait = self.statement_timeout.unwrap_or(Duration::from_secs(60));
        [
            lock_wait.min(idempotency_core::FOR_GOOD) + self.call_timeout,
            Duration::from_secs(16 * 60),
            Duration::from_secs(70 * 60),
        ]
    }

    /// After `budgets` call budgets, gives back `grants`, all at once (one after the other, a
    /// long outage held a shutdown for each); those not settled are returned for the next
    /// look: not found (not committed yet, or never written), or the store unreachable (a
    /// partition: the claim's bytes may still arrive once it heals), which it says.
    async fn give_back_round(
        &self,
        grants: Vec<(RecordId, LeaseToken, bool)>,
        budgets: u32,
    ) -> (Vec<(RecordId, LeaseToken, bool)>, bool) {
        tokio::time::sleep(self.call_timeout.saturating_mul(budgets)).await;
        let looked = futures::future::join_all(
            grants
                .iter()
                .map(|(id, token, took)| self.give_back_once(id, *token, *took)),
        )
        .await;
        let unreachable = looked.contains(&Look::Unreachable);
        let left = grants
            .into_iter()
            .zip(looked)
            .filter_map(|(grant, look)| (look != Look::Settled).then_some(grant))
            .collect();
        (left, unreachable)
    }

    /// Releases (or, `took`, ends and keeps) the grant of `token`, fenced on it. One try:
    /// the looks after this one are the retries.
    async fn give_back_once(&self, id: &RecordId, token: LeaseToken, took: bool) -> Look {
        let given = if took {
            self.renew(id, token, Duration::ZERO).await
        } else {
            self.release(id, token).await
        };
        match given {
            Ok(()) => Look::Settled,
            Err(Error::LeaseLost) => Look::NotFound,
            Err(error @ Error::Unavailable(_)) => {
                tracing::debug!(%error, record = %id, "could not give back a grant; looking again");
                Look::Unreachable
            }
            // Anything else (a corrupt row, a misconfiguration) is no outage to look through
            // every budget: the schedule's next look.
            Err(error) => {
                tracing::warn!(%error, record = %id, "could not give back a grant; looking again later");
                Look::NotFound
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
    ///
    /// What the rounds leave for a caller that gives the claim up is in `rounds`.
    async fn claim(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        tokens: &[LeaseToken],
        rounds: &Rounds,
    ) -> Result<(Begin, Option<Duration>)> {
        let takeovers = &rounds.takeovers;
        for (round, token) in tokens.iter().enumerate() {
            // Nobody waits for the answer, and what was sent is being given back: a new
            // round's grant would be one more to give back (see `abandon`).
            if rounds.abandoned() {
                return Err(Error::unavailable("nobody waits for this claim any more"));
            }
            let job = BeginJob::new(id, fp, *token, lease);
            let wire = job.wire.clone();
            rounds
                .wires
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push((*token, wire.clone()));
            let batched = self.batches.is_some() && round == 0;
            let found = match (&self.batches, round) {
                // `None`: the batch gave the call back (a lock, a race): next round.
                (Some(batches), 0) => batches.begin.call(self, |b| &b.begin, job).await,
                _ => self.begin_statement(&job, &self.pool).await.map(Some),
            };
            // Only a grant wrote this round's token; a row read (another attempt's, or none)
            // did not, nor a statement that failed before it could commit (see
            // `may_have_written`). A batch gives back its own in-doubt claims.
            let maybe_written = match &found {
                Ok(Some(Round::Granted(_))) => true,
                Ok(_) => false,
                Err(error) => !batched && wire.sent() && may_have_written(error),
            };
            if maybe_written {
                rounds.note(Some(*token));
            }
            let settled = match found {
                Ok(Some(found)) => self.follow(id, fp, lease, *token, found, rounds).await,
                other => other.map(|_| None),
            };
            match settled {
                Ok(Some(decision)) => return Ok(decision),
                Ok(None) => rounds.note(None),
                // Another transaction won the race; under READ COMMITTED this cannot happen,
                // under a pool configured SERIALIZABLE it can: the next round reads the winner.
                // Raised after this round's grant committed (by a re-arm, a give-back), it
                // leaves that grant to nobody, and the next round would read it as another
                // attempt's: it is given back first (fenced on the token: a grant never
                // written changes nothing). The server answered, so no statement of this
                // round is still on its way. A give-back that fails is retried later, and
                // the claim ends `Unavailable` ("nothing changed", true once that lands):
                // the next round would read the grant as another attempt's.
                Err(error) if is_serialization_race(&error) => {
                    if let Some(token) = rounds.take_in_doubt() {
                        let took = takeovers
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .contains(&token);
                        let given = if took {
                            self.renew(id, token, Duration::ZERO).await
                        } else {
                            self.release(id, token).await
                        };
                        if let Err(given_back) = given
                            && !matches!(given_back, Error::LeaseLost)
                        {
                            tracing::debug!(error = %given_back, record = %id, "could not give back a grant after a race; looking again later");
                            self.settle_orphans_later(*id, vec![token], takeovers);
                            return Err(Error::unavailable(format!(
                                "a race ({error}), then the grant could not be given back \
                                 ({given_back}); it is given back later"
                            )));
                        }
                    }
                }
                Err(error) => return Err(error),
            }
        }
        Err(Error::unavailable(
            "begin did not settle: the record changed on every read",
        ))
    }

    /// The per-request claim statement: insert, or read the live row.
    ///
    /// Sent only once a connection was had for it, and only if the claim was not given up
    /// meanwhile (see [`OnWire`](crate::batch::OnWire)).
    pub(crate) async fn begin_statement(
        &self,
        job: &BeginJob,
        pool: &impl Source,
    ) -> Result<Round> {
        let Some(mut checkout) = Checkout::acquire_to_send(pool, || job.wire.send())
            .await
            .map_err(db_error)?
        else {
            return Err(Error::unavailable(
                "the claim was given up before it was sent",
            ));
        };
        let row: std::result::Result<Option<BeginRow>, _> = claim_query(
            self.sql.get(BEGIN_SQL),
            &job.id,
            &job.fp,
            job.token,
            job.lease,
        )
        .fetch_optional(checkout.conn())
        .await;
        checkout.finished();
        let row = row.map_err(db_error)?;
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
        rounds: &Rounds,
    ) -> Result<Option<(Begin, Option<Duration>)>> {
        let view = match round {
            Round::Granted(left) => {
                return self
                    .fresh_grant(id, token, lease, left, false, rounds)
                    .await;
            }
            Round::Row(view) => Some(view),
            // Conflict with a row our snapshot cannot see: read it in a new statement.
            Round::Hidden => sqlx::query_as::<_, RowView>(self.sql.get(READ_SQL))
                .bind(&id.as_bytes()[..])
                .fetch_optional_on(&self.pool)
                .await
                .map_err(db_error)?,
        };
        let Some(view) = view else {
            return Ok(None); // released or purged in between: insert again
        };
        // An expired lease (not a completed row past its retention) never stored its outcome.
        let (state, unfinished) = (view.1, view.1 == 0);
        if let Some(decision) = Self::decide(fp, view)? {
            return Ok(Some(decision));
        }
        // Checked with no await before the token is noted: a look for the grants of a claim
        // whose caller went away must know every token a takeover may write (see `abandon`).
        if rounds.abandoned() {
            return Err(Error::unavailable("nobody waits for this claim any more"));
        }
        if unfinished {
            rounds
                .takeovers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(token);
        }
        // The takeover writes the token: in doubt from before it is sent.
        rounds.note(Some(token));
        *rounds
            .takeover_sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((token, Instant::now()));
        let taken: Option<(f64,)> = claim_query(self.sql.get(TAKEOVER_SQL), id, fp, token, lease)
            .bind(state)
            .fetch_optional_on(&self.pool)
            .await
            .map_err(db_error)?;
        if let Some((left,)) = taken {
            tracing::info!(record = %id, unfinished, "took over an expired idempotency record");
            let granted = self
                .fresh_grant(id, token, lease, left, unfinished, rounds)
                .await?;
            return Ok(granted.map(|(answer, ttl)| match answer {
                Begin::Execute(token) if unfinished => (Begin::TakeOver(token), ttl),
                other => (other, ttl),
            }));
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
        unfinished: bool,
        rounds: &Rounds,
    ) -> Result<Option<(Begin, Option<Duration>)>> {
        // Half of the lease the row got (capped like the statement's).
        let half = millis(lease) as f64 / 2.0;
        for _ in 0..2 {
            // A lease of zero is over when it is written, waited on a lock or not: it is
            // granted as asked (the next `begin` takes it over, as after a renew for zero),
            // not re-armed and given back round after round until the claim gives up.
            // Nor is a grant nobody waits for (see `Rounds::abandon`): it is given back as
            // it is; re-armed after the look for it ended it, it would hold the key for a
            // lease with nobody to give it back if the re-arm's reply were lost.
            if left_ms >= half || half == 0.0 || rounds.abandoned() {
                // The TTL is what is left, on Postgres' clock: a cache in front must not
                // outlive the row.
                let left = Duration::from_millis(left_ms.max(0.0) as u64).min(lease);
                return Ok(Some((Begin::Execute(token), Some(left))));
            }
            tracing::info!(record = %id, left_ms, "a claim waited on a lock: re-arming its lease");
            rounds.rearming.store(true, Ordering::Release);
            let rearmed: std::result::Result<Option<(f64,)>, _> =
                sqlx::query_as(self.sql.get(REARM_SQL))
                    .bind(&id.as_bytes()[..])
                    .bind(token.as_uuid())
                    .bind(millis(lease))
                    .fetch_optional_on(&self.pool)
                    .await;
            // Answered or failed, the re-arm wrote what it wrote: a look from now on sees it.
            rounds.rearming.store(false, Ordering::Release);
            let rearmed = rearmed.map_err(db_error)?;
            match rearmed {
                Some((left,)) => left_ms = left,
                None => return Ok(None), // taken over meanwhile: look again
            }
        }
        // Still waiting on locks: give this grant back, and the next round looks again. A
        // grant taken over from an unfinished lease is given back as an expired lease, not
        // deleted: the next round must still see (and report) the unfinished attempt.
        let give_back = if unfinished { EXPIRE_SQL } else { RELEASE_SQL };
        sqlx::query(self.sql.get(give_back))
            .bind(&id.as_bytes()[..])
            .bind(token.as_uuid())
            .execute_on(&self.pool)
            .await
            .map_err(db_error)?;
        Ok(None)
    }
}

impl PostgresStore {
    /// The per-request `release`: whether the token owned the in-flight row.
    pub(crate) async fn release_statement(
        &self,
        job: &FenceJob,
        pool: &impl Source,
    ) -> Result<bool> {
        let done = sqlx::query(self.sql.get(RELEASE_SQL))
            .bind(&job.id.as_bytes()[..])
            .bind(job.token.as_uuid())
            .execute_on(pool)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    /// The per-request `renew`: whether the token owned the in-flight row.
    pub(crate) async fn renew_statement(&self, job: &FenceJob, pool: &impl Source) -> Result<bool> {
        let done = sqlx::query(self.sql.get(RENEW_SQL))
            .bind(&job.id.as_bytes()[..])
            .bind(job.token.as_uuid())
            .bind(millis(job.lease))
            .execute_on(pool)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }
}

/// A claim statement (`BEGIN_SQL`, `TAKEOVER_SQL`) with its four parameters bound.
fn claim_query<'q, O>(
    sql: sqlx::SqlStr,
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

/// A claim's guard: dropped armed (the claim dropped before it settled), it gives back the
/// tokens its rounds sent, on the store's own runtime.
struct ClaimDropped<'a> {
    store: &'a PostgresStore,
    id: RecordId,
    rounds: &'a Rounds,
    armed: bool,
}

impl Drop for ClaimDropped<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.store
            .settle_orphans_later(self.id, self.rounds.give_up(), &self.rounds.takeovers);
    }
}

/// What a claim's rounds leave for a caller that gives the claim up (its budget ran out, or
/// it failed), to know which grants to give back and how.
#[derive(Default)]
struct Rounds {
    /// The tokens of rounds that tried to take an unfinished lease over, noted before the
    /// statement is sent: a grant of theirs must be ended, not deleted.
    takeovers: std::sync::Mutex<Vec<LeaseToken>>,
    /// The token of the round under way once one of its statements may have written it: an
    /// error from there on may hide a committed grant. Only that round's token can be on the
    /// row; a round that ends without an answer holds nothing.
    in_doubt: std::sync::Mutex<Option<LeaseToken>>,
    /// The rounds begun, with whether each one's statement was sent: a claim cut off by its
    /// budget gives back only the tokens of those sent, not ones no statement carried.
    wires: std::sync::Mutex<Vec<(LeaseToken, Arc<OnWire>)>>,
    /// When the round under way (the last of `wires`) sent a takeover of the row it read,
    /// if it did: the lease it may write runs out no sooner than a lease later.
    takeover_sent: std::sync::Mutex<Option<(LeaseToken, Instant)>>,
    /// See [`Rounds::abandon`].
    abandoned: std::sync::atomic::AtomicBool,
    /// A re-arm (`fresh_grant`) is on its way: it may write its token again after a look
    /// that ended that token's grant.
    rearming: std::sync::atomic::AtomicBool,
}

impl Rounds {
    /// Gives every round up: the tokens of those whose statement may have been sent (their
    /// grants are looked for); the others are never sent.
    fn give_up(&self) -> Vec<LeaseToken> {
        self.wires
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(_, wire)| wire.give_up())
            .map(|(token, _)| *token)
            .collect()
    }

    /// Whether `token`'s grant is given back already, or being looked for.
    fn given_back(&self, token: LeaseToken) -> bool {
        self.wires
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .any(|(sent, wire)| *sent == token && wire.given_back())
    }

    /// Notes the token of the round under way as one its statements may have written
    /// (`None`: none of them did).
    fn note(&self, token: Option<LeaseToken>) {
        *self
            .in_doubt
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = token;
    }

    /// Nobody waits for the claim's answer: no round begins and no takeover is sent from
    /// now on.
    fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
    }

    fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }

    /// The token of the round whose grant may have been written, taken.
    fn take_in_doubt(&self) -> Option<LeaseToken> {
        self.in_doubt
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

/// The grants of one give-back still looked for, counted in the store's
/// [`grants_in_doubt`](PostgresStore::grants_in_doubt) until found or until every task
/// looking for them ended (all looks done, or dropped by a runtime shutting down).
struct Looking {
    count: Arc<AtomicUsize>,
    unsettled: std::sync::Mutex<Vec<LeaseToken>>,
}

impl Looking {
    fn new(count: &Arc<AtomicUsize>, grants: &[(RecordId, LeaseToken, bool)]) -> Arc<Self> {
        count.fetch_add(grants.len(), Ordering::Relaxed);
        Arc::new(Self {
            count: count.clone(),
            unsettled: std::sync::Mutex::new(grants.iter().map(|g| g.1).collect()),
        })
    }

    /// Those not in `left` were found (or given back): no longer counted.
    fn left(&self, left: &[(RecordId, LeaseToken, bool)]) {
        let mut unsettled = self
            .unsettled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = unsettled.len();
        unsettled.retain(|token| left.iter().any(|g| g.1 == *token));
        self.count
            .fetch_sub(before - unsettled.len(), Ordering::Relaxed);
    }
}

impl Drop for Looking {
    fn drop(&mut self) {
        let unsettled = self
            .unsettled
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.count.fetch_sub(unsettled.len(), Ordering::Relaxed);
    }
}

/// When a grant not found by its first give-back is looked for again, in call budgets after
/// the look before: 5, 21, 85, 341 and 1,365 budgets after the claim was given up, over an
/// hour with the default budget (3 s). Each look is one fenced statement per grant still
/// missing.
const LATER_LOOKS: [u32; 5] = [4, 16, 64, 256, 1024];

/// The least time between two looks for a grant while the store cannot be reached.
const MIN_LOOK_GAP: Duration = Duration::from_millis(100);

/// When to look for a grant once more before its lease, written by a statement sent at
/// `since`, runs out: a tenth of the lease (at least [`MIN_LOOK_GAP`]) before. `None` for a
/// lease too long for the clock (`Duration::MAX` is a lease for good).
fn last_look_before_expiry(since: Instant, lease: Duration) -> Option<Instant> {
    since.checked_add(lease.saturating_sub((lease / 10).max(MIN_LOOK_GAP)))
}

/// What one look for a grant to give back found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    /// Given back.
    Settled,
    /// Not held by its token: not committed yet, never written, or taken over since.
    NotFound,
    /// The store did not answer.
    Unreachable,
}

impl PostgresStore {
    async fn inspect_row(&self, id: &RecordId) -> Result<Option<Inspection>> {
        type Row = (i16, Vec<u8>, Option<i16>, f64, f64, f64);
        let row: Option<Row> = sqlx::query_as(self.sql.get(INSPECT_SQL))
            .bind(&id.as_bytes()[..])
            .fetch_optional_on(&self.pool)
            .await
            .map_err(db_error)?;
        let Some((state, fingerprint, status, created, expires, left)) = row else {
            return Ok(None);
        };
        let fingerprint = self::fingerprint(fingerprint)?;
        let (created, expires) = (
            Some(system_time_from_millis(created)),
            system_time_from_millis(expires),
        );
        Ok(match (state, status) {
            (0, _) => Some(Inspection::in_flight(
                fingerprint,
                created,
                expires,
                Duration::from_secs_f64(left.max(0.0) / 1000.0),
            )),
            // Past its retention the row is gone for every other call: so it is here.
            (1, _) if left <= 0.0 => None,
            (1, Some(status)) => Some(Inspection::completed(
                fingerprint,
                created,
                expires,
                u16::try_from(status).map_err(|_| Error::Corrupt("negative status".into()))?,
            )),
            _ => return Err(Error::Corrupt("unexpected key row".into())),
        })
    }

    async fn force_release_row(
        &self,
        id: &RecordId,
        scope: ReleaseScope,
        asked: tokio::time::Instant,
    ) -> Result<ForceReleased> {
        // On a checked-out connection, as every statement: one that hangs is closed when
        // given up (its transaction rolled back, the row's lock freed), not handed back to
        // the pool through a ping that waits for ever.
        let mut checkout = Checkout::acquire(&self.pool).await.map_err(db_error)?;
        let released = self
            .force_release_locked(checkout.conn(), id, scope, asked)
            .await;
        checkout.finished();
        released
    }

    /// The row is read, and deleted if the scope covers it, under its lock in one
    /// transaction, so the answer is what the release met. (A delete and then a read of why
    /// it deleted nothing, two statements without the lock, let a claim come between them
    /// every time under a stream of claims: a release of live leases answered `Live`, which
    /// no order of the calls gives; found by the linearizability check.)
    async fn force_release_locked(
        &self,
        conn: &mut PgConnection,
        id: &RecordId,
        scope: ReleaseScope,
        asked: tokio::time::Instant,
    ) -> Result<ForceReleased> {
        // Read committed whatever the pool's default (an application's own pool may set
        // another): under a snapshot taken at the first statement, a row changed before the
        // lock would fail the release with a serialization error.
        let mut tx = sqlx::Connection::begin_with(conn, "BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(db_error)?;
        // The end of this call's budget by the database's clock, which the delete carries:
        // one that arrives later deletes nothing (see `DELETE_LOCKED_SQL`).
        let left = || self.call_timeout.saturating_sub(asked.elapsed());
        let (clock, _): (f64, String) = sqlx::query_as(CLOCK_SQL)
            .bind(left().as_millis().max(1).to_string())
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
        // Counted from the answer: the clock was read no later than it came.
        let until = clock + left().as_secs_f64();
        let row: Option<(i16, bool)> = sqlx::query_as(self.sql.get(LOCK_ROW_SQL))
            .bind(&id.as_bytes()[..])
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error)?;
        let found = match row {
            None => ForceReleased::Absent,
            // Every scope takes an unfinished lease that ran out.
            Some((0, over)) if scope.live || over => ForceReleased::Released,
            Some((0, _)) => ForceReleased::Live,
            // Past its retention the row is gone for every other call: so it is here.
            Some((_, true)) => ForceReleased::Absent,
            Some(_) if scope.completed => ForceReleased::Deleted,
            Some(_) => ForceReleased::Completed,
        };
        if !matches!(found, ForceReleased::Released | ForceReleased::Deleted) {
            // Left as it is (a rollback that fails changed nothing either).
            let _ = tx.rollback().await;
            return Ok(found);
        }
        let (deleted, _): (i64, String) = sqlx::query_as(self.sql.get(DELETE_LOCKED_SQL))
            .bind(&id.as_bytes()[..])
            .bind(until)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
        if deleted == 0 {
            return Err(Error::unavailable(
                "the release reached Postgres past its budget and deleted nothing; call again",
            ));
        }
        tx.commit().await.map_err(db_error)?;
        Ok(found)
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        idempotency_core::observe(self.name(), "begin", async {
            Ok(self.begin_with_ttl(id, fp, lease).await?.0)
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
            self.complete_with_fingerprint(id, token, outcome, retention)
                .await
                .map(|_| ())
        })
        .await
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        idempotency_core::observe(self.name(), "release", async {
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
                // Boxed, as `complete`'s fallback is.
                fenced(Box::pin(self.release_statement(&job(), &self.pool)).await?)
            })
            .await
        })
        .await
    }

    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        idempotency_core::observe(self.name(), "renew", async {
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
                // Boxed, as `complete`'s fallback is.
                fenced(Box::pin(self.renew_statement(&job(), &self.pool)).await?)
            })
            .await
        })
        .await
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64> {
        self.timed(async {
            let done = sqlx::query(self.sql.get(PURGE_SQL))
                .bind(i64::try_from(batch).unwrap_or(i64::MAX))
                .bind(millis(self.unknown_outcome_retention))
                .execute_on(&self.pool)
                .await
                .map_err(db_error)?;
            Ok(done.rows_affected())
        })
        .await
    }

    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>> {
        idempotency_core::observe(self.name(), "inspect", self.timed(self.inspect_row(id))).await
    }

    async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased> {
        idempotency_core::observe(
            self.name(),
            "force_release",
            self.timed(self.force_release_row(id, scope, tokio::time::Instant::now())),
        )
        .await
    }

    fn name(&self) -> &'static str {
        "postgres"
    }

    fn begin_settles_when_dropped(&self) -> bool {
        // `begin` wraps its claim in `detached_begin`, tracked by `settling`.
        true
    }

    /// Waits for the claims this store stopped waiting for (its call budget ran out) to
    /// settle, with the release of what they granted, and for the give-back of grants a
    /// claim whose answer was lost may have made. A release is retried while Postgres is
    /// unavailable, for up to an hour: bound the wait by your shutdown deadline.
    async fn drain(&self) {
        self.settling.close();
        self.settling.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use idempotency_core::{IdempotencyKey, Scope};

    use super::*;

    /// A lease for good (`Duration::MAX`, which `Store::begin` takes) has no look before it
    /// runs out: added to the clock it overflowed, and the look for an orphaned claim's
    /// grants panicked before it looked.
    #[test]
    fn a_lease_for_good_has_no_last_look() {
        let now = Instant::now();
        assert_eq!(last_look_before_expiry(now, Duration::MAX), None);
        let lease = Duration::from_secs(10);
        assert_eq!(
            last_look_before_expiry(now, lease),
            Some(now + Duration::from_secs(9))
        );
        // Short leases keep at least the least gap between two looks.
        let short = Duration::from_millis(500);
        assert_eq!(
            last_look_before_expiry(now, short),
            Some(now + Duration::from_millis(400))
        );
    }

    /// The call budget wraps every statement's future; it must hold that future once
    /// (an `async fn` keeps its future argument beside the one it awaits: twice the bytes,
    /// copied on every move — rust-lang/rust#62958).
    #[tokio::test]
    async fn the_call_budget_adds_little_to_a_statement_future() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1/nothing")
            .expect("a lazy pool connects nothing");
        let store = PostgresStore::from_pool(pool);
        let job = CompleteJob {
            id: RecordId::new(&Scope::global(), &IdempotencyKey::new("k").expect("key")),
            token: LeaseToken::generate(),
            status: 201,
            response: Vec::new(),
            retention: Duration::from_secs(60),
        };
        let statement = store.complete_statement(&job, &store.pool);
        let bare = std::mem::size_of_val(&statement);
        let timed = store.timed(statement);
        let size = std::mem::size_of_val(&timed);
        assert!(
            size < bare + 256,
            "the budget made a {bare}-byte future {size} bytes"
        );

        // The batched call (the common path) does not carry the per-request statement's
        // state inline: that fallback is rare, and boxed.
        let outcome = Outcome::new(201);
        let call = store.complete_with_fingerprint(&job.id, job.token, &outcome, job.retention);
        let size = std::mem::size_of_val(&call);
        assert!(
            size < bare / 2,
            "a batched complete is a {size}-byte future, its fallback statement {bare}"
        );
    }
}
