//! The daemon layer: what the command line and QMP create (IoThreads, objects, block
//! nodes, exports, the NBD server) and the operations on them, as one API over [`State`].
//! The QMP handlers and the command line call it; it knows neither (events leave through
//! [`crate::events`]).
//!
//! [`graph`] opens nodes (the driver table, inline children, rollback); [`objects`] holds
//! the `--object` types; [`jobs`] is the graph side of each job, a file per job.

mod active;
mod chain;
mod graph;
pub mod jobs;
mod lookup;
mod new_image;
pub mod objects;
mod snapshot;

use crate::cli::id_wellformed;

pub use objects::{ObjectType, UserObject, OBJECT_TYPES};

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::rc::Rc;
use std::sync::Arc;

use stord_aio::{AioContext, IoThread, Remote};

pub use self::snapshot::{hold_all_exports, SnapshotDone, SnapshotSyncOptions};
use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;
use crate::block::throttle_group::ThrottleGroup;
use crate::cli::keyval::{KeyVal, OptionError};
use crate::events::Events;
use crate::export::nbd::options::{ListenAddr, NbdServerOpts};
use crate::export::nbd::server::NbdServer;
use crate::export::{Export, ExportEnv, ExportServers, EXPORT_TYPES};
use crate::secret::SecretError;
use crate::tls::error::TlsError;
use crate::tls::TlsServer;

/// Why a command on the daemon's objects, nodes or exports failed: the daemon layer's
/// error. QMP reports it with [`DaemonError::qmp_class`]; the texts are qsd's where it has
/// one, so scripts that match them keep working.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A malformed option list.
    #[error(transparent)]
    Option(#[from] OptionError),
    /// Options that parse but describe something we cannot build (a driver's or export's
    /// own checks).
    #[error("{0}")]
    Invalid(String),
    #[error("attempt to add duplicate property '{0}' to object (type 'container')")]
    DuplicateObject(String),
    #[error("object '{0}' not found")]
    ObjectNotFound(String),
    #[error("object '{0}' is in use and cannot be deleted")]
    ObjectInUse(String),
    #[error("cannot start iothread '{id}': {source}")]
    IoThreadStart { id: String, source: io::Error },
    #[error("Failed to find node with node-name='{0}'")]
    NodeNotFound(String),
    #[error(transparent)]
    Graph(#[from] crate::block::open::GraphError),
    #[error(transparent)]
    Export(#[from] crate::export::ExportError),
    #[error(transparent)]
    Throttle(#[from] crate::block::throttle_group::ThrottleConfigError),
    #[error(transparent)]
    Job(#[from] crate::job::JobError),
    #[error("Block device {name} is in use (it is the '{role}' child of node '{parent}')")]
    NodeIsChild {
        name: String,
        parent: String,
        role: &'static str,
    },
    /// A `device` naming nothing (class DeviceNotFound, which libvirt probes for).
    #[error("Device '{0}' not found")]
    DeviceNotFound(String),
    #[error("Node {0} is not owned by the monitor")]
    NodeNotOwned(String),
    #[error("Node {0} is in use")]
    NodeInUse(String),
    #[error("Block export id '{0}' is already in use")]
    ExportIdTaken(String),
    #[error("Export '{0}' is not found")]
    ExportNotFound(String),
    #[error("Export '{0}' is already shutting down")]
    ExportShuttingDown(String),
    #[error("export '{0}' still in use (use mode 'hard' to disconnect its clients)")]
    ExportInUse(String),
    #[error("NBD server already running")]
    NbdServerRunning,
    #[error("NBD server not running")]
    NbdServerNotRunning,
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: io::Error },
    #[error(transparent)]
    Perm(#[from] crate::block::node::perm::PermError),
    /// A job has the node ("Node 'x' is busy: ...").
    #[error(transparent)]
    Busy(#[from] crate::block::node::blocker::Busy),
    #[error(transparent)]
    Property(#[from] crate::iothread::PropertyError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("No TLS credentials with id '{0}'")]
    NoTlsCreds(String),
    #[error("No authorization object with id '{0}'")]
    NoAuthz(String),
}

impl DaemonError {
    /// The QMP error class: qsd reports all of these as GenericError.
    pub fn qmp_class(&self) -> &'static str {
        match self {
            DaemonError::Job(e) => e.qmp_class(),
            DaemonError::DeviceNotFound(_) => "DeviceNotFound",
            _ => "GenericError",
        }
    }
}

/// A GenericError with QEMU's text.
pub(super) fn invalid(s: impl Into<String>) -> DaemonError {
    DaemonError::Invalid(s.into())
}

/// Everything the daemon has created (main thread only).
#[derive(Default)]
pub struct State {
    /// `--object iothread` by id.
    iothreads: BTreeMap<String, IoThread>,
    /// `--object throttle-group` by id.
    throttle_groups: BTreeMap<String, Arc<ThrottleGroup>>,
    /// `--object tls-creds-x509|tls-creds-psk|authz-simple|secret` by id.
    objects: BTreeMap<String, UserObject>,
    /// Block nodes by node-name.
    nodes: BTreeMap<String, Arc<BlockNode>>,
    /// Nodes opened inline as another node's child (removed with their parent).
    implicit: BTreeSet<String>,
    /// The next `#blockNNN` number.
    implicit_seq: u32,
    /// Exports by id, whatever their type.
    exports: BTreeMap<String, Box<dyn Export>>,
    /// Each export's permissions on its node (given back once it has drained).
    export_claims: BTreeMap<String, crate::block::node::block_node::Claim>,
    /// Exports made with `allow-inactive=on`.
    allow_inactive: BTreeSet<String>,
    /// Exports whose node is inactive: the permissions they take back on activation.
    inactive_exports: BTreeMap<
        String,
        (
            crate::block::node::perm::Perm,
            crate::block::node::perm::Perm,
        ),
    >,
    /// Exports being removed: each task ends once its export has drained.
    removals: Vec<stord_aio::JoinHandle<()>>,
    /// Protocol servers (the NBD server, once started), by the export type they serve.
    servers: ExportServers,
    /// Jobs, by id.
    jobs: crate::job::Jobs,
    /// Event fan-out to negotiated monitor connections.
    events: Events,
    /// Character devices, those monitors use and those without a user.
    chardevs: crate::chardev::table::Table,
    /// `--object metrics` listeners by id.
    metrics: BTreeMap<String, crate::metrics::MetricsServer>,
    /// The shared state this is (what a metrics scrape reads from later).
    me: std::rc::Weak<RefCell<State>>,

    /// Set to stop the main loop.
    quit: Rc<Cell<bool>>,
}

/// Shared handle to the state.
pub type SharedState = Rc<RefCell<State>>;

/// What an export takes of its node, as QEMU's `blk_exp_add`: reads, writes when
/// writable, resizes when growable (FUSE); others may do anything but, for NBD, resize (its
/// clients were told the size).
fn export_perms(
    kind: &str,
    writable: bool,
    growable: bool,
) -> (
    crate::block::node::perm::Perm,
    crate::block::node::perm::Perm,
) {
    use crate::block::node::perm::Perm;
    let mut perm = Perm::CONSISTENT_READ;
    if writable {
        perm = perm | Perm::WRITE;
    }
    if growable {
        perm = perm | Perm::RESIZE;
    }
    let shared = if kind == "nbd" {
        Perm::ALL & Perm::RESIZE.complement()
    } else {
        Perm::ALL
    };
    (perm, shared)
}

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
    /// persistent bitmaps to its image), as tasks on the calling loop.
    pub fn close_writable_nodes(&self) -> Vec<stord_aio::JoinHandle<()>> {
        self.nodes
            .values()
            .filter(|n| n.can_write() && !n.is_inactive())
            .cloned()
            .map(|node| {
                stord_aio::spawn(async move {
                    if let Err(e) = node.close().await {
                        tracing::error!("closing node '{}' failed: {e}", node.name);
                    }
                })
            })
            .collect()
    }

    /// Takes the IoThreads out (to be stopped).
    pub fn take_iothreads(&mut self) -> BTreeMap<String, IoThread> {
        std::mem::take(&mut self.iothreads)
    }
}

impl State {
    /// Removes implicit nodes nobody uses any more (and, in turn, their implicit children).
    fn drop_implicit(&mut self, names: Vec<String>) {
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
                graph::close_now(&node);
            }
            todo.extend(node.children().iter().map(|(_, c)| c.name.clone()));
        }
    }

    /// How many references to `node` neither the node table nor a parent node holds:
    /// exports, live or still draining, and requests in flight.
    fn users(&self, node: &Arc<BlockNode>) -> usize {
        Arc::strong_count(node) - 1 - self.parents_of(&node.name).len()
    }

    /// The nodes that use `name` as a child, with the child's role.
    fn parents_of(&self, name: &str) -> Vec<(String, &'static str)> {
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

    /// `blockdev-del`: fails while a parent node or an export uses the node. Its inline
    /// children go with it.
    pub fn del_blockdev(&mut self, name: &str) -> Result<(), DaemonError> {
        let Some(node) = self.nodes.get(name) else {
            return Err(DaemonError::NodeNotFound(name.into()));
        };
        if self.implicit.contains(name) {
            // qsd's words: the node was opened inline by its parent, not by blockdev-add.
            return Err(DaemonError::NodeNotOwned(name.into()));
        }
        // A job's own user of the node (a mirror's target) comes first, as QEMU checks
        // for a BlockBackend before the op blockers.
        if node.has_job() {
            return Err(DaemonError::NodeInUse(name.into()));
        }
        node.check_not_busy()?;
        let parents = self.parents_of(name);
        // QEMU blocks every operation on a backing node for its overlay's sake.
        if let Some((parent, _)) = parents.iter().find(|(_, role)| *role == "backing") {
            return Err(DaemonError::Invalid(format!(
                "Node '{name}' is busy: node is used as backing hd of '{parent}'"
            )));
        }
        if let Some((parent, role)) = parents.into_iter().next() {
            return Err(DaemonError::NodeIsChild {
                name: name.into(),
                parent,
                role,
            });
        }
        if self.users(node) > 0 {
            return Err(DaemonError::NodeInUse(name.into()));
        }
        let node = self.nodes.remove(name).expect("present");
        // What a format node still caches (qcow2's tables, its persistent bitmaps) goes
        // to disk before it closes, as QEMU's bdrv_close does.
        graph::close_now(&node);
        let children: Vec<String> = node
            .children()
            .iter()
            .map(|(_, c)| c.name.clone())
            .collect();
        drop(node);
        self.drop_implicit(children);
        Ok(())
    }

    /// `block_resize`: with the resize permission for the time it takes (refused while a
    /// user does not share it, as an NBD export whose clients were told the size).
    pub fn resize_node(
        &mut self,
        device: Option<&str>,
        node_name: Option<&str>,
        size: i64,
    ) -> Result<(), DaemonError> {
        let name = node_name.or(device).unwrap_or_default();
        let Some(node) = self.nodes.get(name).cloned() else {
            return Err(DaemonError::Invalid(format!(
                "Cannot find device='{}' nor node-name='{}'",
                device.unwrap_or_default(),
                node_name.unwrap_or_default()
            )));
        };
        let Ok(size) = u64::try_from(size) else {
            return Err(DaemonError::Invalid(
                "Parameter 'size' expects a >0 size".into(),
            ));
        };
        if node.is_read_only() {
            return Err(DaemonError::Invalid("Image is read-only".into()));
        }
        let claim = node.claim(
            "block_resize",
            "root",
            crate::block::node::perm::Perm::RESIZE,
            crate::block::node::perm::Perm::ALL,
        )?;
        let n = node.clone();
        let r =
            crate::block::helper_thread::block_on_helper(
                move || async move { n.resize(size).await },
            );
        drop(claim);
        match r {
            Ok(Ok(())) => {
                for e in self.exports.values() {
                    e.resized();
                }
                Ok(())
            }
            Ok(Err(e)) | Err(e) => Err(DaemonError::Invalid(e.to_string())),
        }
    }

    /// `blockdev-reopen` of one node's `read-only` state. A node goes read-only only when
    /// no writable export or writable parent uses it (after a flush), and writable again
    /// only if it was opened writable: stord does not reopen files with other flags.
    pub fn reopen_read_only(&mut self, name: &str, read_only: bool) -> Result<(), DaemonError> {
        let Some(node) = self.nodes.get(name).cloned() else {
            return Err(DaemonError::NodeNotFound(name.into()));
        };
        if node.is_read_only() == read_only {
            return Ok(());
        }
        if !read_only {
            self.make_writable(&node)?;
            return Ok(());
        }
        // Every node at or above this one, for the writers among their users.
        let mut above = vec![name.to_string()];
        let mut i = 0;
        while i < above.len() {
            for (parent, _) in self.parents_of(&above[i].clone()) {
                if !above.contains(&parent) {
                    above.push(parent);
                }
            }
            i += 1;
        }
        if let Some(e) = self
            .exports
            .values()
            .find(|e| e.writable() && above.contains(&e.node().name))
        {
            return Err(DaemonError::Invalid(format!(
                "Cannot make node '{name}' read-only: writable export '{}' uses it",
                e.id()
            )));
        }
        if let Some(p) = above[1..]
            .iter()
            .find(|p| self.nodes.get(*p).is_some_and(|n| !n.is_read_only()))
        {
            return Err(DaemonError::Invalid(format!(
                "Cannot make node '{name}' read-only: writable node '{p}' uses it"
            )));
        }
        let n = node.clone();
        match crate::block::helper_thread::block_on_helper(move || async move { n.flush().await }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) | Err(e) => {
                return Err(DaemonError::Invalid(format!(
                    "Cannot make node '{name}' read-only: flush failed: {e}"
                )))
            }
        }
        node.set_read_only(true);
        // What it takes of its children shrinks with it (a format node's write lock goes).
        let _ = node.refresh_perms();
        Ok(())
    }

    /// Makes `node` writable with the nodes it stores its data on (its `file`, and
    /// theirs), as QEMU's reopen with read-only off: bottom-up, each node writable and its
    /// permissions taken on its children (their locks) before its driver reopens (a file
    /// its descriptor read-write, an image its metadata for writing), then its own locks
    /// taken again. On a failure every node changed goes back. The nodes it changed,
    /// top first (to be made read-only again).
    pub fn make_writable(&self, node: &Arc<BlockNode>) -> Result<Vec<Arc<BlockNode>>, DaemonError> {
        let mut chain = vec![node.clone()];
        while let Some(file) = chain
            .last()
            .and_then(|n| n.children().into_iter().find(|(r, _)| *r == "file"))
            .map(|(_, c)| c)
        {
            chain.push(file);
        }
        if let Some(n) = chain.iter().find(|n| n.is_inactive()) {
            return Err(DaemonError::Invalid(format!(
                "Cannot make node '{}' writable: it is inactive",
                n.name
            )));
        }
        let mut changed: Vec<Arc<BlockNode>> = Vec::new();
        for n in chain.iter().rev().filter(|n| n.is_read_only()) {
            changed.insert(0, n.clone());
            let r = n
                .refresh_perms_as(false)
                .map_err(DaemonError::from)
                .and_then(|()| {
                    let m = n.clone();
                    crate::block::helper_thread::block_on_helper(move || async move {
                        m.reopen_rw().await
                    })
                    .map_err(|e| e.to_string())
                    .and_then(|r| r)
                    .map_err(|e| {
                        DaemonError::Invalid(format!("Cannot make node '{}' writable: {e}", n.name))
                    })?;
                    n.refresh_perms().map_err(DaemonError::from)
                });
            if let Err(e) = r {
                drop(crate::block::node::read_only_again::ReadOnlyAgain::new(
                    changed,
                ));
                return Err(e);
            }
        }
        Ok(changed)
    }

    /// `--nbd-server` / `nbd-server-start`.
    pub fn start_nbd_server(
        &mut self,
        ctx: &AioContext,
        opts: NbdServerOpts,
    ) -> Result<(), DaemonError> {
        if self.servers.contains_key("nbd") {
            return Err(DaemonError::NbdServerRunning);
        }
        let tls = match &opts.tls_creds {
            None => None,
            Some(id) => {
                let Some(UserObject::TlsCreds(creds)) = self.objects.get(id) else {
                    return Err(DaemonError::NoTlsCreds(id.clone()));
                };
                if creds.is_client() {
                    return Err(DaemonError::Invalid(
                        "Expected TLS credentials for a server endpoint".into(),
                    ));
                }
                let authz = match &opts.tls_authz {
                    None => None,
                    Some(a) => match self.objects.get(a) {
                        Some(UserObject::Authz(z)) => Some((a.clone(), z.clone())),
                        _ => return Err(DaemonError::NoAuthz(a.clone())),
                    },
                };
                Some(Arc::new(TlsServer {
                    creds_id: id.clone(),
                    creds: creds.clone(),
                    authz,
                }))
            }
        };
        if opts.tls_authz.is_some() && tls.is_none() {
            return Err(DaemonError::Invalid(
                "tls-authz is only useful together with tls-creds".into(),
            ));
        }
        let addr = opts.addr.clone();
        let server = NbdServer::start(ctx, opts, tls).map_err(|source| DaemonError::Listen {
            addr: addr.to_string(),
            source,
        })?;
        self.servers.insert("nbd", Box::new(server));
        Ok(())
    }

    /// Whether the NBD server listens.
    pub fn nbd_server_running(&self) -> bool {
        self.servers.contains_key("nbd")
    }

    /// `nbd-server-stop`: stops listening; exports stay until deleted (as in QEMU, NBD
    /// exports are removed with the server).
    pub fn stop_nbd_server(&mut self) -> Result<(), DaemonError> {
        if !self.stop_server("nbd") {
            return Err(DaemonError::NbdServerNotRunning);
        }
        Ok(())
    }

    /// Stops the protocol server for export type `kind` and removes the exports offered
    /// through it; false if none runs.
    fn stop_server(&mut self, kind: &str) -> bool {
        let Some(mut s) = self.servers.remove(kind) else {
            return false;
        };
        s.stop();
        let offered: Vec<String> = self
            .exports
            .values()
            .filter(|e| e.kind() == s.kind())
            .map(|e| e.id().to_string())
            .collect();
        for id in offered {
            self.begin_export_removal(&id);
        }
        true
    }

    /// `--export` / `block-export-add`: the type's constructor from [`EXPORT_TYPES`].
    pub fn add_export(&mut self, mut kv: KeyVal) -> Result<(), DaemonError> {
        let kind = kv.take_required("type")?;
        let Some(ty) = EXPORT_TYPES.iter().find(|t| t.name == kind) else {
            let names: Vec<&str> = EXPORT_TYPES.iter().map(|t| t.name).collect();
            return Err(kv.bad_value("type", &names.join(", "), &kind).into());
        };
        if let Some(id) = kv.get("id") {
            if !id_wellformed(id) {
                return Err(DaemonError::Invalid("Invalid block export id".into()));
            }
            if self.exports.contains_key(id) {
                return Err(DaemonError::ExportIdTaken(id.into()));
            }
        }
        // The export's permissions on its node come first, so a conflict refuses it before
        // it listens or mounts anything.
        let allow_inactive = kv.take_bool("allow-inactive", false)?;
        if allow_inactive && !ty.supports_inactive {
            return Err(DaemonError::Invalid(
                "Export type does not support inactive exports".into(),
            ));
        }
        let mut held_back = None;
        let claim = match kv.get("node-name").and_then(|n| self.nodes.get(n)).cloned() {
            Some(node) => {
                let writable = matches!(kv.get("writable"), Some("on" | "true" | "yes"));
                let growable = matches!(kv.get("growable"), Some("on" | "true" | "yes"));
                let (mut perm, mut shared) = export_perms(&kind, writable, growable);
                if self.prepare_export_node(&node, allow_inactive)? {
                    held_back = Some((perm, shared));
                    (perm, shared) = (
                        crate::block::node::perm::Perm::NONE,
                        crate::block::node::perm::Perm::ALL,
                    );
                }
                // An export's BlockBackend has no name in QEMU: its words for the user.
                Some(node.claim("an unnamed block device", "root", perm, shared)?)
            }
            None => None,
        };
        // A node moved to an IoThread keeps its exports there, as QEMU's exports follow
        // their node's AioContext.
        if kv.get("iothread").is_none() && kv.get("iothread.0").is_none() {
            if let Some(home) = kv.get("node-name").and_then(|n| self.nodes.get(n)?.home()) {
                kv.inherit("iothread", &home);
            }
        }
        let env = ExportEnv {
            nodes: &self.nodes,
            iothreads: &self.iothreads,
            servers: &self.servers,
            claimed: self.exports.values().filter_map(|e| e.claim()).collect(),
        };
        let export = (ty.create)(&env, kv)?;
        let id = export.id().to_string();
        if let Some(c) = claim {
            self.export_claims.insert(id.clone(), c);
        }
        if let Some(p) = held_back {
            self.inactive_exports.insert(id.clone(), p);
        }
        if allow_inactive {
            self.allow_inactive.insert(id.clone());
        }
        self.exports.insert(id, export);
        Ok(())
    }

    /// `block-export-del`: with `hard`, clients are disconnected; without, the export must
    /// have none. The export is gone (and `BLOCK_EXPORT_DELETED` sent) once the last
    /// client's requests have finished.
    pub fn del_export(&mut self, id: &str, hard: bool) -> Result<(), DaemonError> {
        let Some(e) = self.exports.get(id) else {
            return Err(DaemonError::ExportNotFound(id.into()));
        };
        if e.shutting_down() {
            return Err(DaemonError::ExportShuttingDown(id.into()));
        }
        if !hard && e.in_use() {
            return Err(DaemonError::ExportInUse(id.into()));
        }
        self.begin_export_removal(id);
        Ok(())
    }

    /// Takes the export out of the table and stops it; a main-loop task waits for its
    /// requests to finish (woken by the export, no polling), then announces and drops it.
    fn begin_export_removal(&mut self, id: &str) {
        let Some(mut e) = self.exports.remove(id) else {
            return;
        };
        e.begin_stop();
        let claim = self.export_claims.remove(id);
        self.allow_inactive.remove(id);
        self.inactive_exports.remove(id);
        let events = self.events.clone();
        self.removals.retain(|h| !h.is_finished());
        self.removals.push(stord_aio::spawn(async move {
            std::future::poll_fn(|cx| e.poll_drained(cx)).await;
            events.emit("BLOCK_EXPORT_DELETED", serde_json::json!({ "id": e.id() }));
            drop(e);
            drop(claim);
        }));
    }

    /// The links of the exports that serve `node` now.
    pub fn export_links_on(&self, node: &Arc<BlockNode>) -> Vec<Arc<NodeLink>> {
        self.exports
            .values()
            .filter(|e| Arc::ptr_eq(&e.node(), node))
            .map(|e| e.link().clone())
            .collect()
    }

    /// The IoThread that serves `node`: the one it was moved to, else the first that one
    /// of its exports runs on (QEMU's node AioContext); None for the main loop.
    pub fn iothread_serving(&self, node: &Arc<BlockNode>) -> Option<Remote> {
        if let Some(home) = node.home() {
            return self.iothread(&home).cloned();
        }
        let serves = |r: &Remote| {
            self.exports
                .values()
                .any(|e| Arc::ptr_eq(&e.node(), node) && e.runs_on(r))
        };
        self.iothreads()
            .find(|(_, r)| serves(r))
            .map(|(_, r)| r.clone())
    }

    /// Points every export that serves `from` at `to` (QEMU's bdrv_replace_node, for the
    /// exports' root links): each export's permissions are taken on `to` before any moves,
    /// so a conflict leaves everything as it was. Requests in flight finish on `from`.
    /// `only`: just the exports with these links (those a job held and drained; an export
    /// added since stays where it is).
    pub fn repoint_exports(
        &mut self,
        from: &Arc<BlockNode>,
        to: &Arc<BlockNode>,
        only: Option<&[Arc<NodeLink>]>,
    ) -> Result<(), DaemonError> {
        let ids: Vec<String> = self
            .exports
            .values()
            .filter(|e| Arc::ptr_eq(&e.node(), from))
            .filter(|e| only.is_none_or(|l| l.iter().any(|l| Arc::ptr_eq(l, e.link()))))
            .map(|e| e.id().to_string())
            .collect();
        let mut moved = Vec::new();
        for id in &ids {
            let e = &self.exports[id];
            if e.writable() && to.is_read_only() {
                return Err(DaemonError::Invalid(format!(
                    "Cannot move writable export '{id}' to read-only node '{}'",
                    to.name
                )));
            }
            if let Some(c) = self.export_claims.get(id) {
                moved.push((id.clone(), c.transfer(to)?));
            }
        }
        for id in &ids {
            self.exports[id].link().repoint(to.clone());
        }
        for (id, c) in moved {
            self.export_claims.insert(id, c);
        }
        Ok(())
    }

    /// Deletes every export, disconnecting its clients and unmounting FUSE files.
    fn drain_exports(&mut self) {
        let ids: Vec<String> = self.exports.keys().cloned().collect();
        for id in ids {
            if let Some(e) = self.exports.get(&id) {
                e.log_statistics();
            }
            self.begin_export_removal(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::open::GraphError;
    use graph::check_node_name;

    fn kv(s: &str) -> KeyVal {
        KeyVal::parse("--blockdev", s, None).unwrap()
    }

    /// The graph's rules, as typed errors (QMP and the command line show their texts).
    #[test]
    fn node_names_follow_qemus_rules() {
        for ok in ["a", "disk0", "drive-efidisk0", "x.y_z-1", &"n".repeat(31)] {
            assert!(check_node_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "0abc", "-x", "a b", "a/b", "#block1", "é"] {
            let e = check_node_name(bad).unwrap_err().to_string();
            assert_eq!(e, format!("Invalid node-name: '{bad}'"));
        }
        let e = check_node_name(&"n".repeat(32)).unwrap_err().to_string();
        assert_eq!(e, "Node name too long");
        assert!(id_wellformed("io0") && !id_wellformed("0io") && !id_wellformed("a,b"));
    }

    #[test]
    fn graph_errors_are_typed() {
        let mut st = State::default();
        st.add_blockdev(kv("driver=null-co,node-name=n,size=1M"))
            .unwrap();
        st.add_blockdev(kv("driver=raw,node-name=r,file=n"))
            .unwrap();
        assert!(matches!(
            st.add_blockdev(kv("driver=null-co,node-name=n")),
            Err(DaemonError::Graph(GraphError::DuplicateNode(n))) if n == "n"
        ));
        assert!(matches!(
            st.add_blockdev(kv("driver=raw,node-name=x,file=nope")),
            Err(DaemonError::Graph(GraphError::ChildNotFound(n))) if n == "nope"
        ));
        assert!(matches!(
            st.add_blockdev(kv("driver=raw,node-name=x,file=n,bogus=1")),
            Err(DaemonError::Graph(GraphError::Option(OptionError::Unknown { key, .. }))) if key == "bogus"
        ));
        assert!(matches!(
            st.del_blockdev("n"),
            Err(DaemonError::NodeIsChild { parent, role: "file", .. }) if parent == "r"
        ));
        assert!(matches!(
            st.del_blockdev("zz"),
            Err(DaemonError::NodeNotFound(_))
        ));
        st.add_blockdev(kv(
            "driver=raw,node-name=i,file.driver=null-co,file.size=1M",
        ))
        .unwrap();
        let child = st.implicit.iter().next().cloned().unwrap();
        assert!(matches!(
            st.del_blockdev(&child),
            Err(DaemonError::NodeNotOwned(_))
        ));
        st.del_blockdev("i").unwrap();
        assert!(st.implicit.is_empty() && !st.nodes.contains_key(&child));
        st.del_blockdev("r").unwrap();
        st.del_blockdev("n").unwrap();
        let e = DaemonError::ExportInUse("e".into());
        assert_eq!(e.qmp_class(), "GenericError");
    }
}
