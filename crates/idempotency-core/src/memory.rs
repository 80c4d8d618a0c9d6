//! The in-process store: for unit tests and the zero-setup demo. Single process only.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{
    Begin, Error, Fingerprint, ForceReleased, Inspection, LeaseToken, Outcome, RecordId,
    ReleaseScope, Result, Store, UNKNOWN_OUTCOME_RETENTION,
};

/// A [`Store`] in this process's memory.
///
/// **Single process only.** Two replicas of a service each have their own map, so a retry that
/// reaches the other replica executes again; and a restart forgets every record. Use it for
/// tests, examples and single-instance tools; use the Postgres (or hybrid) store for anything
/// that runs more than one process or must survive a restart.
///
/// Records past their retention stay in memory until [`Store::purge_expired`] runs (see
/// [`spawn_purger`](crate::spawn_purger)).
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{MemoryStore, Store};
///
/// let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
/// assert_eq!(store.name(), "memory");
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    records: Mutex<HashMap<RecordId, Record>>,
    /// When each record may be purged, earliest first: an entry is pushed each time a
    /// record's deadline is set (`begin`, `complete`, `renew`), and one made stale by a later
    /// deadline or a removal is dropped when it comes up. A purge reads only what is due,
    /// instead of scanning every record under the lock every request waits on. Locked
    /// after `records`, never before.
    deadlines: Mutex<BinaryHeap<Reverse<(Instant, RecordId)>>>,
    /// `None`: Tokio's clock and random tokens. `Some`: see [`MemoryStore::with_manual_clock`].
    manual: Option<Mutex<ManualClock>>,
    /// See [`MemoryStore::with_unknown_outcome_retention`]; `None`: the default.
    unknown_outcome_retention: Option<Duration>,
}

/// A clock that moves only when told, and a token counter: deterministic runs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ManualClock {
    base: Instant,
    elapsed: Duration,
    issued: u128,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Record {
    fingerprint: Fingerprint,
    created_at: Instant,
    state: State,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum State {
    InFlight {
        token: LeaseToken,
        lease_until: Instant,
    },
    Completed {
        /// The token that completed it: a repeated `complete` by the same owner (its first
        /// answer was lost) succeeds without changing anything.
        token: LeaseToken,
        outcome: Outcome,
        expires_at: Instant,
    },
}

impl Record {
    fn is_live(&self, now: Instant) -> bool {
        match &self.state {
            State::InFlight { lease_until, .. } => *lease_until > now,
            State::Completed { expires_at, .. } => *expires_at > now,
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store whose clock moves only by [`MemoryStore::advance`] and whose lease tokens are
    /// sequential, so that a run is fully determined by its calls. With
    /// [`snapshot`](MemoryStore::snapshot), `Eq` and `Hash` (which compare the records and the
    /// clock), this is what the model checker drives:
    /// every state it explores holds one of these (see `tests/model.rs` of this crate).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_core::{Begin, Fingerprint, IdempotencyKey, MemoryStore, RecordId, Scope, Store};
    ///
    /// # futures::executor::block_on(async {
    /// let store = MemoryStore::with_manual_clock();
    /// let id = RecordId::new(&Scope::new("s"), &IdempotencyKey::new("k").unwrap());
    /// let fp = Fingerprint::of(b"");
    /// let lease = Duration::from_secs(2);
    /// assert!(matches!(store.begin(&id, &fp, lease).await, Ok(Begin::Execute(_))));
    /// let snapshot = store.snapshot();
    /// store.advance(Duration::from_secs(2)); // the lease ends unfinished: taken over
    /// assert!(matches!(store.begin(&id, &fp, lease).await, Ok(Begin::TakeOver(_))));
    /// assert_ne!(store, snapshot);
    /// # });
    /// ```
    pub fn with_manual_clock() -> Self {
        Self {
            records: Mutex::default(),
            deadlines: Mutex::default(),
            manual: Some(Mutex::new(ManualClock {
                base: Instant::now(),
                elapsed: Duration::ZERO,
                issued: 0,
            })),
            unknown_outcome_retention: None,
        }
    }

    /// This store keeping the record of an attempt whose lease ran out unfinished (its
    /// outcome unknown: `begin` answers [`Begin::TakeOver`](crate::Begin::TakeOver)) for
    /// `keep` after its lease ended, instead of [`UNKNOWN_OUTCOME_RETENTION`] (a day): when
    /// outcomes are kept longer than a day, a crash must be remembered as long as a success
    /// would be, or a retry on the second day runs as new. Below
    /// [`LATE_COMPLETION_GRACE`](crate::LATE_COMPLETION_GRACE) (an hour) an owner's late
    /// completion may find its record purged, and a retry run as new: this store takes any
    /// value, for tests and models on a manual clock (the Postgres store raises it to that).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_core::MemoryStore;
    ///
    /// let week = Duration::from_secs(7 * 24 * 3600);
    /// let store = MemoryStore::new().with_unknown_outcome_retention(week);
    /// ```
    pub fn with_unknown_outcome_retention(mut self, keep: Duration) -> Self {
        self.unknown_outcome_retention = Some(keep.min(crate::FOR_GOOD));
        self.reschedule_all(); // records already held have their deadlines moved
        self
    }

    /// Moves a [manual clock](MemoryStore::with_manual_clock) forward; does nothing on a
    /// store that reads Tokio's clock.
    pub fn advance(&self, by: Duration) {
        if let Some(clock) = &self.manual {
            lock(clock).elapsed += by;
        }
    }

    fn now(&self) -> Instant {
        match &self.manual {
            Some(clock) => {
                let clock = lock(clock);
                clock.base + clock.elapsed
            }
            None => Instant::now(),
        }
    }

    fn new_token(&self) -> LeaseToken {
        match &self.manual {
            Some(clock) => {
                let mut clock = lock(clock);
                clock.issued += 1;
                LeaseToken::from_uuid(uuid::Uuid::from_u128(clock.issued))
            }
            None => LeaseToken::generate(),
        }
    }

    /// The records in a fixed order, with the clock: what equality and hashing compare.
    fn contents(&self) -> (Vec<(RecordId, Record)>, Option<ManualClock>) {
        let mut records: Vec<_> = self.lock().iter().map(|(k, v)| (*k, v.clone())).collect();
        records.sort_by_key(|(id, _)| *id);
        (records, self.manual.as_ref().map(|c| lock(c).clone()))
    }

    /// A deep copy: the records and the clock, shared with nothing. (Deliberately not
    /// `Clone`: the other stores' clones share one backend, and a clone of this one that did
    /// not would split a key space in two.)
    ///
    /// The purge's deadline queue is copied as it is, stale entries and all, not rebuilt from
    /// the records: the model checker explores the store through snapshots, and a rebuilt
    /// queue would hide a deadline that `begin`, `complete` or `renew` failed to push.
    pub fn snapshot(&self) -> Self {
        let records = self.lock();
        let deadlines = lock(&self.deadlines).clone();
        Self {
            records: Mutex::new(records.clone()),
            deadlines: Mutex::new(deadlines),
            manual: self
                .manual
                .as_ref()
                .map(|clock| Mutex::new(lock(clock).clone())),
            unknown_outcome_retention: self.unknown_outcome_retention,
        }
    }

    /// How many records the map holds, expired ones included.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<RecordId, Record>> {
        lock(&self.records)
    }

    /// When `record` may be purged: its retention's end, or for an attempt that never
    /// completed its lease's end plus the unknown-outcome retention (`None`: never).
    fn purge_at(&self, record: &Record) -> Option<Instant> {
        match record.state {
            // An expired lease is an outcome nobody knows: kept as long as an outcome.
            State::InFlight { lease_until, .. } => lease_until.checked_add(
                self.unknown_outcome_retention
                    .unwrap_or(UNKNOWN_OUTCOME_RETENTION),
            ),
            State::Completed { expires_at, .. } => Some(expires_at),
        }
    }

    /// Notes the purge deadline of `id`'s record, just set (called with `records` locked).
    /// A queue grown to twice the records (entries left stale by releases, renewals and
    /// completions, which go only when their own deadline comes, a day or more on) is
    /// rebuilt from the records: memory stays bounded by the records, and so does the work
    /// of a purge that comes up on stale entries.
    fn schedule(&self, records: &HashMap<RecordId, Record>, id: &RecordId) {
        let mut deadlines = lock(&self.deadlines);
        if deadlines.len() >= 2 * records.len() + 1024 {
            *deadlines = self.deadlines_of(records);
        } else if let Some(at) = records.get(id).and_then(|record| self.purge_at(record)) {
            deadlines.push(Reverse((at, *id)));
        }
    }

    /// Rebuilds the deadline queue from the records.
    fn reschedule_all(&self) {
        let records = self.lock();
        *lock(&self.deadlines) = self.deadlines_of(&records);
    }

    fn deadlines_of(
        &self,
        records: &HashMap<RecordId, Record>,
    ) -> BinaryHeap<Reverse<(Instant, RecordId)>> {
        records
            .iter()
            .filter_map(|(id, record)| Some(Reverse((self.purge_at(record)?, *id))))
            .collect()
    }

    /// Runs `f` on the record if `token` owns it: in flight under this token, whether or not
    /// its lease has run out. An expired lease that nobody took over still belongs to its
    /// token (a takeover would have replaced it), so a late `complete` is accepted rather
    /// than leaving the key to run a second time.
    fn with_owned<T>(
        &self,
        id: &RecordId,
        token: LeaseToken,
        f: impl FnOnce(&mut HashMap<RecordId, Record>) -> T,
    ) -> Result<T> {
        let mut records = self.lock();
        match records.get(id) {
            Some(Record {
                state: State::InFlight { token: owner, .. },
                ..
            }) if *owner == token => Ok(f(&mut records)),
            _ => Err(Error::LeaseLost),
        }
    }
}

/// A panic while holding a lock cannot leave a record half-written (every update is a single
/// assignment), so a poisoned lock still guards consistent data.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl PartialEq for MemoryStore {
    fn eq(&self, other: &Self) -> bool {
        self.contents() == other.contents()
    }
}

impl Eq for MemoryStore {}

impl std::hash::Hash for MemoryStore {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.contents().hash(state);
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        crate::observe(self.name(), "begin", async {
            let mut records = self.lock();
            let now = self.now();
            if let Some(record) = records.get(id).filter(|r| r.is_live(now)) {
                if record.fingerprint != *fp {
                    return Ok(Begin::Mismatch);
                }
                return Ok(match &record.state {
                    State::Completed { outcome, .. } => Begin::Replay(outcome.clone()),
                    State::InFlight { lease_until, .. } => Begin::InFlight {
                        retry_after: *lease_until - now,
                    },
                });
            }
            // An expired lease still there was never completed: its outcome is unknown, and
            // only the same request may take it over.
            let taken_over = match records.get(id) {
                Some(Record {
                    state: State::InFlight { .. },
                    fingerprint,
                    ..
                }) if fingerprint != fp => return Ok(Begin::Mismatch),
                Some(Record {
                    state: State::InFlight { .. },
                    ..
                }) => true,
                _ => false,
            };
            let token = self.new_token();
            let record = Record {
                fingerprint: *fp,
                created_at: now,
                state: State::InFlight {
                    token,
                    lease_until: now + lease.min(crate::FOR_GOOD),
                },
            };
            records.insert(*id, record);
            self.schedule(&records, id);
            Ok(if taken_over {
                Begin::TakeOver(token)
            } else {
                Begin::Execute(token)
            })
        })
        .await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        crate::observe(self.name(), "complete", async {
            // One lock for the check and the write: two `complete`s of one token at once (a
            // retry of one whose answer was lost) both succeed, whichever writes.
            let mut records = self.lock();
            let Some(record) = records.get_mut(id) else {
                return Err(Error::LeaseLost);
            };
            match &record.state {
                // Completed by this token already: the first outcome stands.
                State::Completed { token: owner, .. } if *owner == token => return Ok(()),
                State::InFlight { token: owner, .. } if *owner == token => {}
                _ => return Err(Error::LeaseLost),
            }
            record.state = State::Completed {
                token,
                outcome: outcome.clone(),
                expires_at: self.now() + retention.min(crate::FOR_GOOD),
            };
            self.schedule(&records, id);
            Ok(())
        })
        .await
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        crate::observe(self.name(), "release", async {
            self.with_owned(id, token, |records| {
                records.remove(id);
            })
        })
        .await
    }

    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        crate::observe(self.name(), "renew", async {
            self.with_owned(id, token, |records| {
                if let Some(record) = records.get_mut(id)
                    && let State::InFlight { lease_until, .. } = &mut record.state
                {
                    *lease_until = self.now() + lease.min(crate::FOR_GOOD);
                    self.schedule(records, id);
                }
            })
        })
        .await
    }

    /// Takes the due deadlines off the heap, earliest first, and removes each record whose
    /// deadline (read now: a renewal or a completion may have moved it) has passed.
    async fn purge_expired(&self, batch: usize) -> Result<u64> {
        let mut records = self.lock();
        let mut deadlines = lock(&self.deadlines);
        let now = self.now();
        let mut purged = 0;
        while purged < batch {
            match deadlines.peek() {
                Some(Reverse((at, _))) if *at <= now => {}
                _ => break,
            }
            let Some(Reverse((_, id))) = deadlines.pop() else {
                break;
            };
            let due = records
                .get(&id)
                .and_then(|record| self.purge_at(record))
                .is_some_and(|at| at <= now);
            if due {
                records.remove(&id);
                purged += 1;
            }
        }
        Ok(purged as u64)
    }

    async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>> {
        let records = self.lock();
        let now = self.now();
        // This store's clock is an `Instant`: its times are mapped onto the wall clock now.
        let wall = |at: Instant| {
            let wall_now = std::time::SystemTime::now();
            if at >= now {
                wall_now + (at - now)
            } else {
                wall_now - (now - at)
            }
        };
        Ok(records.get(id).and_then(|record| match &record.state {
            State::InFlight { lease_until, .. } => Some(Inspection::in_flight(
                record.fingerprint,
                Some(wall(record.created_at)),
                wall(*lease_until),
                lease_until.saturating_duration_since(now),
            )),
            State::Completed {
                outcome,
                expires_at,
                ..
            } => (*expires_at > now).then(|| {
                Inspection::completed(
                    record.fingerprint,
                    Some(wall(record.created_at)),
                    wall(*expires_at),
                    outcome.status,
                )
            }),
        }))
    }

    async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased> {
        let mut records = self.lock();
        let now = self.now();
        let found = match records.get(id).map(|r| &r.state) {
            None => ForceReleased::Absent,
            Some(State::InFlight { lease_until, .. }) if *lease_until > now && !scope.live => {
                ForceReleased::Live
            }
            Some(State::InFlight { .. }) => ForceReleased::Released,
            Some(State::Completed { expires_at, .. }) if *expires_at <= now => {
                ForceReleased::Absent
            }
            Some(State::Completed { .. }) if scope.completed => ForceReleased::Deleted,
            Some(State::Completed { .. }) => ForceReleased::Completed,
        };
        if matches!(found, ForceReleased::Released | ForceReleased::Deleted) {
            records.remove(id);
        }
        Ok(found)
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn begin_settles_when_dropped(&self) -> bool {
        // `begin` never awaits: dropped, it did nothing or everything.
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each attempt leaves a deadline in the queue, which a release does not take out: a
    /// key retried 10,000 times through a handler that fails (each attempt released) left
    /// 10,000 entries for a day, and for good under an unknown-outcome retention of
    /// `FOR_GOOD`. The queue is now rebuilt once it is twice the records.
    #[tokio::test]
    async fn released_attempts_do_not_grow_the_deadline_queue() {
        let store =
            MemoryStore::with_manual_clock().with_unknown_outcome_retention(crate::FOR_GOOD);
        let (id, fp) = (RecordId::from_bytes([1; 32]), Fingerprint::of(b"p"));
        for _ in 0..10_000 {
            let Ok(Begin::Execute(token)) = store.begin(&id, &fp, Duration::from_secs(30)).await
            else {
                panic!("a released key runs again");
            };
            store.release(&id, token).await.expect("release");
        }
        assert!(
            lock(&store.deadlines).len() <= 1024 + 2,
            "{}",
            lock(&store.deadlines).len()
        );
    }
}
