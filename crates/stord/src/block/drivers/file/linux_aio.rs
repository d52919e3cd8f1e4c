//! `aio=native`: Linux AIO, one context per IoThread, completions read in userspace.
//!
//! The kernel maps each AIO context's completion ring into our address space (the
//! `aio_context_t` *is* its address). We check its magic and feature words once, then
//! harvest completions by reading the ring's head and tail (with acquire ordering on the
//! tail, pairing with the kernel's write barrier) instead of calling io_getevents. We
//! harvest when the eventfd fires, when the ring's poll handler sees head != tail while the
//! loop busy-polls, and right after every io_submit (the ring tends to be full before
//! that, and rarely after). iocbs are batched: up to `aio-max-batch` (default 32) per
//! io_submit, the rest at the end of the loop iteration (a bottom half).
//!
//! All `unsafe` of this backend is in this file: the raw syscalls and the ring reads.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use stord_aio::{Bh, Histogram, Interest, IoVecs, PollHandler};

use crate::iov::IoVec;

const MAX_EVENTS: u32 = 1024;
const DEFAULT_MAX_BATCH: u32 = 32;
const AIO_RING_MAGIC: u32 = 0xa10a_10a1;
const IOCB_CMD_PREAD: u16 = 0;
const IOCB_CMD_PWRITE: u16 = 1;
const IOCB_CMD_PREADV: u16 = 7;
const IOCB_CMD_PWRITEV: u16 = 8;
const IOCB_FLAG_RESFD: u32 = 1;

/// The kernel's `struct iocb` (x86_64 little-endian layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Iocb {
    aio_data: u64,
    aio_key: u32,
    aio_rw_flags: i32,
    aio_lio_opcode: u16,
    aio_reqprio: i16,
    aio_fildes: u32,
    aio_buf: u64,
    aio_nbytes: u64,
    aio_offset: i64,
    aio_reserved2: u64,
    aio_flags: u32,
    aio_resfd: u32,
}

/// The kernel's `struct io_event`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

/// The kernel's `struct aio_ring` header; `io_event`s follow it.
#[repr(C)]
struct AioRingHeader {
    id: u32,
    nr: u32,
    head: u32,
    tail: u32,
    magic: u32,
    compat_features: u32,
    incompat_features: u32,
    header_length: u32,
}

/// The loop histograms of completions reaped per harvest (query-iothreads x-stats), split by
/// when the harvest ran: woken by the eventfd or the ring's poll handler, or right after an
/// io_submit.
pub const HARVEST_ON_EVENT: &str = "linux-aio.harvest-on-event";
/// See [`HARVEST_ON_EVENT`].
pub const HARVEST_AFTER_SUBMIT: &str = "linux-aio.harvest-after-submit";

struct Req {
    buf: Option<IoVec>,
    res: Option<i64>,
    waker: Option<Waker>,
    /// The future was dropped; free the slot (and buffer) when the completion arrives.
    orphan: bool,
}

struct LinuxAio {
    ctx: u64,
    eventfd: OwnedFd,
    userspace_ring: bool,
    reqs: RefCell<Vec<Option<Req>>>,
    free: RefCell<Vec<usize>>,
    pending: RefCell<VecDeque<Iocb>>,
    in_flight: Cell<u32>,
    max_batch: Cell<u32>,
    /// Harvest the ring right after each io_submit (on unless `x-reap-after-submit=off`;
    /// the switch exists so the benchmark can show what it buys).
    reap_after_submit: Cell<bool>,
    submit_bh: RefCell<Option<Bh>>,
    /// Scratch array of iocb pointers for io_submit (kept to avoid an allocation per call).
    submit_ptrs: RefCell<Vec<*mut Iocb>>,
    /// This loop's [`HARVEST_ON_EVENT`] and [`HARVEST_AFTER_SUBMIT`] histograms.
    harvest_on_event: Arc<Histogram>,
    harvest_after_submit: Arc<Histogram>,
}

/// The IoThread's Linux AIO context, kept as its [`AioContext::local`] state so it is
/// destroyed with the IoThread's context.
///
/// [`AioContext::local`]: stord_aio::AioContext::local
struct PerContext(Rc<LinuxAio>);

fn sys_io_setup(nr: u32) -> io::Result<u64> {
    let mut ctx: u64 = 0;
    // SAFETY: io_setup writes one aio_context_t to the pointer, which is a live u64.
    let r = unsafe { libc::syscall(libc::SYS_io_setup, nr as libc::c_long, &mut ctx as *mut u64) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ctx)
    }
}

impl LinuxAio {
    /// The calling IoThread's instance, made on first use.
    fn current() -> io::Result<Rc<LinuxAio>> {
        stord_aio::with_current_context(|c| c.local(|_| Self::new().map(PerContext)))
            .ok_or_else(|| io::Error::other("aio=native used outside an AioContext"))?
            .map(|l| l.0.clone())
    }

    fn new() -> io::Result<Rc<LinuxAio>> {
        let ctx = sys_io_setup(MAX_EVENTS)?;
        let eventfd = stord_aio::sys::eventfd()?;
        // SAFETY: `ctx` is the address of the ring the kernel mapped for this context;
        // its header is readable for the context's lifetime.
        let userspace_ring = unsafe {
            let h = ctx as *const AioRingHeader;
            (*h).magic == AIO_RING_MAGIC && (*h).incompat_features == 0
        };
        let (harvest_on_event, harvest_after_submit) = stord_aio::with_current_context(|c| {
            (
                c.histogram(HARVEST_ON_EVENT),
                c.histogram(HARVEST_AFTER_SUBMIT),
            )
        })
        .ok_or_else(|| io::Error::other("aio=native used outside an AioContext"))?;
        let aio = Rc::new(LinuxAio {
            ctx,
            eventfd,
            userspace_ring,
            reqs: RefCell::default(),
            free: RefCell::default(),
            pending: RefCell::default(),
            in_flight: Cell::new(0),
            max_batch: Cell::new(DEFAULT_MAX_BATCH),
            reap_after_submit: Cell::new(true),
            submit_bh: RefCell::new(None),
            submit_ptrs: RefCell::default(),
            harvest_on_event,
            harvest_after_submit,
        });
        let weak = Rc::downgrade(&aio);
        stord_aio::with_current_context(|ctx| -> io::Result<()> {
            let w = weak.clone();
            *aio.submit_bh.borrow_mut() = Some(ctx.new_bh(move || {
                if let Some(a) = w.upgrade() {
                    a.submit();
                }
            }));
            let w = weak.clone();
            ctx.set_fd_handler(aio.eventfd.as_raw_fd(), Interest::READABLE, move |_| {
                if let Some(a) = w.upgrade() {
                    let _ = stord_aio::sys::eventfd_read(a.eventfd.as_raw_fd());
                    a.on_event();
                }
            })?;
            if aio.userspace_ring {
                ctx.add_poll_handler(Rc::new(RingPoller { aio: weak.clone() }));
            }
            Ok(())
        })
        .ok_or_else(|| io::Error::other("aio=native used outside an AioContext"))??;
        Ok(aio)
    }

    fn on_event(&self) {
        let n = self.harvest();
        self.harvest_on_event.record(n as u64);
        if !self.pending.borrow().is_empty() {
            self.submit();
        }
    }

    fn ring_has_events(&self) -> bool {
        // SAFETY: the ring header stays mapped while the context lives; head is only
        // written by us (on this thread), tail by the kernel, read atomically.
        unsafe {
            let h = self.ctx as *mut AioRingHeader;
            let tail =
                (*(std::ptr::addr_of!((*h).tail) as *const AtomicU32)).load(Ordering::Relaxed);
            std::ptr::read_volatile(std::ptr::addr_of!((*h).head)) != tail
        }
    }

    fn complete(&self, data: u64, res: i64) {
        let idx = data as usize;
        let mut reqs = self.reqs.borrow_mut();
        let Some(Some(req)) = reqs.get_mut(idx) else {
            return;
        };
        self.in_flight.set(self.in_flight.get() - 1);
        if req.orphan {
            reqs[idx] = None;
            self.free.borrow_mut().push(idx);
            return;
        }
        req.res = Some(res);
        if let Some(w) = req.waker.take() {
            w.wake();
        }
    }

    /// Reaps every completion the ring holds. Returns how many.
    fn harvest(&self) -> usize {
        if !self.userspace_ring {
            return self.harvest_syscall();
        }
        let mut total = 0;
        loop {
            // The ring (header + `nr` events) stays mapped while the context lives. The
            // tail is written by the kernel: read it with Acquire so the events before it
            // are visible (the read barrier the AIO ABI asks for). The head is ours; we
            // publish it with Release after reading the events.
            let mut batch = [IoEvent::default(); 64];
            // SAFETY: as described above; at most 64 events are copied into `batch`.
            let n = unsafe {
                let h = self.ctx as *mut AioRingHeader;
                let nr = (*h).nr;
                let head = std::ptr::read_volatile(std::ptr::addr_of!((*h).head));
                let tail =
                    (*(std::ptr::addr_of!((*h).tail) as *const AtomicU32)).load(Ordering::Acquire);
                if head == tail || head >= nr {
                    break;
                }
                let n = if tail > head { tail - head } else { nr - head }.min(batch.len() as u32);
                let events =
                    (h as *const u8).add(std::mem::size_of::<AioRingHeader>()) as *const IoEvent;
                for (i, slot) in batch.iter_mut().take(n as usize).enumerate() {
                    *slot = std::ptr::read_volatile(events.add(head as usize + i));
                }
                (*(std::ptr::addr_of!((*h).head) as *const AtomicU32))
                    .store((head + n) % nr, Ordering::Release);
                n as usize
            };
            total += n;
            for ev in &batch[..n] {
                self.complete(ev.data, ev.res);
            }
        }
        total
    }

    fn harvest_syscall(&self) -> usize {
        let mut events = [IoEvent::default(); 64];
        let mut total = 0;
        loop {
            let ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `events` is a writable array of 64 io_events; `ts` lives for the call.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_getevents,
                    self.ctx,
                    0 as libc::c_long,
                    events.len() as libc::c_long,
                    events.as_mut_ptr(),
                    &ts as *const libc::timespec,
                )
            };
            if r <= 0 {
                break;
            }
            for ev in &events[..r as usize] {
                self.complete(ev.data, ev.res);
            }
            total += r as usize;
        }
        total
    }

    fn submit(&self) {
        loop {
            let mut pending = self.pending.borrow_mut();
            let room = MAX_EVENTS - self.in_flight.get();
            if pending.is_empty() || room == 0 {
                break;
            }
            let n = (pending.len() as u32)
                .min(room)
                .min(self.max_batch.get().max(1)) as usize;
            let iocbs = pending.make_contiguous();
            let mut ptrs = self.submit_ptrs.borrow_mut();
            ptrs.clear();
            ptrs.extend(iocbs[..n].iter_mut().map(|i| i as *mut Iocb));
            // SAFETY: `ptrs` holds `n` pointers to live iocbs; the kernel copies them during
            // the call. The buffers they name are owned by `self.reqs` until completion.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_submit,
                    self.ctx,
                    n as libc::c_long,
                    ptrs.as_mut_ptr(),
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO);
                if e == libc::EAGAIN {
                    break;
                }
                // Fail the first request and retry the rest.
                let first = pending.pop_front().expect("non-empty");
                drop(pending);
                self.in_flight.set(self.in_flight.get() + 1);
                self.complete(first.aio_data, -(e as i64));
                continue;
            }
            pending.drain(..r as usize);
            self.in_flight.set(self.in_flight.get() + r as u32);
        }
        if self.in_flight.get() > 0 && self.reap_after_submit.get() {
            let n = self.harvest();
            self.harvest_after_submit.record(n as u64);
        }
    }

    fn enqueue(&self, fd: RawFd, write: bool, fua: bool, iov: IoVec, offset: u64) -> usize {
        // One piece: a plain read/write of it. Several: the vectored command, whose iovec
        // array the kernel reads at io_submit, which may be later (the array is on the
        // heap inside `iov`, which the request holds until completion).
        let (opcode, ptr, len) = match iov.iovecs() {
            [one] => (
                if write {
                    IOCB_CMD_PWRITE
                } else {
                    IOCB_CMD_PREAD
                },
                one.iov_base as u64,
                one.iov_len as u64,
            ),
            many => (
                if write {
                    IOCB_CMD_PWRITEV
                } else {
                    IOCB_CMD_PREADV
                },
                many.as_ptr() as u64,
                many.len() as u64,
            ),
        };
        let req = Req {
            buf: Some(iov),
            res: None,
            waker: None,
            orphan: false,
        };
        let idx = match self.free.borrow_mut().pop() {
            Some(i) => {
                self.reqs.borrow_mut()[i] = Some(req);
                i
            }
            None => {
                let mut reqs = self.reqs.borrow_mut();
                reqs.push(Some(req));
                reqs.len() - 1
            }
        };
        let iocb = Iocb {
            aio_data: idx as u64,
            aio_lio_opcode: opcode,
            aio_rw_flags: if fua { libc::RWF_DSYNC } else { 0 },
            aio_fildes: fd as u32,
            aio_buf: ptr,
            aio_nbytes: len,
            aio_offset: offset as i64,
            aio_flags: IOCB_FLAG_RESFD,
            aio_resfd: self.eventfd.as_raw_fd() as u32,
            ..Iocb::default()
        };
        self.pending.borrow_mut().push_back(iocb);
        idx
    }
}

impl Drop for LinuxAio {
    fn drop(&mut self) {
        // io_destroy waits for in-flight requests, so the buffers in `reqs` (dropped after
        // this) are no longer used by the kernel.
        // SAFETY: plain syscall on our own context.
        unsafe { libc::syscall(libc::SYS_io_destroy, self.ctx) };
    }
}

struct RingPoller {
    aio: Weak<LinuxAio>,
}

impl PollHandler for RingPoller {
    fn name(&self) -> &str {
        "linux-aio"
    }
    fn poll(&self) -> bool {
        self.aio.upgrade().is_some_and(|a| a.ring_has_events())
    }
    fn ready(&self) {
        if let Some(a) = self.aio.upgrade() {
            a.on_event();
        }
    }
}

struct AioFuture {
    aio: Rc<LinuxAio>,
    idx: usize,
    done: bool,
}

impl Future for AioFuture {
    type Output = (i32, IoVec);
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<(i32, IoVec)> {
        let idx = self.idx;
        let mut reqs = self.aio.reqs.borrow_mut();
        let req = reqs[idx].as_mut().expect("live request");
        match req.res {
            Some(res) => {
                let buf = req.buf.take().expect("buffer");
                reqs[idx] = None;
                drop(reqs);
                self.aio.free.borrow_mut().push(idx);
                self.done = true;
                Poll::Ready((res as i32, buf))
            }
            None => {
                req.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl Drop for AioFuture {
    fn drop(&mut self) {
        if !self.done {
            let mut reqs = self.aio.reqs.borrow_mut();
            if let Some(Some(req)) = reqs.get_mut(self.idx) {
                if req.res.is_some() {
                    reqs[self.idx] = None;
                    self.aio.free.borrow_mut().push(self.idx);
                } else {
                    req.orphan = true;
                }
            }
        }
    }
}

/// Per-node knobs of the thread's AIO context (the last node to submit sets them).
#[derive(Debug, Clone, Copy)]
pub struct NativeTuning {
    /// io_submit batch limit (0 = default 32).
    pub max_batch: u32,
    /// Harvest right after io_submit.
    pub reap_after_submit: bool,
}

/// The linux-aio engine (`aio=native`): io_submit on the IoThread's AIO context, completions
/// harvested from its ring in userspace; flushes and fallocate on the worker pool.
pub(crate) struct Native(pub NativeTuning);

impl super::engine::Engine for Native {
    fn transfer(
        &self,
        fd: &std::sync::Arc<std::os::fd::OwnedFd>,
        write: bool,
        fua: bool,
        iov: IoVec,
        offset: u64,
    ) -> impl Future<Output = (i32, IoVec)> {
        use std::os::fd::AsRawFd;
        transfer(fd.as_raw_fd(), write, fua, iov, offset, self.0)
    }
}

/// One read or write of what `iov` shows at `offset`; the raw result.
async fn transfer(
    fd: RawFd,
    write: bool,
    fua: bool,
    iov: IoVec,
    offset: u64,
    tuning: NativeTuning,
) -> (i32, IoVec) {
    let aio = match LinuxAio::current() {
        Ok(a) => a,
        Err(e) => return (-e.raw_os_error().unwrap_or(libc::EIO), iov),
    };
    if tuning.max_batch != 0 {
        aio.max_batch.set(tuning.max_batch);
    }
    aio.reap_after_submit.set(tuning.reap_after_submit);
    let idx = aio.enqueue(fd, write, fua, iov, offset);
    if aio.pending.borrow().len() as u32 >= aio.max_batch.get() {
        aio.submit();
    } else if let Some(bh) = aio.submit_bh.borrow().as_ref() {
        bh.schedule();
    }
    AioFuture {
        aio,
        idx,
        done: false,
    }
    .await
}

// The ABI structs must match the kernel's sizes exactly.
const _: () = assert!(std::mem::size_of::<Iocb>() == 64);
const _: () = assert!(std::mem::size_of::<IoEvent>() == 32);
const _: () = assert!(std::mem::size_of::<AioRingHeader>() == 32);
