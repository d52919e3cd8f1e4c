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

pub mod backup;
pub mod commit;
pub mod home;
pub mod mirror;
pub mod stream;
pub mod write_blocking;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::events::{EventPoster, Events};

/// Jobs the daemon keeps at once (concluded ones stay until dismissed): a limit on what
/// clients can make it hold.
pub const MAX_JOBS: usize = 1024;

/// The length of a rate limit slice (QEMU's BLOCK_JOB_SLICE_TIME).
const SLICE: Duration = Duration::from_millis(100);

/// QEMU's JobStatus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    Created,
    Running,
    Paused,
    Ready,
    Standby,
    Waiting,
    Pending,
    Aborting,
    Concluded,
    Null,
}

impl JobStatus {
    /// As QMP names it.
    pub fn name(self) -> &'static str {
        match self {
            JobStatus::Created => "created",
            JobStatus::Running => "running",
            JobStatus::Paused => "paused",
            JobStatus::Ready => "ready",
            JobStatus::Standby => "standby",
            JobStatus::Waiting => "waiting",
            JobStatus::Pending => "pending",
            JobStatus::Aborting => "aborting",
            JobStatus::Concluded => "concluded",
            JobStatus::Null => "null",
        }
    }
}

/// QEMU's JobVerb, with the states that accept each (its JobVerbTable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Cancel,
    Pause,
    Resume,
    SetSpeed,
    Complete,
    Finalize,
    Dismiss,
    Change,
}

impl Verb {
    fn name(self) -> &'static str {
        match self {
            Verb::Cancel => "cancel",
            Verb::Pause => "pause",
            Verb::Resume => "resume",
            Verb::SetSpeed => "set-speed",
            Verb::Complete => "complete",
            Verb::Finalize => "finalize",
            Verb::Dismiss => "dismiss",
            Verb::Change => "change",
        }
    }

    fn allowed(self, s: JobStatus) -> bool {
        use JobStatus::*;
        match self {
            Verb::Cancel => matches!(
                s,
                Created | Running | Paused | Ready | Standby | Waiting | Pending
            ),
            Verb::Pause | Verb::Resume | Verb::SetSpeed | Verb::Change => {
                matches!(s, Created | Running | Paused | Ready | Standby)
            }
            Verb::Complete => s == Ready,
            Verb::Finalize => s == Pending,
            Verb::Dismiss => s == Concluded,
        }
    }
}

/// Why a job command was refused (QEMU's texts).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("Job not found")]
    NotFound,
    /// A `block-job-*` command naming no block job (class DeviceNotActive).
    #[error("Block job '{0}' not found")]
    BlockJobNotFound(String),
    #[error("Job ID '{0}' already in use")]
    IdInUse(String),
    #[error("Invalid job ID '{0}'")]
    InvalidId(String),
    #[error("Too many jobs ({MAX_JOBS}): dismiss concluded ones first")]
    TooMany,
    #[error("Job '{id}' in state '{state}' cannot accept command verb '{verb}'")]
    BadVerb {
        id: String,
        state: &'static str,
        verb: &'static str,
    },
    #[error("Job is already paused")]
    AlreadyPaused,
    #[error("Can't resume a job that was not paused")]
    NotPaused,
    #[error("The active block job '{0}' cannot be completed")]
    CannotComplete(String),
    #[error("The block job for device '{0}' is currently paused")]
    Paused(String),
    #[error("Parameter 'speed' expects a non-negative value")]
    Speed,
    /// A job type's own refusal (QEMU's text).
    #[error("{0}")]
    Other(String),
}

impl JobError {
    /// The QMP error class (QEMU's).
    pub fn qmp_class(&self) -> &'static str {
        match self {
            JobError::BlockJobNotFound(_) => "DeviceNotActive",
            _ => "GenericError",
        }
    }
}

/// What a job does on an I/O error (QEMU's BlockdevOnError).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Fail the job.
    Report,
    /// Go on as if the step had succeeded.
    Ignore,
    /// Pause the job (the user resumes it to retry).
    Stop,
    /// Stop on ENOSPC, report anything else.
    Enospc,
}

impl OnError {
    /// From its QMP name.
    pub fn parse(s: &str) -> Option<OnError> {
        Some(match s {
            "report" => OnError::Report,
            "ignore" => OnError::Ignore,
            "stop" => OnError::Stop,
            "enospc" => OnError::Enospc,
            _ => return None,
        })
    }
}

/// What the job does with one failed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorAction {
    Report,
    Ignore,
    /// Paused: retry the step once resumed.
    Stop,
}

/// QEMU's prepare: what a job that did its work changes once it is finalized (the graph
/// change of stream and commit). It runs only if the job was not cancelled first.
pub type Finish = Option<Pin<Box<dyn Future<Output = Result<(), String>>>>>;

/// What a copying job does to one chunk: sent to the thread that serves its node and run
/// there, several chunks at once.
#[allow(async_fn_in_trait)] // Its future runs where it is made: no Send bound is wanted.
pub trait ChunkCopy: Clone + Send + 'static {
    /// Handles `[offset, offset + len)`: the bytes it copied (what the speed limit counts),
    /// or the error with whether reading failed.
    async fn copy(&self, offset: u64, len: u64) -> Result<u64, CopyError>;
}

/// A job that copies chunk by chunk (stream, commit), run by [`run_copy`].
#[allow(async_fn_in_trait)] // Jobs are tasks on one thread: no Send bound is wanted.
pub trait CopyJob: 'static {
    /// The most one chunk holds.
    const CHUNK: u64;
    type Chunk: ChunkCopy;
    /// Bytes to go over.
    fn bytes(&self) -> u64;
    fn on_error(&self) -> OnError;
    /// The node whose thread runs the chunks.
    fn node(&self) -> &std::sync::Arc<crate::block::node::block_node::BlockNode>;
    /// Before the first chunk.
    async fn prepare(&self) -> Result<(), String> {
        Ok(())
    }
    /// What copies each chunk.
    fn chunk(&self) -> Self::Chunk;
    /// The graph change at finalize (QEMU's prepare).
    async fn finish(&self) -> Result<(), String>;
}

/// A copy's failure, with whether it was reading (QEMU's `on-source-error` against
/// `on-target-error`, and a stream's copy-on-read).
pub type CopyError = (std::io::Error, bool);

/// The allocation runs of `[offset, end)` in a node's chain, in order: what a copying
/// job walks to decide, run by run, what to copy, zero or skip.
pub struct Runs<'a> {
    node: &'a crate::block::node::block_node::BlockNode,
    at: u64,
    end: u64,
}

impl<'a> Runs<'a> {
    pub fn new(node: &'a crate::block::node::block_node::BlockNode, offset: u64, end: u64) -> Self {
        Runs {
            node,
            at: offset,
            end,
        }
    }

    /// The next run's start, length and allocation depth (see
    /// `BlockDriver::allocation_depth`); None at the end. Not finding it is a read error.
    pub async fn next(&mut self) -> Option<Result<(u64, u64, u32), CopyError>> {
        if self.at >= self.end {
            return None;
        }
        let at = self.at;
        let found = self.node.driver().allocation_depth(at, self.end - at).await;
        Some(match found {
            Ok((n, depth)) => {
                let n = n.clamp(1, self.end - at);
                self.at += n;
                Ok((at, n, depth))
            }
            Err(e) => Err((e, true)),
        })
    }
}

/// Copies `[at, at + n)` of `from` to `to` through a request buffer.
pub async fn copy_range(
    from: &crate::block::node::block_node::BlockNode,
    to: &crate::block::node::block_node::BlockNode,
    at: u64,
    n: u64,
) -> Result<(), CopyError> {
    let (r, buf) = from.read(at, crate::buf::request_buf(n as usize)).await;
    r.map_err(|e| (e, true))?;
    let (r, _) = to.write(at, buf, false).await;
    r.map_err(|e| (e, false))
}

/// Runs a copying job chunk by chunk on the thread `home` names; at finalize its graph
/// change, then its holds (the claims and blockers it owns) go and `after` runs.
pub async fn run_copy<T: CopyJob>(
    t: T,
    job: Arc<Job>,
    home: impl Fn() -> Option<home::Home>,
    after: impl FnOnce() + 'static,
) -> Result<Finish, String> {
    t.prepare().await?;
    let span = (t.bytes(), T::CHUNK);
    if !job
        .run_chunks(span, t.on_error(), &t.chunk(), t.node(), &home)
        .await?
    {
        return Ok(None);
    }
    Ok(Some(Box::pin(async move {
        let r = t.finish().await;
        drop(t);
        after();
        r
    })))
}

/// Chunks a copying job has in flight at most when no speed limit is set (QEMU's stream
/// and commit copy one at a time; several keep the storage's queue busy). With a limit,
/// one at a time, as QEMU's.
const CHUNKS_IN_FLIGHT: usize = 8;

/// A finished chunk: its range and what [`ChunkCopy::copy`] said.
type ChunkDone = (u64, u64, Result<u64, CopyError>);

/// Where a copying job's chunk loop is: what it carries from one thread to the next when
/// its node moves.
#[derive(Default)]
struct ChunksAt {
    /// The start of the first chunk not started yet.
    next: u64,
    /// Chunks to copy again (failed under `on-error=stop`).
    again: Vec<(u64, u64)>,
    /// The first error ignored (`on-error=ignore`): the job fails with it at the end.
    ignored: Option<std::io::Error>,
    cancelled: bool,
}

impl ChunksAt {
    /// How the loop ended: Ok(false) cancelled.
    fn finish(self) -> Result<bool, String> {
        match self.ignored {
            _ if self.cancelled => Ok(false),
            Some(e) => Err(e.to_string()),
            None => Ok(true),
        }
    }
}

/// What a block job holds on the graph while it lasts.
pub struct Holds {
    pub claims: Vec<crate::block::node::block_node::Claim>,
    pub blockers: Vec<crate::block::node::blocker::Blocker>,
    /// The job on the node it was started on.
    pub attached: crate::block::node::blocker::JobAttachment,
    /// Nodes made writable for the job, read-only again after it.
    pub reopened: crate::block::node::read_only_again::ReadOnlyAgain,
}

/// A rate limit in QEMU's manner (util/ratelimit.h): a quota of bytes per slice; bytes
/// beyond it push the end of the slice out, and the job sleeps until then.
#[derive(Clone, Copy)]
struct RateLimit {
    quota: u64,
    start: Instant,
    end: Instant,
    dispatched: u64,
}

impl RateLimit {
    fn new(speed: u64) -> Self {
        let now = Instant::now();
        let quota = if speed == 0 {
            0
        } else {
            ((speed as f64 * SLICE.as_secs_f64()) as u64).max(1)
        };
        RateLimit {
            quota,
            start: now,
            end: now,
            dispatched: 0,
        }
    }

    /// Counts `n` bytes; how long to wait before the next step.
    fn delay(&mut self, n: u64) -> Duration {
        if self.quota == 0 {
            return Duration::ZERO;
        }
        let now = Instant::now();
        if self.end < now {
            self.start = now;
            self.end = now + SLICE;
            self.dispatched = 0;
        }
        self.dispatched += n;
        if self.dispatched < self.quota {
            return Duration::ZERO;
        }
        let slices = self.dispatched as f64 / self.quota as f64;
        self.end = self.start + SLICE.mul_f64(slices);
        self.end.saturating_duration_since(now)
    }
}

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
struct Pause {
    /// Pause requests: the user's (or an error's stop, one between them).
    count: u32,
    /// Paused by `job-pause` or an error's stop (the user resumes it).
    user: bool,
}

/// One job. Its verbs and queries run on the main loop, its copying loop on the thread
/// that serves its node ([`home`]), so its state is shared: atomics and short locks, and
/// the events it raises away from the main loop are posted there in order.
pub struct Job {
    id: String,
    /// QEMU's JobType name (`create`, `stream`, `commit`).
    kind: &'static str,
    /// A block job: BLOCK_JOB_* events, `query-block-jobs`, the `block-job-*` verbs.
    block: bool,
    status: Mutex<JobStatus>,
    /// (current, total) progress.
    progress: Mutex<(u64, u64)>,
    error: Mutex<Option<String>>,
    auto_finalize: bool,
    auto_dismiss: bool,
    events: EventPoster,
    /// `job-finalize` was given (auto-finalize off).
    finalized: AtomicBool,
    speed: AtomicU64,
    limit: Mutex<RateLimit>,
    pause: Mutex<Pause>,
    cancelled: AtomicBool,
    force_cancel: AtomicBool,
    /// A ready job was cancelled without force: it ends as completed, its graph change
    /// left undone (QEMU's mirror_cancel).
    soft_cancelled: AtomicBool,
    /// `job-complete` was accepted (jobs that wait in ready).
    complete_requested: AtomicBool,
    /// Whether the job can be completed (it waits in ready for it).
    completable: bool,
    /// The last I/O error stopped the job (`io-status`).
    io_failed: AtomicBool,
    /// Asleep or waiting (not `busy`).
    idle: AtomicBool,
    /// A verb happened: a sleeping job wakes to look.
    kicked: AtomicBool,
    /// The job's task, parked.
    waker: Mutex<Option<Waker>>,
    /// Where the job's loop runs now ([`home::follow`]): a pause there ends early when the
    /// node moves, so the paused loop goes along rather than stay parked on a thread the
    /// node left (and that may be deleted).
    stay: Mutex<Option<home::Stay>>,
    /// The state a pause left, kept while the paused loop moves to its node's new thread.
    resume_to: Mutex<Option<JobStatus>>,
    /// What the job's type adds (set by the work as it starts).
    ext: Mutex<Option<Arc<dyn JobType>>>,
}

/// Locks `m`, whatever a panic elsewhere left in it (the job's state stays readable).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Job {
    fn status(&self) -> JobStatus {
        *lock(&self.status)
    }

    /// Announced under the status lock, so the events of two threads' changes go out in
    /// the order the changes were made.
    fn set(&self, s: JobStatus) {
        let mut status = lock(&self.status);
        if std::mem::replace(&mut *status, s) == s {
            return;
        }
        self.events.emit_here_or_post(
            "JOB_STATUS_CHANGE",
            json!({ "status": s.name(), "id": self.id }),
        );
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

    fn pause_count(&self) -> u32 {
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

    /// The job's copy is in step: ready (once), BLOCK_JOB_READY announced.
    pub fn set_ready(&self) {
        if self.is_ready() {
            return;
        }
        self.set(JobStatus::Ready);
        self.block_event("BLOCK_JOB_READY", None);
    }

    /// A verb happened: the job's task looks again (from any thread).
    fn wake(&self) {
        self.kicked.store(true, SeqCst);
        if let Some(w) = lock(&self.waker).take() {
            w.wake();
        }
    }

    /// Waits (idle) until `cond` holds; every verb re-checks it. The waker is left before
    /// `cond` is read, so a verb on another thread between the two is not missed.
    async fn wait_until(&self, cond: impl Fn() -> bool) {
        self.idle.store(true, SeqCst);
        std::future::poll_fn(|cx| {
            *lock(&self.waker) = Some(cx.waker().clone());
            if cond() {
                return Poll::Ready(());
            }
            Poll::Pending
        })
        .await;
        self.unpark();
    }

    /// Where a pause takes effect: paused (standby when ready) until resumed or
    /// cancelled, then back to the state before. A pause on a thread the job's node left
    /// ends early, still paused: the loop moves and pauses on again there.
    pub async fn pause_point(&self) {
        if !self.pausing() {
            self.end_carried_pause();
            return;
        }
        // Paused on the thread the node left: the state to go back to came along.
        let kept = lock(&self.resume_to).take();
        let before = kept.unwrap_or_else(|| self.status());
        if kept.is_none() {
            self.set(if before == JobStatus::Ready {
                JobStatus::Standby
            } else {
                JobStatus::Paused
            });
        }
        self.wait_until(|| !self.pausing() || self.loop_moved())
            .await;
        if self.pausing() {
            // Still paused (not busy) while the loop moves.
            self.idle.store(true, SeqCst);
            *lock(&self.resume_to) = Some(before);
            return;
        }
        self.unpause(before);
    }

    /// A pause carried to a new thread is over (resumed or cancelled meanwhile, or the
    /// loop ended): back to the state before it, as a resume would (a cancelled paused
    /// job goes through running, as QEMU's).
    pub(crate) fn end_carried_pause(&self) {
        if let Some(before) = lock(&self.resume_to).take() {
            self.unpause(before);
        }
    }

    /// `job-cancel`: a paused job is resumed to stop; a ready job that can be completed
    /// and is not forced ends as completed, its graph change left undone.
    fn cancel(&self, force: bool) -> Result<(), JobError> {
        self.check(Verb::Cancel)?;
        {
            let mut p = lock(&self.pause);
            if std::mem::replace(&mut p.user, false) {
                p.count = p.count.saturating_sub(1);
            }
        }
        if !force && self.completable && self.is_ready() {
            self.soft_cancelled.store(true, SeqCst);
            self.wake();
            return Ok(());
        }
        self.cancelled.store(true, SeqCst);
        self.force_cancel.fetch_or(force, SeqCst);
        self.wake();
        Ok(())
    }

    /// Resumed: back to the state before the pause.
    fn unpause(&self, before: JobStatus) {
        self.io_failed.store(false, SeqCst);
        self.set(before);
    }

    /// The job's loop now runs where `stay` says (None: it is not running).
    pub(crate) fn set_stay(&self, stay: Option<home::Stay>) {
        *lock(&self.stay) = stay;
    }

    /// Whether the node the job's loop runs for was moved to another thread.
    fn loop_moved(&self) -> bool {
        lock(&self.stay).as_ref().is_some_and(home::Stay::moved)
    }

    /// Sleeps `d`, then a pause point. Any verb since the last sleep or step
    /// ([`ratelimit`](Self::ratelimit)) cuts it short, so a verb on the main loop between
    /// the caller's look at the job and the sleep is not missed; the sleep takes it.
    pub async fn sleep(&self, d: Duration) {
        if self.is_cancelled() {
            return;
        }
        if self.pause_count() == 0 {
            self.idle.store(true, SeqCst);
            let mut s = std::pin::pin!(stord_aio::sleep(d));
            std::future::poll_fn(|cx| {
                *lock(&self.waker) = Some(cx.waker().clone());
                if self.kicked.load(SeqCst)
                    || self.is_cancelled()
                    || self.pause_count() > 0
                    || s.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(());
                }
                Poll::Pending
            })
            .await;
            self.kicked.store(false, SeqCst);
            self.unpark();
        }
        self.pause_point().await;
    }

    /// Done waiting: busy again, and the waker left for verbs goes (a verb later must not
    /// wake this task when it waits on something else, such as its loop's result).
    fn unpark(&self) {
        self.idle.store(false, SeqCst);
        lock(&self.waker).take();
    }

    /// Counts `n` bytes against the speed limit.
    pub fn ratelimit_processed(&self, n: u64) {
        lock(&self.limit).delay(n);
    }

    /// Between steps: waits as long as the speed limit asks (yielding to the loop even
    /// when it asks nothing), then a pause point.
    pub async fn ratelimit(&self) {
        // Before the delay is read: a speed change after it cuts the sleep short.
        self.kicked.store(false, SeqCst);
        let d = lock(&self.limit).delay(0);
        if d.is_zero() {
            stord_aio::yield_now().await;
            self.pause_point().await;
        } else {
            self.sleep(d).await;
        }
    }

    /// What to do with a failed step under `on_error` (BLOCK_JOB_ERROR tells the user);
    /// with Stop the job is paused by the time this returns.
    pub fn error_action(&self, on_error: OnError, read: bool, e: &std::io::Error) -> ErrorAction {
        let action = match on_error {
            OnError::Report => ErrorAction::Report,
            OnError::Ignore => ErrorAction::Ignore,
            OnError::Stop => ErrorAction::Stop,
            OnError::Enospc if e.raw_os_error() == Some(libc::ENOSPC) => ErrorAction::Stop,
            OnError::Enospc => ErrorAction::Report,
        };
        let name = match action {
            ErrorAction::Report => "report",
            ErrorAction::Ignore => "ignore",
            ErrorAction::Stop => "stop",
        };
        if action == ErrorAction::Stop {
            // As a user's pause (the user resumes it), with the failure in io-status; once,
            // however many copies in flight fail (QEMU's block_job_error_action), so one
            // resume resumes it. Paused before the event goes: a client that resumes on
            // seeing it finds the job paused.
            let mut p = lock(&self.pause);
            if !p.user {
                p.user = true;
                p.count += 1;
            }
            self.io_failed.store(true, SeqCst);
        }
        self.events.emit_here_or_post(
            "BLOCK_JOB_ERROR",
            json!({
                "device": self.id,
                "operation": if read { "read" } else { "write" },
                "action": name,
            }),
        );
        action
    }

    /// The loop of a copying job (stream, commit): `[0, len)` in chunks of `chunk` bytes,
    /// handed to `c` several at once, on the thread `home` names (the loop too, and it
    /// follows `node` to another IoThread). Between chunks the speed limit, pause and
    /// cancel take effect; a failed chunk goes as `on_error` says (stop: it is copied
    /// again once resumed). Ok(false) when cancelled; an ignored error fails the job at
    /// the end, as QEMU leaves the graph then. Whatever ends it, the chunks it started
    /// have finished when it returns.
    pub async fn run_chunks<C: ChunkCopy>(
        self: &Arc<Self>,
        (len, chunk): (u64, u64),
        on_error: OnError,
        c: &C,
        node: &Arc<crate::block::node::block_node::BlockNode>,
        home: home::FindHome<'_>,
    ) -> Result<bool, String> {
        self.set_remaining(len);
        let (job, c) = (self.clone(), c.clone());
        let run = move |mut at: ChunksAt, stay: home::Stay, here: home::Home| async move {
            let ops = home::InFlight::new();
            let r = job
                .chunks_loop(&mut at, (len, chunk, on_error), &c, &stay, &here, &ops)
                .await;
            ops.drain().await;
            r.map(|done| match done {
                true => home::Step::Done(at.finish()),
                false => home::Step::Moved(at),
            })
        };
        home::follow(self, node, home, ChunksAt::default(), run).await?
    }

    /// Chunks until the end (true) or until `stay` says the node moved and nothing is in
    /// flight (false); Err when the job fails. Cancelled: true, with `at.cancelled`.
    async fn chunks_loop<C: ChunkCopy>(
        &self,
        at: &mut ChunksAt,
        (len, chunk, on_error): (u64, u64, OnError),
        c: &C,
        stay: &home::Stay,
        here: &home::Home,
        ops: &home::InFlight<ChunkDone>,
    ) -> Result<bool, String> {
        loop {
            while let Some(done) = ops.next_to_settle(self.pausing()).await {
                self.settle_chunk(done, on_error, at)?;
            }
            self.ratelimit().await;
            if self.is_cancelled() {
                at.cancelled = true;
                return Ok(true);
            }
            let busy = ops.load().0;
            let most = if self.limited() { 1 } else { CHUNKS_IN_FLIGHT };
            let moved = stay.moved();
            let work = if busy >= most || moved {
                None
            } else if let Some(w) = at.again.pop() {
                Some(w)
            } else if at.next < len {
                let w = (at.next, chunk.min(len - at.next));
                at.next += w.1;
                Some(w)
            } else {
                None
            };
            match work {
                Some((offset, n)) => {
                    let c = c.clone();
                    let lost = (offset, n, Err((home::stopped(), false)));
                    ops.start(here, n, lost, move || async move {
                        (offset, n, c.copy(offset, n).await)
                    });
                }
                None if ops.is_empty() => return Ok(!moved),
                None => {
                    if let Some(done) = ops.next().await {
                        self.settle_chunk(done, on_error, at)?;
                    }
                }
            }
        }
    }

    /// Counts a finished chunk, or applies `on_error` to its failure.
    fn settle_chunk(
        &self,
        (offset, n, r): ChunkDone,
        on_error: OnError,
        at: &mut ChunksAt,
    ) -> Result<(), String> {
        match r {
            Ok(copied) => {
                self.progress_add(n);
                self.ratelimit_processed(copied);
            }
            Err((e, read)) => match self.error_action(on_error, read, &e) {
                // Paused now; the chunk is copied again once resumed.
                ErrorAction::Stop => at.again.push((offset, n)),
                ErrorAction::Ignore => {
                    at.ignored.get_or_insert(e);
                    self.progress_add(n);
                }
                ErrorAction::Report => return Err(e.to_string()),
            },
        }
        Ok(())
    }

    fn block_event(&self, name: &'static str, error: Option<&str>) {
        if !self.block {
            return;
        }
        let (cur, total) = *lock(&self.progress);
        let mut data = json!({
            "type": self.kind,
            "device": self.id,
            "len": total,
            "offset": cur,
            "speed": self.speed.load(SeqCst),
        });
        if let Some(e) = error {
            data["error"] = e.into();
        }
        self.events.emit_here_or_post(name, data);
    }

    fn check(&self, verb: Verb) -> Result<(), JobError> {
        let status = self.status();
        if verb.allowed(status) {
            return Ok(());
        }
        Err(JobError::BadVerb {
            id: self.id.clone(),
            state: status.name(),
            verb: verb.name(),
        })
    }

    fn info(&self) -> Value {
        let (cur, total) = *lock(&self.progress);
        let mut v = json!({
            "id": self.id,
            "type": self.kind,
            "status": self.status().name(),
            "current-progress": cur,
            "total-progress": total,
        });
        if let Some(e) = &*lock(&self.error) {
            v["error"] = e.clone().into();
        }
        v
    }

    /// Says what the job's type adds to the verbs and queries.
    pub fn set_type(&self, t: Arc<dyn JobType>) {
        *lock(&self.ext) = Some(t);
    }

    fn block_info(&self) -> Value {
        let (cur, total) = *lock(&self.progress);
        let s = self.status();
        let mut v = json!({
            "type": self.kind,
            "device": self.id,
            "len": total,
            "offset": cur,
            "busy": !self.idle.load(SeqCst),
            "paused": self.pause_count() > 0,
            "speed": self.speed.load(SeqCst),
            "io-status": if self.io_failed.load(SeqCst) { "failed" } else { "ok" },
            "ready": matches!(s, JobStatus::Ready | JobStatus::Standby),
            "status": s.name(),
            "auto-finalize": self.auto_finalize,
            "auto-dismiss": self.auto_dismiss,
        });
        if let Some(e) = &*lock(&self.error) {
            v["error"] = e.clone().into();
        }
        let ext = lock(&self.ext).clone();
        if let (Some(t), Value::Object(m)) = (ext, &mut v) {
            t.query(m);
        }
        v
    }
}

/// Every job, by id (main thread only); clones share the table.
#[derive(Default, Clone)]
pub struct Jobs {
    map: Rc<RefCell<BTreeMap<String, Arc<Job>>>>,
    /// Creation order, for query-jobs (QEMU lists the newest first).
    order: Rc<RefCell<Vec<String>>>,
}

/// How a job is made and ends.
pub struct JobOptions {
    pub auto_finalize: bool,
    pub auto_dismiss: bool,
    /// A block job (BLOCK_JOB_* events).
    pub block: bool,
    /// Bytes per second (0: unlimited).
    pub speed: u64,
    /// It waits in ready for `job-complete`.
    pub completable: bool,
    /// Started inside a drained section that ends right after (QEMU runs blockdev-backup
    /// as a transaction action, which drains the source from prepare to clean): the job
    /// is paused at its first pause point and resumed as the section ends, both
    /// announced before the command's reply.
    pub drained: bool,
}

impl JobOptions {
    /// A job that is not a block job (blockdev-create).
    pub fn plain(auto_finalize: bool, auto_dismiss: bool) -> Self {
        JobOptions {
            auto_finalize,
            auto_dismiss,
            block: false,
            speed: 0,
            completable: false,
            drained: false,
        }
    }
}

impl Jobs {
    /// Whether `id` could start now (well formed, free, within the limit).
    pub fn check_new(&self, id: &str) -> Result<(), JobError> {
        if !crate::cli::id_wellformed(id) {
            return Err(JobError::InvalidId(id.into()));
        }
        if self.map.borrow().contains_key(id) {
            return Err(JobError::IdInUse(id.into()));
        }
        if self.map.borrow().len() >= MAX_JOBS {
            return Err(JobError::TooMany);
        }
        Ok(())
    }

    /// Starts `work` as job `id` of type `kind`; its state changes go to `events`.
    pub fn start<F>(
        &self,
        id: &str,
        kind: &'static str,
        opts: JobOptions,
        events: &Events,
        work: impl FnOnce(Arc<Job>) -> F,
    ) -> Result<(), JobError>
    where
        F: Future<Output = Result<Finish, String>> + 'static,
    {
        self.check_new(id)?;
        let Some(poster) = events.poster() else {
            return Err(JobError::Other("jobs run on a loop".into()));
        };
        let job = Arc::new(Job {
            id: id.into(),
            kind,
            block: opts.block,
            status: Mutex::new(JobStatus::Created),
            progress: Mutex::new((0, 0)),
            error: Mutex::new(None),
            auto_finalize: opts.auto_finalize,
            auto_dismiss: opts.auto_dismiss,
            events: poster,
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
        });
        self.map.borrow_mut().insert(id.into(), job.clone());
        self.order.borrow_mut().push(id.into());
        events.emit(
            "JOB_STATUS_CHANGE",
            json!({ "status": "created", "id": job.id }),
        );
        let fut = work(job.clone());
        let (map, order) = (self.map.clone(), self.order.clone());
        // Running before the command's reply, as QEMU's job_start; the work itself starts
        // after the reply has gone out.
        job.set(JobStatus::Running);
        if opts.drained {
            job.set(JobStatus::Paused);
            job.set(JobStatus::Running);
        }
        stord_aio::spawn_detached(async move {
            stord_aio::yield_now().await;
            // As QEMU's job_co_entry: a pause asked for before the start holds here.
            job.pause_point().await;
            let r = if job.is_cancelled() {
                Ok(None)
            } else {
                fut.await
            };
            Self::conclude(&job, r).await;
            if job.auto_dismiss {
                job.set(JobStatus::Null);
                map.borrow_mut().remove(&job.id);
                order.borrow_mut().retain(|j| *j != job.id);
            }
        });
        Ok(())
    }

    /// From the end of the work to concluded, in QEMU's order.
    async fn conclude(job: &Arc<Job>, r: Result<Finish, String>) {
        let fail = |e: String, cancelled: bool| {
            *lock(&job.error) = Some(e.clone());
            job.set(JobStatus::Aborting);
            if cancelled {
                job.block_event("BLOCK_JOB_CANCELLED", None);
            } else {
                job.block_event("BLOCK_JOB_COMPLETED", Some(&e));
            }
        };
        let finish = match r {
            _ if job.is_cancelled() => {
                fail("Operation canceled".into(), true);
                None
            }
            Err(e) => {
                fail(e, false);
                None
            }
            Ok(f) => Some(f),
        };
        if let Some(f) = finish {
            job.set(JobStatus::Waiting);
            job.set(JobStatus::Pending);
            if !job.auto_finalize {
                if job.block {
                    job.events.emit_here_or_post(
                        "BLOCK_JOB_PENDING",
                        json!({ "type": job.kind, "id": job.id }),
                    );
                }
                job.wait_until(|| job.finalized.load(SeqCst) || job.is_cancelled())
                    .await;
            }
            if job.is_cancelled() {
                fail("Operation canceled".into(), true);
            } else {
                match f {
                    Some(f) => match f.await {
                        Ok(()) => job.block_event("BLOCK_JOB_COMPLETED", None),
                        Err(e) => fail(e, false),
                    },
                    None => job.block_event("BLOCK_JOB_COMPLETED", None),
                }
            }
        }
        job.set(JobStatus::Concluded);
    }

    /// A node moved to another thread (x-blockdev-set-iothread): every job looks again,
    /// so the loop of a job on it goes along, even paused (its pause ends on the thread
    /// the node left and goes on on the new one).
    pub fn node_moved(&self) {
        for job in self.map.borrow().values() {
            job.wake();
        }
    }

    /// Whether a job's loop runs on IoThread `id` now (until it has left, the thread is
    /// in use even after the node moved away).
    pub fn loop_on(&self, id: &str) -> bool {
        self.map
            .borrow()
            .values()
            .any(|job| lock(&job.stay).as_ref().is_some_and(|s| s.on(id)))
    }

    fn get(&self, id: &str) -> Result<Arc<Job>, JobError> {
        self.map.borrow().get(id).cloned().ok_or(JobError::NotFound)
    }

    /// A block job by the id `block-job-*` commands call `device`.
    pub fn get_block(&self, id: &str) -> Result<Arc<Job>, JobError> {
        match self.map.borrow().get(id) {
            Some(j) if j.block => Ok(j.clone()),
            _ => Err(JobError::BlockJobNotFound(id.into())),
        }
    }

    /// The job `id`, `block` ones looked up as `block-job-*` commands do.
    pub fn find(&self, id: &str, block: bool) -> Result<Arc<Job>, JobError> {
        if block {
            self.get_block(id)
        } else {
            self.get(id)
        }
    }

    /// `job-dismiss`: a concluded job goes (null).
    pub fn dismiss(&self, job: &Job) -> Result<(), JobError> {
        job.check(Verb::Dismiss)?;
        job.set(JobStatus::Null);
        self.map.borrow_mut().remove(&job.id);
        self.order.borrow_mut().retain(|j| *j != job.id);
        Ok(())
    }

    /// `job-finalize`: a job waiting in pending (auto-finalize off) concludes.
    pub fn finalize(&self, job: &Job) -> Result<(), JobError> {
        job.check(Verb::Finalize)?;
        if job.finalized.swap(true, SeqCst) {
            return Err(JobError::BadVerb {
                id: job.id.clone(),
                state: job.status().name(),
                verb: "finalize",
            });
        }
        job.wake();
        Ok(())
    }

    /// `job-pause`: the job pauses at its next pause point.
    pub fn pause(&self, job: &Job) -> Result<(), JobError> {
        job.check(Verb::Pause)?;
        {
            let mut p = lock(&job.pause);
            if p.user {
                return Err(JobError::AlreadyPaused);
            }
            p.user = true;
            p.count += 1;
        }
        job.wake();
        Ok(())
    }

    /// `job-resume`.
    pub fn resume(&self, job: &Job) -> Result<(), JobError> {
        {
            let p = *lock(&job.pause);
            if !p.user || p.count == 0 {
                return Err(JobError::NotPaused);
            }
        }
        job.check(Verb::Resume)?;
        {
            let mut p = lock(&job.pause);
            if p.user && p.count > 0 {
                p.user = false;
                p.count -= 1;
            }
        }
        job.wake();
        Ok(())
    }

    /// `job-cancel` (force) and `block-job-cancel`: a paused job is resumed to stop.
    pub fn cancel(&self, job: &Job, force: bool) -> Result<(), JobError> {
        job.cancel(force)
    }

    /// `block-job-cancel`: refused for a paused job unless forced, as QEMU.
    pub fn block_cancel(&self, job: &Job, force: bool) -> Result<(), JobError> {
        if lock(&job.pause).user && !force {
            return Err(JobError::Paused(job.id.clone()));
        }
        self.cancel(job, force)
    }

    /// `job-complete`: a ready job finishes its work.
    pub fn complete(&self, job: &Job) -> Result<(), JobError> {
        job.check(Verb::Complete)?;
        if job.pause_count() > 0 || job.is_cancelled() || !job.completable {
            return Err(JobError::CannotComplete(job.id.clone()));
        }
        job.complete_requested.store(true, SeqCst);
        job.wake();
        Ok(())
    }

    /// `block-job-change`: QEMU's verb check, then the job type's own.
    pub fn change(
        &self,
        job: &Job,
        options: &serde_json::Map<String, Value>,
    ) -> Result<(), JobError> {
        job.check(Verb::Change)?;
        let ext = lock(&job.ext).clone();
        match ext {
            Some(t) => t.change(options).map_err(JobError::Other),
            None => Err(JobError::Other("Job type does not support change".into())),
        }
    }

    /// `block-job-set-speed`.
    pub fn set_speed(&self, job: &Job, speed: i64) -> Result<(), JobError> {
        job.check(Verb::SetSpeed)?;
        let Ok(speed) = u64::try_from(speed) else {
            return Err(JobError::Speed);
        };
        let old = job.speed.swap(speed, SeqCst);
        *lock(&job.limit) = RateLimit::new(speed);
        if speed == 0 || speed > old {
            // A job asleep for the old limit goes on now.
            job.wake();
        }
        Ok(())
    }

    /// At the daemon's stop, as QEMU's job_cancel_sync_all: every job is cancelled (as
    /// `job-cancel` does, forced) and, once concluded, dismissed; completes when none is
    /// left.
    pub async fn cancel_all(&self) {
        // Newest first, one at a time, as QEMU walks its job list.
        loop {
            let newest = {
                let map = self.map.borrow();
                let order = self.order.borrow();
                order.iter().rev().find_map(|id| map.get(id).cloned())
            };
            let Some(job) = newest else { return };
            let _ = self.cancel(&job, true);
            // The job finishes on this loop: look again shortly.
            while job.status() != JobStatus::Concluded && self.map.borrow().contains_key(&job.id) {
                stord_aio::sleep(Duration::from_millis(1)).await;
            }
            if job.status() == JobStatus::Concluded {
                let _ = self.dismiss(&job);
            }
            self.map.borrow_mut().remove(&job.id);
            self.order.borrow_mut().retain(|j| *j != job.id);
        }
    }

    /// `query-jobs`: newest first.
    pub fn query(&self) -> Value {
        self.list(|j| Some(j.info()))
    }

    /// `query-block-jobs`: the block jobs, newest first.
    pub fn query_block(&self) -> Value {
        self.list(|j| j.block.then(|| j.block_info()))
    }

    fn list(&self, f: impl Fn(&Job) -> Option<Value>) -> Value {
        let map = self.map.borrow();
        Value::Array(
            self.order
                .borrow()
                .iter()
                .rev()
                .filter_map(|id| map.get(id).and_then(|j| f(j)))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn the_rate_limit_holds_a_slice_quota_and_pushes_the_slice_out() {
        let mut l = RateLimit::new(10 << 20);
        // 1 MiB per 100 ms slice: under it no wait, past it about the excess.
        assert_eq!(l.delay(512 << 10), Duration::ZERO);
        let d = l.delay(1536 << 10);
        assert!(
            d > Duration::from_millis(150) && d <= Duration::from_millis(200),
            "{d:?}"
        );
        assert_eq!(RateLimit::new(0).delay(u64::MAX / 2), Duration::ZERO);
    }

    #[test]
    fn copies_that_fail_together_under_stop_pause_the_job_once() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let events = Events::default();
        let jobs = Jobs::default();
        // A job that stays running until cancelled.
        jobs.start(
            "s",
            "create",
            JobOptions::plain(true, true),
            &events,
            |job| async move {
                while !job.is_cancelled() {
                    job.sleep(Duration::from_millis(1)).await;
                }
                Ok(None)
            },
        )
        .unwrap();
        ctx.block_on(async { stord_aio::yield_now().await });
        let job = jobs.get("s").unwrap();
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        for _ in 0..3 {
            assert_eq!(
                job.error_action(OnError::Stop, false, &full),
                ErrorAction::Stop
            );
        }
        assert!(job.pausing());
        // One resume resumes it, as QEMU's; a second finds nothing paused.
        jobs.resume(&job).unwrap();
        assert!(!job.pausing());
        assert!(matches!(jobs.resume(&job), Err(JobError::NotPaused)));
        jobs.cancel(&job, true).unwrap();
        ctx.block_on(async {
            for _ in 0..20 {
                stord_aio::sleep(Duration::from_millis(1)).await;
            }
        });
    }

    #[test]
    fn a_verb_between_the_jobs_look_and_its_sleep_cuts_the_sleep_short() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let events = Events::default();
        let jobs = Jobs::default();
        let looked = Rc::new(std::cell::Cell::new(false));
        let looked2 = looked.clone();
        jobs.start(
            "k",
            "create",
            JobOptions::plain(true, false),
            &events,
            move |job| async move {
                job.ratelimit().await;
                // The job has looked at its state; the verb lands before it sleeps.
                looked2.set(true);
                stord_aio::yield_now().await;
                let t0 = Instant::now();
                job.sleep(Duration::from_secs(2)).await;
                match t0.elapsed() < Duration::from_secs(1) {
                    true => Ok(None),
                    false => Err("slept through the verb".into()),
                }
            },
        )
        .unwrap();
        let job = jobs.get("k").unwrap();
        let j = jobs.clone();
        ctx.block_on(async move {
            while !looked.get() {
                stord_aio::yield_now().await;
            }
            j.set_speed(&job, 0).unwrap();
            while job.status() != JobStatus::Concluded {
                stord_aio::sleep(Duration::from_millis(1)).await;
            }
        });
        assert_eq!(jobs.query()[0]["status"], "concluded");
        assert_eq!(jobs.query()[0].get("error"), None, "{}", jobs.query());
    }

    #[test]
    fn verbs_follow_qemus_table() {
        use JobStatus::*;
        assert!(Verb::Complete.allowed(Ready) && !Verb::Complete.allowed(Running));
        assert!(Verb::Cancel.allowed(Pending) && !Verb::Cancel.allowed(Concluded));
        assert!(Verb::Pause.allowed(Standby) && !Verb::Pause.allowed(Waiting));
        assert!(Verb::Dismiss.allowed(Concluded) && !Verb::Dismiss.allowed(Aborting));
    }

    #[test]
    fn states_follow_qemus_order_with_and_without_auto_finalize() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let events = Events::default();
        let seen = crate::events::Recorder::listen(&events);
        let jobs = Jobs::default();
        let manual = JobOptions::plain(false, true);
        jobs.start("a", "create", manual, &events, |_| async { Ok(None) })
            .unwrap();
        let auto = JobOptions::plain(true, false);
        jobs.start("b", "create", auto, &events, |_| async {
            Err("no".to_string())
        })
        .unwrap();
        assert!(matches!(
            jobs.start(
                "b",
                "create",
                JobOptions::plain(true, true),
                &events,
                |_| async { Ok(None) }
            ),
            Err(JobError::IdInUse(_))
        ));
        assert!(matches!(
            jobs.dismiss(&jobs.get("a").unwrap()),
            Err(JobError::BadVerb { .. })
        ));
        ctx.block_on(async {
            for _ in 0..10 {
                stord_aio::yield_now().await;
            }
        });
        // a waits in pending for job-finalize; b failed and stays concluded.
        assert_eq!(jobs.query()[1]["status"], "pending");
        assert_eq!(jobs.query()[0]["error"], "no");
        jobs.finalize(&jobs.get("a").unwrap()).unwrap();
        ctx.block_on(async {
            for _ in 0..10 {
                stord_aio::yield_now().await;
            }
        });
        jobs.dismiss(&jobs.get("b").unwrap()).unwrap();
        // Each status change as "id:status".
        let got: Vec<String> = seen
            .got
            .borrow()
            .iter()
            .map(|e| {
                format!(
                    "{}:{}",
                    e["data"]["id"].as_str().unwrap(),
                    e["data"]["status"].as_str().unwrap()
                )
            })
            .collect();
        let of = |id: &str| -> Vec<String> {
            got.iter()
                .filter(|e| e.starts_with(&format!("{id}:")))
                .map(|e| e[2..].to_string())
                .collect()
        };
        assert_eq!(
            of("a"),
            [
                "created",
                "running",
                "waiting",
                "pending",
                "concluded",
                "null"
            ]
        );
        assert_eq!(
            of("b"),
            ["created", "running", "aborting", "concluded", "null"]
        );
        assert_eq!(jobs.query(), Value::Array(vec![]));
    }
}
