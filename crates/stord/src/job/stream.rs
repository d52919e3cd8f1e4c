//! block-stream: what the chain between an image and its base holds is copied into the
//! image, chunk by chunk, where the image has nothing of its own; at finalize the image's
//! backing link and the backing file its header names skip the copied part (QEMU's
//! stream_run and stream_prepare). Guest writes go on meanwhile: a copy only fills
//! clusters the image does not allocate, under the image's allocation lock.

use std::sync::Arc;

use super::copy_job::{ChunkCopy, CopyError, CopyJob, Runs};
use super::on_error::OnError;
use super::options::Holds;
use crate::block::node::block_node::BlockNode;

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
    pub holds: Holds,
}

/// What streams one chunk: the image, and how deep the base lies below it.
#[derive(Clone)]
pub struct StreamChunk {
    top: Arc<BlockNode>,
    base_depth: Option<u32>,
}

impl ChunkCopy for StreamChunk {
    /// Copies what lies between top and base in `[offset, offset + len)`, run by run: the
    /// bytes copied.
    async fn copy(&self, offset: u64, len: u64) -> Result<u64, CopyError> {
        let mut runs = Runs::new(&self.top, offset, offset + len);
        let mut copied = 0;
        while let Some(run) = runs.next().await {
            let (at, n, depth) = run?;
            if depth >= 2 && self.base_depth.is_none_or(|b| depth < b) {
                // A failed copy-on-read counts as a read error, as QEMU reports it.
                self.top
                    .driver()
                    .populate(at, n)
                    .await
                    .map_err(|e| (e, true))?;
                copied += n;
            }
        }
        Ok(copied)
    }
}

impl CopyJob for Stream {
    const CHUNK: u64 = CHUNK;
    type Chunk = StreamChunk;
    fn bytes(&self) -> u64 {
        self.top.size()
    }
    fn on_error(&self) -> OnError {
        self.on_error
    }
    fn node(&self) -> &Arc<BlockNode> {
        &self.top
    }
    fn chunk(&self) -> StreamChunk {
        StreamChunk {
            top: self.top.clone(),
            base_depth: self.base_depth,
        }
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
