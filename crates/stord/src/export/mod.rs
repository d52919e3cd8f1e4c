//! Exports: how block nodes reach clients. One folder per export type, each implementing
//! [`Export`] and registered once in [`types::EXPORT_TYPES`]; the daemon keeps one table of
//! `Box<dyn Export>` and knows no protocol by name. `virtio_blk/` is no type of its own:
//! it is the device the two virtio transports (`vhost_user_blk/`, `vduse_blk/`) serve.
//!
//! Life cycle: a type's constructor parses its `--export` / `block-export-add` options
//! (the daemon has checked that the id is free) and starts serving. Removal is two steps so
//! the main loop never blocks in it: [`Export::begin_stop`] stops accepting and disconnects
//! clients at once, then [`Export::poll_drained`] completes when the last request has
//! finished, after which the daemon sends BLOCK_EXPORT_DELETED and drops the export.

pub mod budget;
pub mod fuse;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz_loop;
pub mod nbd;
pub mod types;
pub mod vduse_blk;
pub mod vhost_user_blk;
pub mod virtio_blk;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use stord_aio::{IoThread, Remote};

use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;
use crate::cli::keyval::{KeyVal, OptionError};
use crate::cli::Help;

/// One running export, whatever its protocol.
pub trait Export {
    /// The block-export id.
    fn id(&self) -> &str;
    /// The export type as on the command line (`nbd`, `fuse`, `vhost-user-blk`).
    fn kind(&self) -> &'static str;
    /// The link to the node served (a snapshot or a pivot points it elsewhere).
    fn link(&self) -> &Arc<NodeLink>;
    /// The node served now.
    fn node(&self) -> Arc<BlockNode> {
        self.link().current()
    }
    /// Whether clients may write (the node must stay writable).
    fn writable(&self) -> bool;
    /// Whether it serves on the IoThread `thread` (which then cannot be deleted).
    fn runs_on(&self, thread: &Remote) -> bool;
    /// A resource only one export may hold (a mountpoint, a socket path), if any.
    fn claim(&self) -> Option<String> {
        None
    }
    /// Clients are connected: a soft `block-export-del` is refused.
    fn in_use(&self) -> bool;
    /// Removal has begun.
    fn shutting_down(&self) -> bool;
    /// Fields of its own for query-block-exports (beside type, id, node-name).
    fn describe(&self, _out: &mut serde_json::Map<String, serde_json::Value>) {}
    /// Stops accepting clients and disconnects those connected; does not wait.
    fn begin_stop(&mut self);
    /// Ready once every request started before `begin_stop` has finished.
    fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()>;
    /// Logs what it served (at shutdown, through tracing).
    fn log_statistics(&self) {}
    /// A node was resized (maybe its node, maybe one under it): an export whose clients
    /// can be told of a new size tells them (QEMU's BlockDevOps resize_cb).
    fn resized(&self) {}
}

/// Why an export could not be added: the export layer's error. The texts name the option
/// list (`--export`, `block-export-add`) they come from.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("Cannot find device='{name}' nor node-name='{name}'")]
    NodeNotFound { what: String, name: String },
    #[error("{what}: iothread \"{id}\" not found")]
    IoThreadNotFound { what: String, id: String },
    #[error("{what}: '{resource}' is already used by another export")]
    Claimed { what: String, resource: String },
    /// The export type's own checks, and what the system refused while starting it.
    #[error("{0}")]
    Invalid(String),
}

impl From<String> for ExportError {
    fn from(s: String) -> Self {
        ExportError::Invalid(s)
    }
}

/// A protocol server exports are offered through (the NBD server): exports of its kind
/// register with it when they are created and go when it stops.
pub trait ExportServer: std::any::Any {
    /// The export type it serves (`nbd`).
    fn kind(&self) -> &'static str;
    /// Stops listening (connections already served go on until their exports go).
    fn stop(&mut self);
    /// For [`ExportEnv::server`].
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Running protocol servers, by the export type they serve.
pub type ExportServers = BTreeMap<&'static str, Box<dyn ExportServer>>;

/// What constructors may look at: the graph, the IoThreads and protocol servers.
pub struct ExportEnv<'a> {
    /// Block nodes by name.
    pub nodes: &'a BTreeMap<String, Arc<BlockNode>>,
    /// IoThreads by id.
    pub iothreads: &'a BTreeMap<String, IoThread>,
    /// The protocol servers that run.
    pub servers: &'a ExportServers,
    /// Resources other exports hold ([`Export::claim`]).
    pub claimed: Vec<String>,
}

impl ExportEnv<'_> {
    /// The running server for export type `kind`, as its own type.
    pub fn server<T: ExportServer>(&self, kind: &str) -> Option<&T> {
        self.servers.get(kind)?.as_any().downcast_ref()
    }

    /// The node named `name`.
    pub fn node(&self, what: &str, name: &str) -> Result<Arc<BlockNode>, ExportError> {
        self.nodes
            .get(name)
            .cloned()
            .ok_or_else(|| ExportError::NodeNotFound {
                what: what.into(),
                name: name.into(),
            })
    }

    /// The Remotes of the named IoThreads.
    pub fn remotes(&self, what: &str, names: &[String]) -> Result<Vec<Remote>, ExportError> {
        names
            .iter()
            .map(|t| {
                self.iothreads
                    .get(t)
                    .map(|i| i.remote().clone())
                    .ok_or_else(|| ExportError::IoThreadNotFound {
                        what: what.into(),
                        id: t.clone(),
                    })
            })
            .collect()
    }

    /// Fails if another export holds `resource`.
    pub fn check_claim(&self, what: &str, resource: &str) -> Result<(), ExportError> {
        if self.claimed.iter().any(|c| c == resource) {
            return Err(ExportError::Claimed {
                what: what.into(),
                resource: resource.into(),
            });
        }
        Ok(())
    }
}

/// Builds and starts an export from its options (`type` already taken).
pub type ExportConstructor = fn(&ExportEnv<'_>, KeyVal) -> Result<Box<dyn Export>, ExportError>;

/// One export type.
pub struct ExportType {
    /// `type=`.
    pub name: &'static str,
    pub create: ExportConstructor,
    /// It may serve an inactive node (`allow-inactive=on`; QEMU's supports_inactive).
    pub supports_inactive: bool,
    /// Its options beside `type`, `id` and `node-name`, for `--help` and docs/usage.md.
    pub help: Help,
}

/// Waits until `drained` is ready, for at most `limit` (None: no limit); true if it was.
/// On a loop thread the loop keeps running meanwhile (a request being waited for may
/// complete there); off any loop the thread parks until the drain's wake-up. For the
/// exports' `Drop`, which must not return while requests still use what it frees; the
/// daemon itself waits through [`Export::poll_drained`] in a task.
pub(crate) fn wait_drained(
    limit: Option<Duration>,
    mut drained: impl FnMut(&mut Context<'_>) -> Poll<()> + 'static,
) -> bool {
    let deadline = limit.map(|l| Instant::now() + l);
    if stord_aio::with_current_context(|_| ()).is_some() {
        let wait = async move {
            let mut timer = limit.map(|l| Box::pin(stord_aio::sleep(l)));
            std::future::poll_fn(|cx| {
                if drained(cx).is_ready() {
                    return Poll::Ready(true);
                }
                match timer.as_mut().map(|t| t.as_mut().poll(cx)) {
                    Some(Poll::Ready(())) => Poll::Ready(false),
                    _ => Poll::Pending,
                }
            })
            .await
        };
        return stord_aio::with_current_context(|ctx| ctx.block_on(wait)).unwrap_or(false);
    }
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if drained(&mut cx).is_ready() {
            return true;
        }
        match deadline {
            None => std::thread::park(),
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return false;
                }
                std::thread::park_timeout(d - now);
            }
        }
    }
}

/// A drain wake-up: whoever finishes the last request calls [`wake`](Self::wake) (from
/// any thread); the daemon's removal task registers its waker and re-checks. Until a task
/// waits, `wake` is one atomic load: it runs whenever a count reaches zero, which for a
/// QD1 client is after every request.
#[derive(Default)]
pub struct DrainSignal {
    waker: Mutex<Option<Waker>>,
    armed: AtomicBool,
}

impl DrainSignal {
    /// Ready if `drained()` holds; else registers the task's waker and checks again, so a
    /// wake between the first check and the registration is not lost (the waker side
    /// updates its count before it looks at `armed`; both sides are SeqCst).
    pub fn poll(&self, cx: &mut Context<'_>, drained: impl Fn() -> bool) -> Poll<()> {
        if drained() {
            return Poll::Ready(());
        }
        *self.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        self.armed.store(true, Ordering::SeqCst);
        if drained() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Wakes the task waiting for the drain, if any.
    pub fn wake(&self) {
        if !self.armed.load(Ordering::SeqCst) {
            return;
        }
        if let Some(w) = self.waker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.wake();
        }
    }
}
