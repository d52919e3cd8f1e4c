//! Mirror (blockdev-mirror, and block-commit of the active layer, which QEMU runs as a
//! mirror into the base): the source's content is copied to the target while clients
//! keep writing to the source. A tracker bitmap on the source records every write; the
//! job copies what it marks, a run at a time, until nothing is left (ready), and goes on
//! copying new writes while ready. On `job-complete` it holds the links of the exports
//! that serve the source (new requests wait, those in flight finish), copies the rest,
//! flushes the target, and at finalize points those exports at the target with their
//! permissions (QEMU's mirror_exit_common and bdrv_replace_node). Cancelled without force
//! once ready, it stops in step the same way but leaves the exports where they are.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use super::write_blocking::{MirrorType, WriteBlocking};
use super::{ErrorAction, Finish, Holds, Job, OnError};
use crate::block::blocker::JobAttachment;
use crate::block::dirty_bitmap::DirtyBitmap;
use crate::block::hook::HookOn;
use crate::block::link::{Hold, NodeLink};
use crate::block::perm::{Claim, Perm};
use crate::block::{request_buf, BlockNode};

/// How much one step copies at most.
const CHUNK: u64 = 1 << 20;

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

impl Mirror {
    fn action(&self, depth: u32) -> Action {
        match (self.scope, depth) {
            (Scope::AboveBase(base), d) if d == 0 || d >= base => Action::Skip,
            (_, 0) => Action::Zero,
            _ => Action::Copy,
        }
    }

    /// Marks what the first pass copies.
    async fn mark_initial(&self, t: &DirtyBitmap) -> Result<(), String> {
        let size = self.source.size();
        let wanted = |depth: u32| match self.scope {
            Scope::Full => depth >= 1,
            Scope::Top => depth == 1,
            Scope::None => false,
            Scope::AboveBase(b) => depth >= 1 && depth < b,
        };
        match self.scope {
            Scope::None => return Ok(()),
            Scope::Full => {
                let zeroed = match self.target_start {
                    TargetStart::Unknown => false,
                    TargetStart::ReadsZero => true,
                    TargetStart::ZeroFirst => self.target.write_zeroes(0, size, true).await.is_ok(),
                };
                if !zeroed {
                    t.set_granules(0, size.div_ceil(self.granularity));
                    return Ok(());
                }
            }
            _ => {}
        }
        let mut at = 0;
        while at < size {
            let (n, depth) = self
                .source
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

    /// Brings `[offset, offset + len)` of the target in step with the source: the bytes
    /// copied, or the error with whether it was the source's.
    async fn copy(&self, offset: u64, len: u64) -> Result<u64, (std::io::Error, bool)> {
        let end = (offset + len).min(self.source.size());
        // Against write-blocking writes: the data read here lands before theirs.
        let _held = self.active.hold_copy(offset, end - offset).await;
        let mut at = offset;
        let mut copied = 0;
        while at < end {
            let (n, depth) = self
                .source
                .driver()
                .allocation_depth(at, end - at)
                .await
                .map_err(|e| (e, true))?;
            let n = n.clamp(1, end - at);
            match self.action(depth) {
                Action::Skip => {}
                Action::Zero => self
                    .target
                    .write_zeroes(at, n, self.unmap)
                    .await
                    .map_err(|e| (e, false))?,
                Action::Copy => {
                    let (r, buf) = self.source.read(at, request_buf(n as usize)).await;
                    r.map_err(|e| (e, true))?;
                    let (r, _) = self.target.write(at, buf, false).await;
                    r.map_err(|e| (e, false))?;
                    copied += n;
                }
            }
            at += n;
        }
        Ok(copied)
    }
}

/// Runs a mirror job: the whole source marked dirty, copied until the job is told to
/// complete (or cancelled once ready), then the last writes in step and the pivot at
/// finalize.
pub async fn run(m: Mirror, job: Rc<Job>) -> Result<Finish, String> {
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
        job.set_type(Rc::new(MirrorType(m.active.clone())));
    }
    m.mark_initial(&tracker.bitmap).await?;
    if !m.copy_until_told(&job, &tracker.bitmap).await? {
        return Ok(None);
    }
    m.finish_in_step(&job, tracker).await
}

impl Mirror {
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

    /// Copies what is dirty, then waits in ready, until the job is told to complete or
    /// cancelled softly (true) or cancelled (false).
    async fn copy_until_told(&self, job: &Rc<Job>, t: &DirtyBitmap) -> Result<bool, String> {
        let mut cursor = 0;
        loop {
            job.progress_grow(self.active.take_synced());
            job.set_remaining(t.count());
            job.ratelimit().await;
            if job.is_cancelled() {
                job.progress_grow(self.active.take_synced());
                return Ok(false);
            }
            match t.take_dirty(cursor, CHUNK) {
                Some((offset, len)) => match self.copy(offset, len).await {
                    Ok(copied) => {
                        cursor = offset + len;
                        job.progress_add(len);
                        job.ratelimit_processed(copied);
                    }
                    Err((e, read)) => {
                        // Copied again later, whatever the policy says now.
                        t.mark(offset, len);
                        self.on_copy_error(job, e, read).await?;
                    }
                },
                None if job.complete_requested() || job.soft_cancelled() => return Ok(true),
                None => {
                    job.set_ready();
                    self.active.went_ready();
                    job.sleep(IDLE).await;
                }
            }
        }
    }

    /// What a failed copy does, as `on-source-error` / `on-target-error` say.
    async fn on_copy_error(
        &self,
        job: &Rc<Job>,
        e: std::io::Error,
        read: bool,
    ) -> Result<(), String> {
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

    /// In step: the exports on the source wait at their door while the last writes are
    /// copied; they stay held until the graph change at finalize (QEMU's drained
    /// section), which moves them to the target if the job was told to complete.
    async fn finish_in_step(self, job: &Rc<Job>, tracker: Tracker) -> Result<Finish, String> {
        let t = &tracker.bitmap;
        let mut held: Vec<Hold> = Vec::new();
        for link in self.parents.links_on(&self.source) {
            held.push(link.hold().await);
        }
        while let Some((offset, len)) = t.take_dirty(0, CHUNK) {
            if let Err((e, _)) = self.copy(offset, len).await {
                // The job fails and the exports stay on the source: nothing to copy later,
                // but the record stays true while the job lasts.
                t.mark(offset, len);
                return Err(e.to_string());
            }
            job.progress_add(len);
        }
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
