//! What the policies' tests share: QEMU's parameters, and synthetic iterations fed to a
//! policy with the window it answers.

use super::{HandlerId, Observation, PollParams, PollPolicy, QEMU_POLL_MAX_NS};

/// QEMU's defaults (the rules' tests use its 32768 maximum).
pub(super) fn qemu() -> PollParams {
    PollParams {
        max_ns: QEMU_POLL_MAX_NS,
        ..PollParams::default()
    }
}

/// Feeds `p` one iteration that waited `block_ns` (of which it slept `slept_ns`, if it
/// slept) with `events`; the window after it.
pub(super) fn feed(
    p: &mut impl PollPolicy,
    block_ns: u64,
    slept_ns: Option<u64>,
    events: &[HandlerId],
) -> u64 {
    p.adjust(&Observation {
        block_ns,
        slept_ns,
        events,
        polled_ns: 0,
        work: 1,
        served: 0,
        elapsed_ns: 0,
        cpu_ns: None,
    });
    p.window_ns()
}

/// One iteration in which `events` came after `block_ns`, without a sleep.
pub(super) fn step(p: &mut impl PollPolicy, block_ns: u64, events: &[HandlerId]) -> u64 {
    feed(p, block_ns, None, events)
}

/// One iteration that slept all of its `ns` wait, no handler's event in it.
pub(super) fn slept(p: &mut impl PollPolicy, ns: u64) -> u64 {
    feed(p, ns, Some(ns), &[])
}

/// One iteration whose `ns` wait ended with handler 0's event, without a sleep.
pub(super) fn polled(p: &mut impl PollPolicy, ns: u64) -> u64 {
    step(p, ns, &[0])
}
