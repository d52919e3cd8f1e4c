//! `stord-bench fuse`: fio through a FUSE-mounted image, stord vs qemu-storage-daemon,
//! with fio on the raw file as the floor, in one run.
//!
//! Workloads as the FUSE issue asks: libaio O_DIRECT 4k randread/randwrite at QD16 and
//! psync QD1, on the null and the O_DIRECT file backends, with one and two IoThreads.

use std::path::Path;

use crate::daemon_args::fuse_args;
use crate::matrix::Row;
use crate::media::{bench_dir, prepare_image, IMAGE_SIZE};
use crate::peers::{process_cpu_ns, run_fio, stord_binary, which, FioResult, Mounted};

/// Options of the FUSE benchmark.
pub struct FuseOptions {
    pub runtime_s: u64,
    pub reps: usize,
    pub backends: Vec<String>,
    pub iothreads: Vec<usize>,
    pub daemons: Vec<String>,
}

impl Default for FuseOptions {
    fn default() -> Self {
        Self {
            runtime_s: 5,
            reps: 2,
            backends: vec!["null".into(), "file".into()],
            iothreads: vec![1, 2],
            daemons: vec!["stord".into(), "stord-uring".into(), "qsd".into()],
        }
    }
}

const WORKLOADS: [(&str, u32); 4] = [
    ("randread", 1),
    ("randwrite", 1),
    ("randread", 16),
    ("randwrite", 16),
];

fn start(daemon: &str, backend: &str, img: &Path, mnt: &Path, threads: usize) -> Mounted {
    let node = match backend {
        "null" => format!("driver=null-co,node-name=disk,size={IMAGE_SIZE},read-zeroes=on"),
        _ => format!(
            "driver=file,node-name=disk,filename={},aio=io_uring,cache.direct=on",
            img.display()
        ),
    };
    let bin = if daemon.starts_with("stord") {
        stord_binary()
    } else {
        which("qemu-storage-daemon")
    };
    let objects = (0..threads).map(|i| format!("iothread,id=io{i}")).collect();
    let args = fuse_args(objects, node, mnt, daemon == "stord-uring");
    Mounted::start(&bin, &args, mnt)
}

fn fio_args(rw: &str, qd: u32, runtime: u64, filename: &Path) -> Vec<String> {
    let mut a = vec![
        "--name=bench".to_string(),
        format!("--filename={}", filename.display()),
        format!("--rw={rw}"),
        "--bs=4k".into(),
        "--direct=1".into(),
        "--time_based".into(),
        format!("--runtime={runtime}"),
        "--ramp_time=1".into(),
        format!("--size={IMAGE_SIZE}"),
        "--norandommap".into(),
        "--randrepeat=0".into(),
    ];
    if qd == 1 {
        a.push("--ioengine=psync".into());
    } else {
        a.push("--ioengine=libaio".into());
        a.push(format!("--iodepth={qd}"));
    }
    a
}

const URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Turns the kernel's FUSE-over-io_uring switch on for the run, and back as it was.
struct UringSwitch(Option<String>);

impl UringSwitch {
    fn on() -> Self {
        let old = std::fs::read_to_string(URING_PARAM).ok();
        if std::fs::write(URING_PARAM, "Y").is_err() {
            eprintln!("warning: cannot enable {URING_PARAM}; stord-uring rows will fail");
        }
        Self(old)
    }
}

impl Drop for UringSwitch {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = std::fs::write(URING_PARAM, old.trim());
        }
    }
}

/// Runs the matrix.
pub fn run(opts: &FuseOptions) -> Vec<Row> {
    let _switch = opts
        .daemons
        .iter()
        .any(|d| d == "stord-uring")
        .then(UringSwitch::on);
    let dir = bench_dir();
    let img = dir.join("nbd-bench.img");
    let mnt = dir.join("fuse-mnt");
    if opts.backends.iter().any(|b| b == "file") {
        prepare_image(&img);
    }
    let mut rows = Vec::new();
    for backend in &opts.backends {
        for &threads in &opts.iothreads {
            for (rw, qd) in WORKLOADS {
                // qsd before 10.1 takes a single iothread for FUSE (no multi-queue): it only
                // runs in the one-IoThread rows.
                let mut names: Vec<String> = opts
                    .daemons
                    .iter()
                    .filter(|d| threads == 1 || *d != "qsd")
                    .cloned()
                    .collect();
                if backend == "file" && threads == 1 {
                    names.push("fio-raw".into());
                }
                let mut per: Vec<Vec<(FioResult, Option<f64>)>> = vec![Vec::new(); names.len()];
                for rep in 0..opts.reps {
                    for (i, d) in names.iter().enumerate() {
                        eprintln!(
                            "fuse {backend} {threads}t {rw} QD{qd} {d} (rep {})",
                            rep + 1
                        );
                        if d == "fio-raw" {
                            per[i].push((run_fio(&fio_args(rw, qd, opts.runtime_s, &img)), None));
                            continue;
                        }
                        let m = start(d, backend, &img, &mnt, threads);
                        let pid = m.child.id();
                        let c0 = process_cpu_ns(pid);
                        let r = run_fio(&fio_args(rw, qd, opts.runtime_s, &mnt));
                        let c1 = process_cpu_ns(pid);
                        let ios = r.iops * (opts.runtime_s + 1) as f64;
                        per[i].push((r, Some((c1 - c0) as f64 / 1000.0 / ios.max(1.0))));
                        drop(m);
                    }
                }
                for (i, d) in names.iter().enumerate() {
                    rows.push(Row::summarize(
                        &format!("{backend} {threads}t"),
                        rw,
                        qd,
                        d,
                        &per[i],
                    ));
                }
            }
        }
    }
    rows
}
