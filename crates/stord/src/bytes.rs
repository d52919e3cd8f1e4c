//! Big-endian numbers read out of on-disk bytes: qcow2 (header, tables, snapshot table,
//! bitmap directory) and LUKS headers store their fields this way. One place, so the
//! parsers share them; each panics only on a slice too short, which callers rule out by
//! reading whole structures first.

/// The u16 at `at`.
pub fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

/// The u32 at `at`.
pub fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The u64 at `at`.
pub fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
