//! `null` (qsd: `null-co`): a device of a given size that stores nothing.
//!
//! Reads return zeroes with `read-zeroes=on`; with `read-zeroes=off` (the default, as in
//! qsd) the buffer is handed back as it is, which costs nothing. Writes are dropped.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::keyval::KeyVal;
use crate::cli::Help;
use crate::iov::IoVec;

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["null-co", "null"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "[,size=<size>][,read-zeroes=on|off]",
        about: "reads zeroes (with read-zeroes=on), drops writes: for tests\n\
                and benchmarks",
    },
    create: None,
    amend: None,
    open: |_, kv, flags| {
        Ok(Opened {
            driver: Box::new(NullDriver::from_opts(kv)?),
            read_only: flags.read_only,
            direct: false,
            bitmaps: Vec::new(),
        })
    },
};

/// qsd's default null size (1 GiB).
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// QEMU's largest node size (`BDRV_MAX_LENGTH`: INT64_MAX rounded down to 1 GiB).
pub const MAX_SIZE: u64 = (i64::MAX as u64) & !((1 << 30) - 1);

/// The null driver.
pub struct NullDriver {
    size: AtomicU64,
    read_zeroes: bool,
}

/// A writable 1 MiB null node named `name`, for unit tests of the graph's mechanisms.
#[cfg(test)]
pub(crate) fn test_node(name: &str) -> std::sync::Arc<crate::block::node::block_node::BlockNode> {
    std::sync::Arc::new(crate::block::node::block_node::BlockNode::new(
        name.into(),
        Box::new(NullDriver::new(1 << 20, false)),
        false,
        false,
    ))
}

impl NullDriver {
    /// A null device.
    pub fn new(size: u64, read_zeroes: bool) -> Self {
        Self {
            size: AtomicU64::new(size),
            read_zeroes,
        }
    }

    /// From `--blockdev driver=null,size=...,read-zeroes=on|off`.
    pub fn from_opts(opts: &mut KeyVal) -> Result<Self, GraphError> {
        let size = opts.take_u64("size", true)?.unwrap_or(DEFAULT_SIZE);
        if size > MAX_SIZE {
            return Err(GraphError::Invalid(format!(
                "{}: size must be in 0..={MAX_SIZE} (QEMU's largest node), got {size}",
                opts.what
            )));
        }
        let read_zeroes = opts.take_bool("read-zeroes", false)?;
        // qsd's null-co also takes latency-ns; accept 0 only (we do not simulate latency).
        if let Some(l) = opts.take_u64("latency-ns", false)? {
            if l != 0 {
                return Err(GraphError::Invalid(format!(
                    "{}: latency-ns is not supported (only 0)",
                    opts.what
                )));
            }
        }
        Ok(Self::new(size, read_zeroes))
    }

    /// Everything is allocated; it reads as zero when read-zeroes is on.
    fn status(&self, _offset: u64, len: u64) -> BlockStatus {
        BlockStatus {
            len,
            allocated: true,
            zero: self.read_zeroes,
        }
    }
}

impl BlockDriver for NullDriver {
    /// Nothing of its own is read-only: its child is reopened by the caller.
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn driver_name(&self) -> &'static str {
        "null-co"
    }
    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }
    fn read(&self, _offset: u64, mut buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        if self.read_zeroes {
            buf.fill(0);
        }
        Box::pin(std::future::ready((Ok(()), buf)))
    }
    fn write(&self, _offset: u64, buf: Buf, _fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(std::future::ready((Ok(()), buf)))
    }
    fn readv(&self, _offset: u64, mut iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        if self.read_zeroes {
            iov.zero_from(0);
        }
        Box::pin(std::future::ready((Ok(()), iov)))
    }
    fn writev(&self, _offset: u64, iov: IoVec, _fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(std::future::ready((Ok(()), iov)))
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    fn discard(&self, _: u64, _: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(std::future::ready(Ok(self.status(offset, len))))
    }
    fn block_status_cached(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        Some(self.status(offset, len))
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        self.size.store(size, Relaxed);
        Box::pin(std::future::ready(Ok(())))
    }
}
