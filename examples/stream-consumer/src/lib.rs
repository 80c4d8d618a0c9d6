//! A Redis Streams consumer group that applies charge messages exactly once.
//!
//! Streams deliver at least once: a consumer that dies after doing the work but before
//! `XACK` gets the message again (another consumer claims it with `XAUTOCLAIM`), and producers
//! that retry publish the same charge twice. Each message names its charge; the
//! [`Executor`] runs the effect once per charge id over the Postgres store, and every
//! repeat — redelivery or duplicate — replays the stored result and is acknowledged without
//! a second effect.
//!
//! # The effect and its outcome commit together
//!
//! The effect is a Postgres write, so it runs through [`Executor::run_with_claim`]: the
//! ledger row and the charge's stored result ([`PostgresStore::commit_claim`]) are
//! written in **one transaction**. Whatever stops the attempt — a crash, a panic, a poll
//! dropped at any await (a shutdown's `select!`, an outer timeout), a commit whose answer
//! was lost — either rolled the row back (the key is given back, or its lease runs out, and
//! the redelivery applies the charge) or committed it with its result (the redelivery
//! replays). This example's ledger has **no unique constraint on purpose**, so that its
//! tests see any second effect the framework lets through. An effect outside the store's
//! database (a card network) cannot share the transaction: key it by the record id instead
//! ([`Claim::id`](idempotency::Claim::id)), as the payments demo's charges do.
//!
//! # Poison messages
//!
//! A message that can never succeed would otherwise stay pending and be claimed again every
//! [`Consumer::claim_idle`], forever. Such messages go to a dead-letter stream instead
//! ([`Consumer::dead_letter_stream`], default `<stream>:dead`) and are acknowledged:
//!
//! - at once when they are **malformed** (no `charge_id`, an `amount` that is not a positive
//!   whole number written in digits alone, a charge id that is not a valid key, a field
//!   given twice or whose name is not UTF-8) or **mismatch** (a charge id applied already with another
//!   amount: no redelivery can change that answer; while the other amount is still in
//!   flight, the message is only deferred, as that attempt may yet fail; once that attempt's
//!   lease ran out unfinished — its worker gone, and perhaps its message trimmed, so nothing
//!   may ever finish it — each delivery counts as a failure of the message, below);
//! - when **the effect failed** (or panicked) for the [`Consumer::max_failures`]-th time
//!   (default 5), or its stored result no longer decodes (a damaged record under a previous
//!   scope counts each delivery as a failure too, until the current scope decides the
//!   charge: its duplicates then replay that decision at once). Failures are counted per message
//!   and group in a Redis hash (`<stream>:<group>:failures`), so the count survives
//!   consumer restarts, and only attempts that ran count, deliveries that found the charge
//!   held by another amount's attempt whose lease ran out, and deliveries that found its
//!   record under a previous scope damaged: a delivery to a consumer that died
//!   before handling it, or that found the charge in flight elsewhere, is not a failure of
//!   the message. A count goes with its message: dropped by the ack, and never raised for a
//!   message no longer pending (acknowledged by another consumer meanwhile). Such a dead
//!   letter decides its charge first: the charge's key is claimed and the dead letter stored
//!   as its result, then the message is moved, so a consumer still holding the message and
//!   every later delivery of the charge replay the dead letter, and dead-letter their
//!   message too, instead of applying it. A charge is applied or dead-lettered, never both.
//!   To apply a dead-lettered charge once its cause is fixed, release its key first
//!   (`force_release` with `ReleaseScope::with_completed`, or the admin surface; a record
//!   whose result begins with `dead-lettered `, never one that says `applied`), then
//!   publish it again. A message dead-lettered because another amount's attempt that never
//!   finished holds its charge names the scope of that attempt's record: release that one
//!   (after an upgrade, the previous scope's), once its worker is known dead. So does one
//!   dead-lettered because an earlier version decided its charge so under a previous scope
//!   (`… (decided under scope <scope>)`): release that scope's record. A charge id applied
//!   with another amount names the scope of its record too (`… under scope <scope> …`), as
//!   does a failure on a damaged record under a previous scope (`… (scope <scope>)`): that
//!   record may be the charge applied (its result cannot be read to tell), so look for the
//!   charge in the ledger before releasing it (see [`Consumer::with_previous_scope`]).
//!
//! A message trimmed from the stream while pending is dead-lettered with its id, all that
//! is left of it (it may have been applied: the consumer holding it may have been applying
//! it; its charge is in the ledger then).
//!
//! Charges are keyed by the effect they apply, the ledger ([`Consumer::scope`]), not by the
//! group reading them, and their records are kept for good, as the ledger keeps its rows: a
//! consumer group created anew on the stream (renamed, or reset to its start), however
//! much later, replays every charge the ledger holds instead of applying it again. Earlier
//! versions keyed charges by the group: [`Consumer::with_previous_scope`] carries an upgrade
//! over without applying a charge twice.
//!
//! Claiming scans the pending list a bounded stretch per poll and goes on from where the
//! last poll stopped, so an idle message behind a long run of live ones is reached.
//!
//! A message that met an outage — the idempotency store unavailable, or the database
//! unreachable, restarting, overloaded or out of time in the middle of the effect (its
//! transaction rolled back) — is left pending and never counted or dead-lettered for it: an
//! outage is not the message's fault, and it is applied once the database is back. A
//! message whose charge another consumer is applying right now (`InFlight`) is deferred
//! likewise. Each dead letter holds the original id (`id`), the
//! `reason`, the `deliveries` and `failures` so far, the `group` and `consumer`, and the
//! message's own fields prefixed with `payload.` (the first thousand, by name; how many more
//! there were in `payload_omitted`), so no field of the message can overwrite the others.
//! The copy and the `XACK` are one Lua script, the copy first: a message is dead-lettered
//! once even when two consumers hold it, and never acknowledged without its copy.
//!
//! # Outcomes that were not stored
//!
//! The charge's result commits with it, so the executor stores nothing after the operation
//! returns: it confirms the commit (it gives the lease back, which the store refuses for a
//! record no longer in flight under the claim's token, then completes with that token,
//! which such a record accepts only if that token completed it). Should the store's
//! database go down right after the commit, the confirmation fails for a whole lease of
//! retries and the executor answers
//! [`RunError::Unconfirmed`]: the message stays pending, counted in [`Polled::failed`] (not
//! toward dead-lettering), and its redelivery replays the committed charge once the
//! database is back (a transaction that did not commit would run again instead). The lease
//! is the executor's ([`Consumer::with_lease`], default 30 s). [`RunError::NotStored`]
//! ("it ran, its outcome was not stored") is what the executor answers an operation that
//! stores no result of its own; should it ever reach this consumer, the charge was applied,
//! and the message is acknowledged, counted in [`Polled::not_stored`] and logged at error
//! level.
//!
//! # Its connection
//!
//! A consumer makes its Redis connection itself, on first use, and makes it again after
//! one that closed (Redis restarted, a proxy or the network reset it), timed out (a peer
//! gone without a reset), or answered `READONLY` (a failover left it on the demoted primary):
//! the poll that met it fails, and the next one goes on. Needs Redis 7.0 or later: before,
//! `XAUTOCLAIM` keeps a message trimmed while pending in the pending list and reports it as
//! nil, so it would be skipped, not dead-lettered.
//!
//! # Shutting down
//!
//! Stop polling between messages, or drop a poll anywhere: either way nothing is applied
//! twice. (A poll dropped or failed mid-way leaves the messages it took and had not started
//! to the consumer's next poll; the one it was handling is claimed again after
//! `claim_idle`.) Then [`Consumer::drain`], which waits for what dropped runs left to settle (a
//! lease given back, an outcome being stored).
//!
//! Run the example with: `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run -p stream-consumer`

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    pin::Pin,
    sync::Arc,
    time::Duration,
};

use idempotency::{
    Begin, Executor, FOR_GOOD, Fingerprint, IdempotencyKey, Policy, RecordId, RecordState,
    RunError, Scope, Store,
    postgres::{CommitClaimError, PostgresStore},
};
use redis::{
    AsyncCommands, Cmd, Pipeline, RedisFuture, RedisResult, Script, Value,
    aio::{ConnectionLike, MultiplexedConnection},
    streams::{StreamPendingCountReply, StreamReadOptions},
};
use sqlx::PgPool;

/// What can stop a consumer.
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    /// Redis failed.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// The idempotency store failed (setting up the ledger).
    #[error(transparent)]
    Store(#[from] idempotency::Error),
    /// The fault the tests inject: the process "dies" after the effect, before `XACK`.
    #[error("crashed before acknowledging {0}")]
    Crashed(String),
}

/// Why a charge's effect failed; its transaction rolled back.
#[derive(Debug, thiserror::Error)]
pub enum EffectError {
    /// The ledger write or the transaction failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// Storing the result in the transaction failed (`LeaseLost`: another attempt took the
    /// charge over, and its effect is the one that counts).
    #[error(transparent)]
    Store(#[from] idempotency::Error),
}

/// The completion's error as the store's, a failed `COMMIT` as the database's: a constraint
/// checked at the commit is the message's fault as much as one checked at the insert.
impl From<CommitClaimError> for EffectError {
    fn from(error: CommitClaimError) -> Self {
        match error {
            CommitClaimError::Commit(error) => Self::Database(error),
            CommitClaimError::Store(error) => Self::Store(error),
            // `non_exhaustive`: whatever comes next is the store's.
            other => Self::Store(other.into()),
        }
    }
}

/// Counts of one [`Consumer::poll`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Polled {
    /// Messages whose effect ran now.
    pub applied: u64,
    /// Messages that repeated a charge already applied (acknowledged, no effect).
    pub replayed: u64,
    /// Messages left pending because another consumer is applying the same charge now.
    pub deferred: u64,
    /// Messages whose attempt failed (the effect or the store) and were left pending for
    /// another delivery.
    pub failed: u64,
    /// Messages this poll moved to the dead-letter stream (and acknowledged).
    pub dead_lettered: u64,
    /// Messages whose effect ran now but whose outcome the store did not take
    /// ([`RunError::NotStored`]; not expected here, the charge's result committing with it):
    /// acknowledged, not redelivered, and logged at error level.
    pub not_stored: u64,
    /// Messages this poll acknowledged first, dead letters included (`XACK` answers 0 for a
    /// message another consumer already acknowledged: at-least-once delivery can hand one
    /// message to two).
    pub acked: u64,
}

/// A test fault run inside the effect: see [`Consumer::after_effect`].
pub type AfterEffect = Arc<dyn Fn(&str) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// How the stored result of a dead-lettered charge begins (an applied one's is `applied `).
const DEAD_LETTERED: &str = "dead-lettered ";

/// What a charge's record says of another amount than a message's ([`Consumer::other_amount`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OtherAmount {
    Applied,
    Unfinished,
    InFlight,
}

/// The dead letter's reason for a charge id held by another amount's attempt whose lease ran
/// out unfinished, under `scope` (the record to release, once its attempt is known dead, to
/// apply the charge: the previous scope's after an upgrade, not the ledger's).
fn unfinished_otherwise_reason(charge_id: &str, failures: u64, scope: &Scope) -> String {
    format!(
        "mismatch: charge {charge_id} is held by an attempt with another amount whose lease ran \
         out unfinished, under scope {} (failure {failures} of this message; see the ledger \
         and the dead letters)",
        scope.as_str()
    )
}

/// The dead letter's reason for a charge id decided already with another amount, its record
/// under `scope` (after an upgrade, a previous scope's: where an operator freeing the charge
/// id must look).
fn applied_otherwise_reason(charge_id: &str, scope: &Scope) -> String {
    format!(
        "mismatch: charge {charge_id} was already decided with another amount, under scope {} \
         (applied, or dead-lettered: see the ledger and the dead letters)",
        scope.as_str()
    )
}

/// The consumer's own Redis connection: made on first use, and made again by the call after
/// one that left it unusable. A multiplexed connection is never remade by redis-rs: once its
/// socket closed (Redis restarted, a proxy or the network reset it) every command on it
/// failed, and a consumer given one stopped consuming for good; one left on a demoted
/// primary by a failover (a proxy that keeps its sessions) answered `READONLY` to every
/// acknowledgement for as long. Messages stay pending meanwhile, and a stream capped by
/// its producer trims those never read.
struct Connection {
    client: redis::Client,
    config: redis::AsyncConnectionConfig,
    current: Option<MultiplexedConnection>,
}

impl Connection {
    async fn current(&mut self) -> RedisResult<&mut MultiplexedConnection> {
        let current = match self.current.take() {
            Some(current) => current,
            None => {
                self.client
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await?
            }
        };
        Ok(self.current.insert(current))
    }

    /// Forgets the connection after an error that leaves it unusable, or on the wrong
    /// server: closed, timed out (a peer gone without a reset answers nothing, ever; so too
    /// a call dropped while it waited, [`ForgetIfDropped`]), or
    /// refusing writes as a replica (`replica`: a server's error is a reply here, made an
    /// `Err` by the caller's conversion).
    fn after<T>(&mut self, result: RedisResult<T>, replica: fn(&T) -> bool) -> RedisResult<T> {
        let spent = match &result {
            Ok(reply) => replica(reply),
            Err(error) => {
                error.is_io_error()
                    || error.is_connection_dropped()
                    || error.is_timeout()
                    || error.is_unrecoverable_error()
                    || error.code() == Some("READONLY")
            }
        };
        if spent {
            self.current = None;
        }
        result
    }
}

/// Whether a reply is a replica's refusal of a write.
fn readonly(reply: &Value) -> bool {
    matches!(reply, Value::ServerError(error) if error.code() == "READONLY")
}

/// Forgets the connection unless disarmed: a call dropped while it waited for Redis (a poll
/// under an outer timeout shorter than the response timeout) may have met one that answers
/// nothing, ever (a peer gone behind a proxy that keeps its session). Kept, every poll after
/// queued on it and was dropped the same way, for good.
struct ForgetIfDropped<'a>(Option<&'a mut Option<MultiplexedConnection>>);

impl Drop for ForgetIfDropped<'_> {
    fn drop(&mut self) {
        if let Some(current) = self.0.take() {
            *current = None;
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut connection = self.current().await?.clone();
            let mut dropped = ForgetIfDropped(Some(&mut self.current));
            let result = connection.req_packed_command(cmd).await;
            dropped.0 = None;
            drop(dropped);
            self.after(result, readonly)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut connection = self.current().await?.clone();
            let mut dropped = ForgetIfDropped(Some(&mut self.current));
            let result = connection
                .req_packed_commands(pipeline, offset, count)
                .await;
            dropped.0 = None;
            drop(dropped);
            self.after(result, |replies| replies.iter().any(readonly))
        })
    }

    fn get_db(&self) -> i64 {
        self.client.get_connection_info().redis_settings().db()
    }
}

/// What the record a charge had under the previous scope says.
enum Previously {
    /// None: apply it under the current scope.
    Nothing,
    /// Applied with this amount: acknowledge the message.
    Applied,
    /// Decided dead-lettered with this amount (the stored decision): dead-letter the
    /// message.
    DeadLettered(String),
    /// Applied with another amount, under this scope.
    OtherAmount(Scope),
    /// An attempt holds it: wait.
    Holding,
    /// An attempt with another amount holds it, its lease run out unfinished: counted as a
    /// failure of the message, as under the current scope (nothing may ever finish it).
    Unfinished(Scope),
    /// The store could not tell: wait.
    Unknown(String),
    /// The record is damaged (its row, or a stored result that no longer decodes): every
    /// delivery would find it so, and it counts as a failure of the message, as under the
    /// current scope.
    Damaged(String),
}

impl Previously {
    /// A store call on `previous`'s record that failed: damaged, or the store could not
    /// tell (an outage: wait).
    fn failed(error: &idempotency::Error, previous: &Scope) -> Self {
        let said = format!("{error} (scope {})", previous.as_str());
        match error {
            idempotency::Error::Corrupt(_) => Self::Damaged(said),
            _ => Self::Unknown(said),
        }
    }
}

/// What a completed record of a charge with the message's amount under a previous scope
/// decided: dead-lettered (its stored value says so; the dead letter names the scope, where
/// its record must be released for the charge to be applied), or applied.
fn decided(outcome: &idempotency::Outcome, previous: &Scope) -> Previously {
    match stored_decision(outcome) {
        Ok(Some(value)) => Previously::DeadLettered(format!(
            "{value} (decided under scope {})",
            previous.as_str()
        )),
        Ok(None) => Previously::Applied,
        // Read as applied, a dead-letter decision whose result no longer decodes would
        // acknowledge the message with no ledger row.
        Err(error) => Previously::Damaged(format!(
            "the charge's stored result no longer decodes: {error} (scope {})",
            previous.as_str()
        )),
    }
}

/// What a charge's stored result says: its dead-letter decision (`Some`), or that it was
/// applied (`None`); an error when it no longer decodes.
fn stored_decision(outcome: &idempotency::Outcome) -> serde_json::Result<Option<String>> {
    let value = serde_json::from_slice::<String>(&outcome.body)?;
    Ok(value.starts_with(DEAD_LETTERED).then_some(value))
}

/// One consumer of a group.
pub struct Consumer {
    redis: Connection,
    pool: PgPool,
    store: Arc<PostgresStore>,
    executor: Executor<PostgresStore>,
    /// The executor's policy, kept to change its lease alone ([`Consumer::with_lease`]).
    policy: Policy,
    stream: String,
    group: String,
    name: String,
    ledger: String,
    /// Messages idle this long in another consumer's pending list are claimed.
    pub claim_idle: Duration,
    /// A message whose effect failed this many times (counting this one; a delivery that
    /// found its charge held by another amount's attempt whose lease ran out counts too, as
    /// does one that found its record under a previous scope damaged) is
    /// dead-lettered rather than left for another attempt (default 5; 1 dead-letters on the
    /// first failure).
    pub max_failures: u64,
    /// The stream dead letters are added to (default `<stream>:dead`).
    pub dead_letter_stream: String,
    /// The hash counting each pending message's failed attempts
    /// (`<stream>:<group>:failures`: each group has its own attempts).
    failures: String,
    /// Where the next `XAUTOCLAIM` goes on scanning the pending list: each call looks at a
    /// bounded number of entries, so always starting at the front would never reach an idle
    /// message behind a long run of live ones.
    claim_from: String,
    /// Messages a poll took (claimed or read) and had not started to handle when it failed
    /// or was dropped, with their delivery counts: the next poll handles them first. Left to
    /// the claim, they waited `claim_idle` (30 s by default) after one failed `XACK`, their
    /// idle time reset by the claim or the read that took them. (A poll that fails again on
    /// one of them leaves the rest to the claim: a Redis that keeps failing would otherwise
    /// fail them one a poll.)
    owed: VecDeque<(Entry, u64)>,
    /// The scopes earlier versions keyed charges by, consulted in order before a charge is
    /// applied ([`Consumer::with_previous_scope`]).
    previous_scopes: Vec<Scope>,
    /// Test fault: crash after the effect of this charge, before its `XACK`.
    pub crash_before_ack: Option<String>,
    /// Test fault: crash after this charge was decided dead-lettered, before its message
    /// is moved.
    pub crash_before_dead_letter: Option<String>,
    /// Test fault: awaited inside the effect of every charge (given its id), after the
    /// ledger write and before its transaction stores the outcome and commits.
    pub after_effect: Option<AfterEffect>,
    /// Test fault: awaited after the effect's transaction committed, before the operation
    /// returns (the executor then confirms the commit) — e.g. to stop the database.
    pub after_commit: Option<AfterEffect>,
}

impl Consumer {
    /// A consumer `name` in `group` on `stream`, writing its effect to the `ledger` table,
    /// reading from the Redis `redis` opens.
    ///
    /// Every consumer makes its own connection, on first use: `XREADGROUP BLOCK` holds the
    /// connection it runs on, so consumers sharing one would wait on each other's reads. It
    /// makes it again after a failure that leaves it unusable (see
    /// [`with_connection_config`](Self::with_connection_config)).
    ///
    /// ```no_run
    /// # async fn doc(store: std::sync::Arc<idempotency::postgres::PostgresStore>) -> redis::RedisResult<()> {
    /// let redis = redis::Client::open("redis://127.0.0.1:6379")?;
    /// let consumer =
    ///     stream_consumer::Consumer::new(redis, store, "charges", "ledger", "consumer-1", "ledger_entries");
    /// # Ok(()) }
    /// ```
    pub fn new(
        redis: redis::Client,
        store: Arc<PostgresStore>,
        stream: &str,
        group: &str,
        name: &str,
        ledger: &str,
    ) -> Self {
        Self {
            redis: Connection {
                client: redis,
                config: redis::AsyncConnectionConfig::new(),
                current: None,
            },
            pool: store.pool().clone(),
            executor: Executor::new(store.clone())
                .with_policy(Policy::default().with_retention(FOR_GOOD)),
            policy: Policy::default().with_retention(FOR_GOOD),
            store,
            stream: stream.into(),
            group: group.into(),
            name: name.into(),
            ledger: ledger.into(),
            claim_idle: Duration::from_secs(30),
            max_failures: 5,
            dead_letter_stream: format!("{stream}:dead"),
            failures: format!("{stream}:{group}:failures"),
            claim_from: "0-0".into(),
            owed: VecDeque::new(),
            previous_scopes: Vec::new(),
            crash_before_ack: None,
            crash_before_dead_letter: None,
            after_effect: None,
            after_commit: None,
        }
    }

    /// Sets how the consumer's connection is made (default:
    /// `redis::AsyncConnectionConfig::new()`). Its response timeout must exceed the 100 ms
    /// block of each read and what the largest batch of messages takes to arrive (redis-rs'
    /// default, 500 ms, covers small messages on a local network): a read that times out
    /// after Redis delivered leaves its messages pending, and `claim_idle` later hands them
    /// out again.
    ///
    /// ```
    /// # fn doc(consumer: stream_consumer::Consumer) -> stream_consumer::Consumer {
    /// let config = redis::AsyncConnectionConfig::new()
    ///     .set_response_timeout(Some(std::time::Duration::from_secs(5)));
    /// consumer.with_connection_config(config)
    /// # }
    /// ```
    pub fn with_connection_config(mut self, config: redis::AsyncConnectionConfig) -> Self {
        self.redis.config = config;
        self.redis.current = None;
        self
    }

    /// Replaces the executor's policy (default: [`Policy::default`] with a retention
    /// [`FOR_GOOD`]): its lease is how long an attempt holds a charge against other
    /// consumers, and how long confirming an applied charge's commit is retried before the
    /// message is left for a redelivery. Its retention is how long a charge's record says it
    /// was applied: keep it for as long as the stream may deliver the charge again (a group
    /// created anew, or reset to the stream's start, reads every message the stream still
    /// holds), as the ledger keeps its row. A charge delivered after its record is gone is
    /// applied again. (`Policy::default()` keeps records a day: set the retention again,
    /// `.with_retention(FOR_GOOD)`, when changing the lease, or change it alone with
    /// [`Consumer::with_lease`].)
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.executor = self.executor.with_policy(policy.clone());
        self.policy = policy;
        self
    }

    /// Sets the executor's lease alone (default 30 s), keeping its retention: how long an
    /// attempt holds a charge against other consumers, and how long confirming an applied
    /// charge's commit is retried before the message is left for a redelivery.
    ///
    /// ```
    /// # fn doc(consumer: stream_consumer::Consumer) -> stream_consumer::Consumer {
    /// consumer.with_lease(std::time::Duration::from_secs(10))
    /// # }
    /// ```
    pub fn with_lease(self, lease: Duration) -> Self {
        let policy = self.policy.clone().with_lease(lease);
        self.with_policy(policy)
    }

    /// The scope of this consumer's charge keys: its effect, the ledger table. Not the
    /// stream or the group: a group created anew, renamed or reset to the stream's start,
    /// or a second stream carrying the same charges, replays what this ledger applied
    /// already instead of applying it again. The scope is the name as given: keep it spelled
    /// the same across deploys and fleets. Postgres reads `ledger`, `Ledger` and
    /// `public.ledger` as one table, but each is a scope of its own, and a charge read again
    /// under another spelling (a pending message redelivered after a deploy, a group made
    /// anew) is applied again. (Not checked: what name Postgres prints for a table depends
    /// on each role's `search_path`.) To respell it, stop every consumer of the old spelling,
    /// then start the new one with the old spelling's scope as a previous scope
    /// ([`Consumer::with_previous_scope`]).
    ///
    /// ```
    /// # fn doc(consumer: &stream_consumer::Consumer) {
    /// let key = idempotency::IdempotencyKey::new("ch_1").expect("a valid key");
    /// let record = idempotency::RecordId::new(&consumer.scope(), &key);
    /// # }
    /// ```
    pub fn scope(&self) -> Scope {
        Scope::new(format!("ledger:{}", self.ledger))
    }

    /// The scope versions of this example before 4 December 2026 keyed charges by: the
    /// stream and the group. Pass it to [`Consumer::with_previous_scope`] when upgrading.
    pub fn group_scope(stream: &str, group: &str) -> Scope {
        Scope::new(format!("stream:{stream}:{group}"))
    }

    /// Consults the records an earlier version wrote under `previous` (see
    /// [`Consumer::group_scope`]) before applying a charge, so that changing the scope
    /// applies nothing twice: a message still pending at the upgrade, or published again
    /// after it, is acknowledged as a replay when its charge was applied under the old key,
    /// dead-lettered when an old consumer decided the charge dead-lettered (and died before
    /// moving its message), and waits while an old attempt still holds it. An old attempt whose lease ran out
    /// unfinished is taken over, which fences it should it still be running, and released,
    /// and the charge is applied: what the earlier version did on its own takeover. Since
    /// the ledger row and the outcome became one transaction (`run_with_claim`), such an
    /// attempt never committed; a record left by a version older than that (its row
    /// committed on its own, under `run`) may have, and is applied again, as that version
    /// would have. An old attempt with another amount whose lease ran out unfinished holds
    /// the charge id for good: each delivery that meets it counts as a failure of the
    /// message, dead-lettered after `max_failures`, as under the current scope; so does an
    /// old record with the message's amount that is damaged (its stored result no longer
    /// decodes, or neither the operator's view nor a claim can read it), until the charge
    /// is decided under the current scope (dead-lettered, so, by the first of its messages
    /// to fail `max_failures` times), whose decision its other messages then replay at
    /// once. A record the
    /// operator's view cannot read but a claim can answers as it reads (the key table's
    /// checks leave that view one damage to trip on, a negative status on a completed
    /// row). Dead letters for a record under an old key name its scope. A damaged record
    /// may be the charge the earlier version applied: look for the charge in the ledger
    /// first. Only if it is not there, release (or mend) the record under the named scope
    /// and the current scope's dead-letter record, then publish it again; released alone,
    /// the current one is dead-lettered again. While a store call on an old scope fails
    /// (an outage), the message waits, not counted.
    ///
    /// Stop every consumer of the earlier version before starting one with the new scope: an
    /// old consumer does not look under the new one. Keep the option for as long as the old
    /// records are kept (the store's retention).
    ///
    /// Called again, it adds a scope: each is consulted; the charge applied with the
    /// message's amount under any of them is acknowledged as applied; else, while one of
    /// them cannot be read (an outage), the message waits; else the first, in the order
    /// given, that holds anything of it answers — an upgrade from the group scope, and a
    /// ledger spelled otherwise before (`ledger:public.ledger` for a ledger now given as
    /// `ledger`; see [`Consumer::scope`]).
    ///
    /// ```no_run
    /// # fn doc(consumer: stream_consumer::Consumer) -> stream_consumer::Consumer {
    /// let old = stream_consumer::Consumer::group_scope("charges", "ledger");
    /// consumer
    ///     .with_previous_scope(old)
    ///     .with_previous_scope(idempotency::Scope::new("ledger:public.ledger"))
    /// # }
    /// ```
    pub fn with_previous_scope(mut self, previous: Scope) -> Self {
        self.previous_scopes.push(previous);
        self
    }

    /// At shutdown, once polling stopped: waits until what dropped runs left to settle (an
    /// applied charge's outcome, a lease given back) has landed. See [`Executor::drain`].
    pub async fn drain(&self) {
        self.executor.drain().await;
    }

    /// Creates the group (from the stream's start) and the ledger table, if missing.
    pub async fn setup(&mut self) -> Result<(), ConsumeError> {
        self.create_group().await?;
        // The ledger has no unique constraint on purpose: a second effect would show.
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {} (charge_id text NOT NULL, amount bigint NOT NULL, at timestamptz NOT NULL DEFAULT now())",
            self.ledger
        );
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(&self.pool)
            .await
            .map_err(idempotency::Error::unavailable)?;
        Ok(())
    }

    /// Creates the group from the stream's start unless it exists.
    async fn create_group(&mut self) -> Result<(), ConsumeError> {
        // A group it creates starts with no failure counts (one destroyed and made again
        // would otherwise inherit the old group's: see `CREATE_GROUP`). An existing group
        // (BUSYGROUP) is what we want, and keeps its counts.
        let _created: u8 = CREATE_GROUP
            .key(&self.stream)
            .key(&self.failures)
            .arg(&self.group)
            .invoke_async(&mut self.redis)
            .await?;
        Ok(())
    }

    /// A poll that found the group gone (`NOGROUP`): a Redis restarted from a snapshot
    /// older than the group or with no persistence, a failover to a replica that never got
    /// it, an operator's `XGROUP DESTROY`. Every later poll failed on it, and nothing was
    /// applied until someone ran `setup` again. Made again from the stream's start: each
    /// charge read again replays (its outcome is kept for good), none runs twice.
    /// (Messages dead-lettered before and still in the stream are dead-lettered again.)
    async fn group_lost(
        &mut self,
        error: &redis::RedisError,
        polled: Polled,
    ) -> Result<Polled, ConsumeError> {
        tracing::warn!(%error, stream = %self.stream, group = %self.group, "the consumer group is gone: created again from the stream's start");
        self.create_group().await?;
        self.claim_from = "0-0".to_owned();
        Ok(polled)
    }

    /// Claims messages other consumers left pending too long, then reads new ones; applies
    /// and acknowledges each.
    pub async fn poll(&mut self, count: usize) -> Result<Polled, ConsumeError> {
        let mut polled = Polled::default();
        // What the last poll took and did not get to: its messages are pending under this
        // consumer, idle for less than `claim_idle`, and `>` does not hand them out again.
        if let Err(error) = self.handle_owed(&mut polled).await {
            // The rest go back to the claim, as before: a Redis failing now would fail them
            // one a poll. The group gone, the claim below meets it too and makes it again
            // (its stream read from the start: they come back).
            self.owed.clear();
            if !matches!(&error, ConsumeError::Redis(error) if group_is_gone(error)) {
                return Err(error);
            }
        }
        let idle = u64::try_from(self.claim_idle.as_millis()).unwrap_or(u64::MAX);
        // Read as values, not as `StreamAutoClaimReply` or `StreamReadReply`: those take
        // field names for strings, and one name that is not UTF-8 failed the whole reply, so
        // every message read with it stayed pending and came back with it, for ever.
        //
        // Messages trimmed from the stream while pending are dead-lettered by the claim's own
        // script: `XAUTOCLAIM` takes them off the pending list and reports them once, so
        // written later, by this process, they were lost without a trace when its answer
        // was (a response timeout, a poll dropped at this await) or the process restarted.
        let claimed: redis::RedisResult<Value> = CLAIM
            .key(&self.stream)
            .key(&self.dead_letter_stream)
            .key(&self.failures)
            .arg(&self.group)
            .arg(&self.name)
            .arg(idle)
            .arg(&self.claim_from)
            .arg(count)
            .arg(TRIMMED_REASON)
            .invoke_async(&mut self.redis)
            .await;
        let claimed = match claimed {
            Err(error) if group_is_gone(&error) => return self.group_lost(&error, polled).await,
            claimed => claimed?,
        };
        let claimed = AutoClaimed::from_value(&claimed)?;
        for id in &claimed.deleted {
            tracing::error!(id, reason = TRIMMED_REASON, stream = %self.dead_letter_stream, "dead-lettered message");
            polled.dead_lettered += 1;
        }
        let options = StreamReadOptions::default()
            .group(&self.group, &self.name)
            .count(count)
            .block(100);
        let read: Value = match self
            .redis
            .xread_options(&[&self.stream], &[">"], &options)
            .await
        {
            // Gone since the claim: what it claimed was on the lost group's pending list,
            // and the group made again reads it from the stream.
            Err(error) if group_is_gone(&error) => return self.group_lost(&error, polled).await,
            read => read?,
        };
        // `>` hands out messages never delivered before: this is their first delivery.
        self.owed = read_entries(&read)?.into_iter().map(|m| (m, 1)).collect();
        let deliveries = self.deliveries(&claimed.entries).await?;
        for message in claimed.entries.into_iter().rev() {
            // Not pending any more (acknowledged meanwhile): whatever happens, its `XACK`
            // answers 0; count it as a first delivery so nothing is dead-lettered for it.
            let delivered = deliveries.get(&message.id).copied().unwrap_or(1);
            self.owed.push_front((message, delivered));
        }
        self.handle_owed(&mut polled).await?;
        // Only once what it claimed was handled: a poll that fails before leaves the cursor
        // where it was, and the next one scans that stretch again.
        // `0-0` once the scan has gone round the whole list.
        self.claim_from = claimed.next;
        Ok(polled)
    }

    /// Handles the messages owed ([`Consumer::owed`]), in order. Each leaves the list as its
    /// handling starts: one that fails, or whose handling is dropped, is left to the claim,
    /// as before (so that a message that always fails so does not hold up every poll).
    async fn handle_owed(&mut self, polled: &mut Polled) -> Result<(), ConsumeError> {
        while let Some((message, delivered)) = self.owed.pop_front() {
            self.handle(&message, delivered, polled).await?;
        }
        Ok(())
    }

    /// How many times each claimed message has been delivered, this claim included, as the
    /// group's pending list counts (one pipelined `XPENDING id id 1` per message).
    async fn deliveries(
        &mut self,
        claimed: &[Entry],
    ) -> Result<HashMap<String, u64>, ConsumeError> {
        if claimed.is_empty() {
            return Ok(HashMap::new());
        }
        let mut pipe = redis::pipe();
        for message in claimed {
            pipe.xpending_count(&self.stream, &self.group, &message.id, &message.id, 1);
        }
        let replies: Vec<StreamPendingCountReply> = pipe.query_async(&mut self.redis).await?;
        Ok(replies
            .into_iter()
            .flat_map(|reply| reply.ids)
            .map(|pending| (pending.id, pending.times_delivered as u64))
            .collect())
    }

    async fn handle(
        &mut self,
        message: &Entry,
        delivered: u64,
        polled: &mut Polled,
    ) -> Result<(), ConsumeError> {
        let (charge_id, amount, key) = match parse(message) {
            Ok(charge) => charge,
            Err(reason) => {
                let reason = format!("malformed: {reason}");
                self.dead_letter(message, delivered, &reason, polled)
                    .await?;
                return Ok(());
            }
        };
        let scope = self.scope();
        let fingerprint = Fingerprint::of(&amount.to_be_bytes());
        match self.under_previous_scope(&key, &fingerprint).await {
            Previously::Nothing => {}
            Previously::Applied => {
                polled.replayed += 1;
                return self.ack(message, charge_id, polled).await;
            }
            Previously::DeadLettered(decided) => {
                self.dead_letter(message, delivered, &decided, polled)
                    .await?;
                return Ok(());
            }
            Previously::Holding => {
                polled.deferred += 1;
                return Ok(());
            }
            Previously::Unfinished(previous) => {
                return self
                    .wait_for_unfinished(message, delivered, &charge_id, &previous, polled)
                    .await;
            }
            Previously::OtherAmount(previous) => {
                let reason = applied_otherwise_reason(&charge_id, &previous);
                self.dead_letter(message, delivered, &reason, polled)
                    .await?;
                return Ok(());
            }
            Previously::Unknown(error) => {
                tracing::warn!(%error, charge = %charge_id, delivered, "the idempotency store failed; will be redelivered");
                polled.failed += 1;
                return Ok(());
            }
            // Read as an outage, it kept its message pending for ever, where the same damage
            // under the current scope is dead-lettered after `max_failures`. Unless the
            // current scope decided the charge already (a message of it dead-lettered for
            // this damage): that decision answers at once, as on the main path. (Before,
            // each duplicate counted failures of its own on the damaged record first, to
            // `max_failures`, a `claim_idle` apart.)
            Previously::Damaged(error) => {
                match self.decided_here(&scope, &key, &fingerprint).await {
                    Some(Previously::DeadLettered(decided)) => {
                        self.dead_letter(message, delivered, &decided, polled)
                            .await?;
                        return Ok(());
                    }
                    Some(Previously::Applied) => {
                        polled.replayed += 1;
                        return self.ack(message, charge_id, polled).await;
                    }
                    _ => {}
                }
                let charge = (charge_id.as_str(), &key, &fingerprint);
                return self
                    .count_failed_delivery(message, charge, delivered, &error, polled)
                    .await;
            }
        }
        let (store, ledger) = (&*self.store, &self.ledger);
        let (after_effect, after_commit) = (&self.after_effect, &self.after_commit);
        let charge = charge_id.as_str();
        let result = self
            .executor
            .run_with_claim(&scope, &key, &fingerprint, |claim| async move {
                // The row and the charge's result commit together, or neither does.
                let value = format!("applied {charge}");
                let mut tx = store.pool().begin().await?;
                let insert = format!("INSERT INTO {ledger} (charge_id, amount) VALUES ($1, $2)");
                sqlx::query(sqlx::AssertSqlSafe(insert))
                    .bind(charge)
                    .bind(amount)
                    .execute(&mut *tx)
                    .await?;
                if let Some(fault) = after_effect {
                    fault(charge).await;
                }
                store.commit_claim(tx, &claim, &value).await?;
                if let Some(fault) = after_commit {
                    fault(charge).await;
                }
                Ok::<_, EffectError>(value)
            })
            .await;
        let id = RecordId::new(&scope, &key);
        match result {
            // The charge was dead-lettered (by another delivery of it): so is this message.
            Ok(done) if done.replayed && done.value.starts_with(DEAD_LETTERED) => {
                self.dead_letter(message, delivered, &done.value, polled)
                    .await?;
                return Ok(());
            }
            Ok(done) if done.replayed => polled.replayed += 1,
            Ok(_) => polled.applied += 1,
            // Someone else is applying this charge right now (or took it over from this
            // attempt, which was stopped): leave the message pending; it is claimed again
            // after `claim_idle` and then replays.
            Err(
                RunError::InFlight { .. }
                | RunError::LeaseLost
                | RunError::Failed(EffectError::Store(idempotency::Error::LeaseLost)),
            ) => {
                polled.deferred += 1;
                return Ok(());
            }
            // Another amount holds the charge id. Applied: every redelivery would answer the
            // same, so the message cannot wait for one. Still in flight: that attempt may yet
            // fail and give the charge id back, so the message waits. But not for ever once
            // that attempt's lease ran out unfinished: its worker is gone, and if its message
            // was trimmed from the stream nothing will finish it (its record stays in flight
            // until a purge of unknown outcomes, if one runs). Each such wait counts as a
            // failure of the message, which is dead-lettered after `max_failures` of them.
            Err(RunError::Mismatch) => {
                match self.other_amount(&id, &fingerprint).await {
                    OtherAmount::Applied => {
                        let reason = applied_otherwise_reason(&charge_id, &scope);
                        self.dead_letter(message, delivered, &reason, polled)
                            .await?;
                    }
                    OtherAmount::Unfinished => {
                        self.wait_for_unfinished(message, delivered, &charge_id, &scope, polled)
                            .await?;
                    }
                    OtherAmount::InFlight => polled.deferred += 1,
                }
                return Ok(());
            }
            // The charge ran, but its outcome was not stored (a store call of the executor's
            // own failed after the run): acknowledge it, and say so loudly.
            Err(error @ RunError::NotStored(_)) => {
                let error = error_chain(&error);
                tracing::error!(%error, charge = %charge_id, id = %message.id, "the charge was applied but the outcome was not stored; acknowledging the message without a redelivery");
                polled.not_stored += 1;
            }
            // Anything but a fault of the message (the store or the database unreachable,
            // read-only, refusing the login, misconfigured): nothing took effect, or it rolled
            // back. It stays pending, for a delivery once they are back, and does not count
            // toward dead-lettering: a dead letter is acknowledged without its charge.
            Err(error) if !fault_of_the_message(&error) => {
                let error = error_chain(&error);
                tracing::warn!(%error, charge = %charge_id, delivered, "the idempotency store failed; will be redelivered");
                polled.failed += 1;
                return Ok(());
            }
            // The effect failed or panicked, and rolled back (the key is released): a later
            // attempt may succeed, up to `max_failures`.
            Err(error) => {
                let error = error_chain(&error);
                let charge = (charge_id.as_str(), &key, &fingerprint);
                return self
                    .count_failed_delivery(message, charge, delivered, &error, polled)
                    .await;
            }
        }
        self.ack(message, charge_id, polled).await
    }

    /// Counts a delivery that failed for the message's sake (`error`): once `max_failures`
    /// are counted, the charge is decided dead-lettered and the message moved; until then it
    /// waits for a redelivery.
    async fn count_failed_delivery(
        &mut self,
        message: &Entry,
        charge: (&str, &IdempotencyKey, &Fingerprint),
        delivered: u64,
        error: &str,
        polled: &mut Polled,
    ) -> Result<(), ConsumeError> {
        let charge_id = charge.0;
        let failures: u64 = self.count_failure(message).await?;
        if failures == 0 {
            tracing::info!(%error, charge = %charge_id, "attempt failed, but the message was acknowledged meanwhile");
            polled.failed += 1;
            return Ok(());
        }
        if failures >= self.max_failures {
            let reason = format!("failed {failures} times (delivery {delivered}): {error}");
            return self
                .dead_letter_charge(message, charge, delivered, &reason, polled)
                .await;
        }
        tracing::warn!(%error, charge = %charge_id, delivered, failures, "attempt failed; will be redelivered");
        polled.failed += 1;
        Ok(())
    }

    /// Counts a failure of `message` if it is still pending; answers the count (0: it was
    /// acknowledged meanwhile).
    async fn count_failure(&mut self, message: &Entry) -> Result<u64, ConsumeError> {
        Ok(COUNT_FAILURE
            .key(&self.stream)
            .key(&self.failures)
            .arg(&self.group)
            .arg(&message.id)
            .invoke_async(&mut self.redis)
            .await?)
    }

    /// A delivery that finds the charge held by another amount's attempt whose lease ran out
    /// unfinished, its record under `scope`: nothing may ever finish it, so the wait counts
    /// as a failure of the message, which is dead-lettered after `max_failures` of them
    /// (naming `scope`, where the record to release is) and deferred until then.
    async fn wait_for_unfinished(
        &mut self,
        message: &Entry,
        delivered: u64,
        charge_id: &str,
        scope: &Scope,
        polled: &mut Polled,
    ) -> Result<(), ConsumeError> {
        let failures = self.count_failure(message).await?;
        if failures >= self.max_failures {
            let reason = unfinished_otherwise_reason(charge_id, failures, scope);
            self.dead_letter(message, delivered, &reason, polled)
                .await?;
        } else {
            polled.deferred += 1;
        }
        Ok(())
    }

    /// Acknowledges a message whose charge is applied (now, or before).
    async fn ack(
        &mut self,
        message: &Entry,
        charge_id: String,
        polled: &mut Polled,
    ) -> Result<(), ConsumeError> {
        if self.crash_before_ack.as_deref() == Some(charge_id.as_str()) {
            return Err(ConsumeError::Crashed(charge_id));
        }
        let (acked, _): (u64, u64) = redis::pipe()
            .xack(&self.stream, &self.group, &[&message.id])
            .hdel(&self.failures, &message.id)
            .query_async(&mut self.redis)
            .await?;
        polled.acked += acked;
        Ok(())
    }

    /// What the records of this charge under the previous scopes say: applied with this
    /// amount under any of them; else, if the store could not tell for one of them, that
    /// (the message waits: that scope may hold it applied); else what the first, in the
    /// order they were given, that holds anything says (a dead-letter decision, another
    /// amount's record, an attempt, a damaged record). Acknowledging an applied charge adds
    /// no effect whatever another scope holds; another scope's record of another amount,
    /// answering first, dead-lettered a message whose own amount was in the ledger.
    async fn under_previous_scope(&self, key: &IdempotencyKey, fp: &Fingerprint) -> Previously {
        let (mut first, mut unknown) = (Previously::Nothing, None);
        for previous in &self.previous_scopes {
            match self.under_scope(previous, key, fp).await {
                Previously::Nothing => {}
                Previously::Applied => return Previously::Applied,
                // A scope that could not be read may hold the charge applied: the message
                // waits, whatever the others say (a dead letter, a failure counted).
                found @ Previously::Unknown(_) => unknown = unknown.or(Some(found)),
                found if matches!(first, Previously::Nothing) => first = found,
                _ => {}
            }
        }
        unknown.unwrap_or(first)
    }

    /// A record under a previous scope completed with this amount: applied, or decided
    /// dead-lettered by an earlier version whose message was not moved yet (its consumer
    /// died between the two), which dead-letters this message too, as under the current
    /// scope: acknowledged as applied, the charge left no ledger row and no dead letter.
    async fn decided_under(&self, previous: &Scope, id: &RecordId, fp: &Fingerprint) -> Previously {
        match self.store.begin(id, fp, Duration::from_secs(30)).await {
            Ok(Begin::Replay(outcome)) => decided(&outcome, previous),
            // Released since the read: nothing holds the charge there any more.
            Ok(Begin::Execute(token) | Begin::TakeOver(token)) => {
                match self.store.release(id, token).await {
                    Ok(()) => Previously::Nothing,
                    Err(error) => Previously::failed(&error, previous),
                }
            }
            // Another attempt took the record since: the next delivery reads it again.
            Ok(Begin::InFlight { .. } | Begin::Mismatch) => Previously::Holding,
            Err(error) => Previously::failed(&error, previous),
        }
    }

    /// What the current `scope` decided of the charge with this amount, if it did: a
    /// dead-letter decision (its stored value, as the main path replays it) or the charge
    /// applied. `None` for anything else (no record, an attempt, another amount, a result
    /// that does not decode, a read that failed): the caller goes on as it would have.
    ///
    /// The result is read by a claim (the operator's view carries none), for a second: a
    /// record released since the view read it is claimed and released at once, and should
    /// that release fail, the key is held for a second, not for a lease of 30 s that would
    /// defer the charge published again after the operator's release.
    async fn decided_here(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fp: &Fingerprint,
    ) -> Option<Previously> {
        let id = RecordId::new(scope, key);
        let record = self.store.inspect(&id).await.ok()??;
        if !matches!(record.state, RecordState::Completed { .. }) || record.fingerprint != *fp {
            return None;
        }
        match self.store.begin(&id, fp, Duration::from_secs(1)).await {
            Ok(Begin::Replay(outcome)) => match stored_decision(&outcome) {
                Ok(Some(value)) => Some(Previously::DeadLettered(value)),
                Ok(None) => Some(Previously::Applied),
                Err(_) => None,
            },
            Ok(Begin::Execute(token) | Begin::TakeOver(token)) => {
                let _ = self.store.release(&id, token).await;
                None
            }
            Ok(Begin::InFlight { .. } | Begin::Mismatch) | Err(_) => None,
        }
    }

    /// What the record of this charge under `previous` says.
    async fn under_scope(
        &self,
        previous: &Scope,
        key: &IdempotencyKey,
        fp: &Fingerprint,
    ) -> Previously {
        let id = RecordId::new(previous, key);
        let found = match self.store.inspect(&id).await {
            Ok(found) => found,
            // A row the operator's view cannot read (its status column, say) may still hold
            // an outcome a claim reads, the charge applied by the earlier version: the claim
            // decides. Read as damaged, an applied charge was dead-lettered, and the docs'
            // way to apply it (release the records, publish again) applied it twice.
            Err(idempotency::Error::Corrupt(_)) => {
                return self.claimed_under(previous, &id, fp, true).await;
            }
            Err(error) => return Previously::failed(&error, previous),
        };
        match found {
            None => Previously::Nothing,
            Some(record) => match record.state {
                RecordState::Completed { .. } if record.fingerprint != *fp => {
                    Previously::OtherAmount(previous.clone())
                }
                RecordState::Completed { .. } => self.decided_under(previous, &id, fp).await,
                RecordState::InFlight { lease_remaining } if !lease_remaining.is_zero() => {
                    Previously::Holding
                }
                _ => self.claimed_under(previous, &id, fp, false).await,
            },
        }
    }

    /// What a claim of the charge's record under `previous` says: a lease that ran out
    /// unfinished (with the transactional completion, it never committed) is fenced by a
    /// takeover (a stalled transaction of it can no longer store its outcome, so it rolls
    /// back), then let go; a record completed since the read (its `complete` landed late)
    /// says what it decided. Another amount's attempt answers `Mismatch`: its worker is gone
    /// and nothing may ever finish it, so each such delivery counts as a failure of the
    /// message, as under the current scope. Another amount's record the operator's view
    /// could not read (`unreadable`) is a completed one: a mismatch.
    async fn claimed_under(
        &self,
        previous: &Scope,
        id: &RecordId,
        fp: &Fingerprint,
        unreadable: bool,
    ) -> Previously {
        match self.store.begin(id, fp, Duration::from_secs(30)).await {
            Ok(Begin::TakeOver(token) | Begin::Execute(token)) => {
                match self.store.release(id, token).await {
                    Ok(()) => Previously::Nothing,
                    Err(error) => Previously::failed(&error, previous),
                }
            }
            Ok(Begin::Replay(outcome)) => decided(&outcome, previous),
            Ok(Begin::InFlight { .. }) => Previously::Holding,
            // The operator's view fails on a live completed row alone (the key table's checks
            // leave it one damage to trip on, a negative status): another amount's charge.
            Ok(Begin::Mismatch) if unreadable => Previously::OtherAmount(previous.clone()),
            Ok(Begin::Mismatch) => Previously::Unfinished(previous.clone()),
            Err(error) => Previously::failed(&error, previous),
        }
    }

    /// What the charge's record says of another amount than `fingerprint`'s: completed with
    /// it (or that record unreadable to the operator's view: completed, see below), or held
    /// by its attempt whose lease ran out unfinished; else `InFlight` (a live lease, the record gone, completed with this amount — a duplicate
    /// of this message won meanwhile: the next delivery replays —, or the store cannot
    /// tell now: the message then waits).
    async fn other_amount(&self, id: &RecordId, fingerprint: &Fingerprint) -> OtherAmount {
        match self.store.inspect(id).await {
            Ok(Some(found)) if found.fingerprint != *fingerprint => match found.state {
                RecordState::Completed { .. } => OtherAmount::Applied,
                RecordState::InFlight { lease_remaining } if lease_remaining.is_zero() => {
                    OtherAmount::Unfinished
                }
                _ => OtherAmount::InFlight,
            },
            // The key table's checks leave the operator's view one damage to trip on, a
            // negative status, and only on a live completed row: another amount's charge.
            // Deferred as in flight, the message waited for ever.
            Err(idempotency::Error::Corrupt(_)) => OtherAmount::Applied,
            _ => OtherAmount::InFlight,
        }
    }

    /// Copies `message` to the dead-letter stream and acknowledges it, atomically, if it is
    /// still pending (so only one consumer copies it); answers whether it did.
    async fn dead_letter(
        &mut self,
        message: &Entry,
        delivered: u64,
        reason: &str,
        polled: &mut Polled,
    ) -> Result<u64, ConsumeError> {
        tracing::error!(id = %message.id, reason, delivered, stream = %self.dead_letter_stream, "dead-lettering message");
        let failures: Option<u64> = self.redis.hget(&self.failures, &message.id).await?;
        let mut invocation = DEAD_LETTER.key(&self.stream);
        invocation
            .key(&self.dead_letter_stream)
            .key(&self.failures)
            .arg(&self.group)
            .arg(&message.id)
            .arg("id")
            .arg(&message.id)
            .arg("reason")
            .arg(reason)
            .arg("deliveries")
            .arg(delivered)
            .arg("failures")
            .arg(failures.unwrap_or(0))
            .arg("group")
            .arg(&self.group)
            .arg("consumer")
            .arg(&self.name);
        // Sorted: the copy's field order does not depend on the message's.
        let mut fields: Vec<&(Vec<u8>, Vec<u8>)> = message.fields.iter().collect();
        fields.sort();
        let omitted = fields.len().saturating_sub(MAX_PAYLOAD_FIELDS);
        for (field, value) in fields.into_iter().take(MAX_PAYLOAD_FIELDS) {
            invocation
                .arg([&b"payload."[..], field].concat())
                .arg(value);
        }
        if omitted > 0 {
            invocation.arg("payload_omitted").arg(omitted);
        }
        let moved: u64 = invocation.invoke_async(&mut self.redis).await?;
        polled.dead_lettered += moved;
        polled.acked += moved;
        Ok(moved)
    }

    /// Dead-letters a message whose charge failed for good, deciding the charge so first: its
    /// key is claimed and the dead letter stored as its result, then the message is moved.
    /// A consumer still holding the message (claimed in a batch it works through), or the
    /// charge published again, then replays the dead letter, and dead-letters its message
    /// too, instead of applying the charge: a charge is applied or dead-lettered, never both.
    /// (Moved first, a lost reply or a dropped poll between the two would leave the message
    /// dead-lettered and its charge free.) While another attempt holds the charge, the
    /// message waits for it; a charge applied meanwhile is acknowledged as a replay. A charge
    /// held by another amount's record (the first of its messages dead-lettered decided it
    /// with its own amount) dead-letters the message as a mismatch, its reason naming both
    /// causes.
    async fn dead_letter_charge(
        &mut self,
        message: &Entry,
        (charge_id, key, fingerprint): (&str, &IdempotencyKey, &Fingerprint),
        delivered: u64,
        reason: &str,
        polled: &mut Polled,
    ) -> Result<(), ConsumeError> {
        let (executor, scope) = (self.executor.clone(), self.scope());
        let dead = format!("{DEAD_LETTERED}{charge_id}: {reason}");
        let decided = executor
            .run(&scope, key, fingerprint, || async {
                Ok::<_, std::convert::Infallible>(dead)
            })
            .await;
        match decided {
            // Decided dead-lettered, now or before: the message goes (once, whoever moves it).
            Ok(done) if done.value.starts_with(DEAD_LETTERED) => {
                if self.crash_before_dead_letter.as_deref() == Some(charge_id) {
                    return Err(ConsumeError::Crashed(charge_id.to_owned()));
                }
                let why = if done.replayed { &done.value } else { reason };
                self.dead_letter(message, delivered, why, polled).await?;
            }
            // Applied meanwhile (another consumer held the message, or a duplicate of it).
            Ok(done) => {
                tracing::warn!(charge = %charge_id, id = %message.id, decided = %done.value, "the charge was applied meanwhile; acknowledging");
                polled.replayed += 1;
                return self.ack(message, charge_id.to_owned(), polled).await;
            }
            // Decided already, with a stored result that no longer decodes (the failure
            // being dead-lettered): nothing to claim, the message goes.
            Err(RunError::Store(idempotency::Error::Corrupt(_))) => {
                self.dead_letter(message, delivered, reason, polled).await?;
            }
            // Another attempt holds the charge: it decides.
            Err(RunError::InFlight { .. } | RunError::LeaseLost) => {
                polled.deferred += 1;
            }
            // Another amount does (another message of the charge applied it, or decided it
            // dead-lettered, since this one last failed): as on the main path. Deferred, a
            // message that fails before it reaches the main path (a damaged record under a
            // previous scope) would stay pending for ever.
            Err(RunError::Mismatch) => {
                let id = RecordId::new(&scope, key);
                match self.other_amount(&id, fingerprint).await {
                    // Both causes named: the failures (one on a damaged record under a
                    // previous scope names that scope), and the record holding the charge.
                    OtherAmount::Applied => {
                        let otherwise = applied_otherwise_reason(charge_id, &scope);
                        let reason = format!("{reason}; then {otherwise}");
                        self.dead_letter(message, delivered, &reason, polled)
                            .await?;
                    }
                    OtherAmount::Unfinished => {
                        self.wait_for_unfinished(message, delivered, charge_id, &scope, polled)
                            .await?;
                    }
                    OtherAmount::InFlight => polled.deferred += 1,
                }
            }
            // The dead letter was not stored (the store failed; it may yet land): the message
            // stays pending, and its next delivery finds the charge decided or free.
            Err(error) => {
                let error = error_chain(&error);
                tracing::warn!(%error, charge = %charge_id, "the idempotency store failed while dead-lettering; will be redelivered");
                polled.failed += 1;
            }
        }
        Ok(())
    }
}

/// Why a message trimmed while pending was dead-lettered. (`XAUTOCLAIM` takes it off the
/// pending list, however briefly it had been pending: the consumer it was delivered to may
/// be applying it right now, or have applied it and died before its `XACK`. Its charge
/// cannot be looked up without its fields.)
const TRIMMED_REASON: &str = "trimmed from the stream while pending (its fields are gone): it \
                              may have been applied by the consumer it was delivered to; look \
                              for its charge in the ledger before publishing it again";

/// `XAUTOCLAIM`, and a dead letter for each message it reports trimmed (deleted from the
/// stream while pending), in one step: it takes those off the pending list and reports them
/// this once. The keys are checked first: a script that fails part-way keeps what it did.
/// (So a dead-letter key of another type stops every poll, not only one that finds a
/// trimmed message: consuming on while dead letters cannot be written would lose them.)
/// KEYS: stream, dead-letter stream, failure counts. ARGV: group, consumer, min idle (ms),
/// start, count, the dead letters' reason. Answers `XAUTOCLAIM`'s reply.
static CLAIM: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
    Script::new(
        r"
for i, kind in ipairs({'stream', 'hash'}) do
    local t = redis.call('TYPE', KEYS[i + 1]).ok
    if t ~= kind and t ~= 'none' then
        return redis.error_reply('WRONGTYPE ' .. KEYS[i + 1] .. ' holds a ' .. t)
    end
end
local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
for _, id in ipairs(reply[3] or {}) do
    local failures = redis.call('HGET', KEYS[3], id) or '0'
    redis.call('XADD', KEYS[2], '*', 'id', id, 'reason', ARGV[6], 'failures', failures,
        'group', ARGV[1], 'consumer', ARGV[2])
    redis.call('HDEL', KEYS[3], id)
end
return reply
",
    )
});

/// Whether a failed run failed for its message's sake, so that another delivery would fail
/// the same way: the ledger refused its data (a data exception, class 22; a constraint, 23;
/// a limit, 54; a validation trigger's error, P0), the effect panicked, or the charge's
/// stored result no longer decodes. Only such failures count toward dead-lettering. Every
/// other failure is the service's (the store or the database unreachable, restarting,
/// read-only after a failover, refusing a rotated password, a table not migrated): a message
/// dead-lettered for it would be acknowledged with its charge never applied.
fn fault_of_the_message(error: &RunError<EffectError>) -> bool {
    match error {
        // Data exception, integrity constraint, a value past a limit (54), an error a
        // validation trigger raised (P0).
        RunError::Failed(EffectError::Database(sqlx::Error::Database(db))) => {
            db.code().is_some_and(|code| {
                ["22", "23", "54", "P0"]
                    .iter()
                    .any(|class| code.starts_with(class))
            })
        }
        // The charge's stored result no longer decodes: every delivery would find it so.
        RunError::Panicked | RunError::Store(idempotency::Error::Corrupt(_)) => true,
        _ => false,
    }
}

/// If the message is still pending: `XADD` the dead letter, then `XACK` it; the message's
/// failure count goes either way. Copied first, so a copy that fails (a stream key of
/// another type) leaves the message pending, not acknowledged with no dead letter. KEYS:
/// stream, dead-letter stream, failure counts. ARGV: group, message id, then the dead
/// letter's fields (few enough for `unpack`: see `MAX_PAYLOAD_FIELDS`).
static DEAD_LETTER: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
    Script::new(
        r"
redis.call('HDEL', KEYS[3], ARGV[2])
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then
    return 0
end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return 1
",
    )
});

/// The most fields of a message a dead letter copies (Redis' Lua `unpack` takes about 8,000
/// values, two a field); the count of those left out is in `payload_omitted`.
const MAX_PAYLOAD_FIELDS: usize = 1_000;

/// Whether Redis said the group (or the stream) does not exist: `NOGROUP`, raised by
/// `XREADGROUP`, or by `XAUTOCLAIM` inside the claim's script.
fn group_is_gone(error: &redis::RedisError) -> bool {
    error.code() == Some("NOGROUP")
}

/// Creates the group (from the stream's start, the stream too if missing) and, only when it
/// created it, deletes the group's failure counts: a group destroyed and created anew starts
/// its deliveries afresh, and must start its failures so. Answers 1 if it created the group,
/// 0 if the group existed. KEYS: stream, failure counts. ARGV: group.
static CREATE_GROUP: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
    Script::new(
        r"
local created = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(created) == 'table' and created.err then
    if string.find(created.err, 'BUSYGROUP', 1, true) then
        return 0
    end
    return redis.error_reply(created.err)
end
redis.call('DEL', KEYS[2])
return 1
",
    )
});

/// Counts a failed attempt of a message, if it is still pending; answers the count (0 if it
/// is not: another consumer acknowledged it, after this attempt failed, and dropped its
/// count, which an increment landing after that would leave behind for ever). A count is
/// never more than the deliveries the pending list counts: a group destroyed and created
/// anew by hand (not by `setup`, which deletes the counts) starts those afresh, and so caps
/// the old group's count (it dead-lettered a charge after one failure in the new one) — but
/// only until deliveries without a failure (deferrals) pass it: delete
/// `<stream>:<group>:failures` when making a group again by hand.
/// KEYS: stream, failure counts. ARGV: group, message id.
static COUNT_FAILURE: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
    Script::new(
        r"
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then
    return 0
end
local count = redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
local deliveries = tonumber(pending[1][4])
if count > deliveries then
    redis.call('HSET', KEYS[2], ARGV[2], deliveries)
    return deliveries
end
return count
",
    )
});

/// The most fields a charge message may have (it needs three).
const MAX_MESSAGE_FIELDS: usize = 1_000;

/// The charge a message names, or why it names none.
fn parse(message: &Entry) -> Result<(String, i64, IdempotencyKey), String> {
    // Bounded first: the checks below cost a step per field, and a message of a million
    // fields (which Redis takes) would hold every consumer of the group in turn.
    if message.fields.len() > MAX_MESSAGE_FIELDS {
        return Err(format!(
            "{} fields, more than a charge message has ({MAX_MESSAGE_FIELDS} at most)",
            message.fields.len()
        ));
    }
    let mut names = std::collections::HashSet::with_capacity(message.fields.len());
    for (name, _) in &message.fields {
        let name = std::str::from_utf8(name).map_err(|_| "a field name is not UTF-8")?;
        if !names.insert(name) {
            return Err(format!("the field {name:?} is given twice"));
        }
    }
    let field = |name: &str| {
        message
            .fields
            .iter()
            .find(|(n, _)| n == name.as_bytes())
            .map(|(_, value)| {
                std::str::from_utf8(value).map_err(|_| format!("{name} is not UTF-8"))
            })
            .transpose()
    };
    let charge_id = field("charge_id")?.ok_or("no charge_id field")?.to_owned();
    let amount = field("amount")?.ok_or("no amount field")?;
    // Digits only: no sign, no spaces, no fraction; and not zero.
    let amount = amount
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| amount.parse::<i64>().ok())
        .flatten()
        .filter(|&amount| amount > 0)
        .ok_or_else(|| format!("the amount is not a positive whole number: {amount:?}"))?;
    let key = IdempotencyKey::new(charge_id.clone())
        .map_err(|e| format!("charge_id is not a valid key: {e}"))?;
    Ok((charge_id, amount, key))
}

/// A stream entry with its fields as bytes.
#[derive(Debug)]
struct Entry {
    id: String,
    fields: Vec<(Vec<u8>, Vec<u8>)>,
}

/// What `XAUTOCLAIM` answered.
struct AutoClaimed {
    next: String,
    entries: Vec<Entry>,
    /// Pending messages no longer in the stream (trimmed), taken off the pending list.
    deleted: Vec<String>,
}

impl AutoClaimed {
    fn from_value(value: &Value) -> redis::RedisResult<Self> {
        let items = array(value).ok_or_else(|| unexpected("XAUTOCLAIM", value))?;
        let [next, entries, rest @ ..] = items else {
            return Err(unexpected("XAUTOCLAIM", value));
        };
        let deleted = match rest.first() {
            Some(ids) => array(ids)
                .ok_or_else(|| unexpected("XAUTOCLAIM", value))?
                .iter()
                .map(|id| text(id).ok_or_else(|| unexpected("XAUTOCLAIM", value)))
                .collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        Ok(Self {
            next: text(next).ok_or_else(|| unexpected("XAUTOCLAIM", value))?,
            entries: entries_of(entries)?,
            deleted,
        })
    }
}

/// The entries of an `XREADGROUP` reply on one stream (nil when none came).
fn read_entries(value: &Value) -> redis::RedisResult<Vec<Entry>> {
    let streams: Vec<&Value> = match value {
        Value::Nil => return Ok(Vec::new()),
        Value::Map(pairs) => pairs.iter().map(|(_, entries)| entries).collect(),
        Value::Array(streams) => streams
            .iter()
            .map(|stream| match array(stream) {
                Some([_name, entries]) => Ok(entries),
                _ => Err(unexpected("XREADGROUP", value)),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(unexpected("XREADGROUP", value)),
    };
    let mut all = Vec::new();
    for entries in streams {
        all.extend(entries_of(entries)?);
    }
    Ok(all)
}

/// `[[id, [field, value, …]], …]`; an entry Redis answers as nil (deleted, before Redis 7)
/// is skipped.
fn entries_of(value: &Value) -> redis::RedisResult<Vec<Entry>> {
    let bad = || unexpected("stream entries", value);
    let mut entries = Vec::new();
    for entry in array(value).ok_or_else(bad)? {
        if let Value::Nil = entry {
            continue;
        }
        let Some([id, fields]) = array(entry) else {
            return Err(bad());
        };
        let fields = match fields {
            Value::Map(pairs) => pairs
                .iter()
                .map(|(name, value)| Some((bytes(name)?, bytes(value)?)))
                .collect::<Option<_>>(),
            fields => array(fields).and_then(|flat| {
                flat.chunks(2)
                    .map(|pair| match pair {
                        [name, value] => Some((bytes(name)?, bytes(value)?)),
                        _ => None,
                    })
                    .collect::<Option<_>>()
            }),
        }
        .ok_or_else(bad)?;
        entries.push(Entry {
            id: text(id).ok_or_else(bad)?,
            fields,
        });
    }
    Ok(entries)
}

fn array(value: &Value) -> Option<&[Value]> {
    match value {
        Value::Array(items) | Value::Set(items) => Some(items),
        _ => None,
    }
}

fn bytes(value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes.clone()),
        Value::SimpleString(text) => Some(text.clone().into_bytes()),
        _ => None,
    }
}

fn text(value: &Value) -> Option<String> {
    String::from_utf8(bytes(value)?).ok()
}

fn unexpected(what: &'static str, value: &Value) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected stream reply",
        format!("{what}: {value:?}"),
    ))
}

/// An error and its sources: `RunError::Failed` says only "failed"; the reason is below it.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        // sqlx's database error shows its source's message too: say it once.
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Publishes one charge message.
pub async fn publish(
    redis: &mut MultiplexedConnection,
    stream: &str,
    charge_id: &str,
    amount: i64,
) -> Result<String, redis::RedisError> {
    redis
        .xadd(
            stream,
            "*",
            &[
                ("charge_id", charge_id.to_owned()),
                ("amount", amount.to_string()),
            ],
        )
        .await
}
