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
//!
//! The format itself (extension, directory, table entries) is parsed in
//! [`super::bitmap_dir`].

use std::io;

use super::bitmap_dir::{
    encode_dir, ext_bytes, loaded_bits_bytes, parse_dir, parse_ext, table_entries, table_entry_ok,
    DirEntry, Directory, ENTRY_ALL_ONES, ENTRY_OFFSET, FLAG_AUTO, FLAG_IN_USE,
    MAX_LOADED_BITS_BYTES, MAX_NAME, MAX_PHYS_SIZE, MAX_TABLE_SIZE,
};
use super::bytes::{be64, decode_be64};
use super::driver::{corrupt, Meta, MetaKind, Qcow2Driver};
use super::header::{autoclear, field, Header};
use crate::block::node::block_node::BlockDriver;
use crate::block::node::dirty_bitmap::DirtyBitmap;
use crate::buf::request_buf;

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
    let t = decode_be64(&b);
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
