//! Where the work a call leaves running runs: the runtime the store was made on, for as long
//! as it runs, then a runtime of the store's own ([`Home`]).

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
    runtime::{Handle, Runtime},
    task::JoinHandle,
};
use tokio_util::task::TaskTracker;

/// Where the work a store's calls leave running is spawned: the runtime the store was made
/// on (see `HybridStore::spawn` for why not the caller's), until that runtime shuts down;
/// then, or when the store was made off any runtime, a runtime of the store's own (one
/// thread, made when first needed, shut down with the store).
///
/// Not the caller's: a store is often made in a setup `block_on` whose runtime is then
/// dropped, and used from the application's. A runtime that has shut down drops every task
/// spawned on it, unrun: the store's copies to Redis, its repairs, its breaker's probe and
/// an operator's second delete never ran. And the caller's may be a current-thread runtime
/// left idle once its `block_on` returned (a sync worker's), where they would not run
/// either, and a `complete` waiting for a lease's mirror would wait for good.
#[derive(Debug)]
pub(crate) struct Home {
    handle: Option<Handle>,
    /// Set once `handle`'s runtime refused a task: it has shut down, for good.
    gone: AtomicBool,
    /// The store's own runtime, once needed (`None`: it could not be made).
    own: OnceLock<Option<Runtime>>,
}

impl Home {
    /// The runtime this is called on, if any.
    pub(crate) fn here() -> Self {
        Self {
            handle: Handle::try_current().ok(),
            gone: AtomicBool::new(false),
            own: OnceLock::new(),
        }
    }

    /// Spawns `task`, tracked by `tracker`, on the home runtime, or on the store's own once
    /// that one has shut down. A runtime that refuses a task drops it as it is spawned:
    /// such a task comes back here (see [`Unrun`]).
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
            return self.spawn_on_own(tracker, task);
        };
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
        self.spawn_on_own(tracker, task)
    }

    /// `task` on the store's own runtime; on the caller's if it cannot be made (off any
    /// runtime, that panics as `tokio::spawn` does).
    fn spawn_on_own<F>(&self, tracker: &TaskTracker, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let own = self.own.get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("idempotency-hybrid")
                .enable_all()
                .build()
                .inspect_err(|error| {
                    tracing::warn!(%error, "could not make the hybrid store's own runtime");
                })
                .ok()
        });
        match own {
            Some(own) => tracker.spawn_on(task, own.handle()),
            None => tracker.spawn(task),
        }
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        // Without waiting: the store may be dropped in an async context, or on that
        // runtime's own thread, by the last task that held it.
        if let Some(Some(own)) = self.own.take() {
            own.shutdown_background();
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

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn a_task_runs_on_the_home_runtime_while_it_runs() {
        let (home_rt, caller) = (runtime(), runtime());
        let home = home_rt.block_on(async { Home::here() });
        let tracker = TaskTracker::new();
        let handle = {
            let _on_the_caller = caller.enter();
            home.spawn(&tracker, async { Handle::current().id() })
        };
        let ran_on = home_rt.block_on(handle).expect("the task");
        assert_eq!(ran_on, home_rt.handle().id());
    }

    #[test]
    fn a_task_runs_on_a_runtime_of_its_own_once_home_has_shut_down() {
        let home = runtime().block_on(async { Home::here() });
        let (caller, tracker) = (runtime(), TaskTracker::new());
        // Spawned from a runtime left idle once its `block_on` returned: it runs all the
        // same, and every later one on the same runtime.
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let _on_the_caller = caller.enter();
                home.spawn(&tracker, async { Handle::current().id() })
            })
            .collect();
        let ran_on: Vec<_> = handles
            .into_iter()
            .map(|handle| futures::executor::block_on(handle).expect("the task ran"))
            .collect();
        assert_ne!(ran_on[0], caller.handle().id());
        assert_eq!(ran_on[0], ran_on[1]);
        assert!(home.gone.load(Ordering::Acquire));
    }

    #[test]
    fn off_any_runtime_a_store_made_off_any_runtime_runs_its_tasks() {
        let (home, tracker) = (Home::here(), TaskTracker::new());
        let handle = home.spawn(&tracker, async { 7 });
        assert_eq!(
            futures::executor::block_on(handle).expect("the task ran"),
            7
        );
        // Dropped from within a runtime: no panic for shutting one down there.
        runtime().block_on(async move { drop(home) });
    }

    #[test]
    fn a_task_aborted_before_its_first_poll_stays_aborted() {
        let (home_rt, tracker) = (runtime(), TaskTracker::new());
        let home = home_rt.block_on(async { Home::here() });
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
