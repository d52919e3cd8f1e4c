//! A job's speed limit (`speed`, `block-job-set-speed`), counted as QEMU counts it.

use std::time::{Duration, Instant};

/// The length of a rate limit slice (QEMU's BLOCK_JOB_SLICE_TIME).
const SLICE: Duration = Duration::from_millis(100);

/// A rate limit in QEMU's manner (util/ratelimit.h): a quota of bytes per slice; bytes
/// beyond it push the end of the slice out, and the job sleeps until then.
#[derive(Clone, Copy)]
pub(super) struct RateLimit {
    quota: u64,
    start: Instant,
    end: Instant,
    dispatched: u64,
}

impl RateLimit {
    pub(super) fn new(speed: u64) -> Self {
        let now = Instant::now();
        let quota = if speed == 0 {
            0
        } else {
            ((speed as f64 * SLICE.as_secs_f64()) as u64).max(1)
        };
        RateLimit {
            quota,
            start: now,
            end: now,
            dispatched: 0,
        }
    }

    /// Counts `n` bytes; how long to wait before the next step.
    pub(super) fn delay(&mut self, n: u64) -> Duration {
        if self.quota == 0 {
            return Duration::ZERO;
        }
        let now = Instant::now();
        if self.end < now {
            self.start = now;
            self.end = now + SLICE;
            self.dispatched = 0;
        }
        self.dispatched += n;
        if self.dispatched < self.quota {
            return Duration::ZERO;
        }
        let slices = self.dispatched as f64 / self.quota as f64;
        self.end = self.start + SLICE.mul_f64(slices);
        self.end.saturating_duration_since(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_limit_holds_a_slice_quota_and_pushes_the_slice_out() {
        let mut l = RateLimit::new(10 << 20);
        // 1 MiB per 100 ms slice: under it no wait, past it about the excess.
        assert_eq!(l.delay(512 << 10), Duration::ZERO);
        let d = l.delay(1536 << 10);
        assert!(
            d > Duration::from_millis(150) && d <= Duration::from_millis(200),
            "{d:?}"
        );
        assert_eq!(RateLimit::new(0).delay(u64::MAX / 2), Duration::ZERO);
    }
}
