//! The record state machine, model-checked: every interleaving of three workers and a store
//! clock, up to a bound, explored exhaustively by `stateright` — against the real
//! [`MemoryStore`], not a copy of its rules. Each model state holds a `MemoryStore` with a
//! manual clock (its `Clone`/`Eq`/`Hash` compare records and clock), and every action calls
//! the store's own `begin` / `complete` / `release` / `renew`.
//!
//! Workers may begin, run the effect, complete, release (before the effect: an error), renew,
//! crash at any step, or stall for any number of clock ticks (time advances between any two
//! steps), so they complete late, after their lease ran out; leases and retention expire.
//!
//! Properties (`docs/model.md` maps them to Postgres and Redis):
//! - (a) `at most one effect per window`: a second effect in a retention window only where
//!   an owner lost its lease without completing — a takeover of a crashed owner that had run
//!   the effect, or of one still holding (stalled) — as the README documents;
//! - (b) `replays return the completed execution`: a replay carries the outcome of the
//!   execution whose `complete` the store accepted, never another;
//! - (c) `answerable once owners stopped`: when no worker holds a lease and the last lease
//!   granted or renewed has run out, a `begin` does not answer `InFlight`;
//! - (d) `fenced writes change nothing`: a `complete`/`release`/`renew` with a token that does
//!   not own the record answers `LeaseLost` and leaves the store as it was;
//! - (e) `a takeover is reported exactly when a lease ran out unfinished`: `begin` answers
//!   `TakeOver` (the earlier attempt's outcome is unknown) when, and only when, the record
//!   was claimed and neither completed nor released; a fresh key, a released one, or a
//!   completed one past its retention is `Execute`.

use std::time::Duration;

use futures::executor::block_on;
use idempotency_core::{
    Begin, Error, Fingerprint, IdempotencyKey, LeaseToken, MemoryStore, Outcome, RecordId, Scope,
    Store,
};
use stateright::{Checker, Model, Property};

const WORKERS: usize = 3;
/// `begin` calls per worker (a retry after `InFlight` is another attempt).
const ATTEMPTS: u8 = 2;
const TICK: Duration = Duration::from_secs(1);
const LEASE: Duration = Duration::from_secs(2);
const RETENTION: Duration = Duration::from_secs(4);
/// Clock ticks explored: past a lease, a retention, and a lease after that.
const MAX_TICKS: u8 = 7;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Worker {
    Ready {
        attempts: u8,
    },
    Holding {
        token: LeaseToken,
        ran: bool,
        label: u8,
    },
    Crashed {
        ran: bool,
    },
    Finished,
}

/// The store in a model state: a deep copy per state (`MemoryStore::snapshot`).
#[derive(Debug, PartialEq, Eq, Hash)]
struct Snap(MemoryStore);

impl Clone for Snap {
    fn clone(&self) -> Self {
        Self(self.0.snapshot())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    store: Snap,
    ticks: u8,
    workers: [Worker; WORKERS],
    // Ghost variables: what the properties are stated over, derived from the store's answers.
    /// Effects run so far.
    effects: u8,
    /// Effects the guarantee allows: one per retention window, plus one per owner that lost
    /// its lease without completing and ran (or runs) its effect anyway: taken over after it
    /// crashed having run it, or still holding a token that no longer owns the record.
    allowed: u8,
    /// An `Execute` while the previous owner's lease still lived.
    double_claim: bool,
    /// Witnesses that the bounds reach the cases that matter.
    late_completion_accepted: bool,
    crashed_owner_taken_over: bool,
    /// The worker and token of the latest `Execute`.
    owner: Option<(usize, LeaseToken)>,
    /// The label of the outcome whose `complete` the store accepted in this window.
    completed: Option<u8>,
    completed_until: Option<u8>,
    /// When the last lease granted or renewed ends.
    lease_until: u8,
    bad_replay: bool,
    fence_broken: bool,
    takeover_misreported: bool,
    takeover_reported: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Tick,
    Begin(usize),
    Run(usize),
    Complete(usize),
    Release(usize),
    Renew(usize),
    Crash(usize),
}

struct Protocol {
    id: RecordId,
    fp: Fingerprint,
}

fn outcome(label: u8) -> Outcome {
    Outcome::new(201).with_body(vec![label])
}

fn ticks(d: Duration) -> u8 {
    (d.as_secs() / TICK.as_secs()) as u8
}

impl Protocol {
    fn new() -> Self {
        Self {
            id: RecordId::new(
                &Scope::new("model"),
                &IdempotencyKey::new("k").expect("a valid key"),
            ),
            fp: Fingerprint::of(b"request"),
        }
    }

    /// A fenced write with `token`: if the token does not own the record (another token
    /// does, or nobody), it must fail and leave the store exactly as it was (property d).
    fn fenced(
        &self,
        next: &mut State,
        token: LeaseToken,
        write: impl FnOnce(&MemoryStore) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let before = next.store.clone();
        let owns = next.owner.is_some_and(|(_, t)| t == token);
        let result = write(&next.store.0);
        if !owns && (result.is_ok() || next.store != before) {
            next.fence_broken = true;
        }
        result
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            store: Snap(MemoryStore::with_manual_clock()),
            ticks: 0,
            workers: std::array::from_fn(|_| Worker::Ready { attempts: ATTEMPTS }),
            effects: 0,
            allowed: 1,
            double_claim: false,
            late_completion_accepted: false,
            crashed_owner_taken_over: false,
            owner: None,
            completed: None,
            completed_until: None,
            lease_until: 0,
            bad_replay: false,
            fence_broken: false,
            takeover_misreported: false,
            takeover_reported: false,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.ticks < MAX_TICKS {
            actions.push(Action::Tick);
        }
        for (w, worker) in state.workers.iter().enumerate() {
            match worker {
                Worker::Ready { attempts } if *attempts > 0 => actions.push(Action::Begin(w)),
                Worker::Holding { ran: false, .. } => actions.extend([
                    Action::Run(w),
                    Action::Release(w),
                    Action::Renew(w),
                    Action::Crash(w),
                ]),
                Worker::Holding { ran: true, .. } => {
                    actions.extend([Action::Complete(w), Action::Renew(w), Action::Crash(w)]);
                }
                _ => {}
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut next = last.clone();
        match action {
            Action::Tick => {
                next.store.0.advance(TICK);
                next.ticks += 1;
            }
            Action::Begin(w) => {
                let Worker::Ready { attempts } = next.workers[w] else {
                    return None;
                };
                match block_on(next.store.0.begin(&self.id, &self.fp, LEASE)).ok()? {
                    answer @ (Begin::Execute(_) | Begin::TakeOver(_)) => {
                        let token = answer.lease_token()?;
                        // (e) `TakeOver` exactly when an owner's lease ran out unfinished:
                        // somebody claimed, and neither completed nor released.
                        let unfinished = next.owner.is_some() && next.completed.is_none();
                        if matches!(answer, Begin::TakeOver(_)) != unfinished {
                            next.takeover_misreported = true;
                        }
                        if matches!(answer, Begin::TakeOver(_)) {
                            next.takeover_reported = true;
                        }
                        // A new retention window after the last one expired...
                        if next
                            .completed_until
                            .is_some_and(|until| next.ticks >= until)
                        {
                            next.allowed += 1;
                            next.completed = None;
                            next.completed_until = None;
                        }
                        // ... or a takeover, which must never happen while the previous
                        // owner's lease lives; of an owner that ran its effect and lost its
                        // lease without completing, it allows a second effect. (An owner
                        // taken over before running is counted if it runs anyway: `Run`.)
                        if let Some((previous, _)) = next.owner {
                            let holds = matches!(
                                next.workers[previous],
                                Worker::Holding { .. } | Worker::Crashed { .. }
                            );
                            if holds && next.ticks < next.lease_until {
                                next.double_claim = true;
                            }
                            match next.workers[previous] {
                                Worker::Holding { ran: true, .. } => next.allowed += 1,
                                Worker::Crashed { ran: true } => {
                                    next.allowed += 1;
                                    next.crashed_owner_taken_over = true;
                                }
                                _ => {}
                            }
                        }
                        next.owner = Some((w, token));
                        next.lease_until = next.ticks + ticks(LEASE);
                        next.workers[w] = Worker::Holding {
                            token,
                            ran: false,
                            label: 0,
                        };
                    }
                    Begin::Replay(replayed) => {
                        if next.completed.map(outcome) != Some(replayed) {
                            next.bad_replay = true;
                        }
                        next.workers[w] = Worker::Finished;
                    }
                    Begin::InFlight { .. } => {
                        next.workers[w] = Worker::Ready {
                            attempts: attempts - 1,
                        };
                    }
                    Begin::Mismatch => return None, // one fingerprint: cannot happen
                }
            }
            Action::Run(w) => {
                let Worker::Holding {
                    token, ran: false, ..
                } = next.workers[w]
                else {
                    return None;
                };
                next.effects += 1;
                if next.owner.is_none_or(|(_, owner)| owner != token) {
                    next.allowed += 1; // a stalled owner that lost its lease runs anyway
                }
                next.workers[w] = Worker::Holding {
                    token,
                    ran: true,
                    label: next.effects,
                };
            }
            Action::Complete(w) => {
                let Worker::Holding { token, label, .. } = next.workers[w] else {
                    return None;
                };
                let (id, now) = (self.id, next.ticks);
                let result = self.fenced(&mut next, token, |s| {
                    block_on(s.complete(&id, token, &outcome(label), RETENTION))
                });
                if result.is_ok() {
                    if now >= next.lease_until {
                        next.late_completion_accepted = true;
                    }
                    next.completed = Some(label);
                    next.completed_until = Some(now + ticks(RETENTION));
                }
                next.workers[w] = Worker::Finished;
            }
            Action::Release(w) => {
                let Worker::Holding { token, .. } = next.workers[w] else {
                    return None;
                };
                let id = self.id;
                if self
                    .fenced(&mut next, token, |s| block_on(s.release(&id, token)))
                    .is_ok()
                {
                    next.owner = None;
                }
                next.workers[w] = Worker::Finished;
            }
            Action::Renew(w) => {
                let Worker::Holding { token, .. } = next.workers[w] else {
                    return None;
                };
                let id = self.id;
                if self
                    .fenced(&mut next, token, |s| block_on(s.renew(&id, token, LEASE)))
                    .is_ok()
                {
                    next.lease_until = next.ticks + ticks(LEASE);
                }
            }
            Action::Crash(w) => {
                let Worker::Holding { ran, .. } = next.workers[w] else {
                    return None;
                };
                next.workers[w] = Worker::Crashed { ran };
            }
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("at most one effect per window", |_, s: &State| {
                s.effects <= s.allowed
            }),
            Property::always("replays return the completed execution", |_, s: &State| {
                !s.bad_replay
            }),
            Property::always(
                "answerable once owners stopped",
                |m: &Protocol, s: &State| {
                    let holding = s
                        .workers
                        .iter()
                        .any(|w| matches!(w, Worker::Holding { .. }));
                    if holding || s.ticks < s.lease_until {
                        return true;
                    }
                    !matches!(
                        block_on(s.store.0.snapshot().begin(&m.id, &m.fp, LEASE)),
                        Ok(Begin::InFlight { .. })
                    )
                },
            ),
            Property::always("fenced writes change nothing", |_, s: &State| {
                !s.fence_broken
            }),
            Property::always("no claim while a lease lives", |_, s: &State| {
                !s.double_claim
            }),
            Property::always(
                "a takeover is reported exactly when a lease ran out unfinished",
                |_, s: &State| !s.takeover_misreported,
            ),
            // Reachability: the bounds reach the cases the properties are about.
            Property::sometimes("a completion after its lease ran out", |_, s: &State| {
                s.late_completion_accepted
            }),
            Property::sometimes("a crashed owner is taken over", |_, s: &State| {
                s.crashed_owner_taken_over && s.effects == 2
            }),
            Property::sometimes("a takeover reported", |_, s: &State| s.takeover_reported),
            Property::sometimes("a replay", |_, s: &State| {
                s.completed.is_some()
                    && s.workers.iter().filter(|w| **w == Worker::Finished).count() >= 2
            }),
        ]
    }
}

#[test]
fn the_state_machine_holds_its_properties_exhaustively() {
    let checker = Protocol::new().checker().spawn_bfs().join();
    println!(
        "model: {} states ({} unique), depth {}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth()
    );
    checker.assert_properties();
}
