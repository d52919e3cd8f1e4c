//! Encrypted images (`encrypt.format=luks`, QEMU's crypt_method 2; libvirt's
//! `<encryption format='luks'>`, OpenStack's encrypted volumes): a LUKS1 header in
//! clusters of the image that the crypto header extension points at (metadata to the
//! overlap checks and the refcounts), unlocked at open with the `secret` object
//! `encrypt.key-secret` names.
//!
//! Every data cluster holds ciphertext, each 512-byte sector encrypted with the number of
//! its sector in the image file (QEMU's crypt_physical_offset): data moved to another host
//! cluster (copy-on-write) is decrypted and encrypted again at its new place, and data
//! from the backing file, plaintext there, is encrypted on its way into this image.
//! Compressed clusters are stored unencrypted, as QEMU stores them. Requests are
//! widened to whole sectors, read and decrypted into a buffer of ours (never the
//! caller's), and writes are encrypted from one: a partial sector is read, patched and
//! written whole under a lock on its sectors, which every write, write-zeroes and discard
//! of the image takes. The legacy AES method (crypt_method 1) is refused at open.

use std::io;
use std::sync::Arc;

use stord_aio::AsyncMutex;

use super::driver::{Crypt, Qcow2Driver};
use super::header::{crypt, Header};
use crate::block::drivers::luks::amend::Keys;
use crate::block::node::block_node::BlockNode;
use crate::block::node::debug_event::DebugEvent;
use crate::block::node::range_lock::RangeLocks;
use crate::block::open::{Graph, GraphError};
use crate::buf::{request_buf, Buf};
use crate::cli::keyval::KeyVal;
use crate::crypto::cipher::SECTOR_SIZE;
use crate::crypto::luks::header::HEADER_LEN;
use crate::crypto::luks::{password_of, Luks};
use crate::crypto::CryptoError;

const SECTOR: u64 = SECTOR_SIZE as u64;

/// `--blockdev driver=qcow2`'s `encrypt.*` options (QEMU's BlockdevQcow2Encryption).
pub(super) struct EncryptOptions {
    format: String,
    key_secret: Option<String>,
}

/// Takes `encrypt.format` and `encrypt.key-secret`: the format is the union's tag, which
/// QEMU's schema requires once anything of `encrypt` is given.
pub(super) fn take_options(kv: &mut KeyVal) -> Result<Option<EncryptOptions>, GraphError> {
    let format = kv.take_choice("encrypt.format", &["aes", "luks"])?;
    let key_secret = kv.take("encrypt.key-secret");
    match format {
        Some(format) => Ok(Some(EncryptOptions { format, key_secret })),
        None if key_secret.is_some() => Err(kv.missing("encrypt.format").into()),
        None => Ok(None),
    }
}

fn invalid(s: String) -> GraphError {
    GraphError::Invalid(s)
}

/// The encryption of the image `h` heads on `file`, unlocked with the options' secret
/// (QEMU's checks of the options against the header, in its words); None when the image
/// is not encrypted.
pub(super) fn open(
    g: &mut dyn Graph,
    opts: Option<EncryptOptions>,
    h: &Header,
    file: &Arc<BlockNode>,
) -> Result<Option<Crypt>, GraphError> {
    let format = opts.as_ref().map(|o| o.format.clone());
    match (h.crypt_method, format) {
        (crypt::NONE, None) => return Ok(None),
        (crypt::NONE, Some(f)) => {
            return Err(invalid(format!(
                "No encryption in image header, but options specified format '{f}'"
            )))
        }
        (_, Some(f)) if f != "luks" => {
            return Err(invalid(format!(
                "Header reported 'luks' encryption format but options specify '{f}'"
            )))
        }
        _ => {}
    }
    let (offset, length) = h
        .crypto_header
        .expect("the header's parse checked it is there");
    let Some(id) = opts.and_then(|o| o.key_secret) else {
        return Err(invalid(
            "Parameter 'encrypt.key-secret' is required for cipher".into(),
        ));
    };
    let Some(bytes) = g.secret(&id).map(zeroize::Zeroizing::new) else {
        return Err(invalid(format!("No secret with id '{id}'")));
    };
    let crypto_err = |e: CryptoError| invalid(e.to_string());
    let password = password_of(&id, &bytes).map_err(crypto_err)?;
    // QEMU's qcow2_crypto_hdr_read_func: within the extension's length only.
    let mut read = |off: u64, buf: &mut [u8]| {
        if off + buf.len() as u64 > length {
            return Err(CryptoError::Io(
                "Request for data outside of extension header".into(),
            ));
        }
        crate::block::drivers::luks::read_storage(file, offset + off, buf)
    };
    let mut first = [0u8; HEADER_LEN];
    read(0, &mut first).map_err(crypto_err)?;
    let luks = Luks::load(&first, false).map_err(crypto_err)?;
    let key = luks.find_key(&password, &mut read).map_err(crypto_err)?;
    let cipher = luks.cipher(&key).map_err(crypto_err)?;
    Ok(Some(Crypt {
        cipher,
        keys: Keys {
            luks: Arc::new(AsyncMutex::new(luks)),
            opened_with: id,
        },
        header: (offset, length),
        rmw: RangeLocks::default(),
    }))
}

/// The whole sectors that cover `[offset, offset + len)`.
fn widen(offset: u64, len: usize) -> (u64, usize) {
    let start = offset / SECTOR * SECTOR;
    let end = (offset + len as u64).div_ceil(SECTOR) * SECTOR;
    (start, (end - start) as usize)
}

fn eio(e: CryptoError) -> io::Error {
    io::Error::other(e.to_string())
}

/// Data in host clusters: decrypted as it is read, encrypted as it is written (as they
/// are for an image without encryption, otherwise).
impl Qcow2Driver {
    /// `len` bytes of data at `host` (whole sectors when encrypted).
    pub(super) async fn data_read(&self, host: u64, len: usize) -> io::Result<Buf> {
        let mut b = self.host_read(host, len).await?;
        if let Some(c) = &self.crypt {
            debug_assert!(host.is_multiple_of(SECTOR) && len.is_multiple_of(SECTOR_SIZE));
            c.cipher.decrypt(host / SECTOR, &mut b).map_err(eio)?;
        }
        Ok(b)
    }

    /// Writes `data` at `host`, from a copy (encrypted there).
    pub(super) async fn data_write(&self, host: u64, data: &[u8]) -> io::Result<()> {
        let mut buf = request_buf(data.len());
        buf.copy_from_slice(data);
        self.data_write_buf(host, buf).await.0
    }

    /// Writes `buf` at `host`, encrypted in place: only for a buffer of ours when the
    /// image is encrypted.
    pub(super) async fn data_write_buf(&self, host: u64, mut buf: Buf) -> (io::Result<()>, Buf) {
        self.ev(DebugEvent::WriteAio);
        if let Some(c) = &self.crypt {
            debug_assert!(host.is_multiple_of(SECTOR) && buf.len().is_multiple_of(SECTOR_SIZE));
            if let Err(e) = c.cipher.encrypt(host / SECTOR, &mut buf) {
                return (Err(eio(e)), buf);
            }
        }
        self.host_write_buf(host, buf).await
    }

    /// The encryption, for a request of an encrypted image.
    fn crypt_state(&self) -> &Crypt {
        self.crypt
            .as_deref()
            .expect("only encrypted images come here")
    }

    /// Reads the guest range at `offset` into `dst` through a buffer of whole sectors.
    pub(super) async fn crypt_read(&self, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let (start, wlen) = widen(offset, dst.len());
        let (pieces, inflight, backing) = self.map_range(start, wlen as u64).await?;
        let mut b = request_buf(wlen);
        let r = self
            .read_pieces(start, &pieces, backing.as_ref(), &mut b)
            .await;
        drop(inflight);
        r?;
        let skip = (offset - start) as usize;
        dst.copy_from_slice(&b[skip..skip + dst.len()]);
        Ok(())
    }

    /// Writes `len` bytes at `offset` that `src` puts into a buffer of ours, under the lock
    /// on the sectors they cover.
    pub(super) async fn crypt_write(
        &self,
        (offset, len): (u64, usize),
        fua: bool,
        src: impl FnOnce(&mut [u8]),
    ) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (start, wlen) = widen(offset, len);
        let _span = self
            .crypt_state()
            .rmw
            .lock(start, start + wlen as u64)
            .await;
        self.crypt_write_locked((offset, len), fua, src).await
    }

    /// [`crypt_write`](Self::crypt_write) with the sectors held: the partial ones read
    /// first, then the whole sectors written in place, or as a write that allocates.
    async fn crypt_write_locked(
        &self,
        (offset, len): (u64, usize),
        fua: bool,
        src: impl FnOnce(&mut [u8]),
    ) -> io::Result<()> {
        let (start, wlen) = widen(offset, len);
        let mut bounce = request_buf(wlen);
        if start != offset || wlen != len {
            self.crypt_read(start, &mut bounce).await?;
        }
        let skip = (offset - start) as usize;
        src(&mut bounce[skip..skip + len]);
        if let Some((host, inflight)) = self.in_place(start, wlen as u64).await? {
            let (r, _) = self.data_write_buf(host, bounce).await;
            drop(inflight);
            r?;
            if fua {
                self.file.driver().flush().await?;
            }
            return Ok(());
        }
        self.write_owned(start, bounce, fua).await.0
    }

    /// Write-zeroes: partial sectors at either end get encrypted zeroes, the whole
    /// sectors between go as for any image (zero clusters, or zeroes written as data).
    pub(super) async fn crypt_write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> io::Result<()> {
        let (start, wlen) = widen(offset, len as usize);
        let _span = self
            .crypt_state()
            .rmw
            .lock(start, start + wlen as u64)
            .await;
        let end = offset + len;
        let head_end = offset.next_multiple_of(SECTOR).min(end);
        let tail_start = (end / SECTOR * SECTOR).max(head_end);
        for (a, b) in [(offset, head_end), (tail_start, end)] {
            if a < b {
                self.crypt_write_locked((a, (b - a) as usize), false, |z| z.fill(0))
                    .await?;
            }
        }
        if head_end < tail_start {
            self.write_zeroes_impl(head_end, tail_start - head_end, may_unmap)
                .await?;
        }
        Ok(())
    }

    /// Discard, under the lock on the sectors it covers (a partial sector's write must
    /// not put back what the discard took).
    pub(super) async fn crypt_discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let (start, wlen) = widen(offset, len as usize);
        let _span = self
            .crypt_state()
            .rmw
            .lock(start, start + wlen as u64)
            .await;
        self.discard_impl(offset, len).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_widen_to_whole_sectors() {
        assert_eq!(widen(0, 512), (0, 512));
        assert_eq!(widen(300, 5), (0, 512));
        assert_eq!(widen(4095, 2), (3584, 1024));
        assert_eq!(widen(1024, 1), (1024, 512));
    }
}
