//! Block status and allocation depth: what the mapping says about a guest range (data,
//! zeroes, or the backing node's, asked further down), in runs of one kind (of
//! subclusters, with extended L2 entries); from the cached tables alone when they hold the
//! answer, without a future.

use std::io;

use super::driver::{Meta, Qcow2Driver};
use super::read::{Piece, Source};
use super::subcluster::{self, Kind};
use super::table::Mapping;
use crate::block::node::block_node::BlockStatus;

impl Qcow2Driver {
    pub(super) async fn allocation_depth_impl(
        &self,
        offset: u64,
        len: u64,
    ) -> io::Result<(u64, u32)> {
        let (pieces, inflight, backing) = self
            .map_range(offset, len.min(self.cluster_size << self.l2_bits))
            .await?;
        drop(inflight);
        // Everything but an unallocated cluster is this image's (zero clusters too).
        let here = |p: &Piece| !matches!(p.src, Source::Backing | Source::Unmapped);
        let first_here = here(&pieces[0]);
        let run: u64 = pieces
            .iter()
            .take_while(|p| here(p) == first_here)
            .map(|p| p.len)
            .sum();
        if first_here {
            return Ok((run, 1));
        }
        match &backing {
            Some(b) if offset < b.size() => {
                let n = run.min(b.size() - offset);
                let (n, d) = b.driver().allocation_depth(offset, n).await?;
                Ok((n.clamp(1, run), if d == 0 { 0 } else { d + 1 }))
            }
            _ => Ok((run, 0)),
        }
    }

    /// Block status from cached tables, without a future: the first cluster's (or, with
    /// extended L2 entries, subcluster's) kind and the run of the same kind after it
    /// (within one L2 table's reach). None when a table is not cached, the metadata is
    /// busy, or the backing node must answer.
    pub(super) fn block_status_from_cache(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        let mut m = self.meta.try_lock()?;
        let no_backing = !self.has_backing();
        // (allocated, zero) of a subcluster's kind; None for one the backing node answers for.
        let class = |k: Kind| match k {
            Kind::Data | Kind::Compressed => Some((true, false)),
            Kind::Zero => Some((false, true)),
            Kind::Unallocated => no_backing.then_some((false, true)),
        };
        // The kind at `pos` and where its run ends within the cluster.
        let run_at = |m: &mut Meta, pos: u64| -> Option<(Option<(bool, bool)>, u64)> {
            let (map, bitmap) = self.lookup_cached(m, pos)?.ok()?;
            let cstart = self.cluster_start(pos);
            if self.extended_l2 {
                let sc = ((pos - cstart) >> self.subcluster_bits) as u32;
                let (kind, n) = subcluster::run(map, bitmap, sc);
                let next = cstart + (u64::from(sc + n) << self.subcluster_bits);
                return Some((class(kind), next));
            }
            let kind = match map {
                Mapping::Data { .. } | Mapping::Compressed { .. } => Kind::Data,
                Mapping::Zero { .. } => Kind::Zero,
                Mapping::Unallocated => Kind::Unallocated,
            };
            Some((class(kind), cstart + self.cluster_size))
        };
        let (first, mut end) = run_at(&mut m, offset)?;
        let first = first?;
        if first == (true, false) && self.may_ask_data_file() {
            return None;
        }
        let reach = offset + len.min(self.cluster_size << self.l2_bits);
        while end < reach {
            match run_at(&mut m, end) {
                Some((Some(c), next)) if c == first => end = next,
                _ => break,
            }
        }
        Some(BlockStatus {
            len: (end - offset).min(len),
            allocated: first.0,
            zero: first.1,
        })
    }

    pub(super) async fn block_status_impl(&self, offset: u64, len: u64) -> io::Result<BlockStatus> {
        let (pieces, inflight, backing) = self
            .map_range(offset, len.min(self.cluster_size << self.l2_bits))
            .await?;
        drop(inflight);
        let first = pieces[0];
        let class = |s: Source| match s {
            Source::Host(_) | Source::Compressed { .. } => 0,
            Source::Zero | Source::Unmapped => 1,
            Source::Backing => 2,
        };
        let run: u64 = pieces
            .iter()
            .take_while(|p| class(p.src) == class(first.src))
            .map(|p| p.len)
            .sum();
        match first.src {
            Source::Host(h) if self.metadata_preallocated().await => {
                Ok(self.data_file_status(h, first.len).await)
            }
            Source::Host(_) | Source::Compressed { .. } => Ok(BlockStatus {
                len: run,
                allocated: true,
                zero: false,
            }),
            Source::Zero | Source::Unmapped => Ok(BlockStatus {
                len: run,
                allocated: false,
                zero: true,
            }),
            Source::Backing => {
                let b = backing;
                let bsize = b.as_ref().map_or(0, |b| b.size());
                let Some(b) = b.filter(|_| offset < bsize) else {
                    return Ok(BlockStatus {
                        len: run,
                        allocated: false,
                        zero: true,
                    });
                };
                let n = run.min(bsize - offset);
                let mut st = match b.driver().block_status_cached(offset, n) {
                    Some(st) => st,
                    None => b.driver().block_status(offset, n).await?,
                };
                st.len = st.len.clamp(1, n);
                Ok(st)
            }
        }
    }
}
