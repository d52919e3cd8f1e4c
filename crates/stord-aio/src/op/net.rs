//! Socket operations: recv and send.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};

use super::{to_result, Blocking, Op, OpDesc};
use crate::buf::{IoBuf, IoBufMut};
use crate::sys::blocking;

/// Receives up to `buf.len()` bytes. Output: the count (0 at end of stream) and the buffer.
pub fn recv<B: IoBufMut>(fd: RawFd, buf: B, flags: i32) -> Op<Recv<B>> {
    Op::new(Recv { fd, buf, flags })
}

/// Sends `buf`. Output: the count sent and the buffer. MSG_NOSIGNAL is always added.
pub fn send<B: IoBuf>(fd: RawFd, buf: B, flags: i32) -> Op<Send<B>> {
    Op::new(Send { fd, buf, flags })
}

/// See [`recv`].
pub struct Recv<B> {
    fd: RawFd,
    buf: B,
    flags: i32,
}

impl<B: IoBufMut> OpDesc for Recv<B> {
    type Output = (io::Result<usize>, B);
    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.bytes_len() as u32;
        opcode::Recv::new(types::Fd(self.fd), self.buf.stable_mut_ptr(), len)
            .flags(self.flags)
            .build()
    }
    fn run_blocking(&mut self) -> Blocking {
        let len = self.buf.bytes_len();
        // SAFETY: the buffer is owned by this op and writable for `len` bytes.
        match unsafe { blocking::recv(self.fd, self.buf.stable_mut_ptr(), len, self.flags) } {
            r if r == -libc::EAGAIN => Blocking::WaitFor(self.fd, libc::POLLIN as u32),
            r => Blocking::Done(r),
        }
    }
    fn finish(self, res: i32) -> Self::Output {
        (to_result(res), self.buf)
    }
}

/// See [`send`].
pub struct Send<B> {
    fd: RawFd,
    buf: B,
    flags: i32,
}

impl<B: IoBuf> OpDesc for Send<B> {
    type Output = (io::Result<usize>, B);
    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.bytes_len() as u32;
        opcode::Send::new(types::Fd(self.fd), self.buf.stable_ptr(), len)
            .flags(self.flags | libc::MSG_NOSIGNAL)
            .build()
    }
    fn run_blocking(&mut self) -> Blocking {
        let len = self.buf.bytes_len();
        // SAFETY: the buffer is owned by this op and readable for `len` bytes.
        match unsafe { blocking::send(self.fd, self.buf.stable_ptr(), len, self.flags) } {
            r if r == -libc::EAGAIN => Blocking::WaitFor(self.fd, libc::POLLOUT as u32),
            r => Blocking::Done(r),
        }
    }
    fn finish(self, res: i32) -> Self::Output {
        (to_result(res), self.buf)
    }
}
