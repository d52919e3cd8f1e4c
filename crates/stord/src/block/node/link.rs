//! A parent's link to the node it uses, which a graph change can point elsewhere while
//! requests run: QEMU's `BdrvChild` as an export's root (and the pivot of a snapshot, a
//! mirror or an active commit moves it).
//!
//! Every request [`enter`](NodeLink::enter)s the link, gets the node it points to now and
//! finishes on that node, whatever happens to the link meanwhile. A graph change that must
//! see no request half done (a mirror's last copy before its pivot) first
//! [`hold`](NodeLink::hold)s the link: new requests wait at the door, and the hold is
//! granted once those in flight have left (QEMU's drained section). Entering costs two
//! atomic operations on the link's counter and a clone of the node's `Arc`.

use std::future::poll_fn;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Poll, Waker};

use crate::block::node::block_node::BlockNode;

/// Set in [`NodeLink::state`] while someone holds the link.
const HELD: u64 = 1 << 63;

/// See the module docs.
pub struct NodeLink {
    node: RwLock<Arc<BlockNode>>,
    /// Requests inside (low bits) and [`HELD`].
    state: AtomicU64,
    /// Holds granted or being waited for (the bit is set while above zero).
    holders: Mutex<u32>,
    /// Holders waiting for the last request to leave (several may wait at once: a
    /// snapshot's drain and a mirror's pivot).
    drained: Mutex<Vec<Waker>>,
    /// Requests waiting at the door of a held link.
    waiting: Mutex<Vec<Waker>>,
}

/// A request inside a link: the node it runs on (kept even if the link moves).
pub struct Entered<'a> {
    link: &'a NodeLink,
    node: Arc<BlockNode>,
}

impl Deref for Entered<'_> {
    type Target = Arc<BlockNode>;
    fn deref(&self) -> &Arc<BlockNode> {
        &self.node
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        if self.link.state.fetch_sub(1, SeqCst) == HELD | 1 {
            self.link.wake_holders();
        }
    }
}

/// A link held: no request inside, new ones wait until this is dropped.
pub struct Hold {
    link: Arc<NodeLink>,
}

impl Hold {
    /// The link held.
    pub fn link(&self) -> &Arc<NodeLink> {
        &self.link
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut holders = self.link.holders.lock().unwrap_or_else(|e| e.into_inner());
        *holders -= 1;
        if *holders == 0 {
            self.link.state.fetch_and(!HELD, SeqCst);
            drop(holders);
            let waiting =
                std::mem::take(&mut *self.link.waiting.lock().unwrap_or_else(|e| e.into_inner()));
            for w in waiting {
                w.wake();
            }
        }
    }
}

impl NodeLink {
    /// A link to `node`.
    pub fn new(node: Arc<BlockNode>) -> Arc<Self> {
        Arc::new(NodeLink {
            node: RwLock::new(node),
            state: AtomicU64::new(0),
            holders: Mutex::new(0),
            drained: Mutex::new(Vec::new()),
            waiting: Mutex::new(Vec::new()),
        })
    }

    /// The node the link points to now (for queries: a request enters instead).
    pub fn current(&self) -> Arc<BlockNode> {
        self.node.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Enters at once unless the link is held.
    pub fn try_enter(&self) -> Option<Entered<'_>> {
        if self.state.fetch_add(1, SeqCst) & HELD != 0 {
            if self.state.fetch_sub(1, SeqCst) == HELD | 1 {
                self.wake_holders();
            }
            return None;
        }
        Some(Entered {
            link: self,
            node: self.current(),
        })
    }

    /// Enters, waiting while the link is held.
    pub async fn enter(&self) -> Entered<'_> {
        loop {
            if let Some(e) = self.try_enter() {
                return e;
            }
            poll_fn(|cx| {
                let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
                if self.state.load(SeqCst) & HELD == 0 {
                    return Poll::Ready(());
                }
                waiting.push(cx.waker().clone());
                Poll::Pending
            })
            .await;
        }
    }

    /// Holds the link: ready once every request inside has left (new ones wait).
    pub async fn hold(self: &Arc<Self>) -> Hold {
        {
            let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
            *holders += 1;
            self.state.fetch_or(HELD, SeqCst);
        }
        let hold = Hold { link: self.clone() };
        // The waker is registered and the count checked under one lock, which the last
        // request to leave takes after its decrement: no wake-up falls between.
        poll_fn(|cx| {
            let mut waiting = self.drained.lock().unwrap_or_else(|e| e.into_inner());
            if self.state.load(SeqCst) == HELD {
                return Poll::Ready(());
            }
            waiting.push(cx.waker().clone());
            Poll::Pending
        })
        .await;
        hold
    }

    fn wake_holders(&self) {
        let waiting = std::mem::take(&mut *self.drained.lock().unwrap_or_else(|e| e.into_inner()));
        for w in waiting {
            w.wake();
        }
    }

    /// Points the link at `node`; the node it pointed to is given back. Requests inside
    /// finish where they started.
    pub fn repoint(&self, node: Arc<BlockNode>) -> Arc<BlockNode> {
        std::mem::replace(
            &mut *self.node.write().unwrap_or_else(|e| e.into_inner()),
            node,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::drivers::null::test_node as null;

    #[test]
    fn requests_finish_on_the_node_they_entered_and_a_hold_waits_for_them() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        ctx.block_on(async {
            let link = NodeLink::new(null("a"));
            let first = link.enter().await;
            assert_eq!(first.name, "a");
            let old = link.repoint(null("b"));
            assert_eq!(old.name, "a");
            // The request inside still runs on `a`; new ones get `b`.
            assert_eq!(first.name, "a");
            assert_eq!(link.try_enter().unwrap().name, "b");

            let l2 = link.clone();
            let held = std::rc::Rc::new(std::cell::Cell::new(false));
            let h2 = held.clone();
            let holder = stord_aio::spawn(async move {
                let hold = l2.hold().await;
                h2.set(true);
                stord_aio::sleep(std::time::Duration::from_millis(20)).await;
                l2.repoint(null("c"));
                drop(hold);
            });
            stord_aio::yield_now().await;
            // Held but not granted while `first` is inside; newcomers wait at the door.
            assert!(!held.get());
            assert!(link.try_enter().is_none());
            drop(first);
            let next = link.enter().await;
            assert!(held.get());
            assert_eq!(next.name, "c");
            drop(next);
            holder.await;
            assert_eq!(link.state.load(SeqCst), 0);
        });
    }

    #[test]
    fn two_holds_waiting_together_are_both_granted() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        ctx.block_on(async {
            let link = NodeLink::new(null("a"));
            let inside = link.enter().await;
            let (l1, l2) = (link.clone(), link.clone());
            let a = stord_aio::spawn(async move { l1.hold().await });
            let b = stord_aio::spawn(async move { l2.hold().await });
            stord_aio::yield_now().await;
            drop(inside);
            let (ha, hb) = (a.await, b.await);
            assert!(link.try_enter().is_none());
            drop(ha);
            assert!(link.try_enter().is_none());
            drop(hb);
            assert!(link.try_enter().is_some());
        });
    }
}
