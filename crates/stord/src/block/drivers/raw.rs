//! The `raw` format driver: a node over a child node (its `file`), optionally a window of
//! it (`offset`, `size`), as QEMU's raw format.
//!
//! It is the first layer of the block graph, so it sets the rule every layer follows:
//! a request goes to the child's driver with its offset shifted and nothing else, no copy
//! and no future of its own (the child's future is returned as it is).

use std::io;
use std::sync::Arc;

use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::keyval::KeyVal;
use crate::cli::Help;
use crate::iov::IoVec;

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["raw"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node>
\
                   | file.driver=<driver>,file.<option>=...
\
                   [,offset=<bytes>][,size=<bytes>]",
        about: "the raw format over its child `file` (named or inline);\n\
                offset and size cut a window of it",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let child = g.child(kv, "file")?;
        let raw = RawDriver::from_opts(kv, child.clone())?;
        Ok(Opened {
            driver: Box::new(raw),
            // A format node cannot write where its child cannot.
            read_only: flags.read_only || child.is_read_only(),
            direct: child.direct,
            bitmaps: Vec::new(),
        })
    },
};

/// Sizes of a window must be whole sectors, so a request can never round past its end.
const SECTOR: u64 = 512;

/// See the module docs.
pub struct RawDriver {
    child: Arc<BlockNode>,
    offset: u64,
    /// Fixed by `size=`; else the child's size minus the offset (follows resizes).
    size: Option<u64>,
}

impl RawDriver {
    /// A raw node over `child`, taking `offset` and `size` from the options (qsd's texts
    /// for bad windows).
    pub fn from_opts(opts: &mut KeyVal, child: Arc<BlockNode>) -> Result<Self, GraphError> {
        let offset = opts.take_u64("offset", true)?.unwrap_or(0);
        let size = opts.take_u64("size", true)?;
        let real = child.size();
        if offset > real {
            return Err(GraphError::Invalid(format!(
                "Offset ({offset}) cannot be greater than size of the containing file ({real})"
            )));
        }
        if let Some(size) = size {
            if real - offset < size {
                return Err(GraphError::Invalid(format!(
                    "The sum of offset ({offset}) and size ({size}) has to be smaller or equal \
                     to the actual size of the containing file ({real})"
                )));
            }
            if size % SECTOR != 0 {
                return Err(GraphError::Invalid(format!(
                    "Specified size is not multiple of {SECTOR}"
                )));
            }
        }
        Ok(Self {
            child,
            offset,
            size,
        })
    }

    /// The child node.
    pub fn child(&self) -> &Arc<BlockNode> {
        &self.child
    }

    /// Whether this node is a window (`offset` or `size` given), not the whole child.
    pub fn is_window(&self) -> bool {
        self.offset != 0 || self.size.is_some()
    }

    fn child_driver(&self) -> &dyn BlockDriver {
        self.child.driver()
    }
}

impl BlockDriver for RawDriver {
    /// Nothing of its own is read-only: its child is reopened by the caller.
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn no_flush(&self) -> bool {
        self.child_driver().no_flush()
    }
    fn driver_name(&self) -> &'static str {
        "raw"
    }
    fn is_filter(&self) -> bool {
        true
    }
    fn size(&self) -> u64 {
        self.size
            .unwrap_or_else(|| self.child.size().saturating_sub(self.offset))
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        self.child_driver().read(self.offset + offset, buf)
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        self.child_driver().write(self.offset + offset, buf, fua)
    }
    fn readv(&self, offset: u64, iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        self.child_driver().readv(self.offset + offset, iov)
    }
    fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        self.child_driver().writev(self.offset + offset, iov, fua)
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        self.child_driver().flush()
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        self.child.driver_discard(self.offset + offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        self.child_driver()
            .write_zeroes(self.offset + offset, len, may_unmap)
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        self.child_driver().block_status(self.offset + offset, len)
    }
    fn block_status_costly(&self) -> bool {
        self.child_driver().block_status_costly()
    }
    fn block_status_cached(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        self.child_driver()
            .block_status_cached(self.offset + offset, len)
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<(u64, u32)>> {
        self.child_driver()
            .allocation_depth(self.offset + offset, len)
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        if self.size.is_some() {
            // A window keeps its size, as in QEMU.
            return Box::pin(std::future::ready(Err(io::Error::from_raw_os_error(
                libc::ENOTSUP,
            ))));
        }
        self.child_driver().resize(self.offset + size)
    }
    fn resize_falloc(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        if self.size.is_some() {
            return self.resize(size);
        }
        self.child_driver().resize_falloc(self.offset + size)
    }
    fn filename(&self) -> Option<String> {
        if !self.is_window() {
            return self.child.filename();
        }
        // What qsd shows for a window: its options as a json: pseudo-filename.
        let mut o = serde_json::json!({
            "driver": "raw",
            "offset": self.offset,
            "file": { "driver": self.child.driver_name() },
        });
        if let Some(size) = self.size {
            o["size"] = size.into();
        }
        if let Some(f) = self.child.filename() {
            o["file"]["filename"] = f.into();
        }
        Some(format!("json:{o}"))
    }
    fn allocated_bytes(&self) -> Option<u64> {
        self.child.allocated_bytes()
    }
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        vec![("file", self.child.clone())]
    }
    fn passes_through(&self) -> Option<(&Arc<BlockNode>, u64)> {
        Some((&self.child, self.offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::drivers::null::NullDriver;

    fn node(size: u64) -> Arc<BlockNode> {
        Arc::new(BlockNode::new(
            "n".into(),
            Box::new(NullDriver::new(size, true)),
            false,
            false,
        ))
    }

    fn raw(child: Arc<BlockNode>, opts: &str) -> Result<RawDriver, String> {
        let mut kv = KeyVal::parse("--blockdev", opts, None).unwrap();
        RawDriver::from_opts(&mut kv, child).map_err(|e| e.to_string())
    }

    #[test]
    fn a_window_has_its_own_size_and_bad_windows_are_refused() {
        let child = node(1 << 20);
        assert_eq!(raw(child.clone(), "").unwrap().size(), 1 << 20);
        assert_eq!(
            raw(child.clone(), "offset=4096").unwrap().size(),
            (1 << 20) - 4096
        );
        assert_eq!(
            raw(child.clone(), "offset=4096,size=8192").unwrap().size(),
            8192
        );
        let e = raw(child.clone(), "offset=2M").err().unwrap();
        assert!(e.contains("cannot be greater"), "{e}");
        let e = raw(child.clone(), "offset=512,size=1M").err().unwrap();
        assert!(e.contains("has to be smaller or equal"), "{e}");
        let e = raw(child, "size=1000").err().unwrap();
        assert!(e.contains("not multiple of 512"), "{e}");
    }
}
