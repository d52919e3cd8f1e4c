//! stord-bench: benchmarks that print figures and write them to JSON under `results/`.
//!
//! Subcommands:
//! - `aio [--duration-ms N] [--reactor io_uring|epoll] [--policy P]... [--think-us N]...`:
//!   Remote round trips into an IoThread per polling policy and think time.
//! - `nbd [--runtime S] [--reps N] [--backend null|file|dev]... [--daemon stord|qsd|nbdkit]...
//!   [--workload randread:16]... [--stord-policy P] [--file-aio MODE]`: fio's nbd engine
//!   against stord, qemu-storage-daemon and nbdkit, with fio on the raw file as the floor
//!   (`dev`: a loop device with direct I/O over a file in /dev/shm, the fast-device medium,
//!   opened as `host_device`; fio on the device is the floor).
//!   A workload may name a block size: `--workload read/64k:16`. `--jobs N` runs N fio jobs
//!   (connections); `--iothreads N` spreads stord's export over N IoThreads.
//!   `--daemon stord-base` adds an earlier stord build (`STORD_BENCH_BASELINE=PATH`), for
//!   before/after comparisons in one run.
//! - `idle [--seconds N]`: CPU used by each daemon with two IoThreads and an export, idle.
//! - `vhost [--runtime S] [--reps N] [--backend null|file|dev]... [--daemon stord-POLICY|qsd]...
//!   [--workload randread:16]... [--client own|blkio|blkio-poll]... [--queues N] [--iothreads N] [--think-us N] [--think-spin on|off]`: our own
//!   vhost-user frontend or libblkio against the vhost-user-blk exports of stord (one row per
//!   polling policy) and qemu-storage-daemon.
//! - `fuse [--runtime S] [--reps N] [--backend null|file]... [--iothreads N]...
//!   [--daemon stord|qsd]...`: fio through the FUSE-mounted image, stord vs qsd.
//! - `report [--quick on|off] [--runtime-ms N] [--ramp-ms N] [--reps N] [--export nbd|fuse|vhost-user-blk|vhost-user-blk-libblkio|vhost-user-blk-libblkio-poll]...
//!   [--all-engines on|off] [--extras on|off] [--docs on|off] [--out DIR]`: everything
//!   above side by side in one run (5 s x 3 by default; `--quick on`: 1 s x 2, for a look
//!   only), then docs/benchmarks.md, its plots and the README headline regenerated.
//! - `load [--runtime S] [--reps N] [--export nbd|fuse|vhost-user-blk-libblkio]...
//!   [--backend file-io_uring|dev]... [--daemon D]... [--workload RW:QD]... [--load PCT]...
//!   [--pinned on|off]`: each daemon flat out (fio on the medium as the floor), then at
//!   PCT % (default 50 and 90) of the slower daemon's maximum: CPU per I/O (user and
//!   system), sleeps per I/O and latency at equal load.
//! - `timeline [--export E]... [--backend file-io_uring|dev]... [--daemon D]... [--reps N]
//!   [--trace-ms N]`: 4k random reads at QD1 traced with `perf record -a` (scheduler,
//!   system calls, io_uring, block layer), each request split into milestones: where the
//!   latency a daemon adds goes.
//! - `report-docs FILE.json`: regenerates the docs from an earlier report's JSON.

mod aio;
mod daemon_args;
mod fuse;
mod idle;
mod load;
mod matrix;
mod media;
mod nbd;
mod peers;
mod qmp;
mod report;
mod timeline;
mod vhost;
mod vhost_client;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn usage() -> ! {
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
         \x20      stord-bench report [--quick on|off] [--runtime-ms N] [--ramp-ms N] [--reps N] \
         [--export nbd|fuse|vhost-user-blk|vhost-user-blk-libblkio|vhost-user-blk-libblkio-poll]... \
         [--all-engines on|off] [--extras on|off] [--docs on|off] [--out DIR]\n\
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

/// Writes `doc` (plus the time) to `results/<kind>/<time>.json` (or under `--out`), and
/// `md` next to it if given.
fn write_results(out: Option<PathBuf>, kind: &str, mut doc: serde_json::Value, md: Option<&str>) {
    let dir = out
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../results"))
        .join(kind);
    std::fs::create_dir_all(&dir).expect("create results dir");
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    doc["unix_time"] = ts.into();
    let path = dir.join(format!("{ts}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).expect("write results");
    if let Some(md) = md {
        std::fs::write(dir.join(format!("{ts}.md")), md).expect("write results");
    }
    println!("results: {}", path.display());
}

/// Prints the rows as a table and writes them with the run's parameters.
fn write_rows(
    out: Option<PathBuf>,
    kind: &str,
    name: &str,
    rows: &[matrix::Row],
    mut doc: serde_json::Value,
) {
    let table = matrix::markdown(rows);
    println!("{table}");
    doc["benchmark"] = name.into();
    doc["rows"] = serde_json::to_value(rows).unwrap();
    write_results(out, kind, doc, Some(&table));
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

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first().map(String::as_str) else {
        usage()
    };
    let mut out = None;
    match cmd {
        "aio" => {
            let mut opts = aio::AioOptions::default();
            let (mut policies, mut thinks) = (Vec::new(), Vec::new());
            for (flag, v) in flag_pairs(&args[1..]) {
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
            let cases = aio::run(&opts);
            let doc = serde_json::json!({
                "benchmark": "aio-remote-round-trip",
                "duration_ms": opts.duration.as_millis() as u64,
                "cases": cases,
            });
            write_results(out, "aio", doc, None);
        }
        "nbd" => {
            let mut opts = nbd::NbdOptions::default();
            let mut m = MatrixFlags::default();
            for (flag, v) in flag_pairs(&args[1..]) {
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
            let rows = nbd::run(&opts);
            let doc = serde_json::json!({
                "runtime_s": opts.runtime_s,
                "reps": opts.reps,
                "stord_policy": opts.stord_policy,
                "file_aio": opts.file_aio,
                "tls": opts.tls,
                "tcp": opts.tcp,
            });
            write_rows(out, "nbd", "nbd-fio", &rows, doc);
        }
        "fuse" => {
            let mut opts = fuse::FuseOptions::default();
            let mut m = MatrixFlags::default();
            let mut threads = Vec::new();
            for (flag, v) in flag_pairs(&args[1..]) {
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
            let rows = fuse::run(&opts);
            let doc = serde_json::json!({ "runtime_s": opts.runtime_s, "reps": opts.reps });
            write_rows(out, "fuse", "fuse-fio", &rows, doc);
        }
        "vhost" => {
            let mut opts = vhost::VhostOptions::default();
            let mut m = MatrixFlags::default();
            let mut clients = Vec::new();
            for (flag, v) in flag_pairs(&args[1..]) {
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
            let (rows, counters) = vhost::run(&opts);
            let doc = serde_json::json!({
                "runtime_s": opts.runtime_s,
                "reps": opts.reps,
                "queues": opts.queues,
                "counters": counters,
            });
            write_rows(out, "vhost", "vhost-user-blk-frontend", &rows, doc);
        }
        "load" => {
            let mut opts = load::LoadOptions::default();
            let mut m = MatrixFlags::default();
            let (mut exports, mut loads) = (Vec::new(), Vec::new());
            for (flag, v) in flag_pairs(&args[1..]) {
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
                .map(|(rw, qd)| {
                    let (rw, bs) = rw.split_once('/').unwrap_or((&rw, "4k"));
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
                })
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
            let rows = load::run(&opts);
            let md = load::markdown(&rows, &opts.daemons);
            println!("{md}");
            let doc = serde_json::json!({
                "benchmark": "equal-offered-load",
                "runtime_s": secs,
                "ramp_ms": opts.timing.ramp.as_millis() as u64,
                "reps": opts.reps,
                "pinned": opts.pinned,
                "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
                "rows": rows,
            });
            write_results(out, "load", doc, Some(&md));
        }
        "timeline" => {
            let mut opts = timeline::TimelineOptions::default();
            let mut m = MatrixFlags::default();
            let mut exports = Vec::new();
            for (flag, v) in flag_pairs(&args[1..]) {
                match flag {
                    "--trace-ms" => opts.trace = Duration::from_millis(parse(flag, v)),
                    "--export" => exports.push(export_named(v)),
                    _ if m.take(flag, v) => {}
                    _ => usage(),
                }
            }
            set_if_given(&mut opts.exports, exports);
            let mut secs = 0;
            let out = m.apply(
                &mut secs,
                &mut opts.reps,
                &mut opts.backends,
                &mut opts.daemons,
                None,
            );
            let traces = timeline::run(&opts);
            let md = timeline::markdown(&traces);
            println!("{md}");
            let doc = serde_json::json!({
                "benchmark": "qd1-timeline",
                "trace_ms": opts.trace.as_millis() as u64,
                "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
                "gaps": timeline::GAPS,
                "traces": traces,
            });
            write_results(out, "timeline", doc, Some(&md));
        }
        "idle" => {
            let mut secs = 10;
            for (flag, v) in flag_pairs(&args[1..]) {
                match flag {
                    "--seconds" => secs = parse(flag, v),
                    "--out" => out = Some(PathBuf::from(v)),
                    _ => usage(),
                }
            }
            let rows = idle::run(secs);
            write_results(
                out,
                "idle",
                serde_json::json!({ "benchmark": "idle-cost", "rows": rows }),
                None,
            );
        }
        "report" => {
            let mut opts = report::ReportOptions::default();
            let mut exports = Vec::new();
            let on_off = |flag: &str, v: &str| match v {
                "on" => true,
                "off" => false,
                _ => {
                    eprintln!("stord-bench: {flag} takes on or off");
                    usage()
                }
            };
            for (flag, v) in flag_pairs(&args[1..]) {
                match flag {
                    "--runtime-ms" => {
                        opts.timing.runtime = Duration::from_millis(parse(flag, v));
                    }
                    "--ramp-ms" => opts.timing.ramp = Duration::from_millis(parse(flag, v)),
                    "--reps" => opts.reps = parse(flag, v),
                    "--export" => exports.push(match v {
                        "nbd" => report::Export::Nbd,
                        "fuse" => report::Export::Fuse,
                        "vhost-user-blk" | "vhost" => report::Export::Vhost,
                        "vhost-user-blk-libblkio" => report::Export::VhostBlkio,
                        "vhost-user-blk-libblkio-poll" => report::Export::VhostBlkioPoll,
                        _ => usage(),
                    }),
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
            report::run(&opts);
        }
        "report-docs" => match &args[1..] {
            [file] => report::generate_docs(std::path::Path::new(file)),
            _ => usage(),
        },
        _ => usage(),
    }
}
