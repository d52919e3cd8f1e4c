//! I/O throttling, as QEMU's: a `throttle-group` object holds limits (IOPS and bytes per
//! second, total / read / write, with bursts) that every `throttle` filter node in the
//! group shares, so several disks can split one budget.
//!
//! Each limit is a bucket scheduled by virtual time (GCRA): a request of cost `c` moves
//! the bucket's "next free" instant on by `c / rate`, and may start once that instant is
//! no more than the burst window ahead of now. A request waits, on its own IoThread's
//! timer, until every bucket it is charged to admits it. Without a `*-max` burst the
//! window is a tenth of a second, as QEMU's default.

use std::sync::Mutex;
use std::time::Duration;

use stord_aio::sys::now_ns;

use crate::cli::keyval::{KeyVal, OptionError};

/// Which limit a bucket enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    BpsTotal,
    BpsRead,
    BpsWrite,
    IopsTotal,
    IopsRead,
    IopsWrite,
}

const KINDS: [(Kind, &str); 6] = [
    (Kind::BpsTotal, "bps-total"),
    (Kind::BpsRead, "bps-read"),
    (Kind::BpsWrite, "bps-write"),
    (Kind::IopsTotal, "iops-total"),
    (Kind::IopsRead, "iops-read"),
    (Kind::IopsWrite, "iops-write"),
];

#[derive(Debug, Clone)]
struct Bucket {
    kind: Kind,
    /// Units (bytes or operations) per second.
    rate: f64,
    /// How far ahead of now the schedule may run, in ns (the burst).
    window_ns: f64,
    /// When the next unit is free, in ns on the monotonic clock.
    next_free: f64,
}

/// QEMU's largest throttle value (`THROTTLE_VALUE_MAX`).
pub const THROTTLE_VALUE_MAX: u64 = 1_000_000_000_000_000;

/// Why a throttle group's limits were refused: an option, or QEMU's rules (its texts).
#[derive(Debug, thiserror::Error)]
pub enum ThrottleConfigError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("{0}")]
    Invalid(String),
}

/// QEMU's `throttle_is_valid` over (avg, max, burst length) per kind, in [`KINDS`] order.
fn check_limits(l: &[(u64, u64, u64); 6], iops_size: u64) -> Result<(), ThrottleConfigError> {
    let bad = |m: &str| Err(ThrottleConfigError::Invalid(m.into()));
    for total in [0, 3] {
        if l[total].0 > 0 && (l[total + 1].0 > 0 || l[total + 2].0 > 0)
            || l[total].1 > 0 && (l[total + 1].1 > 0 || l[total + 2].1 > 0)
        {
            return bad(
                "bps/iops/max total values and read/write values cannot be used at the same time",
            );
        }
    }
    if iops_size > 0 && l[3].0 == 0 && l[4].0 == 0 && l[5].0 == 0 {
        return bad("iops size requires an iops value to be set");
    }
    if iops_size > THROTTLE_VALUE_MAX {
        return Err(ThrottleConfigError::Invalid(format!(
            "bps/iops/max values must be within [0, {THROTTLE_VALUE_MAX}]"
        )));
    }
    for &(avg, max, len) in l {
        if avg > THROTTLE_VALUE_MAX || max > THROTTLE_VALUE_MAX {
            return Err(ThrottleConfigError::Invalid(format!(
                "bps/iops/max values must be within [0, {THROTTLE_VALUE_MAX}]"
            )));
        }
        if len == 0 {
            return bad("the burst length cannot be 0");
        }
        if len > 1 && max == 0 {
            return bad("burst length set without burst rate");
        }
        if max > 0 && len > THROTTLE_VALUE_MAX / max {
            return bad("burst length too high for this burst rate");
        }
        if max > 0 && avg == 0 {
            return bad("bps_max/iops_max require corresponding bps/iops values");
        }
        if max > 0 && max < avg {
            return bad("bps_max/iops_max cannot be lower than bps/iops");
        }
    }
    Ok(())
}

/// Limits shared by the `throttle` nodes of one group.
#[derive(Debug)]
pub struct ThrottleGroup {
    /// The object's id.
    pub id: String,
    /// `iops-size`: requests larger than this count as several operations.
    iops_size: u64,
    buckets: Mutex<Vec<Bucket>>,
}

impl ThrottleGroup {
    /// `--object throttle-group,id=...,x-iops-total=...` (or `limits.iops-total=...`, as
    /// QMP's object-add sends it).
    pub fn from_opts(id: String, kv: &mut KeyVal) -> Result<Self, ThrottleConfigError> {
        let mut take = |name: &str| -> Result<Option<u64>, OptionError> {
            let a = kv.take_u64(&format!("x-{name}"), false)?;
            let b = kv.take_u64(&format!("limits.{name}"), false)?;
            Ok(b.or(a))
        };
        // (avg, max, burst length) per kind, checked whole with QEMU's rules
        // (throttle_is_valid) before any bucket is made.
        let mut limits = [(0u64, 0u64, 1u64); 6];
        for (i, (_, name)) in KINDS.iter().enumerate() {
            limits[i] = (
                take(name)?.unwrap_or(0),
                take(&format!("{name}-max"))?.unwrap_or(0),
                take(&format!("{name}-max-length"))?.unwrap_or(1),
            );
        }
        let iops_size = take("iops-size")?.unwrap_or(0);
        check_limits(&limits, iops_size)?;
        let mut buckets = Vec::new();
        for (i, (kind, _)) in KINDS.iter().enumerate() {
            let (avg, max, len) = limits[i];
            if avg == 0 {
                continue;
            }
            let rate = avg as f64;
            // A burst of `max` units per second for `len` seconds, else a tenth of a second.
            let burst_units = if max > 0 {
                (max * len) as f64
            } else {
                rate / 10.0
            }
            .max(1.0);
            buckets.push(Bucket {
                kind: *kind,
                rate,
                window_ns: burst_units / rate * 1e9,
                next_free: 0.0,
            });
        }
        Ok(Self {
            id,
            iops_size,
            buckets: Mutex::new(buckets),
        })
    }

    /// Waits until a request of `bytes` (a read or a write) may start, and charges it.
    pub(crate) async fn admit(&self, write: bool, bytes: u64) {
        let ops = bytes.checked_div(self.iops_size).unwrap_or(1).max(1);
        loop {
            let wait_ns = {
                let mut bs = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
                let now = now_ns() as f64;
                let applies = |k: Kind| match k {
                    Kind::BpsTotal | Kind::IopsTotal => true,
                    Kind::BpsRead | Kind::IopsRead => !write,
                    Kind::BpsWrite | Kind::IopsWrite => write,
                };
                let wait = bs
                    .iter()
                    .filter(|b| applies(b.kind))
                    .map(|b| b.next_free.max(now) - now - b.window_ns)
                    .fold(0.0f64, f64::max);
                if wait <= 0.0 {
                    for b in bs.iter_mut().filter(|b| applies(b.kind)) {
                        let cost = match b.kind {
                            Kind::BpsTotal | Kind::BpsRead | Kind::BpsWrite => bytes as f64,
                            _ => ops as f64,
                        };
                        b.next_free = b.next_free.max(now) + cost / b.rate * 1e9;
                    }
                    return;
                }
                wait
            };
            stord_aio::sleep(Duration::from_nanos(wait_ns.ceil() as u64)).await;
        }
    }

    /// Whether the group limits anything.
    #[cfg(test)]
    fn is_unlimited(&self) -> bool {
        self.buckets.lock().map(|b| b.is_empty()).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn group(opts: &str) -> ThrottleGroup {
        let mut kv = KeyVal::parse("--object", opts, None).unwrap();
        let g = ThrottleGroup::from_opts("tg".into(), &mut kv).unwrap();
        kv.finish().unwrap();
        g
    }

    /// QEMU's rules and texts (throttle_is_valid); before, a huge max times its burst
    /// length overflowed, and a max without an average was silently dropped.
    #[test]
    fn limits_follow_qemus_rules() {
        let err = |opts: &str| {
            let mut kv = KeyVal::parse("--object", opts, None).unwrap();
            ThrottleGroup::from_opts("tg".into(), &mut kv)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert_eq!(
            err("x-bps-total=1,x-bps-read=1"),
            "bps/iops/max total values and read/write values cannot be used at the same time"
        );
        assert_eq!(
            err("x-bps-total=1000000000000001"),
            "bps/iops/max values must be within [0, 1000000000000000]"
        );
        assert_eq!(
            err("x-iops-total=1,x-iops-total-max-length=0"),
            "the burst length cannot be 0"
        );
        assert_eq!(
            err("x-iops-total=1,x-iops-total-max-length=2"),
            "burst length set without burst rate"
        );
        assert_eq!(
            err("x-iops-total=1,x-iops-total-max=1000,x-iops-total-max-length=9223372036854775807"),
            "burst length too high for this burst rate"
        );
        assert_eq!(
            err("x-iops-total-max=10"),
            "bps_max/iops_max require corresponding bps/iops values"
        );
        assert_eq!(
            err("x-iops-total=10,x-iops-total-max=5"),
            "bps_max/iops_max cannot be lower than bps/iops"
        );
        assert_eq!(
            err("x-iops-size=4096"),
            "iops size requires an iops value to be set"
        );
        assert_eq!(
            err("x-iops-total=10,x-iops-total-max=20,x-iops-total-max-length=3"),
            ""
        );
    }

    #[test]
    fn a_1000_iops_limit_admits_1000_per_second_after_the_burst() {
        let g = Arc::new(group("x-iops-total=1000"));
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let g2 = g.clone();
        let t0 = now_ns();
        let n = ctx.block_on(async move {
            let mut n = 0u64;
            while now_ns() - t0 < 300_000_000 {
                g2.admit(n.is_multiple_of(2), 4096).await;
                n += 1;
            }
            n
        });
        // 100 of burst plus 300 in 0.3 s.
        assert!((380..=420).contains(&n), "{n} admitted");
    }

    #[test]
    fn limits_parse_in_both_spellings_and_bad_values_are_refused() {
        assert!(group("").is_unlimited());
        assert!(!group("limits.bps-read=1048576").is_unlimited());
        let mut kv = KeyVal::parse("--object", "x-iops-total=lots", None).unwrap();
        assert!(ThrottleGroup::from_opts("tg".into(), &mut kv).is_err());
    }
}
