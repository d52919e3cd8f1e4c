//! One FUSE queue: a /dev/fuse channel read by an fd handler on its IoThread, one task per
//! request, replies written with writev. Opcodes and semantics follow qemu-storage-daemon's
//! FUSE export.

use std::cell::RefCell;
use std::fs::File;
use std::io::{IoSlice, Read, Write};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::handler::Processed;
use super::proto::*;
use super::FuseShared;

/// Requests read per readiness event before giving the loop back.
const READS_PER_EVENT: usize = 64;

/// A channel and its spare request buffers (main or IoThread, never shared).
pub struct Queue {
    pub dev: Arc<File>,
    pub shared: Arc<FuseShared>,
    spare: RefCell<Vec<Vec<u8>>>,
}

impl Queue {
    pub fn new(dev: Arc<File>, shared: Arc<FuseShared>) -> Rc<Self> {
        Rc::new(Self {
            dev,
            shared,
            spare: RefCell::default(),
        })
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
            let mut buf = self.buffer();
            match (&*self.dev).read(&mut buf) {
                Ok(n) => {
                    self.shared.dev_requests.fetch_add(1, Ordering::Relaxed);
                    let q = self.clone();
                    self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
                    stord_aio::spawn(async move {
                        q.handle(&buf[..n]).await;
                        q.recycle(buf);
                        q.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
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
