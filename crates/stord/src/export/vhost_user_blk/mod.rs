//! The vhost-user-blk export: a QEMU/KVM guest's virtio-blk disk, served from shared guest
//! memory.
//!
//! The listening socket is watched by the main loop (through an
//! [`Acceptor`](crate::accept::Acceptor)); the connection gets a control thread that reads
//! vhost-user messages (blocking, they are rare) through the rust-vmm `vhost` crate's
//! request handler ([`backend`]). The data path never touches that thread: each
//! virtqueue runs on an IoThread of the export's list ([`vring`]): a kick fd handler plus a
//! poll handler peeking at the avail index, requests as tasks ([`request`]), completions
//! batched per loop iteration. Like qsd, one frontend at a time: while one is connected the
//! export stops accepting, so a second waits in the listen backlog (costing the daemon
//! nothing) until the first has gone.

mod backend;
pub(crate) mod device;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;
pub(crate) mod inflight;
mod request;
pub(crate) mod vring;

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use stord_aio::{Interest, Remote};
use vhost::vhost_user::message::FrontendReq;
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

use crate::accept::Acceptor;
use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;
use crate::cli::keyval::KeyVal;
use crate::export::{Export, ExportEnv, ExportError};
use std::task::{Context, Poll};

pub use device::BlkDevice;

/// Options of `--export type=vhost-user-blk`.
pub struct VhostUserBlkOptions {
    pub id: String,
    pub node_name: String,
    pub path: PathBuf,
    pub writable: bool,
    /// `writethrough=on`: the device starts with its write cache off (the guest may turn
    /// it on, as virtio's WCE allows).
    pub writethrough: bool,
    pub num_queues: u16,
    pub logical_block_size: u32,
    pub iothreads: Vec<String>,
}

impl VhostUserBlkOptions {
    /// Parses the options after `type=vhost-user-blk` (the caller took `type`).
    pub fn from_opts(kv: &mut KeyVal) -> Result<Self, ExportError> {
        let id = kv.take_required("id")?;
        let node_name = kv.take_required("node-name")?;
        let what = kv.what.clone();
        match kv.take("addr.type").as_deref() {
            Some("unix") => {}
            Some(t) => {
                return Err(format!("{what}: addr.type '{t}' not supported (use unix)").into())
            }
            None => return Err(format!("{what}: parameter 'addr.type' is missing").into()),
        }
        let path = PathBuf::from(kv.take_required("addr.path")?);
        let writable = kv.take_bool("writable", false)?;
        let writethrough = kv.take_bool("writethrough", false)?;
        let _ = kv.take_bool("fixed-iothread", false)?;
        let num_queues = kv.take_u64_in("num-queues", false, 1..=64)?.unwrap_or(1) as u16;
        let logical_block_size = match kv.take_u64("logical-block-size", true)? {
            None => 512,
            Some(n @ (512 | 1024 | 2048 | 4096)) => n as u32,
            Some(n) => {
                return Err(format!(
                    "{what}: logical-block-size must be 512, 1024, 2048 or 4096, got {n}"
                )
                .into())
            }
        };
        let iothreads = kv.take_list("iothread");
        Ok(Self {
            id,
            node_name,
            path,
            writable,
            writethrough,
            num_queues,
            logical_block_size,
            iothreads,
        })
    }
}

/// The connection being served.
struct Connection {
    stream: UnixStream,
    thread: JoinHandle<()>,
}

/// The frontends of one export. vhost-user serves one frontend at a time (as qsd); one
/// more may wait for it to leave (a frontend reconnecting lands here while its old
/// connection winds down), and any beyond that is refused at once: closed, with a logged
/// reason, instead of waiting unanswered in the listen backlog.
struct Frontends {
    dev: Arc<BlkDevice>,
    remotes: Vec<Remote>,
    /// The frontend served (with its control thread), until its thread has finished.
    conns: Mutex<Vec<Connection>>,
    /// The frontend waiting for its turn.
    waiting: Mutex<Option<OwnedFd>>,
    /// Refusals are logged at most once a second.
    refused_log: Mutex<crate::log::RateLimit>,
}

/// A listening vhost-user-blk export.
pub struct VhostUserBlkExport {
    pub id: String,
    pub path: PathBuf,
    /// Guests may write.
    writable: bool,
    dev: Arc<BlkDevice>,
    acceptor: Option<Acceptor>,
    frontends: Arc<Frontends>,
    /// Where the queues run.
    remotes: Vec<Remote>,
    stopping: bool,
}

impl VhostUserBlkExport {
    /// Binds the socket and starts accepting on the current (main) loop. `remotes` are the
    /// IoThreads that serve the queues (queue i on remotes[i % len]); empty: the main loop.
    pub fn start(
        opts: VhostUserBlkOptions,
        node: Arc<BlockNode>,
        mut remotes: Vec<Remote>,
    ) -> Result<Self, String> {
        let what = format!("vhost-user-blk export '{}'", opts.id);
        if opts.writable && node.is_read_only() {
            return Err(format!("{what}: node '{}' is read-only", node.name));
        }
        if !node
            .size()
            .is_multiple_of(u64::from(opts.logical_block_size))
        {
            return Err(format!(
                "{what}: size {} is not a multiple of the logical block size {}",
                node.size(),
                opts.logical_block_size
            ));
        }
        if remotes.is_empty() {
            remotes
                .push(stord_aio::current_remote().ok_or_else(|| format!("{what}: no event loop"))?);
        }
        if opts.path.exists() {
            let _ = std::fs::remove_file(&opts.path);
        }
        let listener = UnixListener::bind(&opts.path)
            .map_err(|e| format!("{what}: cannot listen on {}: {e}", opts.path.display()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("{what}: {e}"))?;
        let dev = Arc::new(BlkDevice::new(
            opts.id.clone(),
            node,
            opts.writable,
            opts.logical_block_size,
            opts.num_queues,
        ));
        dev.writeback
            .store(!opts.writethrough, std::sync::atomic::Ordering::Relaxed);
        let frontends = Arc::new(Frontends {
            dev: dev.clone(),
            remotes: remotes.clone(),
            conns: Mutex::default(),
            waiting: Mutex::default(),
            refused_log: Mutex::new(crate::log::RateLimit::new(Duration::from_secs(1))),
        });
        let f2 = frontends.clone();
        let acceptor = stord_aio::with_current_context(|ctx| {
            Acceptor::start(ctx, what.clone(), listener.into(), move |conn| {
                accept(conn, &f2)
            })
        })
        .ok_or_else(|| format!("{what}: no event loop"))?
        .map_err(|e| format!("{what}: {e}"))?;
        Ok(Self {
            id: opts.id,
            path: opts.path,
            writable: opts.writable,
            dev,
            acceptor: Some(acceptor),
            frontends,
            remotes,
            stopping: false,
        })
    }

    /// Requests served per queue.
    pub fn queue_requests(&self) -> Vec<u64> {
        self.dev.queue_requests()
    }

    /// Whether a frontend is connected.
    pub fn connected(&self) -> bool {
        self.frontends
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|c| !c.thread.is_finished())
    }

    /// Stops listening and disconnects the frontend; its queues stop on their own.
    fn halt(&mut self) {
        if std::mem::replace(&mut self.stopping, true) {
            return;
        }
        self.acceptor.take();
        let _ = std::fs::remove_file(&self.path);
        // A waiting frontend is closed unserved.
        self.frontends
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        for c in self
            .frontends
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Stops listening, disconnects the frontend and waits for its queues to drain. Called
    /// on the main loop, which it keeps running meanwhile (a queue may live there). For
    /// drop; the daemon uses [`Export::begin_stop`] and [`Export::poll_drained`].
    pub fn stop(&mut self) {
        self.halt();
        // Each control thread counts itself out of `serving` and wakes the drain as it
        // ends; then joining it does not block.
        let dev = self.dev.clone();
        crate::export::wait_drained(None, move |cx| {
            dev.drain.poll(cx, || {
                dev.serving.load(std::sync::atomic::Ordering::SeqCst) == 0
            })
        });
        let conns = std::mem::take(
            &mut *self
                .frontends
                .conns
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for c in conns {
            let _ = c.thread.join();
        }
    }
}

/// `--export type=vhost-user-blk` / `block-export-add`.
pub fn create(env: &ExportEnv<'_>, mut kv: KeyVal) -> Result<Box<dyn Export>, ExportError> {
    let opts = VhostUserBlkOptions::from_opts(&mut kv)?;
    let what = kv.what.clone();
    kv.finish()?;
    let node = env.node(&what, &opts.node_name)?;
    env.check_claim(&what, &opts.path.display().to_string())?;
    let remotes = env.remotes(&what, &opts.iothreads)?;
    Ok(Box::new(VhostUserBlkExport::start(opts, node, remotes)?))
}

impl Export for VhostUserBlkExport {
    fn id(&self) -> &str {
        &self.id
    }
    fn kind(&self) -> &'static str {
        "vhost-user-blk"
    }
    fn writable(&self) -> bool {
        self.writable
    }
    fn link(&self) -> &Arc<NodeLink> {
        &self.dev.link
    }
    fn runs_on(&self, thread: &Remote) -> bool {
        self.remotes
            .iter()
            .any(|r| r.thread_id() == thread.thread_id())
    }
    fn claim(&self) -> Option<String> {
        Some(self.path.display().to_string())
    }
    fn in_use(&self) -> bool {
        self.connected()
    }
    fn shutting_down(&self) -> bool {
        self.stopping
    }
    fn describe(&self, out: &mut serde_json::Map<String, serde_json::Value>) {
        out.insert("x-queue-requests".into(), self.queue_requests().into());
    }
    fn begin_stop(&mut self) {
        self.halt();
    }
    fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.dev.poll_drained(cx)
    }
    fn resized(&self) {
        self.dev.announce_capacity();
    }
    fn log_statistics(&self) {
        tracing::info!(
            "vhost-user-blk export {}: requests per queue {:?}",
            self.id,
            self.queue_requests()
        );
    }
}

impl Drop for VhostUserBlkExport {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A frontend connected: served at once if no other is, else it waits for its turn (one
/// at most) or is refused.
fn accept(conn: OwnedFd, f: &Arc<Frontends>) {
    let busy = !f.conns.lock().unwrap_or_else(|e| e.into_inner()).is_empty();
    if !busy {
        return serve_frontend(conn, f);
    }
    let mut waiting = f.waiting.lock().unwrap_or_else(|e| e.into_inner());
    if waiting.is_none() {
        tracing::info!(
            "vhost-user-blk {}: a frontend waits until the connected one leaves (one at a time)",
            f.dev.id
        );
        *waiting = Some(conn);
        return;
    }
    drop(waiting);
    drop(conn);
    if let Some(n) = f
        .refused_log
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .allow()
    {
        tracing::warn!(
            "vhost-user-blk {}: frontend refused: one is served and another waits \
             ({n} more refused since the last report)",
            f.dev.id
        );
    }
}

/// Serves a frontend on a control thread; when that thread has finished (its end of a
/// socket pair closes; the main loop waits for that as for any other readiness, no
/// polling), the waiting frontend, if any, gets its turn.
fn serve_frontend(conn: OwnedFd, f: &Arc<Frontends>) {
    let stream = UnixStream::from(conn);
    let setup = (|| {
        let ctl = stream.try_clone()?;
        stream.set_nonblocking(false)?;
        let (done_rx, done_tx) = UnixStream::pair()?;
        done_rx.set_nonblocking(true)?;
        Ok::<_, std::io::Error>((ctl, done_rx, done_tx))
    })();
    let (ctl, done_rx, done_tx) = match setup {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(
                "vhost-user-blk {}: cannot set up the connection: {e}",
                f.dev.id
            );
            return;
        }
    };
    let (dev, remotes) = (f.dev.clone(), f.remotes.clone());
    dev.serving
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let thread = std::thread::Builder::new()
        .name(format!("vhost-user-{}", dev.id))
        .spawn(move || {
            serve(ctl, dev.clone(), remotes);
            drop(done_tx);
            // Counted down before the wake, so a removal that wakes sees it (the thread
            // itself is finished only a little later).
            dev.serving
                .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            dev.drain.wake();
        });
    match thread {
        Ok(thread) => {
            let fd = stream.as_raw_fd();
            f.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Connection { stream, thread });
            let f = f.clone();
            stord_aio::spawn(async move {
                let _ = stord_aio::op::poll_add(done_rx.as_raw_fd(), Interest::READABLE).await;
                drop(done_rx);
                // The connection is over: its socket closes now (the thread itself only
                // has its counters left to update).
                f.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|c| c.stream.as_raw_fd() != fd);
                let next = f.waiting.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(next) = next {
                    serve_frontend(next, &f);
                }
            });
        }
        Err(e) => {
            f.dev
                .serving
                .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            tracing::error!("vhost-user-blk: cannot start a control thread: {e}")
        }
    }
}

/// The control thread: one vhost-user message at a time until the frontend goes away or
/// breaks the protocol. Rejected requests (the backend said no) keep the connection.
fn serve(stream: UnixStream, dev: Arc<BlkDevice>, remotes: Vec<Remote>) {
    let fault = match stream.try_clone() {
        Ok(s) => Arc::new(device::GuestFault::new(s)),
        Err(e) => {
            tracing::warn!("vhost-user-blk {}: cannot serve a frontend: {e}", dev.id);
            return;
        }
    };
    let backend = Arc::new(Mutex::new(backend::BlkBackend::new(
        dev.clone(),
        remotes,
        fault,
    )));
    // The handler owns the socket, and the descriptor stays valid as long as it lives.
    let control_fd = stream.as_raw_fd();
    let mut handler = BackendReqHandler::from_stream(stream, backend.clone());
    // A frontend that sends refused requests in a loop gets one log line a second.
    let refused_log = crate::log::RateLimit::new(Duration::from_secs(1));
    loop {
        let channel = backend_channel_in_next_message(control_fd);
        match handler.handle_request() {
            Ok(()) => {
                if let Some(sock) = channel {
                    dev.set_config_channel(Some(sock));
                }
            }
            Err(VuError::ReqHandlerError(e)) => {
                if let Some(n) = refused_log.allow() {
                    tracing::warn!(
                        "vhost-user-blk {}: request refused: {e} ({n} more refused since the last report)",
                        dev.id
                    );
                }
            }
            Err(VuError::Disconnected) | Err(VuError::PartialMessage) => break,
            Err(VuError::SocketBroken(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                break
            }
            Err(e) => {
                tracing::warn!("vhost-user-blk {}: closing the connection: {e}", dev.id);
                break;
            }
        }
    }
    dev.set_config_channel(None);
    backend.lock().unwrap_or_else(|e| e.into_inner()).stop_all();
}

/// The backend-request channel the next message carries, if it is `SET_BACKEND_REQ_FD`.
/// The vhost crate hands that socket only to a `Backend` that cannot send
/// `CONFIG_CHANGE_MSG`, so the message is peeked at first and its descriptor duplicated.
/// Blocks until the next message starts arriving; one more syscall per control message.
fn backend_channel_in_next_message(fd: std::os::fd::RawFd) -> Option<UnixStream> {
    let mut hdr = [0u8; 4];
    let (n, _) = crate::sys::peek_message(fd, &mut hdr, false).ok()?;
    let set_backend_req_fd: u32 = FrontendReq::SET_BACKEND_REQ_FD.into();
    if n < hdr.len() || u32::from_le_bytes(hdr) != set_backend_req_fd {
        return None;
    }
    let (_, passed) = crate::sys::peek_message(fd, &mut hdr, true).ok()?;
    Some(UnixStream::from(passed?))
}
