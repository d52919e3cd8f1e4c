//! `tls-creds-x509`: a CA, a server certificate and key from qsd's file names, served by
//! rustls; client certificates checked against the CA (and its CRL) when `verify-peer=on`.
//! With `endpoint=client` (the `nbd` block driver's connections): the CA, and a client
//! certificate and key if the directory has them; the server's certificate is checked
//! against the CA and the host name as QEMU checks it (no name given, no name checked).

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::pki_types::{ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    CertificateError, ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore,
    ServerConfig, ServerConnection, SignatureScheme,
};

use super::error::TlsError;
use super::session::TlsSession;

/// Loaded x509 credentials, for one side.
pub enum X509Creds {
    /// Requires client certificates when `verify-peer=on`.
    Server(Arc<ServerConfig>),
    /// `named` checks the server's certificate against a host name; `unnamed` (a unix
    /// socket without `tls-hostname`) checks only its chain, as QEMU does.
    Client {
        named: Arc<ClientConfig>,
        unnamed: Arc<ClientConfig>,
    },
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
        sanity_check: bool,
        password: Option<&[u8]>,
    ) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (ca_path, roots) = ca(what, dir)?;
        let cert_path = dir.join("server-cert.pem");
        let chain = certs(what, &cert_path)?;
        if sanity_check {
            let v = WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots.clone()),
                provider.clone(),
            )
            .build()
            .map_err(|e| bad(what, &ca_path, e))?;
            let checker = ServerVerifier {
                webpki: v,
                check_chain: true,
                check_name: false,
            };
            let r = checker.verify_server_cert(
                &chain[0],
                &chain[1..],
                &ServerName::try_from("localhost").expect("a name"),
                &[],
                UnixTime::now(),
            );
            own_certificate(r.map(|_| ()), &cert_path, &ca_path)?;
        }
        let key_path = dir.join("server-key.pem");
        let key = private_key(what, &key_path, password)?;
        let crls = crls(what, dir)?;
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
        Ok(X509Creds::Server(Arc::new(config)))
    }

    /// Client credentials: `dir`/ca-cert.pem (required), ca-crl.pem, and client-cert.pem
    /// with client-key.pem if both are there (QEMU's names; one without the other is an
    /// error, as in QEMU). `verify_peer=false` accepts any server certificate.
    pub fn load_client(
        what: &str,
        dir: &Path,
        verify_peer: bool,
        sanity_check: bool,
        password: Option<&[u8]>,
    ) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (ca_path, roots) = ca(what, dir)?;
        let (cert_path, key_path) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
        let identity = match (cert_path.exists(), key_path.exists()) {
            (false, false) => None,
            (true, false) => {
                return Err(bad(
                    what,
                    &cert_path,
                    "certificate without corresponding key",
                ))
            }
            (false, true) => {
                return Err(bad(
                    what,
                    &key_path,
                    "key without corresponding certificate",
                ))
            }
            (true, true) => Some((
                certs(what, &cert_path)?,
                private_key(what, &key_path, password)?,
            )),
        };
        if let (true, Some((chain, _))) = (sanity_check, &identity) {
            let v = WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots.clone()),
                provider.clone(),
            )
            .build()
            .map_err(|e| bad(what, &ca_path, e))?;
            let r = v.verify_client_cert(&chain[0], &chain[1..], UnixTime::now());
            own_certificate(r.map(|_| ()), &cert_path, &ca_path)?;
        }
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .with_crls(crls(what, dir)?)
            .build()
            .map_err(|e| bad(what, &ca_path, e))?;
        let config = |check_name: bool| -> Result<Arc<ClientConfig>, TlsError> {
            let verifier = Arc::new(ServerVerifier {
                webpki: webpki.clone(),
                check_chain: verify_peer,
                check_name,
            });
            let builder = ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()?
                .dangerous()
                .with_custom_certificate_verifier(verifier);
            let mut config = match &identity {
                None => builder.with_no_client_auth(),
                Some((chain, key)) => builder
                    .with_client_auth_cert(chain.clone(), key.clone_key())
                    .map_err(|e| bad(what, &key_path, e))?,
            };
            // Without a name there is nothing to indicate.
            config.enable_sni = check_name;
            Ok(Arc::new(config))
        };
        Ok(X509Creds::Client {
            named: config(true)?,
            unnamed: config(false)?,
        })
    }

    pub fn new_session(&self) -> Result<Box<dyn TlsSession>, TlsError> {
        let X509Creds::Server(config) = self else {
            return Err(TlsError::Handshake(
                "client credentials cannot serve".into(),
            ));
        };
        let mut conn = ServerConnection::new(config.clone())?;
        // Replies are queued whole; back-pressure is the connection's own budget.
        conn.set_buffer_limit(None);
        Ok(Box::new(RustlsSession(conn.into())))
    }

    /// A client session that checks the server's certificate against `hostname`, if given.
    pub fn new_client_session(
        &self,
        hostname: Option<&str>,
    ) -> Result<Box<dyn TlsSession>, TlsError> {
        let X509Creds::Client { named, unnamed } = self else {
            return Err(TlsError::Handshake(
                "server credentials cannot connect".into(),
            ));
        };
        let (config, name) = match hostname {
            Some(h) => (
                named.clone(),
                ServerName::try_from(h.to_string())
                    .map_err(|_| TlsError::Handshake(format!("invalid host name '{h}'")))?,
            ),
            // Not sent (no SNI) and not checked.
            None => (
                unnamed.clone(),
                ServerName::try_from("localhost").expect("a name"),
            ),
        };
        let mut conn = ClientConnection::new(config, name)?;
        conn.set_buffer_limit(None);
        Ok(Box::new(RustlsSession(conn.into())))
    }
}

/// QEMU's sanity check of our own certificate against the CA, in its words.
fn own_certificate(r: Result<(), rustls::Error>, cert: &Path, ca: &Path) -> Result<(), TlsError> {
    r.map_err(|e| {
        let why = refusal_text(&e, None).unwrap_or_else(|| e.to_string());
        TlsError::Sanity(format!(
            "Our own certificate {} failed validation against {}: {why}",
            cert.display(),
            ca.display()
        ))
    })
}

/// `dir`/ca-cert.pem as a root store, and its path.
fn ca(what: &str, dir: &Path) -> Result<(std::path::PathBuf, RootCertStore), TlsError> {
    let ca_path = dir.join("ca-cert.pem");
    let mut roots = RootCertStore::empty();
    for c in certs(what, &ca_path)? {
        roots.add(c).map_err(|e| bad(what, &ca_path, e))?;
    }
    Ok((ca_path, roots))
}

/// A PEM private key, decrypted with `password` if it is encrypted (OpenSSL reads it;
/// rustls takes the result).
fn private_key(
    what: &str,
    path: &Path,
    password: Option<&[u8]>,
) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(what, path)?;
    match password {
        None => PrivateKeyDer::from_pem_slice(&pem).map_err(|e| bad(what, path, e)),
        Some(pass) => {
            let pkey = openssl::pkey::PKey::private_key_from_pem_passphrase(&pem, pass)
                .map_err(|e| bad(what, path, format!("cannot decrypt the key: {e}")))?;
            let der = pkey.private_key_to_pkcs8()?;
            Ok(PrivateKeyDer::Pkcs8(der.into()))
        }
    }
}

/// `dir`/ca-crl.pem's revocation lists, if the file is there.
fn crls(what: &str, dir: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    let crl_path = dir.join("ca-crl.pem");
    if !crl_path.exists() {
        return Ok(Vec::new());
    }
    CertificateRevocationListDer::pem_slice_iter(&read(what, &crl_path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(what, &crl_path, e))
}

/// Checks a server's certificate as QEMU's client does: its chain against the CA (unless
/// `verify-peer=off`), and the host name only when one was given.
#[derive(Debug)]
struct ServerVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    check_chain: bool,
    check_name: bool,
}

impl ServerCertVerifier for ServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if !self.check_chain {
            return Ok(ServerCertVerified::assertion());
        }
        match self
            .webpki
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// A rustls connection (server or client).
pub struct RustlsSession(pub rustls::Connection);

impl TlsSession for RustlsSession {
    fn read_tls(&mut self, rd: &mut dyn io::Read) -> io::Result<usize> {
        self.0.read_tls(rd)
    }

    fn process_new_packets(&mut self) -> Result<(), TlsError> {
        self.0.process_new_packets().map(|_| ())?;
        Ok(())
    }

    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::Read::read(&mut self.0.reader(), buf)
    }

    fn write_plain(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        // One vectored write makes full-size records across the pieces (a reply header
        // and its data share a record); the send buffer is unbounded (set at creation).
        let n = io::Write::write_vectored(&mut self.0.writer(), bufs)?;
        if n != total {
            return Err(io::Error::other("TLS send buffer refused data"));
        }
        Ok(())
    }

    fn wants_write(&self) -> bool {
        self.0.wants_write()
    }

    fn write_tls(&mut self, wr: &mut dyn io::Write) -> io::Result<usize> {
        self.0.write_tls(wr)
    }

    fn is_handshaking(&self) -> bool {
        self.0.is_handshaking()
    }

    fn peer_identity(&self) -> Option<String> {
        let cert = self.0.peer_certificates()?.first()?;
        distinguished_name(cert)
    }

    fn describe(&self) -> String {
        match (self.0.protocol_version(), self.0.negotiated_cipher_suite()) {
            (Some(v), Some(s)) => format!("{v:?} {:?}", s.suite()),
            _ => "handshake not finished".into(),
        }
    }
}

/// QEMU's words for a server certificate the client refused (GnuTLS's verification
/// status as `qcrypto_tls_session_check_certificate` names it), or `None` for other errors.
pub fn refusal_text(e: &rustls::Error, hostname: Option<&str>) -> Option<String> {
    let rustls::Error::InvalidCertificate(c) = e else {
        return None;
    };
    Some(match c {
        CertificateError::UnknownIssuer => "The certificate hasn't got a known issuer".into(),
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
            format!(
                "Certificate does not match the hostname {}",
                hostname.unwrap_or_default()
            )
        }
        CertificateError::Revoked => "The certificate has been revoked".into(),
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            "The certificate has expired".into()
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            "The certificate is not yet activated".into()
        }
        _ => "The certificate is not trusted".into(),
    })
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
