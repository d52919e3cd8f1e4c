//! The algorithms QEMU names (QAPI's QCryptoCipherAlgo, QCryptoCipherMode,
//! QCryptoIVGenAlgo and QCryptoHashAlgo), with QEMU's spellings, and what OpenSSL gives
//! for each. The ciphers OpenSSL lacks (serpent, twofish, cast5) run on RustCrypto's;
//! SM4, which QEMU's own builds here refuse, runs where OpenSSL has it.

use openssl::hash::MessageDigest;

use super::CryptoError;

/// A block cipher with its key size (QCryptoCipherAlgo).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CipherAlg {
    Aes128,
    Aes192,
    Aes256,
    Cast5_128,
    Serpent128,
    Serpent192,
    Serpent256,
    Twofish128,
    Twofish192,
    Twofish256,
    Sm4,
}

/// Every cipher, with QEMU's name, LUKS's family name and key length.
const CIPHERS: &[(CipherAlg, &str, &str, usize)] = &[
    (CipherAlg::Aes128, "aes-128", "aes", 16),
    (CipherAlg::Aes192, "aes-192", "aes", 24),
    (CipherAlg::Aes256, "aes-256", "aes", 32),
    (CipherAlg::Cast5_128, "cast5-128", "cast5", 16),
    (CipherAlg::Serpent128, "serpent-128", "serpent", 16),
    (CipherAlg::Serpent192, "serpent-192", "serpent", 24),
    (CipherAlg::Serpent256, "serpent-256", "serpent", 32),
    (CipherAlg::Twofish128, "twofish-128", "twofish", 16),
    (CipherAlg::Twofish192, "twofish-192", "twofish", 24),
    (CipherAlg::Twofish256, "twofish-256", "twofish", 32),
    (CipherAlg::Sm4, "sm4", "sm4", 16),
];

impl CipherAlg {
    fn entry(self) -> &'static (CipherAlg, &'static str, &'static str, usize) {
        CIPHERS
            .iter()
            .find(|c| c.0 == self)
            .expect("every cipher is listed")
    }

    /// QEMU's name (`aes-256`).
    pub fn name(self) -> &'static str {
        self.entry().1
    }

    /// The name a LUKS header stores (`aes`).
    pub fn luks_name(self) -> &'static str {
        self.entry().2
    }

    /// The key length in bytes (one key: XTS takes two).
    pub fn key_len(self) -> usize {
        self.entry().3
    }

    /// The cipher's block length.
    pub fn block_len(self) -> usize {
        if self == CipherAlg::Cast5_128 {
            8
        } else {
            16
        }
    }

    /// By QEMU's name.
    pub fn from_name(name: &str) -> Option<Self> {
        CIPHERS.iter().find(|c| c.1 == name).map(|c| c.0)
    }

    /// By a LUKS header's family name and key length, as QEMU looks it up.
    pub fn from_luks(name: &str, key_len: usize) -> Result<Self, CryptoError> {
        CIPHERS
            .iter()
            .find(|c| c.2 == name && c.3 == key_len)
            .map(|c| c.0)
            .ok_or_else(|| {
                CryptoError::Invalid(format!(
                    "Algorithm {name} with key size {key_len} bytes not supported"
                ))
            })
    }

    /// The AES variant whose key is `len` bytes long.
    fn aes_of_len(len: usize) -> Option<Self> {
        [CipherAlg::Aes128, CipherAlg::Aes192, CipherAlg::Aes256]
            .into_iter()
            .find(|a| a.key_len() == len)
    }

    /// dm-crypt's ESSIV quirk as QEMU follows it: the IV cipher takes the hash's digest as
    /// its key, so it is the member of the data cipher's family with that key length.
    pub fn essiv_cipher(self, hash: HashAlg) -> Result<Self, CryptoError> {
        let digest = hash.digest_len();
        if digest == self.key_len() {
            return Ok(self);
        }
        let family = self.luks_name();
        let found = match family {
            "aes" => Self::aes_of_len(digest),
            "serpent" | "twofish" => CIPHERS
                .iter()
                .find(|c| c.2 == family && c.3 == digest)
                .map(|c| c.0),
            _ => {
                return Err(CryptoError::Invalid(format!(
                    "Cipher {} not supported with essiv",
                    self.name()
                )))
            }
        };
        let label = match family {
            "aes" => "AES",
            "serpent" => "Serpent",
            _ => "Twofish",
        };
        found.ok_or_else(|| {
            CryptoError::Invalid(format!(
                "No {label} cipher with key size {digest} available"
            ))
        })
    }
}

/// A block cipher mode (QCryptoCipherMode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CipherMode {
    Ecb,
    Cbc,
    Xts,
    Ctr,
}

impl CipherMode {
    pub const NAMES: &'static [&'static str] = &["ecb", "cbc", "xts", "ctr"];

    pub fn name(self) -> &'static str {
        match self {
            CipherMode::Ecb => "ecb",
            CipherMode::Cbc => "cbc",
            CipherMode::Xts => "xts",
            CipherMode::Ctr => "ctr",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Ecb, Self::Cbc, Self::Xts, Self::Ctr]
            .into_iter()
            .find(|m| m.name() == name)
    }

    /// Keys are this many times the cipher's key (XTS: two keys).
    pub fn key_factor(self) -> usize {
        if self == CipherMode::Xts {
            2
        } else {
            1
        }
    }
}

/// How each sector's IV is made (QCryptoIVGenAlgo).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IvGenAlg {
    Plain,
    Plain64,
    Essiv,
}

impl IvGenAlg {
    pub const NAMES: &'static [&'static str] = &["plain", "plain64", "essiv"];

    pub fn name(self) -> &'static str {
        match self {
            IvGenAlg::Plain => "plain",
            IvGenAlg::Plain64 => "plain64",
            IvGenAlg::Essiv => "essiv",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Plain, Self::Plain64, Self::Essiv]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// A hash (QCryptoHashAlgo).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    Md5,
    Sha1,
    Sha224,
    Sha256,
    Sha384,
    Sha512,
    Ripemd160,
    Sm3,
}

const HASHES: &[(HashAlg, &str, usize)] = &[
    (HashAlg::Md5, "md5", 16),
    (HashAlg::Sha1, "sha1", 20),
    (HashAlg::Sha224, "sha224", 28),
    (HashAlg::Sha256, "sha256", 32),
    (HashAlg::Sha384, "sha384", 48),
    (HashAlg::Sha512, "sha512", 64),
    (HashAlg::Ripemd160, "ripemd160", 20),
    (HashAlg::Sm3, "sm3", 32),
];

impl HashAlg {
    pub fn names() -> Vec<&'static str> {
        HASHES.iter().map(|h| h.1).collect()
    }

    pub fn name(self) -> &'static str {
        HASHES.iter().find(|h| h.0 == self).map_or("", |h| h.1)
    }

    pub fn from_name(name: &str) -> Option<Self> {
        HASHES.iter().find(|h| h.1 == name).map(|h| h.0)
    }

    pub fn digest_len(self) -> usize {
        HASHES.iter().find(|h| h.0 == self).map_or(0, |h| h.2)
    }

    /// OpenSSL's digest, if it has this one.
    pub fn digest(self) -> Result<MessageDigest, CryptoError> {
        MessageDigest::from_name(self.name()).ok_or_else(|| {
            CryptoError::Invalid(format!("Hash algorithm {} not supported", self.name()))
        })
    }
}

/// QAPI's names of the ciphers, for the schema's enum.
pub fn cipher_names() -> Vec<&'static str> {
    CIPHERS.iter().map(|c| c.1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn luks_names_and_key_sizes_map_as_qemus() {
        assert_eq!(CipherAlg::from_luks("aes", 32).unwrap(), CipherAlg::Aes256);
        assert_eq!(
            CipherAlg::from_luks("serpent", 16).unwrap(),
            CipherAlg::Serpent128
        );
        let e = CipherAlg::from_luks("aes", 20).unwrap_err().to_string();
        assert_eq!(e, "Algorithm aes with key size 20 bytes not supported");
        assert!(CipherAlg::from_luks("blowfish", 16).is_err());
    }

    #[test]
    fn essiv_takes_the_cipher_whose_key_is_the_digest() {
        let a = CipherAlg::Aes128.essiv_cipher(HashAlg::Sha256).unwrap();
        assert_eq!(a, CipherAlg::Aes256);
        let a = CipherAlg::Aes256.essiv_cipher(HashAlg::Md5).unwrap();
        assert_eq!(a, CipherAlg::Aes128);
        let e = CipherAlg::Aes256.essiv_cipher(HashAlg::Sha1).unwrap_err();
        assert_eq!(e.to_string(), "No AES cipher with key size 20 available");
        let e = CipherAlg::Cast5_128
            .essiv_cipher(HashAlg::Sha256)
            .unwrap_err();
        assert_eq!(e.to_string(), "Cipher cast5-128 not supported with essiv");
    }

    #[test]
    fn openssl_has_the_hashes_luks_images_use() {
        for h in [
            HashAlg::Sha1,
            HashAlg::Sha256,
            HashAlg::Sha512,
            HashAlg::Md5,
        ] {
            assert_eq!(h.digest().unwrap().size(), h.digest_len(), "{}", h.name());
        }
    }
}
