//! A node move seen: whether a job's node was moved to another IoThread since its loop
//! started on the old one ([`Stay`]), which tells the loop to hand back its place and go
//! on where the node went.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;

use crate::block::node::block_node::BlockNode;

/// Whether a job's node was moved to another IoThread since its loop started there: the
/// loop then stops starting copies, settles those in flight and hands back its place, to
/// go on where the node went. Once seen, a move stays seen (the clones share it), even if
/// the node comes straight back: the loop that saw it is on its way out.
#[derive(Clone)]
pub struct Stay {
    node: Arc<BlockNode>,
    pub(super) home: Option<String>,
    seen: Arc<AtomicBool>,
}

impl Stay {
    pub(super) fn new(node: &Arc<BlockNode>) -> Self {
        Stay {
            node: node.clone(),
            home: node.home(),
            seen: Arc::default(),
        }
    }

    pub fn moved(&self) -> bool {
        if self.seen.load(SeqCst) {
            return true;
        }
        let moved = self.node.home() != self.home;
        if moved {
            self.seen.store(true, SeqCst);
        }
        moved
    }

    /// Whether the loop runs on IoThread `id` (the node's home when it started).
    pub fn on(&self, id: &str) -> bool {
        self.home.as_deref() == Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_once_seen_stays_seen() {
        let node = crate::block::drivers::null::test_node("n");
        node.set_home(Some("io1".into()));
        let stay = Stay::new(&node);
        let kept = stay.clone();
        assert!(!stay.moved() && stay.on("io1"));
        node.set_home(Some("io2".into()));
        assert!(stay.moved());
        // Straight back: the loop that saw the move is already on its way out.
        node.set_home(Some("io1".into()));
        assert!(stay.moved() && kept.moved());
    }
}
