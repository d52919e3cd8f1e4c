//! Op blockers: a job marks the nodes it works on busy, and other jobs and graph changes
//! on them are refused with QEMU's message ("Node 'x' is busy: ...") until the job ends.
//! Permissions say who may read, write or resize; a blocker says nobody may restructure.

use std::sync::Arc;

use crate::block::node::block_node::BlockNode;

/// Why an operation on a node was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("Node '{node}' is busy: {reason}")]
pub struct Busy {
    pub node: String,
    pub reason: String,
}

/// A node marked busy; the mark goes when this is dropped.
pub struct Blocker {
    node: Arc<BlockNode>,
}

impl Drop for Blocker {
    fn drop(&mut self) {
        *self.node.blocked.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

impl BlockNode {
    /// Refused while a job has the node (QEMU's bdrv_op_is_blocked).
    pub fn check_not_busy(&self) -> Result<(), Busy> {
        match &*self.blocked.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(reason) => Err(Busy {
                node: self.name.clone(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Marks the node busy for `reason` (refused if it already is).
    pub fn block_ops(self: &Arc<Self>, reason: String) -> Result<Blocker, Busy> {
        let mut b = self.blocked.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = &*b {
            return Err(Busy {
                node: self.name.clone(),
                reason: r.clone(),
            });
        }
        *b = Some(reason);
        Ok(Blocker { node: self.clone() })
    }
}

/// A job's attachment to the node it runs on (QEMU gives the job a BlockBackend there,
/// so the node is no longer a root node while the job lasts).
pub struct JobAttachment {
    node: Arc<BlockNode>,
    filtered: bool,
}

impl Drop for JobAttachment {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.node.jobs_attached.fetch_sub(1, Relaxed);
        if self.filtered {
            self.node.jobs_filtered.fetch_sub(1, Relaxed);
        }
    }
}

impl BlockNode {
    /// Attaches a job to the node until the attachment is dropped.
    pub fn attach_job(self: &Arc<Self>) -> JobAttachment {
        self.jobs_attached
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        JobAttachment {
            node: self.clone(),
            filtered: false,
        }
    }

    /// As [`BlockNode::attach_job`], for a job that reaches the node through a filter it
    /// puts above it (QEMU's mirror_top and copy-before-write): no BlockBackend of the job
    /// sits on the node itself.
    pub fn attach_job_through_filter(self: &Arc<Self>) -> JobAttachment {
        let mut a = self.attach_job();
        a.filtered = true;
        self.jobs_filtered
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        a
    }

    /// Whether a job's BlockBackend sits on the node itself (QEMU's bdrv_has_blk, for
    /// jobs).
    pub fn has_job_backend(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.jobs_attached.load(Relaxed) > self.jobs_filtered.load(Relaxed)
    }

    /// Whether a job runs on the node.
    pub fn has_job(&self) -> bool {
        self.jobs_attached
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_busy_while_blocked_and_free_after() {
        let n = Arc::new(BlockNode::new(
            "n".into(),
            Box::new(crate::block::drivers::null::NullDriver::new(1 << 20, false)),
            false,
            false,
        ));
        n.check_not_busy().unwrap();
        let b = n
            .block_ops("block device is in use by block job: stream".into())
            .unwrap();
        let e = n.check_not_busy().unwrap_err();
        assert_eq!(
            e.to_string(),
            "Node 'n' is busy: block device is in use by block job: stream"
        );
        assert!(n.block_ops("again".into()).is_err());
        drop(b);
        n.check_not_busy().unwrap();
    }
}
