//! block-commit of an intermediate image: what the images from `top` down to just above
//! `base` hold is copied into `base`, chunk by chunk; at finalize the overlay of `top`
//! names `base` as its backing file and its backing link skips the committed images
//! (QEMU's commit_run and commit_prepare). The overlay keeps serving reads meanwhile: its
//! chain reads the same before and after, since only images below it change.

use std::sync::Arc;

use super::copy_job::{copy_range, ChunkCopy, CopyError, CopyJob, Runs};
use super::on_error::OnError;
use super::options::Holds;
use crate::block::node::block_node::BlockNode;

/// How much one step copies at most (QEMU's COMMIT_BUFFER_SIZE).
const CHUNK: u64 = 512 << 10;

/// A commit job's nodes and holds.
pub struct Commit {
    /// The image whose backing link changes.
    pub overlay: Arc<BlockNode>,
    /// The topmost image committed.
    pub top: Arc<BlockNode>,
    pub base: Arc<BlockNode>,
    /// The base's allocation depth below `top` (top is 1).
    pub base_depth: u32,
    /// The backing file name and format the overlay's header will name.
    pub backing: (String, String),
    pub on_error: OnError,
    /// Held until the job ends.
    pub holds: Holds,
}

/// What commits one chunk: the images, and how deep the base lies below top.
#[derive(Clone)]
pub struct CommitChunk {
    top: Arc<BlockNode>,
    base: Arc<BlockNode>,
    base_depth: u32,
}

impl ChunkCopy for CommitChunk {
    /// Copies into base what an image above it holds in `[offset, offset + len)`, run by
    /// run: the bytes copied.
    async fn copy(&self, offset: u64, len: u64) -> Result<u64, CopyError> {
        let mut runs = Runs::new(&self.top, offset, offset + len);
        let mut copied = 0;
        while let Some(run) = runs.next().await {
            let (at, n, depth) = run?;
            if depth != 0 && depth < self.base_depth {
                copy_range(&self.top, &self.base, at, n).await?;
                copied += n;
            }
        }
        Ok(copied)
    }
}

impl CopyJob for Commit {
    const CHUNK: u64 = CHUNK;
    type Chunk = CommitChunk;
    fn bytes(&self) -> u64 {
        self.top.size()
    }
    fn on_error(&self) -> OnError {
        self.on_error
    }
    fn node(&self) -> &Arc<BlockNode> {
        &self.top
    }
    fn chunk(&self) -> CommitChunk {
        CommitChunk {
            top: self.top.clone(),
            base: self.base.clone(),
            base_depth: self.base_depth,
        }
    }

    /// Base grows to top's size first.
    async fn prepare(&self) -> Result<(), String> {
        let len = self.top.size();
        if self.base.size() < len {
            self.base.resize(len).await.map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// QEMU's commit_prepare: base durable, then the overlay's link and header skip the
    /// committed images.
    async fn finish(&self) -> Result<(), String> {
        self.base.flush().await.map_err(|e| e.to_string())?;
        self.overlay.set_backing(Some(self.base.clone()))?;
        let (name, fmt) = &self.backing;
        self.overlay
            .driver()
            .change_backing_file(Some((name.as_str(), Some(fmt.as_str()))))
            .await
            .map_err(|e| e.to_string())
    }
}
