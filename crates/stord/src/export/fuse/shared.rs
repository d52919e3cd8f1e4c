//! What all of a FUSE export's queues share: the node, the file's attributes, the count of
//! requests in progress (a removal waits for it to drop to zero), and the FUSE over
//! io_uring plan and rings. The request handler, both transports and the export hold it.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use stord_aio::Remote;

use super::proto;
use crate::block::node::link::NodeLink;
use crate::export::DrainSignal;

/// Largest READ we accept (and the mount's max_read).
pub const MAX_READ: u32 = 1 << 20;
/// Largest WRITE the kernel sends us (negotiated in INIT; also the io_uring payload size).
pub const MAX_WRITE: u32 = 128 << 10;

/// Kernel queue ids per IoThread (None: the loop the export was created on).
pub(super) type UringPlan = Vec<(Option<Remote>, Vec<u16>)>;

/// State shared by all of an export's queues.
pub struct FuseShared {
    /// The node served (a pivot may move it).
    pub(super) link: Arc<NodeLink>,
    pub(super) writable: bool,
    /// `writethrough=on`: writes are durable before they complete (FUA).
    pub(super) writethrough: bool,
    pub(super) growable: bool,
    pub(super) allow_other: bool,
    pub(super) mode: AtomicU32,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) max_write: u32,
    /// Requests being processed now (all queues).
    pub(super) in_flight: AtomicUsize,
    /// Woken when `in_flight` drops to zero.
    pub(super) drain: DrainSignal,
    /// The channel is gone (unmounted) or broken: stop reading.
    pub(super) halted: AtomicBool,
    /// The kernel's INIT has been answered.
    pub(super) initialized: AtomicBool,
    /// The export asked for FUSE over io_uring (and the kernel has it enabled).
    pub(super) want_uring: bool,
    /// INIT granted FUSE over io_uring.
    pub(super) uring_granted: AtomicBool,
    /// Which kernel queues (qids) each IoThread serves over io_uring (None: this loop).
    pub(super) uring_plan: Mutex<Option<UringPlan>>,
    /// Rings started, for teardown.
    pub(super) rings: Mutex<Vec<(Option<Remote>, u64)>>,
    /// Requests served through /dev/fuse reads and through io_uring entries.
    pub(super) dev_requests: std::sync::atomic::AtomicU64,
    pub(super) uring_requests: std::sync::atomic::AtomicU64,
}

impl FuseShared {
    /// A request has finished (its reply is written): the last one wakes a removal.
    pub(super) fn request_done(&self) {
        if self.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.drain.wake();
        }
    }

    pub(super) fn request_buf_len(&self) -> usize {
        (self.max_write as usize + 4096).max(proto::FUSE_MIN_READ_BUFFER)
    }

    pub(super) fn allocated_bytes(&self) -> u64 {
        let node = self.link.current();
        node.allocated_bytes().unwrap_or_else(|| node.size())
    }
}
