//! Cross-thread wakeups: the notify_me / notified handshake over an eventfd.
//!
//! A producer on any thread publishes work, sets `notified`, and writes the eventfd only if
//! the loop announced (with `notify_me`) that it may block. The loop sets `notify_me`
//! before it checks `notified` and blocks. With SeqCst on both sides (a Dekker handshake)
//! either the loop sees `notified` and does not block, or the producer sees `notify_me`
//! and writes the eventfd: a wakeup is never lost, and while the loop is awake or polling
//! (it reads `notified` from memory as a poll handler) no eventfd write happens at all.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, Ordering::*};

use crate::stats::AioStats;
use crate::sys;

/// The eventfd plus the two handshake flags.
#[derive(Debug)]
pub(crate) struct Notifier {
    eventfd: OwnedFd,
    notify_me: AtomicBool,
    notified: AtomicBool,
}

impl Notifier {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self {
            eventfd: sys::eventfd()?,
            notify_me: AtomicBool::new(false),
            notified: AtomicBool::new(false),
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.eventfd.as_raw_fd()
    }

    /// Producer side, any thread, after the work is published.
    pub(crate) fn notify(&self, stats: &AioStats) {
        self.notified.store(true, SeqCst);
        fence(SeqCst);
        if self.notify_me.load(SeqCst) {
            AioStats::add(&stats.eventfd_writes, 1);
            // An eventfd write can only fail on counter overflow, which means the loop has
            // a wakeup pending anyway.
            let _ = sys::eventfd_write(self.fd());
        } else {
            AioStats::add(&stats.eventfd_writes_avoided, 1);
        }
    }

    /// Loop side: announce a possible block. Returns false if work is already pending,
    /// in which case the loop must not block.
    pub(crate) fn prepare_block(&self) -> bool {
        self.notify_me.store(true, SeqCst);
        fence(SeqCst);
        !self.notified.load(SeqCst)
    }

    /// Loop side: the blocking wait is over.
    pub(crate) fn finish_block(&self) {
        self.notify_me.store(false, Release);
    }

    /// Loop side: a cheap memory peek, used as the notifier's poll handler.
    pub(crate) fn peek(&self) -> bool {
        self.notified.load(Relaxed)
    }

    /// Loop side: consume the notification before looking at the queued work, so that
    /// work published after this point sets `notified` again.
    pub(crate) fn accept(&self) {
        if self.notified.load(Relaxed) {
            self.notified.store(false, SeqCst);
            fence(SeqCst);
        }
    }

    /// Drains the eventfd counter; the number of writes folded into it.
    pub(crate) fn drain(&self) -> u64 {
        sys::eventfd_read(self.fd()).unwrap_or(0)
    }
}
