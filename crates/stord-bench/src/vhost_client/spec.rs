//! What a vhost-user-blk client drives (like one fio job), and fio's think time.

use std::time::{Duration, Instant};

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
