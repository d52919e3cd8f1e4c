//! Opening an image: what the driver needs before it exists, read from the file and
//! checked ([`Image::load`]): the header, the L1 and refcount tables, the persistent
//! bitmaps, the snapshot tables and where all metadata lies. Opened for writing, the
//! image is also made fit to write: refused when marked corrupt, its foreign autoclear
//! bits cleared, its refcounts rebuilt when lazy refcounts left it dirty.

use std::io;

use super::bytes::decode_be64;
use super::driver::MetaKind;
use super::header::{autoclear, field, has_magic, incompat, Header, HeaderError};
use super::table::{RefcountCodec, OFFSET_MASK};
use super::{bitmaps, repair, snapshot};
use crate::block::node::block_node::{BlockDriver, BlockNode};
use crate::buf::request_buf;

/// Why a qcow2 node could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    /// The header says no.
    #[error(transparent)]
    Header(#[from] HeaderError),
    /// Reading or updating the image failed.
    #[error("qcow2: {0}")]
    Io(#[from] io::Error),
    /// A read of the open failed: QEMU's words for the step, then the error's.
    #[error("{what}: {text}")]
    Step { what: &'static str, text: String },
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
    pub(super) l1: Vec<u64>,
    pub(super) reftable: Vec<u64>,
    pub(super) file_end: u64,
    /// The end of the last cluster the refcounts call in use.
    pub(super) used_end: u64,
    pub(super) regions: std::collections::BTreeMap<u64, MetaKind>,
    /// The persistent dirty bitmaps (their directory stays with the driver, the bitmaps go
    /// to the node).
    pub(super) bitmaps: Option<bitmaps::Loaded>,
    /// Loaded for writing.
    pub(super) writable: bool,
}

impl Image {
    /// Reads and checks the header and the tables every request needs (on a loop of the
    /// calling thread's: see [`crate::block::helper_thread::block_on_helper`]), and the persistent
    /// dirty bitmaps. With `writable`, images this driver must not write are refused, the
    /// bitmaps are marked in use ([`bitmaps`]), and other autoclear bits are cleared on
    /// disk, as a program without those features must.
    pub async fn load(file: &BlockNode, writable: bool) -> Result<Image, Qcow2Error> {
        let f = file.driver();
        let mut header = read_header(f).await?;
        let step = |what: &'static str| {
            move |e: io::Error| Qcow2Error::Step {
                what,
                text: crate::sys::os_text(&e),
            }
        };
        let l1 = read_table(f, header.l1_table_offset, header.l1_size as usize)
            .await
            .map_err(step("Could not read L1 table"))?;
        f.debug_event(crate::block::node::debug_event::DebugEvent::ReftableLoad);
        let reftable = read_table(
            f,
            header.refcount_table_offset,
            (header.refcount_table_clusters as u64 * header.cluster_size() / 8) as usize,
        )
        .await
        .map_err(step("Could not initialize refcount handling"))?;
        if writable && header.incompatible & incompat::CORRUPT != 0 {
            return Err(Qcow2Error::NotWritable(
                "Image is corrupt; cannot be opened read/write",
            ));
        }
        let loaded = load_bitmaps(f, &header, writable).await?;
        if writable && header.version >= 3 {
            clear_foreign_autoclear(f, &mut header, loaded.is_some()).await?;
        }
        let snapshots = if writable && header.nb_snapshots > 0 {
            read_snapshot_table(f, &header).await?
        } else {
            (Vec::new(), 0)
        };
        if writable && header.incompatible & incompat::DIRTY != 0 {
            repair_dirty(f, &mut header, &l1, &reftable, &snapshots, loaded.as_ref()).await?;
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

/// The header, read and checked with its extensions (the whole first cluster, once its
/// first bytes have told the cluster size).
async fn read_header(f: &dyn BlockDriver) -> Result<Header, Qcow2Error> {
    let (r, first) = f.read(0, request_buf(4096)).await;
    r?;
    if !has_magic(&first) {
        return Err(HeaderError::NotQcow2.into());
    }
    let need = Header::bytes_needed(&first)?;
    let (r, buf) = f.read(0, request_buf(need)).await;
    r?;
    Ok(Header::parse(&buf)?)
}

/// The `n` entries of the table at `off` (the L1 or the refcount table).
async fn read_table(f: &dyn BlockDriver, off: u64, n: usize) -> io::Result<Vec<u64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let (r, b) = f.read(off, request_buf(n * 8)).await;
    r.map(|_| decode_be64(&b))
}

/// The persistent dirty bitmaps, loaded ([`bitmaps::load`]) when they count: only while the
/// autoclear bit vouches for them (else a program without bitmap support wrote the image
/// since: QEMU ignores them too).
async fn load_bitmaps(
    f: &dyn BlockDriver,
    header: &Header,
    writable: bool,
) -> Result<Option<bitmaps::Loaded>, Qcow2Error> {
    let loaded = match &header.bitmaps_ext {
        Some(ext) if header.version >= 3 && header.autoclear & autoclear::BITMAPS != 0 => Some(
            bitmaps::load(f, header, ext, writable)
                .await
                .map_err(Qcow2Error::Bitmaps)?,
        ),
        _ => None,
    };
    Ok(loaded)
}

/// Clears on disk the autoclear bits of features stord does not keep (that is their
/// contract); the bitmaps bit stays while there are bitmaps to keep (`keep_bitmaps`), the
/// raw data file's always (stord keeps the data file a raw image).
async fn clear_foreign_autoclear(
    f: &dyn BlockDriver,
    header: &mut Header,
    keep_bitmaps: bool,
) -> io::Result<()> {
    let keep = autoclear::DATA_FILE_RAW | if keep_bitmaps { autoclear::BITMAPS } else { 0 };
    if header.autoclear & !keep != 0 {
        header.autoclear &= keep;
        let mut b = request_buf(8);
        b.copy_from_slice(&header.autoclear.to_be_bytes());
        let (r, _) = f.write(field::AUTOCLEAR, b, false).await;
        r?;
        f.flush().await?;
    }
    Ok(())
}

/// An image left open with lazy refcounts, whose counts may lag: they are rebuilt first
/// ([`repair`]), and the dirty bit goes.
async fn repair_dirty(
    f: &dyn BlockDriver,
    header: &mut Header,
    l1: &[u64],
    reftable: &[u64],
    snapshots: &(Vec<snapshot::SnapshotL1>, u64),
    loaded: Option<&bitmaps::Loaded>,
) -> Result<(), Qcow2Error> {
    let bitmap_refs = loaded.map_or(&[][..], |l| &l.refs[..]);
    let fixed = repair::rebuild_refcounts(
        f,
        header,
        l1,
        reftable,
        &snapshots.0,
        snapshots.1,
        bitmap_refs,
    )
    .await
    .map_err(|e| Qcow2Error::Corrupt(format!("dirty image (lazy refcounts): {e}")))?;
    tracing::info!("qcow2: repaired {fixed} refcounts of a dirty image");
    header.incompatible &= !incompat::DIRTY;
    Ok(())
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
) -> Result<std::collections::BTreeMap<u64, MetaKind>, String> {
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
    if let Some((off, len)) = h.crypto_header {
        add(off, len, MetaKind::CryptoHeader, "encryption header")?;
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

/// The end of the last cluster the refcounts call in use: where metadata that must be
/// contiguous goes (QEMU finds such runs from the refcounts too, not from the file's size,
/// which for a block device, an RBD image or an NBD export is the storage's whole size).
/// Reads the last refcount block (and earlier ones only if it counts nothing).
async fn used_end(f: &dyn BlockDriver, header: &Header, reftable: &[u64]) -> io::Result<u64> {
    let cs = header.cluster_size();
    let codec = RefcountCodec::new(header.refcount_order);
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
