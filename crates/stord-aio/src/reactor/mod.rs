//! Reactors: where the loop blocks and where completions come from.
//!
//! [`uring`] is the primary reactor: one io_uring per context, created by the owning thread
//! with the best setup flags the kernel accepts. [`epoll`] is the fallback, selectable so
//! that every test runs on both; it performs the ring's operations synchronously (file I/O)
//! or on readiness (sockets, poll-add), so the same futures work on either.

pub(crate) mod epoll;
pub(crate) mod uring;

use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::slab::Key;

/// User-data tags: what a completion or event belongs to.
pub(crate) const TAG_OP: u8 = 1;
pub(crate) const TAG_FD: u8 = 2;
pub(crate) const TAG_NOTIFIER: u8 = 3;
pub(crate) const TAG_WAITER: u8 = 4;
pub(crate) const TAG_IGNORE: u8 = 5;
/// An operation that waits on storage (see [`crate::op::Op::on_storage`]).
pub(crate) const TAG_OP_STORAGE: u8 = 6;

/// Which reactor a context should use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReactorKind {
    /// The program's default ([`set_default_reactor`]) if it set one, else io_uring with
    /// epoll as the fallback when the kernel refuses io_uring.
    #[default]
    Auto,
    /// io_uring, or fail.
    IoUring,
    /// epoll.
    Epoll,
}

impl ReactorKind {
    /// The name used in options and reports.
    pub fn name(self) -> &'static str {
        match self {
            ReactorKind::Auto => "auto",
            ReactorKind::IoUring => "io_uring",
            ReactorKind::Epoll => "epoll",
        }
    }
}

/// What `Auto` stands for in this process (0: io_uring with the epoll fallback).
static DEFAULT_REACTOR: AtomicU8 = AtomicU8::new(0);

/// Sets what contexts created with [`ReactorKind::Auto`] use from now on: the program's
/// choice (stord takes it from its environment once, at start). The library itself reads
/// no configuration; an explicit `IoUring` or `Epoll` is never overridden.
pub fn set_default_reactor(kind: ReactorKind) {
    let v = match kind {
        ReactorKind::Auto => 0,
        ReactorKind::IoUring => 1,
        ReactorKind::Epoll => 2,
    };
    DEFAULT_REACTOR.store(v, Ordering::Relaxed);
}

/// What [`ReactorKind::Auto`] stands for now.
pub fn default_reactor() -> ReactorKind {
    match DEFAULT_REACTOR.load(Ordering::Relaxed) {
        1 => ReactorKind::IoUring,
        2 => ReactorKind::Epoll,
        _ => ReactorKind::Auto,
    }
}

impl fmt::Display for ReactorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReactorKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ReactorKind::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(ReactorKind::IoUring),
            "epoll" => Ok(ReactorKind::Epoll),
            _ => Err(format!(
                "unknown reactor '{s}' (expected auto, io_uring or epoll)"
            )),
        }
    }
}

/// What a context ended up with: the reactor and, for io_uring, the setup flags in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReactorInfo {
    /// "io_uring" or "epoll".
    pub kind: &'static str,
    /// io_uring setup flags in force (SINGLE_ISSUER, DEFER_TASKRUN, COOP_TASKRUN,
    /// TASKRUN_FLAG); empty for epoll.
    pub flags: Vec<&'static str>,
    /// Why the fallback was taken, if it was.
    pub fallback_reason: Option<String>,
}

/// What one wait reaped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Reaped {
    /// Completions (CQEs or ready events) of every kind.
    pub(crate) completions: usize,
    /// Of those, completions of operations that waited on storage.
    pub(crate) storage: usize,
    /// Of those, completions of other operations and fd readiness: the peers' side.
    /// (Cancellations, timeouts and the notifier count in neither.)
    pub(crate) peer: usize,
    /// Whether the notifier fired.
    pub(crate) notified: bool,
}

impl Reaped {
    /// Both waits of one iteration together.
    pub(crate) fn merge(self, other: Reaped) -> Reaped {
        Reaped {
            completions: self.completions + other.completions,
            storage: self.storage + other.storage,
            peer: self.peer + other.peer,
            notified: self.notified || other.notified,
        }
    }
}

/// Something that happened on an fd the context watches.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Event {
    /// An fd handler's fd is ready (`revents` as poll(2) bits).
    Fd { key: Key, revents: u32 },
}

/// The reactor of one context.
// One per context and never moved after creation: the size difference is irrelevant.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Reactor {
    Uring(uring::UringReactor),
    Epoll(epoll::EpollReactor),
}

impl Reactor {
    pub(crate) fn new(kind: ReactorKind, notifier_fd: RawFd) -> io::Result<Self> {
        let kind = match kind {
            ReactorKind::Auto => default_reactor(),
            k => k,
        };
        match kind {
            ReactorKind::Epoll => Ok(Reactor::Epoll(epoll::EpollReactor::new(notifier_fd, None)?)),
            ReactorKind::IoUring => Ok(Reactor::Uring(uring::UringReactor::new(notifier_fd)?)),
            ReactorKind::Auto => match uring::UringReactor::new(notifier_fd) {
                Ok(r) => Ok(Reactor::Uring(r)),
                Err(e) => Ok(Reactor::Epoll(epoll::EpollReactor::new(
                    notifier_fd,
                    Some(format!("io_uring unavailable: {e}")),
                )?)),
            },
        }
    }

    pub(crate) fn info(&self) -> ReactorInfo {
        match self {
            Reactor::Uring(r) => r.info(),
            Reactor::Epoll(r) => r.info(),
        }
    }

    /// Cheap memory peek: are completions waiting to be reaped? Never a syscall.
    pub(crate) fn peek(&self) -> bool {
        match self {
            Reactor::Uring(r) => r.peek(),
            Reactor::Epoll(_) => false,
        }
    }

    /// Whether a storage operation's completion is still to come (on epoll they complete
    /// as they are issued).
    pub(crate) fn storage_owed(&self) -> bool {
        match self {
            Reactor::Uring(r) => r.storage_owed(),
            Reactor::Epoll(_) => false,
        }
    }

    /// Whether the loop must make a syscall this iteration even if polling found work.
    pub(crate) fn need_wait(&self) -> bool {
        match self {
            Reactor::Uring(r) => r.need_wait(),
            Reactor::Epoll(r) => r.need_wait(),
        }
    }

    /// io_uring_enter calls since the last time this was asked (0 for epoll).
    pub(crate) fn take_enters(&mut self) -> u64 {
        match self {
            Reactor::Uring(r) => r.take_enters(),
            _ => 0,
        }
    }

    /// Submits queued work (the end-of-iteration batch).
    pub(crate) fn flush(&mut self) {
        if let Reactor::Uring(r) = self {
            r.flush();
        }
    }

    /// Waits up to `timeout_ns` (None: forever, Some(0): don't block), then reaps.
    pub(crate) fn wait(&mut self, timeout_ns: Option<u64>, out: &mut Vec<Event>) -> Reaped {
        match self {
            Reactor::Uring(r) => r.wait(timeout_ns, out),
            Reactor::Epoll(r) => r.wait(timeout_ns, out),
        }
    }

    pub(crate) fn add_fd(&mut self, fd: RawFd, events: u32, key: Key) -> io::Result<()> {
        match self {
            Reactor::Uring(r) => {
                r.add_fd(fd, events, key);
                Ok(())
            }
            Reactor::Epoll(r) => r.add_fd(fd, events, key),
        }
    }

    pub(crate) fn remove_fd(&mut self, key: Key) {
        match self {
            Reactor::Uring(r) => r.remove_fd(key),
            Reactor::Epoll(r) => r.remove_fd(key),
        }
    }

    /// Waits for in-flight operations before the context goes away (buffers they still
    /// use are then freed safely).
    pub(crate) fn shutdown(&mut self) {
        if let Reactor::Uring(r) = self {
            r.shutdown();
        }
    }
}
