//! FUSE over io_uring (kernel 6.14+, `/sys/module/fuse/parameters/enable_uring`).
//!
//! After INIT grants it, every CPU's kernel queue (qid) gets entries registered with
//! IORING_OP_URING_CMD on an SQE128 ring: a 288-byte header buffer and a payload buffer per
//! entry. A request arrives as a CQE (the headers and payload already copied in); we answer
//! by writing the reply into the same buffers and submitting COMMIT_AND_FETCH, which also
//! re-arms the entry for the next request. No read(2)/write(2) on /dev/fuse per request.
//!
//! Each IoThread serving qids owns one such ring (created on that thread). Its completions
//! are a poll handler (peek at the CQ) and, for when the loop sleeps, an eventfd the kernel
//! signals on each CQE, suppressed while the loop busy-polls.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use stord_aio::{FdHandlerId, Interest, PollHandler, PollHandlerId, Remote};

use super::handler::{write_out, Processed};
use super::proto::*;
use super::shared::{FuseShared, UringPlan};
use crate::buf::Buf;

/// Entries registered per kernel queue.
const DEPTH: usize = 16;

struct Entry {
    qid: u16,
    header: Box<[u8]>,
    /// The payload buffer; lent to a READ or WRITE while it runs (the kernel does not
    /// touch it until we commit, and only the task holding it commits).
    payload: Option<Buf>,
    iov: Box<[libc::iovec; 2]>,
    /// Registered with the kernel (a CQE will come back for it).
    armed: bool,
}

/// One IoThread's FUSE ring for one export.
pub struct FuseRing {
    // Declared first so it is dropped before the ring whose memory it peeks at.
    cq_status: cqueue::CompletionStatus,
    ring: RefCell<IoUring<squeue::Entry128, cqueue::Entry>>,
    dev: Arc<File>,
    eventfd: OwnedFd,
    entries: RefCell<Vec<Entry>>,
    shared: Arc<FuseShared>,
    handlers: RefCell<Option<(FdHandlerId, PollHandlerId)>>,
    /// Submits the commits queued during a loop iteration with one io_uring_enter.
    flush_bh: RefCell<Option<stord_aio::Bh>>,
    /// The teardown task, waiting for the kernel to hand the entries back.
    closing: RefCell<Option<std::task::Waker>>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static RINGS: RefCell<HashMap<u64, Rc<FuseRing>>> = RefCell::new(HashMap::new());
}

fn uring_cmd(
    fd: i32,
    cmd_op: u32,
    iov: *const libc::iovec,
    commit_id: u64,
    qid: u16,
    user_data: u64,
) -> squeue::Entry128 {
    let mut cmd = [0u8; 80];
    // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 padding[6]; }
    cmd[8..16].copy_from_slice(&commit_id.to_le_bytes());
    cmd[16..18].copy_from_slice(&qid.to_le_bytes());
    let e = opcode::UringCmd80::new(types::Fd(fd), cmd_op)
        .cmd(cmd)
        .addr(Some(iov as u64))
        .build()
        .user_data(user_data);
    // The kernel wants sqe->len = 2 (two iovecs), which the builder cannot set.
    // SAFETY: Entry128 is #[repr(C)] over the kernel's 128-byte SQE (a 64-byte io_uring_sqe
    // plus 64 command bytes), so it has the layout of [u8; 128]; `len` is the u32 at byte 24.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
    raw[24..28].copy_from_slice(&2u32.to_le_bytes());
    // SAFETY: as above, in the other direction; every byte pattern is a valid SQE value.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

impl FuseRing {
    /// Queues an SQE; it goes out with the iteration's batch (the flush bottom half).
    fn push(&self, e: &squeue::Entry128) {
        self.push_now(e, false);
        match self.flush_bh.borrow().as_ref() {
            Some(bh) => bh.schedule(),
            None => {
                let _ = self.ring.borrow().submit();
            }
        }
    }

    fn push_now(&self, e: &squeue::Entry128, submit: bool) {
        let mut ring = self.ring.borrow_mut();
        loop {
            // SAFETY: every SQE pushed here names an entry's iovec array and buffers, which
            // live in `self.entries` (boxed, never moved) until the entry's completion has
            // been reaped or the ring is torn down (see `teardown`, which leaks them if the
            // kernel has not given them back).
            if unsafe { ring.submission().push(e) }.is_ok() {
                break;
            }
            let _ = ring.submit();
        }
        if submit {
            let _ = ring.submit();
        }
    }

    /// Completions waiting (CQ) or deferred task work that will produce them.
    fn has_work(&self) -> bool {
        if !self.cq_status.is_empty() {
            return true;
        }
        match self.ring.try_borrow() {
            // SAFETY: no SubmissionQueue of this ring is alive outside `push_now`, which
            // never runs while this borrow is held; this only reads the SQ header flags.
            Ok(r) => unsafe { r.submission_shared() }.taskrun(),
            Err(_) => false,
        }
    }

    /// Reaps the CQ: each completed entry holds a request; handle it in a task.
    fn reap(self: &Rc<Self>) {
        // Run deferred task work (it posts the CQEs) if the kernel says there is some.
        if self.has_work() && self.cq_status.is_empty() {
            let _ = self.ring.borrow().submit();
        }
        let cqes: Vec<(u64, i32)> = {
            let mut ring = self.ring.borrow_mut();
            let mut cq = ring.completion();
            cq.sync();
            cq.map(|c| (c.user_data(), c.result())).collect()
        };
        for (idx, res) in cqes {
            let idx = idx as usize;
            if res != 0 {
                // -ENOTCONN/-ECONNABORTED at teardown; anything else ends this entry too.
                if let Some(e) = self.entries.borrow_mut().get_mut(idx) {
                    e.armed = false;
                }
                if res != -libc::ENOTCONN && res != -libc::ECONNABORTED && res != -libc::ECANCELED {
                    tracing::warn!(
                        "fuse io_uring entry {idx} failed: {}",
                        std::io::Error::from_raw_os_error(-res)
                    );
                }
                continue;
            }
            if self.try_zero_copy(idx) {
                continue;
            }
            let Some(msg) = self.request_bytes(idx) else {
                continue;
            };
            self.shared.uring_requests.fetch_add(1, Ordering::Relaxed);
            let me = self.clone();
            self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
            stord_aio::spawn_detached(async move {
                let processed = me.shared.process(&msg).await;
                me.commit(idx, processed);
                me.shared.request_done();
            });
        }
        if let Some(w) = self.closing.borrow_mut().take() {
            w.wake();
        }
    }

    /// Whether the kernel may still own an entry (its buffers must stay).
    fn any_armed(&self) -> bool {
        self.entries.borrow().iter().any(|e| e.armed)
    }

    /// READ and WRITE run on the entry's own payload buffer: the data goes from the node
    /// into it (or from it to the node) with no copy. True if the request was taken.
    fn try_zero_copy(self: &Rc<Self>, idx: usize) -> bool {
        let (opcode, op, payload, payload_sz) = {
            let mut entries = self.entries.borrow_mut();
            let Some(e) = entries.get_mut(idx) else {
                return false;
            };
            let f = Fields(&e.header);
            let opcode = f.u32(URING_HDR_IN_OUT + 4).unwrap_or(0);
            if opcode != READ && opcode != WRITE {
                return false;
            }
            let payload_sz = f.u32(URING_HDR_ENT + 16).unwrap_or(0) as usize;
            let mut op = [0u8; 40];
            op.copy_from_slice(&e.header[URING_HDR_OP_IN..URING_HDR_OP_IN + 40]);
            let Some(payload) = e.payload.take() else {
                return false;
            };
            (opcode, op, payload, payload_sz)
        };
        self.shared.uring_requests.fetch_add(1, Ordering::Relaxed);
        self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
        let me = self.clone();
        stord_aio::spawn_detached(async move {
            let f = Fields(&op);
            let (result, mut buf) = if opcode == READ {
                me.shared.read_into(&f, payload).await
            } else {
                let mut payload = payload;
                let cap = payload.capacity();
                payload.set_len(payload_sz.min(cap));
                let (r, mut buf) = me.shared.write_from(&f, payload).await;
                let cap = buf.capacity();
                buf.set_len(cap);
                let r = r.map(|n| {
                    buf[..8].copy_from_slice(&write_out(n));
                    8
                });
                (r, buf)
            };
            let cap = buf.capacity();
            buf.set_len(cap);
            me.finish(idx, Some(buf), result);
            me.shared.request_done();
        });
        true
    }

    /// Puts the payload back (if it was lent), writes the out header and commits.
    fn finish(&self, idx: usize, payload: Option<Buf>, result: Result<usize, i32>) {
        let mut entries = self.entries.borrow_mut();
        let Some(e) = entries.get_mut(idx) else {
            return;
        };
        if payload.is_some() {
            e.payload = payload;
        }
        let f = Fields(&e.header);
        let commit_id = f.u64(URING_HDR_ENT + 8).unwrap_or(0);
        let unique = f.u64(URING_HDR_IN_OUT + 8).unwrap_or(0);
        let (error, body_len) = match result {
            Ok(n) => (0, n),
            Err(errno) => (-errno, 0),
        };
        let out = reply(unique, error, body_len);
        e.header[URING_HDR_IN_OUT..URING_HDR_IN_OUT + OUT_HEADER].copy_from_slice(&out);
        e.header[URING_HDR_ENT + 16..URING_HDR_ENT + 20]
            .copy_from_slice(&(body_len as u32).to_le_bytes());
        let sqe = uring_cmd(
            self.dev.as_raw_fd(),
            URING_CMD_COMMIT_AND_FETCH,
            e.iov.as_ptr(),
            commit_id,
            e.qid,
            idx as u64,
        );
        drop(entries);
        self.push(&sqe);
    }

    /// The request of entry `idx` as /dev/fuse would deliver it: in header, op struct,
    /// payload (with the header's length made to match).
    fn request_bytes(&self, idx: usize) -> Option<Vec<u8>> {
        let entries = self.entries.borrow();
        let e = entries.get(idx)?;
        let payload = e.payload.as_ref()?;
        let h = &e.header;
        let f = Fields(h);
        let total = f.u32(URING_HDR_IN_OUT)? as usize;
        let payload_sz = (f.u32(URING_HDR_ENT + 16)? as usize).min(payload.len());
        let op_len = total.saturating_sub(IN_HEADER + payload_sz).min(128);
        let mut msg = Vec::with_capacity(IN_HEADER + op_len + payload_sz);
        msg.extend_from_slice(&h[URING_HDR_IN_OUT..URING_HDR_IN_OUT + IN_HEADER]);
        msg.extend_from_slice(&h[URING_HDR_OP_IN..URING_HDR_OP_IN + op_len]);
        msg.extend_from_slice(&payload[..payload_sz]);
        let len = msg.len() as u32;
        msg[0..4].copy_from_slice(&len.to_le_bytes());
        Some(msg)
    }

    /// Copies a generic reply into entry `idx`'s payload and commits it.
    fn commit(&self, idx: usize, processed: Option<Processed>) {
        let result = match processed {
            Some(Processed {
                result: Ok(body), ..
            }) => {
                let b = body.as_slice();
                let mut entries = self.entries.borrow_mut();
                let Some(payload) = entries.get_mut(idx).and_then(|e| e.payload.as_mut()) else {
                    return;
                };
                let n = b.len().min(payload.len());
                payload[..n].copy_from_slice(&b[..n]);
                Ok(n)
            }
            Some(Processed {
                result: Err(errno), ..
            }) => Err(errno),
            // Requests without a reply never come over the ring; answer ENOSYS to be safe.
            None => Err(libc::ENOSYS),
        };
        self.finish(idx, None, result);
    }
}

struct RingPoller(Rc<FuseRing>);

impl PollHandler for RingPoller {
    fn name(&self) -> &str {
        "fuse-uring"
    }
    fn poll(&self) -> bool {
        self.0.has_work()
    }
    fn ready(&self) {
        self.0.reap();
    }
    fn poll_begin(&self) {
        // While we spin on the CQ, the kernel need not signal the eventfd.
        if let Ok(mut r) = self.0.ring.try_borrow_mut() {
            r.completion().disable_eventfd();
        }
    }
    fn poll_end(&self) {
        if let Ok(mut r) = self.0.ring.try_borrow_mut() {
            r.completion().enable_eventfd();
        }
    }
}

impl FuseShared {
    /// Called by the queue that answered INIT: if io_uring was granted, start a ring on
    /// every IoThread of the plan (registration must follow the INIT reply).
    pub(super) fn after_init(self: &Arc<Self>, dev: &Arc<File>) {
        if !self.uring_granted.load(Ordering::SeqCst) {
            return;
        }
        let Some(plan) = self
            .uring_plan
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        for (remote, qids) in plan {
            let (s, d, r2) = (self.clone(), dev.clone(), remote.clone());
            let start = move || match start(s.clone(), d, &qids) {
                Ok(id) => {
                    tracing::info!("fuse: serving queues {qids:?} over io_uring");
                    s.rings
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((r2, id));
                }
                Err(e) => tracing::warn!(
                    "fuse: io_uring queues {qids:?} failed, staying on /dev/fuse: {e}"
                ),
            };
            match remote {
                Some(r) if !r.is_current() => r.call(start),
                _ => start(),
            }
        }
    }
}

/// Which kernel queues each of `places` serves: the kernel has one queue per possible CPU;
/// they are spread over our IoThreads.
pub(super) fn plan(places: &[Option<Remote>]) -> UringPlan {
    let mut plan: UringPlan = places.iter().map(|p| (p.clone(), Vec::new())).collect();
    for qid in 0..possible_cpus() {
        let n = plan.len();
        plan[qid as usize % n].1.push(qid);
    }
    plan
}

/// Number of possible CPUs (the kernel makes one FUSE io_uring queue per possible CPU).
fn possible_cpus() -> u16 {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            s.trim()
                .rsplit(['-', ','])
                .next()
                .and_then(|n| n.parse::<u16>().ok())
        })
        .map(|max| max + 1)
        .unwrap_or(1)
}

/// Creates this thread's ring for `qids`, registers their entries and hooks the ring into
/// the current loop. Returns an id for [`teardown`].
pub fn start(shared: Arc<FuseShared>, dev: Arc<File>, qids: &[u16]) -> Result<u64, String> {
    let mut ring = new_ring(qids.len())?;
    let eventfd = stord_aio::sys::eventfd().map_err(|e| e.to_string())?;
    ring.submitter()
        .register_eventfd(eventfd.as_raw_fd())
        .map_err(|e| format!("cannot register the FUSE ring's eventfd: {e}"))?;
    // SAFETY: stored in the FuseRing next to the ring and declared before it, so it is
    // dropped first and never outlives the ring's memory.
    let cq_status = unsafe { ring.completion().status() };
    let entries = new_entries(qids, shared.max_write as usize + 4096);
    let r = Rc::new(FuseRing {
        cq_status,
        ring: RefCell::new(ring),
        dev,
        eventfd,
        entries: RefCell::new(entries),
        shared,
        handlers: RefCell::new(None),
        closing: RefCell::new(None),
        flush_bh: RefCell::new(None),
    });
    r.register_entries();
    let hooked = r.hook()?;
    *r.handlers.borrow_mut() = Some(hooked);
    // Registration errors (e.g. the kernel refusing) show up as CQEs right away.
    r.reap();
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    RINGS.with(|m| m.borrow_mut().insert(id, r));
    Ok(id)
}

/// A ring for `queues` kernel queues of [`DEPTH`] entries each.
fn new_ring(queues: usize) -> Result<IoUring<squeue::Entry128, cqueue::Entry>, String> {
    // Owned by this thread only: SINGLE_ISSUER + DEFER_TASKRUN keep request arrivals from
    // interrupting the thread (no IPI); TASKRUN_FLAG lets the poll handler see them, and the
    // registered eventfd wakes the loop when it sleeps.
    let entries = (queues * DEPTH).next_power_of_two() as u32;
    let cq = (queues * DEPTH * 2).next_power_of_two() as u32;
    IoUring::builder()
        .setup_cqsize(cq)
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(entries)
        .or_else(|_| IoUring::builder().setup_cqsize(cq).build(entries))
        .map_err(|e| format!("cannot create the FUSE io_uring: {e}"))
}

/// [`DEPTH`] entries per kernel queue of `qids`, each with its header and payload buffers
/// and the iovecs that name them to the kernel.
fn new_entries(qids: &[u16], payload_len: usize) -> Vec<Entry> {
    let mut entries = Vec::with_capacity(qids.len() * DEPTH);
    for &qid in qids {
        for _ in 0..DEPTH {
            let mut header = vec![0u8; URING_HDR_LEN].into_boxed_slice();
            let mut payload = crate::buf::new_buf(payload_len);
            let iov = Box::new([
                libc::iovec {
                    iov_base: header.as_mut_ptr().cast(),
                    iov_len: header.len(),
                },
                libc::iovec {
                    iov_base: payload.as_mut_ptr().cast(),
                    iov_len: payload.len(),
                },
            ]);
            entries.push(Entry {
                qid,
                header,
                payload: Some(payload),
                iov,
                armed: true,
            });
        }
    }
    entries
}

impl FuseRing {
    /// Registers every entry with the kernel (REGISTER), which hands each back as a CQE
    /// when a request arrives for its queue.
    fn register_entries(&self) {
        let n = self.entries.borrow().len();
        for idx in 0..n {
            let (qid, iov) = {
                let es = self.entries.borrow();
                (es[idx].qid, es[idx].iov.as_ptr())
            };
            self.push(&uring_cmd(
                self.dev.as_raw_fd(),
                URING_CMD_REGISTER,
                iov,
                0,
                qid,
                idx as u64,
            ));
        }
    }

    /// Hooks the ring into the current loop: its eventfd as an fd handler, its CQ as a
    /// poll handler.
    fn hook(self: &Rc<Self>) -> Result<(FdHandlerId, PollHandlerId), String> {
        stord_aio::with_current_context(|ctx| -> Result<(FdHandlerId, PollHandlerId), String> {
            let rr = self.clone();
            let fd_id = ctx
                .set_fd_handler(self.eventfd.as_raw_fd(), Interest::READABLE, move |_| {
                    let _ = stord_aio::sys::eventfd_read(rr.eventfd.as_raw_fd());
                    rr.reap();
                })
                .map_err(|e| e.to_string())?;
            let poll_id = ctx.add_poll_handler(Rc::new(RingPoller(self.clone())));
            Ok((fd_id, poll_id))
        })
        .ok_or("no event loop on this thread")?
    }
}

/// Frees ring `id` once the kernel has handed every entry back (the connection is gone by
/// then, so each comes back with an error, a request in progress after its commit). The
/// loop is not held up meanwhile: the ring stays hooked to it (its eventfd wakes the loop,
/// each reap wakes the task that waits for the last entry). If the loop ends first, the
/// ring and its buffers are leaked rather than freed under the kernel.
pub fn teardown(id: u64) {
    let Some(r) = RINGS.with(|m| m.borrow_mut().remove(&id)) else {
        return;
    };
    r.flush_bh.borrow_mut().take();
    let _ = r.ring.borrow().submit();
    let closing = Closing(Some(r));
    stord_aio::spawn_detached(async move {
        std::future::poll_fn(|cx| {
            let Some(r) = &closing.0 else {
                return Poll::Ready(());
            };
            r.reap();
            if !r.any_armed() {
                return Poll::Ready(());
            }
            *r.closing.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        if let Some(r) = &closing.0 {
            if let Some((fd_id, poll_id)) = r.handlers.borrow_mut().take() {
                stord_aio::with_current_context(|ctx| {
                    ctx.remove_fd_handler(fd_id);
                    ctx.remove_poll_handler(poll_id);
                });
            }
        }
        drop(closing);
    });
}

/// A ring being torn down: freed when dropped, unless the kernel may still own an entry.
struct Closing(Option<Rc<FuseRing>>);

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some(r) = self.0.take() {
            if r.any_armed() {
                std::mem::forget(r);
            }
        }
    }
}
