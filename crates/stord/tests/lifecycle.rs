//! The daemon's life cycle: SIGTERM under load, --daemonize, the monitor socket's mode.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::rawnbd::{RawNbd, CMD_FLUSH};
use common::{run_ok, sparse_image, tmpdir, Stord};

#[test]
fn sigterm_during_fio_writes_keeps_acknowledged_flushed_data() {
    let dir = tmpdir("sigterm-load");
    let img = dir.join("disk.img");
    sparse_image(&img, 64 << 20);
    let sock = dir.join("nbd.sock");
    let mon = dir.join("qmp.sock");
    let args: Vec<String> = vec![
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", mon.display()),
        "--monitor".into(),
        "chardev=m".into(),
        "--object".into(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        format!(
            "driver=file,node-name=disk,filename={},aio=io_uring,cache.direct=on",
            img.display()
        ),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", sock.display()),
        "--export".into(),
        "type=nbd,id=e,node-name=disk,name=disk,writable=on,iothread=io0".into(),
    ];
    let mut s = Stord::start(&dir, &args);
    assert_eq!(
        std::fs::metadata(&mon).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // fio writes to the first 32 MiB; a tracker writes numbered blocks to the last 32 MiB,
    // flushing after each, and remembers which writes+flushes were acknowledged.
    let uri = s.uri();
    let mut fio = Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=64k",
            "--iodepth=16",
            "--size=32M",
            "--time_based",
            "--runtime=60",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut tracker = RawNbd::connect(&s.sock, "disk");
    let base = 32u64 << 20;
    let mut acked = Vec::new();
    let start = Instant::now();
    let mut signalled = false;
    for i in 0..4096u64 {
        // The signal lands once enough writes are acknowledged to mean something (on a
        // busy machine fio's writes can hold each flush up for a long time), with fio
        // still running.
        let waited = start.elapsed();
        if !signalled
            && waited > Duration::from_millis(700)
            && (acked.len() > 50 || waited > Duration::from_secs(20))
        {
            s.signal(libc::SIGTERM);
            signalled = true;
        }
        let block = vec![(i % 251) as u8 + 1; 4096];
        let offset = base + (i % 8192) * 4096;
        use std::io::{Read, Write};
        let mut req = Vec::new();
        req.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&1u16.to_be_bytes());
        req.extend_from_slice(&i.to_be_bytes());
        req.extend_from_slice(&offset.to_be_bytes());
        req.extend_from_slice(&4096u32.to_be_bytes());
        req.extend_from_slice(&block);
        req.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&CMD_FLUSH.to_be_bytes());
        req.extend_from_slice(&(i | 1 << 63).to_be_bytes());
        req.extend_from_slice(&0u64.to_be_bytes());
        req.extend_from_slice(&0u32.to_be_bytes());
        if tracker.s.write_all(&req).is_err() {
            break;
        }
        // Two simple replies: the write and the flush.
        let mut ok = true;
        for _ in 0..2 {
            let mut h = [0u8; 16];
            if tracker.s.read_exact(&mut h).is_err() || h[4..8] != [0, 0, 0, 0] {
                ok = false;
                break;
            }
        }
        if !ok {
            break;
        }
        acked.push((offset, block[0]));
        if signalled && start.elapsed() > Duration::from_secs(30) {
            break;
        }
    }
    assert!(signalled, "the tracker finished before the signal");
    let status = s.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "stord exited with {status}");
    let _ = fio.wait();
    assert!(!s.sock.exists(), "NBD socket left behind");
    assert!(!mon.exists(), "monitor socket left behind");
    assert!(!s.pidfile.exists(), "pidfile left behind");
    assert!(
        acked.len() > 10,
        "too few acknowledged writes ({}) to mean anything",
        acked.len()
    );
    // Every acknowledged and flushed block is in the image (last write per offset wins).
    let data = std::fs::read(&img).unwrap();
    let mut last = std::collections::HashMap::new();
    for (off, pat) in &acked {
        last.insert(*off, *pat);
    }
    for (off, pat) in last {
        let b = &data[off as usize..off as usize + 4096];
        assert!(
            b.iter().all(|&x| x == pat),
            "block at {off} lost (expected {pat:#x}, found {:#x})",
            b[0]
        );
    }
}

#[test]
fn daemonize_returns_once_ready_and_the_daemon_serves() {
    let dir = tmpdir("daemonize");
    let img = dir.join("disk.img");
    sparse_image(&img, 4 << 20);
    let sock = dir.join("nbd.sock");
    let pidfile = dir.join("stord.pid");
    let status = Command::new(env!("CARGO_BIN_EXE_stord"))
        .args([
            "--daemonize",
            "--pidfile",
            &pidfile.display().to_string(),
            "--blockdev",
            &format!("driver=file,node-name=disk,filename={}", img.display()),
            "--nbd-server",
            &format!("addr.type=unix,addr.path={}", sock.display()),
            "--export",
            "type=nbd,id=e,node-name=disk,name=disk,writable=on",
        ])
        .status()
        .unwrap();
    assert!(status.success());
    // Ready when the parent returns: pidfile and socket exist, the export serves.
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    run_ok("nbdinfo", &[&uri]);
    // SAFETY: kill(2) on the daemon we started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let start = Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z"))
            .unwrap_or(false)
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "daemon did not exit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!pidfile.exists() && !sock.exists());
    // A bad command line makes --daemonize fail in the parent, with the message.
    let out = Command::new(env!("CARGO_BIN_EXE_stord"))
        .args([
            "--daemonize",
            "--blockdev",
            "driver=file,node-name=x,filename=/nonexistent/img",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nonexistent"));
}

#[test]
fn qmp_quit_shuts_down_cleanly() {
    let dir = tmpdir("quit");
    let mon = dir.join("qmp.sock");
    let mut s = Stord::start(
        &dir,
        &[
            "--chardev".into(),
            format!("socket,id=m,path={},server=on,wait=off", mon.display()),
            "--monitor".into(),
            "chardev=m".into(),
        ],
    );
    use std::io::{BufRead, BufReader, Write};
    let c = std::os::unix::net::UnixStream::connect(&mon).unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut w = c;
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.contains("\"QMP\""));
    w.write_all(b"{\"execute\":\"qmp_capabilities\"}\n{\"execute\":\"quit\",\"id\":1}\n")
        .unwrap();
    // QMP text as qsd writes it; no SHUTDOWN event (qsd has none), quit's reply last.
    let mut seen = String::new();
    while r.read_line(&mut seen).unwrap() > 0 {}
    assert_eq!(seen, "{\"return\": {}}\r\n{\"return\": {}, \"id\": 1}\r\n");
    let st = s.wait_exit(Duration::from_secs(10));
    assert!(st.success());
    assert!(!mon.exists() && !s.pidfile.exists());
}

/// STORD_AIO_REACTOR says what `auto` means for the daemon (read once, by the binary, not by
/// the event-loop library); an iothread's explicit `reactor=` is never overridden, and a
/// bad value stops the start with a message naming the variable.
#[test]
fn the_reactor_variable_sets_auto_and_never_overrides_an_explicit_choice() {
    let dir = common::tmpdir("reactor-env");
    let sock = dir.join("qmp.sock");
    let mut args = common::rawqmp::monitor_args(&sock);
    for o in ["iothread,id=explicit,reactor=io_uring", "iothread,id=auto"] {
        args.push("--object".into());
        args.push(o.into());
    }
    let s = common::Stord::start_wrapped(&dir, &["env", "STORD_AIO_REACTOR=epoll"], &args);
    let mut q = common::rawqmp::RawQmp::connect(&sock);
    let r = q.send(r#"{"execute":"query-iothreads"}"#);
    let kind = |id: &str| {
        r["return"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["id"] == id)
            .map(|t| t["x-stats"]["reactor"].clone())
            .unwrap()
    };
    assert_eq!(kind("explicit"), "io_uring", "{r}");
    assert_eq!(kind("auto"), "epoll", "{r}");
    drop(s);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stord"))
        .env("STORD_AIO_REACTOR", "kqueue")
        .args(["--blockdev", "driver=null-co,node-name=n"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("STORD_AIO_REACTOR") && err.contains("kqueue"),
        "{err}"
    );
}

/// As qsd: a daemon that runs well writes nothing to stderr, through a stop by SIGTERM with
/// an NBD, a FUSE and a vhost-user-blk export that served a client (QEMU's tests compare
/// the daemon's stderr).
#[test]
fn stderr_stays_empty_through_a_sigterm_stop_with_every_export() {
    let dir = tmpdir("quiet");
    let (nbd, mnt, vhost) = (dir.join("nbd.sock"), dir.join("mnt"), dir.join("vu.sock"));
    std::fs::write(&mnt, b"").unwrap();
    let args: Vec<String> = [
        "--object",
        "iothread,id=io0",
        "--blockdev",
        "driver=null-co,node-name=n0,size=64M,read-zeroes=on",
        "--nbd-server",
        &format!("addr.type=unix,addr.path={}", nbd.display()),
        "--export",
        "type=nbd,id=e0,node-name=n0,iothread=io0",
        "--export",
        &format!("type=fuse,id=e1,node-name=n0,mountpoint={}", mnt.display()),
        "--export",
        &format!(
            "type=vhost-user-blk,id=e2,node-name=n0,addr.type=unix,addr.path={}",
            vhost.display()
        ),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut s = Stord::start(&dir, &args);
    let uri = format!("nbd+unix:///n0?socket={}", nbd.display());
    run_ok(
        "qemu-io",
        &["-r", "-f", "raw", "-c", "read -P 0 0 1M", &uri],
    );
    assert_eq!(std::fs::read(&mnt).unwrap().len(), 64 << 20);
    let err = s.stop_and_stderr();
    let st = s.child.try_wait().unwrap();
    assert!(st.is_some_and(|st| st.success()), "{st:?}");
    assert_eq!(err, "", "stord wrote to stderr");
}

/// `--trace` with a QEMU trace pattern shows its subsystem's diagnostics, in the file
/// `file=` names; a name that selects nothing is warned about in QEMU's words.
#[test]
fn trace_shows_a_subsystems_diagnostics_in_its_file() {
    let dir = tmpdir("trace");
    let nbd = dir.join("nbd.sock");
    let log = dir.join("trace.log");
    let args: Vec<String> = [
        "--trace",
        &format!("enable=nbd_*,file={}", log.display()),
        "--trace",
        "no_such_event",
        "--blockdev",
        "driver=null-co,node-name=n0",
        "--nbd-server",
        &format!("addr.type=unix,addr.path={}", nbd.display()),
        "--export",
        "type=nbd,id=e0,node-name=n0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut s = Stord::start(&dir, &args);
    let uri = format!("nbd+unix:///n0?socket={}", nbd.display());
    run_ok("qemu-io", &["-r", "-f", "raw", "-c", "read 0 4k", &uri]);
    s.signal(libc::SIGTERM);
    assert!(s.wait_exit(Duration::from_secs(10)).success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("stord::export::nbd"), "{text}");
    assert!(
        text.contains("trace event 'no_such_event' does not exist"),
        "{text}"
    );
}
