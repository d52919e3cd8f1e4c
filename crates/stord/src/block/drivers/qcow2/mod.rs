//! The `qcow2` format driver: QEMU's copy-on-write image format (versions 2 and 3) over a
//! child node (its `file`), with an optional `backing` node read through where a cluster
//! is not allocated.
//!
//! A request maps its guest range cluster by cluster through the L1 and L2 tables
//! ([`metadata`]). In steady state (tables cached, clusters allocated) a read or write is
//! one lookup under the metadata lock and one request to the child, with the caller's
//! buffer passed straight through when the range is contiguous on the host. A write into
//! a cluster that is unallocated, zero, compressed or shared allocates a new cluster under
//! a lock on that guest cluster (concurrent writers of one cluster allocate it once),
//! copies what it does not overwrite from the old content (backing file, compressed
//! data) and then points the L2 entry at it; metadata changes reach the disk in the
//! crash-safe order [`metadata`] describes, at the next flush.
//!
//! Images with internal snapshots are written as QEMU writes them: tables and clusters
//! the active image shares with a snapshot are copied before they change ([`snapshot`]).
//!
//! Not supported, and refused at open with a clear error rather than served wrongly:
//! encryption, external data files, extended L2 entries; writing to
//! images marked dirty or corrupt.

mod amend;
mod bitmaps;
pub mod create;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;
mod header;
mod internal;
mod metadata;
mod repair;
mod snapshot;
mod table;

pub use header::{Compression, Header, HeaderError};

/// Whether `first`, a file's first bytes, starts like a qcow2 image (for probing a backing
/// file whose format the image does not name).
pub fn has_magic(first: &[u8]) -> bool {
    first.starts_with(&header::MAGIC.to_be_bytes())
}

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use stord_aio::sys::now_ns;
use stord_aio::AsyncMutex;

use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::perm::Perm;
use crate::block::node::range_lock::RangeLocks;
use crate::block::node::stats::Op;
use crate::block::open::{GraphError, Opened};
use crate::buf::{request_buf, Buf};
use crate::cli::keyval::KeyVal;
use crate::cli::Help;
use crate::iov::IoVec;
use metadata::{corrupt, Meta};
use table::{Mapping, TableCache, COPIED, OFFSET_MASK, ZERO};

/// The driver table's entry: a qcow2 image over its `file`; its backing node is
/// `backing=NAME`, inline `backing.driver=...`, none with `backing=null`, else the one the
/// image names (opened read-only, relative to the image's directory, as QEMU does).
pub const DRIVER: DriverDef = DriverDef {
    names: &["qcow2"],
    takes_discard: true,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node> | file.driver=...\n\
                   [,backing=<node>|null | ,backing.driver=...][,l2-cache-size=<size>]\n\
                   [,refcount-cache-size=<size>][,cache-size=<size>][,discard=unmap|ignore]",
        about: "the qcow2 format over its child `file`; the backing file an\n\
                image names opens by itself unless `backing` says otherwise",
    },
    create: Some(&create::CREATE),
    amend: Some(&amend::AMEND),
    open: |g, kv, flags| {
        let file = g.child(kv, "file")?;
        let opts = Qcow2Options::from_opts(kv)?;
        let ro = flags.read_only || file.is_read_only();
        // An inactive image is read as a read-only one; activation reads it again.
        let writes = !ro && !flags.inactive;
        let given = g.optional_child(kv, "backing")?;
        // The file's permissions (its locks) before the image is read and, when writable,
        // written (dirty refcounts repaired, bitmaps marked in use): as QEMU attaches the
        // child before qcow2_open runs. The node takes them for good once it exists.
        let (perm, shared) = crate::block::node::perm::storage_perms(writes);
        let opening = file.claim(flags.node_name, "file", perm, shared)?;
        let f = file.clone();
        let mut image = crate::block::helper_thread::block_on_helper(move || async move {
            Image::load(&f, writes).await
        })
        .and_then(|r| r.map_err(io::Error::other))
        .map_err(|e| GraphError::Invalid(format!("{}: {e}", kv.what)))?;
        drop(opening);
        let backing = match given {
            Some(b) => b,
            None => match image.header.backing_file.clone() {
                Some(name) => {
                    let fmt = image.header.backing_format.clone();
                    Some(g.backing_file(&file, &name, fmt)?)
                }
                None => None,
            },
        };
        let direct = file.direct;
        let bitmaps = image
            .bitmaps
            .as_mut()
            .map(|l| std::mem::take(&mut l.bitmaps))
            .unwrap_or_default();
        Ok(Opened {
            driver: Box::new(Qcow2Driver::new(file, backing, image, &opts)),
            read_only: ro,
            direct,
            bitmaps,
        })
    },
};

/// QEMU's cap on the default L2 cache (32 MiB).
const DEFAULT_L2_CACHE_MAX: u64 = 32 << 20;

/// `--blockdev driver=qcow2` options beyond the children.
#[derive(Debug, Clone, Default)]
pub struct Qcow2Options {
    /// `l2-cache-size` in bytes.
    pub l2_cache: Option<u64>,
    /// `refcount-cache-size` in bytes.
    pub refcount_cache: Option<u64>,
    /// `cache-size`: both caches together.
    pub cache: Option<u64>,
    /// `discard=unmap`: guest discards free clusters (the default, `ignore`, drops them).
    pub discard: bool,
}

impl Qcow2Options {
    /// Takes the options from a `--blockdev` / `blockdev-add`.
    pub fn from_opts(kv: &mut KeyVal) -> Result<Self, GraphError> {
        let o = Self {
            l2_cache: kv.take_u64("l2-cache-size", true)?,
            refcount_cache: kv.take_u64("refcount-cache-size", true)?,
            cache: kv.take_u64("cache-size", true)?,
            discard: matches!(
                kv.take_choice("discard", &["ignore", "off", "unmap", "on"])?
                    .as_deref(),
                Some("unmap" | "on")
            ),
        };
        // Accepted as QEMU does; stord keeps refcounts exact, so lazy ones change nothing.
        let _ = kv.take_bool("lazy-refcounts", false)?;
        let _ = kv.take_bool("pass-discard-request", true)?;
        // QEMU: an unsigned int of seconds.
        let _ = kv.take_u64_in("cache-clean-interval", false, 0..=u64::from(u32::MAX))?;
        // QEMU's rules for the three cache sizes (read_cache_sizes), and its texts.
        if let Some(total) = o.cache {
            let bad = |m: &str| Err(GraphError::Invalid(m.into()));
            match (o.l2_cache, o.refcount_cache) {
                (Some(_), Some(_)) => {
                    return bad("cache-size, l2-cache-size and refcount-cache-size may not be set at the same time")
                }
                (Some(l2), None) if l2 > total => return bad("l2-cache-size may not exceed cache-size"),
                (None, Some(rc)) if rc > total => {
                    return bad("refcount-cache-size may not exceed cache-size")
                }
                _ => {}
            }
        }
        Ok(o)
    }

    /// Tables in the L2 and refcount caches, for an image of `size` bytes.
    fn cache_tables(&self, size: u64, cluster_size: u64) -> (usize, usize) {
        let whole_disk = size.div_ceil(cluster_size * (cluster_size / 8)) * cluster_size;
        let (l2, rc) = match (self.l2_cache, self.refcount_cache, self.cache) {
            (Some(l2), Some(rc), _) => (l2.min(whole_disk), rc),
            (Some(l2), None, Some(total)) => (l2.min(whole_disk), total - l2),
            (Some(l2), None, None) => (l2.min(whole_disk), (l2 / 4).max(4 * cluster_size)),
            (None, rc, Some(total)) => {
                let rc = rc.unwrap_or((total / 4).max(4 * cluster_size).min(total / 2));
                (total - rc, rc)
            }
            (None, rc, None) => {
                let l2 = whole_disk.min(DEFAULT_L2_CACHE_MAX);
                (l2, rc.unwrap_or((l2 / 4).max(4 * cluster_size)))
            }
        };
        (
            (l2 / cluster_size).max(2) as usize,
            (rc / cluster_size).max(2) as usize,
        )
    }
}

/// Why a qcow2 node could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    /// The header says no.
    #[error(transparent)]
    Header(#[from] HeaderError),
    /// Reading or updating the image failed.
    #[error("qcow2: {0}")]
    Io(#[from] io::Error),
    /// Opening read-write is not possible.
    #[error("qcow2: {0}")]
    NotWritable(&'static str),
    /// The persistent dirty bitmaps could not be loaded (QEMU refuses the open too).
    #[error("qcow2: Could not load the image's dirty bitmaps: {0}")]
    Bitmaps(String),
    /// The metadata contradicts itself: writing would destroy it.
    #[error("qcow2: Image is corrupt: {0}; cannot be opened read/write")]
    Corrupt(String),
}

/// What `open` reads from the image before the driver exists.
pub struct Image {
    /// The header.
    pub header: Header,
    l1: Vec<u64>,
    reftable: Vec<u64>,
    file_end: u64,
    /// The end of the last cluster the refcounts call in use.
    used_end: u64,
    regions: std::collections::BTreeMap<u64, metadata::MetaKind>,
    /// The persistent dirty bitmaps (their directory stays with the driver, the bitmaps go
    /// to the node).
    bitmaps: Option<bitmaps::Loaded>,
    /// Loaded for writing.
    writable: bool,
}

/// The snapshot tables' L1 tables and the table's length, read in growing pieces.
async fn read_snapshot_table(
    f: &dyn BlockDriver,
    h: &Header,
) -> Result<(Vec<snapshot::SnapshotL1>, u64), Qcow2Error> {
    let mut want = 64 * 1024u64;
    loop {
        let len = want.min(f.size().saturating_sub(h.snapshots_offset));
        let (r, buf) = f.read(h.snapshots_offset, request_buf(len as usize)).await;
        r?;
        match snapshot::parse(&buf, h.nb_snapshots).map_err(Qcow2Error::Corrupt)? {
            snapshot::Parsed::Done(l1s, n) => return Ok((l1s, n)),
            snapshot::Parsed::NeedMore(n) if len < want || n > snapshot::MAX_TABLE_BYTES => {
                return Err(Qcow2Error::Corrupt(
                    "the snapshot table runs past the end of the image".into(),
                ))
            }
            snapshot::Parsed::NeedMore(n) => want = n.max(want * 2),
        }
    }
}

/// Where the image's metadata lies, from the header, L1 and refcount tables; an error when
/// two kinds of metadata claim one cluster, or a table is not where a table can be.
fn metadata_regions(
    h: &Header,
    l1: &[u64],
    reftable: &[u64],
    snapshots: &(Vec<snapshot::SnapshotL1>, u64),
    bitmap_dir: Option<(u64, u64)>,
) -> Result<std::collections::BTreeMap<u64, metadata::MetaKind>, String> {
    use metadata::MetaKind;
    let bits = h.cluster_bits;
    let cs = h.cluster_size();
    let mut map = std::collections::BTreeMap::new();
    let mut add = |off: u64, len: u64, kind: MetaKind, what: &str| -> Result<(), String> {
        if off & (cs - 1) != 0 {
            return Err(format!("{what} at {off:#x} is not cluster aligned"));
        }
        if len == 0 {
            return Ok(());
        }
        for c in off >> bits..=(off + len - 1) >> bits {
            if let Some(other) = map.insert(c, kind) {
                return Err(format!(
                    "{what} at {off:#x} overlaps with another table ({other:?})"
                ));
            }
        }
        Ok(())
    };
    add(0, cs, MetaKind::Header, "header")?;
    add(
        h.l1_table_offset,
        h.l1_size as u64 * 8,
        MetaKind::L1,
        "L1 table",
    )?;
    add(
        h.refcount_table_offset,
        h.refcount_table_clusters as u64 * cs,
        MetaKind::RefTable,
        "refcount table",
    )?;
    if snapshots.1 > 0 {
        add(
            h.snapshots_offset,
            snapshots.1,
            MetaKind::Snapshots,
            "snapshot table",
        )?;
        for (i, s) in snapshots.0.iter().enumerate() {
            add(
                s.offset,
                s.entries as u64 * 8,
                MetaKind::InactiveL1,
                &format!("L1 table of snapshot {i}"),
            )?;
        }
    }
    if let Some((off, len)) = bitmap_dir {
        add(off, len, MetaKind::BitmapDir, "bitmap directory")?;
    }
    for (i, e) in l1.iter().enumerate() {
        let off = e & OFFSET_MASK;
        if off != 0 {
            add(off, cs, MetaKind::L2, &format!("L2 table of L1 entry {i}"))?;
        }
    }
    for (i, e) in reftable.iter().enumerate() {
        let off = e & OFFSET_MASK;
        if off != 0 {
            add(off, cs, MetaKind::RefBlock, &format!("refcount block {i}"))?;
        }
    }
    Ok(map)
}

impl Image {
    /// Reads and checks the header and the tables every request needs (on a loop of the
    /// calling thread's: see [`crate::block::helper_thread::block_on_helper`]), and the persistent
    /// dirty bitmaps. With `writable`, images this driver must not write are refused, the
    /// bitmaps are marked in use ([`bitmaps`]), and other autoclear bits are cleared on
    /// disk, as a program without those features must.
    pub async fn load(file: &BlockNode, writable: bool) -> Result<Image, Qcow2Error> {
        let f = file.driver();
        let (r, first) = f.read(0, request_buf(4096)).await;
        r?;
        if !has_magic(&first) {
            return Err(HeaderError::NotQcow2.into());
        }
        let need = Header::bytes_needed(&first)?;
        let (r, buf) = f.read(0, request_buf(need)).await;
        r?;
        let mut header = Header::parse(&buf)?;
        let read_table = |off: u64, n: usize| async move {
            if n == 0 {
                return Ok(Vec::new());
            }
            let (r, b) = f.read(off, request_buf(n * 8)).await;
            r.map(|_| {
                b.chunks_exact(8)
                    .map(|c| u64::from_be_bytes(c.try_into().expect("8")))
                    .collect::<Vec<u64>>()
            })
        };
        let l1 = read_table(header.l1_table_offset, header.l1_size as usize).await?;
        let reftable = read_table(
            header.refcount_table_offset,
            (header.refcount_table_clusters as u64 * header.cluster_size() / 8) as usize,
        )
        .await?;
        if writable && header.incompatible & header::incompat::CORRUPT != 0 {
            return Err(Qcow2Error::NotWritable(
                "Image is corrupt; cannot be opened read/write",
            ));
        }
        // Persistent bitmaps count only while the autoclear bit vouches for them (else a
        // program without bitmap support wrote the image since: QEMU ignores them too).
        let loaded = match &header.bitmaps_ext {
            Some(ext)
                if header.version >= 3 && header.autoclear & header::autoclear::BITMAPS != 0 =>
            {
                Some(
                    bitmaps::load(f, &header, ext, writable)
                        .await
                        .map_err(Qcow2Error::Bitmaps)?,
                )
            }
            _ => None,
        };
        if writable && header.version >= 3 {
            // Autoclear bits of features stord does not keep go (that is their contract);
            // the bitmaps bit stays while there are bitmaps to keep.
            let keep = if loaded.is_some() {
                header::autoclear::BITMAPS
            } else {
                0
            };
            if header.autoclear & !keep != 0 {
                header.autoclear &= keep;
                let mut b = request_buf(8);
                b.copy_from_slice(&header.autoclear.to_be_bytes());
                let (r, _) = f.write(header::field::AUTOCLEAR, b, false).await;
                r?;
                f.flush().await?;
            }
        }
        let snapshots = if writable && header.nb_snapshots > 0 {
            read_snapshot_table(f, &header).await?
        } else {
            (Vec::new(), 0)
        };
        if writable && header.incompatible & header::incompat::DIRTY != 0 {
            // Left open with lazy refcounts: counts may lag; rebuild them first.
            let bitmap_refs = loaded.as_ref().map_or(&[][..], |l| &l.refs[..]);
            let fixed = repair::rebuild_refcounts(
                f,
                &header,
                &l1,
                &reftable,
                &snapshots.0,
                snapshots.1,
                bitmap_refs,
            )
            .await
            .map_err(|e| Qcow2Error::Corrupt(format!("dirty image (lazy refcounts): {e}")))?;
            tracing::info!("qcow2: repaired {fixed} refcounts of a dirty image");
            header.incompatible &= !header::incompat::DIRTY;
        }
        let bitmap_dir = loaded.as_ref().map(|l| (l.dir.offset, l.dir.size));
        let regions = match metadata_regions(&header, &l1, &reftable, &snapshots, bitmap_dir) {
            Ok(r) => r,
            // Read-only, a corrupt image can still be read (as QEMU allows), with no
            // write to guard.
            Err(_) if !writable => Default::default(),
            Err(e) => return Err(Qcow2Error::Corrupt(e)),
        };
        let cs = header.cluster_size();
        let used_end = if writable {
            used_end(f, &header, &reftable).await?
        } else {
            0
        };
        Ok(Image {
            file_end: f.size().div_ceil(cs) * cs,
            used_end,
            header,
            l1,
            reftable,
            regions,
            bitmaps: loaded,
            writable,
        })
    }
}

/// The end of the last cluster the refcounts call in use: where metadata that must be
/// contiguous goes (QEMU finds such runs from the refcounts too, not from the file's size,
/// which for a block device, an RBD image or an NBD export is the storage's whole size).
/// Reads the last refcount block (and earlier ones only if it counts nothing).
async fn used_end(f: &dyn BlockDriver, header: &Header, reftable: &[u64]) -> io::Result<u64> {
    let cs = header.cluster_size();
    let codec = table::RefcountCodec::new(header.refcount_order);
    let per_block = (cs * 8) >> header.refcount_order;
    for (bi, e) in reftable.iter().enumerate().rev() {
        let off = e & OFFSET_MASK;
        if off == 0 {
            continue;
        }
        let (r, block) = f.read(off, request_buf(cs as usize)).await;
        r?;
        if let Some(i) = (0..per_block as usize)
            .rev()
            .find(|&i| codec.get(&block, i) != 0)
        {
            return Ok((bi as u64 * per_block + i as u64 + 1) * cs);
        }
    }
    Ok(0)
}

/// See the module docs.
pub struct Qcow2Driver {
    file: Arc<BlockNode>,
    /// The backing node; stream and commit change it.
    backing: std::sync::RwLock<Option<Arc<BlockNode>>>,
    /// Whether there is a backing node (bit 0) and how often the link changed (the rest):
    /// lookups read this instead of taking the lock, and take it only to read from the
    /// backing node, checking that the link did not change since they looked.
    backing_state: std::sync::atomic::AtomicU64,
    version: u32,
    cluster_bits: u32,
    cluster_size: u64,
    /// log2 of the entries per L2 table.
    l2_bits: u32,
    refcount_order: u32,
    /// The virtual size (grows with `block_resize`).
    size: std::sync::atomic::AtomicU64,
    discard: bool,
    meta: AsyncMutex<Meta>,
    /// Guest clusters being allocated.
    alloc_locks: RangeLocks,
    /// Requests doing data I/O at host offsets they looked up (freed clusters are not
    /// reused under them).
    io_inflight: AtomicUsize,
    /// The header's incompatible feature bits as opened.
    incompatible: u64,
    /// How compressed clusters are compressed (read only: stord never compresses).
    compression: Compression,
    /// A write on metadata was prevented: every request fails from now on.
    corrupt: std::sync::atomic::AtomicBool,
    /// Opened (or reloaded) read-write.
    writable: std::sync::atomic::AtomicBool,
    /// The table caches' sizes (L2, refcount blocks), for a reload.
    cache: (usize, usize),
}

/// Clusters a large write overwrites whole and that need new ones: what they mapped
/// before, and the new host clusters, allocated and not mapped yet.
struct WholeClusters {
    olds: Vec<Mapping>,
    hosts: Vec<u64>,
}

/// Counts a request in `io_inflight` until dropped.
struct Inflight<'a>(&'a AtomicUsize);

impl<'a> Inflight<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::AcqRel);
        Self(n)
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Where a piece of a read comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Host(u64),
    /// A zero cluster.
    Zero,
    /// Unallocated, no backing file: zeroes too, but not this image's.
    Unmapped,
    Backing,
    /// A compressed cluster; the piece starts `within` bytes into it.
    Compressed {
        offset: u64,
        len: u64,
        within: u64,
    },
}

#[derive(Debug, Clone, Copy)]
struct Piece {
    guest: u64,
    len: u64,
    src: Source,
}

/// A request's pieces: one, mostly (no allocation then).
type Pieces = smallvec::SmallVec<[Piece; 2]>;

/// A range looked up: its pieces, the request counted in flight, and the backing node
/// its backing pieces read from.
type Mapped<'a> = (Pieces, Inflight<'a>, Option<Arc<BlockNode>>);

impl Qcow2Driver {
    /// A driver for a loaded image over `file`, reading through to `backing`.
    pub fn new(
        file: Arc<BlockNode>,
        backing: Option<Arc<BlockNode>>,
        image: Image,
        opts: &Qcow2Options,
    ) -> Self {
        let h = image.header.clone();
        let cache = opts.cache_tables(h.size, h.cluster_size());
        let writable = image.writable;
        let meta = Self::meta_of(image, cache);
        Self {
            file,
            backing_state: (backing.is_some() as u64).into(),
            backing: std::sync::RwLock::new(backing),
            version: h.version,
            cluster_bits: h.cluster_bits,
            cluster_size: h.cluster_size(),
            l2_bits: h.cluster_bits - 3,
            refcount_order: h.refcount_order,
            size: h.size.into(),
            discard: opts.discard,
            meta: AsyncMutex::new(meta),
            cache,
            alloc_locks: RangeLocks::default(),
            io_inflight: AtomicUsize::new(0),
            incompatible: h.incompatible,
            compression: h.compression,
            corrupt: Default::default(),
            writable: writable.into(),
        }
    }

    /// The metadata state of a loaded image, with caches of `(l2, refcount)` tables.
    fn meta_of(image: Image, (l2_tables, rc_tables): (usize, usize)) -> Meta {
        let h = image.header;
        // Contiguous metadata goes past every cluster the refcounts count and every table
        // this open found (an image whose refcounts undercount its metadata must not get
        // it overwritten).
        let used_end = image.used_end.max(
            image
                .regions
                .last_key_value()
                .map_or(0, |(&c, _)| (c + 1) << h.cluster_bits),
        );
        Meta {
            regions: image.regions,
            l1: image.l1,
            l1_offset: h.l1_table_offset,
            reftable_offset: h.refcount_table_offset,
            l1_dirty: Default::default(),
            l2: TableCache::new(l2_tables),
            reftable: image.reftable.iter().map(|e| e & !511).collect(),
            reftable_dirty: Default::default(),
            refblocks: TableCache::new(rc_tables),
            free_hint: 0,
            file_end: image.file_end,
            used_end,
            pending_free: Vec::new(),
            needs_sync: false,
            bitmap_dir: image.bitmaps.map(|l| l.dir).unwrap_or_default(),
        }
    }

    /// Reads the image's metadata again, as a fresh open would (QEMU's invalidate-cache):
    /// with `writable`, for writing (refused images refused, dirty refcounts repaired,
    /// other autoclear bits cleared). What was cached goes; the caller made sure nothing
    /// was written through this driver since its last flush (it was read-only, or
    /// inactive). Images with persistent bitmaps are refused: their bitmaps live in the
    /// node, which a reload does not replace.
    pub async fn reload(&self, writable: bool) -> io::Result<()> {
        let mut m = self.meta.lock().await;
        let refuse = || io::Error::other("stord cannot reload an image with persistent bitmaps");
        if !m.bitmap_dir.entries.is_empty() {
            return Err(refuse());
        }
        // Read first as it is: a load for writing would already mark bitmaps in use.
        let probe = Image::load(&self.file, false)
            .await
            .map_err(io::Error::other)?;
        if probe.bitmaps.is_some() {
            return Err(refuse());
        }
        let image = if writable {
            Image::load(&self.file, true)
                .await
                .map_err(io::Error::other)?
        } else {
            probe
        };
        let h = &image.header;
        if h.cluster_bits != self.cluster_bits || h.refcount_order != self.refcount_order {
            return Err(io::Error::other("the image's layout changed"));
        }
        self.size.store(h.size, Ordering::Relaxed);
        *m = Self::meta_of(image, self.cache);
        self.writable.store(writable, Ordering::Relaxed);
        Ok(())
    }

    fn cluster_start(&self, off: u64) -> u64 {
        off & !(self.cluster_size - 1)
    }

    /// The backing node now.
    fn backing(&self) -> Option<Arc<BlockNode>> {
        self.backing
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn has_backing(&self) -> bool {
        self.backing_state.load(Ordering::Acquire) & 1 != 0
    }

    /// Maps `[offset, offset + len)` to pieces, merging neighbours from one source.
    /// With them, the backing node the lookup saw where a piece reads from it: the read
    /// goes there even if a job changes the backing link meanwhile.
    async fn map_range(&self, offset: u64, len: u64) -> io::Result<Mapped<'_>> {
        let mut m = self.meta.lock().await;
        loop {
            let state = self.backing_state.load(Ordering::Acquire);
            let pieces = self.pieces(&mut m, offset, len, state & 1 != 0).await?;
            let backing = if pieces.iter().any(|p| p.src == Source::Backing) {
                let b = self.backing();
                if self.backing_state.load(Ordering::Acquire) != state {
                    // The link moved while we looked: look again.
                    continue;
                }
                b
            } else {
                None
            };
            let inflight = Inflight::new(&self.io_inflight);
            drop(m);
            return Ok((pieces, inflight, backing));
        }
    }

    async fn pieces(
        &self,
        m: &mut Meta,
        offset: u64,
        len: u64,
        has_backing: bool,
    ) -> io::Result<Pieces> {
        let mut pieces = Pieces::new();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let cstart = self.cluster_start(pos);
            let n = (cstart + self.cluster_size).min(end) - pos;
            let within = pos - cstart;
            let src = match self.lookup(m, pos).await? {
                Mapping::Data { host, .. } => Source::Host(host + within),
                Mapping::Zero { .. } => Source::Zero,
                Mapping::Unallocated if has_backing => Source::Backing,
                Mapping::Unallocated => Source::Unmapped,
                Mapping::Compressed { offset, len } => Source::Compressed {
                    offset,
                    len,
                    within,
                },
            };
            match (pieces.last_mut(), src) {
                (Some(last), Source::Host(h)) if matches!(last.src, Source::Host(lh) if lh + last.len == h) => {
                    last.len += n
                }
                (Some(last), Source::Zero | Source::Unmapped | Source::Backing)
                    if last.src == src =>
                {
                    last.len += n
                }
                _ => pieces.push(Piece {
                    guest: pos,
                    len: n,
                    src,
                }),
            }
            pos += n;
        }
        Ok(pieces)
    }

    /// Reads `dst.len()` bytes of the backing node at `guest` (zeroes past its end).
    async fn read_backing(
        backing: Option<&Arc<BlockNode>>,
        guest: u64,
        dst: &mut [u8],
    ) -> io::Result<()> {
        let n = match backing {
            Some(b) => (dst.len() as u64).min(b.size().saturating_sub(guest)) as usize,
            None => 0,
        };
        if let (Some(b), true) = (backing, n > 0) {
            let (r, buf) = b.driver().read(guest, request_buf(n)).await;
            r?;
            dst[..n].copy_from_slice(&buf);
        }
        dst[n..].fill(0);
        Ok(())
    }

    /// A compressed cluster, inflated.
    async fn decompress(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        if len > 2 * self.cluster_size {
            return Err(corrupt(format!(
                "compressed cluster at {offset:#x} too long"
            )));
        }
        let data = self.file_read(offset, len as usize).await?;
        let mut out = vec![0u8; self.cluster_size as usize];
        let inflated = match self.compression {
            // A full cluster is enough: QEMU too accepts a stream without its end marker.
            Compression::Zlib => {
                let mut z = flate2::Decompress::new(false);
                let _ = z.decompress(&data, &mut out, flate2::FlushDecompress::Finish);
                z.total_out() == self.cluster_size
            }
            // As QEMU: one cluster's worth from the stream; what follows it in the last
            // sector is padding.
            Compression::Zstd => {
                let mut src: &[u8] = &data;
                match ruzstd::decoding::StreamingDecoder::new(&mut src) {
                    Ok(mut d) => std::io::Read::read_exact(&mut d, &mut out).is_ok(),
                    Err(_) => false,
                }
            }
        };
        if !inflated {
            return Err(corrupt(format!(
                "compressed cluster at {offset:#x} does not inflate to a cluster"
            )));
        }
        Ok(out)
    }

    /// Fills `buf` (the guest range at `offset`) from its pieces.
    async fn read_pieces(
        &self,
        offset: u64,
        pieces: &[Piece],
        backing: Option<&Arc<BlockNode>>,
        buf: &mut [u8],
    ) -> io::Result<()> {
        for p in pieces {
            let at = (p.guest - offset) as usize;
            let dst = &mut buf[at..at + p.len as usize];
            match p.src {
                Source::Zero | Source::Unmapped => dst.fill(0),
                Source::Backing => Self::read_backing(backing, p.guest, dst).await?,
                Source::Host(h) => {
                    let b = self.file_read(h, dst.len()).await?;
                    dst.copy_from_slice(&b);
                }
                Source::Compressed {
                    offset,
                    len,
                    within,
                } => {
                    let c = self.decompress(offset, len).await?;
                    dst.copy_from_slice(&c[within as usize..within as usize + dst.len()]);
                }
            }
        }
        Ok(())
    }

    async fn read_impl(&self, offset: u64, mut buf: Buf) -> (io::Result<()>, Buf) {
        let (pieces, inflight, backing) = match self.map_range(offset, buf.len() as u64).await {
            Ok(p) => p,
            Err(e) => return (Err(e), buf),
        };
        if let [Piece {
            src: Source::Host(h),
            ..
        }] = pieces[..]
        {
            let (start, len) = (now_ns(), buf.len() as u64);
            let r = self.file.driver().read(h, buf).await;
            drop(inflight);
            self.file
                .count_direct(Op::Read, start, h + len, len, r.0.is_ok());
            return r;
        }
        let r = self
            .read_pieces(offset, &pieces, backing.as_ref(), &mut buf)
            .await;
        drop(inflight);
        (r, buf)
    }

    /// Where a write of `[offset, offset + len)` can go in place: one host range, every
    /// cluster allocated with refcount one.
    async fn in_place(&self, offset: u64, len: u64) -> io::Result<Option<(u64, Inflight<'_>)>> {
        let mut m = self.meta.lock().await;
        let mut start = None;
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let cstart = self.cluster_start(pos);
            let Mapping::Data { host, copied: true } = self.lookup(&mut m, pos).await? else {
                return Ok(None);
            };
            let h = host + (pos - cstart);
            match start {
                None => start = Some(h),
                Some(s) if s + (pos - offset) == h => {}
                Some(_) => return Ok(None),
            }
            pos = (cstart + self.cluster_size).min(end);
        }
        if let Some(s) = start {
            // An L2 entry pointing at metadata must not turn guest data into tables.
            self.check_overlap(&m, s, len, None).await?;
        }
        let inflight = Inflight::new(&self.io_inflight);
        drop(m);
        Ok(start.map(|s| (s, inflight)))
    }

    /// The content of a guest cluster as `old` maps it; None when it reads as zeroes.
    async fn cluster_content(&self, cstart: u64, old: Mapping) -> io::Result<Option<Vec<u8>>> {
        let cs = self.cluster_size as usize;
        match old {
            Mapping::Zero { .. } => Ok(None),
            Mapping::Unallocated => match &self.backing() {
                Some(b) if cstart < b.size() => {
                    let mut v = vec![0u8; cs];
                    Self::read_backing(Some(b), cstart, &mut v).await?;
                    Ok(Some(v))
                }
                _ => Ok(None),
            },
            Mapping::Data { host, .. } => Ok(Some(self.file_read(host, cs).await?.to_vec())),
            Mapping::Compressed { offset, len } => Ok(Some(self.decompress(offset, len).await?)),
        }
    }

    /// Writes `data` at `within` bytes into the guest cluster at `cstart`, mapped by `old`
    /// (anything but an in-place cluster): onto a new cluster holding the rest of the old
    /// content, then pointed at by the L2 entry.
    async fn allocating_write(
        &self,
        cstart: u64,
        within: u64,
        data: &[u8],
        old: Mapping,
    ) -> io::Result<()> {
        let cs = self.cluster_size;
        // A preallocated zero cluster of ours is reused; anything else gets a new one.
        let (host, fresh) = match old {
            Mapping::Zero {
                host: Some(h),
                copied: true,
            } => (h, false),
            _ => {
                let mut m = self.meta.lock().await;
                self.alloc_cluster(&mut m).await?
            }
        };
        let r = async {
            if within == 0 && data.len() as u64 == cs {
                return self.file_write(host, data).await;
            }
            match self.cluster_content(cstart, old).await? {
                // Untouched bytes of a fresh cluster already read as zeroes.
                None if fresh => self.file_write(host + within, data).await,
                content => {
                    let mut c = content.unwrap_or_else(|| vec![0u8; cs as usize]);
                    c[within as usize..within as usize + data.len()].copy_from_slice(data);
                    self.file_write(host, &c).await
                }
            }
        }
        .await;
        let mut m = self.meta.lock().await;
        if let Err(e) = r {
            if host != old_host(old) {
                // Nothing references the new cluster: give it back now.
                self.change_refcount(&mut m, host, -1).await?;
            }
            return Err(e);
        }
        self.set_l2(&mut m, cstart, host | COPIED).await?;
        if host != old_host(old) {
            self.release(&mut m, old).await?;
        }
        Ok(())
    }

    /// Whole clusters from `pos` (cluster-aligned) that `data` overwrites completely and
    /// that need new clusters: allocated together and written with one request per run of
    /// contiguous host clusters, instead of one allocation and write per cluster (a large
    /// sequential write into an empty image). Where the next position is, or None when
    /// fewer than two such clusters start at `pos`. The caller holds the guest range.
    async fn write_whole_clusters(&self, pos: u64, data: &[u8]) -> io::Result<Option<u64>> {
        match self.plan_whole_clusters(pos, data.len() as u64).await? {
            Some(plan) => self.settle_plan_copied(pos, plan, data).await.map(Some),
            None => Ok(None),
        }
    }

    /// The first half of [`write_whole_clusters`](Self::write_whole_clusters): the
    /// clusters from `pos` that `len` bytes cover and that need new ones, with the new
    /// ones allocated; None when fewer than two.
    async fn plan_whole_clusters(&self, pos: u64, len: u64) -> io::Result<Option<WholeClusters>> {
        const MAX_RUN: usize = 256;
        let cs = self.cluster_size;
        if pos != self.cluster_start(pos) || len < 2 * cs {
            return Ok(None);
        }
        let mut m = self.meta.lock().await;
        let mut olds = Vec::new();
        let mut p = pos;
        while p - pos + cs <= len && olds.len() < MAX_RUN {
            match self.lookup(&mut m, p).await? {
                // In place, or a preallocated cluster of ours: the per-cluster path.
                Mapping::Data { copied: true, .. }
                | Mapping::Zero {
                    host: Some(_),
                    copied: true,
                } => break,
                old => olds.push(old),
            }
            p += cs;
        }
        if olds.len() < 2 {
            return Ok(None);
        }
        let mut hosts = Vec::with_capacity(olds.len());
        for _ in 0..olds.len() {
            match self.alloc_cluster(&mut m).await {
                Ok((h, _)) => hosts.push(h),
                Err(e) => {
                    for h in hosts {
                        self.change_refcount(&mut m, h, -1).await?;
                    }
                    return Err(e);
                }
            }
        }
        Ok(Some(WholeClusters { olds, hosts }))
    }

    /// The second half: once the data is written (`written`), the new clusters are
    /// mapped and the old ones released; if it failed, the new ones are given back.
    /// Where the next position is.
    async fn settle_whole_clusters(
        &self,
        pos: u64,
        plan: WholeClusters,
        written: io::Result<()>,
    ) -> io::Result<u64> {
        let cs = self.cluster_size;
        let mut m = self.meta.lock().await;
        if let Err(e) = written {
            // Nothing references the new clusters: give them back now.
            for h in plan.hosts {
                self.change_refcount(&mut m, h, -1).await?;
            }
            return Err(e);
        }
        let next = pos + plan.olds.len() as u64 * cs;
        for (k, (old, host)) in plan.olds.into_iter().zip(plan.hosts).enumerate() {
            self.set_l2(&mut m, pos + k as u64 * cs, host | COPIED)
                .await?;
            self.release(&mut m, old).await?;
        }
        Ok(next)
    }

    /// A write the in-place path did not take, with the request's own buffer: when it
    /// covers whole clusters that all get new ones in one host run (a large write into
    /// an empty image, a mirror's or a backup's target), the buffer goes to the file as it
    /// is; otherwise as [`write_slow`](Self::write_slow), which copies what it writes.
    async fn write_owned(&self, offset: u64, buf: Buf, fua: bool) -> (io::Result<()>, Buf) {
        let cs = self.cluster_size;
        let len = buf.len() as u64;
        if offset != self.cluster_start(offset) || !len.is_multiple_of(cs) {
            let r = self.write_slow(offset, &buf, fua).await;
            return (r, buf);
        }
        let _lock = self.alloc_locks.lock(offset, offset + len).await;
        let plan = match self.plan_whole_clusters(offset, len).await {
            Ok(Some(plan)) => plan,
            Ok(None) => {
                let r = self.write_locked(offset, &buf, fua, false).await;
                return (r, buf);
            }
            Err(e) => return (Err(e), buf),
        };
        let whole =
            plan.hosts.len() as u64 * cs == len && plan.hosts.windows(2).all(|w| w[1] == w[0] + cs);
        if !whole {
            // Several runs, or only the first clusters: copied, as write_slow does.
            let r = self.settle_plan_copied(offset, plan, &buf).await;
            let r = match r {
                Ok(next) if next < offset + len => {
                    let rest = &buf[(next - offset) as usize..];
                    self.write_locked(next, rest, fua, true).await
                }
                Ok(_) if fua => self.flush_impl().await,
                r => r.map(|_| ()),
            };
            return (r, buf);
        }
        let (written, buf) = self.file_write_buf(plan.hosts[0], buf).await;
        let r = match self.settle_whole_clusters(offset, plan, written).await {
            Ok(_) if fua => self.flush_impl().await,
            r => r.map(|_| ()),
        };
        (r, buf)
    }

    /// Writes a plan's clusters from copies of `data` (one request per host run), then
    /// settles it.
    async fn settle_plan_copied(
        &self,
        pos: u64,
        plan: WholeClusters,
        data: &[u8],
    ) -> io::Result<u64> {
        let cs = self.cluster_size;
        let hosts = &plan.hosts;
        let mut r = Ok(());
        let mut i = 0;
        while i < hosts.len() && r.is_ok() {
            let mut j = i + 1;
            while j < hosts.len() && hosts[j] == hosts[j - 1] + cs {
                j += 1;
            }
            let bytes = &data[i * cs as usize..j * cs as usize];
            r = self.file_write(hosts[i], bytes).await;
            i = j;
        }
        self.settle_whole_clusters(pos, plan, r).await
    }

    async fn write_slow(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let end = offset + data.len() as u64;
        let span_end = self.cluster_start(end + self.cluster_size - 1);
        let _lock = self
            .alloc_locks
            .lock(self.cluster_start(offset), span_end)
            .await;
        self.write_locked(offset, data, fua, false).await
    }

    /// [`write_slow`](Self::write_slow) with the guest range held; `allocated`: the
    /// caller allocated clusters already (a FUA write then flushes the metadata too).
    async fn write_locked(
        &self,
        offset: u64,
        data: &[u8],
        fua: bool,
        mut allocated: bool,
    ) -> io::Result<()> {
        let end = offset + data.len() as u64;
        let mut pos = offset;
        while pos < end {
            if let Some(next) = self
                .write_whole_clusters(pos, &data[(pos - offset) as usize..])
                .await?
            {
                allocated = true;
                pos = next;
                continue;
            }
            let cstart = self.cluster_start(pos);
            let chunk_end = (cstart + self.cluster_size).min(end);
            let chunk = &data[(pos - offset) as usize..(chunk_end - offset) as usize];
            let old = {
                let mut m = self.meta.lock().await;
                let old = self.lookup(&mut m, pos).await?;
                if let Mapping::Data { host, .. }
                | Mapping::Zero {
                    host: Some(host), ..
                } = old
                {
                    self.check_overlap(&m, host, self.cluster_size, None)
                        .await?;
                }
                old
            };
            match old {
                Mapping::Data { host, copied: true } => {
                    self.file_write(host + (pos - cstart), chunk).await?;
                }
                _ => {
                    self.allocating_write(cstart, pos - cstart, chunk, old)
                        .await?;
                    allocated = true;
                }
            }
            pos = chunk_end;
        }
        if fua {
            if allocated {
                self.flush_impl().await?;
            } else {
                self.file.driver().flush().await?;
            }
        }
        Ok(())
    }

    async fn write_impl(&self, offset: u64, buf: Buf, fua: bool) -> (io::Result<()>, Buf) {
        match self.in_place(offset, buf.len() as u64).await {
            Err(e) => return (Err(e), buf),
            Ok(Some((host, inflight))) => {
                let (start, len) = (now_ns(), buf.len() as u64);
                self.file.note_write(host, len);
                let r = self.file.driver().write(host, buf, fua).await;
                drop(inflight);
                self.file
                    .count_direct(Op::Write, start, host + len, len, r.0.is_ok());
                return r;
            }
            Ok(None) => {}
        }
        self.write_owned(offset, buf, fua).await
    }

    /// See [`BlockDriver::populate`]: each run of clusters this image does not allocate
    /// gets the backing chain's content (clusters of zeroes become zero clusters), under
    /// the allocation lock so a guest write to the same clusters waits or wins.
    async fn populate_impl(&self, offset: u64, len: u64) -> io::Result<()> {
        let cs = self.cluster_size;
        let start = self.cluster_start(offset);
        let end = self.cluster_start(offset + len + cs - 1);
        let _lock = self.alloc_locks.lock(start, end).await;
        let Some(backing) = self.backing() else {
            return Ok(());
        };
        let zero_clusters = self.version >= 3;
        let mut pos = start;
        while pos < end {
            let mut run_end = pos;
            {
                let mut m = self.meta.lock().await;
                while run_end < end && self.lookup(&mut m, run_end).await? == Mapping::Unallocated {
                    run_end += cs;
                }
            }
            if run_end == pos {
                pos += cs;
                continue;
            }
            let mut data = vec![0u8; (run_end - pos) as usize];
            Self::read_backing(Some(&backing), pos, &mut data).await?;
            let zero_at = |p: u64| {
                let i = (p - pos) as usize;
                zero_clusters && data[i..i + cs as usize].iter().all(|&b| b == 0)
            };
            let mut p = pos;
            while p < run_end {
                if zero_at(p) {
                    let mut m = self.meta.lock().await;
                    self.set_l2(&mut m, p, ZERO).await?;
                    p += cs;
                    continue;
                }
                let mut q = p + cs;
                while q < run_end && !zero_at(q) {
                    q += cs;
                }
                let bytes = &data[(p - pos) as usize..(q - pos) as usize];
                p = match self.write_whole_clusters(p, bytes).await? {
                    Some(next) => next,
                    None => {
                        self.allocating_write(p, 0, &bytes[..cs as usize], Mapping::Unallocated)
                            .await?;
                        p + cs
                    }
                };
            }
            pos = run_end;
        }
        Ok(())
    }

    async fn change_backing_file_impl(
        &self,
        backing: Option<(&str, Option<&str>)>,
    ) -> io::Result<()> {
        let m = self.meta.lock().await;
        let c0 = self.file_read(0, self.cluster_size as usize).await?;
        let new = header::with_backing(&c0, backing)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        self.check_overlap(&m, 0, new.len() as u64, Some(metadata::MetaKind::Header))
            .await?;
        self.file_write(0, &new).await?;
        self.file.driver().flush().await?;
        drop(m);
        Ok(())
    }

    async fn flush_impl(&self) -> io::Result<()> {
        let mut m = self.meta.lock().await;
        self.write_back(&mut m).await?;
        self.file.driver().flush().await?;
        m.needs_sync = false;
        let freed = self.apply_frees(&mut m).await?;
        if !freed.is_empty() {
            // The lowered refcounts, durable too: a flush before close leaves no leak.
            self.write_back(&mut m).await?;
            self.sync_if_needed(&mut m).await?;
        }
        if self.discard {
            // Under the metadata lock: once it is released, a freed cluster can be
            // allocated again, and a discard after that would drop the new data.
            for host in freed {
                // Dropped unless the file node passes discards on (its `discard=` option).
                let _ = self.file.driver_discard(host, self.cluster_size).await;
            }
        }
        drop(m);
        Ok(())
    }

    /// Grows the virtual size (L1 table first, if it must cover more, then the header's
    /// size field, each durable before the next). Shrinking is refused: stord does not
    /// yet drop the clusters past the new end.
    async fn resize_impl(&self, new: u64) -> io::Result<()> {
        let mut m = self.meta.lock().await;
        self.check_not_corrupt()?;
        let old = self.size();
        if new < old {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "qcow2: shrinking an image is not supported",
            ));
        }
        if !new.is_multiple_of(512) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "The new size must be a multiple of 512",
            ));
        }
        let need = new.div_ceil(self.cluster_size << self.l2_bits) as usize;
        if need > m.l1.len() {
            self.grow_l1(&mut m, need).await?;
        }
        self.file_write(header::field::SIZE, &new.to_be_bytes())
            .await?;
        self.file.driver().flush().await?;
        self.size.store(new, Ordering::Relaxed);
        Ok(())
    }

    /// Gives the whole clusters of `[start, end)` the L2 entry `entry_for(old mapping)`
    /// picks (None: leave the cluster as it is), freeing the host clusters the new entry
    /// no longer holds.
    async fn unmap_clusters(
        &self,
        start: u64,
        end: u64,
        entry_for: impl Fn(Mapping) -> Option<u64>,
    ) -> io::Result<()> {
        if start >= end {
            return Ok(());
        }
        let _lock = self.alloc_locks.lock(start, end).await;
        let mut pos = start;
        while pos < end {
            let mut m = self.meta.lock().await;
            let old = self.lookup(&mut m, pos).await?;
            if let Some(entry) = entry_for(old) {
                self.set_l2(&mut m, pos, entry).await?;
                if entry & OFFSET_MASK != old_host(old) || old_host(old) == 0 {
                    self.release(&mut m, old).await?;
                }
            }
            pos += self.cluster_size;
        }
        Ok(())
    }

    async fn discard_impl(&self, offset: u64, len: u64) -> io::Result<()> {
        if !self.discard {
            return Ok(());
        }
        // Only whole clusters; the rest of the range keeps its data, as discard allows.
        let start = self.cluster_start(offset + self.cluster_size - 1);
        let end = self.cluster_start(offset + len).max(start);
        let backing = self.has_backing();
        let v3 = self.version >= 3;
        self.unmap_clusters(start, end, |old| match old {
            Mapping::Unallocated if !backing => None,
            Mapping::Zero { host: None, .. } => None,
            // With a backing file a discarded cluster must not show the backing's data.
            _ if backing && v3 => Some(ZERO),
            // Version 2 cannot say "zero" over a backing file: keep the data.
            _ if backing => None,
            _ => Some(0),
        })
        .await
    }

    async fn write_zeroes_impl(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        let end = offset + len;
        let mut start = self.cluster_start(offset + self.cluster_size - 1);
        let mut whole_end = self.cluster_start(end);
        if self.version < 3 || whole_end <= start {
            start = end;
            whole_end = end;
        }
        // Partial clusters (and everything on version 2) get zeroes written.
        for (a, b) in [(offset, start.min(end)), (whole_end.max(start), end)] {
            let mut pos = a;
            while pos < b {
                let n = (b - pos).min(1 << 20);
                let z = vec![0u8; n as usize];
                self.write_slow(pos, &z, false).await?;
                pos += n;
            }
        }
        self.unmap_clusters(start, whole_end, |old| match old {
            Mapping::Zero { .. } if !may_unmap => None,
            Mapping::Data { host, copied: true } if !may_unmap => Some(host | COPIED | ZERO),
            _ => Some(ZERO),
        })
        .await
    }

    async fn allocation_depth_impl(&self, offset: u64, len: u64) -> io::Result<(u64, u32)> {
        let (pieces, inflight, backing) = self
            .map_range(offset, len.min(self.cluster_size << self.l2_bits))
            .await?;
        drop(inflight);
        // Everything but an unallocated cluster is this image's (zero clusters too).
        let here = |p: &Piece| !matches!(p.src, Source::Backing | Source::Unmapped);
        let first_here = here(&pieces[0]);
        let run: u64 = pieces
            .iter()
            .take_while(|p| here(p) == first_here)
            .map(|p| p.len)
            .sum();
        if first_here {
            return Ok((run, 1));
        }
        match &backing {
            Some(b) if offset < b.size() => {
                let n = run.min(b.size() - offset);
                let (n, d) = b.driver().allocation_depth(offset, n).await?;
                Ok((n.clamp(1, run), if d == 0 { 0 } else { d + 1 }))
            }
            _ => Ok((run, 0)),
        }
    }

    /// Block status from cached tables, without a future: the first cluster's kind and
    /// the run of clusters of the same kind after it (within one L2 table's reach). None
    /// when a table is not cached, the metadata is busy, or the backing node must answer.
    fn block_status_from_cache(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        let mut m = self.meta.try_lock()?;
        let no_backing = !self.has_backing();
        // (allocated, zero) of a mapping; None for one the backing node answers for.
        let kind = |mp: Mapping| match mp {
            Mapping::Data { .. } | Mapping::Compressed { .. } => Some((true, false)),
            Mapping::Zero { .. } => Some((false, true)),
            Mapping::Unallocated => no_backing.then_some((false, true)),
        };
        let first = kind(self.lookup_cached(&mut m, offset)?.ok()?)?;
        let reach = len.min(self.cluster_size << self.l2_bits);
        let mut run = self.cluster_start(offset) + self.cluster_size - offset;
        while run < reach {
            match self.lookup_cached(&mut m, offset + run) {
                Some(Ok(mp)) if kind(mp) == Some(first) => run += self.cluster_size,
                _ => break,
            }
        }
        Some(BlockStatus {
            len: run.min(len),
            allocated: first.0,
            zero: first.1,
        })
    }

    async fn block_status_impl(&self, offset: u64, len: u64) -> io::Result<BlockStatus> {
        let (pieces, inflight, backing) = self
            .map_range(offset, len.min(self.cluster_size << self.l2_bits))
            .await?;
        drop(inflight);
        let first = pieces[0];
        let class = |s: Source| match s {
            Source::Host(_) | Source::Compressed { .. } => 0,
            Source::Zero | Source::Unmapped => 1,
            Source::Backing => 2,
        };
        let run: u64 = pieces
            .iter()
            .take_while(|p| class(p.src) == class(first.src))
            .map(|p| p.len)
            .sum();
        match first.src {
            Source::Host(_) | Source::Compressed { .. } => Ok(BlockStatus {
                len: run,
                allocated: true,
                zero: false,
            }),
            Source::Zero | Source::Unmapped => Ok(BlockStatus {
                len: run,
                allocated: false,
                zero: true,
            }),
            Source::Backing => {
                let b = backing;
                let bsize = b.as_ref().map_or(0, |b| b.size());
                let Some(b) = b.filter(|_| offset < bsize) else {
                    return Ok(BlockStatus {
                        len: run,
                        allocated: false,
                        zero: true,
                    });
                };
                let n = run.min(bsize - offset);
                let mut st = match b.driver().block_status_cached(offset, n) {
                    Some(st) => st,
                    None => b.driver().block_status(offset, n).await?,
                };
                st.len = st.len.clamp(1, n);
                Ok(st)
            }
        }
    }
}

/// The host cluster a mapping holds, 0 for none.
fn old_host(m: Mapping) -> u64 {
    match m {
        Mapping::Data { host, .. }
        | Mapping::Zero {
            host: Some(host), ..
        } => host,
        _ => 0,
    }
}

impl BlockDriver for Qcow2Driver {
    fn no_flush(&self) -> bool {
        self.file.driver().no_flush()
    }
    fn driver_name(&self) -> &'static str {
        "qcow2"
    }
    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.read_impl(offset, buf))
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.write_impl(offset, buf, fua))
    }
    fn readv(&self, offset: u64, iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(async move {
            let (pieces, inflight, backing) = match self.map_range(offset, iov.len() as u64).await {
                Ok(p) => p,
                Err(e) => return (Err(e), iov),
            };
            if let [Piece {
                src: Source::Host(h),
                ..
            }] = pieces[..]
            {
                let (start, len) = (now_ns(), iov.len() as u64);
                let r = self.file.driver().readv(h, iov).await;
                drop(inflight);
                self.file
                    .count_direct(Op::Read, start, h + len, len, r.0.is_ok());
                return r;
            }
            crate::buf::count_bounce();
            let mut buf = request_buf(iov.len());
            let r = self
                .read_pieces(offset, &pieces, backing.as_ref(), &mut buf)
                .await;
            drop(inflight);
            let mut iov = iov;
            if r.is_ok() {
                iov.copy_in(0, &buf);
            }
            (r, iov)
        })
    }
    fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(async move {
            match self.in_place(offset, iov.len() as u64).await {
                Err(e) => return (Err(e), iov),
                Ok(Some((host, inflight))) => {
                    let (start, len) = (now_ns(), iov.len() as u64);
                    self.file.note_write(host, len);
                    let r = self.file.driver().writev(host, iov, fua).await;
                    drop(inflight);
                    self.file
                        .count_direct(Op::Write, start, host + len, len, r.0.is_ok());
                    return r;
                }
                Ok(None) => {}
            }
            crate::buf::count_bounce();
            let mut buf = request_buf(iov.len());
            iov.copy_out(0, &mut buf);
            let (r, _) = self.write_owned(offset, buf, fua).await;
            (r, iov)
        })
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.flush_impl())
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.discard_impl(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.write_zeroes_impl(offset, len, may_unmap))
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(self.block_status_impl(offset, len))
    }
    fn block_status_cached(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        self.block_status_from_cache(offset, len)
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<(u64, u32)>> {
        Box::pin(self.allocation_depth_impl(offset, len))
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.resize_impl(size))
    }
    fn filename(&self) -> Option<String> {
        self.file.filename()
    }
    fn allocated_bytes(&self) -> Option<u64> {
        self.file.allocated_bytes()
    }
    fn cluster_size(&self) -> Option<u64> {
        Some(self.cluster_size)
    }
    fn child_perms(
        &self,
        role: &'static str,
        perm: Perm,
        shared: Perm,
        writable: bool,
    ) -> (Perm, Perm) {
        match role {
            "backing" => crate::block::node::perm::backing_perms(perm, shared),
            _ => crate::block::node::perm::storage_perms(writable),
        }
    }
    fn activate(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.activate_impl())
    }
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async move { self.reload(true).await.map_err(|e| e.to_string()) })
    }
    fn invalidate_cache(&self, writable: bool) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async move { self.reload(writable).await.map_err(|e| e.to_string()) })
    }
    fn can_store_bitmap(&self, granularity: u64, name: &str) -> Option<Result<(), String>> {
        Some(self.can_store(granularity, name))
    }
    fn store_bitmaps(
        &self,
        bitmaps: Vec<Arc<crate::block::node::dirty_bitmap::DirtyBitmap>>,
    ) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.store_bitmaps_impl(bitmaps))
    }
    fn remove_stored_bitmap<'a>(&'a self, name: &'a str) -> BoxFut<'a, io::Result<()>> {
        Box::pin(self.remove_bitmap_impl(name))
    }
    fn populate(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.populate_impl(offset, len))
    }
    fn set_backing(&self, new: Option<Arc<BlockNode>>) -> Result<Option<Arc<BlockNode>>, String> {
        let mut b = self.backing.write().unwrap_or_else(|e| e.into_inner());
        let changes = (self.backing_state.load(Ordering::Relaxed) >> 1) + 1;
        self.backing_state
            .store(changes << 1 | new.is_some() as u64, Ordering::Release);
        Ok(std::mem::replace(&mut *b, new))
    }
    fn can_snapshot(&self) -> bool {
        true
    }
    fn list_snapshots(
        &self,
    ) -> BoxFut<'_, io::Result<Vec<crate::block::node::block_node::SnapshotInfo>>> {
        Box::pin(self.list_snapshots_impl())
    }
    fn create_snapshot<'a>(
        &'a self,
        name: &'a str,
        date: (u32, u32),
    ) -> BoxFut<'a, io::Result<crate::block::node::block_node::SnapshotInfo>> {
        Box::pin(self.create_snapshot_impl(name, date))
    }
    fn delete_snapshot<'a>(
        &'a self,
        id: Option<&'a str>,
        name: Option<&'a str>,
    ) -> BoxFut<'a, io::Result<Option<crate::block::node::block_node::SnapshotInfo>>> {
        Box::pin(self.delete_snapshot_impl(id, name))
    }
    fn change_backing_file<'a>(
        &'a self,
        backing: Option<(&'a str, Option<&'a str>)>,
    ) -> BoxFut<'a, io::Result<()>> {
        Box::pin(self.change_backing_file_impl(backing))
    }
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        let mut v = vec![("file", self.file.clone())];
        if let Some(b) = self.backing() {
            v.push(("backing", b));
        }
        v
    }
}

/// Fuzz entry (`fuzz/fuzz_targets/qcow2_header.rs`): `data` as the start of an image; if
/// its header parses, every 8 bytes of it decoded as an L2 entry and all of it read as a
/// refcount block, with the header's geometry.
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub fn fuzz(data: &[u8]) {
    let _ = header::Header::bytes_needed(data);
    let Ok(h) = header::Header::parse(data) else {
        return;
    };
    assert!((9..=21).contains(&h.cluster_bits) && h.refcount_order <= 6);
    let codec = table::EntryCodec::new(h.cluster_bits, h.version);
    for w in data.chunks_exact(8) {
        let _ = codec.decode(u64::from_be_bytes(w.try_into().expect("8 bytes")));
    }
    let rc = table::RefcountCodec::new(h.refcount_order);
    let entries = (data.len() * 8) >> h.refcount_order;
    for i in 0..entries {
        assert!(rc.get(data, i) <= rc.max());
    }
}

#[cfg(test)]
mod option_tests {
    use super::*;

    /// QEMU's rules for the cache sizes; before, refcount-cache-size over cache-size
    /// underflowed the subtraction of one from the other.
    #[test]
    fn cache_sizes_follow_qemus_rules() {
        let opts = |s: &str| {
            let mut kv = KeyVal::parse("--blockdev", s, None).unwrap();
            Qcow2Options::from_opts(&mut kv).map_err(|e| e.to_string())
        };
        assert_eq!(
            opts("cache-size=1M,refcount-cache-size=2M").unwrap_err(),
            "refcount-cache-size may not exceed cache-size"
        );
        assert_eq!(
            opts("cache-size=1M,l2-cache-size=2M").unwrap_err(),
            "l2-cache-size may not exceed cache-size"
        );
        assert!(opts("cache-size=1M,l2-cache-size=1M,refcount-cache-size=1M").is_err());
        // l2 beyond the whole disk is cut to it: a 1 GiB image with 64 KiB clusters needs
        // 128 KiB of L2 tables (2 tables).
        let o = opts("l2-cache-size=1T").unwrap();
        assert_eq!(o.cache_tables(1 << 30, 65536).0, 2);
        let o = opts("cache-size=4M,l2-cache-size=1M").unwrap();
        assert_eq!(o.cache_tables(1 << 40, 65536), (16, 48));
    }
}
