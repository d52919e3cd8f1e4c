//! Guest clusters mapped through the image's metadata: lookups in the L1 table and the
//! cached L2 tables, L2 entries set (the table allocated, or copied away from a snapshot
//! that shares it, on the way), and the L1 table grown. With them the checks that keep
//! writes off metadata (QEMU's overlap checks, which mark the image corrupt), and the
//! driver's own reads and writes of its file. Allocation is [`super::refcount`]'s,
//! write-back [`super::writeback`]'s.

use std::io;

use super::bytes::decode_be64;
use super::driver::{corrupt, Meta, MetaKind, Qcow2Driver};
use super::header::{field, incompat, MAX_L1_BYTES};
use super::table::{EntryCodec, Mapping, RefcountCodec, COPIED, OFFSET_MASK};
use crate::block::node::debug_event::DebugEvent;
use crate::block::node::stats::Op;
use crate::buf::request_buf;

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
                let bits = self.incompatible | incompat::CORRUPT;
                let _ = self
                    .file_write(field::INCOMPATIBLE, &bits.to_be_bytes())
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

    /// Where the entry of the guest cluster containing `guest` starts in its L2 table's
    /// words (its bitmap follows it when entries are extended).
    pub(super) fn l2_slot(&self, guest: u64) -> usize {
        self.l2_index(guest) << u32::from(self.extended_l2)
    }

    pub(super) fn entries(&self) -> EntryCodec {
        EntryCodec::new(self.cluster_bits, self.version, self.extended_l2)
            .with_data_file(self.has_data_file())
    }

    pub(super) fn refcounts(&self) -> RefcountCodec {
        RefcountCodec::new(self.refcount_order)
    }

    /// Announces debug event `e` on the file (a `blkdebug` node there acts on it).
    pub(super) fn ev(&self, e: DebugEvent) {
        self.file.debug_event(e);
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
        self.ev(DebugEvent::L2Load);
        let buf = self.file_read(l2_off, self.cluster_size as usize).await?;
        m.l2.insert(l2_off, decode_be64(&buf), false);
        Ok(())
    }

    /// What the image says about the guest cluster containing `guest`. With extended L2
    /// entries this is the cluster's mapping only: what its subclusters hold is
    /// [`lookup_entry`](Self::lookup_entry)'s.
    pub(super) async fn lookup(&self, m: &mut Meta, guest: u64) -> io::Result<Mapping> {
        self.lookup_entry(m, guest).await.map(|(map, _)| map)
    }

    /// The guest cluster containing `guest`: its mapping and, with extended L2 entries, its
    /// subcluster bitmap (0 otherwise).
    pub(super) async fn lookup_entry(
        &self,
        m: &mut Meta,
        guest: u64,
    ) -> io::Result<(Mapping, u64)> {
        self.check_not_corrupt()?;
        let l2_off = m.l1[self.l1_index(guest)] & OFFSET_MASK;
        if l2_off == 0 {
            return Ok((Mapping::Unallocated, 0));
        }
        self.load_l2(m, l2_off).await?;
        let table = m.l2.get(l2_off).expect("just loaded");
        let (map, bitmap) = self.decode_slot(table, guest)?;
        if let Some(what) = self.data_mapping_error(map, guest, l2_off) {
            return Err(self.signal_corruption(&what).await);
        }
        Ok((map, bitmap))
    }

    /// The entry of `guest`'s cluster in its L2 table `table`, decoded with its bitmap.
    fn decode_slot(&self, table: &[u64], guest: u64) -> io::Result<(Mapping, u64)> {
        let i = self.l2_slot(guest);
        let bitmap = if self.extended_l2 { table[i + 1] } else { 0 };
        let map = self.entries().decode_pair(table[i], bitmap);
        map.map(|map| (map, bitmap)).map_err(corrupt)
    }

    /// As [`lookup_entry`](Self::lookup_entry), from cached tables only: None when the L2
    /// table is not in the cache.
    pub(super) fn lookup_cached(
        &self,
        m: &mut Meta,
        guest: u64,
    ) -> Option<io::Result<(Mapping, u64)>> {
        let l2_off = m.l1[self.l1_index(guest)] & OFFSET_MASK;
        if l2_off == 0 {
            return Some(Ok((Mapping::Unallocated, 0)));
        }
        let r = self.decode_slot(m.l2.get(l2_off)?, guest);
        match r {
            // The image is corrupt there: the lookup that marks it so answers.
            Ok((map, _)) if self.data_mapping_error(map, guest, l2_off).is_some() => None,
            r => Some(r),
        }
    }

    /// Sets the L2 entry of the guest cluster containing `guest` (with extended entries,
    /// its subcluster bitmap too; `bitmap` is unused otherwise), allocating its L2 table if
    /// it has none.
    pub(super) async fn set_l2(
        &self,
        m: &mut Meta,
        guest: u64,
        entry: u64,
        bitmap: u64,
    ) -> io::Result<()> {
        let l2_off = self.l2_table_to_write(m, guest).await?;
        let i = self.l2_slot(guest);
        let table = m.l2.get_mut(l2_off).expect("just loaded");
        table[i] = entry;
        if self.extended_l2 {
            table[i + 1] = bitmap;
        }
        Ok(())
    }

    /// Sets only the subcluster bitmap of the guest cluster containing `guest` (extended
    /// L2 entries), allocating its L2 table if it has none.
    pub(super) async fn set_l2_bitmap(
        &self,
        m: &mut Meta,
        guest: u64,
        bitmap: u64,
    ) -> io::Result<()> {
        debug_assert!(self.extended_l2);
        let l2_off = self.l2_table_to_write(m, guest).await?;
        let i = self.l2_slot(guest);
        m.l2.get_mut(l2_off).expect("just loaded")[i + 1] = bitmap;
        Ok(())
    }

    /// The L2 table that maps `guest`, cached and the active image's own: allocated if
    /// there is none, copied if an internal snapshot shares it. Its host offset.
    pub(super) async fn l2_table_to_write(&self, m: &mut Meta, guest: u64) -> io::Result<u64> {
        let i1 = self.l1_index(guest);
        let mut l2_off = m.l1[i1] & OFFSET_MASK;
        if l2_off != 0 && m.l1[i1] & COPIED == 0 {
            // Shared with an internal snapshot: the active image gets its own copy (the
            // data clusters' counts stay: both tables still reference them), and the
            // shared table loses one reference once the copy is durable.
            self.ev(DebugEvent::L2AllocCowRead);
            self.load_l2(m, l2_off).await?;
            let entries = m.l2.get(l2_off).expect("just loaded").clone();
            let (table, _) = self.alloc_cluster(m).await?;
            if m.l2.full_of_dirty() {
                self.write_back(m).await?;
            }
            self.ev(DebugEvent::L2AllocWrite);
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
            self.ev(DebugEvent::L2AllocWrite);
            m.l2.insert(table, vec![0; (self.cluster_size / 8) as usize], true);
            m.add_region(self.cluster_bits, table, self.cluster_size, MetaKind::L2);
            m.l1[i1] = table | COPIED;
            m.l1_dirty.insert(i1);
            l2_off = table;
        } else {
            self.load_l2(m, l2_off).await?;
        }
        Ok(l2_off)
    }

    /// Moves the L1 table to a larger one of `need` entries, as QEMU's
    /// `qcow2_grow_l1_table`: the new table is written to new clusters, then the header
    /// names it (size and offset in one write), then the old table's clusters are freed.
    pub(super) async fn grow_l1(&self, m: &mut Meta, need: usize) -> io::Result<()> {
        let cs = self.cluster_size;
        let entries = need.max(m.l1.len() * 3 / 2);
        if entries as u64 * 8 > MAX_L1_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "qcow2: the L1 table would exceed 32 MiB",
            ));
        }
        let n = (entries as u64 * 8).div_ceil(cs);
        // The on-disk L1 must hold every cached change before it is copied.
        self.write_back(m).await?;
        self.sync_if_needed(m).await?;
        self.ev(DebugEvent::L1GrowAllocTable);
        let start = self.alloc_contiguous(m, n).await?;
        let mut l1 = m.l1.clone();
        l1.resize((n * cs / 8) as usize, 0);
        let bytes: Vec<u8> = l1.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.check_overlap(m, start, n * cs, None).await?;
        self.write_back(m).await?;
        self.ev(DebugEvent::L1GrowWriteTable);
        self.file_write(start, &bytes).await?;
        self.file.driver().flush().await?;
        self.ev(DebugEvent::L1GrowActivateTable);
        let mut header = [0u8; 12];
        header[..4].copy_from_slice(&(entries as u32).to_be_bytes());
        header[4..].copy_from_slice(&start.to_be_bytes());
        self.file_write(field::L1, &header).await?;
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
}
