//! block-stream: what the chain between an image and its base holds is copied into the
//! image, chunk by chunk, where the image has nothing of its own; at finalize the image's
//! backing link and the backing file its header names skip the copied part (QEMU's
//! stream_run and stream_prepare). Guest writes go on meanwhile: a copy only fills
//! clusters the image does not allocate, under the image's allocation lock.

use std::rc::Rc;
use std::sync::Arc;

use super::{ErrorAction, Finish, Job, OnError};
use crate::block::blocker::Blocker;
use crate::block::perm::Claim;
use crate::block::BlockNode;

/// How much one step looks at (QEMU's STREAM_CHUNK).
const CHUNK: u64 = 512 << 10;

/// A stream job's nodes and holds.
pub struct Stream {
    pub top: Arc<BlockNode>,
    /// The node that stays below (None: the whole chain comes up).
    pub base: Option<Arc<BlockNode>>,
    /// The base's allocation depth below top (top is 1).
    pub base_depth: Option<u32>,
    /// The backing file name and format the header will name.
    pub backing: Option<(String, String)>,
    pub on_error: OnError,
    /// Held until the job ends.
    pub claims: Vec<Claim>,
    pub blockers: Vec<Blocker>,
}

impl Stream {
    /// The job's work; `after` runs once the graph changed and the holds are gone.
    pub async fn run(self, job: Rc<Job>, after: impl FnOnce() + 'static) -> Result<Finish, String> {
        let len = self.top.size();
        job.set_remaining(len);
        let mut offset = 0;
        let mut ignored = None;
        while offset < len {
            job.ratelimit().await;
            if job.is_cancelled() {
                return Ok(None);
            }
            let want = CHUNK.min(len - offset);
            match self.step(offset, want).await {
                Ok((n, copied)) => {
                    job.progress_add(n);
                    if copied {
                        job.ratelimit_processed(n);
                    }
                    offset += n;
                }
                Err(e) => match job.error_action(self.on_error, true, &e) {
                    // Paused now; the step is tried again once resumed.
                    ErrorAction::Stop => {}
                    ErrorAction::Ignore => {
                        ignored.get_or_insert(e);
                        job.progress_add(want);
                        offset += want;
                    }
                    ErrorAction::Report => return Err(e.to_string()),
                },
            }
        }
        // An ignored error leaves the chain as it is.
        if let Some(e) = ignored {
            return Err(e.to_string());
        }
        Ok(Some(Box::pin(async move {
            let r = self.finish().await;
            drop(self);
            after();
            r
        })))
    }

    /// Copies what lies between top and base in one run at `offset`: its length, and
    /// whether it was copied.
    async fn step(&self, offset: u64, want: u64) -> std::io::Result<(u64, bool)> {
        let (n, depth) = self.top.driver().allocation_depth(offset, want).await?;
        let n = n.clamp(1, want);
        let copy = depth >= 2 && self.base_depth.is_none_or(|b| depth < b);
        if copy {
            self.top.driver().populate(offset, n).await?;
        }
        Ok((n, copy))
    }

    /// QEMU's stream_prepare: the backing link moves to the base, and the header names it.
    async fn finish(&self) -> Result<(), String> {
        self.top.set_backing(self.base.clone())?;
        let backing = self
            .backing
            .as_ref()
            .map(|(name, fmt)| (name.as_str(), Some(fmt.as_str())));
        self.top
            .driver()
            .change_backing_file(backing)
            .await
            .map_err(|e| e.to_string())
    }
}
