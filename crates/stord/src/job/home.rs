//! Where a job's I/O runs, and its copy operations in flight.
//!
//! QEMU runs a block job's coroutines in the AioContext of the node it copies from, so a
//! job on a node that an IoThread serves does its I/O there and not beside the monitor.
//! Here the job's task (its states, verbs and events) stays on the main loop, and each
//! copy operation runs as a task on the node's [`Home`]: the IoThread whose exports serve
//! the node (or that it was moved to), through that thread's ring. The main loop hands
//! out an operation and takes its result back, once per operation (a MiB or so), so a
//! busy monitor delays the job by that hand-over, not by each request.
//!
//! [`InFlight`] keeps the operations a job has started: how many and how many bytes (the
//! job's limits, QEMU's mirror `MAX_IN_FLIGHT` and `buf-size`), and their results as they
//! finish, in any order. An operation whose thread stopped before it finished comes back
//! as an error, so the job never waits for it forever.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};

use stord_aio::Remote;

/// The thread a job's operations run on.
#[derive(Clone, Debug, Default)]
pub enum Home {
    /// The main loop (a node no IoThread serves, as QEMU's main AioContext).
    #[default]
    Main,
    IoThread(Remote),
}

impl Home {
    /// Runs the future `make` builds as a task on this thread; `make` is called there.
    fn spawn<F, Fut>(&self, make: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        match self {
            Home::IoThread(r) if !r.is_current() => {
                r.call(move || stord_aio::spawn_detached(make()));
            }
            _ => stord_aio::spawn_detached(make()),
        }
    }

    /// Runs one operation there and waits for its result (an error if the thread
    /// stopped first).
    pub async fn run<T, F, Fut>(&self, make: F) -> io::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = io::Result<T>> + 'static,
    {
        let ops = InFlight::new();
        ops.start(self, 0, Err(stopped()), make);
        ops.next().await.unwrap_or_else(|| Err(stopped()))
    }
}

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
struct Slot<T> {
    state: Arc<Mutex<State<T>>>,
    bytes: u64,
    lost: Option<T>,
}

impl<T> Slot<T> {
    fn give(&mut self, r: T) {
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
        {
            let mut s = self.lock();
            s.ops += 1;
            s.bytes += bytes;
        }
        let mut slot = Slot {
            state: self.state.clone(),
            bytes,
            lost: Some(lost),
        };
        home.spawn(move || async move {
            let r = make().await;
            slot.give(r);
        });
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
    fn an_operation_whose_thread_stopped_comes_back_as_lost() {
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let mut t = IoThread::spawn(AioContextOptions::default()).unwrap();
        let home = Home::IoThread(t.remote().clone());
        t.stop();
        let r = ctx.block_on(async move { home.run(|| async { Ok::<_, io::Error>(1) }).await });
        assert_eq!(r.unwrap_err().to_string(), "the IoThread stopped");
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
