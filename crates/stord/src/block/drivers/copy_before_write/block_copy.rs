//! Copy-before-write: the mechanism under a backup (QEMU's block-copy and its
//! copy-before-write filter). From the moment it is installed, the target is to hold the
//! source's content as it was then. A set of clusters says what is still only in the
//! source; before a write changes one of them its old content is copied to the target,
//! and the backup job copies the rest in the background. Either way a cluster is copied
//! once, under an exclusive hold of its range, and leaves the set only when the copy is
//! on the target.
//!
//! When the target reads through to the source (the fleecing image whose backing node is
//! the source), a reader of the target holds the clusters it reads shared while any of
//! them is still to be copied: a copy waits for readers that may have found the target
//! empty there, so none of them reads the source after the write that follows the copy.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::block::node::block_node::BlockNode;
use crate::block::node::future::BoxFut;
use crate::block::node::hook::{Hold, NodeHook};
use crate::block::node::range_lock::RangeLocks;
use crate::buf::request_buf;

/// The most one copy moves at a time.
const CHUNK: u64 = 1 << 20;

/// A failed copy: the error, and whether reading the source failed (else writing the
/// target).
#[derive(Debug)]
pub struct CopyError {
    pub error: io::Error,
    pub read: bool,
}

/// What a copy does with a range the source has nothing of its own in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unallocated {
    /// Copies what reads there (zeroes or the backing chain's data).
    Copy,
    /// Leaves it: the target's own backing chain has it (`sync=top`).
    Skip,
}

/// A source, its target, and what is still to be copied.
pub struct CopyBeforeWrite {
    pub source: Arc<BlockNode>,
    pub target: Arc<BlockNode>,
    /// Bytes per bit of `todo`.
    cluster: u64,
    size: u64,
    unallocated: Unallocated,
    /// One bit per cluster whose point-in-time content is only in the source.
    todo: Mutex<Vec<u64>>,
    /// Copies hold their clusters exclusively, point-in-time readers shared.
    locks: RangeLocks,
    /// Bytes copied (or zeroed) on the target.
    copied: AtomicU64,
    /// One bit per cluster the point-in-time view still offers (a discard through
    /// `snapshot-access` gives clusters up).
    access: Mutex<Vec<u64>>,
    /// A copy failed under `on-cbw-error=break-snapshot`: the view reads nothing now.
    broken: AtomicBool,
    /// A failed copy breaks the view (set while the copy still holds its clusters, so no
    /// reader waiting behind it reads the source after the write it lets through).
    break_on_error: AtomicBool,
    /// Data goes to the target compressed (backup's `compress`), a cluster at a time.
    compress: AtomicBool,
}

impl CopyBeforeWrite {
    /// Nothing to copy yet; `cluster` is a power of two.
    pub fn new(
        source: Arc<BlockNode>,
        target: Arc<BlockNode>,
        cluster: u64,
        unallocated: Unallocated,
    ) -> Self {
        let size = source.size();
        let words = size.div_ceil(cluster).div_ceil(64) as usize;
        CopyBeforeWrite {
            source,
            target,
            cluster,
            size,
            unallocated,
            todo: Mutex::new(vec![0; words]),
            locks: RangeLocks::default(),
            copied: AtomicU64::new(0),
            access: Mutex::new(vec![u64::MAX; words]),
            broken: AtomicBool::new(false),
            break_on_error: AtomicBool::new(false),
            compress: AtomicBool::new(false),
        }
    }

    /// Backup's `compress`: data reaches the target as compressed writes (QEMU's
    /// block_copy_set_copy_opts with `compress`); set before anything is copied.
    pub fn set_compress(&self) {
        self.compress.store(true, Relaxed);
    }

    /// `on-cbw-error=break-snapshot`: a failed copy loses the view instead of failing
    /// the write.
    pub fn set_break_on_error(&self) {
        self.break_on_error.store(true, Relaxed);
    }

    /// Whether the view was lost.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Relaxed)
    }

    fn accessible(&self, first: u64, end: u64) -> bool {
        let w = self.access.lock().unwrap_or_else(|e| e.into_inner());
        (first..end).all(|c| w[(c / 64) as usize] & (1 << (c % 64)) != 0)
    }

    /// Whether cluster `c` is still to be copied.
    fn pending(&self, c: u64) -> bool {
        self.bits()[(c / 64) as usize] & (1 << (c % 64)) != 0
    }

    /// Reads `[offset, offset + len)` of the point-in-time view (QEMU's snapshot read):
    /// what is still to be copied from the source, held shared so no copy (and no write
    /// after it) runs under the read, the rest from the target. EACCES once the view is
    /// lost or for clusters it gave up.
    pub async fn read_snapshot(&self, offset: u64, len: u64) -> io::Result<crate::buf::Buf> {
        let (first, end) = self.span(offset, len);
        if self.broken.load(Relaxed) || !self.accessible(first, end) {
            return Err(io::Error::from_raw_os_error(libc::EACCES));
        }
        let _held = self
            .locks
            .lock_shared(first * self.cluster, end * self.cluster)
            .await;
        // Again under the hold: a copy that failed, or a discard, may have run before it.
        if self.broken.load(Relaxed) || !self.accessible(first, end) {
            return Err(io::Error::from_raw_os_error(libc::EACCES));
        }
        let mut out = request_buf(len as usize);
        let stop = offset + len;
        let mut o = offset;
        while o < stop {
            let pending = self.pending(o / self.cluster);
            let mut e = ((o / self.cluster + 1) * self.cluster).min(stop);
            while e < stop && self.pending(e / self.cluster) == pending {
                e = ((e / self.cluster + 1) * self.cluster).min(stop);
            }
            let node = if pending { &self.source } else { &self.target };
            let (r, b) = node.read(o, request_buf((e - o) as usize)).await;
            r?;
            out[(o - offset) as usize..(e - offset) as usize].copy_from_slice(&b);
            o = e;
        }
        Ok(out)
    }

    /// The status of the view's first extent at `offset` (at most `len` bytes): the
    /// source's where it is still to be copied, the target's elsewhere.
    pub async fn snapshot_status(
        &self,
        offset: u64,
        len: u64,
    ) -> io::Result<crate::block::node::block_node::BlockStatus> {
        let (first, end) = self.span(offset, len);
        if self.broken.load(Relaxed) || !self.accessible(first, end) {
            return Err(io::Error::from_raw_os_error(libc::EACCES));
        }
        let _held = self
            .locks
            .lock_shared(first * self.cluster, end * self.cluster)
            .await;
        if self.broken.load(Relaxed) || !self.accessible(first, end) {
            return Err(io::Error::from_raw_os_error(libc::EACCES));
        }
        let pending = self.pending(offset / self.cluster);
        let mut e = ((offset / self.cluster + 1) * self.cluster).min(offset + len);
        while e < offset + len && self.pending(e / self.cluster) == pending {
            e = ((e / self.cluster + 1) * self.cluster).min(offset + len);
        }
        let node = if pending { &self.source } else { &self.target };
        node.block_status(offset, e - offset).await
    }

    /// A discard through the view (QEMU's cbw_co_pdiscard_snapshot): the whole clusters
    /// in the range leave it, are not copied any more, and go from the target.
    pub async fn discard_snapshot(&self, offset: u64, len: u64) -> io::Result<()> {
        let first = offset.div_ceil(self.cluster);
        let end = (offset + len) / self.cluster;
        if first >= end {
            return Ok(());
        }
        let _held = self
            .locks
            .lock(first * self.cluster, end * self.cluster)
            .await;
        {
            let mut w = self.access.lock().unwrap_or_else(|e| e.into_inner());
            for c in first..end {
                w[(c / 64) as usize] &= !(1 << (c % 64));
            }
        }
        self.clear(first, end);
        let stop = (end * self.cluster).min(self.size);
        self.target
            .discard(first * self.cluster, stop - first * self.cluster)
            .await
    }

    fn clusters(&self) -> u64 {
        self.size.div_ceil(self.cluster)
    }

    fn bits(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.todo.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes per cluster.
    pub fn cluster(&self) -> u64 {
        self.cluster
    }

    /// Marks `[offset, offset + len)` to be copied.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let first = offset / self.cluster;
        let end = offset
            .saturating_add(len)
            .div_ceil(self.cluster)
            .min(self.clusters());
        let mut w = self.bits();
        for c in first..end {
            w[(c / 64) as usize] |= 1 << (c % 64);
        }
    }

    /// Bytes still to be copied.
    /// Whole clusters, as QEMU counts a backup's progress: a short last cluster counts whole.
    pub fn remaining(&self) -> u64 {
        let n: u64 = self.bits().iter().map(|w| u64::from(w.count_ones())).sum();
        n * self.cluster
    }

    /// Bytes copied so far (by writes and by the job).
    pub fn copied(&self) -> u64 {
        self.copied.load(Relaxed)
    }

    /// The first cluster still to be copied at or after `from` (else from the start).
    pub fn next(&self, from: u64) -> Option<u64> {
        let w = self.bits();
        let n = self.clusters();
        let find = |start: u64| (start..n).find(|&c| w[(c / 64) as usize] & (1 << (c % 64)) != 0);
        find((from / self.cluster).min(n))
            .or_else(|| find(0))
            .map(|c| c * self.cluster)
    }

    /// The ranges still to be copied, in order.
    pub fn uncopied(&self) -> Vec<(u64, u64)> {
        let w = self.bits();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for c in 0..self.clusters() {
            if w[(c / 64) as usize] & (1 << (c % 64)) == 0 {
                continue;
            }
            let (o, l) = (c * self.cluster, self.cluster);
            match out.last_mut() {
                Some((a, b)) if *a + *b == o => *b += l,
                _ => out.push((o, l)),
            }
        }
        out
    }

    /// The first run of clusters to copy in `[first, end)`, as cluster indices.
    fn run(&self, first: u64, end: u64) -> Option<(u64, u64)> {
        let w = self.bits();
        let set = |c: u64| w[(c / 64) as usize] & (1 << (c % 64)) != 0;
        let a = (first..end).find(|&c| set(c))?;
        let b = (a..end).find(|&c| !set(c)).unwrap_or(end);
        Some((a, b))
    }

    fn clear(&self, first: u64, end: u64) {
        let mut w = self.bits();
        for c in first..end {
            w[(c / 64) as usize] &= !(1 << (c % 64));
        }
    }

    /// The clusters covering `[offset, offset + len)`, as indices.
    fn span(&self, offset: u64, len: u64) -> (u64, u64) {
        let end = offset.saturating_add(len).div_ceil(self.cluster);
        (
            (offset / self.cluster).min(self.clusters()),
            end.min(self.clusters()),
        )
    }

    /// Copies what is still to be copied of the clusters covering `[offset, offset + len)`.
    pub async fn copy(&self, offset: u64, len: u64) -> Result<(), CopyError> {
        let (first, end) = self.span(offset, len);
        if self.run(first, end).is_none() {
            return Ok(());
        }
        let _held = self
            .locks
            .lock(first * self.cluster, end * self.cluster)
            .await;
        let mut at = first;
        while let Some((a, b)) = self.run(at, end) {
            let stop = (b * self.cluster).min(self.size);
            self.copy_range(a * self.cluster, stop).await?;
            // The short last cluster counts whole (as remaining() counted it).
            self.copied.fetch_add(b * self.cluster - stop, Relaxed);
            self.clear(a, b);
            at = b;
        }
        Ok(())
    }

    /// Copies `[start, stop)` from the source to the target, a chunk at a time.
    async fn copy_range(&self, start: u64, stop: u64) -> Result<(), CopyError> {
        if self.compress.load(Relaxed) {
            return self.copy_compressed(start, stop).await;
        }
        let read_err = |error| CopyError { error, read: true };
        let write_err = |error| CopyError { error, read: false };
        let mut o = start;
        while o < stop {
            let mut n = CHUNK.min(stop - o);
            if self.unallocated == Unallocated::Skip {
                let (len, depth) = self.source.allocation_depth(o, n).await.map_err(read_err)?;
                n = len.clamp(1, n);
                if depth != 1 {
                    o += n;
                    continue;
                }
            }
            let st = self.source.block_status(o, n).await.map_err(read_err)?;
            n = st.len;
            if st.zero {
                self.target
                    .write_zeroes(o, n, false)
                    .await
                    .map_err(write_err)?;
            } else {
                let (r, buf) = self.source.read(o, request_buf(n as usize)).await;
                r.map_err(read_err)?;
                let (r, _) = self.target.write(o, buf, false).await;
                r.map_err(write_err)?;
            }
            self.copied.fetch_add(n, Relaxed);
            o += n;
        }
        Ok(())
    }
}

impl CopyBeforeWrite {
    /// [`copy_range`](Self::copy_range) with `compress`, as QEMU's block-copy then copies
    /// (COPY_READ_WRITE_CLUSTER): a cluster at a time (`start` is on one; `stop` too, or
    /// the end), one that reads as zeroes throughout written as zeroes, any other read
    /// and written compressed; with `sync=top`, a cluster allocated nowhere in the
    /// source's own image is skipped. Each cluster leaves the set once copied, as each of
    /// QEMU's one-cluster tasks does.
    async fn copy_compressed(&self, start: u64, stop: u64) -> Result<(), CopyError> {
        let read_err = |error| CopyError { error, read: true };
        let write_err = |error| CopyError { error, read: false };
        let mut o = start;
        while o < stop {
            let n = self.cluster.min(stop - o);
            let skip = if self.unallocated == Unallocated::Skip {
                let (len, depth) = self.source.allocation_depth(o, n).await.map_err(read_err)?;
                len >= n && depth != 1
            } else {
                false
            };
            if !skip {
                let st = self.source.block_status(o, n).await.map_err(read_err)?;
                if st.zero && st.len >= n {
                    let r = self.target.write_zeroes(o, n, false).await;
                    r.map_err(write_err)?;
                } else {
                    let (r, buf) = self.source.read(o, request_buf(n as usize)).await;
                    r.map_err(read_err)?;
                    let (r, _) = self.target.write_compressed(o, buf).await;
                    r.map_err(write_err)?;
                }
                self.copied.fetch_add(n, Relaxed);
            }
            // Done: a failure further on must not have it copied again (a compressed write
            // onto a cluster that holds data fails).
            self.clear(o / self.cluster, o / self.cluster + 1);
            o += n;
        }
        Ok(())
    }
}

/// Whether reads of `target` reach `source` (a fleecing image backed by the source).
pub fn reads_through(target: &Arc<BlockNode>, source: &Arc<BlockNode>) -> bool {
    let mut n = target.filtered_or_backing();
    while let Some(b) = n {
        if Arc::ptr_eq(&b, source) {
            return true;
        }
        n = b.filtered_or_backing();
    }
    false
}

/// On the source: a write first has the old content of its clusters copied; a failed
/// copy fails the write (QEMU's `on-cbw-error=break-guest-write`).
pub struct BeforeWrite(pub Arc<CopyBeforeWrite>);

impl NodeHook for BeforeWrite {
    fn before_write(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<Option<Hold<'_>>>> {
        Box::pin(async move {
            self.0.copy(offset, len).await.map_err(|e| e.error)?;
            Ok(None)
        })
    }
}

/// On a target that reads through to the source: a read holds the clusters still to be
/// copied shared, so no copy (and no write after it) runs under it.
pub struct PointInTimeReads(pub Arc<CopyBeforeWrite>);

impl NodeHook for PointInTimeReads {
    fn before_write(&self, _offset: u64, _len: u64) -> BoxFut<'_, io::Result<Option<Hold<'_>>>> {
        Box::pin(std::future::ready(Ok(None)))
    }

    fn before_read(&self, offset: u64, len: u64) -> BoxFut<'_, Option<Hold<'_>>> {
        Box::pin(async move {
            let c = &self.0;
            let (first, end) = c.span(offset, len);
            c.run(first, end)?;
            let held = c
                .locks
                .lock_shared(first * c.cluster, end * c.cluster)
                .await;
            Some(Box::new(held) as Hold<'_>)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::drivers::null::NullDriver;

    fn node(name: &str, size: u64) -> Arc<BlockNode> {
        Arc::new(BlockNode::new(
            name.into(),
            Box::new(NullDriver::new(size, false)),
            false,
            false,
        ))
    }

    #[test]
    fn a_cluster_is_copied_once_and_leaves_the_set() {
        let c = Arc::new(CopyBeforeWrite::new(
            node("s", 1 << 20),
            node("t", 1 << 20),
            65536,
            Unallocated::Copy,
        ));
        c.mark(0, 1 << 20);
        assert_eq!(c.remaining(), 1 << 20);
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let c2 = c.clone();
        ctx.block_on(async move {
            let c = c2;
            c.copy(70000, 10).await.unwrap();
            assert_eq!(c.remaining(), (1 << 20) - 65536);
            assert_eq!(c.copied(), 65536);
            c.copy(65536, 65536).await.unwrap();
            assert_eq!(c.copied(), 65536, "a copied cluster is not copied again");
        });
        assert_eq!(c.next(0), Some(0));
        assert_eq!(c.next(2 * 65536), Some(2 * 65536));
        assert_eq!(c.uncopied(), vec![(0, 65536), (131072, (1 << 20) - 131072)]);
    }

    #[test]
    fn the_last_cluster_stops_at_the_end_of_the_source() {
        let size = 65536 + 4096;
        let c = Arc::new(CopyBeforeWrite::new(
            node("s", size),
            node("t", size),
            65536,
            Unallocated::Copy,
        ));
        c.mark(0, u64::MAX);
        // Progress counts the short last cluster whole, as QEMU's backup reports it.
        assert_eq!(c.remaining(), 2 * 65536);
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let c2 = c.clone();
        // The copy reads and writes the 4 KiB there are (the nodes refuse more).
        ctx.block_on(async move { c2.copy(size - 1, 1).await.unwrap() });
        assert_eq!(c.copied(), 65536);
        assert_eq!(c.remaining(), 65536);
        assert_eq!(c.next(65536), Some(0));
    }
}
