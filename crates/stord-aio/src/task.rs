//! The single-threaded task executor: one task per request, polled on the owning thread.
//!
//! A task's waker is `Send`: woken on the owning thread it goes straight onto the local
//! run queue; woken from any other thread it travels through the context's remote queue
//! and notifies the loop (never a silent wake that waits for a timer).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use crate::context::{try_with_current, Shared};
use crate::remote::RemoteMsg;
use crate::slab::{Key, Slab};

/// Task polls per loop iteration, at least (more if more were runnable at its start).
const RUN_BUDGET: usize = 256;

pub(crate) type LocalFuture = Pin<Box<dyn Future<Output = ()>>>;

pub(crate) struct TaskWaker {
    /// The task's slab key (`Key::to_token`), reset when the waker is recycled.
    key: AtomicU64,
    queued: AtomicBool,
    shared: Arc<Shared>,
}

impl TaskWaker {
    fn key(&self) -> Key {
        Key::from_token(self.key.load(Ordering::Relaxed)).1
    }
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let local = try_with_current(|c| {
            if Arc::ptr_eq(&c.shared, &self.shared) {
                c.exec.run_queue.borrow_mut().push_back(self.clone());
                true
            } else {
                false
            }
        })
        .unwrap_or(false);
        if !local {
            self.shared.send(RemoteMsg::Wake(self.clone()));
        }
    }
}

struct TaskSlot {
    future: Option<LocalFuture>,
    handle: Arc<TaskWaker>,
    waker: Waker,
}

/// Finished tasks' wakers kept for reuse (one allocation less per task).
const SPARE_WAKERS: usize = 1024;

#[derive(Default)]
pub(crate) struct Executor {
    tasks: RefCell<Slab<TaskSlot>>,
    pub(crate) run_queue: RefCell<VecDeque<Arc<TaskWaker>>>,
    /// Wakers of finished tasks that nobody else holds.
    spare: RefCell<Vec<Arc<TaskWaker>>>,
}

impl Executor {
    /// A slot for a new task holding `future` (None while it is being polled), and its
    /// waker's handle, `queued` as given.
    fn insert(
        &self,
        shared: &Arc<Shared>,
        future: Option<LocalFuture>,
        queued: bool,
    ) -> (Key, Arc<TaskWaker>, Waker) {
        let mut tasks = self.tasks.borrow_mut();
        let key = tasks.next_key().to_token(0);
        let handle = match self.spare.borrow_mut().pop() {
            Some(h) => {
                // Nobody else holds it (checked when it was put aside).
                h.key.store(key, Ordering::Relaxed);
                h.queued.store(queued, Ordering::Relaxed);
                h
            }
            None => Arc::new(TaskWaker {
                key: AtomicU64::new(key),
                queued: AtomicBool::new(queued),
                shared: shared.clone(),
            }),
        };
        let waker = Waker::from(handle.clone());
        let inserted = tasks.insert(TaskSlot {
            future,
            handle: handle.clone(),
            waker: waker.clone(),
        });
        debug_assert_eq!(inserted, handle.key());
        (inserted, handle, waker)
    }

    pub(crate) fn spawn(&self, shared: &Arc<Shared>, future: LocalFuture) {
        let (_, handle, _) = self.insert(shared, Some(future), true);
        self.run_queue.borrow_mut().push_back(handle);
    }

    /// Polls a new task at once, in the caller's turn (inside another task's poll, say),
    /// and keeps it only if it must wait. QEMU enters a request's coroutine the same way:
    /// a request that needs no I/O (or gets its I/O under way) is done or parked without
    /// a trip through the run queue.
    pub(crate) fn spawn_now(&self, shared: &Arc<Shared>, mut future: LocalFuture) {
        // The slot is taken first: the task's waker names it, and whatever the poll
        // spawns must not take its key.
        let (key, handle, waker) = self.insert(shared, None, false);
        let done = future
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_ready();
        let mut tasks = self.tasks.borrow_mut();
        if done {
            let slot = tasks.remove(key);
            drop(tasks);
            drop((future, slot, waker));
            self.recycle(handle);
        } else if let Some(slot) = tasks.get_mut(key) {
            slot.future = Some(future);
        }
    }

    /// Keeps a finished task's waker for the next task, if nobody else holds it.
    fn recycle(&self, w: Arc<TaskWaker>) {
        let mut spare = self.spare.borrow_mut();
        if Arc::strong_count(&w) == 1 && spare.len() < SPARE_WAKERS {
            spare.push(w);
        }
    }

    /// A wake that arrived through the remote queue.
    pub(crate) fn wake_remote(&self, w: Arc<TaskWaker>) {
        self.run_queue.borrow_mut().push_back(w);
    }

    pub(crate) fn has_runnable(&self) -> bool {
        !self.run_queue.borrow().is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.tasks.borrow().len()
    }

    /// Polls runnable tasks, including those woken while doing so (a request task spawned
    /// by a reader runs in the same pass), up to a budget so that a task that keeps waking
    /// itself cannot starve I/O. Returns how many polls ran.
    pub(crate) fn run(&self) -> usize {
        let budget = self.run_queue.borrow().len().max(RUN_BUDGET);
        let mut ran = 0;
        for _ in 0..budget {
            let Some(w) = self.run_queue.borrow_mut().pop_front() else {
                break;
            };
            w.queued.store(false, Ordering::Release);
            let (mut fut, waker) = {
                let mut tasks = self.tasks.borrow_mut();
                match tasks.get_mut(w.key()) {
                    Some(slot) if Arc::ptr_eq(&slot.handle, &w) => match slot.future.take() {
                        Some(f) => (f, slot.waker.clone()),
                        None => continue,
                    },
                    _ => continue,
                }
            };
            ran += 1;
            let done = fut
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_ready();
            let mut tasks = self.tasks.borrow_mut();
            if done {
                drop(waker);
                let slot = tasks.remove(w.key());
                drop(tasks);
                // Drop the finished future and the slot's waker before checking who else
                // still holds this waker.
                drop(fut);
                drop(slot);
                self.recycle(w);
            } else if let Some(slot) = tasks.get_mut(w.key()) {
                slot.future = Some(fut);
            }
        }
        ran
    }

    /// Drops every task (their futures run their destructors on this thread).
    pub(crate) fn clear(&self) {
        loop {
            let drained = self.tasks.borrow_mut().drain();
            if drained.is_empty() {
                break;
            }
            drop(drained);
        }
        self.run_queue.borrow_mut().clear();
    }
}

struct JoinState<T> {
    result: Option<T>,
    waker: Option<Waker>,
}

/// Awaits a spawned task's output.
pub struct JoinHandle<T> {
    state: Rc<RefCell<JoinState<T>>>,
}

impl<T> JoinHandle<T> {
    /// The output, if the task has finished.
    pub fn try_take(&self) -> Option<T> {
        self.state.borrow_mut().result.take()
    }

    /// Whether the task has finished.
    pub fn is_finished(&self) -> bool {
        self.state.borrow().result.is_some()
    }
}

impl<T> Future for JoinHandle<T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut s = self.state.borrow_mut();
        match s.result.take() {
            Some(v) => Poll::Ready(v),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Wraps `future` so that its output lands in the returned handle.
pub(crate) fn with_join<F>(future: F) -> (LocalFuture, JoinHandle<F::Output>)
where
    F: Future + 'static,
{
    let state = Rc::new(RefCell::new(JoinState {
        result: None,
        waker: None,
    }));
    let s2 = state.clone();
    let fut = Box::pin(async move {
        let v = future.await;
        let mut s = s2.borrow_mut();
        s.result = Some(v);
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    });
    (fut, JoinHandle { state })
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use crate::context::with_current;
    use crate::{AioContext, AioContextOptions};

    fn live_tasks() -> usize {
        with_current(|c| c.exec.len())
    }

    /// A task started now that needs nothing runs to its end in the caller's turn and
    /// leaves no task behind; one that must wait is kept, with its own waker, and ends
    /// after the caller went on; what it spawns while first polled takes a slot of its
    /// own.
    #[test]
    fn a_task_started_now_runs_in_the_callers_turn_and_is_kept_only_while_it_waits() {
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let log = Rc::new(RefCell::new(Vec::new()));
        let l = log.clone();
        let done = ctx.block_on(async move {
            let before = live_tasks();
            let l2 = l.clone();
            crate::spawn_now(Box::pin(async move { l2.borrow_mut().push("ready") }));
            l.borrow_mut().push("caller");
            assert_eq!(live_tasks(), before, "a finished task is not kept");

            let l3 = l.clone();
            crate::spawn_now(Box::pin(async move {
                l3.borrow_mut().push("waits");
                let l4 = l3.clone();
                crate::spawn_detached(async move { l4.borrow_mut().push("spawned") });
                crate::yield_now().await;
                l3.borrow_mut().push("woken");
            }));
            l.borrow_mut().push("caller again");
            assert_eq!(
                live_tasks(),
                before + 2,
                "the waiting task and the one it spawned"
            );
            while live_tasks() > before {
                crate::yield_now().await;
            }
            l.borrow().clone()
        });
        assert_eq!(
            done,
            [
                "ready",
                "caller",
                "waits",
                "caller again",
                "spawned",
                "woken"
            ]
        );
        assert_eq!(log.borrow().len(), 6);
    }
}
