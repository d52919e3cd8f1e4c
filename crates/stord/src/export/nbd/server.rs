//! The listening NBD server: binds its address, accepts on the main loop and hands each
//! new connection to `connection`; holds the table of exports it offers and the budget its
//! connections' requests share.

use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use stord_aio::AioContext;

use super::connection::start_connection;
use super::export::ExportTable;
use super::options::{ListenAddr, NbdServerOpts};
use crate::accept::Acceptor;
use crate::export::budget::MemoryBudget;
use crate::tls::TlsServer;

/// A listening NBD server on the main loop.
pub struct NbdServer {
    /// The address.
    pub addr: ListenAddr,
    acceptor: Option<Acceptor>,
    /// What all its connections' requests may hold together.
    pub(super) budget: Arc<MemoryBudget>,
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
                // Inherited by every connection the socket accepts.
                opts.keep_alive
                    .apply(std::os::fd::AsRawFd::as_raw_fd(&l))
                    .map_err(std::io::Error::other)?;
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
