//! The sector cipher (QEMU's QCryptoBlock cipher with its IV generator): encrypts and
//! decrypts a run of 512-byte sectors in place, each sector with the IV its number gives
//! (QEMU's qcrypto_block_cipher_encrypt_helper). Where OpenSSL has the cipher and mode,
//! the key schedule is made once per run on its EVP path (AES-NI where the CPU has it)
//! and only the IV is set again per sector; ECB, which has no IV, takes the run whole.
//! The rest (AES-192-XTS, Serpent, Twofish, CAST5) and ESSIV's IVs come from RustCrypto
//! ([`super::soft`]).
//!
//! OpenSSL's contexts cannot move between threads, so each run makes its own from the
//! fetched cipher and the key this holds; the key is wiped when this is dropped.

use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;
use zeroize::{Zeroize, Zeroizing};

use super::algs::{CipherAlg, CipherMode, HashAlg, IvGenAlg};
use super::soft::{self, OneBlock, SectorMode};
use super::CryptoError;

/// The unit of encryption: each sector has its own IV.
pub const SECTOR_SIZE: usize = 512;

/// What the data is encrypted with: cipher, mode and IV generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CipherSpec {
    pub alg: CipherAlg,
    pub mode: CipherMode,
    pub ivgen: IvGenAlg,
    /// The hash ESSIV keys its cipher with (kept when another IV generator names one, as
    /// dm-crypt ignores it).
    pub ivgen_hash: Option<HashAlg>,
    /// ESSIV's cipher (the data cipher for the other generators).
    pub ivgen_cipher: CipherAlg,
}

impl CipherSpec {
    /// The IV length (none for ECB; the cipher's block otherwise).
    pub fn iv_len(&self) -> usize {
        if self.mode == CipherMode::Ecb {
            0
        } else {
            self.alg.block_len()
        }
    }

    /// The key length this spec takes (both keys for XTS).
    pub fn key_len(&self) -> usize {
        self.alg.key_len() * self.mode.key_factor()
    }
}

/// OpenSSL's cipher for `alg` in `mode`, where it has one.
fn fetch(alg: CipherAlg, mode: CipherMode) -> Option<Cipher> {
    let name = match alg.luks_name() {
        "aes" => format!("AES-{}-{}", alg.key_len() * 8, mode.name()),
        "sm4" => format!("SM4-{}", mode.name()),
        _ => return None,
    };
    Cipher::fetch(None, &name.to_uppercase(), None).ok()
}

/// What runs the data cipher: OpenSSL's EVP where it has the cipher and mode, RustCrypto's
/// otherwise (AES-192-XTS, Serpent, Twofish, CAST5).
enum Engine {
    Evp {
        cipher: Cipher,
        key: Zeroizing<Vec<u8>>,
    },
    Soft(Box<dyn SectorMode>),
}

impl Engine {
    fn new(spec: &CipherSpec, key: &[u8]) -> Result<Self, CryptoError> {
        Ok(match fetch(spec.alg, spec.mode) {
            Some(cipher) => Engine::Evp {
                cipher,
                key: Zeroizing::new(key.to_vec()),
            },
            None => Engine::Soft(soft::sector_mode(spec.alg, spec.mode, key)?),
        })
    }
}

/// How each sector's IV is made.
enum IvGen {
    Plain,
    Plain64,
    /// The sector number encrypted (ECB) under the hash of the key.
    Essiv {
        cipher: Box<dyn OneBlock>,
        block: usize,
    },
}

/// See the module docs.
pub struct SectorCipher {
    spec: CipherSpec,
    engine: Engine,
    ivgen: IvGen,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SectorCipher")
            .field("spec", &self.spec)
            .finish()
    }
}

impl SectorCipher {
    /// A cipher for `spec` with `key` (checked against the spec's length, QEMU's texts).
    pub fn new(spec: &CipherSpec, key: &[u8]) -> Result<Self, CryptoError> {
        if spec.mode == CipherMode::Xts && !key.len().is_multiple_of(2) {
            return Err(CryptoError::Invalid(
                "XTS cipher key length should be a multiple of 2".into(),
            ));
        }
        let want = spec.key_len();
        if key.len() != want {
            let f = spec.mode.key_factor();
            return Err(CryptoError::Invalid(format!(
                "Cipher key length {} should be {}",
                key.len() / f,
                want / f
            )));
        }
        let engine = Engine::new(spec, key)?;
        let ivgen = match spec.ivgen {
            IvGenAlg::Plain => IvGen::Plain,
            IvGenAlg::Plain64 => IvGen::Plain64,
            IvGenAlg::Essiv => essiv(spec, key)?,
        };
        Ok(Self {
            spec: *spec,
            engine,
            ivgen,
        })
    }

    /// What this encrypts with.
    pub fn spec(&self) -> &CipherSpec {
        &self.spec
    }

    /// Encrypts `buf` in place; its first byte is the start of sector `sector`. Whole
    /// sectors, but for a last short one (key material of some key sizes).
    pub fn encrypt(&self, sector: u64, buf: &mut [u8]) -> Result<(), CryptoError> {
        self.run(true, sector, buf)
    }

    /// Decrypts `buf` in place, as [`encrypt`](Self::encrypt).
    pub fn decrypt(&self, sector: u64, buf: &mut [u8]) -> Result<(), CryptoError> {
        self.run(false, sector, buf)
    }

    fn run(&self, encrypt: bool, sector: u64, buf: &mut [u8]) -> Result<(), CryptoError> {
        match &self.engine {
            Engine::Evp { cipher, key } => self.run_evp(cipher, key, encrypt, sector, buf),
            Engine::Soft(mode) => self.run_soft(mode.as_ref(), encrypt, sector, buf),
        }
    }

    /// One OpenSSL context for the run, keyed once; only the IV is set again per sector.
    fn run_evp(
        &self,
        cipher: &Cipher,
        key: &[u8],
        encrypt: bool,
        sector: u64,
        buf: &mut [u8],
    ) -> Result<(), CryptoError> {
        let mut ctx = context(cipher, key, encrypt)?;
        let niv = self.spec.iv_len();
        if niv == 0 {
            return update(&mut ctx, buf);
        }
        let mut iv = [0u8; 16];
        for (i, chunk) in buf.chunks_mut(SECTOR_SIZE).enumerate() {
            self.iv(sector.wrapping_add(i as u64), &mut iv[..niv]);
            let set = if encrypt {
                ctx.encrypt_init(None, None, Some(&iv[..niv]))
            } else {
                ctx.decrypt_init(None, None, Some(&iv[..niv]))
            };
            set.map_err(CryptoError::backend("Unable to set the cipher IV"))?;
            update(&mut ctx, chunk)?;
        }
        Ok(())
    }

    fn run_soft(
        &self,
        mode: &dyn SectorMode,
        encrypt: bool,
        sector: u64,
        buf: &mut [u8],
    ) -> Result<(), CryptoError> {
        let niv = self.spec.iv_len();
        let mut iv = [0u8; 16];
        for (i, chunk) in buf.chunks_mut(SECTOR_SIZE).enumerate() {
            self.iv(sector.wrapping_add(i as u64), &mut iv[..niv]);
            if encrypt {
                mode.encrypt(&iv[..niv], chunk)?;
            } else {
                mode.decrypt(&iv[..niv], chunk)?;
            }
        }
        Ok(())
    }

    /// Sector `sector`'s IV (QEMU's ivgen-plain, -plain64, -essiv).
    fn iv(&self, sector: u64, iv: &mut [u8]) {
        iv.fill(0);
        match &self.ivgen {
            IvGen::Plain => {
                let b = (sector as u32).to_le_bytes();
                let n = iv.len().min(4);
                iv[..n].copy_from_slice(&b[..n]);
            }
            IvGen::Plain64 => {
                let b = sector.to_le_bytes();
                let n = iv.len().min(8);
                iv[..n].copy_from_slice(&b[..n]);
            }
            IvGen::Essiv { cipher, block } => {
                let mut data = Zeroizing::new([0u8; 16]);
                data[..8].copy_from_slice(&sector.to_le_bytes());
                cipher.encrypt_block(&mut data[..*block]);
                let n = iv.len().min(*block);
                iv[..n].copy_from_slice(&data[..n]);
            }
        }
    }
}

/// An OpenSSL context for `cipher`, keyed, without padding.
fn context(cipher: &Cipher, key: &[u8], encrypt: bool) -> Result<CipherCtx, CryptoError> {
    let err = CryptoError::backend("Unable to initialize the cipher");
    let mut ctx = CipherCtx::new().map_err(err)?;
    let init = if encrypt {
        ctx.encrypt_init(Some(cipher), Some(key), None)
    } else {
        ctx.decrypt_init(Some(cipher), Some(key), None)
    };
    init.map_err(err)?;
    ctx.set_padding(false);
    Ok(ctx)
}

/// ESSIV's cipher, keyed with the hash of the whole key (QEMU's qcrypto_ivgen_essiv_init).
fn essiv(spec: &CipherSpec, key: &[u8]) -> Result<IvGen, CryptoError> {
    let hash = spec
        .ivgen_hash
        .ok_or_else(|| CryptoError::Invalid("Missing IV generator hash specification".into()))?;
    let digest = openssl::hash::hash(hash.digest()?, key)
        .map_err(CryptoError::backend("Unable to hash the key"))?;
    let nkey = spec.ivgen_cipher.key_len().min(digest.len());
    let salt = Zeroizing::new(digest[..nkey].to_vec());
    Ok(IvGen::Essiv {
        cipher: soft::one_block(spec.ivgen_cipher, &salt)?,
        block: spec.ivgen_cipher.block_len(),
    })
}

/// Runs `data` through `ctx` in place. Ciphers with blocks (CBC, ECB) go through a
/// scratch sector, as OpenSSL's in-place call wants room for a block more.
fn update(ctx: &mut CipherCtx, data: &mut [u8]) -> Result<(), CryptoError> {
    let err = CryptoError::backend("Unable to run the cipher");
    if ctx.block_size() <= 1 {
        let n = ctx.cipher_update_inplace(data, data.len()).map_err(err)?;
        return short(n, data.len());
    }
    let mut scratch = Zeroizing::new([0u8; SECTOR_SIZE + 32]);
    for chunk in data.chunks_mut(SECTOR_SIZE) {
        let n = ctx
            .cipher_update(chunk, Some(&mut scratch[..]))
            .map_err(err)?;
        short(n, chunk.len())?;
        chunk.copy_from_slice(&scratch[..n]);
    }
    scratch.zeroize();
    Ok(())
}

fn short(n: usize, want: usize) -> Result<(), CryptoError> {
    if n == want {
        Ok(())
    } else {
        Err(CryptoError::Invalid(format!(
            "Length {want} must be a multiple of the cipher's block size"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(alg: CipherAlg, mode: CipherMode, ivgen: IvGenAlg) -> CipherSpec {
        let ivgen_hash = (ivgen == IvGenAlg::Essiv).then_some(HashAlg::Sha256);
        let ivgen_cipher = match ivgen_hash {
            Some(h) => alg.essiv_cipher(h).unwrap(),
            None => alg,
        };
        CipherSpec {
            alg,
            mode,
            ivgen,
            ivgen_hash,
            ivgen_cipher,
        }
    }

    #[test]
    fn runs_round_trip_and_sectors_differ() {
        use CipherAlg::*;
        use CipherMode::*;
        use IvGenAlg::*;
        for (a, m, i) in [
            (Aes256, Xts, Plain64),
            (Aes128, Xts, Plain),
            (Aes128, Cbc, Essiv),
            (Aes256, Cbc, Plain),
            (Aes192, Cbc, Plain64),
            (Aes256, Ecb, Plain64),
            (Aes256, Ctr, Plain64),
            (Aes192, Xts, Plain64),
            (Serpent256, Xts, Plain64),
            (Serpent128, Cbc, Essiv),
            (Twofish192, Xts, Plain),
            (Twofish256, Ctr, Plain64),
            (Cast5_128, Cbc, Plain64),
            (Cast5_128, Ctr, Plain64),
            (Cast5_128, Ecb, Plain64),
        ] {
            let s = spec(a, m, i);
            let key: Vec<u8> = (0..s.key_len() as u8).map(|b| b.wrapping_mul(7)).collect();
            let c = SectorCipher::new(&s, &key).unwrap();
            let plain = vec![0x5au8; 4 * SECTOR_SIZE];
            let mut buf = plain.clone();
            c.encrypt(10, &mut buf).unwrap();
            assert_ne!(buf, plain);
            if m != Ecb {
                // The same plaintext in two sectors encrypts differently.
                assert_ne!(buf[..SECTOR_SIZE], buf[SECTOR_SIZE..2 * SECTOR_SIZE]);
            }
            // A run is the same as its sectors one by one.
            let mut one = plain[SECTOR_SIZE..2 * SECTOR_SIZE].to_vec();
            c.encrypt(11, &mut one).unwrap();
            assert_eq!(one, buf[SECTOR_SIZE..2 * SECTOR_SIZE]);
            c.decrypt(10, &mut buf).unwrap();
            assert_eq!(buf, plain, "{a:?} {m:?} {i:?}");
        }
    }

    #[test]
    fn xts_plain64_is_the_standard_construction() {
        // IEEE 1619 vector 10 (AES-256-XTS, data unit 0xff): the tweak is the
        // little-endian sector number, as plain64 makes it.
        let key1 = "2718281828459045235360287471352662497757247093699959574966967627";
        let key2 = "3141592653589793238462643383279502884197169399375105820974944592";
        let key = hex(&format!("{key1}{key2}"));
        let c = SectorCipher::new(
            &spec(CipherAlg::Aes256, CipherMode::Xts, IvGenAlg::Plain64),
            &key,
        )
        .unwrap();
        let mut buf: Vec<u8> = (0..512).map(|i| i as u8).collect();
        c.encrypt(0xff, &mut buf).unwrap();
        assert_eq!(hex_of(&buf[..16]), "1c3b3a102f770386e4836c99e370cf9b");
    }

    #[test]
    fn rustcryptos_modes_agree_with_openssls() {
        use CipherAlg::*;
        use CipherMode::*;
        use IvGenAlg::*;
        for (a, m, i) in [
            (Aes256, Xts, Plain64),
            (Aes128, Xts, Plain),
            (Aes128, Cbc, Essiv),
            (Aes192, Cbc, Plain64),
            (Aes256, Ecb, Plain64),
            (Aes256, Ctr, Plain64),
        ] {
            let s = spec(a, m, i);
            let key: Vec<u8> = (0..s.key_len() as u8).map(|b| b ^ 0xa5).collect();
            let evp = SectorCipher::new(&s, &key).unwrap();
            assert!(matches!(evp.engine, Engine::Evp { .. }), "{a:?} {m:?}");
            let soft = SectorCipher {
                engine: Engine::Soft(soft::sector_mode(a, m, &key).unwrap()),
                ..SectorCipher::new(&s, &key).unwrap()
            };
            let plain: Vec<u8> = (0..8 * SECTOR_SIZE).map(|b| (b * 31 % 251) as u8).collect();
            let (mut x, mut y) = (plain.clone(), plain.clone());
            evp.encrypt(77, &mut x).unwrap();
            soft.encrypt(77, &mut y).unwrap();
            assert_eq!(x, y, "{a:?} {m:?} {i:?}");
            soft.decrypt(77, &mut x).unwrap();
            assert_eq!(x, plain);
        }
    }

    #[test]
    fn wrong_key_lengths_are_refused_with_qemus_words() {
        let s = spec(CipherAlg::Aes256, CipherMode::Xts, IvGenAlg::Plain64);
        let e = SectorCipher::new(&s, &[0; 63]).unwrap_err().to_string();
        assert_eq!(e, "XTS cipher key length should be a multiple of 2");
        let e = SectorCipher::new(&s, &[0; 32]).unwrap_err().to_string();
        assert_eq!(e, "Cipher key length 16 should be 32");
        let s = spec(CipherAlg::Cast5_128, CipherMode::Xts, IvGenAlg::Plain64);
        let e = SectorCipher::new(&s, &[0; 32]).unwrap_err().to_string();
        assert_eq!(e, "Unsupported cipher mode xts");
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn hex_of(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}
