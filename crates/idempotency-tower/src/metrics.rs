//! Counters of the middleware's decisions.

use std::{
    fmt::Write,
    sync::atomic::{AtomicU64, Ordering},
};

/// Counters of every decision the layer takes; share them with a `/metrics` endpoint.
///
/// ```
/// use idempotency_tower::Metrics;
///
/// let metrics = Metrics::default();
/// assert!(metrics.render_prometheus().contains("idempotency_executions_total 0"));
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
    pub(crate) unavailable: AtomicU64,
    pub(crate) panics: AtomicU64,
    pub(crate) lease_lost: AtomicU64,
}

/// A copy of the counters at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
    /// 503: store unavailable.
    pub unavailable: u64,
    /// Handlers that panicked (their lease was released).
    pub panics: u64,
    /// Completions refused because the lease was lost (taken over after expiring).
    pub lease_lost: u64,
}

impl Metrics {
    pub(crate) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
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
            unavailable: get(&self.unavailable),
            panics: get(&self.panics),
            lease_lost: get(&self.lease_lost),
        }
    }

    /// The counters in the Prometheus text exposition format.
    pub fn render_prometheus(&self) -> String {
        let s = self.snapshot();
        let mut out = String::new();
        for (name, help, value) in [
            (
                "idempotency_executions_total",
                "Operations executed with a stored outcome.",
                s.executions,
            ),
            (
                "idempotency_replays_total",
                "Requests answered with a stored outcome.",
                s.replays,
            ),
            (
                "idempotency_released_total",
                "Operations whose outcome was not cacheable.",
                s.released,
            ),
            (
                "idempotency_conflicts_total",
                "Requests refused with 409 (in flight).",
                s.conflicts,
            ),
            (
                "idempotency_mismatches_total",
                "Requests refused with 422 (key reused).",
                s.mismatches,
            ),
            (
                "idempotency_too_large_total",
                "Requests refused with 413.",
                s.too_large,
            ),
            (
                "idempotency_bad_keys_total",
                "Requests refused with 400 (key missing or invalid).",
                s.bad_keys,
            ),
            (
                "idempotency_unavailable_total",
                "Requests refused with 503 (store unavailable).",
                s.unavailable,
            ),
            (
                "idempotency_panics_total",
                "Handlers that panicked.",
                s.panics,
            ),
            (
                "idempotency_lease_lost_total",
                "Completions refused because the lease was lost.",
                s.lease_lost,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        out
    }
}
