//! The TCG guest of the vhost-user-blk and VDUSE tests: Debian's kernel and a busybox
//! initramfs built by scripts/build-guest.sh, booted under qemu-system-x86_64. The guest
//! runs a script from tests/guest/ and reports on its serial console (`GUEST-*` lines).

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where build-guest.sh puts the kernel and the initramfs images.
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/guest")
}

/// Runs scripts/build-guest.sh with `args` (none: the plain initramfs).
pub fn build(args: &[&str]) {
    let st =
        Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-guest.sh"))
            .args(args)
            .stdout(Stdio::null())
            .status()
            .expect("run scripts/build-guest.sh");
    assert!(st.success(), "scripts/build-guest.sh failed");
}

/// Boots `initrd` with the kernel command line `append` and the machine options `machine`
/// (memory, devices), calling `on_line` with each console line as it comes; returns the
/// console output and QEMU's stderr once the guest powers off or `limit` passes.
pub fn boot(
    machine: &[String],
    initrd: &str,
    append: &str,
    limit: Duration,
    mut on_line: impl FnMut(&str),
) -> String {
    let g = dir();
    let mut child = Command::new("qemu-system-x86_64")
        .args(machine)
        .args([
            "-nographic",
            "-no-reboot",
            "-nodefaults",
            "-serial",
            "stdio",
        ])
        .args(["-kernel", &g.join("vmlinuz").display().to_string()])
        .args(["-initrd", &g.join(initrd).display().to_string()])
        .args(["-append", &format!("console=ttyS0 quiet panic=-1 {append}")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn qemu-system-x86_64");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + limit;
    let mut out = String::new();
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => {
                on_line(&line);
                out.push_str(&line);
                out.push('\n');
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break;
                }
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    format!("{out}\n{err}")
}
