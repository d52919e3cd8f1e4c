//! `file`: a regular file or block device, through one of three I/O engines, each an
//! [`Engine`] the driver is generic over:
//!
//! - `aio=io_uring` ([`uring`]): requests go on the issuing IoThread's own ring and are
//!   submitted with the rest of the loop iteration's batch.
//! - `aio=native` ([`linux_aio`]): one Linux AIO context per IoThread (the context's local
//!   state, destroyed with it), completions read from the kernel's AIO ring in userspace.
//! - `aio=threads` ([`threads`]): a small pool of workers per IoThread doing
//!   preadv/pwritev (also joined when the IoThread's context goes).
//!
//! Common to all three, here: EINTR/EAGAIN are resubmitted, short reads continue (and are
//! zero-filled at end of file), short writes are ENOSPC, and with `cache.direct=on`
//! requests that are not aligned go through an aligned bounce buffer. Every engine
//! transfers an [`IoVec`]: one of our buffers, or pieces of a guest's memory read into and
//! written from directly (vectored) when they are aligned enough for the file.

pub mod create;
mod engine;
mod extent_cache;
mod limits;
mod linux_aio;
pub(crate) mod lock;
mod threads;
mod uring;

pub use linux_aio::{NativeTuning, HARVEST_AFTER_SUBMIT, HARVEST_ON_EVENT};

use std::fs::OpenOptions;

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use self::engine::{errno, from_res, Engine};
use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::open::{GraphError, Opened};
use crate::block::worker_pool;
use crate::buf::{new_buf, request_buf, Buf};
use crate::cli::keyval::KeyVal;
use crate::cli::Help;
use crate::iov::IoVec;
use crate::sys;

/// Which backend a file node uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AioMode {
    /// The IoThread's io_uring.
    IoUring,
    /// Linux AIO (io_submit), harvested in userspace.
    Native,
    /// A worker thread pool.
    Threads,
}

impl AioMode {
    /// The option value.
    pub fn name(self) -> &'static str {
        match self {
            AioMode::IoUring => "io_uring",
            AioMode::Native => "native",
            AioMode::Threads => "threads",
        }
    }
}

/// What `discard` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiscardMode {
    /// Punch holes.
    Unmap,
    /// Ignore discards.
    Ignore,
}

/// Options of a file node.
#[derive(Debug, Clone)]
pub struct FileOptions {
    /// Path.
    pub filename: String,
    /// Backend.
    pub aio: AioMode,
    /// O_DIRECT.
    pub direct: bool,
    /// `native` only: io_submit batch limit (`aio-max-batch`, 0 = default 32) and
    /// whether to harvest right after io_submit (`x-reap-after-submit`, default on).
    pub native: NativeTuning,
    /// Discard behaviour.
    pub discard: DiscardMode,
    /// Open read-only.
    pub read_only: bool,
    /// `locking=auto|on` (QEMU's image locks; `off` takes none).
    pub locking: bool,
    /// `cache.no-flush=on`: flushes succeed without reaching the disk (QEMU's
    /// `cache=unsafe`).
    pub no_flush: bool,
}

impl FileOptions {
    /// From `--blockdev driver=file,filename=...,aio=...,cache.direct=...`.
    pub fn from_opts(opts: &mut KeyVal, read_only: bool) -> Result<Self, GraphError> {
        let filename = opts.take_required("filename")?;
        let aio = match opts
            .take_choice("aio", &["io_uring", "native", "threads"])?
            .as_deref()
        {
            Some("io_uring") => AioMode::IoUring,
            Some("native") => AioMode::Native,
            Some("threads") | None => AioMode::Threads,
            Some(_) => unreachable!(),
        };
        let direct = opts.take_bool("cache.direct", false)?;
        let no_flush = opts.take_bool("cache.no-flush", false)?;
        let native = NativeTuning {
            max_batch: opts
                .take_u64_in("aio-max-batch", false, 0..=u64::from(u32::MAX))?
                .unwrap_or(0) as u32,
            reap_after_submit: opts.take_bool("x-reap-after-submit", true)?,
        };
        let discard = match opts
            .take_choice("discard", &["unmap", "ignore", "on", "off"])?
            .as_deref()
        {
            Some("unmap" | "on") => DiscardMode::Unmap,
            _ => DiscardMode::Ignore,
        };
        // auto: on, as OFD locks are always there on Linux.
        let locking = opts
            .take_choice("locking", &["auto", "on", "off"])?
            .as_deref()
            != Some("off");
        if aio == AioMode::Native && !direct {
            // Same rule as QEMU: linux-aio without O_DIRECT would block in io_submit.
            return Err(GraphError::Invalid(format!(
                "{}: aio=native was specified, but it requires cache.direct=on, which was not specified.",
                opts.what
            )));
        }
        Ok(Self {
            filename,
            aio,
            direct,
            native,
            discard,
            read_only,
            locking,
            no_flush,
        })
    }
}

/// The driver table's entry (`host_device` is the same driver, as stord opens block
/// devices and regular files alike).
pub const DRIVER: DriverDef = DriverDef {
    names: &["file", "host_device"],
    takes_discard: true,
    takes_cache: true,
    help: Help {
        synopsis: "filename=<path>\n\
                   [,aio=io_uring|native|threads][,cache.direct=on|off][,cache.no-flush=on|off]\n\
                   [,aio-max-batch=<n>][,x-reap-after-submit=on|off][,discard=unmap|ignore]\n\
                   [,locking=auto|on|off]",
        about: "a regular file or block device, locked as QEMU locks its images",
    },
    create: Some(&create::CREATE),
    amend: None,
    open: |_, kv, flags| {
        let opts = FileOptions::from_opts(kv, flags.read_only)?;
        let direct = opts.direct;
        let driver = open(opts).map_err(|e| GraphError::Invalid(format!("{}: {e}", kv.what)))?;
        Ok(Opened {
            driver,
            read_only: flags.read_only,
            direct,
            bitmaps: Vec::new(),
        })
    },
};

/// The file driver, over one of the [`Engine`]s.
pub(crate) struct FileDriver<E> {
    engine: E,
    fd: Arc<OwnedFd>,
    opts: FileOptions,
    size: AtomicU64,
    /// Offset and length alignment required with O_DIRECT.
    align: u64,
    block_device: bool,
    /// Write serialisation for read-modify-write (only used when `align > 1`).
    write_locks: crate::block::node::range_lock::RangeLocks,
    /// The last extent block status found.
    extents: extent_cache::ExtentCache,
    /// QEMU's image locks on the file.
    lock: lock::ImageLock,
}

/// The smallest offset/length alignment O_DIRECT accepts on this file: 512 if a 512-byte
/// read at 512 works, else 4096.
fn probe_direct_alignment(fd: RawFd, size: u64) -> u64 {
    if size < 1024 {
        return 4096;
    }
    let r = crate::sys::direct_read(fd, 512, 512);
    if r == 512 {
        512
    } else {
        4096
    }
}

/// Opens the file with the engine its `aio=` asks for.
pub fn open(opts: FileOptions) -> io::Result<Box<dyn BlockDriver>> {
    Ok(match opts.aio {
        AioMode::IoUring => Box::new(FileDriver::open(opts, uring::Uring::default())?),
        AioMode::Native => {
            let engine = linux_aio::Native(opts.native);
            Box::new(FileDriver::open(opts, engine)?)
        }
        AioMode::Threads => Box::new(FileDriver::open(opts, threads::Threads)?),
    })
}

impl<E: Engine> FileDriver<E> {
    /// Opens the file.
    pub fn open(opts: FileOptions, mut engine: E) -> io::Result<Self> {
        let mut oo = OpenOptions::new();
        oo.read(true).write(!opts.read_only);
        let mut flags = libc::O_CLOEXEC;
        if opts.direct {
            flags |= libc::O_DIRECT;
        }
        oo.custom_flags(flags);
        let file = oo.open(&opts.filename).map_err(|e| {
            let text = format!("Could not open '{}': {}", opts.filename, sys::os_text(&e));
            io::Error::new(e.kind(), text)
        })?;
        let meta = file.metadata()?;
        let block_device = meta.file_type().is_block_device();
        let size = if block_device {
            let mut f = &file;
            io::Seek::seek(&mut f, io::SeekFrom::End(0))?
        } else {
            meta.len()
        };
        let fd: OwnedFd = file.into();
        engine.opened(fd.as_raw_fd());
        let align = if opts.direct {
            probe_direct_alignment(fd.as_raw_fd(), size)
        } else {
            1
        };
        Ok(Self {
            engine,
            lock: lock::ImageLock::new(opts.locking, &opts.filename),
            fd: Arc::new(fd),
            align,
            opts,
            size: AtomicU64::new(size),
            block_device,
            write_locks: crate::block::node::range_lock::RangeLocks::default(),
            extents: extent_cache::ExtentCache::default(),
        })
    }

    fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// One backend transfer of what `iov` shows at `offset`: the raw result (count or
    /// -errno).
    async fn transfer(&self, write: bool, fua: bool, iov: IoVec, offset: u64) -> (i32, IoVec) {
        self.engine
            .transfer(&self.fd, write, fua, iov, offset)
            .await
    }

    /// Reads or writes all of `iov` at `offset`, resubmitting as the rules say.
    async fn rw_all(
        &self,
        write: bool,
        fua: bool,
        mut iov: IoVec,
        offset: u64,
    ) -> (io::Result<()>, IoVec) {
        let len = iov.len();
        let mut done = 0usize;
        let result = loop {
            if done >= len {
                break Ok(());
            }
            iov.advance_to(done);
            let (res, v) = self.transfer(write, fua, iov, offset + done as u64).await;
            iov = v;
            match res {
                r if r == -libc::EINTR || r == -libc::EAGAIN => continue,
                r if r < 0 => break Err(io::Error::from_raw_os_error(-r)),
                0 if !write => {
                    // End of file: the rest reads as zeroes.
                    iov.zero_from(done);
                    break Ok(());
                }
                0 => break Err(io::Error::from_raw_os_error(libc::ENOSPC)),
                r if write && (done + r as usize) < len => {
                    break Err(io::Error::from_raw_os_error(libc::ENOSPC));
                }
                r => done += r as usize,
            }
        };
        iov.rewind();
        (result, iov)
    }

    /// `rw_all` on one of our buffers.
    async fn rw_buf(&self, write: bool, fua: bool, buf: Buf, offset: u64) -> (io::Result<()>, Buf) {
        let (r, iov) = self.rw_all(write, fua, IoVec::from_buf(buf), offset).await;
        (r, iov.into_buf().expect("an IoVec made from a buffer"))
    }

    fn aligned(&self, offset: u64, len: usize) -> bool {
        offset.is_multiple_of(self.align) && (len as u64).is_multiple_of(self.align)
    }

    /// Whether `iov` can go to the file as it is: always without O_DIRECT; with it, when
    /// the offset and every piece are aligned.
    fn direct_ok(&self, offset: u64, iov: &IoVec) -> bool {
        self.align == 1 || (self.aligned(offset, iov.len()) && iov.is_aligned(self.align as usize))
    }

    /// The aligned range covering `[offset, offset+len)`.
    fn widen(&self, offset: u64, len: usize) -> (u64, usize) {
        let start = offset / self.align * self.align;
        let end = (offset + len as u64).div_ceil(self.align) * self.align;
        (start, (end - start) as usize)
    }

    async fn read_impl(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        if self.aligned(offset, buf.len()) {
            return self.rw_buf(false, false, buf, offset).await;
        }
        // Bounce: read the covering aligned range, copy out the part asked for.
        let (wstart, wlen) = self.widen(offset, buf.len());
        let (r, bounce) = self.rw_buf(false, false, request_buf(wlen), wstart).await;
        let mut buf = buf;
        if r.is_ok() {
            let skip = (offset - wstart) as usize;
            let n = buf.len();
            buf.copy_from_slice(&bounce[skip..skip + n]);
        }
        (r, buf)
    }

    /// Reads into `iov` directly when its pieces suit the file, else through a buffer.
    async fn readv_impl(&self, offset: u64, mut iov: IoVec) -> (io::Result<()>, IoVec) {
        if self.direct_ok(offset, &iov) {
            return self.rw_all(false, false, iov, offset).await;
        }
        crate::buf::count_bounce();
        let (r, buf) = self.read_impl(offset, request_buf(iov.len())).await;
        if r.is_ok() {
            iov.copy_in(0, &buf);
        }
        (r, iov)
    }

    async fn write_impl(&self, offset: u64, buf: Buf, fua: bool) -> (io::Result<()>, Buf) {
        self.extents.before_write(offset, offset + buf.len() as u64);
        if self.align == 1 {
            return self.rw_buf(true, fua, buf, offset).await;
        }
        // Hold the aligned span so that no read-modify-write overlaps this write.
        let (wstart, wlen) = self.widen(offset, buf.len());
        let _span = self.write_locks.lock(wstart, wstart + wlen as u64).await;
        if self.aligned(offset, buf.len()) {
            return self.rw_buf(true, fua, buf, offset).await;
        }
        // Read-modify-write through an aligned bounce buffer.
        let (r, mut bounce) = self.rw_buf(false, false, request_buf(wlen), wstart).await;
        if let Err(e) = r {
            return (Err(e), buf);
        }
        let skip = (offset - wstart) as usize;
        bounce[skip..skip + buf.len()].copy_from_slice(&buf);
        let (r, _) = self.rw_buf(true, fua, bounce, wstart).await;
        (r, buf)
    }

    /// Writes `iov` directly when its pieces suit the file, else through a buffer.
    async fn writev_impl(&self, offset: u64, iov: IoVec, fua: bool) -> (io::Result<()>, IoVec) {
        self.extents.before_write(offset, offset + iov.len() as u64);
        if self.align == 1 {
            return self.rw_all(true, fua, iov, offset).await;
        }
        if self.direct_ok(offset, &iov) {
            let (wstart, wlen) = self.widen(offset, iov.len());
            let _span = self.write_locks.lock(wstart, wstart + wlen as u64).await;
            return self.rw_all(true, fua, iov, offset).await;
        }
        crate::buf::count_bounce();
        let mut buf = request_buf(iov.len());
        iov.copy_out(0, &mut buf);
        let (r, _) = self.write_impl(offset, buf, fua).await;
        (r, iov)
    }

    async fn flush_impl(&self) -> io::Result<()> {
        if self.opts.no_flush {
            return Ok(());
        }
        from_res(self.engine.fsync(&self.fd).await).map(|_| ())
    }

    /// fallocate(2) off the loop thread: on the ring with the io_uring engine, on the pool
    /// otherwise. Anything it does may punch holes: the extent cache is dropped first.
    async fn fallocate(&self, mode: i32, offset: u64, len: u64) -> io::Result<()> {
        self.extents.invalidate();
        self.engine.fallocate(&self.fd, mode, offset, len).await
    }

    async fn write_zeroes_impl(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        if !self.block_device {
            let mode = if may_unmap && self.opts.discard == DiscardMode::Unmap {
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
            } else {
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
            };
            match self.fallocate(mode, offset, len).await {
                Ok(()) => return Ok(()),
                Err(e) if errno(&e) == libc::EOPNOTSUPP || errno(&e) == libc::EINVAL => {}
                Err(e) => return Err(e),
            }
            // No zero range (tmpfs, NFS): a hole punched and allocated again reads as
            // zeroes and stays allocated, as QEMU's handle_aiocb_write_zeroes does it.
            if mode & libc::FALLOC_FL_PUNCH_HOLE == 0 {
                let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                if self.fallocate(punch, offset, len).await.is_ok() {
                    match self.fallocate(0, offset, len).await {
                        Ok(()) => return Ok(()),
                        Err(e) if errno(&e) == libc::EOPNOTSUPP => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        // Fallback: write zeroes in chunks of at most 1 MiB, from one buffer.
        let chunk = (len as usize).min(1 << 20);
        let mut zeroes = new_buf(chunk);
        let mut off = offset;
        let end = offset + len;
        while off < end {
            let n = ((end - off) as usize).min(chunk);
            zeroes.set_len(n);
            let (r, buf) = self.write_impl(off, zeroes, false).await;
            r?;
            zeroes = buf;
            off += n as u64;
        }
        Ok(())
    }

    /// Block status: from the extent cache when it knows, else found with lseek on the
    /// pool (never on the loop thread) and cached.
    /// Block status without I/O: a block device is all data; a file answers from its
    /// extent cache.
    fn block_status_known(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        if self.block_device {
            return Some(BlockStatus {
                len,
                allocated: true,
                zero: false,
            });
        }
        let extent = self.extents.lookup(offset)?;
        Some(extent_status(extent, offset, len))
    }

    async fn block_status_impl(&self, offset: u64, len: u64) -> io::Result<BlockStatus> {
        if let Some(st) = self.block_status_known(offset, len) {
            return Ok(st);
        }
        let gen = self.extents.generation();
        let (fd, size) = (self.fd.clone(), self.size());
        let (e, cacheable) =
            worker_pool::run(move || probe_extent(fd.as_raw_fd(), offset, size)).await;
        if cacheable {
            self.extents.store(e, gen);
        }
        Ok(extent_status(e, offset, len))
    }
}

/// What an extent says of `[offset, offset+len)`.
fn extent_status(e: extent_cache::Extent, offset: u64, len: u64) -> BlockStatus {
    BlockStatus {
        len: (e.end - offset).min(len).max(1),
        allocated: e.allocated,
        zero: !e.allocated,
    }
}

/// The extent that starts at `offset`, found with SEEK_DATA / SEEK_HOLE; false when lseek
/// failed (the answer is then a guess: data to the end, not worth caching).
fn probe_extent(fd: RawFd, offset: u64, size: u64) -> (extent_cache::Extent, bool) {
    let extent = |end: u64, allocated| extent_cache::Extent {
        start: offset,
        end: end.max(offset + 1),
        allocated,
    };
    match sys::lseek(fd, offset, libc::SEEK_DATA) {
        Ok(data) if data == offset => {
            // Data starts here; it lasts until the next hole.
            let hole = sys::lseek(fd, offset, libc::SEEK_HOLE).unwrap_or(size);
            (extent(hole, true), true)
        }
        Ok(data) => (extent(data, false), true),
        // ENXIO: no data after offset: a hole to the end.
        Err(e) if errno(&e) == libc::ENXIO => (extent(size, false), true),
        Err(_) => (extent(size, true), false),
    }
}

impl<E: Engine> BlockDriver for FileDriver<E> {
    fn refresh_limits(&self, bl: &mut crate::block::node::limits::BlockLimits) {
        let (align, dev) = (self.align, self.block_device);
        limits::refresh(bl, self.raw(), align, dev, &self.opts.filename);
    }
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async move {
            let name = &self.opts.filename;
            let mut flags = libc::O_CLOEXEC;
            if self.opts.direct {
                flags |= libc::O_DIRECT;
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(flags)
                .open(name)
                .map_err(|e| format!("Could not reopen '{name}' read-write: {e}"))?;
            // The descriptor number requests use stays; requests in flight hold their own
            // reference to the file. The new open file has no locks yet: they are taken
            // again with the node's permissions, which the caller refreshes.
            crate::sys::dup_onto(file.as_raw_fd(), self.raw())
                .map_err(|e| format!("Could not reopen '{name}' read-write: {e}"))?;
            self.lock.forget();
            Ok(())
        })
    }
    fn no_flush(&self) -> bool {
        self.opts.no_flush
    }
    fn driver_name(&self) -> &'static str {
        if self.block_device {
            "host_device"
        } else {
            "file"
        }
    }
    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }
    fn filename(&self) -> Option<String> {
        Some(self.opts.filename.clone())
    }
    fn allocated_bytes(&self) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        // Through the descriptor, not the name: a FUSE export may be mounted on the name
        // (stat would then ask this very daemon, from the thread that must answer).
        std::fs::metadata(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
            .ok()
            .filter(|m| m.file_type().is_file())
            .map(|m| m.blocks() * 512)
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.read_impl(offset, buf))
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.write_impl(offset, buf, fua))
    }
    fn readv(&self, offset: u64, iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(self.readv_impl(offset, iov))
    }
    fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(self.writev_impl(offset, iov, fua))
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.flush_impl())
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            if self.opts.discard == DiscardMode::Ignore || self.block_device {
                return Ok(());
            }
            let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            match self.fallocate(mode, offset, len).await {
                Err(e) if errno(&e) == libc::EOPNOTSUPP => Ok(()),
                other => other,
            }
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.write_zeroes_impl(offset, len, may_unmap))
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(self.block_status_impl(offset, len))
    }
    fn block_status_cached(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        self.block_status_known(offset, len)
    }
    fn set_perm(
        &self,
        perm: crate::block::node::perm::Perm,
        shared: crate::block::node::perm::Perm,
    ) -> Result<(), crate::block::node::perm::PermError> {
        self.lock.set(self.raw(), perm, shared)
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        let r = if self.block_device {
            Err(io::Error::from_raw_os_error(libc::ENOTSUP))
        } else {
            self.extents.invalidate();
            sys::ftruncate(self.raw(), size).map(|()| self.size.store(size, Relaxed))
        };
        Box::pin(std::future::ready(r))
    }
    fn resize_falloc(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            let old = self.size.load(Relaxed);
            if size <= old || self.block_device {
                return self.resize(size).await;
            }
            // fallocate past the end grows the file with the area allocated, or fails
            // leaving it as it was. Allocating may take long on a big range: on a worker,
            // as QEMU's thread pool. A filesystem without it grows the file plainly.
            let fd = self.fd.clone();
            self.extents.invalidate();
            let r =
                worker_pool::run(move || sys::fallocate(fd.as_raw_fd(), 0, old, size - old)).await;
            match r {
                Ok(()) => {
                    self.size.store(size, Relaxed);
                    Ok(())
                }
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => self.resize(size).await,
                Err(e) => Err(e),
            }
        })
    }
    fn invalidate_cache(&self, _writable: bool) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async move {
            // Another process may have written and grown the file.
            self.extents.invalidate();
            if !self.block_device {
                let len = self
                    .fd
                    .try_clone()
                    .and_then(|fd| std::fs::File::from(fd).metadata())
                    .map_err(|e| {
                        format!(
                            "Could not refresh the size of '{}': {e}",
                            self.opts.filename
                        )
                    })?
                    .len();
                self.size.store(len, Relaxed);
            }
            Ok(())
        })
    }
}
