//! stord: block nodes exported over NBD, FUSE, vhost-user-blk and VDUSE, served by
//! `stord-aio` IoThreads, driven by a qemu-storage-daemon compatible command line and QMP.
//!
//! The modules, lowest layer first; each imports only modules of the layers before it
//! (scripts/check-structure.py holds the code to this list):
//! 1. [`buf`] and [`iov`] (the buffers requests carry, and a request's data as pieces of
//!    memory, ours or a guest's), [`bytes`] (big-endian on-disk fields), [`cli`] (qsd's option syntax), [`schema`] (QAPI's types
//!    for the tables that describe their arguments), [`events`] (QMP events, fanned out
//!    to the monitors), [`version`] (the QEMU interface version stord reports, and its own).
//! 2. [`sys`] (syscall wrappers), [`iothread`] (the iothread object's properties),
//!    [`secret`] (`--object secret`), [`tls`] (credentials, `authz-simple` and sessions
//!    for either NBD endpoint), [`trace`] (`--trace`: QEMU's event names mapped onto
//!    modules).
//! 3. [`crypto`] (LUKS and the sector cipher), [`nbd_wire`] (the NBD protocol and socket
//!    I/O the server and the client driver share), [`chardev`] (`--chardev`, the devices
//!    monitors talk through), [`qom`] (QEMU's type tree), [`log`] (the tracing
//!    subscriber, rate-limited events).
//! 4. [`block`]: `BlockNode` and the `BlockDriver` trait (`block::node`), the driver
//!    contracts, and every driver (`block::drivers`, whose table lists them); [`accept`]
//!    (listening sockets that survive descriptor exhaustion).
//! 5. [`export`] (the `Export` trait, `export::types` listing a folder per export type,
//!    and the virtio-blk device both virtio transports serve) and [`job`] (QEMU's states,
//!    verbs and events, and each job's work).
//! 6. [`metrics`]: the OpenMetrics listener.
//! 7. [`daemon`]: the daemon's API over what it holds: objects, nodes, exports, and each
//!    job's graph side.
//! 8. [`qmp`]: the monitor and its command table.
//! 9. [`usage`] (`--help` and the man page, generated from the tables) and [`process`]
//!    (the main loop, signals, the command line applied, the stop).

pub mod accept;
pub mod block;
pub mod buf;
pub mod bytes;
pub mod chardev;
pub mod cli;
pub mod crypto;
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
pub mod version;
