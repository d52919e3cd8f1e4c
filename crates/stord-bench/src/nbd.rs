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

use crate::daemon_args::nbd_args;
use crate::matrix::{default_workloads, fio_common, fio_raw, Row};
use crate::media::{bench_dir, prepare_image, prepare_qcow2, FastDev, Paths};
use crate::peers::{run_fio, which, Daemon, FioResult};

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
    let mut bench = Bench {
        opts,
        sock,
        tls,
        done_runs: 0,
        total_runs,
    };
    for backend in &opts.backends {
        // The medium: the image file, or the fast device.
        let img = match (backend.as_str(), &fastdev) {
            ("dev", Some(f)) => f.dev.clone(),
            _ => img.clone(),
        };
        for (rw, qd) in &opts.workloads {
            let case = Case {
                backend,
                img: &img,
                rw,
                qd: *qd,
            };
            rows.extend(bench.case(&case));
        }
    }
    let _ = std::fs::remove_file(&bench.sock);
    rows
}

/// The matrix as it runs: the socket, the TLS credentials and the progress count.
struct Bench<'a> {
    opts: &'a NbdOptions,
    sock: PathBuf,
    /// The server's credentials directory with `--tls on`.
    tls: Option<PathBuf>,
    done_runs: usize,
    total_runs: usize,
}

/// One (backend, workload) of the matrix, on the medium `img`.
struct Case<'a> {
    backend: &'a str,
    img: &'a Path,
    rw: &'a str,
    qd: u32,
}

impl Bench<'_> {
    /// Every daemon (and on a medium the floor) once per repetition, in turn; a row each.
    fn case(&mut self, c: &Case) -> Vec<Row> {
        let opts = self.opts;
        let (backend, rw, qd) = (c.backend, c.rw, c.qd);
        let mut names: Vec<String> = opts.daemons.clone();
        if backend == "file" || backend == "dev" {
            names.push("fio-raw".into());
        }
        let mut per: Vec<Vec<(FioResult, Option<f64>)>> = vec![Vec::new(); names.len()];
        for rep in 0..opts.reps {
            for (i, d) in names.iter().enumerate() {
                self.done_runs += 1;
                eprintln!(
                    "[{}/{}] {backend} {rw} QD{qd} {d} (rep {})",
                    self.done_runs,
                    self.total_runs,
                    rep + 1
                );
                if d == "fio-raw" {
                    per[i].push((fio_raw(rw, qd, opts.runtime_s, c.img), None));
                    continue;
                }
                per[i].push(self.daemon_run(c, d));
            }
        }
        names
            .iter()
            .enumerate()
            .map(|(i, d)| Row::summarize(backend, rw, qd, d, &per[i]))
            .collect()
    }

    /// One fio run against daemon `d`, started fresh: what fio measured, and the daemon's
    /// CPU µs per I/O.
    fn daemon_run(&self, c: &Case, d: &str) -> (FioResult, Option<f64>) {
        let opts = self.opts;
        let mut fio = fio_common(c.rw, c.qd, opts.runtime_s);
        if opts.jobs > 1 {
            fio.push(format!("--numjobs={}", opts.jobs));
            fio.push("--group_reporting".into());
        }
        let (daemon, uri) = self.start(c, d);
        fio.extend(["--ioengine=nbd".into(), format!("--uri={uri}")]);
        let cpu0 = daemon.cpu_ns();
        let r = run_fio(&fio);
        let cpu1 = daemon.cpu_ns();
        // fio's ramp time also costs CPU: count all I/Os fio did over the run.
        let ios_total = r.iops * (opts.runtime_s + 1) as f64;
        let cpu = (cpu1 - cpu0) as f64 / 1000.0 / ios_total.max(1.0);
        drop(daemon);
        (r, Some(cpu))
    }

    /// Starts daemon `d` serving the case's backend over NBD (on TCP, behind TLS, over
    /// several IoThreads as asked); returns it and the URI to use.
    fn start(&self, c: &Case, d: &str) -> (Daemon, String) {
        let opts = self.opts;
        // This benchmark's names, in the report's terms.
        let daemon = match d {
            "stord" => format!("stord-{}", opts.stord_policy),
            "stord-base" => format!("base-{}", opts.stord_policy),
            other => other.to_string(),
        };
        let backend = match c.backend {
            "file" => format!("file-{}", opts.file_aio),
            other => other.to_string(),
        };
        if backend == "qcow2-empty" {
            // Every run allocates from nothing.
            prepare_qcow2(c.img, "empty");
        }
        let paths = Paths {
            img: c.img.to_path_buf(),
            sock: self.sock.clone(),
            mnt: PathBuf::new(),
        };
        let (bin, mut args, mut uri) = nbd_args(&daemon, &backend, &paths);
        if opts.tcp {
            uri = use_tcp(d, &mut args);
        }
        if let Some(creds) = &self.tls {
            uri = add_tls(d, &mut args, &uri, creds);
        }
        if opts.iothreads > 1 && d.starts_with("stord") {
            spread_over_iothreads(&mut args, opts.iothreads);
        }
        let daemon = if opts.tcp {
            Daemon::start_tcp(d, &bin, &args, TCP_PORT)
        } else {
            Daemon::start(d, &bin, &args, &self.sock)
        };
        (daemon, uri)
    }
}
