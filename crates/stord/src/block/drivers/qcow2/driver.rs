//! The driver's state: [`Qcow2Driver`] (the image's geometry and what requests share:
//! the backing link, the allocation locks, the requests in flight) and [`Meta`], the
//! mutable metadata behind its lock. Only the types and their small accessors live here,
//! below everything else; the methods are in the files of their concern: `metadata`
//! (guest clusters mapped through the L1 and L2 tables), `refcount` (allocating and
//! freeing), `writeback` (the crash-safe order), `read`, `write`, `discard`,
//! `block_status`, `bitmaps`, `internal` (snapshots).

use std::collections::BTreeSet;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use stord_aio::AsyncMutex;

use super::bitmap_dir::Directory;
use super::header::Compression;
use super::table::TableCache;
use crate::block::node::block_node::BlockNode;
use crate::block::node::range_lock::RangeLocks;

/// The qcow2 driver of one node (see the `qcow2` module's docs).
pub struct Qcow2Driver {
    pub(super) file: Arc<BlockNode>,
    /// The backing node; stream and commit change it.
    pub(super) backing: std::sync::RwLock<Option<Arc<BlockNode>>>,
    /// Whether there is a backing node (bit 0) and how often the link changed (the rest):
    /// lookups read this instead of taking the lock, and take it only to read from the
    /// backing node, checking that the link did not change since they looked.
    pub(super) backing_state: std::sync::atomic::AtomicU64,
    pub(super) version: u32,
    pub(super) cluster_bits: u32,
    pub(super) cluster_size: u64,
    /// log2 of the entries per L2 table.
    pub(super) l2_bits: u32,
    /// Extended L2 entries (subclusters: [`super::subcluster`]).
    pub(super) extended_l2: bool,
    /// log2 of the subcluster size (the cluster size's without extended L2 entries).
    pub(super) subcluster_bits: u32,
    pub(super) refcount_order: u32,
    /// The virtual size (grows with `block_resize`).
    pub(super) size: std::sync::atomic::AtomicU64,
    pub(super) discard: bool,
    pub(super) meta: AsyncMutex<Meta>,
    /// Guest clusters being allocated.
    pub(super) alloc_locks: RangeLocks,
    /// Requests doing data I/O at host offsets they looked up (freed clusters are not
    /// reused under them).
    pub(super) io_inflight: AtomicUsize,
    /// The header's incompatible feature bits as opened.
    pub(super) incompatible: u64,
    /// How compressed clusters are compressed (read, and written by `compress`).
    pub(super) compression: Compression,
    /// A write on metadata was prevented: every request fails from now on.
    pub(super) corrupt: std::sync::atomic::AtomicBool,
    /// Opened (or reloaded) read-write.
    pub(super) writable: std::sync::atomic::AtomicBool,
    /// The table caches' sizes (L2, refcount blocks), for a reload.
    pub(super) cache: (usize, usize),
    /// The external data file guest data lives in, if the image has one.
    pub(super) data: Option<DataFile>,
    /// The encryption of an `encrypt.format=luks` image ([`super::crypt`]).
    pub(super) crypt: Option<Box<Crypt>>,
}

/// The external data file of an image (see `data_file`).
pub(super) struct DataFile {
    pub(super) node: Arc<BlockNode>,
    /// `data-file-raw`: the data file is a raw image of the disk by itself.
    pub(super) raw: bool,
    /// Whether the image looks metadata-preallocated (QEMU's guess, made at the first
    /// block status): [`PREALLOC_UNKNOWN`], [`PREALLOC_NO`] or [`PREALLOC_YES`].
    pub(super) preallocated: std::sync::atomic::AtomicU8,
}

/// [`DataFile::preallocated`]'s values.
pub(super) const PREALLOC_UNKNOWN: u8 = 0;
pub(super) const PREALLOC_NO: u8 = 1;
pub(super) const PREALLOC_YES: u8 = 2;

impl DataFile {
    pub(super) fn new(node: Arc<BlockNode>, raw: bool) -> Self {
        Self {
            node,
            raw,
            preallocated: PREALLOC_UNKNOWN.into(),
        }
    }
}

/// An encrypted image's keys and cipher ([`super::crypt`]).
pub(super) struct Crypt {
    pub(super) cipher: crate::crypto::cipher::SectorCipher,
    /// The LUKS header as opened (`x-blockdev-amend` changes its slots) and the secret
    /// that unlocked it.
    pub(super) keys: crate::block::drivers::luks::amend::Keys,
    /// Where the LUKS header lies in the file: offset and length.
    pub(super) header: (u64, u64),
    /// Held over the guest sectors a write covers (a partial sector is read, patched and
    /// written whole under it).
    pub(super) rmw: RangeLocks,
}

/// Counts a request in `io_inflight` until dropped.
pub(super) struct Inflight<'a>(&'a AtomicUsize);

impl<'a> Inflight<'a> {
    pub(super) fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::AcqRel);
        Self(n)
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Qcow2Driver {
    pub(super) fn cluster_start(&self, off: u64) -> u64 {
        off & !(self.cluster_size - 1)
    }

    /// The backing node now.
    pub(super) fn backing(&self) -> Option<Arc<BlockNode>> {
        self.backing
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) fn has_backing(&self) -> bool {
        self.backing_state.load(Ordering::Acquire) & 1 != 0
    }
}

/// What a host cluster holding metadata holds (QEMU's overlap-check names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MetaKind {
    Header,
    L1,
    L2,
    RefTable,
    RefBlock,
    Snapshots,
    InactiveL1,
    BitmapDir,
    /// The LUKS header of an encrypted image (QEMU counts it in its refcount check and
    /// has no overlap check of its own for it).
    CryptoHeader,
}

impl MetaKind {
    pub(super) fn name(self) -> &'static str {
        match self {
            MetaKind::Header => "qcow2_header",
            MetaKind::L1 => "active L1 table",
            MetaKind::L2 => "active L2 table",
            MetaKind::RefTable => "refcount table",
            MetaKind::RefBlock => "refcount block",
            MetaKind::Snapshots => "snapshot table",
            MetaKind::InactiveL1 => "inactive L1 table",
            MetaKind::BitmapDir => "bitmap directory",
            MetaKind::CryptoHeader => "encryption header",
        }
    }
}

/// Mutable metadata, behind the driver's async mutex.
pub(super) struct Meta {
    /// Every host cluster that holds metadata, by cluster index: no data write and no
    /// other table's write may land there (QEMU's overlap checks).
    pub regions: std::collections::BTreeMap<u64, MetaKind>,
    pub l1: Vec<u64>,
    /// Where the L1 table is on the host.
    pub l1_offset: u64,
    /// Where the refcount table is (it moves when it grows).
    pub reftable_offset: u64,
    pub l1_dirty: BTreeSet<usize>,
    pub l2: TableCache<Vec<u64>>,
    pub reftable: Vec<u64>,
    pub reftable_dirty: BTreeSet<usize>,
    pub refblocks: TableCache<Vec<u8>>,
    /// The first cluster index that may be free.
    pub free_hint: u64,
    /// End of the host file as far as anything was ever written or allocated: clusters
    /// allocated at or past it read as zeroes until written.
    pub file_end: u64,
    /// End of everything allocated (from the refcounts at open, then as allocation goes):
    /// contiguous metadata (a grown L1 or refcount table, bitmap tables) goes past it,
    /// never past `file_end`, which on storage of a fixed size is its end.
    pub used_end: u64,
    /// Host clusters whose refcount drops once the tables that referenced them are
    /// durable (see `writeback`'s docs).
    pub pending_free: Vec<u64>,
    /// Where the next compressed cluster may go in the host cluster the last one went to
    /// (QEMU's free_byte_offset); 0 for none (that cluster is full, or freed).
    pub free_byte_offset: u64,
    /// Metadata was written since the last fsync.
    pub needs_sync: bool,
    /// The persistent bitmaps' directory as the image holds it.
    pub bitmap_dir: Directory,
}

impl Meta {
    /// Records `[offset, offset + len)` as metadata of `kind`.
    pub(super) fn add_region(&mut self, cluster_bits: u32, offset: u64, len: u64, kind: MetaKind) {
        if len == 0 {
            return;
        }
        for c in offset >> cluster_bits..=(offset + len - 1) >> cluster_bits {
            self.regions.insert(c, kind);
        }
    }
}

/// An I/O error for metadata that makes no sense (the image is corrupt there).
pub(super) fn corrupt(what: String) -> io::Error {
    tracing::error!("qcow2: {what}");
    io::Error::from_raw_os_error(libc::EIO)
}
