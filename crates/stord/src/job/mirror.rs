//! Mirror (blockdev-mirror, and block-commit of the active layer, which QEMU runs as a
//! mirror into the base): the source's content is copied to the target while clients
//! keep writing to the source. A tracker bitmap on the source records every write; the
//! job copies what it marks, a run at a time, until nothing is left (ready), and goes on
//! copying new writes while ready. On `job-complete` it holds the links of the exports
//! that serve the source (new requests wait, those in flight finish), copies the rest,
//! flushes the target, and at finalize points those exports at the target with their
//! permissions (QEMU's mirror_exit_common and bdrv_replace_node). Cancelled without force
//! once ready, it stops in step the same way but leaves the exports where they are.
//!
//! As QEMU's mirror, the copy runs as several operations at once (up to
//! [`MAX_IN_FLIGHT`], holding at most `buf-size` bytes, each a dirty run of up to
//! `buf-size / 16` or 1 MiB), on the thread that serves the source ([`super::home`]).
//! Operations on overlapping granules wait for each other, so the copy that read the
//! newer data lands last.

use std::sync::Arc;
use std::time::Duration;

use super::copy_job::{copy_range, CopyError, Runs};
use super::handle::Job;
use super::home::Home;
use super::in_flight::{stopped, InFlight};
use super::job_loop::{follow, Step};
use super::known_zero::KnownZero;
use super::on_error::{ErrorAction, OnError};
use super::options::{Finish, Holds};
use super::stay::Stay;
use super::write_blocking::{MirrorType, WriteBlocking};
use crate::block::node::block_node::BlockNode;
use crate::block::node::block_node::Claim;
use crate::block::node::blocker::JobAttachment;
use crate::block::node::dirty_bitmap::DirtyBitmap;
use crate::block::node::hook_on::HookOn;
use crate::block::node::link::{Hold, NodeLink};
use crate::block::node::perm::Perm;

/// Copy operations in flight at most (QEMU's MAX_IN_FLIGHT).
pub const MAX_IN_FLIGHT: usize = 16;

/// The least one operation may copy at most (QEMU's MAX_IO_BYTES): a larger `buf-size`
/// makes operations larger.
const MAX_IO_BYTES: u64 = 1 << 20;

/// The buffer a mirror copies through when `buf-size` is not given (QEMU's
/// DEFAULT_MIRROR_BUF_SIZE).
pub const DEFAULT_BUF_SIZE: u64 = MAX_IN_FLIGHT as u64 * MAX_IO_BYTES;

/// How long a ready job with nothing to copy waits before it looks again (QEMU's
/// BLOCK_JOB_SLICE_TIME); a verb wakes it sooner.
const IDLE: Duration = Duration::from_millis(100);

/// What the first pass copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Everything the source reads (`sync=full`); unallocated ranges become zeroes.
    Full,
    /// What the source holds itself, not its backing chain (`sync=top`).
    Top,
    /// Nothing: only what clients write from now on (`sync=none`).
    None,
    /// What the images above the base hold, the base at this allocation depth below the
    /// source (an active commit: the base is the target).
    AboveBase(u32),
}

/// What the target holds when a `sync=full` mirror starts (QEMU's zero_target and
/// bdrv_has_zero_init): what the first pass must copy follows from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetStart {
    /// Anything: every byte is copied (zeroes written where the source has none).
    Unknown,
    /// A fresh image that reads as zeroes: only what the source's chain holds is copied.
    ReadsZero,
    /// Zeroed first (with unmap, as QEMU does), then as [`TargetStart::ReadsZero`].
    ZeroFirst,
}

/// What the daemon does for a mirror: find and move the exports on a node.
pub trait Parents {
    /// The links of the exports that serve `node` now.
    fn links_on(&self, node: &Arc<BlockNode>) -> Vec<Arc<NodeLink>>;
    /// The thread that serves `node` now (where the job's loop and copies run); None
    /// when it cannot be looked up just now.
    fn home_of(&self, node: &Arc<BlockNode>) -> Option<Home>;
    /// Points the exports on `from` whose links are `links` (those held) at `to`, their
    /// permissions moved with them (all or nothing).
    fn replace(
        &self,
        links: &[Arc<NodeLink>],
        from: &Arc<BlockNode>,
        to: &Arc<BlockNode>,
    ) -> Result<(), String>;
}

/// The tracker bitmap, taken off the source when the job ends however it ends, with the
/// write-blocking hook.
struct Tracker {
    node: Arc<BlockNode>,
    bitmap: Arc<DirtyBitmap>,
    _hook: HookOn,
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.node.forget_bitmap(&self.bitmap);
    }
}

/// A mirror job's nodes and settings.
pub struct Mirror {
    pub source: Arc<BlockNode>,
    pub target: Arc<BlockNode>,
    pub scope: Scope,
    /// Bytes per bit of the tracker.
    pub granularity: u64,
    /// The most the copies in flight hold at once (`buf-size`).
    pub buf_size: u64,
    /// Zero ranges may be left unallocated in the target.
    pub unmap: bool,
    /// What the target holds at the start (`sync=full`).
    pub target_start: TargetStart,
    /// `copy-mode=write-blocking`, and the job's copies held against such writes (see
    /// [`super::write_blocking`]).
    pub active: Arc<WriteBlocking>,
    pub on_source_error: OnError,
    pub on_target_error: OnError,
    /// The job's write claim on the target, given up before the exports move there.
    pub target_claim: Claim,
    /// The job's user of the target (QEMU's BlockBackend there).
    pub target_attached: JobAttachment,
    /// Held until the job ends.
    pub holds: Holds,
    pub parents: Box<dyn Parents>,
}

/// What one range needs.
enum Action {
    Skip,
    Zero,
    Copy,
}

/// What a copy operation needs, sent to the thread it runs on.
#[derive(Clone)]
struct Copier {
    source: Arc<BlockNode>,
    target: Arc<BlockNode>,
    scope: Scope,
    unmap: bool,
    active: Arc<WriteBlocking>,
}

/// A finished copy operation: its range, and the bytes copied or the error with whether
/// it was the source's.
struct Copied {
    offset: u64,
    len: u64,
    result: Result<u64, CopyError>,
}

impl Copier {
    fn action(&self, depth: u32) -> Action {
        match (self.scope, depth) {
            (Scope::AboveBase(base), d) if d == 0 || d >= base => Action::Skip,
            (_, 0) => Action::Zero,
            _ => Action::Copy,
        }
    }

    /// Brings `[offset, offset + len)` of the target in step with the source: the bytes
    /// copied, or the error with whether it was the source's.
    async fn copy(&self, offset: u64, len: u64) -> Result<u64, CopyError> {
        let end = (offset + len).min(self.source.size());
        // Against write-blocking writes and other copies of these granules: the data
        // read here lands before theirs.
        let _held = self.active.hold_copy(offset, end - offset).await;
        let mut runs = Runs::new(&self.source, offset, end);
        let mut copied = 0;
        while let Some(run) = runs.next().await {
            let (at, n, depth) = run?;
            match self.action(depth) {
                Action::Skip => {}
                Action::Zero => self.zero(at, n).await?,
                Action::Copy if self.active.known_zero().is_some() => {
                    copied += self.copy_or_zero(at, n).await?;
                }
                Action::Copy => {
                    copy_range(&self.source, &self.target, at, n).await?;
                    copied += n;
                }
            }
        }
        Ok(copied)
    }

    /// Zeroes to the target, skipped where it reads as zeroes already.
    async fn zero(&self, at: u64, n: u64) -> Result<(), CopyError> {
        let r = self.active.zero_target(at, n, self.unmap).await;
        r.map(drop).map_err(|e| (e, false))
    }

    /// A `sync=full` copy of an allocated run (QEMU's mirror_iteration by block status):
    /// what the source reads as zeroes goes as zeroes ([`Copier::zero`]), the rest as data;
    /// the bytes copied.
    async fn copy_or_zero(&self, at: u64, n: u64) -> Result<u64, CopyError> {
        let (mut pos, end, mut copied) = (at, at + n, 0);
        while pos < end {
            let st = self
                .source
                .block_status(pos, end - pos)
                .await
                .map_err(|e| (e, true))?;
            let len = st.len.min(end - pos);
            if st.zero {
                self.zero(pos, len).await?;
            } else {
                self.active.target_changes(pos, len);
                copy_range(&self.source, &self.target, pos, len).await?;
                copied += len;
            }
            pos += len;
        }
        Ok(copied)
    }
}

/// What the mirror's loop needs, sent to the thread that serves the source.
#[derive(Clone)]
struct Looper {
    copier: Copier,
    /// The tracker bitmap: what is still to be copied.
    dirty: Arc<DirtyBitmap>,
    granularity: u64,
    buf_size: u64,
    target_start: TargetStart,
    on_source_error: OnError,
    on_target_error: OnError,
}

/// Where the mirror's loop is, carried to the next thread when the source moves.
#[derive(Clone, Copy, Default)]
struct At {
    /// The first pass's marks are made.
    marked: bool,
    /// Where the next dirty run is looked for.
    cursor: u64,
}

impl Looper {
    /// Marks what the first pass copies.
    async fn mark_initial(&self) -> Result<(), String> {
        let (source, target, t) = (&self.copier.source, &self.copier.target, &self.dirty);
        let size = source.size();
        let scope = self.copier.scope;
        let wanted = |depth: u32| match scope {
            Scope::Full => depth >= 1,
            Scope::Top => depth == 1,
            Scope::None => false,
            Scope::AboveBase(b) => depth >= 1 && depth < b,
        };
        match scope {
            Scope::None => return Ok(()),
            Scope::Full => {
                let zeroed = match self.target_start {
                    TargetStart::Unknown => false,
                    TargetStart::ReadsZero => true,
                    TargetStart::ZeroFirst => target.write_zeroes(0, size, true).await.is_ok(),
                };
                let known = KnownZero::new(self.granularity, size, zeroed);
                self.copier.active.track_zeroes(known);
                if !zeroed {
                    t.set_granules(0, size.div_ceil(self.granularity));
                    return Ok(());
                }
            }
            _ => {}
        }
        let mut at = 0;
        while at < size {
            let (n, depth) = source
                .driver()
                .allocation_depth(at, (size - at).min(1 << 30))
                .await
                .map_err(|e| e.to_string())?;
            let n = n.max(1);
            if wanted(depth) {
                t.mark(at, n);
            }
            at += n;
        }
        Ok(())
    }

    /// The most one operation copies (QEMU's max_io_bytes).
    fn op_bytes(&self) -> u64 {
        (self.buf_size / MAX_IN_FLIGHT as u64).max(MAX_IO_BYTES)
    }

    /// Whether another operation may start beside those in flight (one at a time under
    /// a speed limit).
    fn has_room(&self, job: &Job, ops: &InFlight<Copied>) -> bool {
        let (n, bytes) = ops.load();
        n == 0 || (!job.limited() && n < MAX_IN_FLIGHT && bytes + self.op_bytes() <= self.buf_size)
    }

    /// Starts copying `[offset, offset + len)` on `here` (the loop's own thread).
    fn start(&self, ops: &InFlight<Copied>, here: &Home, offset: u64, len: u64) {
        let c = self.copier.clone();
        let lost = Copied {
            offset,
            len,
            result: Err((stopped(), false)),
        };
        ops.start(here, len, lost, move || async move {
            // Where the job's copies ran, in the loop's statistics (`x-stats`).
            stord_aio::with_current_context(|l| l.counter("job.copies").add(1));
            let result = c.copy(offset, len).await;
            Copied {
                offset,
                len,
                result,
            }
        });
    }
}

/// Runs a mirror job: the whole source marked dirty, copied until the job is told to
/// complete (or cancelled once ready), then the last writes in step and the pivot at
/// finalize. The copying runs on the source's thread ([`Home::drive`]).
pub async fn run(m: Mirror, job: Arc<Job>) -> Result<Finish, String> {
    m.fit_target().await?;
    let bitmap = DirtyBitmap::tracker(job.id(), m.granularity, m.source.size())
        .map_err(|e| e.to_string())?;
    let tracker = Tracker {
        bitmap: m.source.add_tracker(bitmap),
        node: m.source.clone(),
        _hook: HookOn::install(&m.source, m.active.clone()),
    };
    m.active.set_tracker(tracker.bitmap.clone());
    if !matches!(m.scope, Scope::AboveBase(_)) {
        // A mirror's copy mode can change; an active commit's cannot (QEMU's drivers).
        job.set_type(Arc::new(MirrorType(m.active.clone())));
    }
    let l = m.looper(&tracker.bitmap);
    if !m.copy_until_told(&job, &l).await? {
        return Ok(None);
    }
    m.finish_in_step(&job, &l, tracker).await
}

impl Mirror {
    fn looper(&self, dirty: &Arc<DirtyBitmap>) -> Looper {
        Looper {
            copier: Copier {
                source: self.source.clone(),
                target: self.target.clone(),
                scope: self.scope,
                unmap: self.unmap,
                active: self.active.clone(),
            },
            dirty: dirty.clone(),
            granularity: self.granularity,
            buf_size: self.buf_size,
            target_start: self.target_start,
            on_source_error: self.on_source_error,
            on_target_error: self.on_target_error,
        }
    }

    /// The target's size against the source's: a commit's base grows to it first, as
    /// QEMU's mirror_run does; otherwise they must be equal (QEMU finds this once the job
    /// runs: the job fails, not the command).
    async fn fit_target(&self) -> Result<(), String> {
        let len = self.source.size();
        if let Scope::AboveBase(_) = self.scope {
            if self.target.size() < len {
                self.target.resize(len).await.map_err(|e| e.to_string())?;
            }
        } else if self.target.size() != len {
            return Err("Source and target image have different sizes".into());
        }
        Ok(())
    }

    /// The first pass marked, then copies what is dirty and waits in ready, on the
    /// source's thread (following it when it moves), until the job is told to complete
    /// or cancelled softly (true) or cancelled (false). Whatever ends it, the operations
    /// it started have finished when it returns.
    async fn copy_until_told(&self, job: &Arc<Job>, l: &Looper) -> Result<bool, String> {
        let (looping, l) = (job.clone(), l.clone());
        let run = move |mut at: At, stay: Stay, here: Home| async move {
            if !at.marked && !looping.is_cancelled() {
                l.mark_initial().await?;
                at.marked = true;
            }
            let ops = InFlight::new();
            let r = l
                .copy_loop(&looping, &mut at.cursor, &stay, &here, &ops)
                .await;
            for done in ops.drain().await {
                if done.result.is_err() {
                    l.dirty.mark(done.offset, done.len);
                }
            }
            r.map(|step| match step {
                Step::Done(told) => Step::Done(told),
                Step::Moved(()) => Step::Moved(at),
            })
        };
        let home = || self.parents.home_of(&self.source);
        follow(job, &self.source, &home, At::default(), run).await
    }
}

impl Looper {
    async fn copy_loop(
        &self,
        job: &Job,
        cursor: &mut u64,
        stay: &Stay,
        here: &Home,
        ops: &InFlight<Copied>,
    ) -> Result<Step<bool, ()>, String> {
        let t = &self.dirty;
        let active = &self.copier.active;
        loop {
            while let Some(done) = ops.next_to_settle(job.pausing()).await {
                self.settle(job, done).await?;
            }
            job.progress_grow(active.take_synced());
            job.set_remaining(t.count() + ops.load().1);
            job.ratelimit().await;
            if job.is_cancelled() {
                job.progress_grow(active.take_synced());
                return Ok(Step::Done(false));
            }
            let moved = stay.moved();
            if moved || !self.has_room(job, ops) {
                match ops.next().await {
                    Some(done) => self.settle(job, done).await?,
                    None if moved => return Ok(Step::Moved(())),
                    None => {}
                }
                continue;
            }
            match t.take_dirty(*cursor, self.op_bytes()) {
                Some((offset, len)) => {
                    *cursor = offset + len;
                    self.start(ops, here, offset, len);
                }
                None if !ops.is_empty() => {
                    if let Some(done) = ops.next().await {
                        self.settle(job, done).await?;
                    }
                }
                None if job.complete_requested() || job.soft_cancelled() => {
                    return Ok(Step::Done(true))
                }
                None => {
                    job.set_ready();
                    active.went_ready();
                    job.sleep(IDLE).await;
                }
            }
        }
    }

    /// Counts a finished operation; a failed one is marked to be copied again, whatever
    /// the policy says now, and the policy applied.
    async fn settle(&self, job: &Job, done: Copied) -> Result<(), String> {
        match done.result {
            // The limit counts what was copied (zeroes and skipped runs are free, as
            // QEMU counts them).
            Ok(copied) => {
                job.progress_add(done.len);
                job.ratelimit_processed(copied);
            }
            Err((e, read)) => {
                self.dirty.mark(done.offset, done.len);
                self.on_copy_error(job, e, read).await?;
            }
        }
        Ok(())
    }

    /// What a failed copy does, as `on-source-error` / `on-target-error` say.
    async fn on_copy_error(&self, job: &Job, e: std::io::Error, read: bool) -> Result<(), String> {
        let on = if read {
            self.on_source_error
        } else {
            self.on_target_error
        };
        match job.error_action(on, read, &e) {
            ErrorAction::Report => return Err(e.to_string()),
            ErrorAction::Stop => {}
            ErrorAction::Ignore => job.sleep(IDLE).await,
        }
        Ok(())
    }

    /// Copies what is still dirty while the exports are held: operations in flight as
    /// in the copy loop; the first error fails the job (what failed stays marked: the
    /// exports stay on the source, and the record stays true while the job lasts).
    async fn copy_rest(&self, job: &Job, here: &Home) -> Result<(), String> {
        let t = &self.dirty;
        let ops = InFlight::new();
        let mut failed = None;
        loop {
            let next = if failed.is_none() && self.has_room(job, &ops) {
                t.take_dirty(0, self.op_bytes())
            } else {
                None
            };
            if let Some((offset, len)) = next {
                self.start(&ops, here, offset, len);
                continue;
            }
            // Nothing more to start: the next to finish, until none is left.
            let Some(done) = ops.next().await else {
                break;
            };
            match done.result {
                Ok(_) => job.progress_add(done.len),
                Err((e, _)) => {
                    t.mark(done.offset, done.len);
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e.to_string()),
            None => Ok(()),
        }
    }
}

impl Mirror {
    /// In step: the exports on the source wait at their door while the last writes are
    /// copied (on the source's thread); they stay held until the graph change at
    /// finalize (QEMU's drained section), which moves them to the target if the job was
    /// told to complete.
    async fn finish_in_step(
        self,
        job: &Arc<Job>,
        l: &Looper,
        tracker: Tracker,
    ) -> Result<Finish, String> {
        let mut held: Vec<Hold> = Vec::new();
        for link in self.parents.links_on(&self.source) {
            held.push(link.hold().await);
        }
        let here = self.parents.home_of(&self.source).unwrap_or_default();
        let (job2, l, there) = (job.clone(), l.clone(), here.clone());
        let lost = Err(stopped().to_string());
        here.drive(
            lost,
            move || async move { l.copy_rest(&job2, &there).await },
        )
        .await?;
        job.set_remaining(0);
        self.target.flush().await.map_err(|e| e.to_string())?;
        let pivot = job.complete_requested() && !job.soft_cancelled();
        let mut m = self;
        Ok(Some(Box::pin(async move {
            let r = if pivot {
                // The job's own write permission on the target goes first: the exports'
                // take its place.
                let _ = m.target_claim.set(Perm::NONE, Perm::ALL);
                let links: Vec<Arc<NodeLink>> = held.iter().map(|h| h.link().clone()).collect();
                let r = m.parents.replace(&links, &m.source, &m.target);
                if r.is_ok() {
                    // The target serves the exports now: it stays writable.
                    m.holds.reopened.keep();
                }
                r
            } else {
                Ok(())
            };
            drop(held);
            drop(tracker);
            r
        })))
    }
}
