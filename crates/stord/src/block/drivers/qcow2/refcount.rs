//! Refcounts: the cluster allocator over the refcount table and the cached refcount
//! blocks, the table grown when it runs out (QEMU's way: a new table in a fresh area,
//! the header switched to it in one write), and clusters freed once nothing durable
//! references them (see `writeback` for the order).

use std::io;

use super::driver::{corrupt, Meta, MetaKind, Qcow2Driver};
use super::header::{field, MAX_REFTABLE_BYTES};
use super::table::{Mapping, OFFSET_MASK};
use crate::block::node::debug_event::DebugEvent;

/// Where a grown refcount table goes, in clusters: `table_clusters` at `area`, then
/// `blocks` new refcount blocks that count the area.
struct ReftableGrowth {
    area: u64,
    table_clusters: u64,
    blocks: u64,
}

impl ReftableGrowth {
    /// The cluster past the new blocks.
    fn end(&self) -> u64 {
        self.area + self.table_clusters + self.blocks
    }
}

impl Qcow2Driver {
    /// log2 of the refcounts per refcount block.
    fn refblock_bits(&self) -> u32 {
        self.cluster_bits + 3 - self.refcount_order
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

    /// Allocates one cluster (refcount 1): its host offset, and whether it lies past
    /// everything ever written (so it reads as zeroes).
    pub(super) async fn alloc_cluster(&self, m: &mut Meta) -> io::Result<(u64, bool)> {
        self.ev(DebugEvent::ClusterAlloc);
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
                self.ev(DebugEvent::RefblockAlloc);
                self.ev(DebugEvent::RefblockAllocWrite);
                self.ev(DebugEvent::RefblockAllocHookup);
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
                    // The refcount set (QEMU's update_refcount: alloc_refcount_block).
                    self.ev(DebugEvent::RefblockAlloc);
                    self.ev(DebugEvent::RefblockLoad);
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
        self.ev(DebugEvent::ReftableGrow);
        // The table on disk must hold everything the cached one does.
        self.write_back(m).await?;
        self.sync_if_needed(m).await?;
        let growth = self.plan_reftable_growth(m, need)?;
        let table = self.write_grown_reftable(m, &growth).await?;
        self.adopt_grown_reftable(m, &growth, table).await
    }

    /// Where the grown refcount table goes and how large it is, with the refcount blocks
    /// that must follow it.
    fn plan_reftable_growth(&self, m: &Meta, need: usize) -> io::Result<ReftableGrowth> {
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
            if table_clusters * cs > MAX_REFTABLE_BYTES {
                return Err(too_large());
            }
            let blocks = self.blocks_missing_after(m, area, table_clusters);
            let end = area + table_clusters + blocks;
            let want = end.div_ceil(per_block) as usize;
            if want <= entries {
                break (table_clusters, blocks);
            }
            entries = want.max(entries * 2);
        };
        if table_clusters * cs > MAX_REFTABLE_BYTES {
            return Err(too_large());
        }
        Ok(ReftableGrowth {
            area,
            table_clusters,
            blocks,
        })
    }

    /// Refcount blocks for the area, placed after a table of `table_clusters` at `area`:
    /// enough to count the table, themselves, and anything up to their end not yet
    /// covered.
    fn blocks_missing_after(&self, m: &Meta, area: u64, table_clusters: u64) -> u64 {
        let per_block = 1u64 << self.refblock_bits();
        let old = m.reftable.len();
        let mut blocks = 0u64;
        loop {
            let end = area + table_clusters + blocks;
            let first = area / per_block;
            let last = (end - 1) / per_block;
            let missing = (first..=last)
                .filter(|&b| b as usize >= old || m.reftable[b as usize] & OFFSET_MASK == 0)
                .count() as u64;
            if missing == blocks {
                return blocks;
            }
            blocks = missing;
        }
    }

    /// Writes the grown table's new refcount blocks and the table itself, then switches
    /// the header to it, each durable before the next: the new table.
    async fn write_grown_reftable(&self, m: &Meta, g: &ReftableGrowth) -> io::Result<Vec<u64>> {
        let cs = self.cluster_size;
        let per_block = 1u64 << self.refblock_bits();
        let (area, table_clusters) = (g.area, g.table_clusters);
        let end = g.end();
        let mut table = m.reftable.clone();
        table.resize((table_clusters * cs / 8) as usize, 0);
        // The new blocks, in order after the table, each counting the area's clusters in
        // its range.
        let rc = self.refcounts();
        let mut next = area + table_clusters;
        self.ev(DebugEvent::RefblockAllocWriteBlocks);
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
        self.ev(DebugEvent::RefblockAllocWriteTable);
        self.file_write(area * cs, &bytes).await?;
        self.file.driver().flush().await?;
        self.ev(DebugEvent::RefblockAllocSwitchTable);
        let mut header = [0u8; 12];
        header[..8].copy_from_slice(&(area * cs).to_be_bytes());
        header[8..].copy_from_slice(&(table_clusters as u32).to_be_bytes());
        self.file_write(field::REFCOUNT_TABLE, &header).await?;
        self.file.driver().flush().await?;
        tracing::debug!(
            "qcow2: refcount table grew from {} to {} entries at {:#x}",
            m.reftable.len(),
            table.len(),
            area * cs
        );
        Ok(table)
    }

    /// Makes the new `table`, on disk and named by the header, the one in use: its
    /// clusters and blocks become metadata, and the old table's clusters, referenced by
    /// nothing durable now, are freed at once.
    async fn adopt_grown_reftable(
        &self,
        m: &mut Meta,
        g: &ReftableGrowth,
        table: Vec<u64>,
    ) -> io::Result<()> {
        let cs = self.cluster_size;
        let (area, table_clusters, blocks) = (g.area, g.table_clusters, g.blocks);
        let end = g.end();
        let old = m.reftable.len();
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

    /// `n` free clusters in a row (refcount 1 each), past everything in use, as QEMU's
    /// `alloc_clusters_noref` then `update_refcount`: the run is reserved first, so the
    /// refcount blocks its ranges lack are allocated after it, not inside it.
    pub(super) async fn alloc_contiguous(&self, m: &mut Meta, n: u64) -> io::Result<u64> {
        self.ev(DebugEvent::ClusterAlloc);
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

    /// The refcount of host cluster number `c` (0 where no refcount block counts it).
    pub(super) async fn refcount_of(&self, m: &mut Meta, c: u64) -> io::Result<u64> {
        let bits = self.refblock_bits();
        let rb_off = m
            .reftable
            .get((c >> bits) as usize)
            .map_or(0, |e| e & OFFSET_MASK);
        if rb_off == 0 {
            return Ok(0);
        }
        self.load_refblock(m, rb_off).await?;
        let block = m.refblocks.get(rb_off).expect("just loaded");
        Ok(self
            .refcounts()
            .get(block, (c & ((1 << bits) - 1)) as usize))
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
        // QEMU's update_refcount: alloc_refcount_block, then load_refcount_block.
        self.ev(DebugEvent::RefblockAlloc);
        self.ev(DebugEvent::RefblockLoad);
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
        if new == 0 && m.free_byte_offset >> self.cluster_bits == c {
            // Compressed clusters are packed into it no more: it may be handed out whole.
            m.free_byte_offset = 0;
        }
        Ok(new)
    }

    /// The refcount of the host cluster at `host`.
    pub(super) async fn refcount(&self, m: &mut Meta, host: u64) -> io::Result<u64> {
        let bits = self.refblock_bits();
        let c = host >> self.cluster_bits;
        let rb_off = m
            .reftable
            .get((c >> bits) as usize)
            .map_or(0, |e| e & OFFSET_MASK);
        if rb_off == 0 {
            return Ok(0);
        }
        self.load_refblock(m, rb_off).await?;
        let block = m.refblocks.get(rb_off).expect("just loaded");
        Ok(self
            .refcounts()
            .get(block, (c & ((1 << bits) - 1)) as usize))
    }

    /// Queues the host clusters behind a mapping that is being replaced for freeing. A
    /// mapping whose clusters are metadata (the image lies: an L2 entry pointing at a
    /// table) is not freed, as its discard would destroy the table: the image is marked
    /// corrupt and the request fails.
    pub(super) async fn release(&self, m: &mut Meta, old: Mapping) -> io::Result<()> {
        if self.has_data_file() {
            // Data clusters in a data file are not counted (see `data_file`).
            return Ok(());
        }
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
        self.ev(DebugEvent::ClusterFree);
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
}
