//! Locks on byte ranges, for writers that must not overlap: the file driver's
//! read-modify-write under O_DIRECT (an unaligned write patches the covering aligned
//! blocks; two such writes into one block would lose an update) and qcow2's cluster
//! allocation (two writes into one unallocated cluster must not both allocate it).
//! Ranges that do not overlap never wait. A shared hold waits only for exclusive ones
//! (a backup's point-in-time readers against its copy-before-write). Waiters may be on any IoThread: their wakers
//! hand the wake-up to their own loop.

use std::future::poll_fn;
use std::sync::Mutex;
use std::task::{Poll, Waker};

#[derive(Default)]
struct State {
    /// Held ranges: start, end, shared.
    held: Vec<(u64, u64, bool)>,
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
    range: (u64, u64, bool),
}

impl RangeLocks {
    /// Waits until no held range overlaps `[start, end)`, then holds it.
    pub async fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        self.hold(start, end, false).await
    }

    /// Waits until no range held exclusively overlaps `[start, end)`, then holds it
    /// shared: other shared holds of it may come, exclusive ones wait.
    pub async fn lock_shared(&self, start: u64, end: u64) -> RangeGuard<'_> {
        self.hold(start, end, true).await
    }

    async fn hold(&self, start: u64, end: u64, shared: bool) -> RangeGuard<'_> {
        poll_fn(|cx| {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let conflict = |&(a, b, sh): &(u64, u64, bool)| a < end && start < b && !(sh && shared);
            if s.held.iter().any(conflict) {
                s.waiters.push(cx.waker().clone());
                Poll::Pending
            } else {
                s.held.push((start, end, shared));
                Poll::Ready(())
            }
        })
        .await;
        RangeGuard {
            locks: self,
            range: (start, end, shared),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Waker};

    /// The guard if the hold is taken at once.
    fn now<'a>(f: impl Future<Output = RangeGuard<'a>>) -> Option<RangeGuard<'a>> {
        match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(g) => Some(g),
            Poll::Pending => None,
        }
    }

    #[test]
    fn shared_holds_wait_only_for_exclusive_ones() {
        let l = RangeLocks::default();
        let a = now(l.lock_shared(0, 100)).expect("free");
        let b = now(l.lock_shared(50, 150));
        assert!(b.is_some(), "two shared holds overlap");
        assert!(
            now(l.lock(90, 95)).is_none(),
            "an exclusive hold waits for shared ones"
        );
        let x = now(l.lock(200, 300)).expect("ranges apart never wait");
        assert!(
            now(l.lock_shared(250, 260)).is_none(),
            "a shared hold waits for an exclusive one"
        );
        drop((a, b, x));
        assert!(now(l.lock(0, 300)).is_some(), "all released");
    }
}
