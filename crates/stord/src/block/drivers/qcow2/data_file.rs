//! External data files (incompatible feature bit 2, QEMU's `data-file`): the image file
//! keeps the metadata, the guest data lives in a second node, the `data-file` child.
//!
//! As QEMU has it (qcow2_do_open, qcow2-cluster.c, qcow2-refcount.c):
//! - The child is `data-file=<node>` or inline `data-file.driver=...`; else the file the
//!   header's extension names, opened as a protocol node (`file`, or `host_device` for a
//!   device) with what children inherit from the image (read-only among it). QEMU opens
//!   that name as it stands, so a relative one is relative to the daemon's working
//!   directory, not to the image's. QEMU's refusals: "'data-file' is required for this
//!   image", "'data-file' can only be set for images with an external data file",
//!   "data-file-raw requires a data file".
//! - Every data cluster sits at its guest offset in the data file ([`Qcow2Driver::alloc_data`]):
//!   nothing is counted in the image's refcounts, an L2 entry of offset 0 with COPIED set
//!   maps the data file's first cluster, and an entry that maps a cluster elsewhere, or a
//!   compressed one, marks the image corrupt.
//! - A freed data cluster has no refcount to drop: a guest discard (or write-zeroes that
//!   may unmap) passes it down to the data file instead, when the image's node lets
//!   discards through.
//! - With `data-file-raw` (autoclear bit 1) the data file is a raw image of the disk by
//!   itself: write-zeroes zero it before the L2 entries change, a resize maps the new
//!   clusters one to one (QEMU's metadata preallocation), and no backing file may be set.
//! - Block status of data asks the data file too (zero where it has a hole) once the image
//!   looks metadata-preallocated by QEMU's guess (qcow2_detect_metadata_preallocation,
//!   BDRV_BLOCK_RECURSE), as a raw data file qemu-img made does.
//! - Internal snapshots are refused (ENOTSUP, as QEMU's qcow2_snapshot_*), and so are
//!   compressed clusters.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use stord_aio::sys::now_ns;

use super::driver::{DataFile, Meta, Qcow2Driver, PREALLOC_NO, PREALLOC_UNKNOWN, PREALLOC_YES};
use super::header::Header;
use super::table::{Mapping, COPIED};
use crate::block::node::block_node::{BlockNode, BlockStatus};
use crate::block::node::stats::Op;
use crate::block::open::{Graph, GraphError};
use crate::buf::{request_buf, Buf};
use crate::cli::keyval::KeyVal;

/// The `data-file` option: a node, an inline one, or none.
pub(super) fn given_data_file(
    g: &mut dyn Graph,
    kv: &mut KeyVal,
) -> Result<Option<Arc<BlockNode>>, GraphError> {
    match g.optional_child(kv, "data-file")? {
        None => Ok(None),
        Some(Some(node)) => Ok(Some(node)),
        // `data-file` is a BlockdevRef, not BlockdevRefOrNull: null names no node.
        Some(None) => Err(GraphError::ChildNotFound("null".into())),
    }
}

/// The data file an image opens with, once its header is read: the one `given` (the
/// `data-file` option), else the one the header names; QEMU's refusals where the option
/// and the header disagree.
pub(super) fn open_data_file(
    g: &mut dyn Graph,
    given: Option<Arc<BlockNode>>,
    header: &Header,
) -> Result<Option<DataFile>, GraphError> {
    if !header.has_data_file() {
        if given.is_some() {
            return Err(GraphError::Invalid(
                "'data-file' can only be set for images with an external data file".into(),
            ));
        }
        if header.data_file_raw() {
            return Err(GraphError::Invalid(
                "data-file-raw requires a data file".into(),
            ));
        }
        return Ok(None);
    }
    let node = match (given, &header.data_file) {
        (Some(node), _) => node,
        (None, Some(name)) => g.data_file(name)?,
        (None, None) => {
            return Err(GraphError::Invalid(
                "'data-file' is required for this image".into(),
            ))
        }
    };
    Ok(Some(DataFile::new(node, header.data_file_raw())))
}

impl Qcow2Driver {
    /// This image with `data` as its external data file.
    pub(super) fn with_data_file(mut self, data: Option<DataFile>) -> Self {
        self.data = data;
        self
    }

    /// Whether guest data lives in an external data file.
    pub(super) fn has_data_file(&self) -> bool {
        self.data.is_some()
    }

    /// Whether the data file is kept a raw image of the disk (`data-file-raw`).
    pub(super) fn data_file_raw(&self) -> bool {
        self.data.as_ref().is_some_and(|d| d.raw)
    }

    /// The node guest data lives on: the data file, or the image's own file.
    pub(super) fn data_node(&self) -> &Arc<BlockNode> {
        self.data.as_ref().map_or(&self.file, |d| &d.node)
    }

    /// Reads `len` bytes of guest data at host offset `offset`, as stored (an encrypted
    /// image's encrypted: [`data_read`](Self::data_read) decrypts).
    pub(super) async fn host_read(&self, offset: u64, len: usize) -> io::Result<Buf> {
        let node = self.data_node();
        let start = now_ns();
        let (r, buf) = node.driver().read(offset, request_buf(len)).await;
        let end = offset + len as u64;
        node.count_direct(Op::Read, start, end, len as u64, r.is_ok());
        r.map(|_| buf)
    }

    /// Writes `buf` as guest data at host offset `offset` as it is (no copy), and gives it
    /// back.
    pub(super) async fn host_write_buf(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        let node = self.data_node();
        let (start, len) = (now_ns(), buf.len() as u64);
        node.note_write(offset, len);
        let (r, buf) = node.driver().write(offset, buf, false).await;
        node.count_direct(Op::Write, start, offset + len, len, r.is_ok());
        (r, buf)
    }

    /// A host cluster for the guest cluster at `cstart`, and whether it reads as zeroes
    /// already: in a data file the cluster at the same offset, which nothing counts (QEMU's
    /// do_alloc_cluster_offset) and which may hold anything; else a new cluster of the
    /// image file.
    pub(super) async fn alloc_data(&self, m: &mut Meta, cstart: u64) -> io::Result<(u64, bool)> {
        if self.has_data_file() {
            return Ok((cstart, false));
        }
        self.alloc_cluster(m).await
    }

    /// Gives back a data cluster [`alloc_data`](Self::alloc_data) handed out for a write
    /// that failed (nothing to give back in a data file).
    pub(super) async fn give_back(&self, m: &mut Meta, host: u64) -> io::Result<()> {
        if self.has_data_file() {
            return Ok(());
        }
        self.change_refcount(m, host, -1).await.map(|_| ())
    }

    /// QEMU's overlap check for guest data at `host`: none in a data file, which holds no
    /// metadata.
    pub(super) async fn check_data_overlap(&self, m: &Meta, host: u64, len: u64) -> io::Result<()> {
        if self.has_data_file() {
            return Ok(());
        }
        self.check_overlap(m, host, len, None).await
    }

    /// Why the mapping `map` of the guest cluster holding `guest`, read from the L2 table
    /// at `l2_off`, cannot be in an image with a data file (QEMU's texts, from
    /// qcow2_get_host_offset): a compressed cluster, or one not at its guest offset.
    pub(super) fn data_mapping_error(
        &self,
        map: Mapping,
        guest: u64,
        l2_off: u64,
    ) -> Option<String> {
        if !self.has_data_file() {
            return None;
        }
        let index = self.l2_index(guest);
        let cstart = self.cluster_start(guest);
        match map {
            Mapping::Compressed { .. } => Some(format!(
                "Compressed cluster entry found in image with external data file (L2 offset: \
                 {l2_off:#x}, L2 index: {index:#x})"
            )),
            Mapping::Data { host, .. }
            | Mapping::Zero {
                host: Some(host), ..
            } if host != cstart => Some(format!(
                "External data file host cluster offset {host:#x} does not match guest \
                 cluster offset: {cstart:#x}, L2 index: {index:#x})"
            )),
            _ => None,
        }
    }

    /// After the L2 entry of the guest cluster at `cstart` went from `old` to `entry`: a
    /// data cluster the entry no longer holds (no COPIED flag: every data cluster has one)
    /// is discarded in the data file, as QEMU's qcow2_free_any_cluster passes a guest
    /// discard down where the image's refcounts would drop it.
    pub(super) async fn discard_freed_data(&self, cstart: u64, old: Mapping, entry: u64) {
        let held = matches!(
            old,
            Mapping::Data { .. } | Mapping::Zero { host: Some(_), .. }
        );
        if !self.has_data_file() || !self.discard || !held || entry & COPIED != 0 {
            return;
        }
        // Dropped unless the data file's node passes discards on (its `discard=` option).
        let _ = self
            .data_node()
            .driver_discard(cstart, self.cluster_size)
            .await;
    }

    /// With `data-file-raw`: zeroes `[offset, offset + len)` of the data file, before the
    /// L2 entries say zero (QEMU's qcow2_subcluster_zeroize), so it stays the disk's image.
    pub(super) async fn zero_raw_data(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> io::Result<()> {
        if !self.data_file_raw() || len == 0 {
            return Ok(());
        }
        self.data_node().write_zeroes(offset, len, may_unmap).await
    }

    /// Internal snapshots: QEMU refuses them on an image with a data file (ENOTSUP).
    pub(super) fn refuse_snapshots(&self) -> io::Result<()> {
        if self.has_data_file() {
            return Err(io::Error::from_raw_os_error(libc::ENOTSUP));
        }
        Ok(())
    }

    /// A backing file for an image whose data file is raw: QEMU's qcow2_co_change_backing_file
    /// refuses it (EINVAL), the data file alone would no longer be the disk.
    pub(super) fn refuse_backing(&self, backing: bool) -> io::Result<()> {
        if backing && self.data_file_raw() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(())
    }

    /// The data file's part of growing the disk from `old` to `new` bytes, under the
    /// metadata lock after the L1 table grew (QEMU's qcow2_co_truncate): a raw one gets
    /// the new clusters mapped one to one, made durable, and grows if it is shorter
    /// (preallocate_co); another is resized to the new size.
    pub(super) async fn grow_data_file(&self, m: &mut Meta, old: u64, new: u64) -> io::Result<()> {
        let Some(data) = &self.data else {
            return Ok(());
        };
        if !data.raw {
            return data.node.resize(new).await;
        }
        let cs = self.cluster_size;
        let mut pos = self.cluster_start(old);
        while pos < new {
            if self.lookup(m, pos).await? == Mapping::Unallocated {
                // Preallocated subclusters stay unallocated (QEMU leaves the bitmap 0).
                self.set_l2(m, pos, pos | COPIED, 0).await?;
            }
            pos += cs;
        }
        self.write_back(m).await?;
        self.sync_if_needed(m).await?;
        if data.node.size() < new {
            data.node.resize(new).await?;
        }
        Ok(())
    }

    /// Whether block status asks the data file where this image maps data (QEMU's
    /// BDRV_BLOCK_RECURSE, set when qcow2_detect_metadata_preallocation finds more clusters
    /// in use in the image file than it has allocated, as after a metadata
    /// preallocation); decided once, at the first call.
    pub(super) async fn metadata_preallocated(&self) -> bool {
        let Some(d) = &self.data else {
            return false;
        };
        if d.preallocated.load(Ordering::Acquire) == PREALLOC_UNKNOWN {
            let mut m = self.meta.lock().await;
            if d.preallocated.load(Ordering::Acquire) == PREALLOC_UNKNOWN {
                let yes = self.detect_preallocation(&mut m).await.unwrap_or(false);
                let v = if yes { PREALLOC_YES } else { PREALLOC_NO };
                d.preallocated.store(v, Ordering::Release);
            }
        }
        d.preallocated.load(Ordering::Acquire) == PREALLOC_YES
    }

    /// Whether block status of data may have to ask the data file (not known to be
    /// otherwise yet): the cached answer is not the whole one then.
    pub(super) fn may_ask_data_file(&self) -> bool {
        self.data
            .as_ref()
            .is_some_and(|d| d.preallocated.load(Ordering::Acquire) != PREALLOC_NO)
    }

    /// QEMU's qcow2_detect_metadata_preallocation: counting clusters in use in the image
    /// file, are there at least 10/9 (and 2 more than) the clusters it has allocated?
    async fn detect_preallocation(&self, m: &mut Meta) -> io::Result<bool> {
        let cs = self.cluster_size;
        let Some(real) = self.file.allocated_bytes() else {
            return Ok(false);
        };
        let real_clusters = real / cs;
        let threshold = (real_clusters * 10 / 9).max(real_clusters + 2);
        let end = self.file.size().div_ceil(cs);
        let (mut c, mut count) = (0, 0);
        while c < end && count < threshold {
            count += u64::from(self.refcount_of(m, c).await? > 0);
            c += 1;
        }
        Ok(count >= threshold)
    }

    /// Block status of `run` bytes of guest data at `host` in the data file of a
    /// metadata-preallocated image: data, zero too where the data file reads as zeroes
    /// (a hole, or past its end), for as long as the data file says one thing; data
    /// alone if it cannot tell (QEMU ignores its errors).
    pub(super) async fn data_file_status(&self, host: u64, run: u64) -> BlockStatus {
        let node = self.data_node();
        let size = node.size();
        let status = |len, zero| BlockStatus {
            len,
            allocated: true,
            zero,
        };
        if host >= size {
            return status(run, true);
        }
        let n = run.min(size - host);
        let st = match node.driver().block_status_cached(host, n) {
            Some(st) => Ok(st),
            None => node.driver().block_status(host, n).await,
        };
        match st {
            Ok(st) => status(st.len.clamp(1, n), st.zero),
            Err(_) => status(run, false),
        }
    }

    /// Flushes the data file (before the metadata that points into it is written back).
    pub(super) async fn flush_data_file(&self) -> io::Result<()> {
        match &self.data {
            Some(d) => d.node.driver().flush().await,
            None => Ok(()),
        }
    }
}
