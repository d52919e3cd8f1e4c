//! The in-flight region (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD): shared memory the frontend
//! keeps across our restarts, where each queue records which descriptor heads it has taken
//! and not yet completed. A restarted daemon gets it back with SET_INFLIGHT_FD and resubmits
//! those requests, so a guest's I/O survives a daemon crash.
//!
//! The layout is ours (the frontend only stores it); it follows libvhost-user's split-ring
//! layout. Per queue: a 16-byte header (features u64, version u16, desc_num u16,
//! last_batch_head u16, used_idx u16) and one 16-byte entry per descriptor (inflight u8,
//! padding, next u16, counter u64), the queue's area aligned to 64 bytes.

use std::fs::File;
use std::sync::Arc;

use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

const VERSION: u16 = 1;
const HEADER: usize = 16;
const ENTRY: usize = 16;

/// Bytes one queue's area takes.
pub fn queue_area(queue_size: u16) -> usize {
    (HEADER + ENTRY * queue_size as usize).next_multiple_of(64)
}

/// The mapped region.
pub struct InflightRegion {
    map: MmapRegion,
    file: File,
    pub queue_size: u16,
    pub num_queues: u16,
}

impl InflightRegion {
    /// A new zeroed region for `num_queues` queues of `queue_size` (GET_INFLIGHT_FD).
    pub fn create(num_queues: u16, queue_size: u16) -> std::io::Result<Self> {
        let size = queue_area(queue_size) * num_queues as usize;
        let file = crate::sys::memfd_create("stord-inflight")?;
        file.set_len(size as u64)?;
        Self::map(file, 0, size as u64, num_queues, queue_size)
    }

    /// Maps a region the frontend hands back (SET_INFLIGHT_FD).
    pub fn map(
        file: File,
        offset: u64,
        size: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> std::io::Result<Self> {
        if queue_size == 0 || size < (queue_area(queue_size) * num_queues as usize) as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("in-flight region of {size} bytes too small for {num_queues} queues of {queue_size}"),
            ));
        }
        super::guest_fault::within_file(&file, offset, size)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let dup = file.try_clone()?;
        let map = MmapRegion::from_file(FileOffset::new(dup, offset), size as usize)
            .map_err(std::io::Error::other)?;
        Ok(Self {
            map,
            file,
            queue_size,
            num_queues,
        })
    }

    /// Opens (or creates) a region kept in a file of its own, for a device whose state
    /// outlives the daemon (VDUSE). `fresh`: start from zero whatever the file holds.
    pub fn in_file(
        path: &std::path::Path,
        num_queues: u16,
        queue_size: u16,
        fresh: bool,
    ) -> std::io::Result<Self> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let size = (queue_area(queue_size) * num_queues as usize) as u64;
        // The daemon may run as root in a shared $TMPDIR: never through a symlink, and
        // only a regular file of our own that nobody else may write.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        let meta = file.metadata()?;
        if !meta.is_file() || meta.uid() != crate::sys::euid() || meta.mode() & 0o022 != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "not a regular file of ours that only we may write",
            ));
        }
        if fresh || meta.len() != size {
            file.set_len(0)?;
            file.set_len(size)?;
        }
        Self::map(file, 0, size, num_queues, queue_size)
    }

    /// Forgets every queue's state (the device was reset), through the mapping: the
    /// file keeps its size, so nothing that still maps it can fault.
    pub fn clear(&self) {
        let zeroes = [0u8; 4096];
        let slice = self.map.as_volatile_slice();
        let mut at = 0;
        while at < slice.len() {
            let n = zeroes.len().min(slice.len() - at);
            let _ = slice.write_slice(&zeroes[..n], at);
            at += n;
        }
    }

    /// The fd to hand to the frontend.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.map.size() as u64
    }
}

/// One queue's view of the region.
#[derive(Clone)]
pub struct InflightQueue {
    region: Arc<InflightRegion>,
    base: usize,
    size: u16,
    counter: std::cell::Cell<u64>,
}

// The queue view is used by one IoThread at a time; the region itself is shared memory.
impl InflightQueue {
    pub fn new(region: Arc<InflightRegion>, index: u16) -> Option<Self> {
        if index >= region.num_queues {
            return None;
        }
        let base = queue_area(region.queue_size) * index as usize;
        let size = region.queue_size;
        Some(Self {
            region,
            base,
            size,
            counter: std::cell::Cell::new(0),
        })
    }

    fn put<T: vm_memory::ByteValued>(&self, off: usize, v: T) {
        let _ = self
            .region
            .map
            .as_volatile_slice()
            .write_obj(v, self.base + off);
    }

    fn get<T: vm_memory::ByteValued + Default>(&self, off: usize) -> T {
        self.region
            .map
            .as_volatile_slice()
            .read_obj(self.base + off)
            .unwrap_or_default()
    }

    fn entry(head: u16) -> usize {
        HEADER + ENTRY * head as usize
    }

    /// Prepares the area when the queue starts: returns the heads to resubmit (oldest first)
    /// if it holds state from an earlier daemon, after settling the one completion that may
    /// have been published to the used ring but not yet cleared here.
    pub fn start(&self, used_idx_in_ring: u16) -> Vec<u16> {
        let valid = self.get::<u16>(8) == VERSION && self.get::<u16>(10) == self.size;
        let mut resubmit = Vec::new();
        if valid {
            if self.get::<u16>(14) != used_idx_in_ring {
                let last = self.get::<u16>(12);
                if last < self.size {
                    self.put(Self::entry(last), 0u8);
                }
            }
            let mut heads: Vec<(u64, u16)> = (0..self.size)
                .filter(|&h| self.get::<u8>(Self::entry(h)) == 1)
                .map(|h| (self.get::<u64>(Self::entry(h) + 8), h))
                .collect();
            heads.sort_unstable();
            if let Some(&(c, _)) = heads.last() {
                self.counter.set(c + 1);
            }
            resubmit = heads.into_iter().map(|(_, h)| h).collect();
        } else {
            for h in 0..self.size {
                self.put(Self::entry(h), 0u8);
            }
            self.put(0, 0u64);
            self.put(8, VERSION);
            self.put(10, self.size);
        }
        self.put(14, used_idx_in_ring);
        resubmit
    }

    /// How many requests an earlier daemon took and did not complete, as
    /// [`start`](Self::start) would resubmit them (changing nothing): with the used index,
    /// where the avail ring is to be taken up again when no frontend says (VDUSE).
    pub fn pending(&self, used_idx_in_ring: u16) -> u16 {
        if self.get::<u16>(8) != VERSION || self.get::<u16>(10) != self.size {
            return 0;
        }
        let settled = (self.get::<u16>(14) != used_idx_in_ring).then(|| self.get::<u16>(12));
        (0..self.size)
            .filter(|&h| Some(h) != settled && self.get::<u8>(Self::entry(h)) == 1)
            .count() as u16
    }

    /// The request at `head` was taken from the avail ring.
    pub fn taken(&self, head: u16) {
        if head >= self.size {
            return;
        }
        let c = self.counter.get();
        self.counter.set(c + 1);
        self.put(Self::entry(head) + 8, c);
        self.put(Self::entry(head), 1u8);
    }

    /// About to publish `head` in the used ring.
    pub fn completing(&self, head: u16) {
        self.put(12, head);
    }

    /// `head` is in the used ring, whose index is now `used_idx`.
    pub fn completed(&self, head: u16, used_idx: u16) {
        if head < self.size {
            self.put(Self::entry(head), 0u8);
        }
        self.put(14, used_idx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_region_resubmits_nothing_and_remembers_taken_heads() {
        let r = Arc::new(InflightRegion::create(2, 8).unwrap());
        assert_eq!(r.size(), 2 * 192);
        let q = InflightQueue::new(r.clone(), 1).unwrap();
        assert!(q.start(0).is_empty());
        q.taken(5);
        q.taken(2);
        q.taken(7);
        q.completing(7);
        q.completed(7, 1);
        // A new daemon maps the same file: heads 5 then 2 are still in flight.
        let again = Arc::new(
            InflightRegion::map(r.file().try_clone().unwrap(), 0, r.size(), 2, 8).unwrap(),
        );
        let q2 = InflightQueue::new(again.clone(), 1).unwrap();
        assert_eq!(q2.start(1), vec![5, 2]);
        // Queue 0 was never started: nothing to resubmit.
        assert!(InflightQueue::new(again, 0).unwrap().start(0).is_empty());
    }

    #[test]
    fn completion_published_but_not_cleared_is_settled() {
        let r = Arc::new(InflightRegion::create(1, 4).unwrap());
        let q = InflightQueue::new(r.clone(), 0).unwrap();
        q.start(0);
        q.taken(3);
        q.taken(1);
        // The daemon died after the used ring showed head 3 (used idx 1) but before
        // clearing its entry.
        q.completing(3);
        let q2 = InflightQueue::new(r, 0).unwrap();
        assert_eq!(q2.start(1), vec![1]);
    }

    #[test]
    fn pending_counts_what_start_would_resubmit() {
        let r = Arc::new(InflightRegion::create(1, 8).unwrap());
        let q = InflightQueue::new(r.clone(), 0).unwrap();
        assert_eq!(q.pending(0), 0);
        q.start(0);
        q.taken(3);
        q.taken(1);
        q.taken(6);
        q.completing(6);
        q.completed(6, 1);
        q.completing(3);
        // The used ring shows 3 completed too: 1 is the only one left.
        let q2 = InflightQueue::new(r.clone(), 0).unwrap();
        assert_eq!(q2.pending(2), 1);
        assert_eq!(q2.start(2), vec![1]);
        r.clear();
        assert_eq!(InflightQueue::new(r, 0).unwrap().pending(2), 0);
    }

    #[test]
    fn too_small_a_region_is_refused() {
        let r = InflightRegion::create(1, 8).unwrap();
        assert!(InflightRegion::map(r.file().try_clone().unwrap(), 0, r.size(), 2, 8).is_err());
    }
}
