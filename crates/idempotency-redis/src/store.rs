//! `RedisStore`: the record state machine in one Redis string per record, one round trip per
//! operation (a claim that finds a live lease reads its TTL in a second one): plain commands
//! where they suffice, Lua scripts where a write is fenced.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use async_trait::async_trait;
use futures::FutureExt;
use idempotency_core::{
    Begin, Error, Fingerprint, ForceReleased, Inspection, LATE_COMPLETION_GRACE, LeaseToken,
    Outcome, RecordId, ReleaseScope, Result, Store, system_time_from_millis,
};
use redis::{
    Cmd, Pipeline, RedisFuture, Script, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
};

use crate::scripts::{self, FP, OUTCOME};

/// What [`RedisStore::replace_mirror`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replaced {
    /// The outcome replaced the lease's mirror.
    Written,
    /// Nothing written: something else was there (another lease's mirror, now deleted; an
    /// outcome, left), or the copy was past its deadline (the mirror deleted).
    Not,
    /// Nothing written: the key was empty.
    Absent,
}

/// What the read-only [`RedisStore::peek`] finds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Peek {
    /// Nothing that answers by itself: no record (never written, expired, evicted or
    /// flushed), a lease that is over, a cancel marker, or another request's mirror (Postgres
    /// decides).
    Absent,
    /// A record that answers `begin` by itself: `Replay`, `InFlight` or `Mismatch`.
    Found(Begin),
}

/// Connection to a standalone Redis or a cluster, both cheap to clone.
#[derive(Clone)]
enum Conn {
    /// The application's own connection ([`RedisStore::from_connection_manager`]), kept as
    /// it is: its reconnects are the application's.
    Single(ConnectionManager),
    /// The store's own connection to a standalone Redis, replaced when it is found on a
    /// replica.
    Own(Arc<Own>),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

/// The store's own connection to a standalone Redis. The client library keeps a connection
/// whose server answers `READONLY`, an error it takes for recoverable: after a failover whose
/// old primary kept this connection (a proxy that keeps its sessions, a managed failover, an
/// operator's `REPLICAOF`, or a reconnect made before the DNS name moved), every write would
/// be refused there until the process restarted — every claim `Unavailable`, and the
/// operations running could neither renew nor store their outcomes. So the connection that
/// answered `READONLY` is replaced (once a second at most: a new one that lands on the
/// demoted node again is replaced at the next second). Commands already sent on it finish
/// there; a replica runs no write, so none of them lands late.
struct Own {
    current: std::sync::Mutex<Current>,
    client: redis::Client,
    config: ConnectionManagerConfig,
}

/// The connection [`Own`] hands out now.
struct Current {
    conn: ConnectionManager,
    /// Bumped by each replacement: only the connection that answered `READONLY` is replaced.
    generation: u64,
    /// When it replaced the one before (`None`: the first).
    made: Option<std::time::Instant>,
}

impl Own {
    fn new(client: redis::Client, config: ConnectionManagerConfig) -> Result<Self> {
        let first = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(Error::unavailable)?;
        Ok(Self {
            current: std::sync::Mutex::new(Current {
                conn: first,
                generation: 0,
                made: None,
            }),
            client,
            config,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Current> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn connection(&self) -> (ConnectionManager, u64) {
        let current = self.lock();
        (current.conn.clone(), current.generation)
    }

    /// Replaces connection `generation`, which answered `READONLY`, unless it was replaced
    /// already or the current one is less than a second old.
    fn on_replica(&self, generation: u64) {
        let mut current = self.lock();
        let young = current
            .made
            .is_some_and(|made| made.elapsed() < std::time::Duration::from_secs(1));
        if current.generation != generation || young {
            return;
        }
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone()) {
            Ok(fresh) => {
                tracing::warn!(
                    "Redis answered READONLY (a replica: a failover?); connecting again"
                );
                *current = Current {
                    conn: fresh,
                    generation: generation + 1,
                    made: Some(std::time::Instant::now()),
                };
            }
            Err(error) => {
                tracing::warn!(%error, "could not replace a connection to a Redis replica");
            }
        }
    }

    /// Runs `call` on the current connection; a `READONLY` answer (`replica` says which
    /// replies are one) replaces it.
    fn run<'a, T: Send + 'a, F>(
        self: &Arc<Self>,
        call: impl FnOnce(ConnectionManager) -> F + Send + 'a,
        replica: fn(&T) -> bool,
    ) -> RedisFuture<'a, T>
    where
        F: Future<Output = redis::RedisResult<T>> + Send + 'a,
    {
        let (this, (conn, generation)) = (self.clone(), self.connection());
        Box::pin(async move {
            let answer = call(conn).await;
            let refused = match &answer {
                Ok(reply) => replica(reply),
                Err(error) => error.code() == Some("READONLY"),
            };
            if refused {
                this.on_replica(generation);
            }
            answer
        })
    }
}

/// Whether a reply is a replica's refusal of a write (a server's error is a reply here; the
/// caller's conversion makes it an `Err`).
fn readonly(reply: &Value) -> bool {
    matches!(reply, Value::ServerError(error) if error.code() == "READONLY")
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Own(own) => own.run(
                move |mut c| async move { c.send_packed_command(cmd).await },
                readonly,
            ),
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Own(own) => own.run(
                move |mut c| async move { c.send_packed_commands(pipeline, offset, count).await },
                |replies| replies.iter().any(readonly),
            ),
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Own(own) => own.connection().0.get_db(),
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

struct Scripts {
    takeover: Script,
    legacy_begin: Script,
    cancel: Script,
    complete: Script,
    cache_completed: Script,
    replace_mirror: Script,
    release: Script,
    renew: Script,
    inspect: Script,
    force_release: Script,
    clock: Script,
    read_with_ttl: Script,
}

/// How many call budgets after its sending an outcome's copy may land (see
/// [`RedisStore::cache_completed`]).
const COPY_DEADLINE_BUDGETS: u32 = 4;

/// A [`Store`] on Redis: the fast path.
///
/// Every operation is atomic and, but for a claim that finds a live lease (which reads the
/// lease's TTL in a second round trip), one round trip: a claim is a plain `SET NX GET`, the
/// token-fenced writes are Lua scripts (see the layout in
/// `scripts.rs`). Lease and retention are key TTLs counted by Redis. Calls are bounded by a
/// connect timeout and a hard budget per call, so a hung Redis costs at most the budget and
/// then [`Error::Unavailable`].
///
/// **Redis alone is not a guarantee.** An evicted, flushed or lost key is a forgotten record,
/// and the next retry executes again. [`RedisStoreBuilder::connect`] therefore refuses a Redis
/// whose `maxmemory-policy` evicts (anything but `noeviction`) unless told to accept it (read
/// with `CONFIG GET`, or from `INFO memory` on a server that refuses `CONFIG`, as managed
/// Redis often does; one that says it in neither cannot be checked: the store starts with a
/// warning, and the policy is yours to check). The policy is read at connect only: one
/// changed later is not seen. Persistence/failover loss remains. For money, put Postgres
/// behind it (the hybrid store).
///
/// ```no_run
/// use std::time::Duration;
/// use idempotency_redis::RedisStore;
///
/// # async fn run() -> Result<(), idempotency_core::Error> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379/")
///     .prefix("payments")
///     .call_budget(Duration::from_millis(250))
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: Arc<str>,
    budget: Duration,
    scripts: Arc<Scripts>,
    /// Writes left running in the background (shared by clones): see [`Store::drain`].
    settling: tokio_util::task::TaskTracker,
    /// The runtime the store was made on: a claim's cancel runs there too, for the caller's
    /// may be shutting down (see [`cancel_later`](Self::cancel_later)).
    home: Option<tokio::runtime::Handle>,
    /// Shared by clones: while Redis refuses cancels, one of them probes at a time; while a
    /// direct connection hangs, a few cancels retry at once.
    cancels: Arc<CancelGate>,
}

/// The store's turns for cancels Redis refuses as it refuses writes (`NOREPLICAS`,
/// `MISCONF`, `LOADING`, ...: a shard that cannot write, on a cluster or a direct
/// connection): one such cancel probes at a time, with backoff (from 50 ms, doubling up to
/// 5 s); the others wait. Every claim given up owes a cancel, so cancels retrying on their
/// own made the writes into a Redis that refuses them grow with every claim refused (64
/// claims refused for two seconds: 401 scripts refused). Only a cancel refused that way
/// waits its turn: one on a shard that takes writes (a cluster with one shard refusing), or
/// failed another way (a timeout), retries on its own as before. A probe that lands lets
/// every waiting cancel try when its wait ends: within the probe's hold (at most 5 s) and
/// a second, spread over that second so that they do not reach Redis as one burst. No
/// lock is held across an await: a probe dropped mid-call, or on a runtime no longer driven,
/// holds the turn for its budget (at most 5 s), not for ever. It also keeps the places of
/// the cancels retrying on a direct connection that hangs ([`CancelGate::retry`]).
///
/// The turns are the store's, not a shard's (the store does not know which node refused):
/// with two shards refusing, a probe that lands on one lets the other's cancels try too,
/// and one that recovered may not get a turn soon among the other's many. So a waiting
/// cancel also tries on its own every one to two minutes ([`own_try_after`], spread by its
/// token so that a burst of them does not write in step): a shard's cancels land within two
/// minutes of it taking writes again, and a shard that refuses is sent about one cancel a
/// second for every ninety it is owed (before: one for every five), besides the probes.
#[derive(Debug)]
struct CancelGate(std::sync::Mutex<Turns>);

#[derive(Debug)]
struct Turns {
    /// A cancel was refused, and no probe has landed since.
    refusing: bool,
    /// No probe starts before this.
    next: tokio::time::Instant,
    backoff: Duration,
    /// The last cancel tried on a direct connection got no answer (see
    /// [`CancelGate::retry`]).
    hung: bool,
    /// When each retry in flight on a direct connection while it hangs ends at the latest;
    /// one in the past is free.
    retries: [tokio::time::Instant; CANCEL_RETRIES_IN_FLIGHT],
}

/// Whose turn it is for a cancel that Redis refused.
enum Turn {
    /// Nothing is refused now: try.
    Free,
    /// This cancel is the probe: try, and say how it went ([`CancelGate::probed`]).
    Probe,
    /// Another probe's: wait until then, and ask again.
    Wait(tokio::time::Instant),
}

impl Default for CancelGate {
    fn default() -> Self {
        let now = tokio::time::Instant::now();
        Self(std::sync::Mutex::new(Turns {
            refusing: false,
            next: now,
            backoff: FIRST_CANCEL_BACKOFF,
            hung: false,
            retries: [now; CANCEL_RETRIES_IN_FLIGHT],
        }))
    }
}

impl CancelGate {
    fn turns(&self) -> std::sync::MutexGuard<'_, Turns> {
        // Nothing panics while it is held; a poisoned one is still consistent.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A cancel (or the claim that owes one) was refused as Redis refuses writes.
    fn refused(&self) {
        let mut turns = self.turns();
        if !turns.refusing {
            turns.refusing = true;
            turns.next = tokio::time::Instant::now() + turns.backoff;
        }
    }

    /// The turn of a cancel that was refused; a probe holds it for `budget` (its answer).
    fn turn(&self, budget: Duration) -> Turn {
        let mut turns = self.turns();
        let now = tokio::time::Instant::now();
        if !turns.refusing {
            Turn::Free
        } else if now >= turns.next {
            // Nobody asked for a turn since well past the last one: that refusal ended
            // without a probe seeing it (its cancels landed on their own tries, or gave up).
            if now > turns.next + MAX_CANCEL_BACKOFF {
                turns.backoff = FIRST_CANCEL_BACKOFF;
            }
            turns.next = now + budget.min(MAX_CANCEL_BACKOFF);
            Turn::Probe
        } else {
            Turn::Wait(turns.next)
        }
    }

    /// How the probe went: landed, every cancel may try; refused, the next probe waits
    /// longer. (Failed another way, the next probe waits for this one's hold.)
    fn probed(&self, landed: bool, refused: bool) {
        let mut turns = self.turns();
        if landed {
            turns.refusing = false;
            turns.backoff = FIRST_CANCEL_BACKOFF;
        } else if refused {
            turns.next = tokio::time::Instant::now() + turns.backoff;
            turns.backoff = (turns.backoff * 2).min(MAX_CANCEL_BACKOFF);
        }
    }

    /// Whether one more cancel may retry on a direct connection now. Replies on one
    /// connection come in order, so while one call hangs every call behind it does (a hung
    /// Redis, or a shard that hangs behind a proxy): cancels retrying on their own there sent
    /// a script per cancel per try into it, growing with every claim given up (256 claims
    /// given up for six seconds: 2,304 cancel scripts run when it resumed). So while
    /// the last cancel tried got no answer, at most [`CANCEL_RETRIES_IN_FLIGHT`] retry at
    /// once, each place held for `hold` (its budget, at most 5 s) at most; a retry that finds
    /// none skips its try and backs off. Once one is answered, they all go again, so that
    /// the cancels owed after a hang drain at Redis' pace. Held by time, not by a guard: a
    /// retry dropped mid-call, or on a runtime no longer driven, frees its place when its
    /// hold ends.
    fn retry(&self, hold: Duration) -> Retry {
        let mut turns = self.turns();
        if !turns.hung {
            return Retry::Go;
        }
        let now = tokio::time::Instant::now();
        let Some((slot, until)) = turns
            .retries
            .iter_mut()
            .enumerate()
            .find(|(_, until)| **until <= now)
        else {
            return Retry::Full;
        };
        *until = now + hold.min(MAX_CANCEL_BACKOFF);
        Retry::Placed(RetryPlace {
            slot,
            until: *until,
        })
    }

    /// The retry in `place` ended: its place is free (unless its hold ended and another
    /// took it).
    fn retried(&self, place: RetryPlace) {
        let mut turns = self.turns();
        if turns.retries[place.slot] == place.until {
            turns.retries[place.slot] = tokio::time::Instant::now();
        }
    }

    /// How a cancel's try on a direct connection went: `answered` (the script ran, or Redis
    /// refused it as it refuses writes: see [`answered`]), or not (no answer in its budget, a
    /// broken connection, another error reply).
    fn tried(&self, answered: bool) {
        self.turns().hung = !answered;
    }
}

/// What a cancel's retry on a direct connection may do ([`CancelGate::retry`]).
enum Retry {
    /// Redis answers: go.
    Go,
    /// Go, in this place; give it back when the call ends ([`CancelGate::retried`]).
    Placed(RetryPlace),
    /// Every place is taken: skip this try.
    Full,
}

/// A place taken by [`CancelGate::retry`].
#[derive(Debug, Clone, Copy)]
struct RetryPlace {
    slot: usize,
    until: tokio::time::Instant,
}

/// How many cancels retry at once on a direct connection that hangs (see
/// [`CancelGate::retry`]).
const CANCEL_RETRIES_IN_FLIGHT: usize = 4;
const FIRST_CANCEL_BACKOFF: Duration = Duration::from_millis(50);
const MAX_CANCEL_BACKOFF: Duration = Duration::from_secs(5);
/// How long after its last try a cancel waiting for the store's turn tries on its own (see
/// [`CancelGate`]): one to two minutes, spread by its token.
fn own_try_after(token: LeaseToken) -> Duration {
    Duration::from_secs(60) + spread(token, Duration::from_secs(60))
}

/// A share of `over` that `token` (random) picks: cancels waiting together wake spread over
/// it rather than in step (a burst of scripts on the connection live claims share).
fn spread(token: LeaseToken, over: Duration) -> Duration {
    let millis = over.as_millis().max(1);
    Duration::from_millis(u64::try_from(token.as_uuid().as_u128() % millis).unwrap_or(0))
}

/// A cancel's backoff, spread by its token over half to one and a half times it: cancels
/// given up together otherwise retry in step, every round (and on a direct connection that
/// hangs, where a few retry at a time, all but those few would skip every round together).
fn jittered(backoff: Duration, token: LeaseToken) -> Duration {
    backoff / 2 + spread(token, backoff)
}

/// Whether Redis itself answered a cancel: the script ran, or Redis refused it as it refuses
/// writes (see [`CancelGate`]). Not a timeout or a broken connection, nor another error
/// reply: a proxy in front of a shard that hangs answers with its own error (`ERR upstream
/// timed out`) while the scripts written to that shard still run when it resumes. (On a
/// Redis that answers, a place is held a round trip: counting one of its errors as no
/// answer costs nothing.)
fn answered<T>(result: &Result<T>) -> bool {
    match result {
        Ok(_) => true,
        Err(error) => refused_write(error),
    }
}

/// Whether a call failed because Redis refuses writes for now (see [`refuses_writes`]).
fn refused_write(error: &Error) -> bool {
    matches!(error, Error::Unavailable(source)
        if source.downcast_ref::<redis::RedisError>().is_some_and(refuses_writes))
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

/// What to do about a Redis whose `maxmemory-policy` may evict records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionCheck {
    /// Refuse to start (the default for a Redis-only store).
    Refuse,
    /// Log a warning and start: the caller accepts that evicted records execute again.
    Warn,
    /// Do not check (the hybrid store, where Postgres decides and eviction costs latency only).
    /// Nothing is asked of Redis at connect then, not even its version, which the other two
    /// check too (the Redis store needs 7.0 or later).
    Skip,
}

/// A connection the application made itself (see [`RedisStore::from_connection_manager`]).
#[derive(Clone)]
struct Given(Conn);

impl std::fmt::Debug for Given {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Given(..)")
    }
}

/// A Redis Cluster node's response timeout unless one is set
/// ([`RedisStoreBuilder::response_timeout`]).
#[cfg(feature = "cluster")]
const CLUSTER_RESPONSE_TIMEOUT: Duration = Duration::from_millis(250);

/// Configures and connects a [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    urls: Vec<String>,
    cluster: bool,
    given: Option<Given>,
    prefix: String,
    connect_timeout: Duration,
    response_timeout: Option<Duration>,
    budget: Duration,
    eviction: EvictionCheck,
    dead_after: Duration,
    /// PEM root certificates for `rediss://` (none: the system's).
    #[cfg(feature = "tls-rustls")]
    tls_roots: Option<Vec<u8>>,
}

impl RedisStoreBuilder {
    /// Key prefix (default `idem`). Keys are `{prefix}:{<record id hex>}`.
    ///
    /// One prefix per key space: stores on one Redis with one prefix share their records.
    /// Two services (or staging and production) that use the same scope names — the default
    /// scope is one for everyone — answer each other's keys: a key a client sent to both
    /// is in flight or "reused" (409, 422) at the second, or replays the first's outcome
    /// where the fingerprints match. Give each key space its own prefix (`payments`,
    /// `orders`, `staging-payments`). On a cluster the prefix has no `{` (refused by
    /// `connect` with [`Error::Config`]): a record's keys share a slot by the store's own hash
    /// tag, which must be each key's first.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// TCP connect timeout (default 250 ms).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// A response timeout per command, inside each call's budget. Default: none for a single
    /// Redis — every call is bounded by [`call_budget`](Self::call_budget) already, and a
    /// second timer per command cost about a tenth of a first request's time in the store —
    /// and 250 ms for a Redis Cluster, whose client gives up on a node with it.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = Some(timeout);
        self
    }

    /// Ends a connection whose data has gone unacknowledged by Redis's host for `timeout`
    /// (`TCP_USER_TIMEOUT`, Linux; idle connections are probed by TCP keepalive), so that
    /// redis-rs reconnects. Off by default (zero): TCP's own limit, about 15 minutes, applies.
    ///
    /// **What it cures.** A server gone without a reset (a failover behind a virtual IP, a
    /// NAT that dropped the flow) leaves the connection open and silent: redis-rs reconnects
    /// on an error it sees, and a call given up by its budget shows none. Until TCP gives up,
    /// every call runs out of budget, and the operations running meanwhile cannot renew their
    /// leases (a hybrid store serves from Postgres alone meanwhile).
    ///
    /// **What it costs, and why it is off by default.** The kernel also ends a connection to
    /// a Redis that is alive but stopped (paused, blocked by a long command, swapping) once
    /// its receive buffer is full. The commands Redis had already accepted on it then run
    /// when Redis resumes, interleaved with those sent on the new connection. The Redis
    /// store's own writes are safe against that (a claim is cancelled twice, every other write
    /// is fenced by its token), but a [hybrid store's](https://docs.rs/idempotency-hybrid)
    /// copies and its repairs of them rely on one connection's order: a copy deleted by an
    /// operator's release could land again and replay the deleted record. Turn it on for a
    /// Redis-only store on a network where hosts vanish.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_redis::RedisStore;
    ///
    /// let builder = RedisStore::builder("redis://127.0.0.1:6379/")
    ///     .dead_connection_after(Duration::from_secs(5));
    /// ```
    pub fn dead_connection_after(mut self, timeout: Duration) -> Self {
        self.dead_after = timeout;
        self
    }

    /// The hard budget of one store call, reconnects included (default 500 ms). A hung Redis
    /// costs each call its whole budget (a hybrid store's breaker opens after three such
    /// failures): lower it for a faster fallback. At most a day.
    pub fn call_budget(mut self, budget: Duration) -> Self {
        // At most a day (`Duration::MAX` for "no limit" is a day): the deadlines and sums of
        // budgets built on it stay far from overflowing.
        self.budget = budget.min(Duration::from_secs(86_400));
        self
    }

    /// What to do when `maxmemory-policy` evicts (default [`EvictionCheck::Refuse`]).
    pub fn eviction_check(mut self, check: EvictionCheck) -> Self {
        self.eviction = check;
        self
    }

    /// Trusts these root certificates (PEM, one or more) for a `rediss://` URL instead of
    /// the system's: the private CA of a managed Redis. The server's certificate must name
    /// the URL's host. Needs the `tls-rustls` feature; a `redis://` URL with roots given is
    /// refused at [`connect`](Self::connect) (the roots would protect nothing).
    ///
    /// ```no_run
    /// use idempotency_redis::RedisStore;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let ca = std::fs::read("/etc/ssl/redis-ca.pem")?;
    /// let store = RedisStore::builder("rediss://redis.internal:6380/")
    ///     .tls_root_certificates(ca)
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tls-rustls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls-rustls")))]
    pub fn tls_root_certificates(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_roots = Some(pem.into());
        self
    }

    /// Refuses URLs whose TLS would not be what it looks like: `rediss://` without the TLS
    /// feature, `#insecure` (no certificate check), roots given for a URL without TLS.
    /// Installs the ring crypto provider for `rediss://` unless the application installed
    /// one first (rustls needs one per process; install yours before connecting).
    fn check_tls(&self) -> Result<()> {
        let tls = self.urls.iter().any(|u| u.starts_with("rediss://"));
        if self.urls.iter().any(|u| u.contains("#insecure")) {
            return Err(Error::Config(
                "a Redis URL with #insecure turns certificate checks off: not accepted".into(),
            ));
        }
        #[cfg(feature = "tls-rustls")]
        {
            if self.tls_roots.is_some() && !tls {
                return Err(Error::Config(
                    "TLS root certificates were given for a URL without TLS: use rediss://".into(),
                ));
            }
            if tls {
                let _ = rustls::crypto::ring::default_provider().install_default();
            }
        }
        if tls && !cfg!(feature = "tls-rustls") {
            return Err(Error::Config(
                "a rediss:// URL needs the `tls-rustls` feature of idempotency-redis".into(),
            ));
        }
        Ok(())
    }

    /// A client for the first URL, with the given TLS roots if any.
    fn client(&self) -> Result<redis::Client> {
        self.check_tls()?;
        let invalid = |e: redis::RedisError| Error::Config(format!("invalid Redis URL: {e}"));
        let info = redis::IntoConnectionInfo::into_connection_info(self.urls[0].as_str())
            .map_err(invalid)?;
        let tcp = dead_connection_settings(info.tcp_settings().clone(), self.dead_after);
        let info = info.set_tcp_settings(tcp);
        #[cfg(feature = "tls-rustls")]
        if let Some(pem) = &self.tls_roots {
            let certificates = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            };
            return redis::Client::build_with_tls(info, certificates).map_err(invalid);
        }
        redis::Client::open(info).map_err(invalid)
    }

    /// Connects (lazily for a standalone Redis, so the store can start while Redis is down
    /// when the eviction check is skipped), then checks the eviction policy. With the check
    /// on, a Redis that cannot be reached — down, or refusing the TLS handshake — is
    /// [`Error::Unavailable`]: nothing was checked. A server that refuses `CONFIG` (managed
    /// Redis often does) is judged by the policy its `INFO memory` names, and is only a
    /// warning when that does not name one either.
    pub async fn connect(self) -> Result<RedisStore> {
        // A record's keys (the record, its takeover's tombstone, an operator's receipt) share
        // a cluster slot by the hash tag `{record id}`, which must be each key's first: a
        // prefix's own `{}` (hashing the whole key) put them in other slots, and every
        // takeover, cancel and release failed with `CROSSSLOT`.
        let cluster = self.cluster
            || matches!(&self.given, Some(Given(c)) if !matches!(c, Conn::Single(_) | Conn::Own(_)));
        if cluster && self.prefix.contains('{') {
            return Err(Error::Config(format!(
                "the Redis key prefix {:?} contains '{{': on a cluster the store's own hash tag \
                 must be the first in each key",
                self.prefix
            )));
        }
        let conn = if let Some(Given(conn)) = self.given.clone() {
            conn
        } else if self.cluster {
            self.connect_cluster().await?
        } else {
            let client = self.client()?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(self.connect_timeout))
                .set_response_timeout(self.response_timeout)
                // Reconnects happen on the next call; a call never sleeps through retries
                // longer than its budget allows.
                .set_number_of_retries(1)
                .set_max_delay(self.connect_timeout);
            Conn::Own(Arc::new(Own::new(client, config)?))
        };
        let store = RedisStore {
            conn,
            prefix: self.prefix.into(),
            budget: self.budget,
            scripts: Arc::new(Scripts {
                takeover: scripts::takeover(),
                legacy_begin: scripts::legacy_begin(),
                cancel: scripts::cancel(),
                complete: scripts::complete(),
                cache_completed: scripts::cache_completed(),
                replace_mirror: scripts::replace_mirror(),
                release: scripts::release(),
                renew: scripts::renew(),
                inspect: scripts::inspect(),
                force_release: scripts::force_release(),
                clock: scripts::clock(),
                read_with_ttl: scripts::read_with_ttl(),
            }),
            settling: tokio_util::task::TaskTracker::new(),
            home: tokio::runtime::Handle::try_current().ok(),
            cancels: Arc::default(),
        };
        match self.eviction {
            EvictionCheck::Skip => {}
            check => {
                store.check_eviction_policy(check).await?;
                store.check_version().await?;
            }
        }
        Ok(store)
    }

    #[cfg(feature = "cluster")]
    async fn connect_cluster(&self) -> Result<Conn> {
        self.check_tls()?;
        let builder = redis::cluster::ClusterClient::builder(self.urls.clone())
            .connection_timeout(self.connect_timeout)
            .response_timeout(self.response_timeout.unwrap_or(CLUSTER_RESPONSE_TIMEOUT))
            .tcp_settings(dead_connection_settings(
                redis::io::tcp::TcpSettings::default(),
                self.dead_after,
            ))
            .retries(1);
        #[cfg(feature = "tls-rustls")]
        let builder = {
            match &self.tls_roots {
                Some(pem) => builder.certs(redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                }),
                None => builder,
            }
        };
        let client = builder
            .build()
            .map_err(|e| Error::Config(format!("invalid Redis Cluster nodes: {e}")))?;
        let conn = tokio::time::timeout(self.budget * 4, client.get_async_connection())
            .await
            .map_err(|_| Error::unavailable("Redis Cluster did not answer"))?
            .map_err(Error::unavailable)?;
        Ok(Conn::Cluster(conn))
    }

    #[cfg(not(feature = "cluster"))]
    async fn connect_cluster(&self) -> Result<Conn> {
        Err(Error::Config(
            "Redis Cluster needs the `cluster` feature of idempotency-redis".into(),
        ))
    }
}

/// The value of a one-parameter `CONFIG GET` reply: an array `[name, value]` (RESP2) or a
/// map `{name: value}` (RESP3).
fn config_value(reply: &Value) -> Option<String> {
    let text = |v: &Value| match v {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    };
    match reply {
        Value::Array(items) if items.len() == 2 => text(&items[1]),
        Value::Map(pairs) if pairs.len() == 1 => text(&pairs[0].1),
        _ => None,
    }
}

/// A lease or TTL in milliseconds for `PX`, at least 1 and capped at
/// [`FOR_GOOD`](idempotency_core::FOR_GOOD): Redis refuses an expiry past its range.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.min(idempotency_core::FOR_GOOD).as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A lease in milliseconds, zero included (a lease that ends now), capped like [`millis`].
/// Only for a TTL that adds the grace to it: `PX` refuses zero.
fn lease_millis(d: Duration) -> u64 {
    u64::try_from(d.min(idempotency_core::FOR_GOOD).as_millis()).unwrap_or(u64::MAX)
}

fn grace() -> u64 {
    millis(idempotency_core::LATE_COMPLETION_GRACE)
}

fn grace_ms() -> String {
    grace().to_string()
}

/// A claim [`RedisStore::begin`] may stop waiting for: its caller went away, its budget ran
/// out, or it panicked. Dropped armed, it cancels the claim in a task of its own, tracked for
/// `drain` — whether the claim has landed yet or not (see `scripts::cancel`): a lease it
/// granted is deleted, or the late `SET NX` finds the cancel marker (see
/// [`RedisStore::cancel_later`] for the second cancel that may follow). Nothing is boxed and
/// no task is made while the caller waits.
struct Unanswered<'a> {
    store: &'a RedisStore,
    id: RecordId,
    token: LeaseToken,
    armed: bool,
    /// Set by the claim once Redis refused its `SET` unrun: it wrote nothing, so nothing is
    /// cancelled however the reads after it end (a cancel into a full Redis would write its
    /// marker there; into a read-only one it would be retried for an hour, `drain` with it).
    unrun: &'a AtomicBool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.armed || self.unrun.load(Ordering::Relaxed) {
            return;
        }
        self.store.cancel_later(&self.id, self.token, false);
    }
}

/// `tcp` with a connection ended after `after` unacknowledged, and idle ones probed from
/// half of it on (one lost probe is not a dead connection); zero leaves `tcp` as it is.
fn dead_connection_settings(
    tcp: redis::io::tcp::TcpSettings,
    after: Duration,
) -> redis::io::tcp::TcpSettings {
    if after.is_zero() {
        return tcp;
    }
    let keepalive = redis::io::tcp::socket2::TcpKeepalive::new()
        // Both in whole seconds to the kernel, which refuses zero.
        .with_time((after / 2).max(Duration::from_secs(1)))
        .with_interval((after / 8).max(Duration::from_secs(1)));
    let tcp = tcp.set_keepalive(keepalive);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let tcp = tcp.set_user_timeout(after);
    tcp
}

/// A lease token as the layout stores it (16 bytes), and as the legacy hash did (text, the
/// hyphenated form `Display` writes), both on the stack.
fn token_forms(token: LeaseToken) -> ([u8; 16], [u8; 36]) {
    let mut text = [0u8; 36];
    token.as_uuid().hyphenated().encode_lower(&mut text);
    (*token.as_uuid().as_bytes(), text)
}

/// `call` within `budget`: [`by`] a deadline `budget` from now.
fn within<T>(
    budget: Duration,
    call: impl Future<Output = redis::RedisResult<T>>,
) -> impl Future<Output = Result<T>> {
    by(tokio::time::Instant::now() + budget, call)
}

/// `call` by `deadline`; a Redis error or no answer in time is `Unavailable`. Not an
/// `async fn`: that would hold `call` twice (its argument and the timeout around it).
fn by<T>(
    deadline: tokio::time::Instant,
    call: impl Future<Output = redis::RedisResult<T>>,
) -> impl Future<Output = Result<T>> {
    tokio::time::timeout_at(deadline, call).map(|answer| match answer {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(Error::unavailable(error)),
        Err(_) => Err(Error::unavailable(
            "Redis did not answer within the call's budget",
        )),
    })
}

/// Whether Redis refused a command without running it, on a connection that does not resend.
fn refused_unrun(conn: &Conn, error: &redis::RedisError) -> bool {
    matches!(conn, Conn::Single(_) | Conn::Own(_)) && refuses_writes(error)
}

/// Whether Redis answered that it runs no write for now (full, read-only, no replicas to
/// write to, a failed save, loading, a script running).
fn refuses_writes(error: &redis::RedisError) -> bool {
    matches!(
        error.code(),
        Some("OOM" | "READONLY" | "NOREPLICAS" | "MISCONF" | "LOADING" | "BUSY")
    )
}

/// Whether a command met a record of the earlier (hash) layout.
fn wrong_type(error: &redis::RedisError) -> bool {
    error.code() == Some("WRONGTYPE")
        || error
            .clone()
            .into_server_errors()
            .is_some_and(|errors| errors.iter().any(|(_, e)| e.code() == "WRONGTYPE"))
}

/// What a record found by a claim says.
enum Found {
    Answer(Begin),
    /// A lease that is over, or another claim's cancel marker: take it over.
    Free,
    /// This very claim's cancel marker: it ran after it was given up.
    Cancelled,
    /// This very claim's lease: its `SET` (or takeover) had landed already — a client that
    /// sent it twice, as a cluster connection retrying a request that timed out does.
    /// `took`: it took an unfinished lease over.
    Ours {
        took: bool,
    },
}

/// Whether `value` is the lease of `token` (current layout), and if so whether that lease
/// took an unfinished one over.
fn own_lease(value: &[u8], token: &[u8; 16]) -> Option<bool> {
    let own =
        value.len() >= scripts::OUTCOME && value[0] == b'0' && value[scripts::TOKEN] == token[..];
    own.then(|| value.get(scripts::OUTCOME) == Some(&b't'))
}

/// Reads a record of the current layout (`value`, with `pttl` ms left) for a claim with
/// fingerprint `fp` and token `token`.
fn read_record(value: &[u8], pttl: i64, fp: &Fingerprint, token: &[u8; 16]) -> Result<Found> {
    if value.len() < scripts::OUTCOME {
        return Err(Error::Corrupt("a record shorter than its header".into()));
    }
    let same_fp = value[scripts::FP] == fp.as_bytes()[..];
    let left = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0).max(1));
    // Gone (or expiring) between reading the value and its TTL: free.
    if pttl < 0 && pttl != -1 {
        return Ok(Found::Free);
    }
    Ok(match value[0] {
        b'c' if value[scripts::TOKEN] == token[..] => Found::Cancelled,
        b'c' => Found::Free,
        b'0' if let Some(took) = own_lease(value, token) => Found::Ours { took },
        b'0' => {
            let lease_left = pttl - i64::try_from(grace()).unwrap_or(i64::MAX);
            // Over, but unfinished: taken over by the same request only (another request
            // under this key must not inherit its unknown outcome).
            if pttl != -1 && lease_left <= 0 && same_fp {
                Found::Free
            } else if !same_fp {
                Found::Answer(Begin::Mismatch)
            } else {
                Found::Answer(Begin::InFlight {
                    retry_after: left(lease_left),
                })
            }
        }
        _ if !same_fp => Found::Answer(Begin::Mismatch),
        b'm' => Found::Answer(Begin::InFlight {
            retry_after: left(pttl),
        }),
        b'1' => Found::Answer(Begin::Replay(decode_outcome(&value[scripts::OUTCOME..])?)),
        _ => return Err(Error::Corrupt("a record in an unknown state".into())),
    })
}

/// The answer of a claim that finds its own lease.
fn ours(took: bool, token: LeaseToken) -> Begin {
    if took {
        Begin::TakeOver(token)
    } else {
        Begin::Execute(token)
    }
}

fn decode_outcome(bytes: &[u8]) -> Result<Outcome> {
    Outcome::decode(bytes).map_err(|e| Error::Corrupt(e.to_string()))
}

/// Parses the begin script's `{'x'}` / `{'r', out}` / `{'i', pttl}` / `{'m'}` replies.
fn parse_begin(value: Value, token: LeaseToken) -> Result<Begin> {
    let Value::Array(items) = value else {
        return Err(Error::Corrupt(format!("unexpected script reply {value:?}")));
    };
    let tag = match items.first() {
        Some(Value::BulkString(tag)) => tag.as_slice(),
        _ => return Err(Error::Corrupt("script reply without tag".into())),
    };
    Ok(match (tag, items.get(1)) {
        (b"x", _) => Begin::Execute(token),
        (b"t", _) => Begin::TakeOver(token),
        (b"c", _) => {
            return Err(Error::unavailable(
                "the claim ran after it was given up and cancelled",
            ));
        }
        (b"s", _) => {
            // The old record expired between the failed `SET` and this script: nothing was
            // written; the caller's retry claims in the current layout.
            return Err(Error::unavailable(
                "the record changed layout during the claim",
            ));
        }
        (b"m", _) => Begin::Mismatch,
        (b"r", Some(Value::BulkString(out))) => Begin::Replay(decode_outcome(out)?),
        (b"i", Some(Value::Int(pttl))) => Begin::InFlight {
            retry_after: Duration::from_millis(u64::try_from(*pttl).unwrap_or(0).max(1)),
        },
        _ => return Err(Error::Corrupt("malformed script reply".into())),
    })
}

impl RedisStore {
    /// Starts configuring a store on a standalone Redis.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            urls: vec![url.into()],
            cluster: false,
            given: None,
            prefix: "idem".into(),
            connect_timeout: Duration::from_millis(250),
            response_timeout: None,
            budget: Duration::from_millis(500),
            eviction: EvictionCheck::Refuse,
            dead_after: Duration::ZERO,
            #[cfg(feature = "tls-rustls")]
            tls_roots: None,
        }
    }

    /// Starts configuring a store on a Redis Cluster, given some of its nodes
    /// (needs the `cluster` feature).
    pub fn cluster_builder(
        nodes: impl IntoIterator<Item = impl Into<String>>,
    ) -> RedisStoreBuilder {
        RedisStoreBuilder {
            urls: nodes.into_iter().map(Into::into).collect(),
            cluster: true,
            ..Self::builder(String::new())
        }
    }

    /// Starts configuring a store on a connection the application already has, so the
    /// store shares its TLS, credentials, timeouts and reconnect policy (and its one
    /// multiplexed socket). The builder's connect and response timeouts do not apply to it;
    /// the call budget does.
    ///
    /// ```no_run
    /// use idempotency_redis::{RedisStore, redis};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let manager = redis::aio::ConnectionManager::new(client).await?;
    /// let store = RedisStore::from_connection_manager(manager)
    ///     .prefix("payments")
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn from_connection_manager(manager: ConnectionManager) -> RedisStoreBuilder {
        RedisStoreBuilder {
            given: Some(Given(Conn::Single(manager))),
            ..Self::builder(String::new())
        }
    }

    /// [`RedisStore::from_connection_manager`] for a Redis Cluster connection (needs the
    /// `cluster` feature).
    ///
    /// Build the client **without** `read_from_replicas`: the store's reads (`GET`, `PTTL`)
    /// must see the primary, or a lagging replica answers "in flight" or "key reused" for a
    /// record the primary has already moved on from.
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
    pub fn from_cluster_connection(
        conn: redis::cluster_async::ClusterConnection,
    ) -> RedisStoreBuilder {
        RedisStoreBuilder {
            given: Some(Given(Conn::Cluster(conn))),
            cluster: true,
            ..Self::builder(String::new())
        }
    }

    /// The Redis key of a record: the id is a hash tag, so a record's keys share one slot.
    pub fn key(&self, id: &RecordId) -> String {
        // `prefix:{hex}`, built without `format!` (one per store call).
        let mut key = String::with_capacity(self.prefix.len() + 67);
        key.push_str(&self.prefix);
        key.push_str(":{");
        id.write_hex(&mut key);
        key.push('}');
        key
    }

    /// `call` within the call budget.
    fn timed<T>(
        &self,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> impl Future<Output = Result<T>> {
        within(self.budget, call)
    }

    /// The TTL `read_record` needs for a lease or a mirror (whether its lease is over, and
    /// the `Retry-After`), asked only then: a first request or a replay reads one value and
    /// no TTL. The record is read again with it, atomically, so value and TTL belong together; a
    /// lease found over is only ever taken by the takeover script, which checks again. Other
    /// states need none (`-1`). Within the caller's `deadline`: one budget for both reads.
    async fn pttl_if_live(
        &self,
        key: &str,
        value: Vec<u8>,
        deadline: tokio::time::Instant,
    ) -> Result<(Vec<u8>, i64)> {
        if !matches!(value.first(), Some(b'0' | b'm')) {
            return Ok((value, -1));
        }
        // The value again with its TTL, in one script: a record that changed in between
        // (completed, say) is read whole, never a lease with the TTL of a retention (a
        // pipeline is not atomic: Redis may run another client's commands between the two).
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let keys = [key.to_owned()];
        let (again, pttl): (Vec<u8>, i64) = self
            .run_keys(left, &self.scripts.read_with_ttl, &keys, &[])
            .await?;
        // Gone in between (no record is empty): free (`-2`), which only ever leads to the
        // takeover's re-check.
        Ok(if again.is_empty() {
            (value, -2)
        } else {
            (again, pttl)
        })
    }

    async fn check_eviction_policy(&self, check: EvictionCheck) -> Result<()> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg("maxmemory-policy");
        let configs = self.on_every_master(cmd).await?;
        // Managed Redis often refuses `CONFIG` (ElastiCache, whose default policy,
        // `volatile-lru`, evicts records: each has a TTL) but says the policy in `INFO
        // memory`: asked only then.
        let refused = configs
            .iter()
            .any(|(_, reply)| matches!(reply, Err(error) if error.code().is_some()));
        let infos = if refused {
            let mut cmd = redis::cmd("INFO");
            cmd.arg("memory");
            self.on_every_master(cmd).await?
        } else {
            Vec::new()
        };
        for (node, reply) in configs {
            let from_info = infos
                .iter()
                .find(|(other, _)| *other == node)
                .and_then(|(_, info)| info_text(info.as_ref().ok()?))
                .and_then(|info| info_field(&info, "maxmemory_policy").map(str::to_owned));
            Self::judge_eviction_policy(&node, &reply, from_info, check)?;
        }
        Ok(())
    }

    /// Refuses a Redis older than 7.0, whose every claim would fail (`SET … NX GET` is a
    /// syntax error there, and the `complete` script's flags unknown): a clear error at
    /// start instead of a 503 for every request. A server that does not say its version (an
    /// `INFO` refused, a proxy) is let through.
    async fn check_version(&self) -> Result<()> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg("server");
        for (node, reply) in self.on_every_master(cmd).await? {
            if let Some(info) = reply.ok().as_ref().and_then(info_text) {
                judge_version(&node, &info)?;
            }
        }
        Ok(())
    }

    /// Each node's answer to `cmd`, by node (`""` for a standalone Redis). A cluster would
    /// route the command to one node of its choosing: every master is asked (one evicting
    /// master loses the records of its slots; one old master fails the claims of its slots).
    async fn on_every_master(
        &self,
        cmd: redis::Cmd,
    ) -> Result<Vec<(String, redis::RedisResult<Value>)>> {
        #[cfg(feature = "cluster")]
        if let Conn::Cluster(conn) = &self.conn {
            use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
            let mut conn = conn.clone();
            let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            let reply = self
                .timed(async { Ok(conn.route_command(cmd, all).await) })
                .await?;
            // A map of node address to its answer (an error reply of one node included).
            return match reply {
                Ok(Value::Map(nodes)) => Ok(nodes
                    .into_iter()
                    .map(|(node, answer)| {
                        let node = match node {
                            Value::BulkString(name) => String::from_utf8_lossy(&name).into_owned(),
                            other => format!("{other:?}"),
                        };
                        let answer = match answer {
                            Value::ServerError(error) => Err(error.into()),
                            answer => Ok(answer),
                        };
                        (node, answer)
                    })
                    .collect()),
                Ok(other) => Ok(vec![(String::new(), Ok(other))]),
                Err(error) => Ok(vec![(String::new(), Err(error))]),
            };
        }
        let mut conn = self.conn.clone();
        let reply = self
            .timed(async { Ok(cmd.query_async(&mut conn).await) })
            .await?;
        Ok(vec![(String::new(), reply)])
    }

    /// Whether one node's `maxmemory-policy` (its `reply` to `CONFIG GET`, or what its
    /// `INFO memory` said when the server refused that) lets the store start.
    fn judge_eviction_policy(
        node: &str,
        reply: &redis::RedisResult<Value>,
        from_info: Option<String>,
        check: EvictionCheck,
    ) -> Result<()> {
        let node = if node.is_empty() {
            String::new()
        } else {
            format!(" (node {node})")
        };
        let policy = match (reply.as_ref().map(config_value), from_info) {
            (Ok(Some(policy)), _) => policy,
            // `CONFIG` refused by the server, the policy read from its `INFO`.
            (Err(error), Some(policy)) if error.code().is_some() => policy,
            // Anything but the server's own refusal (down, refused, a failed TLS handshake,
            // a client misconfiguration): nothing was checked, and a store that cannot reach
            // Redis must not start as if it had been.
            (Err(error), _) if error.code().is_none() => {
                return Err(Error::unavailable(format!(
                    "cannot reach Redis{node} to check its maxmemory-policy: {error}"
                )));
            }
            // Managed Redis often disables CONFIG (or the user may not run it): the server
            // refused (an error reply: unknown command, NOPERM), and its `INFO` did not say
            // either: we cannot know, so say so and go on.
            (Err(error), _) => {
                tracing::warn!(
                    %error,
                    "cannot read Redis{node} maxmemory-policy (CONFIG disabled?): make sure it is `noeviction`, \
                     or an evicted idempotency record will execute again"
                );
                return Ok(());
            }
            // An answer this store cannot read is no reason to assume the safe policy.
            (Ok(None), _) => {
                let why = format!(
                    "cannot read Redis{node} maxmemory-policy from the reply {reply:?}: make sure it is \
                     `noeviction`, then accept with EvictionCheck::Warn"
                );
                return match check {
                    EvictionCheck::Refuse => Err(Error::Config(why)),
                    _ => {
                        tracing::warn!("{why}");
                        Ok(())
                    }
                };
            }
        };
        if policy == "noeviction" {
            return Ok(());
        }
        let why = format!(
            "Redis{node} maxmemory-policy is `{policy}`: under memory pressure Redis silently deletes idempotency \
             records, and the retry of an evicted key executes a second time (a double charge). Set \
             `maxmemory-policy noeviction`, put Postgres behind Redis (the hybrid store), or accept the risk \
             with EvictionCheck::Warn"
        );
        match check {
            EvictionCheck::Refuse => Err(Error::Config(why)),
            _ => {
                tracing::warn!("{why}");
                Ok(())
            }
        }
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        id: &RecordId,
        args: &[&[u8]],
    ) -> Result<T> {
        self.run_within(self.budget, script, id, args).await
    }

    async fn run_within<T: redis::FromRedisValue>(
        &self,
        budget: Duration,
        script: &Script,
        id: &RecordId,
        args: &[&[u8]],
    ) -> Result<T> {
        self.run_keys(budget, script, &[self.key(id)], args).await
    }

    async fn run_keys<T: redis::FromRedisValue>(
        &self,
        budget: Duration,
        script: &Script,
        keys: &[String],
        args: &[&[u8]],
    ) -> Result<T> {
        // `EVALSHA` written straight into one command, as `ScriptInvocation::invoke_async`
        // sends it, and with its fallback: the invocation would first copy every key and
        // argument into a `Vec` of its own (about seven allocations per call, counted with a
        // malloc probe under the bench).
        let bytes: usize = keys.iter().map(String::len).sum::<usize>()
            + args.iter().map(|a| a.len()).sum::<usize>();
        let mut eval = redis::Cmd::with_capacity(3 + keys.len() + args.len(), 64 + bytes);
        eval.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
        for key in keys {
            eval.arg(key.as_str());
        }
        for arg in args {
            eval.arg(*arg);
        }
        let mut conn = self.conn.clone();
        let call = async {
            match eval.query_async(&mut conn).await {
                // Not in Redis' script cache (a restart, a `SCRIPT FLUSH`): load it, once more.
                Err(error)
                    if error.kind()
                        == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    script.load_async(&mut conn).await?;
                    eval.query_async(&mut conn).await
                }
                answer => answer,
            }
        };
        within(budget, call).await
    }

    /// The claim: a plain `SET NX GET` (a `PTTL` follows only when it finds a lease); the
    /// takeover script only when the record it found is free to take (a lease that is over,
    /// a cancel marker), the legacy script only for a record of the earlier layout. Bounded
    /// by `begin`, which cancels it if it stops waiting (see [`Unanswered`]) unless `unrun`
    /// says Redis refused the `SET` unrun; `deadline` is that bound, for the reads after it.
    async fn claim(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        token: LeaseToken,
        deadline: tokio::time::Instant,
        unrun: &AtomicBool,
    ) -> Result<Begin> {
        let (raw, _) = token_forms(token);
        let key = self.key(id);
        // A zero lease is over at once, not in 1 ms (`millis` rounds up for `PX`).
        let ttl = lease_millis(lease).saturating_add(grace());
        let fresh = scripts::value(b'0', fp.as_bytes(), &raw, &[]);
        let mut set = redis::cmd("SET");
        set.arg(&key)
            .arg(&fresh)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(ttl);
        let mut conn = self.conn.clone();
        let claimed: Result<Option<Vec<u8>>> = match set.query_async(&mut conn).await {
            Ok(reply) => Ok(reply),
            Err(error) if wrong_type(&error) => {
                return self.claim_legacy(id, fp, lease, token).await;
            }
            // Refused: nothing was sent, nothing can land late.
            Err(error) if error.is_connection_refusal() => {
                return Err(Error::unavailable(error));
            }
            // Redis itself refused the command (`OOM` on a full `noeviction` Redis, `READONLY`
            // from a replica after a failover): it did not run, nothing can land late, and a
            // cancel would only write a marker into a Redis that is full. Only those codes,
            // and only on a direct connection: a cluster client may have resent a claim whose
            // first copy landed, and a proxy's own error says nothing of what it forwarded.
            // Reads still run there: a record already written (an outcome, a live lease, a
            // claim of another request) answers as it would have — a full Redis keeps
            // replaying what it stores, rather than answering every retry `Unavailable`
            // until TTLs free it.
            Err(error) if refused_unrun(&self.conn, &error) => {
                unrun.store(true, Ordering::Relaxed);
                // Not on a replica (`READONLY`: a primary demoted by a failover), whose copy
                // may lag the primary's: a key deleted or released there would still replay
                // or mismatch here.
                if error.code() == Some("READONLY") {
                    return Err(Error::unavailable(error));
                }
                return match self.answer_refused(&key, fp, &raw, deadline).await {
                    Some(answer) => Ok(answer),
                    None => Err(Error::unavailable(error)),
                };
            }
            // Refused as the cancel this claim owes would be (a cluster client may have
            // resent the claim, whose first copy may have landed): that cancel waits for the
            // store's probe rather than trying at once. (Not `OOM`: the cancel, `allow-oom`,
            // lands.)
            Err(error) if refuses_writes(&error) && error.code() != Some("OOM") => {
                self.cancel_later(id, token, true);
                return Err(Error::unavailable(error));
            }
            Err(error) => Err(Error::unavailable(error)),
        };
        let found = match claimed {
            Ok(None) => return Ok(Begin::Execute(token)),
            // This claim's own lease (its `SET` sent twice by a cluster client, the first
            // landed): owned at once. Read again for its TTL first, a read that failed (the
            // budget spent on the resend) left that lease to nobody, uncancelled.
            Ok(Some(value)) if let Some(took) = own_lease(&value, &raw) => {
                return Ok(ours(took, token));
            }
            // Someone else's record: this claim wrote nothing, so nothing needs cancelling.
            Ok(Some(value)) => {
                let (value, pttl) = self.pttl_if_live(&key, value, deadline).await?;
                read_record(&value, pttl, fp, &raw)
            }
            Err(error) => {
                self.cancel_later(id, token, false);
                return Err(error);
            }
        };
        match found? {
            Found::Answer(answer) => Ok(answer),
            Found::Ours { took } => Ok(ours(took, token)),
            Found::Cancelled => Err(Error::unavailable(
                "the claim ran after it was given up and cancelled",
            )),
            Found::Free => self.take_over(id, fp, lease, token, &fresh).await,
        }
    }

    /// What a record already there answers to a claim Redis refused to run (`OOM`,
    /// `READONLY`, ...): `None` when there is none, or when it is free to take (a claim that
    /// cannot be written), or cannot be read.
    async fn answer_refused(
        &self,
        key: &str,
        fp: &Fingerprint,
        raw: &[u8; 16],
        deadline: tokio::time::Instant,
    ) -> Option<Begin> {
        let mut conn = self.conn.clone();
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(key)
            .query_async(&mut conn)
            .await
            .ok()?;
        let (value, pttl) = self.pttl_if_live(key, value?, deadline).await.ok()?;
        match read_record(&value, pttl, fp, raw) {
            Ok(Found::Answer(answer)) => Some(answer),
            _ => None,
        }
    }

    /// Takes a free record over (atomically re-checked), or reads the record that is there.
    async fn take_over(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        token: LeaseToken,
        fresh: &[u8],
    ) -> Result<Begin> {
        let (raw, _) = token_forms(token);
        let ttl = lease_millis(lease).saturating_add(grace()).to_string();
        let taken: Result<Value> = self
            .run_keys(
                self.budget * 4,
                &self.scripts.takeover,
                &[self.key(id), self.tombstone(id, token)],
                &[fresh, ttl.as_bytes(), grace_ms().as_bytes(), &raw],
            )
            .await;
        let items = match taken {
            Ok(Value::Array(items)) => items,
            Ok(other) => {
                return Err(Error::Corrupt(format!(
                    "unexpected takeover reply {other:?}"
                )));
            }
            Err(error) => {
                self.cancel_later(id, token, false);
                return Err(error);
            }
        };
        match (items.first(), items.get(1), items.get(2)) {
            (Some(Value::BulkString(tag)), _, _) if tag == b"x" => Ok(Begin::Execute(token)),
            (Some(Value::BulkString(tag)), _, _) if tag == b"t" => {
                tracing::info!(record = %id, "took over an expired idempotency lease");
                Ok(Begin::TakeOver(token))
            }
            (Some(Value::BulkString(tag)), _, _) if tag == b"c" => Err(Error::unavailable(
                "the claim ran after it was given up and cancelled",
            )),
            (Some(Value::BulkString(tag)), _, _) if tag == b"h" => {
                self.claim_legacy(id, fp, lease, token).await
            }
            (Some(Value::BulkString(tag)), Some(Value::BulkString(v)), Some(Value::Int(pttl)))
                if tag == b"v" =>
            {
                match read_record(v, *pttl, fp, &raw)? {
                    Found::Answer(answer) => Ok(answer),
                    Found::Ours { took } => Ok(ours(took, token)),
                    // The script found it live; a clock edge between its two reads here.
                    _ => Ok(Begin::InFlight {
                        retry_after: Duration::from_millis(1),
                    }),
                }
            }
            _ => Err(Error::Corrupt("malformed takeover reply".into())),
        }
    }

    /// The claim on a key that still holds a record of the earlier (hash) layout, under
    /// `token`. Public for tests, which send one claim twice as a cluster client's resend
    /// does; every other caller wants `begin`.
    #[doc(hidden)]
    pub async fn claim_legacy(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        token: LeaseToken,
    ) -> Result<Begin> {
        let (_, text) = token_forms(token);
        // Zero honoured, as by the current layout's claim: the script adds the grace.
        let lease = lease_millis(lease).to_string();
        let keys = [self.key(id), self.tombstone(id, token)];
        let claimed: Result<Value> = self
            .run_keys(
                self.budget * 4,
                &self.scripts.legacy_begin,
                &keys,
                &[
                    &fp.as_bytes()[..],
                    &text,
                    lease.as_bytes(),
                    grace_ms().as_bytes(),
                ],
            )
            .await;
        match claimed {
            Ok(value) => parse_begin(value, token),
            Err(error) => {
                self.cancel_later(id, token, false);
                Err(error)
            }
        }
    }

    /// Unknown whether a claim ran, or will: a hung Redis runs the commands queued on the
    /// connection when it resumes, after the client gave up. Cancel it in a way that holds in
    /// either order (see `scripts::cancel`).
    ///
    /// A cancel that did not find the claim's own lease runs once more, three call budgets
    /// later: it may have overtaken the claim — sent on a connection that replaced the one
    /// the claim is still queued on, on a Redis that hung — and found another request's
    /// record, leaving only a tombstone; once that record is gone the late claim could
    /// land. The second deletes what it granted then. (One that replaced or ended the
    /// claim's lease is final: its marker or tombstone stops the claim written again.)
    ///
    /// It runs on the caller's runtime and, when the store was made on another, on that one
    /// too ([`spawn_where_it_survives`](idempotency_core::spawn_where_it_survives)): a claim
    /// dropped as its runtime shuts down would otherwise have its cancel dropped unrun with
    /// that runtime's tasks. The cancel is fenced on the claim's token: twice, it changes
    /// nothing more.
    ///
    /// `refused`: Redis refused the claim as it would refuse the cancel (see
    /// [`cancel_claim`](Self::cancel_claim)).
    fn cancel_later(&self, id: &RecordId, token: LeaseToken, refused: bool) {
        let cancel = || {
            let (this, id) = (self.clone(), *id);
            async move {
                if !this.cancel_claim(&id, token, refused).await {
                    tokio::time::sleep(this.budget * 3).await;
                    this.cancel_claim(&id, token, false).await;
                }
            }
        };
        if idempotency_core::spawn_where_it_survives(&self.settling, self.home.as_ref(), cancel)
            == 0
        {
            tracing::warn!(record = %id, "a claim was given up outside any Tokio runtime: a lease it took expires by itself");
        }
    }

    /// The tombstone of one claim: same hash tag, so same cluster slot, as the record.
    fn tombstone(&self, id: &RecordId, token: LeaseToken) -> String {
        format!("{}:{{{}}}:cancelled:{token}", self.prefix, id.to_hex())
    }

    /// The receipt of one operator's release: same hash tag, so same cluster slot, as the
    /// record.
    fn receipt(&self, id: &RecordId, receipt: LeaseToken) -> String {
        format!("{}:{{{}}}:released:{receipt}", self.prefix, id.to_hex())
    }

    /// [`Store::force_release`] under `receipt`: the release runs once per receipt, however
    /// many copies of it reach Redis (see `scripts::force_release`). For tests, which send
    /// one release twice; every other caller wants `force_release`.
    #[doc(hidden)]
    pub async fn force_release_once(
        &self,
        id: &RecordId,
        scope: ReleaseScope,
        receipt: LeaseToken,
    ) -> Result<ForceReleased> {
        idempotency_core::observe(self.name(), "force_release", async {
            let flag = |on: bool| -> &[u8] { if on { b"1" } else { b"0" } };
            // Bounded by Redis' clock where the record lives: a release that reaches it after
            // its call gave up (its bytes held up by the network) deletes nothing, for a
            // record there by then may have come after the operator was told `Unavailable`
            // and released the key again. Read first, then the release is sent at once and
            // waited for one budget: the bound ends no later than that wait.
            let now: i64 = self.run(&self.scripts.clock, id, &[]).await?;
            let until =
                now.saturating_add(i64::try_from(self.budget.as_millis()).unwrap_or(i64::MAX));
            let keys = [self.key(id), self.receipt(id, receipt)];
            let found: i64 = self
                .run_keys(
                    self.budget,
                    &self.scripts.force_release,
                    &keys,
                    &[
                        flag(scope.live),
                        flag(scope.completed),
                        grace_ms().as_bytes(),
                        until.to_string().as_bytes(),
                    ],
                )
                .await?;
            Ok(match found {
                1 => ForceReleased::Released,
                2 => ForceReleased::Deleted,
                3 => ForceReleased::Completed,
                4 => ForceReleased::Live,
                5 => {
                    return Err(Error::unavailable(
                        "the release reached Redis past its budget and deleted nothing; call again",
                    ));
                }
                _ => ForceReleased::Absent,
            })
        })
        .await
    }

    /// Retries the cancel script until Redis answers (for at most the grace period): until
    /// then a late claim could still land. Its first try is at once unless its claim was
    /// refused as Redis refuses writes (`refused`). Refused so, it tries again in the store's
    /// turn ([`CancelGate`]), or on its own one to two minutes after its last try; failed
    /// another way (Redis hung), it backs off on its own (50 ms doubling to 5 s, spread by
    /// its token over half to one and a half times that). On a direct connection that hangs,
    /// its retries also need a place among a few ([`CancelGate::retry`]).
    /// `true` when it deleted or ended the claim's own lease.
    async fn cancel_claim(&self, id: &RecordId, token: LeaseToken, refused: bool) -> bool {
        let (raw, text) = token_forms(token);
        let keys = [self.key(id), self.tombstone(id, token)];
        let ttl = grace_ms();
        let args: [&[u8]; 4] = [&raw, &text, ttl.as_bytes(), ttl.as_bytes()];
        let give_up = tokio::time::Instant::now() + idempotency_core::LATE_COMPLETION_GRACE;
        // Refused so, the first try waits its turn too (a burst of refused claims would
        // otherwise send as many first tries before one of them failed).
        if refused {
            self.cancels.refused();
        }
        let (mut refused, mut backoff) = (refused, FIRST_CANCEL_BACKOFF);
        let own_try_after = own_try_after(token);
        let mut own_try = tokio::time::Instant::now() + own_try_after;
        // On a direct connection that hangs, a few retries at a time (`CancelGate::retry`).
        let direct = matches!(self.conn, Conn::Single(_) | Conn::Own(_));
        let mut tried = false;
        while tokio::time::Instant::now() < give_up {
            let place = match direct && tried {
                false => None,
                true => match self.cancels.retry(self.budget) {
                    Retry::Go => None,
                    Retry::Placed(place) => Some(place),
                    Retry::Full => {
                        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
                        tokio::time::sleep(jittered(backoff, token).min(left)).await;
                        backoff = (backoff * 2).min(MAX_CANCEL_BACKOFF);
                        continue;
                    }
                },
            };
            let probe = refused
                && match self.cancels.turn(self.budget) {
                    Turn::Free => false,
                    Turn::Probe => true,
                    Turn::Wait(_) if tokio::time::Instant::now() >= own_try => false,
                    Turn::Wait(until) => {
                        if let Some(place) = place {
                            self.cancels.retried(place);
                        }
                        let wake = until + spread(token, Duration::from_secs(1));
                        tokio::time::sleep_until(wake.min(own_try).min(give_up)).await;
                        continue;
                    }
                };
            let undone: Result<i64> = self
                .run_keys(self.budget, &self.scripts.cancel, &keys, &args)
                .await;
            if let Some(place) = place {
                self.cancels.retried(place);
            }
            if direct {
                self.cancels.tried(answered(&undone));
            }
            tried = true;
            own_try = tokio::time::Instant::now() + own_try_after;
            refused = undone.as_ref().is_err_and(refused_write);
            if probe {
                self.cancels.probed(undone.is_ok(), refused);
            }
            match undone {
                Ok(undone) => return undone == 1,
                Err(error) => {
                    tracing::debug!(%error, record = %id, "cancelling an unanswered claim; retrying");
                    if refused {
                        self.cancels.refused();
                    } else {
                        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
                        tokio::time::sleep(jittered(backoff, token).min(left)).await;
                        backoff = (backoff * 2).min(MAX_CANCEL_BACKOFF);
                    }
                }
            }
        }
        tracing::warn!(record = %id, "could not cancel an unanswered claim; it expires with its lease");
        true // nothing more to try
    }

    /// Reads a record without changing it: what the hybrid store asks before Postgres.
    ///
    /// A plain `GET`; a script reads the value again with its TTL only when it is a lease
    /// or a mirror.
    pub async fn peek(&self, id: &RecordId, fp: &Fingerprint) -> Result<Peek> {
        let key = self.key(id);
        let deadline = tokio::time::Instant::now() + self.budget;
        let mut conn = self.conn.clone();
        let read: redis::RedisResult<Option<Vec<u8>>> = match tokio::time::timeout_at(
            deadline,
            redis::cmd("GET").arg(&key).query_async(&mut conn),
        )
        .await
        {
            Ok(read) => read,
            Err(_) => {
                return Err(Error::unavailable(format!(
                    "Redis did not answer within {:?}",
                    self.budget
                )));
            }
        };
        let value = match read {
            Ok(read) => read,
            Err(error) if wrong_type(&error) => {
                return self.peek_legacy(&key, fp, deadline).await;
            }
            Err(error) => return Err(Error::unavailable(error)),
        };
        let Some(value) = value else {
            return Ok(Peek::Absent);
        };
        let (value, pttl) = self.pttl_if_live(&key, value, deadline).await?;
        // A lease's mirror may outlive the lease it copies (its delete failed, another process
        // released the key): it may only delay the same request (a 409 until its TTL), never
        // turn another one away with a 422. Another request asks the store that decides.
        if value.first() == Some(&b'm') && value.get(scripts::FP) != Some(&fp.as_bytes()[..]) {
            return Ok(Peek::Absent);
        }
        // A peek claims nothing: any token will do for reading.
        Ok(match read_record(&value, pttl, fp, &[0; 16])? {
            Found::Answer(answer) => Peek::Found(answer),
            Found::Free | Found::Cancelled | Found::Ours { .. } => Peek::Absent,
        })
    }

    /// [`RedisStore::peek`] on a record of the earlier (hash) layout.
    /// Within the `GET`'s `deadline`: one budget for the whole peek.
    async fn peek_legacy(
        &self,
        key: &str,
        fp: &Fingerprint,
        deadline: tokio::time::Instant,
    ) -> Result<Peek> {
        let mut conn = self.conn.clone();
        let [state, stored_fp, out, exp]: [Option<Vec<u8>>; 4] = by(
            deadline,
            redis::cmd("HMGET")
                .arg(key)
                .arg("st")
                .arg("fp")
                .arg("out")
                .arg("exp")
                .query_async(&mut conn),
        )
        .await?;
        let Some(state) = state else {
            return Ok(Peek::Absent);
        };
        if stored_fp.as_deref() != Some(&fp.as_bytes()[..]) {
            // A lease without `exp` is a mirror (as `READ_FENCED` reads it): like one of the
            // current layout, it never turns another request away.
            if state == b"0" && exp.is_none() {
                return Ok(Peek::Absent);
            }
            return Ok(Peek::Found(Begin::Mismatch));
        }
        if state == b"1" {
            let out =
                out.ok_or_else(|| Error::Corrupt("completed record without outcome".into()))?;
            return Ok(Peek::Found(Begin::Replay(decode_outcome(&out)?)));
        }
        let pttl: i64 = by(deadline, redis::cmd("PTTL").arg(key).query_async(&mut conn)).await?;
        Ok(match u64::try_from(pttl) {
            Ok(ms) if ms > 0 => Peek::Found(Begin::InFlight {
                retry_after: Duration::from_millis(ms),
            }),
            _ => Peek::Absent,
        })
    }

    /// Mirrors a lease granted elsewhere (Postgres), so live duplicates are answered here:
    /// `SET NX PX`, so a record already there (an outcome, say) is left alone.
    pub async fn cache_in_flight(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<()> {
        let (raw, _) = token_forms(token);
        let mut conn = self.conn.clone();
        let _: Option<String> = self
            .timed(
                redis::cmd("SET")
                    .arg(self.key(id))
                    .arg(scripts::value(b'm', fp.as_bytes(), &raw, &[]))
                    .arg("NX")
                    .arg("PX")
                    .arg(millis(lease))
                    .query_async(&mut conn),
            )
            .await?;
        Ok(())
    }

    /// Caches an outcome stored elsewhere (Postgres) until `expires`, the instant its record
    /// expires there (or a little before), replacing whatever is there (a mirrored lease:
    /// the outcome is the truth). Returns whether the copy was written: once `expires` has
    /// passed, whatever the key holds is deleted instead (a mirror of the lease must not
    /// answer "in flight" for a record that is over), and `false` is returned.
    ///
    /// The copy lives the time left until `expires` as this call counts it (by the monotonic
    /// clock, when it sends the command), and never past that instant by Redis' clock (this
    /// host's wall clock at sending, plus the time left): a copy that waited in a stalled
    /// connection (Redis paused, then resumed) expires with its record instead of a whole
    /// retention after it landed, when the key may have been used again. A Redis clock
    /// behind this host's by `d` can keep such a late copy up to `d` longer; one ahead ends
    /// copies `d` early, which only sends their replays to Postgres.
    ///
    /// And a copy lands within four call budgets of its sending (by Redis' clock against
    /// this host's) or not at all: held up longer (a partition TCP retransmits across once it
    /// heals, a stalled host), it deletes the key instead of writing, and `false` is
    /// returned. Its record may have been released by an operator meanwhile, from any
    /// process: the hybrid's release deletes the key again once every copy still allowed
    /// could have landed. (A Redis clock ahead of this host's by more than four budgets
    /// turns every copy into a delete: replays then go to Postgres.)
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tokio::time::Instant;
    /// # use idempotency_core::{Fingerprint, Outcome, RecordId, Scope, IdempotencyKey};
    /// # async fn run(redis: idempotency_redis::RedisStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let id = RecordId::new(&Scope::new("charges"), &IdempotencyKey::new("k1")?);
    /// let outcome = Outcome::new(201).with_body("ch_1");
    /// let expires = Instant::now() + Duration::from_secs(24 * 3600);
    /// let written = redis
    ///     .cache_completed(&id, &Fingerprint::of(b"body"), &outcome, expires)
    ///     .await?;
    /// assert!(written);
    /// # Ok(()) }
    /// ```
    pub async fn cache_completed(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        outcome: &Outcome,
        expires: tokio::time::Instant,
    ) -> Result<bool> {
        let far = tokio::time::Instant::now() + self.budget.saturating_mul(COPY_DEADLINE_BUDGETS);
        self.cache_completed_within(id, fp, outcome, expires, far)
            .await
    }

    /// [`cache_completed`](Self::cache_completed) whose copy lands by `deadline` at the
    /// latest (and within four call budgets of its sending, as always), or deletes the key:
    /// for a copy made after answering, whose bound counts from the Postgres read or write
    /// it copies, however late the task that sends it started (see the hybrid store's
    /// operator release). A `deadline` already past deletes the key.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tokio::time::Instant;
    /// # use idempotency_core::{Fingerprint, Outcome, RecordId, Scope, IdempotencyKey};
    /// # async fn run(redis: idempotency_redis::RedisStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let id = RecordId::new(&Scope::new("charges"), &IdempotencyKey::new("k1")?);
    /// let read = Instant::now(); // when Postgres was asked
    /// let expires = read + Duration::from_secs(24 * 3600);
    /// let written = redis
    ///     .cache_completed_within(
    ///         &id,
    ///         &Fingerprint::of(b"body"),
    ///         &Outcome::new(201),
    ///         expires,
    ///         read + Duration::from_secs(5),
    ///     )
    ///     .await?;
    /// assert!(written);
    /// # Ok(()) }
    /// ```
    pub async fn cache_completed_within(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        outcome: &Outcome,
        expires: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<bool> {
        let [value, ttl, at, deadline] = self.copy_args(fp, outcome, expires, deadline);
        let written: i64 = self
            .run(
                &self.scripts.cache_completed,
                id,
                &[&value, &ttl, &at, &deadline],
            )
            .await?;
        Ok(written == 1)
    }

    /// [`cache_completed_within`](Self::cache_completed_within), fenced on the lease's
    /// mirror: the outcome replaces the mirror `token` left (see
    /// [`cache_in_flight`](Self::cache_in_flight)), and nothing else. Another lease's mirror
    /// there (perhaps a newer attempt's, after an operator's release) is deleted, not
    /// overwritten; an outcome there is left; an empty key is left empty, and the caller
    /// decides ([`Replaced::Absent`]: the mirror expired or never landed, or an operator's
    /// release deleted it). Past `deadline`, the mirror is deleted instead.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tokio::time::Instant;
    /// # use idempotency_core::{Fingerprint, LeaseToken, Outcome, RecordId, Scope, IdempotencyKey};
    /// # async fn run(redis: idempotency_redis::RedisStore, token: LeaseToken) -> Result<(), Box<dyn std::error::Error>> {
    /// let id = RecordId::new(&Scope::new("charges"), &IdempotencyKey::new("k1")?);
    /// let written = Instant::now(); // when the outcome was written where it is kept
    /// let replaced = redis
    ///     .replace_mirror(
    ///         &id,
    ///         token,
    ///         &Fingerprint::of(b"body"),
    ///         &Outcome::new(201),
    ///         written + Duration::from_secs(24 * 3600),
    ///         written + Duration::from_secs(5),
    ///     )
    ///     .await?;
    /// assert_ne!(replaced, idempotency_redis::Replaced::Written); // no mirror of `token` there
    /// # Ok(()) }
    /// ```
    pub async fn replace_mirror(
        &self,
        id: &RecordId,
        token: LeaseToken,
        fp: &Fingerprint,
        outcome: &Outcome,
        expires: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Replaced> {
        let (raw, text) = token_forms(token);
        let [value, ttl, at, deadline] = self.copy_args(fp, outcome, expires, deadline);
        let replaced: i64 = self
            .run(
                &self.scripts.replace_mirror,
                id,
                &[&raw, &text, &value, &ttl, &at, &deadline],
            )
            .await?;
        Ok(match replaced {
            1 => Replaced::Written,
            2 => Replaced::Absent,
            _ => Replaced::Not,
        })
    }

    /// A copy's arguments: the completed record's value, its TTL, the instant it must be
    /// gone by and the instant it must land by (Unix ms, this host's clock).
    fn copy_args(
        &self,
        fp: &Fingerprint,
        outcome: &Outcome,
        expires: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> [Vec<u8>; 4] {
        // Whole milliseconds left (none under one: too late, as Redis counts).
        let left = expires
            .saturating_duration_since(tokio::time::Instant::now())
            .min(idempotency_core::FOR_GOOD);
        let ttl = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
        let unix_ms = |after: Duration| {
            (SystemTime::now() + after)
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        };
        let at = unix_ms(left);
        let now = tokio::time::Instant::now();
        // A deadline already past is 0: before any clock's now, the script deletes.
        let deadline = if deadline <= now {
            0
        } else {
            unix_ms(
                self.budget
                    .saturating_mul(COPY_DEADLINE_BUDGETS)
                    .min(deadline - now),
            )
        };
        let value = scripts::value(b'1', fp.as_bytes(), &[0; 16], &outcome.encode());
        [
            value,
            ttl.to_string().into_bytes(),
            at.to_string().into_bytes(),
            deadline.to_string().into_bytes(),
        ]
    }

    /// The hard budget of one call (see [`RedisStoreBuilder::call_budget`]).
    pub fn call_budget(&self) -> Duration {
        self.budget
    }

    /// Deletes whatever this store holds for the record, at once and unfenced, in one round
    /// trip: for Redis as a cache in front of another store (the hybrid's copies, after an
    /// operator's release there), where a delete that lands late costs a cache miss. Not for
    /// a Redis-only store's records: its operator's release is
    /// [`force_release`](Store::force_release), which a late arrival cannot turn against a
    /// record made since.
    pub async fn delete_record(&self, id: &RecordId) -> Result<()> {
        let mut conn = self.conn.clone();
        let _: i64 = self
            .timed(redis::cmd("DEL").arg(self.key(id)).query_async(&mut conn))
            .await?;
        Ok(())
    }

    /// Sends `PING`: a health check.
    pub async fn ping(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        let _: String = self
            .timed(redis::cmd("PING").query_async(&mut conn))
            .await?;
        Ok(())
    }

    /// Writes a key of this store's prefix (`{prefix}:probe:{random}`, kept a second): how
    /// the hybrid store's breaker probes. A write, so that a Redis that answers reads but not
    /// writes (paused, read-only after a failover, out of memory) is not taken for up; a key
    /// of its own each time, so that the probes of a Redis Cluster visit its nodes as the
    /// records' keys do, not always the same one.
    pub async fn probe_write(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        let key = format!("{}:probe:{}", self.prefix, uuid::Uuid::new_v4().simple());
        let _: String = self
            .timed(
                redis::cmd("SET")
                    .arg(key)
                    .arg("1")
                    .arg("PX")
                    .arg(1000)
                    .query_async(&mut conn),
            )
            .await?;
        Ok(())
    }

    fn fenced(done: i64) -> Result<()> {
        if done == 1 {
            Ok(())
        } else {
            Err(Error::LeaseLost)
        }
    }
}

/// An `INFO` reply's text (RESP2 bulk or RESP3 verbatim string).
fn info_text(info: &Value) -> Option<String> {
    match info {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// The value of `name` in an `INFO` text (`name:value` lines).
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
        .filter(|value| !value.is_empty())
}

/// Refuses a node whose `INFO server` says a Redis (or a server compatible with one) older
/// than 7.0; lets through one whose version it cannot read.
fn judge_version(node: &str, info: &str) -> Result<()> {
    let version = info_field(info, "redis_version");
    let major = version.and_then(|v| v.split('.').next()?.parse::<u32>().ok());
    match (version, major) {
        (Some(version), Some(major)) if major < 7 => {
            let node = if node.is_empty() {
                String::new()
            } else {
                format!(" (node {node})")
            };
            Err(Error::Config(format!(
                "Redis{node} is {version}: the Redis store needs Redis 7.0 or later (its claim \
                 is `SET … NX GET`, its completion a script with flags)"
            )))
        }
        _ => Ok(()),
    }
}

/// Decodes the reply of [`scripts::inspect`].
/// 9999-01-01T00:00:00Z in Unix milliseconds: "never", for a record without a TTL.
const NEVER_MS: i64 = 253_370_764_800_000;

fn inspection(reply: &[Vec<u8>]) -> Result<Option<Inspection>> {
    let corrupt = || Error::Corrupt("unexpected inspect reply".into());
    let number = |i: usize| -> Result<i64> {
        let field = reply.get(i).ok_or_else(corrupt)?;
        std::str::from_utf8(field)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(corrupt)
    };
    let kind = reply.first().ok_or_else(corrupt)?;
    if kind == b"n" {
        return Ok(None);
    }
    let (now, pttl) = (number(1)?, number(2)?);
    // No TTL (`-1`: persisted from outside) never expires, and `begin` and `force_release`
    // read such a lease as live: so does this, as a lease and a record that last for good
    // (until the year 9999, which every date format can still write).
    let pttl = if pttl == -1 { NEVER_MS - now } else { pttl };
    let at = |ms: i64| system_time_from_millis(ms as f64);
    let grace = i64::try_from(LATE_COMPLETION_GRACE.as_millis()).unwrap_or(i64::MAX);
    let left = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    let fingerprint = |bytes: &[u8]| -> Result<Fingerprint> {
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| corrupt())?;
        Ok(Fingerprint::from_bytes(bytes))
    };
    let status = |encoded: &[u8]| decode_outcome(encoded).map(|o| o.status);
    match kind.as_slice() {
        b"v" => {
            let value = reply.get(3).ok_or_else(corrupt)?;
            if value.len() < OUTCOME {
                return Ok(None); // not a record
            }
            let fp = fingerprint(&value[FP])?;
            Ok(match value[0] {
                // A lease lives `lease + grace`: its lease is over once the grace is all
                // that is left.
                b'0' => Some(Inspection::in_flight(
                    fp,
                    None,
                    at(now + pttl - grace),
                    left(pttl - grace),
                )),
                b'm' => Some(Inspection::in_flight(fp, None, at(now + pttl), left(pttl))),
                b'1' => Some(Inspection::completed(
                    fp,
                    None,
                    at(now + pttl),
                    status(&value[OUTCOME..])?,
                )),
                _ => None,
            })
        }
        b"h" => {
            let field = |i: usize| reply.get(i).map(Vec::as_slice).ok_or_else(corrupt);
            let fp = fingerprint(field(4)?)?;
            Ok(match field(3)? {
                b"1" => Some(Inspection::completed(
                    fp,
                    None,
                    at(now + pttl),
                    status(field(5)?)?,
                )),
                b"0" if field(6)?.is_empty() => {
                    Some(Inspection::in_flight(fp, None, at(now + pttl), left(pttl)))
                }
                b"0" => {
                    let exp = number(6)?;
                    Some(Inspection::in_flight(fp, None, at(exp), left(exp - now)))
                }
                _ => None,
            })
        }
        _ => Err(corrupt()),
    }
}

#[async_trait]
impl Store for RedisStore {
    /// Cancel-safe: a claim it stops waiting for — dropped, out of budget, panicked — is
    /// cancelled in a task of its own, whether it has landed yet or not: a lease it granted
    /// is deleted, and one still on its way finds the cancel marker, or is deleted by a
    /// second cancel (the store's `Unanswered` guard). The claim runs in the caller's
    /// future, under one timer.
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        idempotency_core::observe(self.name(), "begin", async {
            let token = LeaseToken::generate();
            let unrun = AtomicBool::new(false);
            let mut unanswered = Unanswered {
                store: self,
                id: *id,
                token,
                armed: true,
                unrun: &unrun,
            };
            let deadline = tokio::time::Instant::now() + self.budget;
            let claim = AssertUnwindSafe(self.claim(id, fp, lease, token, deadline, &unrun));
            let answer = match tokio::time::timeout_at(deadline, claim.catch_unwind()).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_panic)) => {
                    return Err(Error::unavailable("the claim panicked; it is cancelled"));
                }
                Err(_) => {
                    return Err(Error::unavailable(format!(
                        "Redis did not answer within {:?}",
                        self.budget
                    )));
                }
            };
            // The claim answered: it settled whatever it wrote itself (an error after
            // sending cancels it, see `cancel_later`).
            unanswered.armed = false;
            answer
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
            let (raw, text) = token_forms(token);
            let retention = millis(retention).to_string();
            let done: i64 = self
                .run(
                    &self.scripts.complete,
                    id,
                    &[&raw, &text, &outcome.encode()[..], retention.as_bytes()],
                )
                .await?;
            Self::fenced(done)
        })
        .await
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        idempotency_core::observe(self.name(), "release", async {
            let (raw, text) = token_forms(token);
            let done: i64 = self.run(&self.scripts.release, id, &[&raw, &text]).await?;
            Self::fenced(done)
        })
        .await
    }

    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        idempotency_core::observe(self.name(), "renew", async {
            let (raw, text) = token_forms(token);
            // Zero ends the lease now (the record stays for the grace; a mirror goes), so
            // not `millis`, which rounds up to 1 ms: for that millisecond the lease would
            // still answer `InFlight`.
            let lease = lease_millis(lease).to_string();
            let done: i64 = self
                .run(
                    &self.scripts.renew,
                    id,
                    &[&raw, &text, lease.as_bytes(), grace_ms().as_bytes()],
                )
                .await?;
            Self::fenced(done)
        })
        .await
    }

    /// Redis expires records by itself (key TTLs): nothing to purge.
    async fn purge_expired(&self, _batch: usize) -> Result<u64> {
        Ok(0)
    }

    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>> {
        idempotency_core::observe(self.name(), "inspect", async {
            let reply: Vec<Vec<u8>> = self.run(&self.scripts.inspect, id, &[]).await?;
            inspection(&reply)
        })
        .await
    }

    async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased> {
        self.force_release_once(id, scope, LeaseToken::generate())
            .await
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn begin_settles_when_dropped(&self) -> bool {
        // `begin` cancels a claim it stops waiting for (`Unanswered`), tracked by `settling`.
        true
    }

    /// Waits for the cancels of the claims this store stopped waiting for (dropped, or their
    /// call budget ran out; a second cancel, when needed, comes three budgets later): until
    /// they land, a claim still queued on a Redis that hung could grant a lease nobody holds.
    async fn drain(&self) {
        self.settling.close();
        self.settling.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store's turns for refused cancels: none until one is refused, then one probe at a
    /// time, whose hold on the turn is capped at the longest backoff whatever the store's
    /// budget (a budget of an hour held every other cancel for that hour: past their give-up,
    /// they ended without a try); the backoff doubles with each refused probe, and starts
    /// again for a refusal no probe saw end; a probe that lands frees every cancel.
    #[tokio::test(start_paused = true)]
    async fn refused_cancels_take_turns() {
        let gate = CancelGate::default();
        let hour = Duration::from_secs(3600);
        let now = tokio::time::Instant::now;
        assert!(matches!(gate.turn(hour), Turn::Free));
        gate.refused();
        let Turn::Wait(until) = gate.turn(hour) else {
            panic!("a refusal makes the next cancel wait");
        };
        tokio::time::sleep_until(until).await;
        assert!(matches!(gate.turn(hour), Turn::Probe));
        let Turn::Wait(until) = gate.turn(hour) else {
            panic!("one probe at a time");
        };
        assert!(until <= now() + MAX_CANCEL_BACKOFF);
        // Refused probes, each in its turn: the wait grows to the longest backoff.
        for _ in 0..8 {
            gate.probed(false, true);
            let Turn::Wait(until) = gate.turn(hour) else {
                panic!("a refused probe makes the next cancel wait");
            };
            tokio::time::sleep_until(until).await;
            assert!(matches!(gate.turn(hour), Turn::Probe));
        }
        gate.probed(false, true);
        assert!(
            matches!(gate.turn(hour), Turn::Wait(until) if until == now() + MAX_CANCEL_BACKOFF)
        );
        // Nobody asked for a turn for a while (those cancels landed on their own tries):
        // the next refusal starts from the shortest backoff again.
        tokio::time::sleep(MAX_CANCEL_BACKOFF * 3).await;
        assert!(matches!(gate.turn(hour), Turn::Probe));
        gate.probed(false, true);
        assert!(
            matches!(gate.turn(hour), Turn::Wait(until) if until == now() + FIRST_CANCEL_BACKOFF)
        );
        gate.probed(true, false);
        assert!(matches!(gate.turn(hour), Turn::Free));
    }

    /// While a direct connection hangs, a few cancels retry at once; a place is free again
    /// when its retry ends, or when its hold does (a retry dropped mid-call, or never polled
    /// again: at most 5 s, whatever the budget). Once Redis answers, every cancel may retry.
    #[tokio::test(start_paused = true)]
    async fn a_few_cancels_retry_at_once_while_redis_hangs() {
        let gate = CancelGate::default();
        let budget = Duration::from_millis(500);
        let place = |gate: &CancelGate, hold| match gate.retry(hold) {
            Retry::Placed(place) => Some(place),
            Retry::Full => None,
            Retry::Go => panic!("a place is needed while Redis hangs"),
        };
        assert!(matches!(gate.retry(budget), Retry::Go), "Redis answers");
        gate.tried(false);
        let places: Vec<_> = (0..CANCEL_RETRIES_IN_FLIGHT)
            .map(|_| place(&gate, budget).expect("a free place"))
            .collect();
        assert!(place(&gate, budget).is_none(), "every place taken");
        gate.retried(places[0]);
        let again = place(&gate, budget).expect("the place the retry left");
        assert!(place(&gate, budget).is_none());
        // The holds end: every place is free, though three were never given back...
        tokio::time::sleep(budget).await;
        let hour = Duration::from_secs(3600);
        let later: Vec<_> = (0..CANCEL_RETRIES_IN_FLIGHT)
            .map(|_| place(&gate, hour).expect("a place whose hold ended"))
            .collect();
        assert!(place(&gate, budget).is_none());
        // ...and one given back late frees nothing another took since.
        gate.retried(places[1]);
        gate.retried(again);
        assert!(place(&gate, budget).is_none());
        gate.retried(later[0]);
        assert!(place(&gate, budget).is_some());
        // A hold is 5 s at most, whatever the budget: the three held for an hour are free.
        tokio::time::sleep(MAX_CANCEL_BACKOFF).await;
        for _ in 0..CANCEL_RETRIES_IN_FLIGHT {
            assert!(place(&gate, budget).is_some());
        }
        // Redis answered a cancel: the others go without a place.
        gate.tried(true);
        assert!(matches!(gate.retry(budget), Retry::Go));
    }

    /// What `INFO server` says decides: 6.x is refused with the node named, 7.x and later
    /// (Valkey says `redis_version:7.2.4` too) pass, and an answer without a version passes.
    #[test]
    fn a_redis_older_than_7_is_refused() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        let refused = judge_version("10.0.0.1:6379", &info("6.2.14"));
        assert!(
            matches!(&refused, Err(Error::Config(why)) if why.contains("6.2.14") && why.contains("10.0.0.1:6379")),
            "{refused:?}"
        );
        for passes in ["7.0.0", "7.2.4", "8.2.3"] {
            assert!(judge_version("", &info(passes)).is_ok(), "{passes}");
        }
        assert!(judge_version("", "# Server\r\nuptime_in_seconds:5\r\n").is_ok());
    }

    /// The legacy layout compared the token's text with what `Display` wrote.
    #[test]
    fn a_token_s_text_form_is_what_display_writes() {
        let token = LeaseToken::generate();
        let (raw, text) = token_forms(token);
        assert_eq!(
            std::str::from_utf8(&text).expect("ascii"),
            token.to_string()
        );
        assert_eq!(raw, *token.as_uuid().as_bytes());
    }

    /// A claim that finds its own lease (its `SET` sent twice, the first landed) owns it:
    /// read as someone else's, it was a lease nobody held, answered `InFlight`.
    #[test]
    fn a_claim_that_finds_its_own_lease_owns_it() {
        let token = LeaseToken::generate();
        let (raw, _) = token_forms(token);
        let fp = Fingerprint::of(b"request");
        let lease = scripts::value(b'0', fp.as_bytes(), &raw, &[]);
        let ttl = 30_000 + i64::try_from(grace()).unwrap_or(i64::MAX);
        assert!(matches!(
            read_record(&lease, ttl, &fp, &raw),
            Ok(Found::Ours { took: false })
        ));
        let took = scripts::value(b'0', fp.as_bytes(), &raw, b"t");
        assert!(matches!(
            read_record(&took, ttl, &fp, &raw),
            Ok(Found::Ours { took: true })
        ));
        let (other, _) = token_forms(LeaseToken::generate());
        assert!(matches!(
            read_record(&lease, ttl, &fp, &other),
            Ok(Found::Answer(Begin::InFlight { .. }))
        ));
        // Known from the claim's own answer, without the second read for the TTL.
        assert_eq!(own_lease(&lease, &raw), Some(false));
        assert_eq!(own_lease(&took, &raw), Some(true));
        assert_eq!(own_lease(&lease, &other), None);
        let done = scripts::value(b'1', fp.as_bytes(), &raw, b"");
        assert_eq!(
            own_lease(&done, &raw),
            None,
            "a completed record is no lease"
        );
        assert_eq!(ours(true, token), Begin::TakeOver(token));
    }
}
