//! One daemon serving one export of one backend, started fresh, and the workloads run
//! against it: fio's nbd engine for NBD, fio's io_uring engine on the mounted file for
//! FUSE and on the image itself for the raw floor, our own frontend or libblkio for
//! vhost-user-blk.

use std::time::{Duration, Instant};

use crate::daemon_args::{blockdev, fuse_args, nbd_args, qsd_style, vhost_args};
use crate::media::{Paths, IMAGE_SIZE};
use crate::peers::{try_run_fio, Daemon, FioResult, Mounted, ProcStat, ProcUse};
use crate::vhost_client::{drive_with, DriveSpec};

/// The exports a session can serve (vhost-user-blk once per client that drives it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Export {
    Nbd,
    Fuse,
    /// vhost-user-blk driven by stord-bench's own frontend.
    Vhost,
    /// vhost-user-blk driven by libblkio's blocking queues.
    VhostBlkio,
    /// vhost-user-blk driven by libblkio's poll queues.
    VhostBlkioPoll,
    /// No daemon: fio on the image file (the floor).
    Raw,
}

impl Export {
    pub fn name(self) -> &'static str {
        match self {
            Export::Nbd => "nbd",
            Export::Fuse => "fuse",
            Export::Vhost => "vhost-user-blk",
            Export::VhostBlkio => "vhost-user-blk-libblkio",
            Export::VhostBlkioPoll => "vhost-user-blk-libblkio-poll",
            Export::Raw => "raw",
        }
    }
}

/// One fio-like job.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// fio's rw: randread, randwrite or read (sequential).
    pub rw: &'static str,
    pub bs: u32,
    pub qd: u32,
}

impl Workload {
    pub fn bs_label(&self) -> String {
        format!("{}k", self.bs / 1024)
    }

    pub fn label(&self) -> String {
        format!("{} {} QD{}", self.bs_label(), self.rw, self.qd)
    }
}

/// Timing of every run.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub ramp: Duration,
    pub runtime: Duration,
}

/// A running daemon (or none, for the raw floor).
pub enum Running {
    Nbd(Daemon, String),
    Fuse(Mounted),
    Vhost(Daemon),
    Raw,
}

/// A daemon serving one export of one backend, restarted if it died between runs.
pub struct Session {
    pub running: Running,
    export: Export,
    backend: String,
    daemon: String,
    /// How often the daemon had exited by itself and was started again.
    pub restarts: usize,
    /// Started by `start` (so `revive` knows how to start it again).
    revivable: bool,
    /// Daemon on [`DAEMON_CPU`], client on [`CLIENT_CPU`] (else both float).
    pinned: bool,
}

/// Where a pinned session's daemon runs (every thread, and those it starts later).
pub const DAEMON_CPU: usize = 1;
/// Where a pinned session's client runs.
pub const CLIENT_CPU: usize = 0;

/// Pins every thread of `pid` (and the threads they start later) to `cpu`.
fn pin_process(pid: u32, cpu: usize) {
    let st = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", &cpu.to_string(), &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run taskset (util-linux)");
    assert!(st.success(), "taskset -a -p -c {cpu} {pid} failed");
}

/// Runs `f` with the calling thread (and the threads it starts) on `cpu`, then puts the
/// thread's affinity back.
fn on_cpu<T>(cpu: usize, f: impl FnOnce() -> T) -> T {
    // SAFETY: cpu_set_t is plain data; the calls read and write only `old` and `set`, which
    // live for the whole function, with their true size.
    unsafe {
        let mut old: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        let got = libc::sched_getaffinity(0, size, &mut old) == 0;
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size, &set);
        let r = f();
        if got {
            libc::sched_setaffinity(0, size, &old);
        }
        r
    }
}

impl Session {
    pub fn start(export: Export, backend: &str, daemon: &str, p: &Paths) -> Session {
        Session {
            running: Self::spawn(export, backend, daemon, p),
            export,
            backend: backend.to_string(),
            daemon: daemon.to_string(),
            restarts: 0,
            revivable: true,
            pinned: false,
        }
    }

    /// As [`start`](Self::start), with the daemon on [`DAEMON_CPU`] and every client run on
    /// [`CLIENT_CPU`]: placement as a measured variable.
    pub fn start_pinned(export: Export, backend: &str, daemon: &str, p: &Paths) -> Session {
        let mut s = Self::start(export, backend, daemon, p);
        s.pinned = true;
        s.pin();
        s
    }

    fn pin(&self) {
        if let (true, Some(pid)) = (self.pinned, self.pid()) {
            pin_process(pid, DAEMON_CPU);
        }
    }

    /// Wraps a daemon the caller started itself (it is not restarted if it dies).
    pub fn from_running(running: Running) -> Session {
        Session {
            running,
            export: Export::Nbd,
            backend: String::new(),
            daemon: "daemon".into(),
            restarts: 0,
            revivable: false,
            pinned: false,
        }
    }

    fn spawn(export: Export, backend: &str, daemon: &str, p: &Paths) -> Running {
        if daemon == "fio-raw" {
            return Running::Raw;
        }
        match export {
            Export::Nbd => {
                let (bin, args, uri) = nbd_args(daemon, backend, p);
                Running::Nbd(Daemon::start(daemon, &bin, &args, &p.sock), uri)
            }
            Export::Fuse => {
                let (bin, iothread) = qsd_style(daemon);
                let args = fuse_args(vec![iothread], blockdev(backend, &p.img), &p.mnt, false);
                Running::Fuse(Mounted::start(&bin, &args, &p.mnt))
            }
            Export::Vhost | Export::VhostBlkio | Export::VhostBlkioPoll => {
                let (bin, iothread) = qsd_style(daemon);
                let args = vhost_args(iothread, blockdev(backend, &p.img), &p.sock);
                Running::Vhost(Daemon::start(daemon, &bin, &args, &p.sock))
            }
            Export::Raw => Running::Raw,
        }
    }

    /// Starts the daemon again if it exited (qsd 10.0 can abort when an NBD client
    /// disconnects: an assertion in nbd_blockdev_client_closed).
    fn revive(&mut self, p: &Paths) {
        let dead = match &mut self.running {
            Running::Nbd(d, _) | Running::Vhost(d) => matches!(d.child.try_wait(), Ok(Some(_))),
            Running::Fuse(m) => matches!(m.child.try_wait(), Ok(Some(_))),
            Running::Raw => false,
        };
        if dead {
            assert!(self.revivable, "{} exited during the run", self.daemon);
            eprintln!(
                "report: {} ({} {}) exited by itself; starting it again",
                self.daemon,
                self.export.name(),
                self.backend
            );
            self.restarts += 1;
            // Drop the dead one first (unmount, remove the socket) before the new one.
            self.running = Running::Raw;
            self.running = Self::spawn(self.export, &self.backend, &self.daemon, p);
            self.pin();
        }
    }

    pub fn pid(&self) -> Option<u32> {
        match &self.running {
            Running::Nbd(d, _) | Running::Vhost(d) => Some(d.pid()),
            Running::Fuse(m) => Some(m.child.id()),
            Running::Raw => None,
        }
    }

    /// fio's arguments for `w` (plus `extra`) against this session (not for vhost).
    fn fio_args(&self, w: &Workload, t: &Timing, p: &Paths, extra: &[String]) -> Vec<String> {
        let mut a = vec![
            "--name=bench".to_string(),
            format!("--rw={}", w.rw),
            format!("--bs={}", w.bs),
            format!("--iodepth={}", w.qd),
            "--time_based".into(),
            format!("--runtime={}ms", t.runtime.as_millis()),
            format!("--ramp_time={}ms", t.ramp.as_millis()),
            format!("--size={IMAGE_SIZE}"),
            "--norandommap".into(),
            "--randrepeat=0".into(),
        ];
        match &self.running {
            Running::Nbd(_, uri) => {
                a.extend(["--ioengine=nbd".into(), format!("--uri={uri}")]);
            }
            Running::Fuse(_) => a.extend([
                "--ioengine=io_uring".into(),
                "--direct=1".into(),
                format!("--filename={}", p.mnt.display()),
            ]),
            Running::Raw => a.extend([
                "--ioengine=io_uring".into(),
                "--direct=1".into(),
                format!("--filename={}", p.img.display()),
            ]),
            Running::Vhost(_) => unreachable!("vhost-user-blk is driven by our frontend"),
        }
        if self.pinned {
            a.push(format!("--cpus_allowed={CLIENT_CPU}"));
        }
        a.extend_from_slice(extra);
        a
    }

    /// Runs `w`; returns what the client measured, the daemon's CPU time over the whole
    /// run (ramp included) in µs, and the wall time of the run.
    pub fn run(
        &mut self,
        w: &Workload,
        t: &Timing,
        p: &Paths,
        extra: &[String],
    ) -> (FioResult, Option<f64>, Duration) {
        let m = self.run_at(w, t, p, extra, None);
        let cpu_us = m.daemon.map(|d| (d.user_ns + d.sys_ns) as f64 / 1000.0);
        (m.fio, cpu_us, m.wall)
    }

    /// Runs `w` at `rate` I/Os per second (fio's `rate_iops`; None: as fast as it goes);
    /// returns what the client measured and what the daemon used over the whole run (ramp
    /// included).
    pub fn run_at(
        &mut self,
        w: &Workload,
        t: &Timing,
        p: &Paths,
        extra: &[String],
        rate: Option<f64>,
    ) -> Measured {
        self.revive(p);
        let pid = self.pid();
        let stat = || pid.map(ProcStat::read);
        let s0 = stat();
        let t0 = Instant::now();
        let fio = match &self.running {
            Running::Vhost(_) => {
                let spec = DriveSpec {
                    write: w.rw.contains("write"),
                    sequential: !w.rw.starts_with("rand"),
                    bs: w.bs,
                    qd: w.qd as u16,
                    ramp: t.ramp,
                    runtime: t.runtime,
                    think: Duration::ZERO,
                    think_spin: false,
                    rate_iops: rate,
                };
                let client = match self.export {
                    Export::VhostBlkio => "blkio",
                    Export::VhostBlkioPoll => "blkio-poll",
                    _ => "own",
                };
                if self.pinned {
                    on_cpu(CLIENT_CPU, || drive_with(client, &p.sock, &spec, 1))
                } else {
                    drive_with(client, &p.sock, &spec, 1)
                }
            }
            _ => {
                let mut args = self.fio_args(w, t, p, extra);
                if let Some(r) = rate {
                    args.push(format!("--rate_iops={}", r.round().max(1.0)));
                }
                match try_run_fio(&args) {
                    Ok(r) => r,
                    Err(e) => {
                        // The daemon may have died after the previous client left and not
                        // yet have been reaped when we looked: give it a moment, revive it
                        // and try once more.
                        std::thread::sleep(Duration::from_millis(200));
                        let before = self.restarts;
                        self.revive(p);
                        if self.restarts == before || self.restarts > 20 {
                            panic!("{e}");
                        }
                        return self.run_at(w, t, p, extra, rate);
                    }
                }
            }
        };
        let wall = t0.elapsed();
        let daemon = s0.zip(stat()).map(|(a, b)| b.since(&a));
        Measured { fio, daemon, wall }
    }
}

/// What one run measured: the client's figures and what the daemon used (None for the
/// raw floor).
pub struct Measured {
    pub fio: FioResult,
    pub daemon: Option<ProcUse>,
    pub wall: Duration,
}
