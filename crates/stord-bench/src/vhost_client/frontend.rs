//! A vhost-user frontend of our own, driving a vhost-user-blk export the way a guest's
//! virtio-blk driver would: shared memfd memory, a split virtqueue we lay out ourselves,
//! EVENT_IDX for kicks and interrupts, and a blocking wait on the call eventfd when nothing
//! has completed (so the daemon's side of notification suppression is exercised). The wait
//! is a poll(2): qemu-storage-daemon makes the (shared) call eventfd non-blocking, which
//! turned an earlier version's blocking read into a busy spin against qsd only. One queue,
//! driven from the calling thread.

use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use vmm_sys_util::eventfd::EventFd;

use super::spec::{figures, think, DriveSpec};
use crate::media::IMAGE_SIZE;
use crate::peers::FioResult;

const QUEUE_SIZE: u16 = 256;
const MEM_SIZE: usize = 16 << 20;
const DESC: u64 = 0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HEADERS: u64 = 0x4000;
const STATUS: u64 = 0x5000;
const DATA: u64 = 1 << 20;
/// Data buffer per request slot: the largest request size.
const SLOT_BYTES: u64 = 64 << 10;

const F_VERSION_1: u64 = 1 << 32;
const F_EVENT_IDX: u64 = 1 << 29;
const F_PROTOCOL_FEATURES: u64 = 1 << 30;

/// A connected frontend with one queue, driven from this thread.
struct Driver {
    fe: Frontend,
    mem: GuestMemoryMmap,
    kick: EventFd,
    call: EventFd,
    avail_idx: u16,
    last_used: u16,
    event_idx: bool,
    sectors: u64,
    rng: u64,
    /// Next sector of a sequential stream.
    seq_next: u64,
    /// Reads of the call eventfd, and those that waited (the driver really slept).
    call_reads: u64,
    call_sleeps: u64,
}

impl Driver {
    fn connect(sock: &Path) -> Driver {
        let file = memfd(MEM_SIZE);
        let map = MmapRegion::from_file(FileOffset::new(file, 0), MEM_SIZE).expect("map memfd");
        let region = GuestRegionMmap::new(map, GuestAddress(0)).expect("region");
        let info = VhostUserMemoryRegionInfo::from_guest_region(&region).expect("region info");
        let mem = GuestMemoryMmap::from_regions(vec![region]).expect("guest memory");
        let mut fe = Frontend::connect(sock, 1).expect("connect to the vhost-user socket");
        fe.set_owner().expect("SET_OWNER");
        let offered = fe.get_features().expect("GET_FEATURES");
        let features = offered & (F_VERSION_1 | F_EVENT_IDX | F_PROTOCOL_FEATURES);
        if features & F_PROTOCOL_FEATURES != 0 {
            let p = fe.get_protocol_features().expect("GET_PROTOCOL_FEATURES");
            fe.set_protocol_features(
                p & (VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::CONFIG),
            )
            .expect("SET_PROTOCOL_FEATURES");
        }
        fe.set_features(features).expect("SET_FEATURES");
        fe.set_mem_table(&[info]).expect("SET_MEM_TABLE");
        let host = |gpa: u64| info.userspace_addr + gpa;
        fe.set_vring_num(0, QUEUE_SIZE).expect("SET_VRING_NUM");
        fe.set_vring_addr(
            0,
            &VringConfigData {
                queue_max_size: QUEUE_SIZE,
                queue_size: QUEUE_SIZE,
                flags: 0,
                desc_table_addr: host(DESC),
                used_ring_addr: host(USED),
                avail_ring_addr: host(AVAIL),
                log_addr: None,
            },
        )
        .expect("SET_VRING_ADDR");
        fe.set_vring_base(0, 0).expect("SET_VRING_BASE");
        let call = EventFd::new(0).expect("eventfd");
        let kick = EventFd::new(0).expect("eventfd");
        fe.set_vring_call(0, &call).expect("SET_VRING_CALL");
        fe.set_vring_kick(0, &kick).expect("SET_VRING_KICK");
        if features & F_PROTOCOL_FEATURES != 0 {
            fe.set_vring_enable(0, true).expect("SET_VRING_ENABLE");
        }
        Driver {
            fe,
            mem,
            kick,
            call,
            avail_idx: 0,
            last_used: 0,
            event_idx: features & F_EVENT_IDX != 0,
            sectors: IMAGE_SIZE / 512,
            rng: 0x2545_f491_4f6c_dd1d,
            seq_next: 0,
            call_reads: 0,
            call_sleeps: 0,
        }
    }

    /// The next request's sector: random (aligned to `bs`) or the next in sequence.
    fn next_sector(&mut self, spec: &DriveSpec) -> u64 {
        let step = u64::from(spec.bs) / 512;
        if spec.sequential {
            let s = self.seq_next;
            self.seq_next = (s + step) % (self.sectors - self.sectors % step);
            return s;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % (self.sectors / step)) * step
    }

    /// Puts the request of `slot` (descriptors 3*slot..3*slot+2) in the avail ring.
    fn queue(&mut self, slot: u16, spec: &DriveSpec) {
        let write = spec.write;
        let sector = self.next_sector(spec);
        let m = &self.mem;
        let hdr = HEADERS + 16 * u64::from(slot);
        m.write_obj(u32::from(write).to_le(), GuestAddress(hdr))
            .unwrap();
        m.write_obj(0u32, GuestAddress(hdr + 4)).unwrap();
        m.write_obj(sector.to_le(), GuestAddress(hdr + 8)).unwrap();
        let d = 3 * slot;
        let (next, wr) = (1u16, 2u16);
        let data_flags = if write { next } else { next | wr };
        self.desc(d, hdr, 16, next, d + 1);
        self.desc(
            d + 1,
            DATA + u64::from(slot) * SLOT_BYTES,
            spec.bs,
            data_flags,
            d + 2,
        );
        self.desc(d + 2, STATUS + u64::from(slot), 1, wr, 0);
        let pos = AVAIL + 4 + 2 * u64::from(self.avail_idx % QUEUE_SIZE);
        m.write_obj(d.to_le(), GuestAddress(pos)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
    }

    fn desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = GuestAddress(DESC + 16 * u64::from(i));
        self.mem.write_obj(addr.to_le(), at).unwrap();
        self.mem
            .write_obj(len.to_le(), GuestAddress(at.0 + 8))
            .unwrap();
        self.mem
            .write_obj(flags.to_le(), GuestAddress(at.0 + 12))
            .unwrap();
        self.mem
            .write_obj(next.to_le(), GuestAddress(at.0 + 14))
            .unwrap();
    }

    /// Publishes the avail index and kicks if the device asked for it.
    fn publish(&mut self, old: u16) {
        fence(Ordering::Release);
        self.mem
            .store(self.avail_idx, GuestAddress(AVAIL + 2), Ordering::Release)
            .unwrap();
        fence(Ordering::SeqCst);
        let kick = if self.event_idx {
            let event: u16 = self
                .mem
                .load(
                    GuestAddress(USED + 4 + 8 * u64::from(QUEUE_SIZE)),
                    Ordering::Acquire,
                )
                .unwrap();
            self.avail_idx.wrapping_sub(event).wrapping_sub(1) < self.avail_idx.wrapping_sub(old)
        } else {
            let flags: u16 = self
                .mem
                .load(GuestAddress(USED), Ordering::Acquire)
                .unwrap();
            flags & 1 == 0
        };
        if kick {
            self.kick.write(1).unwrap();
        }
    }

    fn used_idx(&self) -> u16 {
        self.mem
            .load(GuestAddress(USED + 2), Ordering::Acquire)
            .unwrap()
    }

    /// Keeps `spec.qd` requests in flight through the ramp and the run; returns the
    /// latencies (ns) of those that completed after the ramp.
    fn run(&mut self, spec: &DriveSpec) -> Vec<u64> {
        let (qd, runtime) = (spec.qd, spec.runtime);
        let mut started = vec![Instant::now(); qd as usize];
        let old = self.avail_idx;
        for s in 0..qd {
            self.queue(s, spec);
        }
        self.publish(old);
        let ramp_end = Instant::now() + spec.ramp;
        let mut measuring = false;
        let mut end = ramp_end + runtime;
        let mut lat_ns: Vec<u64> = Vec::with_capacity(1 << 20);
        let mut done = Vec::with_capacity(qd as usize);
        loop {
            done.clear();
            self.reap(&mut done);
            let now = Instant::now();
            if !measuring && now >= ramp_end {
                measuring = true;
                lat_ns.clear();
                end = now + runtime;
            }
            if measuring && now >= end {
                return lat_ns;
            }
            let old = self.avail_idx;
            for &s in &done {
                if measuring {
                    lat_ns.push((now - started[s as usize]).as_nanos() as u64);
                }
                think(spec.think, spec.think_spin);
                started[s as usize] = Instant::now();
                self.queue(s, spec);
            }
            self.publish(old);
        }
    }

    /// Waits for completions; returns the slots that completed.
    fn reap(&mut self, out: &mut Vec<u16>) {
        loop {
            let mut idx = self.used_idx();
            if idx == self.last_used {
                // Ask for an interrupt at the next completion, re-check, then sleep.
                self.mem
                    .store(
                        self.last_used,
                        GuestAddress(AVAIL + 4 + 2 * u64::from(QUEUE_SIZE)),
                        Ordering::Release,
                    )
                    .unwrap();
                fence(Ordering::SeqCst);
                idx = self.used_idx();
                if idx == self.last_used {
                    let t = Instant::now();
                    wait_readable(&self.call);
                    let _ = self.call.read();
                    self.call_reads += 1;
                    if t.elapsed() > Duration::from_micros(3) {
                        self.call_sleeps += 1;
                    }
                    continue;
                }
            }
            while self.last_used != idx {
                let pos = USED + 4 + 8 * u64::from(self.last_used % QUEUE_SIZE);
                let id: u32 = self.mem.read_obj(GuestAddress(pos)).unwrap();
                let slot = (u32::from_le(id) / 3) as u16;
                let status: u8 = self
                    .mem
                    .read_obj(GuestAddress(STATUS + u64::from(slot)))
                    .unwrap();
                assert_eq!(status, 0, "request failed with virtio-blk status {status}");
                out.push(slot);
                self.last_used = self.last_used.wrapping_add(1);
            }
            return;
        }
    }
}

/// Blocks until `fd` is readable. The call eventfd's file description is shared with the
/// daemon, which may make it non-blocking (qemu-storage-daemon does): a plain read would
/// then return EAGAIN at once and turn this frontend's wait into a busy spin, so we wait
/// with poll(2) whatever its flags, as libblkio does.
fn wait_readable(fd: &EventFd) {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, owned by this frame, for the duration of the call.
    unsafe { libc::poll(&mut p, 1, -1) };
}

/// Anonymous shared memory (memfd) of `size` bytes, for the daemon to map.
fn memfd(size: usize) -> std::fs::File {
    use std::os::fd::FromRawFd;
    // SAFETY: the name is a NUL-terminated literal; no other pointers.
    let fd = unsafe { libc::memfd_create(c"stord-bench-guest".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: memfd_create returned a new fd that nothing else owns.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(size as u64).expect("size the memfd");
    f
}

/// Runs `spec` against the vhost-user socket `sock`; returns fio-like figures (measured
/// after the ramp).
pub(crate) fn drive(sock: &Path, spec: &DriveSpec) -> FioResult {
    assert!(
        spec.rate_iops.is_none(),
        "our own frontend has no rate limit"
    );
    assert!(u64::from(spec.bs) <= SLOT_BYTES && spec.bs.is_multiple_of(512));
    assert!(DATA + u64::from(spec.qd) * SLOT_BYTES <= MEM_SIZE as u64);
    let mut d = Driver::connect(sock);
    let lat_ns = d.run(spec);
    // Let the daemon finish what is queued before we disconnect.
    let deadline = Instant::now() + Duration::from_secs(2);
    while d.used_idx() != d.avail_idx && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(d.fe);
    if std::env::var_os("STORD_BENCH_DRIVER_STATS").is_some() {
        print_call_stats(&d.call, d.call_reads, d.call_sleeps, lat_ns.len());
    }
    let iops = lat_ns.len() as f64 / spec.runtime.as_secs_f64();
    figures(iops, lat_ns)
}

/// `STORD_BENCH_DRIVER_STATS`: whether the daemon made the call eventfd non-blocking, and
/// how often the frontend read it (and slept on it) per request.
fn print_call_stats(call: &EventFd, reads: u64, sleeps: u64, requests: usize) {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GETFL on our own eventfd.
    let fl = unsafe { libc::fcntl(call.as_raw_fd(), libc::F_GETFL) };
    eprintln!(
        "  frontend: call eventfd O_NONBLOCK: {}",
        fl & libc::O_NONBLOCK != 0
    );
    eprintln!(
        "  frontend: call-eventfd reads {} (that waited > 3 us: {}), per request {:.3} / {:.3}",
        reads,
        sleeps,
        reads as f64 / requests.max(1) as f64,
        sleeps as f64 / requests.max(1) as f64
    );
}
