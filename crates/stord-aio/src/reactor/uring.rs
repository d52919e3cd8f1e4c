//! The io_uring reactor: one ring per context, only ever entered by its owning thread.
//!
//! Setup probes, in order, SINGLE_ISSUER|DEFER_TASKRUN|TASKRUN_FLAG,
//! SINGLE_ISSUER|COOP_TASKRUN|TASKRUN_FLAG, COOP_TASKRUN|TASKRUN_FLAG, COOP_TASKRUN, and no
//! flags, and reports what it got. With TASKRUN_FLAG the kernel raises IORING_SQ_TASKRUN
//! when completions wait as deferred task work, so [`UringReactor::peek`] sees them by
//! reading the CQ tail and the SQ flags: the ring is a poll handler with no syscall.
//!
//! Operations push SQEs as they are created; the loop submits them all with one
//! io_uring_enter at the end of the iteration ([`UringReactor::flush`] or the wait).

use std::any::Any;
use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::task::{Context, Poll, Waker};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::{Event, ReactorInfo, Reaped, TAG_FD, TAG_IGNORE, TAG_NOTIFIER, TAG_OP, TAG_OP_STORAGE};
use crate::slab::{Key, Slab};

const RING_ENTRIES: u32 = 256;
const CQ_ENTRIES: u32 = 4096;

enum OpSlot {
    /// In flight; the future's waker, once it has been polled.
    Waiting(Option<Waker>),
    /// Completed: (res, flags).
    Done(i32, u32),
    /// The future was dropped while in flight: we keep what the kernel may still touch
    /// until the completion arrives.
    Orphan(#[allow(dead_code)] Box<dyn Any>),
}

struct FdWatch {
    fd: RawFd,
    events: u32,
}

pub(crate) struct UringReactor {
    // Field order matters for drop: the status peeks into the ring's memory.
    cq_status: cqueue::CompletionStatus,
    ring: IoUring,
    flags: Vec<&'static str>,
    ext_arg: bool,
    notifier_fd: RawFd,
    ops: Slab<OpSlot>,
    fds: HashMap<Key, FdWatch>,
    /// Storage operations submitted whose completion has not been reaped.
    storage_owed: usize,
    /// io_uring_enter calls not yet counted in the context's statistics.
    enters: u64,
    /// Fallback wait timeout (no EXT_ARG): the kernel reads it when the SQE is submitted.
    timeout_ts: Box<types::Timespec>,
}

type FlagSet = &'static [&'static str];

/// The user-data tag of an operation submitted with `storage`.
fn op_tag(storage: bool) -> u8 {
    if storage {
        TAG_OP_STORAGE
    } else {
        TAG_OP
    }
}

fn build(flags: FlagSet) -> io::Result<IoUring> {
    let mut b = IoUring::builder();
    b.setup_cqsize(CQ_ENTRIES);
    for f in flags {
        match *f {
            "SINGLE_ISSUER" => b.setup_single_issuer(),
            "DEFER_TASKRUN" => b.setup_defer_taskrun(),
            "COOP_TASKRUN" => b.setup_coop_taskrun(),
            "TASKRUN_FLAG" => b.setup_taskrun_flag(),
            _ => unreachable!("unknown setup flag"),
        };
    }
    b.build(RING_ENTRIES)
}

impl UringReactor {
    pub(crate) fn new(notifier_fd: RawFd) -> io::Result<Self> {
        const CANDIDATES: [FlagSet; 5] = [
            &["SINGLE_ISSUER", "DEFER_TASKRUN", "TASKRUN_FLAG"],
            &["SINGLE_ISSUER", "COOP_TASKRUN", "TASKRUN_FLAG"],
            &["COOP_TASKRUN", "TASKRUN_FLAG"],
            &["COOP_TASKRUN"],
            &[],
        ];
        let mut last_err = None;
        for flags in CANDIDATES {
            match build(flags) {
                Ok(mut ring) => {
                    // SAFETY: the status is stored next to the ring and declared before it,
                    // so it is dropped first and never outlives the ring's mapping.
                    let cq_status = unsafe { ring.completion().status() };
                    let ext_arg = ring.params().is_feature_ext_arg();
                    let mut r = Self {
                        cq_status,
                        ring,
                        flags: flags.to_vec(),
                        ext_arg,
                        notifier_fd,
                        ops: Slab::default(),
                        fds: HashMap::new(),
                        storage_owed: 0,
                        enters: 0,
                        timeout_ts: Box::new(types::Timespec::new()),
                    };
                    r.arm_notifier();
                    return Ok(r);
                }
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("io_uring setup failed")))
    }

    pub(crate) fn info(&self) -> ReactorInfo {
        ReactorInfo {
            kind: "io_uring",
            flags: self.flags.clone(),
            fallback_reason: None,
        }
    }

    fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: every entry pushed here refers only to memory that outlives its
            // completion: operation buffers are owned by the op (and parked in an Orphan
            // slot if the future is dropped), and poll/timeout entries hold no pointers
            // except `timeout_ts`, which lives as long as the ring.
            let pushed = unsafe { self.ring.submission().push(entry) };
            if pushed.is_ok() {
                return;
            }
            // SQ full: submit what is there (we are the owning thread) and retry.
            self.enters += 1;
            let _ = self.ring.submit();
        }
    }

    fn arm_notifier(&mut self) {
        let e = opcode::PollAdd::new(types::Fd(self.notifier_fd), libc::POLLIN as u32)
            .build()
            .user_data((TAG_NOTIFIER as u64) << 56);
        self.push(&e);
    }

    fn taskrun(&self) -> bool {
        // SAFETY: no SubmissionQueue is alive outside `push`, which does not call us; this
        // only reads the shared SQ header.
        unsafe { self.ring.submission_shared().taskrun() }
    }

    fn sq_pending(&self) -> bool {
        // SAFETY: as in `taskrun`.
        !unsafe { self.ring.submission_shared() }.is_empty()
    }

    pub(crate) fn peek(&self) -> bool {
        !self.cq_status.is_empty() || self.taskrun()
    }

    pub(crate) fn need_wait(&self) -> bool {
        self.peek() || self.sq_pending()
    }

    /// io_uring_enter calls since the last time this was asked.
    pub(crate) fn take_enters(&mut self) -> u64 {
        std::mem::take(&mut self.enters)
    }

    /// Whether a storage operation's completion is still to come.
    pub(crate) fn storage_owed(&self) -> bool {
        self.storage_owed > 0
    }

    pub(crate) fn flush(&mut self) {
        if self.sq_pending() {
            self.enters += 1;
            let _ = self.ring.submit();
        }
    }

    pub(crate) fn wait(&mut self, timeout_ns: Option<u64>, out: &mut Vec<Event>) -> Reaped {
        if timeout_ns == Some(0) && !self.sq_pending() && !self.taskrun() {
            // Nothing to submit and no time to wait: the completion queue is in memory.
            return self.reap(out);
        }
        self.enters += 1;
        let res = match timeout_ns {
            Some(0) => self.ring.submit(),
            None => self.ring.submit_and_wait(1),
            Some(ns) => {
                let ts = types::Timespec::new()
                    .sec(ns / 1_000_000_000)
                    .nsec((ns % 1_000_000_000) as u32);
                if self.ext_arg {
                    let args = types::SubmitArgs::new().timespec(&ts);
                    self.ring.submitter().submit_with_args(1, &args)
                } else {
                    *self.timeout_ts = ts;
                    let e = opcode::Timeout::new(&*self.timeout_ts)
                        .count(1)
                        .build()
                        .user_data((TAG_IGNORE as u64) << 56);
                    self.push(&e);
                    self.ring.submit_and_wait(1)
                }
            }
        };
        if let Err(e) = res {
            match e.raw_os_error() {
                Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN) => {}
                _ => panic!("io_uring_enter failed: {e}"),
            }
        }
        self.reap(out)
    }

    fn reap(&mut self, out: &mut Vec<Event>) -> Reaped {
        let mut n = 0;
        let mut storage = 0;
        let mut peer = 0;
        let mut notified = false;
        let mut rearm = Vec::new();
        {
            let mut cq = self.ring.completion();
            cq.sync();
            for cqe in &mut cq {
                n += 1;
                let (tag, key) = Key::from_token(cqe.user_data());
                match tag {
                    TAG_OP | TAG_OP_STORAGE => {
                        if tag == TAG_OP_STORAGE {
                            storage += 1;
                            self.storage_owed = self.storage_owed.saturating_sub(1);
                        } else {
                            peer += 1;
                        }
                        if let Some(slot) = self.ops.get_mut(key) {
                            match std::mem::replace(slot, OpSlot::Done(cqe.result(), cqe.flags())) {
                                OpSlot::Waiting(Some(w)) => w.wake(),
                                OpSlot::Orphan(_) => {
                                    self.ops.remove(key);
                                }
                                _ => {}
                            }
                        }
                    }
                    TAG_FD if self.fds.contains_key(&key) => {
                        peer += 1;
                        let res = cqe.result();
                        let revents = if res < 0 {
                            libc::POLLERR as u32
                        } else {
                            res as u32
                        };
                        out.push(Event::Fd { key, revents });
                        rearm.push(key);
                    }
                    TAG_NOTIFIER => notified = true,
                    _ => {}
                }
            }
        }
        // POLL_ADD is one-shot: re-arm, which gives level-triggered behaviour. The SQEs go
        // out with the next flush, after the handlers have run.
        for key in rearm {
            self.arm_fd(key);
        }
        if notified {
            self.arm_notifier();
        }
        Reaped {
            completions: n,
            storage,
            peer,
            notified,
        }
    }

    fn arm_fd(&mut self, key: Key) {
        if let Some(w) = self.fds.get(&key) {
            let e = opcode::PollAdd::new(types::Fd(w.fd), w.events)
                .build()
                .user_data(key.to_token(TAG_FD));
            self.push(&e);
        }
    }

    pub(crate) fn add_fd(&mut self, fd: RawFd, events: u32, key: Key) {
        self.fds.insert(key, FdWatch { fd, events });
        self.arm_fd(key);
    }

    pub(crate) fn remove_fd(&mut self, key: Key) {
        if self.fds.remove(&key).is_some() {
            let e = opcode::PollRemove::new(key.to_token(TAG_FD))
                .build()
                .user_data((TAG_IGNORE as u64) << 56);
            self.push(&e);
        }
    }

    /// Queues an operation's SQE; the returned key polls its completion. A `storage`
    /// operation's completion is counted apart (see [`Reaped::storage`]).
    pub(crate) fn submit_op(&mut self, entry: squeue::Entry, storage: bool) -> Key {
        let key = self.ops.insert(OpSlot::Waiting(None));
        self.storage_owed += usize::from(storage);
        self.push(&entry.user_data(key.to_token(op_tag(storage))));
        key
    }

    /// Polls an operation: `Ready((res, flags))` once, then the slot is gone.
    pub(crate) fn poll_op(&mut self, key: Key, cx: &mut Context<'_>) -> Poll<(i32, u32)> {
        match self.ops.get_mut(key) {
            Some(OpSlot::Done(res, flags)) => {
                let r = (*res, *flags);
                self.ops.remove(key);
                Poll::Ready(r)
            }
            Some(OpSlot::Waiting(w)) => {
                match w {
                    Some(old) if old.will_wake(cx.waker()) => {}
                    _ => *w = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
            _ => panic!("polled an unknown io_uring operation"),
        }
    }

    /// The op's future is dropped: free at once if done, else park `resources` until the
    /// kernel has finished with them. `storage` is what it was submitted with.
    pub(crate) fn orphan_op(&mut self, key: Key, storage: bool, resources: Box<dyn Any>) {
        match self.ops.get_mut(key) {
            Some(OpSlot::Done(..)) => {
                self.ops.remove(key);
            }
            Some(slot) => {
                *slot = OpSlot::Orphan(resources);
                let e = opcode::AsyncCancel::new(key.to_token(op_tag(storage)))
                    .build()
                    .user_data((TAG_IGNORE as u64) << 56);
                self.push(&e);
            }
            None => {}
        }
    }

    /// Cancels everything and waits (bounded) for the kernel to let go of our buffers. If
    /// it does not within the bound, the parked buffers are leaked rather than freed.
    pub(crate) fn shutdown(&mut self) {
        let e = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data((TAG_IGNORE as u64) << 56);
        self.push(&e);
        let deadline = crate::sys::now_ns() + 2_000_000_000;
        let mut events = Vec::new();
        while self.in_flight_kernel() > 0 && crate::sys::now_ns() < deadline {
            self.wait(Some(10_000_000), &mut events);
            events.clear();
        }
        if self.in_flight_kernel() > 0 {
            for slot in self.ops.drain() {
                std::mem::forget(slot);
            }
        }
    }

    fn in_flight_kernel(&self) -> usize {
        self.ops
            .keys()
            .into_iter()
            .filter(|k| !matches!(self.ops.get(*k), Some(OpSlot::Done(..))))
            .count()
    }
}
