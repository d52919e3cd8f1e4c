//! Hooks on a node's requests: what a job runs before a write changes a range, or holds
//! while a read looks at one (a backup's copy-before-write and the point-in-time readers
//! of its target). QEMU inserts a filter node above the source for this; stord calls the
//! hook from the node's own request path instead, so exports and parents stay where they
//! are and nothing moves when the job ends. A node without hooks pays one relaxed load
//! per request.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

use super::future::BoxFut;
use crate::iov::IoVec;

/// Anything a request holds while it runs (a range lock's guard).
pub trait Held {}
impl<T> Held for T {}

/// What a hook holds for one request.
pub type Hold<'a> = Box<dyn Held + 'a>;

/// What a write-like request wrote, for [`NodeHook::after_write`].
#[derive(Clone, Copy)]
pub enum Written<'a> {
    Data(&'a [u8]),
    Iov(&'a IoVec),
    Zeroes { may_unmap: bool },
    Discard,
}

/// A hook on a node's requests.
pub trait NodeHook: Send + Sync {
    /// Runs before `[offset, offset + len)` changes (a write, write-zeroes or discard);
    /// its error fails the request. What it returns is held until the request and
    /// [`after_write`](Self::after_write) are done.
    fn before_write(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<Option<Hold<'_>>>>;
    /// Runs once the request is done (`ok`: it succeeded), before it completes, with
    /// whether this hook held something for it.
    fn after_write<'a>(
        &'a self,
        _offset: u64,
        _len: u64,
        _ok: bool,
        _held: bool,
        _what: Written<'a>,
    ) -> BoxFut<'a, ()> {
        Box::pin(std::future::ready(()))
    }
    /// Runs before a read of `[offset, offset + len)`; what it returns is held until the
    /// read is done.
    fn before_read(&self, _offset: u64, _len: u64) -> BoxFut<'_, Option<Hold<'_>>> {
        Box::pin(std::future::ready(None))
    }
}

/// A node's hooks as they were when a request started.
pub(super) type HookList = Option<Vec<Arc<dyn NodeHook>>>;

/// A node's hooks.
#[derive(Default)]
pub(super) struct Hooks {
    list: RwLock<Vec<Arc<dyn NodeHook>>>,
    any: AtomicBool,
}

impl Hooks {
    /// The hooks now, None when there are none (the common case, without the lock).
    pub(super) fn current(&self) -> HookList {
        if !self.any.load(Relaxed) {
            return None;
        }
        Some(self.list.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

/// Runs every hook's [`NodeHook::before_write`]: what each holds, in order.
pub(super) async fn before_write(
    hooks: &[Arc<dyn NodeHook>],
    offset: u64,
    len: u64,
) -> io::Result<Vec<Option<Hold<'_>>>> {
    let mut held = Vec::new();
    for h in hooks {
        held.push(h.before_write(offset, len).await?);
    }
    Ok(held)
}

/// Runs every hook's [`NodeHook::after_write`].
pub(super) async fn after_write(
    hooks: &[Arc<dyn NodeHook>],
    held: &[Option<Hold<'_>>],
    (offset, len): (u64, u64),
    ok: bool,
    what: Written<'_>,
) {
    for (h, hold) in hooks.iter().zip(held) {
        h.after_write(offset, len, ok, hold.is_some(), what).await;
    }
}

impl Hooks {
    pub(super) fn add(&self, h: Arc<dyn NodeHook>) {
        let mut list = self.list.write().unwrap_or_else(|e| e.into_inner());
        list.push(h);
        self.any.store(true, Relaxed);
    }

    pub(super) fn remove(&self, h: &Arc<dyn NodeHook>) {
        let mut list = self.list.write().unwrap_or_else(|e| e.into_inner());
        list.retain(|x| !std::ptr::addr_eq(Arc::as_ptr(x), Arc::as_ptr(h)));
        self.any.store(!list.is_empty(), Relaxed);
    }
}
