//! A vhost-user-blk export's frontends: a connection accepted on the listening socket is
//! served on a control thread of its own, which reads vhost-user messages (blocking, they
//! are rare) through the rust-vmm `vhost` crate's request handler ([`BlkBackend`]). Like
//! qsd, one frontend at a time; one more may wait for its turn.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use stord_aio::{Interest, Remote};
use vhost::vhost_user::message::FrontendReq;
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

use super::backend::BlkBackend;
use super::config_channel::ConfigChannel;
use crate::export::virtio_blk::device::BlkDevice;
use crate::export::virtio_blk::guest_fault::GuestFault;

/// The connection being served.
struct Connection {
    stream: UnixStream,
    thread: JoinHandle<()>,
}

/// The frontends of one export. vhost-user serves one frontend at a time (as qsd); one
/// more may wait for it to leave (a frontend reconnecting lands here while its old
/// connection winds down), and any beyond that is refused at once: closed, with a logged
/// reason, instead of waiting unanswered in the listen backlog.
pub struct Frontends {
    dev: Arc<BlkDevice>,
    /// The backend-request channel of the frontend served.
    pub channel: Arc<ConfigChannel>,
    remotes: Vec<Remote>,
    /// The frontend served (with its control thread), until its thread has finished.
    conns: Mutex<Vec<Connection>>,
    /// The frontend waiting for its turn.
    waiting: Mutex<Option<OwnedFd>>,
    /// Refusals are logged at most once a second.
    refused_log: Mutex<crate::log::RateLimit>,
}

impl Frontends {
    /// None yet, for device `dev` whose queues run on `remotes`.
    pub fn new(dev: Arc<BlkDevice>, remotes: Vec<Remote>) -> Self {
        Self {
            dev,
            channel: Arc::default(),
            remotes,
            conns: Mutex::default(),
            waiting: Mutex::default(),
            refused_log: Mutex::new(crate::log::RateLimit::new(Duration::from_secs(1))),
        }
    }

    /// Whether a frontend is connected.
    pub fn connected(&self) -> bool {
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|c| !c.thread.is_finished())
    }

    /// Closes the waiting frontend unserved and disconnects the one served; its queues
    /// stop on their own.
    pub fn disconnect(&self) {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Waits for the control threads (which have ended or are ending).
    pub fn join(&self) {
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|e| e.into_inner()));
        for c in conns {
            let _ = c.thread.join();
        }
    }
}

/// A frontend connected: served at once if no other is, else it waits for its turn (one
/// at most) or is refused.
pub fn accept(conn: OwnedFd, f: &Arc<Frontends>) {
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
    let (dev, channel, remotes) = (f.dev.clone(), f.channel.clone(), f.remotes.clone());
    dev.serving
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let thread = std::thread::Builder::new()
        .name(format!("vhost-user-{}", dev.id))
        .spawn(move || {
            serve(ctl, dev.clone(), channel, remotes);
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
pub fn serve(
    stream: UnixStream,
    dev: Arc<BlkDevice>,
    channel: Arc<ConfigChannel>,
    remotes: Vec<Remote>,
) {
    let fault = match stream.try_clone() {
        Ok(s) => Arc::new(GuestFault::new(s)),
        Err(e) => {
            tracing::warn!("vhost-user-blk {}: cannot serve a frontend: {e}", dev.id);
            return;
        }
    };
    let backend = Arc::new(Mutex::new(BlkBackend::new(dev.clone(), remotes, fault)));
    // The handler owns the socket, and the descriptor stays valid as long as it lives.
    let control_fd = stream.as_raw_fd();
    let mut handler = BackendReqHandler::from_stream(stream, backend.clone());
    // A frontend that sends refused requests in a loop gets one log line a second.
    let refused_log = crate::log::RateLimit::new(Duration::from_secs(1));
    loop {
        let sock = backend_channel_in_next_message(control_fd);
        match handler.handle_request() {
            Ok(()) => {
                if let Some(sock) = sock {
                    channel.set(&dev, Some(sock));
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
    channel.set(&dev, None);
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
