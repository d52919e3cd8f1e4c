//! Discard and write-zeroes: whole clusters unmapped, or made zero clusters (version 3),
//! their host clusters freed; partial clusters, and every cluster on version 2, get
//! zeroes written.

use std::io;

use super::driver::Qcow2Driver;
use super::table::{old_host, Mapping, COPIED, OFFSET_MASK, ZERO};

impl Qcow2Driver {
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

    pub(super) async fn discard_impl(&self, offset: u64, len: u64) -> io::Result<()> {
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

    pub(super) async fn write_zeroes_impl(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> io::Result<()> {
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
}
