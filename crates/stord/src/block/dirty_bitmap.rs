//! Dirty bitmaps: which parts of a node were written since a point in time (incremental
//! backup's base).
//!
//! A bitmap has one bit per `granularity` bytes of its node; a write, write-zeroes or
//! (passed-on) discard that enters the graph at the node sets the bits it touches while the
//! bitmap records. Names, defaults, errors and the `x-debug-block-dirty-bitmap-sha256`
//! digest are QEMU's: the digest is over the bits as 64-bit little-endian words (QEMU's
//! last HBitmap level), so equal digests mean the same bits as qsd's. Bitmaps here are
//! transient (persistent ones in qcow2 are refused until stord stores them).

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
    #[error("stord cannot store persistent dirty bitmaps yet (add it with persistent=false)")]
    Persistent,
    #[error("Bitmap '{0}' is currently in use by another operation and cannot be used")]
    Busy(String),
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

/// Whether a bitmap of `granularity` can cover `size` bytes within [`MAX_BITS_BYTES`].
pub fn fits(size: u64, granularity: u64) -> bool {
    size.div_ceil(granularity).div_ceil(64) * 8 <= MAX_BITS_BYTES
}

/// One bitmap.
pub struct DirtyBitmap {
    pub name: String,
    granularity: u64,
    recording: AtomicBool,
    /// One bit per granule, in 64-bit words.
    bits: Mutex<Vec<u64>>,
    /// Granules the node's size covers (bits past them stay clear).
    granules: std::sync::atomic::AtomicU64,
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
            bits: Mutex::new(Vec::new()),
            granules: Default::default(),
        };
        b.resize(size);
        Ok(b)
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
        let tail = granules % 64;
        if tail != 0 {
            if let Some(last) = w.last_mut() {
                *last &= (1u64 << tail) - 1;
            }
        }
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

    /// Bytes per bit.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    pub fn clear(&self) {
        self.words().fill(0);
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
        json!({
            "name": self.name,
            "recording": self.recording.load(Ordering::Relaxed),
            "persistent": false,
            "busy": false,
            "granularity": self.granularity,
            "count": self.count(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
