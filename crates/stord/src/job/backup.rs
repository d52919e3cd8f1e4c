//! Backup (blockdev-backup): the target gets the source's content as it was when the job
//! was made, while clients keep writing to the source. Copy-before-write
//! ([`crate::block::copy_before_write`]) keeps the point in time; the job copies what is
//! still to be copied in the background, a chunk at a time (`sync=none` copies nothing
//! itself and runs until cancelled: the fleecing case, where the target is read while
//! the job lasts).
//!
//! A `bitmap` is handled as QEMU's successor scheme: while the job runs the bitmap is busy
//! and stops recording, and a successor records the writes; when the job ends, the bitmap
//! becomes the successor (synced: `on-success` that succeeded, `always`) or gets the
//! successor's bits back on top of its own (`never`, or a failure), and `always` that
//! failed also gets back what was not copied.

use std::sync::Arc;
use std::time::Duration;

use super::{ErrorAction, Finish, Holds, Job, OnError};
use crate::block::blocker::JobAttachment;
use crate::block::copy_before_write::CopyBeforeWrite;
use crate::block::dirty_bitmap::DirtyBitmap;
use crate::block::hook::HookOn;
use crate::block::BlockNode;

/// How much one copy moves at most.
const CHUNK: u64 = 1 << 20;

/// Copies in flight at once (QEMU's block-copy runs up to 64 workers; a few keep the
/// storage's queue busy without holding much memory).
const IN_FLIGHT: usize = 8;

/// How long a `sync=none` job sleeps between looks at its progress (a verb wakes it).
const IDLE: Duration = Duration::from_millis(100);

/// QEMU's BitmapSyncMode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BitmapMode {
    OnSuccess,
    Never,
    Always,
}

impl BitmapMode {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "on-success" => BitmapMode::OnSuccess,
            "never" => BitmapMode::Never,
            "always" => BitmapMode::Always,
            _ => return None,
        })
    }
}

/// A bitmap a backup reads and then syncs (QEMU's frozen bitmap and its successor).
pub struct SyncBitmap {
    node: Arc<BlockNode>,
    bitmap: Arc<DirtyBitmap>,
    /// Records the writes while the job runs.
    successor: Arc<DirtyBitmap>,
    mode: BitmapMode,
    was_recording: bool,
    /// What was not copied, for `always` after a failure.
    copy: Arc<CopyBeforeWrite>,
    resolved: bool,
}

impl SyncBitmap {
    /// Freezes `bitmap` of `node` and starts its successor.
    pub fn freeze(
        node: &Arc<BlockNode>,
        bitmap: Arc<DirtyBitmap>,
        mode: BitmapMode,
        copy: Arc<CopyBeforeWrite>,
    ) -> Result<Self, String> {
        let was_recording = bitmap.is_recording();
        let successor = DirtyBitmap::tracker(&bitmap.name, bitmap.granularity(), node.size())
            .map_err(|e| e.to_string())?;
        successor.set_recording(was_recording);
        let successor = node.add_tracker(successor);
        bitmap.set_recording(false);
        bitmap.set_busy(true);
        Ok(SyncBitmap {
            node: node.clone(),
            bitmap,
            successor,
            mode,
            was_recording,
            copy,
            resolved: false,
        })
    }

    /// QEMU's backup_cleanup_sync_bitmap: how the job ended decides what the bitmap is.
    fn resolve(&mut self, succeeded: bool) {
        if self.resolved {
            return;
        }
        self.resolved = true;
        self.node.forget_bitmap(&self.successor);
        let synced =
            (succeeded || self.mode == BitmapMode::Always) && self.mode != BitmapMode::Never;
        if synced {
            self.bitmap.clear();
        }
        self.bitmap.merge(&self.successor);
        self.bitmap.set_recording(true);
        if !succeeded && self.mode == BitmapMode::Always {
            for (o, l) in self.copy.uncopied() {
                self.bitmap.mark(o, l);
            }
        }
        self.bitmap.set_recording(self.was_recording);
        self.bitmap.set_busy(false);
    }
}

impl Drop for SyncBitmap {
    fn drop(&mut self) {
        self.resolve(false);
    }
}

/// What the job copies itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// What the copy set holds (`full`, `top`, `bitmap`).
    Copy,
    /// Nothing: copy-before-write only, until cancelled (`none`).
    None,
}

/// A backup job's state.
pub struct Backup {
    pub copy: Arc<CopyBeforeWrite>,
    pub sync: Sync,
    pub bitmap: Option<SyncBitmap>,
    pub on_source_error: OnError,
    pub on_target_error: OnError,
    /// The copy-before-write hook on the source (and the point-in-time hook on a target
    /// that reads through to it); removed when the job ends.
    pub hooks: Vec<HookOn>,
    pub holds: Holds,
    pub target_attached: JobAttachment,
}

impl Backup {
    fn progress(&self, job: &Job) {
        let done = self.copy.copied();
        job.set_progress(done, done + self.copy.remaining());
    }
}

/// The next chunks to copy from `offset` on, in order, at most [`IN_FLIGHT`] (none past
/// the end once the search wraps around).
fn next_chunks(copy: &CopyBeforeWrite, offset: u64) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::new();
    let mut from = offset;
    while out.len() < IN_FLIGHT {
        match copy.next(from) {
            Some(at) if out.last().is_none_or(|&l| at > l) => {
                out.push(at);
                from = at + CHUNK;
            }
            _ => break,
        }
    }
    out
}

/// Runs a backup: what is to be copied is copied (or, with `sync=none`, the job waits to
/// be cancelled); at finalize the bitmap is synced, then the hooks go.
pub async fn run(mut b: Backup, job: std::rc::Rc<Job>) -> Result<Finish, String> {
    b.progress(&job);
    if b.sync == Sync::None {
        while !job.is_cancelled() {
            job.sleep(IDLE).await;
            b.progress(&job);
        }
        return Ok(None);
    }
    let mut offset = 0;
    loop {
        job.ratelimit().await;
        if job.is_cancelled() {
            return Ok(None);
        }
        let batch = next_chunks(&b.copy, offset);
        let Some(&last) = batch.last() else {
            break;
        };
        let before = b.copy.copied();
        let copies: Vec<_> = batch
            .iter()
            .map(|&at| {
                let copy = b.copy.clone();
                stord_aio::spawn(async move { copy.copy(at, CHUNK).await })
            })
            .collect();
        let mut failed = None;
        for c in copies {
            if let Err(e) = c.await {
                failed.get_or_insert(e);
            }
        }
        job.ratelimit_processed(b.copy.copied().saturating_sub(before));
        offset = last + CHUNK;
        if let Some(e) = failed {
            let policy = if e.read {
                b.on_source_error
            } else {
                b.on_target_error
            };
            // Stop pauses the job (what failed is tried again once resumed); ignore
            // tries again at once, as QEMU's backup_loop does.
            if job.error_action(policy, e.read, &e.error) == ErrorAction::Report {
                b.progress(&job);
                return Err(crate::block::os_text(&e.error));
            }
        }
        b.progress(&job);
    }
    b.progress(&job);
    Ok(Some(Box::pin(async move {
        if let Some(bm) = &mut b.bitmap {
            bm.resolve(true);
        }
        drop(b);
        Ok(())
    })))
}
