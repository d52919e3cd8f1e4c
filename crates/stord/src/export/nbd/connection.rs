//! One accepted connection's life: the handshake on the main loop, cut off when it takes
//! longer than `handshake-max-seconds`, then the transmission phase on the chosen export's
//! least loaded IoThread, counted in the server's `max-connections` tally throughout.

use std::cell::Cell;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::export::ExportTable;
use super::{handshake, transmission};
use crate::export::budget::MemoryBudget;
use crate::tls::TlsServer;

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

pub(super) fn start_connection(
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
