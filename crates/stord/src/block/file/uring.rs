//! `aio=io_uring`: each request goes on the issuing IoThread's own ring.
//!
//! The SQE is queued when the request's future is first polled and submitted with the rest
//! of the loop iteration's batch, so many requests cost one io_uring_enter.

use std::io;
use std::os::fd::RawFd;

use stord_aio::{op, Slice};

use crate::block::Buf;

fn raw(r: io::Result<usize>) -> i32 {
    match r {
        Ok(n) => n as i32,
        Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
    }
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
    if write && fua {
        let (r, mut v) = op::writev_flags(fd, vec![slice], offset, libc::RWF_DSYNC).await;
        (raw(r), v.pop().expect("one buffer").into_inner())
    } else if write {
        let (r, s) = op::write(fd, slice, offset).await;
        (raw(r), s.into_inner())
    } else {
        let (r, s) = op::read(fd, slice, offset).await;
        (raw(r), s.into_inner())
    }
}

/// fdatasync on the ring.
pub(super) async fn fsync(fd: RawFd) -> i32 {
    match op::fsync(fd, true).await {
        Ok(()) => 0,
        Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
    }
}
