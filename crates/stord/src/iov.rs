//! [`IoVec`]: a request's data as pieces of memory, either one buffer of ours or memory
//! lent by someone else (a guest's RAM, kept mapped by a handle the `IoVec` holds), so the
//! file backend reads into and writes from guest pages directly, with no copy, and every
//! I/O engine deals with one type. The raw memory accesses of the block layer's data path
//! (copies and zero-fills of lent memory) are all in this module.

use std::any::Any;
use std::sync::Arc;

use stord_aio::{AlignedBuf, IoBufMut, IoVecs, IoVecsMut};

/// The pieces an operation sees.
enum Segs {
    One(libc::iovec),
    /// On the heap, so the array stays put while the `IoVec` moves (the kernel may read it
    /// after the operation was queued).
    Many(Box<[libc::iovec]>),
}

impl Segs {
    fn as_slice(&self) -> &[libc::iovec] {
        match self {
            Segs::One(v) => std::slice::from_ref(v),
            Segs::Many(v) => v,
        }
    }
}

/// Who keeps the memory alive.
enum Owner {
    /// Our own buffer (the one piece points into it).
    Buf(AlignedBuf),
    /// Someone else's memory, valid while this handle lives.
    Lent(#[allow(dead_code)] Arc<dyn Any + Send + Sync>),
}

/// A request's data: pieces of memory valid for as long as the `IoVec` lives.
pub struct IoVec {
    /// What an operation sees now: the whole request, or its tail after [`advance_to`].
    ///
    /// [`advance_to`]: IoVec::advance_to
    view: Segs,
    /// The whole request while `view` is advanced.
    whole: Option<Segs>,
    /// Bytes in `view`.
    len: usize,
    /// Bytes of the whole request.
    total: usize,
    owner: Owner,
}

// SAFETY: the pointers name memory owned by `owner` (an AlignedBuf, or a handle that keeps
// a mapping alive), both of which may move to and be dropped on another thread.
unsafe impl Send for IoVec {}

impl IoVec {
    /// Our own buffer as one piece.
    pub fn from_buf(mut buf: AlignedBuf) -> Self {
        let len = buf.len();
        let v = libc::iovec {
            iov_base: buf.stable_mut_ptr().cast(),
            iov_len: len,
        };
        Self {
            view: Segs::One(v),
            whole: None,
            len,
            total: len,
            owner: Owner::Buf(buf),
        }
    }

    /// The buffer [`from_buf`](Self::from_buf) wrapped, if that is what this is.
    pub fn into_buf(self) -> Option<AlignedBuf> {
        match self.owner {
            Owner::Buf(b) => Some(b),
            Owner::Lent(_) => None,
        }
    }

    /// Memory someone else owns, as pieces `(address, length)`.
    ///
    /// # Safety
    /// Every piece must be memory mapped readable and writable (for as long as `owner`
    /// lives), which nothing else in this process accesses through references meanwhile.
    /// Another process (the guest) may change it at any time; this type only ever copies
    /// bytes in and out of it, and the kernel reads and writes it.
    pub unsafe fn lent(pieces: &[(*mut u8, usize)], owner: Arc<dyn Any + Send + Sync>) -> Self {
        let iov = |&(p, l): &(*mut u8, usize)| libc::iovec {
            iov_base: p.cast(),
            iov_len: l,
        };
        let total = pieces.iter().map(|p| p.1).sum();
        let view = match pieces {
            [one] => Segs::One(iov(one)),
            many => Segs::Many(many.iter().map(iov).collect()),
        };
        Self {
            view,
            whole: None,
            len: total,
            total,
            owner: Owner::Lent(owner),
        }
    }

    /// Bytes an operation sees now (the whole request unless advanced).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether every piece starts and ends on a multiple of `align` (what O_DIRECT needs).
    pub fn is_aligned(&self, align: usize) -> bool {
        self.whole
            .as_ref()
            .unwrap_or(&self.view)
            .as_slice()
            .iter()
            .all(|v| (v.iov_base as usize).is_multiple_of(align) && v.iov_len.is_multiple_of(align))
    }

    /// Lets an operation see only the bytes after the first `n` of the whole request
    /// (to continue a short transfer). Allocates only for a tail of several pieces.
    pub fn advance_to(&mut self, n: usize) {
        self.rewind();
        if n == 0 {
            return;
        }
        let n = n.min(self.total);
        let mut skip = n;
        let mut rest = Vec::new();
        for v in self.view.as_slice() {
            if skip >= v.iov_len {
                skip -= v.iov_len;
                continue;
            }
            rest.push(libc::iovec {
                // SAFETY: skip < iov_len, so the pointer stays inside this piece.
                iov_base: unsafe { v.iov_base.cast::<u8>().add(skip) }.cast(),
                iov_len: v.iov_len - skip,
            });
            skip = 0;
        }
        let tail = match rest.len() {
            0 => Segs::One(libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }),
            1 => Segs::One(rest[0]),
            _ => Segs::Many(rest.into_boxed_slice()),
        };
        self.whole = Some(std::mem::replace(&mut self.view, tail));
        self.len = self.total - n;
    }

    /// Back to the whole request.
    pub fn rewind(&mut self) {
        if let Some(w) = self.whole.take() {
            self.view = w;
            self.len = self.total;
        }
    }

    /// Visits the whole request's pieces from byte `at` on, as (pointer, length).
    fn pieces_from(&self, mut at: usize, mut f: impl FnMut(*mut u8, usize)) {
        for v in self.whole.as_ref().unwrap_or(&self.view).as_slice() {
            if at >= v.iov_len {
                at -= v.iov_len;
                continue;
            }
            // SAFETY: at < iov_len, inside the piece.
            f(unsafe { v.iov_base.cast::<u8>().add(at) }, v.iov_len - at);
            at = 0;
        }
    }

    /// Copies `src` into the whole request starting at its byte `at`.
    pub fn copy_in(&mut self, at: usize, src: &[u8]) {
        assert!(at + src.len() <= self.total, "IoVec::copy_in out of range");
        let mut done = 0;
        self.pieces_from(at, |p, l| {
            let n = l.min(src.len() - done);
            // SAFETY: `p..p+n` lies inside one piece, writable memory valid while `self`
            // lives (the constructors' contracts); `src` is our own memory, disjoint from it.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(done), p, n) };
            done += n;
        });
    }

    /// Copies the whole request's bytes from `at` into `dst`.
    pub fn copy_out(&self, at: usize, dst: &mut [u8]) {
        assert!(at + dst.len() <= self.total, "IoVec::copy_out out of range");
        let mut done = 0;
        self.pieces_from(at, |p, l| {
            let n = l.min(dst.len() - done);
            // SAFETY: as in copy_in, reading this time; `dst` is ours and disjoint.
            unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr().add(done), n) };
            done += n;
        });
    }

    /// Zeroes the whole request from byte `at` to its end.
    pub fn zero_from(&mut self, at: usize) {
        self.pieces_from(at, |p, l| {
            // SAFETY: `p..p+l` is the rest of one writable piece.
            unsafe { std::ptr::write_bytes(p, 0, l) };
        });
    }
}

// SAFETY: the pieces stay valid while the IoVec lives (its owner keeps them: our own
// AlignedBuf, which does not move its bytes, or a lent mapping's handle), and a multi-piece
// array is boxed, so it does not move with the IoVec either.
unsafe impl IoVecs for IoVec {
    fn iovecs(&self) -> &[libc::iovec] {
        self.view.as_slice()
    }
}

// SAFETY: as above; the memory is writable (our buffer, or lent read-write).
unsafe impl IoVecsMut for IoVec {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_round_trips_and_advancing_shows_the_tail() {
        let mut b = AlignedBuf::zeroed(8192, 4096);
        b[4096] = 7;
        let mut v = IoVec::from_buf(b);
        assert!(v.is_aligned(4096));
        v.advance_to(4096);
        assert_eq!(v.len(), 4096);
        // SAFETY: the one piece is the buffer's second half, readable.
        assert_eq!(unsafe { *(v.iovecs()[0].iov_base as *const u8) }, 7);
        v.rewind();
        assert_eq!(v.len(), 8192);
        assert_eq!(v.into_buf().unwrap()[4096], 7);
    }

    #[test]
    fn lent_pieces_copy_zero_and_advance_across_boundaries() {
        let mut mem = vec![1u8; 3000];
        let base = mem.as_mut_ptr();
        // Three pieces: 1000 at 0, 500 at 1500, 1000 at 2000.
        // SAFETY: the pieces lie inside `mem`, which outlives `v` and is not touched
        // through references while `v` lives.
        let mut v = unsafe {
            IoVec::lent(
                &[(base, 1000), (base.add(1500), 500), (base.add(2000), 1000)],
                Arc::new(()),
            )
        };
        assert_eq!(v.len(), 2500);
        assert!(!v.is_aligned(512));
        let src: Vec<u8> = (0..2500u32).map(|i| (i % 251) as u8).collect();
        v.copy_in(0, &src);
        let mut back = vec![0u8; 2500];
        v.copy_out(0, &mut back);
        assert_eq!(back, src);
        v.advance_to(1200);
        let seen: Vec<usize> = v.iovecs().iter().map(|i| i.iov_len).collect();
        assert_eq!(seen, vec![300, 1000]);
        assert_eq!(v.len(), 1300);
        v.zero_from(1200);
        v.rewind();
        v.copy_out(0, &mut back);
        assert_eq!(&back[..1200], &src[..1200]);
        assert!(back[1200..].iter().all(|&b| b == 0));
        drop(v);
        // The gap between the pieces was never written.
        assert!(mem[1000..1500].iter().all(|&b| b == 1));
    }
}
