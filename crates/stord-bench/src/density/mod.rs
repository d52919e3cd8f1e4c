//! `stord-bench density`: many light guests on one host. N IoThreads with one export each
//! (NBD through fio's nbd engine, vhost-user-blk through libblkio), every client paced at
//! QD1 so that together they offer a fraction (half by default) of what the slower daemon
//! serves one export at QD1 flat out: the shape then measures the daemons, not the
//! scheduler of a small machine. A variant runs one client flat out among the light ones.
//!
//! Each daemon set-up (stord and qsd, with their default polling and with poll-max-ns=0)
//! serves each shape in turn, started afresh, the order alternating between repetitions.
//! Measured: the daemon's CPU per second and per I/O, latency percentiles pooled over the
//! clients and the worst client's p99, the flat-out client's IOPS, the resident memory per
//! export; and, with every client connected and no I/O, the idle cost from the threads'
//! schedstat.

mod clients;
mod daemon;
pub mod floor;
pub mod report;

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::media::Media;
use crate::peers::ProcStat;
use clients::ClientSpec;
use daemon::DaemonSet;
pub use daemon::Transport;

pub struct DensityOptions {
    /// IoThreads (one export each) per shape.
    pub shapes: Vec<usize>,
    pub transports: Vec<Transport>,
    /// `null`, `file-io_uring`, `dev`.
    pub backends: Vec<String>,
    /// `stord`, `stord-poll0`, `qsd`, `qsd-poll0`, a stord-POLICY, or `floor` (the
    /// kernel's own cost of a request: [`floor`]; NBD over null only).
    pub daemons: Vec<String>,
    pub ramp: Duration,
    pub runtime: Duration,
    pub reps: usize,
    /// The variants each shape runs: `light`, `flat-out` (one client flat out), or both.
    pub variants: Vec<&'static str>,
    /// How long the idle cost is measured (zero: not at all).
    pub idle: Duration,
    /// The offered load as a fraction of the slower daemon's one-export QD1 maximum.
    pub load: f64,
    /// How long each daemon's one-export maximum is measured.
    pub calibrate: Duration,
    /// The total offered load, given instead of measured (for before/after runs at one
    /// load).
    pub total_iops: Option<f64>,
}

impl Default for DensityOptions {
    fn default() -> Self {
        Self {
            shapes: vec![8, 32, 64],
            transports: vec![Transport::Nbd, Transport::Vhost],
            backends: vec!["null".into(), "file-io_uring".into(), "dev".into()],
            daemons: ["stord", "stord-poll0", "qsd", "qsd-poll0"]
                .map(String::from)
                .to_vec(),
            ramp: Duration::from_secs(3),
            runtime: Duration::from_secs(60),
            reps: 3,
            variants: vec!["light", "flat-out"],
            idle: Duration::from_secs(60),
            load: 0.5,
            calibrate: Duration::from_secs(5),
            total_iops: None,
        }
    }
}

/// What one run of one daemon set-up measured.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// The daemon's user and system CPU over the measured time.
    pub cpu_ms_per_s: f64,
    pub cpu_us_per_io: f64,
    /// Every client's I/Os together.
    pub iops: f64,
    /// Pooled over every light client.
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// The highest p99 of a single light client.
    pub worst_p99_us: f64,
    /// The flat-out client's IOPS, in that variant.
    pub flat_iops: Option<f64>,
    /// The daemon's resident memory at the end, over the exports.
    pub rss_kib_per_export: f64,
    /// Light clients served less than nine tenths of their rate (lost requests, a stall).
    pub short_clients: usize,
}

/// One (transport, backend, variant, shape, daemon) over its repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub transport: &'static str,
    pub backend: String,
    /// `light`, or `flat-out` with client 0 unpaced.
    pub variant: &'static str,
    pub shape: usize,
    pub daemon: String,
    pub rate_per_client: f64,
    pub runs: Vec<Run>,
    /// CPU over the idle measurement, every client connected (light rows only).
    pub idle_ms: Option<f64>,
}

/// The benchmark's result: the one-export maxima the loads came from, and the rows.
#[derive(Debug, Clone, Serialize)]
pub struct Density {
    /// (transport, backend, daemon, IOPS at QD1 with one export).
    pub maxima: Vec<(&'static str, String, String, f64)>,
    pub rows: Vec<Row>,
}

/// Runs every case of `opts`.
pub fn run(opts: &DensityOptions) -> Density {
    let backends: Vec<&str> = opts.backends.iter().map(String::as_str).collect();
    let media = Media::prepare(&backends);
    let mut out = Density {
        maxima: Vec::new(),
        rows: Vec::new(),
    };
    for &t in &opts.transports {
        for (i, &backend) in backends.iter().enumerate() {
            let img = media.paths(backend, "density").img;
            let case = Case {
                opts,
                transport: t,
                backend,
                img: &img,
            };
            let total = match opts.total_iops {
                Some(t) => t,
                None => case.calibrate(&mut out.maxima) * opts.load,
            };
            for &n in &opts.shapes {
                let rate = total / n as f64;
                let mut rows = case.shape(n, rate);
                if i == 0 && !opts.idle.is_zero() && opts.variants.contains(&"light") {
                    case.idle(n, &mut rows);
                }
                out.rows.extend(rows);
            }
        }
    }
    out
}

/// One transport over one backend.
struct Case<'a> {
    opts: &'a DensityOptions,
    transport: Transport,
    backend: &'a str,
    img: &'a std::path::Path,
}

impl Case<'_> {
    /// Each daemon's one-export QD1 maximum (stord's and qsd's default set-ups); the
    /// slower one's.
    fn calibrate(&self, maxima: &mut Vec<(&'static str, String, String, f64)>) -> f64 {
        let mut slower = f64::INFINITY;
        for d in ["stord", "qsd"] {
            eprintln!(
                "density: {} {} {d}: one export, QD1 flat out",
                self.transport.name(),
                self.backend
            );
            let set = DaemonSet::start(d, self.transport, self.backend, self.img, 1);
            let spec = ClientSpec {
                rate: None,
                ramp: Duration::from_secs(1),
                runtime: self.opts.calibrate,
            };
            let iops = clients::run(self.transport, &set, &[spec]).iops();
            maxima.push((self.transport.name(), self.backend.into(), d.into(), iops));
            slower = slower.min(iops);
        }
        slower
    }

    /// Every daemon on `n` exports, light (and with one client flat out), repetitions
    /// alternating the daemons' order.
    fn shape(&self, n: usize, rate: f64) -> Vec<Row> {
        let mut rows = Vec::new();
        for &variant in &self.opts.variants {
            let mut mine: Vec<Row> = self
                .opts
                .daemons
                .iter()
                .map(|d| self.row(variant, n, d, rate))
                .collect();
            for rep in 0..self.opts.reps {
                let order: Vec<usize> = if rep % 2 == 0 {
                    (0..mine.len()).collect()
                } else {
                    (0..mine.len()).rev().collect()
                };
                for i in order {
                    let r = &mut mine[i];
                    eprintln!(
                        "density: {} {} {variant} x{n} at {rate:.0} IOPS each: {} (rep {}/{})",
                        r.transport,
                        r.backend,
                        r.daemon,
                        rep + 1,
                        self.opts.reps
                    );
                    let run = self.once(&r.daemon, n, rate, variant == "flat-out");
                    r.runs.push(run);
                }
            }
            rows.extend(mine);
        }
        rows
    }

    fn row(&self, variant: &'static str, n: usize, daemon: &str, rate: f64) -> Row {
        Row {
            transport: self.transport.name(),
            backend: self.backend.into(),
            variant,
            shape: n,
            daemon: daemon.into(),
            rate_per_client: rate,
            runs: Vec::new(),
            idle_ms: None,
        }
    }

    /// One run: the daemon started with `n` exports, its clients driven, its CPU read
    /// over the measured time.
    fn once(&self, daemon: &str, n: usize, rate: f64, flat: bool) -> Run {
        let opts = self.opts;
        let set = DaemonSet::start(daemon, self.transport, self.backend, self.img, n);
        let specs: Vec<ClientSpec> = (0..n)
            .map(|i| ClientSpec {
                rate: (!(flat && i == 0)).then_some(rate),
                ramp: opts.ramp,
                runtime: opts.runtime,
            })
            .collect();
        let clients = clients::start(self.transport, &set, &specs);
        std::thread::sleep(opts.ramp);
        let (s0, t0) = (ProcStat::read(set.pid()), Instant::now());
        std::thread::sleep(opts.runtime);
        let used = ProcStat::read(set.pid()).since(&s0);
        let secs = t0.elapsed().as_secs_f64();
        let rss = set.rss_kib();
        let figures = clients.finish();
        drop(set);
        let cpu_ns = (used.user_ns + used.sys_ns) as f64;
        let iops = figures.iops();
        let short_clients = figures.short_of(rate, flat);
        let (light, flat_iops) = figures.split_flat(flat);
        Run {
            cpu_ms_per_s: cpu_ns / 1e6 / secs,
            cpu_us_per_io: cpu_ns / 1e3 / (iops * secs).max(1.0),
            iops,
            p50_us: light.pooled(0.50),
            p99_us: light.pooled(0.99),
            p999_us: light.pooled(0.999),
            worst_p99_us: light.worst(0.99),
            flat_iops,
            rss_kib_per_export: rss as f64 / n as f64,
            short_clients,
        }
    }

    /// The idle cost of each daemon with `n` exports, every client connected, no I/O.
    fn idle(&self, n: usize, rows: &mut [Row]) {
        for r in rows.iter_mut().filter(|r| r.variant == "light") {
            eprintln!(
                "density: {} idle x{n}: {} for {} s",
                r.transport,
                r.daemon,
                self.opts.idle.as_secs()
            );
            let set = DaemonSet::start(&r.daemon, self.transport, self.backend, self.img, n);
            let conns = clients::connect_idle(self.transport, &set);
            // What connecting cost settles first.
            std::thread::sleep(Duration::from_secs(2));
            let before = set.sched_ns();
            std::thread::sleep(self.opts.idle);
            r.idle_ms = Some((set.sched_ns() - before) as f64 / 1e6);
            drop(conns);
        }
    }
}
