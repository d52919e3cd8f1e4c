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
//! - `density [--shape N]... [--transport nbd|vhost-user-blk]... [--backend B]... [--daemon D]...
//!   [--runtime S] [--reps N] [--flat-out on|off] [--idle S] [--load PCT]`: many light
//!   guests, an IoThread and an export each, paced at QD1 to PCT % (50) of the slower
//!   daemon's one-export maximum, with one client flat out in a variant: the daemons' CPU,
//!   pooled and worst-client latency, memory per export and idle cost. `--daemon floor`
//!   adds a minimal NBD server whose CPU per request is the kernel's own share.
//! - `floor-server DAEMON-ARGS`: that minimal server (its NBD socket and pidfile taken
//!   from a daemon's command line), for `density --daemon floor`.
//! - `crash [--daemon stord|qsd]... [--workload W]... [--points N] [--seed S] [--stord PATH]
//!   [--dir DIR]`: crash consistency by replay: qcow2 workloads written through
//!   `blklogwrites`, the log replayed to flush points and torn points between them, each
//!   checked with `qemu-img check` and against what the guest wrote (exits 1 on a failure).
//! - `replay LOG DEVICE [--entries N]`: replays a dm-log-writes log (stord's, qsd's or
//!   Linux's) onto a copy of the device it logged.
//! - `report-docs FILE.json`: regenerates the docs from an earlier report's JSON.

mod aio;
mod cli;
mod crash;
mod daemon_args;
mod density;
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

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use cli::usage;

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

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first().map(String::as_str) else {
        usage()
    };
    let flags = &args[1..];
    match cmd {
        "aio" => bench_aio(flags),
        "nbd" => bench_nbd(flags),
        "fuse" => bench_fuse(flags),
        "vhost" => bench_vhost(flags),
        "load" => bench_load(flags),
        "timeline" => bench_timeline(flags),
        "idle" => bench_idle(flags),
        "density" => bench_density(flags),
        "floor-server" => density::floor::serve_command(flags),
        "crash" => bench_crash(flags),
        "replay" => {
            if let Err(e) = crash::log::replay_command(flags) {
                eprintln!("stord-bench replay: {e}");
                std::process::exit(1);
            }
        }
        "report" => {
            report::run(&cli::report_options(flags));
        }
        "report-docs" => match flags {
            [file] => report::generate_docs(Path::new(file)),
            _ => usage(),
        },
        _ => usage(),
    }
}

fn bench_aio(flags: &[String]) {
    let (opts, out) = cli::aio_options(flags);
    let cases = aio::run(&opts);
    let doc = serde_json::json!({
        "benchmark": "aio-remote-round-trip",
        "duration_ms": opts.duration.as_millis() as u64,
        "cases": cases,
    });
    write_results(out, "aio", doc, None);
}

fn bench_nbd(flags: &[String]) {
    let (opts, out) = cli::nbd_options(flags);
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

fn bench_fuse(flags: &[String]) {
    let (opts, out) = cli::fuse_options(flags);
    let rows = fuse::run(&opts);
    let doc = serde_json::json!({ "runtime_s": opts.runtime_s, "reps": opts.reps });
    write_rows(out, "fuse", "fuse-fio", &rows, doc);
}

fn bench_vhost(flags: &[String]) {
    let (opts, out) = cli::vhost_options(flags);
    let (rows, counters) = vhost::run(&opts);
    let doc = serde_json::json!({
        "runtime_s": opts.runtime_s,
        "reps": opts.reps,
        "queues": opts.queues,
        "counters": counters,
    });
    write_rows(out, "vhost", "vhost-user-blk-frontend", &rows, doc);
}

fn bench_load(flags: &[String]) {
    let (opts, out) = cli::load_options(flags);
    let rows = load::run(&opts);
    let md = load::markdown(&rows, &opts.daemons);
    println!("{md}");
    let doc = serde_json::json!({
        "benchmark": "equal-offered-load",
        "runtime_s": opts.timing.runtime.as_secs(),
        "ramp_ms": opts.timing.ramp.as_millis() as u64,
        "reps": opts.reps,
        "pinned": opts.pinned,
        "kernel": kernel_release(),
        "rows": rows,
    });
    write_results(out, "load", doc, Some(&md));
}

fn bench_timeline(flags: &[String]) {
    let (opts, out) = cli::timeline_options(flags);
    let traces = timeline::run(&opts);
    let md = timeline::markdown(&traces);
    println!("{md}");
    let doc = serde_json::json!({
        "benchmark": "qd1-timeline",
        "trace_ms": opts.trace.as_millis() as u64,
        "kernel": kernel_release(),
        "gaps": timeline::GAPS,
        "traces": traces,
    });
    write_results(out, "timeline", doc, Some(&md));
}

fn bench_density(flags: &[String]) {
    let (opts, out) = cli::density_options(flags);
    let d = density::run(&opts);
    let md = density::report::markdown(&d);
    println!("{md}");
    let doc = serde_json::json!({
        "benchmark": "density",
        "runtime_s": opts.runtime.as_secs(),
        "ramp_s": opts.ramp.as_secs(),
        "reps": opts.reps,
        "load": opts.load,
        "total_iops": opts.total_iops,
        "idle_s": opts.idle.as_secs(),
        "kernel": kernel_release(),
        "result": d,
    });
    write_results(out, "density", doc, Some(&md));
}

fn bench_crash(flags: &[String]) {
    let (opts, out) = cli::crash_options(flags);
    let rs = crash::run(&opts);
    let md = crash::markdown(&rs);
    println!("{md}");
    let passed = rs.iter().all(crash::Outcome::passed);
    let doc = serde_json::json!({
        "benchmark": "crash-replay",
        "points_per_workload": opts.points,
        "seed": opts.seed,
        "passed": passed,
        "outcomes": rs,
    });
    write_results(out, "crash", doc, Some(&md));
    if !passed {
        std::process::exit(1);
    }
}

fn bench_idle(flags: &[String]) {
    let (secs, out) = cli::idle_options(flags);
    let rows = idle::run(secs);
    write_results(
        out,
        "idle",
        serde_json::json!({ "benchmark": "idle-cost", "rows": rows }),
        None,
    );
}

/// The running kernel's release (empty if unreadable).
fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}
