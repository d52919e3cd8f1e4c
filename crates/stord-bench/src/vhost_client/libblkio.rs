//! libblkio (the `blkio` crate, driver `virtio-blk-vhost-user`) as a vhost-user-blk client:
//! the driver behind QEMU's `virtio-blk-vhost-user` blockdev and fio's libblkio engine, so
//! a client nobody here wrote. Each queue is driven by its own thread like one fio job:
//! `qd` requests kept in flight, each completion answered with a new request at a random
//! (or the next sequential) offset. Blocking queues wait in `do_io` on libblkio's
//! completion eventfd; poll queues spin in `do_io` without ever sleeping. A rate
//! (`DriveSpec::rate_iops`) paces the requests as fio's `rate_iops` does.

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, ReqFlags};

use super::spec::{figures, think, DriveSpec};
use crate::peers::FioResult;

/// Which kind of libblkio queue drives the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueKind {
    /// Completions waited for on the completion eventfd (the daemon's call eventfd).
    Blocking,
    /// Completions polled for in a loop (no interrupts).
    Poll,
}

fn fail(what: &str, e: blkio::Error) -> ! {
    panic!("libblkio {what}: {}", e.message())
}

/// One queue's latencies (ns, measured after the ramp) and its measured wall time.
struct QueueRun {
    lat_ns: Vec<u64>,
    measured: Duration,
}

/// A connected and started libblkio device with its queues and one memory region, a
/// slice of it per queue.
struct Device {
    _b: Blkio,
    qs: Vec<Blkioq>,
    capacity: u64,
    base: usize,
    per_queue: usize,
    _region: blkio::MemoryRegion,
}

impl Device {
    /// The device on `sock` with `queues` queues of `kind`, each with room for `spec`'s
    /// requests; `read_only` for an export that is.
    fn open(
        sock: &Path,
        spec: &DriveSpec,
        kind: QueueKind,
        queues: usize,
        read_only: bool,
    ) -> Device {
        let mut b = Blkio::new("virtio-blk-vhost-user").unwrap_or_else(|e| fail("new", e));
        b.set_str("path", &sock.display().to_string())
            .unwrap_or_else(|e| fail("path", e));
        b.set_bool("read-only", read_only)
            .unwrap_or_else(|e| fail("read-only", e));
        b.connect().unwrap_or_else(|e| fail("connect", e));
        let n = queues as i32;
        let (blocking, poll) = match kind {
            QueueKind::Blocking => (n, 0),
            QueueKind::Poll => (0, n),
        };
        b.set_i32("num-queues", blocking)
            .unwrap_or_else(|e| fail("num-queues", e));
        b.set_i32("num-poll-queues", poll)
            .unwrap_or_else(|e| fail("num-poll-queues", e));
        let started = b.start().unwrap_or_else(|e| fail("start", e));
        let qs = match kind {
            QueueKind::Blocking => started.queues,
            QueueKind::Poll => started.poll_queues,
        };
        let capacity = b
            .get_u64("capacity")
            .unwrap_or_else(|e| fail("capacity", e));
        let align = b
            .get_u64("mem-region-alignment")
            .unwrap_or_else(|e| fail("mem-region-alignment", e))
            .max(4096) as usize;
        let per_queue = (usize::from(spec.qd) * spec.bs as usize).div_ceil(align) * align;
        let region = b
            .alloc_mem_region(per_queue * queues)
            .unwrap_or_else(|e| fail("alloc_mem_region", e));
        b.map_mem_region(&region)
            .unwrap_or_else(|e| fail("map_mem_region", e));
        Device {
            base: region.addr,
            _b: b,
            qs,
            capacity,
            per_queue,
            _region: region,
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // The queues go before the instance they belong to (the fields after them).
        self.qs.clear();
    }
}

/// Drives `spec` with libblkio over `queues` queues of `kind`; latency percentiles over all
/// queues, IOPS summed.
pub(crate) fn drive(sock: &Path, spec: &DriveSpec, kind: QueueKind, queues: usize) -> FioResult {
    let mut d = Device::open(sock, spec, kind, queues, false);
    let (base, per_queue, capacity) = (d.base, d.per_queue, d.capacity);
    let runs: Vec<QueueRun> = std::thread::scope(|s| {
        let handles: Vec<_> =
            d.qs.iter_mut()
                .enumerate()
                .map(|(i, q)| {
                    let buf = base + i * per_queue;
                    s.spawn(move || run_queue(q, buf, capacity, spec, i as u64))
                })
                .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(d);
    summarize(runs)
}

/// One read-only device per socket with one blocking queue, each driven by its own thread
/// with its own spec (the density benchmark's light guests): each device's IOPS and
/// latencies (ns).
pub(crate) fn drive_devices(socks: &[PathBuf], specs: &[DriveSpec]) -> Vec<(f64, Vec<u64>)> {
    std::thread::scope(|s| {
        let handles: Vec<_> = socks
            .iter()
            .zip(specs)
            .enumerate()
            .map(|(i, (sock, spec))| {
                s.spawn(move || {
                    let mut d = Device::open(sock, spec, QueueKind::Blocking, 1, true);
                    let (buf, capacity) = (d.base, d.capacity);
                    let r = run_queue(&mut d.qs[0], buf, capacity, spec, i as u64);
                    let iops = r.lat_ns.len() as f64 / r.measured.as_secs_f64().max(1e-9);
                    (iops, r.lat_ns)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Connects a read-only device to each socket and does one read on each, says so on `ready`, then
/// holds them without I/O until `stop` says (or its sender goes).
pub(crate) fn hold_devices(
    socks: &[PathBuf],
    ready: std::sync::mpsc::Sender<()>,
    stop: std::sync::mpsc::Receiver<()>,
) {
    let spec = DriveSpec {
        write: false,
        sequential: true,
        bs: 4096,
        qd: 1,
        ramp: Duration::ZERO,
        runtime: Duration::ZERO,
        think: Duration::ZERO,
        think_spin: false,
        rate_iops: None,
    };
    let mut devices: Vec<Device> = socks
        .iter()
        .map(|s| Device::open(s, &spec, QueueKind::Blocking, 1, true))
        .collect();
    for d in &mut devices {
        let (buf, capacity) = (d.base, d.capacity);
        let mut slots = Slots::new(&mut d.qs[0], buf, &spec, Offsets::new(capacity, &spec, 0));
        slots.issue_due(Instant::now(), None);
        slots.drain();
    }
    let _ = ready.send(());
    let _ = stop.recv();
}

/// One queue's loop, like one fio job.
fn run_queue(q: &mut Blkioq, buf: usize, capacity: u64, spec: &DriveSpec, seed: u64) -> QueueRun {
    let mut s = Slots::new(q, buf, spec, Offsets::new(capacity, spec, seed));
    let interval = spec.rate_iops.map(|r| Duration::from_secs_f64(1.0 / r));
    let t0 = Instant::now();
    let ramp_end = t0 + spec.ramp;
    let mut measure_start = None;
    let expected = spec.rate_iops.map_or(1 << 20, |r| {
        (r * spec.runtime.as_secs_f64() * 1.2) as usize + 1024
    });
    let mut lat_ns = Vec::with_capacity(expected.min(1 << 20));
    loop {
        let now = Instant::now();
        match measure_start {
            Some(t) if now - t >= spec.runtime => break,
            None if now >= ramp_end => measure_start = Some(now),
            _ => {}
        }
        let not_due = s.issue_due(t0, interval);
        // Ahead of the rate, fio finishes what is in flight, one completion at a time,
        // and then sleeps until the next request is due (io_u_quiesce, usec_sleep): so
        // does this (and issues again as soon as a request is due).
        let min = match not_due {
            Some(due) if s.in_flight == 0 => {
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                continue;
            }
            _ => 1,
        };
        s.reap(min, measure_start.is_some().then_some(&mut lat_ns));
    }
    let measured = measure_start.map_or(Duration::ZERO, |t| t.elapsed());
    // Let what is in flight finish before the buffers go.
    s.drain();
    QueueRun { lat_ns, measured }
}

/// Where a queue's next request goes: a random block, or the next one in sequence.
struct Offsets {
    sequential: bool,
    bs: u64,
    blocks: u64,
    rng: u64,
    seq: u64,
}

impl Offsets {
    /// The offsets of queue `seed`: its own random sequence, or a stream starting at its
    /// own eighth of the device.
    fn new(capacity: u64, spec: &DriveSpec, seed: u64) -> Offsets {
        let blocks = capacity / spec.bs as u64;
        Offsets {
            sequential: spec.sequential,
            bs: spec.bs as u64,
            blocks,
            rng: 0x2545_f491_4f6c_dd1d ^ (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            seq: seed * (blocks / 8),
        }
    }

    fn next_offset(&mut self) -> u64 {
        if self.sequential {
            self.seq = (self.seq + 1) % self.blocks;
            return self.seq * self.bs;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % self.blocks) * self.bs
    }
}

/// A queue's `qd` request slots (slot i's buffer at `buf + i * bs`): which are free, when
/// each in flight started, how many requests were issued and how many are in flight.
struct Slots<'a> {
    q: &'a mut Blkioq,
    buf: usize,
    spec: &'a DriveSpec,
    offsets: Offsets,
    started: Vec<Instant>,
    /// Free slots, the next to use last.
    free: Vec<usize>,
    issued: u64,
    in_flight: usize,
    comps: Vec<MaybeUninit<Completion>>,
}

impl<'a> Slots<'a> {
    fn new(q: &'a mut Blkioq, buf: usize, spec: &'a DriveSpec, offsets: Offsets) -> Self {
        let qd = usize::from(spec.qd);
        Slots {
            q,
            buf,
            spec,
            offsets,
            started: vec![Instant::now(); qd],
            free: (0..qd).rev().collect(),
            issued: 0,
            in_flight: 0,
            comps: (0..qd).map(|_| MaybeUninit::uninit()).collect(),
        }
    }

    /// Issues into the free slots what is due: everything without a rate (`interval`
    /// None); with one, request k at t0 + k * interval, as fio's linear rate process
    /// schedules them. Returns when the next request is due if it is not yet.
    fn issue_due(&mut self, t0: Instant, interval: Option<Duration>) -> Option<Instant> {
        while let Some(&slot) = self.free.last() {
            let now = Instant::now();
            if let Some(iv) = interval {
                let due = t0 + iv.mul_f64(self.issued as f64);
                if now < due {
                    return Some(due);
                }
            }
            self.free.pop();
            self.started[slot] = now;
            let offset = self.offsets.next_offset();
            self.submit(slot, offset);
            self.in_flight += 1;
            self.issued += 1;
        }
        None
    }

    fn submit(&mut self, slot: usize, offset: u64) {
        let bs = self.spec.bs as usize;
        let addr = self.buf + slot * bs;
        if self.spec.write {
            self.q
                .write(offset, addr as *const u8, bs, slot, ReqFlags::empty());
        } else {
            self.q
                .read(offset, addr as *mut u8, bs, slot, ReqFlags::empty());
        }
    }

    /// Waits for at least `min` completions; frees their slots after the think time, and
    /// records their latencies in `lat_ns` if given.
    fn reap(&mut self, min: usize, mut lat_ns: Option<&mut Vec<u64>>) {
        let n = self
            .q
            .do_io(&mut self.comps, min, None, None)
            .unwrap_or_else(|e| fail("do_io", e));
        let now = Instant::now();
        for c in &self.comps[..n] {
            // SAFETY: do_io initialised the first `n` completions.
            let c = unsafe { c.assume_init_read() };
            assert_eq!(c.ret, 0, "a request failed: {}", c.ret);
            let slot = c.user_data;
            if let Some(lat_ns) = lat_ns.as_deref_mut() {
                lat_ns.push((now - self.started[slot]).as_nanos() as u64);
            }
            think(self.spec.think, self.spec.think_spin);
            self.free.push(slot);
        }
        self.in_flight -= n;
    }

    /// Waits until nothing is in flight.
    fn drain(&mut self) {
        while self.in_flight > 0 {
            let n = self
                .q
                .do_io(&mut self.comps, self.in_flight, None, None)
                .unwrap_or_else(|e| fail("do_io", e));
            self.in_flight -= n;
        }
    }
}

fn summarize(runs: Vec<QueueRun>) -> FioResult {
    let iops: f64 = runs
        .iter()
        .map(|r| r.lat_ns.len() as f64 / r.measured.as_secs_f64().max(1e-9))
        .sum();
    let lat: Vec<u64> = runs.into_iter().flat_map(|r| r.lat_ns).collect();
    figures(iops, lat)
}
