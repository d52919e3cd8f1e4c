//! Block encryption as QEMU's crypto/ does it: the LUKS1 format ([`luks`]: its header,
//! key slots, creation and key changes), and the sector cipher that encrypts and
//! decrypts runs of 512-byte sectors in place by sector number ([`cipher`], QEMU's
//! qcrypto_block_encrypt/decrypt), which the `luks` block driver uses for its payload and
//! qcow2's `encrypt.format=luks` can use per cluster.
//!
//! It sits below the block layer and knows nothing of nodes: reads and writes of a
//! header come in as closures or go out as buffers for the caller to write. No primitive
//! is written here: OpenSSL's EVP ciphers (AES-NI), PBKDF2, digests and random bytes, and
//! RustCrypto's block ciphers and modes for what OpenSSL lacks (AES-192-XTS, Serpent,
//! Twofish, CAST5: [`soft`]); keys live in zeroed-on-drop buffers and never reach a log,
//! an error text or QMP.

pub mod afsplit;
pub mod algs;
pub mod cipher;
#[cfg(any(test, fuzzing))]
pub mod fuzz;
pub mod luks;
pub mod pbkdf;
mod soft;

/// Why an encryption step failed; texts are QEMU's.
#[derive(Debug, thiserror::Error)]
pub enum CryptoError {
    /// A header, option or parameter QEMU refuses, in its words.
    #[error("{0}")]
    Invalid(String),
    /// No key slot opens with the password.
    #[error("Invalid password, cannot unlock any keyslot")]
    BadPassword,
    /// Reading or writing the header failed.
    #[error("{0}")]
    Io(String),
    /// OpenSSL failed (its error stack names no key).
    #[error("{what}: {source}")]
    Backend {
        what: &'static str,
        source: openssl::error::ErrorStack,
    },
}

impl CryptoError {
    fn backend(what: &'static str) -> impl Fn(openssl::error::ErrorStack) -> Self + Copy {
        move |source| CryptoError::Backend { what, source }
    }
}

/// Random bytes for salts, stripes and keys (OpenSSL's generator).
pub fn random_bytes(buf: &mut [u8]) -> Result<(), CryptoError> {
    openssl::rand::rand_priv_bytes(buf).map_err(CryptoError::backend("Unable to read random bytes"))
}
