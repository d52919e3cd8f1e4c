//! [`LuksDriver`]: the payload's requests, decrypted and encrypted by sector.

use std::io;
use std::sync::Arc;

use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::perm::Perm;
use crate::block::node::range_lock::RangeLocks;
use crate::buf::{request_buf, Buf};
use crate::crypto::cipher::{SectorCipher, SECTOR_SIZE};
use crate::crypto::luks::Luks;
use crate::iov::IoVec;
use stord_aio::AsyncMutex;

const SECTOR: u64 = SECTOR_SIZE as u64;
/// Zeroes are written through the cipher in pieces of this size (QEMU's bounce size).
const ZERO_CHUNK: u64 = 1 << 20;

/// What a volume's keys are: its header as opened (changed by amendments, one at a time)
/// and the secret it was unlocked with.
#[derive(Clone)]
pub(crate) struct Keys {
    pub luks: Arc<AsyncMutex<Luks>>,
    pub opened_with: String,
}

/// See the module docs.
pub struct LuksDriver {
    file: Arc<BlockNode>,
    header: Option<Arc<BlockNode>>,
    /// Where the payload starts on `file`.
    payload: u64,
    /// The header as opened (key slots change with `x-blockdev-amend`), and the secret
    /// that opened it.
    keys: Keys,
    cipher: SectorCipher,
    /// Held over the sectors a write covers, so a read-modify-write of a partial sector
    /// never interleaves with another write to it.
    locks: RangeLocks,
}

fn eio(e: crate::crypto::CryptoError) -> io::Error {
    io::Error::other(e.to_string())
}

/// The whole sectors that cover `[offset, offset + len)`.
fn widen(offset: u64, len: usize) -> (u64, usize) {
    let start = offset / SECTOR * SECTOR;
    let end = (offset + len as u64).div_ceil(SECTOR) * SECTOR;
    (start, (end - start) as usize)
}

impl LuksDriver {
    /// A driver for the volume `luks` describes, unlocked with the secret `opened_with`.
    pub fn new(
        (file, header): (Arc<BlockNode>, Option<Arc<BlockNode>>),
        luks: Luks,
        opened_with: String,
        cipher: SectorCipher,
    ) -> Self {
        Self {
            file,
            header,
            payload: luks.payload_offset(),
            keys: Keys {
                luks: Arc::new(AsyncMutex::new(luks)),
                opened_with,
            },
            cipher,
            locks: RangeLocks::default(),
        }
    }

    /// The node that holds the header, and the keys (for `x-blockdev-amend`).
    pub(crate) fn key_store(&self) -> (Arc<BlockNode>, Keys) {
        let node = self.header.clone().unwrap_or_else(|| self.file.clone());
        (node, self.keys.clone())
    }

    fn payload(&self) -> u64 {
        self.payload
    }

    /// Reads whole sectors at `offset` (a multiple of 512) and decrypts them in `buf`.
    async fn read_sectors(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        let (r, mut buf) = self.file.driver().read(self.payload() + offset, buf).await;
        if let Err(e) = r {
            return (Err(e), buf);
        }
        let r = self.cipher.decrypt(offset / SECTOR, &mut buf).map_err(eio);
        (r, buf)
    }

    async fn read_impl(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        if offset.is_multiple_of(SECTOR) && (buf.len() as u64).is_multiple_of(SECTOR) {
            return self.read_sectors(offset, buf).await;
        }
        let (start, len) = widen(offset, buf.len());
        let (r, plain) = self.read_sectors(start, request_buf(len)).await;
        let mut buf = buf;
        if r.is_ok() {
            let skip = (offset - start) as usize;
            let n = buf.len();
            buf.copy_from_slice(&plain[skip..skip + n]);
        }
        (r, buf)
    }

    /// Writes `data` (plaintext, whole sectors at a multiple of 512) encrypted in place.
    async fn write_sectors(&self, offset: u64, mut data: Buf, fua: bool) -> io::Result<()> {
        self.cipher
            .encrypt(offset / SECTOR, &mut data)
            .map_err(eio)?;
        let at = self.payload() + offset;
        self.file.driver().write(at, data, fua).await.0
    }

    /// Writes `src(bounce)`'s bytes at `offset` through a buffer of ours: the covering
    /// sectors are read and patched first where the range is not whole sectors.
    async fn write_from(
        &self,
        offset: u64,
        len: usize,
        fua: bool,
        src: impl FnOnce(&mut [u8]),
    ) -> io::Result<()> {
        let (start, wlen) = widen(offset, len);
        let _span = self.locks.lock(start, start + wlen as u64).await;
        if start == offset && wlen == len {
            let mut bounce = request_buf(len);
            src(&mut bounce);
            return self.write_sectors(offset, bounce, fua).await;
        }
        let (r, mut bounce) = self.read_sectors(start, request_buf(wlen)).await;
        r?;
        let skip = (offset - start) as usize;
        src(&mut bounce[skip..skip + len]);
        self.write_sectors(start, bounce, fua).await
    }

    /// Zeroes encrypted as data, as QEMU's generic zero write does for this driver.
    async fn write_zeroes_impl(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(ZERO_CHUNK) as usize;
            self.write_from(offset + done, n, false, |b| b.fill(0))
                .await?;
            done += n as u64;
        }
        Ok(())
    }
}

impl BlockDriver for LuksDriver {
    fn driver_name(&self) -> &'static str {
        "luks"
    }
    fn size(&self) -> u64 {
        self.file.size().saturating_sub(self.payload())
    }
    fn encrypted(&self) -> bool {
        true
    }
    /// As QEMU's block_crypto_refresh_limits: requests by sector.
    fn refresh_limits(&self, bl: &mut crate::block::node::limits::BlockLimits) {
        bl.request_alignment = SECTOR_SIZE as u32;
    }
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn no_flush(&self) -> bool {
        self.file.driver().no_flush()
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.read_impl(offset, buf))
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            let r = self
                .write_from(offset, buf.len(), fua, |b| b.copy_from_slice(&buf))
                .await;
            (r, buf)
        })
    }
    fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(async move {
            let r = self
                .write_from(offset, iov.len(), fua, |b| iov.copy_out(0, b))
                .await;
            (r, iov)
        })
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            if let Some(h) = &self.header {
                h.driver().flush().await?;
            }
            self.file.driver().flush().await
        })
    }
    /// QEMU's driver has no discard: the data stays (and stays encrypted).
    fn discard(&self, _offset: u64, _len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    fn write_zeroes(&self, offset: u64, len: u64, _may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.write_zeroes_impl(offset, len))
    }
    /// Everything is data, as QEMU reports for a driver without block status.
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        let s = self.block_status_cached(offset, len);
        Box::pin(std::future::ready(Ok(s.expect("always known"))))
    }
    fn block_status_cached(&self, _offset: u64, len: u64) -> Option<BlockStatus> {
        Some(BlockStatus {
            len,
            allocated: true,
            zero: false,
        })
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        self.file.driver().resize(self.payload() + size)
    }
    fn resize_falloc(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        self.file.driver().resize_falloc(self.payload() + size)
    }
    fn filename(&self) -> Option<String> {
        self.file.filename()
    }
    fn allocated_bytes(&self) -> Option<u64> {
        self.file.allocated_bytes()
    }
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        let mut c = vec![("file", self.file.clone())];
        if let Some(h) = &self.header {
            c.push(("header", h.clone()));
        }
        c
    }
    /// QEMU's block_crypto_child_perms: consistent reads, and write and resize only as
    /// the node's users take them (the header is written only by key changes).
    fn child_perms(&self, _role: &'static str, perm: Perm, shared: Perm, _w: bool) -> (Perm, Perm) {
        (perm | Perm::CONSISTENT_READ, shared)
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
