//! `aio=io_uring`: each request goes on the issuing IoThread's own ring.
//!
//! The SQE is queued when the request's future is first polled and submitted with the rest
//! of the loop iteration's batch, so many requests cost one io_uring_enter. Every
//! operation is marked `on_storage`, so the loop's polling learns the device's latency
//! apart from its clients' turnaround.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use stord_aio::op;

use crate::block::IoVec;

fn raw(r: io::Result<usize>) -> i32 {
    r.map_or_else(|e| -super::errno(&e), |n| n as i32)
}

/// The io_uring engine: requests, flushes and fallocate on the issuing IoThread's ring.
pub(crate) struct Uring;

impl super::Engine for Uring {
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
            let (r, v) = op::read_iov(fd, iov, offset).on_storage().await;
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
