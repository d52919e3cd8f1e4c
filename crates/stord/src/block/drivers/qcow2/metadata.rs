//! The image's metadata: the L1 table, cached L2 tables, the refcount table and cached
//! refcount blocks, with the cluster allocator over them, and their write-back.
//!
//! ## Crash safety
//! Metadata is written back, never through: a guest write that allocates changes only
//! cached tables, and the next flush (or a cache full of dirty tables) writes them in an
//! order that leaves the image consistent at every step, with an fsync between steps:
//! refcount blocks, then refcount table entries, then L2 tables, then L1 entries. So an
//! on-disk reference never points at a cluster whose refcount or table is not yet on disk;
//! a crash can leave clusters counted but unreferenced (leaks, which `qemu-img check -r
//! leaks` repairs), never referenced but uncounted (corruption).
//!
//! Freeing goes the other way (reference gone before the count drops), so freed clusters
//! wait in `pending_free` until a flush has made the tables that dropped them durable,
//! and until no request that looked up a mapping before then is still doing I/O.

use std::collections::BTreeSet;
use std::io;

use super::table::{EntryCodec, Mapping, RefcountCodec, TableCache, COPIED, OFFSET_MASK};
use super::Qcow2Driver;
use crate::block::node::stats::Op;
use crate::buf::request_buf;

/// Entries written per L1 / refcount table write-back unit (one 4 KiB page).
const PAGE_ENTRIES: usize = 512;

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
}

impl MetaKind {
    fn name(self) -> &'static str {
        match self {
            MetaKind::Header => "qcow2_header",
            MetaKind::L1 => "active L1 table",
            MetaKind::L2 => "active L2 table",
            MetaKind::RefTable => "refcount table",
            MetaKind::RefBlock => "refcount block",
            MetaKind::Snapshots => "snapshot table",
            MetaKind::InactiveL1 => "inactive L1 table",
            MetaKind::BitmapDir => "bitmap directory",
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
    /// durable (see the module docs).
    pub pending_free: Vec<u64>,
    /// Metadata was written since the last fsync.
    pub needs_sync: bool,
    /// The persistent bitmaps' directory as the image holds it.
    pub bitmap_dir: super::bitmaps::Directory,
}

/// An I/O error for metadata that makes no sense (the image is corrupt there).
pub(super) fn corrupt(what: String) -> io::Error {
    tracing::error!("qcow2: {what}");
    io::Error::from_raw_os_error(libc::EIO)
}

fn decode_be64(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes")))
        .collect()
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

impl Qcow2Driver {
    /// Refuses a write of `[host, host + len)` that would land on metadata other than
    /// `own` (the table being written itself): the image is marked corrupt, as QEMU does,
    /// and the request fails with EIO.
    pub(super) async fn check_overlap(
        &self,
        m: &Meta,
        host: u64,
        len: u64,
        own: Option<MetaKind>,
    ) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let first = host >> self.cluster_bits;
        let last = (host + len - 1) >> self.cluster_bits;
        let hit = m
            .regions
            .range(first..=last)
            .find(|(_, k)| Some(**k) != own)
            .map(|(_, k)| *k);
        match hit {
            None => Ok(()),
            Some(kind) => Err(self
                .signal_corruption(&format!(
                    "Preventing invalid write on metadata (overlaps with {})",
                    kind.name()
                ))
                .await),
        }
    }

    /// Marks the image corrupt (the header's corrupt bit, on version 3) and fails every
    /// later request, as QEMU's `qcow2_signal_corruption`: the error for the request.
    pub(super) async fn signal_corruption(&self, what: &str) -> io::Error {
        if !self.corrupt.swap(true, std::sync::atomic::Ordering::AcqRel) {
            tracing::error!(
                "qcow2: Marking image as corrupt: {what}; further corruption events will be suppressed"
            );
            if self.version >= 3 {
                let bits = self.incompatible | super::header::incompat::CORRUPT;
                let _ = self
                    .file_write(super::header::field::INCOMPATIBLE, &bits.to_be_bytes())
                    .await;
                let _ = self.file.driver().flush().await;
            }
        }
        io::Error::from_raw_os_error(libc::EIO)
    }

    /// EIO once the image has been found corrupt.
    pub(super) fn check_not_corrupt(&self) -> io::Result<()> {
        if self.corrupt.load(std::sync::atomic::Ordering::Acquire) {
            Err(io::Error::from_raw_os_error(libc::EIO))
        } else {
            Ok(())
        }
    }

    pub(super) fn l1_index(&self, guest: u64) -> usize {
        (guest >> (self.cluster_bits + self.l2_bits)) as usize
    }

    pub(super) fn l2_index(&self, guest: u64) -> usize {
        ((guest >> self.cluster_bits) & ((1 << self.l2_bits) - 1)) as usize
    }

    pub(super) fn entries(&self) -> EntryCodec {
        EntryCodec::new(self.cluster_bits, self.version)
    }

    pub(super) fn refcounts(&self) -> RefcountCodec {
        RefcountCodec::new(self.refcount_order)
    }

    /// log2 of the refcounts per refcount block.
    fn refblock_bits(&self) -> u32 {
        self.cluster_bits + 3 - self.refcount_order
    }

    pub(super) async fn file_read(&self, offset: u64, len: usize) -> io::Result<crate::buf::Buf> {
        let start = stord_aio::sys::now_ns();
        let (r, buf) = self.file.driver().read(offset, request_buf(len)).await;
        let end = offset + len as u64;
        self.file
            .count_direct(Op::Read, start, end, len as u64, r.is_ok());
        r.map(|_| buf)
    }

    pub(super) async fn file_write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut buf = request_buf(data.len());
        buf.copy_from_slice(data);
        self.file_write_buf(offset, buf).await.0
    }

    /// Writes `buf` at `offset` of the file as it is (no copy), and gives it back.
    pub(super) async fn file_write_buf(
        &self,
        offset: u64,
        buf: crate::buf::Buf,
    ) -> (io::Result<()>, crate::buf::Buf) {
        let (start, len) = (stord_aio::sys::now_ns(), buf.len() as u64);
        self.file.note_write(offset, len);
        let (r, buf) = self.file.driver().write(offset, buf, false).await;
        self.file
            .count_direct(Op::Write, start, offset + len, len, r.is_ok());
        (r, buf)
    }

    /// The L2 table at `l2_off`, read into the cache if it is not there.
    pub(super) async fn load_l2(&self, m: &mut Meta, l2_off: u64) -> io::Result<()> {
        if m.l2.contains(l2_off) {
            return Ok(());
        }
        if l2_off & (self.cluster_size - 1) != 0 {
            return Err(corrupt(format!("L2 table offset {l2_off:#x} unaligned")));
        }
        if m.l2.full_of_dirty() {
            self.write_back(m).await?;
        }
        let buf = self.file_read(l2_off, self.cluster_size as usize).await?;
        m.l2.insert(l2_off, decode_be64(&buf), false);
        Ok(())
    }

    async fn load_refblock(&self, m: &mut Meta, off: u64) -> io::Result<()> {
        if m.refblocks.contains(off) {
            return Ok(());
        }
        if off & (self.cluster_size - 1) != 0 {
            return Err(corrupt(format!("refcount block offset {off:#x} unaligned")));
        }
        if m.refblocks.full_of_dirty() {
            self.write_back(m).await?;
        }
        let buf = self.file_read(off, self.cluster_size as usize).await?;
        m.refblocks.insert(off, buf.to_vec(), false);
        Ok(())
    }

    /// What the image says about the guest cluster containing `guest`.
    pub(super) async fn lookup(&self, m: &mut Meta, guest: u64) -> io::Result<Mapping> {
        self.check_not_corrupt()?;
        let l2_off = m.l1[self.l1_index(guest)] & OFFSET_MASK;
        if l2_off == 0 {
            return Ok(Mapping::Unallocated);
        }
        self.load_l2(m, l2_off).await?;
        let e = m.l2.get(l2_off).expect("just loaded")[self.l2_index(guest)];
        self.entries().decode(e).map_err(corrupt)
    }

    /// As [`lookup`](Self::lookup), from cached tables only: None when the L2 table is not
    /// in the cache.
    pub(super) fn lookup_cached(&self, m: &mut Meta, guest: u64) -> Option<io::Result<Mapping>> {
        let l2_off = m.l1[self.l1_index(guest)] & OFFSET_MASK;
        if l2_off == 0 {
            return Some(Ok(Mapping::Unallocated));
        }
        let e = m.l2.get(l2_off)?[self.l2_index(guest)];
        Some(self.entries().decode(e).map_err(corrupt))
    }

    /// Sets the L2 entry of the guest cluster containing `guest`, allocating its L2 table
    /// if it has none.
    pub(super) async fn set_l2(&self, m: &mut Meta, guest: u64, entry: u64) -> io::Result<()> {
        let i1 = self.l1_index(guest);
        let mut l2_off = m.l1[i1] & OFFSET_MASK;
        if l2_off != 0 && m.l1[i1] & COPIED == 0 {
            // Shared with an internal snapshot: the active image gets its own copy (the
            // data clusters' counts stay: both tables still reference them), and the
            // shared table loses one reference once the copy is durable.
            self.load_l2(m, l2_off).await?;
            let entries = m.l2.get(l2_off).expect("just loaded").clone();
            let (table, _) = self.alloc_cluster(m).await?;
            if m.l2.full_of_dirty() {
                self.write_back(m).await?;
            }
            m.l2.insert(table, entries, true);
            m.add_region(self.cluster_bits, table, self.cluster_size, MetaKind::L2);
            m.l1[i1] = table | COPIED;
            m.l1_dirty.insert(i1);
            m.pending_free.push(l2_off);
            l2_off = table;
        } else if l2_off == 0 {
            let (table, _) = self.alloc_cluster(m).await?;
            if m.l2.full_of_dirty() {
                self.write_back(m).await?;
            }
            m.l2.insert(table, vec![0; 1 << self.l2_bits], true);
            m.add_region(self.cluster_bits, table, self.cluster_size, MetaKind::L2);
            m.l1[i1] = table | COPIED;
            m.l1_dirty.insert(i1);
            l2_off = table;
        } else {
            self.load_l2(m, l2_off).await?;
        }
        m.l2.get_mut(l2_off).expect("just loaded")[self.l2_index(guest)] = entry;
        Ok(())
    }

    /// Allocates one cluster (refcount 1): its host offset, and whether it lies past
    /// everything ever written (so it reads as zeroes).
    pub(super) async fn alloc_cluster(&self, m: &mut Meta) -> io::Result<(u64, bool)> {
        let bits = self.refblock_bits();
        let per_block = 1u64 << bits;
        let rc = self.refcounts();
        loop {
            let c = m.free_hint;
            let bi = (c >> bits) as usize;
            let idx = (c & (per_block - 1)) as usize;
            if bi >= m.reftable.len() {
                self.grow_reftable(m, bi + 1).await?;
                continue;
            }
            let rb_off = m.reftable[bi] & OFFSET_MASK;
            if rb_off == 0 {
                // No block counts this range yet, so all of it is free: the new refcount
                // block takes the range's first free cluster and counts itself.
                if m.refblocks.full_of_dirty() {
                    self.write_back(m).await?;
                }
                let mut block = vec![0u8; self.cluster_size as usize];
                rc.set(&mut block, idx, 1);
                let host = c << self.cluster_bits;
                self.check_overlap(m, host, self.cluster_size, None).await?;
                m.refblocks.insert(host, block, true);
                m.add_region(
                    self.cluster_bits,
                    host,
                    self.cluster_size,
                    MetaKind::RefBlock,
                );
                m.reftable[bi] = host;
                m.reftable_dirty.insert(bi);
                m.file_end = m.file_end.max(host + self.cluster_size);
                m.used_end = m.used_end.max(host + self.cluster_size);
                m.free_hint = c + 1;
                continue;
            }
            self.load_refblock(m, rb_off).await?;
            let block = m.refblocks.get(rb_off).expect("just loaded");
            match (idx..per_block as usize).find(|&i| rc.get(block, i) == 0) {
                None => m.free_hint = (bi as u64 + 1) << bits,
                Some(i) => {
                    let c = ((bi as u64) << bits) + i as u64;
                    let block = m.refblocks.get_mut(rb_off).expect("loaded");
                    rc.set(block, i, 1);
                    m.free_hint = c + 1;
                    let host = c << self.cluster_bits;
                    // Refcounts that call a metadata cluster free are corrupt: never
                    // hand it out for data.
                    self.check_overlap(m, host, self.cluster_size, None).await?;
                    let fresh = host >= m.file_end;
                    m.file_end = m.file_end.max(host + self.cluster_size);
                    m.used_end = m.used_end.max(host + self.cluster_size);
                    return Ok((host, fresh));
                }
            }
        }
    }

    /// Replaces the refcount table with a larger one of at least `need` entries, as QEMU
    /// does: the new table and the refcount blocks that count it go in a fresh area past
    /// everything in use (those blocks count the area itself), then the header switches to
    /// the new table in one write, then the old table's clusters are freed. Every step is
    /// durable before the next, so a crash leaves either table in force, never neither.
    async fn grow_reftable(&self, m: &mut Meta, need: usize) -> io::Result<()> {
        // The table on disk must hold everything the cached one does.
        self.write_back(m).await?;
        self.sync_if_needed(m).await?;
        let cs = self.cluster_size;
        let per_block = 1u64 << self.refblock_bits();
        let old = m.reftable.len();
        let covered = old as u64 * per_block;
        // Past every cluster in use, and outside the old table's reach (where blocks
        // exist for every range, all of it in use, or we would not be here).
        let area = m.used_end.div_ceil(cs).max(covered);
        let mut entries = need.max(old * 2).max(old + 1);
        let too_large = || {
            io::Error::new(
                io::ErrorKind::StorageFull,
                "qcow2: the refcount table cannot grow past 8 MiB",
            )
        };
        let (table_clusters, blocks) = loop {
            let table_clusters = (entries as u64 * 8).div_ceil(cs);
            // Checked before counting blocks over the area: a corrupt image can put the
            // area so far out that counting alone would take minutes.
            if table_clusters * cs > super::header::MAX_REFTABLE_BYTES {
                return Err(too_large());
            }
            // Refcount blocks for the area, placed after the table: enough to count the
            // table, themselves, and anything up to their end not yet covered.
            let mut blocks = 0u64;
            loop {
                let end = area + table_clusters + blocks;
                let first = area / per_block;
                let last = (end - 1) / per_block;
                let missing = (first..=last)
                    .filter(|&b| b as usize >= old || m.reftable[b as usize] & OFFSET_MASK == 0)
                    .count() as u64;
                if missing == blocks {
                    break;
                }
                blocks = missing;
            }
            let end = area + table_clusters + blocks;
            let want = end.div_ceil(per_block) as usize;
            if want <= entries {
                break (table_clusters, blocks);
            }
            entries = want.max(entries * 2);
        };
        if table_clusters * cs > super::header::MAX_REFTABLE_BYTES {
            return Err(too_large());
        }
        let end = area + table_clusters + blocks;
        let mut table = m.reftable.clone();
        table.resize((table_clusters * cs / 8) as usize, 0);
        // The new blocks, in order after the table, each counting the area's clusters in
        // its range.
        let rc = self.refcounts();
        let mut next = area + table_clusters;
        for b in area / per_block..=(end - 1) / per_block {
            if table[b as usize] & OFFSET_MASK != 0 {
                continue;
            }
            let mut block = vec![0u8; cs as usize];
            let lo = (b * per_block).max(area);
            let hi = ((b + 1) * per_block).min(end);
            for c in lo..hi {
                rc.set(&mut block, (c - b * per_block) as usize, 1);
            }
            table[b as usize] = next * cs;
            self.file_write(next * cs, &block).await?;
            next += 1;
        }
        debug_assert_eq!(next, end);
        let bytes: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.file_write(area * cs, &bytes).await?;
        self.file.driver().flush().await?;
        let mut header = [0u8; 12];
        header[..8].copy_from_slice(&(area * cs).to_be_bytes());
        header[8..].copy_from_slice(&(table_clusters as u32).to_be_bytes());
        self.file_write(super::header::field::REFCOUNT_TABLE, &header)
            .await?;
        self.file.driver().flush().await?;
        tracing::debug!(
            "qcow2: refcount table grew from {old} to {} entries at {:#x}",
            table.len(),
            area * cs
        );
        let (old_offset, old_clusters) = (m.reftable_offset, (old as u64 * 8).div_ceil(cs));
        m.reftable = table;
        m.reftable_offset = area * cs;
        let old_bytes = old as u64 * 8;
        for c in old_offset / cs..(old_offset + old_bytes).div_ceil(cs) {
            m.regions.remove(&c);
        }
        m.add_region(
            self.cluster_bits,
            area * cs,
            table_clusters * cs,
            MetaKind::RefTable,
        );
        m.add_region(
            self.cluster_bits,
            (area + table_clusters) * cs,
            blocks * cs,
            MetaKind::RefBlock,
        );
        m.reftable_dirty.clear();
        m.file_end = m.file_end.max(end * cs);
        m.used_end = m.used_end.max(end * cs);
        // The old table is referenced by nothing durable now: free it at once.
        for i in 0..old_clusters {
            self.change_refcount(m, old_offset + i * cs, -1).await?;
        }
        self.write_back(m).await?;
        self.sync_if_needed(m).await
    }

    /// Moves the L1 table to a larger one of `need` entries, as QEMU's
    /// `qcow2_grow_l1_table`: the new table is written to new clusters, then the header
    /// names it (size and offset in one write), then the old table's clusters are freed.
    pub(super) async fn grow_l1(&self, m: &mut Meta, need: usize) -> io::Result<()> {
        let cs = self.cluster_size;
        let entries = need.max(m.l1.len() * 3 / 2);
        if entries as u64 * 8 > super::header::MAX_L1_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "qcow2: the L1 table would exceed 32 MiB",
            ));
        }
        let n = (entries as u64 * 8).div_ceil(cs);
        // The on-disk L1 must hold every cached change before it is copied.
        self.write_back(m).await?;
        self.sync_if_needed(m).await?;
        let start = self.alloc_contiguous(m, n).await?;
        let mut l1 = m.l1.clone();
        l1.resize((n * cs / 8) as usize, 0);
        let bytes: Vec<u8> = l1.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.check_overlap(m, start, n * cs, None).await?;
        self.write_back(m).await?;
        self.file_write(start, &bytes).await?;
        self.file.driver().flush().await?;
        let mut header = [0u8; 12];
        header[..4].copy_from_slice(&(entries as u32).to_be_bytes());
        header[4..].copy_from_slice(&start.to_be_bytes());
        self.file_write(super::header::field::L1, &header).await?;
        self.file.driver().flush().await?;
        let (old_off, old_len) = (m.l1_offset, m.l1.len() as u64 * 8);
        for c in old_off / cs..(old_off + old_len).div_ceil(cs) {
            m.regions.remove(&c);
            self.change_refcount(m, c * cs, -1).await?;
        }
        l1.truncate(entries);
        m.l1 = l1;
        m.l1_offset = start;
        m.l1_dirty.clear();
        m.add_region(self.cluster_bits, start, entries as u64 * 8, MetaKind::L1);
        // The old table's clusters, free on disk too (no leak if the daemon dies now).
        self.write_back(m).await?;
        self.sync_if_needed(m).await
    }

    /// `n` free clusters in a row (refcount 1 each), past everything in use, as QEMU's
    /// `alloc_clusters_noref` then `update_refcount`: the run is reserved first, so the
    /// refcount blocks its ranges lack are allocated after it, not inside it.
    pub(super) async fn alloc_contiguous(&self, m: &mut Meta, n: u64) -> io::Result<u64> {
        let cs = self.cluster_size;
        let bits = self.refblock_bits();
        let start = m.used_end.div_ceil(cs);
        m.used_end = (start + n) * cs;
        m.file_end = m.file_end.max(m.used_end);
        let hint = m.free_hint;
        m.free_hint = start + n;
        for c in start..start + n {
            let bi = (c >> bits) as usize;
            if bi >= m.reftable.len() {
                self.grow_reftable(m, bi + 1).await?;
            }
            if m.reftable[bi] & OFFSET_MASK == 0 {
                // A block for this range, wherever allocation finds room (it counts
                // itself in its own range's block).
                let (block, _) = self.alloc_cluster(m).await?;
                if m.refblocks.full_of_dirty() {
                    self.write_back(m).await?;
                }
                m.refblocks.insert(block, vec![0u8; cs as usize], true);
                m.add_region(self.cluster_bits, block, cs, MetaKind::RefBlock);
                m.reftable[bi] = block;
                m.reftable_dirty.insert(bi);
            }
            self.change_refcount(m, c * cs, 1).await?;
        }
        m.free_hint = hint.min(start);
        Ok(start * cs)
    }

    /// Adds `delta` (+1 or -1) to the refcount of the host cluster at `host`: the new
    /// refcount.
    pub(super) async fn change_refcount(
        &self,
        m: &mut Meta,
        host: u64,
        delta: i64,
    ) -> io::Result<u64> {
        let bits = self.refblock_bits();
        let c = host >> self.cluster_bits;
        let bi = (c >> bits) as usize;
        let idx = (c & ((1 << bits) - 1)) as usize;
        let rb_off = m.reftable.get(bi).map_or(0, |e| e & OFFSET_MASK);
        if rb_off == 0 {
            return Err(corrupt(format!("cluster {host:#x} has no refcount block")));
        }
        self.load_refblock(m, rb_off).await?;
        let rc = self.refcounts();
        let block = m.refblocks.get_mut(rb_off).expect("just loaded");
        let v = rc.get(block, idx);
        let new = match v.checked_add_signed(delta) {
            Some(n) if n <= rc.max() => n,
            _ => {
                return Err(corrupt(format!(
                    "refcount of cluster {host:#x} out of range"
                )))
            }
        };
        rc.set(block, idx, new);
        if new == 0 && c < m.free_hint {
            m.free_hint = c;
        }
        Ok(new)
    }

    /// Queues the host clusters behind a mapping that is being replaced for freeing. A
    /// mapping whose clusters are metadata (the image lies: an L2 entry pointing at a
    /// table) is not freed, as its discard would destroy the table: the image is marked
    /// corrupt and the request fails.
    pub(super) async fn release(&self, m: &mut Meta, old: Mapping) -> io::Result<()> {
        let (start, len) = match old {
            Mapping::Data { host, .. }
            | Mapping::Zero {
                host: Some(host), ..
            } => (host, self.cluster_size),
            Mapping::Compressed { offset, len } => (offset, len),
            Mapping::Unallocated | Mapping::Zero { host: None, .. } => return Ok(()),
        };
        if len == 0 {
            return Ok(());
        }
        let first = start >> self.cluster_bits;
        let last = (start + len - 1) >> self.cluster_bits;
        if let Some((_, kind)) = m.regions.range(first..=last).next() {
            let what = format!(
                "Preventing invalid free of metadata (a data cluster overlaps with {})",
                kind.name()
            );
            return Err(self.signal_corruption(&what).await);
        }
        for c in first..=last {
            m.pending_free.push(c << self.cluster_bits);
        }
        Ok(())
    }

    /// Drops the refcounts of freed clusters whose references are durable; called right
    /// after an fsync that followed a write-back. Returns the clusters whose refcount
    /// reached zero (for a discard to pass down): a host cluster that compressed clusters
    /// share is freed once per compressed cluster, and its bytes stay until the last goes.
    pub(super) async fn apply_frees(&self, m: &mut Meta) -> io::Result<Vec<u64>> {
        if m.pending_free.is_empty()
            || self.io_inflight.load(std::sync::atomic::Ordering::Acquire) != 0
        {
            return Ok(Vec::new());
        }
        let frees = std::mem::take(&mut m.pending_free);
        let mut unused = Vec::new();
        for host in frees {
            if self.change_refcount(m, host, -1).await? == 0 {
                // A table nothing references any more is no longer metadata.
                m.regions.remove(&(host >> self.cluster_bits));
                unused.push(host);
            }
        }
        Ok(unused)
    }

    pub(super) async fn sync_if_needed(&self, m: &mut Meta) -> io::Result<()> {
        if m.needs_sync {
            self.file.driver().flush().await?;
            m.needs_sync = false;
        }
        Ok(())
    }

    /// Writes every dirty table back, in the order the module docs give.
    pub(super) async fn write_back(&self, m: &mut Meta) -> io::Result<()> {
        for off in m.refblocks.dirty() {
            self.check_overlap(m, off, self.cluster_size, Some(MetaKind::RefBlock))
                .await?;
            self.file_write(off, m.refblocks.peek(off).expect("dirty is cached"))
                .await?;
            m.refblocks.mark_clean(off);
            m.needs_sync = true;
        }
        if !m.reftable_dirty.is_empty() {
            self.sync_if_needed(m).await?;
            let pages: BTreeSet<usize> =
                m.reftable_dirty.iter().map(|i| i / PAGE_ENTRIES).collect();
            for p in pages {
                self.write_entries(m.reftable_offset, &m.reftable, p)
                    .await?;
            }
            m.reftable_dirty.clear();
            m.needs_sync = true;
        }
        let dirty_l2 = m.l2.dirty();
        if !dirty_l2.is_empty() {
            self.sync_if_needed(m).await?;
            for off in dirty_l2 {
                self.check_overlap(m, off, self.cluster_size, Some(MetaKind::L2))
                    .await?;
                let table = m.l2.peek(off).expect("dirty is cached");
                let bytes: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
                self.file_write(off, &bytes).await?;
                m.l2.mark_clean(off);
            }
            m.needs_sync = true;
        }
        if !m.l1_dirty.is_empty() {
            self.sync_if_needed(m).await?;
            let pages: BTreeSet<usize> = m.l1_dirty.iter().map(|i| i / PAGE_ENTRIES).collect();
            for p in pages {
                self.write_entries(m.l1_offset, &m.l1, p).await?;
            }
            m.l1_dirty.clear();
            m.needs_sync = true;
        }
        Ok(())
    }

    /// Writes page `page` of a table of big-endian entries that starts at `base`.
    async fn write_entries(&self, base: u64, table: &[u64], page: usize) -> io::Result<()> {
        let start = page * PAGE_ENTRIES;
        let end = (start + PAGE_ENTRIES).min(table.len());
        let bytes: Vec<u8> = table[start..end]
            .iter()
            .flat_map(|e| e.to_be_bytes())
            .collect();
        self.file_write(base + start as u64 * 8, &bytes).await
    }
}
