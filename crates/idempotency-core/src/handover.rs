//! Work that runs in its caller's task while the caller drives it, and in a task of its own
//! as soon as the caller does not: [`finish_in_any_case`].
//!
//! [`FinishOnDrop`](crate::FinishOnDrop) covers a caller that drops the future. A caller can
//! also *hold* it without polling it — busy in another branch of a `select!` — and work that
//! must finish soon (an outcome to store before the lease it is written under runs out) must
//! not wait for that caller. (A runtime starved as a whole is not helped: the work moves into
//! a task on that runtime.) Spawning a task for every such
//! piece of work covers both, but costs a hand-off there and back per request, which on a
//! busy server costs more than the store's round trip. Here the work stays in the caller's
//! task, and a standby thread moves it into a task of its own once it has been running for
//! [`HANDOVER_AFTER`] unfinished, whatever the caller is doing.

use std::{
    collections::VecDeque,
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::{
        Arc, Mutex, OnceLock, PoisonError, Weak,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use futures::{FutureExt, future::BoxFuture};

/// How long work may stay in its caller's task unfinished before the standby thread moves it
/// into a task of its own: far below any lease, so a caller that holds the future without
/// polling it cannot let a lease lapse (see [`finish_in_any_case`]).
pub const HANDOVER_AFTER: Duration = Duration::from_millis(100);

/// Work polled in its caller's task that moves into a task of its own when its caller drops
/// it unfinished, or has not finished it within [`HANDOVER_AFTER`]: see [`finish_in_any_case`].
#[must_use = "dropped, it still runs to its end, in a task of its own"]
pub struct FinishInAnyCase<T: Send + 'static> {
    shared: Arc<Shared<T>>,
}

impl<T: Send + 'static> std::fmt::Debug for FinishInAnyCase<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FinishInAnyCase").finish_non_exhaustive()
    }
}

struct Shared<T> {
    state: Mutex<State<T>>,
    runtime: tokio::runtime::Handle,
    span: tracing::Span,
}

enum State<T> {
    /// Polled by its caller, with the waker of its last poll: the work's own wake-ups go to
    /// the task that polls it, so a move must wake the caller itself.
    Inline(BoxFuture<'static, T>, Option<Waker>),
    /// Running in a task of its own; the caller's waker, if it still waits.
    Moved(Option<Waker>),
    /// Finished in its task; the output waits for the caller.
    Finished(T),
    /// Panicked in its task: the caller's next poll panics with it.
    Panicked(Box<dyn std::any::Any + Send>),
    /// Taken by the caller, or nobody waits any more.
    Gone,
}

/// Runs `future` in the caller's task while the caller polls it, and in a task of its own
/// (on the runtime it was made in) if the caller drops it before its end, or has not
/// finished it [`HANDOVER_AFTER`] after it was made — held without being polled, or merely
/// slow. The caller still receives the output when it polls again. Polled where there is no
/// runtime (a plain thread that took the caller's future over), it moves at once: its timers
/// would panic there. A future that panics is not resumed: the panic reaches the caller (at
/// its next poll, if it panicked in its task).
///
/// ```
/// use idempotency_core::finish_in_any_case;
///
/// # #[tokio::main] async fn main() {
/// let (go, wait) = tokio::sync::oneshot::channel::<()>();
/// let (done, landed) = tokio::sync::oneshot::channel();
/// let mut write = finish_in_any_case(async move {
///     let _ = wait.await;
///     let _ = done.send("written");
///     1
/// });
/// // Polled once, then held without polling: it moves into a task all the same.
/// assert!(futures::poll!(&mut write).is_pending());
/// go.send(()).unwrap();
/// assert_eq!(landed.await.unwrap(), "written");
/// assert_eq!(write.await, 1);
/// # }
/// ```
///
/// # Panics
///
/// Outside a Tokio runtime: the work must have somewhere to go.
pub fn finish_in_any_case<F>(future: F) -> FinishInAnyCase<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    finish_in_any_case_or_on(None, future)
}

/// [`finish_in_any_case`], made where there may be no runtime context (a run's future
/// started on a runtime and polled to its end by a plain thread): the work then goes at once
/// into a task on `fallback`, the runtime its caller started on — polled inline, its timers
/// would panic, and a panic there unwinds through the caller's lease guard.
///
/// # Panics
///
/// Outside a Tokio runtime, with no `fallback`.
pub(crate) fn finish_in_any_case_or_on<F>(
    fallback: Option<&tokio::runtime::Handle>,
    future: F,
) -> FinishInAnyCase<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (runtime, inline) = match (tokio::runtime::Handle::try_current(), fallback) {
        (Ok(current), _) => (current, true),
        (Err(_), Some(fallback)) => (fallback.clone(), false),
        (Err(error), None) => panic!("finish_in_any_case outside a Tokio runtime: {error}"),
    };
    let shared = Arc::new(Shared {
        state: Mutex::new(State::Moved(None)),
        runtime,
        span: tracing::Span::current(),
    });
    let future: BoxFuture<'static, F::Output> = Box::pin(future);
    match standby().filter(|_| inline) {
        Some(standby) => {
            *shared.lock() = State::Inline(future, None);
            let weak: Weak<dyn Movable> = Arc::downgrade(&shared) as Weak<dyn Movable>;
            standby.watch(weak);
            // The thread died between the check and the push, after it emptied the queue:
            // nobody will look at this entry, so move it now.
            if !standby.alive.load(Ordering::SeqCst) {
                shared.clone().move_if_inline();
            }
        }
        // No standby thread (it could not start, or died): nothing would move work held
        // without polling, so it goes into its task at once. So does work made outside
        // its runtime's context.
        None => shared.spawn(future, true),
    }
    FinishInAnyCase { shared }
}

impl<T: Send + 'static> Shared<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves inline work into a task of its own; `waiting`: whether the caller still waits
    /// for its output.
    fn spawn(self: &Arc<Self>, mut future: BoxFuture<'static, T>, waiting: bool) {
        let shared = self.clone();
        // Dropped with the task, run or not: a task its runtime dropped unfinished (shut
        // down, or never running) leaves its caller a panic to resume, not a wait for ever.
        let unfinished = Unfinished {
            shared: self.clone(),
            waiting,
        };
        let rest = async move {
            let _unfinished = unfinished;
            let output = AssertUnwindSafe(future.as_mut()).catch_unwind().await;
            drop(future);
            let mut state = shared.lock();
            if let State::Moved(waker) = std::mem::replace(&mut *state, State::Gone) {
                if waiting {
                    *state = match output {
                        Ok(output) => State::Finished(output),
                        Err(panic) => State::Panicked(panic),
                    };
                }
                drop(state);
                if let Some(waker) = waker {
                    waker.wake();
                }
            }
        };
        // A runtime that shut down meanwhile drops the task unrun (its I/O is gone anyway),
        // and with it `Unfinished`.
        drop(
            self.runtime
                .spawn(tracing::Instrument::instrument(rest, self.span.clone())),
        );
    }
}

/// Work moved into a task, as its task holds it: see [`Shared::spawn`].
struct Unfinished<T: Send + 'static> {
    shared: Arc<Shared<T>>,
    waiting: bool,
}

impl<T: Send + 'static> Drop for Unfinished<T> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        // Still `Moved`: the task ends without having finished the work.
        if !matches!(*state, State::Moved(_)) {
            return;
        }
        if let State::Moved(waker) = std::mem::replace(&mut *state, State::Gone) {
            if self.waiting {
                let why = "the runtime dropped this work before it finished (shut down?)";
                *state = State::Panicked(Box::new(why));
            }
            drop(state);
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }
}

impl<T: Send + 'static> Future for FinishInAnyCase<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut state = self.shared.lock();
        // Taken out while polled: a panic leaves `Gone`, so nothing resumes it.
        match std::mem::replace(&mut *state, State::Gone) {
            // Polled where there is no runtime (a plain thread took the caller's future
            // over): the work's timers and tasks would panic there, mid-write. It goes on
            // in its task, on the runtime it was made on.
            State::Inline(future, _) if tokio::runtime::Handle::try_current().is_err() => {
                *state = State::Moved(Some(cx.waker().clone()));
                drop(state);
                self.shared.spawn(future, true);
                Poll::Pending
            }
            State::Inline(mut future, mut waker) => match future.as_mut().poll(cx) {
                Poll::Ready(output) => Poll::Ready(output),
                Poll::Pending => {
                    if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        waker = Some(cx.waker().clone());
                    }
                    *state = State::Inline(future, waker);
                    Poll::Pending
                }
            },
            State::Moved(_) => {
                *state = State::Moved(Some(cx.waker().clone()));
                Poll::Pending
            }
            State::Finished(output) => Poll::Ready(output),
            State::Panicked(panic) => {
                drop(state);
                std::panic::resume_unwind(panic)
            }
            State::Gone => panic!("FinishInAnyCase polled after it finished"),
        }
    }
}

impl<T: Send + 'static> Drop for FinishInAnyCase<T> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        match std::mem::replace(&mut *state, State::Gone) {
            State::Inline(future, _) => {
                *state = State::Moved(None);
                drop(state);
                self.shared.spawn(future, false);
            }
            // Still running in its task: its output is dropped there.
            State::Moved(_) | State::Finished(_) | State::Panicked(_) | State::Gone => {}
        }
    }
}

/// What the standby thread can do to a piece of work, whatever its output type.
trait Movable: Send + Sync {
    /// Moves it into a task if it is still inline. `false`: its caller is polling it right
    /// now (it is alive); ask again later.
    fn move_if_inline(self: Arc<Self>) -> bool;
}

impl<T: Send + 'static> Movable for Shared<T> {
    fn move_if_inline(self: Arc<Self>) -> bool {
        let mut state = match self.state.try_lock() {
            Ok(state) => state,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        match std::mem::replace(&mut *state, State::Gone) {
            State::Inline(future, waker) => {
                // The caller's waker waits for the output now; the task wakes it.
                *state = State::Moved(waker);
                drop(state);
                self.spawn(future, true);
            }
            other => *state = other,
        }
        true
    }
}

/// The work made in the last [`HANDOVER_AFTER`], oldest first, and the thread that moves
/// what is still unfinished when its time comes. One per process, started with the first
/// piece of work: it outlives any runtime, so work made on a runtime that was dropped costs
/// nothing more than a queue entry.
struct Standby {
    queue: Mutex<VecDeque<(Instant, Weak<dyn Movable>)>>,
    /// Whether its thread runs.
    alive: AtomicBool,
}

/// The standby, `None` while its thread is not running.
fn standby() -> Option<&'static Standby> {
    static STANDBY: OnceLock<&'static Standby> = OnceLock::new();
    let standby = STANDBY.get_or_init(|| {
        let standby: &'static Standby = Box::leak(Box::new(Standby {
            queue: Mutex::new(VecDeque::new()),
            alive: AtomicBool::new(true),
        }));
        let started = std::thread::Builder::new()
            .name("idempotency-standby".into())
            .spawn(move || {
                let ended = std::panic::catch_unwind(AssertUnwindSafe(|| standby.run()));
                standby.alive.store(false, Ordering::SeqCst);
                // What it was watching is moved now; what comes later is spawned at once.
                for (_, work) in standby.take_all() {
                    // Being polled right now: ask again until it is free.
                    while work.upgrade().is_some_and(|live| !live.move_if_inline()) {
                        std::thread::yield_now();
                    }
                }
                if ended.is_err() {
                    tracing::error!("the standby thread panicked; work now moves into tasks at once");
                }
            });
        if let Err(error) = started {
            standby.alive.store(false, Ordering::SeqCst);
            tracing::error!(%error, "could not start the standby thread; work moves into tasks at once");
        }
        standby
    });
    standby.alive.load(Ordering::SeqCst).then_some(*standby)
}

impl Standby {
    fn watch(&self, work: Weak<dyn Movable>) {
        let due = Instant::now() + HANDOVER_AFTER;
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back((due, work));
    }

    fn take_all(&self) -> VecDeque<(Instant, Weak<dyn Movable>)> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn run(&self) {
        let mut busy = Vec::new();
        loop {
            std::thread::sleep(HANDOVER_AFTER / 2);
            let now = Instant::now();
            let mut due = Vec::new();
            {
                let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                while queue.front().is_some_and(|(at, _)| *at <= now) {
                    if let Some((_, work)) = queue.pop_front() {
                        due.push(work);
                    }
                }
            }
            // Outside the queue's lock: moving spawns, and work being polled is asked again.
            for work in due.into_iter().chain(std::mem::take(&mut busy)) {
                if work.upgrade().is_some_and(|live| !live.move_if_inline()) {
                    busy.push(work);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn polled_to_its_end_it_runs_inline() {
        let (caller, ran_in) = tokio::spawn(async {
            let ran_in = finish_in_any_case(async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                tokio::task::try_id()
            })
            .await;
            (tokio::task::id(), ran_in)
        })
        .await
        .unwrap();
        assert_eq!(ran_in, Some(caller));
    }

    #[tokio::test]
    async fn held_without_polling_it_moves_into_a_task_and_still_answers() {
        let steps = Arc::new(AtomicUsize::new(0));
        let counted = steps.clone();
        let mut work = finish_in_any_case(async move {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(10)).await;
            counted.fetch_add(1, Ordering::SeqCst);
            "done"
        });
        assert!(futures::poll!(&mut work).is_pending());
        // Held: never polled for several hand-over periods.
        tokio::time::sleep(HANDOVER_AFTER * 4).await;
        assert_eq!(steps.load(Ordering::SeqCst), 2, "it finished in a task");
        assert_eq!(work.await, "done");
    }

    /// Awaited, and slower than the hand-over: its caller waits parked while the work moves,
    /// and is woken when it finishes in its task.
    #[tokio::test]
    async fn a_caller_parked_across_the_move_is_woken() {
        let work = finish_in_any_case(async {
            tokio::time::sleep(HANDOVER_AFTER * 3).await;
            tokio::task::try_id()
        });
        let caller = tokio::spawn(async move {
            let ran_in = work.await;
            (tokio::task::id(), ran_in)
        });
        let (caller, ran_in) = tokio::time::timeout(Duration::from_secs(5), caller)
            .await
            .expect("the caller was woken")
            .unwrap();
        assert_ne!(ran_in, Some(caller), "it finished in a task of its own");
    }

    #[tokio::test]
    async fn dropped_unfinished_it_runs_to_its_end() {
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let (done, landed) = tokio::sync::oneshot::channel();
        let mut work = finish_in_any_case(async move {
            let _ = wait.await;
            let _ = done.send(());
        });
        assert!(futures::poll!(&mut work).is_pending());
        drop(work);
        go.send(()).unwrap();
        landed.await.expect("it ran to its end");
    }

    #[tokio::test]
    async fn a_panic_in_its_task_reaches_the_caller() {
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let mut work = finish_in_any_case(async move {
            let _ = wait.await;
            panic!("on purpose");
        });
        assert!(futures::poll!(&mut work).is_pending());
        tokio::time::sleep(HANDOVER_AFTER * 3).await; // moved meanwhile
        go.send(()).unwrap();
        let caller = tokio::spawn(work);
        assert!(caller.await.unwrap_err().is_panic());
    }

    #[tokio::test]
    async fn a_caller_that_waits_after_the_move_is_woken() {
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let mut work = finish_in_any_case(async move {
            let _ = wait.await;
            7
        });
        assert!(futures::poll!(&mut work).is_pending());
        tokio::time::sleep(HANDOVER_AFTER * 3).await; // moved meanwhile
        let waiter = tokio::spawn(work);
        tokio::time::sleep(Duration::from_millis(10)).await;
        go.send(()).unwrap();
        assert_eq!(waiter.await.unwrap(), 7);
    }
}
