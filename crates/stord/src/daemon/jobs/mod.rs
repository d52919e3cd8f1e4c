//! The graph side of each job: for every job command, a file named as the job that
//! resolves its nodes by QEMU's rules (its checks in its order, its texts), takes the
//! permissions and op blockers the job holds while it runs, and hands the work to the job
//! of the same name in [`crate::job`]. So a job is its work in `job/<kind>.rs` and its
//! graph side here in `<kind>.rs`; the QMP arguments are in `qmp/commands/job.rs`.
//!
//! Why here and not beside the work, behind a narrow trait as `blockdev-create`'s
//! [`crate::block::create::CreateEnv`]: a job's setup needs much of the daemon (the
//! node table and QEMU's look-ups, the parents of a node, reopening a node writable, the
//! job table and the events, the exports a mirror moves and the thread that serves a
//! node, dropping the nodes a stream or commit removed, creating and opening a drive-*
//! target), and its refusals are [`DaemonError`](super::DaemonError)s whose QMP classes
//! differ (`DeviceNotFound`, a job's own). Such a trait would be the daemon again.
//!
//! [`start`] is what every block job shares: the job announced, started, and what runs
//! after it; [`backing_chain`] the chain stream and commit walk.

pub mod backing_chain;
pub mod backup;
pub mod commit;
pub mod create;
pub mod drive;
pub mod mirror;
pub mod start;
pub mod stream;
