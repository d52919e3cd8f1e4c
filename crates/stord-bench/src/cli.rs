//! The command line: the usage text, the `--flag value` pairs, and each subcommand's
//! options read from them, one function per subcommand ([`MatrixFlags`]: the flags the
//! matrix benchmarks share). A flag that is not the subcommand's, or a bad value, prints
//! the usage and exits with status 2.

use std::path::PathBuf;
use std::time::Duration;

use crate::{aio, crash, density, fuse, load, nbd, report, timeline, vhost};

pub(crate) fn usage() -> ! {
    eprintln!(
        "usage: stord-bench aio [--duration-ms N] [--reactor io_uring|epoll] \
         [--policy off|classic|weighted|haltpoll]... [--think-us N]... [--out DIR]\n\
         \x20      stord-bench nbd [--runtime S] [--reps N] [--backend null|file|dev]... \
         [--daemon stord|stord-base|qsd|nbdkit]... [--workload RW:QD]... [--stord-policy P] [--file-aio MODE] [--jobs N] [--iothreads N] [--tcp on|off] [--tls on|off] [--out DIR]\n\
         \x20      stord-bench fuse [--runtime S] [--reps N] [--backend null|file]... \
         [--iothreads N]... [--daemon stord|stord-uring|qsd]... [--out DIR]\n\
         \x20      stord-bench vhost [--runtime S] [--reps N] [--backend null|file|dev]... \
         [--daemon stord-off|stord-classic|stord-weighted|stord-haltpoll|qsd]... [--workload RW:QD]... \
         [--client own|blkio|blkio-poll]... [--queues N] [--iothreads N] [--think-us N] [--think-spin on|off] [--out DIR]\n\
         \x20      stord-bench idle [--seconds N] [--out DIR]\n\
         \x20      stord-bench timeline [--export nbd|fuse|vhost-user-blk-libblkio]... [--backend file-io_uring|dev]... \
         [--daemon D]... [--reps N] [--trace-ms N] [--out DIR]\n\
         \x20      stord-bench load [--runtime S] [--reps N] [--export nbd|fuse|vhost-user-blk-libblkio]... \
         [--backend file-io_uring|dev]... [--daemon D]... [--workload RW:QD]... [--load PCT]... [--pinned on|off] [--out DIR]\n\
         \x20      stord-bench density [--shape N]... [--transport nbd|vhost-user-blk]... [--backend null|file-io_uring|dev]... \
         [--daemon stord|stord-poll0|qsd|qsd-poll0|floor]... [--runtime S] [--ramp S] [--reps N] [--flat-out on|off|only] [--idle S] [--load PCT | --total-iops N] [--out DIR]\n\
         \x20      stord-bench report [--quick on|off] [--runtime-ms N] [--ramp-ms N] [--reps N] \
         [--export nbd|fuse|vhost-user-blk|vhost-user-blk-libblkio|vhost-user-blk-libblkio-poll]... \
         [--all-engines on|off] [--extras on|off] [--docs on|off] [--out DIR]\n\
         \x20      stord-bench crash [--daemon stord|qsd]... [--workload W]... [--points N] [--seed S] \
         [--stord PATH] [--dir DIR] [--out DIR]\n\
         \x20      stord-bench replay LOG DEVICE [--entries N]\n\
         \x20      stord-bench report-docs FILE.json"
    );
    std::process::exit(2);
}

/// Every option takes a value: `--flag value` pairs, in order.
fn flag_pairs(args: &[String]) -> Vec<(&str, &str)> {
    args.chunks(2)
        .map(|c| match c {
            [f, v] if f.starts_with("--") => (f.as_str(), v.as_str()),
            [f] => {
                eprintln!("stord-bench: {f} needs a value");
                usage()
            }
            _ => usage(),
        })
        .collect()
}

fn parse<T: std::str::FromStr>(flag: &str, v: &str) -> T
where
    T::Err: std::fmt::Display,
{
    v.parse().unwrap_or_else(|e| {
        eprintln!("stord-bench: bad value '{v}' for {flag}: {e}");
        std::process::exit(2)
    })
}

/// Replaces `dst` with `src` when the command line gave any.
fn set_if_given<T>(dst: &mut Vec<T>, src: Vec<T>) {
    if !src.is_empty() {
        *dst = src;
    }
}

/// The flags the matrix benchmarks (nbd, fuse, vhost) share.
#[derive(Default)]
struct MatrixFlags {
    runtime_s: Option<u64>,
    reps: Option<usize>,
    backends: Vec<String>,
    daemons: Vec<String>,
    workloads: Vec<(String, u32)>,
    out: Option<PathBuf>,
}

impl MatrixFlags {
    /// Takes `flag` if it is a shared one.
    fn take(&mut self, flag: &str, v: &str) -> bool {
        match flag {
            "--runtime" => self.runtime_s = Some(parse(flag, v)),
            "--reps" => self.reps = Some(parse(flag, v)),
            "--backend" => self.backends.push(v.to_string()),
            "--daemon" => self.daemons.push(v.to_string()),
            "--workload" => {
                let (rw, qd) = v.split_once(':').unwrap_or_else(|| usage());
                self.workloads.push((rw.to_string(), parse(flag, qd)));
            }
            "--out" => self.out = Some(PathBuf::from(v)),
            _ => return false,
        }
        true
    }

    /// Puts what was given over the defaults (`workloads`: None when the benchmark has
    /// none to choose); returns `--out`.
    fn apply(
        self,
        runtime_s: &mut u64,
        reps: &mut usize,
        backends: &mut Vec<String>,
        daemons: &mut Vec<String>,
        workloads: Option<&mut Vec<(String, u32)>>,
    ) -> Option<PathBuf> {
        *runtime_s = self.runtime_s.unwrap_or(*runtime_s);
        *reps = self.reps.unwrap_or(*reps);
        set_if_given(backends, self.backends);
        set_if_given(daemons, self.daemons);
        match workloads {
            Some(w) => set_if_given(w, self.workloads),
            None if !self.workloads.is_empty() => usage(),
            None => {}
        }
        self.out
    }
}

/// The exports the load and timeline benchmarks drive (through clients nobody here wrote).
fn export_named(v: &str) -> report::Export {
    match v {
        "nbd" => report::Export::Nbd,
        "fuse" => report::Export::Fuse,
        "vhost-user-blk-libblkio" => report::Export::VhostBlkio,
        _ => usage(),
    }
}

/// `aio`'s options, and `--out`.
pub(crate) fn aio_options(args: &[String]) -> (aio::AioOptions, Option<PathBuf>) {
    let mut opts = aio::AioOptions::default();
    let mut out = None;
    let (mut policies, mut thinks) = (Vec::new(), Vec::new());
    for (flag, v) in flag_pairs(args) {
        match flag {
            "--duration-ms" => opts.duration = Duration::from_millis(parse(flag, v)),
            "--reactor" => opts.reactor = parse(flag, v),
            "--policy" => policies.push(parse(flag, v)),
            "--think-us" => thinks.push(parse(flag, v)),
            "--out" => out = Some(PathBuf::from(v)),
            _ => usage(),
        }
    }
    set_if_given(&mut opts.policies, policies);
    set_if_given(&mut opts.think_us, thinks);
    (opts, out)
}

/// `nbd`'s options, and `--out`.
pub(crate) fn nbd_options(args: &[String]) -> (nbd::NbdOptions, Option<PathBuf>) {
    let mut opts = nbd::NbdOptions::default();
    let mut m = MatrixFlags::default();
    for (flag, v) in flag_pairs(args) {
        match flag {
            _ if m.take(flag, v) => {}
            "--stord-policy" => opts.stord_policy = v.to_string(),
            "--file-aio" => opts.file_aio = v.to_string(),
            "--jobs" => opts.jobs = parse(flag, v),
            "--iothreads" => opts.iothreads = parse(flag, v),
            "--tls" => opts.tls = v == "on",
            "--tcp" => opts.tcp = v == "on",
            _ => usage(),
        }
    }
    let out = m.apply(
        &mut opts.runtime_s,
        &mut opts.reps,
        &mut opts.backends,
        &mut opts.daemons,
        Some(&mut opts.workloads),
    );
    (opts, out)
}

/// `fuse`'s options, and `--out`.
pub(crate) fn fuse_options(args: &[String]) -> (fuse::FuseOptions, Option<PathBuf>) {
    let mut opts = fuse::FuseOptions::default();
    let mut m = MatrixFlags::default();
    let mut threads = Vec::new();
    for (flag, v) in flag_pairs(args) {
        match flag {
            _ if m.take(flag, v) => {}
            "--iothreads" => threads.push(parse(flag, v)),
            _ => usage(),
        }
    }
    set_if_given(&mut opts.iothreads, threads);
    let out = m.apply(
        &mut opts.runtime_s,
        &mut opts.reps,
        &mut opts.backends,
        &mut opts.daemons,
        None,
    );
    (opts, out)
}

/// `vhost`'s options, and `--out`.
pub(crate) fn vhost_options(args: &[String]) -> (vhost::VhostOptions, Option<PathBuf>) {
    let mut opts = vhost::VhostOptions::default();
    let mut m = MatrixFlags::default();
    let mut clients = Vec::new();
    for (flag, v) in flag_pairs(args) {
        match flag {
            "--client" => clients.push(v.to_string()),
            "--queues" => opts.queues = parse(flag, v),
            "--iothreads" => opts.iothreads = Some(parse(flag, v)),
            "--think-us" => opts.think_us = parse(flag, v),
            "--think-spin" => opts.think_spin = parse::<String>(flag, v) == "on",
            _ if m.take(flag, v) => {}
            _ => usage(),
        }
    }
    set_if_given(&mut opts.clients, clients);
    let out = m.apply(
        &mut opts.runtime_s,
        &mut opts.reps,
        &mut opts.backends,
        &mut opts.daemons,
        Some(&mut opts.workloads),
    );
    (opts, out)
}

/// `load`'s options, and `--out`.
pub(crate) fn load_options(args: &[String]) -> (load::LoadOptions, Option<PathBuf>) {
    let mut opts = load::LoadOptions::default();
    let mut m = MatrixFlags::default();
    let (mut exports, mut loads) = (Vec::new(), Vec::new());
    for (flag, v) in flag_pairs(args) {
        match flag {
            _ if m.take(flag, v) => {}
            "--export" => exports.push(export_named(v)),
            // `--load 0`: flat out only.
            "--load" => loads.push(parse::<f64>(flag, v) / 100.0),
            "--pinned" => opts.pinned = v == "on",
            _ => usage(),
        }
    }
    set_if_given(&mut opts.exports, exports);
    set_if_given(&mut opts.fractions, loads);
    let workloads: Vec<report::Workload> = m
        .workloads
        .drain(..)
        .map(|(rw, qd)| load_workload(&rw, qd))
        .collect();
    set_if_given(&mut opts.workloads, workloads);
    let mut secs = opts.timing.runtime.as_secs();
    let out = m.apply(
        &mut secs,
        &mut opts.reps,
        &mut opts.backends,
        &mut opts.daemons,
        None,
    );
    opts.timing.runtime = Duration::from_secs(secs);
    (opts, out)
}

/// A `--workload RW[/BSk]:QD` of `load` (4k when no size is given).
fn load_workload(rw: &str, qd: u32) -> report::Workload {
    let (rw, bs) = rw.split_once('/').unwrap_or((rw, "4k"));
    let rw = match rw {
        "randread" => "randread",
        "randwrite" => "randwrite",
        "read" => "read",
        "write" => "write",
        _ => usage(),
    };
    let kib: u32 = parse("--workload", bs.trim_end_matches('k'));
    report::Workload {
        rw,
        bs: kib * 1024,
        qd,
    }
}

/// `timeline`'s options, and `--out`.
pub(crate) fn timeline_options(args: &[String]) -> (timeline::TimelineOptions, Option<PathBuf>) {
    let mut opts = timeline::TimelineOptions::default();
    let mut m = MatrixFlags::default();
    let mut exports = Vec::new();
    for (flag, v) in flag_pairs(args) {
        match flag {
            "--trace-ms" => opts.trace = Duration::from_millis(parse(flag, v)),
            "--export" => exports.push(export_named(v)),
            _ if m.take(flag, v) => {}
            _ => usage(),
        }
    }
    set_if_given(&mut opts.exports, exports);
    // The runtime follows from `--trace-ms`: a `--runtime` is taken and left unused.
    let mut secs = 0;
    let out = m.apply(
        &mut secs,
        &mut opts.reps,
        &mut opts.backends,
        &mut opts.daemons,
        None,
    );
    (opts, out)
}

/// `density`'s options, and `--out`.
pub(crate) fn density_options(args: &[String]) -> (density::DensityOptions, Option<PathBuf>) {
    let mut opts = density::DensityOptions::default();
    let mut m = MatrixFlags::default();
    let (mut shapes, mut transports) = (Vec::new(), Vec::new());
    for (flag, v) in flag_pairs(args) {
        match flag {
            _ if m.take(flag, v) => {}
            "--shape" => shapes.push(parse(flag, v)),
            "--transport" => transports.push(match v {
                "nbd" => density::Transport::Nbd,
                "vhost-user-blk" | "vhost" => density::Transport::Vhost,
                _ => usage(),
            }),
            "--ramp" => opts.ramp = Duration::from_secs(parse(flag, v)),
            "--flat-out" => {
                opts.variants = match v {
                    "on" => vec!["light", "flat-out"],
                    "off" => vec!["light"],
                    "only" => vec!["flat-out"],
                    _ => usage(),
                }
            }
            "--idle" => opts.idle = Duration::from_secs(parse(flag, v)),
            "--load" => opts.load = parse::<f64>(flag, v) / 100.0,
            "--total-iops" => opts.total_iops = Some(parse(flag, v)),
            _ => usage(),
        }
    }
    set_if_given(&mut opts.shapes, shapes);
    set_if_given(&mut opts.transports, transports);
    let mut secs = opts.runtime.as_secs();
    let out = m.apply(
        &mut secs,
        &mut opts.reps,
        &mut opts.backends,
        &mut opts.daemons,
        None,
    );
    opts.runtime = Duration::from_secs(secs);
    (opts, out)
}

/// `idle`'s seconds, and `--out`.
pub(crate) fn idle_options(args: &[String]) -> (u64, Option<PathBuf>) {
    let mut secs = 10;
    let mut out = None;
    for (flag, v) in flag_pairs(args) {
        match flag {
            "--seconds" => secs = parse(flag, v),
            "--out" => out = Some(PathBuf::from(v)),
            _ => usage(),
        }
    }
    (secs, out)
}

/// `report`'s options (`--out` among them).
pub(crate) fn report_options(args: &[String]) -> report::ReportOptions {
    let mut opts = report::ReportOptions::default();
    let mut exports = Vec::new();
    for (flag, v) in flag_pairs(args) {
        match flag {
            "--runtime-ms" => {
                opts.timing.runtime = Duration::from_millis(parse(flag, v));
            }
            "--ramp-ms" => opts.timing.ramp = Duration::from_millis(parse(flag, v)),
            "--reps" => opts.reps = parse(flag, v),
            "--export" => exports.push(report_export(v)),
            "--quick" => {
                if on_off(flag, v) {
                    opts.quick = true;
                    opts.timing.runtime = Duration::from_secs(1);
                    opts.timing.ramp = Duration::from_millis(250);
                    opts.reps = 2;
                }
            }
            "--all-engines" => opts.all_engines = on_off(flag, v),
            "--extras" => opts.extras = on_off(flag, v),
            "--docs" => opts.docs = on_off(flag, v),
            "--out" => opts.out = Some(PathBuf::from(v)),
            _ => usage(),
        }
    }
    set_if_given(&mut opts.exports, exports);
    opts
}

/// The exports the report can run.
fn report_export(v: &str) -> report::Export {
    match v {
        "nbd" => report::Export::Nbd,
        "fuse" => report::Export::Fuse,
        "vhost-user-blk" | "vhost" => report::Export::Vhost,
        "vhost-user-blk-libblkio" => report::Export::VhostBlkio,
        "vhost-user-blk-libblkio-poll" => report::Export::VhostBlkioPoll,
        _ => usage(),
    }
}

/// A flag that takes `on` or `off`.
fn on_off(flag: &str, v: &str) -> bool {
    match v {
        "on" => true,
        "off" => false,
        _ => {
            eprintln!("stord-bench: {flag} takes on or off");
            usage()
        }
    }
}

pub(crate) fn crash_options(args: &[String]) -> (crash::Options, Option<PathBuf>) {
    let mut o = crash::Options::default();
    let (mut daemons, mut workloads, mut out) = (Vec::new(), Vec::new(), None);
    for (flag, v) in flag_pairs(args) {
        match flag {
            "--daemon" => daemons.push(v.to_string()),
            "--workload" => workloads.push(v.to_string()),
            "--points" => o.points = parse(flag, v),
            "--seed" => o.seed = parse(flag, v),
            "--stord" => o.stord = Some(PathBuf::from(v)),
            "--dir" => o.dir = PathBuf::from(v),
            "--lose-every" => o.lose_every = parse(flag, v),
            "--out" => out = Some(PathBuf::from(v)),
            _ => usage(),
        }
    }
    set_if_given(&mut o.daemons, daemons);
    set_if_given(&mut o.workloads, workloads);
    (o, out)
}
