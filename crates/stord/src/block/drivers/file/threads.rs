//! `aio=threads`: each read and write a job for the IoThread's worker pool
//! ([`crate::block::worker_pool`]), doing preadv/pwritev2.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use stord_aio::IoVecs;

use super::engine::Engine;
use crate::block::worker_pool::run;
use crate::iov::IoVec;

/// The thread-pool engine: preadv / pwritev2 on the IoThread's workers.
pub(crate) struct Threads;

impl Engine for Threads {
    /// One preadv or pwritev2 (with RWF_DSYNC for FUA) of what `iov` shows.
    fn transfer(
        &self,
        fd: &Arc<OwnedFd>,
        write: bool,
        fua: bool,
        iov: IoVec,
        offset: u64,
    ) -> impl std::future::Future<Output = (i32, IoVec)> {
        let fd = fd.clone();
        run(move || {
            let raw = fd.as_raw_fd();
            let res = if write {
                let flags = if fua { libc::RWF_DSYNC } else { 0 };
                // SAFETY: the iovecs name memory `iov` keeps valid; this closure owns `iov`.
                unsafe { stord_aio::sys::blocking::pwritev(raw, iov.iovecs(), offset, flags) }
            } else {
                // SAFETY: as above, and the memory is writable (IoVecsMut).
                unsafe { stord_aio::sys::blocking::preadv(raw, iov.iovecs(), offset, 0) }
            };
            (res, iov)
        })
    }
}
