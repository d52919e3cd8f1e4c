//! The daemon: IoThreads, block nodes and exports, wired on the main loop.
//!
//! The main thread runs its own `AioContext` (with polling off, like QEMU's main loop): it
//! accepts and negotiates NBD connections and handles signals. Exports with an `iothread`
//! run their connections there. SIGINT, SIGTERM and SIGHUP stop the daemon: the server
//! stops listening, writable nodes are flushed, IoThreads are joined, the socket and the
//! pidfile are removed.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use stord_aio::{AioContext, AioContextOptions, IoThread, PolicyKind, PollParams, ReactorKind};

use crate::block::file::{FileDriver, FileOptions};
use crate::block::null::NullDriver;
use crate::block::{BlockDriver, BlockNode};
use crate::cli::keyval::KeyVal;
use crate::cli::{CommandLine, Item};
use crate::export::nbd::{ExportTable, ListenAddr, NbdExport, NbdServer};
use crate::sys;

/// The running daemon.
pub struct Daemon {
    ctx: AioContext,
    iothreads: BTreeMap<String, IoThread>,
    nodes: BTreeMap<String, Arc<BlockNode>>,
    exports: ExportTable,
    nbd: Option<NbdServer>,
    pidfile: Option<PathBuf>,
    quit: Rc<Cell<bool>>,
    _signals: OwnedFd,
}

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
        let quit = Rc::new(Cell::new(false));
        let q = quit.clone();
        let sigfd = signals.as_raw_fd();
        ctx.set_fd_handler(sigfd, stord_aio::Interest::READABLE, move |_| {
            while let Some(sig) = sys::read_signal(sigfd) {
                eprintln!("stord: signal {sig} received, shutting down");
                q.set(true);
            }
        })?;
        Ok(Self {
            ctx,
            iothreads: BTreeMap::new(),
            nodes: BTreeMap::new(),
            exports: ExportTable::default(),
            nbd: None,
            pidfile: None,
            quit,
            _signals: signals,
        })
    }

    /// The main loop's context.
    pub fn context(&self) -> &AioContext {
        &self.ctx
    }

    /// Creates everything the command line asks for: iothreads first, then the rest in
    /// order; then writes the pidfile.
    pub fn apply(&mut self, cl: CommandLine) -> Result<(), String> {
        let (objects, rest): (Vec<_>, Vec<_>) = cl
            .items
            .into_iter()
            .partition(|i| matches!(i, Item::Object(_)));
        for item in objects.into_iter().chain(rest) {
            match item {
                Item::Object(s) => {
                    self.add_object(KeyVal::parse("--object", &s, Some("qom-type"))?)?
                }
                Item::Blockdev(s) => self.add_blockdev(KeyVal::parse("--blockdev", &s, None)?)?,
                Item::NbdServer(s) => {
                    self.start_nbd_server(KeyVal::parse("--nbd-server", &s, None)?)?
                }
                Item::Export(s) => self.add_export(KeyVal::parse("--export", &s, None)?)?,
            }
        }
        if let Some(p) = cl.pidfile {
            std::fs::write(&p, format!("{}\n", std::process::id()))
                .map_err(|e| format!("cannot write pidfile '{}': {e}", p.display()))?;
            self.pidfile = Some(p);
        }
        Ok(())
    }

    /// `--object iothread,id=...`.
    pub fn add_object(&mut self, mut kv: KeyVal) -> Result<(), String> {
        let kind = kv.take_required("qom-type")?;
        if kind != "iothread" {
            return Err(format!(
                "--object: unsupported object type '{kind}' (supported: iothread)"
            ));
        }
        let id = kv.take_required("id")?;
        if self.iothreads.contains_key(&id) {
            return Err(format!("--object: an object with id '{id}' already exists"));
        }
        let (poll, reactor) = iothread_params(&mut kv)?;
        kv.finish()?;
        let t = IoThread::spawn(AioContextOptions {
            name: id.clone(),
            reactor,
            poll,
        })
        .map_err(|e| format!("--object: cannot start iothread '{id}': {e}"))?;
        self.iothreads.insert(id, t);
        Ok(())
    }

    /// `--blockdev driver=...,node-name=...`.
    pub fn add_blockdev(&mut self, mut kv: KeyVal) -> Result<(), String> {
        let driver = kv.take_required("driver")?;
        let name = kv.take_required("node-name")?;
        if self.nodes.contains_key(&name) {
            return Err(format!("--blockdev: duplicate node name '{name}'"));
        }
        let read_only = kv.take_bool("read-only", false)?;
        let _ = kv.take_bool("auto-read-only", false)?;
        if let Some(dz) = kv.take_choice("detect-zeroes", &["off", "on", "unmap"])? {
            if dz != "off" {
                return Err("--blockdev: detect-zeroes is not supported (only off)".into());
            }
        }
        let (drv, direct): (Box<dyn BlockDriver>, bool) = match driver.as_str() {
            "null" | "null-co" => {
                let _ = kv.take_bool("cache.direct", false)?;
                (Box::new(NullDriver::from_opts(&mut kv)?), false)
            }
            "file" | "host_device" => {
                let opts = FileOptions::from_opts(&mut kv, read_only)?;
                let direct = opts.direct;
                let f = FileDriver::open(opts).map_err(|e| format!("--blockdev: {e}"))?;
                (Box::new(f), direct)
            }
            other => {
                return Err(format!(
                    "--blockdev: parameter 'driver' expects null-co, null or file, got '{other}'"
                ))
            }
        };
        kv.finish()?;
        self.nodes.insert(
            name.clone(),
            Arc::new(BlockNode::new(name, drv, read_only, direct)),
        );
        Ok(())
    }

    /// `--nbd-server addr.type=...`.
    pub fn start_nbd_server(&mut self, mut kv: KeyVal) -> Result<(), String> {
        if self.nbd.is_some() {
            return Err("--nbd-server: NBD server already running".into());
        }
        let addr = match kv.take_choice("addr.type", &["unix", "inet"])?.as_deref() {
            Some("unix") => ListenAddr::Unix(PathBuf::from(kv.take_required("addr.path")?)),
            Some("inet") => {
                let host = kv.take_required("addr.host")?;
                let port = kv.take_required("addr.port")?;
                let port = port.parse().map_err(|_| {
                    format!(
                        "--nbd-server: parameter 'addr.port' expects a port number, got '{port}'"
                    )
                })?;
                ListenAddr::Inet(host, port)
            }
            _ => {
                return Err("--nbd-server: parameter 'addr.type' is missing (unix or inet)".into())
            }
        };
        let max_connections = kv.take_u64("max-connections", false)?.unwrap_or(0) as u32;
        if kv.take("tls-creds").is_some() {
            return Err("--nbd-server: tls-creds is not supported".into());
        }
        kv.finish()?;
        let server = NbdServer::start(
            &self.ctx,
            addr.clone(),
            self.exports.clone(),
            max_connections,
        )
        .map_err(|e| format!("--nbd-server: cannot listen on {addr}: {e}"))?;
        self.nbd = Some(server);
        Ok(())
    }

    /// `--export type=nbd,...`.
    pub fn add_export(&mut self, mut kv: KeyVal) -> Result<(), String> {
        let kind = kv.take_required("type")?;
        if kind != "nbd" {
            return Err(format!(
                "--export: parameter 'type' expects nbd, got '{kind}'"
            ));
        }
        let id = kv.take_required("id")?;
        let node_name = kv.take_required("node-name")?;
        let node = self
            .nodes
            .get(&node_name)
            .cloned()
            .ok_or_else(|| format!("--export: cannot find node '{node_name}'"))?;
        let name = kv.take("name").unwrap_or_else(|| node_name.clone());
        let description = kv.take("description").unwrap_or_default();
        let writable = kv.take_bool("writable", false)?;
        let _ = kv.take_bool("writethrough", false)?;
        let _ = kv.take_bool("fixed-iothread", false)?;
        let _ = kv.take_bool("allocation-depth", false)?;
        let iothread = match kv.take("iothread") {
            None => None,
            Some(t) => Some(
                self.iothreads
                    .get(&t)
                    .ok_or_else(|| format!("--export: iothread '{t}' not found"))?
                    .remote()
                    .clone(),
            ),
        };
        kv.finish()?;
        if writable && node.read_only {
            return Err(format!(
                "--export: node '{node_name}' is read-only, cannot export it writable"
            ));
        }
        if self.nbd.is_none() {
            return Err("--export: NBD server not running (use --nbd-server first)".into());
        }
        if self.exports.all().iter().any(|e| e.id == id) {
            return Err(format!("--export: an export with id '{id}' already exists"));
        }
        let export = NbdExport {
            id,
            name,
            description,
            node,
            writable,
            iothread,
            connections: Default::default(),
        };
        self.exports
            .add(Arc::new(export))
            .map_err(|e| format!("--export: {e}"))
    }

    /// Where the NBD server listens, if it runs.
    pub fn nbd_addr(&self) -> Option<&ListenAddr> {
        self.nbd.as_ref().map(|s| &s.addr)
    }

    /// Runs the main loop until a shutdown signal.
    pub fn run(&mut self) {
        while !self.quit.get() {
            self.ctx.run_once(true);
        }
    }

    /// Asks the main loop to stop (from the main thread).
    pub fn request_quit(&self) {
        self.quit.set(true);
    }

    /// Stops serving, flushes writable nodes, joins IoThreads and removes files.
    pub fn shutdown(&mut self) {
        if let Some(mut s) = self.nbd.take() {
            s.stop(&self.ctx);
        }
        for node in self.nodes.values() {
            if !node.read_only {
                let n = node.clone();
                if let Err(e) = self.ctx.block_on(async move { n.flush().await }) {
                    eprintln!("stord: flushing node '{}' failed: {e}", node.name);
                }
            }
        }
        if std::env::var_os("STORD_STATS").is_some() {
            let h = crate::block::file::harvest_histograms();
            eprintln!(
                "stord: linux-aio completions per harvest (power-of-two buckets): on event {:?}, after io_submit {:?}",
                h.on_event.snapshot(),
                h.after_submit.snapshot()
            );
        }
        for (id, mut t) in std::mem::take(&mut self.iothreads) {
            if std::env::var_os("STORD_STATS").is_some() {
                eprintln!("stord: iothread {id}: {:?}", t.remote().stats());
            }
            t.stop();
        }
        if let Some(p) = self.pidfile.take() {
            let _ = std::fs::remove_file(p);
        }
    }
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
    let items = vec![
        Item::Object("iothread,id=iothread0".into()),
        Item::Blockdev(format!(
            "driver=file,node-name=default,filename={},aio=io_uring,cache.direct=on",
            img.display().to_string().replace(',', ",,")
        )),
        Item::NbdServer(format!(
            "addr.type=unix,addr.path={}",
            sock.display().to_string().replace(',', ",,")
        )),
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
