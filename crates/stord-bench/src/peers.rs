//! Finding and running the daemons under test (stord, qemu-storage-daemon, nbdkit): one
//! listening on a socket, or with its FUSE export mounted; running fio; and measuring a
//! daemon's CPU time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

/// The repo root (stord-bench lives in crates/stord-bench).
pub fn repo_root() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    p.canonicalize().unwrap_or(p)
}

/// The release stord binary, built (once per process) if missing or stale.
pub fn stord_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = repo_root();
            let status = Command::new("cargo")
                .args(["build", "--release", "-p", "stord", "--quiet"])
                .current_dir(&root)
                .status()
                .expect("run cargo build");
            assert!(status.success(), "building stord failed");
            root.join("target/release/stord")
        })
        .clone()
}

/// The path of `cmd` (a daemon or tool the benchmarks run), or a panic naming the script
/// that installs it.
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

/// A daemon process that is killed when dropped.
pub struct Daemon {
    pub child: Child,
}

impl Daemon {
    /// Starts `cmd args` and waits until `sock` accepts connections.
    pub fn start(name: &str, cmd: &Path, args: &[String], sock: &Path) -> Daemon {
        let mut c = Command::new(cmd);
        c.args(args).stdout(Stdio::null()).stderr(Stdio::inherit());
        Self::start_cmd(name, c, sock)
    }

    /// Spawns a prepared command and waits until `sock` accepts connections.
    pub fn start_cmd(name: &str, cmd: Command, sock: &Path) -> Daemon {
        let _ = std::fs::remove_file(sock);
        Self::start_until(name, cmd, &|| {
            std::os::unix::net::UnixStream::connect(sock).is_ok()
        })
    }

    /// Starts `cmd args` and waits until 127.0.0.1:`port` accepts connections.
    pub fn start_tcp(name: &str, cmd: &Path, args: &[String], port: u16) -> Daemon {
        let mut c = Command::new(cmd);
        c.args(args).stdout(Stdio::null()).stderr(Stdio::inherit());
        Self::start_until(name, c, &|| {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        })
    }

    /// Spawns a prepared command and waits until `ready` says it listens.
    fn start_until(name: &str, mut cmd: Command, ready: &dyn Fn() -> bool) -> Daemon {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let mut d = Daemon { child };
        let start = Instant::now();
        loop {
            if ready() {
                break;
            }
            if let Ok(Some(st)) = d.child.try_wait() {
                panic!("{name} exited during start-up: {st}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "{name} did not start listening"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time (user + system) of all the daemon's live threads, in nanoseconds.
    pub fn cpu_ns(&self) -> u64 {
        process_cpu_ns(self.pid())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn is_mounted(p: &Path) -> bool {
    let needle = format!(" {} ", p.display());
    std::fs::read_to_string("/proc/mounts")
        .map(|m| m.lines().any(|l| l.contains(&needle)))
        .unwrap_or(false)
}

/// A daemon with its FUSE export mounted; unmounted and stopped when dropped.
pub(crate) struct Mounted {
    pub child: Child,
    mnt: PathBuf,
}

impl Mounted {
    /// Starts `bin args` (whose FUSE export mounts on `mnt`, made here as an empty file);
    /// returns once the file is mounted.
    pub fn start(bin: &Path, args: &[String], mnt: &Path) -> Mounted {
        std::fs::write(mnt, b"").expect("mountpoint");
        let child = Command::new(bin)
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .expect("start daemon");
        let start = Instant::now();
        while !is_mounted(mnt) {
            assert!(
                start.elapsed().as_secs() < 15,
                "{} did not mount",
                bin.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Mounted {
            child,
            mnt: mnt.to_path_buf(),
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let start = Instant::now();
        while is_mounted(&self.mnt) && start.elapsed().as_secs() < 5 {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Sum of utime+stime of a process (all threads, including exited ones), from
/// /proc/PID/stat, in nanoseconds (clock-tick resolution).
pub fn process_cpu_ns(pid: u32) -> u64 {
    let s = ProcStat::read(pid);
    s.user_ns + s.sys_ns
}

/// What a process has used so far: CPU time in user and system mode (all threads,
/// including exited ones; clock-tick resolution) and how often each of its threads gave
/// up the CPU to wait (voluntary context switches: sleeps), by thread.
#[derive(Debug, Clone, Default)]
pub struct ProcStat {
    pub user_ns: u64,
    pub sys_ns: u64,
    /// (thread id, its voluntary context switches so far).
    pub sleeps: Vec<(u32, u64)>,
}

/// What a process used between two [`ProcStat`]s.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProcUse {
    pub user_ns: u64,
    pub sys_ns: u64,
    /// Sleeps of the threads alive at the end (a thread that exited during the run takes
    /// its count with it).
    pub sleeps: u64,
}

impl ProcStat {
    pub fn read(pid: u32) -> ProcStat {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return ProcStat::default();
        };
        // Fields after the ")" of the command name: state is field 3; utime 14, stime 15.
        let rest = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        let sleeps = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|t| {
                let tid = t.file_name().to_str()?.parse::<u32>().ok()?;
                let st = std::fs::read_to_string(t.path().join("status")).ok()?;
                let n = st
                    .lines()
                    .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
                    .trim()
                    .parse::<u64>()
                    .ok()?;
                Some((tid, n))
            })
            .collect();
        ProcStat {
            user_ns: field(11) * 1_000_000_000 / hz,
            sys_ns: field(12) * 1_000_000_000 / hz,
            sleeps,
        }
    }

    /// What was used between `before` and `self`: each live thread's sleeps since
    /// `before` (all of them for a thread started since).
    pub fn since(&self, before: &ProcStat) -> ProcUse {
        let sleeps = self
            .sleeps
            .iter()
            .map(|&(tid, n)| {
                let was = before
                    .sleeps
                    .iter()
                    .find(|(t, _)| *t == tid)
                    .map_or(0, |x| x.1);
                n.saturating_sub(was)
            })
            .sum();
        ProcUse {
            user_ns: self.user_ns.saturating_sub(before.user_ns),
            sys_ns: self.sys_ns.saturating_sub(before.sys_ns),
            sleeps,
        }
    }
}

/// What one fio run measured.
#[derive(Debug, Clone, Serialize)]
pub struct FioResult {
    pub iops: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub total_ios: u64,
}

/// Runs fio with `args` (plus json output) and parses the first job's read or write side.
pub fn run_fio(args: &[String]) -> FioResult {
    try_run_fio(args).unwrap_or_else(|e| panic!("{e}"))
}

/// The HOME fio runs with, if set (libnbd looks for TLS certificates under it).
pub static FIO_HOME: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// [`run_fio`], but a failed fio is an error rather than a panic.
pub fn try_run_fio(args: &[String]) -> Result<FioResult, String> {
    let mut cmd = Command::new("fio");
    if let Some(home) = FIO_HOME.get() {
        cmd.env("HOME", home);
    }
    let out = cmd
        .args(args)
        .arg("--output-format=json")
        .arg("--verify_state_save=0")
        .output()
        .expect("run fio (scripts/install-deps.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    let failed = || {
        format!(
            "fio {args:?} failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let v: serde_json::Value = text
        .find('{')
        .and_then(|start| serde_json::from_str(&text[start..]).ok())
        .ok_or_else(failed)?;
    // A server that drops the connection as fio leaves makes fio exit non-zero after a
    // complete run: keep the figures if the job itself had no error.
    if !out.status.success() && v["jobs"][0]["error"].as_i64() != Some(0) {
        return Err(failed());
    }
    let job = &v["jobs"][0];
    let side = if job["write"]["total_ios"].as_u64().unwrap_or(0)
        > job["read"]["total_ios"].as_u64().unwrap_or(0)
    {
        &job["write"]
    } else {
        &job["read"]
    };
    let pct = |p: &str| side["clat_ns"]["percentile"][p].as_f64().unwrap_or(0.0) / 1000.0;
    Ok(FioResult {
        iops: side["iops"].as_f64().unwrap_or(0.0),
        mean_us: side["lat_ns"]["mean"].as_f64().unwrap_or(0.0) / 1000.0,
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        total_ios: side["total_ios"].as_u64().unwrap_or(0),
    })
}
