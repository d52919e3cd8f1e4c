//! One connection's TLS state, without I/O of its own.
//!
//! The caller receives ciphertext and hands it over (`read_tls`, then
//! `process_new_packets`), takes decrypted bytes out (`read_plain`), puts bytes to send in
//! (`write_plain`) and sends what the session has produced (`write_tls`). Both
//! implementations (rustls for certificates, in [`x509`](super::x509); OpenSSL for
//! pre-shared keys, in [`psk`](super::psk)) fit this shape, so the NBD code drives either
//! the same way, on either side (stord's NBD server, and the `nbd` block driver's client
//! connections).

use std::io;

use super::error::TlsError;

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
