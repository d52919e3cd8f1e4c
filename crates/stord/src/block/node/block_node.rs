//! `BlockNode`, a named driver instance with its flags, users, bitmaps and hooks, and the
//! `BlockDriver` trait every driver implements. The two name each other (a node holds its
//! driver; a driver names its child nodes), so they share this file; what a node does
//! lives beside it: its requests (`requests.rs`), its bitmaps (`bitmaps.rs`), its users'
//! permissions (`claim.rs`).
//!
//! Drivers are `Send + Sync` so a node can be shared by exports on several IoThreads; their
//! request futures are not `Send`: a request runs entirely on the IoThread that issued it
//! (for the io_uring backend, on that thread's own ring).

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::future::{unsupported_fut, BoxFut};
use super::options::{CommonOptions, DetectZeroes};
use super::{debug_event, dirty_bitmap, hook, limits, perm, stats};
use crate::buf::{count_bounce, request_buf, Buf};
use crate::iov::IoVec;

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
    /// Writes `buf` at `offset` compressed (QEMU's BDRV_REQ_WRITE_COMPRESSED, which backup's
    /// `compress` sets): whole clusters, or the image's last one. ENOTSUP from drivers
    /// that cannot ([`supports_compressed_writes`](Self::supports_compressed_writes)).
    fn write_compressed(&self, _offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        let e = io::Error::from_raw_os_error(libc::ENOTSUP);
        Box::pin(std::future::ready((Err(e), buf)))
    }
    /// Whether [`write_compressed`](Self::write_compressed) works here (QEMU's
    /// bdrv_supports_compressed_writes): a format that compresses, or a filter whose child
    /// takes them.
    fn supports_compressed_writes(&self) -> bool {
        false
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
    /// The node's data is encrypted (QEMU's bs->encrypted: `luks`), as query commands
    /// report it.
    fn encrypted(&self) -> bool {
        false
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
    /// The node closes for good, after its parents closed and after its own flush (QEMU's
    /// bdrv_close): what it keeps beside the data is put right (preallocate cuts its
    /// file back to the data).
    fn close(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
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
    /// Puts in the limits the driver knows (QEMU's driver bdrv_refresh_limits), over the
    /// defaults of a node without children or its children's merged (see [`limits`]).
    fn refresh_limits(&self, _bl: &mut limits::BlockLimits) {}
    /// The child nodes, each with its role (`file`), for the graph's bookkeeping.
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        Vec::new()
    }
    /// A debug event announced on this node ([`debug_event`]): a `blkdebug` node acts
    /// on it; true if the driver took it.
    fn debug_event(&self, _e: debug_event::DebugEvent) -> bool {
        false
    }
    /// Whether the driver is a filter of its `file` child (QEMU's `is_filter`): the node
    /// below it in the chain QEMU's bdrv_filter_or_cow_bs walks.
    fn is_filter(&self) -> bool {
        false
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
    /// The driver itself, for a driver that reads another's own API through its node (as
    /// `snapshot-access` reads a `copy-before-write` node's point-in-time view).
    fn as_any(&self) -> Option<&dyn std::any::Any> {
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

/// A named block node.
pub struct BlockNode {
    /// `node-name`.
    pub name: String,
    /// Refuse writes (changes with `blockdev-reopen`).
    pub(super) read_only: std::sync::atomic::AtomicBool,
    /// Opened for writing (or reopened so): whether it may be made writable.
    pub(super) opened_writable: std::sync::atomic::AtomicBool,
    /// Inactive (QEMU's BDRV_O_INACTIVE, `active=off`, `blockdev-set-active`): another
    /// process owns the image; this node reads, writes nothing and holds no lock.
    pub(super) inactive: std::sync::atomic::AtomicBool,
    /// Opened with O_DIRECT.
    pub direct: bool,
    /// Counters (`query-blockstats`).
    pub stats: stats::NodeStats,
    /// `force-share=on`: every user of the node shares everything (read-only nodes only).
    pub(crate) force_share: bool,
    /// `detect-zeroes`.
    pub(super) detect_zeroes: DetectZeroes,
    /// Discards go to the driver (`discard=unmap`); else the node drops them.
    pub(super) unmap: bool,
    /// Who uses the node with which permissions ([`perm`]).
    pub(super) users: std::sync::Mutex<perm::Users<Claim>>,
    /// Dirty bitmaps, oldest first; `has_bitmaps` spares writes the lock when there are
    /// none.
    pub(super) bitmaps: std::sync::RwLock<Vec<Arc<dirty_bitmap::DirtyBitmap>>>,
    pub(super) has_bitmaps: std::sync::atomic::AtomicBool,
    /// Why other jobs and graph changes must leave the node alone now ([`blocker`]).
    pub(super) blocked: std::sync::Mutex<Option<String>>,
    /// Jobs running on the node ([`blocker::JobAttachment`]).
    pub(super) jobs_attached: std::sync::atomic::AtomicUsize,
    /// Of those, the jobs that reach it through a filter of theirs.
    pub(super) jobs_filtered: std::sync::atomic::AtomicUsize,
    /// What jobs run around the node's requests ([`hook`]).
    pub(super) hooks: hook::Hooks,
    /// `block-set-write-threshold`: the first write ending past it announces
    /// BLOCK_WRITE_THRESHOLD and clears it (0: none).
    pub(super) write_threshold: AtomicU64,
    /// Where the node's events go (set by the daemon).
    pub(super) events: std::sync::OnceLock<crate::events::EventPoster>,
    /// The IoThread the node was moved to (x-blockdev-set-iothread): its exports run
    /// there unless they name one.
    pub(super) home: std::sync::Mutex<Option<String>>,
    pub(super) driver: Box<dyn BlockDriver>,
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

    /// Announces debug event `e` to this node's driver (QEMU's bdrv_debug_event: a
    /// driver without events drops it; nothing walks on to the children).
    pub fn debug_event(&self, e: debug_event::DebugEvent) {
        self.driver.debug_event(e);
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

    /// The node's I/O limits as QEMU's bdrv_refresh_limits finds them: the children's
    /// merged (a node without children: the protocol defaults), then the driver's own.
    pub fn limits(&self) -> limits::BlockLimits {
        let mut bl = limits::BlockLimits::start();
        let children = self.children();
        if children.is_empty() {
            bl.protocol_defaults();
        }
        for (_, c) in &children {
            bl.merge(&c.limits());
        }
        self.driver.refresh_limits(&mut bl);
        bl
    }

    /// Puts the node in service (see [`BlockDriver::activate`]); only nodes that carry
    /// persistent bitmaps have anything to do.
    pub async fn activate(&self) -> io::Result<()> {
        if !self.has_persistent_bitmaps() {
            return Ok(());
        }
        self.driver.activate().await
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
        self.driver.close().await
    }

    /// `detect-zeroes` as set on this node.
    pub fn detect_zeroes(&self) -> DetectZeroes {
        self.detect_zeroes
    }

    /// The node below this one that QEMU's bdrv_filter_or_cow_bs names: the backing
    /// node, else a filter's ([`BlockDriver::is_filter`]) file node.
    pub fn filtered_or_backing(&self) -> Option<Arc<BlockNode>> {
        let children = self.children();
        let pick = |role: &str| children.iter().find(|(r, _)| *r == role);
        pick("backing")
            .or_else(|| self.driver.is_filter().then(|| pick("file")).flatten())
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

    /// See [`BlockDriver::supports_compressed_writes`].
    pub fn supports_compressed_writes(&self) -> bool {
        self.driver.supports_compressed_writes()
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
}

/// A user's hold on a node's permissions; given back when dropped.
pub struct Claim {
    pub(super) node: Arc<BlockNode>,
    pub(super) id: u64,
}

impl fmt::Debug for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Claim({} #{})", self.node.name, self.id)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.node.release_use(self.id);
    }
}
