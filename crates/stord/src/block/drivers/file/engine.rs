//! The file driver's engines' one trait: how its I/O reaches the kernel.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use crate::block::worker_pool;
use crate::iov::IoVec;
use crate::sys;

pub(super) fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

pub(super) fn from_res(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

/// How the file driver's I/O reaches the kernel: one implementation per `aio=` mode
/// ([`uring::Uring`], [`linux_aio::Native`], [`threads::Threads`]). The driver is generic
/// over it, so the mode is chosen once, when the file is opened, and a request pays no
/// dispatch. Each engine keeps what it needs per IoThread in that IoThread's context
/// (`AioContext::local`): a Linux AIO context, a worker pool; the ring is the loop's own.
pub(crate) trait Engine: Send + Sync + 'static {
    /// Learns what it needs of the file once it is open (before any request).
    fn opened(&mut self, _fd: RawFd) {}

    /// One read or write of what `iov` shows at `offset`: the raw result (count or -errno).
    fn transfer(
        &self,
        fd: &Arc<OwnedFd>,
        write: bool,
        fua: bool,
        iov: IoVec,
        offset: u64,
    ) -> impl Future<Output = (i32, IoVec)>;

    /// fdatasync: the raw result. On the worker pool unless the engine has better.
    fn fsync(&self, fd: &Arc<OwnedFd>) -> impl Future<Output = i32> {
        worker_pool::fsync(fd.clone())
    }

    /// fallocate(2), off the loop thread. On the worker pool unless the engine has better.
    fn fallocate(
        &self,
        fd: &Arc<OwnedFd>,
        mode: i32,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = io::Result<()>> {
        let fd = fd.clone();
        worker_pool::run(move || sys::fallocate(fd.as_raw_fd(), mode, offset, len))
    }
}
