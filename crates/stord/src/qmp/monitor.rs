//! Where a monitor's connections come from, as QEMU attaches a monitor to a chardev: a
//! listening socket (unix, created 0600, or TCP) serves every client that connects; a
//! socket the daemon connected to at start, or its standard input and output, is one
//! connection for as long as the peer keeps it. Every connection is served the same way
//! ([`super::serve`]), on the main loop: standard input and output reach it through a
//! socket pair, copied by two threads (a pipe or a terminal is not a socket the loop's
//! receive and send work on, and blocking reads of stdin must not hold the loop).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use stord_aio::AioContext;

use super::{serve, Session};
use crate::accept::Acceptor;
use crate::chardev::{Chardev, SocketAddr};
use crate::daemon::monitor_object::{MonitorSettings, RuntimeMonitor};
use crate::daemon::SharedState;

/// How long the stop waits for standard output to take the last replies.
const STDOUT_FLUSH_LIMIT: Duration = Duration::from_millis(500);

/// A QMP monitor on one chardev.
pub struct Monitor {
    kind: Kind,
    session: std::rc::Rc<Session>,
}

enum Kind {
    Listening {
        /// A unix socket's path, removed at the stop.
        path: Option<PathBuf>,
        _acceptor: Acceptor,
    },
    /// A connection made at start (its task ends with it).
    Connected,
    /// Standard input and output: the monitor's end of the socket pair (shut at the stop,
    /// so the copy to stdout ends once it has everything), told when that copy has ended.
    Stdio {
        ours: UnixStream,
        stdout_done: mpsc::Receiver<()>,
    },
}

impl Monitor {
    /// Opens the monitor on `dev`: listens, connects, or takes over stdio; `fd` is the
    /// chardev's socket when it is open already (a monitor made at run time serves it).
    pub fn open(
        ctx: &AioContext,
        dev: &Chardev,
        fd: Option<OwnedFd>,
        state: SharedState,
        session: std::rc::Rc<Session>,
    ) -> io::Result<Monitor> {
        let s = session.clone();
        let kind = match (dev, fd) {
            (Chardev::Listen(_), Some(fd)) => accept_on(ctx, fd, None, state, s)?,
            (Chardev::Connect(_), Some(fd)) => {
                stord_aio::spawn_detached(serve(fd, state, s));
                Kind::Connected
            }
            (Chardev::Listen(addr), None) => listen(ctx, addr, state, s)?,
            (Chardev::Connect(addr), None) => {
                let conn = connect(addr).map_err(|e| {
                    let to = match addr {
                        SocketAddr::Unix(p) => p.display().to_string(),
                        SocketAddr::Inet { host, port } => format!("{host}:{port}"),
                    };
                    io::Error::new(e.kind(), format!("Failed to connect to '{to}': {e}"))
                })?;
                stord_aio::spawn_detached(serve(conn, state, s));
                Kind::Connected
            }
            (Chardev::Stdio, _) => {
                let (ours, bridge) = UnixStream::pair()?;
                ours.set_nonblocking(true)?;
                let stdout_done = bridge_stdio(bridge)?;
                let served = ours.try_clone()?;
                stord_aio::spawn_detached(serve(served.into(), state, s));
                Kind::Stdio { ours, stdout_done }
            }
            (Chardev::Null | Chardev::Ringbuf { .. } | Chardev::File { .. }, _) => {
                return Err(io::Error::other(format!(
                    "a monitor needs a socket or stdio chardev in stord, not {}",
                    dev.type_name()
                )))
            }
        };
        Ok(Monitor { kind, session })
    }

    /// Stops listening (removing a unix socket it bound) or waits, bounded, for standard
    /// output to take what was sent.
    pub fn stop(self) {
        match self.kind {
            Kind::Listening { path, _acceptor } => {
                drop(_acceptor);
                if let Some(p) = path {
                    let _ = std::fs::remove_file(p);
                }
            }
            Kind::Connected => {}
            Kind::Stdio { ours, stdout_done } => {
                let _ = ours.shutdown(Shutdown::Write);
                let _ = stdout_done.recv_timeout(STDOUT_FLUSH_LIMIT);
            }
        }
    }
}

/// Serves every client that connects to the listening socket `fd` (`path`: a unix
/// socket's, removed when the monitor stops).
fn accept_on(
    ctx: &AioContext,
    fd: OwnedFd,
    path: Option<PathBuf>,
    state: SharedState,
    session: std::rc::Rc<Session>,
) -> io::Result<Kind> {
    crate::sys::set_nonblocking(std::os::fd::AsRawFd::as_raw_fd(&fd))?;
    let acceptor = Acceptor::start(ctx, "qmp monitor", fd, move |conn| {
        stord_aio::spawn_detached(serve(conn, state.clone(), session.clone()));
    })?;
    Ok(Kind::Listening {
        path,
        _acceptor: acceptor,
    })
}

fn listen(
    ctx: &AioContext,
    addr: &SocketAddr,
    state: SharedState,
    session: std::rc::Rc<Session>,
) -> io::Result<Kind> {
    let (fd, path): (OwnedFd, _) = match addr {
        SocketAddr::Unix(path) => {
            if path.exists() {
                let _ = std::fs::remove_file(path);
            }
            let l = UnixListener::bind(path)?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
            l.set_nonblocking(true)?;
            (l.into(), Some(path.clone()))
        }
        SocketAddr::Inet { host, port } => {
            let l = TcpListener::bind((host.as_str(), *port))?;
            l.set_nonblocking(true)?;
            (l.into(), None)
        }
    };
    accept_on(ctx, fd, path, state, session)
}

fn connect(addr: &SocketAddr) -> io::Result<OwnedFd> {
    Ok(match addr {
        SocketAddr::Unix(path) => {
            let s = UnixStream::connect(path)?;
            s.set_nonblocking(true)?;
            s.into()
        }
        SocketAddr::Inet { host, port } => {
            let s = TcpStream::connect((host.as_str(), *port))?;
            s.set_nonblocking(true)?;
            s.into()
        }
    })
}

/// Copies stdin into `bridge` and `bridge` to stdout until the monitor's end closes. The
/// end of stdin ends only the copy into the monitor: as qsd's stdio monitor, it goes on
/// answering what it was sent and sending events (a script's heredoc ending in `quit`
/// still reads the reply, after the events of the stop).
fn bridge_stdio(bridge: UnixStream) -> io::Result<mpsc::Receiver<()>> {
    let mut to_monitor = bridge.try_clone()?;
    std::thread::Builder::new()
        .name("qmp-stdin".into())
        .spawn(move || {
            let mut buf = [0u8; 64 << 10];
            let mut stdin = io::stdin().lock();
            while let Ok(n @ 1..) = stdin.read(&mut buf) {
                if to_monitor.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        })?;
    let (done, stdout_done) = mpsc::channel();
    let mut from_monitor = bridge;
    std::thread::Builder::new()
        .name("qmp-stdout".into())
        .spawn(move || {
            let mut buf = [0u8; 64 << 10];
            let mut stdout = io::stdout().lock();
            while let Ok(n @ 1..) = from_monitor.read(&mut buf) {
                if stdout
                    .write_all(&buf[..n])
                    .and_then(|()| stdout.flush())
                    .is_err()
                {
                    break;
                }
            }
            let _ = done.send(());
        })?;
    Ok(stdout_done)
}

/// A `monitor-qmp` object's monitor (what the daemon's
/// [`crate::daemon::monitor_object::OpenMonitor`] opens).
pub fn open_object(
    state: &SharedState,
    dev: &Chardev,
    fd: Option<OwnedFd>,
    settings: &MonitorSettings,
) -> io::Result<Box<dyn RuntimeMonitor>> {
    // Its chardev's table is borrowed by the caller: the log comes with the settings.
    let log = settings.log.clone();
    let session = Session::new(Some(settings.id.clone()), settings.pretty, log);
    let opened =
        stord_aio::with_current_context(|ctx| Monitor::open(ctx, dev, fd, state.clone(), session));
    let monitor = opened.ok_or_else(|| io::Error::other("not on the main loop"))??;
    Ok(Box::new(monitor))
}

impl RuntimeMonitor for Monitor {
    /// Stops accepting, then disconnects its clients.
    fn stop(self: Box<Self>) {
        let session = self.session.clone();
        Monitor::stop(*self);
        session.disconnect_all();
    }
}
