//! Per-context statistics, written by the owning thread and readable from any thread.
//!
//! Counters are relaxed atomics: a reader sees each value exactly, but two values read one
//! after the other may belong to slightly different moments. That is enough for
//! `query-iothreads` and for benchmarks, which look at deltas over seconds.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// A histogram with power-of-two buckets: bucket 0 counts the value 0, bucket `i > 0`
/// counts values in `[2^(i-1), 2^i)`; the last bucket takes everything larger.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; Histogram::BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Histogram {
    /// Number of buckets.
    pub const BUCKETS: usize = 24;

    /// Bucket index of `v`.
    pub fn bucket_of(v: u64) -> usize {
        if v == 0 {
            0
        } else {
            ((64 - v.leading_zeros()) as usize).min(Self::BUCKETS - 1)
        }
    }

    /// Lowest value that falls in bucket `i`.
    pub fn bucket_floor(i: usize) -> u64 {
        if i == 0 {
            0
        } else {
            1 << (i - 1)
        }
    }

    /// Counts one value.
    pub fn record(&self, v: u64) {
        self.buckets[Self::bucket_of(v)].fetch_add(1, Relaxed);
    }

    /// The counts, bucket by bucket.
    pub fn snapshot(&self) -> Vec<u64> {
        self.buckets.iter().map(|b| b.load(Relaxed)).collect()
    }
}

/// A counter that a user of the loop keeps in the loop's statistics (a virtqueue's kicks,
/// say), so it shows beside the loop's own figures. Only the loop's thread adds to it (so
/// adding is a plain load and store, no locked instruction); any thread may read it.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n` (from the owning loop's thread only).
    pub fn add(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(n), Relaxed);
    }

    /// The value now.
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// Named counters and histograms registered by the loop's users.
#[derive(Debug, Default)]
pub(crate) struct UserStats {
    pub(crate) counters: Vec<(String, Arc<Counter>)>,
    pub(crate) histograms: Vec<(String, Arc<Histogram>)>,
}

/// Live counters of one `AioContext`.
#[derive(Debug, Default)]
pub struct AioStats {
    pub(crate) iterations: AtomicU64,
    pub(crate) polls_attempted: AtomicU64,
    pub(crate) poll_hits: AtomicU64,
    pub(crate) poll_misses: AtomicU64,
    pub(crate) poll_ns: AtomicU64,
    pub(crate) blocked_ns: AtomicU64,
    pub(crate) blocking_waits: AtomicU64,
    pub(crate) eventfd_wakeups: AtomicU64,
    pub(crate) eventfd_writes: AtomicU64,
    pub(crate) eventfd_writes_avoided: AtomicU64,
    pub(crate) completions: AtomicU64,
    pub(crate) ring_enters: AtomicU64,
    pub(crate) completions_per_iteration: Histogram,
    pub(crate) windows: Mutex<Vec<HandlerWindow>>,
    pub(crate) window_ns: AtomicU64,
    pub(crate) user: Mutex<UserStats>,
}

/// The polling window currently assigned to one poll handler (or to the whole context).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerWindow {
    /// The handler's name; `"(context)"` for a policy's context-wide window.
    pub name: String,
    /// Window in nanoseconds.
    pub ns: u64,
}

/// A copy of a context's counters at one moment.
#[derive(Debug, Clone, Default)]
pub struct StatsSnapshot {
    /// Loop iterations (`run_once` calls).
    pub iterations: u64,
    /// Iterations that entered busy polling.
    pub polls_attempted: u64,
    /// Busy-polling rounds that found a ready handler before the window ran out.
    pub poll_hits: u64,
    /// Busy-polling rounds that ran out of window and went on to block.
    pub poll_misses: u64,
    /// Time spent spinning on poll handlers (excludes `ready()` dispatch).
    pub poll_ns: u64,
    /// Time spent inside the reactor's blocking wait.
    pub blocked_ns: u64,
    /// Number of blocking waits.
    pub blocking_waits: u64,
    /// Wakeups that came through the notifier eventfd.
    pub eventfd_wakeups: u64,
    /// Eventfd writes done by `Remote` notifications (the loop might have been asleep).
    pub eventfd_writes: u64,
    /// Notifications that skipped the eventfd write because the loop was awake or polling.
    pub eventfd_writes_avoided: u64,
    /// Completions (CQEs or ready events) reaped in total.
    pub completions: u64,
    /// io_uring_enter system calls (submitting, waiting, or both at once).
    pub ring_enters: u64,
    /// Histogram of completions reaped per iteration (power-of-two buckets, see [`Histogram`]).
    pub completions_per_iteration: Vec<u64>,
    /// Current polling window per handler.
    pub windows: Vec<HandlerWindow>,
    /// The window the loop polls for before blocking (max over handlers).
    pub window_ns: u64,
    /// The users' counters, by name (see [`Counter`]).
    pub counters: Vec<(String, u64)>,
    /// The users' histograms, by name (power-of-two buckets).
    pub histograms: Vec<(String, Vec<u64>)>,
}

impl AioStats {
    /// Copies all counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            iterations: self.iterations.load(Relaxed),
            polls_attempted: self.polls_attempted.load(Relaxed),
            poll_hits: self.poll_hits.load(Relaxed),
            poll_misses: self.poll_misses.load(Relaxed),
            poll_ns: self.poll_ns.load(Relaxed),
            blocked_ns: self.blocked_ns.load(Relaxed),
            blocking_waits: self.blocking_waits.load(Relaxed),
            eventfd_wakeups: self.eventfd_wakeups.load(Relaxed),
            eventfd_writes: self.eventfd_writes.load(Relaxed),
            eventfd_writes_avoided: self.eventfd_writes_avoided.load(Relaxed),
            completions: self.completions.load(Relaxed),
            ring_enters: self.ring_enters.load(Relaxed),
            completions_per_iteration: self.completions_per_iteration.snapshot(),
            windows: self
                .windows
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            window_ns: self.window_ns.load(Relaxed),
            counters: {
                let u = self.user.lock().unwrap_or_else(|e| e.into_inner());
                u.counters
                    .iter()
                    .map(|(n, c)| (n.clone(), c.get()))
                    .collect()
            },
            histograms: {
                let u = self.user.lock().unwrap_or_else(|e| e.into_inner());
                u.histograms
                    .iter()
                    .map(|(n, h)| (n.clone(), h.snapshot()))
                    .collect()
            },
        }
    }

    /// The counter named `name`, created at zero on first use.
    pub(crate) fn counter(&self, name: &str) -> Arc<Counter> {
        let mut u = self.user.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, c)) = u.counters.iter().find(|(n, _)| n == name) {
            return c.clone();
        }
        let c = Arc::new(Counter::default());
        u.counters.push((name.to_string(), c.clone()));
        c
    }

    /// The histogram named `name`, created empty on first use.
    pub(crate) fn histogram(&self, name: &str) -> Arc<Histogram> {
        let mut u = self.user.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, h)) = u.histograms.iter().find(|(n, _)| n == name) {
            return h.clone();
        }
        let h = Arc::new(Histogram::default());
        u.histograms.push((name.to_string(), h.clone()));
        h
    }

    pub(crate) fn add(counter: &AtomicU64, v: u64) {
        // Only the owning thread writes, so load+store would do; fetch_add keeps it simple.
        counter.fetch_add(v, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_powers_of_two() {
        assert_eq!(Histogram::bucket_of(0), 0);
        assert_eq!(Histogram::bucket_of(1), 1);
        assert_eq!(Histogram::bucket_of(2), 2);
        assert_eq!(Histogram::bucket_of(3), 2);
        assert_eq!(Histogram::bucket_of(4), 3);
        assert_eq!(Histogram::bucket_of(u64::MAX), Histogram::BUCKETS - 1);
        assert_eq!(Histogram::bucket_floor(3), 4);
        let h = Histogram::default();
        h.record(0);
        h.record(5);
        h.record(7);
        let s = h.snapshot();
        assert_eq!(s[0], 1);
        assert_eq!(s[3], 2);
    }

    #[test]
    fn user_counters_are_shared_by_name_and_snapshotted() {
        let st = AioStats::default();
        let a = st.counter("queue.kicks");
        let b = st.counter("queue.kicks");
        a.add(2);
        b.add(3);
        st.histogram("queue.lat").record(5);
        let s = st.snapshot();
        assert_eq!(s.counters, vec![("queue.kicks".to_string(), 5)]);
        assert_eq!(s.histograms[0].1[3], 1);
    }
}
