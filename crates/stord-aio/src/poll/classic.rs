//! `classic`: QEMU's per-handler grow/shrink (util/aio-posix.c `adjust_polling_time`).
//!
//! Each handler that had an event gets its own window adjusted from the iteration's wait:
//! a wait within the window keeps it (the sweet spot); a wait longer than `poll-max-ns`
//! shrinks it (divide by `poll-shrink`, or reset to 0 when that is 0); a wait between the
//! two grows it (from 0 to 4 µs, then times `poll-grow`, capped at `poll-max-ns`). The loop
//! polls for the largest window, so a slow handler cannot switch polling off for a fast one.

use super::{HandlerId, Observation, PolicyKind, PollParams, PollPolicy, Slots};

/// The first window a handler gets when polling starts to pay (QEMU's 4 µs).
pub const START_NS: u64 = 4000;

/// QEMU's per-handler grow/shrink policy.
#[derive(Debug)]
pub struct Classic {
    params: PollParams,
    handlers: Slots<u64>,
}

impl Classic {
    /// A policy with all windows at 0.
    pub fn new(params: &PollParams) -> Self {
        Self {
            params: *params,
            handlers: Slots::default(),
        }
    }

    /// The largest window of the handlers other than `except`: the loop polls for it.
    fn largest_window(&self, except: Option<HandlerId>) -> u64 {
        if self.params.max_ns == 0 {
            return 0;
        }
        self.handlers
            .iter()
            .filter(|(id, _)| Some(*id) != except)
            .map(|(_, ns)| *ns)
            .max()
            .unwrap_or(0)
    }

    /// The rule for one handler's window `ns` after a wait of `block_ns`.
    pub fn next_window(params: &PollParams, ns: u64, block_ns: u64) -> u64 {
        let max = params.max_ns;
        if block_ns <= ns {
            ns
        } else if block_ns > max {
            // poll-shrink 0 means reset.
            ns.checked_div(params.shrink).unwrap_or(0)
        } else if ns < max && block_ns < max {
            let grown = if ns == 0 {
                START_NS
            } else {
                ns.saturating_mul(params.grow_factor())
            };
            grown.min(max)
        } else {
            ns
        }
    }
}

impl PollPolicy for Classic {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Classic
    }
    fn set_params(&mut self, params: &PollParams) {
        self.params = *params;
        self.handlers.reset();
    }
    fn add_handler(&mut self, id: HandlerId) {
        self.handlers.add(id);
    }
    fn remove_handler(&mut self, id: HandlerId) {
        self.handlers.remove(id);
    }
    fn window_ns(&self) -> u64 {
        self.largest_window(None)
    }
    fn window_ns_without(&self, quiet: HandlerId) -> u64 {
        self.largest_window(Some(quiet))
    }
    fn adjust(&mut self, obs: &Observation<'_>) {
        if self.params.max_ns == 0 {
            return;
        }
        for &id in obs.events {
            if let Some(ns) = self.handlers.get_mut(id) {
                *ns = Self::next_window(&self.params, *ns, obs.block_ns);
            }
        }
    }
    fn windows(&self, out: &mut Vec<(Option<HandlerId>, u64)>) {
        out.extend(self.handlers.iter().map(|(id, ns)| (Some(id), *ns)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poll::testing::{qemu, step};

    #[test]
    fn grows_from_4us_doubles_and_caps() {
        let mut p = Classic::new(&qemu());
        p.add_handler(0);
        assert_eq!(p.window_ns(), 0);
        // Waits under the maximum but above the window grow it.
        assert_eq!(step(&mut p, 10_000, &[0]), 4000);
        assert_eq!(step(&mut p, 10_000, &[0]), 8000);
        assert_eq!(step(&mut p, 10_000, &[0]), 16000);
        // A wait inside the window is the sweet spot: no change.
        assert_eq!(step(&mut p, 10_000, &[0]), 16000);
        assert_eq!(step(&mut p, 20_000, &[0]), 32000);
        // Capped at poll-max-ns (32768), not 64000.
        assert_eq!(step(&mut p, 32_500, &[0]), 32768);
        assert_eq!(step(&mut p, 30_000, &[0]), 32768);
    }

    #[test]
    fn long_wait_resets_by_default_and_divides_with_shrink() {
        let mut p = Classic::new(&qemu());
        p.add_handler(0);
        for _ in 0..5 {
            step(&mut p, 20_000, &[0]);
        }
        assert_eq!(p.window_ns(), 32000);
        // Above poll-max-ns with poll-shrink 0: reset.
        assert_eq!(step(&mut p, 100_000, &[0]), 0);

        let params = PollParams {
            shrink: 4,
            grow: 3,
            ..qemu()
        };
        let mut p = Classic::new(&params);
        p.add_handler(0);
        assert_eq!(step(&mut p, 20_000, &[0]), 4000);
        assert_eq!(step(&mut p, 20_000, &[0]), 12000);
        // 12000 * 3 = 36000, capped.
        assert_eq!(step(&mut p, 20_000, &[0]), 32768);
        assert_eq!(step(&mut p, 1_000_000, &[0]), 32768 / 4);
        assert_eq!(step(&mut p, 1_000_000, &[0]), 32768 / 16);
    }

    #[test]
    fn windows_are_per_handler_and_loop_polls_the_largest() {
        let mut p = Classic::new(&qemu());
        p.add_handler(0);
        p.add_handler(1);
        step(&mut p, 10_000, &[0]);
        step(&mut p, 10_000, &[0]);
        assert_eq!(p.window_ns(), 8000);
        // A slow handler shrinking does not switch polling off for the fast one.
        step(&mut p, 10_000_000, &[1]);
        assert_eq!(p.window_ns(), 8000);
        let mut w = Vec::new();
        p.windows(&mut w);
        assert_eq!(w, vec![(Some(0), 8000), (Some(1), 0)]);
        // Handlers without an event are not adjusted.
        step(&mut p, 10_000_000, &[]);
        assert_eq!(p.window_ns(), 8000);
    }

    #[test]
    fn a_quiet_handler_is_left_out_of_the_window() {
        let mut p = Classic::new(&qemu());
        p.add_handler(0);
        p.add_handler(1);
        step(&mut p, 10_000, &[0]);
        step(&mut p, 10_000, &[1]);
        step(&mut p, 10_000, &[1]);
        assert_eq!(p.window_ns(), 8000);
        assert_eq!(p.window_ns_without(1), 4000);
        assert_eq!(p.window_ns_without(0), 8000);
        assert_eq!(p.window_ns_without(7), 8000);
    }

    #[test]
    fn max_zero_disables_and_set_params_resets() {
        let mut p = Classic::new(&qemu());
        p.add_handler(0);
        step(&mut p, 10_000, &[0]);
        assert_eq!(p.window_ns(), 4000);
        p.set_params(&PollParams {
            max_ns: 0,
            ..qemu()
        });
        assert_eq!(step(&mut p, 10, &[0]), 0);
        p.set_params(&qemu());
        assert_eq!(p.window_ns(), 0);
    }
}
