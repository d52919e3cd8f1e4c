//! One connection's TLS state, without I/O of its own.
//!
//! The caller receives ciphertext and hands it over (`read_tls`, then
//! `process_new_packets`), takes decrypted bytes out (`read_plain`), puts bytes to send in
//! (`write_plain`) and sends what the session has produced (`write_tls`). Both
//! implementations (rustls for certificates, OpenSSL for pre-shared keys) fit this shape,
//! so the NBD code drives either the same way, on either side (stord's NBD server, and the
//! `nbd` block driver's client connections).

use std::io;

use super::TlsError;

/// A TLS session, server or client side.
pub trait TlsSession: Send {
    /// Takes received ciphertext from `rd`; returns how much it took.
    fn read_tls(&mut self, rd: &mut dyn io::Read) -> io::Result<usize>;
    /// Decrypts and handles what `read_tls` took (handshake messages, records, alerts).
    fn process_new_packets(&mut self) -> Result<(), TlsError>;
    /// Decrypted bytes: `Ok(0)` when the peer closed the session, `WouldBlock` when more
    /// ciphertext is needed.
    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Encrypts all of `bufs`, in order, into records waiting to be sent.
    fn write_plain(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<()>;
    /// Whether ciphertext waits to be sent.
    fn wants_write(&self) -> bool;
    /// Sends waiting ciphertext into `wr`; returns how much went.
    fn write_tls(&mut self, wr: &mut dyn io::Write) -> io::Result<usize>;
    /// The handshake is still going on.
    fn is_handshaking(&self) -> bool;
    /// The identity the peer proved: its certificate's distinguished name (as QEMU writes it) or
    /// its PSK username.
    fn peer_identity(&self) -> Option<String>;
    /// The protocol version and cipher suite agreed, for logs.
    fn describe(&self) -> String;
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
        super::x509::distinguished_name(cert)
    }

    fn describe(&self) -> String {
        match (self.0.protocol_version(), self.0.negotiated_cipher_suite()) {
            (Some(v), Some(s)) => format!("{v:?} {:?}", s.suite()),
            _ => "handshake not finished".into(),
        }
    }
}
