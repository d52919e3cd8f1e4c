//! The fixed-newstyle negotiation phase, run on the main loop for each new connection.
//!
//! It ends with the export chosen (OPT_GO or OPT_EXPORT_NAME) and the options that matter
//! to the transmission phase (structured replies, the base:allocation context), or with the
//! connection closed (OPT_ABORT, a malformed message, end of stream).
//!
//! What gets a reply and what closes follows the protocol (and qemu's server where the
//! protocol leaves a choice): every option but EXPORT_NAME gets a reply, an error reply when
//! it cannot be honoured; EXPORT_NAME has no error reply, so a name that is unknown, too
//! long or not a string closes the connection, as does anything that breaks the framing
//! (bad magic, unknown client flags, an option too large to skip, any option but
//! EXPORT_NAME from a client that did not ask for fixed newstyle). Names echoed in error
//! messages are cut short and stripped of control characters.
//!
//! With TLS configured (`tls-creds`), the client must send STARTTLS first: any other option
//! gets NBD_REP_ERR_TLS_REQD (EXPORT_NAME, which cannot be refused, closes), as in qemu.
//! After the TLS handshake (and the `tls-authz` check) the negotiation starts over inside
//! the session.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::export::{ExportTable, NbdExport};
use crate::nbd_wire::io::{send, OutChunk, SharedTls, SockReader};
use crate::nbd_wire::proto::*;
use crate::tls::TlsServer;

/// What the negotiation settled.
pub struct Negotiated {
    /// The export.
    pub export: Arc<NbdExport>,
    /// Structured replies are on.
    pub structured: bool,
    /// The metadata contexts selected for this export.
    pub meta: MetaContexts,
    /// Bytes the client already sent past the negotiation (decrypted, with TLS).
    pub pending: Vec<u8>,
    /// The TLS session, if the client started one.
    pub tls: Option<SharedTls>,
    /// Ciphertext received past the negotiation, not yet decrypted.
    pub cipher: Vec<u8>,
}

/// Metadata contexts a connection selected (NBD_OPT_SET_META_CONTEXT).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaContexts {
    /// base:allocation.
    pub base_allocation: bool,
    /// qemu:allocation-depth (offered when the export has `allocation-depth=on`).
    pub allocation_depth: bool,
    /// qemu:dirty-bitmap:NAME of the export's bitmaps: bit `i` for its bitmap `i`.
    pub bitmaps: u32,
}

impl MetaContexts {
    /// Whether BLOCK_STATUS has anything to report.
    pub fn any(&self) -> bool {
        self.base_allocation || self.allocation_depth || self.bitmaps != 0
    }

    /// The selected contexts as (id, name), in id order.
    pub fn selected(&self, export: &NbdExport) -> Vec<(u32, String)> {
        let mut v = Vec::new();
        if self.base_allocation {
            v.push((META_BASE_ALLOCATION_ID, META_BASE_ALLOCATION.to_string()));
        }
        if self.allocation_depth {
            v.push((META_ALLOCATION_DEPTH_ID, META_ALLOCATION_DEPTH.to_string()));
        }
        for (i, b) in export.bitmaps.iter().enumerate() {
            if self.bitmaps & (1 << i) != 0 {
                v.push((
                    META_DIRTY_BITMAP_FIRST_ID + i as u32,
                    format!("{META_DIRTY_BITMAP_PREFIX}{}", b.name),
                ));
            }
        }
        v
    }
}

/// The contexts of `export` a query matches: an exact name, or for LIST a namespace
/// (`base:`, `qemu:`) or nothing at all (every context).
fn matching_contexts(export: &NbdExport, queries: &[String], list: bool) -> MetaContexts {
    let matches = |name: &str| {
        let ns = &name[..name.find(':').map_or(0, |i| i + 1)];
        (list && queries.is_empty()) || queries.iter().any(|q| q == name || (list && q == ns))
    };
    let mut bitmaps = 0;
    for (i, b) in export.bitmaps.iter().enumerate() {
        let name = format!("{META_DIRTY_BITMAP_PREFIX}{}", b.name);
        // LIST also takes the prefix alone: every bitmap (as QEMU answers).
        if matches(&name) || (list && queries.iter().any(|q| q == META_DIRTY_BITMAP_PREFIX)) {
            bitmaps |= 1 << i;
        }
    }
    MetaContexts {
        base_allocation: matches(META_BASE_ALLOCATION),
        allocation_depth: export.allocation_depth && matches(META_ALLOCATION_DEPTH),
        bitmaps,
    }
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

fn opt_reply(opt: u32, kind: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + data.len());
    v.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&opt.to_be_bytes());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

fn opt_error(opt: u32, kind: u32, msg: &str) -> Vec<u8> {
    opt_reply(opt, kind, msg.as_bytes())
}

/// A parser over an option's payload.
struct Cursor<'a> {
    data: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.data.len() < n {
            return None;
        }
        let (a, b) = self.data.split_at(n);
        self.data = b;
        Some(a)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// A length-prefixed protocol string: at most 4096 bytes of UTF-8 without NUL.
    fn string(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        if n > MAX_STRING {
            return None;
        }
        protocol_string(self.take(n)?)
    }
}

/// The protocol's limit on names and other strings.
const MAX_STRING: usize = 4096;
/// Option payloads up to this size are read and skipped when too large to honour; beyond
/// it the client is cut off (qemu's limit, NBD_MAX_BUFFER_SIZE).
const MAX_SKIP: u32 = 32 << 20;

/// `b` as a protocol string: valid UTF-8 with no NUL byte.
fn protocol_string(b: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(b).ok()?;
    (!s.contains('\0')).then(|| s.to_string())
}

/// A client-supplied name fit for an error message: at most 80 characters, control
/// characters replaced.
fn sanitize(name: &str) -> String {
    let mut out: String = name
        .chars()
        .take(80)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if name.chars().count() > 80 {
        out.push_str("...");
    }
    out
}

fn export_info(e: &NbdExport, structured: bool) -> Vec<u8> {
    let mut v = Vec::with_capacity(12);
    v.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    v.extend_from_slice(&e.link.current().size().to_be_bytes());
    v.extend_from_slice(&e.transmission_flags(structured).to_be_bytes());
    v
}

/// Answers an option that arrived before STARTTLS on a server that requires TLS: `Ok(true)`
/// when the client asked to abort.
async fn refuse_before_tls(fd: RawFd, rd: &mut SockReader, opt: u32, len: u32) -> io::Result<bool> {
    if opt == OPT_EXPORT_NAME {
        // No error reply exists for EXPORT_NAME: close.
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "EXPORT_NAME before STARTTLS on a server that requires TLS",
        ));
    }
    if len > MAX_SKIP {
        return Err(invalid("option payload too large"));
    }
    rd.discard(len as usize).await?;
    let reply = opt_error(
        opt,
        REP_ERR_TLS_REQD,
        "TLS is required: send STARTTLS first",
    );
    let sent = send(fd, None, &mut vec![OutChunk::Bytes(reply)], 0).await;
    if opt == OPT_ABORT {
        // The client may hang up before reading the reply: that is fine.
        return Ok(true);
    }
    sent.map(|()| false)
}

/// STARTTLS accepted: acknowledges it, runs the TLS handshake and the `tls-authz` check.
async fn start_tls(fd: RawFd, rd: &mut SockReader, tls: &TlsServer) -> io::Result<SharedTls> {
    let sess = tls
        .creds
        .new_session()
        .map_err(|e| io::Error::other(e.to_string()))?;
    send(
        fd,
        None,
        &mut vec![OutChunk::Bytes(opt_reply(OPT_STARTTLS, REP_ACK, &[]))],
        0,
    )
    .await?;
    let sess = SharedTls::new(sess);
    rd.start_tls(sess.clone());
    rd.tls_handshake().await?;
    let identity = sess.lock().peer_identity();
    if let Some((id, authz)) = &tls.authz {
        if !authz.allows(identity.as_deref()) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "TLS client '{}' is not allowed by authz object '{id}'",
                    identity.as_deref().map_or("(no identity)".into(), sanitize)
                ),
            ));
        }
    }
    tracing::debug!(
        "nbd: TLS session ({}, credentials '{}') with '{}'",
        sess.lock().describe(),
        tls.creds_id,
        identity.as_deref().map_or("(anonymous)".into(), sanitize)
    );
    Ok(sess)
}

/// Runs the negotiation on `fd`. `Ok(None)`: the client ended it cleanly.
pub async fn negotiate(
    fd: RawFd,
    exports: &ExportTable,
    tls: Option<&TlsServer>,
) -> io::Result<Option<Negotiated>> {
    let mut n = Negotiation::greet(fd, exports, tls).await?;
    loop {
        let (opt, len) = n.option_header().await?;
        match n.answer(opt, len).await? {
            Step::Reply(replies) => n.reply(replies).await?,
            Step::Next => {}
            Step::End => return Ok(None),
            Step::Chosen {
                export,
                name,
                reply,
            } => {
                n.reply(reply).await?;
                return Ok(Some(n.settle(export, &name)));
            }
        }
    }
}

/// What answering one option leads to.
enum Step {
    /// Send these replies, then read the next option.
    Reply(Vec<u8>),
    /// Read the next option: nothing to send (STARTTLS done), or sent already.
    Next,
    /// The client ended the negotiation cleanly.
    End,
    /// The client chose `export` by `name`: send `reply`, then the transmission phase.
    Chosen {
        export: Arc<NbdExport>,
        name: String,
        reply: Vec<u8>,
    },
}

/// One connection's negotiation: its socket, what the client said of itself, and what its
/// options have settled so far.
struct Negotiation<'a> {
    fd: RawFd,
    exports: &'a ExportTable,
    tls: Option<&'a TlsServer>,
    rd: SockReader,
    /// The client asked for no zero padding after EXPORT_NAME's reply.
    no_zeroes: bool,
    /// A client that did not ask for fixed newstyle cannot parse option replies: it may
    /// only send EXPORT_NAME.
    fixed: bool,
    /// Structured replies are on.
    structured: bool,
    /// (export name, selected) of the last SET_META_CONTEXT.
    meta: Option<(String, MetaContexts)>,
    /// The TLS session, once STARTTLS has succeeded.
    sess: Option<SharedTls>,
}

impl<'a> Negotiation<'a> {
    /// Sends the server's greeting and reads the client's flags.
    async fn greet(
        fd: RawFd,
        exports: &'a ExportTable,
        tls: Option<&'a TlsServer>,
    ) -> io::Result<Self> {
        let mut hello = Vec::with_capacity(18);
        hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
        hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
        hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        send(fd, None, &mut vec![OutChunk::Bytes(hello)], 0).await?;

        let mut rd = SockReader::new(fd, Vec::new());
        rd.ensure(4).await?;
        let cflags = u32::from_be_bytes(rd.consume(4).try_into().expect("4 bytes"));
        if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            return Err(invalid("unknown client flags"));
        }
        let no_zeroes = cflags & FLAG_C_NO_ZEROES != 0;
        let fixed = cflags & FLAG_C_FIXED_NEWSTYLE != 0;
        if tls.is_some() && !fixed {
            return Err(invalid(
                "TLS is required but the client does not speak fixed newstyle",
            ));
        }
        Ok(Self {
            fd,
            exports,
            tls,
            rd,
            no_zeroes,
            fixed,
            structured: false,
            meta: None,
            sess: None,
        })
    }

    /// Reads the next option's header: its code and the length of its payload.
    async fn option_header(&mut self) -> io::Result<(u32, u32)> {
        self.rd.ensure(16).await?;
        let h = self.rd.consume(16);
        let magic = u64::from_be_bytes(h[..8].try_into().expect("8 bytes"));
        let opt = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
        if magic != IHAVEOPT {
            return Err(invalid("bad option magic"));
        }
        if !self.fixed && opt != OPT_EXPORT_NAME {
            return Err(invalid(
                "option other than EXPORT_NAME from a client without fixed newstyle",
            ));
        }
        Ok((opt, len))
    }

    /// Answers option `opt`, whose `len` bytes of payload are still unread: refused before
    /// STARTTLS where TLS is required, skipped when too large, else read and handed to the
    /// handler of its kind.
    async fn answer(&mut self, opt: u32, len: u32) -> io::Result<Step> {
        if self.tls.is_some() && self.sess.is_none() && opt != OPT_STARTTLS {
            let aborted = refuse_before_tls(self.fd, &mut self.rd, opt, len).await?;
            return Ok(if aborted { Step::End } else { Step::Next });
        }
        if opt == OPT_EXPORT_NAME && len as usize > MAX_STRING {
            // No error reply exists for EXPORT_NAME: close.
            return Err(invalid("EXPORT_NAME longer than 4096 bytes"));
        }
        if len > MAX_OPTION_LEN {
            return self.skip_oversized(opt, len).await;
        }
        let data = self.rd.read_vec(len as usize).await?;
        Ok(match opt {
            OPT_EXPORT_NAME => self.opt_export_name(&data)?,
            OPT_ABORT => self.opt_abort().await,
            OPT_LIST => self.opt_list(&data),
            OPT_STARTTLS => self.opt_starttls(&data).await?,
            OPT_STRUCTURED_REPLY => self.opt_structured_reply(&data),
            OPT_INFO | OPT_GO => self.opt_info_or_go(opt, &data),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.opt_meta_context(opt, &data),
            _ => Step::Reply(opt_error(opt, REP_ERR_UNSUP, "unsupported option")),
        })
    }

    /// Sends option replies (inside the TLS session, once there is one).
    async fn reply(&self, replies: Vec<u8>) -> io::Result<()> {
        send(
            self.fd,
            self.sess.as_ref(),
            &mut vec![OutChunk::Bytes(replies)],
            0,
        )
        .await
    }

    /// An option over MAX_OPTION_LEN: too big to be honest, small enough to skip (up to
    /// MAX_SKIP; beyond, the client is cut off). Its payload is discarded and it gets an
    /// error reply; ABORT still ends the negotiation.
    async fn skip_oversized(&mut self, opt: u32, len: u32) -> io::Result<Step> {
        if len > MAX_SKIP {
            return Err(invalid("option payload too large"));
        }
        self.rd.discard(len as usize).await?;
        let reply = match opt {
            OPT_ABORT => return Ok(self.opt_abort().await),
            OPT_LIST
            | OPT_STARTTLS
            | OPT_INFO
            | OPT_GO
            | OPT_STRUCTURED_REPLY
            | OPT_LIST_META_CONTEXT
            | OPT_SET_META_CONTEXT => opt_error(opt, REP_ERR_TOO_BIG, "option too long"),
            _ => opt_error(opt, REP_ERR_UNSUP, "unsupported option"),
        };
        if opt == OPT_SET_META_CONTEXT {
            self.meta = None;
        }
        Ok(Step::Reply(reply))
    }

    /// EXPORT_NAME: the export's size and flags, then the transmission phase. No way to
    /// report an error here: the protocol says close.
    fn opt_export_name(&self, data: &[u8]) -> io::Result<Step> {
        let Some(name) = protocol_string(data) else {
            return Err(invalid("EXPORT_NAME is not a valid string"));
        };
        let Some(export) = self.exports.find(&name) else {
            return Err(invalid("unknown export"));
        };
        let mut v = Vec::with_capacity(10 + 124);
        v.extend_from_slice(&export.link.current().size().to_be_bytes());
        v.extend_from_slice(&export.transmission_flags(self.structured).to_be_bytes());
        if !self.no_zeroes {
            v.extend_from_slice(&[0u8; 124]);
        }
        Ok(Step::Chosen {
            export,
            name,
            reply: v,
        })
    }

    /// ABORT: acknowledged (the client may hang up before reading it: that is fine), and
    /// the negotiation ends.
    async fn opt_abort(&self) -> Step {
        let ack = opt_reply(OPT_ABORT, REP_ACK, &[]);
        let _ = self.reply(ack).await;
        Step::End
    }

    /// LIST: one SERVER reply per export, then ACK.
    fn opt_list(&self, data: &[u8]) -> Step {
        if !data.is_empty() {
            return Step::Reply(opt_error(OPT_LIST, REP_ERR_INVALID, "LIST takes no data"));
        }
        let mut replies = Vec::new();
        for e in self.exports.all() {
            let mut d = Vec::new();
            d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
            d.extend_from_slice(e.name.as_bytes());
            d.extend_from_slice(e.description.as_bytes());
            replies.extend(opt_reply(OPT_LIST, REP_SERVER, &d));
        }
        replies.extend(opt_reply(OPT_LIST, REP_ACK, &[]));
        Step::Reply(replies)
    }

    /// STARTTLS: the TLS handshake, after which the negotiation starts over inside the
    /// session.
    async fn opt_starttls(&mut self, data: &[u8]) -> io::Result<Step> {
        let opt = OPT_STARTTLS;
        if !data.is_empty() {
            return Ok(Step::Reply(opt_error(
                opt,
                REP_ERR_INVALID,
                "STARTTLS takes no data",
            )));
        }
        Ok(match self.tls {
            None => Step::Reply(opt_error(opt, REP_ERR_POLICY, "TLS is not configured")),
            Some(_) if self.sess.is_some() => {
                Step::Reply(opt_error(opt, REP_ERR_INVALID, "TLS is already on"))
            }
            Some(tls) => {
                self.sess = Some(start_tls(self.fd, &mut self.rd, tls).await?);
                // The negotiation starts over inside the session.
                self.structured = false;
                self.meta = None;
                Step::Next
            }
        })
    }

    /// STRUCTURED_REPLY: turns structured replies on, once.
    fn opt_structured_reply(&mut self, data: &[u8]) -> Step {
        let opt = OPT_STRUCTURED_REPLY;
        Step::Reply(if !data.is_empty() {
            opt_error(opt, REP_ERR_INVALID, "STRUCTURED_REPLY takes no data")
        } else if self.structured {
            opt_error(
                opt,
                REP_ERR_INVALID,
                "structured replies already negotiated",
            )
        } else {
            self.structured = true;
            opt_reply(opt, REP_ACK, &[])
        })
    }

    /// INFO and GO: the export's information; GO also chooses it.
    fn opt_info_or_go(&self, opt: u32, data: &[u8]) -> Step {
        let Some((name, reqs)) = parse_info_request(data) else {
            return Step::Reply(opt_error(opt, REP_ERR_INVALID, "malformed INFO/GO request"));
        };
        let Some(export) = self.exports.find(&name) else {
            return Step::Reply(opt_error(
                opt,
                REP_ERR_UNKNOWN,
                &format!("export '{}' not found", sanitize(&name)),
            ));
        };
        let replies = info_replies(opt, &export, &reqs, self.structured);
        if opt == OPT_GO {
            Step::Chosen {
                export,
                name,
                reply: replies,
            }
        } else {
            Step::Reply(replies)
        }
    }

    /// LIST_META_CONTEXT and SET_META_CONTEXT: the contexts of an export a query matches;
    /// SET also selects them (and any SET first forgets the last selection).
    fn opt_meta_context(&mut self, opt: u32, data: &[u8]) -> Step {
        let set = opt == OPT_SET_META_CONTEXT;
        let parsed = parse_meta_request(data);
        if set {
            self.meta = None;
        }
        if !self.structured {
            return Step::Reply(opt_error(
                opt,
                REP_ERR_INVALID,
                "structured replies not negotiated",
            ));
        }
        let Some((name, qs)) = parsed else {
            return Step::Reply(opt_error(
                opt,
                REP_ERR_INVALID,
                "malformed meta context request",
            ));
        };
        let Some(export) = self.exports.find(&name) else {
            return Step::Reply(opt_error(
                opt,
                REP_ERR_UNKNOWN,
                &format!("export '{}' not found", sanitize(&name)),
            ));
        };
        let sel = matching_contexts(&export, &qs, !set);
        let mut replies = Vec::new();
        for (id, ctx) in sel.selected(&export) {
            let id = if set { id } else { 0 };
            let mut d = id.to_be_bytes().to_vec();
            d.extend_from_slice(ctx.as_bytes());
            replies.extend(opt_reply(opt, REP_META_CONTEXT, &d));
        }
        replies.extend(opt_reply(opt, REP_ACK, &[]));
        if set {
            self.meta = Some((name, sel));
        }
        Step::Reply(replies)
    }

    /// The outcome once an export is chosen: base:allocation counts only if the last
    /// SET_META_CONTEXT selected it for this same export.
    fn settle(self, export: Arc<NbdExport>, name: &str) -> Negotiated {
        let meta = match &self.meta {
            Some((n, sel)) if self.exports.same(n, name) => *sel,
            _ => MetaContexts::default(),
        };
        let (pending, cipher) = self.rd.into_parts();
        Negotiated {
            export,
            structured: self.structured,
            meta,
            pending,
            tls: self.sess,
            cipher,
        }
    }
}

/// An INFO or GO payload: the export name and the information requests.
fn parse_info_request(data: &[u8]) -> Option<(String, Vec<u16>)> {
    let mut c = Cursor { data };
    let name = c.string()?;
    let n = c.u16()? as usize;
    let reqs: Vec<u16> = (0..n).map(|_| c.u16()).collect::<Option<_>>()?;
    c.data.is_empty().then_some((name, reqs))
}

/// A LIST_META_CONTEXT or SET_META_CONTEXT payload: the export name and the queries.
fn parse_meta_request(data: &[u8]) -> Option<(String, Vec<String>)> {
    let mut c = Cursor { data };
    let name = c.string()?;
    // Each query takes at least 4 bytes, so the option's size bounds this.
    let n = c.u32()? as usize;
    let qs: Vec<String> = (0..n).map(|_| c.string()).collect::<Option<_>>()?;
    c.data.is_empty().then_some((name, qs))
}

/// The answer to INFO or GO for `export`: the INFO replies (the export, its name and
/// description if asked for, its block sizes), then ACK.
fn info_replies(opt: u32, export: &NbdExport, reqs: &[u16], structured: bool) -> Vec<u8> {
    let mut replies = Vec::new();
    replies.extend(opt_reply(opt, REP_INFO, &export_info(export, structured)));
    if reqs.contains(&INFO_NAME) {
        let mut d = INFO_NAME.to_be_bytes().to_vec();
        d.extend_from_slice(export.name.as_bytes());
        replies.extend(opt_reply(opt, REP_INFO, &d));
    }
    if reqs.contains(&INFO_DESCRIPTION) && !export.description.is_empty() {
        let mut d = INFO_DESCRIPTION.to_be_bytes().to_vec();
        d.extend_from_slice(export.description.as_bytes());
        replies.extend(opt_reply(opt, REP_INFO, &d));
    }
    let mut d = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    d.extend_from_slice(&1u32.to_be_bytes());
    d.extend_from_slice(&4096u32.to_be_bytes());
    d.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
    replies.extend(opt_reply(opt, REP_INFO, &d));
    replies.extend(opt_reply(opt, REP_ACK, &[]));
    replies
}
