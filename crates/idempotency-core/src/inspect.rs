//! What an operator sees of a record, and what they may do to it: [`Store::inspect`] and
//! [`Store::force_release`](crate::Store::force_release).

use std::time::{Duration, SystemTime};

use crate::Fingerprint;

/// A live record as [`Store::inspect`](crate::Store::inspect) read it. Times come from the
/// store's clock, read by the same call.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{Begin, Fingerprint, IdempotencyKey, MemoryStore, RecordId, RecordState, Scope, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idempotency_core::Error> {
/// let store = MemoryStore::new();
/// let id = RecordId::new(&Scope::new("acct_1"), &IdempotencyKey::new("order-42").unwrap());
/// assert_eq!(store.inspect(&id).await?, None);
///
/// store.begin(&id, &Fingerprint::of(b"amount=100"), Duration::from_secs(30)).await?;
/// let record = store.inspect(&id).await?.expect("claimed");
/// assert!(matches!(record.state, RecordState::InFlight { .. }));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// In flight or completed, with what each state knows.
    pub state: RecordState,
    /// The fingerprint of the request that claimed the record.
    pub fingerprint: Fingerprint,
    /// When the record was claimed; `None` where the store does not keep it (Redis).
    pub created_at: Option<SystemTime>,
    /// In flight: when the lease ends (in the past for a lease that ran out and nobody took
    /// over yet: its owner may still complete it). Completed: when the outcome is forgotten.
    pub expires_at: SystemTime,
}

/// The state of a live record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// An attempt holds (or held) the lease and has not completed.
    InFlight {
        /// How long the lease has left; zero once it ran out (the owner crashed, or is slow:
        /// the next `begin` takes over).
        lease_remaining: Duration,
    },
    /// The outcome is stored and replays.
    Completed {
        /// The stored HTTP status.
        status: u16,
    },
}

impl Inspection {
    /// An in-flight record: its lease ends at `expires_at`, `lease_remaining` from now.
    pub fn in_flight(
        fingerprint: Fingerprint,
        created_at: Option<SystemTime>,
        expires_at: SystemTime,
        lease_remaining: Duration,
    ) -> Self {
        Self {
            state: RecordState::InFlight { lease_remaining },
            fingerprint,
            created_at,
            expires_at,
        }
    }

    /// A completed record holding an outcome with `status`, kept until `expires_at`.
    pub fn completed(
        fingerprint: Fingerprint,
        created_at: Option<SystemTime>,
        expires_at: SystemTime,
        status: u16,
    ) -> Self {
        Self {
            state: RecordState::Completed { status },
            fingerprint,
            created_at,
            expires_at,
        }
    }

    /// Whether the record is completed.
    pub fn is_completed(&self) -> bool {
        matches!(self.state, RecordState::Completed { .. })
    }
}

/// What [`Store::force_release`](crate::Store::force_release) may delete.
///
/// The default deletes only an in-flight record whose lease has run out (its holder stopped
/// renewing it). It is checked atomically with the delete, so an operator who saw a lease run
/// out cannot delete the live lease of a retry that took the key over in the meantime and is
/// running the operation, nor a record completed since.
///
/// Even then, release only after reconciling the unfinished attempt: its holder may be paused
/// rather than gone, and after a release the next `begin` answers `Execute`, not `TakeOver`,
/// so the "outcome unknown" signal is gone.
///
/// ```
/// use idempotency_core::ReleaseScope;
/// let scope = ReleaseScope::default();
/// assert!(!scope.live && !scope.completed);
/// // A holder known to be stuck: release its live lease too.
/// assert!(ReleaseScope::default().with_live().live);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ReleaseScope {
    /// Also an in-flight record whose lease is live: its holder may still be running the
    /// operation, and the next `begin` runs it again.
    pub live: bool,
    /// Also a completed record: its outcome is forgotten and the key runs again.
    pub completed: bool,
}

impl ReleaseScope {
    /// Live leases too (see [`ReleaseScope::live`]).
    pub fn with_live(mut self) -> Self {
        self.live = true;
        self
    }

    /// Completed records too (see [`ReleaseScope::completed`]).
    pub fn with_completed(mut self) -> Self {
        self.completed = true;
        self
    }
}

/// What [`Store::force_release`](crate::Store::force_release) found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForceReleased {
    /// An in-flight record was deleted: the next `begin` executes, and the old owner's token
    /// is fenced off (its late `complete` answers `LeaseLost`).
    Released,
    /// The record's lease is live and [`ReleaseScope::live`] was not asked: nothing changed.
    /// Its holder renews it while it runs.
    Live,
    /// A completed record was deleted (asked for with [`ReleaseScope::completed`]): the next
    /// `begin` executes the operation again.
    Deleted,
    /// The record is completed and [`ReleaseScope::completed`] was not asked: nothing changed.
    Completed,
    /// There is no live record under this id.
    Absent,
}

/// A time given in milliseconds since the Unix epoch (what SQL's `extract(epoch …)` and
/// Redis' `TIME` give), as a [`SystemTime`]; the epoch itself for anything before it.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// let t = idempotency_core::system_time_from_millis(1_500.0);
/// assert_eq!(t, SystemTime::UNIX_EPOCH + Duration::from_millis(1_500));
/// ```
pub fn system_time_from_millis(millis: f64) -> SystemTime {
    if millis <= 0.0 || !millis.is_finite() {
        return SystemTime::UNIX_EPOCH;
    }
    SystemTime::UNIX_EPOCH + Duration::from_secs_f64(millis / 1000.0)
}
