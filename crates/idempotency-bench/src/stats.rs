//! Latency recording and the numbers reported per scenario.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Latencies in microseconds, 1 µs to 60 s, 3 significant digits.
pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3)
        .unwrap_or_else(|e| unreachable!("static bounds: {e}"))
}

pub(crate) fn record(h: &mut Histogram<u64>, latency: Duration) {
    let _ = h.record(
        u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .clamp(1, 60_000_000),
    );
}

/// One measured scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    /// Which group it belongs to (`store-seq`, `store-c32`, `http-first`, …).
    pub group: String,
    /// What ran (`postgres`, `baseline postgres`, `layer hybrid`, …).
    pub name: String,
    /// Completed operations.
    pub ops: u64,
    /// Failed operations.
    pub errors: u64,
    /// Operations per second.
    pub ops_per_sec: f64,
    /// Median latency, µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
    /// 99.9th percentile, µs.
    pub p999_us: u64,
    /// In the side-by-side groups, each round's figures, in order (empty elsewhere): the
    /// paired ratios are taken round by round.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rounds: Vec<Round>,
}

/// One round of a side-by-side scenario: its slots in that round, together.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Round {
    /// Operations per second over the round's slots.
    pub ops_per_sec: f64,
    /// 99th percentile over the round's slots, µs.
    pub p99_us: u64,
}

impl Round {
    pub(crate) fn new(h: &Histogram<u64>, elapsed: Duration) -> Self {
        Self {
            ops_per_sec: h.len() as f64 / elapsed.as_secs_f64().max(1e-9),
            p99_us: h.value_at_quantile(0.99),
        }
    }
}

impl Measured {
    pub(crate) fn new(
        group: &str,
        name: &str,
        h: &Histogram<u64>,
        errors: u64,
        elapsed: Duration,
    ) -> Self {
        Self {
            group: group.into(),
            name: name.into(),
            ops: h.len(),
            errors,
            ops_per_sec: h.len() as f64 / elapsed.as_secs_f64().max(1e-9),
            p50_us: h.value_at_quantile(0.5),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            rounds: Vec::new(),
        }
    }
}
