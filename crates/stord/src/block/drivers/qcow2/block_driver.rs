//! The driver's face to the block layer: [`BlockDriver`] for [`Qcow2Driver`], each request
//! handed to the file of its concern (`read`, `write`, `discard`, `block_status`,
//! `writeback`, `header_update`, `bitmaps`, `internal`).

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::driver::Qcow2Driver;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::node::perm::Perm;
use crate::buf::Buf;
use crate::iov::IoVec;

impl BlockDriver for Qcow2Driver {
    fn no_flush(&self) -> bool {
        self.file.driver().no_flush()
    }
    fn driver_name(&self) -> &'static str {
        "qcow2"
    }
    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.read_impl(offset, buf))
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.write_impl(offset, buf, fua))
    }
    fn readv(&self, offset: u64, iov: IoVec) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(self.readv_impl(offset, iov))
    }
    fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> BoxFut<'_, (io::Result<()>, IoVec)> {
        Box::pin(self.writev_impl(offset, iov, fua))
    }
    fn write_compressed(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(self.write_compressed_impl(offset, buf))
    }
    fn supports_compressed_writes(&self) -> bool {
        true
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.flush_impl())
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        if self.crypt.is_some() {
            return Box::pin(self.crypt_discard(offset, len));
        }
        Box::pin(self.discard_impl(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        if self.crypt.is_some() {
            return Box::pin(self.crypt_write_zeroes(offset, len, may_unmap));
        }
        Box::pin(self.write_zeroes_impl(offset, len, may_unmap))
    }
    fn encrypted(&self) -> bool {
        self.crypt.is_some()
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(self.block_status_impl(offset, len))
    }
    fn block_status_cached(&self, offset: u64, len: u64) -> Option<BlockStatus> {
        self.block_status_from_cache(offset, len)
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<(u64, u32)>> {
        Box::pin(self.allocation_depth_impl(offset, len))
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.resize_impl(size))
    }
    fn filename(&self) -> Option<String> {
        self.file.filename()
    }
    /// The file's, and the data file's with it (QEMU sums a format node's storage children).
    fn allocated_bytes(&self) -> Option<u64> {
        let file = self.file.allocated_bytes();
        match &self.data {
            Some(d) => Some(file? + d.node.allocated_bytes()?),
            None => file,
        }
    }
    fn cluster_size(&self) -> Option<u64> {
        Some(self.cluster_size)
    }
    /// As QEMU's qcow2_refresh_limits: zeroes and discards by (sub)cluster, and an
    /// encrypted image's requests by sector.
    fn refresh_limits(&self, bl: &mut crate::block::node::limits::BlockLimits) {
        if self.crypt.is_some() {
            bl.request_alignment = crate::crypto::cipher::SECTOR_SIZE as u32;
        }
        bl.write_zeroes_alignment = self.cluster_size as u32;
        bl.discard_alignment = self.cluster_size as u32;
    }
    fn child_perms(
        &self,
        role: &'static str,
        perm: Perm,
        shared: Perm,
        writable: bool,
    ) -> (Perm, Perm) {
        match role {
            "backing" => crate::block::node::perm::backing_perms(perm, shared),
            "data-file" => crate::block::node::perm::data_perms(perm, shared),
            _ => crate::block::node::perm::storage_perms(writable),
        }
    }
    fn activate(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.activate_impl())
    }
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async move { self.reload(true).await.map_err(|e| e.to_string()) })
    }
    fn invalidate_cache(&self, writable: bool) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async move { self.reload(writable).await.map_err(|e| e.to_string()) })
    }
    fn can_store_bitmap(&self, granularity: u64, name: &str) -> Option<Result<(), String>> {
        Some(self.can_store(granularity, name))
    }
    fn store_bitmaps(
        &self,
        bitmaps: Vec<Arc<crate::block::node::dirty_bitmap::DirtyBitmap>>,
    ) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.store_bitmaps_impl(bitmaps))
    }
    fn remove_stored_bitmap<'a>(&'a self, name: &'a str) -> BoxFut<'a, io::Result<()>> {
        Box::pin(self.remove_bitmap_impl(name))
    }
    fn populate(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.populate_impl(offset, len))
    }
    fn set_backing(&self, new: Option<Arc<BlockNode>>) -> Result<Option<Arc<BlockNode>>, String> {
        let mut b = self.backing.write().unwrap_or_else(|e| e.into_inner());
        let changes = (self.backing_state.load(Ordering::Relaxed) >> 1) + 1;
        self.backing_state
            .store(changes << 1 | new.is_some() as u64, Ordering::Release);
        Ok(std::mem::replace(&mut *b, new))
    }
    fn can_snapshot(&self) -> bool {
        true
    }
    fn list_snapshots(
        &self,
    ) -> BoxFut<'_, io::Result<Vec<crate::block::node::block_node::SnapshotInfo>>> {
        Box::pin(self.list_snapshots_impl())
    }
    fn create_snapshot<'a>(
        &'a self,
        name: &'a str,
        date: (u32, u32),
    ) -> BoxFut<'a, io::Result<crate::block::node::block_node::SnapshotInfo>> {
        Box::pin(self.create_snapshot_impl(name, date))
    }
    fn delete_snapshot<'a>(
        &'a self,
        id: Option<&'a str>,
        name: Option<&'a str>,
    ) -> BoxFut<'a, io::Result<Option<crate::block::node::block_node::SnapshotInfo>>> {
        Box::pin(self.delete_snapshot_impl(id, name))
    }
    fn change_backing_file<'a>(
        &'a self,
        backing: Option<(&'a str, Option<&'a str>)>,
    ) -> BoxFut<'a, io::Result<()>> {
        Box::pin(self.change_backing_file_impl(backing))
    }
    /// The file, the data file, then the backing node: a new backing node's claim goes
    /// last (see `BlockNode::set_backing`).
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        let mut v = vec![("file", self.file.clone())];
        if let Some(d) = &self.data {
            v.push(("data-file", d.node.clone()));
        }
        if let Some(b) = self.backing() {
            v.push(("backing", b));
        }
        v
    }
}
