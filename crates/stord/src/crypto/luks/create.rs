//! A new LUKS volume (QEMU's qcrypto_block_luks_create): its options with QEMU's
//! defaults, a random master key with its digest, the eight slots laid out, and slot 0
//! made for the password.

use zeroize::Zeroizing;

use super::super::algs::{CipherAlg, CipherMode, HashAlg, IvGenAlg};
use super::super::cipher::{CipherSpec, SectorCipher};
use super::super::{pbkdf, random_bytes, CryptoError};
use super::header::{self, KeySlot, LuksHeader, DIGEST_LEN, HEADER_LEN, KEY_SLOT_OFFSET};
use super::header::{NUM_KEY_SLOTS, SECTOR, STRIPES};
use super::{scale_iters, Luks, MasterKey};

/// QEMU's default PBKDF2 time for a slot, in milliseconds.
pub const DEFAULT_ITER_TIME_MS: u64 = 2000;
/// QEMU's floor on the master key digest's iterations.
const MIN_MASTER_KEY_ITERS: u64 = 1000;

/// QCryptoBlockCreateOptionsLUKS without the secret.
#[derive(Debug, Clone, Copy)]
pub struct CreateOptions {
    pub cipher_alg: CipherAlg,
    pub cipher_mode: CipherMode,
    pub ivgen_alg: IvGenAlg,
    pub ivgen_hash_alg: Option<HashAlg>,
    pub hash_alg: HashAlg,
    pub iter_time_ms: u64,
}

impl Default for CreateOptions {
    fn default() -> Self {
        Self {
            cipher_alg: CipherAlg::Aes256,
            cipher_mode: CipherMode::Xts,
            ivgen_alg: IvGenAlg::Plain64,
            ivgen_hash_alg: None,
            hash_alg: HashAlg::Sha256,
            iter_time_ms: DEFAULT_ITER_TIME_MS,
        }
    }
}

/// A new volume: the header (slot 0 active) and slot 0's encrypted material.
pub struct Created {
    pub luks: Luks,
    pub key: MasterKey,
    /// Slot 0's material, to be written at its offset before the header.
    pub material: Zeroizing<Vec<u8>>,
    /// The header's size with its key material (what a detached header image holds).
    pub header_size: u64,
}

fn put_str(field: &mut [u8], s: &str, what: &str) -> Result<(), CryptoError> {
    if s.len() >= field.len() {
        return Err(CryptoError::Invalid(format!(
            "{what} '{s}' is too long for LUKS header"
        )));
    }
    field[..s.len()].copy_from_slice(s.as_bytes());
    Ok(())
}

/// The cipher spec of the options (ESSIV's hash defaulting to sha256, as in QEMU).
fn spec_of(o: &CreateOptions) -> Result<CipherSpec, CryptoError> {
    let mut ivgen_hash = o.ivgen_hash_alg;
    if o.ivgen_alg == IvGenAlg::Essiv && ivgen_hash.is_none() {
        ivgen_hash = Some(HashAlg::Sha256);
    }
    let ivgen_cipher = match (o.ivgen_alg, ivgen_hash) {
        (IvGenAlg::Essiv, Some(h)) => o.cipher_alg.essiv_cipher(h)?,
        _ => o.cipher_alg,
    };
    Ok(CipherSpec {
        alg: o.cipher_alg,
        mode: o.cipher_mode,
        ivgen: o.ivgen_alg,
        ivgen_hash,
        ivgen_cipher,
    })
}

/// The header's strings and key length for `spec`.
fn blank_header(spec: &CipherSpec, hash: HashAlg) -> Result<LuksHeader, CryptoError> {
    let mut h = LuksHeader::decode(&[0; HEADER_LEN]);
    h.magic = header::MAGIC;
    h.version = header::VERSION;
    put_str(&mut h.cipher_name, spec.alg.luks_name(), "Cipher name")?;
    let mut mode = format!("{}-{}", spec.mode.name(), spec.ivgen.name());
    if let Some(ih) = spec.ivgen_hash {
        mode = format!("{mode}:{}", ih.name());
    }
    put_str(&mut h.cipher_mode, &mode, "Cipher mode")?;
    put_str(&mut h.hash_spec, hash.name(), "Hash name")?;
    h.master_key_len = spec.key_len() as u32;
    put_str(&mut h.uuid, &uuid_v4()?, "UUID")?;
    Ok(h)
}

/// A random UUID in its text form.
fn uuid_v4() -> Result<String, CryptoError> {
    let mut u = [0u8; 16];
    random_bytes(&mut u)?;
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    let x: String = u.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &x[..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..]
    ))
}

/// Makes a volume for `password` (`detached`: the payload starts at 0 of another node).
/// Nothing is written: the caller writes the material, then the header.
pub fn create(o: &CreateOptions, password: &[u8], detached: bool) -> Result<Created, CryptoError> {
    let spec = spec_of(o)?;
    let mut h = blank_header(&spec, o.hash_alg)?;
    random_bytes(&mut h.master_key_salt)?;
    let mut key = Zeroizing::new(vec![0u8; spec.key_len()]);
    random_bytes(&mut key)?;
    // The cipher is made first: one OpenSSL lacks is refused before anything is written.
    SectorCipher::new(&spec, &key)?;
    let salt = h.master_key_salt;
    let per_sec = pbkdf::count_iters(o.hash_alg, &key, &salt, DIGEST_LEN)?;
    let iters = (scale_iters(per_sec, o.iter_time_ms)? / 8).max(MIN_MASTER_KEY_ITERS);
    h.master_key_iterations = iters as u32;
    let mut digest = [0u8; DIGEST_LEN];
    pbkdf::pbkdf2(o.hash_alg, &key, &salt, iters, &mut digest)?;
    h.master_key_digest = digest;
    let header_sectors = KEY_SLOT_OFFSET / SECTOR;
    let split = h.split_key_sectors(STRIPES);
    for (i, s) in h.key_slots.iter_mut().enumerate() {
        *s = KeySlot {
            active: header::SLOT_DISABLED,
            iterations: 0,
            salt: [0; 32],
            key_offset_sector: (header_sectors + i as u64 * split) as u32,
            stripes: STRIPES,
        };
    }
    let header_size = (header_sectors + NUM_KEY_SLOTS as u64 * split) * SECTOR;
    h.payload_offset_sector = if detached {
        0
    } else {
        (header_size / SECTOR) as u32
    };
    let mut luks = Luks {
        header: h,
        spec,
        hash: o.hash_alg,
    };
    let key = MasterKey(key);
    let (slot, material) = luks.make_slot(0, password, &key, o.iter_time_ms)?;
    luks.header.key_slots[0] = slot;
    Ok(Created {
        luks,
        key,
        material,
        header_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A volume in memory: the header and material as they would be written.
    fn volume(o: &CreateOptions, password: &[u8]) -> (Vec<u8>, Created) {
        let c = create(o, password, false).unwrap();
        let mut disk = vec![0u8; c.luks.payload_offset() as usize];
        let (off, len) = c.luks.material(0);
        disk[off as usize..off as usize + len].copy_from_slice(&c.material);
        disk[..HEADER_LEN].copy_from_slice(&c.luks.header.encode());
        (disk, c)
    }

    fn reader(disk: &[u8]) -> impl FnMut(u64, &mut [u8]) -> Result<(), CryptoError> + '_ {
        move |off, buf| {
            buf.copy_from_slice(&disk[off as usize..off as usize + buf.len()]);
            Ok(())
        }
    }

    #[test]
    fn a_new_volume_opens_with_its_password_only() {
        let o = CreateOptions {
            iter_time_ms: 10,
            ..Default::default()
        };
        let (disk, c) = volume(&o, b"s3cret");
        assert_eq!(c.luks.payload_offset(), 4040 * 512);
        assert_eq!(c.header_size, 4040 * 512);
        let luks = Luks::load(disk[..HEADER_LEN].try_into().unwrap(), false).unwrap();
        assert_eq!(
            super::super::header::field_str(&luks.header.cipher_mode),
            "xts-plain64"
        );
        let key = luks.find_key(b"s3cret", &mut reader(&disk)).unwrap();
        assert_eq!(key.bytes(), c.key.bytes());
        let e = luks.find_key(b"wrong", &mut reader(&disk)).unwrap_err();
        assert_eq!(e.to_string(), "Invalid password, cannot unlock any keyslot");
    }

    #[test]
    fn essiv_volumes_name_their_hash_and_refused_ciphers_fail_early() {
        let o = CreateOptions {
            cipher_alg: CipherAlg::Aes128,
            cipher_mode: CipherMode::Cbc,
            ivgen_alg: IvGenAlg::Essiv,
            iter_time_ms: 10,
            ..Default::default()
        };
        let (disk, _) = volume(&o, b"pw");
        let luks = Luks::load(disk[..HEADER_LEN].try_into().unwrap(), false).unwrap();
        let mode = super::super::header::field_str(&luks.header.cipher_mode);
        assert_eq!(mode, "cbc-essiv:sha256");
        assert_eq!(luks.payload_offset(), 1032 * 512);
        luks.find_key(b"pw", &mut reader(&disk)).unwrap();
        // A block cipher of 8 bytes has no XTS (QEMU's words).
        let o = CreateOptions {
            cipher_alg: CipherAlg::Cast5_128,
            cipher_mode: CipherMode::Xts,
            ivgen_alg: IvGenAlg::Plain64,
            ..o
        };
        let e = create(&o, b"pw", false).err().unwrap().to_string();
        assert_eq!(e, "Unsupported cipher mode xts");
    }
}
