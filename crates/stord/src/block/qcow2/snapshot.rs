//! The internal snapshot table: read at open, never written. stord does not create or
//! apply internal snapshots, but it writes images that have them: the active image's
//! shared tables and clusters are copied before they are changed (see `set_l2` and the
//! allocating write), and the snapshots' tables are metadata no write may land on.

/// QEMU's cap on the snapshot table's size.
pub const MAX_TABLE_BYTES: u64 = 64 << 20;
/// QEMU's cap on the number of snapshots.
pub const MAX_SNAPSHOTS: u32 = 65536;

/// One snapshot's L1 table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotL1 {
    pub offset: u64,
    pub entries: u32,
}

/// What parsing a table prefix found.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// The whole table: every snapshot's L1 table, and the table's length in bytes.
    Done(Vec<SnapshotL1>, u64),
    /// The table goes on past the bytes given: at least this many are needed.
    NeedMore(u64),
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

/// Parses `n` snapshot entries from the table's first bytes `buf`.
pub fn parse(buf: &[u8], n: u32) -> Result<Parsed, String> {
    if n > MAX_SNAPSHOTS {
        return Err(format!("too many snapshots ({n})"));
    }
    let mut at = 0usize;
    let mut table_end = 0u64;
    let mut l1s = Vec::with_capacity(n as usize);
    for i in 0..n {
        let need = at as u64 + 40;
        if need > buf.len() as u64 {
            return Ok(Parsed::NeedMore(need));
        }
        let e = &buf[at..at + 40];
        let offset = u64::from_be_bytes(e[..8].try_into().expect("8 bytes"));
        let entries = be32(e, 8);
        let id = be16(e, 12) as u64;
        let name = be16(e, 14) as u64;
        let extra = be32(e, 36) as u64;
        // The next entry starts 8-aligned; the last one's padding need not be there.
        let end = at as u64 + 40 + extra + id + name;
        if end > MAX_TABLE_BYTES {
            return Err(format!("snapshot table too large (entry {i})"));
        }
        if end > buf.len() as u64 {
            return Ok(Parsed::NeedMore(end));
        }
        l1s.push(SnapshotL1 { offset, entries });
        table_end = end;
        at = (end.div_ceil(8) * 8).min(buf.len() as u64) as usize;
    }
    Ok(Parsed::Done(l1s, table_end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(l1: u64, size: u32, id: &str, name: &str, extra: u32) -> Vec<u8> {
        let mut e = vec![0u8; 40];
        e[..8].copy_from_slice(&l1.to_be_bytes());
        e[8..12].copy_from_slice(&size.to_be_bytes());
        e[12..14].copy_from_slice(&(id.len() as u16).to_be_bytes());
        e[14..16].copy_from_slice(&(name.len() as u16).to_be_bytes());
        e[36..40].copy_from_slice(&extra.to_be_bytes());
        e.extend(vec![0u8; extra as usize]);
        e.extend(id.as_bytes());
        e.extend(name.as_bytes());
        e
    }

    fn pad(mut e: Vec<u8>) -> Vec<u8> {
        while !e.len().is_multiple_of(8) {
            e.push(0);
        }
        e
    }

    #[test]
    fn entries_with_extra_data_and_names_are_walked() {
        // The last entry's padding is not on disk (QEMU's images end there).
        let mut t = pad(entry(0x30000, 1, "1", "first", 16));
        t.extend(entry(0x50000, 2, "2", "a longer name", 24));
        let len = t.len() as u64;
        assert_eq!(
            parse(&t, 2),
            Ok(Parsed::Done(
                vec![
                    SnapshotL1 {
                        offset: 0x30000,
                        entries: 1
                    },
                    SnapshotL1 {
                        offset: 0x50000,
                        entries: 2
                    }
                ],
                len
            ))
        );
        assert!(matches!(parse(&t[..50], 2), Ok(Parsed::NeedMore(_))));
        assert!(parse(&t, MAX_SNAPSHOTS + 1).is_err());
    }
}
