//! # stord-aio: the adaptive-polling event loop
//!
//! One [`AioContext`] per thread, in the style of QEMU's AioContext: an io_uring reactor
//! (epoll as the fallback), fd handlers, bottom halves, nanosecond timers, a
//! single-threaded task executor and completion-based I/O operations. Before it blocks,
//! the loop busy-polls its *poll handlers* (cheap memory peeks: the ring's CQ tail, the
//! cross-thread notifier's flag, a virtqueue index) for a window chosen by a
//! [`PollPolicy`](poll::PollPolicy), because on fast devices waking from a sleep costs more
//! than the I/O. [`IoThread`] runs a context on a named thread; [`Remote`] hands work to it
//! from any other thread. This crate knows nothing about blocks or exports.
//!
//! ## Threads and rings
//! Only the thread that created a context ever enters its ring (the ring is created with
//! SINGLE_ISSUER and DEFER_TASKRUN where the kernel has them). Other threads push onto a
//! lock-free queue and *notify*: the eventfd is written only when the loop may be asleep
//! (the notify_me / notified handshake, see [`notify`](crate::notify) in the source), so a
//! busy or polling loop takes hand-overs with no syscall on either side, and an idle one is
//! woken at once, never left waiting for some timer.
//!
//! ## The buffer ownership rule
//! **An operation owns its buffers from the moment it is created until its completion has
//! been reaped.** [`op::read`] and friends take the buffer *by value* (any [`IoBuf`] /
//! [`IoBufMut`]: `Vec<u8>`, `Box<[u8]>`, [`AlignedBuf`]) and give it back with the result,
//! so safe code cannot touch, free or move the bytes while the kernel may use them. If the
//! operation's future is dropped before completion, its buffers are parked in the context
//! (and the request cancelled) until the CQE arrives; when a context is dropped it cancels
//! what is in flight and waits for the kernel, and leaks (never frees) anything the kernel
//! has not released. The traits are `unsafe` to implement because they promise the bytes
//! do not move when the owner does. Operations are `!Send`: they belong to the ring of the
//! thread that polls them first.

#![warn(missing_docs)]

mod bh;
mod buf;
mod context;
mod handler;
mod iothread;
mod iteration;
mod memory;
mod notify;
pub mod op;
pub mod poll;
pub mod pool;
mod reactor;
mod remote;
mod slab;
mod stats;
mod sync;
pub mod sys;
mod task;
mod timer;

pub use bh::{Bh, RemoteBh};
pub use buf::{AlignedBuf, IoBuf, IoBufMut, IoVecs, IoVecsMut, Slice};
pub use context::{with_current_context, AioContext, AioContextOptions, DEFAULT_SCHED_SLICE_NS};
pub use handler::{FdHandlerId, Interest, PollHandler, PollHandlerId, Readiness};
pub use iothread::IoThread;
pub use poll::{PolicyKind, PollParams};
pub use reactor::{default_reactor, set_default_reactor, ReactorInfo, ReactorKind};
pub use remote::Remote;
pub use stats::{Counter, HandlerWindow, Histogram, StatsSnapshot};
pub use sync::{AsyncMutex, AsyncMutexGuard};
pub use task::JoinHandle;
pub use timer::{Sleep, TimerId};

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// Spawns a task on the current thread's context.
///
/// # Panics
/// If the thread has no context.
pub fn spawn<F: Future + 'static>(future: F) -> JoinHandle<F::Output> {
    let (fut, handle) = task::with_join(future);
    context::with_current(|c| c.spawn_local(fut));
    handle
}

/// Spawns a task whose output nobody awaits (a request), without the join handle's
/// allocation.
///
/// # Panics
/// If the thread has no context.
pub fn spawn_detached<F: Future<Output = ()> + 'static>(future: F) {
    // Boxed before the closure takes it: a request's future is copied once, not twice.
    let future: task::LocalFuture = Box::pin(future);
    context::with_current(|c| c.spawn_local(future));
}

/// Runs a task at once, in the caller's turn, until it completes or must wait; only then
/// is it kept as a task of its own (woken like any other). A connection's reader starts
/// each request this way, as QEMU enters a request's coroutine. The future comes boxed (a
/// caller that picks among futures of several kinds boxes each where it is made, and the
/// task takes that allocation as it is).
///
/// # Panics
/// If the thread has no context.
pub fn spawn_now(future: Pin<Box<dyn Future<Output = ()>>>) {
    context::with_current(|c| c.spawn_local_now(future));
}

/// Completes after `d` (a loop timer on the current context).
pub fn sleep(d: Duration) -> Sleep {
    sleep_until(sys::now_ns() + d.as_nanos() as u64)
}

/// Completes when the monotonic clock reaches `deadline_ns`.
pub fn sleep_until(deadline_ns: u64) -> Sleep {
    Sleep::new(deadline_ns)
}

/// The current thread's context as a [`Remote`], if it has one.
pub fn current_remote() -> Option<Remote> {
    context::try_with_current(|c| Remote {
        shared: c.shared.clone(),
    })
}

/// Yields once to the loop, letting other tasks and I/O run.
pub async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}
