//! The credentials objects, `tls-creds-x509` and `tls-creds-psk`: built from their options
//! (their files read at once), and the sessions they make for one connection, server or
//! client side.

use std::path::PathBuf;

use super::error::TlsError;
use super::session::TlsSession;
use super::{psk, x509};
use crate::cli::keyval::KeyVal;

/// Loaded server credentials: what `--object tls-creds-*` made.
pub enum TlsCreds {
    X509(x509::X509Creds),
    Psk(psk::PskCreds),
}

impl TlsCreds {
    /// Builds `kind` (`tls-creds-x509` or `tls-creds-psk`) from its options, reading the
    /// files in `dir` now, so a bad file fails `--object`/`object-add`, as in qsd.
    /// `secret` looks up a `--object secret` by id (for `passwordid`).
    pub fn from_object(
        kind: &str,
        kv: &mut KeyVal,
        secret: &dyn Fn(&str) -> Option<Vec<u8>>,
    ) -> Result<Self, TlsError> {
        let what = kv.what.clone();
        let client = kv
            .take_choice("endpoint", &["server", "client"])?
            .as_deref()
            == Some("client");
        if kv.take("priority").is_some() {
            return Err(TlsError::Unsupported {
                what,
                detail: "priority (a GnuTLS priority string) is not supported: stord uses \
                         rustls's and OpenSSL's safe defaults"
                    .into(),
            });
        }
        // Deprecated in QEMU and without effect: credentials load when created.
        kv.take_bool("loaded", true)?;
        let dir = PathBuf::from(kv.take_required("dir")?);
        match kind {
            "tls-creds-x509" => {
                // The passphrase of an encrypted server-key.pem.
                let password = match kv.take("passwordid") {
                    Some(id) => Some(secret(&id).ok_or_else(|| TlsError::Unsupported {
                        what: what.clone(),
                        detail: format!("passwordid: no secret object with id '{id}'"),
                    })?),
                    None => None,
                };
                let verify_peer = kv.take_bool("verify-peer", true)?;
                // The files are always parsed; this checks our own certificate against
                // the CA too, as QEMU does.
                let sanity_check = kv.take_bool("sanity-check", true)?;
                let load = if client {
                    x509::X509Creds::load_client
                } else {
                    x509::X509Creds::load
                };
                Ok(TlsCreds::X509(load(
                    &what,
                    &dir,
                    verify_peer,
                    sanity_check,
                    password.as_deref(),
                )?))
            }
            _ => {
                let username = kv.take("username");
                if !client {
                    if username.is_some() {
                        return Err(TlsError::Unsupported {
                            what,
                            detail: "username is a client property (endpoint=client)".into(),
                        });
                    }
                    return Ok(TlsCreds::Psk(psk::PskCreds::load(&what, &dir)?));
                }
                // QEMU's default identity.
                let username = username.unwrap_or_else(|| "qemu".into());
                Ok(TlsCreds::Psk(psk::PskCreds::load_client(
                    &what, &dir, &username,
                )?))
            }
        }
    }

    /// Whether these are `endpoint=client` credentials.
    pub fn is_client(&self) -> bool {
        match self {
            TlsCreds::X509(c) => matches!(c, x509::X509Creds::Client { .. }),
            TlsCreds::Psk(c) => c.is_client(),
        }
    }

    /// A new server session for one connection (server credentials).
    pub fn new_session(&self) -> Result<Box<dyn TlsSession>, TlsError> {
        match self {
            TlsCreds::X509(c) => c.new_session(),
            TlsCreds::Psk(c) => c.new_session(),
        }
    }

    /// A new client session for one connection (client credentials); an x509 server's
    /// certificate must name `hostname`, if given.
    pub fn new_client_session(
        &self,
        hostname: Option<&str>,
    ) -> Result<Box<dyn TlsSession>, TlsError> {
        match self {
            TlsCreds::X509(c) => c.new_client_session(hostname),
            TlsCreds::Psk(c) => c.new_session(),
        }
    }
}
