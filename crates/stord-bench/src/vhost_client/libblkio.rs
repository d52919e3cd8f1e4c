//! libblkio (the `blkio` crate, driver `virtio-blk-vhost-user`) as a vhost-user-blk client:
//! the driver behind QEMU's `virtio-blk-vhost-user` blockdev and fio's libblkio engine, so
//! a client nobody here wrote. Each queue is driven by its own thread like one fio job:
//! `qd` requests kept in flight, each completion answered with a new request at a random
//! (or the next sequential) offset. Blocking queues wait in `do_io` on libblkio's
//! completion eventfd; poll queues spin in `do_io` without ever sleeping. A rate
//! (`DriveSpec::rate_iops`) paces the requests as fio's `rate_iops` does.

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, ReqFlags};

use super::spec::{think, DriveSpec};
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

/// Drives `spec` with libblkio over `queues` queues of `kind`; latency percentiles over all
/// queues, IOPS summed.
pub(crate) fn drive(sock: &Path, spec: &DriveSpec, kind: QueueKind, queues: usize) -> FioResult {
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap_or_else(|e| fail("new", e));
    b.set_str("path", &sock.display().to_string())
        .unwrap_or_else(|e| fail("path", e));
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
    let mut qs = match kind {
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
    let base = region.addr;
    let runs: Vec<QueueRun> = std::thread::scope(|s| {
        let handles: Vec<_> = qs
            .iter_mut()
            .enumerate()
            .map(|(i, q)| {
                let buf = base + i * per_queue;
                s.spawn(move || run_queue(q, buf, capacity, spec, i as u64))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(qs);
    drop(b);
    summarize(runs)
}

/// One queue's loop, like one fio job.
fn run_queue(q: &mut Blkioq, buf: usize, capacity: u64, spec: &DriveSpec, seed: u64) -> QueueRun {
    let bs = spec.bs as usize;
    let blocks = capacity / spec.bs as u64;
    let mut rng = 0x2545_f491_4f6c_dd1d ^ (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut seq = seed * (blocks / 8);
    let mut next_offset = || {
        if spec.sequential {
            seq = (seq + 1) % blocks;
            return seq * spec.bs as u64;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % blocks) * spec.bs as u64
    };
    let submit = |q: &mut Blkioq, slot: usize, offset: u64| {
        let addr = buf + slot * bs;
        if spec.write {
            q.write(offset, addr as *const u8, bs, slot, ReqFlags::empty());
        } else {
            q.read(offset, addr as *mut u8, bs, slot, ReqFlags::empty());
        }
    };
    let qd = usize::from(spec.qd);
    let mut started = vec![Instant::now(); qd];
    // Free slots, the next to use last.
    let mut free: Vec<usize> = (0..qd).rev().collect();
    let interval = spec.rate_iops.map(|r| Duration::from_secs_f64(1.0 / r));
    let t0 = Instant::now();
    let mut issued: u64 = 0;
    let mut comps: Vec<MaybeUninit<Completion>> = (0..qd).map(|_| MaybeUninit::uninit()).collect();
    let ramp_end = t0 + spec.ramp;
    let mut measure_start = None;
    let mut lat_ns = Vec::with_capacity(1 << 20);
    let mut in_flight = 0;
    loop {
        let now = Instant::now();
        match measure_start {
            Some(t) if now - t >= spec.runtime => break,
            None if now >= ramp_end => measure_start = Some(now),
            _ => {}
        }
        // Issue into the free slots what is due: everything without a rate; with one,
        // request k at t0 + k / rate, as fio's linear rate process schedules them.
        let mut not_due = None;
        while let Some(&slot) = free.last() {
            let now = Instant::now();
            if let Some(iv) = interval {
                let due = t0 + iv.mul_f64(issued as f64);
                if now < due {
                    not_due = Some(due);
                    break;
                }
            }
            free.pop();
            started[slot] = now;
            submit(q, slot, next_offset());
            in_flight += 1;
            issued += 1;
        }
        // Ahead of the rate, fio finishes what is in flight, one completion at a time,
        // and then sleeps until the next request is due (io_u_quiesce, usec_sleep): so
        // does this (and issues again as soon as a request is due).
        let min = match not_due {
            Some(due) if in_flight == 0 => {
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                continue;
            }
            _ => 1,
        };
        let n = q
            .do_io(&mut comps, min, None, None)
            .unwrap_or_else(|e| fail("do_io", e));
        let now = Instant::now();
        for c in &comps[..n] {
            // SAFETY: do_io initialised the first `n` completions.
            let c = unsafe { c.assume_init_read() };
            assert_eq!(c.ret, 0, "a request failed: {}", c.ret);
            let slot = c.user_data;
            if measure_start.is_some() {
                lat_ns.push((now - started[slot]).as_nanos() as u64);
            }
            think(spec.think, spec.think_spin);
            free.push(slot);
        }
        in_flight -= n;
    }
    let measured = measure_start.map_or(Duration::ZERO, |t| t.elapsed());
    // Let what is in flight finish before the buffers go.
    while in_flight > 0 {
        let n = q
            .do_io(&mut comps, in_flight, None, None)
            .unwrap_or_else(|e| fail("do_io", e));
        in_flight -= n;
    }
    QueueRun { lat_ns, measured }
}

fn summarize(runs: Vec<QueueRun>) -> FioResult {
    let iops: f64 = runs
        .iter()
        .map(|r| r.lat_ns.len() as f64 / r.measured.as_secs_f64().max(1e-9))
        .sum();
    let mut lat: Vec<u64> = runs.into_iter().flat_map(|r| r.lat_ns).collect();
    lat.sort_unstable();
    let n = lat.len();
    let pct = |p: f64| {
        if n == 0 {
            0.0
        } else {
            lat[((n as f64 * p) as usize).min(n - 1)] as f64 / 1000.0
        }
    };
    FioResult {
        iops,
        mean_us: if n == 0 {
            0.0
        } else {
            lat.iter().sum::<u64>() as f64 / n as f64 / 1000.0
        },
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        total_ios: n as u64,
    }
}
