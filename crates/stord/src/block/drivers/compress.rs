//! `compress`: QEMU's filter that makes every write through it a compressed write of its
//! child, so any export (or a job's target) can write compressed clusters into a qcow2
//! image. Its requests are whole clusters of the child (QEMU's refresh_limits sets the
//! cluster size as its request alignment, and QEMU's generic layer pads the rest): an
//! unaligned write reads the rest of its clusters first, under a lock on them. As in
//! QEMU, a compressed write into a cluster that already has data fails with EIO; reads,
//! write-zeroes and discards pass through.

use std::io;
use std::sync::Arc;

use crate::block::driver_def::DriverDef;
use crate::block::drivers::filter::passthrough;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::limits::BlockLimits;
use crate::block::node::range_lock::RangeLocks;
use crate::block::open::{GraphError, Opened};
use crate::buf::{new_buf, Buf};
use crate::cli::Help;

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["compress"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node> | ,file.driver=...",
        about: "every write to `file` (a qcow2 image) made a compressed write",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let child = g.child(kv, "file")?;
        if !child.supports_compressed_writes() {
            return Err(GraphError::Invalid(format!(
                "Compression is not supported for underlying format: {}",
                child.driver_name()
            )));
        }
        Ok(Opened {
            read_only: flags.read_only || child.is_read_only(),
            direct: child.direct,
            driver: Box::new(CompressDriver {
                child,
                rmw: RangeLocks::default(),
            }),
            bitmaps: Vec::new(),
        })
    },
};

/// The compress filter.
pub struct CompressDriver {
    child: Arc<BlockNode>,
    /// Clusters a padded write fills in, and the writes that overlap them.
    rmw: RangeLocks,
}

impl CompressDriver {
    /// The child's cluster size: the unit of a compressed write.
    fn cluster(&self) -> u64 {
        self.child.driver().cluster_size().unwrap_or(512).max(1)
    }

    /// The clusters that cover `[offset, offset + len)`, the last one cut at the end of
    /// the image (a compressed write may end there).
    fn covering(&self, offset: u64, len: u64) -> (u64, u64) {
        let c = self.cluster();
        let end = (offset + len).next_multiple_of(c).min(self.child.size());
        (offset / c * c, end.max(offset + len))
    }

    /// Writes `buf` at `offset`, padded to whole clusters with what the child holds.
    async fn write_locked(&self, offset: u64, buf: Buf, fua: bool) -> (io::Result<()>, Buf) {
        let (start, end) = self.covering(offset, buf.len() as u64);
        let _lock = self.rmw.lock(start, end).await;
        let (r, buf) = if (start, end) == (offset, offset + buf.len() as u64) {
            self.child.driver().write_compressed(offset, buf).await
        } else {
            let r = self.write_padded(start, end, offset, &buf).await;
            (r, buf)
        };
        match r {
            Ok(()) => (self.fua(fua).await, buf),
            e => (e, buf),
        }
    }

    async fn write_padded(&self, start: u64, end: u64, offset: u64, data: &[u8]) -> io::Result<()> {
        let (r, mut whole) = self
            .child
            .driver()
            .read(start, new_buf((end - start) as usize))
            .await;
        r?;
        let skip = (offset - start) as usize;
        whole[skip..skip + data.len()].copy_from_slice(data);
        self.child.driver().write_compressed(start, whole).await.0
    }

    /// FUA as QEMU's generic layer gives it to a child without: a flush after the write.
    async fn fua(&self, fua: bool) -> io::Result<()> {
        if fua {
            self.child.driver().flush().await
        } else {
            Ok(())
        }
    }
}

impl BlockDriver for CompressDriver {
    passthrough!(child);
    fn driver_name(&self) -> &'static str {
        "compress"
    }
    fn size(&self) -> u64 {
        self.child.size()
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        self.child.driver().read(offset, buf)
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.write_locked(offset, buf, fua))
    }
    fn write_compressed(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.write_locked(offset, buf, false))
    }
    fn supports_compressed_writes(&self) -> bool {
        true
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        self.child.driver().write_zeroes(offset, len, may_unmap)
    }
    fn block_status_costly(&self) -> bool {
        self.child.driver().block_status_costly()
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        self.child.driver().resize(size)
    }
    fn cluster_size(&self) -> Option<u64> {
        self.child.driver().cluster_size()
    }
    /// The child's cluster size, as QEMU's compress_refresh_limits sets it.
    fn refresh_limits(&self, bl: &mut BlockLimits) {
        bl.request_alignment = self.cluster() as u32;
    }
}
