//! The NBD-level export: one node offered under a name ([`NbdExport`]), with the IoThreads
//! its connections run on and the clients it has now, and the table of exports a server
//! offers ([`ExportTable`]), which the handshake looks names up in.

use std::cell::RefCell;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use stord_aio::Remote;

use crate::block::node::block_node::BlockNode;
use crate::block::node::dirty_bitmap::DirtyBitmap;
use crate::block::node::link::NodeLink;
use crate::export::budget::MemoryBudget;
use crate::export::DrainSignal;
use crate::nbd_wire::proto::*;

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
    pub(super) drain: DrainSignal,
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
    pub(super) fn place(self: &Arc<Self>) -> Option<(Remote, Placement)> {
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
pub(super) struct Placement {
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
