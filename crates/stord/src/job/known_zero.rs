//! What a `sync=full` mirror knows reads as zeroes on its target, granule by granule
//! (QEMU 10.1's zero_bitmap in block/mirror.c): all of it when the target read as zeroes
//! at the start (`target-is-zero`, a fresh image, or zeroed first), none otherwise. A
//! range the source reads as zeroes is then written only where the target may not read
//! so already: the target stays sparse and nothing is written twice. Data written or
//! discarded clears the granules it touches; zeroes written mark the granules they cover
//! whole (the image's last, partial granule counts whole when the write reaches the end).

use std::sync::Mutex;

/// The target's granules known to read as zeroes.
pub struct KnownZero {
    granularity: u64,
    size: u64,
    bits: Mutex<Vec<u64>>,
}

impl KnownZero {
    /// A map of `size` bytes in `granularity`-byte granules, all known zero or none.
    pub fn new(granularity: u64, size: u64, all: bool) -> Self {
        let granules = size.div_ceil(granularity);
        let words = granules.div_ceil(64) as usize;
        let mut bits = vec![if all { u64::MAX } else { 0 }; words];
        if all && !granules.is_multiple_of(64) {
            if let Some(last) = bits.last_mut() {
                *last = (1u64 << (granules % 64)) - 1;
            }
        }
        KnownZero {
            granularity,
            size,
            bits: Mutex::new(bits),
        }
    }

    fn bits(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.bits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The granules touching `[offset, offset + len)`.
    fn wide(&self, offset: u64, len: u64) -> (u64, u64) {
        let g = self.granularity;
        (offset / g, (offset + len).min(self.size).div_ceil(g))
    }

    /// Whether every granule `[offset, offset + len)` touches reads as zeroes.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        let (a, b) = self.wide(offset, len);
        let bits = self.bits();
        (a..b).all(|i| bits[(i / 64) as usize] & (1 << (i % 64)) != 0)
    }

    /// Data (or a discard) reached `[offset, offset + len)`: its granules may not read as
    /// zeroes any more.
    pub fn clear(&self, offset: u64, len: u64) {
        let (a, b) = self.wide(offset, len);
        let mut bits = self.bits();
        for i in a..b {
            bits[(i / 64) as usize] &= !(1 << (i % 64));
        }
    }

    /// Zeroes were written to `[offset, offset + len)`: the granules it covers whole read
    /// as zeroes now.
    pub fn set(&self, offset: u64, len: u64) {
        let g = self.granularity;
        let end = offset + len;
        let a = offset.div_ceil(g);
        let b = if end >= self.size {
            self.size.div_ceil(g)
        } else {
            end / g
        };
        let mut bits = self.bits();
        for i in a..b {
            bits[(i / 64) as usize] |= 1 << (i % 64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroes_mark_whole_granules_and_data_clears_what_it_touches() {
        let k = KnownZero::new(4096, 70 * 4096 + 100, false);
        assert!(!k.covers(0, 1));
        k.set(100, 3 * 4096);
        assert!(!k.covers(0, 4096) && k.covers(4096, 2 * 4096));
        // The last granule is partial: zeroes up to the end mark it.
        k.set(69 * 4096, 4096 + 100);
        assert!(k.covers(70 * 4096, 100));
        k.clear(4096 + 1, 1);
        assert!(!k.covers(4096, 4096) && k.covers(8192, 4096));
        let all = KnownZero::new(65536, 10 << 20, true);
        assert!(all.covers(0, 10 << 20));
        all.clear((10 << 20) - 1, 1);
        assert!(!all.covers(0, 10 << 20) && all.covers(0, (10 << 20) - 65536));
    }
}
