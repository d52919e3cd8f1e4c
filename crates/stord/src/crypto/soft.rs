//! The sector ciphers OpenSSL has no EVP cipher for, from RustCrypto's block ciphers and
//! modes: AES-192 in XTS (OpenSSL makes XTS of AES-128 and AES-256 only), and the
//! Serpent, Twofish and CAST5 volumes QEMU's nettle and gcrypt back ends make. A mode
//! holds its keyed cipher (its schedule zeroed on drop) and runs one sector with the IV
//! it is given; ESSIV's one-block encryption of a sector number also comes from here for
//! the ciphers OpenSSL lacks. The `aes` crate takes AES-NI where the CPU has it.

use cipher::generic_array::GenericArray;
use cipher::{
    BlockCipher, BlockDecrypt, BlockDecryptMut, BlockEncrypt, BlockEncryptMut, BlockSizeUser,
    InnerIvInit, KeyInit, StreamCipher,
};

use super::algs::{CipherAlg, CipherMode};
use super::CryptoError;

/// One sector at a time, with the IV the caller made for it.
pub(super) trait SectorMode: Send + Sync {
    fn encrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError>;
    fn decrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError>;
}

/// One block encrypted in place (ESSIV's IV from a sector number).
pub(super) trait OneBlock: Send + Sync {
    fn encrypt_block(&self, block: &mut [u8]);
}

/// What every cipher here is.
trait Block:
    BlockCipher + BlockEncrypt + BlockDecrypt + KeyInit + Clone + Send + Sync + 'static
{
}

impl<C> Block for C where
    C: BlockCipher + BlockEncrypt + BlockDecrypt + KeyInit + Clone + Send + Sync + 'static
{
}

impl<C: Block> OneBlock for C {
    fn encrypt_block(&self, block: &mut [u8]) {
        BlockEncrypt::encrypt_block(self, GenericArray::from_mut_slice(block));
    }
}

/// `alg` in `mode` keyed with `key` (both keys for XTS), or QEMU's refusal.
pub(super) fn sector_mode(
    alg: CipherAlg,
    mode: CipherMode,
    key: &[u8],
) -> Result<Box<dyn SectorMode>, CryptoError> {
    use CipherAlg::*;
    match alg {
        Aes128 => wide::<aes::Aes128>(mode, key),
        Aes192 => wide::<aes::Aes192>(mode, key),
        Aes256 => wide::<aes::Aes256>(mode, key),
        Serpent128 | Serpent192 | Serpent256 => wide::<serpent::Serpent>(mode, key),
        Twofish128 | Twofish192 | Twofish256 => wide::<twofish::Twofish>(mode, key),
        Cast5_128 => narrow::<cast5::Cast5>(mode, key),
        Sm4 => Err(unsupported_alg(alg)),
    }
}

/// `alg` keyed with `key`, for ESSIV's single blocks.
pub(super) fn one_block(alg: CipherAlg, key: &[u8]) -> Result<Box<dyn OneBlock>, CryptoError> {
    use CipherAlg::*;
    match alg {
        Aes128 => keyed_box::<aes::Aes128>(key),
        Aes192 => keyed_box::<aes::Aes192>(key),
        Aes256 => keyed_box::<aes::Aes256>(key),
        Serpent128 | Serpent192 | Serpent256 => keyed_box::<serpent::Serpent>(key),
        Twofish128 | Twofish192 | Twofish256 => keyed_box::<twofish::Twofish>(key),
        Cast5_128 => keyed_box::<cast5::Cast5>(key),
        Sm4 => Err(unsupported_alg(alg)),
    }
}

fn keyed_box<C: Block>(key: &[u8]) -> Result<Box<dyn OneBlock>, CryptoError> {
    Ok(Box::new(keyed::<C>(key)?))
}

fn keyed<C: Block>(key: &[u8]) -> Result<C, CryptoError> {
    C::new_from_slice(key)
        .map_err(|_| CryptoError::Invalid(format!("Cipher key length {} is invalid", key.len())))
}

fn unsupported_alg(alg: CipherAlg) -> CryptoError {
    CryptoError::Invalid(format!("Unsupported cipher algorithm {}", alg.name()))
}

fn unsupported_mode(mode: CipherMode) -> CryptoError {
    CryptoError::Invalid(format!("Unsupported cipher mode {}", mode.name()))
}

/// A cipher with 16-byte blocks: every mode.
fn wide<C>(mode: CipherMode, key: &[u8]) -> Result<Box<dyn SectorMode>, CryptoError>
where
    C: Block + BlockSizeUser<BlockSize = cipher::consts::U16>,
{
    Ok(match mode {
        CipherMode::Xts => {
            let (k1, k2) = key.split_at(key.len() / 2);
            Box::new(Xts(xts_mode::Xts128::new(keyed::<C>(k1)?, keyed::<C>(k2)?)))
        }
        CipherMode::Cbc => Box::new(Cbc(keyed::<C>(key)?)),
        CipherMode::Ecb => Box::new(Ecb(keyed::<C>(key)?)),
        CipherMode::Ctr => Box::new(Ctr128(keyed::<C>(key)?)),
    })
}

/// A cipher with 8-byte blocks (CAST5): no XTS, as in QEMU.
fn narrow<C>(mode: CipherMode, key: &[u8]) -> Result<Box<dyn SectorMode>, CryptoError>
where
    C: Block + BlockSizeUser<BlockSize = cipher::consts::U8>,
{
    Ok(match mode {
        CipherMode::Xts => return Err(unsupported_mode(mode)),
        CipherMode::Cbc => Box::new(Cbc(keyed::<C>(key)?)),
        CipherMode::Ecb => Box::new(Ecb(keyed::<C>(key)?)),
        CipherMode::Ctr => Box::new(Ctr64(keyed::<C>(key)?)),
    })
}

/// `data`'s length is whole blocks of `block` bytes (QEMU's check, in its words).
fn whole_blocks(data: &[u8], block: usize) -> Result<(), CryptoError> {
    if data.len().is_multiple_of(block) {
        Ok(())
    } else {
        Err(CryptoError::Invalid(format!(
            "Length {} must be a multiple of block size {block}",
            data.len()
        )))
    }
}

struct Xts<C: Block>(xts_mode::Xts128<C>);

impl<C> Xts<C>
where
    C: Block + BlockSizeUser<BlockSize = cipher::consts::U16>,
{
    /// The tweak is the IV (XTS encrypts it under the second key itself).
    fn tweak(iv: &[u8], data: &[u8]) -> Result<[u8; 16], CryptoError> {
        if data.len() < 16 {
            return Err(CryptoError::Invalid(format!(
                "Length {} must be at least the block size 16",
                data.len()
            )));
        }
        let mut t = [0u8; 16];
        t[..iv.len()].copy_from_slice(iv);
        Ok(t)
    }
}

impl<C> SectorMode for Xts<C>
where
    C: Block + BlockSizeUser<BlockSize = cipher::consts::U16>,
{
    fn encrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        let t = Self::tweak(iv, data)?;
        self.0.encrypt_sector(data, t);
        Ok(())
    }

    fn decrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        let t = Self::tweak(iv, data)?;
        self.0.decrypt_sector(data, t);
        Ok(())
    }
}

struct Cbc<C: Block>(C);

impl<C: Block> SectorMode for Cbc<C> {
    fn encrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        let n = C::block_size();
        whole_blocks(data, n)?;
        let mut e =
            cbc::Encryptor::<C>::inner_iv_init(self.0.clone(), GenericArray::from_slice(iv));
        for b in data.chunks_exact_mut(n) {
            e.encrypt_block_mut(GenericArray::from_mut_slice(b));
        }
        Ok(())
    }

    fn decrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        let n = C::block_size();
        whole_blocks(data, n)?;
        let mut d =
            cbc::Decryptor::<C>::inner_iv_init(self.0.clone(), GenericArray::from_slice(iv));
        for b in data.chunks_exact_mut(n) {
            d.decrypt_block_mut(GenericArray::from_mut_slice(b));
        }
        Ok(())
    }
}

/// ECB: the cipher applied to each block, no IV.
struct Ecb<C: Block>(C);

impl<C: Block> SectorMode for Ecb<C> {
    fn encrypt(&self, _iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        let n = C::block_size();
        whole_blocks(data, n)?;
        for b in data.chunks_exact_mut(n) {
            BlockEncrypt::encrypt_block(&self.0, GenericArray::from_mut_slice(b));
        }
        Ok(())
    }

    fn decrypt(&self, _iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        let n = C::block_size();
        whole_blocks(data, n)?;
        for b in data.chunks_exact_mut(n) {
            BlockDecrypt::decrypt_block(&self.0, GenericArray::from_mut_slice(b));
        }
        Ok(())
    }
}

/// CTR over a 16-byte big-endian counter (nettle's ctr_crypt on a 16-byte block).
struct Ctr128<C: Block>(C);

impl<C> SectorMode for Ctr128<C>
where
    C: Block + BlockSizeUser<BlockSize = cipher::consts::U16>,
{
    fn encrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        let core = ctr::CtrCore::<C, ctr::flavors::Ctr128BE>::inner_iv_init(
            self.0.clone(),
            GenericArray::from_slice(iv),
        );
        let mut s = ctr::Ctr128BE::<C>::from_core(core);
        s.apply_keystream(data);
        Ok(())
    }

    fn decrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        self.encrypt(iv, data)
    }
}

/// CTR over an 8-byte big-endian counter (CAST5's block).
struct Ctr64<C: Block>(C);

impl<C> SectorMode for Ctr64<C>
where
    C: Block + BlockSizeUser<BlockSize = cipher::consts::U8>,
{
    fn encrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        let core = ctr::CtrCore::<C, ctr::flavors::Ctr64BE>::inner_iv_init(
            self.0.clone(),
            GenericArray::from_slice(iv),
        );
        let mut s = ctr::Ctr64BE::<C>::from_core(core);
        s.apply_keystream(data);
        Ok(())
    }

    fn decrypt(&self, iv: &[u8], data: &mut [u8]) -> Result<(), CryptoError> {
        self.encrypt(iv, data)
    }
}
