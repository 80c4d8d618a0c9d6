//! Counters of the middleware's decisions.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of every decision the layer takes.
///
/// Each decision is counted through the [`metrics`](https://docs.rs/metrics) facade
/// (`idempotency_executions_total`, `idempotency_replays_total`, … — the fields of
/// [`MetricsSnapshot`] with the prefix `idempotency_` and the suffix `_total`), so the
/// recorder the application installed exports them; and here, per layer, for
/// [`Metrics::snapshot`].
///
/// ```
/// use std::sync::Arc;
/// use idempotency_tower::{IdempotencyLayer, Metrics};
///
/// // With e.g. metrics-exporter-prometheus installed as the recorder:
/// Metrics::describe();
/// let layer = IdempotencyLayer::new(Arc::new(idempotency_core::MemoryStore::new()));
/// assert_eq!(layer.metrics().snapshot().executions, 0);
/// ```
#[derive(Debug, Default)]
pub struct Metrics {
    pub(crate) executions: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) conflicts: AtomicU64,
    pub(crate) mismatches: AtomicU64,
    pub(crate) too_large: AtomicU64,
    pub(crate) bad_keys: AtomicU64,
    pub(crate) unscoped: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) panics: AtomicU64,
    pub(crate) lease_lost: AtomicU64,
}

/// A copy of the counters at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Operations run and completed with a stored outcome.
    pub executions: u64,
    /// Requests answered with a stored outcome.
    pub replays: u64,
    /// Operations run whose outcome was not cacheable (5xx, 429, …): the key was released.
    pub released: u64,
    /// 409: in flight.
    pub conflicts: u64,
    /// 422: key reused for a different request.
    pub mismatches: u64,
    /// 413: request body too large.
    pub too_large: u64,
    /// 400: missing or invalid key.
    pub bad_keys: u64,
    /// 401 or 400: the request named no principal, or one that could not be read (a
    /// [`NoScope`](crate::NoScope) from the scope function): refused before any claim.
    pub unscoped: u64,
    /// 503: store unavailable.
    pub unavailable: u64,
    /// Handlers that panicked (their lease was released).
    pub panics: u64,
    /// Completions refused because the lease was lost (taken over after expiring).
    pub lease_lost: u64,
}

impl Metrics {
    /// Counts one decision here (for [`Metrics::snapshot`]) and through the `metrics`
    /// facade, as the counter `name`.
    pub(crate) fn inc(counter: &AtomicU64, name: &'static str) {
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(name).increment(1);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            executions: get(&self.executions),
            replays: get(&self.replays),
            released: get(&self.released),
            conflicts: get(&self.conflicts),
            mismatches: get(&self.mismatches),
            too_large: get(&self.too_large),
            bad_keys: get(&self.bad_keys),
            unscoped: get(&self.unscoped),
            unavailable: get(&self.unavailable),
            panics: get(&self.panics),
            lease_lost: get(&self.lease_lost),
        }
    }

    /// Describes the counters (their help texts) to the installed `metrics` recorder; call
    /// it once after installing one (the Prometheus exporter prints them as `# HELP`).
    pub fn describe() {
        metrics::describe_counter!(
            "idempotency_executions_total",
            "Operations executed with a stored outcome."
        );
        metrics::describe_counter!(
            "idempotency_replays_total",
            "Requests answered with a stored outcome."
        );
        metrics::describe_counter!(
            "idempotency_released_total",
            "Operations whose outcome was not cacheable."
        );
        metrics::describe_counter!(
            "idempotency_conflicts_total",
            "Requests refused with 409 (in flight)."
        );
        metrics::describe_counter!(
            "idempotency_mismatches_total",
            "Requests refused with 422 (key reused)."
        );
        metrics::describe_counter!("idempotency_too_large_total", "Requests refused with 413.");
        metrics::describe_counter!(
            "idempotency_bad_keys_total",
            "Requests refused with 400 (key missing or invalid)."
        );
        metrics::describe_counter!(
            "idempotency_unscoped_total",
            "Requests refused with 401 or 400 (no principal to scope the key to)."
        );
        metrics::describe_counter!(
            "idempotency_unavailable_total",
            "Requests refused with 503 (store unavailable)."
        );
        metrics::describe_counter!("idempotency_panics_total", "Handlers that panicked.");
        metrics::describe_counter!(
            "idempotency_lease_lost_total",
            "Completions refused because the lease was lost."
        );
    }
}
