//! The operations a job has in flight ([`InFlight`]): how many and how many bytes (the
//! job's limits, QEMU's mirror `MAX_IN_FLIGHT` and `buf-size`), and their results as they
//! finish, in any order. An operation whose thread stopped before it finished comes back
//! as an error ([`stopped`]), so the job never waits for it forever.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};

use super::home::Home;

/// What an operation whose thread stopped before it finished failed with.
pub fn stopped() -> io::Error {
    io::Error::other("the IoThread stopped")
}

struct State<T> {
    ops: usize,
    bytes: u64,
    done: VecDeque<T>,
    waker: Option<Waker>,
}

/// Operations a job has in flight, and the results of those that finished.
pub struct InFlight<T> {
    state: Arc<Mutex<State<T>>>,
}

impl<T: Send + 'static> Default for InFlight<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// An operation's slot: gives its result back once, or `lost` if it is dropped first
/// (its thread stopped).
pub(super) struct Slot<T> {
    state: Arc<Mutex<State<T>>>,
    bytes: u64,
    lost: Option<T>,
}

impl<T> Slot<T> {
    pub(super) fn give(&mut self, r: T) {
        self.lost = None;
        let waker = {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            s.ops -= 1;
            s.bytes -= self.bytes;
            s.done.push_back(r);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Drop for Slot<T> {
    fn drop(&mut self) {
        if let Some(lost) = self.lost.take() {
            self.give(lost);
        }
    }
}

impl<T: Send + 'static> InFlight<T> {
    pub fn new() -> Self {
        InFlight {
            state: Arc::new(Mutex::new(State {
                ops: 0,
                bytes: 0,
                done: VecDeque::new(),
                waker: None,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Operations and bytes in flight now.
    pub fn load(&self) -> (usize, u64) {
        let s = self.lock();
        (s.ops, s.bytes)
    }

    /// Starts the operation `make` builds on `home`, counted as `bytes` until it ends;
    /// its result is `lost` if its thread stops before it ends.
    pub fn start<F, Fut>(&self, home: &Home, bytes: u64, lost: T, make: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        let mut slot = self.slot(bytes, lost);
        home.spawn(move || async move {
            let r = make().await;
            slot.give(r);
        });
    }

    /// Counts one more operation of `bytes` in flight; its slot gives its result back.
    pub(super) fn slot(&self, bytes: u64, lost: T) -> Slot<T> {
        {
            let mut s = self.lock();
            s.ops += 1;
            s.bytes += bytes;
        }
        Slot {
            state: self.state.clone(),
            bytes,
            lost: Some(lost),
        }
    }

    /// Nothing in flight and no result waiting to be taken.
    pub fn is_empty(&self) -> bool {
        let s = self.lock();
        s.ops == 0 && s.done.is_empty()
    }

    /// A finished operation's result, if one is waiting.
    pub fn try_next(&self) -> Option<T> {
        self.lock().done.pop_front()
    }

    /// What a job settles before its next step: a result waiting now; with `drain` (the
    /// job is about to pause, and a job pauses with nothing in flight, as QEMU's
    /// mirror_pause waits for its I/O) the next to finish, until none is in flight.
    pub async fn next_to_settle(&self, drain: bool) -> Option<T> {
        if drain {
            self.next().await
        } else {
            self.try_next()
        }
    }

    /// The next result: waits for an operation to finish; None if none is in flight and
    /// none is waiting.
    pub async fn next(&self) -> Option<T> {
        std::future::poll_fn(|cx| {
            let mut s = self.lock();
            if let Some(r) = s.done.pop_front() {
                return Poll::Ready(Some(r));
            }
            if s.ops == 0 {
                return Poll::Ready(None);
            }
            s.waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Waits until nothing is in flight; the results not taken yet.
    pub async fn drain(&self) -> Vec<T> {
        let mut out = Vec::new();
        while let Some(r) = self.next().await {
            out.push(r);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stord_aio::{AioContext, AioContextOptions, IoThread};

    #[test]
    fn operations_on_another_thread_come_back_in_the_order_they_finish() {
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let mut t = IoThread::spawn(AioContextOptions::default()).unwrap();
        let home = Home::IoThread(t.remote().clone());
        let main = std::thread::current().id();
        let ran_on = ctx.block_on(async move {
            let ops: InFlight<(u32, std::thread::ThreadId)> = InFlight::new();
            for (i, ms) in [(0u32, 30u64), (1, 1), (2, 15)] {
                ops.start(&home, 1 << 20, (i, main), move || async move {
                    stord_aio::sleep(std::time::Duration::from_millis(ms)).await;
                    (i, std::thread::current().id())
                });
            }
            assert_eq!(ops.load(), (3, 3 << 20));
            let mut out = Vec::new();
            while let Some(r) = ops.next().await {
                out.push(r);
            }
            assert_eq!(ops.load(), (0, 0));
            out
        });
        let order: Vec<u32> = ran_on.iter().map(|r| r.0).collect();
        assert_eq!(order, [1, 2, 0]);
        assert!(ran_on.iter().all(|r| r.1 != main), "ran on the IoThread");
        t.stop();
    }

    #[test]
    fn on_the_main_loop_operations_run_as_local_tasks() {
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let n = ctx.block_on(async {
            let ops: InFlight<u64> = InFlight::new();
            for i in 0..4 {
                ops.start(&Home::Main, 1, 0, move || async move { i * 2 });
            }
            ops.drain().await.into_iter().sum::<u64>()
        });
        assert_eq!(n, 12);
    }
}
