//! Accepting connections on a listening socket without letting a full descriptor table
//! spin the loop.
//!
//! An [`Acceptor`] accepts everything pending whenever its socket is readable and hands each
//! connection to its callback. When accept fails for lack of resources (EMFILE, ENFILE,
//! ENOBUFS, ENOMEM) the pending connection stays in the kernel's backlog, so a
//! level-triggered handler would fire again at once, forever: instead the acceptor stops
//! watching the socket, retries after a back-off (10 ms, doubling up to 250 ms) and logs one
//! line per second at most, with the count of failures it did not log. Once descriptors
//! are free again the next retry accepts the waiting clients.
//!
//! The NBD server, the QMP monitor and the vhost-user-blk export all accept through this.

use std::cell::{Cell, RefCell};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::{Rc, Weak};
use std::time::Duration;

use stord_aio::{AioContext, FdHandlerId, Interest, TimerId};

use crate::log::RateLimit;

const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(250);

type OnConn = Box<dyn FnMut(OwnedFd)>;

struct Inner {
    what: String,
    listener: OwnedFd,
    on_conn: RefCell<OnConn>,
    handler: Cell<Option<FdHandlerId>>,
    timer: Cell<Option<TimerId>>,
    /// Paused by the owner (e.g. one frontend at a time); no retries either.
    paused: Cell<bool>,
    stopped: Cell<bool>,
    backoff: Cell<Duration>,
    log: RateLimit,
    /// Accepts that failed for lack of resources, in all.
    exhausted: Cell<u64>,
}

/// A listening socket served on the loop that created it.
pub struct Acceptor {
    inner: Rc<Inner>,
}

impl Acceptor {
    /// Starts accepting on `listener` (non-blocking) from `ctx`; `what` names it in logs.
    pub fn start(
        ctx: &AioContext,
        what: impl Into<String>,
        listener: OwnedFd,
        on_conn: impl FnMut(OwnedFd) + 'static,
    ) -> io::Result<Self> {
        let inner = Rc::new(Inner {
            what: what.into(),
            listener,
            on_conn: RefCell::new(Box::new(on_conn)),
            handler: Cell::new(None),
            timer: Cell::new(None),
            paused: Cell::new(false),
            stopped: Cell::new(false),
            backoff: Cell::new(BACKOFF_MIN),
            log: RateLimit::new(Duration::from_secs(1)),
            exhausted: Cell::new(0),
        });
        arm(ctx, &inner)?;
        Ok(Self { inner })
    }

    /// Stops accepting until [`resume`](Self::resume); connections wait in the backlog.
    pub fn pause(&self) {
        pause(&self.inner);
    }

    /// Accepts again after [`pause`](Self::pause).
    pub fn resume(&self) {
        resume(&self.inner);
    }

    /// Stops for good (the socket closes when the acceptor is dropped).
    pub fn stop(&self) {
        self.inner.stopped.set(true);
        with_ctx(|ctx| disarm(ctx, &self.inner));
    }

    /// How many accepts failed for lack of descriptors or memory.
    pub fn exhausted_count(&self) -> u64 {
        self.inner.exhausted.get()
    }

    /// A handle that can pause and resume this acceptor without keeping it alive.
    pub fn handle(&self) -> AcceptorHandle {
        AcceptorHandle(Rc::downgrade(&self.inner))
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A weak [`Acceptor`] (for callbacks that must not keep the listener alive).
#[derive(Clone)]
pub struct AcceptorHandle(Weak<Inner>);

impl AcceptorHandle {
    /// As [`Acceptor::pause`]; nothing if the acceptor is gone.
    pub fn pause(&self) {
        if let Some(inner) = self.0.upgrade() {
            pause(&inner);
        }
    }

    /// As [`Acceptor::resume`]; nothing if the acceptor is gone.
    pub fn resume(&self) {
        if let Some(inner) = self.0.upgrade() {
            resume(&inner);
        }
    }
}

fn pause(inner: &Rc<Inner>) {
    inner.paused.set(true);
    with_ctx(|ctx| disarm(ctx, inner));
}

fn resume(inner: &Rc<Inner>) {
    if !inner.paused.replace(false) || inner.stopped.get() {
        return;
    }
    with_ctx(|ctx| {
        if let Err(e) = arm(ctx, inner) {
            tracing::error!("{}: cannot watch the listening socket: {e}", inner.what);
        }
    });
}

fn with_ctx(f: impl FnOnce(&AioContext)) {
    let _ = stord_aio::with_current_context(f);
}

fn arm(ctx: &AioContext, inner: &Rc<Inner>) -> io::Result<()> {
    if inner.handler.get().is_some() {
        return Ok(());
    }
    let weak = Rc::downgrade(inner);
    let id = ctx.set_fd_handler(inner.listener.as_raw_fd(), Interest::READABLE, move |_| {
        if let Some(inner) = weak.upgrade() {
            accept_pending(&inner);
        }
    })?;
    inner.handler.set(Some(id));
    Ok(())
}

fn disarm(ctx: &AioContext, inner: &Inner) {
    if let Some(id) = inner.handler.take() {
        ctx.remove_fd_handler(id);
    }
    if let Some(t) = inner.timer.take() {
        ctx.cancel_timer(t);
    }
}

fn accept_pending(inner: &Rc<Inner>) {
    use io::ErrorKind::*;
    while !inner.paused.get() && !inner.stopped.get() {
        match crate::sys::accept(inner.listener.as_raw_fd()) {
            Ok(conn) => {
                inner.backoff.set(BACKOFF_MIN);
                (inner.on_conn.borrow_mut())(conn);
            }
            Err(e) if e.kind() == WouldBlock => return,
            Err(e) if e.kind() == Interrupted => continue,
            // The client gave up before we took it: nothing to do about it.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNABORTED | libc::EPROTO)) => {
                continue
            }
            Err(e) => return back_off(inner, e),
        }
    }
}

/// Out of descriptors (or memory): stop watching the socket and retry later.
fn back_off(inner: &Rc<Inner>, e: io::Error) {
    inner.exhausted.set(inner.exhausted.get() + 1);
    let delay = inner.backoff.get();
    inner.backoff.set((delay * 2).min(BACKOFF_MAX));
    if let Some(held_back) = inner.log.allow() {
        tracing::warn!(
            "{}: accept failed: {e}; retrying every {} ms at most ({held_back} more failures since the last report)",
            inner.what,
            BACKOFF_MAX.as_millis()
        );
    }
    let weak = Rc::downgrade(inner);
    with_ctx(|ctx| {
        disarm(ctx, inner);
        let deadline = stord_aio::sys::now_ns() + delay.as_nanos() as u64;
        let t = ctx.add_timer(deadline, move || {
            let Some(inner) = weak.upgrade() else { return };
            inner.timer.set(None);
            if inner.paused.get() || inner.stopped.get() {
                return;
            }
            with_ctx(|ctx| {
                if let Err(e) = arm(ctx, &inner) {
                    tracing::error!("{}: cannot watch the listening socket: {e}", inner.what);
                }
            });
        });
        inner.timer.set(Some(t));
    });
}
