//! The FUSE export: a block node appears as a regular file at `mountpoint`.
//!
//! We mount with mount(2) (we run as root) onto an existing regular file, read requests
//! from /dev/fuse ourselves (no libfuse), one task per request ([`session`]). With a list
//! of IoThreads each gets its own channel, cloned with FUSE_DEV_IOC_CLONE, read by an fd
//! handler (never a poll handler: reading /dev/fuse is a syscall). A watchdog process
//! unmounts if the daemon dies without doing so (kill -9).
//!
//! Lowest first: `proto` (the kernel's structures) and [`shared`] (what all queues of an
//! export share); `handler` (what each request does); the transports, `session`
//! (/dev/fuse) and `uring` (FUSE over io_uring); [`options`] and `mount`; [`export`] (the
//! mounted export and the daemon's handle on it).

#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;

pub mod export;
mod handler;
mod mount;
pub mod options;
mod proto;
mod session;
pub mod shared;
mod uring;
