//! The control thread of a VDUSE device: it answers the kernel's messages and starts,
//! stops and remaps the queues (see the module above for what runs where).

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use stord_aio::Remote;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};

use super::memory::IovaMemory;
use super::uapi;
use crate::export::virtio_blk::device::BlkDevice;
use crate::export::virtio_blk::guest_fault::GuestFault;
use crate::export::virtio_blk::inflight::{InflightQueue, InflightRegion};
use crate::export::virtio_blk::vring::{Interrupt, LazyMemory, VringHandle, VringStart};

/// VIRTIO_CONFIG_S_DRIVER_OK.
const DRIVER_OK: u8 = 4;
/// How long a reset waits for the queues' requests, all together.
const DRAIN_LIMIT: Duration = Duration::from_secs(10);
/// The most entries a queue may have (QEMU's VIRTQUEUE_MAX_SIZE).
const MAX_QUEUE_SIZE: u16 = 1024;

/// A queue's interrupt: VDUSE_VQ_INJECT_IRQ.
struct Irq {
    device: Arc<uapi::Device>,
    index: u32,
}

impl Interrupt for Irq {
    fn raise(&self) {
        let _ = self.device.vq_irq(self.index);
    }
}

/// The control thread's state: the device's queues and memory.
pub struct Controller {
    dev: Arc<BlkDevice>,
    device: Arc<uapi::Device>,
    remotes: Vec<Remote>,
    queue_size: u16,
    memory: Arc<IovaMemory>,
    inflight: Arc<InflightRegion>,
    running: Vec<Option<VringHandle>>,
    /// The ring addresses of each running queue (mapped again after UPDATE_IOTLB).
    rings: Vec<Option<[u64; 3]>>,
    /// Next avail index of each stopped queue.
    bases: Vec<u16>,
}

impl Controller {
    pub fn new(
        dev: Arc<BlkDevice>,
        device: Arc<uapi::Device>,
        remotes: Vec<Remote>,
        queue_size: u16,
        inflight: Arc<InflightRegion>,
    ) -> Self {
        let n = dev.num_queues as usize;
        Self {
            memory: Arc::new(IovaMemory::new(device.clone())),
            inflight,
            dev,
            device,
            remotes,
            queue_size,
            running: (0..n).map(|_| None).collect(),
            rings: vec![None; n],
            bases: vec![0; n],
        }
    }

    /// Reads and answers the kernel's messages until `stop` is written.
    pub fn serve(&mut self, stop: &File) {
        use std::io::{Read, Write};
        loop {
            let ready = match uapi::wait(&self.device, stop) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("vduse-blk {}: {e}", self.dev.id);
                    return;
                }
            };
            if ready.other {
                return;
            }
            if ready.broken && !ready.message {
                return self.broken(stop);
            }
            let mut req = uapi::Request([0; 152]);
            match (&self.device.0).read(&mut req.0) {
                Ok(152) => {}
                Ok(n) => {
                    tracing::warn!("vduse-blk {}: short message of {n} bytes", self.dev.id);
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => {
                    tracing::warn!("vduse-blk {}: reading the device: {e}", self.dev.id);
                    return self.broken(stop);
                }
            }
            let reply = self.handle(&req);
            if let Err(e) = (&self.device.0).write(&reply) {
                tracing::warn!("vduse-blk {}: answering the kernel: {e}", self.dev.id);
            }
        }
    }

    /// The kernel gave up on the device (a reply came later than its msg_timeout): it
    /// sends nothing more and refuses every ioctl. The queues stop; the export waits to be
    /// removed (the device must be deleted and created again).
    fn broken(&mut self, stop: &File) {
        tracing::error!(
            "vduse-blk {}: the kernel marked the device broken; remove the export and detach \
             the device (vdpa dev del) to create it again",
            self.dev.id
        );
        self.stop_queues();
        loop {
            match uapi::wait_one(stop) {
                Ok(true) => return,
                Ok(false) => {}
                Err(_) => return,
            }
        }
    }

    fn handle(&mut self, req: &uapi::Request) -> [u8; 152] {
        match req.kind() {
            uapi::REQ_GET_VQ_STATE => {
                let i = req.vq_index();
                let avail = match self.running.get(i as usize) {
                    Some(Some(h)) => h.next_avail(),
                    Some(None) => self.bases.get(i as usize).copied(),
                    None => None,
                };
                match avail {
                    Some(a) => uapi::response(req.id(), true, Some((i, a))),
                    None => uapi::response(req.id(), false, None),
                }
            }
            uapi::REQ_SET_STATUS => {
                let status = req.status();
                let mut ok = true;
                if status & DRIVER_OK != 0 {
                    // A queue that cannot be served fails the status change, so the
                    // driver does not wait on it forever.
                    ok = self.start_queues();
                } else if status == 0 {
                    self.stop_queues();
                    self.bases.iter_mut().for_each(|b| *b = 0);
                    self.memory.reset();
                    self.inflight.clear();
                }
                uapi::response(req.id(), ok, None)
            }
            uapi::REQ_UPDATE_IOTLB => {
                let (start, last) = req.iova_range();
                self.memory.remove(start, last);
                // The rings the running queues use are mapped again at once (the kernel
                // takes back everything, rings included); data ranges come back lazily.
                let rings: Vec<u64> = self.rings.iter().flatten().flatten().copied().collect();
                let mem = match self.memory.ensure(&rings) {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!("vduse-blk {}: {e}", self.dev.id);
                        self.memory.ensure(&[]).unwrap_or_default()
                    }
                };
                for h in self.running.iter().flatten() {
                    h.set_mem(mem.clone());
                }
                uapi::response(req.id(), true, None)
            }
            _ => uapi::response(req.id(), false, None),
        }
    }

    /// A device taken over may be running: its ready queues start at once, and each gets
    /// an interrupt, for completions the last daemon published and did not signal.
    pub fn take_over(&mut self) {
        self.start_queues();
        for (i, h) in self.running.iter().enumerate() {
            if h.is_some() {
                let _ = self.device.vq_irq(i as u32);
            }
        }
    }

    /// Starts every queue the driver made ready and that is not running; false if one
    /// of them could not start.
    fn start_queues(&mut self) -> bool {
        let features = match self.device.features() {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("vduse-blk {}: {e}", self.dev.id);
                return false;
            }
        };
        let mut ok = true;
        for i in 0..self.running.len() {
            if self.running[i].is_some() {
                continue;
            }
            match self.start_queue(i, features) {
                Ok(Some((h, rings))) => {
                    self.running[i] = Some(h);
                    self.rings[i] = Some(rings);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!("vduse-blk {}: queue {i}: {e}", self.dev.id);
                    ok = false;
                }
            }
        }
        ok
    }

    /// Starts queue `i` if the driver made it ready: its handle and ring addresses.
    fn start_queue(
        &self,
        i: usize,
        features: u64,
    ) -> Result<Option<(VringHandle, [u64; 3])>, String> {
        let info = self.device.vq_info(i as u32).map_err(|e| e.to_string())?;
        if info.ready == 0 {
            return Ok(None);
        }
        // The log tracks heads below the queue size it was made for; a device taken over
        // that was made with larger queues needs the same queue-size.
        if info.num > u32::from(self.queue_size) {
            return Err(format!(
                "the device's queues hold {} entries: use queue-size={}",
                info.num, info.num
            ));
        }
        let rings = [info.desc_addr, info.driver_addr, info.device_addr];
        let mem = self.memory.ensure(&rings)?;
        let mut q = Queue::new(MAX_QUEUE_SIZE).map_err(|e| e.to_string())?;
        q.try_set_size(info.num as u16)
            .map_err(|e| format!("queue size {}: {e}", info.num))?;
        let (d, a, u) = (info.desc_addr, info.driver_addr, info.device_addr);
        q.set_desc_table_address(Some(d as u32), Some((d >> 32) as u32));
        q.set_avail_ring_address(Some(a as u32), Some((a >> 32) as u32));
        q.set_used_ring_address(Some(u as u32), Some((u >> 32) as u32));
        q.set_event_idx(features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0);
        let used = q
            .used_idx(&*mem, Ordering::Acquire)
            .map_err(|e| e.to_string())?;
        // Nobody tells a device that is taken over how far the last daemon got: it took
        // every request up to what the used ring shows plus those still in flight in the
        // log, which the queue resubmits (libvduse does the same).
        let pending =
            InflightQueue::new(self.inflight.clone(), i as u16).map_or(0, |q| q.pending(used.0));
        let base = used.0.wrapping_add(pending);
        q.set_next_avail(base);
        q.set_next_used(used.0);
        q.set_ready(true);
        if !q.is_valid(&*mem) {
            return Err(format!("size {} or ring addresses invalid", info.num));
        }
        let kick = File::from(stord_aio::sys::eventfd().map_err(|e| e.to_string())?);
        self.device
            .vq_kickfd(i as u32, &kick)
            .map_err(|e| format!("kick eventfd: {e}"))?;
        let start = VringStart {
            index: i as u16,
            queue: q,
            mem,
            lazy: Some(self.memory.clone() as Arc<dyn LazyMemory>),
            kick,
            call: Some(Arc::new(Irq {
                device: self.device.clone(),
                index: i as u32,
            })),
            dev: self.dev.clone(),
            inflight: Some(self.inflight.clone()),
            enabled: true,
            fault: Arc::new(GuestFault::with_flag(self.memory.fault.clone())),
        };
        let remote = self.remotes[i % self.remotes.len()].clone();
        VringHandle::start(remote, start).map(|h| Some((h, rings)))
    }

    /// Stops every running queue, its requests drained within one deadline for all, well
    /// inside the kernel's wait for our reply (msg_timeout, 30 s by default), past which
    /// it breaks the device for good.
    pub fn stop_queues(&mut self) {
        let deadline = std::time::Instant::now() + DRAIN_LIMIT;
        for (i, h) in self.running.iter_mut().enumerate() {
            self.rings[i] = None;
            if let Some(h) = h.take() {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                self.bases[i] = h.stop(left.max(Duration::from_millis(1)));
            }
        }
    }
}
