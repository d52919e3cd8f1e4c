//! Discard and write-zeroes: whole clusters unmapped, or made zero clusters (version 3),
//! their host clusters freed; partial clusters, and every cluster on version 2, get
//! zeroes written. With extended L2 entries write-zeroes works on subclusters, as QEMU's
//! qcow2_co_pwrite_zeroes and qcow2_subcluster_zeroize do: whole subclusters become zero
//! subclusters, a partial one too where the rest of it reads as zeroes already and it
//! holds no data, and only what remains gets zeroes written; discard stays per cluster.

use std::io;

use super::driver::Qcow2Driver;
use super::subcluster::{self, Kind, ALL_ZERO};
use super::table::{encode_host, old_host, Mapping, COPIED, OFFSET_MASK, ZERO};
use crate::block::node::block_node::BlockDriver;

impl Qcow2Driver {
    /// Gives the whole clusters of `[start, end)` the L2 entry (and, with extended
    /// entries, the bitmap) `entry_for(old mapping, old bitmap)` picks (None: leave the
    /// cluster as it is), freeing the host clusters the new entry no longer holds.
    async fn unmap_clusters(
        &self,
        start: u64,
        end: u64,
        entry_for: impl Fn(Mapping, u64) -> Option<(u64, u64)>,
    ) -> io::Result<()> {
        if start >= end {
            return Ok(());
        }
        let _lock = self.alloc_locks.lock(start, end).await;
        self.unmap_clusters_locked(start, end, entry_for).await
    }

    /// [`unmap_clusters`](Self::unmap_clusters) with the guest range held.
    async fn unmap_clusters_locked(
        &self,
        start: u64,
        end: u64,
        entry_for: impl Fn(Mapping, u64) -> Option<(u64, u64)>,
    ) -> io::Result<()> {
        let mut pos = start;
        while pos < end {
            let mut m = self.meta.lock().await;
            let (old, bitmap) = self.lookup_entry(&mut m, pos).await?;
            if let Some((entry, new_bitmap)) = entry_for(old, bitmap) {
                self.set_l2(&mut m, pos, entry, new_bitmap).await?;
                if entry & OFFSET_MASK != old_host(old) || old_host(old) == 0 {
                    self.release(&mut m, old).await?;
                }
                drop(m);
                self.discard_freed_data(pos, old, entry).await;
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
        if self.extended_l2 {
            // QEMU's discard_in_l2_slice: no host cluster, every subcluster zero, unless
            // the cluster reads as zeroes without that (no backing file, nothing here).
            return self
                .unmap_clusters(start, end, |old, bitmap| match old {
                    Mapping::Unallocated if !backing || bitmap == ALL_ZERO => None,
                    _ => Some((0, ALL_ZERO)),
                })
                .await;
        }
        let v3 = self.version >= 3;
        self.unmap_clusters(start, end, |old, _| match old {
            Mapping::Unallocated if !backing => None,
            Mapping::Zero { host: None, .. } => None,
            // As QEMU's discard_in_l2_slice (a guest discard is not a full one): a zero
            // cluster on version 3, so no backing file's data shows through either.
            _ if v3 => Some((ZERO, 0)),
            // Version 2 cannot say "zero" over a backing file: keep the data.
            _ if backing => None,
            _ => Some((0, 0)),
        })
        .await
    }

    pub(super) async fn write_zeroes_impl(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> io::Result<()> {
        if self.extended_l2 {
            return self.write_zeroes_subclusters(offset, len, may_unmap).await;
        }
        let end = offset + len;
        let mut start = self.cluster_start(offset + self.cluster_size - 1);
        let mut whole_end = self.cluster_start(end);
        if self.version < 3 || whole_end <= start {
            start = end;
            whole_end = end;
        }
        // Partial clusters (and everything on version 2) get zeroes written.
        for (a, b) in [(offset, start.min(end)), (whole_end.max(start), end)] {
            self.write_zero_bytes(a, b).await?;
        }
        self.zero_raw_data(start, whole_end - start, may_unmap)
            .await?;
        self.unmap_clusters(start, whole_end, |old, _| match old {
            Mapping::Zero { .. } if !may_unmap => None,
            Mapping::Data { host, copied: true } if !may_unmap => Some((host | COPIED | ZERO, 0)),
            _ => Some((ZERO, 0)),
        })
        .await
    }

    /// Writes zeroes over `[a, b)` as guest data, a MiB at a time.
    async fn write_zero_bytes(&self, a: u64, b: u64) -> io::Result<()> {
        let mut pos = a;
        while pos < b {
            let n = (b - pos).min(1 << 20);
            let z = vec![0u8; n as usize];
            self.write_slow(pos, &z, false).await?;
            pos += n;
        }
        Ok(())
    }

    /// Write-zeroes with extended L2 entries, split as QEMU's block layer splits it for a
    /// subcluster's alignment: a partial subcluster at either end on its own, and the
    /// subclusters between them (to the image's end if the range reaches it) together.
    async fn write_zeroes_subclusters(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> io::Result<()> {
        let sc = 1u64 << self.subcluster_bits;
        let (end, size) = (offset + len, self.size());
        let mut pos = offset;
        while pos < end {
            let sc_end = (pos & !(sc - 1)) + sc;
            if pos & (sc - 1) != 0 || (end < sc_end && end != size) {
                let stop = end.min(sc_end);
                self.zero_partial_subcluster(pos, stop, may_unmap).await?;
                pos = stop;
                continue;
            }
            let stop = if end == size { end } else { end & !(sc - 1) };
            let span = (
                self.cluster_start(pos),
                self.cluster_start(stop + self.cluster_size - 1),
            );
            let _lock = self.alloc_locks.lock(span.0, span.1).await;
            self.zero_subclusters_locked((pos, stop), may_unmap).await?;
            pos = stop;
        }
        Ok(())
    }

    /// `[pos, stop)`, part of one subcluster: the whole subcluster made zero if the rest of
    /// it reads as zeroes and it holds no data (QEMU's qcow2_co_pwrite_zeroes), else zeroes
    /// written over the part.
    async fn zero_partial_subcluster(
        &self,
        pos: u64,
        stop: u64,
        may_unmap: bool,
    ) -> io::Result<()> {
        let sc = 1u64 << self.subcluster_bits;
        let (start, size) = (pos & !(sc - 1), self.size());
        // Nothing past the image's end to keep.
        let tail_end = if stop == size { stop } else { start + sc };
        let cstart = self.cluster_start(start);
        let _lock = self
            .alloc_locks
            .lock(cstart, cstart + self.cluster_size)
            .await;
        let quiet =
            self.reads_as_zeroes(start, pos).await? && self.reads_as_zeroes(stop, tail_end).await?;
        if quiet {
            let (map, bitmap) = {
                let mut m = self.meta.lock().await;
                self.lookup_entry(&mut m, start).await?
            };
            let sc_index = ((start - cstart) >> self.subcluster_bits) as u32;
            if let (Kind::Unallocated | Kind::Zero, _) = subcluster::run(map, bitmap, sc_index) {
                return self
                    .zero_subclusters_locked((start, start + sc), may_unmap)
                    .await;
            }
        }
        let z = vec![0u8; (stop - pos) as usize];
        self.write_locked(pos, &z, false, false).await
    }

    /// Whether `[a, b)` (cut at the image's end) reads as zeroes through the backing chain,
    /// as block status tells (QEMU's is_zero: no data is read).
    async fn reads_as_zeroes(&self, a: u64, b: u64) -> io::Result<bool> {
        let (mut pos, b) = (a, b.min(self.size()));
        while pos < b {
            let st = self.block_status_impl(pos, b - pos).await?;
            if !st.zero {
                return Ok(false);
            }
            pos += st.len.max(1);
        }
        Ok(true)
    }

    /// Makes the subclusters of `[start, end)` zero (`start` subcluster-aligned, `end` too
    /// unless it is the image's end), with the clusters held (QEMU's
    /// qcow2_subcluster_zeroize): whole clusters (and the last one, partial, at the
    /// image's end) as QEMU's zero_in_l2_slice, the subclusters of the others as its
    /// zero_l2_subclusters.
    pub(super) async fn zero_subclusters_locked(
        &self,
        (start, end): (u64, u64),
        may_unmap: bool,
    ) -> io::Result<()> {
        let (cs, size) = (self.cluster_size, self.size());
        self.zero_raw_data(start, end - start, may_unmap).await?;
        let mut pos = start;
        while pos < end {
            let cstart = self.cluster_start(pos);
            let stop = (cstart + cs).min(end);
            if pos == cstart && (stop == cstart + cs || end >= size) {
                self.unmap_clusters_locked(cstart, cstart + cs, |old, bitmap| {
                    let unmap = match old {
                        Mapping::Compressed { .. } => true,
                        Mapping::Data { .. } => may_unmap,
                        _ => false,
                    };
                    let entry = if unmap { 0 } else { encode_host(old) };
                    (unmap || bitmap != ALL_ZERO).then_some((entry, ALL_ZERO))
                })
                .await?;
            } else {
                self.zero_some_subclusters(pos, stop).await?;
            }
            pos = stop;
        }
        Ok(())
    }

    /// Makes the subclusters of `[pos, stop)`, part of one cluster, zero (a compressed
    /// cluster, which has no subclusters, gets zeroes written there instead).
    async fn zero_some_subclusters(&self, pos: u64, stop: u64) -> io::Result<()> {
        let sb = self.subcluster_bits;
        let cstart = self.cluster_start(pos);
        let from = ((pos - cstart) >> sb) as u32;
        let to = ((stop - cstart).div_ceil(1 << sb)) as u32;
        let mut m = self.meta.lock().await;
        let (map, bitmap) = self.lookup_entry(&mut m, pos).await?;
        if let Mapping::Compressed { .. } = map {
            drop(m);
            let z = vec![0u8; (stop - pos) as usize];
            return self.write_locked(pos, &z, false, false).await;
        }
        let new = subcluster::zeroed(bitmap, from, to);
        if new != bitmap {
            self.set_l2_bitmap(&mut m, pos, new).await?;
        }
        Ok(())
    }
}
