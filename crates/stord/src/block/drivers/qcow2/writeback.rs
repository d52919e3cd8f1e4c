//! Write-back of the cached metadata, and the flush that drives it.
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
//! and until no request that looked up a mapping before then is still doing I/O
//! (`release` queues them, `apply_frees` drops their counts: [`super::refcount`]).

use std::collections::BTreeSet;
use std::io;

use super::driver::{Meta, MetaKind, Qcow2Driver};
use crate::block::node::debug_event::DebugEvent;

/// Entries written per L1 / refcount table write-back unit (one 4 KiB page).
const PAGE_ENTRIES: usize = 512;

impl Qcow2Driver {
    /// Writes every dirty table back in order, makes it durable, then applies the frees
    /// that waited for it.
    pub(super) async fn flush_impl(&self) -> io::Result<()> {
        // Guest data in a data file is durable before the tables that point at it.
        self.flush_data_file().await?;
        self.ev(DebugEvent::FlushToOs);
        let mut m = self.meta.lock().await;
        self.write_back(&mut m).await?;
        self.ev(DebugEvent::FlushToDisk);
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
            self.ev(DebugEvent::RefblockUpdatePart);
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
                self.ev(DebugEvent::L2Update);
                self.file_write(off, &bytes).await?;
                m.l2.mark_clean(off);
            }
            m.needs_sync = true;
        }
        if !m.l1_dirty.is_empty() {
            self.sync_if_needed(m).await?;
            let pages: BTreeSet<usize> = m.l1_dirty.iter().map(|i| i / PAGE_ENTRIES).collect();
            for p in pages {
                self.ev(DebugEvent::L1Update);
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
