//! The [`Job`] handle: one job's shared state, what its work reads (cancelled, pausing,
//! told to complete) and sets (progress), and what a job type adds to the verbs
//! ([`JobType`]). Its verbs and queries run on the main loop, its copying loop on the
//! thread that serves its node ([`super::job_loop`]), so its state is atomics and short
//! locks. The files beside this one add the job's events ([`super::events`]), its pause
//! points ([`super::between_steps`]) and its verbs ([`super::verbs`]).

use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use serde_json::Value;

use super::options::JobOptions;
use super::rate_limit::RateLimit;
use super::status::JobStatus;
use super::stay::Stay;
use crate::events::EventPoster;

/// What a job type adds to the common verbs (QEMU's BlockJobDriver `change` and
/// `query`): a mirror's copy mode.
pub trait JobType: Send + Sync {
    /// `block-job-change` with this type's options.
    fn change(&self, options: &serde_json::Map<String, Value>) -> Result<(), String>;
    /// The members query-block-jobs shows for this type.
    fn query(&self, into: &mut serde_json::Map<String, Value>);
}

/// Pause requests: the job pauses at its next pause point while `count` is above zero.
#[derive(Default, Clone, Copy)]
pub(super) struct Pause {
    /// Pause requests: the user's (or an error's stop, one between them).
    pub(super) count: u32,
    /// Paused by `job-pause` or an error's stop (the user resumes it).
    pub(super) user: bool,
}

/// One job. Its verbs and queries run on the main loop, its copying loop on the thread
/// that serves its node ([`super::home`]), so its state is shared: atomics and short
/// locks, and the events it raises away from the main loop are posted there in order.
pub struct Job {
    pub(super) id: String,
    /// QEMU's JobType name (`create`, `stream`, `commit`).
    pub(super) kind: &'static str,
    /// A block job: BLOCK_JOB_* events, `query-block-jobs`, the `block-job-*` verbs.
    pub(super) block: bool,
    pub(super) status: Mutex<JobStatus>,
    /// (current, total) progress.
    pub(super) progress: Mutex<(u64, u64)>,
    pub(super) error: Mutex<Option<String>>,
    pub(super) auto_finalize: bool,
    pub(super) auto_dismiss: bool,
    pub(super) events: EventPoster,
    /// `job-finalize` was given (auto-finalize off).
    pub(super) finalized: AtomicBool,
    pub(super) speed: AtomicU64,
    pub(super) limit: Mutex<RateLimit>,
    pub(super) pause: Mutex<Pause>,
    pub(super) cancelled: AtomicBool,
    pub(super) force_cancel: AtomicBool,
    /// A ready job was cancelled without force: it ends as completed, its graph change
    /// left undone (QEMU's mirror_cancel).
    pub(super) soft_cancelled: AtomicBool,
    /// `job-complete` was accepted (jobs that wait in ready).
    pub(super) complete_requested: AtomicBool,
    /// Whether the job can be completed (it waits in ready for it).
    pub(super) completable: bool,
    /// The last I/O error stopped the job (`io-status`).
    pub(super) io_failed: AtomicBool,
    /// Asleep or waiting (not `busy`).
    pub(super) idle: AtomicBool,
    /// A verb happened: a sleeping job wakes to look.
    pub(super) kicked: AtomicBool,
    /// The job's task, parked.
    pub(super) waker: Mutex<Option<Waker>>,
    /// Where the job's loop runs now ([`super::job_loop::follow`]): a pause there ends
    /// early when the node moves, so the paused loop goes along rather than stay parked on
    /// a thread the node left (and that may be deleted).
    pub(super) stay: Mutex<Option<Stay>>,
    /// The state a pause left, kept while the paused loop moves to its node's new thread.
    pub(super) resume_to: Mutex<Option<JobStatus>>,
    /// What the job's type adds (set by the work as it starts).
    pub(super) ext: Mutex<Option<Arc<dyn JobType>>>,
}

/// Locks `m`, whatever a panic elsewhere left in it (the job's state stays readable).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Job {
    /// A new job `id` of type `kind`, created, its state changes announced through
    /// `events`.
    pub(super) fn new(
        id: &str,
        kind: &'static str,
        opts: &JobOptions,
        events: EventPoster,
    ) -> Self {
        Job {
            id: id.into(),
            kind,
            block: opts.block,
            status: Mutex::new(JobStatus::Created),
            progress: Mutex::new((0, 0)),
            error: Mutex::new(None),
            auto_finalize: opts.auto_finalize,
            auto_dismiss: opts.auto_dismiss,
            events,
            finalized: AtomicBool::new(false),
            speed: AtomicU64::new(opts.speed),
            limit: Mutex::new(RateLimit::new(opts.speed)),
            pause: Mutex::default(),
            cancelled: AtomicBool::new(false),
            force_cancel: AtomicBool::new(false),
            soft_cancelled: AtomicBool::new(false),
            complete_requested: AtomicBool::new(false),
            completable: opts.completable,
            io_failed: AtomicBool::new(false),
            idle: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
            waker: Mutex::new(None),
            stay: Mutex::new(None),
            resume_to: Mutex::new(None),
            ext: Mutex::new(None),
        }
    }

    pub(super) fn status(&self) -> JobStatus {
        *lock(&self.status)
    }

    /// The job's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Sets the progress shown by query-jobs.
    pub fn set_progress(&self, current: u64, total: u64) {
        *lock(&self.progress) = (current, total);
    }

    /// Adds `n` bytes to the progress made.
    pub fn progress_add(&self, n: u64) {
        let mut p = lock(&self.progress);
        let (c, t) = *p;
        *p = (c + n, t.max(c + n));
    }

    /// `n` more bytes to do, and done (QEMU's job_progress_increase_remaining then
    /// job_progress_update).
    pub fn progress_grow(&self, n: u64) {
        let mut p = lock(&self.progress);
        let (c, t) = *p;
        *p = (c + n, t + n);
    }

    /// Sets the total so that `remaining` bytes are left.
    pub fn set_remaining(&self, remaining: u64) {
        let mut p = lock(&self.progress);
        p.1 = p.0 + remaining;
    }

    pub(super) fn pause_count(&self) -> u32 {
        lock(&self.pause).count
    }

    /// Whether the job is to pause at its next pause point (and is not cancelled).
    pub fn pausing(&self) -> bool {
        self.pause_count() > 0 && !self.is_cancelled()
    }

    /// Whether a speed limit is set: a job with copies in flight then runs one at a time,
    /// as QEMU's limited jobs do, so the limit holds from the first byte.
    pub fn limited(&self) -> bool {
        self.speed.load(SeqCst) > 0
    }

    /// Whether the job was cancelled (it stops at its next step, changing nothing).
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(SeqCst)
    }

    /// Whether `job-complete` was accepted.
    pub fn complete_requested(&self) -> bool {
        self.complete_requested.load(SeqCst)
    }

    /// Whether a ready job was cancelled without force (it stops in step, unchanged).
    pub fn soft_cancelled(&self) -> bool {
        self.soft_cancelled.load(SeqCst)
    }

    /// Whether the job is ready (or in standby, paused while ready).
    pub fn is_ready(&self) -> bool {
        matches!(self.status(), JobStatus::Ready | JobStatus::Standby)
    }

    /// Says what the job's type adds to the verbs and queries.
    pub fn set_type(&self, t: Arc<dyn JobType>) {
        *lock(&self.ext) = Some(t);
    }
}
