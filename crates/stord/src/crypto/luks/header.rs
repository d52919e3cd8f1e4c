//! The LUKS1 partition header (592 bytes, big-endian; QEMU's QCryptoBlockLUKSHeader):
//! decoded, encoded, checked as QEMU checks it, and its cipher strings parsed.

use super::super::algs::{CipherAlg, CipherMode, HashAlg, IvGenAlg};
use super::super::cipher::CipherSpec;
use super::super::CryptoError;
use crate::bytes::be32;

pub const MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 592;
pub const NUM_KEY_SLOTS: usize = 8;
pub const STRIPES: u32 = 4000;
pub const SALT_LEN: usize = 32;
pub const DIGEST_LEN: usize = 20;
pub const UUID_LEN: usize = 40;
/// Where key material may start: the header's first 4 KiB.
pub const KEY_SLOT_OFFSET: u64 = 4096;
pub const SECTOR: u64 = 512;
pub const SLOT_ENABLED: u32 = 0x00AC_71F3;
pub const SLOT_DISABLED: u32 = 0x0000_DEAD;

/// One key slot's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySlot {
    pub active: u32,
    pub iterations: u32,
    pub salt: [u8; SALT_LEN],
    pub key_offset_sector: u32,
    pub stripes: u32,
}

impl KeySlot {
    pub fn is_active(&self) -> bool {
        self.active == SLOT_ENABLED
    }
}

/// The header as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuksHeader {
    pub magic: [u8; 6],
    pub version: u16,
    pub cipher_name: [u8; 32],
    pub cipher_mode: [u8; 32],
    pub hash_spec: [u8; 32],
    pub payload_offset_sector: u32,
    pub master_key_len: u32,
    pub master_key_digest: [u8; DIGEST_LEN],
    pub master_key_salt: [u8; SALT_LEN],
    pub master_key_iterations: u32,
    pub uuid: [u8; UUID_LEN],
    pub key_slots: [KeySlot; NUM_KEY_SLOTS],
}

fn arr<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    b[at..at + N].try_into().expect("in the header")
}

/// A NUL-terminated field as text (up to its NUL or its end).
pub fn field_str(f: &[u8]) -> String {
    let end = f.iter().position(|&c| c == 0).unwrap_or(f.len());
    String::from_utf8_lossy(&f[..end]).into_owned()
}

impl LuksHeader {
    /// Decodes the first [`HEADER_LEN`] bytes of `b` (any bytes decode; [`check`](Self::check)
    /// judges them).
    pub fn decode(b: &[u8; HEADER_LEN]) -> Self {
        let slot = |i: usize| {
            let s = 208 + i * 48;
            KeySlot {
                active: be32(b, s),
                iterations: be32(b, s + 4),
                salt: arr(b, s + 8),
                key_offset_sector: be32(b, s + 40),
                stripes: be32(b, s + 44),
            }
        };
        Self {
            magic: arr(b, 0),
            version: u16::from_be_bytes(arr(b, 6)),
            cipher_name: arr(b, 8),
            cipher_mode: arr(b, 40),
            hash_spec: arr(b, 72),
            payload_offset_sector: be32(b, 104),
            master_key_len: be32(b, 108),
            master_key_digest: arr(b, 112),
            master_key_salt: arr(b, 132),
            master_key_iterations: be32(b, 164),
            uuid: arr(b, 168),
            key_slots: std::array::from_fn(slot),
        }
    }

    /// The stored form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(0, &self.magic);
        put(6, &self.version.to_be_bytes());
        put(8, &self.cipher_name);
        put(40, &self.cipher_mode);
        put(72, &self.hash_spec);
        put(104, &self.payload_offset_sector.to_be_bytes());
        put(108, &self.master_key_len.to_be_bytes());
        put(112, &self.master_key_digest);
        put(132, &self.master_key_salt);
        put(164, &self.master_key_iterations.to_be_bytes());
        put(168, &self.uuid);
        for (i, s) in self.key_slots.iter().enumerate() {
            let at = 208 + i * 48;
            put(at, &s.active.to_be_bytes());
            put(at + 4, &s.iterations.to_be_bytes());
            put(at + 8, &s.salt);
            put(at + 40, &s.key_offset_sector.to_be_bytes());
            put(at + 44, &s.stripes.to_be_bytes());
        }
        b
    }

    /// Sectors a slot's key material takes with `stripes`: rounded up to a sector, then
    /// to the header's 4 KiB, as cryptsetup lays it out.
    pub fn split_key_sectors(&self, stripes: u32) -> u64 {
        let len = u64::from(self.master_key_len) * u64::from(stripes);
        len.div_ceil(SECTOR)
            .next_multiple_of(KEY_SLOT_OFFSET / SECTOR)
    }

    /// QEMU's checks (qcrypto_block_luks_check_header) and texts; with a detached header
    /// the payload is elsewhere, so slots may lie past its offset.
    pub fn check(&self, detached: bool) -> Result<(), CryptoError> {
        let bad = |s: String| Err(CryptoError::Invalid(s));
        if self.magic != MAGIC {
            return bad("Volume is not in LUKS format".into());
        }
        if self.version != VERSION {
            return bad(format!("LUKS version {} is not supported", self.version));
        }
        for (f, what) in [
            (&self.cipher_name, "cipher name"),
            (&self.cipher_mode, "cipher mode"),
            (&self.hash_spec, "hash spec"),
        ] {
            if !f.contains(&0) {
                return bad(format!("LUKS header {what} is not NUL terminated"));
            }
        }
        let header_sectors = KEY_SLOT_OFFSET.div_ceil(SECTOR);
        let payload = u64::from(self.payload_offset_sector);
        if !detached && payload < header_sectors {
            return bad("LUKS payload is overlapping with the header".into());
        }
        if self.master_key_iterations == 0 {
            return bad("LUKS key iteration count is zero".into());
        }
        for (i, s) in self.key_slots.iter().enumerate() {
            self.check_slot(i, s, detached)?;
        }
        Ok(())
    }

    fn check_slot(&self, i: usize, s: &KeySlot, detached: bool) -> Result<(), CryptoError> {
        let bad = |s: String| Err(CryptoError::Invalid(s));
        if s.stripes != STRIPES {
            return bad(format!(
                "Keyslot {i} is corrupted (stripes {} != {STRIPES})",
                s.stripes
            ));
        }
        if s.active != SLOT_DISABLED && s.active != SLOT_ENABLED {
            return bad(format!("Keyslot {i} state (active/disable) is corrupted"));
        }
        if s.is_active() && s.iterations == 0 {
            return bad(format!("Keyslot {i} iteration count is zero"));
        }
        let start = u64::from(s.key_offset_sector);
        let len = self.split_key_sectors(s.stripes);
        if start < KEY_SLOT_OFFSET.div_ceil(SECTOR) {
            return bad(format!("Keyslot {i} is overlapping with the LUKS header"));
        }
        if !detached && start + len > u64::from(self.payload_offset_sector) {
            return bad(format!(
                "Keyslot {i} is overlapping with the encrypted payload"
            ));
        }
        for (j, t) in self.key_slots.iter().enumerate().skip(i + 1) {
            let start2 = u64::from(t.key_offset_sector);
            let len2 = self.split_key_sectors(t.stripes);
            if start < start2 + len2 && start2 < start + len {
                return bad(format!(
                    "Keyslots {i} and {j} are overlapping in the header"
                ));
            }
        }
        Ok(())
    }

    /// The cipher the strings name (QEMU's qcrypto_block_luks_parse_header), and the
    /// hash of the key derivation.
    pub fn parse_spec(&self) -> Result<(CipherSpec, HashAlg), CryptoError> {
        let bad = |s: String| CryptoError::Invalid(s);
        let mode_str = field_str(&self.cipher_mode);
        let (mode_name, rest) = mode_str
            .split_once('-')
            .ok_or_else(|| bad(format!("Unexpected cipher mode string format '{mode_str}'")))?;
        let (ivgen_name, ivhash_name) = match rest.split_once(':') {
            Some((g, h)) => (g, Some(h)),
            None => (rest, None),
        };
        let hash_of = |n: &str| {
            HashAlg::from_name(n).ok_or_else(|| bad(format!("Hash algorithm {n} not supported")))
        };
        let ivgen_hash = ivhash_name.map(hash_of).transpose()?;
        let mode = CipherMode::from_name(mode_name)
            .ok_or_else(|| bad(format!("Cipher mode {mode_name} not supported")))?;
        let key_len = self.master_key_len as usize / mode.key_factor();
        let alg = CipherAlg::from_luks(&field_str(&self.cipher_name), key_len)?;
        let hash = hash_of(&field_str(&self.hash_spec))?;
        let ivgen = IvGenAlg::from_name(ivgen_name)
            .ok_or_else(|| bad(format!("IV generator {ivgen_name} not supported")))?;
        let ivgen_cipher = match (ivgen, ivgen_hash) {
            (IvGenAlg::Essiv, None) => {
                return Err(bad("Missing IV generator hash specification".into()))
            }
            (IvGenAlg::Essiv, Some(h)) => alg.essiv_cipher(h)?,
            _ => alg,
        };
        let spec = CipherSpec {
            alg,
            mode,
            ivgen,
            ivgen_hash,
            ivgen_cipher,
        };
        Ok((spec, hash))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> LuksHeader {
        let mut b = [0u8; HEADER_LEN];
        b[..6].copy_from_slice(&MAGIC);
        b[7] = 1;
        b[8..11].copy_from_slice(b"aes");
        b[40..51].copy_from_slice(b"xts-plain64");
        b[72..78].copy_from_slice(b"sha256");
        let mut h = LuksHeader::decode(&b);
        h.payload_offset_sector = 4096;
        h.master_key_len = 64;
        h.master_key_iterations = 1000;
        for (i, s) in h.key_slots.iter_mut().enumerate() {
            s.active = SLOT_DISABLED;
            s.stripes = STRIPES;
            s.key_offset_sector = 8 + i as u32 * 504;
        }
        h
    }

    #[test]
    fn encode_is_decode_backwards() {
        let mut h = sample();
        h.key_slots[3].active = SLOT_ENABLED;
        h.key_slots[3].iterations = 12345;
        h.key_slots[3].salt = [9; 32];
        let b = h.encode();
        assert_eq!(LuksHeader::decode(&b), h);
        assert_eq!(be32(&b, 208 + 3 * 48), SLOT_ENABLED);
    }

    #[test]
    fn checks_say_what_qemu_says() {
        let h = sample();
        h.check(false).unwrap();
        let (spec, hash) = h.parse_spec().unwrap();
        assert_eq!(spec.alg, CipherAlg::Aes256);
        assert_eq!(spec.mode, CipherMode::Xts);
        assert_eq!(spec.ivgen, IvGenAlg::Plain64);
        assert_eq!(hash, HashAlg::Sha256);
        let err = |h: &LuksHeader, detached| h.check(detached).unwrap_err().to_string();
        let mut x = h.clone();
        x.magic[0] = b'X';
        assert_eq!(err(&x, false), "Volume is not in LUKS format");
        let mut x = h.clone();
        x.version = 2;
        assert_eq!(err(&x, false), "LUKS version 2 is not supported");
        let mut x = h.clone();
        x.key_slots[2].stripes = 3;
        assert_eq!(err(&x, false), "Keyslot 2 is corrupted (stripes 3 != 4000)");
        let mut x = h.clone();
        x.key_slots[7].key_offset_sector = 4000;
        assert_eq!(
            err(&x, false),
            "Keyslot 7 is overlapping with the encrypted payload"
        );
        x.key_slots[7].key_offset_sector = 5000;
        x.check(true).unwrap();
        let mut x = h.clone();
        x.key_slots[1].key_offset_sector = 10;
        assert_eq!(
            err(&x, false),
            "Keyslots 0 and 1 are overlapping in the header"
        );
        let mut x = h;
        x.cipher_mode = [b'a'; 32];
        assert_eq!(
            err(&x, false),
            "LUKS header cipher mode is not NUL terminated"
        );
    }

    #[test]
    fn cipher_strings_parse_as_qemus() {
        let mut h = sample();
        let set = |h: &mut LuksHeader, m: &str| {
            h.cipher_mode = [0; 32];
            h.cipher_mode[..m.len()].copy_from_slice(m.as_bytes());
        };
        let err = |h: &LuksHeader| h.parse_spec().unwrap_err().to_string();
        set(&mut h, "xts");
        assert_eq!(err(&h), "Unexpected cipher mode string format 'xts'");
        set(&mut h, "gcm-plain64");
        assert_eq!(err(&h), "Cipher mode gcm not supported");
        set(&mut h, "xts-foo");
        assert_eq!(err(&h), "IV generator foo not supported");
        set(&mut h, "xts-essiv");
        assert_eq!(err(&h), "Missing IV generator hash specification");
        set(&mut h, "cbc-essiv:sha256");
        h.master_key_len = 16;
        let (spec, _) = h.parse_spec().unwrap();
        assert_eq!(spec.ivgen_cipher, CipherAlg::Aes256);
        set(&mut h, "cbc-plain:whirlpool");
        assert_eq!(err(&h), "Hash algorithm whirlpool not supported");
    }
}
