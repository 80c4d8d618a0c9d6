//! Claims that survive their caller: how a store makes `begin` safe to drop.
//!
//! A `begin` that reaches the store and is then dropped — a client hang-up, an outer timeout,
//! a `select!`, the store's own call budget — may still commit its claim. Nobody then holds
//! the token: the key answers "in flight" until the lease ends, and a caller that was told
//! `Unavailable` ("nothing changed") sees a write land after all. [`detached_claim`] closes
//! that: a claim whose caller goes away runs to its end in a task of its own, and a granted
//! lease whose caller is gone is released at once.
//!
//! [`FinishOnDrop`] is the mechanism: the future runs in the caller's task while the caller
//! waits — no hand-off to another task and back, which on a busy server costs more than the
//! store's round trip — and only a future dropped before its end moves into a task.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    task::{Context, Poll},
};

use futures::{FutureExt, future::BoxFuture};

use crate::{Begin, LeaseToken, Result};

/// What runs on the output of a [`FinishOnDrop`] future whose caller went away.
type Orphaned<T> = Box<dyn FnOnce(T) -> BoxFuture<'static, ()> + Send>;

/// A future that runs to its end even if it is dropped: see [`finish_on_drop`].
#[must_use = "dropped, it still runs to its end, in a task of its own"]
pub struct FinishOnDrop<T: Send + 'static> {
    future: Option<BoxFuture<'static, T>>,
    orphaned: Option<Orphaned<T>>,
    /// The runtime it was made (or first polled) in: drops may happen outside any runtime's
    /// context.
    runtime: Option<tokio::runtime::Handle>,
    /// The span it was made in, for the rest's logs.
    span: tracing::Span,
    /// Where the rest is spawned, if dropped unfinished: see [`FinishOnDrop::tracked_by`].
    tracker: Option<tokio_util::task::TaskTracker>,
    /// Cancelled if dropped unfinished: see [`FinishOnDrop::cancels_when_orphaned`].
    orphan_signal: Option<tokio_util::sync::CancellationToken>,
}

impl<T: Send + 'static> std::fmt::Debug for FinishOnDrop<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FinishOnDrop")
            .field("finished", &self.future.is_none())
            .finish_non_exhaustive()
    }
}

/// Polls `future` in the caller's task and, if it is dropped before its end, moves it into a
/// task of its own that runs it to the end and hands its output to `orphaned` (whose future
/// runs in that task too).
///
/// Dropped before its first poll, it is spawned all the same: the future may own something
/// that must be settled (a lease its caller was granted), and a yield point — a cooperative
/// budget running out — may lie between its creation and that poll. A future that panics is
/// not resumed: the panic reaches the caller, and nothing moves into a task.
///
/// ```
/// use std::sync::{Arc, atomic::{AtomicBool, Ordering}};
/// use idempotency_core::finish_on_drop;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let landed = Arc::new(AtomicBool::new(false));
/// let (go, wait) = tokio::sync::oneshot::channel::<()>();
/// let write = finish_on_drop(async move { let _ = wait.await; "written" }, {
///     let landed = landed.clone();
///     move |_| Box::pin(async move { landed.store(true, Ordering::SeqCst) })
/// });
/// // The caller gives up (an outer timeout); the write goes on in a task of its own.
/// let gave_up = tokio::time::timeout(std::time::Duration::from_millis(10), write).await;
/// assert!(gave_up.is_err());
/// go.send(()).unwrap();
/// tokio::task::yield_now().await;
/// tokio::task::yield_now().await;
/// assert!(landed.load(Ordering::SeqCst));
/// # }
/// ```
///
/// Made and polled outside a Tokio runtime, it runs, but dropped unfinished it cannot move
/// anywhere: it is dropped unfinished, with a warning.
pub fn finish_on_drop<F, O>(future: F, orphaned: O) -> FinishOnDrop<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
    O: FnOnce(F::Output) -> BoxFuture<'static, ()> + Send + 'static,
{
    FinishOnDrop {
        future: Some(Box::pin(future)),
        orphaned: Some(Box::new(orphaned)),
        runtime: tokio::runtime::Handle::try_current().ok(),
        span: tracing::Span::current(),
        tracker: None,
        orphan_signal: None,
    }
}

impl<T: Send + 'static> FinishOnDrop<T> {
    /// If dropped unfinished, runs the rest as a task of `tracker`, so that a graceful
    /// shutdown that waits for the tracker ([`Store::drain`](crate::Store::drain), the
    /// layer's and the executor's `drain`) waits for it. Nothing is counted while the caller
    /// waits: only what a drop leaves running.
    ///
    /// ```
    /// use idempotency_core::finish_on_drop;
    /// use tokio_util::task::TaskTracker;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let settling = TaskTracker::new();
    /// let (go, wait) = tokio::sync::oneshot::channel::<()>();
    /// let write = finish_on_drop(async move { let _ = wait.await; }, |_| Box::pin(async {}))
    ///     .tracked_by(&settling);
    /// drop(write); // the caller went away: the rest runs on, counted
    /// assert_eq!(settling.len(), 1);
    /// go.send(()).unwrap();
    /// settling.close();
    /// settling.wait().await; // a shutdown waits for it
    /// # }
    /// ```
    pub fn tracked_by(mut self, tracker: &tokio_util::task::TaskTracker) -> Self {
        self.tracker = Some(tracker.clone());
        self
    }

    /// If dropped unfinished, cancels `signal` as the rest moves into its task: the future,
    /// given a clone, can tell that nobody waits for its output any more. A claim whose reply
    /// hangs uses it to look for its grant on another connection and give it back while
    /// the lease still runs, rather than once its own bound runs out (after the lease, a
    /// retry would take the key over as an attempt whose outcome is unknown). Never
    /// cancelled while the caller waits, nor once the future has finished.
    ///
    /// ```
    /// use idempotency_core::finish_on_drop;
    /// use tokio_util::sync::CancellationToken;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let gone = CancellationToken::new();
    /// let watched = gone.clone();
    /// let work = finish_on_drop(async move { watched.cancelled().await }, |_| Box::pin(async {}))
    ///     .cancels_when_orphaned(gone.clone());
    /// assert!(tokio::time::timeout(std::time::Duration::from_millis(10), work).await.is_err());
    /// assert!(gone.is_cancelled()); // the caller gave up: the rest was told
    /// # }
    /// ```
    pub fn cancels_when_orphaned(mut self, signal: tokio_util::sync::CancellationToken) -> Self {
        self.orphan_signal = Some(signal);
        self
    }
}

impl<T: Send + 'static> Future for FinishOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = &mut *self;
        if this.runtime.is_none() {
            this.runtime = tokio::runtime::Handle::try_current().ok();
        }
        // Taken out while polled: a panic drops it here, so `drop` never resumes it.
        let mut future = this
            .future
            .take()
            .expect("FinishOnDrop polled after it finished");
        match future.as_mut().poll(cx) {
            Poll::Ready(output) => Poll::Ready(output),
            Poll::Pending => {
                this.future = Some(future);
                Poll::Pending
            }
        }
    }
}

impl<T: Send + 'static> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        let (Some(future), Some(orphaned)) = (self.future.take(), self.orphaned.take()) else {
            return;
        };
        if let Some(signal) = self.orphan_signal.take() {
            signal.cancel();
        }
        let Some(runtime) = self.runtime.take() else {
            tracing::warn!("a future that must finish was dropped outside any Tokio runtime");
            return;
        };
        // A runtime that shut down meanwhile drops the task unrun: its I/O is gone anyway.
        let rest = async move {
            let output = future.await;
            orphaned(output).await;
        };
        let rest = tracing::Instrument::instrument(rest, self.span.clone());
        match self.tracker.take() {
            Some(tracker) => tracker.spawn_on(rest, &runtime),
            None => runtime.spawn(rest),
        };
    }
}

/// Runs `claim` and returns its answer. If the returned future is dropped before it yields
/// the answer — at any point, including after the claim committed — the claim runs to its
/// end in a task of its own, and if it answered `Execute(token)`, `release(token)` runs
/// there: a lease is never left claimed by nobody.
///
/// Calling it starts the claim: dropped even before its first poll, the claim still runs
/// (and an `Execute` is released). Call it where it is awaited at once, not in a `select!`
/// branch that may not be chosen or before an early return.
///
/// While the caller waits, the claim runs in the caller's task ([`finish_on_drop`]): no
/// hand-off. It is boxed here, when called, so the (often large) claim future is copied
/// once, not at every layer of `async` around it. A claim that panics answers
/// `Unavailable`, like a store that failed: a lease it may have taken is not known, so it
/// expires by itself.
///
/// Store implementations wrap the body of `begin` in [`detached_begin`], which is this with
/// the store's own release, and which also ends (renews for zero) a `TakeOver` lease whose
/// claimer went away; this lower-level form takes a release of its own and leaves such a
/// lease to run out, holding the key "in flight" for a lease. (The Redis store cancels a
/// claim it stopped waiting for instead; the in-memory store needs no wrapper because its
/// `begin` never awaits.) The claim itself should be bounded (a statement timeout, a call
/// budget), since nothing waits for it once its caller is gone.
///
/// ```
/// use idempotency_core::{detached_claim, Begin, LeaseToken};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let token = LeaseToken::generate();
/// let answer = detached_claim::<Begin, _, _>(
///     async move { Ok(Begin::Execute(token)) },
///     |orphan| Box::pin(async move { println!("releasing {orphan}") }),
/// )
/// .await;
/// assert_eq!(answer.unwrap(), Begin::Execute(token));
/// # }
/// ```
pub fn detached_claim<T, C, R>(claim: C, release: R) -> FinishOnDrop<Result<T>>
where
    T: GrantsLease,
    C: Future<Output = Result<T>> + Send + 'static,
    R: FnOnce(LeaseToken) -> BoxFuture<'static, ()> + Send + 'static,
{
    finish_on_drop(unwound(claim), move |answer| match answer {
        Ok(answer) => match answer.granted() {
            Some(token) => {
                tracing::debug!(%token, "releasing a lease whose claimer went away");
                release(token)
            }
            None => Box::pin(async {}),
        },
        Err(_) => Box::pin(async {}),
    })
}

/// An answer that may grant a lease: [`Begin`], or `Begin` with extra data such as a TTL.
pub trait GrantsLease: Send + 'static {
    /// The token of the lease to release when nobody receives this answer, if any.
    fn granted(&self) -> Option<LeaseToken>;

    /// The token of a lease taken over from an unfinished attempt, to end (not release)
    /// when nobody receives this answer ([`end_orphan`]): released, the record of the
    /// unfinished attempt would be gone, and the next `begin` would answer a fresh `Execute`
    /// instead of `TakeOver` (its outcome still unknown). None by default: such a lease is
    /// left to run out.
    fn taken_over(&self) -> Option<LeaseToken> {
        None
    }
}

impl GrantsLease for Begin {
    /// `Execute` only. A `TakeOver` lease whose claimer went away is not released but
    /// ended ([`GrantsLease::taken_over`]).
    fn granted(&self) -> Option<LeaseToken> {
        match self {
            Begin::Execute(token) => Some(*token),
            _ => None,
        }
    }

    fn taken_over(&self) -> Option<LeaseToken> {
        match self {
            Begin::TakeOver(token) => Some(*token),
            _ => None,
        }
    }
}

impl<U: Send + 'static> GrantsLease for (Begin, U) {
    fn granted(&self) -> Option<LeaseToken> {
        self.0.granted()
    }

    fn taken_over(&self) -> Option<LeaseToken> {
        self.0.taken_over()
    }
}

/// [`detached_claim`] as a store's `begin` uses it: `claim` runs to its end even if the
/// caller goes away, and a lease it grants after that is given back to `store` with
/// [`release_orphan`]. Like `detached_claim`, calling it starts the claim.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{detached_begin, Begin, Fingerprint, MemoryStore, RecordId, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = Arc::new(MemoryStore::new());
/// let (id, fp) = (RecordId::from_bytes([7; 32]), Fingerprint::of(b"body"));
/// let claimer = store.clone();
/// let answer = detached_begin(store.clone(), id, async move {
///     claimer.begin(&id, &fp, Duration::from_secs(30)).await
/// })
/// .await;
/// assert!(matches!(answer, Ok(Begin::Execute(_))));
/// # }
/// ```
pub fn detached_begin<S, T, C>(store: S, id: crate::RecordId, claim: C) -> FinishOnDrop<Result<T>>
where
    S: crate::Store + 'static,
    T: GrantsLease,
    C: Future<Output = Result<T>> + Send + 'static,
{
    finish_on_drop(unwound(claim), move |answer| match answer {
        Ok(answer) => match (answer.granted(), answer.taken_over()) {
            (Some(token), _) => {
                tracing::debug!(%token, "releasing a lease whose claimer went away");
                Box::pin(async move {
                    release_orphan(&store, &id, token).await;
                })
            }
            (None, Some(token)) => {
                tracing::debug!(%token, "ending a taken-over lease whose claimer went away");
                Box::pin(async move {
                    end_orphan(&store, &id, token).await;
                })
            }
            (None, None) => Box::pin(async {}),
        },
        Err(_) => Box::pin(async {}),
    })
}

/// A claim whose panic answers `Unavailable`, like a store that failed: a lease it may have
/// taken is not known, so it expires by itself.
fn unwound<T: Send + 'static>(
    claim: impl Future<Output = Result<T>> + Send + 'static,
) -> impl Future<Output = Result<T>> + Send + 'static {
    let why = "the claim panicked; a lease it may have taken expires by itself";
    panic_as_unavailable(claim, why)
}

/// A store call whose panic is a failed call (`Unavailable`): a store with a bug must not
/// unwind the code that settles an operation that ran (its outcome's write, the lease's
/// renewal or release), which would leave the key to a retry that runs it again. The
/// executor, the HTTP layer and the give-backs here call the store through it.
///
/// ```
/// use idempotency_core::{panic_as_unavailable, Error};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let call = async { panic!("a store with a bug") };
/// let answer: Result<(), Error> = panic_as_unavailable(call, "the store's renew panicked").await;
/// assert!(matches!(answer, Err(Error::Unavailable(_))));
/// # }
/// ```
pub async fn panic_as_unavailable<T>(
    call: impl Future<Output = Result<T>>,
    what: &'static str,
) -> Result<T> {
    AssertUnwindSafe(call)
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Err(crate::Error::unavailable(what)))
}

/// Runs a write nobody waits for (a give-back, a cancel), counted by `tracker`, on the
/// caller's runtime and, when `home` (the runtime the store was made on) is another one, on
/// that one too: either may be shutting down — an application's worker runtime at its
/// shutdown, a short-lived runtime the store was built on — and a runtime that shuts down
/// drops its tasks unrun, which would leave a lease held by nobody. `make` builds each copy;
/// the write must be fenced (on a lease token) so that a second copy changes nothing more.
/// Off any runtime only `home`'s copy runs. Returns how many copies were spawned (0: no
/// runtime to run it on).
///
/// ```
/// use tokio_util::task::TaskTracker;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let (tracker, home) = (TaskTracker::new(), tokio::runtime::Handle::current());
/// // Made and called on the same runtime: one copy.
/// let spawned = idempotency_core::spawn_where_it_survives(&tracker, Some(&home), || async {});
/// assert_eq!(spawned, 1);
/// # }
/// ```
pub fn spawn_where_it_survives<F>(
    tracker: &tokio_util::task::TaskTracker,
    home: Option<&tokio::runtime::Handle>,
    make: impl Fn() -> F,
) -> usize
where
    F: Future<Output = ()> + Send + 'static,
{
    let here = tokio::runtime::Handle::try_current().ok();
    let away = home.filter(|home| here.as_ref().is_none_or(|here| here.id() != home.id()));
    let mut spawned = 0;
    for runtime in here.iter().chain(away) {
        tracker.spawn_on(make(), runtime);
        spawned += 1;
    }
    spawned
}

/// Releases a lease whose claimer went away, retrying an unavailable store with backoff (up to
/// 5 s apart) for as long as a late write is accepted ([`LATE_COMPLETION_GRACE`], an hour, as
/// an outcome is: [`complete_late`]): orphans appear exactly when the store is slow, and a
/// lease left to run out comes back as an attempt whose outcome is unknown, which the layer's
/// `Reject` answers 409 for a day. The release is fenced on the token, so a retry after one
/// that landed changes nothing.
///
/// [`LATE_COMPLETION_GRACE`]: crate::LATE_COMPLETION_GRACE
/// [`complete_late`]: crate::complete_late
///
/// The release closure stores hand to [`detached_claim`] calls it.
///
/// Returns `false` only when the store answered that the token holds no lease there
/// (`LeaseLost`): it was never written, or it is settled already. A caller that suspects a
/// write still on its way (a statement that has not committed yet) may look again later.
pub async fn release_orphan<S: crate::Store + ?Sized>(
    store: &S,
    id: &crate::RecordId,
    token: LeaseToken,
) -> bool {
    settle_orphan(store, id, token, false).await
}

/// Ends a lease taken over from an unfinished attempt (`Begin::TakeOver`) whose claimer went
/// away, keeping its record: renewed for zero, the lease is over at once, and the next
/// `begin` takes it over and still reports the unfinished attempt, instead of answering
/// `InFlight` until the lease runs out. Retried like [`release_orphan`], and answers like it;
/// fenced on the token.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{end_orphan, Begin, Fingerprint, MemoryStore, RecordId, Store};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let store = MemoryStore::new();
/// let (id, fp) = (RecordId::from_bytes([7; 32]), Fingerprint::of(b"body"));
/// store.begin(&id, &fp, Duration::from_secs(1)).await.unwrap(); // an attempt that crashed
/// tokio::time::advance(Duration::from_secs(2)).await;
/// let Ok(Begin::TakeOver(token)) = store.begin(&id, &fp, Duration::from_secs(30)).await else { panic!() };
/// end_orphan(&store, &id, token).await; // its claimer went away
/// assert!(matches!(store.begin(&id, &fp, Duration::from_secs(30)).await, Ok(Begin::TakeOver(_))));
/// # }
/// ```
pub async fn end_orphan<S: crate::Store + ?Sized>(
    store: &S,
    id: &crate::RecordId,
    token: LeaseToken,
) -> bool {
    settle_orphan(store, id, token, true).await
}

async fn settle_orphan<S: crate::Store + ?Sized>(
    store: &S,
    id: &crate::RecordId,
    token: LeaseToken,
    end: bool,
) -> bool {
    let give_up = tokio::time::Instant::now() + crate::LATE_COMPLETION_GRACE;
    let mut backoff = std::time::Duration::from_millis(50);
    // Past the first seconds, spread over a second by the token, so the releases of one
    // outage do not all try in step (as `complete_late` spreads its tries).
    let spread = std::time::Duration::from_millis(u64::from(token.as_uuid().as_bytes()[0]) * 4);
    loop {
        let settled = if end {
            let call = store.renew(id, token, std::time::Duration::ZERO);
            panic_as_unavailable(call, "the store's renew panicked").await
        } else {
            panic_as_unavailable(store.release(id, token), "the store's release panicked").await
        };
        match settled {
            Ok(()) => return true,
            Err(crate::Error::LeaseLost) => return false,
            // Only a store that may come back is waited for: another error (a corrupt
            // record, a misconfiguration) would answer the same for the whole hour.
            Err(crate::Error::Unavailable(error))
                if tokio::time::Instant::now() + backoff < give_up =>
            {
                tracing::debug!(%error, record = %id, "giving back an orphaned lease; retrying");
                let pause = if backoff >= std::time::Duration::from_secs(5) {
                    backoff + spread
                } else {
                    backoff
                };
                tokio::time::sleep(pause).await;
                backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
            }
            Err(error) => {
                tracing::warn!(%error, record = %id, "could not give back an orphaned lease; it expires by itself");
                return true; // nothing more to try
            }
        }
    }
}

/// Keeps a lease only if it is still safe to act on when its answer is read: half of
/// `lease` or more left, by the caller's clock, counted from `asked` (read before the claim
/// was sent).
///
/// A store counts the lease from when it ran the claim, which is after `asked`: at least
/// `lease - asked.elapsed()` is left. An answer read late — the caller held its future
/// without polling it, its runtime was starved — may carry a lease that is nearly over, or
/// over and already taken by a retry that is running the operation now: acting on it would
/// run the operation twice, and the first renewal (a third of the lease after the answer)
/// would come too late to stop that. Such a grant is given back ([`give_back_orphan`], in a
/// task of its own): an `Execute` released, a `TakeOver` ended and kept, so that its record
/// of the unfinished attempt stays. Either way the caller gets
/// [`Error::Unavailable`](crate::Error::Unavailable): nothing ran, retry. Call it in a Tokio
/// runtime: outside one, the grant is not given back (it runs out after its lease); and a
/// shutdown does not wait for the give-back unless you use
/// [`within_lease_with`] with a task tracker of your own, as the executor and the layer do.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotency_core::{within_lease, Begin, Fingerprint, MemoryStore, RecordId, Store};
/// use tokio::time::Instant;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = Arc::new(MemoryStore::new());
/// let (id, fp, lease) = (RecordId::from_bytes([7; 32]), Fingerprint::of(b"body"), Duration::from_secs(30));
/// let asked = Instant::now();
/// let answer = store.begin(&id, &fp, lease).await;
/// assert!(matches!(within_lease(&store, &id, asked, lease, answer), Ok(Begin::Execute(_))));
/// # }
/// ```
pub fn within_lease<S: crate::Store + ?Sized>(
    store: &std::sync::Arc<S>,
    id: &crate::RecordId,
    asked: tokio::time::Instant,
    lease: std::time::Duration,
    answer: Result<Begin>,
) -> Result<Begin> {
    within_lease_with(id, asked, lease, answer, |grant| {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (store, id) = (store.clone(), *id);
            runtime.spawn(async move { give_back_orphan(&*store, &id, grant).await });
        }
    })
}

/// Gives back a grant nobody will act on: an `Execute`'s lease is released
/// ([`release_orphan`]), a `TakeOver`'s ended and kept ([`end_orphan`]); any other answer
/// holds no lease.
pub async fn give_back_orphan<S: crate::Store + ?Sized>(
    store: &S,
    id: &crate::RecordId,
    grant: Begin,
) {
    match grant {
        Begin::Execute(token) => {
            release_orphan(store, id, token).await;
        }
        Begin::TakeOver(token) => {
            end_orphan(store, id, token).await;
        }
        _ => {}
    }
}

/// [`within_lease`], with the giving back left to the caller: `give_back` gets a grant
/// (`Execute` or `TakeOver`) read too late, and must not wait for it to be given back (spawn
/// [`give_back_orphan`]). For a caller that must account for that, such as a server's
/// graceful shutdown that waits for it.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{within_lease_with, Begin, LeaseToken, RecordId};
/// use tokio::time::Instant;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let (id, lease) = (RecordId::from_bytes([7; 32]), Duration::from_secs(30));
/// let asked = Instant::now();
/// tokio::time::sleep(lease).await; // the answer is read a whole lease late
/// let mut given_back = None;
/// let answer = within_lease_with(&id, asked, lease, Ok(Begin::Execute(LeaseToken::generate())), |grant| {
///     given_back = Some(grant);
/// });
/// assert!(answer.is_err());
/// assert!(given_back.is_some());
/// # }
/// ```
pub fn within_lease_with(
    id: &crate::RecordId,
    asked: tokio::time::Instant,
    lease: std::time::Duration,
    answer: Result<Begin>,
    give_back: impl FnOnce(Begin),
) -> Result<Begin> {
    let waited = asked.elapsed();
    let grant = match answer {
        Ok(grant @ (Begin::Execute(_) | Begin::TakeOver(_))) if waited >= lease / 2 => grant,
        _ => return answer,
    };
    tracing::warn!(record = %id, ?waited, ?lease, "a claim was answered too late to act on its lease; giving it back");
    give_back(grant);
    Err(crate::Error::unavailable(format!(
        "the claim was answered {waited:?} after it was asked, with half or less of its {lease:?} lease left"
    )))
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering::SeqCst},
        },
        time::Duration,
    };

    use tokio::sync::oneshot;

    use super::*;

    fn counting_release(
        released: &Arc<AtomicUsize>,
    ) -> impl FnOnce(LeaseToken) -> BoxFuture<'static, ()> + Send + 'static {
        let released = released.clone();
        move |_| {
            Box::pin(async move {
                released.fetch_add(1, SeqCst);
            })
        }
    }

    #[tokio::test]
    async fn a_dropped_caller_releases_the_lease_it_was_granted() {
        // Dropped while the claim is still running: it goes on in a task, which releases.
        let released = Arc::new(AtomicUsize::new(0));
        let (go, wait) = oneshot::channel::<()>();
        let claim = detached_claim::<Begin, _, _>(
            async move {
                let _ = wait.await;
                Ok(Begin::Execute(LeaseToken::generate()))
            },
            counting_release(&released),
        );
        let dropped = tokio::time::timeout(Duration::from_millis(20), claim).await;
        assert!(dropped.is_err());
        assert_eq!(released.load(SeqCst), 0, "the claim has not answered yet");
        go.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(released.load(SeqCst), 1);

        // Answers read by the caller are never released, and other answers never are.
        let released = Arc::new(AtomicUsize::new(0));
        detached_claim::<Begin, _, _>(
            async { Ok(Begin::Execute(LeaseToken::generate())) },
            counting_release(&released),
        )
        .await
        .unwrap();
        let (go, wait) = oneshot::channel::<()>();
        let finished = Arc::new(AtomicUsize::new(0));
        let claim_finished = finished.clone();
        let mut claim = Box::pin(detached_claim::<Begin, _, _>(
            async move {
                let _ = wait.await;
                claim_finished.fetch_add(1, SeqCst);
                Ok(Begin::Mismatch)
            },
            counting_release(&released),
        ));
        assert!(futures::poll!(&mut claim).is_pending());
        drop(claim);
        go.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(finished.load(SeqCst), 1, "the dropped claim ran to its end");
        assert_eq!(released.load(SeqCst), 0);
    }

    #[tokio::test]
    async fn a_dropped_future_runs_to_its_end_even_unpolled() {
        let ran = Arc::new(AtomicUsize::new(0));
        let step = |ran: &Arc<AtomicUsize>| {
            let ran = ran.clone();
            move |n: usize| -> BoxFuture<'static, ()> {
                Box::pin(async move {
                    ran.fetch_add(n, SeqCst);
                })
            }
        };
        // Never polled (a yield point between its making and its first poll): it runs all
        // the same, in a task, and so does the orphan step.
        let (go, wait) = oneshot::channel::<()>();
        let counted = ran.clone();
        drop(finish_on_drop(
            async move {
                counted.fetch_add(100, SeqCst);
                let _ = wait.await;
                1
            },
            step(&ran),
        ));
        go.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(ran.load(SeqCst), 101);
        ran.store(0, SeqCst);

        // Finished in the caller: the orphan step never runs.
        assert_eq!(finish_on_drop(async { 7 }, step(&ran)).await, 7);
        tokio::task::yield_now().await;
        assert_eq!(ran.load(SeqCst), 0);

        // Dropped mid-way: the rest and then the orphan step run in a task.
        let (go, wait) = oneshot::channel::<()>();
        let counted = ran.clone();
        let mut running = Box::pin(finish_on_drop(
            async move {
                counted.fetch_add(10, SeqCst);
                let _ = wait.await;
                counted.fetch_add(10, SeqCst);
                1
            },
            step(&ran),
        ));
        assert!(futures::poll!(&mut running).is_pending());
        assert_eq!(ran.load(SeqCst), 10);
        drop(running);
        go.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(ran.load(SeqCst), 21);
    }

    #[tokio::test]
    async fn a_future_that_panics_is_not_resumed() {
        let ran = Arc::new(AtomicUsize::new(0));
        let counted = ran.clone();
        let panicked = AssertUnwindSafe(finish_on_drop(
            async { panic!("a bug") },
            move |()| -> BoxFuture<'static, ()> {
                Box::pin(async move {
                    counted.fetch_add(1, SeqCst);
                })
            },
        ))
        .catch_unwind()
        .await;
        assert!(panicked.is_err());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(ran.load(SeqCst), 0, "nothing moved into a task");
    }

    #[tokio::test]
    async fn a_claim_that_panics_answers_unavailable_and_is_not_resumed() {
        let released = Arc::new(AtomicUsize::new(0));
        let answer = detached_claim::<Begin, _, _>(
            async { panic!("a store bug") },
            counting_release(&released),
        )
        .await;
        assert!(matches!(answer, Err(crate::Error::Unavailable(_))));
        tokio::task::yield_now().await;
        assert_eq!(released.load(SeqCst), 0);
    }
}
