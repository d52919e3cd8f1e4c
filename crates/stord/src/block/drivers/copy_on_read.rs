//! `copy-on-read`: QEMU's filter (libvirt's `<driver copy_on_read='on'/>`) that copies
//! into its child what a read finds in the child's backing chain, so later reads of that
//! range stay in the top image. Only what the chain holds above `bottom` (inclusive) is
//! copied, as QEMU's `cor_co_preadv_part` asks `bdrv_is_allocated_above` first; ranges
//! that are nowhere in the chain read as zeroes and copy nothing. The copy is the child's
//! own [`populate`](BlockDriver::populate), as block-stream uses it: content unchanged.

use std::io;
use std::sync::Arc;

use crate::block::driver_def::DriverDef;
use crate::block::drivers::filter::passthrough;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::perm::Perm;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::Help;

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["copy-on-read"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node> | ,file.driver=...\n\
                   [,bottom=<node>]",
        about: "reads that find data in the backing chain copy it into `file`",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let bottom = kv.take("bottom");
        let child = g.child(kv, "file")?;
        let depth = match &bottom {
            None => u32::MAX,
            Some(name) => bottom_depth(&child, name)
                .ok_or_else(|| GraphError::Invalid(format!("Bottom node '{name}' not found")))?,
        };
        Ok(Opened {
            read_only: flags.read_only || child.is_read_only(),
            direct: child.direct,
            driver: Box::new(CopyOnReadDriver {
                child,
                bottom: depth,
            }),
            bitmaps: Vec::new(),
        })
    },
};

/// How deep `name` lies in the chain below `child` (its backing node is 2), as
/// allocation depths count.
fn bottom_depth(child: &Arc<BlockNode>, name: &str) -> Option<u32> {
    let mut depth = 1;
    let mut node = child.filtered_or_backing();
    while let Some(n) = node {
        depth += 1;
        if n.name == name {
            return Some(depth);
        }
        node = n.filtered_or_backing();
    }
    None
}

/// The copy-on-read filter.
pub struct CopyOnReadDriver {
    child: Arc<BlockNode>,
    /// Extents allocated from depth 2 down to this one are copied.
    bottom: u32,
}

impl CopyOnReadDriver {
    /// Copies into the child the extents of `[offset, offset + len)` its chain holds
    /// below it and not below `bottom`.
    async fn copy_in(&self, offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let (n, depth) = self.child.driver().allocation_depth(at, end - at).await?;
            let n = n.clamp(1, end - at);
            if depth >= 2 && depth <= self.bottom {
                self.child.driver().populate(at, n).await?;
            }
            at += n;
        }
        Ok(())
    }
}

impl BlockDriver for CopyOnReadDriver {
    passthrough!(child);
    fn driver_name(&self) -> &'static str {
        "copy-on-read"
    }
    fn size(&self) -> u64 {
        self.child.size()
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            if !self.child.is_read_only() {
                if let Err(e) = self.copy_in(offset, buf.len() as u64).await {
                    return (Err(e), buf);
                }
            }
            self.child.driver().read(offset, buf).await
        })
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        self.child.driver().write(offset, buf, fua)
    }
    fn write_compressed(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        self.child.driver().write_compressed(offset, buf)
    }
    fn supports_compressed_writes(&self) -> bool {
        self.child.supports_compressed_writes()
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
    /// QEMU's cor_child_perm: the parents' read, write and resize passed on, and
    /// unchanged writes (the copies) asked for and shared.
    fn child_perms(&self, _role: &'static str, perm: Perm, shared: Perm, w: bool) -> (Perm, Perm) {
        let pass = Perm::CONSISTENT_READ | Perm::WRITE | Perm::RESIZE;
        let mut p = perm & pass;
        if w {
            p = p | Perm::WRITE_UNCHANGED;
        }
        (p, (shared & pass) | Perm::WRITE_UNCHANGED)
    }
}
