//! `stord-bench report`: the whole comparison in one command, about 50 minutes on a 2-vCPU
//! machine (5 s per case after a ramp, 3 repetitions), written to
//! `results/report/<time>.json` and turned into docs/benchmarks.md, its plots and the
//! README's headline by scripts/bench_report.py, which gives every ratio its interval over
//! the repetitions and a verdict (ahead, behind, within noise). `--quick` (1 s, 2
//! repetitions, a few minutes) is for checking a change and is labelled as such.
//!
//! The matrix keeps the run under 45 minutes by where it looks: on the null device, where
//! the daemons differ most, NBD (fio's nbd engine) gets every stord polling policy, qsd
//! with its default polling and with poll-max-ns=0, and nbdkit; FUSE (fio on the mount) and
//! vhost-user-blk through libblkio (blocking and poll queues) get stord-classic,
//! stord-haltpoll and qsd; all five workloads (4k randread/randwrite at QD1 and QD16, 64k
//! sequential read at QD16). On the O_DIRECT file (io_uring) and on the fast device (a
//! loop device with direct I/O over a file in /dev/shm, `host_device`) every export gets
//! stord-classic, qsd and fio on the medium itself as the floor, for 4k randread QD1/QD16
//! and randwrite QD16. Every daemon is started fresh for its run of the workloads; for each
//! (export, backend) the daemons take turns (A B C, A B C, ...) once per repetition so drift
//! hits all alike. Our own vhost-user frontend (`--export vhost-user-blk`) and the other
//! file engines can be asked for; they are not in the default set.
//! Then the extras: policies against offered load, the poll window over time, linux-aio
//! harvests, the wake-up scenario and the idle cost.

mod extras;
pub(crate) mod session;
mod wakeup;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use stord_aio::{PolicyKind, ReactorKind};

pub use session::{Export, Workload};
use session::{Running, Session, Timing};

use crate::matrix::median;
use crate::media::{Media, Paths, IMAGE_SIZE};
use crate::peers::{repo_root, stord_binary, FioResult};

/// Options of the report.
pub struct ReportOptions {
    pub timing: Timing,
    pub reps: usize,
    pub exports: Vec<Export>,
    /// Also run the extras (curves, window, harvest, wake-up, idle).
    pub extras: bool,
    /// Regenerate docs/benchmarks.md, the plots and the README headline.
    pub docs: bool,
    /// A quick look (short runs): labelled so, never quoted in the README.
    pub quick: bool,
    /// Every file engine (io_uring, native, threads), not only io_uring.
    pub all_engines: bool,
    pub out: Option<PathBuf>,
}

impl Default for ReportOptions {
    fn default() -> Self {
        Self {
            timing: Timing {
                ramp: Duration::from_millis(500),
                runtime: Duration::from_secs(5),
            },
            reps: 3,
            exports: vec![
                Export::Nbd,
                Export::Fuse,
                Export::VhostBlkio,
                Export::VhostBlkioPoll,
            ],
            quick: false,
            all_engines: false,
            extras: true,
            docs: true,
            out: None,
        }
    }
}

pub const WORKLOADS: [Workload; 5] = [
    Workload {
        rw: "randread",
        bs: 4096,
        qd: 1,
    },
    Workload {
        rw: "randwrite",
        bs: 4096,
        qd: 1,
    },
    Workload {
        rw: "randread",
        bs: 4096,
        qd: 16,
    },
    Workload {
        rw: "randwrite",
        bs: 4096,
        qd: 16,
    },
    Workload {
        rw: "read",
        bs: 65536,
        qd: 16,
    },
];

const BACKENDS: [&str; 5] = [
    "null",
    "file-io_uring",
    "dev",
    "file-native",
    "file-threads",
];

/// The workloads (indices into [`WORKLOADS`]) run on `backend`: all on the null device, the
/// 4k ones that matter for a disk on files and on the fast device.
fn workloads(backend: &str) -> Vec<usize> {
    if backend == "null" {
        (0..WORKLOADS.len()).collect()
    } else {
        vec![0, 2, 3]
    }
}
const STORD: [&str; 4] = [
    "stord-off",
    "stord-classic",
    "stord-weighted",
    "stord-haltpoll",
];

/// The daemons compared on `export` with `backend`.
fn daemons(export: Export, backend: &str) -> Vec<&'static str> {
    if export == Export::Raw {
        return vec!["fio-raw"];
    }
    let mut d: Vec<&str> = if backend != "null" {
        vec!["stord-classic", "qsd"]
    } else if export == Export::Nbd {
        let mut d = STORD.to_vec();
        d.extend(["qsd", "qsd-poll0"]);
        d
    } else {
        vec!["stord-classic", "stord-haltpoll", "qsd"]
    };
    // nbdkit has no aio modes: its file plugin does pread/pwrite from a thread pool.
    if export == Export::Nbd && matches!(backend, "null" | "file-threads") {
        d.push("nbdkit");
    }
    // The floor takes its turn between the daemons: the virtual disk's speed drifts by
    // 2-5x over a run, so a floor measured once at the start compares nothing.
    if backend.starts_with("file-") || backend == "dev" {
        d.push("fio-raw");
    }
    d
}

fn backends(export: Export, all_engines: bool) -> Vec<&'static str> {
    match export {
        Export::Raw => vec!["file"],
        // Poll queues compare the clients on the null device only.
        Export::VhostBlkioPoll => vec!["null"],
        Export::Nbd | Export::Fuse | Export::Vhost if all_engines => BACKENDS.to_vec(),
        _ => vec!["null", "file-io_uring", "dev"],
    }
}

/// A progress bar with an ETA from estimated step lengths, corrected by how long the
/// steps so far really took.
struct Progress {
    start: Instant,
    total_est: f64,
    done_est: f64,
    steps: usize,
    done: usize,
}

impl Progress {
    fn new(total_est: f64, steps: usize) -> Self {
        Self {
            start: Instant::now(),
            total_est,
            done_est: 0.0,
            steps,
            done: 0,
        }
    }

    /// Announces a step of about `est` seconds.
    fn step(&mut self, est: f64, what: &str) {
        let elapsed = self.start.elapsed().as_secs_f64();
        let speed = if self.done_est > 0.0 {
            elapsed / self.done_est
        } else {
            1.0
        };
        let left = (self.total_est - self.done_est).max(0.0) * speed;
        let frac = (self.done_est / self.total_est).min(1.0);
        let filled = (frac * 30.0) as usize;
        eprintln!(
            "[{}{}] {:>3.0}% {:>3}/{} {} elapsed, ETA {} | {what}",
            "#".repeat(filled),
            ".".repeat(30 - filled),
            frac * 100.0,
            self.done + 1,
            self.steps,
            mmss(elapsed),
            mmss(left),
        );
        self.done_est += est;
        self.done += 1;
    }
}

fn mmss(s: f64) -> String {
    let s = s as u64;
    format!("{}:{:02}", s / 60, s % 60)
}

/// One (export, backend, workload, daemon) case: medians over the repetitions.
#[derive(Debug, Serialize)]
pub struct ReportRow {
    pub export: String,
    pub backend: String,
    pub workload: String,
    pub bs: String,
    pub iodepth: u32,
    pub daemon: String,
    pub iops: f64,
    pub mbps: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub cpu_us_per_io: Option<f64>,
    pub iops_spread: f64,
    /// Daemon and client pinned to separate CPUs (the placement pass).
    pub pinned: bool,
    pub runs: Vec<RunResult>,
}

/// One repetition of a case.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    #[serde(flatten)]
    pub fio: FioResult,
    pub cpu_us_per_io: Option<f64>,
}

fn summarize(key: &CaseKey, runs: Vec<RunResult>) -> ReportRow {
    let iops: Vec<f64> = runs.iter().map(|r| r.fio.iops).collect();
    let med = median(iops.clone());
    let hi = iops.iter().cloned().fold(f64::MIN, f64::max);
    let lo = iops.iter().cloned().fold(f64::MAX, f64::min);
    let cpu: Vec<f64> = runs.iter().filter_map(|r| r.cpu_us_per_io).collect();
    let w = &WORKLOADS[key.workload];
    ReportRow {
        export: key.export.name().to_string(),
        backend: key.backend.to_string(),
        workload: w.rw.to_string(),
        bs: w.bs_label(),
        iodepth: w.qd,
        daemon: key.daemon.to_string(),
        iops: med,
        mbps: med * f64::from(w.bs) / 1e6,
        mean_us: median(runs.iter().map(|r| r.fio.mean_us).collect()),
        p50_us: median(runs.iter().map(|r| r.fio.p50_us).collect()),
        p99_us: median(runs.iter().map(|r| r.fio.p99_us).collect()),
        cpu_us_per_io: (!cpu.is_empty()).then(|| median(cpu)),
        iops_spread: if med > 0.0 { (hi - lo) / med } else { 0.0 },
        pinned: key.pinned,
        runs,
    }
}

/// One block of the run: these daemons take turns on one export and backend, each serving
/// these workloads, pinned or floating.
struct Block {
    export: Export,
    backend: &'static str,
    daemons: Vec<&'static str>,
    workloads: Vec<usize>,
    pinned: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CaseKey {
    export: Export,
    backend: &'static str,
    workload: usize,
    daemon: &'static str,
    pinned: bool,
}

/// The placement pass: the headline cases again with daemon and client pinned to separate
/// CPUs (every daemon alike), beside the unpinned rows. Exports, daemons, workloads.
const PINNED_EXPORTS: [Export; 3] = [Export::Nbd, Export::Fuse, Export::VhostBlkio];
const PINNED_DAEMONS: [&str; 3] = ["stord-classic", "stord-haltpoll", "qsd"];
const PINNED_WORKLOADS: [usize; 2] = [2, 0];

/// The wake-up scenario's targets: (label, export, daemon).
const WAKEUP: [(&str, Export, &str); 5] = [
    ("raw file", Export::Raw, "fio-raw"),
    ("stord NBD", Export::Nbd, "stord-classic"),
    ("qsd NBD", Export::Nbd, "qsd"),
    ("stord FUSE", Export::Fuse, "stord-classic"),
    ("qsd FUSE", Export::Fuse, "qsd"),
];

const CURVE_DAEMONS: [&str; 6] = [
    "stord-off",
    "stord-classic",
    "stord-weighted",
    "stord-haltpoll",
    "qsd",
    "qsd-poll0",
];

fn first_line(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_string)
        })
        .unwrap_or_else(|| "?".into())
}

/// Installs what is missing (qsd, nbdkit, fio, matplotlib: scripts/install-deps.sh).
fn install_deps() {
    let st = Command::new("bash")
        .arg(repo_root().join("scripts/install-deps.sh"))
        .status()
        .expect("run scripts/install-deps.sh");
    assert!(st.success(), "scripts/install-deps.sh failed");
}

/// Runs the report; returns the path of the JSON it wrote.
pub fn run(opts: &ReportOptions) -> PathBuf {
    install_deps();
    let stord = stord_binary();
    eprintln!("report: stord at {}", stord.display());
    let media = Media::prepare(&media_backends(opts));
    let paths = media.paths("file-io_uring", "report");
    let dev_paths = media.paths("dev", "report");
    let t = opts.timing;
    let run_s = (t.ramp + t.runtime).as_secs_f64() + 0.35;

    let blocks = plan(opts);
    let (est, steps) = estimate(&blocks, opts, run_s);
    let mut prog = Progress::new(est, steps);
    let started = Instant::now();

    let mut matrix = MatrixRun {
        opts,
        prog: &mut prog,
        run_s,
        results: HashMap::new(),
        order: Vec::new(),
        restarts: HashMap::new(),
    };
    for block in blocks {
        let block_paths = if block.backend == "dev" {
            &dev_paths
        } else {
            &paths
        };
        matrix.run_block(&block, block_paths);
    }
    let (rows, restarts) = matrix.into_rows();
    let mut doc = report_doc(opts, rows, restarts);

    if opts.extras {
        run_extras(&mut doc, &t, &paths, &mut prog, run_s);
    }
    let _ = std::fs::remove_file(&paths.sock);
    let _ = std::fs::remove_file(&paths.mnt);

    doc["duration_s"] = started.elapsed().as_secs_f64().into();
    let path = write_report(opts, doc);
    eprintln!(
        "report: {} in {}, results in {}",
        steps,
        mmss(started.elapsed().as_secs_f64()),
        path.display()
    );
    if opts.docs {
        generate_docs(&path);
    }
    path
}

/// The media to prepare: the image file always (the extras use it), the fast device if an
/// export runs on it.
fn media_backends(opts: &ReportOptions) -> Vec<&'static str> {
    let mut media_backends = vec!["file-io_uring"];
    if opts
        .exports
        .iter()
        .any(|&e| backends(e, opts.all_engines).contains(&"dev"))
    {
        media_backends.push("dev");
    }
    media_backends
}

/// The plan: the matrix, then the placement pass over the headline cases.
fn plan(opts: &ReportOptions) -> Vec<Block> {
    let exports = opts.exports.clone();
    let all = opts.all_engines;
    let mut blocks: Vec<Block> = exports
        .iter()
        .flat_map(|&e| {
            backends(e, all).into_iter().map(move |b| Block {
                export: e,
                backend: b,
                daemons: daemons(e, b),
                workloads: workloads(b),
                pinned: false,
            })
        })
        .collect();
    blocks.extend(
        exports
            .iter()
            .filter(|e| PINNED_EXPORTS.contains(e))
            .map(|&e| Block {
                export: e,
                backend: "null",
                daemons: PINNED_DAEMONS.to_vec(),
                workloads: PINNED_WORKLOADS.to_vec(),
                pinned: true,
            }),
    );
    blocks
}

/// The estimated seconds and the steps of the whole run, the extras included.
fn estimate(blocks: &[Block], opts: &ReportOptions, run_s: f64) -> (f64, usize) {
    let matrix_runs: usize = blocks
        .iter()
        .map(|b| b.daemons.len() * b.workloads.len())
        .sum::<usize>()
        * opts.reps;
    let (mut est, mut steps) = (matrix_runs as f64 * run_s, matrix_runs);
    if opts.extras {
        est += 3.0 * 1.9 + 2.0 * run_s + 30.0 * run_s + 10.0 * 2.0 + 11.0;
        steps += 3 + 2 + CURVE_DAEMONS.len() * extras::THINKTIMES_US.len() + 10 + 1;
    }
    (est, steps)
}

/// The matrix as it runs: the repetitions of each case, in the order the cases were first
/// run, and the daemons that had to be started again.
struct MatrixRun<'a> {
    opts: &'a ReportOptions,
    prog: &'a mut Progress,
    run_s: f64,
    results: HashMap<CaseKey, Vec<RunResult>>,
    order: Vec<CaseKey>,
    restarts: HashMap<String, usize>,
}

impl MatrixRun<'_> {
    /// Every repetition of `b`: its daemons in turn, each serving all its workloads.
    fn run_block(&mut self, b: &Block, p: &Paths) {
        for rep in 0..self.opts.reps {
            for &daemon in &b.daemons {
                self.daemon_turn(b, daemon, rep, p);
            }
        }
    }

    /// One daemon, started fresh, through the block's workloads.
    fn daemon_turn(&mut self, b: &Block, daemon: &'static str, rep: usize, p: &Paths) {
        let (export, backend, pinned) = (b.export, b.backend, b.pinned);
        let t = self.opts.timing;
        let mut s = if pinned {
            Session::start_pinned(export, backend, daemon, p)
        } else {
            Session::start(export, backend, daemon, p)
        };
        for &wi in &b.workloads {
            let w = &WORKLOADS[wi];
            self.prog.step(
                self.run_s,
                &format!(
                    "{} {backend} {} {daemon}{} (rep {}/{})",
                    export.name(),
                    w.label(),
                    if pinned { ", pinned" } else { "" },
                    rep + 1,
                    self.opts.reps
                ),
            );
            let (r, cpu_us, _) = s.run(w, &t, p, &[]);
            let ios = r.iops * (t.ramp + t.runtime).as_secs_f64();
            let key = CaseKey {
                export,
                backend,
                workload: wi,
                daemon,
                pinned,
            };
            if !self.results.contains_key(&key) {
                self.order.push(key.clone());
            }
            self.results.entry(key).or_default().push(RunResult {
                fio: r,
                cpu_us_per_io: cpu_us.map(|c| c / ios.max(1.0)),
            });
        }
        if s.restarts > 0 {
            *self
                .restarts
                .entry(format!("{daemon} {} {backend}", export.name()))
                .or_insert(0) += s.restarts;
        }
    }

    /// The rows, in the order the cases ran, and the restarts per daemon.
    fn into_rows(mut self) -> (Vec<ReportRow>, HashMap<String, usize>) {
        let rows = self
            .order
            .iter()
            .map(|k| summarize(k, self.results.remove(k).unwrap_or_default()))
            .collect();
        (rows, self.restarts)
    }
}

/// The report's document: the machine, the parameters and the matrix.
fn report_doc(
    opts: &ReportOptions,
    matrix: Vec<ReportRow>,
    restarts: HashMap<String, usize>,
) -> Value {
    let t = opts.timing;
    json!({
        "benchmark": "report",
        "command": "cargo run --release -p stord-bench -- report",
        "machine": {
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "kernel": first_line("uname", &["-r"]),
            "qsd": first_line("qemu-storage-daemon", &["--version"]),
            "nbdkit": first_line("nbdkit", &["--version"]),
            "fio": first_line("fio", &["--version"]),
            "reactor": std::env::var("STORD_AIO_REACTOR").unwrap_or_else(|_| "io_uring".into()),
        },
        "params": {
            "runtime_s": t.runtime.as_secs_f64(),
            "ramp_ms": t.ramp.as_millis() as u64,
            "reps": opts.reps,
            "quick": opts.quick,
            "image_bytes": IMAGE_SIZE,
        },
        "matrix": matrix,
        "daemon_restarts": restarts,
    })
}

/// The extras, into `doc`: the poll window over time, linux-aio harvests, the offered load
/// curves, the wake-up scenario and the idle cost.
fn run_extras(doc: &mut Value, t: &Timing, paths: &Paths, prog: &mut Progress, run_s: f64) {
    let policies = [
        PolicyKind::Classic,
        PolicyKind::Weighted,
        PolicyKind::Haltpoll,
    ];
    for p in policies {
        prog.step(1.9, &format!("poll window trace, {p}"));
    }
    doc["window_trace"] = extras::window_trace(&policies, ReactorKind::IoUring);

    doc["harvest"] = extras::harvest(t, paths, || {
        prog.step(run_s, "linux-aio completions per harvest")
    });

    let mut curves = Vec::new();
    for d in CURVE_DAEMONS {
        curves.extend(extras::curve(d, t, paths, || {
            prog.step(run_s, &format!("offered load curve, {d}"))
        }));
    }
    doc["curves"] = serde_json::to_value(curves).unwrap();

    doc["wakeup"] = wakeup_scenario(paths, prog);

    prog.step(11.0, "idle cost (10 s, all daemons side by side)");
    doc["idle"] = serde_json::to_value(crate::idle::run(10)).unwrap();
}

/// The wake-up scenario on each of [`WAKEUP`], twice.
fn wakeup_scenario(paths: &Paths, prog: &mut Progress) -> Value {
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); WAKEUP.len()];
    for rep in 0..2 {
        for (i, (label, export, daemon)) in WAKEUP.iter().enumerate() {
            prog.step(2.0, &format!("wake-up scenario, {label} (rep {})", rep + 1));
            let s = Session::start(*export, "file-io_uring", daemon, paths);
            secs[i].push(match s.running {
                Running::Raw => wakeup::file(&paths.img),
                Running::Fuse(_) => wakeup::file(&paths.mnt),
                Running::Nbd(..) => wakeup::nbd(&paths.sock, "disk"),
                Running::Vhost(_) => unreachable!(),
            });
        }
    }
    WAKEUP
        .iter()
        .zip(secs)
        .map(|((label, export, daemon), s)| {
            json!({
                "target": label,
                "export": export.name(),
                "daemon": daemon,
                "median_s": median(s.clone()),
                "seconds": s,
            })
        })
        .collect()
}

/// Writes `doc` (with the time and its own path) to `results/report/<time>.json`, or under
/// `--out`; returns the path.
fn write_report(opts: &ReportOptions, mut doc: Value) -> PathBuf {
    let out_dir = opts
        .out
        .clone()
        .unwrap_or_else(|| repo_root().join("results"))
        .join("report");
    std::fs::create_dir_all(&out_dir).expect("create results/report");
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let path = out_dir.join(format!("{ts}.json"));
    doc["unix_time"] = ts.into();
    doc["results_path"] = path
        .strip_prefix(repo_root())
        .unwrap_or(&path)
        .display()
        .to_string()
        .into();
    std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).expect("write results");
    path
}

/// Regenerates docs/benchmarks.md, docs/plots/ and the README headline from `json`.
pub fn generate_docs(json: &std::path::Path) {
    let st = Command::new("/usr/bin/python3")
        .arg(repo_root().join("scripts/bench_report.py"))
        .arg(json)
        .status()
        .expect("run scripts/bench_report.py");
    assert!(st.success(), "scripts/bench_report.py failed");
}
