//! How long leases and records live, and which outcomes are stored.

use std::{fmt, sync::Arc, time::Duration};

/// Lease length, retention and the cache rule, shared by the HTTP layer and the executor.
///
/// The default caches 2xx, 3xx and 4xx outcomes except 401, 403, 406, 407, 408, 409, 411,
/// 412, 415, 417, 421, 423, 425, 428, 429 and 431, and never 5xx: those statuses say "try
/// again", so storing them would lock the key into a transient failure. 401, 403, 406, 407,
/// 411, 412, 415, 417, 421, 428 and 431 are refusals that depend on headers or the connection,
/// which the fingerprint leaves out (credentials, `Accept`, preconditions, `Content-Type`,
/// framing, header size, the authority): stored, a retry with a fixed header would be
/// replayed the refusal. An uncacheable outcome releases the key and the retry runs again.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::Policy;
///
/// let policy = Policy::default();
/// assert!(policy.is_cacheable(201));
/// assert!(policy.is_cacheable(404));
/// assert!(!policy.is_cacheable(401));
/// assert!(!policy.is_cacheable(412));
/// assert!(!policy.is_cacheable(429));
/// assert!(!policy.is_cacheable(503));
///
/// let strict = Policy::default()
///     .with_retention(Duration::from_secs(7 * 24 * 3600))
///     .with_cacheable(|status| (200..300).contains(&status));
/// assert!(!strict.is_cacheable(404));
/// ```
#[derive(Clone)]
pub struct Policy {
    lease: Duration,
    retention: Duration,
    cacheable: Arc<dyn Fn(u16) -> bool + Send + Sync>,
}

/// Statuses in the cacheable ranges that still mean "not done, try again": a timeout, a
/// conflict, a resource locked for now, too early, too many; and refusals that depend on
/// headers or the connection, not on the request the fingerprint covers: credentials or
/// permissions (401, 403, 407), `Accept` (406), a precondition failed or missing (412, 428),
/// `Content-Type` (415), framing (411 a length required, 417 an `Expect` refused), headers
/// too large (431), a request misdirected to this connection's authority (421). Refused,
/// nothing ran, so running the retry is safe.
const RETRYABLE_4XX: [u16; 16] = [
    401, 403, 406, 407, 408, 409, 411, 412, 415, 417, 421, 423, 425, 428, 429, 431,
];

/// The default cache rule of `docs/design.md` ("What is cached").
pub fn default_cacheable(status: u16) -> bool {
    (200..500).contains(&status) && !RETRYABLE_4XX.contains(&status)
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            cacheable: Arc::new(default_cacheable),
        }
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl Policy {
    /// How long one attempt holds the key before a retry may take it over (default 30 s).
    /// Long operations keep it by renewing every third of it while they run.
    ///
    /// Choose a lease longer than the operation's longest pause between two renewals, and
    /// far longer than a claim's round trip to the store: a grant that arrives with half or
    /// less of its lease left is given back, and the call answers `Unavailable` (the
    /// executor's [`RunError::Store`](crate::RunError::Store), the layer's 503) without
    /// running the operation. So a lease of zero refuses every call: a claim for zero is over
    /// as soon as it is granted (at the store level, the next `begin` takes it over), and
    /// acting on it would leave nothing to keep a duplicate from running beside it.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.min(crate::FOR_GOOD);
        self
    }

    /// How long a completed outcome is replayed (default 24 h).
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention.min(crate::FOR_GOOD);
        self
    }

    /// Replaces the rule deciding which statuses are stored.
    pub fn with_cacheable(mut self, rule: impl Fn(u16) -> bool + Send + Sync + 'static) -> Self {
        self.cacheable = Arc::new(rule);
        self
    }

    /// The lease length.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The retention period.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// How long after it asked for a lease (or a renewal) its holder can count on it by its
    /// own clock: the lease, less a margin (a sixth of it and 5 ms, at most half the lease)
    /// for the store's millisecond rounding and the two clocks' rates. The holder counts on
    /// its monotonic clock, the store on its own (Postgres' `clock_timestamp()`, Redis' key
    /// expiry), and both follow NTP's slewing: chrony corrects an offset (a VM resumed or
    /// moved) at up to a twelfth of a second per second, its default `maxslewrate`. A
    /// holder's clock a twelfth slow against a store's a twelfth fast sees the store end the
    /// lease at 11/13 of it (0.846); a sixth keeps the holder inside that. (Half at most: a
    /// grant answered within half its lease is run, see `within_lease`, and a tiny test
    /// lease still leaves its holder time.) The store counts the lease from when it ran the
    /// call, which is later. Past this the work under the lease is not polled
    /// again until a renewal says the key is still its holder's (see the layer and
    /// [`Executor`](crate::Executor)): a process frozen past its lease wakes with its work
    /// and its overdue renewal both ready, and the work must not go first.
    ///
    /// ```
    /// use std::time::Duration;
    /// let policy = idempotency_core::Policy::default().with_lease(Duration::from_secs(30));
    /// assert_eq!(policy.surely_held(), Duration::from_millis(24_995));
    /// let tiny = policy.with_lease(Duration::from_millis(4));
    /// assert_eq!(tiny.surely_held(), Duration::from_millis(2));
    /// ```
    pub fn surely_held(&self) -> Duration {
        let margin = (self.lease / 6 + Duration::from_millis(5)).min(self.lease / 2);
        self.lease - margin
    }

    /// How often a running operation renews its lease: a third of the lease, so two renewals
    /// can fail before it is lost (every millisecond at most, the timer's resolution: a lease
    /// under 3 ms cannot be kept that way; leases of seconds are what stores are built for).
    pub fn renew_every(&self) -> Duration {
        (self.lease / 3).max(Duration::from_millis(1))
    }

    /// Whether an outcome with this status is stored and replayed.
    pub fn is_cacheable(&self, status: u16) -> bool {
        (self.cacheable)(status)
    }
}
