//! `stord-bench fuse`: fio through a FUSE-mounted image, stord vs qemu-storage-daemon,
//! with fio on the raw file as the floor, in one run.
//!
//! Workloads as the FUSE issue asks: libaio O_DIRECT 4k randread/randwrite at QD16 and
//! psync QD1, on the null and the O_DIRECT file backends, with one and two IoThreads.

use std::path::Path;

use crate::nbd::{bench_dir, prepare_image, which, Row, IMAGE_SIZE};
use crate::peers::{process_cpu_ns, run_fio, stord_binary, FioResult};

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

fn is_mounted(p: &Path) -> bool {
    let needle = format!(" {} ", p.display());
    std::fs::read_to_string("/proc/mounts")
        .map(|m| m.lines().any(|l| l.contains(&needle)))
        .unwrap_or(false)
}

/// A daemon with its FUSE export mounted; unmounted and stopped when dropped.
pub(crate) struct Mounted {
    pub child: std::process::Child,
    mnt: std::path::PathBuf,
}

impl Drop for Mounted {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let start = std::time::Instant::now();
        while is_mounted(&self.mnt) && start.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

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
    start_with(&bin, objects, node, mnt, daemon == "stord-uring")
}

/// Starts `bin` with `--object` for each of `iothreads` (ids io0, io1, ...), the block
/// node `node` (named "disk") and a FUSE export on `mnt` with one queue per IoThread;
/// returns once the file is mounted.
pub(crate) fn start_with(
    bin: &Path,
    iothreads: Vec<String>,
    node: String,
    mnt: &Path,
    io_uring: bool,
) -> Mounted {
    std::fs::write(mnt, b"").expect("mountpoint");
    let threads = iothreads.len();
    let mut args: Vec<String> = Vec::new();
    for obj in iothreads {
        args.push("--object".into());
        args.push(obj);
    }
    args.push("--blockdev".into());
    args.push(node);
    let mut export = format!(
        "type=fuse,id=f0,node-name=disk,mountpoint={},writable=on",
        mnt.display()
    );
    if threads == 1 {
        export.push_str(",iothread=io0");
    } else {
        for i in 0..threads {
            export.push_str(&format!(",iothread.{i}=io{i}"));
        }
    }
    if io_uring {
        export.push_str(",io-uring=on");
    }
    args.push("--export".into());
    args.push(export);
    let child = std::process::Command::new(bin)
        .args(&args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start daemon");
    let start = std::time::Instant::now();
    while !is_mounted(mnt) {
        assert!(
            start.elapsed().as_secs() < 15,
            "{} did not mount",
            bin.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Mounted {
        child,
        mnt: mnt.to_path_buf(),
    }
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
