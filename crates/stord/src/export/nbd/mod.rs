//! The NBD export: a server socket (unix or TCP) and the exports it offers.
//!
//! New connections are accepted and negotiated on the main loop ([`handshake`]); once the
//! client has chosen an export, the connection moves to one of that export's IoThreads (the
//! one with the fewest of its connections), where its requests run as tasks
//! ([`transmission`]). Several IoThreads let a multi-connection client (nbdcopy, fio with
//! several jobs, the kernel client) use several cores; qsd 10 serves all of an export's
//! connections on one thread.
//!
//! With `tls-creds`, every client must start TLS (STARTTLS) before anything else; the
//! session moves with the connection to its IoThread.

#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;
mod handshake;
mod transmission;

pub use crate::nbd_wire::proto;

use std::cell::{Cell, RefCell};

use std::net::TcpListener;
use std::os::fd::RawFd;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use stord_aio::{AioContext, Remote};

use std::task::{Context, Poll};

use crate::accept::Acceptor;
use crate::block::node::block_node::BlockNode;
use crate::block::node::dirty_bitmap::{DirtyBitmap, Use};
use crate::block::node::link::NodeLink;
use crate::cli::keyval::{KeyVal, OptionError};
use crate::export::budget::MemoryBudget;
use crate::export::{DrainSignal, Export, ExportEnv, ExportError};
use crate::tls::TlsServer;
use proto::*;

/// One exported node.
pub struct NbdExport {
    /// The export's `id` (block-export id).
    pub id: String,
    /// The name clients ask for.
    pub name: String,
    /// Free text shown by NBD_OPT_LIST / INFO.
    pub description: String,
    /// The node served (a pivot may move it).
    pub link: Arc<NodeLink>,
    /// Writes allowed.
    pub writable: bool,
    /// Where connections run (empty: the main loop). Each new connection goes to the one
    /// with the fewest of this export's connections.
    pub iothreads: Vec<Remote>,
    /// Connections of this export on each of `iothreads`.
    load: Vec<AtomicUsize>,
    /// Advertise NBD_FLAG_CAN_MULTI_CONN.
    pub multi_conn: bool,
    /// Offer the qemu:allocation-depth metadata context (`allocation-depth=on`).
    pub allocation_depth: bool,
    /// Dirty bitmaps offered as qemu:dirty-bitmap:NAME contexts (`bitmaps=`), busy while
    /// exported.
    pub bitmaps: Vec<Arc<DirtyBitmap>>,
    /// `writethrough=on`: every write is durable before it is acknowledged (FUA).
    pub writethrough: bool,
    /// Sockets of the connections in transmission phase now.
    pub clients: Mutex<Vec<RawFd>>,
    /// Deleted: new connections are refused, existing ones are being closed.
    pub shutting_down: AtomicBool,
    /// Woken when a connection leaves `clients`.
    drain: DrainSignal,
    /// The request data this export's connections may hold together (`x-buffer-limit`,
    /// stord's own; by default half the server's): one export's clients cannot take the
    /// whole server budget from the others.
    pub budget: Arc<MemoryBudget>,
}

impl Drop for NbdExport {
    fn drop(&mut self) {
        for b in &self.bitmaps {
            b.set_busy(false);
        }
    }
}

impl NbdExport {
    /// A new export with no clients.
    pub fn new(
        id: String,
        name: String,
        description: String,
        node: Arc<BlockNode>,
        writable: bool,
        iothreads: Vec<Remote>,
        multi_conn: bool,
    ) -> Self {
        let load = iothreads.iter().map(|_| AtomicUsize::new(0)).collect();
        Self {
            id,
            name,
            description,
            link: NodeLink::new(node),
            writable,
            iothreads,
            load,
            multi_conn,
            allocation_depth: false,
            bitmaps: Vec::new(),
            writethrough: false,
            clients: Mutex::default(),
            shutting_down: AtomicBool::new(false),
            drain: DrainSignal::default(),
            budget: Arc::new(MemoryBudget::new(usize::MAX)),
        }
    }

    /// The IoThread for a new connection (the least loaded), counted until the returned
    /// guard is dropped; None: the main loop serves it.
    fn place(self: &Arc<Self>) -> Option<(Remote, Placement)> {
        let (i, _) = self
            .load
            .iter()
            .enumerate()
            .min_by_key(|(_, n)| n.load(Ordering::Relaxed))?;
        self.load[i].fetch_add(1, Ordering::Relaxed);
        Some((
            self.iothreads[i].clone(),
            Placement {
                export: self.clone(),
                index: i,
            },
        ))
    }

    /// Connections of this export on each IoThread, in order.
    pub fn load(&self) -> Vec<usize> {
        self.load
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect()
    }

    /// Connections in transmission phase now.
    pub fn client_count(&self) -> usize {
        self.clients.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Marks the export deleted and disconnects every client (their in-flight requests
    /// finish; replies are dropped). Safe from any thread.
    pub fn disconnect_all(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        for &fd in self
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            crate::sys::shutdown(fd);
        }
    }

    /// The transmission flags advertised for this export.
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let mut f = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA;
        if self.multi_conn {
            f |= FLAG_CAN_MULTI_CONN;
        }
        if self.writable {
            f |= FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES;
        } else {
            f |= FLAG_READ_ONLY;
        }
        if structured {
            f |= FLAG_SEND_DF;
        }
        f
    }
}

/// A connection's place on one of its export's IoThreads; leaving it frees the place.
struct Placement {
    export: Arc<NbdExport>,
    index: usize,
}

impl Drop for Placement {
    fn drop(&mut self) {
        self.export.load[self.index].fetch_sub(1, Ordering::Relaxed);
    }
}

/// The exports the server offers (main loop only).
#[derive(Clone, Default)]
pub struct ExportTable(Rc<RefCell<Vec<Arc<NbdExport>>>>);

impl ExportTable {
    /// Adds an export; its name must be new.
    pub fn add(&self, e: Arc<NbdExport>) -> Result<(), String> {
        let mut v = self.0.borrow_mut();
        if v.iter().any(|x| x.name == e.name) {
            return Err(format!("an NBD export named '{}' already exists", e.name));
        }
        v.push(e);
        Ok(())
    }

    /// Removes the export with block-export id `id`.
    pub fn remove_id(&self, id: &str) -> Option<Arc<NbdExport>> {
        let mut v = self.0.borrow_mut();
        let i = v.iter().position(|e| e.id == id)?;
        Some(v.remove(i))
    }

    /// The export with block-export id `id`.
    pub fn by_id(&self, id: &str) -> Option<Arc<NbdExport>> {
        self.0.borrow().iter().find(|e| e.id == id).cloned()
    }

    /// The export a client asks for by name; "" means the only export, if there is one.
    pub fn find(&self, name: &str) -> Option<Arc<NbdExport>> {
        let v = self.0.borrow();
        if let Some(e) = v.iter().find(|e| e.name == name) {
            return Some(e.clone());
        }
        if name.is_empty() && v.len() == 1 {
            return Some(v[0].clone());
        }
        None
    }

    /// Whether two names a client used refer to the same export.
    pub fn same(&self, a: &str, b: &str) -> bool {
        match (self.find(a), self.find(b)) {
            (Some(x), Some(y)) => Arc::ptr_eq(&x, &y),
            _ => false,
        }
    }

    /// All exports.
    pub fn all(&self) -> Vec<Arc<NbdExport>> {
        self.0.borrow().clone()
    }
}

/// An NBD export as the daemon holds it: the export and the server table offering it.
pub struct NbdExportHandle {
    export: Arc<NbdExport>,
    table: ExportTable,
}

/// Most bitmaps one export offers.
const MAX_EXPORT_BITMAPS: usize = 32;

/// The `bitmaps` an export offers: each a name found on the node or down its chain of
/// filters and backing files, or `{node, name}` (QEMU's rules and texts).
fn export_bitmaps(
    env: &ExportEnv<'_>,
    kv: &mut KeyVal,
    node: &Arc<BlockNode>,
    writable: bool,
) -> Result<Vec<Arc<DirtyBitmap>>, ExportError> {
    let mut out: Vec<Arc<DirtyBitmap>> = Vec::new();
    for i in 0.. {
        let key = format!("bitmaps.{i}");
        let (b, owner) = if let Some(name) = kv.take(&key) {
            let mut at = Some(node.clone());
            let mut found = None;
            while let Some(n) = at {
                if let Ok(b) = n.bitmap(&name) {
                    found = Some((b, n));
                    break;
                }
                at = n.filtered_or_backing();
            }
            found.ok_or_else(|| ExportError::Invalid(format!("Bitmap '{name}' is not found")))?
        } else if let Some(mut o) = kv.take_prefixed(&key) {
            let node_name = o.take_required("node")?;
            let name = o.take_required("name")?;
            o.finish()?;
            let n = env
                .node(&kv.what, &node_name)
                .map_err(|_| ExportError::Invalid(format!("Node '{node_name}' not found")))?;
            let b = n
                .bitmap(&name)
                .map_err(|e| ExportError::Invalid(e.to_string()))?;
            (b, n)
        } else {
            break;
        };
        b.check(Use::AllowReadOnly)
            .map_err(|e| ExportError::Invalid(e.to_string()))?;
        if !writable && !owner.is_read_only() && b.is_recording() {
            return Err(ExportError::Invalid(format!(
                "Enabled bitmap '{}' incompatible with readonly export",
                b.name
            )));
        }
        if out.len() == MAX_EXPORT_BITMAPS {
            return Err(ExportError::Invalid(format!(
                "an export offers at most {MAX_EXPORT_BITMAPS} bitmaps"
            )));
        }
        out.push(b);
    }
    Ok(out)
}

/// The smallest per-export buffer limit (one large request must fit).
const FREE_REQUEST_FLOOR: usize = 1 << 20;

/// `--export type=nbd` / `block-export-add`: needs the NBD server running.
pub fn create(env: &ExportEnv<'_>, mut kv: KeyVal) -> Result<Box<dyn Export>, ExportError> {
    let id = kv.take_required("id")?;
    let node_name = kv.take_required("node-name")?;
    let node = env.node(&kv.what, &node_name)?;
    let name = kv.take("name").unwrap_or_else(|| node_name.clone());
    let description = kv.take("description").unwrap_or_default();
    let writable = kv.take_bool("writable", false)?;
    let writethrough = kv.take_bool("writethrough", false)?;
    let _ = kv.take_bool("fixed-iothread", false)?;
    let allocation_depth = kv.take_bool("allocation-depth", false)?;
    let names = kv.take_list("iothread");
    let bitmaps = export_bitmaps(env, &mut kv, &node, writable)?;
    // multi-conn is safe whenever it is asked for or left to us: every connection reaches
    // the same node, and a flush (fdatasync of the one file) covers every write completed
    // before it, whichever connection sent it.
    let multi_conn = !matches!(
        kv.take_choice("multi-conn", &["on", "off", "auto"])?
            .as_deref(),
        Some("off")
    );
    let buffer_limit = kv.take_u64("x-buffer-limit", true)?;
    let what = kv.what.clone();
    let iothreads = env.remotes(&what, &names)?;
    kv.finish()?;
    if writable && node.is_read_only() {
        return Err(
            format!("{what}: node '{node_name}' is read-only, cannot export it writable").into(),
        );
    }
    let Some(server) = env.server::<NbdServer>("nbd") else {
        return Err(ExportError::Invalid("NBD server not running".into()));
    };
    let table = server.table();
    let limit = buffer_limit.map_or(server.budget.limit() / 2, |l| l as usize);
    let mut export = NbdExport::new(id, name, description, node, writable, iothreads, multi_conn);
    export.budget = Arc::new(MemoryBudget::new(limit.max(FREE_REQUEST_FLOOR)));
    export.allocation_depth = allocation_depth;
    export.writethrough = writethrough;
    // Busy from now until the export goes (its Drop), as QEMU marks them.
    for b in &bitmaps {
        b.set_busy(true);
    }
    export.bitmaps = bitmaps;
    let export = Arc::new(export);
    table
        .add(export.clone())
        .map_err(|e| format!("{what}: {e}"))?;
    Ok(Box::new(NbdExportHandle {
        export,
        table: table.clone(),
    }))
}

impl Export for NbdExportHandle {
    fn id(&self) -> &str {
        &self.export.id
    }
    fn kind(&self) -> &'static str {
        "nbd"
    }
    fn writable(&self) -> bool {
        self.export.writable
    }
    fn link(&self) -> &Arc<NodeLink> {
        &self.export.link
    }
    fn runs_on(&self, thread: &Remote) -> bool {
        self.export
            .iothreads
            .iter()
            .any(|r| r.thread_id() == thread.thread_id())
    }
    fn in_use(&self) -> bool {
        self.export.client_count() > 0
    }
    fn shutting_down(&self) -> bool {
        self.export.shutting_down.load(Ordering::SeqCst)
    }
    fn begin_stop(&mut self) {
        self.table.remove_id(&self.export.id);
        self.export.disconnect_all();
    }
    fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.export
            .drain
            .poll(cx, || self.export.client_count() == 0)
    }
}

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A unix socket path.
    Unix(PathBuf),
    /// host:port.
    Inet(String, u16),
}

impl ListenAddr {
    /// `addr.type=unix,addr.path=P` or `addr.type=inet,addr.host=H,addr.port=N`.
    pub fn from_options(kv: &mut KeyVal) -> Result<Self, OptionError> {
        Ok(
            match kv.take_choice("addr.type", &["unix", "inet"])?.as_deref() {
                Some("unix") => ListenAddr::Unix(PathBuf::from(kv.take_required("addr.path")?)),
                Some("inet") => {
                    let host = kv.take_required("addr.host")?;
                    let port = kv.take_required("addr.port")?;
                    let port = port
                        .parse()
                        .map_err(|_| kv.bad_value("addr.port", "a port number", &port))?;
                    ListenAddr::Inet(host, port)
                }
                _ => return Err(kv.missing("addr.type")),
            },
        )
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ListenAddr::Inet(h, p) => write!(f, "{h}:{p}"),
        }
    }
}

/// How the server listens and treats new connections (`--nbd-server`, `nbd-server-start`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdServerOpts {
    /// Where.
    pub addr: ListenAddr,
    /// Connections at once (0: no limit), as qsd's `max-connections`.
    pub max_connections: u32,
    /// Time a client has to finish the handshake (0: no limit), as qsd's
    /// `handshake-max-seconds` (default 10).
    pub handshake_max_secs: u32,
    /// The id of the `tls-creds-*` object clients must use, if any.
    pub tls_creds: Option<String>,
    /// The id of the `authz-simple` object that admits TLS clients, if any.
    pub tls_authz: Option<String>,
    /// Request data all connections together may hold (`x-buffer-limit`, stord's own).
    pub buffer_limit: usize,
}

/// Default `x-buffer-limit`: request data all of the server's connections may hold at
/// once (each connection also holds at most its own 64 MiB).
pub const DEFAULT_BUFFER_LIMIT: usize = 512 << 20;

/// qsd's default for `handshake-max-seconds`.
pub const DEFAULT_HANDSHAKE_MAX_SECS: u32 = 10;

impl NbdServerOpts {
    /// The options of `--nbd-server` (flat `addr.type`, `addr.path` | `addr.host`,
    /// `addr.port`) and of `nbd-server-start` (its legacy `addr.data.*` form, flattened):
    /// the one parser of both.
    pub fn from_options(mut kv: KeyVal) -> Result<Self, OptionError> {
        for k in ["path", "host", "port"] {
            if let Some(v) = kv.take(&format!("addr.data.{k}")) {
                kv.insert(&format!("addr.{k}"), v);
            }
        }
        let addr = ListenAddr::from_options(&mut kv)?;
        // QEMU's types: uint32 both (a larger value is refused, not cut down).
        let u32_range = 0..=u64::from(u32::MAX);
        let max_connections = kv
            .take_u64_in("max-connections", false, u32_range.clone())?
            .map_or(0, |v| v as u32);
        let handshake_max_secs = kv
            .take_u64_in("handshake-max-seconds", false, u32_range)?
            .map_or(DEFAULT_HANDSHAKE_MAX_SECS, |s| s as u32);
        let tls_creds = kv.take("tls-creds");
        let tls_authz = kv.take("tls-authz");
        // At least the largest request, at most 64 GiB.
        let buffer_limit = kv
            .take_u64_in("x-buffer-limit", true, u64::from(MAX_PAYLOAD)..=64 << 30)?
            .map_or(DEFAULT_BUFFER_LIMIT, |v| v as usize);
        kv.finish()?;
        Ok(Self {
            addr,
            max_connections,
            handshake_max_secs,
            tls_creds,
            tls_authz,
            buffer_limit,
        })
    }
}

/// A listening NBD server on the main loop.
pub struct NbdServer {
    /// The address.
    pub addr: ListenAddr,
    acceptor: Option<Acceptor>,
    /// What all its connections' requests may hold together.
    budget: Arc<MemoryBudget>,
    /// The exports it offers (shared with the connections, for the handshake).
    table: ExportTable,
}

impl crate::export::ExportServer for NbdServer {
    fn kind(&self) -> &'static str {
        "nbd"
    }
    fn stop(&mut self) {
        NbdServer::stop(self)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl NbdServer {
    /// Binds the address and starts accepting on `ctx` (the main loop).
    pub fn start(
        ctx: &AioContext,
        opts: NbdServerOpts,
        tls: Option<Arc<TlsServer>>,
    ) -> std::io::Result<Self> {
        let exports = ExportTable::default();
        let table = exports.clone();
        let (fd, tcp): (OwnedFd, bool) = match &opts.addr {
            ListenAddr::Unix(p) => {
                if p.exists() {
                    // A stale socket from an earlier run would make bind fail.
                    let _ = std::fs::remove_file(p);
                }
                let l = UnixListener::bind(p)?;
                l.set_nonblocking(true)?;
                (l.into(), false)
            }
            ListenAddr::Inet(h, port) => {
                let l = TcpListener::bind((h.as_str(), *port))?;
                l.set_nonblocking(true)?;
                (l.into(), true)
            }
        };
        let live = Arc::new(AtomicUsize::new(0));
        let max = opts.max_connections as usize;
        let handshake_ns = u64::from(opts.handshake_max_secs) * 1_000_000_000;
        let budget = Arc::new(MemoryBudget::new(opts.buffer_limit));
        let b2 = budget.clone();
        let acceptor = Acceptor::start(ctx, "nbd server", fd, move |conn| {
            if max != 0 && live.load(Ordering::Acquire) >= max {
                return;
            }
            let conn = if tcp {
                let s = std::net::TcpStream::from(conn);
                let _ = s.set_nodelay(true);
                s.into()
            } else {
                conn
            };
            start_connection(conn, &live, &b2, &exports, &tls, handshake_ns)
        })?;
        Ok(Self {
            addr: opts.addr,
            acceptor: Some(acceptor),
            budget,
            table,
        })
    }

    /// The exports it offers.
    pub fn table(&self) -> &ExportTable {
        &self.table
    }

    /// Request data its connections hold now, and the limit.
    pub fn buffer_use(&self) -> (usize, usize) {
        (self.budget.used(), self.budget.limit())
    }

    /// Stops listening (existing connections go on) and removes a unix socket file.
    pub fn stop(&mut self) {
        self.acceptor.take();
        if let ListenAddr::Unix(p) = &self.addr {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Asks for a heap trim on the main loop when a connection's main-loop part ends.
struct TrimWhenDone;

impl Drop for TrimWhenDone {
    fn drop(&mut self) {
        crate::sys::release_free_memory_soon();
    }
}

/// Counts a connection in the server's `max-connections` tally until dropped: it moves
/// with the connection to the IoThread that serves it.
struct LiveConnection(Arc<AtomicUsize>);

impl Drop for LiveConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn start_connection(
    conn: OwnedFd,
    live: &Arc<AtomicUsize>,
    budget: &Arc<MemoryBudget>,
    exports: &ExportTable,
    tls: &Option<Arc<TlsServer>>,
    handshake_ns: u64,
) {
    live.fetch_add(1, Ordering::AcqRel);
    let counted = LiveConnection(live.clone());
    let exports = exports.clone();
    let tls = tls.clone();
    let budget = budget.clone();
    stord_aio::spawn(async move {
        handle_connection(conn, exports, tls, handshake_ns, counted, budget).await;
    });
}

async fn handle_connection(
    conn: OwnedFd,
    exports: ExportTable,
    tls: Option<Arc<TlsServer>>,
    handshake_ns: u64,
    counted: LiveConnection,
    budget: Arc<MemoryBudget>,
) {
    let fd = conn.as_raw_fd();
    // A client that does not finish the handshake in time is cut off: shutting the socket
    // down makes the negotiation's next read or write fail.
    let expired = Rc::new(Cell::new(false));
    let timer = (handshake_ns != 0).then(|| {
        let expired = expired.clone();
        stord_aio::with_current_context(|ctx| {
            ctx.add_timer(stord_aio::sys::now_ns() + handshake_ns, move || {
                expired.set(true);
                crate::sys::shutdown(fd);
            })
        })
        .expect("main loop")
    });
    let result = handshake::negotiate(fd, &exports, tls.as_deref()).await;
    if let Some(t) = timer {
        stord_aio::with_current_context(|ctx| ctx.cancel_timer(t));
    }
    // Whatever this connection ends as, what it allocated (TLS sessions, buffers) goes back
    // to the system once connections stop coming and going.
    let _trim = TrimWhenDone;
    let n = match result {
        Ok(Some(n)) if !expired.get() => n,
        Ok(_) => return,
        Err(_) if expired.get() => {
            tracing::info!("nbd: a client did not finish the handshake in time; disconnected");
            return;
        }
        Err(e) => {
            use std::io::ErrorKind::*;
            // A client that just probes and hangs up is not worth a log line.
            if !matches!(e.kind(), UnexpectedEof | BrokenPipe | ConnectionReset) {
                tracing::info!("nbd: negotiation failed: {e}");
            }
            return;
        }
    };
    let export = n.export.clone();
    tracing::debug!("nbd: a client negotiated export '{}'", export.name);
    if export.shutting_down.load(Ordering::SeqCst) {
        return;
    }
    match export.place() {
        Some((remote, placement)) if !remote.is_current() => {
            remote.call(move || {
                stord_aio::spawn(async move {
                    transmission::serve(conn, n, budget).await;
                    drop(placement);
                    drop(counted);
                });
            });
        }
        placed => {
            transmission::serve(conn, n, budget).await;
            drop(placed);
            drop(counted);
        }
    }
}
