//! The in-process store: for unit tests and the zero-setup demo. Single process only.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
    time::Duration,
};

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{
    Begin, Error, Fingerprint, LATE_COMPLETION_GRACE, LeaseToken, Outcome, RecordId, Result, Store,
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
}

#[derive(Debug)]
struct Record {
    fingerprint: Fingerprint,
    state: State,
}

#[derive(Debug)]
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

    /// How many records the map holds, expired ones included.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<RecordId, Record>> {
        // A panic while holding the lock cannot leave a record half-written (every update is a
        // single assignment), so a poisoned map is still consistent.
        self.records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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

#[async_trait]
impl Store for MemoryStore {
    async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
        let mut records = self.lock();
        let now = Instant::now();
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
        let token = LeaseToken::generate();
        records.insert(
            *id,
            Record {
                fingerprint: *fp,
                state: State::InFlight {
                    token,
                    lease_until: now + lease,
                },
            },
        );
        Ok(Begin::Execute(token))
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<()> {
        {
            let records = self.lock();
            if let Some(Record {
                state: State::Completed { token: owner, .. },
                ..
            }) = records.get(id)
                && *owner == token
            {
                return Ok(()); // completed by this token already: the first outcome stands
            }
        }
        self.with_owned(id, token, |records| {
            if let Some(record) = records.get_mut(id) {
                record.state = State::Completed {
                    token,
                    outcome: outcome.clone(),
                    expires_at: Instant::now() + retention,
                };
            }
        })
    }

    async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
        self.with_owned(id, token, |records| {
            records.remove(id);
        })
    }

    async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
        self.with_owned(id, token, |records| {
            if let Some(Record {
                state: State::InFlight { lease_until, .. },
                ..
            }) = records.get_mut(id)
            {
                *lease_until = Instant::now() + lease;
            }
        })
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64> {
        let mut records = self.lock();
        let now = Instant::now();
        let expired: Vec<RecordId> = records
            .iter()
            .filter(|(_, r)| match r.state {
                // An expired lease stays a while for its owner's late completion.
                State::InFlight { lease_until, .. } => lease_until + LATE_COMPLETION_GRACE <= now,
                State::Completed { expires_at, .. } => expires_at <= now,
            })
            .map(|(id, _)| *id)
            .take(batch)
            .collect();
        for id in &expired {
            records.remove(id);
        }
        Ok(expired.len() as u64)
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}
