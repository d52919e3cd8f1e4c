//! The persistent bitmaps' on-disk format (the bitmaps extension of
//! docs/interop/qcow2.txt): the header extension's fields, the directory and its
//! entries, bitmap table entries; parsed and checked with no I/O, as QEMU checks them.
//! What reads and writes them, and the bitmaps' life cycle, is [`super::bitmaps`].

use super::bytes::{be16, be32, be64};

/// Directory entry flags.
pub(super) const FLAG_IN_USE: u32 = 1;
pub(super) const FLAG_AUTO: u32 = 2;
const RESERVED_FLAGS: u32 = !(FLAG_IN_USE | FLAG_AUTO);
/// The only bitmap type there is.
const TYPE_DIRTY_TRACKING: u8 = 1;
/// QEMU's limits (QCOW2_MAX_BITMAPS, QCOW2_MAX_BITMAP_DIRECTORY_SIZE, BME_*).
pub(super) const MAX_BITMAPS: usize = 65535;
pub(super) const MAX_DIR_SIZE: u64 = 64 << 20;
pub(super) const MAX_TABLE_SIZE: u64 = 0x800_0000;
pub(super) const MAX_PHYS_SIZE: u64 = 0x2000_0000;
pub(super) const MAX_NAME: usize = 1023;
/// Bitmap table entries.
const ENTRY_RESERVED: u64 = 0xff00_0000_0000_01fe;
pub(super) const ENTRY_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
pub(super) const ENTRY_ALL_ONES: u64 = 1;
/// The most memory the bits of one image's bitmaps take together (a 1 TiB disk needs 2 MiB
/// per bitmap at 64 KiB granularity).
pub(super) const MAX_LOADED_BITS_BYTES: u64 = 256 << 20;
/// Length of the extension's data.
const EXT_LEN: usize = 24;
/// Length of an entry's fixed part.
const ENTRY_FIXED: usize = 24;

/// One directory entry (extra data is refused at load, as QEMU does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct DirEntry {
    pub table_offset: u64,
    pub table_size: u32,
    pub flags: u32,
    pub granularity_bits: u8,
    pub name: String,
}

/// The directory as the image holds it now.
#[derive(Debug, Default, Clone)]
pub(super) struct Directory {
    pub offset: u64,
    pub size: u64,
    pub entries: Vec<DirEntry>,
}

fn entry_len(name_len: usize) -> usize {
    (ENTRY_FIXED + name_len).div_ceil(8) * 8
}

/// Clusters of serialized bits a bitmap over `size` bytes takes.
pub(super) fn table_entries(size: u64, granularity: u64, cluster_size: u64) -> u64 {
    size.div_ceil(granularity)
        .div_ceil(8)
        .div_ceil(cluster_size)
}

/// The extension's fields: bitmap count, directory size and offset.
pub(super) fn parse_ext(data: &[u8]) -> Result<(u32, u64, u64), String> {
    if data.len() != EXT_LEN {
        return Err("bitmaps_ext: Invalid extension length".into());
    }
    if be32(data, 4) != 0 {
        return Err("bitmaps_ext: Reserved field is not zero".into());
    }
    let (nb, size, offset) = (be32(data, 0), be64(data, 8), be64(data, 16));
    if nb as usize > MAX_BITMAPS {
        return Err(format!(
            "bitmaps_ext: Image has {nb} bitmaps, exceeding the QEMU supported maximum of {MAX_BITMAPS}"
        ));
    }
    if nb == 0 {
        return Err("found bitmaps extension with zero bitmaps".into());
    }
    if size > MAX_DIR_SIZE {
        return Err(format!(
            "bitmaps_ext: bitmap directory size ({size}) exceeds the maximum supported size ({MAX_DIR_SIZE})"
        ));
    }
    Ok((nb, size, offset))
}

/// The extension's bytes for a directory.
pub(super) fn ext_bytes(nb: usize, size: u64, offset: u64) -> [u8; EXT_LEN] {
    let mut b = [0u8; EXT_LEN];
    b[0..4].copy_from_slice(&(nb as u32).to_be_bytes());
    b[8..16].copy_from_slice(&size.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b
}

/// QEMU's check_dir_entry.
fn check_entry(e: &DirEntry, cluster_size: u64, image_size: u64) -> bool {
    let ok = e.table_size != 0
        && e.table_offset != 0
        && e.table_offset.is_multiple_of(cluster_size)
        && u64::from(e.table_size) <= MAX_TABLE_SIZE
        && (9..=31).contains(&e.granularity_bits)
        && e.flags & RESERVED_FLAGS == 0
        && e.name.len() <= MAX_NAME;
    if !ok {
        return false;
    }
    let phys = u64::from(e.table_size) * cluster_size;
    if phys > MAX_PHYS_SIZE {
        return false;
    }
    // A bitmap in use may have missed a resize; a clean one must cover the image.
    e.flags & FLAG_IN_USE != 0 || image_size <= (phys * 8) << e.granularity_bits
}

/// Parses and checks a directory of `nb` entries (QEMU's bitmap_list_load).
pub(super) fn parse_dir(
    dir: &[u8],
    nb: u32,
    cluster_size: u64,
    image_size: u64,
) -> Result<Vec<DirEntry>, String> {
    let broken = || "Broken bitmap directory".to_string();
    let mut out = Vec::new();
    let mut at = 0;
    while at < dir.len() {
        if at + ENTRY_FIXED > dir.len() {
            return Err(broken());
        }
        if out.len() == nb as usize {
            return Err("More bitmaps found than specified in header extension".into());
        }
        let name_size = be16(dir, at + 18) as usize;
        let extra = be32(dir, at + 20) as usize;
        let len = (ENTRY_FIXED + name_size + extra).div_ceil(8) * 8;
        if at + len > dir.len() {
            return Err(broken());
        }
        if extra != 0 {
            return Err("Bitmap extra data is not supported".into());
        }
        let name = &dir[at + ENTRY_FIXED..at + ENTRY_FIXED + name_size];
        let e = DirEntry {
            table_offset: be64(dir, at),
            table_size: be32(dir, at + 8),
            flags: be32(dir, at + 12),
            granularity_bits: dir[at + 17],
            name: String::from_utf8_lossy(name).into_owned(),
        };
        if dir[at + 16] != TYPE_DIRTY_TRACKING || !check_entry(&e, cluster_size, image_size) {
            return Err(format!(
                "Bitmap '{}' doesn't satisfy the constraints",
                e.name
            ));
        }
        if out.iter().any(|o: &DirEntry| o.name == e.name) {
            return Err(format!("Bitmap '{}' is listed twice", e.name));
        }
        out.push(e);
        at += len;
    }
    if out.len() != nb as usize {
        return Err("Less bitmaps found than specified in header extension".into());
    }
    Ok(out)
}

/// A directory's bytes.
pub(super) fn encode_dir(entries: &[DirEntry]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in entries {
        let start = out.len();
        out.extend_from_slice(&e.table_offset.to_be_bytes());
        out.extend_from_slice(&e.table_size.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
        out.push(TYPE_DIRTY_TRACKING);
        out.push(e.granularity_bits);
        out.extend_from_slice(&(e.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(e.name.as_bytes());
        out.resize(start + entry_len(e.name.len()), 0);
    }
    out
}

/// Memory the bits of `entries` take over an image of `size` bytes.
pub(super) fn loaded_bits_bytes(entries: &[DirEntry], size: u64) -> u64 {
    entries
        .iter()
        .map(|e| size.div_ceil(1 << e.granularity_bits).div_ceil(64) * 8)
        .sum()
}

/// A bitmap table entry as QEMU checks it: no reserved bit, an aligned offset, the
/// all-ones flag only without one.
pub(super) fn table_entry_ok(entry: u64, cluster_size: u64) -> bool {
    let off = entry & ENTRY_OFFSET;
    entry & ENTRY_RESERVED == 0
        && (off == 0 || (entry & ENTRY_ALL_ONES == 0 && off.is_multiple_of(cluster_size)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, flags: u32) -> DirEntry {
        DirEntry {
            table_offset: 0x30000,
            table_size: 1,
            flags,
            granularity_bits: 16,
            name: name.into(),
        }
    }

    #[test]
    fn directories_round_trip_and_bad_ones_are_refused() {
        let es = vec![entry("b0", FLAG_AUTO), entry("a-longer-name", FLAG_IN_USE)];
        let raw = encode_dir(&es);
        assert_eq!(raw.len(), entry_len(2) + entry_len(13));
        assert_eq!(raw.len(), 32 + 40);
        assert_eq!(parse_dir(&raw, 2, 65536, 1 << 30).unwrap(), es);
        assert!(parse_dir(&raw, 1, 65536, 1 << 30)
            .unwrap_err()
            .contains("More"));
        assert!(parse_dir(&raw, 3, 65536, 1 << 30)
            .unwrap_err()
            .contains("Less"));
        assert!(parse_dir(&raw[..40], 2, 65536, 1 << 30)
            .unwrap_err()
            .contains("Broken"));
        // One cluster of bits at 64 KiB granularity covers 32 GiB; a clean bitmap must
        // cover the image, one in use need not.
        assert!(parse_dir(&encode_dir(&es[..1]), 1, 65536, 64 << 30)
            .unwrap_err()
            .contains("constraints"));
        assert!(parse_dir(&encode_dir(&es[1..]), 1, 65536, 64 << 30).is_ok());
        let mut bad = es[..1].to_vec();
        bad[0].flags |= 4;
        assert!(parse_dir(&encode_dir(&bad), 1, 65536, 1 << 30).is_err());
        let mut extra = encode_dir(&es[..1]);
        extra[23] = 8;
        extra.resize(40, 0);
        assert!(parse_dir(&extra, 1, 65536, 1 << 30)
            .unwrap_err()
            .contains("extra data"));
    }

    #[test]
    fn the_extension_and_table_entries_are_checked() {
        let e = ext_bytes(2, 72, 0x50000);
        assert_eq!(parse_ext(&e).unwrap(), (2, 72, 0x50000));
        assert!(parse_ext(&e[..16]).is_err());
        assert!(parse_ext(&ext_bytes(0, 0, 0)).is_err());
        let mut r = e;
        r[7] = 1;
        assert!(parse_ext(&r).is_err());
        assert!(table_entry_ok(0, 65536));
        assert!(table_entry_ok(1, 65536));
        assert!(table_entry_ok(0x10000, 65536));
        assert!(!table_entry_ok(0x10001, 65536));
        assert!(!table_entry_ok(0x10200, 65536));
        assert!(!table_entry_ok(2, 65536));
        assert_eq!(table_entries(1 << 30, 65536, 65536), 1);
        assert_eq!(table_entries(1 << 30, 512, 512), 512);
    }

    #[test]
    fn the_memory_all_bitmaps_take_is_bounded() {
        // 1 TiB at 64 KiB granularity: 2 MiB of bits per bitmap.
        let one = entry("b", FLAG_IN_USE);
        assert_eq!(
            loaded_bits_bytes(std::slice::from_ref(&one), 1 << 40),
            2 << 20
        );
        let many = vec![one; 129];
        assert!(loaded_bits_bytes(&many[..128], 1 << 40) <= MAX_LOADED_BITS_BYTES);
        assert!(loaded_bits_bytes(&many, 1 << 40) > MAX_LOADED_BITS_BYTES);
    }
}
