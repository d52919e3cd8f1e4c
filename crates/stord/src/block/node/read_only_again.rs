//! Nodes a job made writable for its life, made read-only again when it ends.

use std::sync::Arc;

use super::block_node::BlockNode;

/// Nodes a job made writable for its life (a commit's base, reopened read-write as QEMU
/// reopens it): made read-only again, top first, when it is dropped, unless
/// [`keep`](Self::keep) was called (an active commit that pivoted: the base is the active
/// layer now).
#[derive(Default)]
pub struct ReadOnlyAgain(Vec<Arc<BlockNode>>);

impl ReadOnlyAgain {
    /// `nodes`, top first.
    pub fn new(nodes: Vec<Arc<BlockNode>>) -> Self {
        Self(nodes)
    }

    /// They stay writable.
    pub fn keep(&mut self) {
        self.0.clear();
    }
}

impl Drop for ReadOnlyAgain {
    fn drop(&mut self) {
        let nodes = std::mem::take(&mut self.0);
        if nodes.is_empty() {
            return;
        }
        let back = async move {
            // Flushed first, as QEMU's reopen to read-only: nothing cached stays behind
            // for a later write without the write lock.
            if let Some(top) = nodes.first() {
                if let Err(e) = top.flush().await {
                    tracing::warn!("node '{}': flush before going read-only: {e}", top.name);
                }
            }
            for n in &nodes {
                n.set_read_only(true);
                // What it takes of its children shrinks with it (a format node's write lock).
                let _ = n.refresh_perms();
            }
        };
        if stord_aio::with_current_context(|_| ()).is_some() {
            stord_aio::spawn_detached(back);
        }
    }
}
