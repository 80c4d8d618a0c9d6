//! Purging expired records in the background: small batches, paced so that live traffic
//! keeps its latency.

use std::{sync::Arc, time::Duration};

use tokio::{sync::watch, task::JoinHandle};

use crate::{Result, Store};

/// Handle to a purger started by [`Purger::spawn`] or [`spawn_purger`]. Dropping it leaves
/// the task running; call [`PurgeHandle::shutdown`] to stop it and wait for the batch in
/// progress.
#[derive(Debug)]
pub struct PurgeHandle {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl PurgeHandle {
    /// Stops the purger after its current batch and waits for it.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(error) = self.task.await
            && error.is_panic()
        {
            tracing::error!(%error, "the purger's task had panicked: it purged nothing since");
        }
    }
}

/// Deletes expired records in small batches, pausing after each one in proportion to the
/// time it took.
///
/// Why paced, and why small: a delete statement keeps a database core busy for as long as
/// it runs, and live requests that need that core wait behind it. Measured on 2 cores shared
/// by Postgres and the application (the bench's `--scale` run, 16 writers), the writers' p99
/// while a purge ran was 2.4–3.4× their p99 before it with 500–5,000 rows per statement,
/// whatever the pause; with 100 rows and a pause of one to four times each batch's time,
/// 1.4–1.6×. The defaults (100 rows, a pause of twice the batch's time: a third of the time
/// deleting) delete 14,000–16,000 rows a second there, and the writers' p99 during a purge
/// of a million rows was 1.38× their p99 before it: raise `batch` or lower `pause` if records
/// expire faster than the purger deletes them.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{MemoryStore, Purger};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let purger = Purger::new(Arc::new(MemoryStore::new()))
///     .every(Duration::from_secs(60))
///     .batch(100)
///     .pause(2.0)
///     .spawn();
/// purger.shutdown().await;
/// # }
/// ```
#[derive(Debug)]
pub struct Purger<S: ?Sized> {
    store: Arc<S>,
    interval: Duration,
    batch: usize,
    pause: f64,
}

impl<S: ?Sized> Clone for Purger<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            interval: self.interval,
            batch: self.batch,
            pause: self.pause,
        }
    }
}

impl<S: Store + ?Sized> Purger<S> {
    /// A purger of `store`: every 60 s, 100 records per batch, a pause of twice each batch's
    /// time.
    pub fn new(store: Arc<S>) -> Self {
        Self {
            store,
            interval: Duration::from_secs(60),
            batch: 100,
            pause: 2.0,
        }
    }

    /// How often [`spawn`](Self::spawn)'s task starts a pass (default 60 s; between 1 ms and
    /// a year). A pass that outlasts it delays the next one.
    pub fn every(mut self, interval: Duration) -> Self {
        // Tokio's interval panics on zero, and on a period its clock cannot add.
        const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);
        self.interval = interval.clamp(Duration::from_millis(1), YEAR);
        self
    }

    /// Records deleted per statement at most (default 100; at least 1).
    pub fn batch(mut self, records: usize) -> Self {
        self.batch = records.max(1);
        self
    }

    /// After each full batch, wait `factor` times as long as it took (default 2.0; 0 runs
    /// batches back to back, as a purger did before this setting existed), and never longer
    /// than the interval ([`every`](Self::every)). A negative or NaN factor is 0.
    pub fn pause(mut self, factor: f64) -> Self {
        self.pause = if factor.is_nan() {
            0.0
        } else {
            factor.max(0.0)
        };
        self
    }

    /// One pass: deletes expired records batch after batch, paced, until a batch comes back
    /// short (nothing left to purge). Returns how many were deleted. For a purge driven by
    /// the application's own scheduler; [`spawn`](Self::spawn) runs passes in a task.
    pub async fn run_once(&self) -> Result<u64> {
        // Never stopped: the sender lives as long as the pass.
        let (_stop, mut stopped) = watch::channel(false);
        self.pass(&mut stopped).await
    }

    /// Runs a pass every [`every`](Self::every) in a task of its own. Errors are logged and
    /// the pass is tried again at the next tick.
    pub fn spawn(self) -> PurgeHandle {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(self.interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    // A shutdown asked before a tick wins over it: no batch after it.
                    biased;
                    _ = asked_to_stop(&mut stopped) => return,
                    _ = ticker.tick() => {}
                }
                match self.pass(&mut stopped).await {
                    Ok(n) if n > 0 => tracing::debug!(
                        store = self.store.name(),
                        purged = n,
                        "purged expired idempotency records"
                    ),
                    Ok(_) => {}
                    Err(error) => tracing::warn!(
                        store = self.store.name(),
                        %error,
                        "purging expired idempotency records failed"
                    ),
                }
                // A shutdown asked during the pass ends the task at the biased select above.
            }
        });
        PurgeHandle { stop, task }
    }

    /// Batches until one comes back short, or `stopped` says so (checked between batches,
    /// and it cuts a pause short).
    async fn pass(&self, stopped: &mut watch::Receiver<bool>) -> Result<u64> {
        let mut purged = 0;
        loop {
            let started = tokio::time::Instant::now();
            // A store whose purge panics fails the pass, as an unavailable one does: the
            // panic ended the purger's task, and expired records piled up for good.
            let purge = self.store.purge_expired(self.batch);
            let n = crate::panic_as_unavailable(purge, "the store's purge panicked").await?;
            purged += n;
            if n < self.batch as u64 || *stopped.borrow() {
                return Ok(purged);
            }
            // Saturating (`mul_f64` panics on an overflow: an infinite factor, a huge time),
            // and never past the interval, so no factor stops the purge for good.
            let pause = Duration::try_from_secs_f64(started.elapsed().as_secs_f64() * self.pause)
                .unwrap_or(Duration::MAX)
                .min(self.interval);
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = asked_to_stop(stopped) => return Ok(purged),
            }
        }
    }
}

/// Resolves once [`PurgeHandle::shutdown`] was called; never when the handle was dropped
/// instead (a dropped handle leaves the purger running, as documented).
async fn asked_to_stop(stopped: &mut watch::Receiver<bool>) {
    if stopped.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Every `interval`, deletes expired records `batch` at a time until a batch comes back short,
/// pausing after each full batch twice as long as it took: [`Purger`] with its default pause.
///
/// Bounded batches keep each statement short, so purging never holds locks that live traffic
/// waits on; the pause leaves the database's cores to live traffic most of the time. Errors
/// are logged and retried at the next tick.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{spawn_purger, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let purger = spawn_purger(Arc::new(MemoryStore::new()), Duration::from_secs(60), 100);
/// purger.shutdown().await;
/// # }
/// ```
pub fn spawn_purger<S: Store + ?Sized>(
    store: Arc<S>,
    interval: Duration,
    batch: usize,
) -> PurgeHandle {
    Purger::new(store).every(interval).batch(batch).spawn()
}
