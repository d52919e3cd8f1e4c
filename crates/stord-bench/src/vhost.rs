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

use std::time::{Duration, Instant};

use crate::daemon_args::{blockdev, qsd_style, vhost_args_mq};
use crate::matrix::{default_workloads, fio_raw, Row};
use crate::media::{bench_dir, prepare_image, FastDev};
use crate::peers::{which, Daemon, FioResult};
use crate::qmp::{per_unit, Qmp};
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
pub fn run(opts: &VhostOptions) -> (Vec<Row>, Vec<serde_json::Value>) {
    let mut counters = Vec::new();
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
    let runtime = Duration::from_secs(opts.runtime_s);
    let has_file = opts.backends.iter().any(|b| b == "file" || b == "dev");
    let cases = opts.backends.len() * opts.clients.len() * opts.workloads.len() * opts.reps;
    let total = cases * opts.daemons.len()
        + usize::from(has_file) * opts.clients.len() * opts.workloads.len() * opts.reps;
    let mut n = 0;
    let mut rows = Vec::new();
    for backend in &opts.backends {
        let img = match (backend.as_str(), &fastdev) {
            ("dev", Some(f)) => f.dev.clone(),
            _ => img.clone(),
        };
        for client in &opts.clients {
            for (rw, qd) in &opts.workloads {
                let write = rw.contains("write");
                let mut names = opts.daemons.clone();
                if backend == "file" || backend == "dev" {
                    names.push("fio-raw".into());
                }
                let mut per: Vec<Vec<(FioResult, Option<f64>)>> = vec![Vec::new(); names.len()];
                for rep in 0..opts.reps {
                    for (i, d) in names.iter().enumerate() {
                        n += 1;
                        eprintln!(
                            "[{n}/{total}] vhost-user-blk {backend} {client} {rw} QD{qd} {d} (rep {})",
                            rep + 1
                        );
                        if d == "fio-raw" {
                            let fio_qd = *qd * opts.queues as u32;
                            per[i].push((fio_raw(rw, fio_qd, opts.runtime_s, &img), None));
                            continue;
                        }
                        // This benchmark's "file" backend is the report's file-io_uring.
                        let backend = if backend == "file" {
                            "file-io_uring"
                        } else {
                            backend
                        };
                        let (bin, iothread) = qsd_style(d);
                        let stord = d != "qsd";
                        let iothreads = if stord {
                            opts.iothreads.unwrap_or(opts.queues)
                        } else {
                            1
                        };
                        let mut args = vhost_args_mq(
                            iothread,
                            blockdev(backend, &img),
                            &sock,
                            opts.queues,
                            iothreads,
                        );
                        let qmp_sock = dir.join("vhost-bench-qmp.sock");
                        if stord {
                            args.extend([
                                "--chardev".into(),
                                format!(
                                    "socket,id=mon,path={},server=on,wait=off",
                                    qmp_sock.display()
                                ),
                                "--monitor".into(),
                                "chardev=mon".into(),
                            ]);
                        }
                        let daemon = Daemon::start(d, &bin, &args, &sock);
                        let mut qmp = stord.then(|| Qmp::connect(&qmp_sock).expect("QMP"));
                        let before = qmp.as_mut().map(|q| q.loop_counters().expect("x-stats"));
                        let svc0 = qmp
                            .as_mut()
                            .map(|q| q.histogram("virtqueue.service-ns").expect("x-stats"));
                        let cpu0 = daemon.cpu_ns();
                        let t0 = Instant::now();
                        let spec = DriveSpec {
                            write,
                            sequential: false,
                            bs: 4096,
                            qd: *qd as u16,
                            ramp: Duration::from_secs(1),
                            runtime,
                            think: Duration::from_micros(opts.think_us),
                            think_spin: opts.think_spin,
                            rate_iops: None,
                        };
                        let r = drive_with(client, &sock, &spec, opts.queues);
                        let wall = t0.elapsed().as_secs_f64();
                        let cpu1 = daemon.cpu_ns();
                        if let (Some(q), Some(before)) = (qmp.as_mut(), before) {
                            let after = q.loop_counters().expect("x-stats");
                            let svc1 = q.histogram("virtqueue.service-ns").expect("x-stats");
                            let service_p50 = svc0
                                .as_deref()
                                .and_then(|b| crate::qmp::histogram_median(b, &svc1));
                            eprintln!(
                                "  {d}: request service time (pop to completion published) p50 ~{:.1} us",
                                service_p50.unwrap_or(0.0) / 1000.0
                            );
                            let c = per_unit(&before, &after, "virtqueue.requests");
                            eprintln!(
                                "  {d}: per request: kicks {} calls {} sleeps {} poll-hits {} rearms {} poll-ns {}",
                                c["virtqueue.kicks/virtqueue.requests"],
                                c["virtqueue.calls/virtqueue.requests"],
                                c["blocking-waits/virtqueue.requests"],
                                c["poll-hits/virtqueue.requests"],
                                c["virtqueue.notify-rearms/virtqueue.requests"],
                                c["poll-ns/virtqueue.requests"],
                            );
                            counters.push(serde_json::json!({
                                "backend": backend, "client": client, "workload": rw,
                                "iodepth": qd, "daemon": d, "rep": rep,
                                "iops": r.iops, "per_request": c,
                                "service_p50_ns": service_p50,
                            }));
                        }
                        // CPU over the whole connection (ramp included) per I/O at the
                        // measured rate over the same wall time.
                        let ios = r.iops * wall;
                        per[i].push((r, Some((cpu1 - cpu0) as f64 / 1000.0 / ios.max(1.0))));
                        drop(daemon);
                    }
                }
                let label = if client == "own" {
                    backend.clone()
                } else {
                    format!("{backend} {client}")
                };
                let label = match (opts.queues, opts.iothreads) {
                    (1, _) => label,
                    (q, Some(t)) => format!("{label} x{q}q/{t}t"),
                    (q, None) => format!("{label} x{q}q"),
                };
                for (i, d) in names.iter().enumerate() {
                    rows.push(Row::summarize(&label, rw, *qd, d, &per[i]));
                }
            }
        }
    }
    let _ = std::fs::remove_file(&sock);
    (rows, counters)
}
