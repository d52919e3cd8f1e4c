//! Faults, with real clients: the daemon killed during flushed writes on every backend, the
//! disk filling up, the storage under a file vanishing, clients that vanish mid-request on
//! each export, and `max-connections`. Acknowledged flushed writes survive; an error reaches
//! the client as an error; the daemon keeps serving everyone else.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::crash::{block_of, flushed_writes_then_kill, Rng, BLOCK};
use common::rawnbd::RawNbd;
use common::*;

/// Rounds of: batches of 8 random 4 KiB writes, each batch flushed, the last batch still
/// in flight when stord is killed with SIGKILL. After each round every flushed block holds
/// what was written, and every block of the unflushed batch holds its old or its new data.
fn kill_9_rounds(name: &str, objects: &[&str], blockdev: &str, rounds: usize) {
    const SIZE: u64 = 16 << 20;
    let dir = tmpdir(name);
    let img = dir.join("disk.img");
    sparse_image(&img, SIZE);
    let sock = dir.join("nbd.sock");
    let mut args: Vec<String> = Vec::new();
    for o in objects {
        args.extend(["--object".into(), o.to_string()]);
    }
    args.extend([
        "--blockdev".into(),
        format!(
            "node-name=disk,{}",
            blockdev.replace("IMG", &img.display().to_string())
        ),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", sock.display()),
        "--export".into(),
        "type=nbd,id=exp0,node-name=disk,name=disk,writable=on".into(),
    ]);
    let mut rng = Rng::from_clock();
    let mut expect: std::collections::HashMap<u64, u64> = Default::default();
    let mut id = 0u64;
    for round in 0..rounds {
        let mut s = Stord::start(&dir, &args);
        let (flushed, unflushed) = flushed_writes_then_kill(&mut s, &mut rng, SIZE, &mut id);
        expect.extend(flushed);
        let f = std::fs::File::open(&img).unwrap();
        let read = |off: u64| {
            let mut b = vec![0u8; BLOCK as usize];
            f.read_exact_at(&mut b, off).unwrap();
            b
        };
        let unflushed_offsets: Vec<u64> = unflushed.iter().map(|&(o, _)| o).collect();
        for (&off, &want) in &expect {
            if unflushed_offsets.contains(&off) {
                continue;
            }
            assert!(
                read(off) == block_of(want),
                "{name} round {round}: flushed write {want} at {off} lost"
            );
        }
        for &(off, new) in &unflushed {
            let old = expect
                .get(&off)
                .map_or(vec![0u8; BLOCK as usize], |&i| block_of(i));
            let got = read(off);
            assert!(
                got == old || got == block_of(new),
                "{name} round {round}: block at {off} is neither old nor new"
            );
            // Whatever it holds now is what later rounds must find (old: already expected).
            if got == block_of(new) {
                expect.insert(off, new);
            }
        }
    }
}

#[test]
fn kill_9_during_flushed_writes_file_io_uring_direct() {
    kill_9_rounds(
        "k9-uring",
        &[],
        "driver=file,filename=IMG,aio=io_uring,cache.direct=on",
        5,
    );
}

#[test]
fn kill_9_during_flushed_writes_file_native_direct() {
    kill_9_rounds(
        "k9-native",
        &[],
        "driver=file,filename=IMG,aio=native,cache.direct=on",
        5,
    );
}

#[test]
fn kill_9_during_flushed_writes_file_threads() {
    kill_9_rounds("k9-threads", &[], "driver=file,filename=IMG,aio=threads", 5);
}

#[test]
fn kill_9_during_flushed_writes_raw_over_file() {
    kill_9_rounds(
        "k9-raw",
        &[],
        "driver=raw,file.driver=file,file.filename=IMG,file.aio=io_uring,file.cache.direct=on",
        5,
    );
}

#[test]
fn kill_9_during_flushed_writes_throttle_over_file() {
    kill_9_rounds(
        "k9-throttle",
        &["throttle-group,id=g,x-iops-total=100000"],
        "driver=throttle,throttle-group=g,file.driver=file,file.filename=IMG",
        5,
    );
}

/// qemu-io's output for `cmd` on export `disk` of `sock`.
fn qemu_io(sock: &Path, cmd: &str) -> String {
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    let out = run("qemu-io", &["-f", "raw", "-c", cmd, &uri]);
    String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
}

/// A small tmpfs, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        let m = dir.join("small");
        std::fs::create_dir_all(&m).unwrap();
        run_ok(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "tmpfs",
                &m.display().to_string(),
            ],
        );
        Tmpfs(m)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", &self.0.display().to_string()]);
    }
}

#[test]
fn a_full_disk_fails_writes_with_enospc_and_loses_nothing_acknowledged() {
    let dir = tmpdir("enospc");
    let fs = Tmpfs::mount(&dir, "8M");
    let img = fs.0.join("disk.img");
    sparse_image(&img, 64 << 20);
    // Leave about 1 MiB free.
    let filler = fs.0.join("filler");
    run_ok("fallocate", &["-l", "7M", &filler.display().to_string()]);
    let s = Stord::with_node(
        &dir,
        &format!("driver=file,filename={},aio=io_uring", img.display()),
        true,
    );
    // 1 MiB that fits, flushed; then 4 MiB that does not.
    let out = qemu_io(&s.sock, "write -P 0x11 0 512k");
    assert!(out.contains("wrote"), "{out}");
    let out = qemu_io(&s.sock, "flush");
    assert!(!out.contains("failed"), "{out}");
    let out = qemu_io(&s.sock, "write -P 0x22 8M 4M");
    assert!(out.contains("No space left on device"), "{out}");
    // The daemon serves on: the acknowledged data reads back, nbdinfo works.
    let out = qemu_io(&s.sock, "read -P 0x11 0 512k");
    assert!(out.contains("read") && !out.contains("failed"), "{out}");
    assert!(run("nbdinfo", &["--size", &s.uri()]).status.success());
    // Space comes back, the write goes through and is on disk after a flush.
    std::fs::remove_file(&filler).unwrap();
    let out = qemu_io(&s.sock, "write -P 0x22 8M 1M");
    assert!(out.contains("wrote") && !out.contains("failed"), "{out}");
    let out = qemu_io(&s.sock, "flush");
    assert!(!out.contains("failed"), "{out}");
    let mut b = vec![0u8; 4096];
    std::fs::File::open(&img)
        .unwrap()
        .read_exact_at(&mut b, 8 << 20)
        .unwrap();
    assert!(b.iter().all(|&x| x == 0x22));
}

#[test]
fn storage_that_vanishes_under_a_file_gives_io_errors_and_the_daemon_serves_on() {
    // The image lives on a FUSE mount (stord A's export); stord B serves a file on it. A
    // killed with SIGKILL takes the storage away: B's I/O on that file fails.
    let dir = tmpdir("vanish");
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0x33u8; 4 << 20]).unwrap();
    let mnt = dir.join("mnt.img");
    std::fs::write(&mnt, b"").unwrap();
    let a_dir = dir.join("a");
    std::fs::create_dir_all(&a_dir).unwrap();
    let mut a = Stord::start(
        &a_dir,
        &[
            "--blockdev".into(),
            format!("driver=file,node-name=disk,filename={}", img.display()),
            "--export".into(),
            format!(
                "type=fuse,id=f,node-name=disk,mountpoint={},writable=on",
                mnt.display()
            ),
        ],
    );
    let healthy = dir.join("healthy.img");
    std::fs::write(&healthy, vec![0x44u8; 1 << 20]).unwrap();
    let sock = dir.join("nbd.sock");
    let b = Stord::start(
        &dir,
        &[
            "--blockdev".into(),
            format!(
                "driver=file,node-name=disk,filename={},aio=threads",
                mnt.display()
            ),
            "--blockdev".into(),
            format!("driver=file,node-name=ok,filename={}", healthy.display()),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", sock.display()),
            "--export".into(),
            "type=nbd,id=e1,node-name=disk,name=disk,writable=on".into(),
            "--export".into(),
            "type=nbd,id=e2,node-name=ok,name=ok".into(),
        ],
    );
    let out = qemu_io(&sock, "read -P 0x33 0 64k");
    assert!(!out.contains("failed"), "{out}");
    a.kill9();
    let deadline = Instant::now() + Duration::from_secs(10);
    let failed = loop {
        let out = qemu_io(&sock, "read 1M 64k");
        if out.contains("failed") || Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(failed.contains("read failed"), "{failed}");
    let out = qemu_io(&sock, "write -P 0x55 0 4k");
    assert!(out.contains("write failed"), "{out}");
    // The other export, on healthy storage, is unaffected.
    let ok_uri = format!("nbd+unix:///ok?socket={}", sock.display());
    let out = run(
        "qemu-io",
        &["-r", "-f", "raw", "-c", "read -P 0x44 0 1M", &ok_uri],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("read") && !text.contains("failed"), "{text}");
    drop(b);
}

#[test]
fn max_connections_is_honoured() {
    // On the main loop and on an IoThread: a connection handed to its IoThread still
    // counts (it did not, and 10 of 10 clients got in).
    for iothread in [false, true] {
        let dir = tmpdir(&format!("maxconn-{iothread}"));
        let sock = dir.join("nbd.sock");
        let mut args = vec![
            "--blockdev".into(),
            "driver=null-co,node-name=disk,size=1M".into(),
            "--nbd-server".into(),
            format!(
                "addr.type=unix,addr.path={},max-connections=2",
                sock.display()
            ),
            "--export".into(),
            "type=nbd,id=e,node-name=disk,name=disk".into(),
        ];
        if iothread {
            args.insert(0, "iothread,id=io0".into());
            args.insert(0, "--object".into());
            let last = args.last_mut().unwrap();
            last.push_str(",iothread=io0");
        }
        let s = Stord::start(&dir, &args);
        let mut a = RawNbd::connect(&s.sock, "disk");
        let b = RawNbd::connect(&s.sock, "disk");
        // Both are in transmission (and, with an IoThread, handed over to it).
        assert_eq!(a.read(1, 0, 512).0, 0);
        // A third is turned away: nbdinfo cannot get through.
        assert!(
            !run("nbdinfo", &["--size", &s.uri()]).status.success(),
            "a third client got in (iothread: {iothread})"
        );
        assert_eq!(a.read(2, 0, 512).0, 0);
        drop(b);
        // Once one leaves, a new client gets in.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !run("nbdinfo", &["--size", &s.uri()]).status.success() {
            assert!(Instant::now() < deadline, "no room after a client left");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn a_fuse_client_killed_mid_read_or_write_leaves_the_export_serving() {
    let dir = tmpdir("fuse-vanish");
    let img = dir.join("disk.img");
    sparse_image(&img, 256 << 20);
    let mnt = dir.join("mnt.img");
    std::fs::write(&mnt, b"").unwrap();
    let s = Stord::start(
        &dir,
        &[
            "--object".into(),
            "iothread,id=io0".into(),
            "--blockdev".into(),
            format!(
                "driver=file,node-name=disk,filename={},aio=io_uring",
                img.display()
            ),
            "--export".into(),
            format!(
                "type=fuse,id=f,node-name=disk,mountpoint={},writable=on,iothread=io0",
                mnt.display()
            ),
        ],
    );
    let fds = s.fd_count();
    let m = mnt.display().to_string();
    for round in 0..6 {
        let args: Vec<String> = if round % 2 == 0 {
            vec![
                format!("if={m}"),
                "of=/dev/null".into(),
                "bs=1M".into(),
                "iflag=direct".into(),
            ]
        } else {
            vec![
                "if=/dev/zero".into(),
                format!("of={m}"),
                "bs=1M".into(),
                "count=256".into(),
                "oflag=direct".into(),
                "conv=notrunc".into(),
            ]
        };
        let mut dd = std::process::Command::new("dd")
            .args(&args)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(30 + 20 * round));
        dd.kill().unwrap();
        dd.wait().unwrap();
    }
    // The export still reads and writes, and holds no more descriptors than before.
    std::fs::File::options()
        .write(true)
        .open(&mnt)
        .unwrap()
        .write_all_at(&[0x77; 4096], 4096)
        .unwrap();
    let mut b = vec![0u8; 4096];
    std::fs::File::open(&mnt)
        .unwrap()
        .read_exact_at(&mut b, 4096)
        .unwrap();
    assert!(b.iter().all(|&x| x == 0x77));
    assert!(
        s.fd_count() <= fds + 2,
        "descriptors {} -> {}",
        fds,
        s.fd_count()
    );
}

/// stord B serves a file on stord A's FUSE export; A is stopped (SIGSTOP), so B's final
/// flush never returns. B still stops: at once on a second SIGTERM, or once the flush
/// deadline passes, with exit status 1, its pidfile and socket removed.
#[test]
fn sigterm_stops_the_daemon_while_its_storage_hangs() {
    for second_signal in [true, false] {
        let dir = tmpdir(&format!("hang-{second_signal}"));
        let img = dir.join("disk.img");
        std::fs::write(&img, vec![0x33u8; 4 << 20]).unwrap();
        let mnt = dir.join("mnt.img");
        std::fs::write(&mnt, b"").unwrap();
        let a_dir = dir.join("a");
        std::fs::create_dir_all(&a_dir).unwrap();
        let mut a = Stord::start(
            &a_dir,
            &[
                "--blockdev".into(),
                format!("driver=file,node-name=disk,filename={}", img.display()),
                "--export".into(),
                format!(
                    "type=fuse,id=f,node-name=disk,mountpoint={},writable=on",
                    mnt.display()
                ),
            ],
        );
        let sock = dir.join("nbd.sock");
        let mut b = Stord::start(
            &dir,
            &[
                "--blockdev".into(),
                format!(
                    "driver=file,node-name=disk,filename={},aio=threads",
                    mnt.display()
                ),
                "--nbd-server".into(),
                format!("addr.type=unix,addr.path={}", sock.display()),
                "--export".into(),
                "type=nbd,id=e1,node-name=disk,name=disk,writable=on".into(),
            ],
        );
        let out = qemu_io(&sock, "write -P 0x55 0 64k");
        assert!(!out.contains("failed"), "{out}");
        // The storage stops answering.
        a.signal(libc::SIGSTOP);
        let start = Instant::now();
        b.signal(libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(500));
        assert!(b.is_running(), "B stopped although its flush cannot finish");
        let limit = if second_signal {
            b.signal(libc::SIGTERM);
            Duration::from_secs(3)
        } else {
            Duration::from_secs(20)
        };
        // B gives up: its pidfile and socket go, and it exits. The kernel finishes that
        // exit only once the storage answers the close of B's file on it (FUSE waits for
        // its FLUSH), so the exit status is read after A runs again.
        let deadline = Instant::now() + limit;
        while b.pidfile.exists() {
            if Instant::now() > deadline {
                a.signal(libc::SIGCONT);
                panic!("B did not give up within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let gave_up = start.elapsed();
        assert!(!sock.exists());
        if !second_signal {
            // The flush deadline (10 s), not forever.
            assert!(gave_up >= Duration::from_secs(9), "{gave_up:?}");
        }
        a.signal(libc::SIGCONT);
        let status = b.wait_exit(Duration::from_secs(10));
        assert_eq!(
            status.code(),
            Some(1),
            "exit status must say it stopped unclean"
        );
        a.kill9();
    }
}
