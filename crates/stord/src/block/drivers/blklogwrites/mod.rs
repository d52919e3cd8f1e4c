//! `blklogwrites`: QEMU's write logger, a filter over its child `file` that records
//! every write, write-zeroes, discard and flush reaching it on its child `log`, in the
//! dm-log-writes format ([`format`]), byte for byte as QEMU writes it: the file's request
//! first, then its entry ([`log`]). Replaying the log up to any entry gives the file as
//! it stood then, which is how a crash at that moment is simulated.
//!
//! Requests reach the file at the log's sector size (QEMU's generic layer pads them to
//! the node's alignment before the driver sees them): a write that is not aligned reads
//! its head and tail sectors first, under a lock on them. A FUA write is a write, then a
//! flush, as QEMU's generic layer emulates FUA on a node without it; a flush with nothing
//! written since the last one logs nothing (and a FUA write's own flush does not count
//! that write, as in QEMU, whose log then shows no flush after it).

pub mod format;
mod log;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::limits::BlockLimits;
use crate::block::node::perm::{storage_perms, Perm};
use crate::block::node::range_lock::RangeLocks;
use crate::block::open::{GraphError, Opened};
use crate::buf::{new_buf, Buf};
use crate::cli::keyval::KeyVal;
use crate::cli::Help;
use format::Entry;
use log::{Log, Payload};

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["blklogwrites"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node> | ,file.driver=...\n\
                   ,log=<node> | ,log.driver=...\n\
                   [,log-sector-size=<n>][,log-append=on|off][,log-super-update-interval=<n>]",
        about: "QEMU's write logger: what reaches `file` logged to `log`\n\
                (dm-log-writes format), for replay to any point",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let o = Options::take(kv)?;
        let file = g.child(kv, "file")?;
        let log = g.child(kv, "log")?;
        let driver = BlkLogWritesDriver::new(file, log, o)?;
        Ok(Opened {
            read_only: flags.read_only || driver.file.is_read_only(),
            direct: driver.file.direct,
            driver: Box::new(driver),
            bitmaps: Vec::new(),
        })
    },
};

/// The options beside the children.
struct Options {
    append: bool,
    sector_size: Option<u64>,
    update_interval: u64,
}

impl Options {
    fn take(kv: &mut KeyVal) -> Result<Options, GraphError> {
        Ok(Options {
            append: kv.take_bool("log-append", false)?,
            sector_size: kv.take_u64("log-sector-size", true)?,
            update_interval: kv
                .take_u64("log-super-update-interval", false)?
                .unwrap_or(4096),
        })
    }
}

/// The blklogwrites filter.
pub struct BlkLogWritesDriver {
    file: Arc<BlockNode>,
    log: Log,
    /// Writes, write-zeroes and discards finished (QEMU's write_gen), and how many had
    /// when the last flush began that succeeded.
    write_gen: AtomicU64,
    flushed_gen: AtomicU64,
    /// One flush at a time.
    flushing: RangeLocks,
    /// Sectors a padded write patches, and the writes that overlap them.
    rmw: RangeLocks,
}

impl BlkLogWritesDriver {
    fn new(file: Arc<BlockNode>, log: Arc<BlockNode>, o: Options) -> Result<Self, GraphError> {
        let log = Log::open(log, o.append, o.sector_size, o.update_interval)?;
        Ok(BlkLogWritesDriver {
            file,
            log,
            write_gen: AtomicU64::new(0),
            flushed_gen: AtomicU64::new(0),
            flushing: RangeLocks::default(),
            rmw: RangeLocks::default(),
        })
    }

    fn align(&self) -> u64 {
        self.log.sector_size()
    }

    /// The sectors that cover `[offset, offset + len)`.
    fn covering(&self, offset: u64, len: u64) -> (u64, u64) {
        let a = self.align();
        (offset / a * a, (offset + len).next_multiple_of(a))
    }

    fn entry(&self, offset: u64, len: u64, flags: u64) -> Entry {
        Entry {
            sector: offset / self.align(),
            nr_sectors: len / self.align(),
            flags,
            data_len: 0,
        }
    }

    /// The end of a logged write-type request: counted, and the log's error first.
    fn finish(&self, file: io::Result<()>, log: io::Result<()>) -> io::Result<()> {
        self.write_gen.fetch_add(1, SeqCst);
        log.and(file)
    }

    /// `[at, at + out.len())` of the file, zeroes past its end.
    async fn read_file(&self, at: u64, out: &mut [u8]) -> io::Result<()> {
        let have = self.file.size().saturating_sub(at).min(out.len() as u64) as usize;
        out[have..].fill(0);
        if have > 0 {
            let (r, b) = self.file.driver().read(at, new_buf(have)).await;
            r?;
            out[..have].copy_from_slice(&b);
        }
        Ok(())
    }

    /// An aligned write: the file's, then its entry with the data; with `fua`, a flush
    /// before the write counts as written (QEMU emulates FUA before it counts the write,
    /// so the flush logs nothing when nothing else was written since the last one).
    async fn write_whole(&self, offset: u64, buf: Buf, fua: bool) -> (io::Result<()>, Buf) {
        let len = buf.len() as u64;
        let (f, buf) = self.file.driver().write(offset, buf, false).await;
        let l = self
            .log
            .append(self.entry(offset, len, 0), Payload::Data(&buf))
            .await;
        let mut r = l.and(f);
        if r.is_ok() && fua {
            r = self.flush_logged().await;
        }
        self.write_gen.fetch_add(1, SeqCst);
        (r, buf)
    }

    /// A write of `data` at `offset`, its ends padded to whole sectors from the file.
    async fn write_padded(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let (start, end) = self.covering(offset, data.len() as u64);
        let a = self.align();
        let mut whole = new_buf((end - start) as usize);
        if offset != start {
            self.read_file(start, &mut whole[..a as usize]).await?;
        }
        let tail = end - a;
        if offset + data.len() as u64 != end && (tail != start || offset == start) {
            self.read_file(tail, &mut whole[(tail - start) as usize..])
                .await?;
        }
        let skip = (offset - start) as usize;
        whole[skip..skip + data.len()].copy_from_slice(data);
        self.write_whole(start, whole, fua).await.0
    }

    /// Any write, under the lock on its sectors.
    async fn write_locked(&self, offset: u64, buf: Buf, fua: bool) -> (io::Result<()>, Buf) {
        let (start, end) = self.covering(offset, buf.len() as u64);
        let _lock = self.rmw.lock(start, end).await;
        if (start, end) == (offset, offset + buf.len() as u64) {
            return self.write_whole(offset, buf, fua).await;
        }
        let r = self.write_padded(offset, &buf, fua).await;
        (r, buf)
    }

    /// Write-zeroes: the unaligned ends as padded writes of zeroes, the aligned middle
    /// as a write-zeroes of the file, logged with its zeroes.
    async fn write_zeroes_logged(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        let a = self.align();
        let end = offset + len;
        let (mid_start, mid_end) = (offset.next_multiple_of(a), end / a * a);
        if mid_start >= mid_end {
            return self
                .write_locked(offset, new_buf(len as usize), false)
                .await
                .0;
        }
        if offset < mid_start {
            let head = new_buf((mid_start - offset) as usize);
            self.write_locked(offset, head, false).await.0?;
        }
        {
            let n = mid_end - mid_start;
            let _lock = self.rmw.lock(mid_start, mid_end).await;
            let f = self
                .file
                .driver()
                .write_zeroes(mid_start, n, may_unmap)
                .await;
            let l = self
                .log
                .append(self.entry(mid_start, n, 0), Payload::Zeroes(n))
                .await;
            self.finish(f, l)?;
        }
        if mid_end < end {
            let tail = new_buf((end - mid_end) as usize);
            self.write_locked(mid_end, tail, false).await.0?;
        }
        Ok(())
    }

    /// A flush: the file's, then a flush entry (which rewrites the superblock and flushes
    /// the log); nothing is logged when nothing was written since the last one.
    async fn flush_logged(&self) -> io::Result<()> {
        let _one = self.flushing.lock(0, 1).await;
        let gen = self.write_gen.load(SeqCst);
        if self.flushed_gen.load(SeqCst) == gen {
            return self.file.driver().flush().await;
        }
        let f = self.file.driver().flush().await;
        let l = self
            .log
            .append(self.entry(0, 0, format::FLUSH), Payload::None)
            .await;
        let r = l.and(f);
        if r.is_ok() {
            self.flushed_gen.store(gen, SeqCst);
        }
        r
    }
}

impl BlockDriver for BlkLogWritesDriver {
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn driver_name(&self) -> &'static str {
        "blklogwrites"
    }
    fn is_filter(&self) -> bool {
        true
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            let (start, end) = self.covering(offset, buf.len() as u64);
            if (start, end) == (offset, offset + buf.len() as u64) {
                return self.file.driver().read(offset, buf).await;
            }
            let mut wide = new_buf((end - start) as usize);
            let r = self.read_file(start, &mut wide).await;
            let mut buf = buf;
            if r.is_ok() {
                let skip = (offset - start) as usize;
                let n = buf.len();
                buf.copy_from_slice(&wide[skip..skip + n]);
            }
            (r, buf)
        })
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.write_locked(offset, buf, fua))
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.flush_logged())
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            // The unaligned ends are dropped, as QEMU's generic layer drops them.
            let a = self.align();
            let (start, end) = (offset.next_multiple_of(a), (offset + len) / a * a);
            if start >= end {
                return Ok(());
            }
            let _lock = self.rmw.lock(start, end).await;
            let f = self.file.driver_discard(start, end - start).await;
            let l = self
                .log
                .append(
                    self.entry(start, end - start, format::DISCARD),
                    Payload::None,
                )
                .await;
            self.finish(f, l)
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.write_zeroes_logged(offset, len, may_unmap))
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        self.file.driver().block_status(offset, len)
    }
    fn block_status_costly(&self) -> bool {
        self.file.driver().block_status_costly()
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<(u64, u32)>> {
        self.file.driver().allocation_depth(offset, len)
    }
    /// Passed to the file unlogged, as QEMU truncates a filter's child.
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        self.file.driver().resize(size)
    }
    fn filename(&self) -> Option<String> {
        self.file.filename()
    }
    fn no_flush(&self) -> bool {
        self.file.driver().no_flush()
    }
    fn allocated_bytes(&self) -> Option<u64> {
        self.file.allocated_bytes()
    }
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        vec![("file", self.file.clone()), ("log", self.log.node.clone())]
    }
    fn passes_through(&self) -> Option<(&Arc<BlockNode>, u64)> {
        Some((&self.file, 0))
    }
    fn refresh_limits(&self, bl: &mut BlockLimits) {
        bl.request_alignment = self.align() as u32;
    }
    /// The file's as a filter passes them; the log's as a format driver takes its file.
    fn child_perms(&self, role: &'static str, perm: Perm, shared: Perm, w: bool) -> (Perm, Perm) {
        match role {
            "log" => storage_perms(w),
            _ => (perm, shared),
        }
    }
}
