//! The driver of the jobs that copy chunk by chunk (stream, commit): [`CopyJob`] says what
//! a job copies and changes, [`run_copy`] runs it. The chunks go to the thread that
//! serves the job's node, several at once ([`super::in_flight`]), the loop following the
//! node when it moves ([`super::job_loop`]); a failed chunk goes as `on-error` says. Also
//! what every copying job walks and copies with ([`Runs`], [`copy_range`]).

use std::sync::Arc;

use super::handle::Job;
use super::home::Home;
use super::in_flight::{stopped, InFlight};
use super::job_loop::{follow, FindHome, Step};
use super::on_error::{ErrorAction, OnError};
use super::options::Finish;
use super::stay::Stay;

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
    home: impl Fn() -> Option<Home>,
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

impl Job {
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
        home: FindHome<'_>,
    ) -> Result<bool, String> {
        self.set_remaining(len);
        let (job, c) = (self.clone(), c.clone());
        let run = move |mut at: ChunksAt, stay: Stay, here: Home| async move {
            let ops = InFlight::new();
            let r = job
                .chunks_loop(&mut at, (len, chunk, on_error), &c, &stay, &here, &ops)
                .await;
            ops.drain().await;
            r.map(|done| match done {
                true => Step::Done(at.finish()),
                false => Step::Moved(at),
            })
        };
        follow(self, node, home, ChunksAt::default(), run).await?
    }

    /// Chunks until the end (true) or until `stay` says the node moved and nothing is in
    /// flight (false); Err when the job fails. Cancelled: true, with `at.cancelled`.
    async fn chunks_loop<C: ChunkCopy>(
        &self,
        at: &mut ChunksAt,
        (len, chunk, on_error): (u64, u64, OnError),
        c: &C,
        stay: &Stay,
        here: &Home,
        ops: &InFlight<ChunkDone>,
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
                    let lost = (offset, n, Err((stopped(), false)));
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
}
