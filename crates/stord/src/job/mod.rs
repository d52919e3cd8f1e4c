//! Jobs: long operations that outlive the command that started them, with QEMU's states,
//! verbs and events.
//!
//! A job is a task on the main loop, which takes its verbs and changes the graph before
//! and after; the copying loop of mirror, backup, stream and commit, and its copies,
//! several at once, run on the thread that serves their node ([`home`]), sharing the
//! job's state with the main loop. Every state change is announced
//! as JOB_STATUS_CHANGE, in QEMU's order: created, running
//! (paused and back, ready and standby for jobs that wait to be completed), then on
//! success waiting, pending, concluded; on failure or cancel aborting, concluded; and null
//! once dismissed (at once with `auto-dismiss`). Block jobs (stream, commit) also send
//! the BLOCK_JOB_* events and are listed by `query-block-jobs`. Verbs are accepted in the
//! states QEMU's verb table accepts them in, with its texts otherwise.
//!
//! The work is a future that calls [`Job::pause_point`] and [`Job::ratelimit`] between
//! its steps (where pause, cancel and the speed limit take effect) and returns what is to
//! be done at finalize ([`Finish`]: QEMU's prepare, which changes the graph).
//!
//! The files, from the bottom up: the state machine ([`status`]) and the refusals
//! ([`error`]); how a job is made and what it holds ([`options`]); its speed limit
//! ([`rate_limit`]); the [`Job`] handle ([`handle`]) with its events ([`events`]), its
//! pause points ([`between_steps`]) and its I/O error policy ([`on_error`]); the table of
//! jobs ([`table`]), a job's life from created to null ([`lifecycle`]), the verbs
//! ([`verbs`]) and the queries ([`query`]). Where a job's loop runs: the thread
//! ([`home`]), a node move seen ([`stay`]), the copies in flight ([`in_flight`]) and the
//! loop itself, which follows its node ([`job_loop`]). The copy-job driver
//! ([`copy_job`]) runs stream and commit; mirror (with [`write_blocking`] and
//! [`known_zero`]) and backup have loops of their own.
//!
//! Each job's graph side (QEMU's checks, the permissions and op blockers it holds) is the
//! daemon's: `crate::daemon::jobs`, a file per job named as the job here.

pub mod backup;
pub mod between_steps;
pub mod commit;
pub mod copy_job;
pub mod error;
pub mod events;
pub mod handle;
pub mod home;
pub mod in_flight;
pub mod job_loop;
pub mod known_zero;
pub mod lifecycle;
pub mod mirror;
pub mod on_error;
pub mod options;
pub mod query;
pub mod rate_limit;
pub mod status;
pub mod stay;
pub mod stream;
pub mod table;
pub mod verbs;
pub mod write_blocking;

pub use copy_job::{run_copy, ChunkCopy, CopyError, CopyJob};
pub use error::{JobError, MAX_JOBS};
pub use handle::{Job, JobType};
pub use on_error::{ErrorAction, OnError};
pub use options::{Finish, Holds, JobOptions};
pub use status::JobStatus;
pub use table::Jobs;
