//! Statements on pooled connections that are closed, not handed back, when their future is
//! dropped before the statement ended.
//!
//! sqlx hands a dropped connection back to its pool by pinging it first, which waits for the
//! rest of the interrupted statement's answer, with no timeout. A statement given up on a
//! connection that hangs (its host vanished in a failover: no reset, only TCP's own timeout,
//! about 15 minutes) keeps its pool slot that long; the four connections of the batches go
//! first, and every call then fails with a pool timeout although the new primary answers.
//! A [`Checkout`] dropped mid-statement closes its connection instead (sqlx bounds that close
//! at 5 s), and the pool opens a fresh one.

use std::future::Future;

use sqlx::{
    PgPool, Postgres,
    pool::PoolConnection,
    postgres::{PgArguments, PgQueryResult, PgRow},
    query::{Query, QueryAs},
};

/// A pooled connection checked out for one statement: closed if dropped before
/// [`Checkout::finished`], handed back to the pool after it.
pub(crate) struct Checkout(Option<PoolConnection<Postgres>>);

impl Checkout {
    pub(crate) async fn acquire(pool: &PgPool) -> Result<Self, sqlx::Error> {
        Ok(Self(Some(pool.acquire().await?)))
    }

    pub(crate) fn conn(&mut self) -> &mut sqlx::PgConnection {
        self.0
            .as_deref_mut()
            .expect("a checkout holds its connection until it is finished")
    }

    /// The statement ended (answered or failed): the connection goes back to the pool, which
    /// checks it as usual (a broken one fails that check at once).
    pub(crate) fn finished(mut self) {
        self.0.take();
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
