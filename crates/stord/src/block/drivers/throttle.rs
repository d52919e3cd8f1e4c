//! The `throttle` filter node (QEMU's): its child's requests, admitted by the
//! `throttle-group` object it names ([`crate::block::throttle_group`]).

use std::io;
use std::sync::Arc;

use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::open::{GraphError, Opened};
use crate::block::throttle_group::ThrottleGroup;
use crate::buf::Buf;
use crate::cli::Help;
use crate::iov::IoVec;

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["throttle"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "throttle-group=<id>\n\
                   ,file=<node> | ,file.driver=...",
        about: "the limits of an --object throttle-group over its child `file`",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let id = kv.take_required("throttle-group")?;
        let Some(group) = g.throttle_group(&id) else {
            return Err(GraphError::Invalid(format!(
                "{}: throttle group '{id}' does not exist",
                kv.what
            )));
        };
        let child = g.child(kv, "file")?;
        Ok(Opened {
            read_only: flags.read_only || child.is_read_only(),
            direct: child.direct,
            driver: Box::new(ThrottleDriver::new(child, group)),
            bitmaps: Vec::new(),
        })
    },
};

/// The `throttle` filter: its child's requests, admitted by a group.
pub struct ThrottleDriver {
    child: Arc<BlockNode>,
    group: Arc<ThrottleGroup>,
}

impl ThrottleDriver {
    /// A filter over `child` in `group`.
    pub fn new(child: Arc<BlockNode>, group: Arc<ThrottleGroup>) -> Self {
        Self { child, group }
    }
}

impl BlockDriver for ThrottleDriver {
    /// Nothing of its own is read-only: its child is reopened by the caller.
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn no_flush(&self) -> bool {
        self.child.driver().no_flush()
    }
    fn driver_name(&self) -> &'static str {
        "throttle"
    }
    fn is_filter(&self) -> bool {
        true
    }
    fn size(&self) -> u64 {
        self.child.size()
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            self.group.admit(false, buf.len() as u64).await;
            self.child.driver().read(offset, buf).await
        })
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            self.group.admit(true, buf.len() as u64).await;
            self.child.driver().write(offset, buf, fua).await
        })
    }
    /// As QEMU's throttle_co_pwritev_compressed: throttled as a write, then passed on.
    fn write_compressed(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            self.group.admit(true, buf.len() as u64).await;
            self.child.driver().write_compressed(offset, buf).await
        })
    }
    fn supports_compressed_writes(&self) -> bool {
        self.child.supports_compressed_writes()
    }
    fn readv(&self, offset: u64, iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(async move {
            self.group.admit(false, iov.len() as u64).await;
            self.child.driver().readv(offset, iov).await
        })
    }
    fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(async move {
            self.group.admit(true, iov.len() as u64).await;
            self.child.driver().writev(offset, iov, fua).await
        })
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        self.child.driver().flush()
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            // Counted as one write operation; its length moves no data.
            self.group.admit(true, 0).await;
            self.child.driver_discard(offset, len).await
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            self.group.admit(true, 0).await;
            self.child
                .driver()
                .write_zeroes(offset, len, may_unmap)
                .await
        })
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        self.child.driver().block_status(offset, len)
    }
    fn block_status_costly(&self) -> bool {
        self.child.driver().block_status_costly()
    }
    fn block_status_cached(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        self.child.driver().block_status_cached(offset, len)
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<(u64, u32)>> {
        self.child.driver().allocation_depth(offset, len)
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        self.child.driver().resize(size)
    }
    fn filename(&self) -> Option<String> {
        self.child.filename()
    }
    fn allocated_bytes(&self) -> Option<u64> {
        self.child.allocated_bytes()
    }
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        vec![("file", self.child.clone())]
    }
    fn passes_through(&self) -> Option<(&Arc<BlockNode>, u64)> {
        Some((&self.child, 0))
    }
}
