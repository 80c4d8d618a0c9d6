//! A background task that purges expired records in batches.

use std::{sync::Arc, time::Duration};

use tokio::{sync::watch, task::JoinHandle};

use crate::Store;

/// Handle to a purger started by [`spawn_purger`]. Dropping it leaves the task running;
/// call [`PurgeHandle::shutdown`] to stop it and wait for the batch in progress.
#[derive(Debug)]
pub struct PurgeHandle {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl PurgeHandle {
    /// Stops the purger after its current batch and waits for it.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Every `interval`, deletes expired records `batch` at a time until a batch comes back short.
///
/// Bounded batches keep each statement short, so purging never holds locks that live traffic
/// waits on. Errors are logged and retried at the next tick.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{spawn_purger, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let purger = spawn_purger(Arc::new(MemoryStore::new()), Duration::from_secs(60), 1000);
/// purger.shutdown().await;
/// # }
/// ```
pub fn spawn_purger<S: Store + ?Sized>(
    store: Arc<S>,
    interval: Duration,
    batch: usize,
) -> PurgeHandle {
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stopped.changed() => return,
            }
            loop {
                match store.purge_expired(batch).await {
                    Ok(n) => {
                        if n > 0 {
                            tracing::debug!(
                                store = store.name(),
                                purged = n,
                                "purged expired idempotency records"
                            );
                        }
                        if (n as usize) < batch || *stopped.borrow() {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(store = store.name(), %error, "purging expired idempotency records failed");
                        break;
                    }
                }
            }
        }
    });
    PurgeHandle { stop, task }
}
