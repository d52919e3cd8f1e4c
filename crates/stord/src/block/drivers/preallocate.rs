//! `preallocate`: QEMU's filter for file systems where growing a file is slow. A write past
//! the end of the data grows the file by `prealloc-size` more (allocated with fallocate,
//! the end aligned to `prealloc-align`), so the writes after it land in allocated space;
//! the node's size is the end of the data, and the file is cut back to it when the node
//! closes, or resized. As in QEMU it works only while it holds write and resize on its file
//! and shares neither (its idea of the file's end must stay true); otherwise it passes
//! requests through.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use crate::block::driver_def::DriverDef;
use crate::block::drivers::filter::passthrough;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::perm::{Perm, PermError};
use crate::block::node::range_lock::RangeLocks;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::Help;

const MIB: u64 = 1 << 20;

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["preallocate"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node> | ,file.driver=...\n\
                   [,prealloc-align=<size>][,prealloc-size=<size>]",
        about: "writes past the end grow `file` ahead, allocated",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let child = g.child(kv, "file")?;
        let align = kv.take_u64("prealloc-align", true)?.unwrap_or(MIB);
        let size = kv.take_u64("prealloc-size", true)?.unwrap_or(128 * MIB);
        let invalid = |m: String| Err(GraphError::Invalid(m));
        if align % 512 != 0 {
            return invalid(
                "prealloc-align parameter of preallocate filter is not aligned to 512".into(),
            );
        }
        let file_align = u64::from(child.limits().request_alignment.max(1));
        if align % file_align != 0 {
            return invalid(format!(
                "prealloc-align parameter of preallocate filter is not aligned to underlying \
                 node request alignment ({file_align})"
            ));
        }
        let data_end = AtomicU64::new(child.size());
        Ok(Opened {
            read_only: flags.read_only || child.is_read_only(),
            direct: child.direct,
            driver: Box::new(PreallocateDriver {
                child,
                align: align.max(file_align),
                file_align,
                size,
                data_end,
                active: AtomicBool::new(false),
                growing: RangeLocks::default(),
            }),
            bitmaps: Vec::new(),
        })
    },
};

/// The preallocate filter.
pub struct PreallocateDriver {
    child: Arc<BlockNode>,
    align: u64,
    file_align: u64,
    size: u64,
    /// The end of what was written: the node's size (the file may be longer).
    data_end: AtomicU64,
    /// Whether it holds write and resize on the file, sharing neither.
    active: AtomicBool,
    /// One growth at a time.
    growing: RangeLocks,
}

impl PreallocateDriver {
    /// Before a write-type request that ends at `end`: the data's end moved, and the file
    /// grown `size` past it when the request reaches beyond the file (QEMU's handle_write;
    /// a failed growth is left to the write itself, as there).
    async fn before_write(&self, end: u64) {
        if !self.active.load(SeqCst) || end <= self.data_end.load(SeqCst) {
            return;
        }
        let _one = self.growing.lock(0, 1).await;
        self.data_end.fetch_max(end, SeqCst);
        if end <= self.child.size() {
            return;
        }
        let target = (end + self.size).next_multiple_of(self.align);
        let _ = self.child.driver().resize_falloc(target).await;
    }

    /// [`drop_preallocation`](Self::drop_preallocation) once no growth is under way.
    async fn cut_back(&self) -> io::Result<()> {
        let _one = self.growing.lock(0, 1).await;
        self.drop_preallocation().await
    }

    /// Cuts the file back to the data's end (QEMU's preallocate_close); the caller holds
    /// `growing`.
    async fn drop_preallocation(&self) -> io::Result<()> {
        let data_end = self.data_end.load(SeqCst).next_multiple_of(self.file_align);
        if !self.active.load(SeqCst) || self.child.size() <= data_end {
            return Ok(());
        }
        self.child.driver().resize(data_end).await
    }
}

impl BlockDriver for PreallocateDriver {
    passthrough!(child);
    fn driver_name(&self) -> &'static str {
        "preallocate"
    }
    fn size(&self) -> u64 {
        if self.active.load(SeqCst) {
            self.data_end.load(SeqCst)
        } else {
            self.child.size()
        }
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        self.child.driver().read(offset, buf)
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            self.before_write(offset + buf.len() as u64).await;
            self.child.driver().write(offset, buf, fua).await
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            self.before_write(offset + len).await;
            self.child
                .driver()
                .write_zeroes(offset, len, may_unmap)
                .await
        })
    }
    /// The preallocation dropped first, then the file resized (QEMU's
    /// preallocate_co_truncate without `falloc`).
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            let _one = self.growing.lock(0, 1).await;
            self.drop_preallocation().await?;
            self.child.driver().resize(size).await?;
            self.data_end.store(size, SeqCst);
            Ok(())
        })
    }
    fn close(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.cut_back())
    }
    fn inactivate(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            self.child.driver().flush().await?;
            self.cut_back().await
        })
    }
    /// QEMU's preallocate_child_perm: with write and resize from its users it holds both
    /// and shares neither, which is when it preallocates.
    fn child_perms(&self, _role: &'static str, perm: Perm, shared: Perm, _w: bool) -> (Perm, Perm) {
        let wr = Perm::WRITE | Perm::RESIZE;
        if perm & wr == wr {
            (perm | wr, shared & wr.complement())
        } else {
            (perm, shared)
        }
    }
    /// QEMU's preallocate_set_perm: it preallocates from the file's end while its users
    /// hold write and resize (its child then holds both, unshared), and stops when not.
    fn set_perm(&self, perm: Perm, _shared: Perm) -> Result<(), PermError> {
        let wr = Perm::WRITE | Perm::RESIZE;
        if perm & wr != wr {
            self.active.store(false, SeqCst);
        } else if !self.active.swap(true, SeqCst) {
            self.data_end.store(self.child.size(), SeqCst);
        }
        Ok(())
    }
}
