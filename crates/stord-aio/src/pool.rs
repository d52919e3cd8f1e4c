//! A per-thread cache of request buffers, so a request's data buffer costs no allocation,
//! no zero-fill and no page faults in steady state.
//!
//! [`AlignedBuf::from_pool`](crate::AlignedBuf::from_pool) rounds a length up to a size
//! class (a power of two from 4 KiB to [`MAX_CACHED`]) and takes a free buffer of that class
//! from the calling thread's cache; dropping the buffer puts it back. The cache is bounded:
//! at most [`CACHE_LIMIT`] bytes per thread are kept, larger buffers are never kept, and
//! anything beyond goes straight back to the allocator (buffers of 1 MiB and more are
//! mappings, so their memory returns to the kernel at once). A thread that never took a
//! buffer from the pool (a worker thread a buffer merely passes through) keeps nothing.
//!
//! The pool bounds what is *cached*; what is *in use* is bounded by the callers (an export
//! caps the requests and bytes each client may have in flight).

use std::cell::RefCell;
use std::ptr::NonNull;

/// Smallest size class.
const MIN_CLASS: usize = 4096;
/// Largest size class kept in the cache (larger buffers are allocated exactly and freed).
pub const MAX_CACHED: usize = 4 << 20;
/// Bytes of free buffers one thread keeps at most.
pub const CACHE_LIMIT: usize = 32 << 20;
const CLASSES: usize = (MAX_CACHED / MIN_CLASS).trailing_zeros() as usize + 1;

struct Pool {
    /// Set once the thread takes a buffer: only such threads cache.
    active: bool,
    free: [Vec<NonNull<u8>>; CLASSES],
    cached: usize,
}

impl Drop for Pool {
    fn drop(&mut self) {
        for (i, list) in self.free.iter_mut().enumerate() {
            let cap = MIN_CLASS << i;
            for p in list.drain(..) {
                // SAFETY: every cached pointer came from raw_alloc(cap, 4096) for its class
                // and is owned by the cache alone.
                unsafe { crate::memory::raw_free(p, cap, MIN_CLASS) };
            }
        }
    }
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool {
        active: false,
        free: Default::default(),
        cached: 0,
    });
}

fn class_of(cap: usize) -> Option<usize> {
    (cap.is_power_of_two() && (MIN_CLASS..=MAX_CACHED).contains(&cap))
        .then(|| (cap / MIN_CLASS).trailing_zeros() as usize)
}

/// The capacity a pooled buffer of `len` bytes gets: its size class, or `len` rounded up
/// to a page when it is too large to be cached.
pub(crate) fn capacity_for(len: usize) -> usize {
    let len = len.max(1);
    if len <= MAX_CACHED {
        len.next_power_of_two().max(MIN_CLASS)
    } else {
        len.div_ceil(MIN_CLASS) * MIN_CLASS
    }
}

/// A cached buffer of capacity `cap`, if the calling thread has one.
pub(crate) fn take(cap: usize) -> Option<NonNull<u8>> {
    POOL.try_with(|p| {
        let mut p = p.borrow_mut();
        p.active = true;
        let class = class_of(cap)?;
        let b = p.free[class].pop()?;
        p.cached -= cap;
        Some(b)
    })
    .ok()
    .flatten()
}

/// Offers a buffer of capacity `cap` back to the calling thread's cache; false if the
/// cache does not keep it (the caller frees it).
pub(crate) fn give(ptr: NonNull<u8>, cap: usize) -> bool {
    POOL.try_with(|p| {
        let mut p = p.borrow_mut();
        let Some(class) = class_of(cap) else {
            return false;
        };
        if !p.active || p.cached + cap > CACHE_LIMIT {
            return false;
        }
        p.cached += cap;
        p.free[class].push(ptr);
        true
    })
    .unwrap_or(false)
}

/// Bytes of free buffers the calling thread's cache holds.
pub fn cached_bytes() -> usize {
    POOL.try_with(|p| p.borrow().cached).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use crate::AlignedBuf;

    #[test]
    fn buffers_are_recycled_within_a_class_and_the_cache_is_bounded() {
        let a = AlignedBuf::from_pool(5000);
        assert_eq!(a.capacity(), 8192);
        assert_eq!(a.len(), 5000);
        assert_eq!(a.as_ptr() as usize % 4096, 0);
        let addr = a.as_ptr() as usize;
        drop(a);
        assert_eq!(super::cached_bytes(), 8192);
        let b = AlignedBuf::from_pool(8192);
        assert_eq!(
            b.as_ptr() as usize,
            addr,
            "same class: the cached buffer is reused"
        );
        assert_eq!(super::cached_bytes(), 0);
        drop(b);

        // Too large to cache: freed at once.
        let big = AlignedBuf::from_pool(super::MAX_CACHED + 1);
        assert_eq!(big.capacity() % 4096, 0);
        drop(big);
        assert_eq!(super::cached_bytes(), 8192);

        // Never more than the limit, however many buffers come back.
        let many: Vec<_> = (0..16).map(|_| AlignedBuf::from_pool(4 << 20)).collect();
        drop(many);
        assert!(super::cached_bytes() <= super::CACHE_LIMIT);
    }

    #[test]
    fn a_thread_that_never_took_a_buffer_keeps_none() {
        let b = AlignedBuf::from_pool(4096);
        std::thread::spawn(move || {
            drop(b);
            assert_eq!(super::cached_bytes(), 0);
        })
        .join()
        .unwrap();
    }
}
