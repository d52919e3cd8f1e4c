//! `tls-creds-x509`: a CA, a server certificate and key from qsd's file names, served by
//! rustls; client certificates checked against the CA (and its CRL) when `verify-peer=on`.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig, ServerConnection};

use super::session::{RustlsSession, TlsSession};
use super::TlsError;

/// Loaded x509 server credentials.
pub struct X509Creds {
    /// Requires client certificates when `verify-peer=on`.
    config: Arc<ServerConfig>,
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what: what.into(),
        path: path.into(),
        source,
    })
}

fn bad(what: &str, path: &Path, detail: impl ToString) -> TlsError {
    TlsError::BadFile {
        what: what.into(),
        path: path.into(),
        detail: detail.to_string(),
    }
}

fn certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(what, path, e))?;
    if certs.is_empty() {
        return Err(bad(what, path, "no certificate in the file"));
    }
    Ok(certs)
}

impl X509Creds {
    /// Reads `dir`/ca-cert.pem, server-cert.pem, server-key.pem and, if present,
    /// ca-crl.pem (qsd requires the CA even when peers are not verified, and so do we).
    /// `password` decrypts an encrypted key (OpenSSL reads it; rustls takes the result).
    pub fn load(
        what: &str,
        dir: &Path,
        verify_peer: bool,
        password: Option<&[u8]>,
    ) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let ca_path = dir.join("ca-cert.pem");
        let mut roots = RootCertStore::empty();
        for c in certs(what, &ca_path)? {
            roots.add(c).map_err(|e| bad(what, &ca_path, e))?;
        }
        let chain = certs(what, &dir.join("server-cert.pem"))?;
        let key_path = dir.join("server-key.pem");
        let key_pem = read(what, &key_path)?;
        let key = match password {
            None => PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| bad(what, &key_path, e))?,
            Some(pass) => {
                let pkey = openssl::pkey::PKey::private_key_from_pem_passphrase(&key_pem, pass)
                    .map_err(|e| bad(what, &key_path, format!("cannot decrypt the key: {e}")))?;
                let der = pkey.private_key_to_pkcs8()?;
                PrivateKeyDer::Pkcs8(der.into())
            }
        };
        let crl_path = dir.join("ca-crl.pem");
        let crls = if crl_path.exists() {
            CertificateRevocationListDer::pem_slice_iter(&read(what, &crl_path)?)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(what, &crl_path, e))?
        } else {
            Vec::new()
        };
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = if verify_peer {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .with_crls(crls)
                    .build()
                    .map_err(|e| bad(what, &ca_path, e))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| bad(what, &key_path, e))?;
        // NBD clients connect once and stay: session tickets would only be noise.
        config.send_tls13_tickets = 0;
        Ok(Self {
            config: Arc::new(config),
        })
    }

    pub fn new_session(&self) -> Result<Box<dyn TlsSession>, TlsError> {
        let mut conn = ServerConnection::new(self.config.clone())?;
        // Replies are queued whole; back-pressure is the connection's own budget.
        conn.set_buffer_limit(None);
        Ok(Box::new(RustlsSession(conn)))
    }
}

/// A certificate's subject as QEMU names TLS clients for `authz-simple` (GnuTLS's
/// `gnutls_x509_crt_get_dn`): the RDNs in certificate order (`C=GB,O=Example Org,CN=...`,
/// not RFC 4514's reversed order), `,` between RDNs, `+` inside one, values escaped as RFC
/// 4514 says.
pub fn distinguished_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let registry = x509_parser::objects::oid_registry();
    let mut rdns: Vec<String> = Vec::new();
    for rdn in cert.subject().iter_rdn() {
        let mut parts = Vec::new();
        for atv in rdn.iter() {
            let key = x509_parser::objects::oid2abbrev(atv.attr_type(), registry)
                .map(|s| s.to_string())
                .unwrap_or_else(|_| atv.attr_type().to_id_string());
            let value = atv.as_str().ok()?;
            parts.push(format!("{key}={}", escape_value(value)));
        }
        rdns.push(parts.join("+"));
    }
    Some(rdns.join(","))
}

/// RFC 4514 section 2.4: the characters that must be escaped in an attribute value.
fn escape_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    let last = v.chars().count().saturating_sub(1);
    for (i, c) in v.chars().enumerate() {
        let special = matches!(c, ',' | '+' | '"' | '\\' | '<' | '>' | ';')
            || (i == 0 && (c == '#' || c == ' '))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_what_rfc4514_requires() {
        assert_eq!(escape_value("Example Org"), "Example Org");
        assert_eq!(escape_value("a,b+c"), "a\\,b\\+c");
        assert_eq!(escape_value(" lead#"), "\\ lead#");
        assert_eq!(escape_value("#x "), "\\#x\\ ");
    }

    #[test]
    fn not_a_certificate_has_no_name() {
        assert_eq!(distinguished_name(b"not der"), None);
    }
}
