//! Big-endian numbers read out of the image's bytes: every on-disk structure of qcow2
//! (header, tables, snapshot table, bitmap directory) stores its fields this way. One
//! place, so the parsers share them.

/// The u16 at `at`.
pub(super) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

/// The u32 at `at`.
pub(super) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The u64 at `at`.
pub(super) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A table of u64 entries (L1, L2, refcount and bitmap tables), every 8 bytes of `b`.
pub(super) fn decode_be64(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| be64(c, 0)).collect()
}
