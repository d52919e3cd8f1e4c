//! `haltpoll`: the Linux guest haltpoll cpuidle governor, applied to the loop.
//!
//! The window only changes after a real sleep, and it is judged by how long the sleep
//! lasted (the polling before it does not count): a sleep shorter than `poll-max-ns` but
//! longer than the window means polling a little longer would have caught the event, so
//! the window grows (times `poll-grow`, at least `grow-start`, at most the maximum); a sleep
//! longer than the maximum shrinks it (divide by `poll-shrink`, 0 meaning 2) when
//! `allow-shrink` is on. Iterations that never slept leave it alone.

use super::{HandlerId, Observation, PolicyKind, PollParams, PollPolicy};

/// The haltpoll governor.
#[derive(Debug)]
pub struct Haltpoll {
    params: PollParams,
    limit_ns: u64,
}

impl Haltpoll {
    /// A governor with a window of 0 (as haltpoll's `enable`).
    pub fn new(params: &PollParams) -> Self {
        Self {
            params: *params,
            limit_ns: 0,
        }
    }
}

impl PollPolicy for Haltpoll {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Haltpoll
    }
    fn set_params(&mut self, params: &PollParams) {
        self.params = *params;
        self.limit_ns = 0;
    }
    fn add_handler(&mut self, _: HandlerId) {}
    fn remove_handler(&mut self, _: HandlerId) {}
    fn window_ns(&self) -> u64 {
        self.limit_ns.min(self.params.max_ns)
    }
    fn adjust(&mut self, obs: &Observation<'_>) {
        let Some(slept) = obs.slept_ns else { return };
        let max = self.params.max_ns;
        if max == 0 {
            self.limit_ns = 0;
            return;
        }
        if self.limit_ns < slept && slept <= max {
            let grown = self.limit_ns.saturating_mul(self.params.grow_factor());
            self.limit_ns = grown.max(self.params.grow_start_ns).min(max);
        } else if slept > max && self.params.allow_shrink {
            let shrink = if self.params.shrink == 0 {
                2
            } else {
                self.params.shrink
            };
            self.limit_ns /= shrink;
        }
    }
    fn windows(&self, out: &mut Vec<(Option<HandlerId>, u64)>) {
        out.push((None, self.window_ns()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poll::testing::{polled, qemu, slept};

    #[test]
    fn grows_from_grow_start_and_doubles_to_the_maximum() {
        let params = PollParams {
            max_ns: 200_000,
            ..qemu()
        };
        let mut p = Haltpoll::new(&params);
        assert_eq!(p.window_ns(), 0);
        assert_eq!(slept(&mut p, 10_000), 50_000);
        assert_eq!(slept(&mut p, 60_000), 100_000);
        // A sleep inside the window: no change.
        assert_eq!(slept(&mut p, 90_000), 100_000);
        assert_eq!(slept(&mut p, 150_000), 200_000);
        assert_eq!(slept(&mut p, 199_000), 200_000);
    }

    #[test]
    fn only_a_real_sleep_adjusts() {
        let params = PollParams {
            policy: PolicyKind::Haltpoll,
            max_ns: 200_000,
            ..qemu()
        };
        let mut p = Haltpoll::new(&params);
        // Poll hits (no sleep), however short or long the wait, change nothing.
        assert_eq!(polled(&mut p, 10), 0);
        assert_eq!(polled(&mut p, 10_000_000), 0);
        assert_eq!(slept(&mut p, 10_000), 50_000);
        assert_eq!(polled(&mut p, 10_000_000), 50_000);
        assert_eq!(polled(&mut p, 60_000), 50_000);
    }

    #[test]
    fn long_sleeps_halve_unless_shrink_is_disallowed() {
        let params = PollParams {
            max_ns: 200_000,
            ..qemu()
        };
        let mut p = Haltpoll::new(&params);
        slept(&mut p, 10_000);
        slept(&mut p, 60_000);
        assert_eq!(p.window_ns(), 100_000);
        assert_eq!(slept(&mut p, 1_000_000), 50_000);
        assert_eq!(slept(&mut p, 1_000_000), 25_000);
        // After shrinking below grow-start, a short sleep jumps back up to grow-start.
        assert_eq!(slept(&mut p, 30_000), 50_000);

        let params = PollParams {
            max_ns: 200_000,
            allow_shrink: false,
            ..qemu()
        };
        let mut p = Haltpoll::new(&params);
        slept(&mut p, 10_000);
        assert_eq!(slept(&mut p, 1_000_000), 50_000);
    }

    #[test]
    fn default_maximum_caps_grow_start() {
        // With QEMU's poll-max-ns (32768) the 50 µs grow-start is capped at the maximum.
        let mut p = Haltpoll::new(&qemu());
        assert_eq!(slept(&mut p, 10_000), 32_768);
        assert_eq!(slept(&mut p, 40_000), 16_384);
    }
}
