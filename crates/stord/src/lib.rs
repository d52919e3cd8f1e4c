//! stord: block nodes exported over NBD, FUSE and vhost-user-blk, served by `stord-aio`
//! IoThreads, driven by a qemu-storage-daemon compatible command line.
//!
//! - [`block`]: the `BlockDriver` trait, `BlockNode`, and the drivers: `null` and `file`
//!   (protocol nodes), `raw` (a format node over a child).
//! - [`export`]: one folder per export protocol.
//! - [`cli`]: qsd's option syntax.
//! - [`chardev`]: `--chardev`, the devices monitors talk through.
//! - [`qmp`]: the QMP monitor.
//! - [`accept`]: listening sockets that survive descriptor exhaustion.
//! - [`log`]: the tracing subscriber and rate-limited events.
//! - [`nbd`]: the NBD protocol both the server and the client node speak.
//! - [`secret`]: `--object secret`.
//! - [`tls`]: TLS credentials and sessions for the NBD server.
//! - [`daemon`]: the daemon's API over what it holds: objects, nodes, exports.
//! - [`events`]: QMP events, fanned out from the daemon to the monitors.
//! - [`iothread`]: the iothread object's properties, described once.
//! - [`job`]: jobs (QEMU's states, verbs and events); `blockdev-create` runs as one.
//! - [`process`]: the main loop, signals, the command line applied, the stop.
//! - [`schema`]: QAPI's types for the tables that describe their arguments.
//! - [`usage`]: `--help`, generated from the tables.
//! - [`trace`]: `--trace`, QEMU's trace event names mapped onto stord's modules.

pub mod accept;
pub mod block;
pub mod buf;
pub mod chardev;
pub mod cli;
pub mod daemon;
pub mod events;
pub mod export;
pub mod iothread;
pub mod iov;
pub mod job;
pub mod log;
pub mod metrics;
pub mod nbd_wire;
pub mod process;
pub mod qmp;
pub mod qom;
pub mod schema;
pub mod secret;
pub mod sys;
pub mod tls;
pub mod trace;
pub mod usage;
