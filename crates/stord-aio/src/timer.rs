//! Timers with nanosecond deadlines on the monotonic clock.
//!
//! A binary heap ordered by (deadline, id); ids increase, so timers with equal deadlines
//! fire in the order they were added. Cancelling removes the callback; its heap entry is
//! skipped when it comes up.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// Identifies a timer for cancellation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TimerId(u64);

#[derive(Default)]
pub(crate) struct TimerList {
    heap: BinaryHeap<Reverse<(u64, u64)>>,
    callbacks: HashMap<u64, Box<dyn FnOnce()>>,
    next_id: u64,
}

impl TimerList {
    pub(crate) fn add(&mut self, deadline_ns: u64, cb: Box<dyn FnOnce()>) -> TimerId {
        let id = self.next_id;
        self.next_id += 1;
        self.heap.push(Reverse((deadline_ns, id)));
        self.callbacks.insert(id, cb);
        TimerId(id)
    }

    pub(crate) fn cancel(&mut self, id: TimerId) -> bool {
        self.callbacks.remove(&id.0).is_some()
    }

    /// The earliest live deadline.
    pub(crate) fn next_deadline(&mut self) -> Option<u64> {
        while let Some(Reverse((deadline, id))) = self.heap.peek() {
            if self.callbacks.contains_key(id) {
                return Some(*deadline);
            }
            self.heap.pop();
        }
        None
    }

    /// Removes and returns the next callback due at `now`, if any.
    pub(crate) fn pop_expired(&mut self, now: u64) -> Option<Box<dyn FnOnce()>> {
        loop {
            let Reverse((deadline, id)) = *self.heap.peek()?;
            if deadline > now {
                return None;
            }
            self.heap.pop();
            if let Some(cb) = self.callbacks.remove(&id) {
                return Some(cb);
            }
        }
    }

    pub(crate) fn clear(&mut self) {
        self.heap.clear();
        self.callbacks.clear();
    }
}

#[derive(Default)]
struct SleepState {
    fired: bool,
    waker: Option<Waker>,
}

/// Future returned by [`crate::sleep_until`]: completes at its deadline.
pub struct Sleep {
    deadline_ns: u64,
    state: Rc<RefCell<SleepState>>,
    timer: Option<TimerId>,
}

impl Sleep {
    pub(crate) fn new(deadline_ns: u64) -> Self {
        Self {
            deadline_ns,
            state: Rc::default(),
            timer: None,
        }
    }
}

impl Future for Sleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.state.borrow().fired {
            return Poll::Ready(());
        }
        self.state.borrow_mut().waker = Some(cx.waker().clone());
        if self.timer.is_none() {
            let state = self.state.clone();
            let id = crate::context::with_current(|c| {
                c.add_timer_at(self.deadline_ns, move || {
                    let mut s = state.borrow_mut();
                    s.fired = true;
                    if let Some(w) = s.waker.take() {
                        w.wake();
                    }
                })
            });
            self.timer = Some(id);
        }
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(id) = self.timer {
            if !self.state.borrow().fired {
                crate::context::try_with_current(|c| c.cancel_timer(id));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_in_deadline_order_then_insertion_order() {
        let order = Rc::new(RefCell::new(Vec::new()));
        let mut t = TimerList::default();
        for (d, tag) in [(30, "c"), (10, "a"), (20, "b1"), (20, "b2")] {
            let o = order.clone();
            t.add(d, Box::new(move || o.borrow_mut().push(tag)));
        }
        let x = t.add(15, Box::new(|| panic!("cancelled timer fired")));
        assert!(t.cancel(x));
        assert_eq!(t.next_deadline(), Some(10));
        while let Some(cb) = t.pop_expired(25) {
            cb();
        }
        assert_eq!(*order.borrow(), vec!["a", "b1", "b2"]);
        assert_eq!(t.next_deadline(), Some(30));
    }
}
