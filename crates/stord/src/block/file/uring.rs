//! `aio=io_uring`: each request goes on the issuing IoThread's own ring.
//!
//! The SQE is queued when the request's future is first polled and submitted with the rest
//! of the loop iteration's batch, so many requests cost one io_uring_enter.

use std::io;
use std::os::fd::RawFd;

use stord_aio::op;

use crate::block::IoVec;

fn raw(r: io::Result<usize>) -> i32 {
    r.map_or_else(|e| -super::errno(&e), |n| n as i32)
}

/// One read or write of what `iov` shows at `offset`; the raw result.
pub(super) async fn transfer(
    fd: RawFd,
    write: bool,
    fua: bool,
    iov: IoVec,
    offset: u64,
) -> (i32, IoVec) {
    if write {
        let flags = if fua { libc::RWF_DSYNC } else { 0 };
        let (r, v) = op::write_iov(fd, iov, offset, flags).await;
        (raw(r), v)
    } else {
        let (r, v) = op::read_iov(fd, iov, offset).await;
        (raw(r), v)
    }
}

/// fdatasync on the ring.
pub(super) async fn fsync(fd: RawFd) -> i32 {
    raw(op::fsync(fd, true).await.map(|()| 0))
}
