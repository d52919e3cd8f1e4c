//! `aio=io_uring`: each request goes on the issuing IoThread's own ring.
//!
//! The SQE is queued when the request's future is first polled and submitted with the rest
//! of the loop iteration's batch, so many requests cost one io_uring_enter. Every
//! operation is marked `on_storage`, so the loop's polling learns the device's latency
//! apart from its clients' turnaround. Reads of a file that cannot be read without
//! blocking (tmpfs) are handed to the kernel's workers at once.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use stord_aio::op;

use crate::iov::IoVec;

fn raw(r: io::Result<usize>) -> i32 {
    r.map_or_else(|e| -super::engine::errno(&e), |n| n as i32)
}

/// The io_uring engine: requests, flushes and fallocate on the issuing IoThread's ring.
#[derive(Default)]
pub(crate) struct Uring {
    /// The file's reads cannot be tried without blocking (tmpfs): they go to io-wq's
    /// workers at once, so that a read finds a worker of its own rather than wait behind
    /// the writes (see [`op::Op::in_worker_if`]). Writes stay unmarked: io-wq runs
    /// buffered writes to one file one at a time anyway, and marked, each started a worker
    /// that only waited its turn (16 of them for a mirror on /dev/shm, which then took
    /// 0.65 s per GiB against 0.48 s with only the reads marked).
    punt: bool,
}

impl super::engine::Engine for Uring {
    fn opened(&mut self, fd: RawFd) {
        self.punt = !crate::sys::reads_can_be_tried_nowait(fd);
    }

    async fn transfer(
        &self,
        fd: &Arc<OwnedFd>,
        write: bool,
        fua: bool,
        iov: IoVec,
        offset: u64,
    ) -> (i32, IoVec) {
        let fd = fd.as_raw_fd();
        if write {
            let flags = if fua { libc::RWF_DSYNC } else { 0 };
            let (r, v) = op::write_iov(fd, iov, offset, flags).on_storage().await;
            (raw(r), v)
        } else {
            let (r, v) = op::read_iov(fd, iov, offset)
                .on_storage()
                .in_worker_if(self.punt)
                .await;
            (raw(r), v)
        }
    }

    async fn fsync(&self, fd: &Arc<OwnedFd>) -> i32 {
        raw(op::fsync(fd.as_raw_fd(), true)
            .on_storage()
            .await
            .map(|()| 0))
    }

    async fn fallocate(
        &self,
        fd: &Arc<OwnedFd>,
        mode: i32,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        op::fallocate(fd.as_raw_fd(), mode, offset, len)
            .on_storage()
            .await
    }
}
