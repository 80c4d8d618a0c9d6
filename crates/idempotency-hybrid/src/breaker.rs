//! The circuit breaker that routes around a failing Redis.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use tokio::time::Instant;

use crate::flagged::{Flagged, Guard};

/// The breaker's state, as reported in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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
#[non_exhaustive]
pub struct BreakerConfig {
    /// Consecutive Redis failures that open the breaker (default 3).
    pub failure_threshold: u32,
    /// First open period (default 250 ms); doubled after each failed probe.
    pub base_backoff: Duration,
    /// Longest open period (default 5 s).
    pub max_backoff: Duration,
}

impl BreakerConfig {
    /// Consecutive Redis failures that open the breaker.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_hybrid::BreakerConfig;
    ///
    /// let config = BreakerConfig::default()
    ///     .failure_threshold(5)
    ///     .backoff(Duration::from_millis(100), Duration::from_secs(10));
    /// assert_eq!(config.failure_threshold, 5);
    /// ```
    pub fn failure_threshold(mut self, failures: u32) -> Self {
        self.failure_threshold = failures.max(1);
        self
    }

    /// The first open period and the longest one (each failed probe doubles it).
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.base_backoff = base;
        self.max_backoff = max.max(base);
        self
    }
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
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
        backoff: Duration,
    },
    /// `probe`: the number of the probe out; `since`: when it went out.
    HalfOpen {
        backoff: Duration,
        probe: u64,
        since: Instant,
    },
}

#[derive(Debug)]
pub(crate) struct Breaker {
    config: BreakerConfig,
    /// How long a probe may go unanswered before the next call probes instead: a probe's
    /// call held without being polled (a `select!` branch, a buffered stream) neither
    /// answers nor is dropped, and would keep the breaker half-open, Redis unused, for as
    /// long as it is held.
    probe_limit: Duration,
    /// How long a call may go unanswered before dropping it counts as a failure: a caller
    /// that gives up sooner than the call's budget (a client's hang-up, an outer timeout)
    /// would otherwise never tell the breaker of a Redis that hangs, and every call would
    /// wait on it until its caller gave up.
    slow: Duration,
    /// Probes sent, numbering each: only the latest one's answer counts.
    probes: AtomicU64,
    /// Published: `Closed` with no failure counted (healthy). A call is then admitted, and
    /// its success recorded, without the lock.
    inner: Flagged<Inner>,
    pub(crate) opened: AtomicU64,
    pub(crate) closed: AtomicU64,
    /// The closed period a call was admitted in: bumped, under the lock, each time the
    /// breaker closes again. A failure counts toward opening only in the period its call
    /// was admitted in: a call admitted before the breaker opened and failing after it
    /// closed again says nothing of Redis now.
    period: AtomicU64,
}

impl Breaker {
    /// How long a call may go unanswered before it counts as a failure (see
    /// [`Permit::calling`]).
    pub(crate) fn slow(&self) -> Duration {
        self.slow
    }

    pub(crate) fn new(config: BreakerConfig, probe_limit: Duration, slow: Duration) -> Self {
        publish(BreakerState::Closed);
        Self {
            config,
            probe_limit,
            slow,
            probes: AtomicU64::new(0),
            inner: Flagged::new(Inner::Closed { failures: 0 }, |inner| {
                matches!(inner, Inner::Closed { failures: 0 })
            }),
            opened: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            period: AtomicU64::new(0),
        }
    }

    /// Describes the hybrid store's metrics (their help texts) to the installed `metrics`
    /// recorder.
    pub(crate) fn describe() {
        metrics::describe_gauge!(
            "idempotency_breaker_state",
            "Redis breaker state (1 for the current one)."
        );
        metrics::describe_counter!(
            "idempotency_breaker_opened_total",
            "Times the Redis breaker opened."
        );
        metrics::describe_counter!(
            "idempotency_breaker_closed_total",
            "Times the Redis breaker closed again."
        );
    }

    fn lock(&self) -> Guard<'_, Inner> {
        self.inner.lock()
    }

    pub(crate) fn state(&self) -> BreakerState {
        match *self.lock() {
            Inner::Closed { .. } => BreakerState::Closed,
            Inner::Open { .. } => BreakerState::Open,
            Inner::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Whether this call may use Redis: a permit to report the call's result on, or `None`.
    /// When an open period has ended, the first caller becomes the probe and everyone else
    /// keeps going to Postgres until it reports.
    ///
    /// A permit dropped without a report (the call was cancelled: a client hung up, a
    /// timeout fired) says nothing about Redis, unless its Redis call ([`Permit::calling`],
    /// not the wait for other callers' work before it) had gone unanswered for the breaker's
    /// `slow` time (a fifth of a Redis call's budget, where a healthy Redis answers in a
    /// millisecond): that counts as a failure. A dropped probe hands the probe on:
    /// the breaker goes back to open with the same backoff, already over, so the next call
    /// probes. Without that, a cancelled probe would leave the breaker half-open for good.
    /// A probe neither answered nor dropped within the probe limit (its call held without
    /// being polled) hands it on too: the next call probes, and the stale probe's answer,
    /// when it comes, counts for nothing.
    pub(crate) fn allow(&self) -> Option<Permit<'_>> {
        // Closed and nothing failed: the lock would find the same (a failure racing this
        // call is ordered after it, as it would be had this call taken the lock first).
        if self.inner.holds() {
            // Read after the flag (acquire): at least the period the flag was published in.
            return Some(Permit {
                breaker: self,
                probe: None,
                period: self.period.load(Ordering::Acquire),
                reported: false,
                calling: None,
            });
        }
        let mut inner = self.lock();
        let now = Instant::now();
        let backoff = match *inner {
            Inner::Closed { .. } => None,
            Inner::Open { until, backoff } if now >= until => Some(backoff),
            Inner::HalfOpen { backoff, since, .. }
                if since
                    .checked_add(self.probe_limit)
                    .is_some_and(|end| now >= end) =>
            {
                tracing::warn!(limit = ?self.probe_limit, "Redis breaker probe unanswered; probing again");
                Some(backoff)
            }
            Inner::Open { .. } | Inner::HalfOpen { .. } => return None,
        };
        let probe = backoff.map(|backoff| {
            let probe = self.probes.fetch_add(1, Ordering::Relaxed) + 1;
            if !matches!(*inner, Inner::HalfOpen { .. }) {
                publish(BreakerState::HalfOpen);
                tracing::info!("Redis breaker half-open: probing");
            }
            *inner = Inner::HalfOpen {
                backoff,
                probe,
                since: now,
            };
            probe
        });
        Some(Permit {
            breaker: self,
            probe,
            period: self.period.load(Ordering::Acquire),
            reported: false,
            calling: None,
        })
    }

    /// Whether `probe` is the probe out now (a stale one's answer counts for nothing).
    fn is_current(inner: &Inner, probe: u64) -> bool {
        matches!(*inner, Inner::HalfOpen { probe: out, .. } if out == probe)
    }

    fn abandon_probe(&self, probe: u64) {
        let mut inner = self.lock();
        if let Inner::HalfOpen { backoff, .. } = *inner
            && Self::is_current(&inner, probe)
        {
            *inner = Inner::Open {
                until: Instant::now(),
                backoff,
            };
            publish(BreakerState::Open);
        }
    }

    /// A call answered. `probe`: it was the half-open breaker's probe, the only call whose
    /// answer may close it: a call admitted while the breaker was still closed and answered
    /// after it opened says nothing of Redis now (one slow node of a cluster answering
    /// while the others fail would otherwise keep closing it, skipping every backoff).
    fn success(&self, probe: Option<u64>) {
        if self.inner.holds() {
            return; // closed with no failure counted: nothing to reset
        }
        let mut inner = self.lock();
        let counts = match probe {
            Some(probe) => Self::is_current(&inner, probe),
            None => matches!(*inner, Inner::Closed { .. }),
        };
        if !counts {
            return;
        }
        if !matches!(*inner, Inner::Closed { failures: 0 }) {
            if !matches!(*inner, Inner::Closed { .. }) {
                self.closed.fetch_add(1, Ordering::Relaxed);
                self.period.fetch_add(1, Ordering::Release);
                metrics::counter!("idempotency_breaker_closed_total").increment(1);
                publish(BreakerState::Closed);
                tracing::info!("Redis breaker closed: Redis answers again");
            }
            *inner = Inner::Closed { failures: 0 };
        }
    }

    /// A call failed. `probe`: it was the half-open breaker's probe. Only the probe's answer
    /// counts while half-open, as for [`success`](Self::success): a call admitted while the
    /// breaker was closed and failing late says nothing of Redis now, and would reopen it
    /// under the probe's feet and double the backoff. `period`: the closed period the call
    /// was admitted in; a failure from an earlier one is not counted.
    fn failure_of(&self, probe: Option<u64>, period: u64) {
        let mut inner = self.lock();
        match probe {
            Some(probe) if !Self::is_current(&inner, probe) => return,
            Some(_) => {}
            None if matches!(*inner, Inner::HalfOpen { .. }) => return,
            None if period != self.period.load(Ordering::Acquire) => return,
            None => {}
        }
        let open_for = match *inner {
            Inner::Closed { failures } if failures + 1 < self.config.failure_threshold => {
                *inner = Inner::Closed {
                    failures: failures + 1,
                };
                return;
            }
            Inner::Closed { .. } => self.config.base_backoff,
            // Saturating: a backoff configured near `Duration::MAX` must not panic the call
            // that reports the failure.
            Inner::HalfOpen { backoff, .. } => {
                backoff.saturating_mul(2).min(self.config.max_backoff)
            }
            // A call admitted before the breaker opened failed late: already open.
            Inner::Open { .. } => return,
        };
        *inner = Inner::Open {
            until: open_until(open_for),
            backoff: open_for,
        };
        self.opened.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("idempotency_breaker_opened_total").increment(1);
        publish(BreakerState::Open);
        tracing::warn!(?open_for, "Redis breaker open: serving from Postgres alone");
    }
}

/// One admitted Redis call; report its result with [`Permit::success`] or
/// [`Permit::failure`]. See [`Breaker::allow`] for what dropping it does.
#[derive(Debug)]
pub(crate) struct Permit<'a> {
    breaker: &'a Breaker,
    /// The probe's number, when this call is the half-open breaker's probe.
    probe: Option<u64>,
    /// The closed period the call was admitted in.
    period: u64,
    reported: bool,
    /// When its Redis call went out ([`Permit::calling`]).
    calling: Option<Instant>,
}

/// A probe handed to a call of its own ([`Permit::detach`]): its answer, once it comes, is
/// told with [`Detached::answered`].
#[derive(Debug)]
pub(crate) struct Detached {
    probe: Option<u64>,
    period: u64,
}

impl Detached {
    /// Tells `breaker` the answer of this permit's call.
    pub(crate) fn answered(self, breaker: &Breaker, ok: bool) {
        if ok {
            breaker.success(self.probe);
        } else {
            breaker.failure_of(self.probe, self.period);
        }
    }
}

impl Permit<'_> {
    /// Whether this call is the half-open breaker's probe.
    pub(crate) fn is_probe(&self) -> bool {
        self.probe.is_some()
    }

    /// Hands this permit to a call made elsewhere (a task of its own): dropping it here
    /// reports nothing, and the call's answer is told with [`Detached::answered`]. Never
    /// told (the task dropped), a probe is handed on past the probe limit.
    pub(crate) fn detach(mut self) -> Detached {
        self.reported = true;
        Detached {
            probe: self.probe,
            period: self.period,
        }
    }

    pub(crate) fn success(mut self) {
        self.reported = true;
        self.breaker.success(self.probe);
    }

    /// The permit's Redis calls go out now (stale-mirror deletes once it holds the repairs'
    /// lock, then its own call): dropped unanswered past the breaker's `slow` time from the
    /// first of them, it counts as a failure. Not before: waiting for another caller's
    /// repairs (a lock), a caller that gives up says nothing of Redis. (Time the caller's
    /// future went unpolled counts too: on a runtime starved past `slow`, hang-ups can open
    /// the breaker on a Redis that answered, sending its calls to Postgres for a backoff.)
    pub(crate) fn calling(&mut self) {
        self.calling.get_or_insert_with(Instant::now);
    }

    /// Since when Redis has left this permit's calls unanswered, when another caller sent
    /// them first (stale-mirror deletes a caller given up on left in the queue: the wait
    /// began then); `None` once they are answered.
    pub(crate) fn calling_since(&mut self, since: Option<Instant>) {
        self.calling = since;
    }

    /// Whether its calls have gone unanswered for the breaker's slow time: given up now, it
    /// counts as a failure.
    pub(crate) fn unanswered_past_slow(&self) -> bool {
        self.calling
            .is_some_and(|sent| sent.elapsed() >= self.breaker.slow)
    }

    /// The call learnt nothing of Redis (it waited for another caller's work): dropped as a
    /// permit whose calls never went out, however long it waited.
    pub(crate) fn no_news(mut self) {
        self.calling = None;
    }

    pub(crate) fn failure(mut self) {
        self.reported = true;
        self.breaker.failure_of(self.probe, self.period);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.reported {
            return;
        }
        if let Some(probe) = self.probe {
            tracing::debug!("Redis breaker probe cancelled; the next call probes");
            self.breaker.abandon_probe(probe);
        } else if self.unanswered_past_slow() {
            tracing::debug!(
                "a Redis call given up unanswered for a fifth of its budget: a failure"
            );
            self.breaker.failure_of(None, self.period);
        }
    }
}

/// When an open period of `open_for` from now ends: a backoff too long for the clock
/// (`Duration::MAX` as "until an operator restarts it") ends in a century, not in a panic.
fn open_until(open_for: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(open_for)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// The breaker's state as the gauge `idempotency_breaker_state{state}`: 1 for the current
/// state, 0 for the others (one breaker per process is what it describes).
fn publish(now: BreakerState) {
    for state in [
        BreakerState::Closed,
        BreakerState::Open,
        BreakerState::HalfOpen,
    ] {
        metrics::gauge!("idempotency_breaker_state", "state" => state.as_str())
            .set(f64::from(u8::from(state == now)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe limit of these tests.
    const LIMIT: Duration = Duration::from_secs(2);
    /// How long a dropped call must have waited to count as a failure in these tests.
    const SLOW: Duration = Duration::from_millis(250);

    #[tokio::test(start_paused = true)]
    async fn opens_probes_backs_off_and_closes() {
        let breaker = Breaker::new(BreakerConfig::default(), LIMIT, SLOW);
        breaker.failure_of(None, 0);
        breaker.failure_of(None, 0);
        assert_eq!(breaker.state(), BreakerState::Closed);
        breaker.failure_of(None, 0);
        assert_eq!(breaker.state(), BreakerState::Open);
        assert!(breaker.allow().is_none());

        tokio::time::advance(Duration::from_millis(250)).await;
        let probe = breaker
            .allow()
            .expect("the first caller after the backoff probes");
        assert!(breaker.allow().is_none(), "only one probe at a time");
        probe.failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert!(
            breaker.allow().is_none(),
            "a failed probe doubles the backoff"
        );
        tokio::time::advance(Duration::from_millis(250)).await;
        breaker.allow().expect("probe").success();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert_eq!(breaker.opened.load(Ordering::Relaxed), 2);
        assert_eq!(breaker.closed.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_admitted_before_the_breaker_opened_cannot_close_it() {
        let breaker = Breaker::new(BreakerConfig::default(), LIMIT, SLOW);
        let early = breaker.allow().expect("closed");
        for _ in 0..3 {
            breaker.failure_of(None, 0);
        }
        early.success(); // answered late, after the breaker opened
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(250)).await;
        let probe = breaker.allow().expect("probe");
        let late = Permit {
            breaker: &breaker,
            probe: None,
            period: 0,
            reported: false,
            calling: None,
        };
        late.success(); // another call admitted while closed, answered while half-open
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        probe.success();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert_eq!(breaker.closed.load(Ordering::Relaxed), 1);
    }

    /// A call admitted while the breaker was closed and failing after it went half-open
    /// does not reopen it under its probe: only the probe's answer counts. It reopened the
    /// breaker and doubled the backoff.
    #[tokio::test(start_paused = true)]
    async fn a_call_admitted_before_the_breaker_opened_cannot_reopen_it_while_it_probes() {
        let breaker = Breaker::new(BreakerConfig::default(), LIMIT, SLOW);
        let early = breaker.allow().expect("closed");
        for _ in 0..3 {
            breaker.failure_of(None, 0);
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        let probe = breaker.allow().expect("probe");
        early.failure(); // answered late, while the breaker probes
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        assert_eq!(breaker.opened.load(Ordering::Relaxed), 1);
        probe.failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(500)).await;
        breaker
            .allow()
            .expect("the backoff doubled once, not twice")
            .success();
        assert_eq!(breaker.state(), BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_probe_hands_the_probe_on() {
        let breaker = Breaker::new(BreakerConfig::default(), LIMIT, SLOW);
        for _ in 0..3 {
            breaker.failure_of(None, 0);
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        let probe = breaker.allow().expect("probe");
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        drop(probe); // the probing call was cancelled before Redis answered
        assert_eq!(breaker.state(), BreakerState::Open);
        breaker
            .allow()
            .expect("the next call probes at once")
            .success();
        assert_eq!(breaker.state(), BreakerState::Closed);

        // A cancelled call while closed reports nothing either way.
        drop(breaker.allow().expect("closed"));
        assert_eq!(breaker.state(), BreakerState::Closed);
    }

    /// A probe detached to a call of its own decides as the call answers; dropped without
    /// an answer (its task gone), it keeps the breaker half-open until the probe limit,
    /// never hands the probe on at once.
    #[tokio::test(start_paused = true)]
    async fn a_detached_probe_decides_by_its_answer() {
        let breaker = Breaker::new(BreakerConfig::default(), LIMIT, SLOW);
        for _ in 0..3 {
            breaker.failure_of(None, 0);
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        let probe = breaker.allow().expect("probe").detach();
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        assert!(breaker.allow().is_none(), "one probe at a time");
        probe.answered(&breaker, false);
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(500)).await;
        // Its task gone: never answered.
        let _lost = breaker
            .allow()
            .expect("probe after the doubled backoff")
            .detach();
        assert!(
            breaker.allow().is_none(),
            "still half-open: nobody answered"
        );
        tokio::time::advance(LIMIT).await;
        breaker
            .allow()
            .expect("past the probe limit")
            .detach()
            .answered(&breaker, true);
        assert_eq!(breaker.state(), BreakerState::Closed);
    }

    /// A probe whose call is held without being polled (a `select!` branch, a buffered
    /// stream) neither answers nor is dropped: past its limit the next call probes instead,
    /// and the stale probe's late answer, either way, decides nothing. It kept the breaker
    /// half-open, and Redis unused, for as long as its future was held.
    #[tokio::test(start_paused = true)]
    async fn a_probe_held_without_an_answer_hands_the_probe_on() {
        let breaker = Breaker::new(BreakerConfig::default(), LIMIT, SLOW);
        for _ in 0..3 {
            breaker.failure_of(None, 0);
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        let held = breaker.allow().expect("probe");
        assert!(breaker.allow().is_none(), "one probe at a time");
        tokio::time::advance(Duration::from_secs(2)).await;
        let probe = breaker.allow().expect("the held probe is past its limit");
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        held.failure(); // late: decides nothing
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        probe.success();
        assert_eq!(breaker.state(), BreakerState::Closed);

        // And a stale probe's late success does not close a breaker its successor reopened.
        for _ in 0..3 {
            breaker.failure_of(None, breaker.period.load(Ordering::Acquire));
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        let held = breaker.allow().expect("probe");
        tokio::time::advance(Duration::from_secs(2)).await;
        breaker.allow().expect("next probe").failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        held.success();
        assert_eq!(breaker.state(), BreakerState::Open);
        drop(breaker.allow()); // still open (backoff doubled): no probe to drop
        assert_eq!(breaker.state(), BreakerState::Open);
    }

    /// A call admitted before the breaker opened and failing after it closed again says
    /// nothing of Redis now: it does not count toward opening it again. Two such stale
    /// failures and one fresh one reopened it.
    #[tokio::test(start_paused = true)]
    async fn a_call_admitted_before_the_breaker_opened_cannot_count_after_it_closed() {
        let breaker = Breaker::new(BreakerConfig::default(), LIMIT, SLOW);
        let stale = [
            breaker.allow().expect("closed"),
            breaker.allow().expect("closed"),
        ];
        for _ in 0..3 {
            breaker.allow().expect("closed").failure();
        }
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(250)).await;
        breaker.allow().expect("probe").success();
        assert_eq!(breaker.state(), BreakerState::Closed);

        for permit in stale {
            permit.failure(); // answered late, in the next closed period
        }
        breaker.allow().expect("closed").failure();
        assert_eq!(breaker.state(), BreakerState::Closed);
        breaker.allow().expect("closed").failure();
        breaker.allow().expect("closed").failure();
        assert_eq!(
            breaker.state(),
            BreakerState::Open,
            "fresh failures still open it"
        );
    }

    /// Calls given up unanswered after the breaker's slow time (their callers hung up, or an
    /// outer timeout shorter than Redis' budget fired) count as failures and open it; given
    /// up sooner, or while waiting for other callers' work before their own call, they say
    /// nothing. Before, no dropped call counted: with every caller
    /// giving up before the budget, a hung Redis never opened the breaker, and every call
    /// waited on it until its caller gave up.
    #[tokio::test(start_paused = true)]
    async fn calls_given_up_after_waiting_long_open_the_breaker() {
        let breaker = Breaker::new(BreakerConfig::default(), LIMIT, SLOW);
        for _ in 0..5 {
            let mut quick = breaker.allow().expect("closed");
            quick.calling();
            tokio::time::advance(SLOW / 2).await;
            drop(quick);
        }
        for _ in 0..5 {
            // Waited long for another caller's repairs, its own call not sent yet.
            let waiting = breaker.allow().expect("closed");
            tokio::time::advance(SLOW * 4).await;
            drop(waiting);
        }
        assert!(breaker.inner.holds(), "nothing counted");
        for _ in 0..3 {
            let mut hung = breaker.allow().expect("closed");
            hung.calling();
            tokio::time::advance(SLOW).await;
            drop(hung);
        }
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(250)).await;
        let waited = breaker.allow().expect("the backoff is over: a probe");
        tokio::time::advance(SLOW).await;
        waited.no_news();
        assert_eq!(breaker.state(), BreakerState::Open, "the probe handed on");
        assert_eq!(breaker.opened.load(Ordering::Relaxed), 1);
    }

    /// A backoff of `Duration::MAX` (an operator's "until restarted") opens the breaker for
    /// good instead of panicking the call that reports the failure; so does a doubling past
    /// the clock's range.
    #[tokio::test(start_paused = true)]
    async fn a_backoff_too_long_for_the_clock_opens_the_breaker_without_panicking() {
        let breaker = Breaker::new(
            BreakerConfig::default()
                .failure_threshold(1)
                .backoff(Duration::MAX, Duration::MAX),
            Duration::MAX,
            SLOW,
        );
        breaker.allow().expect("closed").failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(breaker.allow().is_none(), "still open an hour later");

        let doubling = Breaker::new(
            BreakerConfig::default()
                .failure_threshold(1)
                .backoff(Duration::from_secs(1), Duration::MAX),
            LIMIT,
            SLOW,
        );
        doubling.allow().expect("closed").failure();
        *doubling.lock() = Inner::HalfOpen {
            backoff: Duration::MAX / 2 + Duration::from_secs(1),
            probe: 1,
            since: Instant::now(),
        };
        let probe = Permit {
            breaker: &doubling,
            probe: Some(1),
            period: 0,
            reported: false,
            calling: None,
        };
        probe.failure();
        assert_eq!(doubling.state(), BreakerState::Open);
    }
}
