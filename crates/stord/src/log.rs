//! Diagnostics: the `tracing` subscriber the binary installs, and a rate limiter for
//! events a hostile or broken peer could otherwise repeat thousands of times a second.
//!
//! Events go to stderr, one line each. `STORD_LOG` sets the most verbose level shown
//! (`error`, `warn` (the default: silent unless something is wrong, as qsd is, whose
//! stderr scripts and QEMU's own tests compare), `info`, `debug`, `trace`).

use std::cell::Cell;
use std::time::Duration;

use stord_aio::sys::now_ns;
use tracing::level_filters::LevelFilter;

/// Installs the stderr subscriber (once per process; later calls do nothing).
pub fn init() {
    let _ = init_with(&crate::trace::TraceConfig::default());
}

/// Installs the subscriber with what `--trace` asked for: its modules shown at every
/// level, its output in its file (once per process; later calls do nothing). Names that
/// selected nothing are warned about.
pub fn init_with(trace: &crate::trace::TraceConfig) -> std::io::Result<()> {
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let level = std::env::var("STORD_LOG")
        .ok()
        .and_then(|v| v.parse::<LevelFilter>().ok())
        .unwrap_or(LevelFilter::WARN);
    let mut filter = tracing_subscriber::filter::Targets::new().with_default(level);
    for t in &trace.targets {
        filter = filter.with_target(*t, LevelFilter::TRACE);
    }
    let writer = match &trace.file {
        Some(p) => BoxMakeWriter::new(std::sync::Mutex::new(std::fs::File::create(p)?)),
        None => BoxMakeWriter::new(std::io::stderr),
    };
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(false)
        .with_target(!trace.targets.is_empty())
        .with_filter(filter);
    let _ = tracing_subscriber::registry().with(layer).try_init();
    for w in &trace.warnings {
        tracing::warn!("--trace: {w}");
    }
    Ok(())
}

/// Lets an event through at most once per interval and counts the ones it held back.
#[derive(Debug)]
pub struct RateLimit {
    interval_ns: u64,
    /// When the last event went through (0: never).
    last_ns: Cell<u64>,
    suppressed: Cell<u64>,
}

impl RateLimit {
    /// At most one event per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval_ns: interval.as_nanos() as u64,
            last_ns: Cell::new(0),
            suppressed: Cell::new(0),
        }
    }

    /// `Some(n)` if an event may be emitted now, `n` being how many were held back since
    /// the last one; `None` (and one more held back) otherwise.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(now_ns())
    }

    fn allow_at(&self, now: u64) -> Option<u64> {
        let last = self.last_ns.get();
        if last != 0 && now.saturating_sub(last) < self.interval_ns {
            self.suppressed.set(self.suppressed.get() + 1);
            return None;
        }
        self.last_ns.set(now.max(1));
        Some(self.suppressed.replace(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_interval_with_the_count_of_the_rest() {
        let r = RateLimit::new(Duration::from_secs(1));
        let s = 1_000_000_000;
        assert_eq!(r.allow_at(5 * s), Some(0));
        for i in 0..999 {
            assert_eq!(r.allow_at(5 * s + i * 1_000_000), None);
        }
        assert_eq!(r.allow_at(6 * s), Some(999));
        assert_eq!(r.allow_at(6 * s + 1), None);
        assert_eq!(r.allow_at(8 * s), Some(1));
    }
}
