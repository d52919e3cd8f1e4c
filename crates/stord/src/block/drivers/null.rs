//! `null-co` (also `null`) and `null-aio`: a device of a given size that stores nothing.
//!
//! Reads return zeroes with `read-zeroes=on`; with `read-zeroes=off` (the default, as in
//! qsd) the buffer is handed back as it is, which costs nothing. Writes are dropped. With
//! `latency-ns`, every request completes that long after it came, on a loop timer (QEMU's
//! null-co sleeps in its coroutine, null-aio arms a timer: in stord both are the loop's
//! timer); without, at once. The two names differ only in what `drv` reports.

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
        synopsis: "[,size=<size>][,read-zeroes=on|off]\n[,latency-ns=<ns>]",
        about: "reads zeroes (with read-zeroes=on), drops writes: for tests\n\
                and benchmarks",
    },
    create: None,
    amend: None,
    open: |_, kv, flags| open(kv, flags, "null-co"),
};

/// `null-aio`: the same device under QEMU's other name for it.
pub const DRIVER_AIO: DriverDef = DriverDef {
    names: &["null-aio"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "[,size=<size>][,read-zeroes=on|off]\n[,latency-ns=<ns>]",
        about: "null-co under QEMU's name for its callback-based twin",
    },
    create: None,
    amend: None,
    open: |_, kv, flags| open(kv, flags, "null-aio"),
};

fn open(
    kv: &mut KeyVal,
    flags: crate::block::open::OpenFlags<'_>,
    name: &'static str,
) -> Result<Opened, GraphError> {
    let mut d = NullDriver::from_opts(kv)?;
    d.name = name;
    if let Some(f) = kv.take("filename") {
        if f != format!("{name}://") {
            return Err(GraphError::Invalid(format!(
                "The only allowed filename for this driver is '{name}://'"
            )));
        }
    }
    Ok(Opened {
        driver: Box::new(d),
        read_only: flags.read_only,
        direct: false,
        bitmaps: Vec::new(),
    })
}

/// qsd's default null size (1 GiB).
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// QEMU's largest node size (`BDRV_MAX_LENGTH`: INT64_MAX rounded down to 1 GiB).
pub const MAX_SIZE: u64 = (i64::MAX as u64) & !((1 << 30) - 1);

/// The null driver.
pub struct NullDriver {
    size: AtomicU64,
    read_zeroes: bool,
    /// `latency-ns`: how long each request takes (zero: none).
    latency_ns: u64,
    /// What `drv` says: `null-co` or `null-aio`.
    name: &'static str,
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
            latency_ns: 0,
            name: "null-co",
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
        let latency_ns = match opts.take("latency-ns") {
            None => 0,
            Some(v) => v
                .parse::<u64>()
                .map_err(|_| GraphError::Invalid("latency-ns is invalid".into()))?,
        };
        let mut d = Self::new(size, read_zeroes);
        d.latency_ns = latency_ns;
        Ok(d)
    }

    /// `v`, once the request's latency has passed.
    fn after<T: 'static>(&self, v: T) -> BoxFut<'_, T> {
        if self.latency_ns == 0 {
            return Box::pin(std::future::ready(v));
        }
        let d = std::time::Duration::from_nanos(self.latency_ns);
        Box::pin(async move {
            stord_aio::sleep(d).await;
            v
        })
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
        self.name
    }
    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }
    fn read(&self, _offset: u64, mut buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        if self.read_zeroes {
            buf.fill(0);
        }
        self.after((Ok(()), buf))
    }
    fn write(&self, _offset: u64, buf: Buf, _fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        self.after((Ok(()), buf))
    }
    fn readv(&self, _offset: u64, mut iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        if self.read_zeroes {
            iov.zero_from(0);
        }
        self.after((Ok(()), iov))
    }
    fn writev(&self, _offset: u64, iov: IoVec, _fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        self.after((Ok(()), iov))
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        self.after(Ok(()))
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
