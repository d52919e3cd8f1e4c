//! Persistent dirty bitmaps in the image, in QEMU's format (the bitmaps extension of
//! docs/interop/qcow2.txt): a directory of entries, each naming a bitmap table whose
//! entries point at clusters of serialized bits.
//!
//! The life cycle is QEMU's, so either program can pick up what the other left:
//! - On a read-write open every bitmap is loaded and marked `in_use` in the image (the
//!   directory is rewritten in place while the autoclear bit is down), so a crash leaves
//!   them marked: whoever opens the image next treats them as inconsistent instead of
//!   trusting bits that missed writes.
//! - While open, the bits live in memory ([`DirtyBitmap`]); nothing is written per
//!   request.
//! - On close the bitmaps are written to fresh clusters, a new directory points at them,
//!   the header switches to it in one write, and only then are the old clusters freed.
//! - Removing a persistent bitmap rewrites the directory at once, as QEMU does.
//!
//! An image whose extension is present but whose autoclear bit is clear was modified by
//! a program without bitmap support: its bitmaps are ignored (QEMU's rule), and what they
//! took shows up as leaks in `qemu-img check`.

use std::io;

use super::header::{autoclear, field, Header};
use super::metadata::{corrupt, Meta, MetaKind};
use super::Qcow2Driver;
use crate::block::node::block_node::BlockDriver;
use crate::block::node::dirty_bitmap::DirtyBitmap;
use crate::buf::request_buf;

/// Directory entry flags.
pub(super) const FLAG_IN_USE: u32 = 1;
pub(super) const FLAG_AUTO: u32 = 2;
const RESERVED_FLAGS: u32 = !(FLAG_IN_USE | FLAG_AUTO);
/// The only bitmap type there is.
const TYPE_DIRTY_TRACKING: u8 = 1;
/// QEMU's limits (QCOW2_MAX_BITMAPS, QCOW2_MAX_BITMAP_DIRECTORY_SIZE, BME_*).
pub(super) const MAX_BITMAPS: usize = 65535;
pub(super) const MAX_DIR_SIZE: u64 = 64 << 20;
const MAX_TABLE_SIZE: u64 = 0x800_0000;
const MAX_PHYS_SIZE: u64 = 0x2000_0000;
pub(super) const MAX_NAME: usize = 1023;
/// Bitmap table entries.
const ENTRY_RESERVED: u64 = 0xff00_0000_0000_01fe;
const ENTRY_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
const ENTRY_ALL_ONES: u64 = 1;
/// The most memory the bits of one image's bitmaps take together (a 1 TiB disk needs 2 MiB
/// per bitmap at 64 KiB granularity).
const MAX_LOADED_BITS_BYTES: u64 = 256 << 20;
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

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
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
fn loaded_bits_bytes(entries: &[DirEntry], size: u64) -> u64 {
    entries
        .iter()
        .map(|e| size.div_ceil(1 << e.granularity_bits).div_ceil(64) * 8)
        .sum()
}

/// A bitmap table entry as QEMU checks it: no reserved bit, an aligned offset, the
/// all-ones flag only without one.
fn table_entry_ok(entry: u64, cluster_size: u64) -> bool {
    let off = entry & ENTRY_OFFSET;
    entry & ENTRY_RESERVED == 0
        && (off == 0 || (entry & ENTRY_ALL_ONES == 0 && off.is_multiple_of(cluster_size)))
}

/// What the image's bitmaps are, read at open.
pub(super) struct Loaded {
    pub dir: Directory,
    pub bitmaps: Vec<DirtyBitmap>,
    /// Every host range the bitmaps take (directory, tables, data), for a refcount
    /// rebuild.
    pub refs: Vec<(u64, u64)>,
}

async fn read_bytes(f: &dyn BlockDriver, off: u64, len: u64) -> io::Result<Vec<u8>> {
    if off.checked_add(len).is_none_or(|end| end > f.size()) {
        return Err(corrupt(format!(
            "bitmap metadata at {off:#x} runs past the end of the image"
        )));
    }
    let (r, b) = f.read(off, request_buf(len as usize)).await;
    r?;
    Ok(b.to_vec())
}

async fn read_table(f: &dyn BlockDriver, e: &DirEntry, cs: u64) -> io::Result<Vec<u64>> {
    let b = read_bytes(f, e.table_offset, u64::from(e.table_size) * 8).await?;
    let t: Vec<u64> = b.chunks_exact(8).map(|c| be64(c, 0)).collect();
    if t.iter().any(|&x| !table_entry_ok(x, cs)) {
        return Err(corrupt(format!(
            "Could not read bitmap_table table from image for bitmap '{}'",
            e.name
        )));
    }
    Ok(t)
}

/// Reads the bitmaps of an image whose bitmaps extension is valid (autoclear bit set);
/// `writable` decides whether they may record (else they are read-only, as QEMU loads
/// them for a read-only node).
pub(super) async fn load(
    f: &dyn BlockDriver,
    h: &Header,
    ext: &[u8],
    writable: bool,
) -> Result<Loaded, String> {
    let io = |e: io::Error| e.to_string();
    let cs = h.cluster_size();
    let (nb, size, offset) = parse_ext(ext)?;
    if !offset.is_multiple_of(cs) {
        return Err("bitmaps_ext: invalid dir offset".into());
    }
    if size == 0 {
        return Err("Requested bitmap directory size is zero".into());
    }
    let raw = read_bytes(f, offset, size).await.map_err(io)?;
    let entries = parse_dir(&raw, nb, cs, h.size)?;
    // What the bits of all bitmaps take in memory, bounded before any is allocated: an
    // image must not make the daemon hold without bound (thousands of entries, each
    // within the per-bitmap limit, would).
    let total = loaded_bits_bytes(&entries, h.size);
    if total > MAX_LOADED_BITS_BYTES {
        return Err(format!(
            "the image's {} bitmaps would take {} MiB of memory (stord loads at most {} MiB)",
            entries.len(),
            total >> 20,
            MAX_LOADED_BITS_BYTES >> 20
        ));
    }
    let mut refs = vec![(offset, size)];
    let mut bitmaps = Vec::new();
    for e in &entries {
        let granularity = 1u64 << e.granularity_bits;
        let in_use = e.flags & FLAG_IN_USE != 0;
        let b = DirtyBitmap::new(&e.name, granularity, h.size, e.flags & FLAG_AUTO != 0)
            .map_err(|err| format!("bitmap '{}': {err}", e.name))?;
        if !in_use && u64::from(e.table_size) != table_entries(h.size, granularity, cs) {
            return Err(format!("Could not read bitmap '{}' from image", e.name));
        }
        refs.push((e.table_offset, u64::from(e.table_size) * 8));
        let table = read_table(f, e, cs).await.map_err(io)?;
        // Granules one cluster of bits covers.
        let per_cluster = cs * 8;
        for (i, &t) in table.iter().enumerate() {
            let data = t & ENTRY_OFFSET;
            if data != 0 {
                refs.push((data, cs));
            }
            if in_use {
                continue;
            }
            let first = i as u64 * per_cluster;
            if data != 0 {
                let bits = read_bytes(f, data, cs).await.map_err(io)?;
                b.load_bits(first, &bits);
            } else if t & ENTRY_ALL_ONES != 0 {
                b.set_granules(first, per_cluster);
            }
        }
        b.set_persistent(true);
        if in_use {
            b.set_inconsistent();
        }
        if !writable {
            b.set_readonly(true);
        }
        bitmaps.push(b);
    }
    Ok(Loaded {
        dir: Directory {
            offset,
            size,
            entries,
        },
        bitmaps,
        refs,
    })
}

/// Marks every loaded bitmap in use in the image (QEMU's in-place update: the autoclear
/// bit goes down while the directory is rewritten, so a crash in between leaves bitmaps
/// known to be stale, never a directory half old and half new that claims to be valid).
async fn mark_in_use(f: &dyn BlockDriver, dir: &mut Directory) -> io::Result<()> {
    if dir.entries.iter().all(|e| e.flags & FLAG_IN_USE != 0) {
        return Ok(());
    }
    for e in &mut dir.entries {
        e.flags |= FLAG_IN_USE;
    }
    let (r, now) = f.read(field::AUTOCLEAR, request_buf(8)).await;
    r?;
    let bits = be64(&now, 0) & !autoclear::BITMAPS;
    let write = |off: u64, data: Vec<u8>| async move {
        let mut b = request_buf(data.len());
        b.copy_from_slice(&data);
        let (r, _) = f.write(off, b, false).await;
        r?;
        f.flush().await
    };
    write(field::AUTOCLEAR, bits.to_be_bytes().to_vec()).await?;
    write(dir.offset, encode_dir(&dir.entries)).await?;
    write(
        field::AUTOCLEAR,
        (bits | autoclear::BITMAPS).to_be_bytes().to_vec(),
    )
    .await
}

impl Qcow2Driver {
    /// The node is in service (opened read-write, every check passed): its bitmaps are
    /// marked in use in the image from now until they are stored at close.
    pub(super) async fn activate_impl(&self) -> io::Result<()> {
        if !self.writable.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let mut m = self.meta.lock().await;
        if m.bitmap_dir.entries.is_empty() {
            return Ok(());
        }
        let mut dir = m.bitmap_dir.clone();
        mark_in_use(self.file.driver(), &mut dir).await?;
        m.bitmap_dir = dir;
        Ok(())
    }

    /// Frees clusters of bitmap metadata nothing references any more.
    async fn free_meta(&self, m: &mut Meta, off: u64, len: u64) -> io::Result<()> {
        if off == 0 || len == 0 {
            return Ok(());
        }
        let cs = self.cluster_size;
        let mut c = off & !(cs - 1);
        while c < off + len {
            if self.change_refcount(m, c, -1).await? == 0 {
                m.regions.remove(&(c >> self.cluster_bits));
            }
            c += cs;
        }
        Ok(())
    }

    /// Frees a bitmap's table and the data clusters it points at.
    async fn free_bitmap_clusters(&self, m: &mut Meta, e: &DirEntry) -> io::Result<()> {
        let table = read_table(self.file.driver(), e, self.cluster_size).await?;
        for t in table {
            self.free_meta(m, t & ENTRY_OFFSET, self.cluster_size)
                .await?;
        }
        self.free_meta(m, e.table_offset, u64::from(e.table_size) * 8)
            .await
    }

    /// Writes `bytes` to `n` fresh clusters in a row: their offset.
    async fn write_new_clusters(
        &self,
        m: &mut Meta,
        bytes: &[u8],
        kind: Option<MetaKind>,
    ) -> io::Result<u64> {
        let cs = self.cluster_size;
        let n = (bytes.len() as u64).div_ceil(cs).max(1);
        let off = self.alloc_contiguous(m, n).await?;
        if let Some(kind) = kind {
            m.add_region(self.cluster_bits, off, bytes.len() as u64, kind);
        }
        self.check_overlap(m, off, bytes.len() as u64, kind).await?;
        self.file_write(off, bytes).await?;
        Ok(off)
    }

    /// Makes `entries` the image's directory: written to new clusters, their refcounts
    /// durable, then the header switched to them in one write (the autoclear bit set
    /// with it, or cleared with the extension when no bitmap is left), then the old
    /// directory freed (QEMU's update_ext_header_and_dir).
    async fn commit_directory(&self, m: &mut Meta, entries: Vec<DirEntry>) -> io::Result<()> {
        let cs = self.cluster_size;
        let (offset, size) = if entries.is_empty() {
            (0, 0)
        } else {
            let bytes = encode_dir(&entries);
            let off = self
                .write_new_clusters(m, &bytes, Some(MetaKind::BitmapDir))
                .await?;
            (off, bytes.len() as u64)
        };
        self.write_back(m).await?;
        self.file.driver().flush().await?;
        m.needs_sync = false;
        let c0 = self.file_read(0, cs as usize).await?;
        let old_autoclear = be64(&c0, field::AUTOCLEAR as usize);
        let (ext, bits) = if entries.is_empty() {
            (None, old_autoclear & !autoclear::BITMAPS)
        } else {
            (
                Some(ext_bytes(entries.len(), size, offset)),
                old_autoclear | autoclear::BITMAPS,
            )
        };
        let new = super::header::with_bitmaps_ext(&c0, ext.as_ref().map(|e| &e[..]), bits)
            .map_err(io::Error::other)?;
        self.check_overlap(m, 0, new.len() as u64, Some(MetaKind::Header))
            .await?;
        self.file_write(0, &new).await?;
        self.file.driver().flush().await?;
        let old = std::mem::replace(
            &mut m.bitmap_dir,
            Directory {
                offset,
                size,
                entries,
            },
        );
        self.free_meta(m, old.offset, old.size).await?;
        Ok(())
    }

    /// Writes a bitmap's bits to fresh clusters (all-zero clusters stay unallocated) and
    /// its table after them: the table's offset and length in entries.
    async fn store_one(&self, m: &mut Meta, b: &DirtyBitmap) -> io::Result<(u64, u32)> {
        let cs = self.cluster_size as usize;
        let bits = b.serialize();
        let mut table = Vec::new();
        for chunk in bits.chunks(cs) {
            if chunk.iter().all(|&x| x == 0) {
                table.push(0u64);
                continue;
            }
            let mut data = chunk.to_vec();
            data.resize(cs, 0);
            table.push(self.write_new_clusters(m, &data, None).await?);
        }
        let bytes: Vec<u8> = table.iter().flat_map(|t| t.to_be_bytes()).collect();
        let off = self.write_new_clusters(m, &bytes, None).await?;
        Ok((off, table.len() as u32))
    }

    /// Stores the persistent bitmaps that record here (close): each to new clusters, one
    /// new directory, then the old clusters freed.
    pub(super) async fn store_bitmaps_impl(
        &self,
        bitmaps: Vec<std::sync::Arc<DirtyBitmap>>,
    ) -> io::Result<()> {
        let ours: Vec<_> = bitmaps
            .into_iter()
            .filter(|b| b.is_persistent() && !b.is_inconsistent() && !b.is_readonly())
            .collect();
        if ours.is_empty() {
            return Ok(());
        }
        let mut m = self.meta.lock().await;
        self.check_not_corrupt()?;
        let mut entries = m.bitmap_dir.entries.clone();
        let mut dropped = Vec::new();
        // New ones join the directory in the node's order, newest first, as in QEMU (so
        // a reopen lists them as QEMU's reopen would).
        for b in &ours {
            let (table_offset, table_size) = self.store_one(&mut m, b).await?;
            let e = DirEntry {
                table_offset,
                table_size,
                flags: if b.is_recording() { FLAG_AUTO } else { 0 },
                granularity_bits: b.granularity().trailing_zeros() as u8,
                name: b.name.clone(),
            };
            match entries.iter_mut().find(|x| x.name == b.name) {
                Some(old) => dropped.push(std::mem::replace(old, e)),
                None => entries.push(e),
            }
        }
        self.commit_directory(&mut m, entries).await?;
        for e in dropped {
            self.free_bitmap_clusters(&mut m, &e).await?;
        }
        self.write_back(&mut m).await?;
        self.file.driver().flush().await?;
        m.needs_sync = false;
        Ok(())
    }

    /// Takes a bitmap out of the image's directory and frees its clusters (absent: nothing
    /// to do, as in QEMU).
    pub(super) async fn remove_bitmap_impl(&self, name: &str) -> io::Result<()> {
        let mut m = self.meta.lock().await;
        self.check_not_corrupt()?;
        let mut entries = m.bitmap_dir.entries.clone();
        let Some(pos) = entries.iter().position(|e| e.name == name) else {
            return Ok(());
        };
        let e = entries.remove(pos);
        self.commit_directory(&mut m, entries).await?;
        self.free_bitmap_clusters(&mut m, &e).await?;
        self.write_back(&mut m).await?;
        self.file.driver().flush().await?;
        m.needs_sync = false;
        Ok(())
    }

    /// Whether a new persistent bitmap could be stored (QEMU's
    /// qcow2_co_can_store_new_dirty_bitmap, less the checks on the node's other bitmaps).
    pub(super) fn can_store(&self, granularity: u64, name: &str) -> Result<(), String> {
        if self.version < 3 {
            return Err("Cannot store dirty bitmaps in qcow2 v2 files".into());
        }
        let bits = granularity.trailing_zeros();
        if bits > 31 {
            return Err("Granularity exceeds maximum (2147483648 bytes)".into());
        }
        if bits < 9 {
            return Err("Granularity is under minimum (512 bytes)".into());
        }
        let bytes = self.size().div_ceil(granularity).div_ceil(8);
        if bytes > MAX_PHYS_SIZE || bytes > MAX_TABLE_SIZE * self.cluster_size {
            return Err(
                "Too much space will be occupied by the bitmap. Use larger granularity".into(),
            );
        }
        if name.len() > MAX_NAME {
            return Err(format!(
                "Name length exceeds maximum ({MAX_NAME} characters)"
            ));
        }
        Ok(())
    }
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
