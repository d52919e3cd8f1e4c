//! `stord-bench load`: the daemons at the same offered load. A daemon that completes more
//! I/Os per second also spends more CPU per second, so CPU per I/O at each daemon's own
//! maximum compares unequal work; here every daemon is first run flat out (with fio on
//! the medium itself as the floor), then again at a fixed rate (fio's `rate_iops`, or the
//! same pacing in the libblkio client) of 50 % and 90 % of the slower daemon's maximum,
//! and each is charged its user and system CPU and its sleeps (voluntary context switches)
//! per I/O at that load. The daemons take turns within every repetition, started afresh
//! for each run.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::matrix::median;
use crate::media::{Media, Paths};
use crate::peers::FioResult;
use crate::report::session::{Export, Measured, Session, Timing, Workload};

pub struct LoadOptions {
    pub timing: Timing,
    pub reps: usize,
    pub exports: Vec<Export>,
    /// `file-io_uring` (the O_DIRECT image file) and/or `dev` (the fast device).
    pub backends: Vec<String>,
    pub daemons: Vec<String>,
    pub workloads: Vec<Workload>,
    /// Offered loads, as fractions of the slower daemon's maximum.
    pub fractions: Vec<f64>,
    /// Daemon and client on separate CPUs.
    pub pinned: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            timing: Timing {
                ramp: Duration::from_millis(500),
                runtime: Duration::from_secs(5),
            },
            reps: 3,
            exports: vec![Export::Nbd, Export::Fuse, Export::VhostBlkio],
            backends: vec!["file-io_uring".into(), "dev".into()],
            daemons: vec!["stord-adaptive".into(), "qsd".into()],
            workloads: vec![
                Workload {
                    rw: "randread",
                    bs: 4096,
                    qd: 16,
                },
                Workload {
                    rw: "randread",
                    bs: 4096,
                    qd: 1,
                },
            ],
            fractions: vec![0.5, 0.9],
            pinned: false,
        }
    }
}

/// One repetition at one load.
#[derive(Debug, Clone, Serialize)]
pub struct LoadRun {
    #[serde(flatten)]
    pub fio: FioResult,
    pub user_us_per_io: Option<f64>,
    pub sys_us_per_io: Option<f64>,
    pub sleeps_per_io: Option<f64>,
}

/// One (export, medium, workload, load, daemon) case over its repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct LoadRow {
    pub export: String,
    pub backend: String,
    pub workload: String,
    /// `max`, or the offered load as a percentage of the slower daemon's maximum.
    pub load: String,
    pub offered_iops: Option<f64>,
    pub daemon: String,
    pub runs: Vec<LoadRun>,
}

impl LoadRow {
    fn med(&self, f: impl Fn(&LoadRun) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self.runs.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(v))
    }

    fn cpu(r: &LoadRun) -> Option<f64> {
        Some(r.user_us_per_io? + r.sys_us_per_io?)
    }

    fn range(&self, f: impl Fn(&LoadRun) -> Option<f64>) -> Option<(f64, f64)> {
        let v: Vec<f64> = self.runs.iter().filter_map(f).collect();
        let lo = v.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        (!v.is_empty()).then_some((lo, hi))
    }
}

fn measured(m: Measured, t: &Timing) -> LoadRun {
    // The daemon's use covers the ramp too; so does this count of I/Os.
    let ios = (m.fio.iops * (t.ramp + t.runtime).as_secs_f64()).max(1.0);
    let per_io = |ns: u64| ns as f64 / 1000.0 / ios;
    LoadRun {
        user_us_per_io: m.daemon.map(|d| per_io(d.user_ns)),
        sys_us_per_io: m.daemon.map(|d| per_io(d.sys_ns)),
        sleeps_per_io: m.daemon.map(|d| d.sleeps as f64 / ios),
        fio: m.fio,
    }
}

/// Runs the matrix and returns its rows.
pub fn run(opts: &LoadOptions) -> Vec<LoadRow> {
    let backends: Vec<&str> = opts.backends.iter().map(String::as_str).collect();
    let media = Media::prepare(&backends);
    let mut rows = Vec::new();
    for &export in &opts.exports {
        for &backend in &backends {
            let p = media.paths(backend, "load");
            for w in &opts.workloads {
                let case = Case {
                    opts,
                    export,
                    backend,
                    w,
                    p: &p,
                };
                rows.extend(case.run());
            }
            let _ = std::fs::remove_file(&p.sock);
            let _ = std::fs::remove_file(&p.mnt);
        }
    }
    rows
}

/// One (export, medium, workload).
struct Case<'a> {
    opts: &'a LoadOptions,
    export: Export,
    backend: &'a str,
    w: &'a Workload,
    p: &'a Paths,
}

impl Case<'_> {
    /// Flat out with the floor, then each load; the rows of every run.
    fn run(&self) -> Vec<LoadRow> {
        let mut out = self.turns("max", None, ["fio-raw"]);
        let slower = out
            .iter()
            .filter(|r| r.daemon != "fio-raw")
            .filter_map(|r| r.med(|x| Some(x.fio.iops)))
            .fold(f64::INFINITY, f64::min);
        if !slower.is_finite() || slower <= 0.0 {
            return out;
        }
        for &f in self.opts.fractions.iter().filter(|&&f| f > 0.0) {
            out.extend(self.turns(&format!("{:.0}%", f * 100.0), Some(slower * f), []));
        }
        out
    }

    /// The daemons (and `extra`) at `rate`: every repetition runs each once, in turn,
    /// started afresh.
    fn turns<const N: usize>(
        &self,
        load: &str,
        rate: Option<f64>,
        extra: [&str; N],
    ) -> Vec<LoadRow> {
        let (opts, export, backend, w) = (self.opts, self.export, self.backend, self.w);
        let mut rows: Vec<LoadRow> = opts
            .daemons
            .iter()
            .map(String::as_str)
            .chain(extra)
            .map(|daemon| LoadRow {
                export: export.name().into(),
                backend: backend.into(),
                workload: w.label(),
                load: load.into(),
                offered_iops: rate,
                daemon: daemon.into(),
                runs: Vec::new(),
            })
            .collect();
        let t = &opts.timing;
        for rep in 0..opts.reps {
            for r in rows.iter_mut() {
                eprintln!(
                    "load: {} {backend} {} {} {load}{}{} (rep {}/{})",
                    export.name(),
                    w.label(),
                    r.daemon,
                    rate.map_or(String::new(), |x| format!(" = {x:.0} IOPS")),
                    if opts.pinned { ", pinned" } else { "" },
                    rep + 1,
                    opts.reps
                );
                let mut s = if opts.pinned {
                    Session::start_pinned(export, backend, &r.daemon, self.p)
                } else {
                    Session::start(export, backend, &r.daemon, self.p)
                };
                let m = s.run_at(w, t, self.p, &[], rate);
                r.runs.push(measured(m, t));
            }
        }
        rows
    }
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.digits$}"))
}

/// `a / b` with the interval from the repetitions' extremes: [min a / max b, max a / min b].
fn ratio(a: Option<(f64, f64)>, b: Option<(f64, f64)>) -> Option<(f64, f64)> {
    let ((alo, ahi), (blo, bhi)) = (a?, b?);
    (blo > 0.0 && bhi > 0.0).then(|| (alo / bhi, ahi / blo))
}

/// The rows as markdown: one table per (export, medium, workload), CPU per I/O beside
/// the first daemon's (stord's) ratio to the last's (qsd's) with its interval, and at
/// QD1 the latency each daemon adds over the floor.
pub fn markdown(rows: &[LoadRow], daemons: &[String]) -> String {
    let mut s = String::new();
    let (first, last) = (daemons.first(), daemons.last());
    let mut groups: Vec<(&str, &str, &str)> = Vec::new();
    for r in rows {
        let k = (r.export.as_str(), r.backend.as_str(), r.workload.as_str());
        if !groups.contains(&k) {
            groups.push(k);
        }
    }
    for (export, backend, workload) in groups {
        let g: Vec<&LoadRow> = rows
            .iter()
            .filter(|r| r.export == export && r.backend == backend && r.workload == workload)
            .collect();
        let _ = writeln!(s, "\n### {export}, {backend}, {workload}\n");
        s.push_str(
            "| load | daemon | IOPS | p50 µs | p99 µs | user µs/IO | sys µs/IO | CPU µs/IO [range] | sleeps/IO | CPU × last [interval] |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &g {
            let cpu = r.range(LoadRow::cpu);
            // The first daemon against the last at the same load.
            let last_row = g
                .iter()
                .find(|x| x.load == r.load && Some(&x.daemon) == last)
                .filter(|_| Some(&r.daemon) == first && first != last);
            let vs = match last_row
                .and_then(|l| Some((ratio(cpu, l.range(LoadRow::cpu))?, l.med(LoadRow::cpu)?)))
            {
                Some(((lo, hi), theirs)) => {
                    let med = r.med(LoadRow::cpu).unwrap_or(0.0) / theirs;
                    format!("{med:.2} [{lo:.2}-{hi:.2}]")
                }
                None => String::new(),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {} | {} | {} | {} | {} {} | {} | {vs} |",
                r.load,
                r.daemon,
                r.med(|x| Some(x.fio.iops)).unwrap_or(0.0),
                fmt(r.med(|x| Some(x.fio.p50_us)), 1),
                fmt(r.med(|x| Some(x.fio.p99_us)), 1),
                fmt(r.med(|x| x.user_us_per_io), 2),
                fmt(r.med(|x| x.sys_us_per_io), 2),
                fmt(r.med(LoadRow::cpu), 2),
                cpu.map_or(String::new(), |(lo, hi)| format!("[{lo:.2}-{hi:.2}]")),
                fmt(r.med(|x| x.sleeps_per_io), 2),
            );
        }
        if let Some(line) = workload
            .ends_with(" QD1")
            .then(|| added_latency(&g, first, last))
            .flatten()
        {
            s.push('\n');
            s.push_str(&line);
            s.push('\n');
        }
    }
    s
}

/// At the maximum load: the mean latency each daemon adds over the floor, per repetition
/// (the floor ran between the daemons in the same turn), and the first daemon's share of
/// the last's with the interval over the repetitions.
fn added_latency(g: &[&LoadRow], first: Option<&String>, last: Option<&String>) -> Option<String> {
    let max = |d: &str| g.iter().find(|r| r.load == "max" && r.daemon == d);
    let raw = max("fio-raw")?;
    let (a, b) = (max(first?)?, max(last?)?);
    let added = |r: &LoadRow| -> Vec<f64> {
        r.runs
            .iter()
            .zip(&raw.runs)
            .map(|(x, f)| x.fio.mean_us - f.fio.mean_us)
            .collect()
    };
    let (aa, bb) = (added(a), added(b));
    let ratios: Vec<f64> = aa
        .iter()
        .zip(&bb)
        .filter(|(_, y)| **y > 0.0)
        .map(|(x, y)| x / y)
        .collect();
    if ratios.is_empty() {
        return None;
    }
    let lo = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    Some(format!(
        "Flat out, mean latency added over fio on the medium ({:.1} µs): {} {:.1} µs, {} {:.1} µs; {} / {} = {:.2} [{lo:.2}-{hi:.2}] over the repetitions.",
        median(raw.runs.iter().map(|r| r.fio.mean_us).collect()),
        a.daemon,
        median(aa),
        b.daemon,
        median(bb),
        a.daemon,
        b.daemon,
        median(ratios),
    ))
}
