//! A small pool of worker threads per IoThread, for the blocking calls nothing else can
//! make without blocking the loop: the file driver's `aio=threads` reads and writes, its
//! lseek, fallocate and fdatasync, and the calls librbd only offers blocking.
//!
//! What a job needs (a buffer, a reference to the fd) moves into it, so nothing the worker
//! touches can go away under it. The worker wakes the caller's task with its waker, which
//! hands over to the owning loop through its Remote queue and notifies it: the loop is
//! woken at once, not at its next timer.

use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};

/// Most workers a pool starts (QEMU's pool grows to 64; a few suffice for 2 cores).
const WORKERS: usize = 8;

type Job = Box<dyn FnOnce() + Send>;

/// One IoThread's pool, its [`AioContext::local`] state: workers start when jobs wait and
/// none is idle, and are joined when the IoThread's context goes (no thread outlives it).
///
/// [`AioContext::local`]: stord_aio::AioContext::local
struct Pool {
    state: Arc<(Mutex<PoolState>, Condvar)>,
    workers: std::cell::RefCell<Vec<std::thread::JoinHandle<()>>>,
    name: String,
}

#[derive(Default)]
struct PoolState {
    queue: VecDeque<Job>,
    idle: usize,
    closed: bool,
}

impl Pool {
    fn new(name: String) -> Self {
        Pool {
            state: Arc::default(),
            workers: Default::default(),
            name,
        }
    }

    fn submit(&self, job: Job) {
        let (lock, cond) = &*self.state;
        let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
        st.queue.push_back(job);
        let spawn = st.idle == 0 && self.workers.borrow().len() < WORKERS;
        drop(st);
        cond.notify_one();
        if spawn {
            self.spawn_worker();
        }
    }

    fn spawn_worker(&self) {
        let state = self.state.clone();
        let n = self.workers.borrow().len();
        let w = std::thread::Builder::new()
            .name(format!("{}-worker{n}", self.name))
            .spawn(move || worker(&state));
        match w {
            Ok(w) => self.workers.borrow_mut().push(w),
            // The queued job waits for a worker that exists; with none, the next submit
            // tries again.
            Err(e) => tracing::error!("cannot start a pool worker: {e}"),
        }
    }
}

fn worker(state: &(Mutex<PoolState>, Condvar)) {
    let (lock, cond) = state;
    loop {
        let job = {
            let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = st.queue.pop_front() {
                    break j;
                }
                if st.closed {
                    return;
                }
                st.idle += 1;
                st = cond.wait(st).unwrap_or_else(|e| e.into_inner());
                st.idle -= 1;
            }
        };
        job();
    }
}

impl Drop for Pool {
    /// Jobs already queued still run (their requests' futures are gone; the results are
    /// dropped), then the workers exit and are joined.
    fn drop(&mut self) {
        let (lock, cond) = &*self.state;
        lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        cond.notify_all();
        for w in self.workers.take() {
            let _ = w.join();
        }
    }
}

struct Shared<T> {
    result: Option<T>,
    waker: Option<Waker>,
}

/// Runs `f` on a worker; completes with its result on the calling loop.
pub(crate) struct PoolFuture<T> {
    shared: Arc<Mutex<Shared<T>>>,
}

impl<T> Future for PoolFuture<T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut s = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        match s.result.take() {
            Some(v) => Poll::Ready(v),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

pub(crate) fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> PoolFuture<T> {
    let shared = Arc::new(Mutex::new(Shared {
        result: None,
        waker: None,
    }));
    let s2 = shared.clone();
    let job: Job = Box::new(move || {
        let v = f();
        let waker = {
            let mut s = s2.lock().unwrap_or_else(|e| e.into_inner());
            s.result = Some(v);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    });
    let pool = stord_aio::with_current_context(|c| {
        c.local(|c| Ok::<_, std::convert::Infallible>(Pool::new(c.name().to_string())))
    });
    match pool {
        Some(Ok(p)) => p.submit(job),
        // No loop to come back to: run it here (the future is then ready at once).
        _ => job(),
    }
    PoolFuture { shared }
}

/// fdatasync on a worker.
pub(crate) async fn fsync(fd: Arc<OwnedFd>) -> i32 {
    run(move || stord_aio::sys::blocking::fsync(fd.as_raw_fd(), true)).await
}
