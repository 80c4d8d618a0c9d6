//! Linearizability: concurrent calls on one key, each recorded when it was made and when it
//! was answered, must be explained by **some order** of the calls that keeps that real-time
//! order (a call answered before another was made comes first) and in which the
//! [`MemoryStore`] the model checker explores gives every call the answer the store gave.
//! `stateright`'s `LinearizabilityTester` searches for that order.
//!
//! The differential test ([`crate::differential`]) carries the model over to a store one
//! call at a time; this carries it over to calls that overlap. A store whose every call
//! takes effect at one instant between its making and its answer passes; one that answers
//! from a state no order explains — a cache that is stale after a write was answered, a
//! write that lands after its answer, a call split into steps another call can come
//! between — fails, with the history printed.
//!
//! The calls are the differential test's, made by three workers at once (two sending one
//! body, the third another), each holding the last token it was granted: `begin` (sometimes
//! losing the answer, sometimes for a lease of zero), `complete` (sometimes with a retention
//! of zero), `release`, `renew` (sometimes for zero), a crash (the token forgotten), an
//! operator's release in each scope, and `inspect`; then, once every call was answered, a
//! fourth caller reads the key back (`inspect`, and a claim with each body), so a write
//! answered but not kept, or a copy landing stale after the last call, shows in the history
//! too. The clock is left out as there: the
//! model's store has a clock that never moves, so a lease or retention of zero is over at
//! once, where a store's clock takes a moment (Redis counts a zero as a millisecond). So a
//! call for zero runs alone, and is answered only [`PAST_ZERO`](crate::differential) later,
//! when it is over on every clock; every other call overlaps whatever it meets.
//!
//! The hybrid store is held to it too: what it writes to Redis after answering (a lease's
//! mirror, an outcome's copy) is replaced or deleted before a later call of the same process
//! can see it stale, and an operator's release waits for those writes on their way, while
//! those that began after it send nothing. (Another process's copies on their way are the
//! release's second delete's business, which one store's calls do not show.)

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use idempotency_core::{Fingerprint, LeaseToken, MemoryStore, RecordId, Store};
use rand::{SeedableRng, rngs::StdRng};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester, SequentialSpec};

use crate::{
    conformance::{fp, fresh_id},
    differential::{Answer, Call, Expiry, PAST_ZERO, Side, WORKERS, draw},
};

/// A call as the tester records it.
#[derive(Debug, Clone)]
struct Op {
    call: Call,
    /// For a `begin`, the grant it may make (numbered in its round); for a call with a
    /// token, the grant that token came from. Each store draws its own tokens: the model's
    /// store uses the token it granted for the same grant.
    grant: Option<usize>,
    /// Unique in the round: an outcome's body names it.
    step: usize,
}

/// The sequential specification: the model's store, and the token it granted for each
/// grant.
struct Spec {
    store: MemoryStore,
    id: RecordId,
    bodies: [Fingerprint; 2],
    grants: BTreeMap<usize, LeaseToken>,
    expiry: Expiry<usize>,
}

impl Clone for Spec {
    fn clone(&self) -> Self {
        Self {
            store: self.store.snapshot(),
            id: self.id,
            bodies: self.bodies,
            grants: self.grants.clone(),
            expiry: self.expiry,
        }
    }
}

impl SequentialSpec for Spec {
    type Op = Op;
    type Ret = Answer;

    fn invoke(&mut self, op: &Op) -> Answer {
        let mut side = Side {
            store: &self.store,
            tokens: [None; WORKERS],
        };
        let call = match op.call {
            // Granted here whether or not the worker heard of it.
            Call::Begin { worker, zero, .. } => Call::Begin {
                worker,
                lost: false,
                zero,
            },
            Call::Complete { worker, .. }
            | Call::Release { worker }
            | Call::Renew { worker, .. } => {
                // The grant is the model's whenever the order got this far: the tester
                // orders the call after its worker's `begin`, answered as the store answered
                // it.
                let granted = op.grant.and_then(|grant| self.grants.get(&grant).copied());
                side.tokens[worker] =
                    Some(granted.expect("a call with a token is ordered after its grant"));
                op.call
            }
            other => other,
        };
        let answer = futures::executor::block_on(side.call(&self.id, &self.bodies, call, op.step));
        if let (Call::Begin { worker, .. }, Some(grant)) = (call, op.grant)
            && matches!(answer, Answer::Execute | Answer::TakeOver)
            && let Some(token) = side.tokens[worker]
        {
            self.grants.insert(grant, token);
        }
        self.expiry.after(&op.call, op.grant, &answer);
        answer
    }

    fn is_valid_step(&mut self, op: &Op, got: &Answer) -> bool {
        let before = self.expiry;
        let want = self.invoke(op);
        want == *got || before.open(&op.call, op.grant, &want, got)
    }
}

/// One worker's calls in one round, recorded as they are made and answered.
struct Worker<'a> {
    index: usize,
    store: &'a dyn Store,
    id: RecordId,
    bodies: &'a [Fingerprint; 2],
    tester: &'a Mutex<LinearizabilityTester<usize, Spec>>,
    log: &'a Mutex<String>,
    grants: &'a AtomicUsize,
    /// Held shared by a call, alone by a call for zero.
    alone: &'a tokio::sync::RwLock<()>,
}

/// How long after a round's last answer its key is read back.
const READ_BACK_AFTER: std::time::Duration = std::time::Duration::from_millis(50);

impl Worker<'_> {
    /// Reads the key back, one call at a time: `inspect`, then a claim with each body (its
    /// answer lost, so no worker holds what it may grant).
    async fn read_back(&self) {
        let me = self.index;
        let mut side = Side {
            store: self.store,
            tokens: [None; WORKERS],
        };
        let reads = [
            Call::Inspect,
            Call::Begin {
                worker: 0,
                lost: true,
                zero: false,
            },
            Call::Begin {
                worker: WORKERS - 1,
                lost: true,
                zero: false,
            },
        ];
        for (n, call) in reads.into_iter().enumerate() {
            let op = Op {
                call,
                grant: None,
                step: me * 1000 + n,
            };
            self.record(
                |t| t.on_invoke(me, op.clone()),
                || format!("{me} reads back {op:?}"),
            );
            let answer = side.call(&self.id, self.bodies, call, op.step).await;
            let said = format!("{me} is answered {answer:?}");
            self.record(|t| t.on_return(me, answer), || said);
        }
    }

    async fn run(&self, rng: &mut StdRng, calls: usize) {
        let me = self.index;
        let mut side = Side {
            store: self.store,
            tokens: [None; WORKERS],
        };
        // The grant this worker's token came from.
        let mut held = None;
        let mut made = 0;
        while made < calls {
            let call = draw(rng, side.tokens.map(|t| t.is_some()));
            // The purge is left out: on a shared table it drains every test's rows.
            if matches!(call, Call::Purge) || call.worker().is_some_and(|w| w != me) {
                continue;
            }
            made += 1;
            if let Call::Crash { .. } = call {
                (side.tokens[me], held) = (None, None);
                continue;
            }
            let grant = match call {
                Call::Begin { .. } => Some(self.grants.fetch_add(1, Ordering::SeqCst)),
                _ if call.worker().is_some() => held,
                _ => None,
            };
            let step = me * 1000 + made;
            let op = Op { call, grant, step };
            // Recorded as made once it may run, and as answered before another may.
            let (_shared, _alone) = if call.zero() {
                (None, Some(self.alone.write().await))
            } else {
                (Some(self.alone.read().await), None)
            };
            self.record(
                |t| t.on_invoke(me, op.clone()),
                || format!("{me} makes {op:?}"),
            );
            let answer = side.call(&self.id, self.bodies, call, step).await;
            if call.zero() {
                tokio::time::sleep(PAST_ZERO).await;
            }
            if let Call::Begin { lost: false, .. } = call
                && matches!(answer, Answer::Execute | Answer::TakeOver)
            {
                held = grant;
            }
            let said = format!("{me} is answered {answer:?}");
            self.record(|t| t.on_return(me, answer), || said);
        }
    }

    fn record(
        &self,
        event: impl FnOnce(
            &mut LinearizabilityTester<usize, Spec>,
        ) -> Result<&mut LinearizabilityTester<usize, Spec>, String>,
        line: impl FnOnce() -> String,
    ) {
        // One lock for both: the log's order is the tester's.
        let mut tester = self.tester.lock().expect("tester");
        event(&mut tester).expect("a well-formed history");
        let _ = writeln!(self.log.lock().expect("log"), "  {}", line());
    }
}

/// Runs `rounds` rounds, each on a fresh key: three workers make `calls` calls each at
/// once on `store`, and the history must be linearizable against the model's store. Fails
/// with the seed and the round's history otherwise. The seed is
/// `IDEMPOTENCY_DIFFERENTIAL_SEED` if set, else fixed.
pub async fn linearizable_for(store: &dyn Store, rounds: usize, calls: usize) {
    let seed = std::env::var("IDEMPOTENCY_DIFFERENTIAL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_205_u64);
    let bodies = [fp("a"), fp("b")];
    for round in 0..rounds {
        let spec = Spec {
            store: MemoryStore::with_manual_clock(),
            id: fresh_id(),
            bodies,
            grants: BTreeMap::new(),
            expiry: Expiry::default(),
        };
        let tester = Mutex::new(LinearizabilityTester::new(spec));
        let (log, grants, id) = (Mutex::new(String::new()), AtomicUsize::new(0), fresh_id());
        let alone = tokio::sync::RwLock::new(());
        let workers = (0..WORKERS).map(|index| {
            let (tester, log, grants, bodies, alone) = (&tester, &log, &grants, &bodies, &alone);
            async move {
                let mut rng =
                    StdRng::seed_from_u64(seed ^ ((round * WORKERS + index) as u64) << 32);
                Worker {
                    index,
                    store,
                    id,
                    bodies,
                    tester,
                    log,
                    grants,
                    alone,
                }
                .run(&mut rng, calls)
                .await;
            }
        });
        futures::future::join_all(workers).await;
        // Then the key as it stands, read by a fourth caller once every call was answered
        // (and what the hybrid writes after answering had its moment): a write answered
        // but not kept, or a copy landing stale after the last call, is in no history that
        // stops at the last answer.
        tokio::time::sleep(READ_BACK_AFTER).await;
        Worker {
            index: WORKERS,
            store,
            id,
            bodies: &bodies,
            tester: &tester,
            log: &log,
            grants: &grants,
            alone: &alone,
        }
        .read_back()
        .await;
        let tester = tester.into_inner().expect("tester");
        assert!(
            tester.serialized_history().is_some(),
            "{}: no order of these calls gets these answers from the model's store (seed \
             {seed}, round {round}; calls made and answered, in real time):\n{}",
            store.name(),
            log.into_inner().expect("log")
        );
    }
}

/// [`linearizable_for`] with the suite's size: 40 rounds of three workers making 8 calls.
pub async fn concurrent_calls_are_linearizable(store: Arc<dyn Store>) {
    linearizable_for(&*store, 40, 8).await;
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, time::Duration};

    use async_trait::async_trait;
    use idempotency_core::{
        Begin, ForceReleased, Inspection, Outcome, ReleaseScope, Result, Store,
    };

    use super::*;

    /// How the model's store is broken in front.
    enum Flaw {
        /// Replays are answered from a cache that nothing clears: an operator's release
        /// deletes the record, and the cache goes on replaying it.
        StaleReplays(Mutex<HashMap<RecordId, Outcome>>),
        /// A claim reads the key, then writes it: a key found free is cleared and claimed,
        /// so two claims that both found it free both execute.
        ReadThenClaim,
    }

    struct Broken {
        inner: MemoryStore,
        flaw: Flaw,
    }

    #[async_trait]
    impl Store for Broken {
        async fn begin(&self, id: &RecordId, fp: &Fingerprint, lease: Duration) -> Result<Begin> {
            match &self.flaw {
                Flaw::StaleReplays(replays) => {
                    if let Some(outcome) = replays.lock().expect("cache").get(id) {
                        return Ok(Begin::Replay(outcome.clone()));
                    }
                    let answer = self.inner.begin(id, fp, lease).await?;
                    if let Begin::Replay(outcome) = &answer {
                        replays.lock().expect("cache").insert(*id, outcome.clone());
                    }
                    Ok(answer)
                }
                Flaw::ReadThenClaim => {
                    if self.inner.inspect(id).await?.is_none() {
                        tokio::task::yield_now().await;
                        let scope = ReleaseScope::default().with_live().with_completed();
                        self.inner.force_release(id, scope).await?;
                    }
                    self.inner.begin(id, fp, lease).await
                }
            }
        }
        async fn complete(
            &self,
            id: &RecordId,
            token: LeaseToken,
            outcome: &Outcome,
            retention: Duration,
        ) -> Result<()> {
            self.inner.complete(id, token, outcome, retention).await
        }
        async fn release(&self, id: &RecordId, token: LeaseToken) -> Result<()> {
            self.inner.release(id, token).await
        }
        async fn renew(&self, id: &RecordId, token: LeaseToken, lease: Duration) -> Result<()> {
            self.inner.renew(id, token, lease).await
        }
        async fn purge_expired(&self, batch: usize) -> Result<u64> {
            self.inner.purge_expired(batch).await
        }
        async fn inspect(&self, id: &RecordId) -> Result<Option<Inspection>> {
            self.inner.inspect(id).await
        }
        async fn force_release(&self, id: &RecordId, scope: ReleaseScope) -> Result<ForceReleased> {
            self.inner.force_release(id, scope).await
        }
        fn name(&self) -> &'static str {
            "broken"
        }
    }

    fn broken(flaw: Flaw) -> Broken {
        Broken {
            inner: MemoryStore::new(),
            flaw,
        }
    }

    /// The check has teeth: a store that replays a record an operator deleted fails it.
    #[tokio::test]
    #[should_panic(expected = "no order of these calls gets these answers")]
    async fn a_store_replaying_a_deleted_record_fails() {
        let store = broken(Flaw::StaleReplays(Mutex::new(HashMap::new())));
        linearizable_for(&store, 40, 8).await;
    }

    /// A race only calls that overlap show: one call at a time, the store answers as the
    /// model's does (the differential test passes it).
    #[tokio::test]
    #[should_panic(expected = "no order of these calls gets these answers")]
    async fn a_store_whose_claim_reads_then_writes_fails() {
        let store = broken(Flaw::ReadThenClaim);
        crate::differential::answers_as_the_model_store_for(&store, 60, 24).await;
        linearizable_for(&store, 40, 8).await;
    }

    /// And the model's store, behind nothing, passes.
    #[tokio::test]
    async fn the_models_store_passes() {
        linearizable_for(&MemoryStore::new(), 40, 8).await;
    }
}
