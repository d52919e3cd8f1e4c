//! What a vhost-user-blk client drives (like one fio job), fio's think time, and the
//! fio-like figures a client reports.

use std::time::{Duration, Instant};

use crate::peers::FioResult;

/// What the frontend drives: like one fio job.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DriveSpec {
    pub write: bool,
    pub sequential: bool,
    /// Request size in bytes (a multiple of 512, at most 64 KiB).
    pub bs: u32,
    pub qd: u16,
    pub ramp: Duration,
    pub runtime: Duration,
    /// Time between a completion and the next request in its slot (fio's `thinktime`).
    pub think: Duration,
    /// Spin through the think time (fio's `thinktime_spin` equal to it) instead of
    /// sleeping (fio's default).
    pub think_spin: bool,
    /// Offered load (fio's `rate_iops`), libblkio clients only; None: as fast as it goes.
    pub rate_iops: Option<f64>,
}

/// Thinks for `d`, as fio does: a sleep (which lasts longer than asked: a wake-up), or a
/// spin with `spin`.
pub(crate) fn think(d: Duration, spin: bool) {
    if d.is_zero() {
        return;
    }
    if !spin {
        std::thread::sleep(d);
        return;
    }
    let end = Instant::now() + d;
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

/// fio-like figures of a run: `iops`, and the mean and percentiles of the latencies (ns)
/// measured.
pub(crate) fn figures(iops: f64, mut lat_ns: Vec<u64>) -> FioResult {
    lat_ns.sort_unstable();
    let n = lat_ns.len();
    let pct = |p: f64| {
        if n == 0 {
            0.0
        } else {
            lat_ns[((n as f64 * p) as usize).min(n - 1)] as f64 / 1000.0
        }
    };
    FioResult {
        iops,
        mean_us: if n == 0 {
            0.0
        } else {
            lat_ns.iter().sum::<u64>() as f64 / n as f64 / 1000.0
        },
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        total_ios: n as u64,
    }
}
