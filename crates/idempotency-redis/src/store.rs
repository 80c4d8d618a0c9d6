//! `RedisStore`: the record state machine in one Redis string per record, one round trip per
//! operation: plain commands where they suffice, Lua scripts where a write is fenced.

use std::{future::Future, sync::Arc, time::Duration};

use async_trait::async_trait;
use idempotency_core::{
    Begin, Error, Fingerprint, LeaseToken, Outcome, RecordId, Result, Store, detached_claim,
};
use redis::{
    Cmd, Pipeline, RedisFuture, Script, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
};

use crate::scripts;

/// What the read-only [`RedisStore::peek`] finds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peek {
    /// No record (never written, expired, evicted or flushed).
    Absent,
    /// A record that answers `begin` by itself: `Replay`, `InFlight` or `Mismatch`.
    Found(Begin),
}

/// Connection to a standalone Redis or a cluster, both cheap to clone.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
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
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
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
    release: Script,
    renew: Script,
}

/// A [`Store`] on Redis: the fast path.
///
/// Every operation is one round trip and atomic: a claim is a plain `SET NX GET` (with
/// `PTTL` in the same pipeline), the token-fenced writes are Lua scripts (see the layout in
/// `scripts.rs`). Lease and retention are key TTLs counted by Redis. Calls are bounded three ways: a connect timeout, a response
/// timeout, and a hard budget per call, so a hung Redis costs at most the budget and then
/// [`Error::Unavailable`].
///
/// **Redis alone is not a guarantee.** An evicted, flushed or lost key is a forgotten record,
/// and the next retry executes again. [`RedisStoreBuilder::connect`] therefore refuses a Redis
/// whose `maxmemory-policy` evicts (anything but `noeviction`) unless told to accept it, and
/// persistence/failover loss remains. For money, put Postgres behind it (the hybrid store).
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
pub enum EvictionCheck {
    /// Refuse to start (the default for a Redis-only store).
    Refuse,
    /// Log a warning and start: the caller accepts that evicted records execute again.
    Warn,
    /// Do not check (the hybrid store, where Postgres decides and eviction costs latency only).
    Skip,
}

/// Configures and connects a [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    urls: Vec<String>,
    cluster: bool,
    prefix: String,
    connect_timeout: Duration,
    response_timeout: Duration,
    budget: Duration,
    eviction: EvictionCheck,
}

impl RedisStoreBuilder {
    /// Key prefix (default `idem`). Keys are `{prefix}:{<record id hex>}`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// TCP connect timeout (default 250 ms).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Per-command response timeout (default 250 ms).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// The hard budget of one store call, reconnects included (default 500 ms).
    pub fn call_budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// What to do when `maxmemory-policy` evicts (default [`EvictionCheck::Refuse`]).
    pub fn eviction_check(mut self, check: EvictionCheck) -> Self {
        self.eviction = check;
        self
    }

    /// Connects (lazily for a standalone Redis, so the store can start while Redis is down
    /// when the eviction check is skipped), then checks the eviction policy.
    pub async fn connect(self) -> Result<RedisStore> {
        let conn = if self.cluster {
            self.connect_cluster().await?
        } else {
            let client = redis::Client::open(self.urls[0].as_str())
                .map_err(|e| Error::Config(format!("invalid Redis URL: {e}")))?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(self.connect_timeout))
                .set_response_timeout(Some(self.response_timeout))
                // Reconnects happen on the next call; a call never sleeps through retries
                // longer than its budget allows.
                .set_number_of_retries(1)
                .set_max_delay(self.connect_timeout);
            Conn::Single(
                ConnectionManager::new_lazy_with_config(client, config)
                    .map_err(Error::unavailable)?,
            )
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
                release: scripts::release(),
                renew: scripts::renew(),
            }),
        };
        match self.eviction {
            EvictionCheck::Skip => {}
            check => store.check_eviction_policy(check).await?,
        }
        Ok(store)
    }

    #[cfg(feature = "cluster")]
    async fn connect_cluster(&self) -> Result<Conn> {
        let client = redis::cluster::ClusterClient::builder(self.urls.clone())
            .connection_timeout(self.connect_timeout)
            .response_timeout(self.response_timeout)
            .retries(1)
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

fn grace() -> u64 {
    millis(idempotency_core::LATE_COMPLETION_GRACE)
}

fn grace_ms() -> String {
    grace().to_string()
}

/// A lease token as the layout stores it (16 bytes), and as the legacy hash did (text).
fn token_forms(token: LeaseToken) -> ([u8; 16], String) {
    (*token.as_uuid().as_bytes(), token.to_string())
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
}

/// Reads a record of the current layout (`value`, with `pttl` ms left) for a claim with
/// fingerprint `fp` and token `token`.
fn read_record(value: &[u8], pttl: i64, fp: &Fingerprint, token: &[u8; 16]) -> Result<Found> {
    if value.len() < scripts::OUTCOME {
        return Err(Error::Corrupt("a record shorter than its header".into()));
    }
    let same_fp = value[scripts::FP] == fp.as_bytes()[..];
    let left = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0).max(1));
    // Gone (or expiring) between the two commands: free.
    if pttl < 0 && pttl != -1 {
        return Ok(Found::Free);
    }
    Ok(match value[0] {
        b'c' if value[scripts::TOKEN] == token[..] => Found::Cancelled,
        b'c' => Found::Free,
        b'0' => {
            let lease_left = pttl - i64::try_from(grace()).unwrap_or(i64::MAX);
            if pttl != -1 && lease_left <= 0 {
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
            prefix: "idem".into(),
            connect_timeout: Duration::from_millis(250),
            response_timeout: Duration::from_millis(250),
            budget: Duration::from_millis(500),
            eviction: EvictionCheck::Refuse,
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

    /// The Redis key of a record: the id is a hash tag, so a record's keys share one slot.
    pub fn key(&self, id: &RecordId) -> String {
        format!("{}:{{{}}}", self.prefix, id.to_hex())
    }

    async fn timed<T>(&self, call: impl Future<Output = redis::RedisResult<T>>) -> Result<T> {
        match tokio::time::timeout(self.budget, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(Error::unavailable(error)),
            Err(_) => Err(Error::unavailable(format!(
                "Redis did not answer within {:?}",
                self.budget
            ))),
        }
    }

    async fn check_eviction_policy(&self, check: EvictionCheck) -> Result<()> {
        let mut conn = self.conn.clone();
        let reply: redis::RedisResult<Vec<String>> = self
            .timed(async {
                Ok(redis::cmd("CONFIG")
                    .arg("GET")
                    .arg("maxmemory-policy")
                    .query_async(&mut conn)
                    .await)
            })
            .await?;
        let policy = match reply {
            Ok(pair) if pair.len() == 2 => pair[1].clone(),
            // Managed Redis often disables CONFIG: we cannot know, so say so and go on.
            Ok(_) | Err(_) => {
                tracing::warn!(
                    "cannot read Redis maxmemory-policy (CONFIG disabled?): make sure it is `noeviction`, \
                     or an evicted idempotency record will execute again"
                );
                return Ok(());
            }
        };
        if policy == "noeviction" {
            return Ok(());
        }
        let why = format!(
            "Redis maxmemory-policy is `{policy}`: under memory pressure Redis silently deletes idempotency \
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
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let mut conn = self.conn.clone();
        match tokio::time::timeout(budget, invocation.invoke_async(&mut conn)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(Error::unavailable(error)),
            Err(_) => Err(Error::unavailable(format!(
                "Redis did not answer within {budget:?}"
            ))),
        }
    }

    /// The claim, run to its end in a task of its own (see [`Store::begin`]): a plain
    /// `SET NX GET` with `PTTL` in one pipeline; the takeover script only when the record it
    /// found is free to take (a lease that is over, a cancel marker), the legacy script only
    /// for a record of the earlier layout.
    async fn claim(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        let token = LeaseToken::generate();
        let (raw, _) = token_forms(token);
        let key = self.key(id);
        let ttl = millis(lease).saturating_add(grace());
        let fresh = scripts::value(b'0', fp.as_bytes(), &raw, &[]);
        // Longer than the caller waits: an answer that comes late is still read, and a lease
        // it granted released, rather than left to expire.
        let budget = self.budget * 4;
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(&key)
            .arg(&fresh)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(ttl)
            .cmd("PTTL")
            .arg(&key);
        let mut conn = self.conn.clone();
        let claimed: Result<(Option<Vec<u8>>, i64)> =
            match tokio::time::timeout(budget, pipe.query_async(&mut conn)).await {
                Ok(Ok(reply)) => Ok(reply),
                Ok(Err(error)) if wrong_type(&error) => {
                    return self.claim_legacy(id, fp, lease, token).await;
                }
                // Refused: nothing was sent, nothing can land late.
                Ok(Err(error)) if error.is_connection_refusal() => {
                    return Err(Error::unavailable(error));
                }
                Ok(Err(error)) => Err(Error::unavailable(error)),
                Err(_) => Err(Error::unavailable(format!(
                    "Redis did not answer within {budget:?}"
                ))),
            };
        let found = match claimed {
            Ok((None, _)) => return Ok(Begin::Execute(token)),
            Ok((Some(value), pttl)) => read_record(&value, pttl, fp, &raw),
            Err(error) => {
                self.cancel_later(id, token);
                return Err(error);
            }
        };
        match found? {
            Found::Answer(answer) => Ok(answer),
            Found::Cancelled => Err(Error::unavailable(
                "the claim ran after it was given up and cancelled",
            )),
            Found::Free => self.take_over(id, fp, lease, token, &fresh).await,
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
        let ttl = millis(lease).saturating_add(grace()).to_string();
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
                self.cancel_later(id, token);
                return Err(error);
            }
        };
        match (items.first(), items.get(1), items.get(2)) {
            (Some(Value::BulkString(tag)), _, _) if tag == b"x" => {
                tracing::info!(record = %id, "took over an expired idempotency lease");
                Ok(Begin::Execute(token))
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
                    // The script found it live; a clock edge between its two reads here.
                    _ => Ok(Begin::InFlight {
                        retry_after: Duration::from_millis(1),
                    }),
                }
            }
            _ => Err(Error::Corrupt("malformed takeover reply".into())),
        }
    }

    /// The claim on a key that still holds a record of the earlier (hash) layout.
    async fn claim_legacy(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        token: LeaseToken,
    ) -> Result<Begin> {
        let (_, text) = token_forms(token);
        let lease = millis(lease).to_string();
        let keys = [self.key(id), self.tombstone(id, token)];
        let claimed: Result<Value> = self
            .run_keys(
                self.budget * 4,
                &self.scripts.legacy_begin,
                &keys,
                &[
                    &fp.as_bytes()[..],
                    text.as_bytes(),
                    lease.as_bytes(),
                    grace_ms().as_bytes(),
                ],
            )
            .await;
        match claimed {
            Ok(value) => parse_begin(value, token),
            Err(error) => {
                self.cancel_later(id, token);
                Err(error)
            }
        }
    }

    /// Unknown whether a claim ran, or will: a hung Redis runs the commands queued on the
    /// connection when it resumes, after the client gave up. Cancel it in a way that holds in
    /// either order (see `scripts::cancel`).
    fn cancel_later(&self, id: &RecordId, token: LeaseToken) {
        let (this, id) = (self.clone(), *id);
        tokio::spawn(async move { this.cancel_claim(&id, token).await });
    }

    /// The tombstone of one claim: same hash tag, so same cluster slot, as the record.
    fn tombstone(&self, id: &RecordId, token: LeaseToken) -> String {
        format!("{}:{{{}}}:cancelled:{token}", self.prefix, id.to_hex())
    }

    /// Retries the cancel script until Redis answers (for at most the grace period): until
    /// then a late claim could still land.
    async fn cancel_claim(&self, id: &RecordId, token: LeaseToken) {
        let (raw, text) = token_forms(token);
        let keys = [self.key(id), self.tombstone(id, token)];
        let ttl = grace_ms();
        let give_up = tokio::time::Instant::now() + idempotency_core::LATE_COMPLETION_GRACE;
        let mut backoff = Duration::from_millis(50);
        while tokio::time::Instant::now() < give_up {
            let undone: Result<i64> = self
                .run_keys(
                    self.budget,
                    &self.scripts.cancel,
                    &keys,
                    &[&raw, text.as_bytes(), ttl.as_bytes()],
                )
                .await;
            match undone {
                Ok(_) => return,
                Err(error) => {
                    tracing::debug!(%error, record = %id, "cancelling an unanswered claim; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        tracing::warn!(record = %id, "could not cancel an unanswered claim; it expires with its lease");
    }

    /// Reads a record without changing it: what the hybrid store asks before Postgres.
    ///
    /// A plain `GET` and `PTTL` in one pipeline: no script.
    pub async fn peek(&self, id: &RecordId, fp: &Fingerprint) -> Result<Peek> {
        let key = self.key(id);
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(&key).cmd("PTTL").arg(&key);
        let read: redis::RedisResult<(Option<Vec<u8>>, i64)> =
            match tokio::time::timeout(self.budget, pipe.query_async(&mut conn)).await {
                Ok(read) => read,
                Err(_) => {
                    return Err(Error::unavailable(format!(
                        "Redis did not answer within {:?}",
                        self.budget
                    )));
                }
            };
        let (value, pttl) = match read {
            Ok(read) => read,
            Err(error) if wrong_type(&error) => {
                return self.peek_legacy(&key, fp).await;
            }
            Err(error) => return Err(Error::unavailable(error)),
        };
        let Some(value) = value else {
            return Ok(Peek::Absent);
        };
        // A peek claims nothing: any token will do for reading.
        Ok(match read_record(&value, pttl, fp, &[0; 16])? {
            Found::Answer(answer) => Peek::Found(answer),
            Found::Free | Found::Cancelled => Peek::Absent,
        })
    }

    /// [`RedisStore::peek`] on a record of the earlier (hash) layout.
    async fn peek_legacy(&self, key: &str, fp: &Fingerprint) -> Result<Peek> {
        let mut conn = self.conn.clone();
        let [state, stored_fp, out]: [Option<Vec<u8>>; 3] = self
            .timed(
                redis::cmd("HMGET")
                    .arg(key)
                    .arg("st")
                    .arg("fp")
                    .arg("out")
                    .query_async(&mut conn),
            )
            .await?;
        let Some(state) = state else {
            return Ok(Peek::Absent);
        };
        if stored_fp.as_deref() != Some(&fp.as_bytes()[..]) {
            return Ok(Peek::Found(Begin::Mismatch));
        }
        if state == b"1" {
            let out =
                out.ok_or_else(|| Error::Corrupt("completed record without outcome".into()))?;
            return Ok(Peek::Found(Begin::Replay(decode_outcome(&out)?)));
        }
        let pttl: i64 = self
            .timed(redis::cmd("PTTL").arg(key).query_async(&mut conn))
            .await?;
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

    /// Caches an outcome stored elsewhere (Postgres) for `ttl`: a plain `SET PX`, replacing
    /// whatever is there (a mirrored lease: the outcome is the truth).
    pub async fn cache_completed(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        outcome: &Outcome,
        ttl: Duration,
    ) -> Result<()> {
        let mut conn = self.conn.clone();
        let _: Option<String> = self
            .timed(
                redis::cmd("SET")
                    .arg(self.key(id))
                    .arg(scripts::value(
                        b'1',
                        fp.as_bytes(),
                        &[0; 16],
                        &outcome.encode(),
                    ))
                    .arg("PX")
                    .arg(millis(ttl))
                    .query_async(&mut conn),
            )
            .await?;
        Ok(())
    }

    /// The hard budget of one call (see [`RedisStoreBuilder::call_budget`]).
    pub fn call_budget(&self) -> Duration {
        self.budget
    }

    /// Sends `PING`: how the hybrid store's breaker probes.
    pub async fn ping(&self) -> Result<()> {
        let mut conn = self.conn.clone();
        let _: String = self
            .timed(redis::cmd("PING").query_async(&mut conn))
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

#[async_trait]
impl Store for RedisStore {
    /// Cancel-safe: the script runs in a task of its own, and a lease it grants after this
    /// call was dropped or ran out of budget is released (see [`detached_claim`]).
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        let (this, releaser, id, fp) = (self.clone(), self.clone(), *id, *fp);
        let claim = async move { this.claim(&id, &fp, lease).await };
        let release = move |token| -> futures::future::BoxFuture<'static, ()> {
            Box::pin(async move { idempotency_core::release_orphan(&releaser, &id, token).await })
        };
        match tokio::time::timeout(self.budget, detached_claim(claim, release)).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::unavailable(format!(
                "Redis did not answer within {:?}",
                self.budget
            ))),
        }
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        let (raw, text) = token_forms(token);
        let retention = millis(retention).to_string();
        let done: i64 = self
            .run(
                &self.scripts.complete,
                id,
                &[
                    &raw,
                    text.as_bytes(),
                    &outcome.encode()[..],
                    retention.as_bytes(),
                ],
            )
            .await?;
        Self::fenced(done)
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        let (raw, text) = token_forms(token);
        let done: i64 = self
            .run(&self.scripts.release, id, &[&raw, text.as_bytes()])
            .await?;
        Self::fenced(done)
    }

    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        let (raw, text) = token_forms(token);
        let lease = millis(lease).to_string();
        let done: i64 = self
            .run(
                &self.scripts.renew,
                id,
                &[
                    &raw,
                    text.as_bytes(),
                    lease.as_bytes(),
                    grace_ms().as_bytes(),
                ],
            )
            .await?;
        Self::fenced(done)
    }

    /// Redis expires records by itself (key TTLs): nothing to purge.
    async fn purge_expired(&self, _batch: usize) -> Result<u64> {
        Ok(0)
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}
