//! `nbd`: a node whose data lives on an NBD server (QEMU's NBD client driver).
//!
//! The node owns one connection and one loop of its own (`nbd-<node>`), whose tasks write
//! what the socket could not take at once and read every reply ([`conn`]); requests from
//! any loop share the connection, many in flight, as QEMU's client node runs in its
//! IoThread. Connecting and negotiating are blocking code ([`handshake`]): at open (tried
//! again until `open-timeout` runs out) and, after the connection is lost, on a reconnect
//! thread that tries until it succeeds or the node goes. While it tries, requests wait
//! up to `reconnect-delay` seconds from the loss and are sent again on the new
//! connection; after that (at once with the default 0) they fail with EIO, as QEMU's.
//! A server that stalls holds requests as long as it stalls, unless `x-request-timeout`
//! (stord's option) gives the connection up after that many seconds without a reply.

mod conn;
pub mod handshake;

use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Duration;

use conn::{Conn, Outcome, Request, Sock};
use handshake::{ExportInfo, HandshakeError, Tls};

use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::keyval::KeyVal;
use crate::cli::Help;
use crate::nbd_wire::keepalive::KeepAlive;
use crate::nbd_wire::proto::*;
use crate::tls::creds::TlsCreds;
use crate::tls::error::TlsError;

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["nbd"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "server.type=unix,server.path=<path>\n\
                   | server.type=inet,server.host=<host>,server.port=<port>\n\
                   [,server.keep-alive=on[,server.keep-alive-count|-idle|-interval=<n>]]\n\
                   [,export=<name>][,reconnect-delay=<s>][,open-timeout=<s>]\n\
                   [,x-dirty-bitmap=<context>][,tls-creds=<id>[,tls-hostname=<name>]]\n\
                   [,x-request-timeout=<s>][,x-multi-conn=<n>]",
        about: "an export of an NBD server",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let opts = NbdOptions::from_kv(kv)?;
        let tls = match &opts.tls_creds {
            Some(id) => Some(g.client_tls_creds(id).map_err(GraphError::Invalid)?),
            None => None,
        };
        let driver = NbdDriver::open(opts, tls, flags.node_name)?;
        if driver.info().has(FLAG_READ_ONLY) && !flags.read_only {
            // QEMU's words: its auto-read-only check fails the open with EACCES.
            tracing::debug!(target: "stord::nbd", "NBD export is read-only");
            return Err(GraphError::Invalid(
                "Could not open image: Permission denied".into(),
            ));
        }
        Ok(Opened {
            driver: Box::new(driver),
            read_only: flags.read_only,
            direct: false,
            bitmaps: Vec::new(),
        })
    },
};

/// Where the server listens (QEMU's SocketAddress, `server.*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerAddr {
    Unix(String),
    Inet(String, String),
}

impl std::fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerAddr::Unix(p) => write!(f, "{p}"),
            ServerAddr::Inet(h, p) => write!(f, "{h}:{p}"),
        }
    }
}

/// The node's options.
#[derive(Debug, Clone)]
pub struct NbdOptions {
    pub server: ServerAddr,
    /// An inet server's keep-alive, set on each connection (QEMU's inet_set_sockopts).
    pub keep_alive: KeepAlive,
    /// `export` (QEMU's default: the empty name).
    pub export: String,
    /// `reconnect-delay`: seconds requests wait for a lost connection to come back.
    pub reconnect_delay: u32,
    /// `open-timeout`: seconds the open keeps trying to connect (0: once).
    pub open_timeout: u32,
    /// `x-dirty-bitmap`: the metadata context block status reports instead of
    /// `base:allocation` (`qemu:dirty-bitmap:NAME` or `qemu:allocation-depth`).
    pub x_dirty_bitmap: Option<String>,
    /// `x-request-timeout`: seconds a request may wait for its reply before the
    /// connection counts as lost (stord's; 0, the default, waits as QEMU's client does).
    pub request_timeout: u32,
    /// `x-multi-conn`: connections to open when the server allows several
    /// (NBD_FLAG_CAN_MULTI_CONN); stord's, 1 (QEMU's one connection) by default.
    pub multi_conn: u32,
    /// `tls-creds`: the id of `endpoint=client` credentials; the connection starts TLS.
    pub tls_creds: Option<String>,
    /// The name the server's certificate must carry: `tls-hostname`, else an inet
    /// server's host; none (nothing checked) for a unix socket without `tls-hostname`.
    pub tls_hostname: Option<String>,
}

impl NbdOptions {
    /// From `server.type`, `server.path` | `server.host`/`server.port`, `export`,
    /// `reconnect-delay`, `open-timeout`, `x-dirty-bitmap`, `tls-creds`, `tls-hostname`.
    pub fn from_kv(kv: &mut KeyVal) -> Result<Self, GraphError> {
        let server = match kv.take_choice("server.type", &["unix", "inet"])?.as_deref() {
            Some("unix") => ServerAddr::Unix(kv.take_required("server.path")?),
            Some("inet") => ServerAddr::Inet(
                kv.take_required("server.host")?,
                kv.take_required("server.port")?,
            ),
            _ => return Err(kv.missing("server.type").into()),
        };
        let keep_alive = match server {
            ServerAddr::Inet(..) => KeepAlive::from_options(kv, "server")?,
            ServerAddr::Unix(_) => KeepAlive::default(),
        };
        // Options of QEMU's inet addresses that change nothing on loopback or a LAN.
        for k in ["server.numeric", "server.ipv4", "server.ipv6"] {
            kv.take_bool(k, false)?;
        }
        let tls_creds = kv.take("tls-creds");
        // Without credentials QEMU takes the name and ignores it.
        let tls_hostname = match (kv.take("tls-hostname"), &server) {
            (Some(h), _) => Some(h),
            (None, ServerAddr::Inet(h, _)) => Some(h.clone()),
            (None, ServerAddr::Unix(_)) => None,
        };
        let u32s = 0..=u64::from(u32::MAX);
        let reconnect_delay = kv
            .take_u64_in("reconnect-delay", false, u32s.clone())?
            .unwrap_or(0) as u32;
        let open_timeout = kv
            .take_u64_in("open-timeout", false, u32s.clone())?
            .unwrap_or(0) as u32;
        let request_timeout = kv
            .take_u64_in("x-request-timeout", false, u32s)?
            .unwrap_or(0) as u32;
        let multi_conn = kv
            .take_u64_in("x-multi-conn", false, 1..=u64::from(MAX_CONNECTIONS))?
            .unwrap_or(1) as u32;
        Ok(NbdOptions {
            server,
            keep_alive,
            export: kv.take("export").unwrap_or_default(),
            reconnect_delay,
            open_timeout,
            request_timeout,
            multi_conn,
            x_dirty_bitmap: kv.take("x-dirty-bitmap"),
            tls_creds,
            tls_hostname,
        })
    }

    /// The request timeout, if there is one.
    fn timeout(&self) -> Option<Duration> {
        (self.request_timeout > 0).then(|| Duration::from_secs(u64::from(self.request_timeout)))
    }

    fn context(&self) -> &str {
        self.x_dirty_bitmap
            .as_deref()
            .unwrap_or(META_BASE_ALLOCATION)
    }

    /// QEMU's file name of the node (`nbd+unix:///EXPORT?socket=PATH`,
    /// `nbd://HOST:PORT/EXPORT`).
    fn filename(&self) -> String {
        match &self.server {
            ServerAddr::Unix(p) => format!("nbd+unix:///{}?socket={p}", self.export),
            ServerAddr::Inet(h, port) => format!("nbd://{h}:{port}/{}", self.export),
        }
    }
}

/// Most connections `x-multi-conn` may ask for.
const MAX_CONNECTIONS: u32 = 16;

/// How long one connection attempt may take (connect and negotiation).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Waits between reconnect attempts: the first, doubled up to the last.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Connects and negotiates once (blocking, each step within `attempt`), starting TLS with
/// `tls` if given.
fn connect(
    o: &NbdOptions,
    tls: Option<&TlsCreds>,
    attempt: Duration,
) -> Result<(Sock, ExportInfo, Tls), String> {
    let failed = |e: io::Error| {
        format!(
            "Failed to connect to '{}': {}",
            o.server,
            crate::sys::os_text(&e)
        )
    };
    let mut sock = match &o.server {
        ServerAddr::Unix(p) => {
            Sock::Unix(std::os::unix::net::UnixStream::connect(p).map_err(failed)?)
        }
        ServerAddr::Inet(h, port) => {
            use std::net::ToSocketAddrs;
            let addrs = format!("{h}:{port}")
                .to_socket_addrs()
                .map_err(|e| format!("address resolution failed for {h}:{port}: {e}"))?;
            let mut last = io::Error::from(io::ErrorKind::AddrNotAvailable);
            let mut got = None;
            for a in addrs {
                match std::net::TcpStream::connect_timeout(&a, attempt) {
                    Ok(s) => {
                        got = Some(s);
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            let s = got.ok_or_else(|| failed(last))?;
            let _ = s.set_nodelay(true);
            o.keep_alive.apply(std::os::fd::AsRawFd::as_raw_fd(&s))?;
            Sock::Tcp(s)
        }
    };
    let sess = match tls {
        Some(c) => Some(
            c.new_client_session(o.tls_hostname.as_deref())
                .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let (info, sess) = match &mut sock {
        Sock::Unix(s) => {
            s.set_read_timeout(Some(attempt)).map_err(failed)?;
            s.set_write_timeout(Some(attempt)).map_err(failed)?;
            handshake::negotiate(s, &o.export, o.context(), sess)
        }
        Sock::Tcp(s) => {
            s.set_read_timeout(Some(attempt)).map_err(failed)?;
            s.set_write_timeout(Some(attempt)).map_err(failed)?;
            handshake::negotiate(s, &o.export, o.context(), sess)
        }
    }
    .map_err(|e| match e {
        // A certificate refused: QEMU's words for it.
        HandshakeError::Tls(TlsError::Rustls(r)) => {
            crate::tls::x509::refusal_text(&r, o.tls_hostname.as_deref())
                .unwrap_or_else(|| format!("TLS handshake failed: {r}"))
        }
        HandshakeError::Tls(TlsError::Handshake(why)) => format!("TLS handshake failed: {why}"),
        e => e.to_string(),
    })?;
    if o.x_dirty_bitmap.is_some() && info.context.is_none() {
        // QEMU reports EINVAL from the open (its own text goes to a hint nobody sees).
        tracing::debug!(target: "stord::nbd", "requested x-dirty-bitmap {} not found", o.context());
        return Err("Could not open image: Invalid argument".into());
    }
    match &sock {
        Sock::Unix(s) => s.set_nonblocking(true),
        Sock::Tcp(s) => s.set_nonblocking(true),
    }
    .map_err(failed)?;
    Ok((sock, info, sess))
}

/// How long an extra connection (multi-conn) may take: a server at its client limit
/// accepts and never greets, and the first connection is already serving.
const EXTRA_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// When the node asks for several connections and the server allows them
/// (NBD_FLAG_CAN_MULTI_CONN: a flush on one covers writes completed on all), more to the
/// export `first` found, as many as connect (blocking).
fn more_connections(o: &NbdOptions, tls: Option<&TlsCreds>, first: &ExportInfo) -> Vec<Arc<Conn>> {
    let mut conns = Vec::new();
    if o.multi_conn <= 1 {
        return conns;
    }
    if !first.has(FLAG_CAN_MULTI_CONN) {
        tracing::info!(
            target: "stord::nbd",
            "{} does not allow several connections: using one",
            o.server
        );
        return conns;
    }
    while conns.len() + 1 < o.multi_conn as usize {
        match connect(o, tls, EXTRA_ATTEMPT_TIMEOUT) {
            Ok((sock, info, sess)) if same_export(first, &info) => {
                conns.push(Conn::new(sock, info, sess, o.timeout()))
            }
            Ok(_) => break,
            Err(e) => {
                tracing::warn!(target: "stord::nbd", "extra connection to {}: {e}", o.server);
                break;
            }
        }
    }
    conns
}

/// Whether a reconnect found the export the node was opened on: the same size and flags,
/// block status where it had it, and room for requests as large as it took.
fn same_export(old: &ExportInfo, new: &ExportInfo) -> bool {
    new.size == old.size
        && new.flags == old.flags
        && new.structured == old.structured
        && new.context.is_some() == old.context.is_some()
        && new.max_block >= old.max_block
        && new.min_block <= old.min_block
}

/// The node's current connections, and who waits for the next.
#[derive(Default)]
struct LinkState {
    /// One, or with multi-conn several, used in turn; they go and come back together.
    conns: Vec<Arc<Conn>>,
    /// The connection the next request takes.
    next: usize,
    /// When the connections were lost (monotonic ns), while there are none.
    lost_at: Option<u64>,
    /// A reconnect thread is trying.
    reconnecting: bool,
    /// The node is going: no more reconnects.
    closing: bool,
    waiters: Vec<Waker>,
}

/// What the driver, its reconnect thread and its requests share.
struct Link {
    opts: NbdOptions,
    /// `tls-creds`, held while the node is open (`object-del` refuses them meanwhile).
    tls: Option<Arc<TlsCreds>>,
    /// The export as first negotiated: a reconnect must find it the same size.
    info: ExportInfo,
    state: Mutex<LinkState>,
    /// The connection's loop.
    home: stord_aio::Remote,
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Installs new connections and wakes whoever waits for one.
    fn install(&self, conns: Vec<Arc<Conn>>) {
        for c in &conns {
            c.start(&self.home);
        }
        let waiters = {
            let mut st = self.lock();
            st.conns = conns;
            st.lost_at = None;
            st.reconnecting = false;
            std::mem::take(&mut st.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }

    /// Adds the extra connections multi-conn asks for beside the first one, which serves
    /// meanwhile; they are dropped if the first is gone by the time they are up.
    fn add_extras(&self) {
        let Some(first) = self.lock().conns.first().cloned() else {
            return;
        };
        let extras = more_connections(&self.opts, self.tls.as_deref(), &first.info);
        if extras.is_empty() {
            return;
        }
        for c in &extras {
            c.start(&self.home);
        }
        let mut st = self.lock();
        if st.closing || !st.conns.first().is_some_and(|f| Arc::ptr_eq(f, &first)) {
            drop(st);
            for c in extras {
                c.disconnect();
            }
            return;
        }
        st.conns.extend(extras);
    }

    /// Tries to connect again until it works or the node closes (on its own thread).
    fn reconnect(self: Arc<Self>) {
        let mut wait = Duration::ZERO;
        loop {
            std::thread::sleep(wait);
            if self.lock().closing {
                return;
            }
            match connect(&self.opts, self.tls.as_deref(), ATTEMPT_TIMEOUT) {
                Ok((sock, info, sess)) if same_export(&self.info, &info) => {
                    tracing::info!(target: "stord::nbd", "reconnected to {}", self.opts.server);
                    self.install(vec![Conn::new(sock, info, sess, self.opts.timeout())]);
                    return self.add_extras();
                }
                Ok(_) => tracing::warn!(
                    target: "stord::nbd",
                    "cannot reconnect to {}: the export changed (size, flags or limits)",
                    self.opts.server
                ),
                Err(e) => tracing::debug!(target: "stord::nbd", "reconnect: {e}"),
            }
            wait = (wait * 2).clamp(RETRY_FIRST, RETRY_MAX);
        }
    }

    /// A live connection: the current one, else one a reconnect brings within
    /// `reconnect-delay` of the loss; else EIO.
    async fn connection(self: &Arc<Self>) -> io::Result<Arc<Conn>> {
        // The timer for the current deadline (it moves if a new connection is lost again).
        let mut sleep: Option<(u64, std::pin::Pin<Box<stord_aio::Sleep>>)> = None;
        std::future::poll_fn(|cx| {
            let mut st = self.lock();
            if !st.conns.is_empty() {
                if st.conns.iter().all(|c| !c.is_dead()) {
                    st.next = st.next.wrapping_add(1);
                    let c = st.conns[st.next % st.conns.len()].clone();
                    return Poll::Ready(Ok(c));
                }
                // One lost takes the others with it: they reconnect as one, and their
                // requests are sent again on the new ones.
                for c in std::mem::take(&mut st.conns) {
                    c.fail("another connection of the node was lost");
                }
            }
            let now = stord_aio::sys::now_ns();
            let lost_at = *st.lost_at.get_or_insert(now);
            if !st.reconnecting && !st.closing {
                st.reconnecting = true;
                let link = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("stord-nbd-reconnect".into())
                    .spawn(move || link.reconnect());
                if let Err(e) = spawned {
                    st.reconnecting = false;
                    tracing::error!("cannot start an NBD reconnect thread: {e}");
                }
            }
            let deadline = lost_at + u64::from(self.opts.reconnect_delay) * 1_000_000_000;
            if now >= deadline || st.closing {
                tracing::debug!(target: "stord::nbd", "request failed: no connection");
                return Poll::Ready(Err(io::Error::from_raw_os_error(libc::EIO)));
            }
            st.waiters.push(cx.waker().clone());
            drop(st);
            if !matches!(&sleep, Some((d, _)) if *d == deadline) {
                sleep = Some((deadline, Box::pin(stord_aio::sleep_until(deadline))));
            }
            // Woken by the timer or a new connection; either way look again.
            if let Some((_, s)) = sleep.as_mut() {
                if s.as_mut().poll(cx).is_ready() {
                    cx.waker().wake_by_ref();
                }
            }
            Poll::Pending
        })
        .await
    }
}

/// The NBD client driver.
pub struct NbdDriver {
    link: Arc<Link>,
    /// The connection's loop (stopped and joined when the node goes).
    _thread: stord_aio::IoThread,
    /// With a server minimum block size above 1, writes hold their blocks so that a
    /// read-modify-write of a partial block never interleaves with another write there.
    write_locks: crate::block::node::range_lock::RangeLocks,
}

impl NbdDriver {
    /// Connects (trying again for `open-timeout` seconds) and starts the node's loop.
    pub fn open(
        opts: NbdOptions,
        tls: Option<Arc<TlsCreds>>,
        node_name: &str,
    ) -> Result<Self, GraphError> {
        let deadline =
            std::time::Instant::now() + Duration::from_secs(u64::from(opts.open_timeout));
        let mut wait = RETRY_FIRST;
        let (sock, info, sess) = loop {
            match connect(&opts, tls.as_deref(), ATTEMPT_TIMEOUT) {
                Ok(c) => break c,
                Err(e) if std::time::Instant::now() + wait >= deadline => {
                    return Err(GraphError::Invalid(e))
                }
                Err(_) => {
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(RETRY_MAX);
                }
            }
        };
        let thread = stord_aio::IoThread::spawn(stord_aio::AioContextOptions {
            name: format!("nbd-{node_name}"),
            ..Default::default()
        })
        .map_err(|e| GraphError::Invalid(format!("cannot start the node's loop: {e}")))?;
        let link = Arc::new(Link {
            opts,
            tls,
            info: info.clone(),
            state: Mutex::default(),
            home: thread.remote().clone(),
        });
        link.install(vec![Conn::new(sock, info, sess, link.opts.timeout())]);
        link.add_extras();
        Ok(NbdDriver {
            link,
            _thread: thread,
            write_locks: Default::default(),
        })
    }

    fn info(&self) -> &ExportInfo {
        &self.link.info
    }

    /// One request, sent again on a new connection if the old one is lost in between
    /// (within `reconnect-delay`).
    async fn call(
        &self,
        req: Request,
        data: Option<&[u8]>,
        mut buf: Option<Buf>,
    ) -> (io::Result<conn::Reply>, Option<Buf>) {
        // A request lost again and again (a reply that always takes longer than
        // x-request-timeout) fails once reconnect-delay has passed since its first loss,
        // not at every new connection's.
        let mut first_lost: Option<u64> = None;
        let delay = u64::from(self.link.opts.reconnect_delay) * 1_000_000_000;
        loop {
            let c = match self.link.connection().await {
                Ok(c) => c,
                Err(e) => return (Err(e), buf),
            };
            match c.call(req, data, buf).await {
                (Outcome::Done(r), b) => return (r, b),
                (Outcome::Lost, b) => {
                    buf = b;
                    let now = stord_aio::sys::now_ns();
                    let first = *first_lost.get_or_insert(now);
                    if now.saturating_sub(first) > delay && first != now {
                        return (Err(io::Error::from_raw_os_error(libc::EIO)), buf);
                    }
                }
            }
        }
    }

    async fn simple(&self, cmd: u16, flags: u16, offset: u64, len: u32) -> io::Result<()> {
        let req = Request {
            cmd,
            flags,
            offset,
            len,
        };
        self.call(req, None, None).await.0.map(|_| ())
    }

    /// Largest request payload (the server's limit).
    fn max_payload(&self) -> usize {
        self.info().max_block as usize
    }

    /// Largest length of a request without payload (trim, write-zeroes, block status).
    fn max_length(&self) -> u64 {
        let align = u64::from(self.info().min_block);
        (u64::from(u32::MAX) / align) * align
    }

    async fn read_at(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        let len = buf.len();
        let req = Request {
            cmd: CMD_READ,
            flags: 0,
            offset,
            len: len as u32,
        };
        let (r, b) = self.call(req, None, Some(buf)).await;
        (r.map(|_| ()), b.expect("a read's buffer comes back"))
    }

    /// One write request; `fua` only where the server takes it.
    async fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let req = Request {
            cmd: CMD_WRITE,
            flags: if fua { CMD_FLAG_FUA } else { 0 },
            offset,
            len: data.len() as u32,
        };
        self.call(req, Some(data), None).await.0.map(|_| ())
    }

    /// A read as the server takes it: in pieces of at most its maximum payload.
    async fn read_pieces(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        let max = self.max_payload();
        if buf.len() <= max {
            return self.read_at(offset, buf).await;
        }
        // Larger than the server takes: in pieces, through a buffer of the largest.
        let mut buf = buf;
        let mut piece = crate::buf::request_buf(max);
        let mut at = 0;
        while at < buf.len() {
            let n = (buf.len() - at).min(max);
            if n < max {
                piece = crate::buf::request_buf(n);
            }
            let (r, p) = self.read_at(offset + at as u64, piece).await;
            piece = p;
            if let Err(e) = r {
                return (Err(e), buf);
            }
            buf[at..at + n].copy_from_slice(&piece[..n]);
            at += n;
        }
        (Ok(()), buf)
    }

    /// A write as the server takes it: in pieces of at most its maximum payload.
    async fn write_pieces(&self, offset: u64, buf: &[u8], fua: bool) -> io::Result<()> {
        // Larger than the server takes: in pieces, each with FUA when the server has
        // it; else one flush after the last.
        let native_fua = fua && self.info().has(FLAG_SEND_FUA);
        let max = self.max_payload();
        let mut at = 0;
        while at < buf.len() {
            let n = (buf.len() - at).min(max);
            self.write_at(offset + at as u64, &buf[at..at + n], native_fua)
                .await?;
            at += n;
        }
        if fua && !native_fua {
            return self.do_flush().await;
        }
        Ok(())
    }

    /// The server's minimum block size (a power of two).
    fn align(&self) -> u64 {
        u64::from(self.info().min_block)
    }

    /// Whether `[offset, offset + len)` splits a block of the server's minimum size.
    fn misaligned(&self, offset: u64, len: u64) -> bool {
        (offset | len) & (self.align() - 1) != 0
    }

    /// The whole blocks around `[offset, offset + len)`, within the export.
    fn blocks(&self, offset: u64, len: u64) -> (u64, u64) {
        let a = self.align();
        let start = offset & !(a - 1);
        let end = (offset + len).div_ceil(a) * a;
        (start, end.min(self.size().max(offset + len)))
    }

    /// A write on a server with a minimum block size: its blocks held, and a partial block
    /// at either end read first and written whole (QEMU's block layer does the same for
    /// its request alignment).
    async fn write_blocks(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let (start, end) = self.blocks(offset, data.len() as u64);
        let _held = self.write_locks.lock(start, end).await;
        if !self.misaligned(offset, data.len() as u64) {
            return self.write_pieces(offset, data, fua).await;
        }
        let a = self.align();
        let mut tmp = crate::buf::request_buf((end - start) as usize);
        // The first and the last block, which the data covers only partly.
        let mut edges = vec![start];
        if end - start > a {
            edges.push(end - a);
        }
        for b in edges {
            let (r, block) = self
                .read_pieces(b, crate::buf::request_buf(a as usize))
                .await;
            r?;
            let at = (b - start) as usize;
            tmp[at..at + a as usize].copy_from_slice(&block);
        }
        let at = (offset - start) as usize;
        tmp[at..at + data.len()].copy_from_slice(data);
        self.write_pieces(start, &tmp, fua).await
    }

    async fn do_flush(&self) -> io::Result<()> {
        if !self.info().has(FLAG_SEND_FLUSH) {
            return Ok(());
        }
        self.simple(CMD_FLUSH, 0, 0, 0).await
    }

    /// Trim or write-zeroes over a range, in pieces the protocol's 32-bit length holds.
    async fn ranged(&self, cmd: u16, flags: u16, mut offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len;
        while offset < end {
            let n = (end - offset).min(self.max_length());
            self.simple(cmd, flags, offset, n as u32).await?;
            offset += n;
        }
        Ok(())
    }
}

impl Drop for NbdDriver {
    fn drop(&mut self) {
        let conns = {
            let mut st = self.link.lock();
            st.closing = true;
            std::mem::take(&mut st.conns)
        };
        for c in conns {
            c.disconnect();
        }
        for w in std::mem::take(&mut self.link.lock().waiters) {
            w.wake();
        }
    }
}

impl BlockDriver for NbdDriver {
    fn driver_name(&self) -> &'static str {
        "nbd"
    }
    /// As QEMU's nbd_refresh_limits: the server's block sizes (stord sends byte-granular
    /// requests to a server that gave none); transfers, zeroing and discards bounded as
    /// QEMU bounds them (32 MiB, INT_MAX).
    fn refresh_limits(&self, bl: &mut crate::block::node::limits::BlockLimits) {
        let info = self.info();
        let (min, max) = (info.min_block, info.max_block.min(32 << 20));
        bl.request_alignment = min;
        bl.max_discard = u64::from(i32::MAX as u32 / min * min);
        bl.max_write_zeroes = u64::from(max);
        bl.max_transfer = max;
        if info.opt_block > bl.opt_transfer {
            bl.opt_transfer = info.opt_block;
        }
    }
    fn size(&self) -> u64 {
        self.info().size
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            if !self.misaligned(offset, buf.len() as u64) {
                return self.read_pieces(offset, buf).await;
            }
            // Whole blocks around it, through a buffer.
            let (start, end) = self.blocks(offset, buf.len() as u64);
            let (r, tmp) = self
                .read_pieces(start, crate::buf::request_buf((end - start) as usize))
                .await;
            let mut buf = buf;
            if r.is_ok() {
                let at = (offset - start) as usize;
                let n = buf.len();
                buf.copy_from_slice(&tmp[at..at + n]);
            }
            (r, buf)
        })
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            if self.align() == 1 {
                let r = self.write_pieces(offset, &buf, fua).await;
                return (r, buf);
            }
            let r = self.write_blocks(offset, &buf, fua).await;
            (r, buf)
        })
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.do_flush())
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            if !self.info().has(FLAG_SEND_TRIM) {
                return Ok(());
            }
            // Only whole blocks: a discard may leave any part of its range as it was.
            let a = self.align();
            let (start, end) = (offset.div_ceil(a) * a, (offset + len) & !(a - 1));
            if start >= end {
                return Ok(());
            }
            self.ranged(CMD_TRIM, 0, start, end - start).await
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            if self.align() > 1 && self.misaligned(offset, len) {
                // Partial blocks at the ends are written as data; the whole ones between
                // are zeroed as the server does it.
                let a = self.align();
                let (inner_start, inner_end) = (offset.div_ceil(a) * a, (offset + len) & !(a - 1));
                if inner_start >= inner_end {
                    return self
                        .write_blocks(offset, &vec![0u8; len as usize], false)
                        .await;
                }
                if offset < inner_start {
                    let n = (inner_start - offset) as usize;
                    self.write_blocks(offset, &vec![0u8; n], false).await?;
                }
                if inner_end < offset + len {
                    let n = (offset + len - inner_end) as usize;
                    self.write_blocks(inner_end, &vec![0u8; n], false).await?;
                }
                return self
                    .write_zeroes(inner_start, inner_end - inner_start, may_unmap)
                    .await;
            }
            let _held = match self.align() {
                1 => None,
                _ => Some(self.write_locks.lock(offset, offset + len).await),
            };
            if self.info().has(FLAG_SEND_WRITE_ZEROES) {
                let flags = if may_unmap { 0 } else { CMD_FLAG_NO_HOLE };
                return self.ranged(CMD_WRITE_ZEROES, flags, offset, len).await;
            }
            // A server without it gets zeroes written.
            let zeroes = vec![0u8; (self.max_payload() as u64).min(len).min(1 << 20) as usize];
            let (mut at, end) = (offset, offset + len);
            while at < end {
                let n = (end - at).min(zeroes.len() as u64) as usize;
                self.write_at(at, &zeroes[..n], false).await?;
                at += n as u64;
            }
            Ok(())
        })
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(async move {
            if self.info().context.is_none() {
                return Ok(BlockStatus {
                    len,
                    allocated: true,
                    zero: false,
                });
            }
            // Asked from the start of the block (a server's extents are whole blocks).
            let start = offset & !(self.align() - 1);
            let (_, end) = self.blocks(offset, len);
            let n = (end - start).min(self.max_length());
            let req = Request {
                cmd: CMD_BLOCK_STATUS,
                flags: CMD_FLAG_REQ_ONE,
                offset: start,
                len: n as u32,
            };
            let (r, _) = self.call(req, None, None).await;
            let mut st = r?
                .status
                .ok_or_else(|| io::Error::other("NBD server sent no block status"))?;
            st.len = st.len.saturating_sub(offset - start).clamp(1, len);
            Ok(st)
        })
    }
    fn block_status_costly(&self) -> bool {
        true
    }
    /// QEMU's block_resize truncates inexactly: a smaller size succeeds and changes
    /// nothing (the export keeps its size); a larger one is refused.
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        let r = if size <= self.size() {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "Cannot grow NBD nodes",
            ))
        };
        Box::pin(std::future::ready(r))
    }
    fn filename(&self) -> Option<String> {
        Some(self.link.opts.filename())
    }
    fn reports_host_size(&self) -> bool {
        false
    }
    fn has_image_info(&self) -> bool {
        false
    }
}
