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
//!   at least the time it spun (latency bought at no more than its price), or when the
//!   epochs since the rest served requests faster than resting did, by [`FASTER`] or more,
//!   for no more of the thread's CPU time per request than the rate they gained.
//!
//! The second test is for a loop that is the bottleneck: with many requests in flight on a
//! fast device a sleep costs the loop a wake-up per batch, and polling that only shaves
//! each wait by less than it spins still gets more requests through per second. Where a
//! client sets the pace (a rate-limited load, a slow client) polling cannot raise the
//! rate, so only the first test can make it poll; and a gain that costs more CPU per
//! request than it adds in rate (spinning through a whole slow device's wait at QD1) does
//! not pay either. Requests are counted as completed operations (storage and peer I/O),
//! not as ready handlers, which take one request or a batch depending on how long the
//! loop slept; CPU time is the thread's own clock, read only at the ends of a rest or an
//! epoch, so a sleep's kernel path counts against resting as it should.
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
/// How much faster than resting (requests served per second) polling must go to pay on
/// its rate: 1/8, above the spread of a steady load over a few epochs.
pub const FASTER: (u128, u128) = (9, 8);
/// Requests per iteration a rest must have served for the rate test to apply: a loop that
/// woke to one request at a time is not the bottleneck, whatever the rates say (on this
/// machine's disk at QD1, rests interleaved with polling ran slower than a loop that
/// only rests, and the rate test polled for less throughput at 1.4 times the CPU).
pub const BATCHED: (u128, u128) = (3, 2);
/// Requests the polling and its baseline must each have served for their rates to be
/// weighed.
pub const MIN_SERVED: u64 = EPOCH as u64;
/// The first epochs after a rest, which go on while their rate is not below the baseline's
/// (an epoch serves a hundred requests or so, too few to show a gain of [`FASTER`] on its
/// own): from then on the rate is weighed over all the epochs since the rest.
pub const TRIAL: u32 = 4;

/// What the policy is doing and what it has measured.
#[derive(Debug, Clone, Default)]
struct Ledger {
    polling: bool,
    /// Resting: iterations with events still to rest, and the baseline's sums.
    rest: u32,
    rest_waited: u64,
    rest_events: u64,
    /// Resting: the time its iterations took, the requests they served and the thread's
    /// CPU time they cost (known once the rest is over).
    rest_elapsed: u64,
    rest_served: u64,
    rest_cpu: Option<u64>,
    /// Resting: its iterations with events.
    rest_iterations: u64,
    /// The rest after the next failed epoch.
    next_rest: u32,
    /// Polling: this epoch's iterations with events, their waits, events and spin.
    iterations: u32,
    waited: u64,
    events: u64,
    spent: u64,
    /// Polling: this epoch's time and requests served.
    elapsed: u64,
    served: u64,
    /// Polling: the epochs since the rest, with their time, requests and CPU time (None
    /// once a reading was missed).
    streak: u32,
    streak_elapsed: u64,
    streak_served: u64,
    streak_cpu: Option<u64>,
    /// The thread's CPU time when the current rest or epoch began.
    mark: Option<u64>,
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

    /// Whether the epochs since the rest served requests faster than the baseline by
    /// `margin` (numerator, denominator), for no more CPU time per request than the
    /// baseline's times the rate they gained.
    fn rate_pays(&self, margin: (u128, u128)) -> bool {
        let (Some(cpu), Some(rest_cpu)) = (self.streak_cpu, self.rest_cpu) else {
            return false;
        };
        if self.streak_served < MIN_SERVED || self.rest_served < MIN_SERVED {
            return false;
        }
        // Only a loop that woke to batches (several requests in flight) can be the
        // bottleneck; with one at a time the latency test has already weighed it.
        let (b_num, b_den) = BATCHED;
        if u128::from(self.rest_served) * b_den < u128::from(self.rest_iterations) * b_num {
            return false;
        }
        let (served, elapsed) = (
            u128::from(self.streak_served),
            u128::from(self.streak_elapsed),
        );
        let (rest_served, rest_elapsed) =
            (u128::from(self.rest_served), u128::from(self.rest_elapsed));
        let (num, den) = margin;
        let faster = served.saturating_mul(rest_elapsed).saturating_mul(den)
            >= rest_served.saturating_mul(elapsed).saturating_mul(num);
        // cpu / served <= (served / elapsed) / (rest_served / rest_elapsed)
        //                 * rest_cpu / rest_served
        // (A rest or streak over a long idle gap could overflow: then it does not pay.)
        let cost = [elapsed, rest_served, rest_served]
            .iter()
            .try_fold(u128::from(cpu), |a, b| a.checked_mul(*b));
        let gain = [served, rest_elapsed, u128::from(rest_cpu)]
            .iter()
            .try_fold(served, |a, b| a.checked_mul(*b));
        let worth_it = matches!((cost, gain), (Some(c), Some(g)) if c <= g);
        faster && worth_it
    }

    /// Whether the next iteration may end a rest or an epoch: then it weighs CPU time.
    fn wants_cpu_ns(&self) -> bool {
        self.mark.is_none()
            || (!self.polling && self.rest <= 1)
            || (self.polling && self.iterations + 1 >= EPOCH)
    }

    /// One iteration's length (the previous one's: see `Observation::elapsed_ns`) and the
    /// requests it served, whether or not it had events.
    fn pace(&mut self, elapsed_ns: u64, served: u64) {
        if self.polling {
            self.elapsed = self.elapsed.saturating_add(elapsed_ns);
            self.served += served;
        } else {
            self.rest_elapsed = self.rest_elapsed.saturating_add(elapsed_ns);
            self.rest_served += served;
        }
    }

    /// The CPU time since the mark, and a new mark at `cpu_ns`.
    fn lap(&mut self, cpu_ns: Option<u64>) -> Option<u64> {
        let since = match (self.mark, cpu_ns) {
            (Some(m), Some(c)) => Some(c.saturating_sub(m)),
            _ => None,
        };
        self.mark = cpu_ns;
        since
    }

    /// Starts a rest of `iterations`, with a fresh baseline.
    fn rest(&mut self, iterations: u32) {
        *self = Self {
            rest: iterations,
            next_rest: self.next_rest,
            mark: self.mark,
            ..Self::default()
        };
    }

    /// One iteration whose `events` waited `block_ns` in all, `spun_ns` of it polling;
    /// `cpu_ns` is the thread's CPU time at its end, if it was read.
    fn record(&mut self, block_ns: u64, events: u64, spun_ns: u64, cpu_ns: Option<u64>) {
        if !self.polling {
            self.rest_waited = self.rest_waited.saturating_add(block_ns);
            self.rest_events += events;
            self.rest_iterations += 1;
            self.rest -= 1;
            if self.rest == 0 {
                self.rest_cpu = self.lap(cpu_ns);
                self.polling = true;
            }
            return;
        }
        self.iterations += 1;
        self.waited = self.waited.saturating_add(block_ns);
        self.events += events;
        self.spent = self.spent.saturating_add(spun_ns);
        if self.iterations >= EPOCH {
            let cpu = self.lap(cpu_ns);
            self.settle(cpu);
        }
    }

    /// Closes an epoch of polling that cost `cpu`.
    fn settle(&mut self, cpu: Option<u64>) {
        self.streak += 1;
        self.streak_elapsed = self.streak_elapsed.saturating_add(self.elapsed);
        self.streak_served += self.served;
        self.streak_cpu = match (self.streak, self.streak_cpu, cpu) {
            (1, _, c) => c,
            (_, Some(s), Some(c)) => Some(s.saturating_add(c)),
            _ => None,
        };
        let pays = self.saved() >= i128::from(self.spent)
            || self.rate_pays(FASTER)
            || (self.streak < TRIAL && self.rate_pays((1, 1)));
        if pays {
            self.next_rest = FIRST_REST;
            self.paid += 1;
            if self.paid >= REFRESH {
                self.rest(BASELINE);
            } else {
                self.iterations = 0;
                self.waited = 0;
                self.events = 0;
                self.spent = 0;
                self.elapsed = 0;
                self.served = 0;
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
    fn wants_cpu_ns(&self) -> bool {
        self.ledger.wants_cpu_ns()
    }
    fn adjust(&mut self, obs: &Observation<'_>) {
        // A timeout brought nothing to weigh; nor does polling with no window grown yet.
        let idle_epoch = self.ledger.polling && self.windows.window_ns() == 0;
        if !idle_epoch {
            self.ledger.pace(obs.elapsed_ns, obs.served);
        }
        if self.ledger.mark.is_none() {
            self.ledger.mark = obs.cpu_ns;
        }
        if !obs.events.is_empty() && !idle_epoch {
            self.ledger
                .record(obs.block_ns, obs.work.max(1), obs.polled_ns, obs.cpu_ns);
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
    /// What serving an event takes, in the simulated loops that wait for their own
    /// requests (a client that sends the next when the last is answered).
    const SERVICE: u64 = 2_000;
    /// The CPU time a sleep and its wake-up cost the loop (the kernel's path).
    const WAKE_CPU: u64 = 5_000;

    struct Loop {
        p: Adaptive,
        polled: u64,
        iterations: u64,
        /// The loop's CPU time so far.
        cpu: u64,
    }

    impl Loop {
        fn new() -> Self {
            Self {
                p: new_policy(),
                polled: 0,
                iterations: 0,
                cpu: 0,
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
            self.cpu += polled_ns + SERVICE + if poll_hit { 0 } else { WAKE_CPU };
            self.p.adjust(&Observation {
                block_ns,
                slept_ns: (!poll_hit).then_some(block_ns - polled_ns),
                events: &[id],
                polled_ns,
                work: 1,
                served: 1,
                elapsed_ns: block_ns + SERVICE,
                cpu_ns: Some(self.cpu),
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

    /// A loop that is the bottleneck (many requests in flight on a fast device): polling
    /// catches the next completion after `spin` and serves it in `serve`; a sleep wakes
    /// WAKE after a completion to a batch of `batch`, and after a wake-up the loop spends
    /// `cold` more (the kernel's way back and cold caches).
    struct Bottleneck {
        p: Adaptive,
        spin: u64,
        serve: u64,
        batch: u64,
        cold: u64,
        cpu: u64,
    }

    impl Bottleneck {
        fn new(spin: u64, serve: u64, batch: u64, cold: u64) -> Self {
            Self {
                p: new_policy(),
                spin,
                serve,
                batch,
                cold,
                cpu: 0,
            }
        }

        /// One iteration; whether it polled.
        fn step(&mut self) -> bool {
            let window = self.p.window_ns();
            let polled = window >= self.spin;
            let (block, slept, spun, served, busy) = if polled {
                (self.spin, None, self.spin, 1, self.spin + self.serve)
            } else {
                let block = 2_000 + WAKE;
                let busy = window + self.batch * self.serve + self.cold;
                (block, Some(block - window), window, self.batch, busy)
            };
            self.cpu += busy;
            self.p.adjust(&Observation {
                block_ns: block,
                slept_ns: slept,
                events: &[1],
                polled_ns: spun,
                work: served,
                served,
                elapsed_ns: block + busy - spun,
                cpu_ns: Some(self.cpu),
            });
            polled
        }

        /// Iterations that polled, of the second `n` of `2 * n`.
        fn polled(&mut self, n: usize) -> usize {
            for _ in 0..n {
                self.step();
            }
            (0..n).filter(|_| self.step()).count()
        }
    }

    fn new_policy() -> Adaptive {
        let mut p = Adaptive::new(&PollParams::default());
        p.add_handler(0);
        p.add_handler(1);
        p
    }

    #[test]
    fn a_loop_that_is_the_bottleneck_polls_when_it_serves_faster() {
        // Asleep, the loop gets a batch of 8 completions 12 µs after it waits and serves
        // them in 32 µs: 5.5 µs and 4 µs of CPU a request. Polling catches each after
        // 1 µs: 4 µs a request, all of it CPU, at 1.4 times the rate. Per event the wait
        // only drops from 1.5 to 1 µs, less than the spin: the latency test alone rests.
        let polled = Bottleneck::new(1_000, 3_000, 8, 8_000).polled(100_000);
        assert!(polled > 90_000, "polled {polled} of 100000");
    }

    #[test]
    fn a_rate_gain_that_costs_more_cpu_than_it_adds_does_not_pay() {
        // The same loop where a wake-up costs little: asleep it serves 8 in 26 µs after a
        // 12 µs wait (4.75 µs and 3.25 µs of CPU a request); polling gains 1.19 times the
        // rate for 1.23 times the CPU a request.
        let polled = Bottleneck::new(1_000, 3_000, 8, 2_000).polled(100_000);
        assert!(polled < 1_000, "polled {polled} of 100000");
    }

    #[test]
    fn one_request_at_a_time_is_left_to_the_latency_test() {
        // Asleep, the loop wakes to one completion 12 µs after it waits; polling catches it
        // after 8 µs, saving less than it spins. The rates and CPU would say poll (a slow
        // way back from each sleep), but with one request in flight the loop is not the
        // bottleneck, and on a VM the rests between epochs measured slower than resting
        // alone: only the latency test decides.
        let polled = Bottleneck::new(8_000, 3_000, 1, 8_000).polled(100_000);
        assert!(polled < 1_000, "polled {polled} of 100000");
    }

    #[test]
    fn a_client_that_sets_the_pace_keeps_the_loop_resting() {
        // A rate-limited client: 4 requests every 30 µs (± 6 µs), whatever the loop does
        // (batches, so the rate test applies). Polling spins until they come, sleeping
        // wakes to them; either way the loop serves 4 per 30 µs, so polling buys nothing
        // but costs the spin, whatever the noise in the rate.
        let mut p = new_policy();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let (mut cpu, mut polled) = (0, 0);
        for i in 0..200_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let period = 24_000 + seed % 12_000;
            let wait = period - 4 * SERVICE;
            let window = p.window_ns();
            let hit = window >= wait;
            cpu += if hit {
                period
            } else {
                window + 4 * SERVICE + WAKE_CPU
            };
            p.adjust(&Observation {
                block_ns: wait,
                slept_ns: (!hit).then_some(wait - window.min(wait)),
                events: &[0],
                polled_ns: if hit { wait } else { window.min(wait) },
                work: 4,
                served: 4,
                elapsed_ns: period,
                cpu_ns: Some(cpu),
            });
            if i >= 100_000 && window > 0 {
                polled += 1;
            }
        }
        assert!(polled < 1_000, "polled {polled} of 100000");
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
                served: 0,
                elapsed_ns: 0,
                cpu_ns: None,
            });
        }
        assert_eq!(p.window_ns(), 0);
    }
}
