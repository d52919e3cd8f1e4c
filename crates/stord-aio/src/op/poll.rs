//! poll-add and timeout.

use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use io_uring::{opcode, squeue, types};

use super::{to_result, Blocking, Op, OpDesc};
use crate::context::with_current;
use crate::handler::{Interest, Readiness};
use crate::reactor::Reactor;
use crate::sys;
use crate::timer::Sleep;

/// Waits until `fd` is ready for `interest` (one-shot).
pub fn poll_add(fd: RawFd, interest: Interest) -> Op<PollAdd> {
    Op::new(PollAdd {
        fd,
        events: interest.0,
    })
}

/// See [`poll_add`].
pub struct PollAdd {
    fd: RawFd,
    events: u32,
}

impl OpDesc for PollAdd {
    type Output = io::Result<Readiness>;
    fn entry(&mut self) -> squeue::Entry {
        opcode::PollAdd::new(types::Fd(self.fd), self.events).build()
    }
    fn run_blocking(&mut self) -> Blocking {
        match sys::poll_now(self.fd, self.events as i16) {
            Ok(0) => Blocking::WaitFor(self.fd, self.events),
            Ok(rev) => Blocking::Done(rev as u16 as i32),
            Err(e) => Blocking::Done(-e.raw_os_error().unwrap_or(libc::EIO)),
        }
    }
    fn finish(self, res: i32) -> Self::Output {
        to_result(res).map(|r| Readiness(r as u32))
    }
}

/// A ring timeout (IORING_OP_TIMEOUT) on io_uring, a loop timer on epoll.
pub fn timeout(d: Duration) -> Timeout {
    let ring = with_current(|c| matches!(*c.reactor.borrow(), Reactor::Uring(_)));
    if ring {
        let ts = Box::new(types::Timespec::from(d));
        Timeout::Ring(Op::new(RingTimeout { ts }))
    } else {
        Timeout::Timer(crate::sleep(d))
    }
}

/// See [`timeout`].
pub enum Timeout {
    /// On the ring.
    Ring(Op<RingTimeout>),
    /// On the loop's timer list.
    Timer(Sleep),
}

impl Future for Timeout {
    type Output = io::Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Timeout::Ring(op) => Pin::new(op).poll(cx),
            Timeout::Timer(s) => Pin::new(s).poll(cx).map(Ok),
        }
    }
}

/// The ring form of [`timeout`].
pub struct RingTimeout {
    // Boxed so the address in the SQE stays valid whatever happens to the Op.
    ts: Box<types::Timespec>,
}

impl OpDesc for RingTimeout {
    type Output = io::Result<()>;
    fn entry(&mut self) -> squeue::Entry {
        opcode::Timeout::new(&*self.ts).build()
    }
    fn run_blocking(&mut self) -> Blocking {
        unreachable!("ring timeouts only exist on io_uring contexts")
    }
    fn finish(self, res: i32) -> Self::Output {
        match res {
            r if r == -libc::ETIME => Ok(()),
            r => to_result(r).map(|_| ()),
        }
    }
}
