//! `stord-bench nbd`: fio's nbd engine against stord, qemu-storage-daemon and nbdkit,
//! with fio on the raw file as the floor, in one run.
//!
//! Each case (backend x workload) runs every daemon in turn, and the whole round is
//! repeated (A B C, A B C, ...) so slow drift on a noisy machine hits all alike. Each run
//! starts a fresh daemon with one IoThread. Reported: median IOPS, mean/p50/p99 latency,
//! the daemon's CPU time per I/O (utime+stime from /proc/PID/stat over the run), spread
//! across repetitions, and the ratios to qsd.
//!
//! `--tcp on` serves on TCP loopback (127.0.0.1:10809) instead of a unix socket.
//! `--tls on` puts every daemon behind TLS (x509, the server's certificate only, as
//! `verify-peer=off`): certificates are made once under results/tmp/tls-pki with the openssl
//! command, and fio's libnbd finds the CA in `$HOME/.pki/libnbd`, with HOME pointed there.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use crate::peers::{repo_root, run_fio, Daemon, FioResult};
use crate::report::session::{nbd_args, Paths};

/// Options of the NBD benchmark.
pub struct NbdOptions {
    pub runtime_s: u64,
    pub reps: usize,
    pub backends: Vec<String>,
    pub workloads: Vec<(String, u32)>,
    pub daemons: Vec<String>,
    pub stord_policy: String,
    pub file_aio: String,
    /// fio jobs (connections) per run.
    pub jobs: u32,
    /// IoThreads serving stord's export (connections spread over them); qsd 10.0 takes one.
    pub iothreads: usize,
    /// Every daemon serves through TLS.
    pub tls: bool,
    /// Serve on TCP loopback rather than a unix socket.
    pub tcp: bool,
}

/// The port of `--tcp on`.
const TCP_PORT: u16 = 10809;

impl Default for NbdOptions {
    fn default() -> Self {
        Self {
            runtime_s: 5,
            reps: 2,
            backends: vec!["null".into(), "file".into()],
            workloads: default_workloads(),
            daemons: vec!["stord".into(), "qsd".into(), "nbdkit".into()],
            stord_policy: "classic".into(),
            file_aio: "io_uring".into(),
            jobs: 1,
            iothreads: 1,
            tls: false,
            tcp: false,
        }
    }
}

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

pub(crate) const IMAGE_SIZE: u64 = 1 << 30;

/// The fast-device medium: a loop device with direct I/O over a file in /dev/shm, so a
/// 4k read costs tens of microseconds and the daemons' own overhead shows. Attached for
/// one benchmark run, detached on drop.
pub(crate) struct FastDev {
    pub dev: PathBuf,
}

impl FastDev {
    pub fn attach() -> FastDev {
        let file = PathBuf::from("/dev/shm/stord-bench-fastdev.img");
        prepare_image(&file);
        let out = Command::new("losetup")
            .args(["--direct-io=on", "--find", "--show"])
            .arg(&file)
            .output()
            .expect("losetup");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        eprintln!("fast device: {} over {}", dev.display(), file.display());
        FastDev { dev }
    }
}

impl Drop for FastDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

pub(crate) fn bench_dir() -> PathBuf {
    let d = repo_root().join("results/tmp");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A 1 GiB image filled with data, so O_DIRECT reads really reach the disk.
pub(crate) fn prepare_image(path: &Path) {
    if std::fs::metadata(path)
        .map(|m| m.len() == IMAGE_SIZE)
        .unwrap_or(false)
    {
        return;
    }
    eprintln!("preparing {} (1 GiB of data)...", path.display());
    let st = Command::new("fio")
        .args([
            "--name=fill",
            "--ioengine=libaio",
            "--direct=1",
            "--rw=write",
            "--bs=1M",
            "--iodepth=8",
            &format!("--size={IMAGE_SIZE}"),
            &format!("--filename={}", path.display()),
        ])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("fio");
    assert!(st.success());
}

/// The qcow2 image of backend `qcow2-KIND` (see [`crate::report::session::qcow2_image`]),
/// made with qemu-img: `full` converted from the raw image once, `empty` created afresh.
fn prepare_qcow2(img: &Path, kind: &str) {
    let q = crate::report::session::qcow2_image(img, kind);
    let (q, raw) = (q.display().to_string(), img.display().to_string());
    let args: Vec<&str> = match kind {
        "full" if Path::new(&q).exists() => return,
        "full" => vec!["convert", "-O", "qcow2", &raw, &q],
        _ => vec!["create", "-q", "-f", "qcow2", &q, "1G"],
    };
    let st = Command::new("qemu-img")
        .args(&args)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img {args:?}");
}

pub(crate) fn which(cmd: &str) -> PathBuf {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cmd} not found: run scripts/install-deps.sh"
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// fio options of a workload: `rw` is fio's `--rw`, optionally with a block size after a
/// slash (`read/64k`; 4k when absent).
fn fio_common(rw: &str, qd: u32, runtime: u64) -> Vec<String> {
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

/// Makes a stord command line from `nbd_args` serve its export from `n` IoThreads (the
/// same options as io0).
fn spread_over_iothreads(args: &mut Vec<String>, n: usize) {
    let io0 = args
        .iter()
        .find(|a| a.starts_with("iothread,id=io0"))
        .cloned()
        .expect("an io0 iothread");
    let mut list = "iothread.0=io0".to_string();
    for i in 1..n {
        args.insert(0, io0.replacen("id=io0", &format!("id=io{i}"), 1));
        args.insert(0, "--object".into());
        list.push_str(&format!(",iothread.{i}=io{i}"));
    }
    for a in args.iter_mut() {
        if a.starts_with("type=nbd") {
            *a = a.replace("iothread=io0", &list);
        }
    }
}

/// A CA and a server certificate for `localhost` (made once), and a HOME whose
/// `.pki/libnbd` holds the CA for libnbd. Returns the server's credentials directory.
fn tls_setup(dir: &Path) -> PathBuf {
    let pki = dir.join("tls-pki");
    let server = pki.join("server");
    let home = pki.join("home");
    if !server.join("server-key.pem").exists() {
        std::fs::create_dir_all(&server).unwrap();
        let script = format!(
            "set -e; cd {}; \
             openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -keyout ca-key.pem \
               -out server/ca-cert.pem -subj '/CN=stord-bench CA' \
               -addext basicConstraints=critical,CA:TRUE \
               -addext keyUsage=critical,keyCertSign,cRLSign; \
             printf 'subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n' > ext; \
             openssl req -newkey rsa:2048 -nodes -keyout server/server-key.pem -out s.csr \
               -subj /CN=localhost; \
             openssl x509 -req -in s.csr -CA server/ca-cert.pem -CAkey ca-key.pem \
               -CAcreateserial -out server/server-cert.pem -days 3650 -extfile ext",
            pki.display()
        );
        let st = Command::new("sh")
            .args(["-c", &script])
            .stderr(std::process::Stdio::null())
            .status()
            .expect("run openssl");
        assert!(st.success(), "making the benchmark's certificates failed");
    }
    let libnbd = home.join(".pki/libnbd");
    std::fs::create_dir_all(&libnbd).unwrap();
    std::fs::copy(server.join("ca-cert.pem"), libnbd.join("ca-cert.pem")).unwrap();
    // Only fio (and the libnbd in it) runs with this HOME.
    let _ = crate::peers::FIO_HOME.set(home);
    server
}

/// Moves a daemon's command line (from `nbd_args`) from its unix socket to TCP loopback,
/// and returns the URI to use.
fn use_tcp(d: &str, args: &mut [String]) -> String {
    for a in args.iter_mut() {
        if a.starts_with("addr.type=unix,") {
            // "addr.type=unix,addr.path=P[,more]": keep "more".
            let rest = a.splitn(3, ',').nth(2).unwrap_or("").to_string();
            *a = format!("addr.type=inet,addr.host=127.0.0.1,addr.port={TCP_PORT}");
            if !rest.is_empty() {
                a.push(',');
                a.push_str(&rest);
            }
        }
    }
    if d == "nbdkit" {
        // "-f -U SOCK ...": listen on the port instead.
        if let Some(i) = args.iter().position(|a| a == "-U") {
            args[i] = "-p".into();
            args[i + 1] = TCP_PORT.to_string();
        }
        return format!("nbd://localhost:{TCP_PORT}/");
    }
    format!("nbd://localhost:{TCP_PORT}/disk")
}

/// Puts a daemon's command line (from `nbd_args`) behind TLS with the credentials in
/// `creds`, and returns the URI to use.
fn add_tls(d: &str, args: &mut Vec<String>, uri: &str, creds: &Path) -> String {
    if d == "nbdkit" {
        args.insert(1, "--tls=require".into());
        args.insert(2, format!("--tls-certificates={}", creds.display()));
    } else {
        args.insert(0, "--object".into());
        args.insert(
            1,
            format!(
                "tls-creds-x509,id=tls0,endpoint=server,dir={},verify-peer=off",
                creds.display()
            ),
        );
        for a in args.iter_mut() {
            if a.starts_with("addr.type=") {
                a.push_str(",tls-creds=tls0");
            }
        }
    }
    uri.replacen("nbd+unix://", "nbds+unix://", 1)
        .replacen("nbd://", "nbds://", 1)
}

/// Runs the matrix; prints progress and returns the rows.
pub fn run(opts: &NbdOptions) -> Vec<Row> {
    let dir = bench_dir();
    let img = dir.join("nbd-bench.img");
    let sock = dir.join("nbd-bench.sock");
    if opts.backends.iter().any(|b| b != "null") {
        prepare_image(&img);
    }
    if opts.backends.iter().any(|b| b == "qcow2-full") {
        prepare_qcow2(&img, "full");
    }
    let tls = opts.tls.then(|| tls_setup(&dir));
    let fastdev = opts
        .backends
        .iter()
        .any(|b| b == "dev")
        .then(FastDev::attach);
    for d in &opts.daemons {
        if !d.starts_with("stord") {
            which(if d == "qsd" { "qemu-storage-daemon" } else { d });
        }
    }
    let mut rows = Vec::new();
    let total_runs: usize = opts.backends.len()
        * opts.workloads.len()
        * opts.reps
        * (opts.daemons.len()
            + usize::from(opts.backends.iter().any(|b| b == "file" || b == "dev")));
    let mut done_runs = 0;
    for backend in &opts.backends {
        // The medium: the image file, or the fast device.
        let img = match (backend.as_str(), &fastdev) {
            ("dev", Some(f)) => f.dev.clone(),
            _ => img.clone(),
        };
        for (rw, qd) in &opts.workloads {
            let mut names: Vec<String> = opts.daemons.clone();
            if backend == "file" || backend == "dev" {
                names.push("fio-raw".into());
            }
            let mut per: Vec<Vec<(FioResult, Option<f64>)>> = vec![Vec::new(); names.len()];
            for rep in 0..opts.reps {
                for (i, d) in names.iter().enumerate() {
                    done_runs += 1;
                    eprintln!(
                        "[{done_runs}/{total_runs}] {backend} {rw} QD{qd} {d} (rep {})",
                        rep + 1
                    );
                    if d == "fio-raw" {
                        per[i].push((fio_raw(rw, *qd, opts.runtime_s, &img), None));
                        continue;
                    }
                    let mut fio = fio_common(rw, *qd, opts.runtime_s);
                    if opts.jobs > 1 {
                        fio.push(format!("--numjobs={}", opts.jobs));
                        fio.push("--group_reporting".into());
                    }
                    // This benchmark's names, in the report's terms.
                    let daemon = match d.as_str() {
                        "stord" => format!("stord-{}", opts.stord_policy),
                        "stord-base" => format!("base-{}", opts.stord_policy),
                        other => other.to_string(),
                    };
                    let backend = match backend.as_str() {
                        "file" => format!("file-{}", opts.file_aio),
                        other => other.to_string(),
                    };
                    if backend == "qcow2-empty" {
                        // Every run allocates from nothing.
                        prepare_qcow2(&img, "empty");
                    }
                    let paths = Paths {
                        img: img.clone(),
                        sock: sock.clone(),
                        mnt: PathBuf::new(),
                    };
                    let (bin, mut args, mut uri) = nbd_args(&daemon, &backend, &paths);
                    if opts.tcp {
                        uri = use_tcp(d, &mut args);
                    }
                    if let Some(creds) = &tls {
                        uri = add_tls(d, &mut args, &uri, creds);
                    }
                    if opts.iothreads > 1 && d.starts_with("stord") {
                        spread_over_iothreads(&mut args, opts.iothreads);
                    }
                    let daemon = if opts.tcp {
                        Daemon::start_tcp(d, &bin, &args, TCP_PORT)
                    } else {
                        Daemon::start(d, &bin, &args, &sock)
                    };
                    fio.extend(["--ioengine=nbd".into(), format!("--uri={uri}")]);
                    let cpu0 = daemon.cpu_ns();
                    let r = run_fio(&fio);
                    let cpu1 = daemon.cpu_ns();
                    // fio's ramp time also costs CPU: count all I/Os fio did over the run.
                    let ios_total = r.iops * (opts.runtime_s + 1) as f64;
                    let cpu = (cpu1 - cpu0) as f64 / 1000.0 / ios_total.max(1.0);
                    per[i].push((r, Some(cpu)));
                    drop(daemon);
                }
            }
            for (i, d) in names.iter().enumerate() {
                rows.push(Row::summarize(backend, rw, *qd, d, &per[i]));
            }
        }
    }
    let _ = std::fs::remove_file(&sock);
    rows
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
