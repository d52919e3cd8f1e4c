//! The block layer: drivers behind one trait, and `BlockNode`, a named driver instance with
//! flags and statistics.
//!
//! Drivers are `Send + Sync` so a node can be shared by exports on several IoThreads; their
//! request futures are not `Send`: a request runs entirely on the IoThread that issued it
//! (for the io_uring backend, on that thread's own ring).

pub mod blocker;
pub mod cbw_driver;
pub mod copy_before_write;
pub mod create;
pub mod dirty_bitmap;
pub mod file;
pub mod graph;
pub mod hook;
pub mod iov;
pub mod link;
pub mod nbd;
pub mod null;
pub mod perm;
pub mod qcow2;
pub mod range_lock;
pub mod raw;
pub mod rbd;
pub mod snapshot_access;
pub mod stats;
pub mod throttle;

pub use iov::IoVec;

/// Runs a blocking call on the current IoThread's worker pool and completes on the loop
/// (drivers whose libraries only offer blocking calls for some operations).
pub(crate) use file::threads::run as offload;

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use stord_aio::sys::now_ns;
use stord_aio::AlignedBuf;

use stats::Op;

/// A request's future (not Send: it belongs to the issuing thread).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// The buffer requests carry: aligned for O_DIRECT, owned for the duration of the I/O.
pub type Buf = AlignedBuf;

/// Memory alignment of request buffers.
pub const BUF_ALIGN: usize = 4096;

/// A fresh request buffer of `len` zero bytes.
pub fn new_buf(len: usize) -> Buf {
    AlignedBuf::zeroed(len, BUF_ALIGN)
}

/// A request's data buffer of `len` bytes from the IoThread's pool (no allocation, no
/// zero-fill in steady state). Its initial bytes are unspecified: use it only where the
/// whole buffer is written before anyone reads it (data read from a node, whose drivers
/// fill every byte or fail, or received from a client).
pub fn request_buf(len: usize) -> Buf {
    AlignedBuf::from_pool(len)
}

/// Counts one request whose data went through a buffer of ours instead of straight
/// to or from the memory it came in (`block.bounced` in the current loop's statistics).
pub(crate) fn count_bounce() {
    stord_aio::with_current_context(|c| c.counter("block.bounced").add(1));
}

/// An I/O error as strerror words it, as QEMU's messages quote it (without Rust's
/// " (os error N)").
pub(crate) fn os_text(e: &io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// Runs a block request future to completion from code that is not on a loop, or
/// that may not wait inside its own (a node being opened reads its image): on a short-lived
/// thread with a loop of its own, as every driver can serve requests from any thread.
pub fn block_on_helper<T, F>(make: impl FnOnce() -> F + Send + 'static) -> io::Result<T>
where
    T: Send + 'static,
    F: Future<Output = T> + 'static,
{
    std::thread::Builder::new()
        .name("stord-open".into())
        .spawn(move || {
            let ctx = stord_aio::AioContext::new(Default::default())?;
            Ok(ctx.block_on(make()))
        })?
        .join()
        .map_err(|_| io::Error::other("the open thread panicked"))?
}

/// Closes running on threads of their own (a node's close past its bound, an rbd image's
/// `rbd_close`): while any runs, the process must not run its exit handlers (see
/// [`closes_pending`]).
static CLOSES_PENDING: AtomicU64 = AtomicU64::new(0);

/// A close running on a thread of its own; counted until dropped.
pub(crate) struct PendingClose(());

impl PendingClose {
    pub(crate) fn new() -> Self {
        CLOSES_PENDING.fetch_add(1, Relaxed);
        PendingClose(())
    }
}

impl Drop for PendingClose {
    fn drop(&mut self) {
        CLOSES_PENDING.fetch_sub(1, Relaxed);
    }
}

/// Closes still running on threads of their own (storage that does not answer): the
/// process leaves without exit handlers while there are any.
pub fn closes_pending() -> u64 {
    CLOSES_PENDING.load(Relaxed)
}

/// As [`block_on_helper`], waiting at most `limit`: None if the helper had not finished by
/// then (it goes on by itself, counted in [`closes_pending`]; what it holds is released
/// when it ends).
pub fn block_on_helper_within<T, F>(
    limit: std::time::Duration,
    make: impl FnOnce() -> F + Send + 'static,
) -> Option<io::Result<T>>
where
    T: Send + 'static,
    F: Future<Output = T> + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("stord-close".into())
        .spawn(move || {
            let _pending = PendingClose::new();
            let r = stord_aio::AioContext::new(Default::default()).map(|ctx| ctx.block_on(make()));
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return Some(Err(e));
    }
    match rx.recv_timeout(limit) {
        Ok(r) => Some(r),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Some(Err(io::Error::other("the helper thread panicked")))
        }
    }
}

/// The allocation status of a range's first extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStatus {
    /// Length of the extent (at least 1, at most the range asked about).
    pub len: u64,
    /// The extent has storage allocated (false: a hole).
    pub allocated: bool,
    /// The extent reads as zeroes.
    pub zero: bool,
}

/// An internal snapshot as QMP reports it (QEMU's SnapshotInfo).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: String,
    pub name: String,
    pub vm_state_size: u64,
    pub date_sec: u64,
    pub date_nsec: u64,
    pub vm_clock_nsec: u64,
    /// None: the snapshot records none (QEMU's -1).
    pub icount: Option<u64>,
}

/// A request the driver does not do: ENOTSUP, "Operation not supported".
pub(crate) fn unsupported_fut<'a, T: 'a>() -> BoxFut<'a, io::Result<T>> {
    Box::pin(std::future::ready(Err(io::Error::from_raw_os_error(
        libc::ENOTSUP,
    ))))
}

/// A block driver. Offsets and lengths have been checked against the size by the node.
pub trait BlockDriver: Send + Sync {
    /// The driver's name as on the command line (`null-co`, `file`).
    fn driver_name(&self) -> &'static str;
    /// Current size in bytes.
    fn size(&self) -> u64;
    /// Reads `buf.len()` bytes at `offset` into `buf`.
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)>;
    /// Writes `buf` at `offset`; with `fua`, the data is durable when this completes.
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)>;
    /// Reads `iov.len()` bytes at `offset` into `iov`'s pieces (memory someone else may
    /// own, such as a guest's). The default reads into a pooled buffer and copies; drivers
    /// that can fill the pieces themselves (the file backend, with readv) override it.
    fn readv(&self, offset: u64, iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(async move {
            count_bounce();
            let (r, buf) = self.read(offset, request_buf(iov.len())).await;
            let mut iov = iov;
            if r.is_ok() {
                iov.copy_in(0, &buf);
            }
            (r, iov)
        })
    }
    /// Writes `iov`'s pieces at `offset`; the default copies them into a pooled buffer.
    fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(async move {
            count_bounce();
            let mut buf = request_buf(iov.len());
            iov.copy_out(0, &mut buf);
            let (r, _) = self.write(offset, buf, fua).await;
            (r, iov)
        })
    }
    /// Makes completed writes durable.
    fn flush(&self) -> BoxFut<'_, io::Result<()>>;
    /// Drops the data of a range (may do nothing).
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>>;
    /// Zeroes a range; `may_unmap` allows leaving a hole.
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>>;
    /// Status of the first extent of `[offset, offset+len)`.
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>>;
    /// The status of the first extent when the driver knows it without I/O (the null
    /// device always, a file from its extent cache): NBD asks before every read, and this
    /// answers with no future to allocate.
    fn block_status_cached(&self, _offset: u64, _len: u64) -> Option<BlockStatus> {
        None
    }
    /// Block status costs a round trip to the storage (an NBD request, librbd walking its
    /// object map on a worker): callers that only save bandwidth with it (an NBD export's
    /// sparse read asking whether the range is a hole) skip it.
    fn block_status_costly(&self) -> bool {
        false
    }
    /// `cache.no-flush=on` holds for the node (flushes succeed without reaching storage),
    /// as `query-named-block-nodes` reports it; a format or filter reports its child's.
    fn no_flush(&self) -> bool {
        false
    }
    /// How deep in the backing chain the first extent of `[offset, offset+len)` is
    /// allocated: its length, and 1 for this node, 2 for its backing node, ..., 0 for
    /// nowhere (NBD's `qemu:allocation-depth`). Nodes without a backing chain are allocated
    /// here everywhere, as QEMU counts protocol nodes.
    fn allocation_depth(&self, _offset: u64, len: u64) -> BoxFut<'_, io::Result<(u64, u32)>> {
        Box::pin(std::future::ready(Ok((len, 1))))
    }
    /// Changes the size.
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>>;
    /// Changes the size with the new area allocated where the storage can (QEMU's
    /// truncate with `preallocation=falloc`); elsewhere as [`resize`](Self::resize).
    fn resize_falloc(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        self.resize(size)
    }
    /// Extra description for query commands (e.g. the file name).
    fn filename(&self) -> Option<String> {
        None
    }
    /// Whether query commands report the image's size on its host (`actual-size`; QEMU
    /// has none for network storage).
    fn reports_host_size(&self) -> bool {
        true
    }
    /// Whether query commands report a dirty flag (QEMU's bdrv_get_info answers; it
    /// does not for an NBD server's export).
    fn has_image_info(&self) -> bool {
        true
    }
    /// Bytes of storage the node takes on its host (st_blocks of the image file), if known.
    fn allocated_bytes(&self) -> Option<u64> {
        None
    }
    /// The node goes inactive (another process takes the image over): what it caches is
    /// written and flushed (QEMU's bdrv_inactivate).
    fn inactivate(&self) -> BoxFut<'_, io::Result<()>> {
        self.flush()
    }

    /// The node is active again after another process may have written the image: what
    /// it caches of it is read again (QEMU's bdrv_co_invalidate_cache), for writing if
    /// `writable`.
    fn invalidate_cache(&self, _writable: bool) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    /// Makes a driver opened read-only able to write (QEMU's reopen with read-only off,
    /// as block-commit asks of a backing image it commits into): a file reopens its
    /// descriptor read-write; a format driver whose state allows it says so. Its children
    /// are made writable first, by the caller.
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        let name = self.driver_name();
        Box::pin(async move { Err(format!("the {name} driver cannot reopen read-write")) })
    }

    /// The image's cluster size, for format drivers that have one.
    fn cluster_size(&self) -> Option<u64> {
        None
    }
    /// The child nodes, each with its role (`file`), for the graph's bookkeeping.
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        Vec::new()
    }
    /// For a filter: the child every write goes to unchanged but for an offset added
    /// (its bitmaps see the write too, as each QEMU node marks what passes through it).
    fn passes_through(&self) -> Option<(&Arc<BlockNode>, u64)> {
        None
    }
    /// What this node takes of its child `role` (and lets others hold) when its users
    /// together take `perm` and share `shared`, and the node is `writable`. The default
    /// passes them through, as QEMU's filters do; format nodes need more of their file.
    fn child_perms(
        &self,
        _role: &'static str,
        perm: perm::Perm,
        shared: perm::Perm,
        _writable: bool,
    ) -> (perm::Perm, perm::Perm) {
        (perm, shared)
    }
    /// The node's users now take `perm` and share `shared`: a driver with storage other
    /// processes can open (a file) makes that visible to them, or refuses.
    fn set_perm(&self, _perm: perm::Perm, _shared: perm::Perm) -> Result<(), perm::PermError> {
        Ok(())
    }
    /// The node passed every check of its open and goes into service: a format driver
    /// may now write what an open writes (qcow2 marks its bitmaps in use).
    fn activate(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    /// Whether the image could store a new persistent bitmap (None: this driver stores
    /// none; Some(Err): why not this one).
    fn can_store_bitmap(&self, _granularity: u64, _name: &str) -> Option<Result<(), String>> {
        None
    }
    /// Writes the node's persistent bitmaps to the image (at close).
    fn store_bitmaps(
        &self,
        _bitmaps: Vec<Arc<dirty_bitmap::DirtyBitmap>>,
    ) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    /// Takes a persistent bitmap out of the image.
    fn remove_stored_bitmap<'a>(&'a self, _name: &'a str) -> BoxFut<'a, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    /// Copies what the backing chain holds in `[offset, offset + len)` into this image
    /// where it has nothing of its own (QEMU's copy-on-read, as block-stream uses it): the
    /// content reads the same before and after.
    fn populate(&self, _offset: u64, _len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the driver has no backing file to copy from",
        ))))
    }
    /// Points the backing link at `new` (QEMU's bdrv_set_backing_hd); the old one back.
    fn set_backing(&self, _new: Option<Arc<BlockNode>>) -> Result<Option<Arc<BlockNode>>, String> {
        Err(format!(
            "Driver '{}' of node does not support backing files",
            self.driver_name()
        ))
    }
    /// A `copy-before-write` node's point-in-time view (what `snapshot-access` reads).
    fn copy_before_write(&self) -> Option<Arc<copy_before_write::CopyBeforeWrite>> {
        None
    }
    /// Whether the driver keeps internal snapshots (QEMU's bdrv_can_snapshot).
    fn can_snapshot(&self) -> bool {
        false
    }
    /// The internal snapshots.
    fn list_snapshots(&self) -> BoxFut<'_, io::Result<Vec<SnapshotInfo>>> {
        unsupported_fut()
    }
    /// Takes internal snapshot `name` at `date` (seconds, nanoseconds).
    fn create_snapshot<'a>(
        &'a self,
        _name: &'a str,
        _date: (u32, u32),
    ) -> BoxFut<'a, io::Result<SnapshotInfo>> {
        unsupported_fut()
    }
    /// Deletes the internal snapshot `id` and/or `name`: it, or None if there is none.
    fn delete_snapshot<'a>(
        &'a self,
        _id: Option<&'a str>,
        _name: Option<&'a str>,
    ) -> BoxFut<'a, io::Result<Option<SnapshotInfo>>> {
        unsupported_fut()
    }
    /// Writes the backing file's name and format into the image (QEMU's
    /// bdrv_change_backing_file); None: the image names no backing file.
    fn change_backing_file<'a>(
        &'a self,
        _backing: Option<(&'a str, Option<&'a str>)>,
    ) -> BoxFut<'a, io::Result<()>> {
        Box::pin(std::future::ready(Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "Operation not supported",
        ))))
    }
}

/// `detect-zeroes`: what a node does with writes whose data is all zeroes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DetectZeroes {
    /// Writes them as they are.
    #[default]
    Off,
    /// Turns them into write-zeroes requests.
    On,
    /// Into write-zeroes that may leave holes (needs `discard=unmap` on the node).
    Unmap,
}

impl DetectZeroes {
    /// As QMP names it.
    pub fn name(self) -> &'static str {
        match self {
            DetectZeroes::Off => "off",
            DetectZeroes::On => "on",
            DetectZeroes::Unmap => "unmap",
        }
    }
}

/// Options every node takes, whatever its driver (QEMU's generic block options).
#[derive(Debug, Clone, Copy, Default)]
pub struct CommonOptions {
    /// `detect-zeroes`.
    pub detect_zeroes: DetectZeroes,
    /// `discard=unmap|on`: discards reach the driver (QEMU's default, `ignore`, drops
    /// them at the node).
    pub unmap: bool,
    /// `force-share=on`.
    pub force_share: bool,
}

/// Whether every byte of `b` is zero (16 bytes at a time).
pub fn is_zero(b: &[u8]) -> bool {
    let chunks = b.chunks_exact(16);
    let tail = chunks.remainder();
    chunks
        .map(|c| u128::from_ne_bytes(c.try_into().expect("16 bytes")))
        .all(|w| w == 0)
        && tail.iter().all(|&x| x == 0)
}

/// A named block node.
pub struct BlockNode {
    /// `node-name`.
    pub name: String,
    /// Refuse writes (changes with `blockdev-reopen`).
    read_only: std::sync::atomic::AtomicBool,
    /// Opened for writing (or reopened so): whether it may be made writable.
    opened_writable: std::sync::atomic::AtomicBool,
    /// Inactive (QEMU's BDRV_O_INACTIVE, `active=off`, `blockdev-set-active`): another
    /// process owns the image; this node reads, writes nothing and holds no lock.
    inactive: std::sync::atomic::AtomicBool,
    /// Opened with O_DIRECT.
    pub direct: bool,
    /// Counters (`query-blockstats`).
    pub stats: stats::NodeStats,
    /// `force-share=on`: every user of the node shares everything (read-only nodes only).
    pub(crate) force_share: bool,
    /// `detect-zeroes`.
    detect_zeroes: DetectZeroes,
    /// Discards go to the driver (`discard=unmap`); else the node drops them.
    unmap: bool,
    /// Who uses the node with which permissions ([`perm`]).
    users: std::sync::Mutex<perm::Users>,
    /// Dirty bitmaps, oldest first; `has_bitmaps` spares writes the lock when there are
    /// none.
    bitmaps: std::sync::RwLock<Vec<Arc<dirty_bitmap::DirtyBitmap>>>,
    has_bitmaps: std::sync::atomic::AtomicBool,
    /// Why other jobs and graph changes must leave the node alone now ([`blocker`]).
    blocked: std::sync::Mutex<Option<String>>,
    /// Jobs running on the node ([`blocker::JobAttachment`]).
    jobs_attached: std::sync::atomic::AtomicUsize,
    /// Of those, the jobs that reach it through a filter of theirs.
    jobs_filtered: std::sync::atomic::AtomicUsize,
    /// What jobs run around the node's requests ([`hook`]).
    hooks: hook::Hooks,
    /// `block-set-write-threshold`: the first write ending past it announces
    /// BLOCK_WRITE_THRESHOLD and clears it (0: none).
    write_threshold: AtomicU64,
    /// Where the node's events go (set by the daemon).
    events: std::sync::OnceLock<crate::events::EventPoster>,
    /// The IoThread the node was moved to (x-blockdev-set-iothread): its exports run
    /// there unless they name one.
    home: std::sync::Mutex<Option<String>>,
    driver: Box<dyn BlockDriver>,
}

fn einval(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

impl BlockNode {
    /// Wraps a driver.
    pub fn new(name: String, driver: Box<dyn BlockDriver>, read_only: bool, direct: bool) -> Self {
        Self {
            name,
            read_only: std::sync::atomic::AtomicBool::new(read_only),
            opened_writable: std::sync::atomic::AtomicBool::new(!read_only),
            inactive: Default::default(),
            direct,
            stats: Default::default(),
            force_share: false,
            detect_zeroes: DetectZeroes::Off,
            unmap: true,
            users: Default::default(),
            bitmaps: Default::default(),
            has_bitmaps: Default::default(),
            blocked: Default::default(),
            jobs_attached: Default::default(),
            jobs_filtered: Default::default(),
            hooks: Default::default(),
            write_threshold: AtomicU64::new(0),
            events: Default::default(),
            home: Default::default(),
            driver,
        }
    }

    /// With the generic options (set before the node is shared).
    pub fn with_options(mut self, o: CommonOptions) -> Self {
        self.force_share = o.force_share;
        self.detect_zeroes = o.detect_zeroes;
        self.unmap = o.unmap;
        self
    }

    /// The write-zeroes an all-zero write of `len` bytes becomes under `detect-zeroes`, if
    /// any: its `may_unmap`.
    fn zero_write(&self, data_is_zero: impl FnOnce() -> bool) -> Option<bool> {
        match self.detect_zeroes {
            DetectZeroes::Off => None,
            mode => data_is_zero().then_some(mode == DetectZeroes::Unmap && self.unmap),
        }
    }

    /// Whether writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.read_only.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the node can be made writable: it was opened (or reopened) for writing.
    pub fn can_write(&self) -> bool {
        self.opened_writable
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reopens a node opened read-only so it can write ([`BlockDriver::reopen_rw`]; its
    /// children first, by the caller); it stays read-only until
    /// [`set_read_only`](Self::set_read_only) says otherwise.
    pub async fn reopen_rw(&self) -> Result<(), String> {
        if !self.can_write() {
            self.driver.reopen_rw().await?;
            self.opened_writable
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// Whether the node is inactive.
    pub fn is_inactive(&self) -> bool {
        self.inactive.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Marks the node inactive or active; the caller refreshes its permissions and tells
    /// its driver ([`BlockDriver::inactivate`], [`BlockDriver::invalidate_cache`]).
    pub fn set_inactive(&self, inactive: bool) {
        self.inactive
            .store(inactive, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets `read-only` and takes what the node then needs of its children (a writable
    /// format node write access to its file, and so the file's locks); on a conflict the
    /// node is as it was.
    pub fn refresh_perms_as(&self, read_only: bool) -> Result<(), perm::PermError> {
        let was = self.is_read_only();
        self.set_read_only(read_only);
        self.refresh_perms().inspect_err(|_| {
            self.set_read_only(was);
            let _ = self.refresh_perms();
        })
    }

    /// `blockdev-reopen` of `read-only`: the caller checked `can_write` and the users.
    pub fn set_read_only(&self, ro: bool) {
        self.read_only
            .store(ro, std::sync::atomic::Ordering::Relaxed);
    }

    /// The driver's name.
    pub fn driver_name(&self) -> &'static str {
        self.driver.driver_name()
    }

    /// The backing file, if any.
    pub fn filename(&self) -> Option<String> {
        self.driver.filename()
    }

    /// See [`BlockDriver::reports_host_size`].
    pub fn reports_host_size(&self) -> bool {
        self.driver.reports_host_size()
    }

    /// See [`BlockDriver::has_image_info`].
    pub fn has_image_info(&self) -> bool {
        self.driver.has_image_info()
    }

    /// The driver, for a parent node that forwards requests to it (no second round of
    /// checks and accounting: the parent's node did them).
    pub fn driver(&self) -> &dyn BlockDriver {
        &*self.driver
    }

    /// A filter's discard handed to this node's driver: dropped unless this node passes
    /// discards on (`discard=unmap`), as QEMU's bdrv_co_pdiscard checks each node's flag.
    pub fn driver_discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        if !self.unmap {
            return Box::pin(std::future::ready(Ok(())));
        }
        self.driver.discard(offset, len)
    }

    /// Bytes of host storage the node takes, if known.
    pub fn allocated_bytes(&self) -> Option<u64> {
        self.driver.allocated_bytes()
    }

    /// The child nodes with their roles.
    pub fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        self.driver.children()
    }

    /// Marks [offset, offset + len) in every recording bitmap (after the write, whatever
    /// its outcome, as QEMU's write_req_finish), here and in the nodes below that a filter
    /// passes the write to (a discard only as far down as the nodes pass discards on).
    fn mark_dirty(&self, offset: u64, len: u64) {
        self.mark_dirty_as(offset, len, false)
    }

    fn mark_dirty_as(&self, offset: u64, len: u64, discard: bool) {
        // A node that drops discards passes none on (QEMU checks each node's flag).
        if !dirty_bitmap::any_exist() || (discard && !self.unmap) {
            return;
        }
        if self.has_bitmaps.load(Relaxed) {
            for b in self
                .bitmaps
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
            {
                b.mark(offset, len);
            }
        }
        if let Some((child, shift)) = self.driver.passes_through() {
            child.mark_dirty_as(offset + shift, len, discard);
        }
    }

    /// The bitmaps, newest first (as QEMU lists them); jobs' trackers are not among them.
    pub fn bitmaps(&self) -> Vec<Arc<dirty_bitmap::DirtyBitmap>> {
        let mut v: Vec<_> = self
            .bitmaps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|b| !b.is_internal())
            .cloned()
            .collect();
        v.reverse();
        v
    }

    /// Starts a job's record of the writes to this node (see
    /// [`dirty_bitmap::DirtyBitmap::tracker`]); [`Self::forget_bitmap`] ends it.
    pub fn add_tracker(&self, b: dirty_bitmap::DirtyBitmap) -> Arc<dirty_bitmap::DirtyBitmap> {
        let b = Arc::new(b);
        let mut list = self.bitmaps.write().unwrap_or_else(|e| e.into_inner());
        list.push(b.clone());
        self.has_bitmaps.store(true, Relaxed);
        b
    }

    /// The bitmap `name`.
    pub fn bitmap(
        &self,
        name: &str,
    ) -> Result<Arc<dirty_bitmap::DirtyBitmap>, dirty_bitmap::BitmapError> {
        self.bitmaps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|b| b.name == name && !b.is_internal())
            .cloned()
            .ok_or_else(|| dirty_bitmap::BitmapError::NotFound(name.into()))
    }

    /// Adds a bitmap (its name must be new on this node).
    pub fn add_bitmap(
        &self,
        b: dirty_bitmap::DirtyBitmap,
    ) -> Result<(), dirty_bitmap::BitmapError> {
        let mut list = self.bitmaps.write().unwrap_or_else(|e| e.into_inner());
        if list.iter().any(|x| x.name == b.name && !x.is_internal()) {
            return Err(dirty_bitmap::BitmapError::Exists(b.name.clone()));
        }
        if list.iter().filter(|x| !x.is_internal()).count() >= dirty_bitmap::MAX_PER_NODE {
            return Err(dirty_bitmap::BitmapError::TooMany);
        }
        list.push(Arc::new(b));
        self.has_bitmaps.store(true, Relaxed);
        Ok(())
    }

    /// Carries the persistent bitmaps its image holds (at open; no limit on their count:
    /// they are the image's).
    pub fn adopt_bitmaps(&self, loaded: Vec<dirty_bitmap::DirtyBitmap>) {
        if loaded.is_empty() {
            return;
        }
        let mut list = self.bitmaps.write().unwrap_or_else(|e| e.into_inner());
        list.extend(loaded.into_iter().map(Arc::new));
        self.has_bitmaps.store(true, Relaxed);
    }

    /// `block-dirty-bitmap-add`: a new bitmap, stored in the image at close when
    /// `persistent` (QEMU's checks and texts, in its order).
    pub fn new_bitmap(
        &self,
        name: &str,
        granularity: Option<u64>,
        persistent: bool,
        disabled: bool,
    ) -> Result<(), dirty_bitmap::BitmapError> {
        use dirty_bitmap::BitmapError;
        if name.is_empty() {
            return Err(BitmapError::EmptyName);
        }
        let granularity = match granularity {
            Some(g) if g < 512 || !g.is_power_of_two() => return Err(BitmapError::BadGranularity),
            Some(g) => g,
            None => self.default_bitmap_granularity(),
        };
        if persistent {
            if self.bitmap(name).is_ok() {
                return Err(BitmapError::Exists(name.into()));
            }
            let why = match self.driver.can_store_bitmap(granularity, name) {
                None => {
                    return Err(BitmapError::CannotStore(format!(
                        "Can't store persistent bitmaps to {}: Operation not supported",
                        self.name
                    )))
                }
                Some(Ok(())) => self.stored_bitmaps_fit(name),
                Some(Err(e)) => Err(e),
            };
            if let Err(e) = why {
                return Err(BitmapError::CannotStore(format!(
                    "Can't make bitmap '{name}' persistent in '{}': {e}",
                    self.name
                )));
            }
        }
        let b = dirty_bitmap::DirtyBitmap::new(name, granularity, self.size(), !disabled)?;
        b.set_persistent(persistent);
        self.add_bitmap(b)
    }

    /// Whether one more persistent bitmap fits the image's directory (QEMU's counts).
    fn stored_bitmaps_fit(&self, name: &str) -> Result<(), String> {
        let list = self.bitmaps();
        let stored: Vec<&str> = list
            .iter()
            .filter(|b| b.is_persistent())
            .map(|b| b.name.as_str())
            .chain([name])
            .collect();
        if stored.len() > 65535 {
            return Err("Maximum number of persistent bitmaps is already reached".into());
        }
        let dir: u64 = stored
            .iter()
            .map(|n| (24 + n.len() as u64).div_ceil(8) * 8)
            .sum();
        if dir > 64 << 20 {
            return Err("Not enough space in the bitmap directory".into());
        }
        Ok(())
    }

    /// `block-dirty-bitmap-remove`: a persistent bitmap leaves the image at once (its
    /// directory rewritten), as in QEMU.
    pub async fn remove_bitmap(&self, name: &str) -> Result<(), dirty_bitmap::BitmapError> {
        let b = self.bitmap(name)?;
        b.check(dirty_bitmap::Use::Remove)?;
        self.unstore_bitmap(&b).await?;
        self.forget_bitmap(&b);
        Ok(())
    }

    /// Takes a persistent bitmap out of the image (it stays on the node: stored again at
    /// close if it is not forgotten by then).
    pub async fn unstore_bitmap(
        &self,
        b: &dirty_bitmap::DirtyBitmap,
    ) -> Result<(), dirty_bitmap::BitmapError> {
        let name = b.name.as_str();
        if b.is_persistent() {
            self.driver.remove_stored_bitmap(name).await.map_err(|e| {
                dirty_bitmap::BitmapError::Io(format!("Failed to update bitmap extension: {e}"))
            })?;
        }
        Ok(())
    }

    /// Drops a bitmap from the node.
    pub fn forget_bitmap(&self, b: &Arc<dirty_bitmap::DirtyBitmap>) {
        let mut list = self.bitmaps.write().unwrap_or_else(|e| e.into_inner());
        list.retain(|x| !Arc::ptr_eq(x, b));
        self.has_bitmaps.store(!list.is_empty(), Relaxed);
    }

    /// Puts the node in service (see [`BlockDriver::activate`]); only nodes that carry
    /// persistent bitmaps have anything to do.
    pub async fn activate(&self) -> io::Result<()> {
        if !self.has_persistent_bitmaps() {
            return Ok(());
        }
        self.driver.activate().await
    }

    /// Whether the node carries bitmaps its image stores.
    pub fn has_persistent_bitmaps(&self) -> bool {
        self.has_bitmaps.load(Relaxed) && self.bitmaps().iter().any(|b| b.is_persistent())
    }

    /// Closes the node for good: flushed, and its persistent bitmaps written to the image
    /// if it was opened for writing (QEMU's bdrv_close).
    pub async fn close(&self) -> io::Result<()> {
        if !self.can_write() {
            return Ok(());
        }
        self.flush().await?;
        let stored: Vec<_> = self
            .bitmaps()
            .into_iter()
            .filter(|b| b.is_persistent())
            .collect();
        if !stored.is_empty() {
            self.driver.store_bitmaps(stored).await?;
        }
        Ok(())
    }

    /// The granularity a new bitmap gets by default: the image's cluster size, else
    /// 64 KiB (QEMU's bdrv_get_default_bitmap_granularity).
    pub fn default_bitmap_granularity(&self) -> u64 {
        self.driver.cluster_size().unwrap_or(65536).max(512)
    }

    /// `detect-zeroes` as set on this node.
    pub fn detect_zeroes(&self) -> DetectZeroes {
        self.detect_zeroes
    }

    /// The node below this one that QEMU's bdrv_filter_or_cow_bs names: the backing
    /// node, else a filter's (raw, throttle) file node.
    pub fn filtered_or_backing(&self) -> Option<Arc<BlockNode>> {
        let children = self.children();
        let pick = |role: &str| children.iter().find(|(r, _)| *r == role);
        pick("backing")
            .or_else(|| {
                matches!(self.driver_name(), "raw" | "throttle")
                    .then(|| pick("file"))
                    .flatten()
            })
            .map(|(_, n)| (*n).clone())
    }

    /// How many backing files lie below this node (QEMU's `backing_file_depth`: the
    /// chain of `backing` children; filters and files have none of their own).
    pub fn backing_depth(&self) -> u32 {
        self.children()
            .iter()
            .find(|(role, _)| *role == "backing")
            .map_or(0, |(_, b)| 1 + b.backing_depth())
    }

    /// Current size.
    pub fn size(&self) -> u64 {
        self.driver.size()
    }

    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(einval("request beyond the end of the node")),
        }
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.is_read_only() || self.is_inactive() {
            Err(io::Error::from_raw_os_error(libc::EPERM))
        } else {
            Ok(())
        }
    }

    /// Whether `[offset, offset + len)` may be written now: the node is writable, the
    /// range inside it, and the hooks ran (a backup copied what the write would change).
    /// What the hooks hold comes back, to be kept until the request is done.
    async fn may_write<'h>(
        &self,
        hooks: &'h hook::HookList,
        offset: u64,
        len: u64,
    ) -> io::Result<Vec<Option<hook::Hold<'h>>>> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        self.note_write(offset, len);
        hook::before_write(hooks, offset, len).await
    }

    /// Whether discards and zero writes that may unmap reach the driver (`discard=unmap`;
    /// QEMU's BDRV_O_UNMAP).
    pub fn unmaps(&self) -> bool {
        self.unmap
    }

    /// The IoThread the node belongs to, if it was moved to one.
    pub fn home(&self) -> Option<String> {
        self.home.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_home(&self, iothread: Option<String>) {
        *self.home.lock().unwrap_or_else(|e| e.into_inner()) = iothread;
    }

    /// Where the node's events go.
    pub fn set_event_poster(&self, p: crate::events::EventPoster) {
        let _ = self.events.set(p);
    }

    /// `block-set-write-threshold` (0 clears it).
    pub fn set_write_threshold(&self, offset: u64) {
        self.write_threshold.store(offset, Relaxed);
    }

    pub fn write_threshold(&self) -> u64 {
        self.write_threshold.load(Relaxed)
    }

    /// A write of `[offset, offset + len)` is about to reach the node (or its driver,
    /// from a format above that writes to it directly): past the write threshold, the
    /// threshold is announced and cleared, once (QEMU's
    /// bdrv_write_threshold_check_write).
    pub fn note_write(&self, offset: u64, len: u64) {
        let threshold = self.write_threshold.load(Relaxed);
        let end = offset.saturating_add(len);
        if threshold == 0 || end <= threshold {
            return;
        }
        if self
            .write_threshold
            .compare_exchange(threshold, 0, Relaxed, Relaxed)
            .is_ok()
        {
            if let Some(e) = self.events.get() {
                e.emit(
                    "BLOCK_WRITE_THRESHOLD",
                    serde_json::json!({
                        "node-name": self.name,
                        "amount-exceeded": end - threshold,
                        "write-threshold": threshold,
                    }),
                );
            }
        }
    }

    /// Runs `read` with what the hooks hold for a read of `[offset, offset + len)` (the
    /// request starts only once they hold it).
    async fn read_hooked<F: Future>(
        &self,
        offset: u64,
        len: u64,
        read: impl FnOnce() -> F,
    ) -> F::Output {
        let hooks = self.hooks.current();
        let mut held = Vec::new();
        for h in hooks.iter().flatten() {
            held.extend(h.before_read(offset, len).await);
        }
        let r = read().await;
        drop(held);
        r
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub async fn read(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        let start = now_ns();
        let len = buf.len() as u64;
        if let Err(e) = self.check_range(offset, len) {
            self.stats.refused(Op::Read, &e);
            return (Err(e), buf);
        }
        let (r, buf) = self
            .read_hooked(offset, len, || self.driver.read(offset, buf))
            .await;
        self.stats.done(Op::Read, start, len, r.is_ok());
        (r, buf)
    }

    /// Writes `buf` at `offset`.
    pub async fn write(&self, offset: u64, buf: Buf, fua: bool) -> (io::Result<()>, Buf) {
        let start = now_ns();
        let len = buf.len() as u64;
        let hooks = self.hooks.current();
        let held = match self.may_write(&hooks, offset, len).await {
            Ok(h) => h,
            Err(e) => {
                self.stats.refused(Op::Write, &e);
                return (Err(e), buf);
            }
        };
        let (r, buf) = match self.zero_write(|| is_zero(&buf)) {
            Some(may_unmap) => (self.zeroes_then_fua(offset, len, may_unmap, fua).await, buf),
            None => self.driver.write(offset, buf, fua).await,
        };
        self.wrote(start, offset, len, &r);
        let what = hook::Written::Data(&buf);
        hook::after_write(&hooks, &held, (offset, len), r.is_ok(), what).await;
        drop(held);
        (r, buf)
    }

    /// Reads `iov.len()` bytes at `offset` into `iov`.
    pub async fn readv(&self, offset: u64, iov: IoVec) -> (io::Result<()>, IoVec) {
        let start = now_ns();
        let len = iov.len() as u64;
        if let Err(e) = self.check_range(offset, len) {
            self.stats.refused(Op::Read, &e);
            return (Err(e), iov);
        }
        let (r, iov) = self
            .read_hooked(offset, len, || self.driver.readv(offset, iov))
            .await;
        self.stats.done(Op::Read, start, len, r.is_ok());
        (r, iov)
    }

    /// Writes `iov` at `offset`.
    pub async fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> (io::Result<()>, IoVec) {
        let start = now_ns();
        let len = iov.len() as u64;
        let hooks = self.hooks.current();
        let held = match self.may_write(&hooks, offset, len).await {
            Ok(h) => h,
            Err(e) => {
                self.stats.refused(Op::Write, &e);
                return (Err(e), iov);
            }
        };
        let zero = self.zero_write(|| {
            let mut b = request_buf(iov.len());
            iov.copy_out(0, &mut b);
            is_zero(&b)
        });
        let (r, iov) = match zero {
            Some(may_unmap) => (self.zeroes_then_fua(offset, len, may_unmap, fua).await, iov),
            None => self.driver.writev(offset, iov, fua).await,
        };
        self.wrote(start, offset, len, &r);
        let what = hook::Written::Iov(&iov);
        hook::after_write(&hooks, &held, (offset, len), r.is_ok(), what).await;
        drop(held);
        (r, iov)
    }

    /// Counts a request a format above sent straight to this node's driver (qcow2's data
    /// and metadata I/O skips the node's checks), as the node's own.
    pub fn count_direct(&self, op: Op, start: u64, end: u64, len: u64, ok: bool) {
        if ok && op == Op::Write {
            self.stats.wrote_up_to(end);
        }
        self.stats.done(op, start, len, ok);
    }

    /// After a write of any kind (data or zeroes): the bitmaps and the counters.
    fn wrote(&self, start: u64, offset: u64, len: u64, r: &io::Result<()>) {
        self.mark_dirty(offset, len);
        if r.is_ok() {
            self.stats.wrote_up_to(offset + len);
        }
        self.stats.done(Op::Write, start, len, r.is_ok());
    }

    /// A write turned into write-zeroes by `detect-zeroes`, durable if it was FUA.
    async fn zeroes_then_fua(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fua: bool,
    ) -> io::Result<()> {
        self.driver.write_zeroes(offset, len, may_unmap).await?;
        if fua {
            self.driver.flush().await?;
        }
        Ok(())
    }

    /// Flushes.
    pub async fn flush(&self) -> io::Result<()> {
        let start = now_ns();
        let r = self.driver.flush().await;
        self.stats.done(Op::Flush, start, 0, r.is_ok());
        r
    }

    /// Discards a range.
    pub async fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let start = now_ns();
        let hooks = self.hooks.current();
        let held = match self.may_write(&hooks, offset, len).await {
            Ok(h) => h,
            Err(e) => {
                self.stats.refused(Op::Unmap, &e);
                return Err(e);
            }
        };
        let r = if self.unmap {
            let r = self.driver.discard(offset, len).await;
            self.mark_dirty_as(offset, len, true);
            r
        } else {
            Ok(())
        };
        self.stats.done(Op::Unmap, start, len, r.is_ok());
        let what = hook::Written::Discard;
        hook::after_write(&hooks, &held, (offset, len), r.is_ok() && self.unmap, what).await;
        drop(held);
        r
    }

    /// Zeroes a range.
    pub async fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        let start = now_ns();
        let hooks = self.hooks.current();
        let held = match self.may_write(&hooks, offset, len).await {
            Ok(h) => h,
            Err(e) => {
                self.stats.refused(Op::Write, &e);
                return Err(e);
            }
        };
        let may_unmap = may_unmap && self.unmap;
        let r = self.driver.write_zeroes(offset, len, may_unmap).await;
        self.wrote(start, offset, len, &r);
        let what = hook::Written::Zeroes { may_unmap };
        hook::after_write(&hooks, &held, (offset, len), r.is_ok(), what).await;
        drop(held);
        r
    }

    /// Allocation status of the first extent of a range.
    pub async fn block_status(&self, offset: u64, len: u64) -> io::Result<BlockStatus> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Err(einval("empty block-status request"));
        }
        // Held as a read: a point-in-time reader must not see a status the write after a
        // copy changed (see [`hook`]).
        let mut st = self
            .read_hooked(offset, len, || async {
                match self.driver.block_status_cached(offset, len) {
                    Some(st) => Ok(st),
                    None => self.driver.block_status(offset, len).await,
                }
            })
            .await?;
        st.len = st.len.clamp(1, len);
        Ok(st)
    }

    /// The allocation depth of the first extent of a range (see
    /// [`BlockDriver::allocation_depth`]).
    pub async fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u64, u32)> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Err(einval("empty block-status request"));
        }
        let (n, depth) = self.driver.allocation_depth(offset, len).await?;
        Ok((n.clamp(1, len), depth))
    }

    /// Resizes.
    pub async fn resize(&self, size: u64) -> io::Result<()> {
        self.resize_with(size, false).await
    }

    /// Changes the size, the new area allocated where the storage can (a FUSE client's
    /// fallocate past the end, as qsd grows with `preallocation=falloc`).
    pub async fn resize_preallocated(&self, size: u64) -> io::Result<()> {
        self.resize_with(size, true).await
    }

    async fn resize_with(&self, size: u64, falloc: bool) -> io::Result<()> {
        self.check_writable()?;
        // The image's bitmaps are resized in memory and stored at close: those whose bits
        // cannot be trusted or changed block it (QEMU's qcow2_truncate_bitmaps_check).
        for b in self.bitmaps().iter().filter(|b| b.is_persistent()) {
            b.check(dirty_bitmap::Use::Modify)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        }
        if self
            .bitmaps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|b| !dirty_bitmap::fits(size, b.granularity()))
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a dirty bitmap of this node could not cover that size",
            ));
        }
        if falloc {
            self.driver.resize_falloc(size).await?;
        } else {
            self.driver.resize(size).await?;
        }
        for b in self
            .bitmaps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            b.resize(size);
        }
        Ok(())
    }
}

/// Nodes a job made writable for its life (a commit's base, reopened read-write as QEMU
/// reopens it): made read-only again, top first, when it is dropped, unless
/// [`keep`](Self::keep) was called (an active commit that pivoted: the base is the active
/// layer now).
#[derive(Default)]
pub struct ReadOnlyAgain(Vec<Arc<BlockNode>>);

impl ReadOnlyAgain {
    /// `nodes`, top first.
    pub fn new(nodes: Vec<Arc<BlockNode>>) -> Self {
        Self(nodes)
    }

    /// They stay writable.
    pub fn keep(&mut self) {
        self.0.clear();
    }
}

impl Drop for ReadOnlyAgain {
    fn drop(&mut self) {
        let nodes = std::mem::take(&mut self.0);
        if nodes.is_empty() {
            return;
        }
        let back = async move {
            // Flushed first, as QEMU's reopen to read-only: nothing cached stays behind
            // for a later write without the write lock.
            if let Some(top) = nodes.first() {
                if let Err(e) = top.flush().await {
                    tracing::warn!("node '{}': flush before going read-only: {e}", top.name);
                }
            }
            for n in &nodes {
                n.set_read_only(true);
                // What it takes of its children shrinks with it (a format node's write lock).
                let _ = n.refresh_perms();
            }
        };
        if stord_aio::with_current_context(|_| ()).is_some() {
            stord_aio::spawn_detached(back);
        }
    }
}
