//! The write path. A write whose clusters are all allocated with refcount one goes in
//! place, with the caller's buffer. Any other cluster is allocated under a lock on that
//! guest cluster (concurrent writers of one cluster allocate it once): the old content it
//! does not overwrite is copied over (backing file, compressed data), then the L2 entry
//! points at it. A large write over whole clusters that need new ones allocates them
//! together and writes each host run with one request. `populate` copies the backing
//! chain's content up the same way. With extended L2 entries the same holds subcluster by
//! subcluster: in place only where every subcluster written is allocated, else the
//! subclusters touched are allocated with their rest copied (the second `impl` below).

use std::io;

use stord_aio::sys::now_ns;

use super::driver::{Inflight, Qcow2Driver};
use super::read::Pieces;
use super::subcluster;
use super::table::{old_host, Mapping, COPIED, ZERO};
use crate::block::node::block_node::{BlockDriver, BlockNode};
use crate::block::node::debug_event::DebugEvent;
use crate::block::node::stats::Op;
use crate::buf::{request_buf, Buf};
use crate::iov::IoVec;

/// Clusters a large write overwrites whole and that need new ones: what they mapped
/// before, and the new host clusters, allocated and not mapped yet.
struct WholeClusters {
    olds: Vec<Mapping>,
    hosts: Vec<u64>,
}

impl Qcow2Driver {
    /// Where a write of `[offset, offset + len)` can go in place: one host range, every
    /// cluster allocated with refcount one.
    pub(super) async fn in_place(
        &self,
        offset: u64,
        len: u64,
    ) -> io::Result<Option<(u64, Inflight<'_>)>> {
        let mut m = self.meta.lock().await;
        let mut start = None;
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let cstart = self.cluster_start(pos);
            let next = (cstart + self.cluster_size).min(end);
            let (map, bitmap) = self.lookup_entry(&mut m, pos).await?;
            let Mapping::Data { host, copied: true } = map else {
                return Ok(None);
            };
            // With subclusters, every subcluster written must be allocated already.
            if self.extended_l2 && !self.all_alloc(bitmap, pos - cstart, next - cstart) {
                return Ok(None);
            }
            let h = host + (pos - cstart);
            match start {
                None => start = Some(h),
                Some(s) if s + (pos - offset) == h => {}
                Some(_) => return Ok(None),
            }
            pos = next;
        }
        if let Some(s) = start {
            // An L2 entry pointing at metadata must not turn guest data into tables.
            self.check_data_overlap(&m, s, len).await?;
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
                    self.ev(DebugEvent::CowRead);
                    self.ev(DebugEvent::ReadBackingAio);
                    let mut v = vec![0u8; cs];
                    Self::read_backing(Some(b), cstart, &mut v).await?;
                    Ok(Some(v))
                }
                _ => Ok(None),
            },
            Mapping::Data { host, .. } => {
                self.ev(DebugEvent::CowRead);
                Ok(Some(self.data_read(host, cs).await?.to_vec()))
            }
            Mapping::Compressed { offset, len } => {
                self.ev(DebugEvent::CowRead);
                Ok(Some(self.decompress(offset, len).await?))
            }
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
        debug_assert!(
            !self.extended_l2,
            "subclusters are written by write_subclusters"
        );
        let cs = self.cluster_size;
        // A preallocated zero cluster of ours is reused; anything else gets a new one.
        let (host, fresh) = match old {
            Mapping::Zero {
                host: Some(h),
                copied: true,
            } => (h, false),
            _ => {
                let mut m = self.meta.lock().await;
                self.alloc_data(&mut m, cstart).await?
            }
        };
        let r = async {
            if within == 0 && data.len() as u64 == cs {
                return self.data_write(host, data).await;
            }
            match self.cluster_content(cstart, old).await? {
                // Untouched bytes of a fresh cluster already read as zeroes (not so
                // through a cipher: an encrypted image's get encrypted zeroes).
                None if fresh && self.crypt.is_none() => {
                    // QEMU zeroes the new cluster's space here (handle_alloc_space);
                    // fresh space reads as zeroes already.
                    self.ev(DebugEvent::ClusterAllocSpace);
                    self.data_write(host + within, data).await
                }
                None => {
                    self.ev(DebugEvent::ClusterAllocSpace);
                    let mut c = vec![0u8; cs as usize];
                    c[within as usize..within as usize + data.len()].copy_from_slice(data);
                    self.data_write(host, &c).await
                }
                content => {
                    let mut c = content.unwrap_or_else(|| vec![0u8; cs as usize]);
                    c[within as usize..within as usize + data.len()].copy_from_slice(data);
                    self.ev(DebugEvent::CowWrite);
                    self.data_write(host, &c).await
                }
            }
        }
        .await;
        let mut m = self.meta.lock().await;
        if let Err(e) = r {
            if host != old_host(old) {
                // Nothing references the new cluster: give it back now.
                self.give_back(&mut m, host).await?;
            }
            return Err(e);
        }
        self.set_l2(&mut m, cstart, host | COPIED, 0).await?;
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
        if self.extended_l2 {
            // As write_subclusters: the L2 table before the data clusters.
            self.l2_table_to_write(&mut m, pos).await?;
        }
        let mut hosts = Vec::with_capacity(olds.len());
        for k in 0..olds.len() as u64 {
            match self.alloc_data(&mut m, pos + k * cs).await {
                Ok((h, _)) => hosts.push(h),
                Err(e) => {
                    for h in hosts {
                        self.give_back(&mut m, h).await?;
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
                self.give_back(&mut m, h).await?;
            }
            return Err(e);
        }
        let next = pos + plan.olds.len() as u64 * cs;
        for (k, (old, host)) in plan.olds.into_iter().zip(plan.hosts).enumerate() {
            // Written whole: with subclusters, every one allocated.
            let guest = pos + k as u64 * cs;
            self.set_l2(&mut m, guest, host | COPIED, subcluster::ALL_ALLOC)
                .await?;
            self.release(&mut m, old).await?;
        }
        Ok(next)
    }

    /// A write the in-place path did not take, with the request's own buffer: when it
    /// covers whole clusters that all get new ones in one host run (a large write into
    /// an empty image, a mirror's or a backup's target), the buffer goes to the file as it
    /// is; otherwise as [`write_slow`](Self::write_slow), which copies what it writes. An
    /// encrypted image's writes come here in a buffer of the driver's, encrypted in place.
    pub(super) async fn write_owned(
        &self,
        offset: u64,
        buf: Buf,
        fua: bool,
    ) -> (io::Result<()>, Buf) {
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
        let (written, buf) = self.data_write_buf(plan.hosts[0], buf).await;
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
            r = self.data_write(hosts[i], bytes).await;
            i = j;
        }
        self.settle_whole_clusters(pos, plan, r).await
    }

    pub(super) async fn write_slow(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
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
    pub(super) async fn write_locked(
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
            let (old, bitmap) = {
                let mut m = self.meta.lock().await;
                let (old, bitmap) = self.lookup_entry(&mut m, pos).await?;
                if let Mapping::Data { host, .. }
                | Mapping::Zero {
                    host: Some(host), ..
                } = old
                {
                    self.check_data_overlap(&m, host, self.cluster_size).await?;
                }
                (old, bitmap)
            };
            if self.extended_l2 {
                allocated |= self
                    .write_subclusters(cstart, pos - cstart, chunk, (old, bitmap))
                    .await?;
                pos = chunk_end;
                continue;
            }
            match old {
                Mapping::Data { host, copied: true } => {
                    self.data_write(host + (pos - cstart), chunk).await?;
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
                self.data_node().driver().flush().await?;
            }
        }
        Ok(())
    }

    pub(super) async fn write_impl(
        &self,
        offset: u64,
        buf: Buf,
        fua: bool,
    ) -> (io::Result<()>, Buf) {
        if self.crypt.is_some() {
            let r = self
                .crypt_write((offset, buf.len()), fua, |b| b.copy_from_slice(&buf))
                .await;
            return (r, buf);
        }
        match self.in_place(offset, buf.len() as u64).await {
            Err(e) => return (Err(e), buf),
            Ok(Some((host, inflight))) => {
                let (start, len, node) = (now_ns(), buf.len() as u64, self.data_node());
                node.note_write(host, len);
                self.ev(DebugEvent::WriteAio);
                let r = node.driver().write(host, buf, fua).await;
                drop(inflight);
                node.count_direct(Op::Write, start, host + len, len, r.0.is_ok());
                return r;
            }
            Ok(None) => {}
        }
        self.write_owned(offset, buf, fua).await
    }

    /// [`write_impl`](Self::write_impl) from the caller's I/O vector: passed to the file as
    /// it is when the write goes in place, else copied into a buffer for the allocating path.
    pub(super) async fn writev_impl(
        &self,
        offset: u64,
        iov: IoVec,
        fua: bool,
    ) -> (io::Result<()>, IoVec) {
        if self.crypt.is_some() {
            let r = self
                .crypt_write((offset, iov.len()), fua, |b| iov.copy_out(0, b))
                .await;
            return (r, iov);
        }
        match self.in_place(offset, iov.len() as u64).await {
            Err(e) => return (Err(e), iov),
            Ok(Some((host, inflight))) => {
                let (start, len, node) = (now_ns(), iov.len() as u64, self.data_node());
                node.note_write(host, len);
                self.ev(DebugEvent::WriteAio);
                let r = node.driver().writev(host, iov, fua).await;
                drop(inflight);
                node.count_direct(Op::Write, start, host + len, len, r.0.is_ok());
                return r;
            }
            Ok(None) => {}
        }
        crate::buf::count_bounce();
        let mut buf = request_buf(iov.len());
        iov.copy_out(0, &mut buf);
        let (r, _) = self.write_owned(offset, buf, fua).await;
        (r, iov)
    }

    /// See [`BlockDriver::populate`]: each run of clusters this image does not allocate
    /// gets the backing chain's content (clusters of zeroes become zero clusters), under
    /// the allocation lock so a guest write to the same clusters waits or wins.
    pub(super) async fn populate_impl(&self, offset: u64, len: u64) -> io::Result<()> {
        let cs = self.cluster_size;
        let start = self.cluster_start(offset);
        let end = self.cluster_start(offset + len + cs - 1);
        let _lock = self.alloc_locks.lock(start, end).await;
        let Some(backing) = self.backing() else {
            return Ok(());
        };
        if self.extended_l2 {
            // Whole subclusters (QEMU's copy-on-read rounds to them), within the image.
            let sc = 1u64 << self.subcluster_bits;
            let stop = ((offset + len).div_ceil(sc) * sc).min(self.size());
            return self
                .populate_subclusters((offset & !(sc - 1), stop), &backing)
                .await;
        }
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
                    self.set_l2(&mut m, p, ZERO, 0).await?;
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
}

/// Writes with extended L2 entries (subclusters): as QEMU's handle_copied, handle_alloc and
/// calculate_l2_meta, a write allocates only the subclusters it touches, copying from the
/// old content just the parts of them it does not overwrite; a cluster that must be
/// replaced (unallocated, compressed, shared with a snapshot) takes every allocated
/// subcluster of the old one along.
impl Qcow2Driver {
    /// Writes `data` at `within` bytes into the guest cluster at `cstart`, which `old`
    /// maps (with its subcluster bitmap), under the caller's allocation lock: in place
    /// where the cluster is ours and every subcluster written is allocated; otherwise into
    /// this cluster or a new one with the copy-on-write around it, and then the entry
    /// changed. Whether the metadata changed.
    pub(super) async fn write_subclusters(
        &self,
        cstart: u64,
        within: u64,
        data: &[u8],
        (old, bitmap): (Mapping, u64),
    ) -> io::Result<bool> {
        let sb = self.subcluster_bits;
        let (from, to) = (within, within + data.len() as u64);
        let keep = matches!(old, Mapping::Data { copied: true, .. });
        if keep && self.all_alloc(bitmap, from, to) {
            self.data_write(old_host(old) + from, data).await?;
            return Ok(false);
        }
        let span = subcluster::cow_span(old, bitmap, keep, (from, to), sb);
        let host = if keep {
            old_host(old)
        } else {
            // The L2 table first, then the data cluster, as QEMU allocates them (the same
            // writes give the same layout).
            let mut m = self.meta.lock().await;
            self.l2_table_to_write(&mut m, cstart).await?;
            self.alloc_data(&mut m, cstart).await?.0
        };
        let r = self
            .write_with_cow(cstart, host, span, (from, data), (old, bitmap))
            .await;
        let mut m = self.meta.lock().await;
        if let Err(e) = r {
            if !keep {
                // Nothing references the new cluster: give it back now.
                self.give_back(&mut m, host).await?;
            }
            return Err(e);
        }
        let new_bitmap = subcluster::written(bitmap, span, sb);
        self.set_l2(&mut m, cstart, host | COPIED, new_bitmap)
            .await?;
        if !keep {
            self.release(&mut m, old).await?;
        }
        Ok(true)
    }

    /// Whether `bitmap` has every subcluster of `[from, to)` (bytes into the cluster)
    /// allocated.
    fn all_alloc(&self, bitmap: u64, from: u64, to: u64) -> bool {
        let sb = self.subcluster_bits;
        subcluster::all_alloc(bitmap, (from >> sb) as u32, ((to - 1) >> sb) as u32)
    }

    /// Writes `[start, end)` of the host cluster at `host` for the guest cluster at
    /// `cstart`: `data` at `from`, and around it the guest cluster's old content as `old`
    /// maps it (the backing file's, zeroes, the old host cluster's or the compressed
    /// data), in one request.
    async fn write_with_cow(
        &self,
        cstart: u64,
        host: u64,
        (start, end): (u64, u64),
        (from, data): (u64, &[u8]),
        (old, bitmap): (Mapping, u64),
    ) -> io::Result<()> {
        let to = from + data.len() as u64;
        let mut buf = request_buf((end - start) as usize);
        let backing = self.backing();
        if start < from || to < end {
            self.ev(DebugEvent::CowRead);
        }
        for (a, b) in [(start, from), (to, end)] {
            if a >= b {
                continue;
            }
            let mut pieces = Pieces::new();
            let range = (cstart + a, b - a);
            self.subcluster_pieces(&mut pieces, range, old, bitmap, backing.is_some());
            let dst = &mut buf[(a - start) as usize..(b - start) as usize];
            self.read_pieces(cstart + a, &pieces, backing.as_ref(), dst)
                .await?;
        }
        buf[(from - start) as usize..(to - start) as usize].copy_from_slice(data);
        if start < from || to < end {
            self.ev(DebugEvent::CowWrite);
        }
        self.data_write_buf(host + start, buf).await.0
    }

    /// [`populate_impl`](Self::populate_impl) with subclusters, over `[start, end)`
    /// (subcluster-aligned, `end` unless it is the image's end; the caller holds its
    /// clusters): each run of subclusters this image leaves to the backing chain gets its
    /// content, subclusters of zeroes made zero subclusters (where QEMU's copy-on-read
    /// looks at a whole run at once), the others written as a guest write would.
    async fn populate_subclusters(
        &self,
        (start, end): (u64, u64),
        backing: &std::sync::Arc<BlockNode>,
    ) -> io::Result<()> {
        let sc = 1u64 << self.subcluster_bits;
        let mut pos = start;
        while pos < end {
            let (run_end, unallocated) = self.subcluster_run(pos, end).await?;
            if !unallocated {
                pos = run_end;
                continue;
            }
            let mut data = vec![0u8; (run_end - pos) as usize];
            Self::read_backing(Some(backing), pos, &mut data).await?;
            let zero_at = |p: u64| {
                let i = (p - pos) as usize;
                data[i..(i + sc as usize).min(data.len())]
                    .iter()
                    .all(|&b| b == 0)
            };
            let mut p = pos;
            while p < run_end {
                let zero = zero_at(p);
                let mut q = p + sc;
                while q < run_end && zero_at(q) == zero {
                    q += sc;
                }
                let q = q.min(run_end);
                if zero {
                    self.zero_subclusters_locked((p, q), false).await?;
                } else {
                    let bytes = &data[(p - pos) as usize..(q - pos) as usize];
                    self.write_locked(p, bytes, false, true).await?;
                }
                p = q;
            }
            pos = run_end;
        }
        Ok(())
    }

    /// From `pos` (subcluster-aligned) to at most `end`: where the run of subclusters that
    /// are all unallocated here, or all not, ends, and which it is.
    async fn subcluster_run(&self, pos: u64, end: u64) -> io::Result<(u64, bool)> {
        let mut m = self.meta.lock().await;
        let sb = self.subcluster_bits;
        let mut p = pos;
        let mut first = None;
        while p < end {
            let cstart = self.cluster_start(p);
            let (map, bitmap) = self.lookup_entry(&mut m, p).await?;
            let (kind, n) = subcluster::run(map, bitmap, ((p - cstart) >> sb) as u32);
            let unallocated = kind == subcluster::Kind::Unallocated;
            if *first.get_or_insert(unallocated) != unallocated {
                break;
            }
            p = cstart + (u64::from(((p - cstart) >> sb) as u32 + n) << sb);
        }
        Ok((p.min(end), first.unwrap_or(false)))
    }
}
