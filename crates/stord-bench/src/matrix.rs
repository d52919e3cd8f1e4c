//! What the matrix benchmarks (nbd, fuse, vhost) share: their default workloads, fio's
//! options for a workload and fio on the raw medium (the floor every export is compared
//! to), and a [`Row`] of figures per (case, daemon) with medians over the repetitions and
//! its Markdown table.

use std::path::Path;

use serde::Serialize;

use crate::media::IMAGE_SIZE;
use crate::peers::{run_fio, FioResult};

/// 4k random reads and writes at QD1 and QD16.
pub(crate) fn default_workloads() -> Vec<(String, u32)> {
    vec![
        ("randread".into(), 1),
        ("randwrite".into(), 1),
        ("randread".into(), 16),
        ("randwrite".into(), 16),
    ]
}

/// One daemon's figures for one case (medians over the repetitions).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub backend: String,
    pub workload: String,
    pub iodepth: u32,
    pub daemon: String,
    pub iops: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub cpu_us_per_io: Option<f64>,
    pub iops_spread: f64,
    pub runs: Vec<FioResult>,
}

/// fio options of a workload: `rw` is fio's `--rw`, optionally with a block size after a
/// slash (`read/64k`; 4k when absent).
pub(crate) fn fio_common(rw: &str, qd: u32, runtime: u64) -> Vec<String> {
    let (rw, bs) = rw.split_once('/').unwrap_or((rw, "4k"));
    vec![
        "--name=bench".into(),
        format!("--rw={rw}"),
        format!("--bs={bs}"),
        format!("--iodepth={qd}"),
        "--time_based".into(),
        format!("--runtime={runtime}"),
        "--ramp_time=1".into(),
        format!("--size={IMAGE_SIZE}"),
        "--norandommap".into(),
        "--randrepeat=0".into(),
    ]
}

/// fio itself on the raw file (io_uring, O_DIRECT): the floor every export is compared to.
pub(crate) fn fio_raw(rw: &str, qd: u32, runtime: u64, img: &Path) -> FioResult {
    let mut fio = fio_common(rw, qd, runtime);
    fio.extend([
        "--ioengine=io_uring".into(),
        "--direct=1".into(),
        format!("--filename={}", img.display()),
    ]);
    run_fio(&fio)
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl Row {
    /// Medians (and the IOPS spread) of one daemon's repetitions of a case.
    pub fn summarize(
        backend: &str,
        workload: &str,
        iodepth: u32,
        daemon: &str,
        per: &[(FioResult, Option<f64>)],
    ) -> Row {
        let runs: Vec<FioResult> = per.iter().map(|(r, _)| r.clone()).collect();
        let iops: Vec<f64> = runs.iter().map(|r| r.iops).collect();
        let med = median(iops.clone());
        let (hi, lo) = (
            iops.iter().cloned().fold(f64::MIN, f64::max),
            iops.iter().cloned().fold(f64::MAX, f64::min),
        );
        let cpu: Vec<f64> = per.iter().filter_map(|(_, c)| *c).collect();
        Row {
            backend: backend.to_string(),
            workload: workload.to_string(),
            iodepth,
            daemon: daemon.to_string(),
            iops: med,
            mean_us: median(runs.iter().map(|r| r.mean_us).collect()),
            p50_us: median(runs.iter().map(|r| r.p50_us).collect()),
            p99_us: median(runs.iter().map(|r| r.p99_us).collect()),
            cpu_us_per_io: (!cpu.is_empty()).then(|| median(cpu)),
            iops_spread: if med > 0.0 { (hi - lo) / med } else { 0.0 },
            runs,
        }
    }
}

/// The rows as a Markdown table with ratios to qsd (and to raw fio for the file backend).
pub fn markdown(rows: &[Row]) -> String {
    let mut s = String::from(
        "| backend | workload | daemon | IOPS | × qsd | × raw fio | mean µs | p50 µs | p99 µs | CPU µs/IO | CPU × qsd | spread |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let find = |d: &str| {
            rows.iter().find(|x| {
                x.backend == r.backend
                    && x.workload == r.workload
                    && x.iodepth == r.iodepth
                    && x.daemon == d
            })
        };
        let qsd = find("qsd");
        let raw = find("fio-raw");
        let ratio = |a: f64, b: Option<f64>| {
            b.filter(|b| *b > 0.0)
                .map_or("–".to_string(), |b| format!("{:.2}", a / b))
        };
        s += &format!(
            "| {} | {} QD{} | {} | {:.0} | {} | {} | {:.1} | {:.1} | {:.1} | {} | {} | {:.0}% |\n",
            r.backend,
            r.workload,
            r.iodepth,
            r.daemon,
            r.iops,
            ratio(r.iops, qsd.map(|q| q.iops)),
            ratio(r.iops, raw.map(|q| q.iops)),
            r.mean_us,
            r.p50_us,
            r.p99_us,
            r.cpu_us_per_io.map_or("–".into(), |c| format!("{c:.1}")),
            match (r.cpu_us_per_io, qsd.and_then(|q| q.cpu_us_per_io)) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
                _ => "–".into(),
            },
            r.iops_spread * 100.0
        );
    }
    s
}
