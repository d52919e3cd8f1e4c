//! `weighted`: QEMU's 2026 "weighted handler intervals" (`poll-weight`).
//!
//! Each handler keeps a moving average of the wait before its events, where a new sample
//! weighs 2^-W (W = `poll-weight`, 0 meaning 3). A handler with no event in an iteration
//! accumulates the wait instead, and any handler whose estimate reaches `poll-max-ns` drops
//! to 0 and stops counting, so sporadic handlers do not keep polling alive. The context
//! window then grows to the largest estimate (at least times `poll-grow`), or shrinks by
//! `poll-shrink` (0 meaning halve) when the largest estimate falls below window/shrink.

use super::{HandlerId, Observation, PolicyKind, PollParams, PollPolicy, Slots};

#[derive(Debug, Default, Clone, Copy)]
struct HandlerEstimate {
    ns: u64,
    has_event: bool,
}

/// The weighted-interval policy.
#[derive(Debug)]
pub struct Weighted {
    params: PollParams,
    poll_ns: u64,
    handlers: Slots<HandlerEstimate>,
}

impl Weighted {
    /// A policy with all estimates at 0.
    pub fn new(params: &PollParams) -> Self {
        Self {
            params: *params,
            poll_ns: 0,
            handlers: Slots::default(),
        }
    }

    fn shrink_divisor(&self) -> u64 {
        if self.params.shrink == 0 {
            2
        } else {
            self.params.shrink
        }
    }
}

impl PollPolicy for Weighted {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Weighted
    }
    fn set_params(&mut self, params: &PollParams) {
        self.params = *params;
        self.poll_ns = 0;
        self.handlers.reset();
    }
    fn add_handler(&mut self, id: HandlerId) {
        self.handlers.add(id);
    }
    fn remove_handler(&mut self, id: HandlerId) {
        self.handlers.remove(id);
    }
    fn window_ns(&self) -> u64 {
        if self.params.max_ns == 0 {
            0
        } else {
            self.poll_ns
        }
    }
    fn adjust(&mut self, obs: &Observation<'_>) {
        let max = self.params.max_ns;
        if max == 0 {
            return;
        }
        let w = self.params.weight_shift();
        for &id in obs.events {
            if let Some(h) = self.handlers.get_mut(id) {
                h.has_event = true;
            }
        }
        let block = obs.block_ns;
        let mut adj = 0;
        let mut any_event = false;
        for (_, h) in self.handlers.iter_mut() {
            if h.has_event {
                any_event = true;
                h.ns = if h.ns == 0 {
                    block
                } else {
                    h.ns - (h.ns >> w) + (block >> w)
                };
                if h.ns >= max {
                    h.ns = 0;
                }
                adj = adj.max(h.ns);
                h.has_event = false;
            } else if h.ns != 0 {
                h.ns = h.ns.saturating_add(block);
                if h.ns >= max {
                    h.ns = 0;
                }
            }
        }
        if !any_event {
            return;
        }
        if adj > self.poll_ns {
            let grown = self.poll_ns.saturating_mul(self.params.grow_factor());
            self.poll_ns = adj.max(grown).min(max);
        } else {
            let s = self.shrink_divisor();
            if adj < self.poll_ns / s {
                self.poll_ns /= s;
            }
        }
    }
    fn windows(&self, out: &mut Vec<(Option<HandlerId>, u64)>) {
        out.push((None, self.poll_ns));
        out.extend(self.handlers.iter().map(|(id, h)| (Some(id), h.ns)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poll::testing::{qemu, step};

    fn estimate(p: &Weighted, id: HandlerId) -> u64 {
        let mut w = Vec::new();
        p.windows(&mut w);
        w.into_iter().find(|(h, _)| *h == Some(id)).unwrap().1
    }

    #[test]
    fn first_sample_jumps_then_moving_average_with_weight_3() {
        let mut p = Weighted::new(&qemu());
        p.add_handler(0);
        // From 0 the window jumps straight to the first estimate (no 4 µs start).
        assert_eq!(step(&mut p, 8000, &[0]), 8000);
        assert_eq!(estimate(&p, 0), 8000);
        // EWMA: 8000 - 8000/8 + 16000/8 = 9000; grow: max(9000, 8000*2) = 16000.
        assert_eq!(step(&mut p, 16000, &[0]), 16000);
        assert_eq!(estimate(&p, 0), 9000);
        // 9000 - 1125 + 1000 = 8875 < 16000 but not below 16000/2: keep.
        assert_eq!(step(&mut p, 8000, &[0]), 16000);
        assert_eq!(estimate(&p, 0), 8875);
        // Short waits pull the estimate under window/2: halve.
        let mut w = 16000;
        for _ in 0..20 {
            w = step(&mut p, 800, &[0]);
        }
        assert!(estimate(&p, 0) < 4000, "{}", estimate(&p, 0));
        assert_eq!(w, 2000);
    }

    #[test]
    fn weight_changes_the_average() {
        let params = PollParams {
            weight: 1,
            ..qemu()
        };
        let mut p = Weighted::new(&params);
        p.add_handler(0);
        step(&mut p, 8000, &[0]);
        step(&mut p, 16000, &[0]);
        // 8000 - 4000 + 8000 = 12000.
        assert_eq!(estimate(&p, 0), 12000);
    }

    #[test]
    fn estimate_over_max_stops_counting_and_idle_handlers_accumulate() {
        let mut p = Weighted::new(&qemu());
        p.add_handler(0);
        p.add_handler(1);
        step(&mut p, 10_000, &[0]);
        step(&mut p, 10_000, &[1]);
        // Handler 0 had no event: its estimate accumulated the wait.
        assert_eq!(estimate(&p, 0), 20_000);
        step(&mut p, 10_000, &[1]);
        // 30000 ... then 40000 >= 32768: dropped to 0.
        step(&mut p, 10_000, &[1]);
        assert_eq!(estimate(&p, 0), 0);
        // A first sample at or above the maximum is dropped at once.
        p.add_handler(2);
        step(&mut p, 50_000, &[2]);
        assert_eq!(estimate(&p, 2), 0);
    }

    #[test]
    fn grow_is_capped_and_shrink_divisor_applies() {
        let params = PollParams {
            shrink: 4,
            ..qemu()
        };
        let mut p = Weighted::new(&params);
        p.add_handler(0);
        assert_eq!(step(&mut p, 30_000, &[0]), 30_000);
        // 30000 - 3750 + 3750 = 30000, not above the window: keep.
        assert_eq!(step(&mut p, 30_000, &[0]), 30_000);
        // Iterations with no event at all change nothing.
        assert_eq!(step(&mut p, 1, &[]), 30_000);
        // A handler dropping to 0 makes adj 0 < 30000/4: divide by 4.
        assert_eq!(step(&mut p, 1_000_000, &[0]), 7500);
        // Growth is capped at poll-max-ns.
        let mut p = Weighted::new(&qemu());
        p.add_handler(0);
        step(&mut p, 20_000, &[0]);
        p.add_handler(1);
        assert_eq!(step(&mut p, 32_000, &[1]), 32_768);
    }
}
