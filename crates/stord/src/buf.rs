//! The buffers requests carry: aligned for O_DIRECT, taken from the IoThread's pool on the
//! data path. Below everything that moves data (the block layer, the exports, the NBD
//! wire), so none of them reaches up to another for a buffer.

use stord_aio::AlignedBuf;

/// The buffer requests carry: aligned for O_DIRECT, owned for the duration of the I/O.
pub type Buf = AlignedBuf;

/// Memory alignment of request buffers.
pub const BUF_ALIGN: usize = 4096;

/// A fresh request buffer of `len` zero bytes.
pub fn new_buf(len: usize) -> Buf {
    AlignedBuf::zeroed(len, BUF_ALIGN)
}

/// A request's data buffer of `len` bytes from the IoThread's pool (no allocation, no
/// zero-fill in steady state). Its initial bytes are unspecified: use it only where the
/// whole buffer is written before anyone reads it (data read from a node, whose drivers
/// fill every byte or fail, or received from a client).
pub fn request_buf(len: usize) -> Buf {
    AlignedBuf::from_pool(len)
}

/// Counts one request whose data went through a buffer of ours instead of straight
/// to or from the memory it came in (`block.bounced` in the current loop's statistics).
pub(crate) fn count_bounce() {
    stord_aio::with_current_context(|c| c.counter("block.bounced").add(1));
}

/// Whether every byte of `b` is zero (16 bytes at a time).
pub fn is_zero(b: &[u8]) -> bool {
    let chunks = b.chunks_exact(16);
    let tail = chunks.remainder();
    chunks
        .map(|c| u128::from_ne_bytes(c.try_into().expect("16 bytes")))
        .all(|w| w == 0)
        && tail.iter().all(|&x| x == 0)
}
