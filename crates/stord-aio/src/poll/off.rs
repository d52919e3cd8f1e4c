//! `off`: never poll. The loop blocks as soon as it runs out of work.

use super::{HandlerId, Observation, PolicyKind, PollParams, PollPolicy};

/// The policy that never polls.
#[derive(Debug, Default)]
pub struct Off;

impl PollPolicy for Off {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Off
    }
    fn set_params(&mut self, _: &PollParams) {}
    fn add_handler(&mut self, _: HandlerId) {}
    fn remove_handler(&mut self, _: HandlerId) {}
    fn window_ns(&self) -> u64 {
        0
    }
    fn adjust(&mut self, _: &Observation<'_>) {}
    fn windows(&self, _: &mut Vec<(Option<HandlerId>, u64)>) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_polls_whatever_happens() {
        let mut p = Off;
        p.add_handler(0);
        for w in [0, 100, 1_000_000] {
            p.adjust(&Observation {
                block_ns: w,
                slept_ns: Some(w),
                events: &[0],
                polled_ns: 0,
                work: 1,
                served: 0,
                elapsed_ns: 0,
                cpu_ns: None,
            });
            assert_eq!(p.window_ns(), 0);
        }
    }
}
