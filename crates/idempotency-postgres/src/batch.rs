//! Group commit: concurrent calls of one kind coalesced into one statement per batch.
//!
//! A call joins a queue. While fewer than `concurrency` batches of its kind are in flight, it
//! starts one at once, so a lone call pays no wait (and a batch of one runs the per-request
//! statement, exactly). A call arriving while every slot is busy joins the next batch, taken
//! as soon as a slot frees: no timer anywhere. A batch is one statement on arrays (`unnest`),
//! so one round trip and one commit serve up to `max_batch` calls.
//!
//! What a batch does not settle, each caller settles on the per-request path: a batch that
//! failed on a lock (its connections carry a short `lock_timeout`, so one row another
//! transaction holds cannot stall the rest), a deadlock or a serialization race — the
//! statement rolled back, so nothing of it landed — and the rare rows a batch statement cannot
//! decide (a key twice in one completion or fence batch, a row committed while the statement
//! ran; a claim repeated in a batch is answered from the row its first claim met, when that
//! row answers it rather than asks for a takeover), or a batch that found no connection
//! (nothing sent: lone calls held unpolled may keep all of the batches' few). Any other
//! failure fails every caller of the batch with `Unavailable` (but a claim repeated in it,
//! which reads its row per request): one statement, one commit, so never a partial success
//! that looks like a failure or the reverse.
//!
//! Batches of more than one run in tasks of their own: a caller that goes away does not take
//! its neighbours' answers with it, and its own call still lands (which every store call may
//! do; `begin`'s callers are protected by `detached_claim`). A batch of one runs in its
//! caller's task, as the per-request statement would. Should that caller keep its future
//! without polling it — or should a drain task's runtime stop running it (a current-thread
//! runtime between two `block_on`s, workers all blocked) — the slot passes to a new drain
//! task once the batch deadline has gone by, so one parked future cannot stall every call
//! after it; its connection stays with it, and batches that find none left go per request.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU8, Ordering as AtomicOrdering},
    },
    time::Duration,
};

use futures::future::BoxFuture;
use idempotency_core::{Error, Fingerprint, LeaseToken, RecordId, Result};
use sqlx::PgPool;
use tokio::sync::oneshot;

use crate::{
    checkout::{Checkout, QueryAsOnPool},
    store::{PostgresStore, Round, RowView, millis},
};

/// Group-commit settings of a [`PostgresStore`](crate::PostgresStore).
///
/// Concurrent calls of one kind share one statement; a lone call runs at once, alone. The
/// defaults suit a database with a few cores; raise `concurrency` when one statement at a
/// time cannot keep a bigger one busy.
///
/// ```no_run
/// use std::time::Duration;
/// use idempotency_postgres::{GroupCommit, PostgresStore};
///
/// # async fn run() -> Result<(), idempotency_core::Error> {
/// let store = PostgresStore::builder("postgres://app@127.0.0.1/app")
///     .group_commit(
///         GroupCommit::default()
///             .concurrency(2)
///             .max_batch(256)
///             .lock_timeout(Duration::from_millis(50)),
///     )
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupCommit {
    /// Batches of one kind (begin, complete, release, renew) in flight at once (default 1:
    /// on a database with few cores, fewer and larger statements serve the most calls;
    /// raise it when one statement at a time cannot keep the database busy). Measured on 2
    /// cores shared by database, server and load (the bench's `http-first-gc` group), 2 in
    /// flight served 0.83–0.96× the requests of 1 (five runs).
    pub concurrency: usize,
    /// Calls per statement at most (default 128).
    pub max_batch: usize,
    /// How long a batch waits on a row lock before its callers go the per-request way
    /// (default 100 ms).
    pub lock_timeout: Duration,
}

impl Default for GroupCommit {
    fn default() -> Self {
        Self {
            concurrency: 1,
            max_batch: 128,
            lock_timeout: Duration::from_millis(100),
        }
    }
}

impl GroupCommit {
    /// The defaults with `concurrency` batches of a kind in flight.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// The defaults with at most `n` calls per statement.
    pub fn max_batch(mut self, n: usize) -> Self {
        self.max_batch = n.max(1);
        self
    }

    /// How long a batch waits on a row lock before giving its calls back.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }
}

/// How many calls and statements the group commit has served: `calls / statements` is the
/// mean batch size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupCommitStats {
    /// Calls that went through a batch queue.
    pub calls: u64,
    /// Statements (batches) that served them, per-request statements of lone calls included.
    pub statements: u64,
}

/// The four queues and the pool their batches run on.
#[derive(Debug)]
pub(crate) struct Batches {
    pub(crate) pool: PgPool,
    /// Whether `pool` is the batches' own (the builder's), not the per-request one too
    /// ([`PostgresStore::from_pool`](crate::PostgresStore::from_pool)), where all its
    /// connections out is the application's load, not lone calls held.
    pub(crate) own_pool: bool,
    pub(crate) settings: GroupCommit,
    pub(crate) begin: Batcher<BeginJob, Round>,
    pub(crate) complete: Batcher<CompleteJob, Option<Fingerprint>>,
    pub(crate) release: Batcher<FenceJob, bool>,
    pub(crate) renew: Batcher<FenceJob, bool>,
}

impl Batches {
    pub(crate) fn new(pool: PgPool, own_pool: bool, mut settings: GroupCommit) -> Self {
        // The fields are public: zero would mean no drain ever, or empty batches forever.
        settings.concurrency = settings.concurrency.max(1);
        settings.max_batch = settings.max_batch.max(1);
        Self {
            pool,
            own_pool,
            settings,
            begin: Batcher::new(run_begin, |round| matches!(round, Round::Granted(_))),
            complete: Batcher::new(run_complete, |_| false),
            release: Batcher::new(run_release, |_| false),
            renew: Batcher::new(run_renew, |_| false),
        }
    }

    pub(crate) fn stats(&self) -> GroupCommitStats {
        [
            self.begin.stats(),
            self.complete.stats(),
            self.release.stats(),
            self.renew.stats(),
        ]
        .into_iter()
        .fold(GroupCommitStats::default(), |a, b| GroupCommitStats {
            calls: a.calls + b.calls,
            statements: a.statements + b.statements,
        })
    }
}

/// A claim: the batch statement inserts with `token` or reads the live row.
#[derive(Debug)]
pub(crate) struct BeginJob {
    pub(crate) id: RecordId,
    pub(crate) fp: Fingerprint,
    pub(crate) token: LeaseToken,
    pub(crate) lease: Duration,
    /// Whether its statement may have reached Postgres (shared with the claim's rounds).
    pub(crate) wire: Arc<OnWire>,
}

impl BeginJob {
    pub(crate) fn new(id: &RecordId, fp: &Fingerprint, token: LeaseToken, lease: Duration) -> Self {
        Self {
            id: *id,
            fp: *fp,
            token,
            lease,
            wire: Arc::default(),
        }
    }
}

/// Whether a claim's statement may have reached Postgres, so that a grant of its token may
/// commit unseen and must be looked for when the claim is given up. A claim is sent only
/// once a connection was had for it (an error getting one — a connect that failed or hung,
/// a pool timeout — sent nothing), and never after it was given up: whoever sends it and
/// whoever gives it up settle which came first here, so a claim given up while its batch
/// waited for a connection is left out of that batch, and nobody looks for a grant it
/// could not have written. Looked for in vain, each such grant cost a statement per look
/// for 70 minutes, a burst of them on a new primary after every failover.
#[derive(Debug, Default)]
pub(crate) struct OnWire(AtomicU8, std::sync::OnceLock<tokio::time::Instant>);

impl OnWire {
    const PENDING: u8 = 0;
    const SENT: u8 = 1;
    /// Given up before it was sent: it never will be.
    const DROPPED: u8 = 2;
    /// Sent, then given up: its grant is being looked for.
    const GIVEN_BACK: u8 = 3;

    /// With a connection in hand, right before sending: false if the claim was given up
    /// (then it must not be sent).
    pub(crate) fn send(&self) -> bool {
        // Stamped first: a look that sees it sent finds when (one never sent is not looked
        // for, stamp or not).
        let _ = self.1.set(tokio::time::Instant::now());
        matches!(
            self.swap(Self::PENDING, Self::SENT),
            Ok(()) | Err(Self::SENT)
        )
    }

    /// When it was (first) sent, or about to be: a lease it writes runs out no sooner than a
    /// lease later.
    pub(crate) fn sent_at(&self) -> Option<tokio::time::Instant> {
        self.1.get().copied()
    }

    /// Gives the claim up: whether its grant is to be looked for — its statement may have
    /// been sent, and nobody gave it up before (a claim cut off by its caller's budget, then
    /// orphaned by its batch's answer, is looked for once, not twice: the second look would
    /// find nothing, and keep looking for 70 minutes). If it was not sent, it never will be.
    pub(crate) fn give_up(&self) -> bool {
        match self.swap(Self::PENDING, Self::DROPPED) {
            Ok(()) => false,
            Err(Self::SENT) => self.swap(Self::SENT, Self::GIVEN_BACK).is_ok(),
            Err(_) => false,
        }
    }

    /// Gives the claim up if it was not sent yet (then it never will be): whether it was
    /// (its statement may have been sent).
    pub(crate) fn drop_unsent(&self) -> bool {
        !matches!(
            self.swap(Self::PENDING, Self::DROPPED),
            Ok(()) | Err(Self::DROPPED)
        )
    }

    /// Whether the claim was given up before it was sent (it never will be).
    pub(crate) fn dropped(&self) -> bool {
        self.0.load(AtomicOrdering::Acquire) == Self::DROPPED
    }

    /// Whether the claim was sent and then given up (its grant given back, or looked for).
    pub(crate) fn given_back(&self) -> bool {
        self.0.load(AtomicOrdering::Acquire) == Self::GIVEN_BACK
    }

    /// Whether the statement may have been sent.
    pub(crate) fn sent(&self) -> bool {
        matches!(
            self.0.load(AtomicOrdering::Acquire),
            Self::SENT | Self::GIVEN_BACK
        )
    }

    /// `from` to `to`, or what it is instead.
    fn swap(&self, from: u8, to: u8) -> std::result::Result<(), u8> {
        self.0
            .compare_exchange(from, to, AtomicOrdering::AcqRel, AtomicOrdering::Acquire)
            .map(|_| ())
    }
}

#[derive(Debug)]
pub(crate) struct CompleteJob {
    pub(crate) id: RecordId,
    pub(crate) token: LeaseToken,
    pub(crate) status: i16,
    pub(crate) response: Vec<u8>,
    pub(crate) retention: Duration,
}

/// A fenced `release` or `renew` (the lease is ignored by `release`).
#[derive(Debug)]
pub(crate) struct FenceJob {
    pub(crate) id: RecordId,
    pub(crate) token: LeaseToken,
    pub(crate) lease: Duration,
}

pub(crate) trait Keyed {
    fn id(&self) -> &RecordId;
    fn token(&self) -> LeaseToken;
    /// The lease a claim may have written (a `begin` job's token), if it was sent.
    fn claim(&self) -> Option<Claim> {
        None
    }
    /// A claim given up before it was sent (its caller gone): it never will be.
    fn given_up(&self) -> bool {
        false
    }
}

/// A claim's record, token and [`OnWire`].
pub(crate) type Claim = (RecordId, LeaseToken, Arc<OnWire>);

impl Keyed for BeginJob {
    fn id(&self) -> &RecordId {
        &self.id
    }
    fn token(&self) -> LeaseToken {
        self.token
    }
    fn claim(&self) -> Option<Claim> {
        Some((self.id, self.token, self.wire.clone()))
    }
    fn given_up(&self) -> bool {
        self.wire.dropped()
    }
}

macro_rules! keyed {
    ($($job:ty),*) => {$(impl Keyed for $job {
        fn id(&self) -> &RecordId { &self.id }
        fn token(&self) -> LeaseToken { self.token }
    })*};
}
keyed!(CompleteJob, FenceJob);

/// Releases claims whose batch ended in doubt (given up, or its connection broke after
/// sending): the statement may have committed, and nobody holds those tokens. Once the
/// server has had time to finish or cancel it, and again later for a commit that came late
/// (see `PostgresStore::give_back_later`).
/// Only claims that may have been sent: the others are given up here, and never will be.
fn release_later(store: &PostgresStore, claims: Vec<Claim>) {
    let grants: Vec<_> = claims
        .into_iter()
        .filter(|(_, _, wire)| wire.give_up())
        .map(|(id, token, _)| (id, token, false))
        .collect();
    store.give_back_later(&grants);
}

/// Each call's answer: `Ok(None)` when the batch did not settle it and the caller must run
/// the per-request path.
type Answers<R> = Vec<Result<Option<R>>>;
type Run<J, R> = fn(PostgresStore, Vec<J>) -> BoxFuture<'static, Answers<R>>;
type Reply<R> = oneshot::Sender<Result<Option<R>>>;

pub(crate) struct Batcher<J, R> {
    queue: Mutex<Queue<J, R>>,
    run: Run<J, R>,
    /// Whether an answer grants its job's claim (a `begin` that inserted its row).
    grants: fn(&R) -> bool,
}

struct Queue<J, R> {
    waiting: VecDeque<(J, Reply<R>)>,
    running: usize,
    /// The `running` slots, by ticket, with when each holder last began a batch: a lone
    /// call when it took its slot, a drain each time it takes calls from the queue.
    held: Vec<(u64, tokio::time::Instant)>,
    tickets: u64,
    stats: GroupCommitStats,
}

impl<J: Keyed, R> Queue<J, R> {
    /// Takes out the calls nobody will be served for: a caller that went away (a claim past
    /// its budget, a dropped `complete`) must not have its call land after it was given up,
    /// and a claim given up before it was sent (see [`OnWire`]) never will be. Left queued,
    /// they held places in batches, each waiting for a connection during an outage, and
    /// filled the queue, which then refused live claims as if Postgres were not keeping up.
    fn shed(&mut self) {
        let waiting = std::mem::take(&mut self.waiting);
        for (job, reply) in waiting {
            if reply.is_closed() {
                continue;
            }
            if job.given_up() {
                // Its claim is still running (looking for what it sent before): told at once.
                let _ = reply.send(Err(Error::unavailable(
                    "the claim was given up before it was sent",
                )));
                continue;
            }
            self.waiting.push_back((job, reply));
        }
    }
}

impl<J, R> Queue<J, R> {
    /// Notes a slot taken now (counted in `running` by the caller); returns its ticket.
    fn hold(&mut self) -> u64 {
        self.tickets += 1;
        self.held.push((self.tickets, tokio::time::Instant::now()));
        self.tickets
    }

    /// Notes that the holder of `ticket` begins a batch now; false if its slot was taken
    /// from it ([`take_stalled`](Self::take_stalled)).
    fn begins(&mut self, ticket: u64) -> bool {
        match self.held.iter_mut().find(|(held, _)| *held == ticket) {
            Some((_, since)) => {
                *since = tokio::time::Instant::now();
                true
            }
            None => false,
        }
    }

    /// Forgets the slot of `ticket`; false if it was taken from it already.
    fn unhold(&mut self, ticket: u64) -> bool {
        match self.held.iter().position(|(held, _)| *held == ticket) {
            Some(i) => {
                self.held.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// Takes the slot of a holder that began its batch longer ago than the batch deadline,
    /// if any, for a new drain (the caller notes it with [`hold`](Self::hold)). A holder
    /// runs in a future that may stop being polled while alive: a lone call in a caller
    /// parked on something else, or a drain spawned on a runtime that no longer runs its
    /// tasks (a current-thread runtime whose `block_on` returned, a runtime whose workers
    /// are all blocked). It would hold its slot, and so every call queued behind it, from
    /// any runtime, for as long as it is kept. Past the deadline a polled batch has ended
    /// (its timer fired), so a slot still held then is stalled. The stalled holder keeps
    /// the statement it has, answers the calls it took if it is ever polled again, and
    /// gives back nothing when it ends.
    fn take_stalled(&mut self, deadline: Duration) -> bool {
        let now = tokio::time::Instant::now();
        match self
            .held
            .iter()
            .position(|(_, since)| now - *since > deadline)
        {
            Some(i) => {
                self.held.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

impl<J, R> std::fmt::Debug for Batcher<J, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

impl<J: Keyed + Send + 'static, R: Send + 'static> Batcher<J, R> {
    fn new(run: Run<J, R>, grants: fn(&R) -> bool) -> Self {
        Self {
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                running: 0,
                held: Vec::new(),
                tickets: 0,
                stats: GroupCommitStats::default(),
            }),
            run,
            grants,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<J, R>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stats(&self) -> GroupCommitStats {
        self.lock().stats
    }

    /// Runs `job` in a batch and returns its answer. `select` picks this batcher out of the
    /// store, for a task that drains the queue.
    ///
    /// A call that finds a slot free and nobody waiting runs as a batch of one in the
    /// caller's own task (no hand-off: a lone request pays nothing). Otherwise it queues, and
    /// starts a draining task if a slot is free, or held by a stalled holder (see
    /// `Queue::take_stalled`). A
    /// full queue (`max_batch` × 32 calls waiting) refuses a claim at once with
    /// `Unavailable` (back-pressure, not an ever longer wait) and sends any other call the
    /// per-request way; only a call that starts a drain joins it.
    pub(crate) async fn call(
        &self,
        store: &PostgresStore,
        select: fn(&Batches) -> &Self,
        job: J,
    ) -> Result<Option<R>> {
        let settings = store.group_commit_settings();
        let (reply, answer) = oneshot::channel();
        let claim = job.claim();
        let mut job = Some(job);
        let start = {
            let mut queue = self.lock();
            queue.stats.calls += 1;
            if queue.running < settings.concurrency && queue.waiting.is_empty() {
                queue.running += 1;
                queue.stats.statements += 1;
                Start::Lone(queue.hold())
            } else {
                let drain = if queue.running < settings.concurrency {
                    queue.running += 1;
                    true
                } else {
                    queue.take_stalled(batch_deadline(store))
                };
                let drain = drain.then(|| queue.hold());
                // Checked after the takeover: a queue that filled up behind a stalled call
                // would otherwise refuse every call, and none would ever start its drain.
                // The call that starts one joins it, full or not. Full of calls nobody waits
                // for, it is not full.
                let full = settings.max_batch.saturating_mul(32);
                if drain.is_none() && queue.waiting.len() >= full {
                    queue.shed();
                }
                if drain.is_none() && queue.waiting.len() >= full {
                    Start::Full
                } else {
                    if let Some(job) = job.take() {
                        queue.waiting.push_back((job, reply));
                    }
                    Start::Queued { drain }
                }
            }
        };
        // From here, a slot taken above is owned by a guard, whatever happens next.
        let slot = |ticket, lone| Slot {
            store: store.clone(),
            select,
            ticket,
            lone,
            released: false,
        };
        match (start, job) {
            (Start::Lone(ticket), Some(job)) => {
                // Dropped with calls queued behind it, the slot passes to a drain task.
                let _slot = slot(ticket, true);
                let mut answers = run_bounded(self.run, store, vec![job]).await;
                answers
                    .pop()
                    .unwrap_or_else(|| Err(Error::unavailable("a batch lost its answer")))
            }
            // A claim is refused (nothing ran). A complete, release or renew is the write of
            // something that happened: it goes on alone, the per-request way, rather than be
            // refused (an outcome refused now and again is taken, in the end, for the store
            // refusing it for good, and its operation runs again after the lease).
            (Start::Full, _) if claim.is_none() => Ok(None),
            (Start::Full, _) => Err(Error::unavailable(
                "the group commit queue is full: Postgres is not keeping up",
            )),
            (start, _) => {
                if let Start::Queued {
                    drain: Some(ticket),
                } = start
                {
                    tokio::spawn(drain(slot(ticket, false)));
                }
                answer.await.unwrap_or_else(|_| {
                    // The drain was dropped without answering (its runtime shut down, a
                    // panic): its statement may have run, and commit on the server all the
                    // same. A grant nobody holds would answer `InFlight` for the lease, then
                    // `TakeOver` for an operation that never ran: given back from here.
                    release_later(store, claim.into_iter().collect());
                    Err(Error::unavailable("the batch ended without an answer"))
                })
            }
        }
    }
}

/// How a call goes: alone in its own future, holding the slot of this ticket; queued
/// (starting a drain task, with this ticket, when it found a slot for one); or refused, the
/// queue being full.
enum Start {
    Lone(u64),
    Queued { drain: Option<u64> },
    Full,
}

fn batch_deadline(store: &PostgresStore) -> Duration {
    store.call_timeout() * 2
}

/// A batch with a deadline of its own: a connection that hangs (a half-open socket after a
/// failover) must not hold the slot, and every call queued behind it, for the minutes TCP
/// takes to notice. Past it, the batch's calls are `Unavailable`.
async fn run_bounded<J: Keyed, R>(
    run: Run<J, R>,
    store: &PostgresStore,
    jobs: Vec<J>,
) -> Answers<R> {
    let n = jobs.len();
    let claims: Vec<_> = jobs.iter().filter_map(Keyed::claim).collect();
    let deadline = batch_deadline(store);
    match tokio::time::timeout(deadline, run(store.clone(), jobs)).await {
        Ok(answers) => answers,
        Err(_) => {
            release_later(store, claims);
            (0..n)
                .map(|_| {
                    Err(Error::unavailable(format!(
                        "a group-commit batch did not finish within {deadline:?}"
                    )))
                })
                .collect()
        }
    }
}

/// One of a batcher's `concurrency` slots, held by whoever runs its batches: the task of a
/// lone call, or a drain task (moved into it before it is spawned, so even a task that never
/// runs gives the slot back).
struct Slot<J: Keyed + Send + 'static, R: Send + 'static> {
    store: PostgresStore,
    select: fn(&Batches) -> &Batcher<J, R>,
    /// The slot's ticket in `Queue::held` (gone from there once a new drain took the slot
    /// of this holder, stalled).
    ticket: u64,
    /// A lone call's slot: it passes to a drain task when calls are queued behind it; a
    /// drain's does not pass (it ends only when the queue is empty, or abnormally).
    lone: bool,
    /// Given back already (a drain that found the queue empty).
    released: bool,
}

impl<J: Keyed + Send + 'static, R: Send + 'static> Slot<J, R> {
    fn batcher(&self) -> Option<&Batcher<J, R>> {
        self.store.batches().map(self.select)
    }
}

impl<J: Keyed + Send + 'static, R: Send + 'static> Drop for Slot<J, R> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let Some(batcher) = self.batcher() else {
            return;
        };
        let mut queue = batcher.lock();
        if !queue.unhold(self.ticket) {
            return; // a drain has its slot already (`take_stalled`)
        }
        if queue.waiting.is_empty() {
            queue.running -= 1;
            return;
        }
        if self.lone
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            // Calls queued behind this one: a drain task takes the slot over.
            let ticket = queue.hold();
            drop(queue);
            runtime.spawn(drain(Slot {
                store: self.store.clone(),
                select: self.select,
                ticket,
                lone: false,
                released: false,
            }));
            return;
        }
        // A drain that ended abnormally (a panic, its runtime shutting down): the calls it
        // leaves are told `Unavailable` rather than left waiting for a drain that never comes.
        queue.running -= 1;
        queue.waiting.clear();
    }
}

/// Runs batches while calls wait, then frees its slot.
async fn drain<J: Keyed + Send + 'static, R: Send + 'static>(mut slot: Slot<J, R>) {
    let Some(batches) = slot.store.batches() else {
        return;
    };
    let batcher = (slot.select)(batches);
    let max = batches.settings.max_batch;
    loop {
        let jobs: Vec<_> = {
            let mut queue = batcher.lock();
            if !queue.begins(slot.ticket) {
                // Stalled past the deadline, this drain's slot went to another.
                slot.released = true;
                return;
            }
            queue.shed();
            if queue.waiting.is_empty() {
                // Freed under the same lock a caller checks: no call is left without a drain.
                queue.running -= 1;
                queue.unhold(slot.ticket);
                slot.released = true;
                return;
            }
            let n = queue.waiting.len().min(max);
            queue.stats.statements += 1;
            queue.waiting.drain(..n).collect()
        };
        let (jobs, replies): (Vec<J>, Vec<Reply<R>>) = jobs.into_iter().unzip();
        let claims: Vec<_> = jobs.iter().map(Keyed::claim).collect();
        let answers = run_bounded(batcher.run, &slot.store, jobs).await;
        let mut orphaned = Vec::new();
        for ((reply, answer), claim) in replies.into_iter().zip(answers).zip(claims) {
            let granted = matches!(&answer, Ok(Some(r)) if (batcher.grants)(r));
            // A caller that went away: its call landed anyway. A caller dropped while it
            // waits hands its claim to a task that takes this answer, unless it could not
            // (its runtime shutting down): a grant nobody holds would answer `InFlight` for
            // the lease, then `TakeOver` for an operation that never ran: given back.
            if reply.send(answer).is_err() && granted {
                orphaned.extend(claim);
            }
        }
        if !orphaned.is_empty() {
            release_later(&slot.store, orphaned);
        }
    }
}

/// Splits off the jobs whose key came earlier in the batch: one statement cannot insert or
/// update a row twice. They are answered `None` (the per-request path) unless their kind
/// answers them from the first's row (a claim: [`echo_repeats`]); the rest run, in key
/// order: every batch statement locks its rows in the order of its input (a claim's insert
/// sorts them itself), so two batches of different kinds (a completion and a renewal of the
/// same two keys, run side by side) never wait on each other in a cycle, each until its
/// `lock_timeout`, then to be run again one call at a time.
fn split_repeats<J: Keyed>(jobs: &[J]) -> (Vec<usize>, Vec<usize>) {
    let mut seen = HashSet::new();
    let (mut unique, repeats): (Vec<usize>, Vec<usize>) =
        (0..jobs.len()).partition(|&i| seen.insert(*jobs[i].id().as_bytes()));
    unique.sort_unstable_by_key(|&i| jobs[i].id().as_bytes());
    (unique, repeats)
}

/// Whether a failed batch statement rolled back for a reason the per-request path handles:
/// a lock wait past `lock_timeout`, a deadlock between two batches, a serialization race —
/// or one call's own bad input (a data exception, class 22; a message over a limit, 54000),
/// which then fails that call alone instead of every call batched with it. Or it was never
/// sent, for want of a batch connection: the batches have few (four per batch in flight),
/// and a lone call held but never polled again keeps its own, so four such calls would
/// otherwise fail every batch until they were dropped, with the per-request pool free.
fn give_back(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            matches!(&*code, "55P03" | "40P01" | "40001" | "54000") || code.starts_with("22")
        }),
        _ => false,
    }
}

/// Whether a statement was cancelled by `statement_timeout` (and rolled back).
fn statement_timed_out(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("57014"))
}

/// Whether a failed statement may have committed all the same. Not when it never left the
/// pool (a pool timeout), nor when Postgres refused it before or while it ran: the errors
/// [`give_back`] and [`statement_timed_out`] name, class 42 (no such table, a syntax or
/// permission error: nothing ran), class 23 (an integrity constraint refused the row, and
/// the statement's transaction rolled back) and class 25 (the transaction's state refused
/// the statement before it ran: `25006`, a read-only server, as a standby still named by the
/// store's address after a failover, or a role fenced with `default_transaction_read_only`).
/// Every other error may come after the commit: the
/// connection broke, or a pooler answered for a server connection that broke after the
/// statement ran (PgBouncer's `08P01`, its `query_timeout`), as the per-request path
/// assumes too (`claim`: an error is not "nothing happened"). A give-back too many is fenced
/// on its token and finds nothing.
pub(crate) fn in_doubt(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => false,
        sqlx::Error::Database(db) => {
            let refused = give_back(error)
                || statement_timed_out(error)
                || db
                    .code()
                    .is_some_and(|code| ["42", "23", "25"].iter().any(|c| code.starts_with(c)));
            !refused
        }
        _ => true,
    }
}

/// A lone call's answer. It ran the per-request statement, but on the batches' connections:
/// a lock wait past their `lock_timeout` gives the call back too, so that it waits on the
/// per-request pool, not in a batch slot its neighbours need.
fn lone<R>(answer: Result<R>) -> Result<Option<R>> {
    match answer {
        Err(Error::Unavailable(source))
            if source.downcast_ref::<sqlx::Error>().is_some_and(give_back) =>
        {
            Ok(None)
        }
        other => other.map(Some),
    }
}

/// Spreads one statement's answer over its jobs. `unique` are the jobs the statement ran,
/// `rows` its rows keyed by record id.
fn spread<J: Keyed, R, T>(
    jobs: &[J],
    unique: &[usize],
    rows: std::result::Result<Vec<(Vec<u8>, T)>, sqlx::Error>,
    mut answer: impl FnMut(&J, Option<T>) -> Result<Option<R>>,
) -> Answers<R> {
    let mut answers: Answers<R> = jobs.iter().map(|_| Ok(None)).collect();
    match rows {
        Ok(rows) => {
            let mut by_id: std::collections::HashMap<Vec<u8>, T> = rows.into_iter().collect();
            for &i in unique {
                answers[i] = answer(&jobs[i], by_id.remove(&jobs[i].id().as_bytes()[..]));
            }
        }
        // No batch connection: every one out past the short wait (lone calls held unpolled),
        // or none opened within the acquire timeout (Postgres unreachable, where the
        // per-request path waits again). Worth a warning either way.
        Err(error @ sqlx::Error::PoolTimedOut) => {
            tracing::warn!(%error, calls = unique.len(), "no batch connection; the calls go per request");
        }
        Err(error) if give_back(&error) => {
            tracing::debug!(%error, "a batch gave its calls back to the per-request path");
        }
        // A batch past the statement timeout (rolled back) may be too long only for being a
        // batch (many large outcomes, many slow rows): its calls go on alone, each within
        // the timeout, rather than fail together, retry together and fail again.
        Err(error) if unique.len() > 1 && statement_timed_out(&error) => {
            tracing::warn!(%error, calls = unique.len(), "a batch ran past the statement timeout; its calls go on alone");
        }
        Err(error) => {
            tracing::warn!(%error, calls = unique.len(), "a batch statement failed");
            for &i in unique {
                answers[i] = Err(shared_error(&error));
            }
        }
    }
    answers
}

/// One failure, told to each caller of the batch.
fn shared_error(error: &sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = error
        && db.code().as_deref() == Some("42P01")
    {
        return Error::Config(format!(
            "{db}: run PostgresStore::migrate (or idempotency_postgres::migrator()) first"
        ));
    }
    Error::unavailable(format!("group commit: {error}"))
}

fn tokens(jobs: &[impl Keyed], unique: &[usize]) -> Vec<uuid::Uuid> {
    unique.iter().map(|&i| jobs[i].token().as_uuid()).collect()
}

fn ids<J: Keyed>(jobs: &[J], unique: &[usize]) -> Vec<Vec<u8>> {
    unique
        .iter()
        .map(|&i| jobs[i].id().as_bytes().to_vec())
        .collect()
}

/// Inserts every claim it can, in key order (two batches never wait on each other in a
/// cycle), and reads the live row of every other key, in one statement. The read runs in the
/// statement's snapshot, like `BEGIN_SQL`'s: a key inserted concurrently answers nothing and
/// its caller reads again on the per-request path.
///
/// The read is a lateral subquery kept apart by `OFFSET 0`, so that its condition on the
/// insert becomes a one-time filter: an inserted key (nearly every key under load) costs no
/// index lookup. As a plain `LEFT JOIN` the planner looked every key up and then discarded
/// the row.
pub(crate) const BEGIN_BATCH_SQL: &str = "
WITH input AS (
    SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::uuid[], $4::int8[])
        AS t(record_id, fingerprint, lease_token, lease_ms)
), ins AS (
    INSERT INTO idempotency_keys (record_id, fingerprint, state, lease_token, expires_at)
    SELECT record_id, fingerprint, 0, lease_token,
           clock_timestamp() + lease_ms * interval '1 millisecond'
    FROM input ORDER BY record_id
    ON CONFLICT (record_id) DO NOTHING
    RETURNING record_id, expires_at
)
SELECT input.record_id, ins.record_id IS NOT NULL, k.fingerprint, k.state, k.response,
       (extract(epoch FROM coalesce(ins.expires_at, k.expires_at) - clock_timestamp()) * 1000)::float8
FROM input
LEFT JOIN ins ON ins.record_id = input.record_id
LEFT JOIN LATERAL (
    SELECT k.fingerprint, k.state, k.response, k.expires_at FROM idempotency_keys k
    WHERE ins.record_id IS NULL AND k.record_id = input.record_id OFFSET 0
) k ON true";

type BeginBatchRow = (
    Vec<u8>,
    bool,
    Option<Vec<u8>>,
    Option<i16>,
    Option<Vec<u8>>,
    Option<f64>,
);

fn run_begin(store: PostgresStore, jobs: Vec<BeginJob>) -> BoxFuture<'static, Answers<Round>> {
    Box::pin(async move {
        if let [job] = &jobs[..] {
            let answer = store.begin_statement(job, &store.batch_pool()).await;
            if let Err(Error::Unavailable(source)) = &answer
                && source.downcast_ref::<sqlx::Error>().is_some_and(in_doubt)
            {
                release_later(&store, job.claim().into_iter().collect());
            }
            return vec![lone(answer)];
        }
        let (mut unique, repeats) = split_repeats(&jobs);
        // Claims given up while the batch waited for its connection stay out of it.
        let sending = Checkout::acquire_to_send(&store.batch_pool(), || {
            unique.retain(|&i| jobs[i].wire.send());
            !unique.is_empty()
        })
        .await;
        let mut checkout = match sending {
            Ok(Some(checkout)) => checkout,
            Ok(None) => return jobs.iter().map(|_| Ok(None)).collect(),
            // No connection, nothing sent: every call fails, and nothing is looked for.
            Err(error) => {
                let rows = Err::<Vec<(Vec<u8>, ())>, _>(error);
                return spread(&jobs, &unique, rows, |_, _| Ok(None));
            }
        };
        let each = || unique.iter().map(|&i| &jobs[i]);
        let rows: std::result::Result<Vec<_>, _> =
            sqlx::query_as::<_, BeginBatchRow>(store.sql.get(BEGIN_BATCH_SQL))
                .bind(ids(&jobs, &unique))
                .bind(each().map(|j| &j.fp.as_bytes()[..]).collect::<Vec<_>>())
                .bind(tokens(&jobs, &unique))
                .bind(each().map(|j| millis(j.lease)).collect::<Vec<_>>())
                .fetch_all(checkout.conn())
                .await
                .map(|rows| {
                    rows.into_iter()
                        .map(|(id, inserted, f, s, r, ms)| (id, (inserted, f, s, r, ms)))
                        .collect()
                });
        checkout.finished();
        if let Err(error) = &rows
            && in_doubt(error)
        {
            release_later(
                &store,
                unique.iter().filter_map(|&i| jobs[i].claim()).collect(),
            );
        }
        let mut answers = spread(&jobs, &unique, rows, |_, row| {
            Ok(match row {
                Some((true, _, _, _, Some(left))) => Some(Round::Granted(left)),
                Some((false, Some(f), Some(s), r, Some(ms))) => {
                    Some(Round::Row(RowView::from((f, s, r, ms))))
                }
                Some((false, None, None, None, None)) => Some(Round::Hidden),
                Some(_) => return Err(Error::Corrupt("unexpected begin row".into())),
                None => None,
            })
        });
        echo_repeats(&jobs, &unique, &repeats, &mut answers);
        answers
    })
}

/// Answers each repeat of a key in a claim batch whose answer the row the statement met for
/// the key's first claim gives: the row it inserted (in flight, that claim's fingerprint,
/// the lease it has left), as of the statement's commit, or the live row it read, as of the
/// statement's snapshot. Every repeat was queued before the statement ran and is answered
/// after it committed, so either is what a read of the repeat's own could have found at a
/// point within its call. Sent on the per-request path instead, a storm of duplicates of one
/// key took a pooled connection per duplicate, and on a busy pool answered `Unavailable` (a
/// 503) rather than `InFlight` (a 409).
///
/// Only a row that answers (`InFlight`, `Replay`, `Mismatch`, or the `Corrupt` error a
/// damaged outcome gives, told without a connection too; the caller decodes it, not this
/// drain): a row whose lease or retention is over leaves the repeat to the per-request path,
/// which reads the row again (most often the takeover of the first claim, in flight) rather
/// than race that takeover with one of its own. A takeover is a write: its round must be one
/// that was sent, for a give-up to look for what it wrote. A first claim the batch did not
/// settle (left out, given back, a row its snapshot could not see, a failure) leaves its
/// repeats to the per-request path too.
fn echo_repeats(
    jobs: &[BeginJob],
    unique: &[usize],
    repeats: &[usize],
    answers: &mut Answers<Round>,
) {
    if repeats.is_empty() {
        return;
    }
    let first: HashMap<&RecordId, usize> = unique.iter().map(|&i| (&jobs[i].id, i)).collect();
    for &i in repeats {
        let Some(&j) = first.get(&jobs[i].id) else {
            continue;
        };
        let row = match &answers[j] {
            Ok(Some(Round::Granted(left))) => (jobs[j].fp.as_bytes().to_vec(), 0, None, *left),
            Ok(Some(Round::Row(row))) => row.clone(),
            _ => continue,
        };
        if !PostgresStore::takes_over(&jobs[i].fp, &row) {
            answers[i] = Ok(Some(Round::Row(row)));
        }
    }
}

/// Completes every row its token still owns; for the others, says whether the same token
/// completed it already (a retried `complete`). Rows it cannot place go the per-request way.
/// The second read is gated like `BEGIN_BATCH_SQL`'s: a completed row costs no second lookup.
pub(crate) const COMPLETE_BATCH_SQL: &str = "
WITH input AS (
    SELECT * FROM unnest($1::bytea[], $2::uuid[], $3::int2[], $4::bytea[], $5::int8[])
        AS t(record_id, lease_token, status, response, retention_ms)
), done AS (
    UPDATE idempotency_keys k
    SET state = 1, status = input.status, response = input.response,
        completed_at = clock_timestamp(),
        expires_at = clock_timestamp() + input.retention_ms * interval '1 millisecond'
    FROM input
    WHERE k.record_id = input.record_id AND k.lease_token = input.lease_token AND k.state = 0
    RETURNING k.record_id, k.fingerprint
)
SELECT input.record_id, coalesce(done.fingerprint, k.fingerprint), done.record_id IS NOT NULL
FROM input
LEFT JOIN done ON done.record_id = input.record_id
LEFT JOIN LATERAL (
    SELECT k.fingerprint FROM idempotency_keys k
    WHERE done.record_id IS NULL AND k.record_id = input.record_id
      AND k.lease_token = input.lease_token AND k.state = 1 OFFSET 0
) k ON true";

fn run_complete(
    store: PostgresStore,
    jobs: Vec<CompleteJob>,
) -> BoxFuture<'static, Answers<Option<Fingerprint>>> {
    Box::pin(async move {
        if let [job] = &jobs[..] {
            return vec![lone(
                store.complete_statement(job, &store.batch_pool()).await,
            )];
        }
        let (unique, _repeats) = split_repeats(&jobs);
        let rows = sqlx::query_as::<_, (Vec<u8>, Option<Vec<u8>>, bool)>(
            store.sql.get(COMPLETE_BATCH_SQL),
        )
        .bind(ids(&jobs, &unique))
        .bind(tokens(&jobs, &unique))
        .bind(unique.iter().map(|&i| jobs[i].status).collect::<Vec<_>>())
        .bind(
            unique
                .iter()
                .map(|&i| &jobs[i].response[..])
                .collect::<Vec<_>>(),
        )
        .bind(
            unique
                .iter()
                .map(|&i| millis(jobs[i].retention))
                .collect::<Vec<_>>(),
        )
        .fetch_all_on(&store.batch_pool())
        .await
        .map(|rows| {
            rows.into_iter()
                .map(|(id, f, fresh)| (id, (f, fresh)))
                .collect()
        });
        spread(&jobs, &unique, rows, |_, row| match row {
            Some((Some(fp), fresh)) => {
                let fp = crate::store::fingerprint(fp)?;
                Ok(Some(fresh.then_some(fp)))
            }
            // Not ours in this snapshot: the per-request path looks again before LeaseLost.
            _ => Ok(None),
        })
    })
}

pub(crate) const RELEASE_BATCH_SQL: &str = "
DELETE FROM idempotency_keys k
USING unnest($1::bytea[], $2::uuid[]) AS t(record_id, lease_token)
WHERE k.record_id = t.record_id AND k.lease_token = t.lease_token AND k.state = 0
RETURNING k.record_id";

pub(crate) const RENEW_BATCH_SQL: &str = "
UPDATE idempotency_keys k SET expires_at = clock_timestamp() + t.lease_ms * interval '1 millisecond'
FROM unnest($1::bytea[], $2::uuid[], $3::int8[]) AS t(record_id, lease_token, lease_ms)
WHERE k.record_id = t.record_id AND k.lease_token = t.lease_token AND k.state = 0
RETURNING k.record_id";

fn run_release(store: PostgresStore, jobs: Vec<FenceJob>) -> BoxFuture<'static, Answers<bool>> {
    Box::pin(run_fence(store, jobs, RELEASE_BATCH_SQL, false))
}

fn run_renew(store: PostgresStore, jobs: Vec<FenceJob>) -> BoxFuture<'static, Answers<bool>> {
    Box::pin(run_fence(store, jobs, RENEW_BATCH_SQL, true))
}

/// A fenced write per row: `true` when the token owned the in-flight row.
async fn run_fence(
    store: PostgresStore,
    jobs: Vec<FenceJob>,
    sql: &'static str,
    renew: bool,
) -> Answers<bool> {
    if let [job] = &jobs[..] {
        let pool = store.batch_pool();
        let done = if renew {
            store.renew_statement(job, &pool).await
        } else {
            store.release_statement(job, &pool).await
        };
        return vec![lone(done)];
    }
    let (unique, _repeats) = split_repeats(&jobs);
    let mut query = sqlx::query_as::<_, (Vec<u8>,)>(store.sql.get(sql))
        .bind(ids(&jobs, &unique))
        .bind(tokens(&jobs, &unique));
    if renew {
        query = query.bind(
            unique
                .iter()
                .map(|&i| millis(jobs[i].lease))
                .collect::<Vec<_>>(),
        );
    }
    let rows = query
        .fetch_all_on(&store.batch_pool())
        .await
        .map(|rows| rows.into_iter().map(|(id,)| (id, ())).collect());
    spread(&jobs, &unique, rows, |_, row| Ok(Some(row.is_some())))
}

#[cfg(test)]
mod tests {
    use idempotency_core::{IdempotencyKey, LeaseToken, RecordId, Scope};

    use super::*;

    /// A claim given up before it was sent is never sent, and nobody looks for it; one sent
    /// is looked for by the first to give it up, and only by that one.
    #[test]
    fn a_claim_is_sent_or_given_up_whichever_comes_first() {
        let never = OnWire::default();
        assert!(!never.give_up(), "not sent: nothing to look for");
        assert!(!never.send(), "given up: must not be sent");
        assert!(!never.sent());

        let sent = OnWire::default();
        assert!(sent.send());
        assert!(sent.send(), "sent already: still sendable until given up");
        assert!(sent.give_up(), "sent: looked for");
        assert!(!sent.give_up(), "looked for once");
        assert!(sent.sent());
        assert!(!sent.send(), "given up: not sent again");
    }

    /// A claim whose caller went away is looked for if it may have been sent, and otherwise
    /// never sent; one sent stays to be looked for again by whoever gives it up.
    #[test]
    fn a_claim_whose_caller_went_away_is_sent_no_more() {
        let pending = OnWire::default();
        assert!(!pending.drop_unsent(), "not sent: nothing to look for");
        assert!(!pending.send(), "dropped: must not be sent");
        assert!(!pending.drop_unsent());

        let sent = OnWire::default();
        assert!(sent.send());
        assert!(sent.drop_unsent(), "sent: looked for");
        assert!(sent.drop_unsent(), "and still sent");
        assert!(sent.give_up(), "still looked for when given up");
        assert!(sent.drop_unsent(), "given back: it was sent");
    }

    /// Rows are written in key order, whatever order their calls came in (and the first
    /// call of a key is the one kept).
    #[test]
    fn a_batch_runs_its_keys_in_order() {
        let id = |k: &str| RecordId::new(&Scope::new("s"), &IdempotencyKey::new(k).unwrap());
        let jobs: Vec<FenceJob> = ["a", "b", "c", "d", "b"]
            .into_iter()
            .map(|k| FenceJob {
                id: id(k),
                token: LeaseToken::generate(),
                lease: Duration::ZERO,
            })
            .collect();
        let (unique, repeats) = split_repeats(&jobs);
        assert_eq!(repeats, [4]);
        let ids: Vec<_> = unique.iter().map(|&i| *jobs[i].id.as_bytes()).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(ids, sorted);
        let mut kept = unique;
        kept.sort_unstable();
        assert_eq!(kept, [0, 1, 2, 3]);
    }
}
