//! Rebuilding refcounts of an image left dirty by lazy refcounts, before it is opened
//! read-write (QEMU runs its check with repair at that point too).
//!
//! With `lazy_refcounts=on` QEMU lets refcount updates lag behind the tables while the
//! image is open and sets the dirty bit; a crash leaves refcounts that may be too low, and
//! allocating from them would hand out clusters still in use. The repair counts every
//! reference the tables make (header, L1 and refcount tables, refcount blocks, L2 tables
//! and data clusters through the active L1 and every snapshot's, the snapshot table, the
//! persistent bitmaps, an encrypted image's LUKS header), writes the refcount blocks that
//! disagree, and clears the dirty bit, each step durable before the next. stord itself
//! keeps refcounts exact, so it never sets the bit.

use std::collections::BTreeMap;
use std::io;

use super::bytes::decode_be64;
use super::header::{field, incompat, Header};
use super::snapshot::SnapshotL1;
use super::table::{EntryCodec, Mapping, RefcountCodec, OFFSET_MASK};
use crate::block::node::block_node::BlockDriver;
use crate::buf::request_buf;

/// Counts of every cluster the metadata references, by cluster index.
struct Counts {
    bits: u32,
    map: BTreeMap<u64, u64>,
}

impl Counts {
    fn range(&mut self, off: u64, len: u64) {
        if len == 0 {
            return;
        }
        for c in off >> self.bits..=(off + len - 1) >> self.bits {
            *self.map.entry(c).or_default() += 1;
        }
    }
}

/// Rebuilds the refcounts and clears the dirty bit; `l1`, `reftable` and `snapshots` are
/// what the image's header names. Fails (leaving the image as it was) where a refcount
/// block is missing for a referenced range, which `qemu-img check -r all` can fix.
pub(super) async fn rebuild_refcounts(
    f: &dyn BlockDriver,
    h: &Header,
    l1: &[u64],
    reftable: &[u64],
    snapshots: &[SnapshotL1],
    snapshot_table_len: u64,
    bitmaps: &[(u64, u64)],
) -> io::Result<u64> {
    let mut counts = count_metadata(h, reftable, snapshots, snapshot_table_len, bitmaps);
    let mut l1s = vec![l1.to_vec()];
    for s in snapshots {
        let (r, b) = f.read(s.offset, request_buf(s.entries as usize * 8)).await;
        r?;
        l1s.push(decode_be64(&b));
    }
    count_l2_tables(f, h, &l1s, &mut counts).await?;
    let fixed = write_refcount_blocks(f, h, reftable, &counts).await?;
    clear_dirty_bit(f, h).await?;
    Ok(fixed)
}

/// The references the metadata makes itself: header, persistent bitmaps (directory,
/// tables and data), L1 and refcount tables, refcount blocks, the snapshot table and
/// the snapshots' L1 tables.
fn count_metadata(
    h: &Header,
    reftable: &[u64],
    snapshots: &[SnapshotL1],
    snapshot_table_len: u64,
    bitmaps: &[(u64, u64)],
) -> Counts {
    let cs = h.cluster_size();
    let mut counts = Counts {
        bits: h.cluster_bits,
        map: BTreeMap::new(),
    };
    counts.range(0, cs);
    // The persistent bitmaps' directory, tables and data.
    for &(off, len) in bitmaps {
        counts.range(off, len);
    }
    counts.range(h.l1_table_offset, h.l1_size as u64 * 8);
    counts.range(
        h.refcount_table_offset,
        h.refcount_table_clusters as u64 * cs,
    );
    for e in reftable {
        if e & OFFSET_MASK != 0 {
            counts.range(e & OFFSET_MASK, cs);
        }
    }
    if h.nb_snapshots > 0 {
        counts.range(h.snapshots_offset, snapshot_table_len);
    }
    for s in snapshots {
        counts.range(s.offset, s.entries as u64 * 8);
    }
    // An encrypted image's LUKS header (QEMU's check counts it too).
    if let Some((off, len)) = h.crypto_header {
        counts.range(off, len);
    }
    counts
}

fn invalid_data(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// The L2 tables the L1 tables `l1s` (the active one and every snapshot's) point at, and
/// the clusters their entries reference.
async fn count_l2_tables(
    f: &dyn BlockDriver,
    h: &Header,
    l1s: &[Vec<u64>],
    counts: &mut Counts,
) -> io::Result<()> {
    let cs = h.cluster_size();
    let codec = EntryCodec::new(h.cluster_bits, h.version, h.extended_l2());
    for table in l1s {
        for e in table {
            let l2 = e & OFFSET_MASK;
            if l2 == 0 {
                continue;
            }
            counts.range(l2, cs);
            if h.has_data_file() {
                // Data clusters live in the data file: the image counts none of them.
                continue;
            }
            let (r, b) = f.read(l2, request_buf(cs as usize)).await;
            r?;
            // An extended entry's bitmap says nothing of the clusters it holds: skipped.
            for entry in decode_be64(&b).into_iter().step_by(codec.words()) {
                match codec.decode(entry).map_err(invalid_data)? {
                    Mapping::Data { host, .. }
                    | Mapping::Zero {
                        host: Some(host), ..
                    } => counts.range(host, cs),
                    Mapping::Compressed { offset, len } => counts.range(offset, len),
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

/// Makes every refcount block agree with `counts` (every cluster with a count, and every
/// cluster a block counts): the refcounts changed.
async fn write_refcount_blocks(
    f: &dyn BlockDriver,
    h: &Header,
    reftable: &[u64],
    counts: &Counts,
) -> io::Result<u64> {
    let cs = h.cluster_size();
    let rc = RefcountCodec::new(h.refcount_order);
    let per_block_bits = h.cluster_bits + 3 - h.refcount_order;
    let last_block = counts
        .map
        .keys()
        .next_back()
        .map_or(0, |c| c >> per_block_bits);
    let mut fixed = 0u64;
    for (bi, e) in reftable.iter().enumerate() {
        let block_off = e & OFFSET_MASK;
        let first = (bi as u64) << per_block_bits;
        let wanted: Vec<(u64, u64)> = counts
            .map
            .range(first..first + (1 << per_block_bits))
            .map(|(&c, &n)| (c, n))
            .collect();
        if block_off == 0 {
            if !wanted.is_empty() {
                return Err(invalid_data(format!(
                    "clusters from {:#x} are used but have no refcount block; repair the image \
                     with 'qemu-img check -r all'",
                    first << h.cluster_bits
                )));
            }
            continue;
        }
        let (r, mut block) = f.read(block_off, request_buf(cs as usize)).await;
        r?;
        let mut changed = false;
        for i in 0..1usize << per_block_bits {
            let want = counts.map.get(&(first + i as u64)).copied().unwrap_or(0);
            if want > rc.max() {
                return Err(invalid_data(format!(
                    "cluster {:#x} is referenced {want} times, more than the refcount width allows",
                    (first + i as u64) << h.cluster_bits
                )));
            }
            if rc.get(&block, i) != want {
                rc.set(&mut block, i, want);
                changed = true;
                fixed += 1;
            }
        }
        if changed {
            let (r, _) = f.write(block_off, block, false).await;
            r?;
        }
    }
    if last_block >= reftable.len() as u64 {
        return Err(invalid_data(
            "clusters past the refcount table's reach are in use; repair the image with \
             'qemu-img check -r all'"
                .into(),
        ));
    }
    Ok(fixed)
}

/// The rebuilt refcounts made durable, then the dirty bit cleared (durable too).
async fn clear_dirty_bit(f: &dyn BlockDriver, h: &Header) -> io::Result<()> {
    f.flush().await?;
    let mut b = request_buf(8);
    b.copy_from_slice(&(h.incompatible & !incompat::DIRTY).to_be_bytes());
    let (r, _) = f.write(field::INCOMPATIBLE, b, false).await;
    r?;
    f.flush().await
}
