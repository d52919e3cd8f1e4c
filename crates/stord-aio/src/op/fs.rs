//! File operations: read, write, readv, writev (and over owned iovecs: read_iov,
//! write_iov), fsync, fallocate.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};

use super::{to_result, Blocking, Op, OpDesc};
use crate::buf::{IoBuf, IoBufMut, IoVecs, IoVecsMut};
use crate::sys::blocking;

/// Reads `buf.len()` bytes at `offset`. Output: the count read and the buffer.
pub fn read<B: IoBufMut>(fd: RawFd, buf: B, offset: u64) -> Op<Read<B>> {
    Op::new(Read { fd, buf, offset })
}

/// Writes `buf` at `offset`. Output: the count written and the buffer.
pub fn write<B: IoBuf>(fd: RawFd, buf: B, offset: u64) -> Op<Write<B>> {
    write_flags(fd, buf, offset, 0)
}

/// pwrite with `RWF_*` flags (e.g. `libc::RWF_DSYNC` for a FUA write).
pub fn write_flags<B: IoBuf>(fd: RawFd, buf: B, offset: u64, rw_flags: i32) -> Op<Write<B>> {
    Op::new(Write {
        fd,
        buf,
        offset,
        rw_flags,
    })
}

/// Reads into several buffers at `offset` (preadv).
pub fn readv<B: IoBufMut>(fd: RawFd, bufs: Vec<B>, offset: u64) -> Op<Readv<B>> {
    Op::new(Readv {
        fd,
        iovecs: Vec::new(),
        bufs,
        offset,
    })
}

/// Writes several buffers at `offset` (pwritev).
pub fn writev<B: IoBuf>(fd: RawFd, bufs: Vec<B>, offset: u64) -> Op<Writev<B>> {
    writev_flags(fd, bufs, offset, 0)
}

/// pwritev2 with `RWF_*` flags (e.g. `libc::RWF_DSYNC` for a FUA write).
pub fn writev_flags<B: IoBuf>(
    fd: RawFd,
    bufs: Vec<B>,
    offset: u64,
    rw_flags: i32,
) -> Op<Writev<B>> {
    Op::new(Writev {
        fd,
        iovecs: Vec::new(),
        bufs,
        offset,
        rw_flags,
    })
}

/// preadv into `v`'s pieces (a plain read when there is one).
pub fn read_iov<V: IoVecsMut>(fd: RawFd, v: V, offset: u64) -> Op<ReadIov<V>> {
    Op::new(ReadIov { fd, v, offset })
}

/// pwritev2 from `v`'s pieces with `RWF_*` flags (a plain write when there is one).
pub fn write_iov<V: IoVecs>(fd: RawFd, v: V, offset: u64, rw_flags: i32) -> Op<WriteIov<V>> {
    Op::new(WriteIov {
        fd,
        v,
        offset,
        rw_flags,
    })
}

/// fsync, or fdatasync with `datasync`.
pub fn fsync(fd: RawFd, datasync: bool) -> Op<Fsync> {
    Op::new(Fsync { fd, datasync })
}

/// fallocate(fd, mode, offset, len).
pub fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> Op<Fallocate> {
    Op::new(Fallocate {
        fd,
        mode,
        offset,
        len,
    })
}

/// Non-blocking fds (pipes, sockets) may say EAGAIN: wait for readiness and retry.
fn would_block(res: i32, fd: RawFd, events: i16) -> Blocking {
    if res == -libc::EAGAIN {
        Blocking::WaitFor(fd, events as u32)
    } else {
        Blocking::Done(res)
    }
}

/// Offset meaning "the file's current position": use it for sockets and pipes.
pub const CURRENT_POSITION: u64 = u64::MAX;

/// See [`read`].
pub struct Read<B> {
    fd: RawFd,
    buf: B,
    offset: u64,
}

impl<B: IoBufMut> OpDesc for Read<B> {
    type Output = (io::Result<usize>, B);
    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.bytes_len() as u32;
        opcode::Read::new(types::Fd(self.fd), self.buf.stable_mut_ptr(), len)
            .offset(self.offset)
            .build()
    }
    fn run_blocking(&mut self) -> Blocking {
        let len = self.buf.bytes_len();
        // SAFETY: the buffer is owned by this op and writable for `len` bytes.
        let r = unsafe { blocking::pread(self.fd, self.buf.stable_mut_ptr(), len, self.offset) };
        would_block(r, self.fd, libc::POLLIN)
    }
    fn finish(self, res: i32) -> Self::Output {
        (to_result(res), self.buf)
    }
}

/// See [`write`].
pub struct Write<B> {
    fd: RawFd,
    buf: B,
    offset: u64,
    rw_flags: i32,
}

impl<B: IoBuf> OpDesc for Write<B> {
    type Output = (io::Result<usize>, B);
    fn entry(&mut self) -> squeue::Entry {
        let len = self.buf.bytes_len() as u32;
        opcode::Write::new(types::Fd(self.fd), self.buf.stable_ptr(), len)
            .offset(self.offset)
            .rw_flags(self.rw_flags)
            .build()
    }
    fn run_blocking(&mut self) -> Blocking {
        let iov = [libc::iovec {
            iov_base: self.buf.stable_ptr() as *mut _,
            iov_len: self.buf.bytes_len(),
        }];
        // SAFETY: the iovec names the buffer owned by this op, readable for its length.
        let r = unsafe { blocking::pwritev(self.fd, &iov, self.offset, self.rw_flags) };
        would_block(r, self.fd, libc::POLLOUT)
    }
    fn finish(self, res: i32) -> Self::Output {
        (to_result(res), self.buf)
    }
}

/// See [`readv`].
pub struct Readv<B> {
    fd: RawFd,
    // The iovec array lives on the heap inside this Vec; it is built once, before the
    // SQE, and never reallocated afterwards.
    iovecs: Vec<libc::iovec>,
    bufs: Vec<B>,
    offset: u64,
}

impl<B: IoBufMut> Readv<B> {
    fn build_iovecs(&mut self) {
        self.iovecs = self
            .bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.stable_mut_ptr().cast(),
                iov_len: b.bytes_len(),
            })
            .collect();
    }
}

impl<B: IoBufMut> OpDesc for Readv<B> {
    type Output = (io::Result<usize>, Vec<B>);
    fn entry(&mut self) -> squeue::Entry {
        self.build_iovecs();
        opcode::Readv::new(
            types::Fd(self.fd),
            self.iovecs.as_ptr(),
            self.iovecs.len() as u32,
        )
        .offset(self.offset)
        .build()
    }
    fn run_blocking(&mut self) -> Blocking {
        self.build_iovecs();
        // SAFETY: every iovec names a buffer owned by this op, writable for its length.
        let r = unsafe { blocking::preadv(self.fd, &self.iovecs, self.offset, 0) };
        would_block(r, self.fd, libc::POLLIN)
    }
    fn finish(self, res: i32) -> Self::Output {
        (to_result(res), self.bufs)
    }
}

/// See [`writev`].
pub struct Writev<B> {
    fd: RawFd,
    iovecs: Vec<libc::iovec>,
    bufs: Vec<B>,
    offset: u64,
    rw_flags: i32,
}

impl<B: IoBuf> Writev<B> {
    fn build_iovecs(&mut self) {
        self.iovecs = self
            .bufs
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.stable_ptr() as *mut _,
                iov_len: b.bytes_len(),
            })
            .collect();
    }
}

impl<B: IoBuf> OpDesc for Writev<B> {
    type Output = (io::Result<usize>, Vec<B>);
    fn entry(&mut self) -> squeue::Entry {
        self.build_iovecs();
        opcode::Writev::new(
            types::Fd(self.fd),
            self.iovecs.as_ptr(),
            self.iovecs.len() as u32,
        )
        .offset(self.offset)
        .rw_flags(self.rw_flags)
        .build()
    }
    fn run_blocking(&mut self) -> Blocking {
        self.build_iovecs();
        // SAFETY: every iovec names a buffer owned by this op, readable for its length.
        let r = unsafe { blocking::pwritev(self.fd, &self.iovecs, self.offset, self.rw_flags) };
        would_block(r, self.fd, libc::POLLOUT)
    }
    fn finish(self, res: i32) -> Self::Output {
        (to_result(res), self.bufs)
    }
}

/// See [`read_iov`].
pub struct ReadIov<V> {
    fd: RawFd,
    v: V,
    offset: u64,
}

impl<V: IoVecsMut> OpDesc for ReadIov<V> {
    type Output = (io::Result<usize>, V);
    fn entry(&mut self) -> squeue::Entry {
        let iov = self.v.iovecs();
        match iov {
            [one] => opcode::Read::new(types::Fd(self.fd), one.iov_base.cast(), one.iov_len as u32)
                .offset(self.offset)
                .build(),
            // The array is heap-stable for as long as `v` lives (IoVecs' contract).
            many => opcode::Readv::new(types::Fd(self.fd), many.as_ptr(), many.len() as u32)
                .offset(self.offset)
                .build(),
        }
    }
    fn run_blocking(&mut self) -> Blocking {
        // SAFETY: the iovecs name memory writable for `v`'s owner, valid while `v` lives.
        let r = unsafe { blocking::preadv(self.fd, self.v.iovecs(), self.offset, 0) };
        would_block(r, self.fd, libc::POLLIN)
    }
    fn finish(self, res: i32) -> Self::Output {
        (to_result(res), self.v)
    }
}

/// See [`write_iov`].
pub struct WriteIov<V> {
    fd: RawFd,
    v: V,
    offset: u64,
    rw_flags: i32,
}

impl<V: IoVecs> OpDesc for WriteIov<V> {
    type Output = (io::Result<usize>, V);
    fn entry(&mut self) -> squeue::Entry {
        let iov = self.v.iovecs();
        match iov {
            [one] => {
                opcode::Write::new(types::Fd(self.fd), one.iov_base.cast(), one.iov_len as u32)
                    .offset(self.offset)
                    .rw_flags(self.rw_flags)
                    .build()
            }
            many => opcode::Writev::new(types::Fd(self.fd), many.as_ptr(), many.len() as u32)
                .offset(self.offset)
                .rw_flags(self.rw_flags)
                .build(),
        }
    }
    fn run_blocking(&mut self) -> Blocking {
        // SAFETY: the iovecs name memory readable while `v` lives.
        let r = unsafe { blocking::pwritev(self.fd, self.v.iovecs(), self.offset, self.rw_flags) };
        would_block(r, self.fd, libc::POLLOUT)
    }
    fn finish(self, res: i32) -> Self::Output {
        (to_result(res), self.v)
    }
}

/// See [`fsync`].
pub struct Fsync {
    fd: RawFd,
    datasync: bool,
}

impl OpDesc for Fsync {
    type Output = io::Result<()>;
    fn entry(&mut self) -> squeue::Entry {
        let flags = if self.datasync {
            types::FsyncFlags::DATASYNC
        } else {
            types::FsyncFlags::empty()
        };
        opcode::Fsync::new(types::Fd(self.fd)).flags(flags).build()
    }
    fn run_blocking(&mut self) -> Blocking {
        Blocking::Done(blocking::fsync(self.fd, self.datasync))
    }
    fn finish(self, res: i32) -> Self::Output {
        to_result(res).map(|_| ())
    }
}

/// See [`fallocate`].
pub struct Fallocate {
    fd: RawFd,
    mode: i32,
    offset: u64,
    len: u64,
}

impl OpDesc for Fallocate {
    type Output = io::Result<()>;
    fn entry(&mut self) -> squeue::Entry {
        opcode::Fallocate::new(types::Fd(self.fd), self.len)
            .offset(self.offset)
            .mode(self.mode)
            .build()
    }
    fn run_blocking(&mut self) -> Blocking {
        Blocking::Done(blocking::fallocate(
            self.fd,
            self.mode,
            self.offset,
            self.len,
        ))
    }
    fn finish(self, res: i32) -> Self::Output {
        to_result(res).map(|_| ())
    }
}
