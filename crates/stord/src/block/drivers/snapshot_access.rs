//! The `snapshot-access` node (QEMU's): the point-in-time view a `copy-before-write`
//! node keeps, read-only, for an NBD export to serve while the guest writes (libvirt's
//! fleecing without a backing link). Reads and block status come from the source where a
//! cluster is still to be copied (held against the copy) and from the target elsewhere;
//! a discard gives clusters up (they are not copied any more). Writes are refused, as
//! QEMU's.

use std::io;
use std::sync::Arc;

use crate::block::driver_def::DriverDef;
use crate::block::drivers::copy_before_write::block_copy::CopyBeforeWrite;
use crate::block::drivers::copy_before_write::filter::CbwDriver;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::perm::Perm;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::Help;

pub const DRIVER: DriverDef = DriverDef {
    names: &["snapshot-access"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "file=<copy-before-write node>",
        about: "the point-in-time view a copy-before-write node keeps, read-only",
    },
    create: None,
    amend: None,
    open: |g, kv, _flags| {
        let file = g.child(kv, "file")?;
        let cbw = file
            .driver()
            .as_any()
            .and_then(|d| d.downcast_ref::<CbwDriver>());
        let Some(view) = cbw.map(|d| d.view().clone()) else {
            return Err(GraphError::Invalid(format!(
                "snapshot-access: '{}' is not a copy-before-write node",
                file.name
            )));
        };
        Ok(Opened {
            read_only: false,
            direct: file.direct,
            bitmaps: Vec::new(),
            driver: Box::new(SnapshotAccess { file, view }),
        })
    },
};

/// See the module docs.
pub struct SnapshotAccess {
    file: Arc<BlockNode>,
    view: Arc<CopyBeforeWrite>,
}

impl BlockDriver for SnapshotAccess {
    fn driver_name(&self) -> &'static str {
        "snapshot-access"
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn read(&self, offset: u64, mut buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            match self.view.read_snapshot(offset, buf.len() as u64).await {
                Ok(data) => {
                    buf.copy_from_slice(&data);
                    (Ok(()), buf)
                }
                Err(e) => (Err(e), buf),
            }
        })
    }
    fn write(&self, _offset: u64, buf: Buf, _fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(std::future::ready((
            Err(io::Error::from_raw_os_error(libc::ENOTSUP)),
            buf,
        )))
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.view.discard_snapshot(offset, len))
    }
    fn write_zeroes(&self, _o: u64, _l: u64, _m: bool) -> BoxFut<'_, io::Result<()>> {
        crate::block::node::future::unsupported_fut()
    }
    fn resize(&self, _size: u64) -> BoxFut<'_, io::Result<()>> {
        crate::block::node::future::unsupported_fut()
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(self.view.snapshot_status(offset, len))
    }
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        vec![("file", self.file.clone())]
    }
    /// As QEMU's snapshot_access_child_perm: nothing taken (it reads the view through
    /// the filter's own API), everything shared.
    fn child_perms(&self, _role: &'static str, _p: Perm, _s: Perm, _w: bool) -> (Perm, Perm) {
        (Perm::NONE, Perm::ALL)
    }
}
