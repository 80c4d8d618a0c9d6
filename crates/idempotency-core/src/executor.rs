//! Run any async operation at most once per key: queue consumers, jobs, RPC handlers.

use std::{future::Future, panic::AssertUnwindSafe, sync::Arc, time::Duration};

use futures::FutureExt;
use serde::{Serialize, de::DeserializeOwned};
use tokio::time::Instant;

use crate::{Begin, Error, Fingerprint, IdempotencyKey, Outcome, Policy, RecordId, Scope, Store};

/// What [`Executor::run`] returns when the operation's result is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executed<T> {
    /// The operation's result: from this run, or stored by an earlier one.
    pub value: T,
    /// Whether it was replayed from the store rather than run now.
    pub replayed: bool,
}

/// Why [`Executor::run`] has no result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError<E> {
    /// Another attempt is running it now: retry after the delay (a consumer delays or NACKs
    /// the message instead of acknowledging it).
    #[error("another attempt holds the key; retry in {retry_after:?}")]
    InFlight {
        /// The rest of the other attempt's lease.
        retry_after: Duration,
    },
    /// The key was used with a different fingerprint: a different operation.
    #[error("the key was used for a different operation")]
    Mismatch,
    /// The operation failed; the key was released, so a redelivery runs it again.
    #[error("the operation failed and was released for a retry")]
    Failed(#[source] E),
    /// The operation panicked; the key was released.
    #[error("the operation panicked and was released for a retry")]
    Panicked,
    /// The store failed: unavailable (nothing ran), or the lease was lost before the result
    /// could be stored (the operation ran; whoever took over decides the stored result).
    #[error(transparent)]
    Store(Error),
}

/// Runs operations at most once per (scope, key, fingerprint), over any [`Store`].
///
/// The operation's `Ok` value is serialised (JSON) into the store and returned to every repeat;
/// an `Err` releases the key so a later delivery runs again. Return `Ok` for every result that
/// must not run twice — business failures included ("card declined" is a result) — and `Err`
/// only for transient failures. While the operation runs its lease is renewed; a panic releases
/// it. A crash leaves the lease to expire, after which a redelivery runs again: make the
/// effect itself idempotent (a unique constraint on the record id, or
/// `PostgresStore::complete_in` in the effect's transaction) where that window matters.
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{Executor, Fingerprint, IdempotencyKey, MemoryStore, Scope};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let executor = Executor::new(Arc::new(MemoryStore::new()));
/// let scope = Scope::new("charges-consumer");
/// let message_id = IdempotencyKey::new("msg-42").unwrap();
/// let payload = br#"{"amount":100}"#;
/// for _ in 0..2 {
///     let done = executor
///         .run(&scope, &message_id, &Fingerprint::of(payload), || async {
///             Ok::<_, std::io::Error>(format!("charged {}", 100)) // the effect, once
///         })
///         .await
///         .unwrap();
///     assert_eq!(done.value, "charged 100");
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Executor<S: ?Sized> {
    store: Arc<S>,
    policy: Policy,
}

impl<S: Store + ?Sized> Executor<S> {
    /// An executor with the default [`Policy`] (30 s lease, 24 h retention).
    pub fn new(store: Arc<S>) -> Self {
        Self {
            store,
            policy: Policy::default(),
        }
    }

    /// Replaces the policy (lease and retention; the cache rule does not apply here).
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Runs `op` unless it already ran for this key; see the type's docs.
    pub async fn run<T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        op: F,
    ) -> Result<Executed<T>, RunError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let id = RecordId::new(scope, key);
        let lease = self.policy.lease();
        let token = match self.store.begin(&id, fingerprint, lease).await {
            Ok(Begin::Execute(token)) => token,
            Ok(Begin::Replay(outcome)) => {
                let value = serde_json::from_slice(&outcome.body).map_err(|e| {
                    RunError::Store(Error::Corrupt(format!(
                        "stored result does not decode: {e}"
                    )))
                })?;
                return Ok(Executed {
                    value,
                    replayed: true,
                });
            }
            Ok(Begin::InFlight { retry_after }) => return Err(RunError::InFlight { retry_after }),
            Ok(Begin::Mismatch) => return Err(RunError::Mismatch),
            Err(error) => return Err(RunError::Store(error)),
        };

        let operation = AssertUnwindSafe(op()).catch_unwind();
        tokio::pin!(operation);
        let every = self.policy.renew_every();
        let mut renew = tokio::time::interval_at(Instant::now() + every, every);
        let result = loop {
            tokio::select! {
                result = &mut operation => break result,
                _ = renew.tick() => {
                    if let Err(error) = self.store.renew(&id, token, lease).await {
                        tracing::warn!(%error, record = %id, "could not renew the lease");
                    }
                }
            }
        };
        let release = || async {
            if let Err(error) = self.store.release(&id, token).await {
                tracing::warn!(%error, record = %id, "could not release the lease; it expires by itself");
            }
        };
        match result {
            Err(_panic) => {
                release().await;
                Err(RunError::Panicked)
            }
            Ok(Err(error)) => {
                release().await;
                Err(RunError::Failed(error))
            }
            Ok(Ok(value)) => {
                let body = serde_json::to_vec(&value).map_err(|e| {
                    RunError::Store(Error::Corrupt(format!("result does not serialise: {e}")))
                })?;
                let outcome = Outcome::new(200).with_body(body);
                self.store
                    .complete(&id, token, &outcome, self.policy.retention())
                    .await
                    .map_err(RunError::Store)?;
                Ok(Executed {
                    value,
                    replayed: false,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::MemoryStore;

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::new(k).unwrap()
    }

    #[tokio::test]
    async fn repeats_replay_and_errors_release() {
        let executor = Executor::new(Arc::new(MemoryStore::new()));
        let scope = Scope::new("t");
        let runs = AtomicUsize::new(0);
        let fp = Fingerprint::of(b"p");
        let failed: Result<Executed<u32>, _> = executor
            .run(&scope, &key("k"), &fp, || async {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<u32, _>("transient")
            })
            .await;
        assert!(matches!(failed, Err(RunError::Failed("transient"))));
        for expected_replay in [false, true, true] {
            let done = executor
                .run(&scope, &key("k"), &fp, || async {
                    Ok::<_, &str>(runs.fetch_add(1, Ordering::SeqCst) as u32)
                })
                .await
                .unwrap();
            assert_eq!((done.value, done.replayed), (1, expected_replay));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        let other = executor
            .run(&scope, &key("k"), &Fingerprint::of(b"other"), || async {
                Ok::<u32, &str>(9)
            })
            .await;
        assert!(matches!(other, Err(RunError::Mismatch)));
    }

    #[tokio::test]
    async fn a_panic_releases_the_key() {
        let executor = Executor::new(Arc::new(MemoryStore::new()));
        let scope = Scope::new("t");
        let fp = Fingerprint::of(b"p");
        let panicked: Result<Executed<u32>, RunError<()>> = executor
            .run(&scope, &key("k"), &fp, || async { panic!("boom") })
            .await;
        assert!(matches!(panicked, Err(RunError::Panicked)));
        let done = executor
            .run(&scope, &key("k"), &fp, || async { Ok::<u32, ()>(7) })
            .await
            .unwrap();
        assert_eq!(done.value, 7);
    }
}
