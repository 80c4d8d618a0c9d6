//! The store's connection: one multiplexed connection to a standalone Redis, replaced when it
//! stops answering, or a cluster connection.
//!
//! redis-rs reconnects when a command fails with an error it sees (a reset, a closed socket).
//! A connection whose server vanished without a reset (a failover behind a virtual IP, a NAT
//! that dropped the flow) shows no error: commands are sent and never answered, until TCP
//! gives up after about 15 minutes. Every store call is bounded by its budget, so each one
//! ends as `Unavailable` and drops its command, which redis-rs never counts. Until then a
//! process would answer 503 to every request and its running operations could neither renew
//! nor complete their leases, so a retry served by another process would take their keys over
//! and run them a second time. So the calls given up are counted here: after
//! [`STALLS_BEFORE_REPLACING`] in a row, with no answer for at least a call budget, the
//! connection is replaced by a new one (opened on the next call).
//!
//! A replacement is safe for the guarantee: commands still on the old connection may land
//! late, as after any reconnect, and every write is fenced for that (see the store).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use arc_swap::ArcSwap;
use redis::{
    Cmd, Pipeline, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig},
};

/// Calls given up unanswered in a row after which a connection is replaced (with no answer
/// on it for a call budget either): one slow answer is not a dead connection.
pub(crate) const STALLS_BEFORE_REPLACING: u32 = 3;

/// Connection to a standalone Redis or a cluster, both cheap to clone.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(Arc<Single>),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

/// A standalone Redis's connection, and how to replace it.
pub(crate) struct Single {
    current: ArcSwap<Current>,
    /// How to open a new one; `None` for a manager the application gave (its own to manage).
    remake: Option<(redis::Client, ConnectionManagerConfig)>,
    /// No answer for this long (with the calls in a row given up) is a dead connection.
    silence: Duration,
    /// When the connection last answered, in ms since `base`.
    answered_at: AtomicU64,
    base: Instant,
}

/// One connection, and the calls given up on it in a row.
struct Current {
    manager: ConnectionManager,
    stalls: AtomicU32,
}

impl Conn {
    /// A connection this store opens, and replaces when it stops answering for `silence`.
    pub(crate) fn single(
        client: redis::Client,
        config: ConnectionManagerConfig,
        silence: Duration,
    ) -> redis::RedisResult<Self> {
        let manager = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?;
        Ok(Self::new_single(manager, Some((client, config)), silence))
    }

    /// A connection the application gave: never replaced here.
    pub(crate) fn given(manager: ConnectionManager) -> Self {
        Self::new_single(manager, None, Duration::MAX)
    }

    fn new_single(
        manager: ConnectionManager,
        remake: Option<(redis::Client, ConnectionManagerConfig)>,
        silence: Duration,
    ) -> Self {
        Conn::Single(Arc::new(Single {
            current: ArcSwap::from_pointee(Current {
                manager,
                stalls: AtomicU32::new(0),
            }),
            remake,
            silence,
            answered_at: AtomicU64::new(0),
            base: Instant::now(),
        }))
    }
}

impl Single {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Sends on the current connection; the returned guard counts the call given up if it
    /// is dropped unanswered.
    fn watch(self: &Arc<Self>) -> (ConnectionManager, Watch) {
        let current = self.current.load_full();
        let manager = current.manager.clone();
        let watch = Watch {
            single: self.clone(),
            current,
            sent_ms: self.now_ms(),
            answered: false,
        };
        (manager, watch)
    }

    /// `current` gave up another call: replaced if it has stopped answering.
    fn stalled(&self, current: &Arc<Current>) {
        let stalls = current.stalls.fetch_add(1, Ordering::Relaxed) + 1;
        let quiet_ms = self
            .now_ms()
            .saturating_sub(self.answered_at.load(Ordering::Relaxed));
        if stalls < STALLS_BEFORE_REPLACING || u128::from(quiet_ms) < self.silence.as_millis() {
            return;
        }
        let Some((client, config)) = &self.remake else {
            return;
        };
        let manager = match ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
        {
            Ok(manager) => manager,
            Err(error) => {
                tracing::warn!(%error, "could not make a new Redis connection");
                return;
            }
        };
        let fresh = Arc::new(Current {
            manager,
            stalls: AtomicU32::new(0),
        });
        // Only the connection that stalled is replaced: of two calls that see it at once,
        // the second finds it replaced already and leaves the new one alone.
        let previous = self.current.compare_and_swap(current, fresh);
        if Arc::ptr_eq(&previous, current) {
            tracing::warn!(
                stalls,
                quiet_ms,
                "the Redis connection stopped answering; replaced by a new one"
            );
        }
    }
}

/// A call on a connection: counted as given up unless it was answered.
struct Watch {
    single: Arc<Single>,
    current: Arc<Current>,
    /// When the call was sent, in ms since `single.base`.
    sent_ms: u64,
    answered: bool,
}

impl Watch {
    /// Notes an answer: anything but redis-rs' own response timeout (set with
    /// `RedisStoreBuilder::response_timeout`), which is a call given up like any other.
    fn answered_by<T>(&mut self, answer: &redis::RedisResult<T>) {
        if matches!(answer, Err(error) if error.is_timeout()) {
            return;
        }
        self.answered = true;
        self.current.stalls.store(0, Ordering::Relaxed);
        self.single
            .answered_at
            .store(self.single.now_ms(), Ordering::Relaxed);
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // A call dropped soon after it was sent (its request went away) says nothing of
        // the connection: only one that waited for half a budget or more counts.
        let waited_ms = self.single.now_ms().saturating_sub(self.sent_ms);
        if !self.answered && u128::from(waited_ms) * 2 >= self.single.silence.as_millis() {
            self.single.stalled(&self.current);
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(single) => {
                let (mut manager, mut watch) = single.watch();
                Box::pin(async move {
                    let answer = manager.req_packed_command(cmd).await;
                    watch.answered_by(&answer);
                    answer
                })
            }
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
            Conn::Single(single) => {
                let (mut manager, mut watch) = single.watch();
                Box::pin(async move {
                    let answer = manager.req_packed_commands(pipeline, offset, count).await;
                    watch.answered_by(&answer);
                    answer
                })
            }
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(single) => single.current.load().manager.get_db(),
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => c.get_db(),
        }
    }
}
