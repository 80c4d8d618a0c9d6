//! A Redis Streams consumer group that applies charge messages exactly once.
//!
//! Streams deliver at least once: a consumer that dies after doing the work but before
//! `XACK` gets the message again (another consumer claims it with `XAUTOCLAIM`), and producers
//! that retry publish the same charge twice. Each message names its charge; the
//! [`Executor`](idempotency::Executor) runs the effect once per charge id over the Postgres
//! store, and every repeat — redelivery or duplicate — replays the stored result and is
//! acknowledged without a second effect.
//!
//! Run the example with: `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run -p stream-consumer`

use std::{sync::Arc, time::Duration};

use idempotency::{
    Executor, Fingerprint, IdempotencyKey, RunError, Scope, postgres::PostgresStore,
};
use redis::{
    AsyncCommands,
    aio::MultiplexedConnection,
    streams::{
        StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions, StreamReadReply,
    },
};
use sqlx::PgPool;

/// What can stop a consumer.
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    /// Redis failed.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// The idempotency store failed.
    #[error(transparent)]
    Store(#[from] idempotency::Error),
    /// A message lacks `charge_id` or `amount`.
    #[error("malformed message {0}")]
    Malformed(String),
    /// The fault the tests inject: the process "dies" after the effect, before `XACK`.
    #[error("crashed before acknowledging {0}")]
    Crashed(String),
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
    /// Messages this poll acknowledged first (`XACK` answers 0 for a message another
    /// consumer already acknowledged: at-least-once delivery can hand one message to two).
    pub acked: u64,
}

/// One consumer of a group.
pub struct Consumer {
    redis: MultiplexedConnection,
    pool: PgPool,
    executor: Executor<PostgresStore>,
    stream: String,
    group: String,
    name: String,
    ledger: String,
    /// Messages idle this long in another consumer's pending list are claimed.
    pub claim_idle: Duration,
    /// Test fault: crash after the effect of this charge, before its `XACK`.
    pub crash_before_ack: Option<String>,
}

impl Consumer {
    /// A consumer `name` in `group` on `stream`, writing its effect to the `ledger` table.
    ///
    /// Give every consumer its own connection: `XREADGROUP BLOCK` holds the connection it
    /// runs on, so consumers sharing one would wait on each other's reads.
    pub fn new(
        redis: MultiplexedConnection,
        store: Arc<PostgresStore>,
        stream: &str,
        group: &str,
        name: &str,
        ledger: &str,
    ) -> Self {
        Self {
            redis,
            pool: store.pool().clone(),
            executor: Executor::new(store),
            stream: stream.into(),
            group: group.into(),
            name: name.into(),
            ledger: ledger.into(),
            claim_idle: Duration::from_secs(30),
            crash_before_ack: None,
        }
    }

    /// Creates the group (from the stream's start) and the ledger table, if missing.
    pub async fn setup(&mut self) -> Result<(), ConsumeError> {
        let created: redis::RedisResult<()> = self
            .redis
            .xgroup_create_mkstream(&self.stream, &self.group, "0")
            .await;
        // BUSYGROUP: the group exists already, which is what we want.
        if let Err(error) = created
            && error.code() != Some("BUSYGROUP")
        {
            return Err(error.into());
        }
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

    /// Claims messages other consumers left pending too long, then reads new ones; applies
    /// and acknowledges each.
    pub async fn poll(&mut self, count: usize) -> Result<Polled, ConsumeError> {
        let mut polled = Polled::default();
        let idle = u64::try_from(self.claim_idle.as_millis()).unwrap_or(u64::MAX);
        let claimed: StreamAutoClaimReply = self
            .redis
            .xautoclaim_options(
                &self.stream,
                &self.group,
                &self.name,
                idle,
                "0-0",
                StreamAutoClaimOptions::default().count(count),
            )
            .await?;
        let options = StreamReadOptions::default()
            .group(&self.group, &self.name)
            .count(count)
            .block(100);
        let read: Option<StreamReadReply> = self
            .redis
            .xread_options(&[&self.stream], &[">"], &options)
            .await?;
        let fresh = read.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids);
        for message in claimed.claimed.into_iter().chain(fresh) {
            self.handle(&message, &mut polled).await?;
        }
        Ok(polled)
    }

    async fn handle(
        &mut self,
        message: &StreamId,
        polled: &mut Polled,
    ) -> Result<(), ConsumeError> {
        let charge_id: String = message
            .get("charge_id")
            .ok_or_else(|| ConsumeError::Malformed(message.id.clone()))?;
        let amount: i64 = message
            .get("amount")
            .ok_or_else(|| ConsumeError::Malformed(message.id.clone()))?;
        let key = IdempotencyKey::new(charge_id.clone())
            .map_err(|e| ConsumeError::Malformed(e.to_string()))?;
        let scope = Scope::new(format!("stream:{}:{}", self.stream, self.group));
        let (pool, ledger) = (&self.pool, &self.ledger);
        let result = self
            .executor
            .run(
                &scope,
                &key,
                &Fingerprint::of(&amount.to_be_bytes()),
                || async {
                    let insert =
                        format!("INSERT INTO {ledger} (charge_id, amount) VALUES ($1, $2)");
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(&charge_id)
                        .bind(amount)
                        .execute(pool)
                        .await?;
                    Ok::<_, sqlx::Error>(format!("applied {charge_id}"))
                },
            )
            .await;
        match result {
            Ok(done) if done.replayed => polled.replayed += 1,
            Ok(_) => polled.applied += 1,
            // Someone else is applying this charge right now: leave the message pending; it
            // is claimed again after `claim_idle` and then replays.
            Err(RunError::InFlight { .. }) => {
                polled.deferred += 1;
                return Ok(());
            }
            // A transient failure: the key was released; leave the message for redelivery.
            Err(RunError::Failed(error)) => {
                tracing::warn!(%error, charge = %charge_id, "effect failed; will be redelivered");
                return Ok(());
            }
            Err(RunError::Store(error)) => return Err(error.into()),
            Err(other) => return Err(ConsumeError::Malformed(other.to_string())),
        }
        if self.crash_before_ack.as_deref() == Some(charge_id.as_str()) {
            return Err(ConsumeError::Crashed(charge_id));
        }
        let acked: u64 = self
            .redis
            .xack(&self.stream, &self.group, &[&message.id])
            .await?;
        polled.acked += acked;
        Ok(())
    }
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
