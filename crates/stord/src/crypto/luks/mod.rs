//! LUKS1 as QEMU's crypto/block-luks.c does it: the header ([`header`]), unlocking the
//! master key from a key slot with a password, making key slots, and new volumes
//! ([`create`]), key slot changes ([`amend`]). I/O stays with the caller: reads come
//! through a closure, and what is to be written comes back as buffers with their offsets.

pub mod amend;
pub mod create;
pub mod header;

use zeroize::Zeroizing;

use super::afsplit;
use super::algs::HashAlg;
use super::cipher::{CipherSpec, SectorCipher};
use super::pbkdf;
use super::CryptoError;
use header::{KeySlot, LuksHeader, DIGEST_LEN, HEADER_LEN, NUM_KEY_SLOTS, SALT_LEN, SECTOR};

/// QEMU's floor on a key slot's PBKDF2 iterations.
pub const MIN_SLOT_KEY_ITERS: u64 = 1000;

/// Reads `buf.len()` bytes of the header's storage at an offset.
pub type ReadFn<'a> = &'a mut dyn FnMut(u64, &mut [u8]) -> Result<(), CryptoError>;

/// The volume key; wiped when dropped, never printed.
pub struct MasterKey(Zeroizing<Vec<u8>>);

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// An opened (or new) volume's header with its parsed cipher.
#[derive(Debug, Clone)]
pub struct Luks {
    pub header: LuksHeader,
    pub spec: CipherSpec,
    /// The hash of the key derivation and the splitter.
    pub hash: HashAlg,
}

impl Luks {
    /// A header read from storage, checked and parsed as QEMU does before it asks for a
    /// key (`detached`: the payload is on another node).
    pub fn load(bytes: &[u8; HEADER_LEN], detached: bool) -> Result<Self, CryptoError> {
        let header = LuksHeader::decode(bytes);
        header.check(detached)?;
        let (spec, hash) = header.parse_spec()?;
        Ok(Self { header, spec, hash })
    }

    /// Where the encrypted data starts on its node, in bytes.
    pub fn payload_offset(&self) -> u64 {
        u64::from(self.header.payload_offset_sector) * SECTOR
    }

    /// Where slot `i`'s key material lies, and its length.
    pub fn material(&self, i: usize) -> (u64, usize) {
        let s = &self.header.key_slots[i];
        let len = self.header.master_key_len as usize * s.stripes as usize;
        (u64::from(s.key_offset_sector) * SECTOR, len)
    }

    pub fn slot_active(&self, i: usize) -> bool {
        self.header.key_slots[i].is_active()
    }

    /// The number of active key slots.
    pub fn active_slots(&self) -> usize {
        (0..NUM_KEY_SLOTS).filter(|&i| self.slot_active(i)).count()
    }

    /// The master key if `password` opens slot `i` (None for an inactive slot or
    /// another password; QEMU's qcrypto_block_luks_load_key).
    pub fn load_key(
        &self,
        i: usize,
        password: &[u8],
        read: ReadFn<'_>,
    ) -> Result<Option<MasterKey>, CryptoError> {
        let slot = &self.header.key_slots[i];
        if !slot.is_active() {
            return Ok(None);
        }
        let nkey = self.header.master_key_len as usize;
        let mut possible = Zeroizing::new(vec![0u8; nkey]);
        let iters = u64::from(slot.iterations);
        pbkdf::pbkdf2(self.hash, password, &slot.salt, iters, &mut possible)?;
        let (offset, len) = self.material(i);
        let mut split = Zeroizing::new(vec![0u8; len]);
        read(offset, &mut split)?;
        SectorCipher::new(&self.spec, &possible)?.decrypt(0, &mut split)?;
        let key = afsplit::decode(self.hash, slot.stripes as usize, &split)?;
        let mut digest = [0u8; DIGEST_LEN];
        let h = &self.header;
        let iters = u64::from(h.master_key_iterations);
        pbkdf::pbkdf2(self.hash, &key, &h.master_key_salt, iters, &mut digest)?;
        if openssl::memcmp::eq(&digest, &h.master_key_digest) {
            Ok(Some(MasterKey(key)))
        } else {
            Ok(None)
        }
    }

    /// The master key from the first slot `password` opens (QEMU's find_key).
    pub fn find_key(&self, password: &[u8], read: ReadFn<'_>) -> Result<MasterKey, CryptoError> {
        for i in 0..NUM_KEY_SLOTS {
            if let Some(k) = self.load_key(i, password, read)? {
                // QEMU's qcrypto_block_luks_load_key trace: the slot, never a key.
                tracing::debug!("luks: key slot {i} unlocked the volume ({:?})", self.spec);
                return Ok(k);
            }
        }
        tracing::debug!("luks: no key slot unlocked the volume");
        Err(CryptoError::BadPassword)
    }

    /// The payload's cipher under `key`.
    pub fn cipher(&self, key: &MasterKey) -> Result<SectorCipher, CryptoError> {
        SectorCipher::new(&self.spec, key.bytes())
    }

    /// Slot `i` made for `password` holding `key`, its PBKDF2 timed to `iter_time_ms`
    /// (QEMU's qcrypto_block_luks_store_key): the new slot header, and the encrypted
    /// material to write at [`material`](Self::material)`(i)` before the header says
    /// the slot is active.
    pub fn make_slot(
        &self,
        i: usize,
        password: &[u8],
        key: &MasterKey,
        iter_time_ms: u64,
    ) -> Result<(KeySlot, Zeroizing<Vec<u8>>), CryptoError> {
        let mut slot = self.header.key_slots[i].clone();
        super::random_bytes(&mut slot.salt)?;
        let nkey = self.header.master_key_len as usize;
        let per_sec = pbkdf::count_iters(self.hash, password, &slot.salt, nkey)?;
        let iters = scale_iters(per_sec, iter_time_ms)?;
        slot.iterations = iters.max(MIN_SLOT_KEY_ITERS) as u32;
        let mut slot_key = Zeroizing::new(vec![0u8; nkey]);
        let n = u64::from(slot.iterations);
        pbkdf::pbkdf2(self.hash, password, &slot.salt, n, &mut slot_key)?;
        let mut split = afsplit::encode(self.hash, slot.stripes as usize, key.bytes())?;
        SectorCipher::new(&self.spec, &slot_key)?.encrypt(0, &mut split)?;
        slot.active = header::SLOT_ENABLED;
        Ok((slot, split))
    }

    /// Marks slot `i` inactive with its salt and count cleared (QEMU's erase_key): the
    /// caller writes the header, then overwrites the material with random bytes.
    pub fn erase_slot(&mut self, i: usize) {
        let s = &mut self.header.key_slots[i];
        s.salt = [0; SALT_LEN];
        s.iterations = 0;
        s.active = header::SLOT_DISABLED;
    }
}

/// Iterations for `ms` milliseconds at `per_sec`, with QEMU's range errors.
pub fn scale_iters(per_sec: u64, ms: u64) -> Result<u64, CryptoError> {
    if ms > 0 && per_sec > u64::MAX / ms {
        return Err(CryptoError::Invalid(format!(
            "PBKDF iterations {per_sec} too large to scale"
        )));
    }
    let iters = per_sec * ms / 1000;
    if iters > u64::from(u32::MAX) {
        return Err(CryptoError::Invalid(format!(
            "PBKDF iterations {iters} larger than {}",
            u32::MAX
        )));
    }
    Ok(iters)
}

/// The password a secret gives: all of it, which must be UTF-8 without a NUL (QEMU's
/// qcrypto_secret_lookup_as_utf8, whose glib check refuses NULs).
pub fn password_of(id: &str, secret: &[u8]) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
    if secret.contains(&0) || std::str::from_utf8(secret).is_err() {
        return Err(CryptoError::Invalid(format!(
            "Data from secret {id} is not valid UTF-8"
        )));
    }
    Ok(Zeroizing::new(secret.to_vec()))
}
