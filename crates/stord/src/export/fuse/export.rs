//! A mounted FUSE export: mounted and its queues started ([`FuseExport::start`]),
//! unmounted and its queues and rings stopped (`FuseExport::halt`), and the daemon's
//! [`Export`] over it, with `block-export-add`'s constructor ([`create`]).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use stord_aio::Remote;

use super::options::FuseOptions;
use super::shared::{FuseShared, MAX_WRITE};
use super::{mount, session, uring};
use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;
use crate::cli::keyval::KeyVal;
use crate::export::{DrainSignal, Export, ExportEnv, ExportError};
use crate::sys::{self, UnmountWatchdog};

/// Where one queue runs.
struct QueueHandle {
    remote: Option<Remote>,
    handler: Option<session::HandlerSlot>,
    _dev: Arc<File>,
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

impl FuseExport {
    /// Mounts `node` at `opts.mountpoint` and starts serving on `remotes` (empty: the
    /// calling thread's loop). Must run on the main loop.
    pub fn start(
        opts: FuseOptions,
        node: Arc<BlockNode>,
        remotes: Vec<Remote>,
    ) -> Result<Self, String> {
        let what = "--export type=fuse";
        let meta = mount::check_mountpoint(what, &opts, &node)?;
        let dev = mount::open_dev(what)?;
        // The file keeps the owner of the mountpoint it covers.
        let (uid, gid) = (meta.uid(), meta.gid());
        let mut mode = libc::S_IFREG | 0o400;
        if opts.writable {
            mode |= 0o200;
        }
        let allow_other = mount::mount(what, &opts, &dev, uid, gid)?;
        let want_uring = mount::want_uring(what, &opts)?;
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
        let devs = mount::channels(what, Arc::new(dev), remotes.len())?;
        let places: Vec<Option<Remote>> = if remotes.is_empty() {
            vec![None]
        } else {
            remotes.into_iter().map(Some).collect()
        };
        if want_uring {
            *shared.uring_plan.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(uring::plan(&places));
        }
        export.start_queues(what, devs, places)?;
        Ok(export)
    }

    /// Starts a queue on each channel, each on its place (an IoThread, or this loop).
    fn start_queues(
        &mut self,
        what: &str,
        devs: Vec<Arc<File>>,
        places: Vec<Option<Remote>>,
    ) -> Result<(), String> {
        for (dev, remote) in devs.into_iter().zip(places) {
            let (d, s) = (dev.clone(), self.shared.clone());
            let register = move || session::Queue::start(d.clone(), s).map_err(|e| e.to_string());
            let handler = match &remote {
                Some(r) if !r.is_current() => r.run(register).ok_or("iothread is gone")?,
                _ => register(),
            }
            .map_err(|e| format!("{what}: {e}"))?;
            self.queues.push(QueueHandle {
                remote,
                handler: Some(handler),
                _dev: dev,
            });
        }
        Ok(())
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
