//! One FUSE queue: a /dev/fuse channel read by an fd handler on its IoThread, one task per
//! request, replies written with writev. Opcodes and semantics follow qemu-storage-daemon's
//! FUSE export.
//!
//! At most [`MAX_RUNNING`] requests run per queue: at the limit the queue stops watching
//! its channel (requests wait in the kernel) and starts again once half have finished.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io::{IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use stord_aio::{FdHandlerId, Interest};

use super::handler::Processed;
use super::proto::*;
use super::shared::FuseShared;

/// Requests read per readiness event before giving the loop back.
const READS_PER_EVENT: usize = 64;

/// Requests one queue runs at once.
pub const MAX_RUNNING: usize = 128;

/// The fd handler a queue has registered now (None while it is at its limit); the export
/// removes it, on the queue's thread, when it stops.
pub type HandlerSlot = Arc<Mutex<Option<FdHandlerId>>>;

/// A channel and its spare request buffers (main or IoThread, never shared).
pub struct Queue {
    pub dev: Arc<File>,
    pub shared: Arc<FuseShared>,
    spare: RefCell<Vec<Vec<u8>>>,
    running: Cell<usize>,
    handler: HandlerSlot,
}

impl Queue {
    /// Starts serving `dev` on the current thread's loop.
    pub fn start(dev: Arc<File>, shared: Arc<FuseShared>) -> std::io::Result<HandlerSlot> {
        let q = Rc::new(Self {
            dev,
            shared,
            spare: RefCell::default(),
            running: Cell::new(0),
            handler: HandlerSlot::default(),
        });
        q.arm()?;
        Ok(q.handler.clone())
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<FdHandlerId>> {
        self.handler.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn arm(self: &Rc<Self>) -> std::io::Result<()> {
        let q = self.clone();
        let fd = self.dev.as_raw_fd();
        let id = stord_aio::with_current_context(|ctx| {
            ctx.set_fd_handler(fd, Interest::READABLE, move |_| q.on_readable())
        })
        .ok_or_else(|| std::io::Error::other("no event loop"))??;
        *self.slot() = Some(id);
        Ok(())
    }

    fn disarm(&self) {
        if let Some(id) = self.slot().take() {
            stord_aio::with_current_context(|ctx| ctx.remove_fd_handler(id));
        }
    }

    /// A request finished: watch the channel again once half the limit is free.
    fn finished(self: &Rc<Self>) {
        self.running.set(self.running.get() - 1);
        let rearm = self.running.get() <= MAX_RUNNING / 2
            && self.slot().is_none()
            && !self.shared.halted.load(Ordering::SeqCst);
        if rearm {
            if let Err(e) = self.arm() {
                tracing::error!("fuse: cannot watch /dev/fuse again: {e}");
                self.shared.halted.store(true, Ordering::SeqCst);
            }
        }
    }

    fn buffer(&self) -> Vec<u8> {
        self.spare
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| vec![0u8; self.shared.request_buf_len()])
    }

    fn recycle(&self, b: Vec<u8>) {
        let mut s = self.spare.borrow_mut();
        if s.len() < 64 {
            s.push(b);
        }
    }

    /// Reads what requests are there and spawns a task for each. Called by the fd handler.
    pub fn on_readable(self: &Rc<Self>) {
        for _ in 0..READS_PER_EVENT {
            if self.shared.halted.load(Ordering::Relaxed) {
                return;
            }
            if self.running.get() >= MAX_RUNNING {
                // Requests wait in the kernel until ours finish.
                self.disarm();
                return;
            }
            let mut buf = self.buffer();
            match (&*self.dev).read(&mut buf) {
                Ok(n) => {
                    self.shared.dev_requests.fetch_add(1, Ordering::Relaxed);
                    let q = self.clone();
                    self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
                    self.running.set(self.running.get() + 1);
                    stord_aio::spawn_detached(async move {
                        q.handle(&buf[..n]).await;
                        q.recycle(buf);
                        q.shared.request_done();
                        q.finished();
                    });
                }
                Err(e) => {
                    self.recycle(buf);
                    match e.raw_os_error() {
                        Some(libc::EAGAIN) => return,
                        Some(libc::EINTR) | Some(libc::ENOENT) => continue,
                        // ENODEV: unmounted; anything else is fatal for this export.
                        _ => {
                            self.shared.halted.store(true, Ordering::SeqCst);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Writes one reply: header and body in a single writev.
    fn send(&self, header: &[u8], body: &[u8]) {
        // A reply is written whole or not at all; ENOENT means the request was
        // interrupted, which is fine.
        let _ = (&*self.dev).write_vectored(&[IoSlice::new(header), IoSlice::new(body)]);
    }

    async fn handle(&self, msg: &[u8]) {
        let Some(Processed {
            unique,
            opcode,
            result,
        }) = self.shared.process(msg).await
        else {
            return;
        };
        match result {
            Ok(body) => {
                let h = reply(unique, 0, body.as_slice().len());
                self.send(&h, body.as_slice());
            }
            Err(e) => self.send(&reply(unique, -e, 0), &[]),
        }
        if opcode == INIT {
            self.shared.after_init(&self.dev);
        }
    }
}
