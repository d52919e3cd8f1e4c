//! Helpers for end-to-end tests: run the real `stord` binary and real clients.

#![allow(dead_code)]

pub mod crash;
pub mod guest;
pub mod rawnbd;
pub mod rawqmp;
pub mod side;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A fresh directory for one test. It goes with what it holds when the test process
/// exits (set STORD_KEEP_TEST_DIRS to keep them, to look at).
pub fn tmpdir(name: &str) -> PathBuf {
    let d =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("stord-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    remove_at_exit(&d);
    d
}

/// The test directories this process made, removed when it exits.
static MADE: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

fn remove_at_exit(d: &Path) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain function with no state of its own; it runs once, at
        // exit, after the test harness is done with every test.
        unsafe { libc::atexit(remove_made) };
    });
    MADE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(d.to_path_buf());
}

extern "C" fn remove_made() {
    if std::env::var_os("STORD_KEEP_TEST_DIRS").is_some() {
        return;
    }
    for d in MADE.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A sparse file of `size` bytes.
pub fn sparse_image(path: &Path, size: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
}

/// A running stord; killed when dropped.
pub struct Stord {
    pub child: Child,
    pub dir: PathBuf,
    pub sock: PathBuf,
    pub pidfile: PathBuf,
    pub args: Vec<String>,
}

impl Stord {
    /// Starts stord with `args` plus `--pidfile`, and waits until the pidfile appears.
    pub fn start(dir: &Path, args: &[String]) -> Stord {
        Self::start_wrapped(dir, &[], args)
    }

    /// As [`start`](Self::start), run through `wrapper` (a program that execs the rest of
    /// its command line, such as `prlimit --nofile=64:64`), so the pid stays stord's.
    pub fn start_wrapped(dir: &Path, wrapper: &[&str], args: &[String]) -> Stord {
        let pidfile = dir.join("stord.pid");
        let _ = std::fs::remove_file(&pidfile);
        let mut full: Vec<String> = wrapper[1.min(wrapper.len())..]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let program = match wrapper.first() {
            Some(w) => {
                full.push(env!("CARGO_BIN_EXE_stord").to_string());
                w.to_string()
            }
            None => env!("CARGO_BIN_EXE_stord").to_string(),
        };
        full.extend(args.iter().cloned());
        full.push("--pidfile".into());
        full.push(pidfile.display().to_string());
        let child = Command::new(program)
            .args(&full)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn stord");
        let mut s = Stord {
            child,
            dir: dir.to_path_buf(),
            sock: dir.join("nbd.sock"),
            pidfile,
            args: args.to_vec(),
        };
        let start = Instant::now();
        while !s.pidfile.exists() {
            if let Some(status) = s.child.try_wait().unwrap() {
                let mut err = String::new();
                use std::io::Read;
                s.child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut err)
                    .unwrap();
                panic!("stord exited early ({status}): {err}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "stord did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    /// Standard arguments: one iothread, `blockdev`, an NBD server on `dir/nbd.sock`, and an
    /// export named `disk` of node `disk`.
    pub fn with_node(dir: &Path, blockdev: &str, writable: bool) -> Stord {
        let sock = dir.join("nbd.sock");
        let args = vec![
            "--object".to_string(),
            "iothread,id=io0".to_string(),
            "--blockdev".to_string(),
            format!("node-name=disk,{blockdev}"),
            "--nbd-server".to_string(),
            format!("addr.type=unix,addr.path={}", sock.display()),
            "--export".to_string(),
            format!(
                "type=nbd,id=exp0,node-name=disk,name=disk,writable={},iothread=io0",
                if writable { "on" } else { "off" }
            ),
        ];
        Stord::start(dir, &args)
    }

    /// The NBD URI of export `disk`.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///disk?socket={}", self.sock.display())
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// A field of /proc/PID/status in KiB (`VmRSS`, `VmHWM`: the peak RSS).
    pub fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/PID/status"))
    }

    /// CPU time the daemon has used (user + system), in clock ticks' worth of nanoseconds.
    pub fn cpu_ns(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        // Fields after the parenthesised command name; utime and stime are 14 and 15.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        // SAFETY: sysconf only reads a configuration value.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        ticks * 1_000_000_000 / hz
    }

    /// Open file descriptors of the daemon.
    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// Waits for exit (bounded).
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(start.elapsed() < limit, "stord did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, wait for exit, and return what the daemon wrote to stderr.
    pub fn stop_and_stderr(&mut self) -> String {
        self.signal(libc::SIGTERM);
        self.wait_exit(Duration::from_secs(15));
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        err
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Stord {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs a command; returns its output (does not check the status).
pub fn run(cmd: &str, args: &[&str]) -> Output {
    Command::new(cmd).args(args).output().unwrap_or_else(|e| {
        panic!("cannot run {cmd}: {e} (is it installed? scripts/install-deps.sh)")
    })
}

/// Runs a command and asserts success; returns stdout.
pub fn run_ok(cmd: &str, args: &[&str]) -> String {
    let out = run(cmd, args);
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs fio with `target` (e.g. `--ioengine=nbd` then `--uri=...`, or `--ioengine=libaio`,
/// `--direct=1`, `--filename=...`): 4k random writes at QD16 over `size`, verified with
/// crc32c, and asserts that the job succeeded and really read its data back.
pub fn fio_write_and_verify(target: &[&str], size: &str) {
    let size_arg = format!("--size={size}");
    // Engine options (like the nbd engine's --uri) must follow --ioengine: target first.
    let mut args = vec!["--name=verify"];
    args.extend_from_slice(target);
    args.extend_from_slice(&[
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        &size_arg,
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_state_save=0",
        "--output-format=json",
    ]);
    let out = run_ok("fio", &args);
    let v: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert!(
        job["read"]["io_bytes"].as_u64().unwrap() > 0,
        "verify read nothing: {job}"
    );
}

/// Reads `len` bytes at `offset` through libblkio from a read-only vhost-user-blk socket, and the
/// device's capacity.
pub fn blkio_read(sock: &Path, offset: u64, len: usize) -> (u64, Vec<u8>) {
    let mut b = blkio::Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", &sock.display().to_string()).unwrap();
    b.set_bool("read-only", true).unwrap();
    b.connect()
        .unwrap_or_else(|e| panic!("connect: {}", e.message()));
    b.set_i32("num-queues", 1).unwrap();
    let mut started = b
        .start()
        .unwrap_or_else(|e| panic!("start: {}", e.message()));
    let capacity = b.get_u64("capacity").unwrap();
    let region = b.alloc_mem_region(len).unwrap();
    b.map_mem_region(&region).unwrap();
    let q = &mut started.queues[0];
    q.read(
        offset,
        region.addr as *mut u8,
        len,
        1,
        blkio::ReqFlags::empty(),
    );
    let mut c: [std::mem::MaybeUninit<blkio::Completion>; 1] = [std::mem::MaybeUninit::uninit()];
    assert_eq!(q.do_io(&mut c, 1, None, None).unwrap(), 1);
    // SAFETY: do_io initialised the first completion.
    let c = unsafe { c[0].assume_init_read() };
    assert_eq!(c.ret, 0, "libblkio read failed");
    // SAFETY: the region is mapped for `len` bytes and no request uses it any more.
    let data = unsafe { std::slice::from_raw_parts(region.addr as *const u8, len) }.to_vec();
    (capacity, data)
}
