//! [`State`]: everything the daemon has created (IoThreads, objects, nodes, exports,
//! servers, jobs, chardevs), on the main thread, and the look-ups every operation on it
//! shares. The operations themselves live beside it, a file per concern.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::Arc;

use stord_aio::{IoThread, Remote};

use crate::block::node::block_node::BlockNode;
use crate::block::throttle_group::ThrottleGroup;
use crate::events::Events;
use crate::export::nbd::options::ListenAddr;
use crate::export::nbd::server::NbdServer;
use crate::export::{Export, ExportServers};

use super::close;
use super::error::DaemonError;
use super::monitor_object::{MonitorObject, OpenMonitor};
use super::user_object::UserObject;

/// Everything the daemon has created (main thread only).
#[derive(Default)]
pub struct State {
    /// `--object iothread` by id.
    pub(super) iothreads: BTreeMap<String, IoThread>,
    /// `--object throttle-group` by id.
    pub(super) throttle_groups: BTreeMap<String, Arc<ThrottleGroup>>,
    /// `--object tls-creds-x509|tls-creds-psk|authz-simple|secret` by id.
    pub(super) objects: BTreeMap<String, UserObject>,
    /// Block nodes by node-name.
    pub(super) nodes: BTreeMap<String, Arc<BlockNode>>,
    /// Nodes opened inline as another node's child (removed with their parent).
    pub(super) implicit: BTreeSet<String>,
    /// The next `#blockNNN` number.
    pub(super) implicit_seq: u32,
    /// Exports by id, whatever their type.
    pub(super) exports: BTreeMap<String, Box<dyn Export>>,
    /// Each export's permissions on its node (given back once it has drained).
    pub(super) export_claims: BTreeMap<String, crate::block::node::block_node::Claim>,
    /// Exports made with `allow-inactive=on`.
    pub(super) allow_inactive: BTreeSet<String>,
    /// Exports whose node is inactive: the permissions they take back on activation.
    pub(super) inactive_exports: BTreeMap<
        String,
        (
            crate::block::node::perm::Perm,
            crate::block::node::perm::Perm,
        ),
    >,
    /// Exports being removed: each task ends once its export has drained.
    pub(super) removals: Vec<stord_aio::JoinHandle<()>>,
    /// Protocol servers (the NBD server, once started), by the export type they serve.
    pub(super) servers: ExportServers,
    /// Jobs, by id.
    pub(super) jobs: crate::job::Jobs,
    /// Event fan-out to negotiated monitor connections.
    pub(super) events: Events,
    /// Character devices, those monitors use and those without a user.
    pub(super) chardevs: crate::chardev::table::Table,
    /// `--object metrics` listeners by id.
    pub(super) metrics: BTreeMap<String, crate::metrics::MetricsServer>,
    /// The shared state this is (what a metrics scrape reads from later).
    pub(super) me: std::rc::Weak<RefCell<State>>,
    /// `--object monitor-qmp` / `object-add` monitors by id.
    pub(super) monitors: BTreeMap<String, MonitorObject>,
    /// How a monitor is opened (the QMP layer's, installed at start).
    pub(super) monitor_opener: Option<OpenMonitor>,
    /// The monitor whose client's command runs now, if made at run time.
    pub(super) current_monitor: Option<String>,

    /// Set to stop the main loop.
    pub(super) quit: Rc<Cell<bool>>,
}

/// Shared handle to the state.
pub type SharedState = Rc<RefCell<State>>;

/// What a driver's `blockdev-create` part may look up.
impl crate::block::create::CreateEnv for State {
    fn node(&self, name: &str) -> Option<Arc<BlockNode>> {
        self.nodes.get(name).cloned()
    }
    fn secret(&self, id: &str) -> Option<Vec<u8>> {
        State::secret(self, id)
    }
}

/// What the monitor and the process read and ask of the daemon.
impl State {
    /// The event fan-out.
    pub fn events(&self) -> &Events {
        &self.events
    }

    /// Tells the state where it is shared (for what reads it later, a metrics scrape).
    pub fn set_self(&mut self, me: std::rc::Weak<RefCell<State>>) {
        self.me = me;
    }

    /// The character devices.
    pub fn chardevs(&mut self) -> &mut crate::chardev::table::Table {
        &mut self.chardevs
    }

    /// The character devices, to read.
    pub fn chardev_table(&self) -> &crate::chardev::table::Table {
        &self.chardevs
    }

    /// The flag that stops the main loop.
    pub fn quit_flag(&self) -> Rc<Cell<bool>> {
        self.quit.clone()
    }

    /// `quit`: ends the main loop (the stop follows; qsd announces nothing).
    pub fn request_quit(&self) {
        self.quit.set(true);
    }

    /// The IoThread `id`.
    pub fn iothread(&self, id: &str) -> Option<&Remote> {
        self.iothreads.get(id).map(IoThread::remote)
    }

    /// Every IoThread, by id.
    pub fn iothreads(&self) -> impl Iterator<Item = (&str, &Remote)> {
        self.iothreads
            .iter()
            .map(|(id, t)| (id.as_str(), t.remote()))
    }

    /// The node `name`.
    pub fn node(&self, name: &str) -> Option<&Arc<BlockNode>> {
        self.nodes.get(name)
    }

    /// The node `name`, or QEMU's error for a node that is not there.
    pub fn node_by_name(&self, name: &str) -> Result<Arc<BlockNode>, DaemonError> {
        self.nodes.get(name).cloned().ok_or_else(|| {
            DaemonError::Graph(crate::block::open::GraphError::ChildNotFound(name.into()))
        })
    }

    /// Every node, by name.
    pub fn nodes(&self) -> impl Iterator<Item = &Arc<BlockNode>> {
        self.nodes.values()
    }

    /// Every export, by id.
    pub fn exports(&self) -> impl Iterator<Item = &dyn Export> {
        self.exports.values().map(|e| &**e)
    }

    /// Where the NBD server listens, if it runs.
    pub fn nbd_addr(&self) -> Option<ListenAddr> {
        let nbd = self
            .servers
            .get("nbd")?
            .as_any()
            .downcast_ref::<NbdServer>()?;
        Some(nbd.addr.clone())
    }

    /// The first step of a stop: the NBD server stops listening and every export is
    /// removed (clients disconnected). Returns the removals, each done once its export
    /// has drained.
    pub fn stop_serving(&mut self) -> Vec<stord_aio::JoinHandle<()>> {
        for (_, mut s) in std::mem::take(&mut self.servers) {
            s.stop();
        }
        self.drain_exports();
        std::mem::take(&mut self.removals)
    }

    /// Closes every node opened for writing (what a format node caches goes to disk, its
    /// persistent bitmaps to its image), parents before their children as QEMU's
    /// bdrv_close_all does (what a parent writes as it closes reaches a child still open,
    /// and preallocate cuts its file back after the last write), the nodes of one level
    /// together: one task.
    pub fn close_writable_nodes(&self) -> Vec<stord_aio::JoinHandle<()>> {
        let writable: Vec<Arc<BlockNode>> = self
            .nodes
            .values()
            .filter(|n| n.can_write() && !n.is_inactive())
            .cloned()
            .collect();
        let levels = parents_first(&writable);
        vec![stord_aio::spawn(async move {
            for level in levels {
                let closing: Vec<_> = level
                    .into_iter()
                    .map(|node| {
                        stord_aio::spawn(async move {
                            if let Err(e) = node.close().await {
                                tracing::error!("closing node '{}' failed: {e}", node.name);
                            }
                        })
                    })
                    .collect();
                for c in closing {
                    c.await;
                }
            }
        })]
    }

    /// Takes the IoThreads out (to be stopped).
    pub fn take_iothreads(&mut self) -> BTreeMap<String, IoThread> {
        std::mem::take(&mut self.iothreads)
    }
}

impl State {
    /// Removes implicit nodes nobody uses any more (and, in turn, their implicit children).
    pub(super) fn drop_implicit(&mut self, names: Vec<String>) {
        let mut todo = names;
        while let Some(name) = todo.pop() {
            if !self.implicit.contains(&name) {
                continue;
            }
            let Some(node) = self.nodes.get(&name) else {
                continue;
            };
            if Arc::strong_count(node) > 1 {
                continue;
            }
            let node = self.nodes.remove(&name).expect("present");
            self.implicit.remove(&name);
            if node.can_write() {
                close::close_now(&node);
            }
            todo.extend(node.children().iter().map(|(_, c)| c.name.clone()));
        }
    }

    /// How many references to `node` neither the node table nor a parent node holds:
    /// exports, live or still draining, and requests in flight.
    pub(super) fn users(&self, node: &Arc<BlockNode>) -> usize {
        Arc::strong_count(node) - 1 - self.parents_of(&node.name).len()
    }

    /// The nodes that use `name` as a child, with the child's role.
    pub(super) fn parents_of(&self, name: &str) -> Vec<(String, &'static str)> {
        self.nodes
            .values()
            .flat_map(|p| {
                p.children()
                    .into_iter()
                    .filter(|(_, c)| c.name == name)
                    .map(|(role, _)| (p.name.clone(), role))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

/// `nodes` in levels, each node in a level below all its parents among them.
fn parents_first(nodes: &[Arc<BlockNode>]) -> Vec<Vec<Arc<BlockNode>>> {
    let index = |n: &Arc<BlockNode>| nodes.iter().position(|m| Arc::ptr_eq(m, n));
    let mut parents: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (p, n) in nodes.iter().enumerate() {
        for (_, c) in n.children() {
            if let Some(c) = index(&c) {
                parents[c].push(p);
            }
        }
    }
    // A node's level: one below its deepest parent (the graph has no cycle; the bound
    // keeps a bad one from looping).
    let mut level = vec![0usize; nodes.len()];
    for _ in 0..nodes.len() {
        let mut moved = false;
        for c in 0..nodes.len() {
            let want = parents[c].iter().map(|&p| level[p] + 1).max().unwrap_or(0);
            if want > level[c] {
                level[c] = want;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    let mut out: Vec<Vec<Arc<BlockNode>>> =
        vec![Vec::new(); level.iter().max().map_or(0, |m| m + 1)];
    for (i, n) in nodes.iter().enumerate() {
        out[level[i]].push(n.clone());
    }
    out
}
