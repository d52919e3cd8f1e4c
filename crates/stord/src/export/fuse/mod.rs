//! The FUSE export: a block node appears as a regular file at `mountpoint`.
//!
//! We mount with mount(2) (we run as root) onto an existing regular file, read requests
//! from /dev/fuse ourselves (no libfuse), one task per request ([`session`]). With a list
//! of IoThreads each gets its own channel, cloned with FUSE_DEV_IOC_CLONE, read by an fd
//! handler (never a poll handler: reading /dev/fuse is a syscall). A watchdog process
//! unmounts if the daemon dies without doing so (kill -9).

#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;
mod handler;
mod proto;
mod session;
mod uring;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stord_aio::Remote;

use std::task::{Context, Poll};

use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;
use crate::cli::keyval::KeyVal;
use crate::export::{DrainSignal, Export, ExportEnv, ExportError};
use crate::sys::{self, UnmountWatchdog};

/// Largest READ we accept (and the mount's max_read).
pub const MAX_READ: u32 = 1 << 20;
/// Largest WRITE the kernel sends us (negotiated in INIT; also the io_uring payload size).
pub const MAX_WRITE: u32 = 128 << 10;

/// Kernel queue ids per IoThread (None: the loop the export was created on).
type UringPlan = Vec<(Option<Remote>, Vec<u16>)>;

/// State shared by all of an export's queues.
pub struct FuseShared {
    /// The node served (a pivot may move it).
    link: Arc<NodeLink>,
    writable: bool,
    /// `writethrough=on`: writes are durable before they complete (FUA).
    writethrough: bool,
    growable: bool,
    allow_other: bool,
    mode: AtomicU32,
    uid: u32,
    gid: u32,
    max_write: u32,
    /// Requests being processed now (all queues).
    in_flight: AtomicUsize,
    /// Woken when `in_flight` drops to zero.
    drain: DrainSignal,
    /// The channel is gone (unmounted) or broken: stop reading.
    halted: AtomicBool,
    /// The kernel's INIT has been answered.
    initialized: AtomicBool,
    /// The export asked for FUSE over io_uring (and the kernel has it enabled).
    want_uring: bool,
    /// INIT granted FUSE over io_uring.
    uring_granted: AtomicBool,
    /// Which kernel queues (qids) each IoThread serves over io_uring (None: this loop).
    uring_plan: Mutex<Option<UringPlan>>,
    /// Rings started, for teardown.
    rings: Mutex<Vec<(Option<Remote>, u64)>>,
    /// Requests served through /dev/fuse reads and through io_uring entries.
    dev_requests: std::sync::atomic::AtomicU64,
    uring_requests: std::sync::atomic::AtomicU64,
}

impl FuseShared {
    /// A request has finished (its reply is written): the last one wakes a removal.
    fn request_done(&self) {
        if self.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.drain.wake();
        }
    }

    /// Called by the queue that answered INIT: if io_uring was granted, start a ring on
    /// every IoThread of the plan (registration must follow the INIT reply).
    fn after_init(self: &Arc<Self>, dev: &Arc<File>) {
        if !self.uring_granted.load(Ordering::SeqCst) {
            return;
        }
        let Some(plan) = self
            .uring_plan
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        for (remote, qids) in plan {
            let (s, d, r2) = (self.clone(), dev.clone(), remote.clone());
            let start = move || match uring::start(s.clone(), d, &qids) {
                Ok(id) => {
                    tracing::info!("fuse: serving queues {qids:?} over io_uring");
                    s.rings
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((r2, id));
                }
                Err(e) => tracing::warn!(
                    "fuse: io_uring queues {qids:?} failed, staying on /dev/fuse: {e}"
                ),
            };
            match remote {
                Some(r) if !r.is_current() => r.call(start),
                _ => start(),
            }
        }
    }

    fn request_buf_len(&self) -> usize {
        (self.max_write as usize + 4096).max(proto::FUSE_MIN_READ_BUFFER)
    }

    fn allocated_bytes(&self) -> u64 {
        let node = self.link.current();
        node.allocated_bytes().unwrap_or_else(|| node.size())
    }
}

/// Where one queue runs.
struct QueueHandle {
    remote: Option<Remote>,
    handler: Option<session::HandlerSlot>,
    _dev: Arc<File>,
}

/// `allow-other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllowOther {
    /// Only the mounting user (root) may access the file.
    Off,
    /// Everyone may (subject to the file mode).
    On,
    /// Try on, fall back to off.
    Auto,
}

/// A mounted FUSE export.
pub struct FuseExport {
    /// Block-export id.
    pub id: String,
    /// Where it is mounted.
    pub mountpoint: PathBuf,
    shared: Arc<FuseShared>,
    queues: Vec<QueueHandle>,
    mounted: bool,
    _watchdog: Option<UnmountWatchdog>,
}

/// Options of `--export type=fuse`.
pub struct FuseOptions {
    pub id: String,
    pub node_name: String,
    pub mountpoint: PathBuf,
    pub writable: bool,
    pub writethrough: bool,
    pub growable: bool,
    pub allow_other: AllowOther,
    pub iothreads: Vec<String>,
    /// `io-uring`: Some(true) on, Some(false) off, None auto.
    pub io_uring: Option<bool>,
}

impl FuseOptions {
    /// Parses the options after `type=fuse` (the caller took `type`).
    pub fn from_opts(kv: &mut KeyVal) -> Result<Self, ExportError> {
        let id = kv.take_required("id")?;
        let node_name = kv.take_required("node-name")?;
        let mountpoint = PathBuf::from(kv.take_required("mountpoint")?);
        let writable = kv.take_bool("writable", false)?;
        let growable = kv.take_bool("growable", false)?;
        let allow_other = match kv
            .take_choice("allow-other", &["off", "on", "auto"])?
            .as_deref()
        {
            Some("on") => AllowOther::On,
            Some("auto") => AllowOther::Auto,
            _ => AllowOther::Off,
        };
        let writethrough = kv.take_bool("writethrough", false)?;
        let _ = kv.take_bool("fixed-iothread", false)?;
        let iothreads = kv.take_list("iothread");
        let io_uring = match kv
            .take_choice("io-uring", &["on", "off", "auto"])?
            .as_deref()
        {
            Some("on") => Some(true),
            Some("off") | None => Some(false),
            _ => None,
        };
        Ok(Self {
            id,
            node_name,
            mountpoint,
            writable,
            writethrough,
            growable,
            allow_other,
            iothreads,
            io_uring,
        })
    }
}

impl FuseExport {
    /// Mounts `node` at `opts.mountpoint` and starts serving on `remotes` (empty: the
    /// calling thread's loop). Must run on the main loop.
    pub fn start(
        opts: FuseOptions,
        node: Arc<BlockNode>,
        remotes: Vec<Remote>,
    ) -> Result<Self, String> {
        let what = "--export type=fuse";
        let meta = std::fs::metadata(&opts.mountpoint)
            .map_err(|e| format!("{what}: mountpoint '{}': {e}", opts.mountpoint.display()))?;
        if !meta.file_type().is_file() {
            return Err(format!(
                "{what}: mountpoint '{}' is not a regular file",
                opts.mountpoint.display()
            ));
        }
        if (opts.writable || opts.growable) && node.is_read_only() {
            return Err(format!("{what}: node '{}' is read-only", node.name));
        }
        let dev = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open("/dev/fuse")
            .map_err(|e| format!("{what}: cannot open /dev/fuse: {e}"))?;
        // The file keeps the owner of the mountpoint it covers.
        let (uid, gid) = (meta.uid(), meta.gid());
        let mut mode = libc::S_IFREG | 0o400;
        if opts.writable {
            mode |= 0o200;
        }
        let try_mount = |allow_other: bool| {
            let mut data = format!(
                "fd={},rootmode={:o},user_id={uid},group_id={gid},max_read={MAX_READ},default_permissions",
                dev.as_raw_fd(),
                libc::S_IFREG
            );
            if allow_other {
                data.push_str(",allow_other");
            }
            let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
            if !opts.writable {
                flags |= libc::MS_RDONLY;
            }
            sys::mount("stord", &opts.mountpoint, "fuse.stord", flags, &data)
        };
        let allow_other = match opts.allow_other {
            AllowOther::On => {
                try_mount(true).map_err(|e| format!("{what}: mount failed: {e}"))?;
                true
            }
            AllowOther::Off => {
                try_mount(false).map_err(|e| format!("{what}: mount failed: {e}"))?;
                false
            }
            AllowOther::Auto => match try_mount(true) {
                Ok(()) => true,
                Err(_) => {
                    try_mount(false).map_err(|e| format!("{what}: mount failed: {e}"))?;
                    false
                }
            },
        };
        let kernel_uring = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
            .map(|v| v.trim() == "Y")
            .unwrap_or(false);
        let want_uring = match opts.io_uring {
            Some(true) if !kernel_uring => {
                let _ = sys::umount(&opts.mountpoint, libc::MNT_DETACH);
                return Err(format!(
                    "{what}: io-uring=on but the kernel does not offer FUSE over io_uring \
                     (/sys/module/fuse/parameters/enable_uring is not Y)"
                ));
            }
            Some(b) => b,
            None => {
                if !kernel_uring {
                    tracing::info!(
                        "fuse: FUSE over io_uring is not enabled in the kernel; using /dev/fuse"
                    );
                }
                kernel_uring
            }
        };
        let watchdog = UnmountWatchdog::spawn(&opts.mountpoint).ok();
        let shared = Arc::new(FuseShared {
            link: NodeLink::new(node),
            writable: opts.writable,
            writethrough: opts.writethrough,
            growable: opts.growable,
            allow_other,
            mode: AtomicU32::new(mode),
            uid,
            gid,
            max_write: MAX_WRITE,
            in_flight: AtomicUsize::new(0),
            drain: DrainSignal::default(),
            halted: AtomicBool::new(false),
            initialized: AtomicBool::new(false),
            want_uring,
            uring_granted: AtomicBool::new(false),
            uring_plan: Mutex::new(None),
            rings: Mutex::default(),
            dev_requests: Default::default(),
            uring_requests: Default::default(),
        });
        let mut export = FuseExport {
            id: opts.id,
            mountpoint: opts.mountpoint,
            shared: shared.clone(),
            queues: Vec::new(),
            mounted: true,
            _watchdog: watchdog,
        };
        let first = Arc::new(dev);
        let mut devs = vec![first.clone()];
        for _ in 1..remotes.len() {
            let clone = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
                .open("/dev/fuse")
                .map_err(|e| format!("{what}: cannot open /dev/fuse: {e}"))?;
            sys::fuse_clone(clone.as_raw_fd(), first.as_raw_fd())
                .map_err(|e| format!("{what}: FUSE_DEV_IOC_CLONE failed: {e}"))?;
            devs.push(Arc::new(clone));
        }
        let places: Vec<Option<Remote>> = if remotes.is_empty() {
            vec![None]
        } else {
            remotes.into_iter().map(Some).collect()
        };
        if want_uring {
            // The kernel has one queue per possible CPU; spread them over our IoThreads.
            let mut plan: UringPlan = places.iter().map(|p| (p.clone(), Vec::new())).collect();
            for qid in 0..possible_cpus() {
                let n = plan.len();
                plan[qid as usize % n].1.push(qid);
            }
            *shared.uring_plan.lock().unwrap_or_else(|e| e.into_inner()) = Some(plan);
        }
        for (dev, remote) in devs.into_iter().zip(places) {
            let (d, s) = (dev.clone(), shared.clone());
            let register = move || session::Queue::start(d.clone(), s).map_err(|e| e.to_string());
            let handler = match &remote {
                Some(r) if !r.is_current() => r.run(register).ok_or("iothread is gone")?,
                _ => register(),
            }
            .map_err(|e| format!("{what}: {e}"))?;
            export.queues.push(QueueHandle {
                remote,
                handler: Some(handler),
                _dev: dev,
            });
        }
        Ok(export)
    }

    /// "io_uring" once INIT granted FUSE over io_uring, else "/dev/fuse".
    pub fn transport(&self) -> &'static str {
        if self.shared.uring_granted.load(Ordering::SeqCst) {
            "io_uring"
        } else {
            "/dev/fuse"
        }
    }

    /// Requests served so far: (through /dev/fuse, through io_uring).
    pub fn request_counts(&self) -> (u64, u64) {
        (
            self.shared.dev_requests.load(Ordering::Relaxed),
            self.shared.uring_requests.load(Ordering::Relaxed),
        )
    }

    /// Requests in progress.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Unmounts, stops reading, and waits (at most `limit`) for requests in progress.
    /// Blocks the calling loop: for drop; the daemon uses [`Export::begin_stop`] and
    /// [`Export::poll_drained`].
    pub fn stop(&mut self, limit: Duration) {
        self.halt();
        let shared = self.shared.clone();
        crate::export::wait_drained(Some(limit), move |cx| {
            shared
                .drain
                .poll(cx, || shared.in_flight.load(Ordering::SeqCst) == 0)
        });
    }

    /// Unmounts and stops reading; requests in progress go on.
    fn halt(&mut self) {
        if self.mounted {
            self.mounted = false;
            if sys::umount(&self.mountpoint, 0).is_err() {
                let _ = sys::umount(&self.mountpoint, libc::MNT_DETACH);
            }
        }
        self.shared.halted.store(true, Ordering::SeqCst);
        for q in &mut self.queues {
            if let Some(slot) = q.handler.take() {
                let remove = move || {
                    let h = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(h) = h {
                        stord_aio::with_current_context(|ctx| ctx.remove_fd_handler(h));
                    }
                };
                match &q.remote {
                    Some(r) if !r.is_current() => {
                        r.run(remove);
                    }
                    _ => remove(),
                }
            }
        }
        let rings =
            std::mem::take(&mut *self.shared.rings.lock().unwrap_or_else(|e| e.into_inner()));
        for (remote, id) in rings {
            match remote {
                Some(r) if !r.is_current() => {
                    r.run(move || uring::teardown(id));
                }
                _ => uring::teardown(id),
            }
        }
    }

    /// Where it is mounted, as text.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }
}

/// `--export type=fuse` / `block-export-add`.
pub fn create(env: &ExportEnv<'_>, mut kv: KeyVal) -> Result<Box<dyn Export>, ExportError> {
    let opts = FuseOptions::from_opts(&mut kv)?;
    let what = kv.what.clone();
    kv.finish()?;
    let node = env.node(&what, &opts.node_name)?;
    env.check_claim(&what, &opts.mountpoint.display().to_string())?;
    let remotes = env.remotes(&what, &opts.iothreads)?;
    Ok(Box::new(FuseExport::start(opts, node, remotes)?))
}

impl Export for FuseExport {
    fn id(&self) -> &str {
        &self.id
    }
    fn kind(&self) -> &'static str {
        "fuse"
    }
    fn writable(&self) -> bool {
        self.shared.writable
    }
    fn link(&self) -> &Arc<NodeLink> {
        &self.shared.link
    }
    fn runs_on(&self, thread: &Remote) -> bool {
        self.queues
            .iter()
            .any(|q| matches!(&q.remote, Some(r) if r.thread_id() == thread.thread_id()))
    }
    fn claim(&self) -> Option<String> {
        Some(self.mountpoint.display().to_string())
    }
    fn in_use(&self) -> bool {
        // Open files are the kernel's business: unmounting ends their access, as in qsd.
        false
    }
    fn shutting_down(&self) -> bool {
        self.shared.halted.load(Ordering::SeqCst)
    }
    fn describe(&self, out: &mut serde_json::Map<String, serde_json::Value>) {
        out.insert("x-transport".into(), self.transport().into());
        let (dev, uring) = self.request_counts();
        out.insert(
            "x-requests".into(),
            serde_json::json!({ "dev-fuse": dev, "io-uring": uring }),
        );
    }
    fn begin_stop(&mut self) {
        self.halt();
    }
    fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.shared.drain.poll(cx, || self.in_flight() == 0)
    }
    fn log_statistics(&self) {
        let (dev, uring) = self.request_counts();
        tracing::info!(
            "fuse export {}: transport {}, requests via /dev/fuse {dev}, via io_uring {uring}",
            self.id,
            self.transport()
        );
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if self.mounted {
            self.stop(Duration::from_secs(1));
        }
    }
}

/// Number of possible CPUs (the kernel makes one FUSE io_uring queue per possible CPU).
fn possible_cpus() -> u16 {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            s.trim()
                .rsplit(['-', ','])
                .next()
                .and_then(|n| n.parse::<u16>().ok())
        })
        .map(|max| max + 1)
        .unwrap_or(1)
}
