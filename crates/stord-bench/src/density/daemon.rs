//! A daemon with N IoThreads, N read-only nodes on one medium and an export of each on its
//! own IoThread (NBD exports on one server socket, or a vhost-user-blk socket each), in
//! qsd's option syntax for both daemons; ready once its pid file is written (after the
//! exports exist), stopped with SIGTERM when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::daemon_args::{blockdev, qsd_style};
use crate::media::bench_dir;
use crate::peers::stord_binary;

/// How the clients reach their exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Transport {
    /// NBD, one fio nbd job per export.
    Nbd,
    /// vhost-user-blk, one libblkio device per export.
    Vhost,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Nbd => "nbd",
            Transport::Vhost => "vhost-user-blk",
        }
    }
}

pub(crate) struct DaemonSet {
    child: Child,
    n: usize,
    dir: PathBuf,
}

/// The binary, the arguments before the daemon's own (`floor-server` for the floor) and
/// the `--object iothread` (as io0) of a daemon set-up.
fn binary_and_iothread(daemon: &str) -> (PathBuf, Vec<String>, String) {
    let iothread = "iothread,id=io0".to_string();
    match daemon {
        "stord" => (stord_binary(), Vec::new(), iothread),
        "stord-poll0" => (
            stord_binary(),
            Vec::new(),
            format!("{iothread},poll-max-ns=0"),
        ),
        "floor" => {
            let me = std::env::current_exe().expect("stord-bench's own path");
            (me, vec!["floor-server".into()], iothread)
        }
        other => {
            let (bin, iothread) = qsd_style(other);
            (bin, Vec::new(), iothread)
        }
    }
}

fn nbd_sock_in(dir: &Path) -> PathBuf {
    dir.join("nbd.sock")
}

fn vhost_sock_in(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("vu{i}.sock"))
}

/// The IoThreads and nodes: io`i` and d`i` for each export, the nodes read-only.
fn node_args(iothread: &str, backend: &str, img: &Path, n: usize) -> Vec<String> {
    let mut args = Vec::new();
    for i in 0..n {
        args.push("--object".to_string());
        args.push(iothread.replacen("id=io0", &format!("id=io{i}"), 1));
        let node = blockdev(backend, img).replacen("node-name=disk", &format!("node-name=d{i}"), 1);
        args.push("--blockdev".into());
        args.push(format!("{node},read-only=on"));
    }
    args
}

/// The exports: d`i` on io`i`, over NBD (one server socket) or vhost-user-blk.
fn export_args(t: Transport, n: usize, dir: &Path) -> Vec<String> {
    let mut args = Vec::new();
    if t == Transport::Nbd {
        args.push("--nbd-server".into());
        args.push(format!(
            "addr.type=unix,addr.path={}",
            nbd_sock_in(dir).display()
        ));
    }
    for i in 0..n {
        args.push("--export".into());
        args.push(match t {
            Transport::Nbd => format!("type=nbd,id=e{i},node-name=d{i},name=d{i},iothread=io{i}"),
            Transport::Vhost => format!(
                "type=vhost-user-blk,id=e{i},node-name=d{i},addr.type=unix,addr.path={},iothread=io{i}",
                vhost_sock_in(dir, i).display()
            ),
        });
    }
    args
}

impl DaemonSet {
    /// `daemon` serving `n` exports of `backend` (on `img`) over `t`.
    pub fn start(daemon: &str, t: Transport, backend: &str, img: &Path, n: usize) -> DaemonSet {
        let dir = bench_dir().join("density");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(
            daemon != "floor" || (t == Transport::Nbd && backend == "null"),
            "the floor serves NBD reads of a null device only"
        );
        let (bin, mut args, iothread) = binary_and_iothread(daemon);
        let pidfile = dir.join("daemon.pid");
        args.extend(node_args(&iothread, backend, img, n));
        args.extend(export_args(t, n, &dir));
        args.extend(["--pidfile".into(), pidfile.display().to_string()]);
        let child = Command::new(&bin)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let mut set = DaemonSet { child, n, dir };
        set.wait_ready(daemon, &pidfile);
        set
    }

    fn wait_ready(&mut self, daemon: &str, pidfile: &Path) {
        let start = Instant::now();
        while !pidfile.exists() {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("{daemon} exited during start-up: {st}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{daemon} did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn exports(&self) -> usize {
        self.n
    }

    pub fn nbd_sock(&self) -> PathBuf {
        nbd_sock_in(&self.dir)
    }

    pub fn export_name(&self, i: usize) -> String {
        format!("d{i}")
    }

    pub fn nbd_uri(&self, i: usize) -> String {
        format!("nbd+unix:///d{i}?socket={}", self.nbd_sock().display())
    }

    pub fn vhost_socks(&self) -> Vec<PathBuf> {
        (0..self.n).map(|i| vhost_sock_in(&self.dir, i)).collect()
    }

    /// Resident memory now, in KiB.
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// Time every live thread has run so far (schedstat, nanoseconds).
    pub fn sched_ns(&self) -> u64 {
        std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }
}

impl Drop for DaemonSet {
    /// Stops the daemon (SIGTERM, then SIGKILL after 10 s) and removes its sockets and
    /// pidfile, so a finished run leaves no scratch under `results/tmp`.
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        let mut exited = false;
        while !exited && start.elapsed() < Duration::from_secs(10) {
            exited = matches!(self.child.try_wait(), Ok(Some(_)));
            if !exited {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if !exited {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
