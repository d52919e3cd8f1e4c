//! `stord-bench vhost`: 4k random reads and writes against stord's and
//! qemu-storage-daemon's vhost-user-blk exports, driven the way a guest's virtio-blk driver
//! would by a vhost-user frontend of our own (the `own` client of [`crate::vhost_client`]:
//! shared memfd memory, a split virtqueue, EVENT_IDX, a blocking wait on the call eventfd).
//!
//! Every stord polling policy is a separate "daemon" in the table; qsd runs with its
//! defaults. The file backend adds fio on the raw file (io_uring, O_DIRECT) as the floor.
//!
//! `--client` picks who drives the load: `own` (this frontend, one queue), `blkio` or
//! `blkio-poll` (libblkio with blocking or poll queues), which can also use several queues
//! (`--queues N`: one client thread per queue, the export's queue i on IoThread i for
//! stord; qsd 10.0 serves all queues from its one IoThread).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::daemon_args::{blockdev, qsd_style, vhost_args_mq};
use crate::matrix::{default_workloads, fio_raw, Row};
use crate::media::{bench_dir, prepare_image, FastDev};
use crate::peers::{which, Daemon, FioResult};
use crate::qmp::{histogram_median, per_unit, Qmp};
use crate::vhost_client::{drive_with, DriveSpec};

/// Options of the vhost-user-blk benchmark.
pub struct VhostOptions {
    pub runtime_s: u64,
    pub reps: usize,
    pub backends: Vec<String>,
    pub workloads: Vec<(String, u32)>,
    pub daemons: Vec<String>,
    /// `own`, `blkio`, `blkio-poll`.
    pub clients: Vec<String>,
    /// Queues (and client threads) per run.
    pub queues: usize,
    /// IoThreads serving them in stord (queue i on IoThread i % n; default: one per queue).
    /// qsd 10.0 always serves every queue from its one IoThread.
    pub iothreads: Option<usize>,
    /// Think time per request (µs), slept as fio does unless `think_spin`.
    pub think_us: u64,
    /// Spin through the think time.
    pub think_spin: bool,
}

impl Default for VhostOptions {
    fn default() -> Self {
        Self {
            runtime_s: 4,
            reps: 2,
            backends: vec!["null".into(), "file".into()],
            workloads: default_workloads(),
            daemons: vec![
                "stord-off".into(),
                "stord-classic".into(),
                "stord-weighted".into(),
                "stord-haltpoll".into(),
                "qsd".into(),
            ],
            clients: vec!["own".into()],
            queues: 1,
            iothreads: None,
            think_us: 0,
            think_spin: false,
        }
    }
}

/// Runs the matrix; prints progress and returns the rows, and for stord runs the loop and
/// virtqueue counters per request (from QMP `query-iothreads`).
pub fn run(opts: &VhostOptions) -> (Vec<Row>, Vec<Value>) {
    let dir = bench_dir();
    let img = dir.join("nbd-bench.img");
    let sock = dir.join("vhost-bench.sock");
    if opts.backends.iter().any(|b| b == "file") {
        prepare_image(&img);
    }
    let fastdev = opts
        .backends
        .iter()
        .any(|b| b == "dev")
        .then(FastDev::attach);
    if opts.daemons.iter().any(|d| d == "qsd") {
        which("qemu-storage-daemon");
    }
    let has_file = opts.backends.iter().any(|b| b == "file" || b == "dev");
    let cases = opts.backends.len() * opts.clients.len() * opts.workloads.len() * opts.reps;
    let total = cases * opts.daemons.len()
        + usize::from(has_file) * opts.clients.len() * opts.workloads.len() * opts.reps;
    let mut bench = Bench {
        opts,
        sock,
        qmp_sock: dir.join("vhost-bench-qmp.sock"),
        n: 0,
        total,
        counters: Vec::new(),
    };
    let mut rows = Vec::new();
    for backend in &opts.backends {
        let img = match (backend.as_str(), &fastdev) {
            ("dev", Some(f)) => f.dev.clone(),
            _ => img.clone(),
        };
        for client in &opts.clients {
            for (rw, qd) in &opts.workloads {
                let case = Case {
                    backend,
                    img: &img,
                    client,
                    rw,
                    qd: *qd,
                };
                rows.extend(bench.case(&case));
            }
        }
    }
    let _ = std::fs::remove_file(&bench.sock);
    (rows, bench.counters)
}

/// The matrix as it runs: its sockets, the progress count and stord's counters so far.
struct Bench<'a> {
    opts: &'a VhostOptions,
    sock: PathBuf,
    qmp_sock: PathBuf,
    /// Runs started, of `total`.
    n: usize,
    total: usize,
    counters: Vec<Value>,
}

/// One (backend, client, workload) of the matrix, on the medium `img`.
struct Case<'a> {
    backend: &'a str,
    img: &'a Path,
    client: &'a str,
    rw: &'a str,
    qd: u32,
}

impl Bench<'_> {
    /// Every daemon (and on a medium the floor) once per repetition, in turn; a row each.
    fn case(&mut self, c: &Case) -> Vec<Row> {
        let opts = self.opts;
        let (backend, client, rw, qd) = (c.backend, c.client, c.rw, c.qd);
        let mut names = opts.daemons.clone();
        if backend == "file" || backend == "dev" {
            names.push("fio-raw".into());
        }
        let mut per: Vec<Vec<(FioResult, Option<f64>)>> = vec![Vec::new(); names.len()];
        for rep in 0..opts.reps {
            for (i, d) in names.iter().enumerate() {
                self.n += 1;
                eprintln!(
                    "[{}/{}] vhost-user-blk {backend} {client} {rw} QD{qd} {d} (rep {})",
                    self.n,
                    self.total,
                    rep + 1
                );
                if d == "fio-raw" {
                    let fio_qd = qd * opts.queues as u32;
                    per[i].push((fio_raw(rw, fio_qd, opts.runtime_s, c.img), None));
                    continue;
                }
                per[i].push(self.daemon_run(c, d, rep));
            }
        }
        let label = self.label(backend, client);
        names
            .iter()
            .enumerate()
            .map(|(i, d)| Row::summarize(&label, rw, qd, d, &per[i]))
            .collect()
    }

    /// One run of daemon `d`, started fresh: what the client measured, and the daemon's CPU
    /// µs per I/O; for stord, its counters go to `counters`.
    fn daemon_run(&mut self, c: &Case, d: &str, rep: usize) -> (FioResult, Option<f64>) {
        let opts = self.opts;
        // This benchmark's "file" backend is the report's file-io_uring.
        let backend = if c.backend == "file" {
            "file-io_uring"
        } else {
            c.backend
        };
        let stord = d != "qsd";
        let daemon = self.start(d, backend, c.img);
        let mut qmp = stord.then(|| Qmp::connect(&self.qmp_sock).expect("QMP"));
        let before = qmp.as_mut().map(|q| q.loop_counters().expect("x-stats"));
        let svc0 = qmp
            .as_mut()
            .map(|q| q.histogram("virtqueue.service-ns").expect("x-stats"));
        let cpu0 = daemon.cpu_ns();
        let t0 = Instant::now();
        let spec = DriveSpec {
            write: c.rw.contains("write"),
            sequential: false,
            bs: 4096,
            qd: c.qd as u16,
            ramp: Duration::from_secs(1),
            runtime: Duration::from_secs(opts.runtime_s),
            think: Duration::from_micros(opts.think_us),
            think_spin: opts.think_spin,
            rate_iops: None,
        };
        let r = drive_with(c.client, &self.sock, &spec, opts.queues);
        let wall = t0.elapsed().as_secs_f64();
        let cpu1 = daemon.cpu_ns();
        if let (Some(q), Some(before)) = (qmp.as_mut(), before) {
            let (per_request, service_p50) = stord_counters(q, d, &before, svc0.as_deref());
            self.counters.push(serde_json::json!({
                "backend": backend, "client": c.client, "workload": c.rw,
                "iodepth": c.qd, "daemon": d, "rep": rep,
                "iops": r.iops, "per_request": per_request,
                "service_p50_ns": service_p50,
            }));
        }
        // CPU over the whole connection (ramp included) per I/O at the measured rate over
        // the same wall time.
        let ios = r.iops * wall;
        let cpu = (cpu1 - cpu0) as f64 / 1000.0 / ios.max(1.0);
        drop(daemon);
        (r, Some(cpu))
    }

    /// Starts daemon `d` with its vhost-user-blk export of `backend` on `img` (and for
    /// stord a QMP monitor on `qmp_sock`).
    fn start(&self, d: &str, backend: &str, img: &Path) -> Daemon {
        let opts = self.opts;
        let (bin, iothread) = qsd_style(d);
        let stord = d != "qsd";
        let iothreads = if stord {
            opts.iothreads.unwrap_or(opts.queues)
        } else {
            1
        };
        let mut args = vhost_args_mq(
            iothread,
            blockdev(backend, img),
            &self.sock,
            opts.queues,
            iothreads,
        );
        if stord {
            args.extend([
                "--chardev".into(),
                format!(
                    "socket,id=mon,path={},server=on,wait=off",
                    self.qmp_sock.display()
                ),
                "--monitor".into(),
                "chardev=mon".into(),
            ]);
        }
        Daemon::start(d, &bin, &args, &self.sock)
    }

    /// The rows' backend column: the backend, the client unless it is our own, and the
    /// queues (and IoThreads) when more than one.
    fn label(&self, backend: &str, client: &str) -> String {
        let label = if client == "own" {
            backend.to_string()
        } else {
            format!("{backend} {client}")
        };
        match (self.opts.queues, self.opts.iothreads) {
            (1, _) => label,
            (q, Some(t)) => format!("{label} x{q}q/{t}t"),
            (q, None) => format!("{label} x{q}q"),
        }
    }
}

/// Prints stord's request service time and its loop and virtqueue counters per request
/// since `before` (and `svc0`); returns the counters and the service time's median (ns).
fn stord_counters(
    q: &mut Qmp,
    d: &str,
    before: &[(String, u64)],
    svc0: Option<&[u64]>,
) -> (Value, Option<f64>) {
    let after = q.loop_counters().expect("x-stats");
    let svc1 = q.histogram("virtqueue.service-ns").expect("x-stats");
    let service_p50 = svc0.and_then(|b| histogram_median(b, &svc1));
    eprintln!(
        "  {d}: request service time (pop to completion published) p50 ~{:.1} us",
        service_p50.unwrap_or(0.0) / 1000.0
    );
    let c = per_unit(before, &after, "virtqueue.requests");
    eprintln!(
        "  {d}: per request: kicks {} calls {} sleeps {} poll-hits {} rearms {} poll-ns {}",
        c["virtqueue.kicks/virtqueue.requests"],
        c["virtqueue.calls/virtqueue.requests"],
        c["blocking-waits/virtqueue.requests"],
        c["poll-hits/virtqueue.requests"],
        c["virtqueue.notify-rearms/virtqueue.requests"],
        c["poll-ns/virtqueue.requests"],
    );
    (c, service_p50)
}
