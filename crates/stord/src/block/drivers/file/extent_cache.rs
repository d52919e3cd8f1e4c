//! The last extent block status found (data or hole, and where it ends), so the next
//! questions inside it cost no lseek. NBD's sparse reads ask before every read, so on a
//! fully allocated image one lseek answers them all.
//!
//! Changes that can turn data into a hole (discard, write-zeroes, resize) drop the cached
//! extent; writes drop it only if it is a hole (a write can fill a hole, never punch one).
//! A generation counter, bumped by every such drop, keeps a lookup that raced with a change
//! from storing what it saw before the change.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One extent: `[start, end)`, allocated (data) or not (a hole).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub start: u64,
    pub end: u64,
    pub allocated: bool,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct ExtentCache {
    last: Mutex<Option<Extent>>,
    gen: AtomicU64,
}

impl ExtentCache {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Extent>> {
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached extent containing `offset`, if any.
    pub fn lookup(&self, offset: u64) -> Option<Extent> {
        self.slot().filter(|e| (e.start..e.end).contains(&offset))
    }

    /// The generation to pass to [`store`](Self::store) after a lookup by lseek.
    pub fn generation(&self) -> u64 {
        self.gen.load(Ordering::Acquire)
    }

    /// Remembers `e`, found by a lookup that started at generation `gen`, unless a change
    /// happened since. An extent of the same kind that overlaps or touches the cached one
    /// is merged with it: a probe only finds where an extent ends, not where it starts, so
    /// random reads over an allocated image widen one extent until it covers the file.
    pub fn store(&self, e: Extent, gen: u64) {
        let mut slot = self.slot();
        if self.gen.load(Ordering::Acquire) != gen {
            return;
        }
        *slot = Some(match *slot {
            Some(c) if c.allocated == e.allocated && e.start <= c.end && c.start <= e.end => {
                Extent {
                    start: c.start.min(e.start),
                    end: c.end.max(e.end),
                    allocated: e.allocated,
                }
            }
            _ => e,
        });
    }

    /// A write to `[start, end)` is about to happen: a cached hole it touches may fill.
    pub fn before_write(&self, start: u64, end: u64) {
        let mut slot = self.slot();
        if matches!(*slot, Some(e) if !e.allocated && start < e.end && e.start < end) {
            *slot = None;
            self.gen.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Something that may punch holes (discard, write-zeroes, resize) is about to happen.
    pub fn invalidate(&self) {
        let mut slot = self.slot();
        *slot = None;
        self.gen.fetch_add(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_inside_the_extent_and_forgets_what_a_change_may_alter() {
        let c = ExtentCache::default();
        let data = Extent {
            start: 0,
            end: 1 << 20,
            allocated: true,
        };
        c.store(data, c.generation());
        assert_eq!(c.lookup(4096), Some(data));
        assert_eq!(c.lookup(1 << 20), None);
        // Writes keep a data extent, drop a hole they touch.
        c.before_write(0, 4096);
        assert_eq!(c.lookup(0), Some(data));
        let hole = Extent {
            start: 1 << 20,
            end: 2 << 20,
            allocated: false,
        };
        c.store(hole, c.generation());
        c.before_write(0, 4096);
        assert_eq!(c.lookup(1 << 20), Some(hole), "a write elsewhere keeps it");
        c.before_write((2 << 20) - 512, 2 << 20);
        assert_eq!(c.lookup(1 << 20), None);
        // Extents of the same kind that touch merge; another kind replaces.
        let d1 = Extent {
            start: 8 << 20,
            end: 16 << 20,
            allocated: true,
        };
        let d2 = Extent {
            start: 4 << 20,
            end: 16 << 20,
            allocated: true,
        };
        c.store(d1, c.generation());
        c.store(d2, c.generation());
        assert_eq!(
            c.lookup(5 << 20).map(|e| (e.start, e.end)),
            Some((4 << 20, 16 << 20))
        );
        c.store(hole, c.generation());
        assert_eq!(c.lookup(5 << 20), None);
        // A lookup that raced with a change does not store its stale answer.
        let g = c.generation();
        c.invalidate();
        c.store(hole, g);
        assert_eq!(c.lookup(1 << 20), None);
    }
}
