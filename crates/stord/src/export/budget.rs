//! A memory budget several connections draw from, on any thread.
//!
//! Each NBD connection already holds at most its own budget (64 MiB of request data), but
//! many connections together could still take the machine. They also draw on one budget
//! per NBD server ([`MemoryBudget`]): a request's data counts against it from when its
//! header is read until its reply has left, and a connection whose next request does not
//! fit waits, woken when another connection gives bytes back (the wake-up crosses threads
//! through the waiting task's waker, which queues it on its own loop).
//!
//! Clients that hold their share and never read their replies must not shut out the
//! others: a connection with nothing in flight may always start one small request
//! ([`FREE_REQUEST`]) beyond the limit, so a well-behaved client keeps being served while
//! the budget is spent, and the daemon holds at most the limit plus that much per
//! connection.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

/// The largest request a connection with nothing in flight may start beyond the limit.
pub const FREE_REQUEST: usize = 1 << 20;

/// Bytes held by requests across connections, with a ceiling.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: AtomicUsize,
    /// Tasks waiting for bytes to come back.
    waiters: Mutex<Vec<Waker>>,
    /// Someone may be in `waiters`: giving back takes the lock only then (it runs at every
    /// reply batch).
    waiting: AtomicBool,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            used: AtomicUsize::new(0),
            waiters: Mutex::default(),
            waiting: AtomicBool::new(false),
        }
    }

    /// The ceiling.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// Takes `n` bytes if they fit (or nothing is held: a request larger than the whole
    /// limit runs alone), or if `idle` (the caller holds nothing) and `n` is at most
    /// [`FREE_REQUEST`].
    fn try_take(&self, n: usize, idle: bool) -> bool {
        if idle && n <= FREE_REQUEST {
            self.used.fetch_add(n, Ordering::SeqCst);
            return true;
        }
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                (u == 0 || u + n <= self.limit).then_some(u + n)
            })
            .is_ok()
    }

    /// Ready once `n` bytes are taken; else the task is woken when bytes come back. A
    /// request larger than the whole limit runs when nothing else is held.
    pub fn poll_take(&self, cx: &mut Context<'_>, n: usize, idle: bool) -> Poll<()> {
        if self.try_take(n, idle) {
            return Poll::Ready(());
        }
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(cx.waker().clone());
        self.waiting.store(true, Ordering::SeqCst);
        // Bytes given back between the first try and the registration are not missed: the
        // giver either sees `waiting` or gave back before this second try.
        if self.try_take(n, idle) {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Gives `n` bytes back (what [`poll_take`](Self::poll_take) took for the same
    /// request) and wakes the waiting tasks, which try again.
    pub fn give_back(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.used.fetch_sub(n, Ordering::SeqCst);
        if !self.waiting.load(Ordering::SeqCst) {
            return;
        }
        let waiters = {
            let mut w = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
            self.waiting.store(false, Ordering::SeqCst);
            std::mem::take(&mut *w)
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
    use std::task::Wake;

    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn takes_up_to_the_limit_and_wakes_waiters_when_bytes_come_back() {
        let b = MemoryBudget::new(8 << 20);
        let flag = Arc::new(Flag(Default::default()));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(b.poll_take(&mut cx, 6 << 20, false).is_ready());
        assert!(b.poll_take(&mut cx, 4 << 20, false).is_pending());
        // A connection with nothing in flight still gets a small request through.
        assert!(b.poll_take(&mut cx, 4096, true).is_ready());
        assert!(b.poll_take(&mut cx, 2 << 20, true).is_pending());
        assert!(!flag.0.load(Ordering::SeqCst));
        b.give_back(6 << 20);
        assert!(flag.0.load(Ordering::SeqCst));
        assert!(b.poll_take(&mut cx, 4 << 20, false).is_ready());
        assert_eq!(b.used(), (4 << 20) + 4096);
        // Larger than the whole limit: runs once nothing else is held.
        b.give_back(4 << 20);
        b.give_back(4096);
        assert!(b.poll_take(&mut cx, 64 << 20, false).is_ready());
        b.give_back(64 << 20);
        assert_eq!(b.used(), 0);
    }
}
