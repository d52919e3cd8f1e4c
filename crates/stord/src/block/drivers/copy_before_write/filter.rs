//! The `copy-before-write` filter node (QEMU's, as libvirt's newer fleecing and its
//! tests use it): reads pass to `file`; a write, write-zeroes or discard first has the
//! old content of its clusters copied to `target` ([`super::block_copy`]), so
//! `target` and a `snapshot-access` node above this one ([`crate::block::drivers::snapshot_access`]) keep
//! `file` as it was when the node opened. `on-cbw-error=break-snapshot` lets the write
//! through when a copy fails and loses the view instead of failing the guest's write.

use std::io;
use std::sync::Arc;

use super::block_copy::{reads_through, CopyBeforeWrite, PointInTimeReads, Unallocated};
use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::hook_on::HookOn;
use crate::block::node::perm::Perm;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::Help;
use crate::iov::IoVec;

/// QEMU's BLOCK_COPY_CLUSTER_SIZE_DEFAULT.
const DEFAULT_CLUSTER: u64 = 64 << 10;

pub const DRIVER: DriverDef = DriverDef {
    names: &["copy-before-write"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node>,target=<node>\n\
                   [,on-cbw-error=break-guest-write|break-snapshot][,min-cluster-size=<bytes>]",
        about: "a filter that first copies what a write changes from file to\n\
                target: target keeps file as it was when the node opened",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let file = g.child(kv, "file")?;
        let target = g.child(kv, "target")?;
        if kv.take_prefixed("bitmap").is_some() || kv.take("bitmap").is_some() {
            return Err(GraphError::Invalid(
                "copy-before-write: 'bitmap' is not supported by stord yet".into(),
            ));
        }
        let break_snapshot = kv
            .take_choice("on-cbw-error", &["break-guest-write", "break-snapshot"])?
            .is_some_and(|v| v == "break-snapshot");
        if kv.take_u64("cbw-timeout", false)?.unwrap_or(0) != 0 {
            return Err(GraphError::Invalid(
                "copy-before-write: 'cbw-timeout' is not supported by stord yet".into(),
            ));
        }
        let min = kv.take_u64("min-cluster-size", true)?.unwrap_or(0);
        if min != 0 && !min.is_power_of_two() {
            return Err(GraphError::Invalid(
                "min-cluster-size needs to be a power of 2".into(),
            ));
        }
        if target.size() != file.size() {
            return Err(GraphError::Invalid(
                "Source and target image have different sizes".into(),
            ));
        }
        let cluster = target
            .driver()
            .cluster_size()
            .unwrap_or(0)
            .max(min)
            .max(DEFAULT_CLUSTER);
        let state = Arc::new(CopyBeforeWrite::new(
            file.clone(),
            target.clone(),
            cluster,
            Unallocated::Copy,
        ));
        state.mark(0, file.size());
        if break_snapshot {
            state.set_break_on_error();
        }
        // A target that reads through to the file (QEMU's older fleecing, the target
        // backed by it): its reads hold what is still to be copied, as a backup's.
        let target_reads = reads_through(&target, &file)
            .then(|| HookOn::install(&target, Arc::new(PointInTimeReads(state.clone()))));
        Ok(Opened {
            read_only: flags.read_only || file.is_read_only(),
            direct: file.direct,
            bitmaps: Vec::new(),
            driver: Box::new(CbwDriver {
                file,
                target,
                state,
                break_snapshot,
                _target_reads: target_reads,
            }),
        })
    },
};

/// See the module docs.
pub struct CbwDriver {
    file: Arc<BlockNode>,
    target: Arc<BlockNode>,
    state: Arc<CopyBeforeWrite>,
    break_snapshot: bool,
    /// The read hook on a target that reads through to the file, while the node lasts.
    _target_reads: Option<HookOn>,
}

impl CbwDriver {
    /// The copy before a change of `[offset, offset + len)`: its error fails the change,
    /// or (break-snapshot) loses the view and lets the change through.
    async fn before(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.state.copy(offset, len).await {
            Ok(()) => Ok(()),
            // The view was marked lost under the copy's hold.
            Err(_) if self.break_snapshot => Ok(()),
            Err(e) => Err(e.error),
        }
    }
}

impl CbwDriver {
    /// The point-in-time view it keeps (what `snapshot-access` reads).
    pub fn view(&self) -> &Arc<CopyBeforeWrite> {
        &self.state
    }
}

impl BlockDriver for CbwDriver {
    fn driver_name(&self) -> &'static str {
        "copy-before-write"
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.file.read(offset, buf))
    }
    fn readv(&self, offset: u64, iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(self.file.readv(offset, iov))
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            if let Err(e) = self.before(offset, buf.len() as u64).await {
                return (Err(e), buf);
            }
            self.file.write(offset, buf, fua).await
        })
    }
    fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(async move {
            if let Err(e) = self.before(offset, iov.len() as u64).await {
                return (Err(e), iov);
            }
            self.file.writev(offset, iov, fua).await
        })
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.file.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            self.before(offset, len).await?;
            self.file.discard(offset, len).await
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            self.before(offset, len).await?;
            self.file.write_zeroes(offset, len, may_unmap).await
        })
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(self.file.block_status(offset, len))
    }
    /// The copy keeps the size it started with, as QEMU's filter refuses resizes.
    fn resize(&self, _size: u64) -> BoxFut<'_, io::Result<()>> {
        crate::block::node::future::unsupported_fut()
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<(u64, u32)>> {
        Box::pin(self.file.allocation_depth(offset, len))
    }
    fn filename(&self) -> Option<String> {
        self.file.filename()
    }
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        vec![("file", self.file.clone()), ("target", self.target.clone())]
    }
    /// As QEMU's cbw_child_perm: the file's users are the filter's (and it reads the old
    /// data), nobody else may write or resize it under the copy; the target is written,
    /// others may do anything but resize it.
    fn child_perms(
        &self,
        role: &'static str,
        perm: Perm,
        shared: Perm,
        _writable: bool,
    ) -> (Perm, Perm) {
        if role == "target" {
            return (Perm::WRITE, Perm::ALL & Perm::RESIZE.complement());
        }
        (
            perm | Perm::CONSISTENT_READ,
            shared & (Perm::WRITE | Perm::RESIZE).complement(),
        )
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
