//! Metadata tables in memory: L2 entries and refcount blocks, and the cache that keeps a
//! bounded number of them (`l2-cache-size`, `refcount-cache-size`).
//!
//! A cached table is the only copy that may be newer than the disk: it is marked dirty
//! when changed and written back by the driver, which decides the order (see the driver's
//! flush). The cache itself never writes; when it is full of dirty tables the driver
//! writes them all back before loading another.

use std::collections::HashMap;

/// Bits 9-55 of an L1 or L2 entry: a host offset.
pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// The cluster's refcount is exactly one (it may be written in place).
pub const COPIED: u64 = 1 << 63;
/// An L2 entry describing a compressed cluster.
pub const COMPRESSED: u64 = 1 << 62;
/// A standard L2 entry whose cluster reads as zeroes (version 3).
pub const ZERO: u64 = 1;

/// What one L2 entry says about its guest cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Not in this image: the backing file's data, or zeroes without one.
    Unallocated,
    /// Reads as zeroes; `host` is the cluster kept for it (preallocated), if any.
    Zero { host: Option<u64>, copied: bool },
    /// Data at `host`; `copied` when it may be written in place.
    Data { host: u64, copied: bool },
    /// Compressed data: `offset` and `len` bytes on the host.
    Compressed { offset: u64, len: u64 },
}

/// The host cluster a mapping holds, 0 for none.
pub fn old_host(m: Mapping) -> u64 {
    match m {
        Mapping::Data { host, .. }
        | Mapping::Zero {
            host: Some(host), ..
        } => host,
        _ => 0,
    }
}

/// Extended L2 entries: every subcluster allocated (the bitmap's low half).
pub const ALL_ALLOC: u64 = 0xffff_ffff;
/// Extended L2 entries: every subcluster reading as zeroes (the high half).
pub const ALL_ZERO: u64 = ALL_ALLOC << 32;

/// Whether the subcluster `bitmap` of an extended entry may stand beside its cluster's
/// mapping `map` (QEMU's QCOW2_SUBCLUSTER_INVALID cases): a subcluster cannot be
/// allocated and zero at once, nor allocated in a cluster without a host cluster. A
/// compressed cluster's bitmap is not looked at, as QEMU does not.
pub fn check_bitmap(map: Mapping, bitmap: u64) -> Result<(), String> {
    match map {
        Mapping::Data { host, .. } if (bitmap >> 32) & bitmap != 0 => Err(format!(
            "cluster at {host:#x}: subclusters both allocated and zero (bitmap {bitmap:#x})"
        )),
        Mapping::Unallocated if bitmap & ALL_ALLOC != 0 => Err(format!(
            "unallocated cluster with allocated subclusters (bitmap {bitmap:#x})"
        )),
        _ => Ok(()),
    }
}

/// The entry word of a mapping that keeps a host cluster (a data cluster, or a zero one
/// kept for preallocation), as it is written back when only the rest of the entry
/// changes; 0 for any other.
pub fn encode_host(m: Mapping) -> u64 {
    match m {
        Mapping::Data { host, copied } => host | if copied { COPIED } else { 0 },
        Mapping::Zero {
            host: Some(host),
            copied,
        } => host | ZERO | if copied { COPIED } else { 0 },
        Mapping::Zero { host: None, .. } => ZERO,
        _ => 0,
    }
}

/// Decodes L2 entries for one cluster size.
#[derive(Debug, Clone, Copy)]
pub struct EntryCodec {
    cluster_bits: u32,
    /// Version 3 (the zero flag exists).
    v3: bool,
    /// Extended L2 entries: 128 bits, the zero flag unused (the bitmap says it).
    extended: bool,
    /// Guest data in an external data file, where offset 0 is a cluster like any other
    /// (its entry's COPIED flag tells it from an unallocated one).
    data_file: bool,
}

impl EntryCodec {
    /// A codec for `cluster_bits`, the image version and whether its L2 entries are
    /// extended ([`super::subcluster`]).
    pub fn new(cluster_bits: u32, version: u32, extended: bool) -> Self {
        Self {
            cluster_bits,
            v3: version >= 3,
            extended,
            data_file: false,
        }
    }

    /// The codec for an image whose data lives in an external data file (QEMU's
    /// qcow2_get_cluster_type: an entry of offset 0 with COPIED set maps the data file's
    /// first cluster).
    pub fn with_data_file(mut self, data_file: bool) -> Self {
        self.data_file = data_file;
        self
    }

    /// 64-bit words per L2 entry: 2 for extended entries (entry, bitmap), else 1.
    pub fn words(&self) -> usize {
        1 + usize::from(self.extended)
    }

    /// Decodes an extended entry `e` with its subcluster `bitmap` (checked against it:
    /// [`check_bitmap`]); for a standard entry `bitmap` is 0 and unused.
    pub fn decode_pair(&self, e: u64, bitmap: u64) -> Result<Mapping, String> {
        let m = self.decode(e)?;
        if self.extended {
            check_bitmap(m, bitmap)?;
        }
        Ok(m)
    }

    /// Decodes the entry word `e` (for an extended entry, its cluster's mapping, the
    /// bitmap aside); an offset that is not cluster-aligned is corruption.
    pub fn decode(&self, e: u64) -> Result<Mapping, String> {
        if e & COMPRESSED != 0 {
            // x = 62 - (cluster_bits - 8): the offset below it, the sector count above.
            let shift = 62 - (self.cluster_bits - 8);
            let offset = e & ((1u64 << shift) - 1);
            let sectors = ((e >> shift) & ((1u64 << (self.cluster_bits - 8)) - 1)) + 1;
            let len = sectors * 512 - (offset & 511);
            return Ok(Mapping::Compressed { offset, len });
        }
        let host = e & OFFSET_MASK;
        let copied = e & COPIED != 0;
        if host & ((1 << self.cluster_bits) - 1) != 0 {
            return Err(format!(
                "L2 entry {e:#x}: cluster offset {host:#x} unaligned"
            ));
        }
        if self.v3 && !self.extended && e & ZERO != 0 {
            let host = (host != 0).then_some(host);
            return Ok(Mapping::Zero { host, copied });
        }
        if host == 0 && !(self.data_file && copied) {
            return Ok(Mapping::Unallocated);
        }
        Ok(Mapping::Data { host, copied })
    }
}

/// Reads and writes refcounts of any width (1 to 64 bits) in a refcount block's bytes.
#[derive(Debug, Clone, Copy)]
pub struct RefcountCodec {
    order: u32,
}

impl RefcountCodec {
    /// A codec for `refcount_order` (width `1 << order` bits).
    pub fn new(order: u32) -> Self {
        Self { order }
    }

    /// The largest refcount the width holds.
    pub fn max(&self) -> u64 {
        if self.order == 6 {
            u64::MAX
        } else {
            (1u64 << (1 << self.order)) - 1
        }
    }

    /// The refcount at `i`.
    pub fn get(&self, block: &[u8], i: usize) -> u64 {
        match self.order {
            0..=2 => {
                let bits = 1usize << self.order;
                let per_byte = 8 / bits;
                let shift = (i % per_byte) * bits;
                ((block[i / per_byte] >> shift) as u64) & self.max()
            }
            _ => {
                let w = 1usize << (self.order - 3);
                block[i * w..i * w + w]
                    .iter()
                    .fold(0u64, |acc, &b| acc << 8 | b as u64)
            }
        }
    }

    /// Sets the refcount at `i` (`v` must fit: see [`max`](Self::max)).
    pub fn set(&self, block: &mut [u8], i: usize, v: u64) {
        match self.order {
            0..=2 => {
                let bits = 1usize << self.order;
                let per_byte = 8 / bits;
                let shift = (i % per_byte) * bits;
                let mask = (self.max() as u8) << shift;
                let b = &mut block[i / per_byte];
                *b = (*b & !mask) | ((v as u8) << shift & mask);
            }
            _ => {
                let w = 1usize << (self.order - 3);
                let bytes = v.to_be_bytes();
                block[i * w..i * w + w].copy_from_slice(&bytes[8 - w..]);
            }
        }
    }
}

struct Slot<T> {
    table: T,
    dirty: bool,
    used: u64,
}

/// A bounded cache of tables keyed by their host offset.
pub struct TableCache<T> {
    slots: HashMap<u64, Slot<T>>,
    capacity: usize,
    clock: u64,
}

impl<T> TableCache<T> {
    /// A cache of at most `capacity` tables (at least 2).
    pub fn new(capacity: usize) -> Self {
        Self {
            slots: HashMap::new(),
            capacity: capacity.max(2),
            clock: 0,
        }
    }

    /// The table at `offset`, if cached (counts as a use).
    pub fn get(&mut self, offset: u64) -> Option<&T> {
        self.clock += 1;
        let clock = self.clock;
        self.slots.get_mut(&offset).map(|s| {
            s.used = clock;
            &s.table
        })
    }

    /// The table at `offset` to change: it is marked dirty.
    pub fn get_mut(&mut self, offset: u64) -> Option<&mut T> {
        self.clock += 1;
        let clock = self.clock;
        self.slots.get_mut(&offset).map(|s| {
            s.used = clock;
            s.dirty = true;
            &mut s.table
        })
    }

    /// Whether a table is cached.
    pub fn contains(&self, offset: u64) -> bool {
        self.slots.contains_key(&offset)
    }

    /// Whether adding a table needs room that only a write-back can make (full, and
    /// every table dirty).
    pub fn full_of_dirty(&self) -> bool {
        self.slots.len() >= self.capacity && self.slots.values().all(|s| s.dirty)
    }

    /// Adds a table (dirty when it is new rather than read from disk), evicting the
    /// least recently used clean one when full. The caller has made sure one is clean
    /// ([`full_of_dirty`](Self::full_of_dirty)).
    pub fn insert(&mut self, offset: u64, table: T, dirty: bool) {
        if self.slots.len() >= self.capacity && !self.slots.contains_key(&offset) {
            let victim = self
                .slots
                .iter()
                .filter(|(_, s)| !s.dirty)
                .min_by_key(|(_, s)| s.used)
                .map(|(&k, _)| k);
            if let Some(k) = victim {
                self.slots.remove(&k);
            }
        }
        self.clock += 1;
        self.slots.insert(
            offset,
            Slot {
                table,
                dirty,
                used: self.clock,
            },
        );
    }

    /// Offsets of the dirty tables, in offset order (written back in one pass).
    pub fn dirty(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, s)| s.dirty)
            .map(|(&k, _)| k)
            .collect();
        v.sort_unstable();
        v
    }

    /// The table at `offset` without touching its age or flags (for a write-back).
    pub fn peek(&self, offset: u64) -> Option<&T> {
        self.slots.get(&offset).map(|s| &s.table)
    }

    /// Forgets the table at `offset` (its cluster is freed: the offset may hold something
    /// else next).
    pub fn remove(&mut self, offset: u64) {
        self.slots.remove(&offset);
    }

    /// Marks a written-back table clean.
    pub fn mark_clean(&mut self, offset: u64) {
        if let Some(s) = self.slots.get_mut(&offset) {
            s.dirty = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refcounts_of_every_width_round_trip() {
        for order in 0..=6 {
            let c = RefcountCodec::new(order);
            let mut block = vec![0u8; 512];
            let n = (512 * 8) >> order;
            for i in 0..n {
                c.set(&mut block, i, (i as u64 * 7 + 3) & c.max());
            }
            for i in 0..n {
                assert_eq!(
                    c.get(&block, i),
                    (i as u64 * 7 + 3) & c.max(),
                    "order {order} i {i}"
                );
            }
        }
        // 16 bits, big-endian, as qemu-img writes them.
        let c = RefcountCodec::new(4);
        let mut b = vec![0u8; 4];
        c.set(&mut b, 1, 0x0102);
        assert_eq!(b, [0, 0, 1, 2]);
    }

    #[test]
    fn l2_entries_decode() {
        let c = EntryCodec::new(16, 3, false);
        assert_eq!(c.decode(0), Ok(Mapping::Unallocated));
        assert_eq!(
            c.decode(COPIED | 0x30000),
            Ok(Mapping::Data {
                host: 0x30000,
                copied: true
            })
        );
        assert_eq!(
            c.decode(ZERO),
            Ok(Mapping::Zero {
                host: None,
                copied: false
            })
        );
        assert!(c.decode(0x30200).is_err());
        // Compressed, 64 KiB clusters: offset in bits 0..54, extra sectors above.
        let e = COMPRESSED | (2u64 << 54) | 0x12345;
        assert_eq!(
            c.decode(e),
            Ok(Mapping::Compressed {
                offset: 0x12345,
                len: 3 * 512 - 0x145
            })
        );
        // Version 2 has no zero flag: bit 0 is ignored.
        assert_eq!(
            EntryCodec::new(16, 2, false).decode(ZERO),
            Ok(Mapping::Unallocated)
        );
    }

    #[test]
    fn offset_zero_is_a_cluster_of_an_external_data_file() {
        let c = EntryCodec::new(16, 3, false);
        assert_eq!(c.decode(COPIED), Ok(Mapping::Unallocated));
        let d = c.with_data_file(true);
        assert_eq!(
            d.decode(COPIED),
            Ok(Mapping::Data {
                host: 0,
                copied: true
            })
        );
        assert_eq!(d.decode(0), Ok(Mapping::Unallocated));
        // A zero flag with offset 0 stays a plain zero cluster, as in QEMU.
        assert_eq!(
            d.decode(COPIED | ZERO),
            Ok(Mapping::Zero {
                host: None,
                copied: true
            })
        );
    }

    #[test]
    fn extended_entries_decode_with_their_bitmap() {
        let c = EntryCodec::new(17, 3, true);
        assert_eq!(c.words(), 2);
        // The zero flag means nothing in an extended entry: the bitmap says zero.
        assert_eq!(c.decode(ZERO), Ok(Mapping::Unallocated));
        let data = Mapping::Data {
            host: 0x60000,
            copied: true,
        };
        assert_eq!(c.decode_pair(COPIED | 0x60000, 0xf | 0xf0 << 32), Ok(data));
        assert!(c.decode_pair(COPIED | 0x60000, 0x1 | 0x1 << 32).is_err());
        assert!(c.decode_pair(0, 0x1).is_err());
        assert_eq!(
            c.decode_pair(0, 0xffff_ffff << 32),
            Ok(Mapping::Unallocated)
        );
        assert_eq!(encode_host(data), COPIED | 0x60000);
        // Allocated and zero at once; allocated without a host cluster.
        assert!(check_bitmap(data, 0x8 | 0x8 << 32).is_err());
        assert!(check_bitmap(Mapping::Unallocated, 0x1).is_err());
        assert!(check_bitmap(Mapping::Unallocated, ALL_ZERO).is_ok());
        assert!(check_bitmap(data, 0x7 | 0xffff_fff8 << 32).is_ok());
    }

    #[test]
    fn the_cache_evicts_clean_tables_first() {
        let mut c = TableCache::new(2);
        c.insert(1, 'a', true);
        c.insert(2, 'b', false);
        assert!(!c.full_of_dirty());
        c.get(2);
        c.insert(3, 'c', false);
        // 2 was clean but used more recently than the dirty 1: dirty tables stay anyway.
        assert!(c.contains(1) && c.contains(3) && !c.contains(2));
        c.get_mut(3);
        assert!(c.full_of_dirty());
        assert_eq!(c.dirty(), vec![1, 3]);
        c.mark_clean(1);
        assert!(!c.full_of_dirty());
    }
}
