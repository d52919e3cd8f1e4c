//! The daemon: IoThreads, block nodes, exports and monitors, wired on the main loop.
//!
//! The main thread runs its own `AioContext` (polling off, like QEMU's main loop): it
//! accepts and negotiates NBD connections, serves the QMP monitors and handles signals.
//! Exports with an `iothread` run their connections there. Everything the command line and
//! QMP create lives in [`State`], shared (main thread only) by the monitor tasks.
//!
//! Shutdown (SIGINT, SIGTERM, SIGHUP or QMP `quit`): stop listening, disconnect clients and
//! let their in-flight requests finish (bounded), flush writable nodes, join IoThreads,
//! remove sockets and the pidfile.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stord_aio::{AioContext, AioContextOptions, IoThread, PolicyKind, PollParams, ReactorKind};

use crate::block::file::FileOptions;
use crate::block::null::NullDriver;
use crate::block::qcow2::{Image, Qcow2Driver, Qcow2Options};
use crate::block::raw::RawDriver;
use crate::block::throttle::{ThrottleDriver, ThrottleGroup};
use crate::block::{BlockDriver, BlockNode};
use crate::cli::keyval::{KeyVal, OptionError};
use crate::cli::{CommandLine, Item};
use crate::export::nbd::{
    ExportTable, ListenAddr, NbdServer, NbdServerOpts, DEFAULT_HANDSHAKE_MAX_SECS,
};
use crate::export::{Export, ExportEnv, EXPORT_TYPES};
use crate::qmp::{Events, MonitorServer};
use crate::secret::{Secret, SecretError};
use crate::sys;
use crate::tls::{AuthzSimple, TlsCreds, TlsError, TlsServer};

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
    #[error("Duplicate nodes with node-name='{0}'")]
    DuplicateNode(String),
    #[error("Failed to find node with node-name='{0}'")]
    NodeNotFound(String),
    #[error("Cannot find device='{0}' nor node-name='{0}'")]
    ChildNotFound(String),
    #[error("Block device {name} is in use (it is the '{role}' child of node '{parent}')")]
    NodeIsChild {
        name: String,
        parent: String,
        role: &'static str,
    },
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
    Perm(#[from] crate::block::perm::PermError),
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
        "GenericError"
    }
}

impl From<String> for DaemonError {
    fn from(s: String) -> Self {
        DaemonError::Invalid(s)
    }
}

impl From<DaemonError> for String {
    fn from(e: DaemonError) -> String {
        e.to_string()
    }
}

/// Everything the daemon has created (main thread only).
#[derive(Default)]
pub struct State {
    /// `--object iothread` by id.
    pub iothreads: BTreeMap<String, IoThread>,
    /// `--object throttle-group` by id.
    pub throttle_groups: BTreeMap<String, Arc<ThrottleGroup>>,
    /// `--object tls-creds-x509|tls-creds-psk|authz-simple|secret` by id.
    pub objects: BTreeMap<String, UserObject>,
    /// Block nodes by node-name.
    pub nodes: BTreeMap<String, Arc<BlockNode>>,
    /// Nodes opened inline as another node's child (removed with their parent).
    pub implicit: BTreeSet<String>,
    /// The next `#blockNNN` number.
    implicit_seq: u32,
    /// Backing files being opened, one inside the other.
    backing_depth: u32,
    /// Exports by id, whatever their type.
    pub exports: BTreeMap<String, Box<dyn Export>>,
    /// Each export's permissions on its node (given back once it has drained).
    export_claims: BTreeMap<String, crate::block::perm::Claim>,
    /// The exports the NBD server offers (shared with it, for the handshake).
    pub nbd_table: ExportTable,
    /// Exports being removed: each task ends once its export has drained.
    removals: Vec<stord_aio::JoinHandle<()>>,
    /// The NBD server, if started.
    pub nbd: Option<NbdServer>,
    /// `--chardev socket` paths by id, until a monitor takes them.
    pub chardevs: BTreeMap<String, PathBuf>,
    /// Listening monitors.
    pub monitors: Vec<MonitorServer>,
    /// Event fan-out to negotiated monitor connections.
    pub events: Events,
    /// Set to stop the main loop.
    pub quit: Rc<Cell<bool>>,
    /// The SHUTDOWN event has been sent (by `quit`).
    pub shutdown_announced: Cell<bool>,
}

/// An object from `--object`/`object-add` that is data, not a thread or a group.
pub enum UserObject {
    TlsCreds(Arc<TlsCreds>),
    Authz(Arc<AuthzSimple>),
    Secret(Secret),
}

impl UserObject {
    /// Whether something (the NBD server) holds it.
    fn in_use(&self) -> bool {
        match self {
            UserObject::TlsCreds(c) => Arc::strong_count(c) > 1,
            UserObject::Authz(a) => Arc::strong_count(a) > 1,
            UserObject::Secret(_) => false,
        }
    }
}

/// The `qom-type`s `--object` and `object-add` take.
pub const OBJECT_TYPES: &[&str] = &[
    "iothread",
    "throttle-group",
    "tls-creds-x509",
    "tls-creds-psk",
    "authz-simple",
    "secret",
];

/// Shared handle to the state.
pub type SharedState = Rc<RefCell<State>>;

/// The running daemon.
pub struct Daemon {
    ctx: AioContext,
    state: SharedState,
    pidfile: Option<PathBuf>,
    /// Shutdown signals received, and who waits for the next one.
    signals_seen: SignalsSeen,
    _signals: OwnedFd,
}

/// Counts shutdown signals, so a second one can cut the shutdown's waits short.
#[derive(Clone, Default)]
struct SignalsSeen {
    count: Rc<Cell<u32>>,
    waker: Rc<Cell<Option<std::task::Waker>>>,
}

/// How a bounded wait of the shutdown ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waited {
    Done,
    TimedOut,
    Signalled,
}

/// How long the final flush of writable nodes may take before the daemon stops without it
/// (storage that stopped answering must not keep a stop from finishing).
const FLUSH_LIMIT: Duration = Duration::from_secs(10);

/// Parses `--object iothread,...` poll options into `PollParams` (and the reactor).
pub fn iothread_params(kv: &mut KeyVal) -> Result<(PollParams, ReactorKind), String> {
    let mut p = PollParams::default();
    if let Some(v) = kv.take_u64("poll-max-ns", false)? {
        p.max_ns = v;
    }
    if let Some(v) = kv.take_u64("poll-grow", false)? {
        p.grow = v;
    }
    if let Some(v) = kv.take_u64("poll-shrink", false)? {
        p.shrink = v;
    }
    if let Some(v) = kv.take_u64("poll-weight", false)? {
        p.weight =
            u32::try_from(v).map_err(|_| format!("{}: poll-weight must be in 0..=63", kv.what))?;
    }
    if let Some(v) = kv.take("poll-policy") {
        p.policy = v
            .parse::<PolicyKind>()
            .map_err(|e| format!("{}: {e}", kv.what))?;
    }
    if let Some(v) = kv.take_u64("poll-grow-start", false)? {
        p.grow_start_ns = v;
    }
    p.allow_shrink = kv.take_bool("poll-allow-shrink", true)?;
    if let Some(v) = kv.take_u64("poll-yield-ns", false)? {
        p.yield_ns = v;
    }
    p.validate().map_err(|e| format!("{}: {e}", kv.what))?;
    let reactor = match kv.take("reactor") {
        Some(r) => r.parse().map_err(|e| format!("{}: {e}", kv.what))?,
        None => ReactorKind::Auto,
    };
    // qsd's event-loop properties we accept; the thread pool and batch size are ours.
    for k in ["aio-max-batch", "thread-pool-min", "thread-pool-max"] {
        kv.take_u64(k, false)?;
    }
    Ok((p, reactor))
}

/// What an export takes of its node, as QEMU's `blk_exp_add`: reads, writes when
/// writable, resizes when growable (FUSE); others may do anything but, for NBD, resize (its
/// clients were told the size).
fn export_perms(
    kind: &str,
    writable: bool,
    growable: bool,
) -> (crate::block::perm::Perm, crate::block::perm::Perm) {
    use crate::block::perm::Perm;
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

/// QEMU's `id_wellformed`: a letter, then letters, digits, `-`, `.` and `_` (object ids,
/// export ids and node names).
fn id_wellformed(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
}

/// QEMU's rules for a node name (`id_wellformed`, and 31 bytes at most): a letter, then
/// letters, digits, `-`, `.` and `_`; its messages.
fn check_node_name(name: &str) -> Result<(), DaemonError> {
    if !id_wellformed(name) {
        return Err(DaemonError::Invalid(format!("Invalid node-name: '{name}'")));
    }
    if name.len() > 31 {
        return Err(DaemonError::Invalid("Node name too long".into()));
    }
    Ok(())
}

/// The options every node takes ([`crate::block::CommonOptions`]), with QEMU's rules and
/// messages. `discard` is only looked at for drivers that take it themselves (file,
/// qcow2).
fn common_options(
    kv: &mut KeyVal,
    driver: &str,
    read_only: bool,
) -> Result<crate::block::CommonOptions, DaemonError> {
    use crate::block::DetectZeroes;
    let detect_zeroes = match kv
        .take_choice("detect-zeroes", &["off", "on", "unmap"])?
        .as_deref()
    {
        Some("on") => DetectZeroes::On,
        Some("unmap") => DetectZeroes::Unmap,
        _ => DetectZeroes::Off,
    };
    const DISCARD: &[&str] = &["ignore", "off", "unmap", "on"];
    let discard = if matches!(driver, "file" | "host_device" | "qcow2") {
        let v = kv.get("discard").map(str::to_string);
        if let Some(v) = &v {
            if !DISCARD.contains(&v.as_str()) {
                return Err(kv.bad_value("discard", "'ignore' or 'unmap'", v).into());
            }
        }
        v
    } else {
        kv.take_choice("discard", DISCARD)?
    };
    let unmap = matches!(discard.as_deref(), Some("unmap" | "on"));
    if detect_zeroes == DetectZeroes::Unmap && !unmap {
        return Err(DaemonError::Invalid(
            "setting detect-zeroes to unmap is not allowed without setting discard operation to unmap"
                .into(),
        ));
    }
    let force_share = kv.take_bool("force-share", false)?;
    if force_share && !read_only {
        return Err(DaemonError::Invalid(
            "force-share=on can only be used with read-only images".into(),
        ));
    }
    Ok(crate::block::CommonOptions {
        detect_zeroes,
        unmap,
        force_share,
    })
}

impl State {
    /// `--object iothread,id=...` / `object-add`.
    pub fn add_object(&mut self, mut kv: KeyVal) -> Result<(), DaemonError> {
        let kind = kv.take_required("qom-type")?;
        if !OBJECT_TYPES.contains(&kind.as_str()) {
            return Err(kv
                .bad_value(
                    "qom-type",
                    &format!("a supported object type ({})", OBJECT_TYPES.join(", ")),
                    &kind,
                )
                .into());
        }
        let id = kv.take_required("id")?;
        if !id_wellformed(&id) {
            return Err(DaemonError::Invalid(
                "Parameter 'id' expects an identifier".into(),
            ));
        }
        if self.iothreads.contains_key(&id)
            || self.throttle_groups.contains_key(&id)
            || self.objects.contains_key(&id)
        {
            return Err(DaemonError::DuplicateObject(id));
        }
        let object = match kind.as_str() {
            "tls-creds-x509" | "tls-creds-psk" => {
                let secret = |id: &str| match self.objects.get(id) {
                    Some(UserObject::Secret(s)) => Some(s.bytes().to_vec()),
                    _ => None,
                };
                Some(UserObject::TlsCreds(Arc::new(TlsCreds::from_object(
                    &kind, &mut kv, &secret,
                )?)))
            }
            "authz-simple" => Some(UserObject::Authz(Arc::new(AuthzSimple::from_object(
                &mut kv,
            )?))),
            "secret" => Some(UserObject::Secret(Secret::from_object(&mut kv)?)),
            _ => None,
        };
        if let Some(object) = object {
            kv.finish()?;
            self.objects.insert(id, object);
            return Ok(());
        }
        if kind == "throttle-group" {
            let group = ThrottleGroup::from_opts(id.clone(), &mut kv)?;
            kv.finish()?;
            self.throttle_groups.insert(id, Arc::new(group));
            return Ok(());
        }
        let (poll, reactor) = iothread_params(&mut kv)?;
        kv.finish()?;
        let thread = IoThread::spawn(AioContextOptions {
            name: id.clone(),
            reactor,
            poll,
        })
        .map_err(|source| DaemonError::IoThreadStart {
            id: id.clone(),
            source,
        })?;
        self.iothreads.insert(id, thread);
        Ok(())
    }

    /// `object-del`: fails while an export runs on the iothread.
    pub fn del_object(&mut self, id: &str) -> Result<(), DaemonError> {
        if let Some(obj) = self.objects.get(id) {
            if obj.in_use() {
                return Err(DaemonError::ObjectInUse(id.into()));
            }
            self.objects.remove(id);
            return Ok(());
        }
        if let Some(group) = self.throttle_groups.get(id) {
            // Held by the table and by each throttle node in the group.
            if Arc::strong_count(group) > 1 {
                return Err(DaemonError::ObjectInUse(id.into()));
            }
            self.throttle_groups.remove(id);
            return Ok(());
        }
        let Some(obj) = self.iothreads.get(id) else {
            return Err(DaemonError::ObjectNotFound(id.into()));
        };
        let remote = obj.remote().clone();
        let in_use = self.exports.values().any(|e| e.runs_on(&remote));
        if in_use {
            return Err(DaemonError::ObjectInUse(id.into()));
        }
        if let Some(mut obj) = self.iothreads.remove(id) {
            obj.stop();
        }
        Ok(())
    }

    /// `--blockdev` / `blockdev-add`.
    pub fn add_blockdev(&mut self, kv: KeyVal) -> Result<(), DaemonError> {
        self.open_node(kv, false).map(|_| ())
    }

    /// Opens a node and, first, its inline children; a child given by name must exist.
    /// Inline children get a generated name (`#block0`, ...) and go when their parent goes.
    fn open_node(&mut self, mut kv: KeyVal, implicit: bool) -> Result<Arc<BlockNode>, DaemonError> {
        let driver = kv.take_required("driver")?;
        let name = match kv.take("node-name") {
            Some(n) => n,
            None if implicit => self.implicit_name(),
            None => {
                return Err(OptionError::Missing {
                    what: kv.what.clone(),
                    key: "node-name".into(),
                }
                .into())
            }
        };
        if !name.starts_with('#') || !implicit {
            check_node_name(&name)?;
        }
        if self.nodes.contains_key(&name) {
            return Err(DaemonError::DuplicateNode(name));
        }
        let read_only = kv.take_bool("read-only", false)?;
        let _ = kv.take_bool("auto-read-only", false)?;
        let common = common_options(&mut kv, &driver, read_only)?;
        // What inline children inherit, as QEMU's do: the cache mode, read-only,
        // force-share, and
        // discard=unmap (a child passes on what its parent decided to discard).
        let mut inherit = vec![("discard", "unmap".to_string())];
        if driver != "file" && driver != "host_device" {
            for key in ["cache.direct", "cache.no-flush"] {
                if let Some(v) = kv.take(key) {
                    inherit.push((key, v));
                }
            }
        }
        if read_only {
            inherit.push(("read-only", "on".into()));
        }
        if common.force_share {
            inherit.push(("force-share", "on".into()));
        }
        let mut opened_children = Vec::new();
        let (drv, read_only, direct): (Box<dyn BlockDriver>, bool, bool) = match driver.as_str() {
            "null" | "null-co" => (Box::new(NullDriver::from_opts(&mut kv)?), read_only, false),
            "file" | "host_device" => {
                let opts = FileOptions::from_opts(&mut kv, read_only)?;
                let direct = opts.direct;
                let f = crate::block::file::open(opts).map_err(|e| format!("{}: {e}", kv.what))?;
                (f, read_only, direct)
            }
            "raw" => {
                let child = self.child_node(&mut kv, "file", &inherit, &mut opened_children)?;
                let raw = RawDriver::from_opts(&mut kv, child.clone());
                let raw = match raw {
                    Ok(r) => r,
                    Err(e) => {
                        drop(child);
                        self.drop_implicit(opened_children);
                        return Err(e.into());
                    }
                };
                // A format node cannot write where its child cannot.
                let ro = read_only || child.is_read_only();
                (Box::new(raw), ro, child.direct)
            }
            "throttle" => {
                let group = kv.take_required("throttle-group")?;
                let Some(group) = self.throttle_groups.get(&group).cloned() else {
                    return Err(DaemonError::Invalid(format!(
                        "{}: throttle group '{group}' does not exist",
                        kv.what
                    )));
                };
                let child = self.child_node(&mut kv, "file", &inherit, &mut opened_children)?;
                let (ro, direct) = (read_only || child.is_read_only(), child.direct);
                (Box::new(ThrottleDriver::new(child, group)), ro, direct)
            }
            "qcow2" => {
                let child = self.child_node(&mut kv, "file", &inherit, &mut opened_children)?;
                match self.open_qcow2(&mut kv, child, read_only, &inherit, &mut opened_children) {
                    Ok(opened) => opened,
                    Err(e) => {
                        self.drop_implicit(opened_children);
                        return Err(e);
                    }
                }
            }
            other => {
                return Err(kv
                    .bad_value(
                        "driver",
                        "null-co, null, file, raw, qcow2 or throttle",
                        other,
                    )
                    .into())
            }
        };
        if let Err(e) = kv.finish() {
            drop(drv);
            self.drop_implicit(opened_children);
            return Err(e.into());
        }
        let node =
            Arc::new(BlockNode::new(name.clone(), drv, read_only, direct).with_options(common));
        // What the node needs of its children (a format node: its file), as locks where
        // they are files: refused here if another user or process is in the way.
        if let Err(e) = node.refresh_perms() {
            drop(node);
            self.drop_implicit(opened_children);
            return Err(e.into());
        }
        self.nodes.insert(name.clone(), node.clone());
        if implicit {
            self.implicit.insert(name);
        }
        Ok(node)
    }

    /// A qcow2 driver over `file`: its backing node is `backing=NAME`, inline
    /// `backing.driver=...`, none with `backing=null`, else the one the image names
    /// (opened read-only, relative to the image's directory, as QEMU does).
    fn open_qcow2(
        &mut self,
        kv: &mut KeyVal,
        file: Arc<BlockNode>,
        read_only: bool,
        inherit: &[(&str, String)],
        opened: &mut Vec<String>,
    ) -> Result<(Box<dyn BlockDriver>, bool, bool), DaemonError> {
        let opts = Qcow2Options::from_opts(kv)?;
        let ro = read_only || file.is_read_only();
        let given = if let Some(mut inline) = kv.take_prefixed("backing") {
            for (k, v) in inherit {
                inline.inherit(k, v);
            }
            let node = self.open_node(inline, true)?;
            opened.push(node.name.clone());
            Some(Some(node))
        } else {
            match kv.take("backing").as_deref() {
                None => None,
                Some("null" | "") => Some(None),
                Some(name) => Some(Some(
                    self.nodes
                        .get(name)
                        .cloned()
                        .ok_or_else(|| DaemonError::ChildNotFound(name.into()))?,
                )),
            }
        };
        let f = file.clone();
        let image =
            crate::block::block_on_helper(move || async move { Image::load(&f, !ro).await })
                .and_then(|r| r.map_err(io::Error::other))
                .map_err(|e| DaemonError::Invalid(format!("{}: {e}", kv.what)))?;
        let backing = match given {
            Some(b) => b,
            None => match image.header.backing_file.clone() {
                Some(name) => {
                    let fmt = image.header.backing_format.clone();
                    Some(self.open_backing(&file, &name, fmt, opened)?)
                }
                None => None,
            },
        };
        let direct = file.direct;
        let drv = Qcow2Driver::new(file, backing, image, &opts);
        Ok((Box::new(drv), ro, direct))
    }

    /// Opens the backing file an image names: read-only, its format from the image or
    /// probed, a chain at most 64 deep.
    fn open_backing(
        &mut self,
        image: &BlockNode,
        name: &str,
        format: Option<String>,
        opened: &mut Vec<String>,
    ) -> Result<Arc<BlockNode>, DaemonError> {
        let path = if name.starts_with('/') {
            PathBuf::from(name)
        } else {
            let Some(dir) = image
                .filename()
                .and_then(|f| Path::new(&f).parent().map(Path::to_path_buf))
            else {
                return Err(DaemonError::Invalid(format!(
                    "Cannot use relative backing file name '{name}' for an image without a file name"
                )));
            };
            dir.join(name)
        };
        if self.backing_depth >= 64 {
            return Err(DaemonError::Invalid(format!(
                "Backing chain too deep (or a loop) at '{}'",
                path.display()
            )));
        }
        let format = match format {
            Some(f) => f,
            None => {
                // No backing_fmt: probe, as QEMU does (qcow2 by its magic, else raw).
                let mut magic = [0u8; 4];
                let is_qcow2 = std::fs::File::open(&path)
                    .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
                    .is_ok()
                    && crate::block::qcow2::has_magic(&magic);
                if is_qcow2 { "qcow2" } else { "raw" }.to_string()
            }
        };
        let mut pairs = vec![
            ("driver".to_string(), format),
            ("read-only".into(), "on".into()),
            ("file.driver".into(), "file".into()),
            ("file.filename".into(), path.display().to_string()),
        ];
        if image.direct {
            pairs.push(("file.cache.direct".into(), "on".into()));
        }
        let kv = KeyVal::from_pairs(&format!("backing file '{}'", path.display()), pairs);
        self.backing_depth += 1;
        let r = self.open_node(kv, true);
        self.backing_depth -= 1;
        let node = r?;
        opened.push(node.name.clone());
        Ok(node)
    }

    /// The child `role` of a node being opened: `role=NAME` names an existing node,
    /// `role.driver=...` opens one inline (recorded in `opened` so a later error can
    /// remove it again).
    fn child_node(
        &mut self,
        kv: &mut KeyVal,
        role: &str,
        inherit: &[(&str, String)],
        opened: &mut Vec<String>,
    ) -> Result<Arc<BlockNode>, DaemonError> {
        if let Some(mut inline) = kv.take_prefixed(role) {
            for (k, v) in inherit {
                inline.inherit(k, v);
            }
            if kv.take(role).is_some() {
                return Err(DaemonError::Invalid(format!(
                    "{}: '{role}' given both as a node name and inline",
                    kv.what
                )));
            }
            let node = self.open_node(inline, true)?;
            opened.push(node.name.clone());
            return Ok(node);
        }
        let name = kv.take_required(role)?;
        self.nodes
            .get(&name)
            .cloned()
            .ok_or(DaemonError::ChildNotFound(name))
    }

    /// A fresh name for an inline child, as qsd's `#blockNNN`.
    fn implicit_name(&mut self) -> String {
        loop {
            let n = format!("#block{:03}", self.implicit_seq);
            self.implicit_seq += 1;
            if !self.nodes.contains_key(&n) {
                return n;
            }
        }
    }

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
        if let Some((parent, role)) = self.parents_of(name).into_iter().next() {
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
        // What a format node still caches (qcow2's tables) goes to disk before it closes,
        // as QEMU's bdrv_close flushes.
        if !node.is_read_only() {
            let n = node.clone();
            match crate::block::block_on_helper(move || async move { n.flush().await }) {
                Ok(Ok(())) => {}
                Ok(Err(e)) | Err(e) => tracing::warn!("blockdev-del {name}: flush failed: {e}"),
            }
        }
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
            crate::block::perm::Perm::RESIZE,
            crate::block::perm::Perm::ALL,
        )?;
        let n = node.clone();
        let r = crate::block::block_on_helper(move || async move { n.resize(size).await });
        drop(claim);
        match r {
            Ok(Ok(())) => Ok(()),
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
            if !node.can_write() {
                return Err(DaemonError::Invalid(format!(
                    "Cannot make node '{name}' writable: it was opened read-only (stord \
                     cannot reopen its file read-write; blockdev-add it writable)"
                )));
            }
            node.set_read_only(false);
            // A format node takes write access to its file again: its lock may be refused.
            if let Err(e) = node.refresh_perms() {
                node.set_read_only(true);
                let _ = node.refresh_perms();
                return Err(e.into());
            }
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
        match crate::block::block_on_helper(move || async move { n.flush().await }) {
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

    /// `--nbd-server` / `nbd-server-start`.
    pub fn start_nbd_server(
        &mut self,
        ctx: &AioContext,
        opts: NbdServerOpts,
    ) -> Result<(), DaemonError> {
        if self.nbd.is_some() {
            return Err(DaemonError::NbdServerRunning);
        }
        let tls = match &opts.tls_creds {
            None => None,
            Some(id) => {
                let Some(UserObject::TlsCreds(creds)) = self.objects.get(id) else {
                    return Err(DaemonError::NoTlsCreds(id.clone()));
                };
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
        let server =
            NbdServer::start(ctx, opts, tls, self.nbd_table.clone()).map_err(|source| {
                DaemonError::Listen {
                    addr: addr.to_string(),
                    source,
                }
            })?;
        self.nbd = Some(server);
        Ok(())
    }

    /// `nbd-server-stop`: stops listening; exports stay until deleted (as in QEMU, NBD
    /// exports are removed with the server).
    pub fn stop_nbd_server(&mut self) -> Result<(), DaemonError> {
        let Some(mut s) = self.nbd.take() else {
            return Err(DaemonError::NbdServerNotRunning);
        };
        s.stop();
        let nbd: Vec<String> = self
            .exports
            .values()
            .filter(|e| e.kind() == "nbd")
            .map(|e| e.id().to_string())
            .collect();
        for id in nbd {
            self.begin_export_removal(&id);
        }
        Ok(())
    }

    /// `--export` / `block-export-add`: the type's constructor from [`EXPORT_TYPES`].
    pub fn add_export(&mut self, mut kv: KeyVal) -> Result<(), DaemonError> {
        let kind = kv.take_required("type")?;
        let Some((_, create)) = EXPORT_TYPES.iter().find(|(k, _)| *k == kind) else {
            let names: Vec<&str> = EXPORT_TYPES.iter().map(|(k, _)| *k).collect();
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
        let claim = match kv.get("node-name").and_then(|n| self.nodes.get(n)) {
            Some(node) => {
                let writable = matches!(kv.get("writable"), Some("on" | "true" | "yes"));
                let growable = matches!(kv.get("growable"), Some("on" | "true" | "yes"));
                let (perm, shared) = export_perms(&kind, writable, growable);
                let user = format!("block export '{}'", kv.get("id").unwrap_or(&kind));
                Some(node.claim(&user, "root", perm, shared)?)
            }
            None => None,
        };
        let env = ExportEnv {
            nodes: &self.nodes,
            iothreads: &self.iothreads,
            nbd: self.nbd.as_ref().map(|_| &self.nbd_table),
            claimed: self.exports.values().filter_map(|e| e.claim()).collect(),
        };
        let export = create(&env, kv)?;
        if let Some(c) = claim {
            self.export_claims.insert(export.id().to_string(), c);
        }
        self.exports.insert(export.id().to_string(), export);
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
        let events = self.events.clone();
        self.removals.retain(|h| !h.is_finished());
        self.removals.push(stord_aio::spawn(async move {
            std::future::poll_fn(|cx| e.poll_drained(cx)).await;
            events.emit("BLOCK_EXPORT_DELETED", serde_json::json!({ "id": e.id() }));
            drop(e);
            drop(claim);
        }));
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

impl Daemon {
    /// Creates the main loop. Blocks the shutdown signals first so every thread started
    /// later inherits the mask and the signals arrive on our signalfd.
    pub fn new() -> io::Result<Self> {
        let signals = sys::signalfd_for_shutdown()?;
        let main_poll = PollParams {
            max_ns: 0,
            ..PollParams::default()
        };
        let ctx = AioContext::new(AioContextOptions {
            name: "main".into(),
            reactor: ReactorKind::Auto,
            poll: main_poll,
        })?;
        let state: SharedState = Rc::default();
        let q = state.borrow().quit.clone();
        let sigfd = signals.as_raw_fd();
        let seen = SignalsSeen::default();
        let seen2 = seen.clone();
        ctx.set_fd_handler(sigfd, stord_aio::Interest::READABLE, move |_| {
            while let Some(sig) = sys::read_signal(sigfd) {
                if q.replace(true) {
                    tracing::warn!("signal {sig} received again: stopping at once");
                } else {
                    tracing::info!("signal {sig} received, shutting down");
                }
                seen2.count.set(seen2.count.get() + 1);
                if let Some(w) = seen2.waker.take() {
                    w.wake();
                }
            }
        })?;
        Ok(Self {
            ctx,
            state,
            pidfile: None,
            signals_seen: seen,
            _signals: signals,
        })
    }

    /// The main loop's context.
    pub fn context(&self) -> &AioContext {
        &self.ctx
    }

    /// The shared state.
    pub fn state(&self) -> &SharedState {
        &self.state
    }

    /// Creates everything the command line asks for: iothreads and chardevs first, then
    /// the rest in order; then writes the pidfile.
    pub fn apply(&mut self, cl: CommandLine) -> Result<(), String> {
        let (first, rest): (Vec<_>, Vec<_>) = cl
            .items
            .into_iter()
            .partition(|i| matches!(i, Item::Object(_) | Item::Chardev(_)));
        for item in first.into_iter().chain(rest) {
            let mut st = self.state.borrow_mut();
            match item {
                Item::Object(s) => {
                    st.add_object(KeyVal::parse("--object", &s, Some("qom-type"))?)?
                }
                Item::Chardev(s) => {
                    add_chardev(&mut st, KeyVal::parse("--chardev", &s, Some("backend"))?)?
                }
                Item::Blockdev(s) => st
                    .add_blockdev(KeyVal::parse("--blockdev", &s, Some("driver"))?)
                    .map_err(|e| match e {
                        // Where qsd says it too: the option list that met the lock.
                        DaemonError::Perm(e) => format!("--blockdev {s}: {e}"),
                        e => e.to_string(),
                    })?,
                Item::NbdServer(s) => {
                    let opts = nbd_server_opts(KeyVal::parse("--nbd-server", &s, None)?)?;
                    st.start_nbd_server(&self.ctx, opts)
                        .map_err(|e| format!("--nbd-server: {e}"))?
                }
                Item::Export(s) => st.add_export(KeyVal::parse("--export", &s, Some("type"))?)?,
                Item::Monitor(s) => {
                    let mut kv = KeyVal::parse("--monitor", &s, Some("chardev"))?;
                    let id = kv.take_required("chardev")?;
                    let _ = kv.take_choice("mode", &["control"])?;
                    let _ = kv.take_bool("pretty", false)?;
                    kv.finish()?;
                    let path = st
                        .chardevs
                        .remove(&id)
                        .ok_or_else(|| format!("--monitor: chardev '{id}' not found"))?;
                    drop(st);
                    let server = MonitorServer::start(&self.ctx, &path, self.state.clone())
                        .map_err(|e| {
                            format!("--monitor: cannot listen on {}: {e}", path.display())
                        })?;
                    self.state.borrow_mut().monitors.push(server);
                }
            }
        }
        if let Some(p) = cl.pidfile {
            std::fs::write(&p, format!("{}\n", std::process::id()))
                .map_err(|e| format!("cannot write pidfile '{}': {e}", p.display()))?;
            self.pidfile = Some(p);
        }
        Ok(())
    }

    /// Where the NBD server listens, if it runs.
    pub fn nbd_addr(&self) -> Option<ListenAddr> {
        self.state.borrow().nbd.as_ref().map(|s| s.addr.clone())
    }

    /// Runs the main loop until a shutdown signal or `quit`.
    pub fn run(&mut self) {
        let quit = self.state.borrow().quit.clone();
        while !quit.get() {
            self.ctx.run_once(true);
        }
    }

    /// Asks the main loop to stop (from the main thread).
    pub fn request_quit(&self) {
        self.state.borrow().quit.set(true);
    }

    /// Stops serving, lets in-flight requests finish (at most 5 s), flushes writable nodes,
    /// joins IoThreads and removes sockets and the pidfile.
    /// Stops everything; false when it had to stop without finishing (requests stuck in
    /// storage that does not answer, or a second signal): the caller should exit at once.
    pub fn shutdown(&mut self) -> bool {
        // The signal that started the stop is counted already; another one cuts it short.
        let signals_at_start = self.signals_seen.count.get().min(1);
        {
            let st = self.state.borrow();
            if !st.shutdown_announced.replace(true) {
                st.events.emit(
                    "SHUTDOWN",
                    serde_json::json!({ "guest": false, "reason": "host-signal" }),
                );
            }
        }
        // Let monitors send what they have (the reply to `quit`, SHUTDOWN), bounded.
        let deadline = Instant::now() + Duration::from_millis(500);
        while !self.state.borrow().events.flushed() && Instant::now() < deadline {
            self.ctx
                .block_on(stord_aio::sleep(Duration::from_millis(1)));
        }
        {
            let mut st = self.state.borrow_mut();
            if let Some(mut s) = st.nbd.take() {
                s.stop();
            }
            for m in std::mem::take(&mut st.monitors) {
                m.stop();
            }
            st.drain_exports();
        }
        // Let the disconnected clients' requests finish (each export wakes its removal
        // task when it has drained), for at most 5 s.
        let removals = std::mem::take(&mut self.state.borrow_mut().removals);
        let drained = self.wait_bounded(removals, Duration::from_secs(5), signals_at_start);
        if drained == Waited::TimedOut {
            tracing::warn!("exports still had requests in flight after 5 s; flushing anyway");
        }
        let mut clean = drained == Waited::Done;
        if drained != Waited::Signalled {
            let flushes: Vec<_> = self
                .state
                .borrow()
                .nodes
                .values()
                .filter(|n| !n.is_read_only())
                .cloned()
                .map(|node| {
                    stord_aio::spawn(async move {
                        if let Err(e) = node.flush().await {
                            tracing::error!("flushing node '{}' failed: {e}", node.name);
                        }
                    })
                })
                .collect();
            match self.wait_bounded(flushes, FLUSH_LIMIT, signals_at_start) {
                Waited::Done => {}
                Waited::TimedOut => {
                    tracing::error!(
                        "writable nodes were not flushed within {} s (storage not answering); \
                         stopping without them",
                        FLUSH_LIMIT.as_secs()
                    );
                    clean = false;
                }
                Waited::Signalled => clean = false,
            }
        }
        if clean {
            let threads = std::mem::take(&mut self.state.borrow_mut().iothreads);
            for (id, mut t) in threads {
                tracing::debug!("iothread {id}: {:?}", t.remote().stats());
                t.stop();
            }
        } else {
            // IoThreads with requests stuck in storage cannot be joined: the process exits
            // with them (the caller exits at once, with a status that says so).
            tracing::error!("stopping with requests still in flight; they are abandoned");
        }
        if let Some(p) = self.pidfile.take() {
            let _ = std::fs::remove_file(p);
        }
        clean
    }

    /// Waits for `tasks` on the main loop for at most `limit`, or until a shutdown signal
    /// beyond the `seen` first ones arrives.
    fn wait_bounded(
        &self,
        mut tasks: Vec<stord_aio::JoinHandle<()>>,
        limit: Duration,
        seen: u32,
    ) -> Waited {
        let signals = self.signals_seen.clone();
        self.ctx.block_on(async move {
            let mut timer = std::pin::pin!(stord_aio::sleep(limit));
            std::future::poll_fn(|cx| {
                tasks.retain_mut(|h| std::pin::Pin::new(h).poll(cx).is_pending());
                if tasks.is_empty() {
                    return std::task::Poll::Ready(Waited::Done);
                }
                if signals.count.get() > seen {
                    return std::task::Poll::Ready(Waited::Signalled);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return std::task::Poll::Ready(Waited::TimedOut);
                }
                signals.waker.set(Some(cx.waker().clone()));
                std::task::Poll::Pending
            })
            .await
        })
    }
}

/// `--chardev socket,id=...,path=...,server=on,wait=off`.
fn add_chardev(st: &mut State, mut kv: KeyVal) -> Result<(), String> {
    let backend = kv.take_required("backend")?;
    if backend != "socket" {
        return Err(format!(
            "--chardev: backend '{backend}' is not supported (only socket)"
        ));
    }
    let id = kv.take_required("id")?;
    let path = kv.take_required("path")?;
    if !kv.take_bool("server", false)? {
        return Err("--chardev: only server=on sockets are supported".into());
    }
    if kv.take_bool("wait", true)? {
        return Err("--chardev: wait=on is not supported (use wait=off)".into());
    }
    kv.finish()?;
    if st.chardevs.contains_key(&id) {
        return Err(format!("--chardev: duplicate chardev id '{id}'"));
    }
    st.chardevs.insert(id, PathBuf::from(path));
    Ok(())
}

/// The `--nbd-server` options (flat SocketAddress).
pub fn nbd_server_opts(mut kv: KeyVal) -> Result<NbdServerOpts, String> {
    let addr = match kv.take_choice("addr.type", &["unix", "inet"])?.as_deref() {
        Some("unix") => ListenAddr::Unix(PathBuf::from(kv.take_required("addr.path")?)),
        Some("inet") => {
            let host = kv.take_required("addr.host")?;
            let port = kv.take_required("addr.port")?;
            let port = port.parse().map_err(|_| {
                format!(
                    "{}: parameter 'addr.port' expects a port number, got '{port}'",
                    kv.what
                )
            })?;
            ListenAddr::Inet(host, port)
        }
        _ => {
            return Err(format!(
                "{}: parameter 'addr.type' is missing (unix or inet)",
                kv.what
            ))
        }
    };
    let max_connections = kv.take_u64("max-connections", false)?.unwrap_or(0) as u32;
    let handshake_max_secs = kv
        .take_u64("handshake-max-seconds", false)?
        .map_or(DEFAULT_HANDSHAKE_MAX_SECS, |s| {
            s.min(u64::from(u32::MAX)) as u32
        });
    let tls_creds = kv.take("tls-creds");
    let tls_authz = kv.take("tls-authz");
    kv.finish()?;
    Ok(NbdServerOpts {
        addr,
        max_connections,
        handshake_max_secs,
        tls_creds,
        tls_authz,
    })
}

/// The repository's root (for the built-in default's data folder).
pub fn repo_root() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    p.canonicalize().unwrap_or(p)
}

/// Size of the built-in default image.
pub const DEFAULT_IMAGE_SIZE: u64 = 1 << 30;

/// The built-in default: a sparse 1 GiB image under `data/`, exported read-write over NBD
/// on a unix socket next to it, served by one IoThread with io_uring and O_DIRECT.
/// Returns the command line and the NBD URI.
pub fn default_job(data_dir: &Path) -> io::Result<(CommandLine, String)> {
    std::fs::create_dir_all(data_dir)?;
    let img = data_dir.join("default.img");
    if !img.exists() {
        let f = std::fs::File::create(&img)?;
        f.set_len(DEFAULT_IMAGE_SIZE)?;
    }
    let sock = data_dir.join("stord.sock");
    let esc = |p: &Path| p.display().to_string().replace(',', ",,");
    let items = vec![
        Item::Object("iothread,id=iothread0".into()),
        Item::Blockdev(format!(
            "driver=file,node-name=default,filename={},aio=io_uring,cache.direct=on",
            esc(&img)
        )),
        Item::NbdServer(format!("addr.type=unix,addr.path={}", esc(&sock))),
        Item::Export(
            "type=nbd,id=export0,node-name=default,name=default,writable=on,iothread=iothread0"
                .into(),
        ),
    ];
    let uri = format!("nbd+unix:///default?socket={}", sock.display());
    Ok((
        CommandLine {
            items,
            ..CommandLine::default()
        },
        uri,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

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
            Err(DaemonError::DuplicateNode(n)) if n == "n"
        ));
        assert!(matches!(
            st.add_blockdev(kv("driver=raw,node-name=x,file=nope")),
            Err(DaemonError::ChildNotFound(n)) if n == "nope"
        ));
        assert!(matches!(
            st.add_blockdev(kv("driver=raw,node-name=x,file=n,bogus=1")),
            Err(DaemonError::Option(OptionError::Unknown { key, .. })) if key == "bogus"
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
