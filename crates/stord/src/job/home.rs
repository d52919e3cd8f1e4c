//! Where a job's I/O runs, and its copy operations in flight.
//!
//! QEMU runs a block job's coroutines in the AioContext of the node it copies from, so a
//! job on a node that an IoThread serves does its I/O there and not beside the monitor.
//! Here a job's copying loop runs as a task on the node's [`Home`] ([`Home::drive`]): the
//! IoThread whose exports serve the node (or that it was moved to), and so do its copy
//! operations, through that thread's ring. The main loop starts the job, takes the verbs
//! (which reach the loop through the job's shared state and waker) and runs what changes
//! the graph before and after; a busy monitor does not hold the copy. A node moved to
//! another IoThread takes the loop along at its next step ([`Stay`]).
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

impl Home {
    /// Runs a job's loop, the future `make` builds, as a task on this thread (QEMU's job
    /// coroutine in its node's AioContext), and waits for what it returns: `lost` if the
    /// thread stops first. The result travels back through the waiting loop's queue,
    /// behind the events the loop posted there, so they go out before the job concludes.
    pub async fn drive<T, F, Fut>(&self, lost: T, make: F) -> T
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        let ops = InFlight::new();
        ops.start(self, 0, lost, move || async move {
            // Where jobs' loops ran, in the loop's statistics (`x-stats`).
            stord_aio::with_current_context(|l| l.counter("job.loops").add(1));
            make().await
        });
        match ops.next().await {
            Some(r) => r,
            None => unreachable!("a started operation gives a result or its lost one"),
        }
    }
}

/// Whether a job's node was moved to another IoThread since its loop started there: the
/// loop then stops starting copies, settles those in flight and hands back its place, to
/// go on where the node went.
pub struct Stay {
    node: std::sync::Arc<crate::block::BlockNode>,
    home: Option<String>,
}

impl Stay {
    pub fn new(node: &std::sync::Arc<crate::block::BlockNode>) -> Self {
        Stay {
            node: node.clone(),
            home: node.home(),
        }
    }

    pub fn moved(&self) -> bool {
        self.node.home() != self.home
    }
}

/// How a job's loop on its node's thread ended.
pub enum Step<T, S> {
    /// The loop's own end.
    Done(T),
    /// The node moved: the loop goes on from `S` on its new thread.
    Moved(S),
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

    #[derive(Default)]
    struct Seen(std::cell::RefCell<Vec<serde_json::Value>>);
    impl crate::events::EventSink for Seen {
        fn deliver(&self, e: &serde_json::Value) {
            self.0.borrow_mut().push(e["data"]["n"].clone());
        }
        fn listening(&self) -> bool {
            true
        }
        fn flushed(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_loop_driven_on_an_iothread_has_its_events_out_before_its_result_is_back() {
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let mut t = IoThread::spawn(AioContextOptions::default()).unwrap();
        let events = crate::events::Events::default();
        let seen = std::rc::Rc::new(Seen::default());
        let sink: std::rc::Rc<dyn crate::events::EventSink> = seen.clone();
        events.subscribe(std::rc::Rc::downgrade(&sink));
        let poster = events.poster().unwrap();
        let home = Home::IoThread(t.remote().clone());
        let main = std::thread::current().id();
        let seen2 = seen.clone();
        let (ran_on, seen_then) = ctx.block_on(async move {
            let ran_on = home
                .drive(main, move || async move {
                    for n in 0..200 {
                        poster
                            .emit_here_or_post("JOB_STATUS_CHANGE", serde_json::json!({ "n": n }));
                        if n % 50 == 0 {
                            stord_aio::yield_now().await;
                        }
                    }
                    std::thread::current().id()
                })
                .await;
            (ran_on, seen2.0.borrow().len())
        });
        assert_ne!(ran_on, main, "the loop ran on the IoThread");
        assert_eq!(
            seen_then, 200,
            "every event was out when the result came back"
        );
        let order: Vec<u64> = seen
            .0
            .borrow()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(order, (0..200).collect::<Vec<u64>>());
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
