//! A mirror's `copy-mode=write-blocking` (QEMU's active mirror): while it is on, a write
//! to the source completes only once it is on the target too, so the copy keeps in step
//! however fast clients write. The hook holds the write's granules against the job's
//! background copies (which hold what they copy, whatever the mode, so a copy that read
//! the old data cannot land after the new), writes the same data to the target, and
//! leaves the tracker's granules it wrote whole clean (a granule it wrote in part stays as
//! the source's write marked it, for the background copy). As QEMU's do_sync_target_write, a part
//! of a granule that was dirty before the write is left to the background copy (the rest
//! of that granule is not on the target yet). A failed write to the target leaves the
//! granules dirty, and the job is no longer "actively synced". `block-job-change`
//! switches the mode on.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::{Map, Value};

use super::known_zero::KnownZero;
use crate::block::node::block_node::BlockNode;
use crate::block::node::dirty_bitmap::DirtyBitmap;
use crate::block::node::future::BoxFut;
use crate::block::node::hook::{Hold, NodeHook, Written};
use crate::block::node::range_lock::{RangeGuard, RangeLocks};
use crate::buf::request_buf;

/// The mirror's shared state for its writes (the hook on the source) and its copies.
pub struct WriteBlocking {
    on: AtomicBool,
    granularity: u64,
    target: Arc<BlockNode>,
    tracker: OnceLock<Arc<DirtyBitmap>>,
    locks: RangeLocks,
    /// Every write since the job went ready reached the target (QEMU's actively_synced).
    synced: AtomicBool,
    /// The job has gone ready (then, in this mode, it is actively synced).
    ready: AtomicBool,
    /// Writes held now: offset, length, and whether their unaligned head and tail
    /// granules were dirty before them (writes that share a granule are held one at a
    /// time, so an offset and length name one).
    pending: Mutex<Vec<(u64, u64, bool, bool)>>,
    /// Bytes written to the target by writes, not yet counted in the job's progress.
    synced_bytes: AtomicU64,
    /// What reads as zeroes on the target (a `sync=full` mirror's, once it has started).
    known_zero: OnceLock<KnownZero>,
}

impl WriteBlocking {
    pub fn new(on: bool, granularity: u64, target: Arc<BlockNode>) -> Self {
        WriteBlocking {
            on: AtomicBool::new(on),
            granularity,
            target,
            tracker: OnceLock::new(),
            locks: RangeLocks::default(),
            synced: AtomicBool::new(false),
            ready: AtomicBool::new(false),
            pending: Mutex::new(Vec::new()),
            synced_bytes: AtomicU64::new(0),
            known_zero: OnceLock::new(),
        }
    }

    /// From now on the job keeps track of what reads as zeroes on the target.
    pub fn track_zeroes(&self, k: KnownZero) {
        let _ = self.known_zero.set(k);
    }

    /// What is known to read as zeroes on the target, if the job keeps track.
    pub fn known_zero(&self) -> Option<&KnownZero> {
        self.known_zero.get()
    }

    /// Zeroes to `[offset, offset + len)` of the target, skipped where it reads as zeroes
    /// already (QEMU's mirror_co_zero); true if they were skipped.
    pub async fn zero_target(&self, offset: u64, len: u64, unmap: bool) -> std::io::Result<bool> {
        let known = self.known_zero();
        if known.is_some_and(|k| k.covers(offset, len)) {
            return Ok(true);
        }
        self.target.write_zeroes(offset, len, unmap).await?;
        if let Some(k) = known {
            k.set(offset, len);
        }
        Ok(false)
    }

    /// Data or a discard is about to reach `[offset, offset + len)` of the target.
    pub fn target_changes(&self, offset: u64, len: u64) {
        if let Some(k) = self.known_zero() {
            k.clear(offset, len);
        }
    }

    /// The job's tracker, once it has one.
    pub fn set_tracker(&self, t: Arc<DirtyBitmap>) {
        let _ = self.tracker.set(t);
    }

    /// The job is ready: in this mode it is actively synced from now on.
    pub fn went_ready(&self) {
        self.ready.store(true, Relaxed);
        if self.on.load(Relaxed) {
            self.synced.store(true, Relaxed);
        }
    }

    /// The bytes writes put on the target since the last call (QEMU counts them in the
    /// job's progress, done and to do).
    pub fn take_synced(&self) -> u64 {
        self.synced_bytes.swap(0, Relaxed)
    }

    /// Holds `[offset, offset + len)` (granule-aligned) for a background copy.
    pub async fn hold_copy(&self, offset: u64, len: u64) -> RangeGuard<'_> {
        let (a, b) = self.span(offset, len);
        self.locks.lock(a, b).await
    }

    fn span(&self, offset: u64, len: u64) -> (u64, u64) {
        let g = self.granularity;
        (offset / g * g, offset.saturating_add(len).div_ceil(g) * g)
    }

    fn dirty_at(&self, at: u64) -> bool {
        self.tracker.get().is_some_and(|t| t.extent(at, 1).1)
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Vec<(u64, u64, bool, bool)>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `[start, end)` of a write at `offset` goes to the target (the write's bytes from
    /// `start - offset` on).
    async fn to_target(
        &self,
        offset: u64,
        (start, end): (u64, u64),
        what: Written<'_>,
    ) -> std::io::Result<()> {
        let (skip, len) = ((start - offset) as usize, end - start);
        if !matches!(what, Written::Zeroes { .. }) {
            self.target_changes(start, len);
        }
        match what {
            Written::Data(d) => {
                let mut buf = request_buf(len as usize);
                buf.copy_from_slice(&d[skip..skip + len as usize]);
                self.target.write(start, buf, false).await.0
            }
            Written::Iov(iov) => {
                let mut buf = request_buf(len as usize);
                iov.copy_out(skip, &mut buf);
                self.target.write(start, buf, false).await.0
            }
            Written::Zeroes { may_unmap } => {
                self.zero_target(start, len, may_unmap).await.map(drop)
            }
            Written::Discard => self.target.discard(start, len).await,
        }
    }

    /// `block-job-change`'s `copy-mode` (QEMU's mirror_change).
    fn change_mode(&self, mode: &str) -> Result<(), String> {
        let current = if self.on.load(Relaxed) {
            "write-blocking"
        } else {
            "background"
        };
        if mode == current {
            return Ok(());
        }
        if mode != "write-blocking" {
            return Err(format!("Change to copy mode '{mode}' is not implemented"));
        }
        self.on.store(true, Relaxed);
        if self.ready.load(Relaxed) {
            // QEMU's mirror loop marks it synced at its next pass once ready.
            self.synced.store(true, Relaxed);
        }
        Ok(())
    }
}

impl NodeHook for WriteBlocking {
    fn before_write(&self, offset: u64, len: u64) -> BoxFut<'_, std::io::Result<Option<Hold<'_>>>> {
        Box::pin(async move {
            if !self.on.load(Relaxed) {
                return Ok(None);
            }
            let (a, b) = self.span(offset, len);
            let held = self.locks.lock(a, b).await;
            let end = offset + len;
            let g = self.granularity;
            let head = !offset.is_multiple_of(g) && self.dirty_at(offset);
            let tail = !end.is_multiple_of(g) && self.dirty_at(end - 1);
            self.pending().push((offset, len, head, tail));
            Ok(Some(Box::new(held) as Hold<'_>))
        })
    }

    fn after_write<'a>(
        &'a self,
        offset: u64,
        len: u64,
        ok: bool,
        held: bool,
        what: Written<'a>,
    ) -> BoxFut<'a, ()> {
        Box::pin(async move {
            if !held {
                return;
            }
            let before = {
                let mut p = self.pending();
                let i = p.iter().position(|e| e.0 == offset && e.1 == len);
                i.map(|i| p.swap_remove(i))
            };
            let (head, tail) = before.map_or((true, true), |e| (e.2, e.3));
            if !ok {
                return;
            }
            // A part of a granule that was dirty is left to the background copy.
            let g = self.granularity;
            let end = offset + len;
            let start = if head { offset.div_ceil(g) * g } else { offset };
            let stop = if tail { end / g * g } else { end };
            if start >= stop {
                return;
            }
            match self.to_target(offset, (start, stop), what).await {
                Ok(()) => {
                    self.synced_bytes.fetch_add(stop - start, Relaxed);
                    // Only granules this write covered whole are clean now: a part of a
                    // granule may have been marked meanwhile by a write not held here (or
                    // a copy that failed), and the rest of it is not on the target.
                    if let Some(t) = self.tracker.get() {
                        t.reset(start, stop - start);
                    }
                }
                // The granules stay dirty (the source's write marked them): the job copies
                // them again.
                Err(_) => self.synced.store(false, Relaxed),
            }
        })
    }
}

/// The mirror job's type: `block-job-change` and `actively-synced`.
pub struct MirrorType(pub Arc<WriteBlocking>);

impl super::handle::JobType for MirrorType {
    fn change(&self, options: &Map<String, Value>) -> Result<(), String> {
        match options.get("copy-mode").and_then(Value::as_str) {
            Some(mode) => self.0.change_mode(mode),
            None => Ok(()),
        }
    }

    fn query(&self, into: &mut Map<String, Value>) {
        into.insert("actively-synced".into(), self.0.synced.load(Relaxed).into());
    }
}
