//! The internal snapshot table: its L1 tables read at open (metadata no write may land on;
//! the active image's shared tables and clusters are copied before they change, see
//! `set_l2` and the allocating write), and its entries read and written whole by
//! `blockdev-snapshot-internal-sync` and its delete ([`super::internal`]). stord does not
//! apply (revert to) a snapshot.

use super::bytes::{be16, be32, be64};

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
        let offset = be64(e, 0);
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

/// One snapshot as the table holds it (QEMU's QCowSnapshotHeader, its extra data kept
/// as stored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub l1: SnapshotL1,
    pub id: String,
    pub name: String,
    pub date_sec: u32,
    pub date_nsec: u32,
    pub vm_clock_nsec: u64,
    pub vm_state_size: u32,
    pub extra: Vec<u8>,
}

/// The extra data QEMU writes: vm_state_size_large, disk_size, icount.
pub const EXTRA_LEN: usize = 24;

impl Entry {
    /// The snapshot's icount (-1: none), from the extra data if it has it.
    pub fn icount(&self) -> Option<u64> {
        let v = u64::from_be_bytes(self.extra.get(16..24)?.try_into().ok()?);
        (v != u64::MAX).then_some(v)
    }
}

/// Every entry of a whole table (`buf`, `n` entries), as [`parse`] walks it.
pub fn entries(buf: &[u8], n: u32) -> Result<Vec<Entry>, String> {
    let mut at = 0usize;
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let e = buf
            .get(at..at + 40)
            .ok_or_else(|| format!("snapshot entry {i} runs past the table"))?;
        let (id_len, name_len) = (be16(e, 12) as usize, be16(e, 14) as usize);
        let extra_len = be32(e, 36) as usize;
        let body = at + 40;
        let end = body + extra_len + id_len + name_len;
        let rest = buf
            .get(body..end)
            .ok_or_else(|| format!("snapshot entry {i} runs past the table"))?;
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        out.push(Entry {
            l1: SnapshotL1 {
                offset: be64(e, 0),
                entries: be32(e, 8),
            },
            id: text(&rest[extra_len..extra_len + id_len]),
            name: text(&rest[extra_len + id_len..]),
            date_sec: be32(e, 16),
            date_nsec: be32(e, 20),
            vm_clock_nsec: be64(e, 24),
            vm_state_size: be32(e, 32),
            extra: rest[..extra_len].to_vec(),
        });
        at = end.div_ceil(8) * 8;
    }
    Ok(out)
}

/// The table holding `entries`, each padded to 8 bytes as QEMU writes it.
pub fn serialize(entries: &[Entry]) -> Vec<u8> {
    let mut t = Vec::new();
    for e in entries {
        t.extend(e.l1.offset.to_be_bytes());
        t.extend(e.l1.entries.to_be_bytes());
        t.extend((e.id.len() as u16).to_be_bytes());
        t.extend((e.name.len() as u16).to_be_bytes());
        t.extend(e.date_sec.to_be_bytes());
        t.extend(e.date_nsec.to_be_bytes());
        t.extend(e.vm_clock_nsec.to_be_bytes());
        t.extend(e.vm_state_size.to_be_bytes());
        t.extend((e.extra.len() as u32).to_be_bytes());
        t.extend(&e.extra);
        t.extend(e.id.as_bytes());
        t.extend(e.name.as_bytes());
        while !t.len().is_multiple_of(8) {
            t.push(0);
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_through_the_table() {
        let e = |id: &str, name: &str| Entry {
            l1: SnapshotL1 {
                offset: 0x30000,
                entries: 3,
            },
            id: id.into(),
            name: name.into(),
            date_sec: 7,
            date_nsec: 8,
            vm_clock_nsec: 9,
            vm_state_size: 0,
            extra: [
                0u64.to_be_bytes(),
                1u64.to_be_bytes(),
                u64::MAX.to_be_bytes(),
            ]
            .concat(),
        };
        let list = vec![e("1", "first"), e("12", "a longer name")];
        let t = serialize(&list);
        assert_eq!(entries(&t, 2).unwrap(), list);
        assert_eq!(list[0].icount(), None);
        assert!(matches!(parse(&t, 2), Ok(Parsed::Done(l, _)) if l.len() == 2));
    }

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
