//! An async mutex whose holders and waiters may be tasks on different threads' loops.
//!
//! Block drivers are shared by IoThreads, and some keep state that must stay locked
//! across I/O (a qcow2 node's metadata caches while a table loads). A `std::sync::Mutex`
//! would block the whole loop of a thread that waits; this one parks only the waiting
//! task, and its waker hands the wake-up to that task's own loop. Unlocking wakes every
//! waiter (they race for the lock again): a waiter whose future was dropped can then never
//! swallow the only wake-up, and the holders here keep the lock briefly.

use std::cell::UnsafeCell;
use std::future::poll_fn;
use std::ops::{Deref, DerefMut};
use std::sync::Mutex;
use std::task::{Poll, Waker};

#[derive(Default)]
struct LockState {
    locked: bool,
    waiters: Vec<Waker>,
}

/// See the module docs.
#[derive(Default)]
pub struct AsyncMutex<T> {
    state: Mutex<LockState>,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through an `AsyncMutexGuard`, and `state.locked`
// admits one guard at a time, so sharing the mutex between threads shares `T` only by
// moving exclusive access, which `T: Send` allows.
unsafe impl<T: Send> Sync for AsyncMutex<T> {}

/// Exclusive access to an [`AsyncMutex`]'s value; unlocks on drop.
pub struct AsyncMutexGuard<'a, T> {
    mutex: &'a AsyncMutex<T>,
}

impl<T> AsyncMutex<T> {
    /// A mutex holding `value`.
    pub fn new(value: T) -> Self {
        Self {
            state: Mutex::new(LockState::default()),
            value: UnsafeCell::new(value),
        }
    }

    /// Waits until the mutex is free, then holds it.
    pub async fn lock(&self) -> AsyncMutexGuard<'_, T> {
        poll_fn(|cx| {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if s.locked {
                if !s.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                    s.waiters.push(cx.waker().clone());
                }
                Poll::Pending
            } else {
                s.locked = true;
                Poll::Ready(())
            }
        })
        .await;
        AsyncMutexGuard { mutex: self }
    }

    /// Holds the mutex if it is free.
    pub fn try_lock(&self) -> Option<AsyncMutexGuard<'_, T>> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.locked {
            return None;
        }
        s.locked = true;
        Some(AsyncMutexGuard { mutex: self })
    }
}

impl<T> Deref for AsyncMutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (`locked` was false when it was made and
        // stays true until it drops), so no `&mut T` exists elsewhere.
        unsafe { &*self.mutex.value.get() }
    }
}

impl<T> DerefMut for AsyncMutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this borrow the only one through the
        // guard.
        unsafe { &mut *self.mutex.value.get() }
    }
}

impl<T> Drop for AsyncMutexGuard<'_, T> {
    fn drop(&mut self) {
        let waiters = {
            let mut s = self.mutex.state.lock().unwrap_or_else(|e| e.into_inner());
            s.locked = false;
            std::mem::take(&mut s.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn tasks_on_two_threads_take_turns() {
        let m = Arc::new(AsyncMutex::new(0u64));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    let ctx = crate::AioContext::new(Default::default()).unwrap();
                    ctx.block_on(async move {
                        for _ in 0..2000 {
                            let mut g = m.lock().await;
                            let v = *g;
                            // Yield while holding it: the other thread must wait.
                            crate::sleep(std::time::Duration::from_micros(1)).await;
                            *g = v + 1;
                        }
                    })
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*m.try_lock().unwrap(), 4000);
    }
}
