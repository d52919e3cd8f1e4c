//! Polling policies: how long the loop busy-polls before it blocks.
//!
//! After every iteration the loop hands the policy an [`Observation`]: how long it waited
//! for work (`block_ns`, polling plus blocking, dispatch excluded), whether it really slept
//! and for how long, and which poll handlers had events. The policy answers with the next
//! polling window. Policies are pure state machines with no clock of their own, so tests
//! drive them with synthetic waits and assert the exact window after each step (the
//! helpers that feed them are shared, in `testing`).
//!
//! One file per policy: [`off`], [`adaptive`] (the default: classic's windows, kept only
//! where the waits they shorten outweigh the time they spin), [`classic`] (QEMU's
//! per-handler grow/shrink),
//! [`weighted`] (QEMU's 2026 weighted handler intervals, `poll-weight`) and [`haltpoll`]
//! (Linux's guest haltpoll governor).

pub mod adaptive;
pub mod classic;
pub mod haltpoll;
pub mod off;
#[cfg(test)]
mod testing;
pub mod weighted;

use std::fmt;
use std::str::FromStr;

/// Index of a poll handler inside its context.
pub type HandlerId = usize;

/// QEMU's default `poll-max-ns` for IOThreads.
pub const QEMU_POLL_MAX_NS: u64 = 32768;
/// Our default `poll-max-ns`: twice QEMU's. Polling pays only when the window covers the
/// peer's turnaround, and that includes the peer's own wake-up; on the virtual machines
/// this was measured on, a wake-up costs 20-50 µs, so with 32 µs a driver that sleeps
/// between requests is almost never caught by polling. Measured with libblkio and
/// stord-bench's frontend against the vhost-user-blk export (5 s x 3 runs, null device):
/// 64 µs gave 2.1-3.6x qsd's IOPS at 0.7x its CPU per I/O where 32 µs gave 1.2-2.3x at
/// 0.8-1.06x; 128 and 256 µs were no better and cost more CPU (docs/benchmark-notes.md).
pub const DEFAULT_POLL_MAX_NS: u64 = 65536;
/// Default `poll-weight` shift (a new sample weighs 2^-3).
pub const DEFAULT_POLL_WEIGHT: u32 = 3;
/// Largest accepted `poll-weight`.
pub const MAX_POLL_WEIGHT: u32 = 63;
/// Default haltpoll grow-start (50 µs, as `guest_halt_poll_grow_start`).
pub const DEFAULT_GROW_START_NS: u64 = 50_000;

/// Which policy a context runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyKind {
    /// Never poll: block as soon as there is nothing to do.
    Off,
    /// Per-handler windows that must pay for themselves (the default).
    #[default]
    Adaptive,
    /// QEMU's per-handler grow/shrink (qemu-storage-daemon's policy).
    Classic,
    /// Per-handler moving average of the wait (`poll-weight`).
    Weighted,
    /// Linux's guest haltpoll governor: adjust only after a real sleep.
    Haltpoll,
}

impl PolicyKind {
    /// All kinds, in a stable order (for benchmarks).
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::Off,
        PolicyKind::Adaptive,
        PolicyKind::Classic,
        PolicyKind::Weighted,
        PolicyKind::Haltpoll,
    ];

    /// The name used on the command line and in QMP.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Off => "off",
            PolicyKind::Adaptive => "adaptive",
            PolicyKind::Classic => "classic",
            PolicyKind::Weighted => "weighted",
            PolicyKind::Haltpoll => "haltpoll",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown poll policy '{s}' (expected off, adaptive, classic, weighted or haltpoll)"
                )
            })
    }
}

/// The tunables of an IOThread's polling, named as QEMU's IOThread properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollParams {
    /// The policy.
    pub policy: PolicyKind,
    /// `poll-max-ns`: the largest window; 0 disables polling whatever the policy.
    pub max_ns: u64,
    /// `poll-grow`: growth factor, 0 means 2.
    pub grow: u64,
    /// `poll-shrink`: shrink divisor; 0 means reset to 0 (classic) or halve (weighted,
    /// haltpoll).
    pub shrink: u64,
    /// `poll-weight`: the moving average gives a new sample weight 2^-weight; 0 means 3.
    pub weight: u32,
    /// haltpoll's grow-start: the first window after a short sleep.
    pub grow_start_ns: u64,
    /// haltpoll's allow-shrink switch.
    pub allow_shrink: bool,
    /// While polling, give the CPU to another runnable thread (sched_yield) this often;
    /// 0 never yields. See [`DEFAULT_POLL_YIELD_NS`].
    pub yield_ns: u64,
}

/// Default `poll-yield-ns`. A poller that never yields keeps a runnable thread on its CPU
/// waiting, and when that thread is the one that would send the next request (more
/// IoThreads and client threads than CPUs) polling makes everything slower. sched_yield
/// returns at once when nothing else is runnable. Measured with two vhost-user-blk queues
/// on two IoThreads and two libblkio threads on 2 vCPUs: 483k IOPS without yielding, 901k
/// with a yield every 5 µs; one queue within noise either way.
pub const DEFAULT_POLL_YIELD_NS: u64 = 5_000;

/// The longest polling window (and yield interval) a loop takes: one second. Longer
/// windows would only burn a core; the limit also keeps the window arithmetic from
/// overflowing.
pub const MAX_POLL_NS: u64 = 1_000_000_000;

/// The largest grow or shrink factor.
pub const MAX_POLL_FACTOR: u64 = 1024;

impl Default for PollParams {
    fn default() -> Self {
        Self {
            policy: PolicyKind::Adaptive,
            max_ns: DEFAULT_POLL_MAX_NS,
            grow: 0,
            shrink: 0,
            weight: 0,
            grow_start_ns: DEFAULT_GROW_START_NS,
            allow_shrink: true,
            yield_ns: DEFAULT_POLL_YIELD_NS,
        }
    }
}

impl PollParams {
    /// Checks ranges; the error names the offending parameter.
    pub fn validate(&self) -> Result<(), String> {
        if self.weight > MAX_POLL_WEIGHT {
            return Err(format!(
                "poll-weight must be in 0..={MAX_POLL_WEIGHT}, got {}",
                self.weight
            ));
        }
        for (name, v, max) in [
            ("poll-max-ns", self.max_ns, MAX_POLL_NS),
            ("poll-grow-start", self.grow_start_ns, MAX_POLL_NS),
            ("poll-yield-ns", self.yield_ns, MAX_POLL_NS),
            ("poll-grow", self.grow, MAX_POLL_FACTOR),
            ("poll-shrink", self.shrink, MAX_POLL_FACTOR),
        ] {
            if v > max {
                return Err(format!("{name} must be in 0..={max}, got {v}"));
            }
        }
        Ok(())
    }

    /// The growth factor with 0 meaning 2.
    pub fn grow_factor(&self) -> u64 {
        if self.grow == 0 {
            2
        } else {
            self.grow
        }
    }

    /// The weight shift with 0 meaning the default.
    pub fn weight_shift(&self) -> u32 {
        if self.weight == 0 {
            DEFAULT_POLL_WEIGHT
        } else {
            self.weight
        }
    }
}

/// What happened during one loop iteration, as a policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    /// Time from the start of polling to the end of the wait (polling + blocking).
    pub block_ns: u64,
    /// `Some(ns)` when the loop really blocked in the reactor, for that long.
    pub slept_ns: Option<u64>,
    /// Handlers that had an event in this iteration.
    pub events: &'a [HandlerId],
    /// Time spent busy-polling, at most the window (0 when the loop did not poll).
    pub polled_ns: u64,
    /// Completions reaped and user handlers ready: the work this wait brought.
    pub work: u64,
    /// Operations that completed (storage and peer I/O, not fd readiness): requests
    /// served, counted alike whether the loop polled or slept (a ready handler may take
    /// one request or many, depending on how long the loop waited).
    pub served: u64,
    /// The previous iteration's whole length, wait and dispatch: with `served`, the rate
    /// at which the loop gets through its work.
    pub elapsed_ns: u64,
    /// The thread's CPU time now (user and system, the kernel's sleep and wake-up path
    /// included), read only when the policy asked for it
    /// ([`PollPolicy::wants_cpu_ns`]): it costs a system call.
    pub cpu_ns: Option<u64>,
}

/// A polling policy. One instance per context; handlers are announced as they come and go.
pub trait PollPolicy: Send {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;
    /// New parameters; like QEMU's `aio_context_set_poll_params`, windows restart from 0.
    fn set_params(&mut self, params: &PollParams);
    /// A handler joins.
    fn add_handler(&mut self, id: HandlerId);
    /// A handler leaves.
    fn remove_handler(&mut self, id: HandlerId);
    /// How long to poll before blocking, in nanoseconds.
    fn window_ns(&self) -> u64;
    /// How long to poll when handler `quiet` cannot have an event (nothing it would report
    /// is outstanding): policies with a window per handler leave its window out; policies
    /// with one window for the context cannot tell, and answer [`window_ns`](Self::window_ns).
    fn window_ns_without(&self, quiet: HandlerId) -> u64 {
        let _ = quiet;
        self.window_ns()
    }
    /// Whether the next observation should carry the thread's CPU time.
    fn wants_cpu_ns(&self) -> bool {
        false
    }
    /// Learns from one iteration.
    fn adjust(&mut self, obs: &Observation<'_>);
    /// The window of each handler (`None` for a context-wide window), for statistics.
    fn windows(&self, out: &mut Vec<(Option<HandlerId>, u64)>);
}

/// Builds the policy `params.policy` names.
pub fn new_policy(params: &PollParams) -> Box<dyn PollPolicy> {
    match params.policy {
        PolicyKind::Off => Box::new(off::Off),
        PolicyKind::Adaptive => Box::new(adaptive::Adaptive::new(params)),
        PolicyKind::Classic => Box::new(classic::Classic::new(params)),
        PolicyKind::Weighted => Box::new(weighted::Weighted::new(params)),
        PolicyKind::Haltpoll => Box::new(haltpoll::Haltpoll::new(params)),
    }
}

/// Per-handler slots indexed by [`HandlerId`], shared by the per-handler policies.
#[derive(Debug, Default, Clone)]
pub(crate) struct Slots<T>(Vec<Option<T>>);

impl<T: Default> Slots<T> {
    pub(crate) fn add(&mut self, id: HandlerId) {
        if self.0.len() <= id {
            self.0.resize_with(id + 1, || None);
        }
        self.0[id] = Some(T::default());
    }
    pub(crate) fn remove(&mut self, id: HandlerId) {
        if let Some(s) = self.0.get_mut(id) {
            *s = None;
        }
    }
    pub(crate) fn get_mut(&mut self, id: HandlerId) -> Option<&mut T> {
        self.0.get_mut(id).and_then(Option::as_mut)
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = (HandlerId, &T)> {
        self.0
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i, s)))
    }
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (HandlerId, &mut T)> {
        self.0
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| s.as_mut().map(|s| (i, s)))
    }
    pub(crate) fn reset(&mut self) {
        for s in self.0.iter_mut().flatten() {
            *s = T::default();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn numbers_out_of_range_are_refused_with_the_range() {
        let p = PollParams {
            max_ns: 1 << 63,
            ..PollParams::default()
        };
        assert_eq!(
            p.validate().unwrap_err(),
            format!("poll-max-ns must be in 0..=1000000000, got {}", 1u64 << 63)
        );
        let p = PollParams {
            grow: 1025,
            ..PollParams::default()
        };
        assert!(p
            .validate()
            .unwrap_err()
            .contains("poll-grow must be in 0..=1024"));
        assert!(PollParams::default().validate().is_ok());
    }

    use super::*;

    #[test]
    fn policy_names_round_trip() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
        }
        assert!("fast".parse::<PolicyKind>().unwrap_err().contains("fast"));
    }

    #[test]
    fn weight_range_is_checked() {
        let p = PollParams {
            weight: 63,
            ..PollParams::default()
        };
        assert!(p.validate().is_ok());
        let p = PollParams { weight: 64, ..p };
        assert!(p.validate().unwrap_err().contains("poll-weight"));
        let p = PollParams { weight: 0, ..p };
        assert_eq!(p.weight_shift(), 3);
    }
}
