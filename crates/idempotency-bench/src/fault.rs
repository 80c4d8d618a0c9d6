//! The hybrid store under load while Redis hangs: per-100 ms p99 latency and errors.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use idempotency::{
    Begin, Fingerprint, IdempotencyKey, RecordId, Scope, Store, hybrid::HybridStore,
};
use serde::Serialize;

use crate::{stats, store_level::outcome};

/// One 100 ms bucket of the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct Bucket {
    /// Start of the bucket, ms since the run started.
    pub at_ms: u64,
    /// Operations completed in it.
    pub ops: u64,
    /// Operations that failed in it.
    pub errors: u64,
    /// Their p99 latency, µs.
    pub p99_us: u64,
    /// Whether Redis was paused during the bucket.
    pub redis_paused: bool,
}

/// Runs `concurrency` workers for `3 × phase`, with Redis paused during the middle phase.
pub(crate) async fn timeline(
    store: Arc<HybridStore>,
    redis: &idempotency_test::services::Service,
    concurrency: usize,
    phase: Duration,
) -> Vec<Bucket> {
    let scope = Scope::new(uuid::Uuid::new_v4().to_string());
    let started = Instant::now();
    let total = phase * 3;
    let workers = (0..concurrency as u64).map(|w| {
        let (store, scope) = (store.clone(), scope.clone());
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut n = 0u64;
            while started.elapsed() < total {
                let id = RecordId::new(
                    &scope,
                    &IdempotencyKey::new(format!("k{w}-{n}"))
                        .unwrap_or_else(|e| unreachable!("{e}")),
                );
                let t = Instant::now();
                let ok = match store
                    .begin(&id, &Fingerprint::of(b"f"), Duration::from_secs(30))
                    .await
                {
                    Ok(Begin::Execute(token)) => store
                        .complete(&id, token, &outcome(), Duration::from_secs(3600))
                        .await
                        .is_ok(),
                    _ => false,
                };
                samples.push((t.duration_since(started), t.elapsed(), ok));
                n += 1;
            }
            samples
        })
    });
    let workers: Vec<_> = workers.collect();
    tokio::time::sleep(phase).await;
    redis.pause().await;
    let paused_at = started.elapsed();
    tokio::time::sleep(phase).await;
    redis.unpause().await;
    let resumed_at = started.elapsed();
    let mut samples = Vec::new();
    for w in futures::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
    {
        samples.extend(w);
    }
    let buckets = (total.as_millis() / 100) as u64 + 1;
    (0..buckets)
        .map(|b| {
            let (from, to) = (
                Duration::from_millis(b * 100),
                Duration::from_millis((b + 1) * 100),
            );
            let mut h = stats::histogram();
            let mut errors = 0;
            for (at, latency, ok) in samples.iter().filter(|(at, ..)| *at >= from && *at < to) {
                let _ = at;
                if *ok {
                    stats::record(&mut h, *latency);
                } else {
                    errors += 1;
                }
            }
            Bucket {
                at_ms: b * 100,
                ops: h.len(),
                errors,
                p99_us: if h.is_empty() {
                    0
                } else {
                    h.value_at_quantile(0.99)
                },
                redis_paused: to > paused_at && from < resumed_at,
            }
        })
        .collect()
}
