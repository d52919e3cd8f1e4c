//! Crash consistency by replay, end to end: `stord-bench crash` over every workload on
//! stord and on qsd (the control: the same checker must pass QEMU's qcow2), a bounded
//! number of points each; the checker's self-test (a replay that loses writes must be
//! caught); and `stord-bench replay` on a log qsd's blklogwrites wrote.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A scratch directory under target/tmp, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("crash-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The stord binary cargo built beside stord-bench (`cargo test --workspace` builds it).
fn stord() -> PathBuf {
    let s = Path::new(env!("CARGO_BIN_EXE_stord-bench")).with_file_name("stord");
    assert!(s.exists(), "no {} (build the workspace)", s.display());
    s
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stord-bench"))
        .args(args)
        .output()
        .unwrap()
}

/// `stord-bench crash` with `args`: its exit status and its outcomes.
fn crash(dir: &Path, args: &[&str]) -> (bool, Vec<serde_json::Value>) {
    let (s, out) = (dir.join("scratch"), dir.join("out"));
    let stord = stord();
    let mut a = vec!["crash", "--stord", stord.to_str().unwrap()];
    a.extend(["--dir", s.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    a.extend(args);
    let o = bench(&a);
    println!("{}", String::from_utf8_lossy(&o.stdout));
    assert!(!s.exists(), "the crash run left its scratch behind");
    let file = std::fs::read_dir(out.join("crash"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "json"))
        .expect("no results written");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
    (
        o.status.success(),
        doc["outcomes"].as_array().unwrap().clone(),
    )
}

#[test]
fn every_workload_survives_its_crash_points_on_stord_and_qsd() {
    let dir = Scratch::new("all");
    let (ok, outcomes) = crash(
        &dir.0,
        &["--daemon", "stord", "--daemon", "qsd", "--points", "8"],
    );
    assert!(ok, "a crash point failed: {outcomes:#?}");
    assert_eq!(outcomes.len(), 18, "nine workloads on two daemons");
    for o in &outcomes {
        let what = format!("{} {}", o["daemon"], o["workload"]);
        assert!(o["points"].as_u64().unwrap() >= 6, "{what}: {o}");
        assert!(o["torn_points"].as_u64().unwrap() >= 1, "{what}: {o}");
        // A backup's target is flushed when the job ends and as the daemon closes it.
        let flushes = if o["workload"] == "backup-target" {
            2
        } else {
            5
        };
        assert!(o["log_flushes"].as_u64().unwrap() >= flushes, "{what}: {o}");
        assert_eq!(o["corrupt"], 0, "{what}: {o}");
        assert_eq!(o["wrong_data"], 0, "{what}: {o}");
        assert_eq!(o["replay_matches_image"], true, "{what}: {o}");
        if o["workload"] == "internal-snapshot" {
            assert!(o["snapshot_points"].as_u64().unwrap() >= 1, "{what}: {o}");
        }
    }
}

#[test]
fn the_checker_catches_a_replay_that_loses_writes() {
    let dir = Scratch::new("lose");
    let (ok, outcomes) = crash(
        &dir.0,
        &["--workload", "alloc", "--points", "8", "--lose-every", "5"],
    );
    assert!(!ok, "lost writes went unnoticed: {outcomes:#?}");
    assert!(
        outcomes[0]["wrong_data"].as_u64().unwrap() >= 1,
        "{outcomes:#?}"
    );
}

/// qsd with a raw file under blklogwrites, exported as `b`.
fn qsd(dir: &Path) -> (std::process::Child, PathBuf) {
    let (sock, pid) = (dir.join("b.sock"), dir.join("b.pid"));
    let c = Command::new("qemu-storage-daemon")
        .arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=f,filename={}",
            dir.join("disk.raw").display()
        ))
        .arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=l,filename={}",
            dir.join("log").display()
        ))
        .args(["--blockdev", "driver=blklogwrites,node-name=b,file=f,log=l"])
        .arg("--nbd-server")
        .arg(format!("addr.type=unix,addr.path={}", sock.display()))
        .args(["--export", "type=nbd,id=e,node-name=b,writable=on"])
        .arg("--pidfile")
        .arg(&pid)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !pid.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "qsd did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    (c, sock)
}

#[test]
fn replays_a_log_qsd_wrote() {
    let dir = Scratch::new("replay");
    let d = &dir.0;
    let zeroes = vec![0u8; 2 << 20];
    std::fs::write(d.join("disk.raw"), &zeroes).unwrap();
    std::fs::write(d.join("log"), b"").unwrap();
    let (mut q, sock) = qsd(d);
    let uri = format!("nbd+unix:///b?socket={}", sock.display());
    let mut args = vec!["-f", "raw", "-t", "writeback"];
    for c in [
        "write -P 1 0 64k",
        "flush",
        "write -P 2 4k 4k",
        "write -z 32k 8k",
        "flush",
        "discard 64k 64k",
        "write -P 3 1m 100",
        "flush",
    ] {
        args.extend(["-c", c]);
    }
    args.push(&uri);
    let o = Command::new("qemu-io").args(&args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    q.kill().unwrap();
    q.wait().unwrap();
    let (log, copy) = (d.join("log"), d.join("copy.raw"));
    let replay = |n: Option<&str>| {
        std::fs::write(&copy, &zeroes).unwrap();
        let mut a = vec!["replay", log.to_str().unwrap(), copy.to_str().unwrap()];
        a.extend(n.map(|n| ["--entries", n]).into_iter().flatten());
        let o = bench(&a);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let said = replay(None);
    assert!(said.contains("3 flushes"), "{said}");
    assert_eq!(
        std::fs::read(&copy).unwrap(),
        std::fs::read(d.join("disk.raw")).unwrap(),
        "the replayed log is not qsd's image"
    );
    // The first entry only: the 64k write, without what overwrote part of it.
    replay(Some("1"));
    let got = std::fs::read(&copy).unwrap();
    assert!(
        got[..64 << 10].iter().all(|&b| b == 1),
        "entry 1 not replayed"
    );
    assert!(
        got[64 << 10..].iter().all(|&b| b == 0),
        "more than entry 1 replayed"
    );
}
