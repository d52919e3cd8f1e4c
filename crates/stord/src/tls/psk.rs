//! `tls-creds-psk`: pre-shared keys from `dir`/keys.psk (a `username:hexkey` line per
//! client, as GnuTLS's psktool writes them and qsd reads them), served by OpenSSL, since
//! rustls has no PSK support. The client's username is its identity for `authz-simple`.
//! With `endpoint=client` the session proves `username` (QEMU's default: `qemu`) with its
//! key from the same file.

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::Arc;

use openssl::ex_data::Index;
use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslMethod, SslStream, SslVersion,
};

use super::error::TlsError;
use super::session::TlsSession;

/// Loaded PSK credentials, for one side.
pub struct PskCreds {
    ctx: SslContext,
    /// Where a server session keeps the username its client proved.
    identity: Index<Ssl, String>,
    client: bool,
}

/// Parses keys.psk: `username:hexkey` lines; blank lines are skipped.
pub fn parse_keys(text: &str) -> Result<HashMap<String, Vec<u8>>, String> {
    let mut keys = HashMap::new();
    for (no, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let (user, hex) = line
            .split_once(':')
            .ok_or_else(|| format!("line {}: expected username:hexkey", no + 1))?;
        if user.is_empty() {
            return Err(format!("line {}: empty username", no + 1));
        }
        let key = decode_hex(hex.trim())
            .ok_or_else(|| format!("line {}: the key is not hexadecimal", no + 1))?;
        if key.is_empty() || key.len() > 256 {
            return Err(format!("line {}: the key must be 1 to 256 bytes", no + 1));
        }
        keys.insert(user.to_string(), key);
    }
    if keys.is_empty() {
        return Err("no key in the file".into());
    }
    Ok(keys)
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

impl PskCreds {
    pub fn load(what: &str, dir: &Path) -> Result<Self, TlsError> {
        let keys = Arc::new(read_keys(what, dir)?);
        let identity = Ssl::new_ex_index::<String>()?;
        let mut b = SslContextBuilder::new(SslMethod::tls_server())?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
        // TLS 1.2's PSK suites (TLS 1.3 takes the same callback with its own suites).
        b.set_cipher_list("ECDHE-PSK:PSK")?;
        b.set_psk_server_callback(move |ssl, id, out| {
            let Some(user) = id.and_then(|i| std::str::from_utf8(i).ok()) else {
                return Ok(0);
            };
            // 0 bytes: an unknown identity, and the handshake fails.
            let Some(key) = keys.get(user).filter(|k| k.len() <= out.len()) else {
                return Ok(0);
            };
            out[..key.len()].copy_from_slice(key);
            ssl.set_ex_data(identity, user.to_string());
            Ok(key.len())
        });
        Ok(Self {
            ctx: b.build(),
            identity,
            client: false,
        })
    }

    /// Client credentials: `username`'s key from `dir`/keys.psk.
    pub fn load_client(what: &str, dir: &Path, username: &str) -> Result<Self, TlsError> {
        let keys = read_keys(what, dir)?;
        let key = keys
            .get(username)
            .cloned()
            .ok_or_else(|| TlsError::BadFile {
                what: what.into(),
                path: dir.join("keys.psk"),
                detail: format!("username {username} not found in the key file"),
            })?;
        let user = username.as_bytes().to_vec();
        let mut b = SslContextBuilder::new(SslMethod::tls_client())?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
        b.set_cipher_list("ECDHE-PSK:PSK")?;
        b.set_psk_client_callback(move |_ssl, _hint, id, out| {
            // The identity goes out NUL-terminated; 0 bytes of key fails the handshake.
            if user.len() >= id.len() || key.len() > out.len() {
                return Ok(0);
            }
            id[..user.len()].copy_from_slice(&user);
            id[user.len()] = 0;
            out[..key.len()].copy_from_slice(&key);
            Ok(key.len())
        });
        Ok(Self {
            ctx: b.build(),
            identity: Ssl::new_ex_index::<String>()?,
            client: true,
        })
    }

    /// A session for one connection, on this side (a client's starts its handshake).
    pub fn new_session(&self) -> Result<Box<dyn TlsSession>, TlsError> {
        let mut ssl = Ssl::new(&self.ctx)?;
        if self.client {
            ssl.set_connect_state();
        } else {
            ssl.set_accept_state();
        }
        let stream = SslStream::new(ssl, MemIo::default())?;
        let mut sess = OpenSslSession {
            stream,
            identity: self.identity,
        };
        if self.client {
            // Queues the ClientHello.
            sess.process_new_packets()?;
        }
        Ok(Box::new(sess))
    }

    pub fn is_client(&self) -> bool {
        self.client
    }
}

/// `dir`/keys.psk, parsed.
fn read_keys(what: &str, dir: &Path) -> Result<HashMap<String, Vec<u8>>, TlsError> {
    let path = dir.join("keys.psk");
    let text = std::fs::read_to_string(&path).map_err(|source| TlsError::Read {
        what: what.into(),
        path: path.clone(),
        source,
    })?;
    parse_keys(&text).map_err(|detail| TlsError::BadFile {
        what: what.into(),
        path,
        detail,
    })
}

/// OpenSSL's transport: ciphertext received and to send, in memory.
#[derive(Default)]
struct MemIo {
    rx: Vec<u8>,
    rx_pos: usize,
    tx: Vec<u8>,
}

impl io::Read for MemIo {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let have = &self.rx[self.rx_pos..];
        if have.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = have.len().min(buf.len());
        buf[..n].copy_from_slice(&have[..n]);
        self.rx_pos += n;
        if self.rx_pos == self.rx.len() {
            self.rx.clear();
            self.rx_pos = 0;
        }
        Ok(n)
    }
}

impl io::Write for MemIo {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tx.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// An OpenSSL session over [`MemIo`].
struct OpenSslSession {
    stream: SslStream<MemIo>,
    identity: Index<Ssl, String>,
}

fn ssl_err(e: openssl::ssl::Error) -> io::Error {
    match e.code() {
        ErrorCode::WANT_READ => io::ErrorKind::WouldBlock.into(),
        _ => io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}")),
    }
}

impl TlsSession for OpenSslSession {
    fn read_tls(&mut self, rd: &mut dyn io::Read) -> io::Result<usize> {
        let mut tmp = [0u8; 16 << 10];
        let n = rd.read(&mut tmp)?;
        self.stream.get_mut().rx.extend_from_slice(&tmp[..n]);
        Ok(n)
    }

    fn process_new_packets(&mut self) -> Result<(), TlsError> {
        if !self.is_handshaking() {
            // Records are decrypted as they are read.
            return Ok(());
        }
        match self.stream.do_handshake() {
            Ok(()) => Ok(()),
            Err(e) if e.code() == ErrorCode::WANT_READ => Ok(()),
            Err(e) => Err(TlsError::Handshake(e.to_string())),
        }
    }

    fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.is_handshaking() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        match self.stream.ssl_read(buf) {
            Ok(n) => Ok(n),
            Err(e) if e.code() == ErrorCode::ZERO_RETURN => Ok(0),
            Err(e) => Err(ssl_err(e)),
        }
    }

    fn write_plain(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<()> {
        // Small pieces (a reply header, then its data) go out as one record.
        let joined: Vec<u8>;
        let whole: &[u8] = match bufs {
            [one] => one,
            _ => {
                joined = bufs.iter().flat_map(|b| b.iter().copied()).collect();
                &joined
            }
        };
        let mut done = 0;
        while done < whole.len() {
            done += self.stream.ssl_write(&whole[done..]).map_err(ssl_err)?;
        }
        Ok(())
    }

    fn wants_write(&self) -> bool {
        !self.stream.get_ref().tx.is_empty()
    }

    fn write_tls(&mut self, wr: &mut dyn io::Write) -> io::Result<usize> {
        let tx = &mut self.stream.get_mut().tx;
        let n = wr.write(tx)?;
        tx.drain(..n);
        Ok(n)
    }

    fn is_handshaking(&self) -> bool {
        !self.stream.ssl().is_init_finished()
    }

    fn peer_identity(&self) -> Option<String> {
        self.stream.ssl().ex_data(self.identity).cloned()
    }

    fn describe(&self) -> String {
        format!(
            "{} {}",
            self.stream.ssl().version_str(),
            self.stream.ssl().current_cipher().map_or("?", |c| c.name())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_file_parses_as_psktool_writes_it() {
        let k = parse_keys("alice:0a0B\n\nbob:ff\r\n").unwrap();
        assert_eq!(k["alice"], vec![0x0a, 0x0b]);
        assert_eq!(k["bob"], vec![0xff]);
    }

    #[test]
    fn bad_keys_files_say_which_line() {
        assert!(parse_keys("").unwrap_err().contains("no key"));
        assert!(parse_keys("alice").unwrap_err().contains("line 1"));
        assert!(parse_keys("a:0\n").unwrap_err().contains("hexadecimal"));
        assert!(parse_keys("ok:00\n:00").unwrap_err().contains("line 2"));
        assert!(parse_keys("a:zz").unwrap_err().contains("hexadecimal"));
    }
}
