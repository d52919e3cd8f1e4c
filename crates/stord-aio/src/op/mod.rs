//! Completion-based I/O operations on the current thread's context.
//!
//! Each function here builds an [`Op`], a future that, when first polled, queues one SQE
//! on the current thread's ring (submitted with the rest of the iteration's batch) and
//! completes with the CQE's result. On the epoll reactor the same operation runs
//! synchronously (file I/O) or when its fd becomes ready (sockets, poll-add).
//!
//! Buffers are moved into the operation and handed back with the result; see the crate
//! docs for why this makes use-after-free of an in-flight buffer impossible in safe code.

mod fs;
mod net;
mod poll;

pub use fs::{
    fallocate, fsync, read, read_iov, readv, write, write_flags, write_iov, writev, writev_flags,
    CURRENT_POSITION,
};
pub use net::{recv, send};
pub use poll::{poll_add, timeout, Timeout};

use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use io_uring::squeue;

use crate::context::{try_with_current, with_current};
use crate::reactor::Reactor;
use crate::slab::Key;
pub(crate) use desc::{Blocking, OpDesc};

/// Sealed: the trait is public (it bounds `Op`) but cannot be named or implemented outside.
mod desc {
    use super::*;

    /// What the epoll reactor does with an operation.
    pub enum Blocking {
        /// Done synchronously with this result (count or -errno).
        Done(i32),
        /// Would block: retry when `fd` has `events` (poll bits).
        WaitFor(RawFd, u32),
    }

    /// The description of one operation: its SQE, its synchronous form, and how to turn the
    /// result into the output (returning the owned buffers).
    pub trait OpDesc: 'static {
        type Output;
        /// The SQE. Pointers in it must refer to memory owned by `self`, stable under moves.
        fn entry(&mut self) -> squeue::Entry;
        /// The synchronous (epoll reactor) form.
        fn run_blocking(&mut self) -> Blocking;
        /// Builds the output from the result.
        fn finish(self, res: i32) -> Self::Output;
    }
}

enum State {
    Init,
    Uring(Key),
    Waiter(Key),
    Done,
}

/// An in-flight (or not yet started) operation. Not `Send`: it belongs to the thread
/// whose ring it is queued on.
#[must_use = "an operation does nothing until awaited"]
pub struct Op<D: OpDesc> {
    desc: Option<D>,
    state: State,
    storage: bool,
    sqe_flags: squeue::Flags,
    _not_send: PhantomData<Rc<()>>,
}

// Op never relies on being pinned: the memory the kernel uses is on the heap (IoBuf's
// contract), not inside the Op.
impl<D: OpDesc> Unpin for Op<D> {}

impl<D: OpDesc> Op<D> {
    pub(crate) fn new(desc: D) -> Self {
        Self {
            desc: Some(desc),
            state: State::Init,
            storage: false,
            sqe_flags: squeue::Flags::empty(),
            _not_send: PhantomData,
        }
    }

    /// Marks the operation as one that waits on storage (a disk, a file's blocks), not on
    /// a peer (a socket, a pipe, /dev/fuse, an eventfd). The loop learns how long to
    /// poll from each kind of wait apart: a device that sometimes takes longer than the
    /// polling window must not cut the window a client's quick turnaround needs.
    pub fn on_storage(self) -> Self {
        self.on_storage_if(true)
    }

    /// [`on_storage`](Self::on_storage) when `storage` is true (for code that serves both
    /// sides, such as a socket reader used by servers and by network block clients).
    pub fn on_storage_if(mut self, storage: bool) -> Self {
        self.storage = storage;
        self
    }

    /// When `punt` is true, hands the operation to the kernel's io-wq workers at once
    /// (IOSQE_ASYNC) instead of trying it inline first. For a file that cannot be tried
    /// without blocking (no FMODE_NOWAIT: tmpfs) that is where it goes anyway; marked so,
    /// it also lets io-wq start another worker when every worker is busy. Unmarked work
    /// waits for a busy worker unless that worker blocks, and tmpfs copies never block, so
    /// one worker would run every read and write of the ring one after another.
    pub fn in_worker_if(mut self, punt: bool) -> Self {
        if punt {
            self.sqe_flags |= squeue::Flags::ASYNC;
        }
        self
    }

    fn finish(&mut self, res: i32) -> D::Output {
        self.state = State::Done;
        self.desc
            .take()
            .expect("operation finished twice")
            .finish(res)
    }
}

impl<D: OpDesc> Future for Op<D> {
    type Output = D::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<D::Output> {
        let this = &mut *self;
        with_current(|ctx| loop {
            match this.state {
                State::Init => {
                    let desc = this.desc.as_mut().expect("polled after completion");
                    let mut reactor = ctx.reactor.borrow_mut();
                    match &mut *reactor {
                        Reactor::Uring(u) => {
                            this.state = State::Uring(
                                u.submit_op(desc.entry().flags(this.sqe_flags), this.storage),
                            );
                        }
                        Reactor::Epoll(ep) => match desc.run_blocking() {
                            Blocking::Done(res) => {
                                drop(reactor);
                                return Poll::Ready(this.finish(res));
                            }
                            Blocking::WaitFor(fd, events) => match ep.add_waiter(fd, events) {
                                Ok(k) => this.state = State::Waiter(k),
                                Err(e) => {
                                    drop(reactor);
                                    let errno = e.raw_os_error().unwrap_or(libc::EIO);
                                    return Poll::Ready(this.finish(-errno));
                                }
                            },
                        },
                    }
                }
                State::Uring(key) => {
                    let polled = match &mut *ctx.reactor.borrow_mut() {
                        Reactor::Uring(u) => u.poll_op(key, cx),
                        Reactor::Epoll(_) => unreachable!("io_uring op on an epoll context"),
                    };
                    return match polled {
                        Poll::Ready((res, _flags)) => Poll::Ready(this.finish(res)),
                        Poll::Pending => Poll::Pending,
                    };
                }
                State::Waiter(key) => {
                    let polled = match &mut *ctx.reactor.borrow_mut() {
                        Reactor::Epoll(ep) => ep.poll_waiter(key, cx),
                        Reactor::Uring(_) => unreachable!("epoll waiter on an io_uring context"),
                    };
                    match polled {
                        // Ready: retry the operation itself.
                        Poll::Ready(_) => this.state = State::Init,
                        Poll::Pending => return Poll::Pending,
                    }
                }
                State::Done => panic!("operation polled after completion"),
            }
        })
    }
}

impl<D: OpDesc> Drop for Op<D> {
    fn drop(&mut self) {
        match self.state {
            State::Uring(key) => {
                let mut desc = self.desc.take();
                let storage = self.storage;
                try_with_current(|ctx| {
                    if let Reactor::Uring(u) = &mut *ctx.reactor.borrow_mut() {
                        u.orphan_op(key, storage, Box::new(desc.take()));
                    }
                });
                if let Some(d) = desc {
                    // No context left to hand the buffers to: the kernel may still use
                    // them, so leak them rather than free them.
                    std::mem::forget(d);
                }
            }
            State::Waiter(key) => {
                try_with_current(|ctx| {
                    if let Reactor::Epoll(ep) = &mut *ctx.reactor.borrow_mut() {
                        ep.remove_waiter(key);
                    }
                });
            }
            State::Init | State::Done => {}
        }
    }
}

/// `res` (count or -errno) as an io::Result.
pub(crate) fn to_result(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}
