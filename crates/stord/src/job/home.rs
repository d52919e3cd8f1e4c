//! The thread a job's loop and its copies run on.
//!
//! QEMU runs a block job's coroutines in the AioContext of the node it copies from, so a
//! job on a node that an IoThread serves does its I/O there and not beside the monitor.
//! Here a job's copying loop runs as a task on the node's [`Home`]: the IoThread whose
//! exports serve the node (or that it was moved to), and so do its copy operations,
//! through that thread's ring. The main loop starts the job, takes the verbs (which reach
//! the loop through the job's shared state and waker) and runs what changes the graph
//! before and after; a busy monitor does not hold the copy. How a loop is run there and
//! follows its node is [`super::job_loop`]; its copies in flight, [`super::in_flight`].

use std::future::Future;

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
    pub(super) fn spawn<F, Fut>(&self, make: F)
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
}
