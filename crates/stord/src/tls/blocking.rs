//! A session driven over a blocking stream, for code that negotiates with plain reads and
//! writes (the NBD client's option haggling runs on a thread of its own, not on a loop).

use std::io::{self, Read, Write};

use super::error::TlsError;
use super::session::TlsSession;

/// `sess` over `sock`: `Read` gives decrypted bytes, `Write` sends records at once.
pub struct BlockingTls<'a, S: Read + Write> {
    pub sess: &'a mut dyn TlsSession,
    pub sock: &'a mut S,
}

impl<S: Read + Write> BlockingTls<'_, S> {
    /// Sends every record the session has waiting.
    fn flush_records(&mut self) -> io::Result<()> {
        while self.sess.wants_write() {
            if self.sess.write_tls(self.sock)? == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
        }
        Ok(())
    }

    /// Receives ciphertext and lets the session handle it.
    fn receive(&mut self) -> Result<(), TlsError> {
        let n = self.sess.read_tls(self.sock).map_err(handshake_io)?;
        if n == 0 {
            // GnuTLS's words, which QEMU reports, for the same event.
            return Err(TlsError::Handshake(
                "The TLS connection was non-properly terminated.".into(),
            ));
        }
        self.sess.process_new_packets()
    }

    /// Runs the handshake to its end; on failure the alert the session queued is sent.
    pub fn handshake(&mut self) -> Result<(), TlsError> {
        loop {
            self.flush_records().map_err(handshake_io)?;
            if !self.sess.is_handshaking() {
                return Ok(());
            }
            if let Err(e) = self.receive() {
                let _ = self.flush_records();
                return Err(e);
            }
        }
    }
}

fn handshake_io(e: io::Error) -> TlsError {
    TlsError::Handshake(e.to_string())
}

impl<S: Read + Write> Read for BlockingTls<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.sess.read_plain(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            self.receive()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        }
    }
}

impl<S: Read + Write> Write for BlockingTls<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sess.write_plain(&[io::IoSlice::new(buf)])?;
        self.flush_records()?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.flush_records()
    }
}
