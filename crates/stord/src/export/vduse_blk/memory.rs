//! The driver's IOVA space as the daemon sees it: ranges the kernel hands out through
//! VDUSE_IOTLB_GET_FD, each mapped once (shared, with the access the kernel grants), kept
//! until the kernel says they are gone (UPDATE_IOTLB) or the device resets. A queue asks
//! for what its chains point at ([`LazyMemory`]); the kernel sets up its bounce buffer
//! only at the first DMA mapping, so nothing can be mapped ahead of time but the rings.
//!
//! A page of the bounce buffer the kernel never allocated raises SIGBUS when touched. Each
//! range is watched ([`guest_fault`]): such a fault raises [`IovaMemory::fault`]
//! instead of killing the daemon, and the queues stop until the driver resets the device.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use super::uapi;
use crate::export::virtio_blk::guest_fault::{self, Watch};
use crate::export::virtio_blk::vring::LazyMemory;

struct Range {
    start: u64,
    last: u64,
    /// The kernel granted write access.
    writable: bool,
    watch: Option<Watch>,
    region: Arc<GuestRegionMmap>,
}

#[derive(Default)]
struct Map {
    ranges: Vec<Range>,
    mem: Arc<GuestMemoryMmap>,
    /// Ranges unmapped from `ranges` that requests in flight may still use, watched until
    /// the last of those lets go. (The watch first: it goes before the mapping does.)
    retired: Vec<(Option<Watch>, Arc<GuestRegionMmap>)>,
}

/// The mapped part of one device's IOVA space.
pub struct IovaMemory {
    device: Arc<uapi::Device>,
    map: Mutex<Map>,
    /// Raised by a SIGBUS in a mapped range.
    pub fault: Arc<AtomicBool>,
    /// Some mapped range is read-only (never with virtio_vdpa): only then does checking a
    /// device-writable buffer take the lock.
    read_only: AtomicBool,
}

impl IovaMemory {
    pub fn new(device: Arc<uapi::Device>) -> Self {
        Self {
            device,
            map: Mutex::default(),
            fault: Arc::default(),
            read_only: AtomicBool::new(false),
        }
    }

    /// Maps the range holding `iova` unless it is mapped.
    fn add(&self, map: &mut Map, iova: u64) -> Result<(), String> {
        if map.ranges.iter().any(|r| r.start <= iova && iova <= r.last) {
            return Ok(());
        }
        let (e, file) = self
            .device
            .iotlb_fd(iova)
            .map_err(|err| format!("IOVA {iova:#x} is not mapped by the kernel: {err}"))?;
        let size = e
            .last
            .checked_sub(e.start)
            .and_then(|n| usize::try_from(n + 1).ok())
            .ok_or_else(|| format!("bad IOTLB entry {e:?}"))?;
        let mut prot = 0;
        if e.perm & uapi::ACCESS_RO != 0 {
            prot |= libc::PROT_READ;
        }
        if e.perm & uapi::ACCESS_WO != 0 {
            prot |= libc::PROT_WRITE;
        }
        let region = MmapRegion::build(
            Some(FileOffset::new(file, e.offset)),
            size,
            prot,
            libc::MAP_SHARED,
        )
        .map_err(|err| format!("cannot map IOVA {:#x}+{size:#x}: {err}", e.start))?;
        let region = GuestRegionMmap::new(region, GuestAddress(e.start))
            .ok_or_else(|| format!("IOTLB entry {e:?} overflows"))?;
        let watch = guest_fault::watch(region.as_ptr() as usize, size, &self.fault);
        let writable = e.perm & uapi::ACCESS_WO != 0;
        let region = Arc::new(region);
        map.ranges.push(Range {
            start: e.start,
            last: e.last,
            writable,
            watch,
            region: region.clone(),
        });
        if let Err(err) = Self::rebuild(map) {
            // Not kept (nothing used it; its watch goes before its mapping): the address
            // stays unmapped and the memory as it was.
            map.ranges.retain(|r| !Arc::ptr_eq(&r.region, &region));
            let _ = Self::rebuild(map);
            return Err(err);
        }
        if !writable {
            self.read_only.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    fn rebuild(map: &mut Map) -> Result<(), String> {
        map.ranges.sort_by_key(|r| r.start);
        map.mem = Arc::new(
            GuestMemoryMmap::from_arc_regions(
                map.ranges.iter().map(|r| r.region.clone()).collect(),
            )
            .map_err(|e| format!("IOTLB ranges overlap: {e}"))?,
        );
        Ok(())
    }

    /// Maps every range holding one of `iovas` (a queue's rings before it starts).
    pub fn ensure(&self, iovas: &[u64]) -> Result<Arc<GuestMemoryMmap>, String> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        for &iova in iovas {
            self.add(&mut map, iova)?;
        }
        Ok(map.mem.clone())
    }

    /// The kernel took back [start, last]: ranges inside it are unmapped (once requests
    /// using them let go). Returns the memory left.
    pub fn remove(&self, start: u64, last: u64) -> Arc<GuestMemoryMmap> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let (gone, kept) = std::mem::take(&mut map.ranges)
            .into_iter()
            .partition(|r| r.last >= start && r.start <= last);
        map.ranges = kept;
        let gone: Vec<Range> = gone;
        map.retired
            .extend(gone.into_iter().map(|r| (r.watch, r.region)));
        // The ranges left did not overlap before, and do not now.
        let _ = Self::rebuild(&mut map);
        map.retired.retain(|(_, r)| Arc::strong_count(r) > 1);
        map.mem.clone()
    }

    /// The device was reset: everything is unmapped and a fault is forgotten.
    pub fn reset(&self) {
        self.remove(0, u64::MAX);
        self.fault.store(false, Ordering::SeqCst);
    }
}

impl LazyMemory for IovaMemory {
    fn writable(&self, addr: u64, len: u64) -> bool {
        if !self.read_only.load(Ordering::Relaxed) {
            return true;
        }
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let last = addr.saturating_add(len.max(1) - 1);
        // Every byte in a writable range (ranges do not overlap; gaps fail).
        let mut at = addr;
        while at <= last {
            match map.ranges.iter().find(|r| r.start <= at && at <= r.last) {
                Some(r) if r.writable => match r.last.checked_add(1) {
                    Some(next) => at = next,
                    None => return true,
                },
                _ => return false,
            }
        }
        true
    }

    fn map(&self, addr: u64) -> Option<Arc<GuestMemoryMmap>> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        match self.add(&mut map, addr) {
            Ok(()) => Some(map.mem.clone()),
            Err(e) => {
                tracing::warn!("vduse-blk: {e}");
                None
            }
        }
    }
}
