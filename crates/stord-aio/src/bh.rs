//! Bottom halves: callbacks scheduled to run once on the loop's next iteration.
//!
//! Scheduling is idempotent until the callback runs: any number of `schedule()` calls
//! before it runs give one run; a `schedule()` after it started gives another. A `RemoteBh`
//! schedules from any thread and wakes the loop.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Weak;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::context::{Inner, Shared};
use crate::remote::RemoteMsg;
use crate::slab::{Key, Slab};

struct BhSlot {
    cb: Option<Box<dyn FnMut()>>,
    scheduled: Arc<AtomicBool>,
}

#[derive(Default)]
pub(crate) struct BhList {
    slots: RefCell<Slab<BhSlot>>,
    ready: RefCell<VecDeque<Key>>,
}

impl BhList {
    pub(crate) fn add(&self, cb: Box<dyn FnMut()>) -> (Key, Arc<AtomicBool>) {
        let scheduled = Arc::new(AtomicBool::new(false));
        let key = self.slots.borrow_mut().insert(BhSlot {
            cb: Some(cb),
            scheduled: scheduled.clone(),
        });
        (key, scheduled)
    }

    pub(crate) fn remove(&self, key: Key) {
        let removed = self.slots.borrow_mut().remove(key);
        drop(removed);
    }

    pub(crate) fn enqueue(&self, key: Key) {
        self.ready.borrow_mut().push_back(key);
    }

    pub(crate) fn has_ready(&self) -> bool {
        !self.ready.borrow().is_empty()
    }

    /// Runs the bottom halves scheduled so far. Returns how many ran.
    pub(crate) fn run(&self) -> usize {
        let n = self.ready.borrow().len();
        let mut ran = 0;
        for _ in 0..n {
            let Some(key) = self.ready.borrow_mut().pop_front() else {
                break;
            };
            let cb = {
                let mut slots = self.slots.borrow_mut();
                match slots.get_mut(key) {
                    // Clear the flag before the call so the callback may reschedule itself.
                    Some(slot) if slot.scheduled.swap(false, Ordering::AcqRel) => slot.cb.take(),
                    _ => None,
                }
            };
            let Some(mut cb) = cb else { continue };
            cb();
            ran += 1;
            if let Some(slot) = self.slots.borrow_mut().get_mut(key) {
                slot.cb = Some(cb);
            }
        }
        ran
    }

    pub(crate) fn clear(&self) {
        let drained = self.slots.borrow_mut().drain();
        drop(drained);
        self.ready.borrow_mut().clear();
    }
}

/// A bottom half owned by the loop's thread. Dropping it deletes it.
pub struct Bh {
    pub(crate) ctx: Weak<Inner>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) key: Key,
    pub(crate) scheduled: Arc<AtomicBool>,
}

impl Bh {
    /// Schedules the callback for the next iteration (no-op if already scheduled).
    pub fn schedule(&self) {
        if !self.scheduled.swap(true, Ordering::AcqRel) {
            if let Some(ctx) = self.ctx.upgrade() {
                ctx.bhs.enqueue(self.key);
            }
        }
    }

    /// Unschedules it if it has not run yet.
    pub fn cancel(&self) {
        self.scheduled.store(false, Ordering::Release);
    }

    /// A handle that schedules this bottom half from any thread.
    pub fn remote(&self) -> RemoteBh {
        RemoteBh {
            shared: self.shared.clone(),
            key: self.key,
            scheduled: self.scheduled.clone(),
        }
    }
}

impl Drop for Bh {
    fn drop(&mut self) {
        if let Some(ctx) = self.ctx.upgrade() {
            ctx.bhs.remove(self.key);
        }
    }
}

/// Schedules a bottom half from any thread.
#[derive(Clone)]
pub struct RemoteBh {
    shared: Arc<Shared>,
    key: Key,
    scheduled: Arc<AtomicBool>,
}

impl RemoteBh {
    /// Schedules the bottom half and wakes its loop (no-op if already scheduled).
    pub fn schedule(&self) {
        if !self.scheduled.swap(true, Ordering::AcqRel) {
            self.shared.send(RemoteMsg::Bh(self.key));
        }
    }
}
