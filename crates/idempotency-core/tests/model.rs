//! The record state machine, model-checked: every interleaving of three workers, an operator
//! and a purger, with a store clock, up to a bound, explored exhaustively by `stateright` —
//! against the real [`MemoryStore`], not a copy of its rules. Each model state holds a
//! `MemoryStore` with a manual clock (its `Clone`/`Eq`/`Hash` compare records and clock), and
//! every action calls the store's own `begin` / `complete` / `release` / `renew` /
//! `purge_expired` / `force_release`.
//!
//! Workers may begin, run the effect, complete, release (before the effect: an error), renew,
//! crash at any step, or stall for any number of clock ticks (time advances between any two
//! steps), so they complete late, after their lease ran out. Leases, retention and the
//! unknown-outcome retention expire. Seven configurations, each explored whole:
//! - three workers sending one request;
//! - two sending it while a third sends another body under the same key;
//! - two workers whose `begin` or `complete` may land with its answer lost (the worker tries
//!   again: a claim nobody holds, a completion repeated), a lease its holder ends at once
//!   (`renew` for zero) before giving up, a purger that may run at any
//!   moment, and an operator who may release an expired attempt or forget a completed
//!   outcome (`force_release`, default scope or with completed records);
//! - the same around two workers sending different bodies;
//! - two workers and an operator who releases live leases too (`with_live`);
//! - two workers of `Executor::run_with_claim` whose transactions commit the effect with its
//!   completion or roll back (returning `Ok` all the same), and the executor's confirmation
//!   of each: a release (its answer may be lost), then a completion with the same token, then
//!   a read of the record;
//! - two workers behind the lease gate (`Policy::surely_held`): each runs its effect only
//!   until a lease's length after its `begin` or its last renewal answered `Ok` was asked
//!   for, and renews in three steps (asked, landed, answered or its answer lost).
//!
//! Properties (`docs/model.md` maps them to Postgres and Redis):
//! - (a) `at most one effect per window`: a second effect in a retention window only where
//!   an owner lost its lease without completing — a takeover of a crashed owner that had run
//!   the effect, or of one still holding (stalled) — or where an operator asked for it;
//! - (b) `replays return the completed execution`: a replay carries the outcome of the
//!   execution whose `complete` the store accepted, never another;
//! - (c) `answerable once the lease ran out`: once the last lease granted or renewed has run
//!   out, a `begin` (either body) does not answer `InFlight`, whether its owner stopped or is
//!   still stalled;
//! - (d) `fenced writes change nothing`: a `complete`/`release`/`renew` with a token that does
//!   not own the record — or a `release`/`renew` of a record its token completed — answers
//!   `LeaseLost` and leaves the store as it was; no call answers any other error;
//! - (e) `begin answers what the record is`: a specification of five lines (`expected`) —
//!   `Mismatch` for a kept record of another body, `InFlight` (with the lease's remaining
//!   time) while an unfinished lease lives, `TakeOver` once it ran out, `Replay` of a
//!   completed outcome within its retention, `Execute` otherwise — against every answer;
//! - (f) `an owner's write is accepted`: the token that owns the record completes, renews and
//!   releases it, however late (a late completion refused runs the operation twice), and a
//!   repeated `complete` answers `Ok` while the outcome is kept, changing nothing;
//! - (g) `the purge removes what is due, and only that`: a completed record past its
//!   retention, an unfinished one past its lease and the unknown-outcome retention;
//! - (h) `an operator's release answers what the record is` and deletes only within its
//!   scope; the token it fenced off stays fenced (d);
//! - (i) `a confirmation tells a commit from a rollback`: a rollback is never confirmed (nor
//!   its value stored), a commit still kept never reported as not committed;
//! - (j) `a gated holder's effect runs only while its lease lives`: its token owns the
//!   record and the store's lease for it has not run out.

use std::time::Duration;

use futures::executor::block_on;
use idempotency_core::{
    Begin, Error, Fingerprint, ForceReleased, IdempotencyKey, LeaseToken, MemoryStore, Outcome,
    RecordId, ReleaseScope, Scope, Store,
};
use stateright::{Checker, Model, Property};

const WORKERS: usize = 3;
/// `begin` calls per worker (a retry after `InFlight` or a lost answer is another attempt).
const ATTEMPTS: u8 = 2;
const TICK: Duration = Duration::from_secs(1);
const LEASE: Duration = Duration::from_secs(2);
const RETENTION: Duration = Duration::from_secs(4);
/// How long an attempt whose lease ran out unfinished is kept (the stores' default is a
/// day; short here so that the purge of one is explored).
const KEEP_UNKNOWN: Duration = Duration::from_secs(2);
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
    /// An operation of `Executor::run_with_claim` returned `Ok`; the executor now confirms
    /// its commit by a release (`Returned`) and then, if that was refused, a completion with
    /// the same token (`Confirming`).
    Returned(Transaction),
    Confirming(Transaction),
    Finished,
}

/// What an operation of `Executor::run_with_claim` did in its transaction, which stored its
/// completion: committed it with its effect, or rolled back (silently: `Ok` all the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Transaction {
    token: LeaseToken,
    /// What the completion stores (for a rollback, a value whose effect never ran).
    label: u8,
    committed: bool,
    /// The end of a committed completion's retention.
    kept_until: u8,
}

/// A gated holder's view of its lease: the lease gate of `Executor::run` and of the layer
/// (`Policy::surely_held`). It counts on its lease until `sure_until`, the lease's length
/// after its `begin` or its last renewal answered `Ok` was *asked* for (the store counts the
/// lease from when the call lands, no earlier); past that, its operation is not polled
/// until a renewal answers. (The real gate keeps a margin for clock rates and rounding; the
/// model's clock is the store's, so it needs none.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Gate {
    sure_until: u8,
    renewal: Renewal,
    /// A renewal's `Ok` moved `sure_until` (a witness).
    renewed: bool,
}

/// A gated holder's renewal, in three steps with the clock running between them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
enum Renewal {
    #[default]
    Idle,
    /// Asked at this tick, not landed yet.
    Asked(u8),
    /// Landed (`kept`: the store renewed the lease), its answer on the way.
    Landed { asked: u8, kept: bool },
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
    /// Each worker's lease gate (default, and unused, unless the protocol gates).
    gates: [Gate; WORKERS],
    // Ghost variables: what the properties are stated over, derived from the store's answers.
    /// Effects run so far.
    effects: u8,
    /// Effects the guarantee allows: one per retention window, plus one per owner that lost
    /// its lease without completing and ran (or runs) its effect anyway (taken over, purged
    /// or released by an operator after it crashed having run it, or still holding a token
    /// that no longer owns the record), plus one per completed outcome an operator deleted.
    allowed: u8,
    /// The worker and token of the latest grant, while its record is kept.
    owner: Option<(usize, LeaseToken)>,
    /// The fingerprint (index) the kept record was claimed with.
    record_fp: Option<usize>,
    /// The label of the outcome whose `complete` the store accepted in this window.
    completed: Option<u8>,
    completed_until: u8,
    /// When the owner's lease ends: granted or last renewed.
    lease_until: u8,
    /// Violations, one per property.
    bad_replay: bool,
    fence_broken: bool,
    double_claim: bool,
    misanswered: bool,
    owner_refused: bool,
    bad_purge: bool,
    bad_release: bool,
    /// A call answered with an error other than `LeaseLost` (the store is never down here).
    errored: bool,
    /// Witnesses that the bounds reach the cases that matter.
    late_completion_accepted: bool,
    crashed_owner_taken_over: bool,
    takeover_reported: bool,
    replay_reported: bool,
    mismatch_reported: bool,
    lost_claim_taken_over: bool,
    repeated_complete: bool,
    unknown_purged: bool,
    operator_released: bool,
    lease_ended: bool,
    live_released: bool,
    /// A grant whose answer was lost: its lease is held by nobody.
    orphan: bool,
    /// (i): a confirmation said `Committed` of a rollback, or `NotCommitted` of a commit
    /// still kept.
    misconfirmed: bool,
    /// Witnesses of the confirmations' answers.
    confirmed_commit: bool,
    rollback_released: bool,
    rollback_taken_over: bool,
    confirmation_unknown: bool,
    /// (j): a gated holder's effect ran while its token did not hold a live lease.
    gate_passed: bool,
    /// Witnesses of the gate: a holder ran after a renewal moved its window, one was
    /// stopped by a renewal answered `LeaseLost`, one was taken over while it waited.
    gated_ran_on_renewal: bool,
    gated_stopped: bool,
    gated_taken_over_waiting: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Tick,
    Begin(usize),
    /// A `begin` that lands, its answer lost: the worker tries again.
    BeginLost(usize),
    Run(usize),
    Complete(usize),
    /// A `complete` that lands, its answer lost: the worker still holds the token.
    CompleteLost(usize),
    Release(usize),
    Renew(usize),
    /// A holder that gives up before running its effect ends its lease now, keeping the
    /// record (`renew` for zero: what `end_orphan` does with a takeover nobody received).
    End(usize),
    Crash(usize),
    Purge,
    /// An operator's `force_release`, in a scope that may take live leases and completed
    /// records too.
    ForceRelease {
        live: bool,
        completed: bool,
    },
    /// An operation of `run_with_claim`: its transaction runs the effect and stores its
    /// completion (`complete_claim_in`), and commits; refused, it rolls back and fails.
    Commit(usize),
    /// Its transaction rolls back after the completion was accepted, and it returns `Ok`.
    RollBack(usize),
    /// The executor's confirmation: its release; `Lost`, the release lands, its answer lost
    /// (tried again).
    ConfirmRelease(usize),
    ConfirmReleaseLost(usize),
    /// The confirmation's completion with the claim's token, after a refused release.
    ConfirmComplete(usize),
    /// A gated holder's renewal: asked, landed, answered (or its answer lost: `Unavailable`,
    /// and the holder asks again later).
    RenewAsk(usize),
    RenewLand(usize),
    RenewAnswer(usize),
    RenewAnswerLost(usize),
}

/// What `begin` must answer, from the ghost record alone.
#[derive(Debug, PartialEq, Eq)]
enum Expect {
    Execute,
    TakeOver,
    Replay(u8),
    InFlight(u8),
    Mismatch,
}

struct Protocol {
    id: RecordId,
    fps: [Fingerprint; 2],
    /// Which fingerprint each worker sends; `None`: no such worker.
    sends: [Option<usize>; WORKERS],
    /// Lost answers, the purger and the operator.
    extras: bool,
    /// An operator who releases live leases too (with completed records or not).
    live_operator: bool,
    /// Workers that store their result in their effect's transaction, and confirm it.
    transactional: bool,
    /// Workers whose effect runs only while they surely hold their lease (the lease gate).
    gated: bool,
    /// Set once exploring met a fenced write by a token that may not write, refused with the
    /// store unchanged: (d) was not vacuous. A witness kept out of the state, which it would
    /// split in two (twice the states for one bit); checked after the exploration, which
    /// visits every reachable step, as a `sometimes` property would be.
    stale_write_refused: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

fn outcome(label: u8) -> Outcome {
    Outcome::new(201).with_body(vec![label])
}

fn ticks(d: Duration) -> u8 {
    (d.as_secs() / TICK.as_secs()) as u8
}

impl State {
    fn unfinished(&self) -> bool {
        self.owner.is_some() && self.completed.is_none()
    }

    fn completed_live(&self) -> bool {
        self.completed.is_some() && self.ticks < self.completed_until
    }

    fn owns(&self, token: LeaseToken) -> bool {
        self.owner.is_some_and(|(_, t)| t == token)
    }

    /// (e): the specification of `begin`.
    fn expected(&self, fp: usize) -> Expect {
        let kept = self.unfinished() || self.completed_live();
        if kept && self.record_fp != Some(fp) {
            Expect::Mismatch
        } else if self.unfinished() && self.ticks < self.lease_until {
            Expect::InFlight(self.lease_until - self.ticks)
        } else if self.unfinished() {
            Expect::TakeOver
        } else if let (true, Some(label)) = (self.completed_live(), self.completed) {
            Expect::Replay(label)
        } else {
            Expect::Execute
        }
    }

    /// The store accepted the completion of `label` now (late, if its lease ran out).
    fn completed_now(&mut self, label: u8) {
        if self.ticks >= self.lease_until {
            self.late_completion_accepted = true;
        }
        self.completed = Some(label);
        self.completed_until = self.ticks + ticks(RETENTION);
        self.orphan = false;
    }

    /// The record is gone (released, purged, deleted): the effect its owner ran or runs
    /// may run again, as after a takeover.
    fn forget(&mut self) {
        self.allow_again_after_owner();
        self.owner = None;
        self.record_fp = None;
        self.completed = None;
        self.orphan = false;
    }

    /// An owner that lost its record without completing: if it ran the effect (crashed
    /// after it, or still holding), the next owner's effect is a second one the guarantee
    /// allows. (One that has not run yet is counted if it runs anyway: `Run`.)
    fn allow_again_after_owner(&mut self) {
        if self.completed.is_some() {
            return;
        }
        let Some((previous, token)) = self.owner else {
            return;
        };
        match self.workers[previous] {
            Worker::Holding {
                ran: true,
                token: t,
                ..
            } if t == token => self.allowed += 1,
            Worker::Crashed { ran: true } => {
                self.allowed += 1;
                self.crashed_owner_taken_over = true;
            }
            _ => {}
        }
    }
}

impl Protocol {
    fn new(sends: [Option<usize>; WORKERS], extras: bool) -> Self {
        Self::with_operator(sends, extras, false)
    }

    fn with_operator(sends: [Option<usize>; WORKERS], extras: bool, live_operator: bool) -> Self {
        Self {
            id: RecordId::new(
                &Scope::new("model"),
                &IdempotencyKey::new("k").expect("a valid key"),
            ),
            fps: [
                Fingerprint::of(b"request"),
                Fingerprint::of(b"another body"),
            ],
            sends,
            extras,
            live_operator,
            transactional: false,
            gated: false,
            stale_write_refused: Default::default(),
        }
    }

    /// Workers whose effect runs only while their lease surely lives, and that renew it in
    /// three steps (asked, landed, answered) with the clock running between them.
    fn gated(sends: [Option<usize>; WORKERS]) -> Self {
        Self {
            gated: true,
            ..Self::new(sends, false)
        }
    }

    /// Workers of `Executor::run_with_claim` that commit or roll back, and confirm.
    fn transactional(sends: [Option<usize>; WORKERS]) -> Self {
        Self {
            transactional: true,
            ..Self::new(sends, false)
        }
    }

    /// The transaction of worker `w`: its effect and its completion commit together, or
    /// (the completion refused) neither does.
    fn commit(&self, next: &mut State, w: usize) -> Option<()> {
        let Worker::Holding {
            token, ran: false, ..
        } = next.workers[w]
        else {
            return None;
        };
        let (id, label) = (self.id, next.effects + 1);
        let due = next.owns(token) && next.unfinished();
        let committed = self
            .fenced(next, due, due, |s| {
                block_on(s.complete(&id, token, &outcome(label), RETENTION))
            })
            .is_ok();
        if !committed {
            next.workers[w] = Worker::Finished; // rolled back; its release is refused
            return Some(());
        }
        next.effects = label;
        next.completed_now(label);
        next.workers[w] = Worker::Returned(Transaction {
            token,
            label,
            committed: true,
            kept_until: next.completed_until,
        });
        Some(())
    }

    /// The confirmation's release: through, the completion did not commit; refused, the
    /// completion comes next. `lost`: it lands, and its answer does not come back.
    fn confirm_release(&self, next: &mut State, w: usize, lost: bool) -> Option<()> {
        let Worker::Returned(tx) = next.workers[w] else {
            return None;
        };
        let (id, token) = (self.id, tx.token);
        let may = next.owns(token) && next.unfinished();
        let released = self
            .fenced(next, may, may, |s| block_on(s.release(&id, token)))
            .is_ok();
        if released {
            next.owner = None;
            next.record_fp = None;
        }
        if lost {
            // Tried again: only a release that landed differs from one seen.
            return released.then_some(());
        }
        next.workers[w] = if released {
            next.misconfirmed |= tx.committed;
            next.rollback_released = true;
            Worker::Finished
        } else {
            Worker::Confirming(tx)
        };
        Some(())
    }

    /// The confirmation's completion with the claim's token: accepted, committed; refused,
    /// the record read tells (another attempt's: not committed; none: unknown).
    fn confirm_complete(&self, next: &mut State, w: usize) -> Option<()> {
        let Worker::Confirming(Transaction {
            token,
            label,
            committed,
            kept_until,
        }) = next.workers[w]
        else {
            return None;
        };
        let id = self.id;
        let may = next.owns(token);
        let repeat = may && next.completed.is_some();
        let before = next.store.clone();
        let result = self.fenced(next, may, repeat, |s| {
            block_on(s.complete(&id, token, &outcome(label), RETENTION))
        });
        if result.is_ok() {
            // Only a repeat of a completion that committed, changing nothing.
            next.misconfirmed |= !committed || !repeat || next.store != before;
            next.confirmed_commit = true;
        } else {
            match block_on(next.store.0.inspect(&id)) {
                Ok(Some(_)) => {
                    next.misconfirmed |= committed && next.ticks < kept_until;
                    next.rollback_taken_over |= !committed;
                }
                Ok(None) => next.confirmation_unknown = true,
                Err(_) => next.errored = true,
            }
        }
        next.workers[w] = Worker::Finished;
        Some(())
    }

    /// A fenced write: if `may` says the token may not write (another token owns the
    /// record, or nobody; or, for a renewal or a release, its own record is completed), it
    /// must fail and leave the store exactly as it was (d); if `must` says the write is due,
    /// it must succeed (f). A failure is `LeaseLost`, never another error.
    fn fenced(
        &self,
        next: &mut State,
        may: bool,
        must: bool,
        write: impl FnOnce(&MemoryStore) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let before = next.store.clone();
        let result = write(&next.store.0);
        if !may && (result.is_ok() || next.store != before) {
            next.fence_broken = true;
        }
        if !may && matches!(result, Err(Error::LeaseLost)) && next.store == before {
            self.stale_write_refused
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if must && result.is_err() {
            next.owner_refused = true;
        }
        if matches!(result, Err(ref error) if !matches!(error, Error::LeaseLost)) {
            next.errored = true;
        }
        result
    }

    /// `begin` for worker `w`, checked against the specification; `lost`: its answer never
    /// reaches the worker. `None` when a lost answer would be no different from a seen one.
    fn begin(&self, next: &mut State, w: usize, lost: bool) -> Option<()> {
        let Worker::Ready { attempts } = next.workers[w] else {
            return None;
        };
        let fp = self.sends[w]?;
        let expected = next.expected(fp);
        let Ok(answer) = block_on(next.store.0.begin(&self.id, &self.fps[fp], LEASE)) else {
            next.errored = true;
            return Some(());
        };
        let seen = match &answer {
            Begin::Execute(_) => Expect::Execute,
            Begin::TakeOver(_) => Expect::TakeOver,
            Begin::Replay(outcome) => Expect::Replay(outcome.body.first().copied().unwrap_or(0)),
            Begin::InFlight { retry_after } => Expect::InFlight(ticks(*retry_after)),
            Begin::Mismatch => Expect::Mismatch,
        };
        if seen != expected {
            next.misanswered = true;
        }
        let left = attempts - 1;
        match answer {
            Begin::Execute(token) | Begin::TakeOver(token) => {
                if matches!(expected, Expect::InFlight(_)) {
                    next.double_claim = true;
                }
                if matches!(answer, Begin::TakeOver(_)) {
                    next.takeover_reported = true;
                    if next.orphan {
                        next.lost_claim_taken_over = true;
                    }
                }
                // A new retention window after the last one expired, or a takeover: the
                // effect may run again if the previous owner ran it.
                if next.completed.is_some() {
                    next.allowed += 1;
                    next.completed = None;
                } else {
                    next.allow_again_after_owner();
                }
                if let Some((previous, _)) = next.owner
                    && matches!(next.workers[previous], Worker::Holding { ran: false, .. })
                    && self.gated
                    && next.ticks >= next.gates[previous].sure_until
                {
                    next.gated_taken_over_waiting = true;
                }
                if self.gated && !lost {
                    next.gates[w] = Gate {
                        sure_until: next.ticks + ticks(LEASE),
                        ..Gate::default()
                    };
                }
                next.owner = Some((w, token));
                next.record_fp = Some(fp);
                next.lease_until = next.ticks + ticks(LEASE);
                next.orphan = lost;
                next.workers[w] = if lost {
                    Worker::Ready { attempts: left }
                } else {
                    Worker::Holding {
                        token,
                        ran: false,
                        label: 0,
                    }
                };
            }
            _ if lost => return None,
            Begin::Replay(replayed) => {
                if next.completed.map(outcome) != Some(replayed) || next.record_fp != Some(fp) {
                    next.bad_replay = true;
                }
                next.replay_reported = true;
                next.workers[w] = Worker::Finished;
            }
            Begin::InFlight { .. } => next.workers[w] = Worker::Ready { attempts: left },
            Begin::Mismatch => {
                next.mismatch_reported = true;
                next.workers[w] = Worker::Finished;
            }
        }
        Some(())
    }

    fn complete(&self, next: &mut State, w: usize, lost: bool) -> Option<()> {
        let Worker::Holding {
            token,
            label,
            ran: true,
            ..
        } = next.workers[w]
        else {
            return None;
        };
        let id = self.id;
        let repeat = next.owns(token) && next.completed.is_some();
        let due = next.owns(token) && (next.unfinished() || next.completed_live());
        let before = next.store.clone();
        let may = next.owns(token);
        let result = self.fenced(next, may, due, |s| {
            block_on(s.complete(&id, token, &outcome(label), RETENTION))
        });
        if result.is_ok() && repeat {
            // The first outcome stands, for as long as it was kept.
            next.repeated_complete = true;
            if next.store != before {
                next.owner_refused = true;
            }
        } else if result.is_ok() {
            next.completed_now(label);
        }
        if !lost {
            next.workers[w] = Worker::Finished;
        }
        Some(())
    }

    /// A fenced `renew` for `lease` by worker `w` (zero ends the lease now): whether the
    /// store took it.
    fn renew(&self, next: &mut State, w: usize, lease: Duration) -> Option<bool> {
        let Worker::Holding { token, .. } = next.workers[w] else {
            return None;
        };
        let (id, may) = (self.id, next.owns(token) && next.unfinished());
        let renewed = self
            .fenced(next, may, may, |s| block_on(s.renew(&id, token, lease)))
            .is_ok();
        if renewed {
            next.lease_until = next.ticks + ticks(lease);
        }
        Some(renewed)
    }

    fn purge(&self, next: &mut State) -> Option<()> {
        let due = (next.completed.is_some() && next.ticks >= next.completed_until)
            || (next.unfinished() && next.ticks >= next.lease_until + ticks(KEEP_UNKNOWN));
        let before = next.store.clone();
        let Ok(purged) = block_on(next.store.0.purge_expired(usize::MAX)) else {
            next.errored = true;
            return Some(());
        };
        if purged != u64::from(due) || (next.store == before) == due {
            next.bad_purge = true;
        }
        if !due {
            return next.bad_purge.then_some(());
        }
        if next.unfinished() {
            next.unknown_purged = true;
        }
        if next.completed.is_some() {
            // Past its retention: the window had ended; the next `Execute` opens another.
            next.allowed += 1;
        }
        next.forget();
        Some(())
    }

    fn force_release(&self, next: &mut State, live_too: bool, completed_too: bool) -> Option<()> {
        let expected = if next.unfinished() && next.ticks < next.lease_until && !live_too {
            ForceReleased::Live
        } else if next.unfinished() {
            ForceReleased::Released
        } else if next.completed_live() && completed_too {
            ForceReleased::Deleted
        } else if next.completed_live() {
            ForceReleased::Completed
        } else {
            ForceReleased::Absent
        };
        let mut scope = ReleaseScope::default();
        if completed_too {
            scope = scope.with_completed();
        }
        if live_too {
            scope = scope.with_live();
        }
        let before = next.store.clone();
        let Ok(answer) = block_on(next.store.0.force_release(&self.id, scope)) else {
            next.errored = true;
            return Some(());
        };
        let deletes = matches!(expected, ForceReleased::Released | ForceReleased::Deleted);
        if answer != expected || (next.store == before) == deletes {
            next.bad_release = true;
        }
        if !deletes {
            return next.bad_release.then_some(());
        }
        next.operator_released = true;
        if next.unfinished() && next.ticks < next.lease_until {
            next.live_released = true;
        }
        if next.completed.is_some() {
            next.allowed += 1; // the operator asked for the operation to run again
        }
        next.forget();
        Some(())
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            store: Snap(
                MemoryStore::with_manual_clock().with_unknown_outcome_retention(KEEP_UNKNOWN),
            ),
            ticks: 0,
            workers: std::array::from_fn(|w| match self.sends[w] {
                Some(_) => Worker::Ready { attempts: ATTEMPTS },
                None => Worker::Finished,
            }),
            gates: [Gate::default(); WORKERS],
            effects: 0,
            allowed: 1,
            owner: None,
            record_fp: None,
            completed: None,
            completed_until: 0,
            lease_until: 0,
            bad_replay: false,
            fence_broken: false,
            double_claim: false,
            misanswered: false,
            owner_refused: false,
            bad_purge: false,
            bad_release: false,
            errored: false,
            late_completion_accepted: false,
            crashed_owner_taken_over: false,
            takeover_reported: false,
            replay_reported: false,
            mismatch_reported: false,
            lost_claim_taken_over: false,
            repeated_complete: false,
            unknown_purged: false,
            operator_released: false,
            lease_ended: false,
            live_released: false,
            orphan: false,
            misconfirmed: false,
            confirmed_commit: false,
            rollback_released: false,
            rollback_taken_over: false,
            confirmation_unknown: false,
            gate_passed: false,
            gated_ran_on_renewal: false,
            gated_stopped: false,
            gated_taken_over_waiting: false,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.ticks < MAX_TICKS {
            actions.push(Action::Tick);
        }
        if self.extras {
            actions.extend([
                Action::Purge,
                Action::ForceRelease {
                    live: false,
                    completed: false,
                },
                Action::ForceRelease {
                    live: false,
                    completed: true,
                },
            ]);
        }
        if self.live_operator {
            for completed in [false, true] {
                actions.push(Action::ForceRelease {
                    live: true,
                    completed,
                });
            }
        }
        for (w, worker) in state.workers.iter().enumerate() {
            match worker {
                Worker::Ready { attempts } if *attempts > 0 => {
                    actions.push(Action::Begin(w));
                    if self.extras {
                        actions.push(Action::BeginLost(w));
                    }
                }
                Worker::Holding { ran: false, .. } if self.gated => {
                    let gate = state.gates[w];
                    if state.ticks < gate.sure_until {
                        actions.push(Action::Run(w));
                    }
                    match gate.renewal {
                        Renewal::Idle => actions.push(Action::RenewAsk(w)),
                        Renewal::Asked(_) => actions.push(Action::RenewLand(w)),
                        Renewal::Landed { .. } => {
                            actions.extend([Action::RenewAnswer(w), Action::RenewAnswerLost(w)]);
                        }
                    }
                    actions.extend([Action::Release(w), Action::Crash(w)]);
                }
                Worker::Holding { ran: false, .. } if self.transactional => {
                    actions.extend([
                        Action::Commit(w),
                        Action::RollBack(w),
                        Action::Release(w),
                        Action::Renew(w),
                        Action::Crash(w),
                    ]);
                }
                Worker::Returned(_) => actions.extend([
                    Action::ConfirmRelease(w),
                    Action::ConfirmReleaseLost(w),
                    Action::Crash(w),
                ]),
                Worker::Confirming(_) => actions.push(Action::ConfirmComplete(w)),
                Worker::Holding { ran: false, .. } => {
                    actions.extend([
                        Action::Run(w),
                        Action::Release(w),
                        Action::Renew(w),
                        Action::Crash(w),
                    ]);
                    if self.extras {
                        actions.push(Action::End(w));
                    }
                }
                Worker::Holding { ran: true, .. } => {
                    actions.extend([Action::Complete(w), Action::Renew(w), Action::Crash(w)]);
                    if self.extras {
                        actions.push(Action::CompleteLost(w));
                    }
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
            Action::Begin(w) => self.begin(&mut next, w, false)?,
            Action::BeginLost(w) => self.begin(&mut next, w, true)?,
            Action::Run(w) => {
                let Worker::Holding {
                    token, ran: false, ..
                } = next.workers[w]
                else {
                    return None;
                };
                next.effects += 1;
                if !next.owns(token) {
                    next.allowed += 1; // a stalled owner that lost its lease runs anyway
                }
                if self.gated {
                    next.gate_passed |= !next.owns(token) || next.ticks >= next.lease_until;
                    next.gated_ran_on_renewal |= next.gates[w].renewed;
                }
                next.workers[w] = Worker::Holding {
                    token,
                    ran: true,
                    label: next.effects,
                };
            }
            Action::Complete(w) => self.complete(&mut next, w, false)?,
            Action::CompleteLost(w) => {
                // Once one landed, another lost answer is no different from a repeat.
                if let Worker::Holding { token, .. } = next.workers[w]
                    && next.owns(token)
                    && next.completed.is_some()
                {
                    return None;
                }
                self.complete(&mut next, w, true)?;
            }
            Action::Release(w) => {
                let Worker::Holding { token, .. } = next.workers[w] else {
                    return None;
                };
                let (id, may) = (self.id, next.owns(token) && next.unfinished());
                if self
                    .fenced(&mut next, may, may, |s| block_on(s.release(&id, token)))
                    .is_ok()
                {
                    next.owner = None;
                    next.record_fp = None;
                }
                next.workers[w] = Worker::Finished;
            }
            Action::Renew(w) => {
                self.renew(&mut next, w, LEASE)?;
            }
            Action::End(w) => {
                if !matches!(next.workers[w], Worker::Holding { ran: false, .. }) {
                    return None;
                }
                // Over now: (c) and (e) ask for `TakeOver` from the next `begin`.
                next.lease_ended |= self.renew(&mut next, w, Duration::ZERO)?;
                next.workers[w] = Worker::Finished;
            }
            Action::Crash(w) => {
                let ran = match next.workers[w] {
                    Worker::Holding { ran, .. } => ran,
                    Worker::Returned(tx) => tx.committed,
                    _ => return None,
                };
                next.workers[w] = Worker::Crashed { ran };
                next.gates[w] = Gate::default();
            }
            Action::RenewAsk(w) => {
                next.gates[w].renewal = Renewal::Asked(next.ticks);
            }
            Action::RenewLand(w) => {
                let Renewal::Asked(asked) = next.gates[w].renewal else {
                    return None;
                };
                let kept = self.renew(&mut next, w, LEASE)?;
                next.gates[w].renewal = Renewal::Landed { asked, kept };
            }
            Action::RenewAnswer(w) => {
                let Renewal::Landed { asked, kept } = next.gates[w].renewal else {
                    return None;
                };
                if kept {
                    // Counted from the ask: the store counted it from the landing, later.
                    next.gates[w] = Gate {
                        sure_until: asked + ticks(LEASE),
                        renewal: Renewal::Idle,
                        renewed: true,
                    };
                } else {
                    // `LeaseLost`: the operation is stopped where it stands.
                    next.gated_stopped = true;
                    next.workers[w] = Worker::Finished;
                    next.gates[w] = Gate::default();
                }
            }
            Action::RenewAnswerLost(w) => {
                next.gates[w].renewal = Renewal::Idle;
            }
            Action::Commit(w) => self.commit(&mut next, w)?,
            Action::RollBack(w) => {
                let Worker::Holding {
                    token, ran: false, ..
                } = next.workers[w]
                else {
                    return None;
                };
                // What the rolled-back completion held: a value whose effect never ran.
                let label = 100 + w as u8;
                next.workers[w] = Worker::Returned(Transaction {
                    token,
                    label,
                    committed: false,
                    kept_until: 0,
                });
            }
            Action::ConfirmRelease(w) => self.confirm_release(&mut next, w, false)?,
            Action::ConfirmReleaseLost(w) => self.confirm_release(&mut next, w, true)?,
            Action::ConfirmComplete(w) => self.confirm_complete(&mut next, w)?,
            Action::Purge => self.purge(&mut next)?,
            Action::ForceRelease { live, completed } => {
                self.force_release(&mut next, live, completed)?;
            }
        }
        // A gate matters only until the effect ran: forgotten then, states merge.
        for (worker, gate) in next.workers.iter().zip(&mut next.gates) {
            if !matches!(worker, Worker::Holding { ran: false, .. }) {
                *gate = Gate::default();
            }
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always("(a) at most one effect per window", |_, s: &State| {
                s.effects <= s.allowed
            }),
            Property::always(
                "(b) replays return the completed execution",
                |_, s: &State| !s.bad_replay,
            ),
            Property::always(
                "(c) answerable once the lease ran out",
                |m: &Protocol, s: &State| {
                    if s.ticks < s.lease_until {
                        return true;
                    }
                    (0..2).all(|fp| {
                        !matches!(
                            block_on(s.store.0.snapshot().begin(&m.id, &m.fps[fp], LEASE)),
                            Ok(Begin::InFlight { .. })
                        )
                    })
                },
            ),
            Property::always("(d) fenced writes change nothing", |_, s: &State| {
                !s.fence_broken
            }),
            Property::always("every call is answered", |_, s: &State| !s.errored),
            Property::always("(e) begin answers what the record is", |_, s: &State| {
                !s.misanswered
            }),
            Property::always("(e) no claim while a lease lives", |_, s: &State| {
                !s.double_claim
            }),
            Property::always("(f) an owner's write is accepted", |_, s: &State| {
                !s.owner_refused
            }),
            Property::always(
                "(g) the purge removes what is due, and only that",
                |_, s: &State| !s.bad_purge,
            ),
            Property::always(
                "(h) an operator's release answers what the record is",
                |_, s: &State| !s.bad_release,
            ),
            // Reachability: the bounds reach the cases the properties are about.
            Property::sometimes("a completion after its lease ran out", |_, s: &State| {
                s.late_completion_accepted
            }),
            Property::sometimes("a takeover reported", |_, s: &State| s.takeover_reported),
        ];
        // A replay, and a takeover of a crashed owner, need a second client of one body.
        if self.sends.iter().filter(|sends| **sends == Some(0)).count() > 1 {
            properties.push(Property::sometimes("a replay", |_, s: &State| {
                s.replay_reported
            }));
            // Not with transactions: their effect commits with its completion, so no owner
            // that ran its effect is ever taken over.
            if !self.transactional {
                properties.push(Property::sometimes(
                    "a crashed owner is taken over",
                    |_, s: &State| s.crashed_owner_taken_over && s.effects == 2,
                ));
            }
        }
        if self.extras {
            properties.extend([
                Property::sometimes(
                    "a claim whose answer was lost is taken over",
                    |_, s: &State| s.lost_claim_taken_over,
                ),
                Property::sometimes("a repeated complete", |_, s: &State| s.repeated_complete),
                Property::sometimes("an unfinished attempt purged", |_, s: &State| {
                    s.unknown_purged
                }),
                Property::sometimes("an operator's release", |_, s: &State| s.operator_released),
                Property::sometimes("a lease ended early", |_, s: &State| s.lease_ended),
            ]);
        }
        if self.transactional {
            properties.extend([
                Property::always(
                    "(i) a confirmation tells a commit from a rollback",
                    |_, s: &State| !s.misconfirmed,
                ),
                Property::sometimes("a commit confirmed", |_, s: &State| s.confirmed_commit),
                Property::sometimes("a rollback released", |_, s: &State| s.rollback_released),
                Property::sometimes("a rollback found taken over", |_, s: &State| {
                    s.rollback_taken_over
                }),
                Property::sometimes("a confirmation left unknown", |_, s: &State| {
                    s.confirmation_unknown
                }),
            ]);
        }
        if self.gated {
            properties.extend([
                Property::always(
                    "(j) a gated holder's effect runs only while its lease lives",
                    |_, s: &State| !s.gate_passed,
                ),
                Property::sometimes("a gated holder ran on a renewal", |_, s: &State| {
                    s.gated_ran_on_renewal
                }),
                Property::sometimes("a gated holder stopped by a lost lease", |_, s: &State| {
                    s.gated_stopped
                }),
                Property::sometimes(
                    "a gated holder taken over while it waited",
                    |_, s: &State| s.gated_taken_over_waiting,
                ),
            ]);
        }
        if self.live_operator {
            properties.push(Property::sometimes(
                "a live lease released by an operator",
                |_, s: &State| s.live_released,
            ));
        }
        if self.sends.contains(&Some(1)) {
            properties.push(Property::sometimes(
                "another body refused",
                |_, s: &State| s.mismatch_reported,
            ));
        }
        properties
    }
}

/// Explores `protocol` exhaustively; fails if a property does not hold, or if the bound is
/// too large to finish (the cap keeps a model grown by a change from eating the machine).
#[allow(clippy::print_stdout)] // the state counts docs/model.md quotes
fn check(protocol: Protocol) {
    const CAP: usize = 2_000_000;
    let stale_write_refused = protocol.stale_write_refused.clone();
    let checker = protocol
        .checker()
        .target_state_count(CAP)
        .spawn_bfs()
        .join();
    println!(
        "model: {} states ({} unique), depth {}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth()
    );
    checker.assert_properties();
    assert!(
        checker.state_count() < CAP,
        "the model did not finish within {CAP} states"
    );
    assert!(
        stale_write_refused.load(std::sync::atomic::Ordering::Relaxed),
        "no fenced write by a token that may not write was ever refused: (d) held vacuously"
    );
}

/// Three clients send one request: crashes, stalls, late completions, renewals, releases.
#[test]
fn the_state_machine_holds_its_properties_exhaustively() {
    check(Protocol::new([Some(0); WORKERS], false));
}

/// A third client sends another body under the same key: `Mismatch` exactly while a record
/// of the first body is kept, and never a replay of the other body's outcome.
#[test]
fn a_key_reused_with_another_body_holds_its_properties_exhaustively() {
    check(Protocol::new([Some(0), Some(0), Some(1)], false));
}

/// Two clients sending one request, and an operator who releases live leases too, with or
/// without completed records (`ReleaseScope::with_live`): the owner is fenced off, and its
/// effect may run again only because the operator asked.
#[test]
fn an_operator_releasing_live_leases_holds_the_properties_exhaustively() {
    check(Protocol::with_operator(
        [Some(0), Some(0), None],
        false,
        true,
    ));
}

/// Two clients, with answers lost on the way back (a claim nobody holds, a completion
/// repeated), a purger and an operator releasing attempts and forgetting outcomes.
#[test]
fn lost_answers_purges_and_operators_hold_the_properties_exhaustively() {
    check(Protocol::new([Some(0), Some(0), None], true));
}

/// Two clients of `Executor::run_with_claim`, whose transactions commit the effect with its
/// completion or roll back (and return `Ok` all the same), and the executor's confirmation
/// of each: its release, then its completion with the same token. A rollback is never
/// confirmed as a commit (nor stored: a replay of a value whose effect never ran), and a
/// commit still kept is never reported as a rollback, whatever the interleaving with the
/// other client's takeover, the clock, and a release whose answer was lost.
#[test]
fn self_completing_runs_are_confirmed_exhaustively() {
    check(Protocol::transactional([Some(0), Some(0), None]));
}

/// Two clients whose effect runs only while their lease surely lives (the lease gate of
/// `Executor::run` and of the layer): counted from when the `begin` or the last renewal
/// that answered `Ok` was asked for, renewals asked, landing and answered (or their answer
/// lost) with the clock running between the steps. A holder stalled past its lease never
/// runs its effect beside the attempt that took the key over: it waits for a renewal, and
/// one answered `LeaseLost` stops it.
#[test]
fn gated_holders_never_run_beside_a_takeover_exhaustively() {
    check(Protocol::gated([Some(0), Some(0), None]));
}

/// Two clients sending different bodies under one key, with answers lost on the way back,
/// a purger and an operator: `Mismatch` exactly while a record of the other body is kept,
/// however it went (purged, released, forgotten, a claim nobody holds).
#[test]
fn another_body_with_lost_answers_purges_and_operators_holds_the_properties_exhaustively() {
    check(Protocol::new([Some(0), Some(1), None], true));
}
