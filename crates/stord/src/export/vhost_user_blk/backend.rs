//! The control plane of one vhost-user connection: the rust-vmm `vhost` crate parses the
//! messages and calls [`BlkBackend`] (its request-handler trait); we keep the negotiated
//! features, guest memory and each vring's configuration, and start a vring on its IoThread
//! once it has a kick fd ([`VringHandle`]). GET_VRING_BASE stops it again after its requests
//! in flight have completed.

use std::fs::File;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use stord_aio::Remote;
use vhost::vhost_user::message::*;
use vhost::vhost_user::{Backend, GpuBackend, VhostUserBackendReqHandlerMut};
use vhost::vhost_user::{Error as VuError, Result as VuResult};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::export::virtio_blk::device::BlkDevice;
use crate::export::virtio_blk::guest_fault::{self, within_file, GuestFault};
use crate::export::virtio_blk::inflight::InflightRegion;
use crate::export::virtio_blk::vring::{Interrupt, VringHandle, VringStart};

/// How long GET_VRING_BASE waits for a queue's requests in flight.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// `VHOST_USER_F_PROTOCOL_FEATURES`: the frontend may negotiate protocol features.
pub const VHOST_USER_F_PROTOCOL_FEATURES: u32 = 30;

/// Queue size the frontend may use at most (QEMU's default is 128 for vhost-user-blk).
pub const MAX_QUEUE_SIZE: u16 = 1024;

fn fail(msg: impl Into<String>) -> VuError {
    VuError::ReqHandlerError(std::io::Error::other(msg.into()))
}

/// Memory regions one frontend may map (GET_MAX_MEM_SLOTS; libvhost-user's figure).
pub const MAX_MEM_SLOTS: usize = 509;

/// One mapped region of guest memory.
struct MemSlot {
    /// Keeps a SIGBUS in the region from stopping the daemon (see `guest_fault`).
    watch: Option<guest_fault::Watch>,
    /// Frontend virtual address, guest physical address, size.
    user_addr: u64,
    gpa: u64,
    size: u64,
    region: Arc<GuestRegionMmap>,
}

/// Guest memory and how frontend addresses map onto it. SET_MEM_TABLE replaces the whole
/// table; ADD_MEM_REG / REM_MEM_REG (CONFIGURE_MEM_SLOTS) change one region. Each change
/// builds a new `GuestMemoryMmap` for the running queues; requests in flight keep the one
/// they started with (an `Arc`), so a removed region stays mapped until they finish.
#[derive(Default)]
struct MemTable {
    slots: Vec<MemSlot>,
    guest: Option<Arc<GuestMemoryMmap>>,
}

impl MemTable {
    fn va_to_gpa(&self, va: u64) -> Option<u64> {
        self.slots
            .iter()
            .find(|s| va >= s.user_addr && va - s.user_addr < s.size)
            .map(|s| s.gpa + (va - s.user_addr))
    }

    /// Maps one region from the frontend's fd.
    fn map(r: &VhostUserMemoryRegion, f: File, fault: &GuestFault) -> VuResult<MemSlot> {
        let bytes = r.memory_size;
        let size = usize::try_from(bytes)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| fail(format!("memory region of {bytes} bytes")))?;
        within_file(&f, r.mmap_offset, bytes).map_err(fail)?;
        let map = MmapRegion::from_file(FileOffset::new(f, r.mmap_offset), size)
            .map_err(|e| fail(format!("cannot map guest memory: {e}")))?;
        let region = GuestRegionMmap::new(map, GuestAddress(r.guest_phys_addr))
            .ok_or_else(|| fail("guest memory region overflows"))?;
        let watch = guest_fault::watch(region.as_ptr() as usize, size, &fault.flag);
        if watch.is_none() {
            tracing::warn!("vhost-user-blk: too many guest memory regions to watch for SIGBUS");
        }
        Ok(MemSlot {
            watch,
            user_addr: r.user_addr,
            gpa: r.guest_phys_addr,
            size: r.memory_size,
            region: Arc::new(region),
        })
    }

    /// Rebuilds the guest memory from the slots (refusing overlaps).
    fn rebuild(&mut self) -> VuResult<Arc<GuestMemoryMmap>> {
        // vm-memory wants the regions in address order.
        self.slots.sort_by_key(|s| s.gpa);
        let guest = Arc::new(
            GuestMemoryMmap::from_arc_regions(
                self.slots.iter().map(|s| s.region.clone()).collect(),
            )
            .map_err(|e| fail(format!("bad memory table: {e}")))?,
        );
        self.guest = Some(guest.clone());
        Ok(guest)
    }
}

/// A vhost-user queue's interrupt: its call eventfd.
impl Interrupt for File {
    fn raise(&self) {
        let _ = (&*self).write(&1u64.to_ne_bytes());
    }
}

#[derive(Default)]
struct VringConfig {
    num: u16,
    /// Frontend virtual addresses of the descriptor table, avail and used rings.
    addr: Option<(u64, u64, u64)>,
    base: u16,
    kick: Option<File>,
    call: Option<Arc<File>>,
    enabled: bool,
    running: Option<VringHandle>,
}

/// One connection's device state.
pub struct BlkBackend {
    dev: Arc<BlkDevice>,
    /// The IoThread serving each queue.
    remotes: Vec<Remote>,
    acked_features: u64,
    protocol_features: u64,
    mem: MemTable,
    vrings: Vec<VringConfig>,
    inflight: Option<Arc<InflightRegion>>,
    /// This connection's guest memory vanished.
    fault: Arc<GuestFault>,
    /// Regions taken out of the table that requests may still use, watched until the last
    /// of those lets go (then unwatched and unmapped together).
    /// (The watch first: it is dropped, so unregistered, before the region is unmapped.)
    retired: Vec<(Option<guest_fault::Watch>, Arc<GuestRegionMmap>)>,
}

impl BlkBackend {
    pub fn new(dev: Arc<BlkDevice>, remotes: Vec<Remote>, fault: Arc<GuestFault>) -> Self {
        let n = dev.num_queues as usize;
        Self {
            dev,
            remotes,
            acked_features: 0,
            protocol_features: 0,
            mem: MemTable::default(),
            vrings: (0..n).map(|_| VringConfig::default()).collect(),
            inflight: None,
            fault,
            retired: Vec::new(),
        }
    }

    /// The feature bits offered: the device's, and vhost-user's protocol features.
    fn features(&self) -> u64 {
        self.dev.features() | (1 << VHOST_USER_F_PROTOCOL_FEATURES)
    }

    /// Slots leave the table: their regions stay watched while anything still maps them.
    fn retire(&mut self, slots: impl IntoIterator<Item = MemSlot>) {
        self.retired
            .extend(slots.into_iter().map(|s| (s.watch, s.region)));
        self.retired.retain(|(_, r)| Arc::strong_count(r) > 1);
    }

    fn vring(&mut self, index: u32) -> VuResult<&mut VringConfig> {
        self.vrings
            .get_mut(index as usize)
            .ok_or_else(|| fail(format!("vring {index} does not exist")))
    }

    /// Hands new guest memory to the running queues.
    fn publish_mem(&self, guest: Arc<GuestMemoryMmap>) {
        for v in &self.vrings {
            if let Some(h) = &v.running {
                h.set_mem(guest.clone());
            }
        }
    }

    /// Stops every running vring (the connection ends, or the owner is reset).
    pub fn stop_all(&mut self) {
        for v in &mut self.vrings {
            if let Some(h) = v.running.take() {
                v.base = h.stop(DRAIN_LIMIT);
            }
        }
    }

    /// Starts vring `index` if it has everything it needs.
    fn maybe_start(&mut self, index: usize) -> VuResult<()> {
        let protocol = self.acked_features & (1 << VHOST_USER_F_PROTOCOL_FEATURES) != 0;
        let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let remote = self.remotes[index % self.remotes.len()].clone();
        let v = &mut self.vrings[index];
        if v.running.is_some() || v.kick.is_none() {
            return Ok(());
        }
        let mem = &self.mem;
        let guest = mem
            .guest
            .clone()
            .filter(|_| !mem.slots.is_empty())
            .ok_or_else(|| fail("vring started before guest memory was set"))?;
        let (d, a, u) = v
            .addr
            .ok_or_else(|| fail(format!("vring {index} started before SET_VRING_ADDR")))?;
        let gpa = |va: u64, what: &str| {
            mem.va_to_gpa(va).ok_or_else(|| {
                fail(format!(
                    "vring {index}: {what} at {va:#x} is outside guest memory"
                ))
            })
        };
        let mut q = Queue::new(MAX_QUEUE_SIZE).map_err(|e| fail(e.to_string()))?;
        q.set_size(v.num);
        let (d, a, u) = (
            gpa(d, "descriptor table")?,
            gpa(a, "avail ring")?,
            gpa(u, "used ring")?,
        );
        q.set_desc_table_address(Some(d as u32), Some((d >> 32) as u32));
        q.set_avail_ring_address(Some(a as u32), Some((a >> 32) as u32));
        q.set_used_ring_address(Some(u as u32), Some((u >> 32) as u32));
        q.set_event_idx(event_idx);
        q.set_next_avail(v.base);
        let used = q
            .used_idx(&*guest, std::sync::atomic::Ordering::Acquire)
            .map_err(|e| fail(e.to_string()))?;
        q.set_next_used(used.0);
        q.set_ready(true);
        if !q.is_valid(&*guest) {
            return Err(fail(format!(
                "vring {index}: size {} or ring addresses invalid",
                v.num
            )));
        }
        let kick = v
            .kick
            .as_ref()
            .unwrap()
            .try_clone()
            .map_err(VuError::ReqHandlerError)?;
        let start = VringStart {
            index: index as u16,
            queue: q,
            mem: guest,
            kick,
            call: v.call.clone().map(|c| c as Arc<dyn Interrupt>),
            lazy: None,
            dev: self.dev.clone(),
            inflight: self.inflight.clone(),
            fault: self.fault.clone(),
            // Without protocol features a ring is enabled when started; with them it waits
            // for SET_VRING_ENABLE. QEMU enables before it kicks, so both work.
            enabled: v.enabled || !protocol,
        };
        v.running = Some(VringHandle::start(remote, start).map_err(fail)?);
        Ok(())
    }
}

impl VhostUserBackendReqHandlerMut for BlkBackend {
    fn set_owner(&mut self) -> VuResult<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> VuResult<()> {
        self.stop_all();
        self.acked_features = 0;
        Ok(())
    }

    fn reset_device(&mut self) -> VuResult<()> {
        self.reset_owner()
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(self.features())
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !self.features() != 0 {
            return Err(fail(format!(
                "frontend acked features {:#x} we did not offer",
                features & !self.features()
            )));
        }
        self.acked_features = features;
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<Vec<u64>>> {
        if ctx.len() > MAX_MEM_SLOTS {
            return Err(fail(format!(
                "{} memory regions (at most {MAX_MEM_SLOTS})",
                ctx.len()
            )));
        }
        let mut table = MemTable::default();
        for (r, f) in ctx.iter().zip(files) {
            table.slots.push(MemTable::map(r, f, &self.fault)?);
        }
        let guest = table.rebuild()?;
        let old = std::mem::replace(&mut self.mem, table);
        self.publish_mem(guest);
        drop(old.guest);
        self.retire(old.slots);
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        if num == 0 || num > u32::from(MAX_QUEUE_SIZE) || !num.is_power_of_two() {
            return Err(fail(format!("vring size {num} not supported")));
        }
        self.vring(index)?.num = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VuResult<()> {
        self.vring(index)?.addr = Some((descriptor, available, used));
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        self.vring(index)?.base = base as u16;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        let v = self.vring(index)?;
        if let Some(h) = v.running.take() {
            v.base = h.stop(DRAIN_LIMIT);
        }
        v.kick = None;
        Ok(VhostUserVringState::new(index, u32::from(v.base)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let v = self.vring(u32::from(index))?;
        if let Some(h) = v.running.take() {
            v.base = h.stop(DRAIN_LIMIT);
        }
        v.kick = fd;
        self.maybe_start(index as usize)
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let v = self.vring(u32::from(index))?;
        v.call = fd.map(Arc::new);
        if let Some(h) = &v.running {
            h.set_call(v.call.clone().map(|c| c as Arc<dyn Interrupt>));
        }
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, _fd: Option<File>) -> VuResult<()> {
        self.vring(u32::from(index))?;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::BACKEND_REQ)
    }

    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        self.protocol_features = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(u64::from(self.dev.num_queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        let v = self.vring(index)?;
        v.enabled = enable;
        if let Some(h) = &v.running {
            h.set_enabled(enable);
        }
        Ok(())
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VuResult<Vec<u8>> {
        let qs = self
            .vrings
            .first()
            .map_or(128, |v| if v.num == 0 { 128 } else { v.num });
        Ok(self.dev.config(offset, size, qs))
    }

    fn set_config(
        &mut self,
        offset: u32,
        buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VuResult<()> {
        self.dev.set_config(offset, buf).map_err(fail)
    }

    /// The channel itself is taken before this message reaches the handler (see
    /// `backend_channel_in_next_message`): vhost's `Backend` cannot send a config change.
    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VuResult<()> {
        Err(fail("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        Err(fail("no shared objects"))
    }

    fn get_inflight_fd(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> VuResult<(VhostUserInflight, File)> {
        if inflight.num_queues == 0
            || inflight.queue_size == 0
            || inflight.queue_size > MAX_QUEUE_SIZE
        {
            return Err(fail(format!(
                "in-flight region for {} queues of {} not supported",
                inflight.num_queues, inflight.queue_size
            )));
        }
        let r = InflightRegion::create(inflight.num_queues, inflight.queue_size)
            .map_err(VuError::ReqHandlerError)?;
        let file = r.file().try_clone().map_err(VuError::ReqHandlerError)?;
        let reply = VhostUserInflight::new(r.size(), 0, inflight.num_queues, inflight.queue_size);
        self.inflight = Some(Arc::new(r));
        Ok((reply, file))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VuResult<()> {
        let r = InflightRegion::map(
            file,
            inflight.mmap_offset,
            inflight.mmap_size,
            inflight.num_queues,
            inflight.queue_size,
        )
        .map_err(VuError::ReqHandlerError)?;
        self.inflight = Some(Arc::new(r));
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        Ok(MAX_MEM_SLOTS as u64)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<u64>> {
        if self.mem.slots.len() >= MAX_MEM_SLOTS {
            return Err(fail(format!(
                "ADD_MEM_REG: all {MAX_MEM_SLOTS} memory slots are in use"
            )));
        }
        let slot = MemTable::map(region, fd, &self.fault)?;
        let added = slot.region.clone();
        self.mem.slots.push(slot);
        match self.mem.rebuild() {
            Ok(guest) => self.publish_mem(guest),
            Err(e) => {
                self.mem.slots.retain(|s| !Arc::ptr_eq(&s.region, &added));
                self.mem.rebuild()?;
                return Err(e);
            }
        }
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        let (gpa, size) = (region.guest_phys_addr, region.memory_size);
        let i = self
            .mem
            .slots
            .iter()
            .position(|s| s.gpa == gpa && s.size == size)
            .ok_or_else(|| {
                fail(format!(
                    "REM_MEM_REG: no region at {gpa:#x} of {size} bytes"
                ))
            })?;
        let removed = self.mem.slots.remove(i);
        let guest = self.mem.rebuild()?;
        self.publish_mem(guest);
        self.retire([removed]);
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        Err(fail("device state transfer not offered"))
    }

    fn check_device_state(&mut self) -> VuResult<()> {
        Err(fail("device state transfer not offered"))
    }

    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        Err(fail("no shared memory regions"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VuResult<()> {
        Err(fail("dirty logging not offered"))
    }
}

#[cfg(test)]
mod tests {
    fn fault() -> super::GuestFault {
        super::GuestFault::new(std::os::unix::net::UnixStream::pair().unwrap().0)
    }
    use super::*;
    use vm_memory::GuestMemoryBackend;

    fn region(gpa: u64, size: u64, user: u64) -> (VhostUserMemoryRegion, File) {
        let f = crate::sys::memfd_create("stord-test-mem").unwrap();
        f.set_len(size).unwrap();
        (VhostUserMemoryRegion::new(gpa, size, user, 0), f)
    }

    #[test]
    fn a_region_past_the_end_of_its_file_is_refused() {
        let f = crate::sys::memfd_create("stord-test-mem").unwrap();
        f.set_len(0x1_0000).unwrap();
        let r = VhostUserMemoryRegion::new(0, 0x2_0000, 0x7f00_0000, 0);
        let e = MemTable::map(&r, f.try_clone().unwrap(), &fault())
            .err()
            .unwrap();
        assert!(e.to_string().contains("runs past"), "{e}");
        let r = VhostUserMemoryRegion::new(0, 0x1_0000, 0x7f00_0000, 0x1000);
        assert!(MemTable::map(&r, f.try_clone().unwrap(), &fault()).is_err());
        let r = VhostUserMemoryRegion::new(0, 0x1_0000, 0x7f00_0000, u64::MAX);
        assert!(MemTable::map(&r, f.try_clone().unwrap(), &fault()).is_err());
        let r = VhostUserMemoryRegion::new(0, 0x1_0000, 0x7f00_0000, 0);
        assert!(MemTable::map(&r, f, &fault()).is_ok());
    }

    #[test]
    fn regions_come_and_go_and_overlaps_are_refused() {
        let mut t = MemTable::default();
        let (r, f) = region(0x10_0000, 0x1_0000, 0x7f00_0000);
        t.slots.push(MemTable::map(&r, f, &fault()).unwrap());
        // Added out of address order: still a valid table.
        let (r, f) = region(0, 0x1_0000, 0x7e00_0000);
        t.slots.push(MemTable::map(&r, f, &fault()).unwrap());
        let g = t.rebuild().unwrap();
        assert_eq!(g.num_regions(), 2);
        assert_eq!(t.va_to_gpa(0x7f00_0010), Some(0x10_0010));
        assert_eq!(t.va_to_gpa(0x7e00_ffff), Some(0xffff));
        assert_eq!(t.va_to_gpa(0x7e01_0000), None);
        // Overlapping the first region.
        let (r, f) = region(0x8000, 0x1_0000, 0x7d00_0000);
        t.slots.push(MemTable::map(&r, f, &fault()).unwrap());
        assert!(t.rebuild().is_err());
        t.slots.retain(|s| s.gpa != 0x8000);
        let g = t.rebuild().unwrap();
        assert_eq!(g.num_regions(), 2);
        // An empty region is refused when mapped.
        let (r, f) = region(0x20_0000, 0, 0x7c00_0000);
        assert!(MemTable::map(&r, f, &fault()).is_err());
    }

    /// A region replaced by a new memory table while a request still maps it stays
    /// watched: the frontend truncating its file then costs the connection, not the daemon
    /// (before, its watch went with the old table and this test process died of SIGBUS).
    #[test]
    fn a_retired_region_stays_watched_while_it_is_used() {
        let node = Arc::new(crate::block::node::block_node::BlockNode::new(
            "n".into(),
            Box::new(crate::block::drivers::null::NullDriver::new(1 << 20, true)),
            false,
            false,
        ));
        let dev = Arc::new(BlkDevice::new("v".into(), node, true, 512, 1));
        let f = Arc::new(fault());
        let mut b = BlkBackend::new(dev, Vec::new(), f.clone());
        let (r, file) = region(0, 0x10_0000, 0x7f00_0000);
        let keep = file.try_clone().unwrap();
        b.set_mem_table(&[r], vec![file], None).unwrap();
        // A request in flight holds the guest memory it started with.
        let in_flight = b.mem.guest.clone().unwrap();
        let (r2, file2) = region(0, 0x10_0000, 0x7e00_0000);
        b.set_mem_table(&[r2], vec![file2], None).unwrap();
        keep.set_len(0).unwrap();
        let mut byte = [7u8; 1];
        use vm_memory::Bytes;
        in_flight
            .read_slice(&mut byte, GuestAddress(0x1000))
            .unwrap();
        assert_eq!(byte, [0]);
        assert!(f.flag.load(std::sync::atomic::Ordering::SeqCst));
        drop(in_flight);
        drop(b);
    }
}
