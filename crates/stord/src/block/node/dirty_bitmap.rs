//! Dirty bitmaps: which parts of a node were written since a point in time (incremental
//! backup's base).
//!
//! A bitmap has one bit per `granularity` bytes of its node; a write, write-zeroes or
//! (passed-on) discard that enters the graph at the node sets the bits it touches while the
//! bitmap records. Names, defaults, errors and the `x-debug-block-dirty-bitmap-sha256`
//! digest are QEMU's: the digest is over the bits as 64-bit little-endian words (QEMU's
//! last HBitmap level), so equal digests mean the same bits as qsd's. The same bytes are
//! the serialized form qcow2 stores persistent bitmaps in (`qcow2::bitmaps`).
//!
//! A persistent bitmap loaded from an image may be read-only (the node is) or
//! inconsistent (the image says it was in use when last closed: its bits may have missed
//! writes); both refuse what QEMU refuses them, with QEMU's texts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};

/// Why a bitmap command was refused (QEMU's texts).
#[derive(Debug, thiserror::Error)]
pub enum BitmapError {
    #[error("Bitmap name cannot be empty")]
    EmptyName,
    #[error("Bitmap name is too long")]
    NameTooLong,
    #[error("Bitmap already exists: {0}")]
    Exists(String),
    #[error("Dirty bitmap '{0}' not found")]
    NotFound(String),
    #[error("Granularity must be power of 2 and at least 512")]
    BadGranularity,
    /// The node's driver cannot store bitmaps, or this one (the driver's reason).
    #[error("{0}")]
    CannotStore(String),
    #[error("Bitmap '{0}' is currently in use by another operation and cannot be used")]
    Busy(String),
    #[error("Bitmap '{0}' is readonly and cannot be modified")]
    ReadOnly(String),
    #[error("Bitmap '{0}' is inconsistent and cannot be used")]
    Inconsistent(String),
    /// Reading or writing the image's copy failed.
    #[error("{0}")]
    Io(String),
    #[error("A bitmap of that granularity over this node would take over {} MiB (use a larger granularity)", MAX_BITS_BYTES >> 20)]
    TooLarge,
    #[error("Too many dirty bitmaps on this node (at most {MAX_PER_NODE})")]
    TooMany,
}

/// The most memory one bitmap's bits may take: 64 MiB covers 2 PiB at 4 KiB granularity.
/// (A client must not make the daemon allocate without bound: a huge null-co node with a
/// 512 B granularity would otherwise ask for more than the machine has.)
pub const MAX_BITS_BYTES: u64 = 64 << 20;
/// Bitmaps one node keeps at most.
pub const MAX_PER_NODE: usize = 64;

/// Bitmaps alive in the process: while there are none, a write checks nothing else.
static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether any bitmap exists (one relaxed load on every write).
pub fn any_exist() -> bool {
    LIVE.load(Ordering::Relaxed) != 0
}

/// Whether a bitmap of `granularity` can cover `size` bytes within [`MAX_BITS_BYTES`].
pub fn fits(size: u64, granularity: u64) -> bool {
    size.div_ceil(granularity).div_ceil(64) * 8 <= MAX_BITS_BYTES
}

/// What a command needs of a bitmap (QEMU's BDRV_BITMAP_* checks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Change its bits (clear, merge into): not busy, not read-only, consistent.
    Modify,
    /// Read it or switch recording: not busy, consistent.
    AllowReadOnly,
    /// Remove it: not busy, not read-only.
    Remove,
    /// Read its bits: consistent.
    Read,
}

/// One bitmap.
pub struct DirtyBitmap {
    pub name: String,
    granularity: u64,
    recording: AtomicBool,
    /// Stored in the image at close (qcow2).
    persistent: AtomicBool,
    /// Loaded from an image opened read-only.
    readonly: AtomicBool,
    /// Loaded with the image's in-use flag set: its bits cannot be trusted.
    inconsistent: AtomicBool,
    /// Used by an operation (an NBD export): not to be changed meanwhile.
    busy: AtomicBool,
    /// One bit per granule, in 64-bit words.
    bits: Mutex<Vec<u64>>,
    /// Granules the node's size covers (bits past them stay clear).
    granules: std::sync::atomic::AtomicU64,
    /// A job's own record of writes (a mirror's): no name users see, not listed.
    internal: bool,
}

impl DirtyBitmap {
    /// A clean bitmap over `size` bytes.
    pub fn new(
        name: &str,
        granularity: u64,
        size: u64,
        recording: bool,
    ) -> Result<Self, BitmapError> {
        if name.is_empty() {
            return Err(BitmapError::EmptyName);
        }
        if name.len() > 1023 {
            return Err(BitmapError::NameTooLong);
        }
        if !granularity.is_power_of_two() || !(512..=1 << 31).contains(&granularity) {
            return Err(BitmapError::BadGranularity);
        }
        if !fits(size, granularity) {
            return Err(BitmapError::TooLarge);
        }
        let b = Self {
            name: name.into(),
            granularity,
            recording: AtomicBool::new(recording),
            persistent: AtomicBool::new(false),
            readonly: AtomicBool::new(false),
            inconsistent: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            bits: Mutex::new(Vec::new()),
            granules: Default::default(),
            internal: false,
        };
        b.resize(size);
        LIVE.fetch_add(1, Ordering::Relaxed);
        Ok(b)
    }

    /// A job's record of the writes to a node (a mirror's): recording, listed nowhere.
    pub fn tracker(job: &str, granularity: u64, size: u64) -> Result<Self, BitmapError> {
        let mut b = Self::new(job, granularity, size, true)?;
        b.internal = true;
        Ok(b)
    }

    /// Whether this is a job's [`tracker`](Self::tracker).
    pub fn is_internal(&self) -> bool {
        self.internal
    }

    /// Takes the first dirty run at or after `from` (else from the start): at most `max`
    /// bytes (at least one granule), clean once returned. None when nothing is dirty.
    pub fn take_dirty(&self, from: u64, max: u64) -> Option<(u64, u64)> {
        let g = self.granularity;
        let mut w = self.words();
        // Read under the lock: resize changes both together.
        let n = self.granules.load(Ordering::Relaxed);
        let find = |w: &[u64], start: u64| -> Option<u64> {
            let mut i = start;
            while i < n {
                let word = w[(i / 64) as usize] >> (i % 64);
                if word != 0 {
                    let at = i + u64::from(word.trailing_zeros());
                    return (at < n).then_some(at);
                }
                i = (i / 64 + 1) * 64;
            }
            None
        };
        let first = find(&w, (from / g).min(n)).or_else(|| find(&w, 0))?;
        let most = (max / g).max(1);
        let mut end = first;
        while end < n && end - first < most && w[(end / 64) as usize] & (1 << (end % 64)) != 0 {
            w[(end / 64) as usize] &= !(1 << (end % 64));
            end += 1;
        }
        Some((first * g, (end - first) * g))
    }

    fn words(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.bits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Follows the node's size (bits past the new end go).
    pub fn resize(&self, size: u64) {
        let granules = size.div_ceil(self.granularity);
        let mut w = self.words();
        self.granules.store(granules, Ordering::Relaxed);
        w.resize(granules.div_ceil(64).max(1) as usize, 0);
        // Bits beyond the last granule stay clear.
        Self::clear_tail(&mut w, granules);
    }

    /// Marks [offset, offset + len) dirty if the bitmap records.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 || !self.recording.load(Ordering::Relaxed) {
            return;
        }
        let first = offset / self.granularity;
        let last = (offset + len - 1) / self.granularity;
        let mut w = self.words();
        let n = self.granules.load(Ordering::Relaxed);
        if first >= n {
            return;
        }
        for g in first..=last.min(n - 1) {
            w[(g / 64) as usize] |= 1 << (g % 64);
        }
    }

    /// Clears the granules wholly inside `[offset, offset + len)` (a part of a granule
    /// stays as it is).
    pub fn reset(&self, offset: u64, len: u64) {
        let g = self.granularity;
        let first = offset.div_ceil(g);
        let end = offset.saturating_add(len) / g;
        let mut w = self.words();
        let n = self.granules.load(Ordering::Relaxed);
        for i in first..end.min(n) {
            w[(i / 64) as usize] &= !(1 << (i % 64));
        }
    }

    /// Sets every bit `other` has (`block-dirty-bitmap-merge`).
    pub fn merge(&self, other: &DirtyBitmap) {
        let src = other.words().clone();
        let mut w = self.words();
        if self.granularity == other.granularity {
            for (d, s) in w.iter_mut().zip(src) {
                *d |= s;
            }
            return;
        }
        // Different granularities: mark the byte ranges other's bits stand for.
        drop(w);
        let was = self.recording.swap(true, Ordering::Relaxed);
        for (i, word) in src.iter().enumerate().filter(|(_, w)| **w != 0) {
            for bit in 0..64 {
                if word & (1 << bit) != 0 {
                    let g = i as u64 * 64 + bit;
                    self.mark(g * other.granularity, other.granularity);
                }
            }
        }
        self.recording.store(was, Ordering::Relaxed);
    }

    /// Refuses `what` with QEMU's text when the bitmap is busy, read-only or
    /// inconsistent (checked in QEMU's order).
    pub fn check(&self, what: Use) -> Result<(), BitmapError> {
        let name = || self.name.clone();
        if what != Use::Read && self.busy.load(Ordering::Relaxed) {
            return Err(BitmapError::Busy(name()));
        }
        if matches!(what, Use::Modify | Use::Remove) && self.is_readonly() {
            return Err(BitmapError::ReadOnly(name()));
        }
        if what != Use::Remove && self.is_inconsistent() {
            return Err(BitmapError::Inconsistent(name()));
        }
        Ok(())
    }

    pub fn set_persistent(&self, on: bool) {
        self.persistent.store(on, Ordering::Relaxed);
    }

    pub fn is_persistent(&self) -> bool {
        self.persistent.load(Ordering::Relaxed)
    }

    pub fn set_readonly(&self, on: bool) {
        self.readonly.store(on, Ordering::Relaxed);
    }

    pub fn is_readonly(&self) -> bool {
        self.readonly.load(Ordering::Relaxed)
    }

    /// Marks the bits untrustworthy; the bitmap stops recording (QEMU's
    /// bdrv_dirty_bitmap_set_inconsistent).
    pub fn set_inconsistent(&self) {
        self.inconsistent.store(true, Ordering::Relaxed);
        self.recording.store(false, Ordering::Relaxed);
    }

    pub fn is_inconsistent(&self) -> bool {
        self.inconsistent.load(Ordering::Relaxed)
    }

    pub fn set_busy(&self, on: bool) {
        self.busy.store(on, Ordering::Relaxed);
    }

    pub fn is_recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    /// The bits as stored (QEMU's serialization): granule `i` is bit `i % 8` of byte
    /// `i / 8`, for as many bytes as the granules need.
    pub fn serialize(&self) -> Vec<u8> {
        let n = self.granules.load(Ordering::Relaxed).div_ceil(8) as usize;
        let mut v: Vec<u8> = self.words().iter().flat_map(|w| w.to_le_bytes()).collect();
        v.truncate(n);
        v
    }

    /// Sets the bits `bytes` (serialized, as [`Self::serialize`]) hold, from granule
    /// `first` (a multiple of 64) on; bits past the node's end are ignored.
    pub fn load_bits(&self, first: u64, bytes: &[u8]) {
        let n = self.granules.load(Ordering::Relaxed);
        let mut w = self.words();
        let base = (first / 64) as usize;
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let Some(word) = w.get_mut(base + i) else {
                break;
            };
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *word |= u64::from_le_bytes(b);
        }
        Self::clear_tail(&mut w, n);
    }

    /// Sets `count` granules from `first` on (an all-ones cluster of a stored bitmap).
    pub fn set_granules(&self, first: u64, count: u64) {
        let n = self.granules.load(Ordering::Relaxed);
        let mut w = self.words();
        for g in first..(first + count).min(n) {
            w[(g / 64) as usize] |= 1 << (g % 64);
        }
    }

    fn clear_tail(w: &mut [u64], granules: u64) {
        let tail = granules % 64;
        if tail != 0 {
            if let Some(last) = w.get_mut((granules / 64) as usize) {
                *last &= (1u64 << tail) - 1;
            }
        }
    }

    /// The extent from `offset` (at most `len` bytes) whose bytes are all dirty or all
    /// clean: its length and whether it is dirty (NBD's qemu:dirty-bitmap context).
    pub fn extent(&self, offset: u64, len: u64) -> (u64, bool) {
        let g = self.granularity;
        let w = self.words();
        let n = self.granules.load(Ordering::Relaxed);
        let bit = |i: u64| i < n && w[(i / 64) as usize] & (1 << (i % 64)) != 0;
        let first = offset / g;
        let dirty = bit(first);
        let end = offset.saturating_add(len);
        let mut i = first + 1;
        while i * g < end && bit(i) == dirty {
            // Whole words at once when they agree.
            if i.is_multiple_of(64) && i / 64 < w.len() as u64 {
                let word = w[(i / 64) as usize];
                if (dirty && word == u64::MAX) || (!dirty && word == 0) {
                    i += 64;
                    continue;
                }
            }
            i += 1;
        }
        ((i * g).min(end) - offset, dirty)
    }

    /// Bytes per bit.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    pub fn clear(&self) {
        self.words().fill(0);
    }

    /// A copy of the bits, to put back if a transaction aborts.
    pub fn backup(&self) -> Vec<u64> {
        self.words().clone()
    }

    /// Puts back bits [`Self::backup`] took (if the size did not change since).
    pub fn restore(&self, bits: Vec<u64>) {
        let mut w = self.words();
        if w.len() == bits.len() {
            *w = bits;
        }
    }

    pub fn set_recording(&self, on: bool) {
        self.recording.store(on, Ordering::Relaxed);
    }

    /// Dirty bytes (set bits times the granularity, as QEMU counts).
    pub fn count(&self) -> u64 {
        self.words()
            .iter()
            .map(|w| u64::from(w.count_ones()))
            .sum::<u64>()
            * self.granularity
    }

    /// QEMU's `x-debug-block-dirty-bitmap-sha256`: SHA-256 of the bits as little-endian
    /// 64-bit words, in hex.
    pub fn sha256(&self) -> String {
        let bytes: Vec<u8> = self.words().iter().flat_map(|w| w.to_le_bytes()).collect();
        let d = ring::digest::digest(&ring::digest::SHA256, &bytes);
        d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// QEMU's BlockDirtyInfo.
    pub fn info(&self) -> Value {
        let mut v = json!({
            "name": self.name,
            "recording": self.recording.load(Ordering::Relaxed),
            "persistent": self.is_persistent(),
            "busy": self.busy.load(Ordering::Relaxed),
            "granularity": self.granularity,
            "count": self.count(),
        });
        if self.is_inconsistent() {
            v["inconsistent"] = json!(true);
        }
        v
    }
}

impl Drop for DirtyBitmap {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tracker_hands_out_dirty_runs_and_forgets_them() {
        let b = DirtyBitmap::tracker("job", 4096, 1 << 20).unwrap();
        assert!(b.is_internal() && b.take_dirty(0, 1 << 20).is_none());
        b.mark(8192, 3 * 4096);
        b.mark(200 * 4096, 1);
        // From the cursor on, at most `max` bytes, then the next run; then from the start.
        assert_eq!(b.take_dirty(0, 8192), Some((8192, 8192)));
        assert_eq!(b.take_dirty(16384, 1 << 20), Some((16384, 4096)));
        assert_eq!(b.take_dirty(300 * 4096, 1 << 20), Some((200 * 4096, 4096)));
        assert_eq!(b.take_dirty(0, 1 << 20), None);
        // Runs across a 64-granule word.
        b.mark(60 * 4096, 10 * 4096);
        assert_eq!(b.take_dirty(0, 1 << 20), Some((60 * 4096, 10 * 4096)));
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn marks_whole_granules_counts_and_clears() {
        let b = DirtyBitmap::new("b", 65536, 1 << 20, true).unwrap();
        b.mark(65535, 2);
        assert_eq!(b.count(), 2 * 65536);
        b.mark(1 << 20, 4096); // past the end: nothing
        assert_eq!(b.count(), 2 * 65536);
        b.set_recording(false);
        b.mark(0, 1 << 20);
        assert_eq!(b.count(), 2 * 65536);
        b.clear();
        assert_eq!(b.count(), 0);
        // The digest of 16 granules (one word) clear: SHA-256 of 8 zero bytes.
        assert_eq!(
            b.sha256(),
            "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc"
        );
        assert!(matches!(
            DirtyBitmap::new("b", 1000, 1, true),
            Err(BitmapError::BadGranularity)
        ));
        // 8 EiB at 512 B: refused, not allocated.
        assert!(matches!(
            DirtyBitmap::new("b", 512, 1 << 63, true),
            Err(BitmapError::TooLarge)
        ));
    }

    #[test]
    fn serialized_bits_round_trip_and_extents_follow_them() {
        // 100 granules of 512 B: 13 bytes serialized.
        let b = DirtyBitmap::new("b", 512, 100 * 512, true).unwrap();
        b.mark(0, 512);
        b.mark(70 * 512, 3 * 512);
        b.mark(99 * 512, 1);
        let s = b.serialize();
        assert_eq!(s.len(), 13);
        assert_eq!(s[0], 1);
        assert_eq!(s[8], 0b1100_0000);
        assert_eq!(s[9], 1);
        assert_eq!(s[12], 0b1000);
        let c = DirtyBitmap::new("c", 512, 100 * 512, true).unwrap();
        c.load_bits(0, &s);
        assert_eq!(c.sha256(), b.sha256());
        assert_eq!(b.extent(0, 100 * 512), (512, true));
        assert_eq!(b.extent(512, 100 * 512), (69 * 512, false));
        assert_eq!(b.extent(70 * 512 + 7, 10 * 512), (3 * 512 - 7, true));
        assert_eq!(b.extent(73 * 512, 4096), (4096, false));
        assert_eq!(b.extent(99 * 512, 512), (512, true));
        // All ones past the end stay clear.
        let d = DirtyBitmap::new("d", 512, 100 * 512, true).unwrap();
        d.set_granules(64, 4096);
        assert_eq!(d.count(), 36 * 512);
        assert_eq!(d.extent(0, 1 << 20), (64 * 512, false));
        assert_eq!(d.extent(64 * 512, 1 << 20), (36 * 512, true));
        d.set_inconsistent();
        assert!(matches!(
            d.check(Use::Read),
            Err(BitmapError::Inconsistent(_))
        ));
        assert!(d.check(Use::Remove).is_ok());
        d.set_readonly(true);
        assert!(matches!(
            d.check(Use::Remove),
            Err(BitmapError::ReadOnly(_))
        ));
    }
}
