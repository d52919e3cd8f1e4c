//! `aio=threads`: a small pool of worker threads doing pread/pwrite.
//!
//! The request's buffer and a reference to the fd move into the job, so nothing the
//! worker touches can go away under it. The worker wakes the request's task with its
//! waker, which hands over to the owning loop through its Remote queue and notifies it:
//! the loop is woken at once, not at its next timer.

use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

use stord_aio::IoVecs;

use crate::block::IoVec;

/// Workers in the pool (QEMU's pool grows to 64; a few suffice for 2 cores).
const WORKERS: usize = 8;

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    queue: Mutex<VecDeque<Job>>,
    cond: Condvar,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            queue: Mutex::default(),
            cond: Condvar::new(),
        }));
        for i in 0..WORKERS {
            std::thread::Builder::new()
                .name(format!("stord-worker{i}"))
                .spawn(move || loop {
                    let job = {
                        let mut q = pool.queue.lock().unwrap_or_else(|e| e.into_inner());
                        loop {
                            if let Some(j) = q.pop_front() {
                                break j;
                            }
                            q = pool.cond.wait(q).unwrap_or_else(|e| e.into_inner());
                        }
                    };
                    job();
                })
                .expect("spawn worker thread");
        }
        pool
    })
}

struct Shared<T> {
    result: Option<T>,
    waker: Option<Waker>,
}

/// Runs `f` on a worker; completes with its result on the calling loop.
pub(super) struct PoolFuture<T> {
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

pub(super) fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> PoolFuture<T> {
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
    let p = pool();
    p.queue
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push_back(job);
    p.cond.notify_one();
    PoolFuture { shared }
}

/// One preadv or pwritev2 (with RWF_DSYNC for FUA) of what `iov` shows.
pub(super) async fn transfer(
    fd: Arc<OwnedFd>,
    write: bool,
    fua: bool,
    iov: IoVec,
    offset: u64,
) -> (i32, IoVec) {
    run(move || {
        let raw = fd.as_raw_fd();
        let res = if write {
            let flags = if fua { libc::RWF_DSYNC } else { 0 };
            // SAFETY: the iovecs name memory `iov` keeps valid; this closure owns `iov`.
            unsafe { stord_aio::sys::blocking::pwritev(raw, iov.iovecs(), offset, flags) }
        } else {
            // SAFETY: as above, and the memory is writable (IoVecsMut).
            unsafe { stord_aio::sys::blocking::preadv(raw, iov.iovecs(), offset, 0) }
        };
        (res, iov)
    })
    .await
}

/// fdatasync on a worker.
pub(super) async fn fsync(fd: Arc<OwnedFd>) -> i32 {
    run(move || stord_aio::sys::blocking::fsync(fd.as_raw_fd(), true)).await
}
