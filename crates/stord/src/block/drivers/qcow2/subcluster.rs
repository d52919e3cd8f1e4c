//! Extended L2 entries (the header's incompatible bit 4): each standard cluster is cut
//! into 32 subclusters that are allocated, zeroed or left to the backing file one by one.
//! An entry is 128 bits: the standard entry (its zero flag unused), then a bitmap whose
//! low 32 bits say "allocated" and high 32 bits "reads as zeroes", one of each per
//! subcluster (docs/interop/qcow2.txt, "Extended L2 Entries"). Compressed clusters have
//! no subclusters; their bitmap is zero.
//!
//! Here is the arithmetic on a cluster's mapping and bitmap, with no I/O: what a
//! subcluster reads as and how far a run of one kind goes (QEMU's
//! qcow2_get_subcluster_range_type), and which part of a cluster a write makes the
//! cluster hold anew, with the copy-on-write around it (QEMU's calculate_l2_meta).

use super::table::Mapping;

pub use super::table::{ALL_ALLOC, ALL_ZERO};

/// Subclusters in a cluster.
pub const PER_CLUSTER: u32 = 32;

/// The allocation bits of subclusters `from..to` (`to` at most 32).
pub const fn alloc_range(from: u32, to: u32) -> u64 {
    (1u64 << to) - (1u64 << from)
}

/// The zero bits of subclusters `from..to`.
pub const fn zero_range(from: u32, to: u32) -> u64 {
    alloc_range(from, to) << 32
}

/// What a subcluster reads as (QEMU's QCow2SubclusterType, the cluster's allocation aside).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Data in the host cluster.
    Data,
    /// Zeroes (whether or not the cluster has a host cluster).
    Zero,
    /// Not in this image: the backing file's data, or zeroes without one.
    Unallocated,
    /// Part of a compressed cluster.
    Compressed,
}

/// What subcluster `sc` reads as, and how many subclusters from it (to the cluster's end
/// at most) read the same way. `bitmap` has passed [`super::table::check_bitmap`].
pub fn run(map: Mapping, bitmap: u64, sc: u32) -> (Kind, u32) {
    let before = alloc_range(0, sc) as u32;
    let (alloc, zero) = (bitmap as u32, (bitmap >> 32) as u32);
    match map {
        Mapping::Compressed { .. } => (Kind::Compressed, PER_CLUSTER - sc),
        // Only standard entries say "zero" for the whole cluster.
        Mapping::Zero { .. } => (Kind::Zero, PER_CLUSTER - sc),
        _ if zero & (1 << sc) != 0 => (Kind::Zero, (zero | before).trailing_ones() - sc),
        _ if alloc & (1 << sc) != 0 => (Kind::Data, (alloc | before).trailing_ones() - sc),
        _ => (
            Kind::Unallocated,
            ((alloc | zero) & !before).trailing_zeros() - sc,
        ),
    }
}

/// Whether subclusters `first..=last` are all allocated.
pub fn all_alloc(bitmap: u64, first: u32, last: u32) -> bool {
    alloc_range(first, last + 1) & !bitmap == 0
}

/// The part `[start, end)` of a cluster (offsets into it) that a write of `[from, to)`
/// makes the cluster hold anew: the write, and around it what must be copied from the
/// cluster's old content, as QEMU's calculate_l2_meta computes it. `keep`: the cluster is
/// written in place (allocated, refcount one); otherwise a new cluster replaces it, and
/// then every allocated subcluster of the old one is copied (all of a compressed one),
/// while unallocated and zero subclusters past the write stay as they were.
/// `sc_bits`: log2 of the subcluster size.
pub fn cow_span(
    map: Mapping,
    bitmap: u64,
    keep: bool,
    (from, to): (u64, u64),
    sc_bits: u32,
) -> (u64, u64) {
    let cs = u64::from(PER_CLUSTER) << sc_bits;
    let (first, last) = ((from >> sc_bits) as u32, ((to - 1) >> sc_bits) as u32);
    let alloc = bitmap as u32;
    let sc_start = |sc: u32| u64::from(sc) << sc_bits;
    let data_at = |sc: u32| run(map, bitmap, sc).0 == Kind::Data;
    let start = match map {
        _ if keep && data_at(first) => from,
        _ if keep => sc_start(first),
        Mapping::Compressed { .. } => 0,
        Mapping::Data { .. } => sc_start(first.min(alloc.trailing_zeros())),
        _ => sc_start(first),
    };
    let end = match map {
        _ if keep && data_at(last) => to,
        _ if keep => sc_start(last + 1),
        Mapping::Compressed { .. } => cs,
        Mapping::Data { .. } => cs - sc_start((PER_CLUSTER - 1 - last).min(alloc.leading_zeros())),
        _ => sc_start(last + 1),
    };
    (start, end)
}

/// The bitmap of a cluster once `[start, end)` of it (offsets into it) holds new data:
/// those subclusters allocated, and no longer zero.
pub fn written(bitmap: u64, (start, end): (u64, u64), sc_bits: u32) -> u64 {
    let (first, to) = ((start >> sc_bits) as u32, ((end - 1) >> sc_bits) as u32 + 1);
    (bitmap | alloc_range(first, to)) & !zero_range(first, to)
}

/// The bitmap with subclusters `from..to` made zero (and no longer allocated).
pub fn zeroed(bitmap: u64, from: u32, to: u32) -> u64 {
    (bitmap | zero_range(from, to)) & !alloc_range(from, to)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATA: Mapping = Mapping::Data {
        host: 0x40000,
        copied: true,
    };
    const SHARED: Mapping = Mapping::Data {
        host: 0x40000,
        copied: false,
    };

    #[test]
    fn runs_of_one_kind() {
        // Subclusters 0-3 allocated, 4-5 zero, 6-31 unallocated.
        let bm = alloc_range(0, 4) | zero_range(4, 6);
        assert_eq!(run(DATA, bm, 0), (Kind::Data, 4));
        assert_eq!(run(DATA, bm, 2), (Kind::Data, 2));
        assert_eq!(run(DATA, bm, 4), (Kind::Zero, 2));
        assert_eq!(run(DATA, bm, 6), (Kind::Unallocated, 26));
        assert_eq!(run(DATA, ALL_ALLOC, 31), (Kind::Data, 1));
        assert_eq!(run(Mapping::Unallocated, 0, 7), (Kind::Unallocated, 25));
        assert_eq!(run(Mapping::Unallocated, ALL_ZERO, 0), (Kind::Zero, 32));
        let c = Mapping::Compressed { offset: 1, len: 2 };
        assert_eq!(run(c, 0, 5), (Kind::Compressed, 27));
        // An unallocated run stops at the next subcluster of another kind.
        let bm = zero_range(9, 10) | alloc_range(20, 21);
        assert_eq!(run(DATA, bm, 3), (Kind::Unallocated, 6));
        assert_eq!(run(DATA, bm, 10), (Kind::Unallocated, 10));
    }

    /// The spans QEMU's calculate_l2_meta gives, with 4 KiB subclusters (128 KiB clusters).
    #[test]
    fn copy_on_write_spans() {
        let k = 1024;
        let b = 12;
        // A new cluster over an unallocated one: only the touched subclusters' rest.
        assert_eq!(
            cow_span(Mapping::Unallocated, 0, false, (5 * k, 6 * k), b),
            (4 * k, 8 * k)
        );
        assert_eq!(
            cow_span(Mapping::Unallocated, 0, false, (4 * k, 12 * k), b),
            (4 * k, 12 * k)
        );
        // In place: allocated subclusters are written as they are, the others get their
        // rest copied.
        let bm = alloc_range(1, 2);
        assert_eq!(cow_span(DATA, bm, true, (5 * k, 6 * k), b), (5 * k, 6 * k));
        assert_eq!(cow_span(DATA, bm, true, (5 * k, 9 * k), b), (5 * k, 12 * k));
        assert_eq!(cow_span(DATA, bm, true, (3 * k, 6 * k), b), (0, 6 * k));
        // Replacing a shared cluster: every allocated subcluster comes along.
        let bm = alloc_range(2, 3) | alloc_range(20, 22) | zero_range(25, 26);
        assert_eq!(
            cow_span(SHARED, bm, false, (10 * k, 11 * k), b),
            (8 * k, 88 * k)
        );
        assert_eq!(cow_span(SHARED, bm, false, (0, k), b), (0, 88 * k));
        assert_eq!(
            cow_span(SHARED, bm, false, (100 * k, 101 * k), b),
            (8 * k, 104 * k)
        );
        // A compressed cluster is copied whole.
        let c = Mapping::Compressed { offset: 1, len: 2 };
        assert_eq!(cow_span(c, 0, false, (50 * k, 51 * k), b), (0, 128 * k));
    }

    #[test]
    fn bitmaps_after_writes_and_zeroes() {
        let b = 12;
        let bm = zero_range(0, 32);
        assert_eq!(
            written(bm, (4096, 3 * 4096), b),
            alloc_range(1, 3) | zero_range(0, 1) | zero_range(3, 32)
        );
        assert_eq!(written(0, (0, 128 << 10), b), ALL_ALLOC);
        assert_eq!(
            zeroed(ALL_ALLOC, 2, 4),
            alloc_range(0, 2) | alloc_range(4, 32) | zero_range(2, 4)
        );
        assert!(all_alloc(alloc_range(2, 5), 2, 4));
        assert!(!all_alloc(alloc_range(2, 5), 2, 5));
    }
}
