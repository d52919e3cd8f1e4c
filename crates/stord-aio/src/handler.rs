//! Poll handlers and fd handlers: the two ways a source of events joins a context.

use std::rc::Rc;

/// A source the loop can busy-poll: a completion ring's tail, a virtqueue's avail index.
///
/// `poll` must only read memory: no syscalls, no locks that may block. The loop calls it
/// in a tight loop while its window lasts and once more after every wait. When it returns
/// true, `ready` is called to do the work; time spent in `ready` is not counted as polling.
pub trait PollHandler {
    /// A short name for statistics.
    fn name(&self) -> &str;
    /// Whether there is work. Memory peeks only.
    fn poll(&self) -> bool;
    /// Does the work `poll` saw.
    fn ready(&self);
    /// The loop starts busy-polling (e.g. suppress guest notifications).
    fn poll_begin(&self) {}
    /// The loop stops busy-polling and may block (e.g. re-enable notifications).
    fn poll_end(&self) {}
}

/// Identifies a registered poll handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollHandlerId(pub(crate) usize);

/// Identifies a registered fd handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdHandlerId(pub(crate) crate::slab::Key);

/// What an fd handler waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interest(pub(crate) u32);

impl Interest {
    /// Readable (POLLIN).
    pub const READABLE: Interest = Interest(libc::POLLIN as u32);
    /// Writable (POLLOUT).
    pub const WRITABLE: Interest = Interest(libc::POLLOUT as u32);
    /// Both.
    pub const BOTH: Interest = Interest((libc::POLLIN | libc::POLLOUT) as u32);
}

/// The readiness an fd handler is called with (poll(2) bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Readiness(pub u32);

impl Readiness {
    /// Readable, or the peer hung up (a read will not block).
    pub fn is_readable(self) -> bool {
        self.0 & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) as u32 != 0
    }
    /// Writable, or an error is pending.
    pub fn is_writable(self) -> bool {
        self.0 & (libc::POLLOUT | libc::POLLERR) as u32 != 0
    }
}

pub(crate) enum PollSource {
    /// The notifier's `notified` flag.
    Notifier,
    /// The reactor's completion queue.
    Reactor,
    /// The share of the reactor's completions that came from storage operations: a
    /// window of its own, peeked through the `Reactor` entry (never on its own).
    StorageCompletions,
    /// A user handler.
    User(Rc<dyn PollHandler>),
}

pub(crate) struct PollEntry {
    pub(crate) name: String,
    pub(crate) source: PollSource,
}
