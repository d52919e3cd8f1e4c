//! The read path: a guest range mapped cluster by cluster (subcluster run by subcluster
//! run, with extended L2 entries) to pieces (host data, zeroes, the backing node,
//! compressed clusters), neighbours from one source merged, then read;
//! a range that is one host run goes to the file with the caller's buffer as it is.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use stord_aio::sys::now_ns;

use super::driver::{corrupt, Inflight, Meta, Qcow2Driver};
use super::header::Compression;
use super::subcluster::{self, Kind};
use super::table::Mapping;
use crate::block::node::block_node::BlockNode;
use crate::block::node::debug_event::DebugEvent;
use crate::block::node::stats::Op;
use crate::buf::{request_buf, Buf};
use crate::iov::IoVec;

/// A request's pieces: one, mostly (no allocation then).
pub(super) type Pieces = smallvec::SmallVec<[Piece; 2]>;

/// A range looked up: its pieces, the request counted in flight, and the backing node
/// its backing pieces read from.
pub(super) type Mapped<'a> = (Pieces, Inflight<'a>, Option<Arc<BlockNode>>);

/// Where a piece of a read comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    Host(u64),
    /// A zero cluster.
    Zero,
    /// Unallocated, no backing file: zeroes too, but not this image's.
    Unmapped,
    Backing,
    /// A compressed cluster; the piece starts `within` bytes into it.
    Compressed {
        offset: u64,
        len: u64,
        within: u64,
    },
}

/// A run of the range that reads from one source.
#[derive(Debug, Clone, Copy)]
pub(super) struct Piece {
    pub(super) guest: u64,
    pub(super) len: u64,
    pub(super) src: Source,
}

/// Adds a piece of `len` bytes at `guest` reading from `src` to `pieces`, merged into the
/// last one where it continues it.
fn push_piece(pieces: &mut Pieces, guest: u64, len: u64, src: Source) {
    match (pieces.last_mut(), src) {
        (Some(last), Source::Host(h)) if matches!(last.src, Source::Host(lh) if lh + last.len == h) => {
            last.len += len
        }
        (Some(last), Source::Zero | Source::Unmapped | Source::Backing) if last.src == src => {
            last.len += len
        }
        _ => pieces.push(Piece { guest, len, src }),
    }
}

impl Qcow2Driver {
    /// Maps `[offset, offset + len)` to pieces, merging neighbours from one source.
    /// With them, the backing node the lookup saw where a piece reads from it: the read
    /// goes there even if a job changes the backing link meanwhile.
    pub(super) async fn map_range(&self, offset: u64, len: u64) -> io::Result<Mapped<'_>> {
        let mut m = self.meta.lock().await;
        loop {
            let state = self.backing_state.load(Ordering::Acquire);
            let pieces = self.pieces(&mut m, offset, len, state & 1 != 0).await?;
            let backing = if pieces.iter().any(|p| p.src == Source::Backing) {
                let b = self.backing();
                if self.backing_state.load(Ordering::Acquire) != state {
                    // The link moved while we looked: look again.
                    continue;
                }
                b
            } else {
                None
            };
            let inflight = Inflight::new(&self.io_inflight);
            drop(m);
            return Ok((pieces, inflight, backing));
        }
    }

    pub(super) async fn pieces(
        &self,
        m: &mut Meta,
        offset: u64,
        len: u64,
        has_backing: bool,
    ) -> io::Result<Pieces> {
        let mut pieces = Pieces::new();
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let cstart = self.cluster_start(pos);
            let n = (cstart + self.cluster_size).min(end) - pos;
            let (map, bitmap) = self.lookup_entry(m, pos).await?;
            if self.extended_l2 {
                self.subcluster_pieces(&mut pieces, (pos, n), map, bitmap, has_backing);
            } else {
                let src = Self::source(map, Kind::Data, pos - cstart, has_backing);
                push_piece(&mut pieces, pos, n, src);
            }
            pos += n;
        }
        Ok(pieces)
    }

    /// Where `[pos, pos + n)`, within one cluster mapped by `map` and `bitmap` (extended
    /// L2 entries), reads from: a piece per run of subclusters of one kind, added to
    /// `pieces`.
    pub(super) fn subcluster_pieces(
        &self,
        pieces: &mut Pieces,
        (pos, n): (u64, u64),
        map: Mapping,
        bitmap: u64,
        has_backing: bool,
    ) {
        let cstart = self.cluster_start(pos);
        let sb = self.subcluster_bits;
        let mut p = pos;
        while p < pos + n {
            let sc = ((p - cstart) >> sb) as u32;
            let (kind, count) = subcluster::run(map, bitmap, sc);
            let run_end = (cstart + (u64::from(sc + count) << sb)).min(pos + n);
            let src = Self::source(map, kind, p - cstart, has_backing);
            push_piece(pieces, p, run_end - p, src);
            p = run_end;
        }
    }

    /// Where bytes `within` a cluster mapped by `map` read from, the subcluster there
    /// being of `kind` (always [`Kind::Data`] with standard L2 entries, where the mapping
    /// alone says).
    fn source(map: Mapping, kind: Kind, within: u64, has_backing: bool) -> Source {
        match (map, kind) {
            (Mapping::Compressed { offset, len }, _) => Source::Compressed {
                offset,
                len,
                within,
            },
            (Mapping::Zero { .. }, _) | (_, Kind::Zero) => Source::Zero,
            (Mapping::Data { host, .. }, Kind::Data) => Source::Host(host + within),
            _ if has_backing => Source::Backing,
            _ => Source::Unmapped,
        }
    }

    /// Reads `dst.len()` bytes of the backing node at `guest` (zeroes past its end).
    pub(super) async fn read_backing(
        backing: Option<&Arc<BlockNode>>,
        guest: u64,
        dst: &mut [u8],
    ) -> io::Result<()> {
        let n = match backing {
            Some(b) => (dst.len() as u64).min(b.size().saturating_sub(guest)) as usize,
            None => 0,
        };
        if let (Some(b), true) = (backing, n > 0) {
            let (r, buf) = b.driver().read(guest, request_buf(n)).await;
            r?;
            dst[..n].copy_from_slice(&buf);
        }
        dst[n..].fill(0);
        Ok(())
    }

    /// A compressed cluster, inflated.
    pub(super) async fn decompress(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        if len > 2 * self.cluster_size {
            return Err(corrupt(format!(
                "compressed cluster at {offset:#x} too long"
            )));
        }
        self.ev(DebugEvent::ReadCompressed);
        let data = self.file_read(offset, len as usize).await?;
        let mut out = vec![0u8; self.cluster_size as usize];
        let inflated = match self.compression {
            // A full cluster is enough: QEMU too accepts a stream without its end marker.
            Compression::Zlib => {
                let mut z = flate2::Decompress::new(false);
                let _ = z.decompress(&data, &mut out, flate2::FlushDecompress::Finish);
                z.total_out() == self.cluster_size
            }
            // As QEMU: one cluster's worth from the stream; what follows it in the last
            // sector is padding.
            Compression::Zstd => {
                let mut src: &[u8] = &data;
                match ruzstd::decoding::StreamingDecoder::new(&mut src) {
                    Ok(mut d) => std::io::Read::read_exact(&mut d, &mut out).is_ok(),
                    Err(_) => false,
                }
            }
        };
        if !inflated {
            return Err(corrupt(format!(
                "compressed cluster at {offset:#x} does not inflate to a cluster"
            )));
        }
        Ok(out)
    }

    /// Fills `buf` (the guest range at `offset`) from its pieces.
    pub(super) async fn read_pieces(
        &self,
        offset: u64,
        pieces: &[Piece],
        backing: Option<&Arc<BlockNode>>,
        buf: &mut [u8],
    ) -> io::Result<()> {
        for p in pieces {
            let at = (p.guest - offset) as usize;
            let dst = &mut buf[at..at + p.len as usize];
            match p.src {
                Source::Zero | Source::Unmapped => dst.fill(0),
                Source::Backing => {
                    self.ev(DebugEvent::ReadBackingAio);
                    Self::read_backing(backing, p.guest, dst).await?
                }
                Source::Host(h) => {
                    self.ev(DebugEvent::ReadAio);
                    let b = self.data_read(h, dst.len()).await?;
                    dst.copy_from_slice(&b);
                }
                Source::Compressed {
                    offset,
                    len,
                    within,
                } => {
                    let c = self.decompress(offset, len).await?;
                    dst.copy_from_slice(&c[within as usize..within as usize + dst.len()]);
                }
            }
        }
        Ok(())
    }

    pub(super) async fn read_impl(&self, offset: u64, mut buf: Buf) -> (io::Result<()>, Buf) {
        if self.crypt.is_some() {
            let r = self.crypt_read(offset, &mut buf).await;
            return (r, buf);
        }
        let (pieces, inflight, backing) = match self.map_range(offset, buf.len() as u64).await {
            Ok(p) => p,
            Err(e) => return (Err(e), buf),
        };
        if let [Piece {
            src: Source::Host(h),
            ..
        }] = pieces[..]
        {
            let (start, len, node) = (now_ns(), buf.len() as u64, self.data_node());
            self.ev(DebugEvent::ReadAio);
            let r = node.driver().read(h, buf).await;
            drop(inflight);
            node.count_direct(Op::Read, start, h + len, len, r.0.is_ok());
            return r;
        }
        let r = self
            .read_pieces(offset, &pieces, backing.as_ref(), &mut buf)
            .await;
        drop(inflight);
        (r, buf)
    }

    /// [`read_impl`](Self::read_impl) into the caller's I/O vector: passed to the file as it
    /// is when the range is one host run, else read into a bounce buffer and copied in.
    pub(super) async fn readv_impl(&self, offset: u64, iov: IoVec) -> (io::Result<()>, IoVec) {
        if self.crypt.is_some() {
            let mut buf = request_buf(iov.len());
            let r = self.crypt_read(offset, &mut buf).await;
            let mut iov = iov;
            if r.is_ok() {
                iov.copy_in(0, &buf);
            }
            return (r, iov);
        }
        let (pieces, inflight, backing) = match self.map_range(offset, iov.len() as u64).await {
            Ok(p) => p,
            Err(e) => return (Err(e), iov),
        };
        if let [Piece {
            src: Source::Host(h),
            ..
        }] = pieces[..]
        {
            let (start, len, node) = (now_ns(), iov.len() as u64, self.data_node());
            self.ev(DebugEvent::ReadAio);
            let r = node.driver().readv(h, iov).await;
            drop(inflight);
            node.count_direct(Op::Read, start, h + len, len, r.0.is_ok());
            return r;
        }
        crate::buf::count_bounce();
        let mut buf = request_buf(iov.len());
        let r = self
            .read_pieces(offset, &pieces, backing.as_ref(), &mut buf)
            .await;
        drop(inflight);
        let mut iov = iov;
        if r.is_ok() {
            iov.copy_in(0, &buf);
        }
        (r, iov)
    }
}
