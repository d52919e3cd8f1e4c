//! The client side of NBD's fixed newstyle negotiation, as blocking code over a connected
//! socket: it runs where blocking is allowed (the open, or a reconnect thread), never on a
//! loop, and hands back a socket ready for transmission.
//!
//! Asks for structured replies, the one metadata context block status reads
//! (`base:allocation`, or what `x-dirty-bitmap` names), and the export with NBD_OPT_GO
//! (its size, flags and block sizes); a server without NBD_OPT_GO gets NBD_OPT_EXPORT_NAME.
//! With TLS credentials, NBD_OPT_STARTTLS comes first and everything after it is
//! encrypted; the session goes on with the connection into transmission.

use std::io::{self, Read, Write};

use crate::nbd_wire::proto::*;
use crate::tls::blocking::BlockingTls;
use crate::tls::error::TlsError;
use crate::tls::session::TlsSession;

/// What the server told us about the export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (`FLAG_*`).
    pub flags: u16,
    /// Smallest request the server accepts without a read-modify-write (at least 1).
    pub min_block: u32,
    /// Largest request payload the server accepts.
    pub max_block: u32,
    /// The request size the server prefers (0: it sent no block sizes).
    pub opt_block: u32,
    /// Replies to reads and block status come as structured chunks.
    pub structured: bool,
    /// The id the server gave the metadata context block status reads, if it has it.
    pub context: Option<u32>,
}

impl ExportInfo {
    /// Whether the server takes requests with transmission flag `f`.
    pub fn has(&self, f: u16) -> bool {
        self.flags & f != 0
    }
}

/// Why a negotiation failed: the text is what blockdev-add reports.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Protocol(String),
    /// The TLS handshake failed (the caller words certificate refusals as QEMU does).
    #[error("TLS handshake failed: {0}")]
    Tls(TlsError),
}

fn proto(s: impl Into<String>) -> HandshakeError {
    HandshakeError::Protocol(s.into())
}

/// Largest option reply we read (replies describing an export are short).
const MAX_REPLY: u32 = 64 << 10;
/// Default and largest request payload when the server names no maximum (the spec's 32 MiB).
const DEFAULT_MAX_BLOCK: u32 = 32 << 20;

fn read_u16(s: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(s: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn send_option(s: &mut impl Write, opt: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)
}

/// One option reply: its type and data.
fn read_reply(s: &mut impl Read, opt: u32) -> Result<(u32, Vec<u8>), HandshakeError> {
    if read_u64(s)? != OPT_REPLY_MAGIC {
        return Err(proto("Bad magic received"));
    }
    if read_u32(s)? != opt {
        return Err(proto("Unexpected option in the server's reply"));
    }
    let ty = read_u32(s)?;
    let len = read_u32(s)?;
    if len > MAX_REPLY {
        return Err(proto(format!("server's reply is too long ({len} bytes)")));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((ty, data))
}

/// QEMU's name for option `opt` in its messages.
fn opt_name(opt: u32) -> &'static str {
    match opt {
        OPT_EXPORT_NAME => "export name",
        OPT_ABORT => "abort",
        OPT_LIST => "list",
        OPT_STARTTLS => "starttls",
        OPT_INFO => "info",
        OPT_GO => "go",
        OPT_STRUCTURED_REPLY => "structured reply",
        OPT_LIST_META_CONTEXT => "list meta context",
        OPT_SET_META_CONTEXT => "set meta context",
        _ => "<unknown>",
    }
}

/// An error reply to option `opt` as QEMU words it, with the server's message logged.
fn reply_error(ty: u32, data: &[u8], opt: u32) -> HandshakeError {
    let what = format!("option {opt} ({})", opt_name(opt));
    let why = match ty {
        REP_ERR_UNKNOWN => "Requested export not available".to_string(),
        REP_ERR_POLICY => format!("Denied by server for {what}"),
        REP_ERR_TLS_REQD => format!("TLS negotiation required before {what}"),
        REP_ERR_UNSUP => format!("Unsupported option {opt} ({})", opt_name(opt)),
        REP_ERR_INVALID => format!("Invalid parameters for {what}"),
        REP_ERR_PLATFORM => format!("Server lacks support for {what}"),
        REP_ERR_SHUTDOWN => format!("Server shutting down before {what}"),
        _ => format!("Unknown error code when asking for {what}"),
    };
    // QEMU keeps the server's message out of the error's text (a hint); so do we.
    let msg = String::from_utf8_lossy(data);
    if !msg.is_empty() {
        tracing::debug!(target: "stord::nbd", "{why}: server reported: {msg}");
    }
    proto(why)
}

fn name_field(export: &str) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(export.len() as u32).to_be_bytes());
    d.extend_from_slice(export.as_bytes());
    d
}

/// A TLS session to start before the options, and what a negotiation gives back.
pub type Tls = Option<Box<dyn TlsSession>>;

/// Negotiates `export` on a connected stream; `context` is the metadata context to use.
/// With `tls`, the options go through that session, which comes back with the export.
pub fn negotiate<S: Read + Write>(
    s: &mut S,
    export: &str,
    context: &str,
    tls: Tls,
) -> Result<(ExportInfo, Tls), HandshakeError> {
    if export.len() > 4096 {
        return Err(proto("export name too long to send to server"));
    }
    if read_u64(s)? != NBDMAGIC {
        return Err(proto("Bad initial magic received"));
    }
    let magic = read_u64(s)?;
    if magic != IHAVEOPT {
        // Oldstyle servers send the size here; nobody still runs one with QEMU's images.
        return Err(proto(
            "Server uses the oldstyle protocol, which stord does not speak",
        ));
    }
    let gflags = read_u16(s)?;
    let fixed = gflags & FLAG_FIXED_NEWSTYLE != 0;
    let no_zeroes = gflags & FLAG_NO_ZEROES != 0;
    let mut cflags = 0u32;
    if fixed {
        cflags |= FLAG_C_FIXED_NEWSTYLE;
    }
    if no_zeroes {
        cflags |= FLAG_C_NO_ZEROES;
    }
    s.write_all(&cflags.to_be_bytes())?;
    let Some(mut sess) = tls else {
        let info = if fixed {
            options(s, export, context, no_zeroes)?
        } else {
            // Only NBD_OPT_EXPORT_NAME is safe with a server that cannot refuse options.
            export_name(s, export, no_zeroes, false, None)?
        };
        return Ok((info, None));
    };
    if !fixed {
        return Err(proto("Server does not support STARTTLS"));
    }
    send_option(s, OPT_STARTTLS, &[])?;
    match read_reply(s, OPT_STARTTLS)? {
        (REP_ACK, _) => {}
        (REP_ERR_UNSUP, _) => return Err(proto("Server don't support STARTTLS option")),
        (t, data) if t & (1 << 31) != 0 => return Err(reply_error(t, &data, OPT_STARTTLS)),
        _ => return Err(proto("Unexpected reply to NBD_OPT_STARTTLS")),
    }
    let mut t = BlockingTls {
        sess: &mut *sess,
        sock: s,
    };
    t.handshake().map_err(HandshakeError::Tls)?;
    let info = options(&mut t, export, context, no_zeroes)?;
    Ok((info, Some(sess)))
}

/// The options after the greeting (and TLS): structured replies, the metadata context,
/// and the export.
fn options<S: Read + Write>(
    s: &mut S,
    export: &str,
    context: &str,
    no_zeroes: bool,
) -> Result<ExportInfo, HandshakeError> {
    send_option(s, OPT_STRUCTURED_REPLY, &[])?;
    let (ty, _) = read_reply(s, OPT_STRUCTURED_REPLY)?;
    let structured = ty == REP_ACK;

    let ctx_id = if structured {
        select_context(s, export, context)?
    } else {
        None
    };

    // NBD_OPT_GO, asking for the block sizes.
    let mut d = name_field(export);
    d.extend_from_slice(&1u16.to_be_bytes());
    d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(s, OPT_GO, &d)?;
    let mut info = ExportInfo {
        size: 0,
        flags: 0,
        min_block: 1,
        max_block: DEFAULT_MAX_BLOCK,
        opt_block: 0,
        structured,
        context: ctx_id,
    };
    let mut have_export = false;
    loop {
        let (ty, data) = read_reply(s, OPT_GO)?;
        match ty {
            REP_INFO if data.len() >= 2 => {
                let it = u16::from_be_bytes([data[0], data[1]]);
                match it {
                    INFO_EXPORT if data.len() == 12 => {
                        info.size = u64::from_be_bytes(data[2..10].try_into().expect("8"));
                        info.flags = u16::from_be_bytes([data[10], data[11]]);
                        have_export = true;
                    }
                    INFO_BLOCK_SIZE if data.len() == 14 => {
                        let f =
                            |i: usize| u32::from_be_bytes(data[i..i + 4].try_into().expect("4"));
                        info.min_block = f(2).max(1);
                        // Checked before it bounds the maximum (a hostile minimum).
                        check_limits(&info)?;
                        info.max_block = f(10).clamp(info.min_block, DEFAULT_MAX_BLOCK);
                        info.opt_block = f(6);
                    }
                    INFO_EXPORT | INFO_BLOCK_SIZE => {
                        return Err(proto("Invalid length in NBD_REP_INFO reply"))
                    }
                    _ => {}
                }
            }
            REP_ACK if have_export => break,
            REP_ACK => return Err(proto("Server did not describe the export")),
            REP_ERR_UNSUP => return export_name(s, export, no_zeroes, structured, ctx_id),
            t if t & (1 << 31) != 0 => return Err(reply_error(t, &data, OPT_GO)),
            _ => return Err(proto("Unexpected reply to NBD_OPT_GO")),
        }
    }
    check_limits(&info)?;
    Ok(info)
}

/// NBD_OPT_SET_META_CONTEXT for `context` on `export`: the id the server gave it, if it
/// has it.
fn select_context<S: Read + Write>(
    s: &mut S,
    export: &str,
    context: &str,
) -> Result<Option<u32>, HandshakeError> {
    let mut ctx_id = None;
    let mut d = name_field(export);
    d.extend_from_slice(&1u32.to_be_bytes());
    d.extend_from_slice(&(context.len() as u32).to_be_bytes());
    d.extend_from_slice(context.as_bytes());
    send_option(s, OPT_SET_META_CONTEXT, &d)?;
    loop {
        let (ty, data) = read_reply(s, OPT_SET_META_CONTEXT)?;
        match ty {
            REP_META_CONTEXT if data.len() >= 4 => {
                let id = u32::from_be_bytes(data[..4].try_into().expect("4 bytes"));
                if &data[4..] == context.as_bytes() {
                    ctx_id = Some(id);
                }
            }
            REP_ACK => break,
            // A server without metadata contexts: block status reads as all data.
            t if t & (1 << 31) != 0 => break,
            _ => return Err(proto("Unexpected reply to NBD_OPT_SET_META_CONTEXT")),
        }
    }
    Ok(ctx_id)
}

/// NBD_OPT_EXPORT_NAME: the server answers with the export's size and flags, or hangs up.
fn export_name<S: Read + Write>(
    s: &mut S,
    export: &str,
    no_zeroes: bool,
    structured: bool,
    context: Option<u32>,
) -> Result<ExportInfo, HandshakeError> {
    send_option(s, OPT_EXPORT_NAME, export.as_bytes())?;
    let size = read_u64(s).map_err(|_| proto("Requested export not available"))?;
    let flags = read_u16(s)?;
    if !no_zeroes {
        let mut pad = [0u8; 124];
        s.read_exact(&mut pad)?;
    }
    let info = ExportInfo {
        size,
        flags,
        min_block: 1,
        max_block: DEFAULT_MAX_BLOCK,
        opt_block: 0,
        structured,
        context,
    };
    check_limits(&info)?;
    Ok(info)
}

fn check_limits(info: &ExportInfo) -> Result<(), HandshakeError> {
    if info.size > crate::block::drivers::null::MAX_SIZE {
        return Err(proto(format!("export size {} is too large", info.size)));
    }
    if !info.min_block.is_power_of_two() || info.min_block > 64 << 10 {
        return Err(proto(format!(
            "server's minimum block size {} is not supported",
            info.min_block
        )));
    }
    // QEMU refuses it too: the last block could not be read or written whole.
    if !info.size.is_multiple_of(u64::from(info.min_block)) {
        return Err(proto(format!(
            "export size {} is not multiple of minimum block size {}",
            info.size, info.min_block
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted server: what it sends, and what the client wrote.
    struct Script {
        input: io::Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Script {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            self.input.read(b)
        }
    }
    impl Write for Script {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn reply(opt: u32, ty: u32, data: &[u8]) -> Vec<u8> {
        let mut v = OPT_REPLY_MAGIC.to_be_bytes().to_vec();
        v.extend_from_slice(&opt.to_be_bytes());
        v.extend_from_slice(&ty.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    fn greeting() -> Vec<u8> {
        let mut v = NBDMAGIC.to_be_bytes().to_vec();
        v.extend_from_slice(&IHAVEOPT.to_be_bytes());
        v.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        v
    }

    #[test]
    fn go_with_structured_replies_and_a_context() {
        let mut srv = greeting();
        srv.extend(reply(OPT_STRUCTURED_REPLY, REP_ACK, &[]));
        let mut ctx = 7u32.to_be_bytes().to_vec();
        ctx.extend_from_slice(b"base:allocation");
        srv.extend(reply(OPT_SET_META_CONTEXT, REP_META_CONTEXT, &ctx));
        srv.extend(reply(OPT_SET_META_CONTEXT, REP_ACK, &[]));
        let mut exp = INFO_EXPORT.to_be_bytes().to_vec();
        exp.extend_from_slice(&(1u64 << 20).to_be_bytes());
        exp.extend_from_slice(&(FLAG_HAS_FLAGS | FLAG_SEND_FLUSH).to_be_bytes());
        srv.extend(reply(OPT_GO, REP_INFO, &exp));
        let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [1u32, 4096, 1 << 20] {
            bs.extend_from_slice(&v.to_be_bytes());
        }
        srv.extend(reply(OPT_GO, REP_INFO, &bs));
        srv.extend(reply(OPT_GO, REP_ACK, &[]));
        let mut s = Script {
            input: io::Cursor::new(srv),
            output: Vec::new(),
        };
        let info = negotiate(&mut s, "exp", "base:allocation", None).unwrap().0;
        assert_eq!(info.size, 1 << 20);
        assert!(info.has(FLAG_SEND_FLUSH) && !info.has(FLAG_SEND_FUA));
        assert_eq!((info.min_block, info.max_block), (1, 1 << 20));
        assert!(info.structured);
        assert_eq!(info.context, Some(7));
        // Client flags, then three options.
        assert_eq!(
            &s.output[..4],
            &(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()
        );
    }

    #[test]
    fn an_unknown_export_is_refused_with_the_servers_words() {
        let mut srv = greeting();
        srv.extend(reply(OPT_STRUCTURED_REPLY, REP_ERR_UNSUP, &[]));
        srv.extend(reply(OPT_GO, REP_ERR_UNKNOWN, b"export 'x' not present"));
        let mut s = Script {
            input: io::Cursor::new(srv),
            output: Vec::new(),
        };
        let e = negotiate(&mut s, "x", "base:allocation", None)
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.to_string(), "Requested export not available");
    }

    #[test]
    fn a_minimum_block_size_past_the_maximum_is_refused() {
        let mut srv = greeting();
        srv.extend(reply(OPT_STRUCTURED_REPLY, REP_ERR_UNSUP, &[]));
        let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [1u32 << 30, 1 << 30, 1 << 30] {
            bs.extend_from_slice(&v.to_be_bytes());
        }
        srv.extend(reply(OPT_GO, REP_INFO, &bs));
        let mut s = Script {
            input: io::Cursor::new(srv),
            output: Vec::new(),
        };
        let e = negotiate(&mut s, "", "base:allocation", None)
            .map(|_| ())
            .unwrap_err();
        assert!(e.to_string().contains("minimum block size"), "{e}");
    }

    #[test]
    fn a_size_that_is_no_multiple_of_the_minimum_block_is_refused() {
        let info = ExportInfo {
            size: 1000,
            flags: 0,
            min_block: 512,
            max_block: 1 << 20,
            opt_block: 4096,
            structured: true,
            context: None,
        };
        let e = check_limits(&info).unwrap_err();
        assert_eq!(
            e.to_string(),
            "export size 1000 is not multiple of minimum block size 512"
        );
        assert!(check_limits(&ExportInfo { size: 1024, ..info }).is_ok());
    }

    #[test]
    fn a_truncated_greeting_is_an_error_not_a_hang() {
        let mut s = Script {
            input: io::Cursor::new(NBDMAGIC.to_be_bytes()[..5].to_vec()),
            output: Vec::new(),
        };
        assert!(negotiate(&mut s, "", "base:allocation", None).is_err());
    }
}
