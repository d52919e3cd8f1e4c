//! One daemon of either binary, stord or qsd, started the same way so a test can hold
//! their answers side by side: nodes from `--blockdev`, node `b` exported over NBD, a QMP
//! monitor; or the error it refused to start with.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A daemon, killed when dropped.
pub struct Daemon(pub Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `binary` with `--blockdev opts` (node `b`): see [`start_nodes`].
pub fn start_with(binary: &str, dir: &Path, opts: &str) -> Result<(Daemon, PathBuf), String> {
    start_nodes(binary, dir, &[opts])
}

/// `binary` with a `--blockdev` per entry of `nodes`, node `b` exported writable over NBD
/// on `dir/b.sock` and a monitor on `dir/qmp.sock`; its start-up error if it refuses.
pub fn start_nodes(binary: &str, dir: &Path, nodes: &[&str]) -> Result<(Daemon, PathBuf), String> {
    let (sock, pid, qmp) = (dir.join("b.sock"), dir.join("b.pid"), dir.join("qmp.sock"));
    for f in [&sock, &pid, &qmp] {
        let _ = std::fs::remove_file(f);
    }
    let mut c = Command::new(binary);
    for n in nodes {
        c.args(["--blockdev", n]);
    }
    let mut c = c
        .arg("--nbd-server")
        .arg(format!("addr.type=unix,addr.path={}", sock.display()))
        .args(["--export", "type=nbd,id=e,node-name=b,writable=on"])
        .arg("--chardev")
        .arg(format!(
            "socket,id=m,path={},server=on,wait=off",
            qmp.display()
        ))
        .args(["--monitor", "chardev=m", "--pidfile"])
        .arg(&pid)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !pid.exists() {
        if c.try_wait().unwrap().is_some() {
            let mut e = String::new();
            use std::io::Read;
            c.stderr.take().unwrap().read_to_string(&mut e).unwrap();
            return Err(e.trim().to_string());
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{binary} did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok((Daemon(c), sock))
}

/// The error after qsd's echo of the options (`--blockdev OPTS: `), or stord's.
pub fn words(e: &str, opts: &str) -> String {
    e.split_once(&format!("{opts}: "))
        .or_else(|| e.split_once("--blockdev: "))
        .or_else(|| e.split_once("stord: "))
        .map_or(e, |x| x.1)
        .to_string()
}
