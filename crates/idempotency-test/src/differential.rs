//! Differential testing: random sequences of calls on one key, answered by a store and by the
//! [`MemoryStore`] the model checker explores (`crates/idempotency-core/tests/model.rs`), must
//! get the same answers. The model proves the memory store's state machine; this carries the
//! proof over to the SQL and Lua stores call by call, instead of only through the cases a
//! person thought of.
//!
//! The sequences leave out the clock: a lease is ended by `renew(token, 0)` (the record is
//! kept, as after a crash) or granted for zero, and an outcome expires by a `complete` with
//! a retention of zero, each followed by a few milliseconds' sleep, so no answer depends on
//! how long a call took. Three workers (two sending one body, the third another), each
//! holding the last token it was granted — stale or not — begin (sometimes losing the
//! answer), complete, release, renew, crash (forget their token); an operator releases
//! within each scope and inspects the record, and a purger runs.
//!
//! The contract leaves one answer open, and it is accepted either way: a repeated
//! `complete` of a record past its retention (memory and Postgres keep it until the purge
//! and answer `Ok`; Redis let the key expire and answers `LeaseLost`).

use std::{fmt::Write as _, sync::Arc, time::Duration};

use idempotency_core::{
    Begin, Error, Fingerprint, ForceReleased, LeaseToken, MemoryStore, Outcome, RecordId,
    RecordState, ReleaseScope, Store,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::conformance::{LONG, fp, fresh_id};

pub(crate) const WORKERS: usize = 3;
/// After a call with a duration of zero: past it on every store's clock (Redis counts
/// a zero as one millisecond).
pub(crate) const PAST_ZERO: Duration = Duration::from_millis(5);

#[derive(Debug, Clone, Copy)]
pub(crate) enum Call {
    /// `lost`: the answer never reaches the worker (it keeps the token it had); `zero`: a
    /// lease of zero, over at once.
    Begin {
        worker: usize,
        lost: bool,
        zero: bool,
    },
    Complete {
        worker: usize,
        expire: bool,
    },
    Release {
        worker: usize,
    },
    Renew {
        worker: usize,
        end: bool,
    },
    /// The worker forgets its token.
    Crash {
        worker: usize,
    },
    ForceRelease {
        live: bool,
        completed: bool,
    },
    Purge,
    Inspect,
}

/// What `inspect` reports, with what differs by store taken out (timestamps, how much of a
/// lease is left): whether the record is completed (its status) or in flight (its lease
/// over or not), and its body's fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seen {
    InFlight { over: bool, body: Fingerprint },
    Completed { status: u16, body: Fingerprint },
    Other,
}

/// What a call answered, with what the contract leaves open taken out: tokens (each store
/// draws its own) and an `InFlight`'s remaining time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    Execute,
    TakeOver,
    Replay(Outcome),
    InFlight,
    Mismatch,
    Ok,
    LeaseLost,
    Released(ForceReleased),
    Purged,
    Inspected(Option<Seen>),
}

/// One side of the comparison: a store and the token each worker holds on it.
pub(crate) struct Side<'a> {
    pub(crate) store: &'a dyn Store,
    pub(crate) tokens: [Option<LeaseToken>; WORKERS],
}

impl Call {
    /// The worker that makes the call with its token or its body; `None` for the
    /// operator's and the purger's calls.
    pub(crate) fn worker(&self) -> Option<usize> {
        match *self {
            Call::Begin { worker, .. }
            | Call::Complete { worker, .. }
            | Call::Release { worker }
            | Call::Renew { worker, .. }
            | Call::Crash { worker } => Some(worker),
            Call::ForceRelease { .. } | Call::Purge | Call::Inspect => None,
        }
    }

    /// Whether it asks for a lease or a retention of zero: over at once (after
    /// [`PAST_ZERO`] on every store's clock).
    pub(crate) fn zero(&self) -> bool {
        matches!(
            self,
            Call::Complete { expire: true, .. }
                | Call::Renew { end: true, .. }
                | Call::Begin { zero: true, .. }
        )
    }
}

impl Side<'_> {
    pub(crate) async fn call(
        &mut self,
        id: &RecordId,
        bodies: &[Fingerprint; 2],
        call: Call,
        step: usize,
    ) -> Answer {
        let store = self.store;
        let written = |result: Result<(), Error>| match result {
            Ok(()) => Answer::Ok,
            Err(Error::LeaseLost) => Answer::LeaseLost,
            Err(other) => panic!("{}: {call:?} failed: {other}", store.name()),
        };
        match call {
            Call::Begin { worker, lost, zero } => {
                let body = &bodies[usize::from(worker == 2)];
                let lease = if zero { Duration::ZERO } else { LONG };
                let answer = store
                    .begin(id, body, lease)
                    .await
                    .unwrap_or_else(|e| panic!("{}: begin failed: {e}", store.name()));
                if let (Some(token), false) = (answer.lease_token(), lost) {
                    self.tokens[worker] = Some(token);
                }
                match answer {
                    Begin::Execute(_) => Answer::Execute,
                    Begin::TakeOver(_) => Answer::TakeOver,
                    Begin::Replay(outcome) => Answer::Replay(outcome),
                    Begin::InFlight { .. } => Answer::InFlight,
                    Begin::Mismatch => Answer::Mismatch,
                }
            }
            Call::Complete { worker, expire } => {
                let token = self.tokens[worker].expect("a worker with a token");
                let outcome = Outcome::new(201).with_body(format!("worker {worker}, step {step}"));
                let retention = if expire { Duration::ZERO } else { LONG };
                written(store.complete(id, token, &outcome, retention).await)
            }
            Call::Release { worker } => {
                let token = self.tokens[worker].expect("a worker with a token");
                written(store.release(id, token).await)
            }
            Call::Renew { worker, end } => {
                let token = self.tokens[worker].expect("a worker with a token");
                let lease = if end { Duration::ZERO } else { LONG };
                written(store.renew(id, token, lease).await)
            }
            Call::Crash { worker } => {
                self.tokens[worker] = None;
                Answer::Ok
            }
            Call::ForceRelease { live, completed } => {
                let mut scope = ReleaseScope::default();
                if live {
                    scope = scope.with_live();
                }
                if completed {
                    scope = scope.with_completed();
                }
                Answer::Released(
                    store
                        .force_release(id, scope)
                        .await
                        .unwrap_or_else(|e| panic!("{}: force_release failed: {e}", store.name())),
                )
            }
            Call::Purge => {
                // Drained: the store may be shared with other cases' expired records.
                while store
                    .purge_expired(1000)
                    .await
                    .unwrap_or_else(|e| panic!("{}: purge failed: {e}", store.name()))
                    >= 1000
                {}
                Answer::Purged
            }
            Call::Inspect => {
                let inspection = store
                    .inspect(id)
                    .await
                    .unwrap_or_else(|e| panic!("{}: inspect failed: {e}", store.name()));
                Answer::Inspected(inspection.map(|record| match record.state {
                    RecordState::InFlight { lease_remaining } => Seen::InFlight {
                        over: lease_remaining.is_zero(),
                        body: record.fingerprint,
                    },
                    RecordState::Completed { status } => Seen::Completed {
                        status,
                        body: record.fingerprint,
                    },
                    _ => Seen::Other,
                }))
            }
        }
    }
}

pub(crate) fn draw(rng: &mut StdRng, holding: [bool; WORKERS]) -> Call {
    loop {
        let worker = rng.random_range(0..WORKERS);
        let call = match rng.random_range(0..100) {
            0..30 => Call::Begin {
                worker,
                lost: rng.random_ratio(1, 8),
                zero: rng.random_ratio(1, 10),
            },
            30..50 => Call::Complete {
                worker,
                expire: rng.random_ratio(1, 4),
            },
            50..58 => Call::Release { worker },
            58..73 => Call::Renew {
                worker,
                end: rng.random_ratio(2, 3),
            },
            73..80 => Call::Crash { worker },
            80..92 => Call::ForceRelease {
                live: rng.random_ratio(1, 4),
                completed: rng.random_bool(0.5),
            },
            92..96 => Call::Inspect,
            _ => Call::Purge,
        };
        let needs_token = matches!(
            call,
            Call::Complete { .. } | Call::Release { .. } | Call::Renew { .. } | Call::Crash { .. }
        );
        if !needs_token || holding[worker] {
            return call;
        }
    }
}

/// Whether the record was completed, and by whom (a worker, or a grant) with a retention of
/// zero: the one answer the contract leaves open.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expiry<K> {
    completed: bool,
    expired_by: Option<K>,
}

impl<K> Default for Expiry<K> {
    fn default() -> Self {
        Self {
            completed: false,
            expired_by: None,
        }
    }
}

impl<K: PartialEq + Copy> Expiry<K> {
    /// Whether `got` differs from the model's `want` only where the contract allows: a
    /// repeated `complete` of a record its retention of zero let expire, `LeaseLost` (Redis
    /// let the key go) where memory and Postgres keep it until the purge and answer `Ok`.
    pub(crate) fn open(&self, call: &Call, by: Option<K>, want: &Answer, got: &Answer) -> bool {
        matches!(call, Call::Complete { .. })
            && by.is_some()
            && self.expired_by == by
            && *want == Answer::Ok
            && *got == Answer::LeaseLost
    }

    /// Follows the record after `call` by `by`, answered `want` by the model's store.
    pub(crate) fn after(&mut self, call: &Call, by: Option<K>, want: &Answer) {
        match call {
            // The first completion sets the retention; a repeat changes nothing.
            Call::Complete { expire, .. } if *want == Answer::Ok && !self.completed => {
                self.completed = true;
                self.expired_by = if *expire { by } else { None };
            }
            Call::Begin { .. } if matches!(want, Answer::Execute | Answer::TakeOver) => {
                *self = Self::default();
            }
            Call::ForceRelease { .. } if *want == Answer::Released(ForceReleased::Deleted) => {
                *self = Self::default();
            }
            _ => {}
        }
    }
}

/// Runs `sequences` random sequences of `steps` calls, each on a fresh key, on `store` and on
/// a [`MemoryStore`], and fails at the first answer that differs, printing the seed and the
/// sequence so far. The seed is `IDEMPOTENCY_DIFFERENTIAL_SEED` if set, else fixed.
pub async fn answers_as_the_model_store_for(store: &dyn Store, sequences: usize, steps: usize) {
    let seed = std::env::var("IDEMPOTENCY_DIFFERENTIAL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_204_u64);
    let mut rng = StdRng::seed_from_u64(seed);
    let bodies = [fp("a"), fp("b")];
    for sequence in 0..sequences {
        let reference_store = MemoryStore::new();
        let mut reference = Side {
            store: &reference_store,
            tokens: [None; WORKERS],
        };
        let mut tested = Side {
            store,
            tokens: [None; WORKERS],
        };
        let (id, model_id) = (fresh_id(), fresh_id());
        let mut expiry = Expiry::default();
        let mut log = String::new();
        for step in 0..steps {
            let call = draw(&mut rng, reference.tokens.map(|t| t.is_some()));
            let want = reference.call(&model_id, &bodies, call, step).await;
            let got = tested.call(&id, &bodies, call, step).await;
            let _ = writeln!(log, "  {step:>2}: {call:?} -> {want:?}");
            let by = call.worker();
            assert!(
                got == want || expiry.open(&call, by, &want, &got),
                "{} answers differently from the model's store (seed {seed}, sequence \
                 {sequence}):\n{log}  the store answered {got:?}",
                store.name()
            );
            expiry.after(&call, by, &want);
            if call.zero() {
                tokio::time::sleep(PAST_ZERO).await;
            }
        }
    }
}

/// [`answers_as_the_model_store_for`] with the suite's size: 60 sequences of 24 calls.
pub async fn answers_as_the_model_store(store: Arc<dyn Store>) {
    answers_as_the_model_store_for(&*store, 60, 24).await;
}
