//! Buffers that can be handed to the kernel.
//!
//! An I/O operation takes its buffer by value and gives it back with the result (see the
//! crate docs for the ownership rule). The traits here say which types may be handed over:
//! their bytes must live on the heap (or in static memory) at an address that does not
//! change when the owning value is moved, and must stay valid until the value is dropped.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::memory::{raw_alloc, raw_free, PAGE};

/// A buffer the kernel may read from while an operation is in flight.
///
/// # Safety
/// `stable_ptr()` must point to `bytes_len()` initialised bytes that stay valid and at the
/// same address while the value is moved around, until it is dropped.
pub unsafe trait IoBuf: 'static {
    /// Address of the first byte.
    fn stable_ptr(&self) -> *const u8;
    /// Number of bytes the operation may read.
    fn bytes_len(&self) -> usize;
}

/// A buffer the kernel may write into while an operation is in flight.
///
/// # Safety
/// As [`IoBuf`], and `stable_mut_ptr()` must allow writes to `bytes_len()` bytes.
pub unsafe trait IoBufMut: IoBuf {
    /// Address of the first byte, writable.
    fn stable_mut_ptr(&mut self) -> *mut u8;
}

/// Memory in one or more pieces that the kernel may read from while an operation is in
/// flight (a request's data spread over guest pages, say).
///
/// # Safety
/// Every iovec must name memory that stays valid, at the same address, until the value is
/// dropped, however the value is moved. When there is more than one iovec, the slice
/// itself must also stay at the same address (keep it on the heap): the kernel may read the
/// array after the operation was queued.
pub unsafe trait IoVecs: 'static {
    /// The pieces, in order.
    fn iovecs(&self) -> &[libc::iovec];
}

/// As [`IoVecs`], for memory the kernel may write into.
///
/// # Safety
/// As [`IoVecs`], and the memory must be writable for the value's owner.
pub unsafe trait IoVecsMut: IoVecs {}

// SAFETY: a Vec's elements live on the heap; moving the Vec moves only its header. The
// operation uses `len()` bytes, which are initialised.
unsafe impl IoBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for IoBuf: the heap bytes are writable through the Vec we own.
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

// SAFETY: a boxed slice's bytes live on the heap and do not move with the box.
unsafe impl IoBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as above, writable through the owned box.
unsafe impl IoBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
}

// SAFETY: static memory never moves nor goes away.
unsafe impl IoBuf for &'static [u8] {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
}

/// A heap buffer with a chosen alignment, for O_DIRECT I/O.
///
/// Two ways to get one: [`AlignedBuf::zeroed`] (fresh, all zero bytes) and
/// [`AlignedBuf::from_pool`] (recycled through the calling thread's [pool](crate::pool):
/// initialised, but holding whatever an earlier request left there). Capacities of 1 MiB
/// (`memory::MAP_MIN`) and more are mapped straight from the kernel, so their memory goes
/// back to it the moment the buffer is freed rather than lingering in the allocator's heap.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    align: usize,
    /// Returned to the owning thread's pool on drop (if it has room).
    pooled: bool,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zero bytes aligned to `align` (a power of two).
    ///
    /// # Panics
    /// If `align` is not a power of two or the layout overflows.
    pub fn zeroed(len: usize, align: usize) -> Self {
        let cap = len.max(1);
        Self {
            ptr: raw_alloc(cap, align),
            len,
            cap,
            align,
            pooled: false,
        }
    }

    /// A buffer of `len` bytes, page-aligned, from the calling thread's pool of recycled
    /// buffers (a fresh one when the pool has none of that size). Its bytes are initialised
    /// but unspecified: use it where the whole buffer is written before it is read (a
    /// request's data from a device or a socket). Dropped on a thread with a pool, it goes
    /// back there while the pool is under its limit; see [`crate::pool`].
    pub fn from_pool(len: usize) -> Self {
        let cap = crate::pool::capacity_for(len);
        let ptr = crate::pool::take(cap).unwrap_or_else(|| raw_alloc(cap, PAGE));
        Self {
            ptr,
            len,
            cap,
            align: PAGE,
            pooled: true,
        }
    }

    /// Bytes allocated (the largest length `set_len` accepts).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Changes the length (the bytes stay initialised: they were zeroed at allocation and
    /// only ever written since), so one allocation can carry requests of different sizes.
    ///
    /// # Panics
    /// If `len` exceeds the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap, "AlignedBuf::set_len beyond capacity");
        self.len = len;
    }

    /// The alignment it was allocated with.
    pub fn align(&self) -> usize {
        self.align
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed) bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.pooled && crate::pool::give(self.ptr, self.cap) {
            return;
        }
        // SAFETY: `ptr` came from raw_alloc(cap, align) (directly or through the pool,
        // which allocates with the same arguments) and is not used after this.
        unsafe { raw_free(self.ptr, self.cap, self.align) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("align", &self.align)
            .finish()
    }
}

// SAFETY: the allocation never moves and lives until drop; all bytes are initialised.
unsafe impl IoBuf for AlignedBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_len(&self) -> usize {
        self.len
    }
}

// SAFETY: as above, and we own the allocation exclusively.
unsafe impl IoBufMut for AlignedBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

/// A sub-range of an owned buffer, so an operation can fill or send part of it.
#[derive(Debug)]
pub struct Slice<B> {
    buf: B,
    start: usize,
    end: usize,
}

impl<B: IoBuf> Slice<B> {
    /// `buf[start..end]`.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub fn new(buf: B, start: usize, end: usize) -> Self {
        assert!(start <= end && end <= buf.bytes_len(), "slice out of range");
        Self { buf, start, end }
    }

    /// Gives the whole buffer back.
    pub fn into_inner(self) -> B {
        self.buf
    }

    /// The range's start within the buffer.
    pub fn start(&self) -> usize {
        self.start
    }
}

// SAFETY: a sub-range of a buffer whose bytes are stable and initialised (B's contract).
unsafe impl<B: IoBuf> IoBuf for Slice<B> {
    fn stable_ptr(&self) -> *const u8 {
        // SAFETY: start <= len, checked in `new`.
        unsafe { self.buf.stable_ptr().add(self.start) }
    }
    fn bytes_len(&self) -> usize {
        self.end - self.start
    }
}

// SAFETY: as above, and B is writable.
unsafe impl<B: IoBufMut> IoBufMut for Slice<B> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: start <= len, checked in `new`.
        unsafe { self.buf.stable_mut_ptr().add(self.start) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_and_zeroed() {
        let mut b = AlignedBuf::zeroed(8192, 4096);
        assert_eq!(b.stable_ptr() as usize % 4096, 0);
        assert!(b.iter().all(|&x| x == 0));
        b[100] = 7;
        let mut moved = b;
        assert_eq!(moved[100], 7);
        moved.set_len(200);
        assert_eq!(moved.len(), 200);
        moved.set_len(8192);
        assert_eq!(moved[100], 7);
    }

    #[test]
    fn large_buffers_are_mapped_zeroed_and_writable() {
        let mut b = AlignedBuf::zeroed(3 << 20, 4096);
        assert_eq!(b.stable_ptr() as usize % 4096, 0);
        assert!(b.iter().all(|&x| x == 0));
        let n = b.len();
        b[n - 1] = 9;
        assert_eq!(b[n - 1], 9);
    }
}
