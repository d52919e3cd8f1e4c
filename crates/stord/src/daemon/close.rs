//! Closing a node from the main loop, bounded: its caches written back and its persistent
//! bitmaps stored, but storage that does not answer does not hold the monitor.

use std::sync::Arc;

use crate::block::node::block_node::BlockNode;

/// Closes a node from the main thread, waiting for it (its persistent bitmaps are written
/// to its image) at most [`CLOSE_LIMIT`].
pub(super) fn close_now(node: &Arc<BlockNode>) {
    let n = node.clone();
    match crate::block::helper_thread::block_on_helper_within(CLOSE_LIMIT, move || async move {
        n.close().await
    }) {
        Some(Ok(Ok(()))) => {}
        Some(Ok(Err(e)) | Err(e)) => tracing::warn!("closing node '{}' failed: {e}", node.name),
        None => tracing::warn!(
            "node '{}' did not close within {CLOSE_LIMIT:?} (its storage does not answer); \
             going on without it",
            node.name
        ),
    }
}

/// How long deleting a node waits for its close (caches written back, flushed): storage
/// that does not answer (a Ceph OSD down, an NBD server gone) must not hold the monitor.
const CLOSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);
