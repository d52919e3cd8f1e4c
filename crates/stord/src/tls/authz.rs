//! `authz-simple`: the one client identity a TLS server admits.

use super::error::TlsError;
use crate::cli::keyval::KeyVal;

/// `--object authz-simple,id=...,identity=...`: the one client identity allowed (the
/// certificate's distinguished name as QEMU writes it, `C=GB,O=...,CN=...`, or the PSK
/// username).
#[derive(Debug)]
pub struct AuthzSimple {
    pub identity: String,
}

impl AuthzSimple {
    pub fn from_object(kv: &mut KeyVal) -> Result<Self, TlsError> {
        Ok(Self {
            identity: kv.take_required("identity")?,
        })
    }

    /// Whether a client that proved `identity` (none: it proved nothing) may connect.
    pub fn allows(&self, identity: Option<&str>) -> bool {
        identity == Some(self.identity.as_str())
    }
}
