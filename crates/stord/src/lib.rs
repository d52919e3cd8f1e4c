//! stord: block nodes exported over NBD, FUSE and vhost-user-blk, served by `stord-aio`
//! IoThreads, driven by a qemu-storage-daemon compatible command line.
//!
//! - [`block`]: the `BlockDriver` trait, `BlockNode`, and the drivers: `null` and `file`
//!   (protocol nodes), `raw` (a format node over a child).
//! - [`export`]: one folder per export protocol.
//! - [`cli`]: qsd's option syntax.
//! - [`qmp`]: the QMP monitor.
//! - [`accept`]: listening sockets that survive descriptor exhaustion.
//! - [`log`]: the tracing subscriber and rate-limited events.
//! - [`secret`]: `--object secret`.
//! - [`tls`]: TLS credentials and sessions for the NBD server.
//! - [`daemon`]: wiring: iothreads, nodes, exports, the main loop and the default job.

pub mod accept;
pub mod block;
pub mod cli;
pub mod daemon;
pub mod export;
pub mod log;
pub mod qmp;
pub mod secret;
pub mod sys;
pub mod tls;
