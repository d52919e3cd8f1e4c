//! `adaptive` (the default): QEMU's per-handler windows, used only while polling pays.
//!
//! Polling trades the loop's time for latency: a wait that polling catches is spared the
//! wake-up a sleep costs, and every nanosecond spun is spent whether or not it catches
//! anything. What a wake-up costs depends on the machine and on everything else that runs
//! (on a virtual machine whose idle vCPU halts, a sleeping loop also slows the device's
//! and the client's own work, and with few CPUs a spinning loop slows them too), so the
//! policy measures instead of assuming. It alternates two states:
//!
//! - resting: no polling; the loop's wait per event (per completion or ready handler) is
//!   the baseline;
//! - polling: classic's per-handler windows (QEMU's `adjust_polling_time`; the ring's
//!   peers and its storage completions are separate handlers) for an epoch of
//!   [`EPOCH`] iterations, which pays when its events waited less than the baseline by
//!   at least the time it spun.
//!
//! An epoch that pays is followed by another (every [`REFRESH`] epochs a short rest takes
//! the baseline again, as the workload may have changed); one that does not starts a rest
//! that doubles with every failed try up to [`MAX_REST`] iterations. On this machine's
//! disk the device's wait is long against a wake-up and polling rests; on a fast device,
//! or with many requests in flight, it keeps polling.

use super::classic::Classic;
use super::{HandlerId, Observation, PolicyKind, PollParams, PollPolicy};

/// Iterations with events in one epoch of polling.
pub const EPOCH: u32 = 64;
/// Iterations with events that make a baseline (the first rest and every refresh).
pub const BASELINE: u32 = 64;
/// The rest after the first epoch that did not pay.
pub const FIRST_REST: u32 = 256;
/// The longest rest, in iterations with events.
pub const MAX_REST: u32 = 1 << 18;
/// Paying epochs between two refreshes of the baseline.
pub const REFRESH: u32 = 64;

/// What the policy is doing and what it has measured.
#[derive(Debug, Clone, Default)]
struct Ledger {
    polling: bool,
    /// Resting: iterations with events still to rest, and the baseline's sums.
    rest: u32,
    rest_waited: u64,
    rest_events: u64,
    /// The rest after the next failed epoch.
    next_rest: u32,
    /// Polling: this epoch's iterations with events, their waits, events and spin.
    iterations: u32,
    waited: u64,
    events: u64,
    spent: u64,
    /// Paying epochs since the last baseline.
    paid: u32,
}

impl Ledger {
    fn new() -> Self {
        Self {
            rest: BASELINE,
            next_rest: FIRST_REST,
            ..Self::default()
        }
    }

    /// Time this epoch's polling saved against the baseline (negative: it cost time).
    fn saved(&self) -> i128 {
        let baseline = i128::from(self.rest_waited) * i128::from(self.events)
            / i128::from(self.rest_events.max(1));
        baseline - i128::from(self.waited)
    }

    /// Starts a rest of `iterations`, with a fresh baseline.
    fn rest(&mut self, iterations: u32) {
        *self = Self {
            rest: iterations,
            next_rest: self.next_rest,
            ..Self::default()
        };
    }

    /// One iteration whose `events` waited `block_ns` in all, `spun_ns` of it polling.
    fn record(&mut self, block_ns: u64, events: u64, spun_ns: u64) {
        if !self.polling {
            self.rest_waited = self.rest_waited.saturating_add(block_ns);
            self.rest_events += events;
            self.rest -= 1;
            if self.rest == 0 {
                self.polling = true;
            }
            return;
        }
        self.iterations += 1;
        self.waited = self.waited.saturating_add(block_ns);
        self.events += events;
        self.spent = self.spent.saturating_add(spun_ns);
        if self.iterations >= EPOCH {
            self.settle();
        }
    }

    /// Closes an epoch of polling.
    fn settle(&mut self) {
        if self.saved() >= i128::from(self.spent) {
            self.next_rest = FIRST_REST;
            self.paid += 1;
            if self.paid >= REFRESH {
                self.rest(BASELINE);
            } else {
                self.iterations = 0;
                self.waited = 0;
                self.events = 0;
                self.spent = 0;
            }
        } else {
            let rest = self.next_rest;
            self.next_rest = rest.saturating_mul(2).min(MAX_REST);
            self.rest(rest);
        }
    }
}

/// Classic's windows behind a ledger that says whether to use them.
#[derive(Debug)]
pub struct Adaptive {
    windows: Classic,
    ledger: Ledger,
}

impl Adaptive {
    /// A policy that first rests to take its baseline.
    pub fn new(params: &PollParams) -> Self {
        Self {
            windows: Classic::new(params),
            ledger: Ledger::new(),
        }
    }
}

impl PollPolicy for Adaptive {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Adaptive
    }
    fn set_params(&mut self, params: &PollParams) {
        self.windows.set_params(params);
        self.ledger = Ledger::new();
    }
    fn add_handler(&mut self, id: HandlerId) {
        self.windows.add_handler(id);
    }
    fn remove_handler(&mut self, id: HandlerId) {
        self.windows.remove_handler(id);
    }
    fn window_ns(&self) -> u64 {
        if self.ledger.polling {
            self.windows.window_ns()
        } else {
            0
        }
    }
    fn window_ns_without(&self, quiet: HandlerId) -> u64 {
        if self.ledger.polling {
            self.windows.window_ns_without(quiet)
        } else {
            0
        }
    }
    fn adjust(&mut self, obs: &Observation<'_>) {
        // A timeout brought nothing to weigh; nor does polling with no window grown yet.
        let idle_epoch = self.ledger.polling && self.windows.window_ns() == 0;
        if !obs.events.is_empty() && !idle_epoch {
            self.ledger
                .record(obs.block_ns, obs.work.max(1), obs.polled_ns);
        }
        self.windows.adjust(obs);
    }
    fn windows(&self, out: &mut Vec<(Option<HandlerId>, u64)>) {
        out.push((None, self.window_ns()));
        self.windows.windows(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a sleep adds to a wait in these simulations.
    const WAKE: u64 = 10_000;

    struct Loop {
        p: Adaptive,
        polled: u64,
        iterations: u64,
    }

    impl Loop {
        fn new() -> Self {
            let mut p = Adaptive::new(&PollParams::default());
            p.add_handler(0);
            p.add_handler(1);
            Self {
                p,
                polled: 0,
                iterations: 0,
            }
        }

        fn wait(&mut self, id: HandlerId, wait: u64) {
            self.wait_quiet(id, wait, None)
        }

        /// One iteration in which `id`'s event comes `wait` ns after the loop starts
        /// waiting, as the loop would see it with its current window, with handler `quiet`
        /// left out of the window (nothing of it owed).
        fn wait_quiet(&mut self, id: HandlerId, wait: u64, quiet: Option<HandlerId>) {
            let window = match quiet {
                None => self.p.window_ns(),
                Some(q) => self.p.window_ns_without(q),
            };
            let (polled_ns, poll_hit, block_ns) = if window == 0 {
                (0, false, wait + WAKE)
            } else if wait <= window {
                (wait, true, wait)
            } else {
                (window, false, wait + WAKE)
            };
            self.iterations += 1;
            if polled_ns > 0 {
                self.polled += 1;
            }
            self.p.adjust(&Observation {
                block_ns,
                slept_ns: (!poll_hit).then_some(block_ns - polled_ns),
                events: &[id],
                polled_ns,
                work: 1,
            });
        }

        /// The share of iterations since the last call that polled.
        fn polled_share(&mut self) -> f64 {
            let share = self.polled as f64 / self.iterations.max(1) as f64;
            self.polled = 0;
            self.iterations = 0;
            share
        }
    }

    #[test]
    fn short_waits_keep_polling() {
        let mut l = Loop::new();
        for _ in 0..100_000 {
            l.wait(0, 3_000);
        }
        l.polled_share();
        for _ in 0..100_000 {
            l.wait(0, 3_000);
        }
        // Only the baseline refreshes (64 of every 64 * 64 + 64) do not poll.
        assert!(l.polled_share() > 0.97);
    }

    #[test]
    fn waits_longer_than_a_wake_up_stop_polling() {
        let mut l = Loop::new();
        // A 40 µs device wait: classic would poll it (under 64 µs) and catch it, spinning
        // 40 µs to save a 10 µs wake-up.
        for _ in 0..100_000 {
            l.wait(0, 40_000);
        }
        l.polled_share();
        for _ in 0..100_000 {
            l.wait(0, 40_000);
        }
        assert!(l.polled_share() < 0.01);
    }

    #[test]
    fn qd1_on_a_fast_device_keeps_polling() {
        let mut l = Loop::new();
        // NBD at QD1: the client's next request after a 5 µs turnaround (0), the device's
        // completion 9 µs after the read is submitted (1), the reply's send completion at
        // once (0). The device is quiet while the client thinks.
        for _ in 0..50_000 {
            l.wait_quiet(0, 5_000, Some(1));
            l.wait(1, 9_000);
            l.wait_quiet(0, 500, Some(1));
        }
        assert!(l.polled_share() > 0.9);
    }

    #[test]
    fn qd1_on_a_slow_device_stops_polling() {
        let mut l = Loop::new();
        // The same with a 60 µs device wait: the device window resets (classic) but the
        // client's window spins through every device wait before the loop sleeps.
        for _ in 0..50_000 {
            l.wait_quiet(0, 30_000, Some(1));
            l.wait(1, 200_000);
            l.wait_quiet(0, 500, Some(1));
        }
        l.polled_share();
        for _ in 0..50_000 {
            l.wait_quiet(0, 30_000, Some(1));
            l.wait(1, 200_000);
            l.wait_quiet(0, 500, Some(1));
        }
        assert!(l.polled_share() < 0.05);
    }

    #[test]
    fn a_resting_loop_probes_again_and_polls_once_it_pays() {
        let mut l = Loop::new();
        for _ in 0..10_000 {
            l.wait(0, 40_000);
        }
        // The device got fast: the next probe finds polling pays, and it stays.
        for _ in 0..(MAX_REST as usize) {
            l.wait(0, 2_000);
        }
        l.polled_share();
        for _ in 0..10_000 {
            l.wait(0, 2_000);
        }
        assert!(l.polled_share() > 0.9);
    }

    #[test]
    fn max_zero_disables() {
        let mut p = Adaptive::new(&PollParams {
            max_ns: 0,
            ..PollParams::default()
        });
        p.add_handler(0);
        for _ in 0..1000 {
            p.adjust(&Observation {
                block_ns: 1000,
                slept_ns: Some(1000),
                events: &[0],
                polled_ns: 0,
                work: 1,
            });
        }
        assert_eq!(p.window_ns(), 0);
    }
}
