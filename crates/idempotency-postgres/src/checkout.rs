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

use std::future::Future;

use sqlx::{
    PgPool, Postgres,
    pool::PoolConnection,
    postgres::{PgArguments, PgQueryResult, PgRow},
    query::{Query, QueryAs},
};

/// How long a connection may take to be pinged on its way back to the pool (sqlx's bound on
/// closing one).
const HAND_BACK_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A pooled connection checked out for one statement: closed if dropped before
/// [`Checkout::finished`], handed back to the pool after it.
pub(crate) struct Checkout(Option<PoolConnection<Postgres>>);

impl Checkout {
    pub(crate) async fn acquire(pool: &PgPool) -> Result<Self, sqlx::Error> {
        Ok(Self(Some(pool.acquire().await?)))
    }

    /// A connection to send a statement on, if `send` still says so once one is in hand
    /// (it settles with whoever gives the statement up whether it is sent: see
    /// [`OnWire`](crate::batch::OnWire)); `None`, the connection back in the pool, if not.
    /// An error getting one sent nothing.
    pub(crate) async fn acquire_to_send(
        pool: &PgPool,
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
        pool: &PgPool,
    ) -> impl Future<Output = Result<Option<O>, sqlx::Error>> + Send;
    fn fetch_one_on(self, pool: &PgPool) -> impl Future<Output = Result<O, sqlx::Error>> + Send;
    fn fetch_all_on(
        self,
        pool: &PgPool,
    ) -> impl Future<Output = Result<Vec<O>, sqlx::Error>> + Send;
}

impl<'q, O> QueryAsOnPool<O> for QueryAs<'q, Postgres, O, PgArguments>
where
    O: Send + Unpin + for<'r> sqlx::FromRow<'r, PgRow> + 'q,
{
    async fn fetch_optional_on(self, pool: &PgPool) -> Result<Option<O>, sqlx::Error> {
        let mut checkout = Checkout::acquire(pool).await?;
        let answer = self.fetch_optional(checkout.conn()).await;
        checkout.finished();
        answer
    }

    async fn fetch_one_on(self, pool: &PgPool) -> Result<O, sqlx::Error> {
        let mut checkout = Checkout::acquire(pool).await?;
        let answer = self.fetch_one(checkout.conn()).await;
        checkout.finished();
        answer
    }

    async fn fetch_all_on(self, pool: &PgPool) -> Result<Vec<O>, sqlx::Error> {
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
        pool: &PgPool,
    ) -> impl Future<Output = Result<PgQueryResult, sqlx::Error>> + Send;
}

impl QueryOnPool for Query<'_, Postgres, PgArguments> {
    async fn execute_on(self, pool: &PgPool) -> Result<PgQueryResult, sqlx::Error> {
        let mut checkout = Checkout::acquire(pool).await?;
        let answer = self.execute(checkout.conn()).await;
        checkout.finished();
        answer
    }
}
