//! The circuit breaker that routes around a failing Redis.

use std::{
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;

/// The breaker's state, as reported in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Redis is used.
    Closed,
    /// Redis is skipped until the backoff ends.
    Open,
    /// One probe call is testing Redis; everything else goes to Postgres.
    HalfOpen,
}

impl BreakerState {
    /// `closed`, `open` or `half_open`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// Breaker tuning.
#[derive(Debug, Clone, Copy)]
pub struct BreakerConfig {
    /// Consecutive Redis failures that open the breaker (default 3).
    pub failure_threshold: u32,
    /// First open period (default 250 ms); doubled after each failed probe.
    pub base_backoff: Duration,
    /// Longest open period (default 5 s).
    pub max_backoff: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            base_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(5),
        }
    }
}

#[derive(Debug)]
enum Inner {
    Closed { failures: u32 },
    Open { until: Instant, backoff: Duration },
    HalfOpen { backoff: Duration },
}

#[derive(Debug)]
pub(crate) struct Breaker {
    config: BreakerConfig,
    inner: Mutex<Inner>,
    pub(crate) opened: AtomicU64,
    pub(crate) closed: AtomicU64,
}

impl Breaker {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            inner: Mutex::new(Inner::Closed { failures: 0 }),
            opened: AtomicU64::new(0),
            closed: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn state(&self) -> BreakerState {
        match *self.lock() {
            Inner::Closed { .. } => BreakerState::Closed,
            Inner::Open { .. } => BreakerState::Open,
            Inner::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Whether this call may use Redis. When an open period has ended, the first caller
    /// becomes the probe and everyone else keeps going to Postgres until it reports.
    pub(crate) fn allow(&self) -> bool {
        let mut inner = self.lock();
        match *inner {
            Inner::Closed { .. } => true,
            Inner::Open { until, backoff } if Instant::now() >= until => {
                *inner = Inner::HalfOpen { backoff };
                tracing::info!("Redis breaker half-open: probing");
                true
            }
            Inner::Open { .. } | Inner::HalfOpen { .. } => false,
        }
    }

    pub(crate) fn success(&self) {
        let mut inner = self.lock();
        if !matches!(*inner, Inner::Closed { failures: 0 }) {
            if !matches!(*inner, Inner::Closed { .. }) {
                self.closed.fetch_add(1, Ordering::Relaxed);
                tracing::info!("Redis breaker closed: Redis answers again");
            }
            *inner = Inner::Closed { failures: 0 };
        }
    }

    pub(crate) fn failure(&self) {
        let mut inner = self.lock();
        let open_for = match *inner {
            Inner::Closed { failures } if failures + 1 < self.config.failure_threshold => {
                *inner = Inner::Closed {
                    failures: failures + 1,
                };
                return;
            }
            Inner::Closed { .. } => self.config.base_backoff,
            Inner::HalfOpen { backoff } => (backoff * 2).min(self.config.max_backoff),
            // A call admitted before the breaker opened failed late: already open.
            Inner::Open { .. } => return,
        };
        *inner = Inner::Open {
            until: Instant::now() + open_for,
            backoff: open_for,
        };
        self.opened.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(?open_for, "Redis breaker open: serving from Postgres alone");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn opens_probes_backs_off_and_closes() {
        let breaker = Breaker::new(BreakerConfig::default());
        breaker.failure();
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Closed);
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        assert!(!breaker.allow());

        tokio::time::advance(Duration::from_millis(250)).await;
        assert!(breaker.allow(), "the first caller after the backoff probes");
        assert!(!breaker.allow(), "only one probe at a time");
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert!(!breaker.allow(), "a failed probe doubles the backoff");
        tokio::time::advance(Duration::from_millis(250)).await;
        assert!(breaker.allow());
        breaker.success();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert_eq!(breaker.opened.load(Ordering::Relaxed), 2);
        assert_eq!(breaker.closed.load(Ordering::Relaxed), 1);
    }
}
