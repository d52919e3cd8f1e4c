//! Locks on byte ranges, for writers that must not overlap: the file driver's
//! read-modify-write under O_DIRECT (an unaligned write patches the covering aligned
//! blocks; two such writes into one block would lose an update) and qcow2's cluster
//! allocation (two writes into one unallocated cluster must not both allocate it).
//! Ranges that do not overlap never wait. Waiters may be on any IoThread: their wakers
//! hand the wake-up to their own loop.

use std::future::poll_fn;
use std::sync::Mutex;
use std::task::{Poll, Waker};

#[derive(Default)]
struct State {
    held: Vec<(u64, u64)>,
    waiters: Vec<Waker>,
}

/// Locks on byte ranges `[start, end)`.
#[derive(Default)]
pub struct RangeLocks {
    state: Mutex<State>,
}

/// A held range; released on drop.
pub struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    range: (u64, u64),
}

impl RangeLocks {
    /// Waits until no held range overlaps `[start, end)`, then holds it.
    pub async fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        poll_fn(|cx| {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if s.held.iter().any(|&(a, b)| a < end && start < b) {
                s.waiters.push(cx.waker().clone());
                Poll::Pending
            } else {
                s.held.push((start, end));
                Poll::Ready(())
            }
        })
        .await;
        RangeGuard {
            locks: self,
            range: (start, end),
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let waiters = {
            let mut s = self.locks.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = s.held.iter().position(|r| *r == self.range) {
                s.held.swap_remove(i);
            }
            std::mem::take(&mut s.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}
