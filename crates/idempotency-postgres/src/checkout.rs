//! Statements on pooled connections that are closed, not handed back, when their future is
//! dropped before the statement ended.
//!
//! sqlx hands a dropped connection back to its pool by pinging it first, which waits for the
//! rest of the interrupted statement's answer, with no timeout. A statement given up on a
//! connection that hangs (its host vanished in a failover: no reset, only TCP's own timeout,
//! about 15 minutes) keeps its pool slot that long; the four connections of the batches go
//! first, and every call then fails with a pool timeout although the new primary answers.
//! A [`Checkout`] dropped mid-statement closes its connection instead (sqlx bounds that close
//! at 5 s), and the pool opens a fresh one; a finished one is handed back within 5 s too
//! (the same unbounded ping, after a statement that answered, hangs as long when the host
//! vanishes in between).

use std::{future::Future, time::Duration};

use sqlx::{
    PgPool, Postgres,
    pool::PoolConnection,
    postgres::{PgArguments, PgQueryResult, PgRow},
    query::{Query, QueryAs},
};

/// How long a connection may take to be pinged on its way back to the pool (sqlx's bound on
/// closing one).
const HAND_BACK_LIMIT: Duration = Duration::from_secs(5);

/// Where a [`Checkout`] comes from: a pool, and how long to wait for one of its connections
/// when every one it may open is checked out.
pub(crate) trait Source: Sync {
    fn pool(&self) -> &PgPool;

    /// The wait for a connection when all of them are out; `None`: the pool's acquire
    /// timeout, as for any wait.
    fn all_out_wait(&self) -> Option<Duration> {
        None
    }
}

impl Source for PgPool {
    fn pool(&self) -> &PgPool {
        self
    }
}

/// How long a batch waits for one of its own connections when every one is out: long enough
/// for one on its way back to the pool (pinged first: a round trip), far shorter than the
/// pool's acquire timeout.
pub(crate) const ALL_OUT_WAIT: Duration = Duration::from_millis(250);

/// The group commit's pool. Its own few connections (four per batch in flight) are out only
/// briefly, unless held by lone calls their callers keep unpolled: a batch that finds them
/// all out waits for one only [`ALL_OUT_WAIT`], then gives its calls back to the
/// per-request pool. Waiting the pool's whole acquire timeout (2 s by default)
/// spent most of a claim's budget before it went the per-request way. On a pool shared
/// with the per-request path (a store made `from_pool`) it waits as any call does: all
/// out is then ordinary load, and the per-request path would wait for the same pool.
#[derive(Clone)]
pub(crate) struct BatchPool {
    pub(crate) pool: PgPool,
    pub(crate) all_out_wait: Option<Duration>,
}

impl Source for BatchPool {
    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn all_out_wait(&self) -> Option<Duration> {
        self.all_out_wait
    }
}

/// A pooled connection checked out for one statement: closed if dropped before
/// [`Checkout::finished`], handed back to the pool after it.
pub(crate) struct Checkout(Option<PoolConnection<Postgres>>);

impl Checkout {
    /// A connection of `source`: `PoolTimedOut` if none came within its wait.
    pub(crate) async fn acquire(source: &impl Source) -> Result<Self, sqlx::Error> {
        let pool = source.pool();
        let conn = match source.all_out_wait() {
            // Checked once, on the way in: a pool that fills up while this call waits makes it
            // wait the acquire timeout, as it would have anyway. Cut short, the acquire
            // closes whatever connection it was opening or pinging (sqlx pools none it gave
            // up on): nothing of ours was sent on it.
            Some(wait)
                if pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections() =>
            {
                tokio::time::timeout(wait, pool.acquire())
                    .await
                    .map_err(|_| sqlx::Error::PoolTimedOut)??
            }
            _ => pool.acquire().await?,
        };
        Ok(Self(Some(conn)))
    }

    /// A connection to send a statement on, if `send` still says so once one is in hand
    /// (it settles with whoever gives the statement up whether it is sent: see
    /// [`OnWire`](crate::batch::OnWire)); `None`, the connection back in the pool, if not.
    /// An error getting one sent nothing.
    pub(crate) async fn acquire_to_send(
        pool: &impl Source,
        send: impl FnOnce() -> bool,
    ) -> Result<Option<Self>, sqlx::Error> {
        let checkout = Self::acquire(pool).await?;
        if send() {
            Ok(Some(checkout))
        } else {
            checkout.finished();
            Ok(None)
        }
    }

    pub(crate) fn conn(&mut self) -> &mut sqlx::PgConnection {
        self.0
            .as_deref_mut()
            .expect("a checkout holds its connection until it is finished")
    }

    /// The statement ended (answered or failed): the connection goes back to the pool, which
    /// pings it first. sqlx's ping has no timeout: a connection whose host vanished during
    /// it (a failover under load, when about as many connections are in that ping as in a
    /// statement) would keep its pool slot for TCP's own timeout. The hand-back is bounded
    /// here, as sqlx bounds a close: past it the connection is dropped and its slot freed.
    pub(crate) fn finished(mut self) {
        if let Some(mut conn) = self.0.take() {
            let back = conn.return_to_pool();
            // Emptied: its own drop hands nothing back.
            drop(conn);
            tokio::spawn(async move {
                if tokio::time::timeout(HAND_BACK_LIMIT, back).await.is_err() {
                    tracing::warn!("a connection hung on its way back to the pool; dropped");
                }
            });
        }
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.0 {
            conn.close_on_drop();
        }
    }
}

/// `fetch_optional`, `fetch_one` and `fetch_all` of a typed query on a [`Checkout`].
pub(crate) trait QueryAsOnPool<O> {
    fn fetch_optional_on(
        self,
        pool: &impl Source,
    ) -> impl Future<Output = Result<Option<O>, sqlx::Error>> + Send;
    fn fetch_one_on(
        self,
        pool: &impl Source,
    ) -> impl Future<Output = Result<O, sqlx::Error>> + Send;
    fn fetch_all_on(
        self,
        pool: &impl Source,
    ) -> impl Future<Output = Result<Vec<O>, sqlx::Error>> + Send;
}

impl<'q, O> QueryAsOnPool<O> for QueryAs<'q, Postgres, O, PgArguments>
where
    O: Send + Unpin + for<'r> sqlx::FromRow<'r, PgRow> + 'q,
{
    async fn fetch_optional_on(self, pool: &impl Source) -> Result<Option<O>, sqlx::Error> {
        let mut checkout = Checkout::acquire(pool).await?;
        let answer = self.fetch_optional(checkout.conn()).await;
        checkout.finished();
        answer
    }

    async fn fetch_one_on(self, pool: &impl Source) -> Result<O, sqlx::Error> {
        let mut checkout = Checkout::acquire(pool).await?;
        let answer = self.fetch_one(checkout.conn()).await;
        checkout.finished();
        answer
    }

    async fn fetch_all_on(self, pool: &impl Source) -> Result<Vec<O>, sqlx::Error> {
        let mut checkout = Checkout::acquire(pool).await?;
        let answer = self.fetch_all(checkout.conn()).await;
        checkout.finished();
        answer
    }
}

/// `execute` of an untyped query on a [`Checkout`].
pub(crate) trait QueryOnPool {
    fn execute_on(
        self,
        pool: &impl Source,
    ) -> impl Future<Output = Result<PgQueryResult, sqlx::Error>> + Send;
}

impl QueryOnPool for Query<'_, Postgres, PgArguments> {
    async fn execute_on(self, pool: &impl Source) -> Result<PgQueryResult, sqlx::Error> {
        let mut checkout = Checkout::acquire(pool).await?;
        let answer = self.execute(checkout.conn()).await;
        checkout.finished();
        answer
    }
}
