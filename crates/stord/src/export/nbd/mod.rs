//! The NBD export: a server socket (unix or TCP) and the exports it offers.
//!
//! New connections are accepted and negotiated on the main loop ([`handshake`]); once the
//! client has chosen an export, the connection moves to that export's IoThread, where its
//! requests run as tasks ([`transmission`]).

mod handshake;
mod io;
pub mod proto;
mod transmission;

use std::cell::RefCell;
use std::net::TcpListener;
use std::os::fd::RawFd;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use stord_aio::{AioContext, FdHandlerId, Interest, Remote};

use crate::block::BlockNode;
use proto::*;

/// One exported node.
pub struct NbdExport {
    /// The export's `id` (block-export id).
    pub id: String,
    /// The name clients ask for.
    pub name: String,
    /// Free text shown by NBD_OPT_LIST / INFO.
    pub description: String,
    /// The node served.
    pub node: Arc<BlockNode>,
    /// Writes allowed.
    pub writable: bool,
    /// Where connections run (None: the main loop).
    pub iothread: Option<Remote>,
    /// Sockets of the connections in transmission phase now.
    pub clients: Mutex<Vec<RawFd>>,
    /// Deleted: new connections are refused, existing ones are being closed.
    pub shutting_down: AtomicBool,
}

impl NbdExport {
    /// A new export with no clients.
    pub fn new(
        id: String,
        name: String,
        description: String,
        node: Arc<BlockNode>,
        writable: bool,
        iothread: Option<Remote>,
    ) -> Self {
        Self {
            id,
            name,
            description,
            node,
            writable,
            iothread,
            clients: Mutex::default(),
            shutting_down: AtomicBool::new(false),
        }
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
        let mut f = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_CAN_MULTI_CONN;
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

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A unix socket path.
    Unix(PathBuf),
    /// host:port.
    Inet(String, u16),
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ListenAddr::Inet(h, p) => write!(f, "{h}:{p}"),
        }
    }
}

/// A listening NBD server on the main loop.
pub struct NbdServer {
    /// The address.
    pub addr: ListenAddr,
    listener: OwnedFd,
    handler: Option<FdHandlerId>,
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    fn accept(&self) -> std::io::Result<OwnedFd> {
        match self {
            Listener::Unix(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(true)?;
                Ok(s.into())
            }
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(true)?;
                s.set_nodelay(true)?;
                Ok(s.into())
            }
        }
    }
}

impl NbdServer {
    /// Binds `addr` and starts accepting on `ctx` (the main loop).
    pub fn start(
        ctx: &AioContext,
        addr: ListenAddr,
        exports: ExportTable,
        max_connections: u32,
    ) -> std::io::Result<Self> {
        let listener = match &addr {
            ListenAddr::Unix(p) => {
                if p.exists() {
                    // A stale socket from an earlier run would make bind fail.
                    let _ = std::fs::remove_file(p);
                }
                Listener::Unix(UnixListener::bind(p)?)
            }
            ListenAddr::Inet(h, port) => Listener::Tcp(TcpListener::bind((h.as_str(), *port))?),
        };
        let fd: OwnedFd = match &listener {
            Listener::Unix(l) => {
                l.set_nonblocking(true)?;
                l.try_clone()?.into()
            }
            Listener::Tcp(l) => {
                l.set_nonblocking(true)?;
                l.try_clone()?.into()
            }
        };
        let live = Rc::new(std::cell::Cell::new(0u32));
        let handler = ctx.set_fd_handler(fd.as_raw_fd(), Interest::READABLE, move |_| loop {
            match listener.accept() {
                Ok(conn) => {
                    if max_connections != 0 && live.get() >= max_connections {
                        drop(conn);
                        continue;
                    }
                    live.set(live.get() + 1);
                    let live2 = live.clone();
                    let exports = exports.clone();
                    stord_aio::spawn(async move {
                        handle_connection(conn, exports).await;
                        live2.set(live2.get() - 1);
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    eprintln!("stord: nbd server: accept failed: {e}");
                    break;
                }
            }
        })?;
        Ok(Self {
            addr,
            listener: fd,
            handler: Some(handler),
        })
    }

    /// Stops listening (existing connections go on) and removes a unix socket file.
    pub fn stop(&mut self, ctx: &AioContext) {
        if let Some(h) = self.handler.take() {
            ctx.remove_fd_handler(h);
        }
        if let ListenAddr::Unix(p) = &self.addr {
            let _ = std::fs::remove_file(p);
        }
        let _ = self.listener.as_raw_fd();
    }
}

async fn handle_connection(conn: OwnedFd, exports: ExportTable) {
    let fd = conn.as_raw_fd();
    let n = match handshake::negotiate(fd, &exports).await {
        Ok(Some(n)) => n,
        Ok(None) => return,
        Err(e) => {
            use std::io::ErrorKind::*;
            // A client that just probes and hangs up is not worth a log line.
            if !matches!(e.kind(), UnexpectedEof | BrokenPipe | ConnectionReset) {
                eprintln!("stord: nbd: negotiation failed: {e}");
            }
            return;
        }
    };
    let export = n.export.clone();
    if export.shutting_down.load(Ordering::SeqCst) {
        return;
    }
    match export.iothread.clone() {
        Some(remote) if !remote.is_current() => {
            remote.call(move || {
                stord_aio::spawn(transmission::serve(
                    conn,
                    n.export,
                    n.structured,
                    n.base_allocation,
                    n.pending,
                ));
            });
        }
        _ => transmission::serve(conn, n.export, n.structured, n.base_allocation, n.pending).await,
    }
}
