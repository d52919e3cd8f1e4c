//! The report's measurements besides the matrix: polling policies against offered load,
//! the poll window over a burst/idle pattern, and linux-aio's completions per harvest.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use stord_aio::{AioContextOptions, IoThread, PolicyKind, PollParams, ReactorKind};

use super::session::{Running, Session, Timing, Workload};
use crate::daemon_args::nbd_args;
use crate::media::Paths;
use crate::peers::Daemon;

/// One point of a policy's load curve.
#[derive(Debug, Serialize)]
pub struct CurvePoint {
    pub daemon: String,
    pub thinktime_us: u64,
    pub iops: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// The daemon's CPU time per second of wall time (its loop, plus an idle main thread).
    pub loop_cpu_ms_per_s: f64,
}

/// fio's thinktime between I/Os: the offered load, from saturated to nearly idle.
pub const THINKTIMES_US: [u64; 5] = [0, 20, 100, 500, 2000];

/// Measures one daemon's curve: NBD, null backend, 4k randread at QD1, one fio run per
/// thinktime against the same daemon.
pub fn curve(daemon: &str, t: &Timing, p: &Paths, mut tick: impl FnMut()) -> Vec<CurvePoint> {
    let mut s = Session::start(super::Export::Nbd, "null", daemon, p);
    let w = Workload {
        rw: "randread",
        bs: 4096,
        qd: 1,
    };
    let mut out = Vec::new();
    for think in THINKTIMES_US {
        tick();
        let extra = if think == 0 {
            Vec::new()
        } else {
            vec![
                format!("--thinktime={think}"),
                "--thinktime_blocks=1".into(),
            ]
        };
        let (r, cpu_us, wall) = s.run(&w, t, p, &extra);
        out.push(CurvePoint {
            daemon: daemon.to_string(),
            thinktime_us: think,
            iops: r.iops,
            p50_us: r.p50_us,
            p99_us: r.p99_us,
            loop_cpu_ms_per_s: cpu_us.unwrap_or(0.0) / 1000.0 / wall.as_secs_f64(),
        });
    }
    out
}

/// The phases of the window trace: (kind, length).
const PHASES: [(&str, u64); 6] = [
    ("burst", 300),
    ("idle", 300),
    ("burst", 300),
    ("idle", 300),
    ("burst", 300),
    ("idle", 300),
];

/// The poll window over time under a burst/idle pattern, for each adaptive policy, on an
/// IoThread of this process (the same loop code the daemon runs). Bursts are back-to-back
/// `Remote` round trips with 5 µs of client think time; idle phases a round trip every
/// 2 ms. The window (the loop's, max over its handlers) is sampled every 0.5 ms.
pub fn window_trace(policies: &[PolicyKind], reactor: ReactorKind) -> Value {
    let mut series = serde_json::Map::new();
    for &policy in policies {
        let t = IoThread::spawn(AioContextOptions {
            name: format!("window-{policy}"),
            reactor,
            poll: PollParams {
                policy,
                ..PollParams::default()
            },
            ..AioContextOptions::default()
        })
        .expect("start iothread");
        let remote = t.remote().clone();
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let sampler = {
            let (remote, stop) = (remote.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut ts, mut ws) = (Vec::new(), Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    ts.push(start.elapsed().as_secs_f64() * 1000.0);
                    ws.push(remote.stats().window_ns);
                    std::thread::sleep(Duration::from_micros(500));
                }
                (ts, ws)
            })
        };
        let reply = Arc::new(AtomicU64::new(0));
        let round_trip = || {
            reply.store(0, Ordering::Relaxed);
            let r = reply.clone();
            remote.spawn(async move { r.store(1, Ordering::Release) });
            while reply.load(Ordering::Acquire) == 0 {
                std::hint::spin_loop();
            }
        };
        let mut phase_end = Duration::ZERO;
        for (kind, ms) in PHASES {
            phase_end += Duration::from_millis(ms);
            while start.elapsed() < phase_end {
                round_trip();
                if kind == "burst" {
                    let until = Instant::now() + Duration::from_micros(5);
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                } else {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        let (ts, ws) = sampler.join().expect("sampler");
        drop(t);
        series.insert(
            policy.name().to_string(),
            json!({ "t_ms": ts, "window_ns": ws }),
        );
    }
    let mut at = 0;
    let phases: Vec<Value> = PHASES
        .iter()
        .map(|(kind, ms)| {
            let v = json!({ "start_ms": at, "end_ms": at + ms, "kind": kind });
            at += ms;
            v
        })
        .collect();
    json!({
        "description": "IoThread in stord-bench's process, poll-max-ns 65536 (the default); bursts: back-to-back Remote round trips with 5 µs client think time; idle: one round trip every 2 ms; window sampled every 0.5 ms",
        "phases": phases,
        "series": series,
    })
}

/// linux-aio completions per harvest, with and without harvesting right after io_submit:
/// stord serves the file (aio=native, O_DIRECT) over NBD to fio (4k randread QD16), and
/// reports its harvest histograms through QMP (query-iothreads x-stats).
pub fn harvest(t: &Timing, p: &Paths, mut tick: impl FnMut()) -> Value {
    let labels: Vec<String> = (0..8)
        .map(|i| match i {
            0 => "0".to_string(),
            1 => "1".to_string(),
            7 => "64+".to_string(),
            i => format!("{}-{}", 1 << (i - 1), (1 << i) - 1),
        })
        .collect();
    let mut runs = Vec::new();
    for reap in [true, false] {
        tick();
        let (bin, mut args, uri) = nbd_args("stord-classic", "file-native", p);
        if !reap {
            let node = args
                .iter_mut()
                .find(|a| a.starts_with("driver=file"))
                .unwrap();
            node.push_str(",x-reap-after-submit=off");
        }
        // The histograms are loop statistics: read them over QMP before the daemon stops.
        let qmp_sock = p.sock.with_extension("qmp");
        args.extend([
            "--chardev".into(),
            format!("socket,id=m,path={},server=on,wait=off", qmp_sock.display()),
            "--monitor".into(),
            "chardev=m".into(),
        ]);
        let mut cmd = Command::new(&bin);
        cmd.args(&args).stdout(Stdio::null()).stderr(Stdio::null());
        let d = Daemon::start_cmd("stord", cmd, &p.sock);
        // The monitor comes after the NBD socket on the command line: wait for it too.
        let start = std::time::Instant::now();
        let mut qmp = loop {
            match crate::qmp::Qmp::connect(&qmp_sock) {
                Ok(q) => break q,
                Err(e) if start.elapsed() > std::time::Duration::from_secs(10) => {
                    panic!("QMP {}: {e}", qmp_sock.display())
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        };
        let mut s = Session::from_running(Running::Nbd(d, uri));
        let w = Workload {
            rw: "randread",
            bs: 4096,
            qd: 16,
        };
        let (r, _, _) = s.run(&w, t, p, &[]);
        let on_event = qmp.histogram("linux-aio.harvest-on-event").expect("QMP");
        let after_submit = qmp
            .histogram("linux-aio.harvest-after-submit")
            .expect("QMP");
        drop(qmp);
        drop(s);
        let _ = std::fs::remove_file(&qmp_sock);
        let h = json!({ "on_event": on_event, "after_submit": after_submit });
        let fold = |v: &Value| -> Vec<u64> {
            let mut b = vec![0u64; 8];
            for (i, n) in v.as_array().into_iter().flatten().enumerate() {
                b[i.min(7)] += n.as_u64().unwrap_or(0);
            }
            b
        };
        runs.push(json!({
            "reap_after_submit": reap,
            "on_event": fold(&h["on_event"]),
            "after_submit": fold(&h["after_submit"]),
            "iops": r.iops,
        }));
    }
    json!({ "bucket_labels": labels, "runs": runs })
}
