//! Where the work a call leaves running runs: the runtime the store was made on, for as long
//! as it runs ([`Home`]).

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use tokio::{runtime::Handle, task::JoinHandle};
use tokio_util::task::TaskTracker;

/// The runtime a store was made on, where the work its calls leave running is spawned
/// (see `HybridStore::spawn` for why not the caller's), until that runtime shuts down.
///
/// A store is often made in a setup `block_on` whose runtime is then dropped, and used from
/// the application's: a runtime that has shut down drops every task spawned on it, unrun,
/// and the store's copies to Redis, its repairs, its breaker's probe and an operator's
/// second delete never ran. A task that runtime refuses comes back here, and it and every
/// later one are spawned on the caller's runtime instead.
#[derive(Debug)]
pub(crate) struct Home {
    handle: Option<Handle>,
    /// Set once `handle`'s runtime refused a task: it has shut down, for good.
    gone: AtomicBool,
}

impl Home {
    /// The runtime this is called on, if any.
    pub(crate) fn here() -> Self {
        Self {
            handle: Handle::try_current().ok(),
            gone: AtomicBool::new(false),
        }
    }

    /// Spawns `task` on the home runtime, or on the caller's once that one has shut down,
    /// tracked by `tracker`. Off any runtime, with no home, it panics as `tokio::spawn`
    /// does; with a home that has shut down, the task is dropped unrun (the handle answers
    /// cancelled): there is no runtime to run it on.
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
            return tracker.spawn(task);
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
        match Handle::try_current() {
            Ok(here) => tracker.spawn_on(task, &here),
            Err(_) => handle,
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
    fn a_task_runs_on_the_callers_runtime_once_home_has_shut_down() {
        let home = runtime().block_on(async { Home::here() });
        let (caller, tracker) = (runtime(), TaskTracker::new());
        for _ in 0..2 {
            let ran_on = caller.block_on(async {
                let handle = home.spawn(&tracker, async { Handle::current().id() });
                handle.await.expect("the task ran")
            });
            assert_eq!(ran_on, caller.handle().id());
        }
        assert!(home.gone.load(Ordering::Acquire));
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
