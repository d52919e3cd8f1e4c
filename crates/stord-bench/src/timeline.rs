//! `stord-bench timeline`: where the time of one request goes at queue depth 1. The
//! client runs 4k random reads at QD1 against one daemon while `perf record -a` traces the
//! scheduler (wake-ups, switches), every system call's entry, io_uring submissions and
//! the block layer for a second. At QD1 the requests follow one another strictly, so the
//! trace splits into cycles at each request's issue to the device, and each cycle into
//! milestones found in order:
//!
//! 1. the device starts the read (`block_rq_issue`) and
//! 2. finishes it (`block_rq_complete`);
//! 3. the daemon's first system call after that (the reply, or a wait);
//! 4. the client is woken (absent when it was running or polling) and
//! 5. sends its next request (its first write, writev, sendto, sendmsg or io_uring_enter
//!    after the reply);
//! 6. the daemon is woken (absent when it was polling) and
//! 7. submits to io_uring for the last time before
//! 8. the device starts the next read.
//!
//! The medians of the gaps between milestones, how often each wake-up happened, and the
//! CPU time each side ran per cycle say where the 100-odd µs a daemon adds go. Tracing
//! every system call slows everybody a little alike; the figures compare the daemons, they
//! are not the untraced latency.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::Serialize;

use crate::matrix::median;
use crate::media::{Media, Paths};
use crate::report::session::{Export, Session, Timing, Workload};

pub struct TimelineOptions {
    pub exports: Vec<Export>,
    pub backends: Vec<String>,
    pub daemons: Vec<String>,
    /// How long perf traces (the client runs 2 s longer).
    pub trace: Duration,
    pub reps: usize,
}

impl Default for TimelineOptions {
    fn default() -> Self {
        Self {
            exports: vec![Export::Nbd, Export::Fuse, Export::VhostBlkio],
            backends: vec!["file-io_uring".into(), "dev".into()],
            daemons: vec!["stord-classic".into(), "qsd".into(), "fio-raw".into()],
            trace: Duration::from_secs(1),
            reps: 2,
        }
    }
}

/// The system calls (x86-64 numbers) a client sends a request with: write (libblkio's
/// kick), writev, sendto and sendmsg (libnbd), io_uring_enter (fio's engine on a file or
/// the FUSE mount).
const SENDS: [u32; 5] = [1, 20, 44, 46, 426];

/// The gaps between milestones, in the order of the module doc.
pub const GAPS: [&str; 7] = [
    "device",
    "complete → daemon's next syscall",
    "→ client sends the next request",
    "→ daemon's last io_uring submit",
    "submit → device",
    "(client woken → syscall)",
    "(daemon woken → submit)",
];

/// One traced run.
#[derive(Debug, Clone, Serialize)]
pub struct Trace {
    pub export: String,
    pub backend: String,
    pub daemon: String,
    /// The client's own figures for the whole run (traced part included).
    pub client_iops: f64,
    pub client_mean_us: f64,
    pub cycles: usize,
    /// Median length of a cycle (request to request), µs.
    pub cycle_us: f64,
    /// Median of each gap of [`GAPS`], µs (None where a milestone was never seen).
    pub gaps_us: Vec<Option<f64>>,
    /// Share of cycles with a client wake-up, and with a daemon wake-up on the request.
    pub client_woken: f64,
    pub daemon_woken: f64,
    /// Per cycle: CPU time the daemon's and the client's threads ran (µs), and their
    /// system calls.
    pub daemon_cpu_us: f64,
    pub client_cpu_us: f64,
    pub daemon_syscalls: f64,
    pub client_syscalls: f64,
}

/// One parsed `perf script` line.
#[derive(Debug)]
enum Ev {
    Wakeup { pid: u32 },
    Switch { prev: u32, next: u32 },
    SysEnter { nr: u32 },
    Submit,
    Issue { dev: String },
    Complete { dev: String },
}

struct Line {
    tid: u32,
    ns: u64,
    ev: Ev,
}

fn field<'a>(s: &'a str, key: &str) -> Option<&'a str> {
    let i = s.find(key)? + key.len();
    s[i..].split_whitespace().next()
}

/// Whether a block event's trace (`7,0 R 4096 () 123 + 8 ...` for an issue, `7,0 R () 123
/// + 8 ...` for a completion) is a 4 KiB read; `third` is the issue's byte count or the
/// completion's `()`.
fn read_4k(trace: &str, third: &str) -> bool {
    let mut t = trace.split_whitespace().skip(1);
    let rwbs = t.next().unwrap_or("");
    rwbs.contains('R') && t.next() == Some(third) && trace.contains(" + 8 ")
}

/// Parses `comm tid [cpu] secs.nanos: event: trace` (the comm may hold spaces).
fn parse_line(l: &str) -> Option<Line> {
    let open = l.match_indices(" [").map(|(i, _)| i).find(|&i| {
        l[i + 2..]
            .split(']')
            .next()
            .is_some_and(|c| !c.is_empty() && c.chars().all(|c| c.is_ascii_digit()))
    })?;
    let tid: u32 = l[..open].split_whitespace().last()?.parse().ok()?;
    let rest = &l[open + 2..];
    let rest = &rest[rest.find("] ")? + 2..];
    let (time, rest) = rest.trim_start().split_once(": ")?;
    let (secs, frac) = time.split_once('.')?;
    let ns = secs.parse::<u64>().ok()? * 1_000_000_000 + frac.parse::<u64>().ok()?;
    let (event, trace) = rest
        .trim_start()
        .split_once(": ")
        .unwrap_or((rest.trim(), ""));
    let dev = || trace.split_whitespace().next().unwrap_or("").to_string();
    let ev = match event {
        "sched:sched_wakeup" => Ev::Wakeup {
            pid: field(trace, "pid=")?.parse().ok()?,
        },
        "sched:sched_switch" => Ev::Switch {
            prev: field(trace, "prev_pid=")?.parse().ok()?,
            next: field(trace, "next_pid=")?.parse().ok()?,
        },
        "raw_syscalls:sys_enter" => Ev::SysEnter {
            nr: field(trace, "NR ")?.parse().ok()?,
        },
        "io_uring:io_uring_submit_req" => Ev::Submit,
        // Only 4 KiB reads, the requests traced (not the writeback of anything else).
        "block:block_rq_issue" if read_4k(trace, "4096") => Ev::Issue { dev: dev() },
        "block:block_rq_complete" if read_4k(trace, "()") => Ev::Complete { dev: dev() },
        _ => return None,
    };
    Some(Line { tid, ns, ev })
}

/// Threads of `pid` now.
fn threads(pid: u32) -> HashSet<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// Threads whose command name is `comm`.
fn threads_named(comm: &str) -> HashSet<u32> {
    let mut out = HashSet::new();
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm) {
            out.extend(threads(pid));
        }
    }
    out
}

/// Records `secs` of the whole machine into `out`.
fn perf_record(out: &Path, d: Duration) {
    let st = Command::new("perf")
        .args([
            "record",
            "-q",
            "-a",
            "-m",
            "1024",
            "-e",
            "sched:sched_switch,sched:sched_wakeup,raw_syscalls:sys_enter,\
             io_uring:io_uring_submit_req,block:block_rq_issue,block:block_rq_complete",
            "-o",
        ])
        .arg(out)
        .args(["--", "sleep", &format!("{:.3}", d.as_secs_f64())])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run perf (linux-perf)");
    assert!(st.success(), "perf record failed");
}

fn perf_lines(data: &Path) -> Vec<Line> {
    let out = Command::new("perf")
        .args([
            "script",
            "--ns",
            "-F",
            "comm,tid,cpu,time,event,trace",
            "-i",
        ])
        .arg(data)
        .stderr(std::process::Stdio::null())
        .output()
        .expect("run perf script");
    let mut v: Vec<Line> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(parse_line)
        .collect();
    v.sort_by_key(|l| l.ns);
    v
}

/// Splits the trace into cycles and measures them (see the module doc).
fn analyse(lines: &[Line], daemon: &HashSet<u32>, client: &HashSet<u32>) -> Analysis {
    let dev = busiest_device(lines);
    let issues: Vec<usize> = (0..lines.len())
        .filter(|&i| matches!(&lines[i].ev, Ev::Issue { dev: d } if *d == dev))
        .collect();
    let mut a = Analysis::default();
    let (first, last) = match (issues.first(), issues.last()) {
        (Some(&f), Some(&l)) if issues.len() > 2 => (f, l),
        _ => return a,
    };
    a.windows = issues.len() - 1;
    let window = (lines[first].ns, lines[last].ns);
    a.count_cpu(lines, window, daemon, client);
    for w in issues.windows(2) {
        let cyc = &lines[w[0]..=w[1]];
        if let Some(m) = Milestones::find(cyc, &dev, daemon, client) {
            a.add_cycle(cyc, &m);
        }
    }
    a
}

/// The device that started the most requests in the trace.
fn busiest_device(lines: &[Line]) -> String {
    let mut per_dev: HashMap<&str, usize> = HashMap::new();
    for l in lines {
        if let Ev::Issue { dev } = &l.ev {
            *per_dev.entry(dev).or_default() += 1;
        }
    }
    per_dev
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(d, _)| d.to_string())
        .unwrap_or_default()
}

/// Where a cycle's milestones (numbered as in the module doc) are in it; the issue (1) is
/// its first line and the next issue (8) its last.
struct Milestones {
    m2: usize,
    m3: Option<usize>,
    m4: Option<usize>,
    m5: Option<usize>,
    m6: Option<usize>,
    m7: Option<usize>,
}

impl Milestones {
    /// Finds them in order in `cyc`; None when the device's completion is not there.
    fn find(cyc: &[Line], dev: &str, daemon: &HashSet<u32>, client: &HashSet<u32>) -> Option<Self> {
        let find = |from: usize, f: &dyn Fn(&Line) -> bool| -> Option<usize> {
            (from..cyc.len()).find(|&i| f(&cyc[i]))
        };
        let m2 = find(
            1,
            &|l| matches!(&l.ev, Ev::Complete { dev: d } if *d == dev),
        )?;
        let m3 = find(m2, &|l| {
            matches!(l.ev, Ev::SysEnter { .. }) && daemon.contains(&l.tid)
        });
        let m5 = m3.and_then(|m3| {
            find(m3, &|l| {
                matches!(l.ev, Ev::SysEnter { nr } if SENDS.contains(&nr))
                    && client.contains(&l.tid)
            })
        });
        let m4 = m3.and_then(|m3| {
            find(
                m3,
                &|l| matches!(l.ev, Ev::Wakeup { pid } if client.contains(&pid)),
            )
            .filter(|&i| m5.is_some_and(|m5| i <= m5))
        });
        // The daemon's last submit of the cycle, after everything before it.
        let after = m5.or(m3).unwrap_or(m2);
        let m7 = (0..cyc.len())
            .rev()
            .find(|&i| matches!(cyc[i].ev, Ev::Submit) && daemon.contains(&cyc[i].tid))
            .filter(|&i| i > after);
        let m6 = m5.and_then(|m5| {
            find(
                m5,
                &|l| matches!(l.ev, Ev::Wakeup { pid } if daemon.contains(&pid)),
            )
            .filter(|&i| m7.is_some_and(|m7| i <= m7))
        });
        Some(Milestones {
            m2,
            m3,
            m4,
            m5,
            m6,
            m7,
        })
    }
}

#[derive(Default)]
struct Analysis {
    /// Request-to-request windows in the trace (CPU and system calls are per window).
    windows: usize,
    /// Lengths of the cycles whose completion was found.
    cycles: Vec<f64>,
    gaps: [Vec<f64>; 7],
    client_woken: usize,
    daemon_woken: usize,
    daemon_cpu_ns: u64,
    client_cpu_ns: u64,
    daemon_syscalls: usize,
    client_syscalls: usize,
}

impl Analysis {
    /// On-CPU time of each side inside the window [ws, we], from the switches, and their
    /// system calls in it: a stretch is cut to the window; one open at the end runs to it; a
    /// thread seen switched out without having been seen switched in ran since the trace
    /// began; one that made system calls but never switched at all ran throughout (a
    /// poller that never sleeps).
    fn count_cpu(
        &mut self,
        lines: &[Line],
        (ws, we): (u64, u64),
        daemon: &HashSet<u32>,
        client: &HashSet<u32>,
    ) {
        let t_begin = lines.first().map_or(ws, |l| l.ns);
        let both: HashSet<u32> = daemon.union(client).copied().collect();
        let clip = |from: u64, to: u64| to.min(we).saturating_sub(from.max(ws));
        let mut on_since: HashMap<u32, u64> = HashMap::new();
        let mut switched: HashSet<u32> = HashSet::new();
        let mut active: HashSet<u32> = HashSet::new();
        let (mut dcpu, mut ccpu) = (0u64, 0u64);
        let mut add = |tid: u32, ns: u64| {
            if daemon.contains(&tid) {
                dcpu += ns;
            } else if client.contains(&tid) {
                ccpu += ns;
            }
        };
        for l in lines {
            match l.ev {
                Ev::Switch { prev, next } => {
                    if both.contains(&prev) {
                        let since = on_since
                            .remove(&prev)
                            .unwrap_or(if switched.contains(&prev) {
                                l.ns
                            } else {
                                t_begin
                            });
                        add(prev, clip(since, l.ns));
                    }
                    switched.insert(prev);
                    switched.insert(next);
                    if both.contains(&next) {
                        on_since.insert(next, l.ns);
                    }
                }
                Ev::SysEnter { .. } if l.ns >= ws && l.ns < we => {
                    active.insert(l.tid);
                    if daemon.contains(&l.tid) {
                        self.daemon_syscalls += 1;
                    } else if client.contains(&l.tid) {
                        self.client_syscalls += 1;
                    }
                }
                _ => {}
            }
        }
        for (tid, since) in on_since {
            add(tid, clip(since, we));
        }
        for &tid in active.difference(&switched) {
            add(tid, we - ws);
        }
        self.daemon_cpu_ns = dcpu;
        self.client_cpu_ns = ccpu;
    }

    /// Adds cycle `cyc`: its length, the gaps between its milestones `m`, its wake-ups.
    fn add_cycle(&mut self, cyc: &[Line], m: &Milestones) {
        let t0 = cyc[0].ns;
        let t = |i: Option<usize>| i.map(|i| cyc[i].ns);
        let gap = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / 1000.0),
            _ => None,
        };
        let t8 = cyc[cyc.len() - 1].ns;
        self.cycles.push((t8 - t0) as f64 / 1000.0);
        let m2 = Some(m.m2);
        let g = [
            gap(Some(t0), t(m2)),
            gap(t(m2), t(m.m3)),
            gap(t(m.m3), t(m.m5)),
            gap(t(m.m5), t(m.m7)),
            gap(t(m.m7), Some(t8)),
            gap(t(m.m4), t(m.m5)),
            gap(t(m.m6), t(m.m7)),
        ];
        for (k, v) in g.into_iter().enumerate() {
            if let Some(v) = v {
                self.gaps[k].push(v);
            }
        }
        self.client_woken += usize::from(m.m4.is_some());
        self.daemon_woken += usize::from(m.m6.is_some());
    }
}

/// Traces one (export, medium, daemon) run.
fn trace_one(export: Export, backend: &str, daemon: &str, p: &Paths, d: Duration) -> Trace {
    let t = Timing {
        ramp: Duration::from_millis(500),
        runtime: d + Duration::from_secs(2),
    };
    let w = Workload {
        rw: "randread",
        bs: 4096,
        qd: 1,
    };
    let mut s = Session::start(export, backend, daemon, p);
    let pid = s.pid();
    // On tmpfs: written to the traced disk, perf's output would be traced too.
    let data = PathBuf::from("/dev/shm/stord-bench-timeline.perf.data");
    let (m, client, daemon_threads) = std::thread::scope(|sc| {
        let h = sc.spawn(|| s.run_at(&w, &t, p, &[], None));
        std::thread::sleep(Duration::from_millis(1200));
        // fio's job runs in a process of its own; libblkio's queue in a thread of ours.
        let client = match export {
            Export::VhostBlkio | Export::VhostBlkioPoll | Export::Vhost if daemon != "fio-raw" => {
                threads(std::process::id())
            }
            _ => threads_named("fio"),
        };
        // The daemon's threads once it serves (connection and worker threads included).
        let daemon_threads = pid.map(threads).unwrap_or_default();
        perf_record(&data, d);
        (h.join().unwrap(), client, daemon_threads)
    });
    let lines = perf_lines(&data);
    let _ = std::fs::remove_file(&data);
    let a = analyse(&lines, &daemon_threads, &client);
    let n = a.cycles.len().max(1) as f64;
    let per_window = a.windows.max(1) as f64;
    Trace {
        export: export.name().into(),
        backend: backend.into(),
        daemon: daemon.into(),
        client_iops: m.fio.iops,
        client_mean_us: m.fio.mean_us,
        cycles: a.cycles.len(),
        cycle_us: median(a.cycles.clone()),
        gaps_us: a
            .gaps
            .iter()
            .map(|g| (!g.is_empty()).then(|| median(g.clone())))
            .collect(),
        client_woken: a.client_woken as f64 / n,
        daemon_woken: a.daemon_woken as f64 / n,
        daemon_cpu_us: a.daemon_cpu_ns as f64 / 1000.0 / per_window,
        client_cpu_us: a.client_cpu_ns as f64 / 1000.0 / per_window,
        daemon_syscalls: a.daemon_syscalls as f64 / per_window,
        client_syscalls: a.client_syscalls as f64 / per_window,
    }
}

pub fn run(opts: &TimelineOptions) -> Vec<Trace> {
    let backends: Vec<&str> = opts.backends.iter().map(String::as_str).collect();
    let media = Media::prepare(&backends);
    let mut out = Vec::new();
    for &export in &opts.exports {
        for &backend in &backends {
            let p = media.paths(backend, "timeline");
            for rep in 0..opts.reps {
                for daemon in &opts.daemons {
                    eprintln!(
                        "timeline: {} {backend} {daemon} (rep {}/{})",
                        export.name(),
                        rep + 1,
                        opts.reps
                    );
                    out.push(trace_one(export, backend, daemon, &p, opts.trace));
                }
            }
            let _ = std::fs::remove_file(&p.sock);
            let _ = std::fs::remove_file(&p.mnt);
        }
    }
    out
}

/// One table per (export, medium): a column per traced run.
pub fn markdown(traces: &[Trace]) -> String {
    let mut s = String::new();
    let mut groups: Vec<(&str, &str)> = Vec::new();
    for t in traces {
        if !groups.contains(&(t.export.as_str(), t.backend.as_str())) {
            groups.push((t.export.as_str(), t.backend.as_str()));
        }
    }
    for (export, backend) in groups {
        let g: Vec<&Trace> = traces
            .iter()
            .filter(|t| t.export == export && t.backend == backend)
            .collect();
        let _ = writeln!(
            s,
            "\n### {export}, {backend}, 4k randread QD1 (µs, medians per cycle)\n"
        );
        let head: Vec<String> = g.iter().map(|t| t.daemon.clone()).collect();
        let _ = writeln!(s, "| | {} |", head.join(" | "));
        let _ = writeln!(s, "|---|{}", "---:|".repeat(g.len()));
        let row = |s: &mut String, name: &str, f: &dyn Fn(&Trace) -> String| {
            let cells: Vec<String> = g.iter().map(|t| f(t)).collect();
            let _ = writeln!(s, "| {name} | {} |", cells.join(" | "));
        };
        row(&mut s, "client mean latency (traced)", &|t| {
            format!("{:.1}", t.client_mean_us)
        });
        row(&mut s, "cycle (request to request)", &|t| {
            format!("{:.1}", t.cycle_us)
        });
        for (k, name) in GAPS.iter().enumerate() {
            row(&mut s, name, &|t| {
                t.gaps_us[k].map_or("-".into(), |v| format!("{v:.1}"))
            });
        }
        row(&mut s, "client woken, share of cycles", &|t| {
            format!("{:.2}", t.client_woken)
        });
        row(&mut s, "daemon woken on the request, share", &|t| {
            format!("{:.2}", t.daemon_woken)
        });
        row(&mut s, "daemon CPU µs per cycle", &|t| {
            format!("{:.1}", t.daemon_cpu_us)
        });
        row(&mut s, "client CPU µs per cycle", &|t| {
            format!("{:.1}", t.client_cpu_us)
        });
        row(&mut s, "daemon syscalls per cycle", &|t| {
            format!("{:.1}", t.daemon_syscalls)
        });
        row(&mut s, "client syscalls per cycle", &|t| {
            format!("{:.1}", t.client_syscalls)
        });
        row(&mut s, "cycles traced", &|t| t.cycles.to_string());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_perf_script_lines_with_spaces_in_the_command_name() {
        let l = parse_line(
            "          IO io0  5714 [001] 11353.493323891:         block:block_rq_issue: 7,0 R 4096 () 13340216 + 8 [IO io0]",
        )
        .unwrap();
        assert_eq!((l.tid, l.ns), (5714, 11_353_493_323_891));
        assert!(matches!(l.ev, Ev::Issue { ref dev } if dev == "7,0"));
        let l = parse_line(
            "         swapper     0 [000] 11353.493228129:           sched:sched_switch: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=fio next_pid=5714 next_prio=120",
        )
        .unwrap();
        assert!(matches!(
            l.ev,
            Ev::Switch {
                prev: 0,
                next: 5714
            }
        ));
        assert!(parse_line("garbage").is_none());
    }

    /// Two cycles of a request served by a daemon that was woken for it.
    #[test]
    fn splits_a_trace_into_cycles_and_milestones() {
        let (d, c) = (100, 200);
        let us = |t: u64| t * 1000;
        let mut lines = Vec::new();
        for k in 0..3u64 {
            let t0 = k * 100;
            let ev = [
                (0, 0, Ev::Issue { dev: "7,0".into() }),
                (10, 0, Ev::Complete { dev: "7,0".into() }),
                (14, d, Ev::SysEnter { nr: 20 }),
                (20, 0, Ev::Wakeup { pid: c }),
                (25, c, Ev::SysEnter { nr: 45 }),
                (30, c, Ev::SysEnter { nr: 44 }),
                (40, 0, Ev::Wakeup { pid: d }),
                (95, d, Ev::Submit),
            ];
            for (t, tid, ev) in ev {
                lines.push(Line {
                    tid,
                    ns: us(t0 + t),
                    ev,
                });
            }
        }
        let a = analyse(&lines, &HashSet::from([d]), &HashSet::from([c]));
        assert_eq!(a.cycles, vec![100.0, 100.0]);
        let g: Vec<f64> = a.gaps.iter().map(|g| g[0]).collect();
        assert_eq!(g, vec![10.0, 4.0, 16.0, 65.0, 5.0, 10.0, 55.0]);
        assert_eq!((a.client_woken, a.daemon_woken), (2, 2));
    }
}
