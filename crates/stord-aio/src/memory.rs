//! The memory behind [`AlignedBuf`](crate::AlignedBuf) and the buffer
//! [pool](crate::pool): zeroed, aligned bytes from the allocator, or an anonymous mapping
//! from the kernel for large capacities. Both the buffer (which frees what it owns) and
//! the pool (which frees what it caches when its thread ends) take them from here.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Capacity from which buffers are mmap'ed rather than taken from the allocator.
pub(crate) const MAP_MIN: usize = 1 << 20;
/// The alignment of pooled buffers, and the most a mapping (page-aligned) satisfies.
pub(crate) const PAGE: usize = 4096;

fn mapped(cap: usize, align: usize) -> bool {
    cap >= MAP_MIN && align <= PAGE
}

/// Allocates `cap` (> 0) zero bytes aligned to `align`.
pub(crate) fn raw_alloc(cap: usize, align: usize) -> NonNull<u8> {
    if mapped(cap, align) {
        // SAFETY: an anonymous private mapping takes no pointer from us; the result is
        // checked for MAP_FAILED before use. Mappings are page-aligned and zero-filled.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            if let Some(p) = NonNull::new(p.cast::<u8>()) {
                return p;
            }
        }
        let layout = Layout::from_size_align(cap, align).expect("bad AlignedBuf layout");
        alloc::handle_alloc_error(layout);
    }
    let layout = Layout::from_size_align(cap, align).expect("bad AlignedBuf layout");
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { alloc::alloc_zeroed(layout) };
    NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout))
}

/// Frees what [`raw_alloc`] returned for the same `cap` and `align`.
///
/// # Safety
/// `ptr` must come from `raw_alloc(cap, align)` and not be used afterwards.
pub(crate) unsafe fn raw_free(ptr: NonNull<u8>, cap: usize, align: usize) {
    if mapped(cap, align) {
        // SAFETY: the caller passes a mapping of exactly `cap` bytes made by raw_alloc.
        unsafe { libc::munmap(ptr.as_ptr().cast(), cap) };
        return;
    }
    let layout = Layout::from_size_align(cap, align).expect("layout");
    // SAFETY: allocated by raw_alloc with this same layout (the caller's contract).
    unsafe { alloc::dealloc(ptr.as_ptr(), layout) }
}
