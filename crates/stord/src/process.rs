//! The stord process: the main loop, shutdown signals, the command line applied, the QMP
//! monitors, and the stop.
//!
//! The main thread runs its own `AioContext` (polling off, like QEMU's main loop): it
//! accepts and negotiates NBD connections, serves the QMP monitors and handles signals.
//! What the command line and QMP create lives in the daemon's [`State`]; this module is
//! the one place that knows both the daemon and the monitor, so neither imports the other.
//!
//! Shutdown (SIGINT, SIGTERM, SIGHUP or QMP `quit`): stop listening, disconnect clients and
//! let their in-flight requests finish (bounded), flush writable nodes (bounded), join
//! IoThreads, remove sockets and the pidfile. A second signal cuts the waits short.

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

use stord_aio::{AioContext, AioContextOptions, PollParams, ReactorKind};

use crate::block::open::GraphError;
use crate::chardev::{Chardev, ChardevError};
use crate::cli::keyval::{KeyVal, OptionError};
use crate::cli::{CommandLine, Item};
use crate::daemon::{DaemonError, SharedState};
use crate::export::nbd::options::{ListenAddr, NbdServerOpts};
use crate::qmp::monitor::Monitor;
use crate::sys;

/// Why the command line could not be applied; the message names the option, as qsd's do.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error(transparent)]
    Daemon(Box<DaemonError>),
    /// Where qsd says it too: the option list that met a lock or a permission conflict.
    #[error("--blockdev {opts}: {source}")]
    Blockdev {
        opts: String,
        source: Box<DaemonError>,
    },
    #[error("--nbd-server: {0}")]
    NbdServer(Box<DaemonError>),
    #[error("--chardev: {0}")]
    Chardev(String),
    #[error("--chardev: {0}")]
    ChardevOption(#[from] ChardevError),
    #[error("--monitor: chardev '{0}' not found")]
    NoChardev(String),
    #[error("--monitor: {0}")]
    Monitor(io::Error),
    #[error("cannot write pidfile '{path}': {source}")]
    Pidfile { path: PathBuf, source: io::Error },
}

impl From<DaemonError> for StartError {
    fn from(e: DaemonError) -> Self {
        StartError::Daemon(Box::new(e))
    }
}

/// The running daemon.
pub struct Daemon {
    ctx: AioContext,
    state: SharedState,
    pidfile: Option<PathBuf>,
    /// The monitors.
    monitors: Vec<Monitor>,
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

/// How long monitors get to send what they hold (the reply to `quit`, the last events).
const MONITOR_FLUSH_LIMIT: Duration = Duration::from_millis(500);
/// How long disconnected clients' requests get to finish.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);
/// How long the final flush of writable nodes may take before the daemon stops without it
/// (storage that stopped answering must not keep a stop from finishing).
const FLUSH_LIMIT: Duration = Duration::from_secs(10);

impl Daemon {
    /// Creates the main loop. Blocks the shutdown signals first so every thread started
    /// later inherits the mask and the signals arrive on our signalfd.
    pub fn new() -> io::Result<Self> {
        // What `reactor=auto` (and every context stord makes itself) uses: io_uring with
        // the epoll fallback, unless STORD_AIO_REACTOR says otherwise (the tests run every
        // daemon on both this way).
        if let Ok(v) = std::env::var("STORD_AIO_REACTOR") {
            if !v.is_empty() {
                let kind: ReactorKind = v.parse().map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("STORD_AIO_REACTOR: {e}"),
                    )
                })?;
                stord_aio::set_default_reactor(kind);
                tracing::info!("reactor for 'auto': {kind} (from STORD_AIO_REACTOR)");
            }
        }
        let signals = sys::signalfd_for_shutdown()?;
        let main_poll = PollParams {
            max_ns: 0,
            ..PollParams::default()
        };
        let ctx = AioContext::new(AioContextOptions {
            name: "main".into(),
            reactor: ReactorKind::Auto,
            poll: main_poll,
            ..AioContextOptions::default()
        })?;
        let state: SharedState = Rc::default();
        state.borrow_mut().set_self(Rc::downgrade(&state));
        // Monitors made at run time (`monitor-qmp` objects) open as `--monitor`'s do.
        let me = Rc::downgrade(&state);
        state
            .borrow_mut()
            .set_monitor_opener(Rc::new(move |dev, fd, settings| {
                let state = me
                    .upgrade()
                    .ok_or_else(|| io::Error::other("the daemon is stopping"))?;
                crate::qmp::monitor::open_object(&state, dev, fd, settings)
            }));
        let q = state.borrow().quit_flag();
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
            monitors: Vec::new(),
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
    pub fn apply(&mut self, cl: CommandLine) -> Result<(), StartError> {
        let (first, rest): (Vec<_>, Vec<_>) = cl
            .items
            .into_iter()
            .partition(|i| matches!(i, Item::Object(_) | Item::Chardev(_)));
        for item in first.into_iter().chain(rest) {
            match item {
                Item::Object(s) => self.state.borrow_mut().add_object(KeyVal::parse(
                    "--object",
                    &s,
                    Some("qom-type"),
                )?)?,
                Item::Chardev(s) => {
                    self.add_chardev(KeyVal::parse("--chardev", &s, Some("backend"))?)?
                }
                Item::Blockdev(s) => self
                    .state
                    .borrow_mut()
                    .add_blockdev(KeyVal::parse("--blockdev", &s, Some("driver"))?)
                    .map_err(|e| match e {
                        DaemonError::Perm(_) | DaemonError::Graph(GraphError::Perm(_)) => {
                            StartError::Blockdev {
                                opts: s.clone(),
                                source: Box::new(e),
                            }
                        }
                        e => e.into(),
                    })?,
                Item::NbdServer(s) => {
                    let kv = KeyVal::parse("--nbd-server", &s, None)?;
                    let opts = NbdServerOpts::from_options(kv)?;
                    self.state
                        .borrow_mut()
                        .start_nbd_server(&self.ctx, opts)
                        .map_err(|e| StartError::NbdServer(Box::new(e)))?
                }
                Item::Export(s) => self.state.borrow_mut().add_export(KeyVal::parse(
                    "--export",
                    &s,
                    Some("type"),
                )?)?,
                Item::Monitor(s) => self.add_monitor(&s)?,
            }
        }
        // What no monitor took is opened now (a ringbuf, a file, a socket bound).
        self.state
            .borrow_mut()
            .chardevs()
            .open_unused()
            .map_err(|e| StartError::Chardev(e.to_string()))?;
        if let Some(p) = cl.pidfile {
            std::fs::write(&p, format!("{}\n", std::process::id())).map_err(|source| {
                StartError::Pidfile {
                    path: p.clone(),
                    source,
                }
            })?;
            self.pidfile = Some(p);
        }
        Ok(())
    }

    /// `--monitor [chardev=]ID[,mode=control][,pretty=on]`.
    fn add_monitor(&mut self, s: &str) -> Result<(), StartError> {
        let mut kv = KeyVal::parse("--monitor", s, Some("chardev"))?;
        let id = kv.take_required("chardev")?;
        let log = self.state.borrow().chardev_table().log_of(&id);
        let _ = kv.take_choice("mode", &["control"])?;
        let pretty = kv.take_bool("pretty", false)?;
        kv.finish()?;
        let dev = self
            .state
            .borrow_mut()
            .chardevs()
            .take_for_monitor(&id)
            .ok_or(StartError::NoChardev(id))?;
        let session = crate::qmp::Session::new(None, pretty, log);
        let monitor = Monitor::open(&self.ctx, &dev, None, self.state.clone(), session)
            .map_err(StartError::Monitor)?;
        self.monitors.push(monitor);
        Ok(())
    }

    /// `--chardev`: for a monitor to take, or opened once the command line is done.
    fn add_chardev(&mut self, kv: KeyVal) -> Result<(), StartError> {
        let (id, dev, log) = Chardev::from_options(kv)?;
        let chardev = |e: crate::chardev::ChardevError| StartError::Chardev(e.to_string());
        let log = crate::chardev::log::ChardevLog::open(&log).map_err(StartError::Chardev)?;
        let mut st = self.state.borrow_mut();
        st.chardevs().add(&id, dev).map_err(chardev)?;
        st.chardevs().set_log(&id, log);
        Ok(())
    }

    /// Where the NBD server listens, if it runs.
    pub fn nbd_addr(&self) -> Option<ListenAddr> {
        self.state.borrow().nbd_addr()
    }

    /// Runs the main loop until a shutdown signal or `quit`.
    pub fn run(&mut self) {
        let quit = self.state.borrow().quit_flag();
        while !quit.get() {
            self.ctx.run_once(true);
        }
    }

    /// Asks the main loop to stop (from the main thread).
    pub fn request_quit(&self) {
        self.state.borrow().quit_flag().set(true);
    }

    /// Stops as qsd does, in its order: exports go (clients disconnected, their requests
    /// finished within 5 s, BLOCK_EXPORT_DELETED each), jobs are cancelled, writable nodes
    /// flushed (at most 10 s), then monitors send what they hold (the reply to `quit`
    /// last) and close; IoThreads are joined and sockets and the pidfile removed. False
    /// when it had to stop without finishing (requests stuck in storage that does not
    /// answer, or a second signal): the caller should exit at once.
    pub fn shutdown(&mut self) -> bool {
        // The signal that started the stop is counted already; another one cuts it short.
        let seen = self.signals_seen.count.get().min(1);
        let removals = self.state.borrow_mut().stop_serving();
        // Each export wakes its removal task when its requests have finished.
        let drained = self.wait_bounded(removals, DRAIN_LIMIT, seen);
        if drained == Waited::TimedOut {
            tracing::warn!("exports still had requests in flight after 5 s; flushing anyway");
        }
        let mut clean = drained == Waited::Done;
        if drained != Waited::Signalled {
            clean &= self.cancel_jobs(seen);
            clean &= self.flush_nodes(seen);
        }
        self.close_monitors(seen);
        if clean {
            let threads = self.state.borrow_mut().take_iothreads();
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

    /// Cancels every job and waits for them to go (bounded); false if they did not.
    fn cancel_jobs(&self, seen: u32) -> bool {
        let jobs = self.state.borrow().jobs().clone();
        let cancelled = stord_aio::spawn(async move { jobs.cancel_all().await });
        match self.wait_bounded(vec![cancelled], DRAIN_LIMIT, seen) {
            Waited::Done => true,
            Waited::TimedOut => {
                tracing::warn!("jobs were still running 5 s after their cancellation");
                false
            }
            Waited::Signalled => false,
        }
    }

    /// Closes every writable node (caches and bitmaps written back, flushed), bounded;
    /// false if that did not finish.
    fn flush_nodes(&self, seen: u32) -> bool {
        let flushes = self.state.borrow().close_writable_nodes();
        match self.wait_bounded(flushes, FLUSH_LIMIT, seen) {
            Waited::Done => true,
            Waited::TimedOut => {
                tracing::error!(
                    "writable nodes were not flushed within {} s (storage not answering); \
                     stopping without them",
                    FLUSH_LIMIT.as_secs()
                );
                false
            }
            Waited::Signalled => false,
        }
    }

    /// Lets monitors send what they hold, the reply to `quit` last (bounded), and closes
    /// them.
    fn close_monitors(&mut self, seen: u32) {
        let events = self.state.borrow().events().clone();
        events.stopped();
        let flushed = stord_aio::spawn(async move { events.all_flushed().await });
        self.wait_bounded(vec![flushed], MONITOR_FLUSH_LIMIT, seen);
        for m in std::mem::take(&mut self.monitors) {
            m.stop();
        }
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
                    return Poll::Ready(Waited::Done);
                }
                if signals.count.get() > seen {
                    return Poll::Ready(Waited::Signalled);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Waited::TimedOut);
                }
                signals.waker.set(Some(cx.waker().clone()));
                Poll::Pending
            })
            .await
        })
    }
}

/// The repository's root (for the built-in default's data folder).
pub fn repo_root() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    p.canonicalize().unwrap_or(p)
}

/// Where the built-in default keeps its image and socket: `STORD_DATA_DIR` (tests set
/// it), else `data/` in the source tree when the binary runs from it (`cargo run`), else
/// `data/` in the current directory (an installed binary, whose build tree is elsewhere).
pub fn default_data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STORD_DATA_DIR") {
        return PathBuf::from(dir);
    }
    let root = repo_root();
    let in_tree = std::env::current_exe()
        .and_then(|exe| exe.canonicalize())
        .is_ok_and(|exe| exe.starts_with(&root));
    if in_tree {
        return root.join("data");
    }
    std::env::current_dir().unwrap_or_default().join("data")
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
