//! `aio=io_uring`: each request goes on the issuing IoThread's own ring.
//!
//! The SQE is queued when the request's future is first polled and submitted with the rest
//! of the loop iteration's batch, so many requests cost one io_uring_enter.

use std::io;
use std::os::fd::RawFd;

use stord_aio::{op, Slice};

use crate::block::Buf;

fn raw(r: io::Result<usize>) -> i32 {
    r.map_or_else(|e| -super::errno(&e), |n| n as i32)
}

/// One read or write of `buf[start..]` at `offset`; the raw result.
pub(super) async fn transfer(
    fd: RawFd,
    write: bool,
    fua: bool,
    buf: Buf,
    start: usize,
    offset: u64,
) -> (i32, Buf) {
    let end = buf.len();
    let slice = Slice::new(buf, start, end);
    if write {
        let flags = if fua { libc::RWF_DSYNC } else { 0 };
        let (r, s) = op::write_flags(fd, slice, offset, flags).await;
        (raw(r), s.into_inner())
    } else {
        let (r, s) = op::read(fd, slice, offset).await;
        (raw(r), s.into_inner())
    }
}

/// fdatasync on the ring.
pub(super) async fn fsync(fd: RawFd) -> i32 {
    raw(op::fsync(fd, true).await.map(|()| 0))
}
