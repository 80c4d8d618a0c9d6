//! Claims that survive their caller: how a store makes `begin` safe to drop.
//!
//! A `begin` that reaches the store and is then dropped — a client hang-up, an outer timeout,
//! a `select!`, the store's own call budget — may still commit its claim. Nobody then holds
//! the token: the key answers "in flight" until the lease ends, and a caller that was told
//! `Unavailable` ("nothing changed") sees a write land after all. [`detached_claim`] closes
//! that: the claim runs in its own task to the end, and a granted lease whose caller is gone
//! is released at once.

use std::{
    future::Future,
    sync::{Arc, Mutex, PoisonError},
};

use futures::future::BoxFuture;
use tokio::sync::oneshot;

use crate::{Begin, LeaseToken, Result};

/// Gives an orphaned lease back (usually a spawned `Store::release`).
type Undo = Box<dyn FnOnce(LeaseToken) -> BoxFuture<'static, ()> + Send>;

/// Runs `claim` in its own task and returns its answer. If the returned future is dropped
/// before it yields the answer — at any point, including after the claim committed — and the
/// answer was `Execute(token)`, `release(token)` runs in a task of its own: a lease is never
/// left claimed by nobody.
///
/// Store implementations wrap the body of `begin` in it (see the Postgres and Redis stores);
/// the in-memory store needs no wrapper because its `begin` never awaits. The claim itself
/// should be bounded (a statement timeout, a call budget), since nothing waits for it.
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
///
/// # Panics
///
/// Outside a Tokio runtime (it spawns the claim).
pub async fn detached_claim<T, C, R>(claim: C, release: R) -> Result<T>
where
    T: GrantsLease,
    C: Future<Output = Result<T>> + Send + 'static,
    R: FnOnce(LeaseToken) -> BoxFuture<'static, ()> + Send + 'static,
{
    let undo: Arc<Mutex<Option<Undo>>> = Arc::new(Mutex::new(Some(Box::new(release))));
    let (tx, rx) = oneshot::channel();
    let task_undo = undo.clone();
    tokio::spawn(async move {
        let answer = claim.await;
        // The send fails exactly when the receiver was dropped first: the caller is gone.
        if let Err(Ok(answer)) = tx.send(answer)
            && let Some(token) = answer.granted()
        {
            run_undo(&task_undo, token);
        }
    });
    let mut guard = Receiver { rx, undo };
    match (&mut guard.rx).await {
        Ok(answer) => answer,
        // The task panicked: a claim it made (if any) is not known, so it expires by itself.
        Err(_) => Err(crate::Error::unavailable(
            "the claim task ended without an answer",
        )),
    }
}

/// The caller's end. Dropped with an answer still in the channel (the claim finished, the
/// caller never read it), it releases an `Execute` lease.
struct Receiver<T: GrantsLease> {
    rx: oneshot::Receiver<Result<T>>,
    undo: Arc<Mutex<Option<Undo>>>,
}

impl<T: GrantsLease> Drop for Receiver<T> {
    fn drop(&mut self) {
        // After `close`, a send either happened before (the value is readable now) or fails
        // (the task releases): exactly one side sees the token.
        self.rx.close();
        if let Ok(Ok(answer)) = self.rx.try_recv()
            && let Some(token) = answer.granted()
        {
            run_undo(&self.undo, token);
        }
    }
}

/// An answer that may grant a lease: [`Begin`], or `Begin` with extra data such as a TTL.
pub trait GrantsLease: Send + 'static {
    /// The token of the lease to release when nobody receives this answer, if any.
    fn granted(&self) -> Option<LeaseToken>;
}

impl GrantsLease for Begin {
    /// `Execute` only. A `TakeOver` lease whose claimer went away is left to run out, not
    /// released: released, the record of the unfinished attempt before it would be gone,
    /// and the next `begin` would answer a fresh `Execute` instead of `TakeOver` (its
    /// outcome still unknown). It costs one lease of `InFlight`.
    fn granted(&self) -> Option<LeaseToken> {
        match self {
            Begin::Execute(token) => Some(*token),
            _ => None,
        }
    }
}

impl<U: Send + 'static> GrantsLease for (Begin, U) {
    fn granted(&self) -> Option<LeaseToken> {
        self.0.granted()
    }
}

/// [`detached_claim`] as a store's `begin` uses it: `claim` runs to its end in a task of its
/// own, and a lease it grants after the caller went away is given back to `store` with
/// [`release_orphan`].
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
pub async fn detached_begin<S, T, C>(store: S, id: crate::RecordId, claim: C) -> Result<T>
where
    S: crate::Store + 'static,
    T: GrantsLease,
    C: Future<Output = Result<T>> + Send + 'static,
{
    detached_claim(claim, move |token| {
        Box::pin(async move { release_orphan(&store, &id, token).await })
    })
    .await
}

/// Releases a lease whose claimer went away, retrying an unavailable store with backoff for up
/// to a minute: orphans appear exactly when the store is slow, so one try is often not enough.
/// The release is fenced on the token, so a retry after one that landed changes nothing.
///
/// The release closure stores hand to [`detached_claim`] calls it.
pub async fn release_orphan<S: crate::Store + ?Sized>(
    store: &S,
    id: &crate::RecordId,
    token: LeaseToken,
) {
    let give_up = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut backoff = std::time::Duration::from_millis(50);
    loop {
        match store.release(id, token).await {
            Ok(()) | Err(crate::Error::LeaseLost) => return,
            Err(error) if tokio::time::Instant::now() + backoff < give_up => {
                tracing::debug!(%error, record = %id, "releasing an orphaned lease; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
            }
            Err(error) => {
                tracing::warn!(%error, record = %id, "could not release an orphaned lease; it expires by itself");
                return;
            }
        }
    }
}

fn run_undo(undo: &Mutex<Option<Undo>>, token: LeaseToken) {
    let Some(undo) = undo.lock().unwrap_or_else(PoisonError::into_inner).take() else {
        return;
    };
    tracing::debug!(%token, "releasing a lease whose claimer went away");
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(undo(token));
        }
        // The runtime is shutting down: the lease expires by itself.
        Err(_) => tracing::warn!(%token, "no runtime to release an orphaned lease; it expires"),
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::atomic::AtomicUsize, time::Duration};

    use super::*;

    fn counting_release(
        released: &Arc<AtomicUsize>,
    ) -> impl FnOnce(LeaseToken) -> BoxFuture<'static, ()> + Send + 'static {
        let released = released.clone();
        move |_| {
            Box::pin(async move {
                released.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            })
        }
    }

    #[tokio::test]
    async fn a_dropped_caller_releases_the_lease_it_was_granted() {
        // Dropped while the claim is still running: the task releases when it lands.
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
        go.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(released.load(std::sync::atomic::Ordering::SeqCst), 1);

        // Dropped after the answer was sent but before it was read.
        let released = Arc::new(AtomicUsize::new(0));
        let mut claim = Box::pin(detached_claim::<Begin, _, _>(
            async { Ok(Begin::Execute(LeaseToken::generate())) },
            counting_release(&released),
        ));
        assert!(futures::poll!(&mut claim).is_pending()); // spawns the claim
        tokio::time::sleep(Duration::from_millis(20)).await; // it answers, unread
        drop(claim);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(released.load(std::sync::atomic::Ordering::SeqCst), 1);

        // Read answers are never released, and other answers never are.
        let released = Arc::new(AtomicUsize::new(0));
        detached_claim::<Begin, _, _>(
            async { Ok(Begin::Execute(LeaseToken::generate())) },
            counting_release(&released),
        )
        .await
        .unwrap();
        let mut claim = Box::pin(detached_claim::<Begin, _, _>(
            async { Ok(Begin::Mismatch) },
            counting_release(&released),
        ));
        assert!(futures::poll!(&mut claim).is_pending());
        drop(claim);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(released.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}
