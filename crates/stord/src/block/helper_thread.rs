//! Block requests run to completion off the loops: on a short-lived thread with a loop of
//! its own (a node being opened reads its image; a close that may hang is bounded), and
//! the count of closes still running when the process leaves.

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Runs a block request future to completion from code that is not on a loop, or
/// that may not wait inside its own (a node being opened reads its image): on a short-lived
/// thread with a loop of its own, as every driver can serve requests from any thread.
pub fn block_on_helper<T, F>(make: impl FnOnce() -> F + Send + 'static) -> io::Result<T>
where
    T: Send + 'static,
    F: Future<Output = T> + 'static,
{
    std::thread::Builder::new()
        .name("stord-open".into())
        .spawn(move || {
            let ctx = stord_aio::AioContext::new(Default::default())?;
            Ok(ctx.block_on(make()))
        })?
        .join()
        .map_err(|_| io::Error::other("the open thread panicked"))?
}

/// Closes running on threads of their own (a node's close past its bound, an rbd image's
/// `rbd_close`): while any runs, the process must not run its exit handlers (see
/// [`closes_pending`]).
static CLOSES_PENDING: AtomicU64 = AtomicU64::new(0);

/// A close running on a thread of its own; counted until dropped.
pub(crate) struct PendingClose(());

impl PendingClose {
    pub(crate) fn new() -> Self {
        CLOSES_PENDING.fetch_add(1, Relaxed);
        PendingClose(())
    }
}

impl Drop for PendingClose {
    fn drop(&mut self) {
        CLOSES_PENDING.fetch_sub(1, Relaxed);
    }
}

/// Closes still running on threads of their own (storage that does not answer): the
/// process leaves without exit handlers while there are any.
pub fn closes_pending() -> u64 {
    CLOSES_PENDING.load(Relaxed)
}

/// As [`block_on_helper`], waiting at most `limit`: None if the helper had not finished by
/// then (it goes on by itself, counted in [`closes_pending`]; what it holds is released
/// when it ends).
pub fn block_on_helper_within<T, F>(
    limit: std::time::Duration,
    make: impl FnOnce() -> F + Send + 'static,
) -> Option<io::Result<T>>
where
    T: Send + 'static,
    F: Future<Output = T> + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("stord-close".into())
        .spawn(move || {
            let _pending = PendingClose::new();
            let r = stord_aio::AioContext::new(Default::default()).map(|ctx| ctx.block_on(make()));
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return Some(Err(e));
    }
    match rx.recv_timeout(limit) {
        Ok(r) => Some(r),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Some(Err(io::Error::other("the helper thread panicked")))
        }
    }
}
