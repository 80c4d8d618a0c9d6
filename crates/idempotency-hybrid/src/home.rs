//! Where the work a call leaves running runs: the multi-thread runtime the store was made
//! on, for as long as it runs, else a background runtime of this crate's ([`Home`]).

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex, OnceLock, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use tokio::{
    runtime::{Handle, Runtime, RuntimeFlavor},
    task::JoinHandle,
};
use tokio_util::task::TaskTracker;

/// Where the work a store's calls leave running is spawned: a runtime that runs its tasks
/// whoever calls. That is the runtime the store was made on when it is a multi-thread one
/// (its workers run its tasks), until it shuts down; otherwise a background runtime of this
/// crate's, one thread for the whole process, made when first needed and never shut down.
///
/// Not the caller's runtime, nor a current-thread one: such a runtime runs its tasks only
/// inside a `block_on`. Left idle once that returned (a sync worker's between jobs; a setup
/// runtime kept in `main` while the application serves from another), it ran none of them:
/// a lease's mirror never landed and the `complete` waiting for it waited for good, the
/// breaker's probe never answered, repairs kept their lock. And a runtime that has shut down
/// (a setup `block_on`'s, dropped) drops what is spawned on it unrun: outcomes were never
/// copied, and an operator's release answered `Unavailable` on every try.
#[derive(Debug)]
pub(crate) struct Home {
    handle: Option<Handle>,
    /// Set once `handle`'s runtime refused a task: it has shut down, for good.
    gone: AtomicBool,
}

impl Home {
    /// The runtime this is called on, if it is a multi-thread one.
    pub(crate) fn here() -> Self {
        let handle = Handle::try_current()
            .ok()
            .filter(|handle| matches!(handle.runtime_flavor(), RuntimeFlavor::MultiThread));
        Self {
            handle,
            gone: AtomicBool::new(false),
        }
    }

    /// Spawns `task`, tracked by `tracker`, on the home runtime, or on the background one
    /// when there is none or it has shut down. A runtime that has shut down drops a task as
    /// it is spawned: such a task comes back here (see [`Unrun`]).
    ///
    /// A task already on the home runtime when it shuts down is dropped with it: what is
    /// spawned there is made to survive being dropped (fenced writes, repairs put back in
    /// their queue, a probe replaced once its time is up).
    pub(crate) fn spawn<F>(&self, tracker: &TaskTracker, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let Some(home) = self
            .handle
            .as_ref()
            .filter(|_| !self.gone.load(Ordering::Acquire))
        else {
            return spawn_in_background(tracker, task);
        };
        // Counted for `drain` throughout: a refused task leaves the tracker as it is
        // spawned, and a `drain` waiting on it then (another task just ending) would return
        // before it is spawned again.
        let _counted = tracker.token();
        let refused = Arc::new(Mutex::new(None));
        let unrun = Unrun {
            task: Some(Box::pin(task)),
            started: false,
            refused: refused.clone(),
        };
        let handle = tracker.spawn_on(unrun, home);
        // A runtime that has shut down drops a task as it is spawned, before this returns;
        // one aborted before its first poll can only be aborted through `handle`.
        let Some(task) = refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return handle;
        };
        self.gone.store(true, Ordering::Release);
        spawn_in_background(tracker, task)
    }
}

/// `task` on the background runtime; on the caller's if it cannot be made (off any
/// runtime, that panics as `tokio::spawn` does).
fn spawn_in_background<F>(tracker: &TaskTracker, task: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match background() {
        Some(runtime) => tracker.spawn_on(task, runtime.handle()),
        None => tracker.spawn(task),
    }
}

/// The process's background runtime for hybrid stores: one worker thread. Never shut down
/// (a static is never dropped): a Redis connection made or remade by a task there (redis-rs
/// drives it on the runtime of the call that connects) serves every store that shares it.
/// Made again on the next need if it could not be made.
fn background() -> Option<&'static Runtime> {
    static BACKGROUND: OnceLock<Runtime> = OnceLock::new();
    if let Some(runtime) = BACKGROUND.get() {
        return Some(runtime);
    }
    let made = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("idempotency-hybrid")
        .enable_all()
        .build();
    match made {
        Ok(runtime) => {
            // Made twice at once: the one not kept is shut down without blocking (this may
            // be an async context).
            if let Err(spare) = BACKGROUND.set(runtime) {
                spare.shutdown_background();
            }
            BACKGROUND.get()
        }
        Err(error) => {
            tracing::warn!(%error, "could not make the hybrid stores' background runtime");
            None
        }
    }
}

/// A task that, dropped before its first poll, puts itself in `refused`.
struct Unrun<F> {
    task: Option<Pin<Box<F>>>,
    started: bool,
    refused: Arc<Mutex<Option<Pin<Box<F>>>>>,
}

impl<F: Future> Future for Unrun<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.started = true;
        let task = self
            .task
            .as_mut()
            .expect("an Unrun polled after it finished");
        let done = task.as_mut().poll(cx);
        if done.is_ready() {
            self.task = None;
        }
        done
    }
}

impl<F> Drop for Unrun<F> {
    fn drop(&mut self) {
        if !self.started {
            *self.refused.lock().unwrap_or_else(PoisonError::into_inner) = self.task.take();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current_thread() -> Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    fn multi_thread() -> Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Where a task spawned from a current-thread runtime left idle ran.
    fn ran_on(home: &Home) -> tokio::runtime::Id {
        let (caller, tracker) = (current_thread(), TaskTracker::new());
        let handle = {
            let _on_the_caller = caller.enter();
            home.spawn(&tracker, async { Handle::current().id() })
        };
        let ran_on = joined(handle);
        assert_ne!(ran_on, caller.handle().id());
        ran_on
    }

    /// `handle`'s task's answer, waited for on a runtime of its own, within a deadline: a
    /// task left where nothing runs it fails the test rather than hang it.
    fn joined<T: Send + 'static>(handle: JoinHandle<T>) -> T {
        let deadline = std::time::Duration::from_secs(10);
        multi_thread()
            .block_on(async { tokio::time::timeout(deadline, handle).await })
            .expect("the task ran within 10 s")
            .expect("the task ran")
    }

    #[test]
    fn a_task_runs_on_a_multi_thread_home_while_it_runs() {
        let home_rt = multi_thread();
        let home = home_rt.block_on(async { Home::here() });
        assert_eq!(ran_on(&home), home_rt.handle().id());
        assert!(!home.gone.load(Ordering::Acquire));
    }

    #[test]
    fn a_task_runs_in_the_background_once_home_has_shut_down() {
        let home = multi_thread().block_on(async { Home::here() });
        let background = background().expect("the background runtime").handle().id();
        assert_eq!(ran_on(&home), background);
        assert!(home.gone.load(Ordering::Acquire));
        assert_eq!(ran_on(&home), background);
    }

    #[test]
    fn a_current_thread_runtime_is_no_home() {
        let home_rt = current_thread();
        let home = home_rt.block_on(async { Home::here() });
        let background = background().expect("the background runtime").handle().id();
        // Alive, but idle: it would never run the task.
        assert_eq!(ran_on(&home), background);
    }

    #[test]
    fn off_any_runtime_a_store_runs_its_tasks_in_the_background() {
        let (home, tracker) = (Home::here(), TaskTracker::new());
        let handle = home.spawn(&tracker, async { 7 });
        assert_eq!(joined(handle), 7);
    }

    #[test]
    fn a_task_aborted_before_its_first_poll_stays_aborted() {
        let (home_rt, tracker) = (current_thread(), TaskTracker::new());
        let home = Home {
            handle: Some(home_rt.handle().clone()),
            gone: AtomicBool::new(false),
        };
        let ran = Arc::new(AtomicBool::new(false));
        let handle = home.spawn(&tracker, {
            let ran = ran.clone();
            async move { ran.store(true, Ordering::Release) }
        });
        handle.abort();
        let answer = home_rt.block_on(handle);
        assert!(answer.expect_err("aborted").is_cancelled());
        home_rt.block_on(tokio::task::yield_now());
        assert!(!ran.load(Ordering::Acquire));
        assert!(!home.gone.load(Ordering::Acquire));
    }
}
