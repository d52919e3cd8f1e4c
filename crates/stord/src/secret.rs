//! `--object secret`: a named secret (a key's passphrase, a LUKS volume's password),
//! given inline (`data=`) or in a file (`file=`), raw or base64, and optionally encrypted
//! with another secret (`keyid=`, `iv=`: AES-256-CBC as QEMU's secret objects decrypt
//! them), as in qemu-storage-daemon.

use crate::cli::keyval::{KeyVal, OptionError};

/// Why a secret could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("{0}: Either 'file' or 'data' must be provided")]
    NoSource(String),
    #[error("{0}: 'file' and 'data' are mutually exclusive")]
    TwoSources(String),
    #[error("{what}: unable to read '{path}': {source}")]
    Read {
        what: String,
        path: String,
        source: std::io::Error,
    },
    #[error("{0}: the secret is not valid base64")]
    Base64(String),
    /// An encrypted secret that does not decrypt (QEMU's texts).
    #[error("{0}")]
    Decrypt(String),
}

/// A secret's bytes.
pub struct Secret {
    bytes: zeroize::Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// The secret the options give; `keys` looks up the secret an encrypted one names.
    pub fn from_object(
        kv: &mut KeyVal,
        keys: &dyn Fn(&str) -> Option<Vec<u8>>,
    ) -> Result<Self, SecretError> {
        let what = kv.what.clone();
        let keyid = kv.take("keyid");
        let iv = kv.take("iv");
        let base64 = kv.take_choice("format", &["raw", "base64"])?.as_deref() == Some("base64");
        let raw = match (kv.take("data"), kv.take("file")) {
            (Some(d), None) => d.into_bytes(),
            (None, Some(path)) => std::fs::read(&path).map_err(|source| SecretError::Read {
                what: what.clone(),
                path,
                source,
            })?,
            (None, None) => return Err(SecretError::NoSource(what)),
            (Some(_), Some(_)) => return Err(SecretError::TwoSources(what)),
        };
        let bytes = if base64 {
            let text = String::from_utf8_lossy(&raw);
            openssl::base64::decode_block(text.trim()).map_err(|_| SecretError::Base64(what))?
        } else {
            raw
        };
        let bytes = match keyid {
            Some(id) => decrypt(&bytes, &id, iv.as_deref(), keys).map_err(SecretError::Decrypt)?,
            None => bytes,
        };
        Ok(Self {
            bytes: zeroize::Zeroizing::new(bytes),
        })
    }

    /// The secret.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// QEMU's qcrypto_secret_decrypt: AES-256-CBC under the secret `keyid` (32 bytes) with
/// `iv` (base64, 16 bytes), the padding's length taken from the last byte.
fn decrypt(
    data: &[u8],
    keyid: &str,
    iv: Option<&str>,
    keys: &dyn Fn(&str) -> Option<Vec<u8>>,
) -> Result<Vec<u8>, String> {
    let key =
        zeroize::Zeroizing::new(keys(keyid).ok_or_else(|| format!("No secret with id '{keyid}'"))?);
    if key.len() != 32 {
        return Err("Key should be 32 bytes in length".into());
    }
    let iv = iv.ok_or("IV is required to decrypt secret")?;
    let iv = openssl::base64::decode_block(iv.trim())
        .map_err(|_| "Base64 data contains invalid characters".to_string())?;
    if iv.len() != 16 {
        return Err(format!("IV should be 16 bytes in length not {}", iv.len()));
    }
    if data.is_empty() || !data.len().is_multiple_of(16) {
        return Err(format!(
            "Length {} must be a multiple of the block size 16",
            data.len()
        ));
    }
    let mut c = openssl::symm::Crypter::new(
        openssl::symm::Cipher::aes_256_cbc(),
        openssl::symm::Mode::Decrypt,
        &key,
        Some(&iv),
    )
    .map_err(|e| format!("Cannot initialize cipher: {e}"))?;
    c.pad(false);
    let mut plain = zeroize::Zeroizing::new(vec![0u8; data.len() + 16]);
    let n = c
        .update(data, &mut plain)
        .map_err(|e| format!("Cannot decrypt secret: {e}"))?;
    let pad = plain[n - 1] as usize;
    if pad > 16 || pad > n {
        return Err(format!(
            "Incorrect number of padding bytes ({pad}) found on decrypted data"
        ));
    }
    Ok(plain[..n - pad].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(s: &str) -> Result<Secret, SecretError> {
        let mut kv = KeyVal::parse("--object", s, None).unwrap();
        // The key of the encrypted secrets below: bytes 0..32.
        Secret::from_object(&mut kv, &|id| (id == "k").then(|| (0..32).collect()))
    }

    #[test]
    fn data_raw_and_base64() {
        assert_eq!(make("data=letmein").unwrap().bytes(), b"letmein");
        assert_eq!(
            make("data=bGV0bWVpbg==,format=base64").unwrap().bytes(),
            b"letmein"
        );
    }

    #[test]
    fn errors_name_the_problem() {
        assert!(make("format=raw")
            .unwrap_err()
            .to_string()
            .contains("Either 'file' or 'data' must be provided"));
        assert!(make("data=a,file=/x")
            .unwrap_err()
            .to_string()
            .contains("'file' and 'data' are mutually exclusive"));
        assert!(make("data=!!,format=base64")
            .unwrap_err()
            .to_string()
            .contains("base64"));
        assert!(make("data=a,keyid=k")
            .unwrap_err()
            .to_string()
            .contains("IV is required"));
        assert!(make("data=a,keyid=x,iv=AAAAAAAAAAAAAAAAAAAAAA==")
            .unwrap_err()
            .to_string()
            .contains("No secret with id 'x'"));
        assert!(make("file=/nonexistent/s")
            .unwrap_err()
            .to_string()
            .contains("unable to read"));
    }

    #[test]
    fn encrypted_secrets_decrypt_as_qemus() {
        // "letmein" under AES-256-CBC with key 0..32 and IV 0..16, PKCS#7 padded (what
        // libvirt sends QEMU), made here with OpenSSL's padding.
        let key: Vec<u8> = (0..32).collect();
        let iv: Vec<u8> = (0..16).collect();
        let ct = openssl::symm::encrypt(
            openssl::symm::Cipher::aes_256_cbc(),
            &key,
            Some(&iv),
            b"letmein",
        )
        .unwrap();
        let opts = format!(
            "data={},format=base64,keyid=k,iv={}",
            openssl::base64::encode_block(&ct),
            openssl::base64::encode_block(&iv)
        );
        assert_eq!(make(&opts).unwrap().bytes(), b"letmein");
        let bad_iv = format!(
            "data={},format=base64,keyid=k,iv=AAAA",
            openssl::base64::encode_block(&ct)
        );
        let e = make(&bad_iv).unwrap_err().to_string();
        assert_eq!(e, "IV should be 16 bytes in length not 3");
    }
}
