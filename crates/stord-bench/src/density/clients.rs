//! The density benchmark's clients, written by others: one fio nbd job per NBD export (one
//! fio run, each job its own process, latency histograms from fio's json+ output), one
//! libblkio device per vhost-user-blk export (each its own thread). Idle clients hold
//! their connections without I/O: an NBD handshake each, a started libblkio device each.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::daemon::{DaemonSet, Transport};
use crate::vhost_client::libblkio;
use crate::vhost_client::spec::DriveSpec;

/// What one client does: QD1 4k random reads, paced to `rate` (None: flat out).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientSpec {
    pub rate: Option<f64>,
    pub ramp: Duration,
    pub runtime: Duration,
}

/// Latencies (ns) with how often each was seen.
#[derive(Debug, Clone, Default)]
pub(crate) struct Hist(BTreeMap<u64, u64>);

impl Hist {
    fn add(&mut self, ns: u64, n: u64) {
        *self.0.entry(ns).or_default() += n;
    }

    fn merge(&mut self, o: &Hist) {
        for (&k, &v) in &o.0 {
            self.add(k, v);
        }
    }

    /// The `p` quantile in µs (0 when empty).
    fn quantile_us(&self, p: f64) -> f64 {
        let total: u64 = self.0.values().sum();
        let want = ((total as f64 * p).ceil() as u64).max(1);
        let mut seen = 0;
        for (&k, &v) in &self.0 {
            seen += v;
            if seen >= want {
                return k as f64 / 1e3;
            }
        }
        0.0
    }
}

/// Latencies of several clients: pooled, and each client's own.
#[derive(Debug, Clone, Default)]
pub(crate) struct Latencies {
    pooled: Hist,
    clients: Vec<Hist>,
}

impl Latencies {
    fn of(h: Hist) -> Latencies {
        Latencies {
            pooled: h.clone(),
            clients: vec![h],
        }
    }

    pub fn add_client(&mut self, l: Latencies) {
        self.pooled.merge(&l.pooled);
        self.clients.extend(l.clients);
    }

    /// Quantile `p` over every latency of every client, in µs.
    pub fn pooled(&self, p: f64) -> f64 {
        self.pooled.quantile_us(p)
    }

    /// The highest of the clients' own quantile `p`, in µs.
    pub fn worst(&self, p: f64) -> f64 {
        self.clients
            .iter()
            .map(|h| h.quantile_us(p))
            .fold(0.0, f64::max)
    }
}

/// Clients at work.
pub(crate) enum Running {
    Fio(Child),
    Blkio(std::thread::JoinHandle<Vec<(f64, Vec<u64>)>>),
}

/// Starts the clients of `set`, one per export, each as its spec says.
pub(crate) fn start(t: Transport, set: &DaemonSet, specs: &[ClientSpec]) -> Running {
    match t {
        Transport::Nbd => Running::Fio(fio(set, specs)),
        Transport::Vhost => {
            let socks = set.vhost_socks();
            let specs: Vec<DriveSpec> = specs.iter().map(drive_spec).collect();
            Running::Blkio(std::thread::spawn(move || {
                libblkio::drive_devices(&socks, &specs)
            }))
        }
    }
}

/// Starts the clients and waits for them.
pub(crate) fn run(t: Transport, set: &DaemonSet, specs: &[ClientSpec]) -> Figures {
    start(t, set, specs).finish()
}

impl Running {
    /// Waits for every client; each one's IOPS and latencies.
    pub fn finish(self) -> Figures {
        match self {
            Running::Fio(child) => fio_figures(child),
            Running::Blkio(h) => Figures {
                clients: h
                    .join()
                    .expect("libblkio clients")
                    .into_iter()
                    .map(|(iops, lat)| {
                        let mut h = Hist::default();
                        for ns in lat {
                            h.add(ns, 1);
                        }
                        (iops, Latencies::of(h))
                    })
                    .collect(),
            },
        }
    }
}

fn drive_spec(c: &ClientSpec) -> DriveSpec {
    DriveSpec {
        write: false,
        sequential: false,
        bs: 4096,
        qd: 1,
        ramp: c.ramp,
        runtime: c.runtime,
        think: Duration::ZERO,
        think_spin: false,
        rate_iops: c.rate,
    }
}

/// One fio run with a job per export: `--output-format=json+` for the latency bins.
fn fio(set: &DaemonSet, specs: &[ClientSpec]) -> Child {
    let first = specs.first().expect("a client");
    let mut args: Vec<String> = [
        "--output-format=json+",
        "--verify_state_save=0",
        "--ioengine=nbd",
        "--rw=randread",
        "--bs=4k",
        "--iodepth=1",
        "--time_based",
    ]
    .map(String::from)
    .to_vec();
    args.push(format!("--ramp_time={}ms", first.ramp.as_millis()));
    args.push(format!("--runtime={}ms", first.runtime.as_millis()));
    for (i, s) in specs.iter().enumerate() {
        args.push(format!("--name=c{i}"));
        args.push(format!("--uri={}", set.nbd_uri(i)));
        if let Some(r) = s.rate {
            args.push(format!("--rate_iops={}", r.round().max(1.0) as u64));
        }
    }
    Command::new("fio")
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("fio (scripts/install-deps.sh installs it)")
}

/// Each fio job's IOPS and latency bins.
fn fio_figures(child: Child) -> Figures {
    let out = child.wait_with_output().expect("fio");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = text
        .find('{')
        .and_then(|i| serde_json::from_str(&text[i..]).ok())
        .unwrap_or_else(|| panic!("fio's output: {text}"));
    let jobs = v["jobs"].as_array().cloned().unwrap_or_default();
    let clients = jobs
        .iter()
        .map(|j| {
            let r = &j["read"];
            let mut h = Hist::default();
            if let Some(bins) = r["clat_ns"]["bins"].as_object() {
                for (k, n) in bins {
                    h.add(k.parse().unwrap_or(0), n.as_u64().unwrap_or(0));
                }
            }
            // A job that failed counts as having served nothing.
            let failed = j["error"].as_i64().unwrap_or(0) != 0;
            let iops = if failed {
                0.0
            } else {
                r["iops"].as_f64().unwrap_or(0.0)
            };
            (iops, Latencies::of(h))
        })
        .collect();
    Figures { clients }
}

/// Connections held open without I/O; closed when dropped.
pub(crate) enum Idle {
    Nbd { _held: Vec<UnixStream> },
    Blkio(mpsc::Sender<()>, Option<std::thread::JoinHandle<()>>),
}

impl Drop for Idle {
    fn drop(&mut self) {
        if let Idle::Blkio(stop, h) = self {
            let _ = stop.send(());
            if let Some(h) = h.take() {
                let _ = h.join();
            }
        }
    }
}

/// A client connected to every export of `set`, each having done one read.
pub(crate) fn connect_idle(t: Transport, set: &DaemonSet) -> Idle {
    match t {
        Transport::Nbd => Idle::Nbd {
            _held: (0..set.exports()).map(|i| nbd_connect(set, i)).collect(),
        },
        Transport::Vhost => {
            let socks = set.vhost_socks();
            let (tx, rx) = mpsc::channel();
            let (ready_tx, ready_rx) = mpsc::channel();
            let h = std::thread::spawn(move || libblkio::hold_devices(&socks, ready_tx, rx));
            ready_rx.recv().expect("libblkio devices connected");
            Idle::Blkio(tx, Some(h))
        }
    }
}

/// An NBD client of export `i` (fixed newstyle, NBD_OPT_GO), after one 4k read.
fn nbd_connect(set: &DaemonSet, i: usize) -> UnixStream {
    let mut s = UnixStream::connect(set.nbd_sock()).expect("NBD connect");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("NBD greeting");
    // NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES.
    s.write_all(&3u32.to_be_bytes()).expect("client flags");
    let name = set.export_name(i);
    let mut opt = Vec::new();
    opt.extend_from_slice(b"IHAVEOPT");
    opt.extend_from_slice(&7u32.to_be_bytes());
    opt.extend_from_slice(&(4 + name.len() as u32 + 2).to_be_bytes());
    opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
    opt.extend_from_slice(name.as_bytes());
    opt.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&opt).expect("NBD_OPT_GO");
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).expect("option reply");
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        s.read_exact(&mut data).expect("option reply data");
        assert!(kind < 1 << 31, "NBD_OPT_GO refused: {kind:#x}");
        if kind == 1 {
            break;
        }
    }
    let mut req = Vec::new();
    req.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    req.extend_from_slice(&[0, 0, 0, 0]);
    req.extend_from_slice(&1u64.to_be_bytes());
    req.extend_from_slice(&0u64.to_be_bytes());
    req.extend_from_slice(&4096u32.to_be_bytes());
    s.write_all(&req).expect("NBD read");
    let mut reply = vec![0u8; 16 + 4096];
    s.read_exact(&mut reply).expect("NBD reply");
    s
}

/// The latencies of every client of a run, and their I/O rates.
pub(crate) struct Figures {
    pub clients: Vec<(f64, Latencies)>,
}

impl Figures {
    pub fn iops(&self) -> f64 {
        self.clients.iter().map(|c| c.0).sum()
    }

    /// The light clients' latencies, and the flat-out client's IOPS (client 0, in that
    /// variant).
    /// Light clients (all but the flat-out one, client 0, in that variant) that served
    /// less than nine tenths of `rate`: requests lost or a daemon that stalled.
    pub fn short_of(&self, rate: f64, flat: bool) -> usize {
        self.clients
            .iter()
            .skip(usize::from(flat))
            .filter(|c| c.0 < rate * 0.9)
            .count()
    }

    pub fn split_flat(self, flat: bool) -> (Latencies, Option<f64>) {
        let mut it = self.clients.into_iter();
        let flat_iops = if flat { it.next().map(|c| c.0) } else { None };
        let mut all = Latencies::default();
        for (_, l) in it {
            all.add_client(l);
        }
        (all, flat_iops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(values: &[(u64, u64)]) -> Hist {
        let mut h = Hist::default();
        for &(ns, n) in values {
            h.add(ns, n);
        }
        h
    }

    #[test]
    fn quantiles_pool_clients_and_the_worst_is_a_clients_own() {
        let a = hist(&[(1000, 98), (5000, 2)]);
        let b = hist(&[(2000, 100)]);
        assert_eq!(a.quantile_us(0.5), 1.0);
        assert_eq!(a.quantile_us(0.99), 5.0);
        let mut all = Latencies::default();
        all.add_client(Latencies::of(a));
        all.add_client(Latencies::of(b));
        // Pooled: 200 latencies, the 99th percentile among b's 2 µs.
        assert_eq!(all.pooled(0.99), 2.0);
        assert_eq!(all.pooled(0.999), 5.0);
        assert_eq!(all.worst(0.99), 5.0);
        assert_eq!(Hist::default().quantile_us(0.99), 0.0);
    }

    #[test]
    fn the_flat_out_client_is_set_apart_and_short_clients_counted() {
        let f = Figures {
            clients: vec![
                (9000.0, Latencies::of(hist(&[(100, 1)]))),
                (100.0, Latencies::of(hist(&[(200, 1)]))),
                (80.0, Latencies::of(hist(&[(300, 1)]))),
            ],
        };
        assert_eq!(f.short_of(100.0, true), 1);
        assert_eq!(f.short_of(100.0, false), 1);
        let (light, flat) = f.split_flat(true);
        assert_eq!(flat, Some(9000.0));
        assert_eq!(light.pooled(0.01), 0.2);
    }
}
