//! Compressed writes, as QEMU's qcow2_co_pwritev_compressed_part (backup's `compress`):
//! whole clusters only (the image's last one may be short, and is padded with zeroes),
//! each compressed on a worker thread ([`compress`]: raw deflate with a 4 KiB window, or
//! zstd, as the header's compression type says). A cluster that does not shrink below its
//! size is written as a normal cluster. A compressed cluster goes only where the image
//! has nothing (unallocated, or zero without a host cluster; anything else is EIO, as in
//! QEMU): its bytes are packed after the previous compressed cluster's in the same host
//! cluster ([`Qcow2Driver::alloc_bytes`], QEMU's qcow2_alloc_bytes), every host cluster
//! counted once per compressed cluster that touches it.
//!
//! The order is the allocating path's: refcounts raised in the cache, the data written,
//! then the L2 entry set (without the copied flag, and with an all-zero subcluster
//! bitmap with extended L2 entries: compressed clusters have none); the flush writes
//! refcounts before L2 tables ([`super::writeback`]), so a crash can leak bytes, never
//! reference uncounted ones.

use std::io;

use super::driver::{Meta, Qcow2Driver};
use super::header::Compression;
use super::table::{Mapping, COMPRESSED};
use crate::block::node::debug_event::DebugEvent;
use crate::buf::Buf;

/// Compresses one cluster `src` into at most `max` bytes (QEMU passes the cluster size
/// less one) as QEMU's qcow2_co_compress: raw deflate at the default level with a 4 KiB
/// window (deflateInit2 with windowBits -12: QEMU inflates with that window, so no match
/// may reach further back), or a zstd frame at libzstd's default level. `Ok(None)` when it
/// does not fit; `Err` when the compressor fails otherwise.
pub(super) fn compress(kind: Compression, src: &[u8], max: usize) -> Result<Option<Vec<u8>>, ()> {
    let mut out = vec![0u8; max];
    let n = match kind {
        Compression::Zlib => {
            let level = flate2::Compression::new(6);
            let mut z = flate2::Compress::new_with_window_bits(level, false, 12);
            match z.compress(src, &mut out, flate2::FlushCompress::Finish) {
                Ok(flate2::Status::StreamEnd) => z.total_out() as usize,
                Ok(_) => return Ok(None),
                Err(_) => return Err(()),
            }
        }
        Compression::Zstd => {
            use zstd::zstd_safe::{zstd_sys::ZSTD_ErrorCode, CCtx};
            let too_small = (ZSTD_ErrorCode::ZSTD_error_dstSize_tooSmall as usize).wrapping_neg();
            let mut cctx = CCtx::try_create().ok_or(())?;
            match cctx.compress2(&mut out[..], src) {
                Ok(n) => n,
                Err(code) if code == too_small => return Ok(None),
                Err(_) => return Err(()),
            }
        }
    };
    out.truncate(n);
    Ok(Some(out))
}

/// The L2 entry of a compressed cluster of `len` bytes at host byte `offset` (qcow2.txt's
/// compressed cluster descriptor: the offset, and above it how many 512-byte sectors the
/// data reaches past the one the offset is in).
pub(super) fn compressed_entry(offset: u64, len: u64, cluster_bits: u32) -> u64 {
    let shift = 62 - (cluster_bits - 8);
    let sectors = (offset + len - 1) / 512 - offset / 512;
    COMPRESSED | sectors << shift | offset
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

impl Qcow2Driver {
    /// See [`BlockDriver::write_compressed`](crate::block::node::block_node::BlockDriver::write_compressed).
    pub(super) async fn write_compressed_impl(
        &self,
        offset: u64,
        buf: Buf,
    ) -> (io::Result<()>, Buf) {
        let r = self.write_compressed_all(offset, &buf).await;
        (r, buf)
    }

    /// Writes `data` at `offset` a cluster at a time; ENOTSUP on an image with an external
    /// data file, EINVAL unless it starts on a cluster and ends on one or at the image's end
    /// (QEMU's checks, in its order).
    async fn write_compressed_all(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let cs = self.cluster_size;
        let end = offset + data.len() as u64;
        if self.has_data_file() {
            return Err(io::Error::from_raw_os_error(libc::ENOTSUP));
        }
        if data.is_empty() {
            return Ok(());
        }
        if offset & (cs - 1) != 0
            || (end & (cs - 1) != 0 && end != self.size.load(std::sync::atomic::Ordering::Relaxed))
        {
            return Err(einval());
        }
        for (i, chunk) in data.chunks(cs as usize).enumerate() {
            self.write_compressed_cluster(offset + i as u64 * cs, chunk)
                .await?;
        }
        Ok(())
    }

    /// One guest cluster at `cstart` (`data` is the cluster, or the image's short last
    /// one): compressed, or written as a normal cluster where that does not shrink it.
    async fn write_compressed_cluster(&self, cstart: u64, data: &[u8]) -> io::Result<()> {
        let cs = self.cluster_size as usize;
        let mut src = vec![0u8; cs];
        src[..data.len()].copy_from_slice(data);
        let kind = self.compression;
        let packed = crate::block::worker_pool::run(move || compress(kind, &src, cs - 1)).await;
        let Some(packed) = packed.map_err(|()| einval())? else {
            return self.write_slow(cstart, data, false).await;
        };
        let len = packed.len() as u64;
        let _lock = self
            .alloc_locks
            .lock(cstart, cstart + self.cluster_size)
            .await;
        let host = self.alloc_compressed(cstart, len).await?;
        self.ev(DebugEvent::WriteCompressed);
        let written = self.file_write(host, &packed).await;
        let mut m = self.meta.lock().await;
        if let Err(e) = written {
            // Nothing references the bytes: give them back now.
            self.free_bytes(&mut m, host, len).await?;
            return Err(e);
        }
        let entry = compressed_entry(host, len, self.cluster_bits);
        self.ev(DebugEvent::L2UpdateCompressed);
        self.set_l2(&mut m, cstart, entry, 0).await
    }

    /// Where `len` compressed bytes for the guest cluster at `cstart` go, counted: as
    /// QEMU's qcow2_alloc_compressed_cluster_offset, its L2 table first (allocated, or
    /// copied from a snapshot that shares it), and EIO if the cluster has a host cluster
    /// (compression overwrites nothing).
    async fn alloc_compressed(&self, cstart: u64, len: u64) -> io::Result<u64> {
        let mut m = self.meta.lock().await;
        self.l2_table_to_write(&mut m, cstart).await?;
        match self.lookup(&mut m, cstart).await? {
            Mapping::Unallocated | Mapping::Zero { host: None, .. } => {}
            _ => return Err(io::Error::from_raw_os_error(libc::EIO)),
        }
        let host = self.alloc_bytes(&mut m, len).await?;
        if let Err(e) = self.check_overlap(&m, host, len, None).await {
            self.free_bytes(&mut m, host, len).await?;
            return Err(e);
        }
        Ok(host)
    }

    /// `size` bytes (at most a cluster) for compressed data, as QEMU's qcow2_alloc_bytes:
    /// after the last compressed cluster's in its host cluster while they fit there and
    /// its refcount can grow; else in a new cluster, which they may run into from the old
    /// one's tail when it comes right after it. Each host cluster the bytes touch gains a
    /// reference. The bytes' host offset.
    pub(super) async fn alloc_bytes(&self, m: &mut Meta, size: u64) -> io::Result<u64> {
        self.ev(DebugEvent::ClusterAllocBytes);
        let cs = self.cluster_size;
        let mut offset = m.free_byte_offset;
        if offset != 0 && self.refcount(m, offset).await? == self.refcounts().max() {
            offset = 0;
        }
        if offset != 0 && cs - (offset & (cs - 1)) >= size {
            self.change_refcount(m, offset, 1).await?;
        } else {
            let (new, _) = self.alloc_cluster(m).await?;
            if offset != 0 && offset.next_multiple_of(cs) == new {
                // From the old cluster's tail into the new one (counted once already).
                self.change_refcount(m, offset, 1).await?;
            } else {
                offset = new;
            }
        }
        let next = offset + size;
        m.free_byte_offset = if next & (cs - 1) == 0 { 0 } else { next };
        Ok(offset)
    }

    /// Gives back `len` bytes at `host` that [`alloc_bytes`](Self::alloc_bytes) counted
    /// and nothing references.
    async fn free_bytes(&self, m: &mut Meta, host: u64, len: u64) -> io::Result<()> {
        for c in host >> self.cluster_bits..=(host + len - 1) >> self.cluster_bits {
            self.change_refcount(m, c << self.cluster_bits, -1).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::drivers::qcow2::table::EntryCodec;

    /// A cluster that compresses well: text with repeats far apart and near.
    fn cluster(cs: usize) -> Vec<u8> {
        let line = b"stord writes qcow2 compressed clusters as QEMU does. ";
        let mut v: Vec<u8> = line.iter().cycle().take(cs).copied().collect();
        for (i, b) in v.iter_mut().enumerate().step_by(97) {
            *b = (i / 97) as u8;
        }
        v
    }

    #[test]
    fn zlib_output_is_raw_deflate_that_a_4k_window_inflates() {
        let src = cluster(65536);
        let out = compress(Compression::Zlib, &src, 65535).unwrap().unwrap();
        assert!(out.len() < 65535);
        // QEMU's inflateInit2(-12): a 4 KiB window, no header.
        let mut z = flate2::Decompress::new_with_window_bits(false, 12);
        let mut back = vec![0u8; 65536];
        let st = z
            .decompress(&out, &mut back, flate2::FlushDecompress::Finish)
            .unwrap();
        assert_eq!(st, flate2::Status::StreamEnd);
        assert_eq!(back, src);
    }

    #[test]
    fn zstd_output_is_a_frame_ruzstd_reads() {
        let src = cluster(65536);
        let out = compress(Compression::Zstd, &src, 65535).unwrap().unwrap();
        assert!(out.len() < 65535);
        let mut r: &[u8] = &out;
        let mut d = ruzstd::decoding::StreamingDecoder::new(&mut r).unwrap();
        let mut back = Vec::new();
        std::io::Read::read_to_end(&mut d, &mut back).unwrap();
        assert_eq!(back, src);
    }

    #[test]
    fn data_that_does_not_shrink_is_not_compressed() {
        // A xorshift stream: incompressible.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let src: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        for kind in [Compression::Zlib, Compression::Zstd] {
            assert_eq!(compress(kind, &src, 4095), Ok(None), "{kind:?}");
        }
    }

    #[test]
    fn entries_decode_to_the_bytes_they_were_made_for() {
        for bits in [9u32, 12, 16, 21] {
            let codec = EntryCodec::new(bits, 3, false);
            for (offset, len) in [
                (0x50000u64, 1u64),
                (0x50000, 511),
                (0x501ff, 2),
                (0x7_0123, 3000),
            ] {
                let len = len.min((1 << bits) - 1);
                let e = compressed_entry(offset, len, bits);
                let Ok(Mapping::Compressed { offset: o, len: l }) = codec.decode(e) else {
                    panic!("{e:#x} does not decode as compressed");
                };
                assert_eq!(o, offset);
                // Whole sectors from the offset's: at least the bytes, less than a sector more.
                assert!(
                    l >= len && l < len + 512,
                    "bits {bits} {offset:#x}+{len}: {l}"
                );
                assert_eq!((o + l) % 512, 0);
            }
        }
        // 700 bytes at 0x10100 with 64 KiB clusters reach one sector past the first.
        assert_eq!(
            compressed_entry(0x10100, 700, 16),
            COMPRESSED | 1u64 << 54 | 0x10100
        );
    }
}
