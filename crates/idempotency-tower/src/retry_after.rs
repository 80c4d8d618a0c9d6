//! The `Retry-After` of a 409: when the first request is likely done, not when its lease ends.
//!
//! A lease is sized for the slowest run (30 s by default), so answering a duplicate with the
//! lease left tells a client of a 3 s operation to wait 30 s. The layer keeps a running mean
//! of how long its operations take and answers with what is left of it for this record:
//! `mean − age`, where the age is the lease minus what the store says is left of it. Never
//! longer than the lease left (by then the key is free or taken over), and at least a
//! second (the header's unit).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

/// Before any operation finished here there is nothing to estimate from: ask for a retry
/// soon rather than at the end of the lease.
const NO_SAMPLE: Duration = Duration::from_secs(1);

/// A running mean of operation run times (exponentially weighted, 1/8 per sample).
#[derive(Debug, Default)]
pub(crate) struct RunTime {
    /// Microseconds; 0 until the first sample.
    mean_us: AtomicU64,
}

impl RunTime {
    /// Adds one operation's run time (claim to outcome).
    pub(crate) fn record(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        let _ = self
            .mean_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |mean| {
                Some(if mean == 0 {
                    sample
                } else {
                    mean - mean / 8 + sample / 8
                })
            });
    }

    /// The wait to advertise for a record whose lease (of `lease` when claimed) has
    /// `lease_left` to run.
    pub(crate) fn retry_after(&self, lease: Duration, lease_left: Duration) -> Duration {
        let estimate = match self.mean_us.load(Ordering::Relaxed) {
            0 => NO_SAMPLE,
            mean => {
                let age = lease.saturating_sub(lease_left);
                Duration::from_micros(mean).saturating_sub(age)
            }
        };
        estimate.min(lease_left).max(Duration::from_secs(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    #[test]
    fn without_samples_a_second_not_the_lease() {
        let run = RunTime::default();
        assert_eq!(run.retry_after(LEASE, LEASE), Duration::from_secs(1));
    }

    #[test]
    fn what_is_left_of_the_mean_run_time() {
        let run = RunTime::default();
        run.record(Duration::from_secs(3));
        // Claimed 500 ms ago: 2.5 s to go.
        assert_eq!(
            run.retry_after(LEASE, LEASE - Duration::from_millis(500)),
            Duration::from_millis(2500)
        );
        // Older than the mean: soon.
        assert_eq!(
            run.retry_after(LEASE, Duration::from_secs(20)),
            Duration::from_secs(1)
        );
        // Never past the lease left.
        run.record(Duration::from_secs(600));
        assert!(run.retry_after(LEASE, Duration::from_secs(4)) <= Duration::from_secs(4));
    }

    #[test]
    fn the_mean_moves_an_eighth_per_sample() {
        let run = RunTime::default();
        run.record(Duration::from_secs(8));
        run.record(Duration::ZERO);
        assert_eq!(run.retry_after(LEASE, LEASE), Duration::from_secs(7));
    }
}
