//! A mutex whose state has one property worth knowing without the lock.

use std::sync::{
    Mutex, MutexGuard, PoisonError,
    atomic::{AtomicBool, Ordering},
};

/// A mutex that publishes one property of its value (`test`) in an atomic, written under the
/// lock each time a guard is released. A reader that sees the property holds acts as if it
/// had taken the lock just after the last writer: what the hot path needs (the breaker
/// closed with nothing failed, no stale mirror to repair) without both cores taking the
/// lock on every call.
#[derive(Debug)]
pub(crate) struct Flagged<T> {
    value: Mutex<T>,
    holds: AtomicBool,
    test: fn(&T) -> bool,
}

impl<T> Flagged<T> {
    pub(crate) fn new(value: T, test: fn(&T) -> bool) -> Self {
        let holds = AtomicBool::new(test(&value));
        Self {
            value: Mutex::new(value),
            holds,
            test,
        }
    }

    /// Whether the property held when the last guard was released.
    pub(crate) fn holds(&self) -> bool {
        self.holds.load(Ordering::Acquire)
    }

    /// The value, locked (a poisoned lock is taken as it is: every writer leaves the value
    /// consistent between statements).
    pub(crate) fn lock(&self) -> Guard<'_, T> {
        Guard {
            value: self.value.lock().unwrap_or_else(PoisonError::into_inner),
            of: self,
        }
    }
}

/// A locked [`Flagged`]; releasing it publishes the property.
pub(crate) struct Guard<'a, T> {
    value: MutexGuard<'a, T>,
    of: &'a Flagged<T>,
}

impl<T> std::ops::Deref for Guard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> std::ops::DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        // Still under the lock: changes and their flag are published in the same order.
        let holds = (self.of.test)(&self.value);
        self.of.holds.store(holds, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_follows_the_value_as_each_guard_is_released() {
        let flagged = Flagged::new(Vec::<u32>::new(), Vec::is_empty);
        assert!(flagged.holds());
        let mut guard = flagged.lock();
        guard.push(1);
        assert!(flagged.holds(), "published when the guard goes, not before");
        drop(guard);
        assert!(!flagged.holds());
        flagged.lock().clear();
        assert!(flagged.holds());
    }
}
