//! `--object secret`: a named secret (a key's passphrase, later a LUKS key), given inline
//! (`data=`) or in a file (`file=`), raw or base64, as in qemu-storage-daemon.

use crate::cli::keyval::{KeyVal, OptionError};

/// Why a secret could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("{0}: exactly one of 'data' and 'file' is required")]
    Source(String),
    #[error("{what}: unable to read '{path}': {source}")]
    Read {
        what: String,
        path: String,
        source: std::io::Error,
    },
    #[error("{0}: the secret is not valid base64")]
    Base64(String),
    #[error("{0}: encrypted secrets (keyid, iv) are not supported; give the secret in clear")]
    Encrypted(String),
}

/// A secret's bytes.
pub struct Secret {
    bytes: Vec<u8>,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    pub fn from_object(kv: &mut KeyVal) -> Result<Self, SecretError> {
        let what = kv.what.clone();
        if kv.take("keyid").is_some() || kv.take("iv").is_some() {
            return Err(SecretError::Encrypted(what));
        }
        let base64 = kv.take_choice("format", &["raw", "base64"])?.as_deref() == Some("base64");
        let raw = match (kv.take("data"), kv.take("file")) {
            (Some(d), None) => d.into_bytes(),
            (None, Some(path)) => std::fs::read(&path).map_err(|source| SecretError::Read {
                what: what.clone(),
                path,
                source,
            })?,
            _ => return Err(SecretError::Source(what)),
        };
        let bytes = if base64 {
            let text = String::from_utf8_lossy(&raw);
            openssl::base64::decode_block(text.trim()).map_err(|_| SecretError::Base64(what))?
        } else {
            raw
        };
        Ok(Self { bytes })
    }

    /// The secret.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(s: &str) -> Result<Secret, SecretError> {
        let mut kv = KeyVal::parse("--object", s, None).unwrap();
        Secret::from_object(&mut kv)
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
            .contains("exactly one"));
        assert!(make("data=a,file=/x")
            .unwrap_err()
            .to_string()
            .contains("exactly one"));
        assert!(make("data=!!,format=base64")
            .unwrap_err()
            .to_string()
            .contains("base64"));
        assert!(make("data=a,keyid=k")
            .unwrap_err()
            .to_string()
            .contains("encrypted"));
        assert!(make("file=/nonexistent/s")
            .unwrap_err()
            .to_string()
            .contains("unable to read"));
    }
}
