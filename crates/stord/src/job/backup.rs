//! Backup (blockdev-backup): the target gets the source's content as it was when the job
//! was made, while clients keep writing to the source. Copy-before-write
//! ([`crate::block::drivers::copy_before_write::block_copy`]) keeps the point in time;
//! the job copies what is still to be copied in the background, a chunk at a time
//! (`sync=none` copies nothing itself and runs until cancelled: the fleecing case, where
//! the target is read while the job lasts).
//!
//! A `bitmap` is handled as QEMU's successor scheme: while the job runs the bitmap is busy
//! and stops recording, and a successor records the writes; when the job ends, the bitmap
//! becomes the successor (synced: `on-success` that succeeded, `always`) or gets the
//! successor's bits back on top of its own (`never`, or a failure), and `always` that
//! failed also gets back what was not copied.

use std::sync::Arc;
use std::time::Duration;

use super::handle::Job;
use super::home::Home;
use super::in_flight::{stopped, InFlight};
use super::job_loop::{follow, FindHome, Step};
use super::on_error::{ErrorAction, OnError};
use super::options::{Finish, Holds};
use super::stay::Stay;
use crate::block::drivers::copy_before_write::block_copy::{CopyBeforeWrite, CopyError};
use crate::block::node::block_node::BlockNode;
use crate::block::node::blocker::JobAttachment;
use crate::block::node::dirty_bitmap::DirtyBitmap;
use crate::block::node::hook_on::HookOn;

/// How much one copy moves at most.
const CHUNK: u64 = 1 << 20;

/// Copies in flight at once (QEMU's block-copy runs up to 64 workers; as many as a
/// mirror's keep the storage's queue busy without holding much memory).
const IN_FLIGHT: usize = 16;

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

/// Shows what `copy` has copied and has left as the job's progress.
fn progress(copy: &CopyBeforeWrite, job: &Job) {
    let done = copy.copied();
    job.set_progress(done, done + copy.remaining());
}

/// Runs a backup: what is to be copied is copied (or, with `sync=none`, the job waits to
/// be cancelled); at finalize the bitmap is synced, then the hooks go. The copying loop
/// runs on the thread `home` names ([`Home::drive`]), `IN_FLIGHT` copies at a time.
pub async fn run(
    mut b: Backup,
    job: Arc<Job>,
    home: impl Fn() -> Option<Home>,
) -> Result<Finish, String> {
    progress(&b.copy, &job);
    if b.sync == Sync::None {
        while !job.is_cancelled() {
            job.sleep(IDLE).await;
            progress(&b.copy, &job);
        }
        return Ok(None);
    }
    let r = copy_all(&b, &job, &home).await;
    progress(&b.copy, &job);
    if !r? {
        return Ok(None);
    }
    Ok(Some(Box::pin(async move {
        if let Some(bm) = &mut b.bitmap {
            bm.resolve(true);
        }
        drop(b);
        Ok(())
    })))
}

/// What the copying loop needs, sent to the thread it runs on.
#[derive(Clone)]
struct Copying {
    copy: Arc<CopyBeforeWrite>,
    on_source_error: OnError,
    on_target_error: OnError,
}

/// Where the copying loop is, carried to the next thread when the source moves.
#[derive(Clone, Copy)]
struct At {
    /// Where the next chunk is looked for.
    offset: u64,
    /// Bytes counted against the speed limit so far.
    counted: u64,
}

/// Copies what is still to be copied on the thread that serves the source, following it
/// when it moves. True once all is copied, false if cancelled.
async fn copy_all(b: &Backup, job: &Arc<Job>, home: FindHome<'_>) -> Result<bool, String> {
    let c = Copying {
        copy: b.copy.clone(),
        on_source_error: b.on_source_error,
        on_target_error: b.on_target_error,
    };
    let at = At {
        offset: 0,
        counted: b.copy.copied(),
    };
    let looping = job.clone();
    let run = move |mut at: At, stay: Stay, here: Home| async move {
        let ops = InFlight::new();
        let r = c.copy_loop(&looping, &mut at, &stay, &here, &ops).await;
        // Whatever ended the loop, nothing it started is left running.
        ops.drain().await;
        r.map(|step| match step {
            Step::Done(all) => Step::Done(all),
            Step::Moved(()) => Step::Moved(at),
        })
    };
    follow(job, &b.copy.source, home, at, run).await
}

impl Copying {
    /// Chunks in order from the start; a chunk found again behind the cursor (a failed
    /// copy, to be tried again) waits until those in flight are done. Done(true) once all
    /// is copied, Done(false) if cancelled; Moved once the source moved and nothing is in
    /// flight.
    async fn copy_loop(
        &self,
        job: &Job,
        at: &mut At,
        stay: &Stay,
        here: &Home,
        ops: &InFlight<Result<(), CopyError>>,
    ) -> Result<Step<bool, ()>, String> {
        loop {
            while let Some(r) = ops.next_to_settle(job.pausing()).await {
                self.settle(job, r)?;
            }
            let copied = self.copy.copied();
            job.ratelimit_processed(copied.saturating_sub(at.counted));
            at.counted = copied;
            progress(&self.copy, job);
            job.ratelimit().await;
            if job.is_cancelled() {
                return Ok(Step::Done(false));
            }
            let busy = ops.load().0;
            let most = if job.limited() { 1 } else { IN_FLIGHT };
            let moved = stay.moved();
            let next = if busy < most && !moved {
                self.copy.next(at.offset)
            } else {
                None
            };
            match next {
                Some(chunk) if chunk >= at.offset => {
                    at.offset = chunk + CHUNK;
                    let copy = self.copy.clone();
                    let lost = Err(CopyError {
                        error: stopped(),
                        read: false,
                    });
                    ops.start(here, CHUNK, lost, move || async move {
                        copy.copy(chunk, CHUNK).await
                    });
                }
                Some(_) if busy == 0 => at.offset = 0,
                None if ops.is_empty() && moved => return Ok(Step::Moved(())),
                None if ops.is_empty() => return Ok(Step::Done(true)),
                _ => {
                    if let Some(r) = ops.next().await {
                        self.settle(job, r)?;
                    }
                }
            }
        }
    }

    /// A finished copy: a failure as `on-source-error` / `on-target-error` say (stop
    /// pauses the job, and what failed is copied again once resumed; ignore tries it again
    /// at once, as QEMU's backup_loop does).
    fn settle(&self, job: &Job, r: Result<(), CopyError>) -> Result<(), String> {
        let Err(e) = r else {
            return Ok(());
        };
        let policy = if e.read {
            self.on_source_error
        } else {
            self.on_target_error
        };
        if job.error_action(policy, e.read, &e.error) == ErrorAction::Report {
            return Err(crate::sys::os_text(&e.error));
        }
        Ok(())
    }
}
