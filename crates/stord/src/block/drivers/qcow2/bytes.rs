//! Big-endian numbers read out of the image's bytes (the crate's readers, and qcow2's
//! tables of u64 entries): every on-disk structure of qcow2 (header, tables, snapshot
//! table, bitmap directory) stores its fields this way.

pub(super) use crate::bytes::{be16, be32, be64};

/// A table of u64 entries (L1, L2, refcount and bitmap tables), every 8 bytes of `b`.
pub(super) fn decode_be64(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| be64(c, 0)).collect()
}
