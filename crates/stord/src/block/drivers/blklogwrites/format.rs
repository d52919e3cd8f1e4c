//! The dm-log-writes format as Linux's dm-log-writes and QEMU's blklogwrites write it,
//! all little-endian: sector 0 holds the superblock; entries follow from sector 1, each a
//! sector with its 32-byte header, then (but for a discard) its data, `nr_sectors`
//! sectors of it. A write-zeroes logs its zeroes as data; a flush is an entry of no sectors.

/// The superblock's magic ("rhswfsj").
pub const MAGIC: u64 = 0x006a_7366_7773_6872;
/// The only version there is.
pub const VERSION: u64 = 1;
/// The entry was a flush.
pub const FLUSH: u64 = 1 << 0;
/// The write was FUA (QEMU never sets it: its generic layer turns FUA into a flush).
pub const FUA: u64 = 1 << 1;
/// The entry was a discard (no data follows its header).
pub const DISCARD: u64 = 1 << 2;
/// A mark (dm-log-writes' message; QEMU writes none).
pub const MARK: u64 = 1 << 3;
/// Every flag there is.
pub const FLAG_MASK: u64 = FLUSH | FUA | DISCARD | MARK;
/// The superblock's bytes (magic, version, nr_entries, sectorsize).
pub const SUPER_LEN: usize = 28;
/// An entry header's bytes (sector, nr_sectors, flags, data_len).
pub const ENTRY_LEN: usize = 32;

/// Whether a log may use `size` as its sector size (QEMU's check).
pub fn sector_size_valid(size: u64) -> bool {
    size.is_power_of_two() && size >= ENTRY_LEN as u64 && size < 1 << 24
}

/// The superblock: how many entries the log holds, in sectors of what size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub magic: u64,
    pub version: u64,
    pub nr_entries: u64,
    pub sector_size: u32,
}

impl Superblock {
    /// A valid superblock of `nr_entries` in sectors of `sector_size`.
    pub fn new(nr_entries: u64, sector_size: u32) -> Self {
        Superblock {
            magic: MAGIC,
            version: VERSION,
            nr_entries,
            sector_size,
        }
    }

    /// Its sector: the fields, then zeroes.
    pub fn to_sector(self) -> Vec<u8> {
        let mut s = vec![0u8; self.sector_size as usize];
        s[0..8].copy_from_slice(&self.magic.to_le_bytes());
        s[8..16].copy_from_slice(&self.version.to_le_bytes());
        s[16..24].copy_from_slice(&self.nr_entries.to_le_bytes());
        s[24..28].copy_from_slice(&self.sector_size.to_le_bytes());
        s
    }

    /// Read from the first [`SUPER_LEN`] bytes of `b`.
    pub fn parse(b: &[u8; SUPER_LEN]) -> Self {
        Superblock {
            magic: le64(&b[0..8]),
            version: le64(&b[8..16]),
            nr_entries: le64(&b[16..24]),
            sector_size: u32::from_le_bytes(b[24..28].try_into().unwrap()),
        }
    }
}

/// One entry's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Where the request began, in log sectors.
    pub sector: u64,
    /// How long it was, in log sectors.
    pub nr_sectors: u64,
    pub flags: u64,
    /// QEMU writes 0 (dm-log-writes: the length of a mark's message).
    pub data_len: u64,
}

impl Entry {
    /// The header in the first [`ENTRY_LEN`] bytes of `sector` (the rest left as it is).
    pub fn write_to(self, sector: &mut [u8]) {
        sector[0..8].copy_from_slice(&self.sector.to_le_bytes());
        sector[8..16].copy_from_slice(&self.nr_sectors.to_le_bytes());
        sector[16..24].copy_from_slice(&self.flags.to_le_bytes());
        sector[24..32].copy_from_slice(&self.data_len.to_le_bytes());
    }

    /// Read from the first [`ENTRY_LEN`] bytes of `b`.
    pub fn parse(b: &[u8; ENTRY_LEN]) -> Self {
        Entry {
            sector: le64(&b[0..8]),
            nr_sectors: le64(&b[8..16]),
            flags: le64(&b[16..24]),
            data_len: le64(&b[24..32]),
        }
    }

    /// The log sectors the entry takes: its header's, then its data's.
    pub fn log_sectors(&self) -> u64 {
        if self.flags & DISCARD != 0 {
            1
        } else {
            1 + self.nr_sectors
        }
    }
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_bytes_are_the_kernel_layout() {
        let s = Superblock::new(3, 512).to_sector();
        assert_eq!(s.len(), 512);
        assert_eq!(&s[0..8], b"rhswfsj\0");
        assert_eq!(s[8], 1);
        assert_eq!(s[16], 3);
        assert_eq!(&s[24..28], &512u32.to_le_bytes());
        assert!(s[28..].iter().all(|&b| b == 0));
        assert_eq!(
            Superblock::parse(s[..SUPER_LEN].try_into().unwrap()),
            Superblock::new(3, 512)
        );
    }

    #[test]
    fn entries_round_trip_and_discards_carry_no_data() {
        let e = Entry {
            sector: 8,
            nr_sectors: 4,
            flags: DISCARD,
            data_len: 0,
        };
        let mut b = [0xffu8; 64];
        e.write_to(&mut b);
        assert_eq!(Entry::parse(b[..ENTRY_LEN].try_into().unwrap()), e);
        assert_eq!(b[32], 0xff);
        assert_eq!(e.log_sectors(), 1);
        assert_eq!(Entry { flags: 0, ..e }.log_sectors(), 5);
    }

    #[test]
    fn sector_sizes_as_qemu_takes_them() {
        assert!(sector_size_valid(512) && sector_size_valid(32) && sector_size_valid(1 << 23));
        assert!(!sector_size_valid(16) && !sector_size_valid(1 << 24) && !sector_size_valid(1000));
    }
}
