//! The FUSE export on real mounts: fio, qemu-img, truncate, lseek, mkfs.ext4 + a loop
//! mount + fsck, read-only refusal, kill -9 clean-up, several IoThreads.

mod common;

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::rawqmp::{monitor_args, RawQmp};
use common::{run, run_ok, sparse_image, tmpdir, Stord};

/// FUSE tests run one at a time: the io_uring transport is switched on with a global
/// kernel parameter, which each test sets for its second half and then restores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

struct RestoreParam(String);

impl Drop for RestoreParam {
    fn drop(&mut self) {
        let _ = std::fs::write(URING_PARAM, &self.0);
    }
}

/// Runs `test` over /dev/fuse, then over FUSE-over-io_uring (enabling the kernel's
/// parameter as root, and restoring it). `test` gets the export option to add.
fn on_both_transports(test: impl Fn(&str)) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    test("io-uring=off");
    let old = std::fs::read_to_string(URING_PARAM)
        .unwrap_or_else(|e| panic!("{URING_PARAM}: {e} (this kernel has no FUSE over io_uring)"));
    let _restore = RestoreParam(old.trim().to_string());
    std::fs::write(URING_PARAM, "Y").unwrap_or_else(|e| panic!("cannot enable {URING_PARAM}: {e}"));
    test("io-uring=on");
}

/// Asserts which transport served the export (from query-block-exports), then stops the
/// daemon.
fn assert_transport(s: &mut Stord, transport_opt: &str) {
    let mut q = RawQmp::connect(&s.dir.join("qmp.sock"));
    let r = q.send(r#"{"execute":"query-block-exports"}"#);
    let e = &r["return"][0];
    let (dev, uring) = (
        e["x-requests"]["dev-fuse"].as_u64().unwrap(),
        e["x-requests"]["io-uring"].as_u64().unwrap(),
    );
    if transport_opt == "io-uring=on" {
        assert_eq!(e["x-transport"], "io_uring", "{r}");
        assert!(uring > 100, "few requests over io_uring: {r}");
    } else {
        assert_eq!(e["x-transport"], "/dev/fuse", "{r}");
        assert_eq!(uring, 0, "{r}");
        assert!(dev > 100, "few requests over /dev/fuse: {r}");
    }
    drop(q);
    s.stop_and_stderr();
}

fn is_mounted(p: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let needle = format!(" {} ", p.display());
    mounts.lines().any(|l| l.contains(&needle))
}

/// Waits (bounded) until the watchdog or the daemon has unmounted `p`.
fn wait_unmounted(p: &Path) {
    let start = Instant::now();
    while is_mounted(p) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} still mounted",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// stord with one node and a FUSE export of it on `dir/mnt`.
fn fuse_stord(
    dir: &Path,
    blockdev: &str,
    export_opts: &str,
    iothreads: &[&str],
) -> (Stord, PathBuf) {
    let mnt = dir.join("mnt");
    // A mount left by the previous transport's run must be gone first.
    wait_unmounted(&mnt);
    std::fs::write(&mnt, b"").unwrap();
    let mut args = monitor_args(&dir.join("qmp.sock"));
    for t in iothreads {
        args.push("--object".into());
        args.push(format!("iothread,id={t}"));
    }
    args.push("--blockdev".into());
    args.push(format!("node-name=disk,{blockdev}"));
    args.push("--export".into());
    args.push(format!(
        "type=fuse,id=f0,node-name=disk,mountpoint={},{export_opts}",
        mnt.display()
    ));
    let s = Stord::start(dir, &args);
    assert!(is_mounted(&mnt));
    (s, mnt)
}

fn file_node(img: &Path, aio: &str) -> String {
    format!(
        "driver=file,filename={},aio={aio},cache.direct=on,discard=unmap",
        img.display()
    )
}

fn fio_verify_file(path: &Path, size: &str) {
    let file = format!("--filename={}", path.display());
    common::fio_write_and_verify(&["--ioengine=libaio", "--direct=1", &file], size);
}

#[test]
fn fio_verify_through_the_mount_for_every_aio_mode() {
    on_both_transports(|tr| {
        for aio in ["io_uring", "native", "threads"] {
            let dir = tmpdir(&format!("fuse-fio-{aio}"));
            let img = dir.join("disk.img");
            sparse_image(&img, 64 << 20);
            let (s, mnt) = fuse_stord(
                &dir,
                &file_node(&img, aio),
                &format!("writable=on,iothread=io0,{tr}"),
                &["io0"],
            );
            fio_verify_file(&mnt, "16M");
            // The mounted file and the image hold the same bytes.
            let out = run_ok(
                "qemu-img",
                &[
                    "compare",
                    "-f",
                    "raw",
                    "-F",
                    "raw",
                    &mnt.display().to_string(),
                    &img.display().to_string(),
                ],
            );
            assert!(out.contains("identical"), "{out}");
            let mut s = s;
            assert_transport(&mut s, tr);
        }
    });
}

#[test]
fn null_node_reads_zeroes_through_the_mount() {
    on_both_transports(|tr| {
        let dir = tmpdir("fuse-null");
        let (_s, mnt) = fuse_stord(
            &dir,
            "driver=null-co,size=67108864,read-zeroes=on",
            &format!("writable=on,{tr}"),
            &[],
        );
        let out = run_ok(
            "fio",
            &[
                "--name=zero",
                &format!("--filename={}", mnt.display()),
                "--ioengine=libaio",
                "--direct=1",
                "--rw=randread",
                "--bs=4k",
                "--iodepth=16",
                "--size=16M",
                "--verify=pattern",
                "--verify_pattern=0x00",
                "--verify_only=1",
                "--verify_state_save=0",
            ],
        );
        assert!(!out.contains("verify: bad"), "{out}");
        assert_eq!(std::fs::metadata(&mnt).unwrap().len(), 64 << 20);
    });
}

#[test]
fn truncate_grows_only_when_growable() {
    on_both_transports(|tr| {
        let dir = tmpdir("fuse-grow");
        let img = dir.join("disk.img");
        sparse_image(&img, 1 << 20);
        let (s, mnt) = fuse_stord(
            &dir,
            &file_node(&img, "io_uring"),
            &format!("writable=on,{tr}"),
            &[],
        );
        let m = mnt.display().to_string();
        let out = run("truncate", &["-s", "2M", &m]);
        assert!(!out.status.success(), "grew without growable");
        assert_eq!(std::fs::metadata(&mnt).unwrap().len(), 1 << 20);
        drop(s);
        wait_unmounted(&mnt);

        let (_s, mnt) = fuse_stord(
            &dir,
            &file_node(&img, "io_uring"),
            &format!("writable=on,growable=on,{tr}"),
            &[],
        );
        let m = mnt.display().to_string();
        run_ok("truncate", &["-s", "3M", &m]);
        assert_eq!(std::fs::metadata(&mnt).unwrap().len(), 3 << 20);
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 3 << 20);
        // A write past the end grows a growable export too.
        run_ok(
            "dd",
            &[
                "if=/dev/zero",
                &format!("of={m}"),
                "bs=4096",
                "count=1",
                "seek=1024",
                "conv=notrunc",
            ],
        );
        assert_eq!(std::fs::metadata(&mnt).unwrap().len(), (4 << 20) + 4096);
    });
}

#[test]
fn read_only_export_refuses_writes() {
    on_both_transports(|tr| {
        let dir = tmpdir("fuse-ro");
        let img = dir.join("disk.img");
        std::fs::write(&img, vec![0x5au8; 1 << 20]).unwrap();
        let (_s, mnt) = fuse_stord(
            &dir,
            &file_node(&img, "io_uring"),
            &format!("writable=off,{tr}"),
            &[],
        );
        let e = OpenOptions::new().write(true).open(&mnt).unwrap_err();
        assert!(
            matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EROFS)),
            "{e}"
        );
        let out = run("truncate", &["-s", "0", &mnt.display().to_string()]);
        assert!(!out.status.success());
        // Reads work and see the image.
        let data = std::fs::read(&mnt).unwrap();
        assert_eq!(data.len(), 1 << 20);
        assert!(data.iter().all(|&b| b == 0x5a));
    });
}

fn seek(fd: i32, off: i64, whence: i32) -> Result<i64, i32> {
    // SAFETY: lseek on an fd we own.
    let r = unsafe { libc::lseek(fd, off, whence) };
    if r < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    } else {
        Ok(r)
    }
}

#[test]
fn seek_data_and_hole_agree_with_the_backing_file() {
    on_both_transports(|tr| {
        let dir = tmpdir("fuse-seek");
        let img = dir.join("disk.img");
        sparse_image(&img, 16 << 20);
        // Data at 1 MiB (64 KiB) and at 8 MiB (1 MiB), holes elsewhere.
        run_ok(
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 1 1M 64k",
                "-c",
                "write -P 2 8M 1M",
                &img.display().to_string(),
            ],
        );
        let (_s, mnt) = fuse_stord(
            &dir,
            &file_node(&img, "io_uring"),
            &format!("writable=off,{tr}"),
            &[],
        );
        let a = std::fs::File::open(&img).unwrap();
        let b = std::fs::File::open(&mnt).unwrap();
        let mut checked = 0;
        for off in (0..(16i64 << 20) + 4096).step_by(256 << 10) {
            for whence in [libc::SEEK_DATA, libc::SEEK_HOLE] {
                let x = seek(a.as_raw_fd(), off, whence);
                let y = seek(b.as_raw_fd(), off, whence);
                assert_eq!(x, y, "offset {off} whence {whence}");
                checked += 1;
            }
        }
        assert!(checked > 100);
        assert_eq!(seek(b.as_raw_fd(), 0, libc::SEEK_DATA), Ok(1 << 20));
        assert_eq!(
            seek(b.as_raw_fd(), 1 << 20, libc::SEEK_HOLE),
            Ok((1 << 20) + (64 << 10))
        );
    });
}

#[test]
fn mkfs_ext4_loop_mount_write_fsck() {
    on_both_transports(|tr| {
        let dir = tmpdir("fuse-ext4");
        let img = dir.join("disk.img");
        sparse_image(&img, 128 << 20);
        let (s, mnt) = fuse_stord(
            &dir,
            &file_node(&img, "io_uring"),
            &format!("writable=on,iothread=io0,{tr}"),
            &["io0"],
        );
        let m = mnt.display().to_string();
        run_ok("mkfs.ext4", &["-q", "-F", &m]);
        let loopdev = run_ok("losetup", &["--find", "--show", "--direct-io=on", &m])
            .trim()
            .to_string();
        let fsdir = dir.join("fs");
        std::fs::create_dir_all(&fsdir).unwrap();
        let mounted = run("mount", &[&loopdev, &fsdir.display().to_string()]);
        if !mounted.status.success() {
            run("losetup", &["-d", &loopdev]);
            panic!("mount failed: {}", String::from_utf8_lossy(&mounted.stderr));
        }
        let payload: Vec<u8> = (0..(3u32 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        for i in 0..5 {
            std::fs::write(fsdir.join(format!("file{i}")), &payload).unwrap();
        }
        run_ok("sync", &[]);
        run_ok("umount", &[&fsdir.display().to_string()]);
        run_ok("losetup", &["-d", &loopdev]);
        let fsck = run("fsck.ext4", &["-n", "-f", &m]);
        assert!(
            fsck.status.success(),
            "fsck: {}",
            String::from_utf8_lossy(&fsck.stdout)
        );
        drop(s);
        // The filesystem is in the image itself: loop-mount the image directly and read back.
        let loopdev = run_ok("losetup", &["--find", "--show", &img.display().to_string()])
            .trim()
            .to_string();
        run_ok(
            "mount",
            &["-o", "ro", &loopdev, &fsdir.display().to_string()],
        );
        let back = std::fs::read(fsdir.join("file3"));
        run("umount", &[&fsdir.display().to_string()]);
        run("losetup", &["-d", &loopdev]);
        let back = back.unwrap();
        assert_eq!(back.len(), payload.len());
        let first_diff = back.iter().zip(&payload).position(|(a, b)| a != b);
        assert_eq!(first_diff, None, "file3 differs from what was written");
    });
}

#[test]
fn kill_9_leaves_no_stale_mount() {
    on_both_transports(|tr| {
        let dir = tmpdir("fuse-kill");
        let img = dir.join("disk.img");
        sparse_image(&img, 8 << 20);
        let (mut s, mnt) = fuse_stord(
            &dir,
            &file_node(&img, "threads"),
            &format!("writable=on,{tr}"),
            &[],
        );
        s.kill9();
        let start = Instant::now();
        while is_mounted(&mnt) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "stale mount after kill -9"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // The mountpoint is a plain empty file again.
        assert_eq!(std::fs::metadata(&mnt).unwrap().len(), 0);
    });
}

#[test]
fn sigterm_unmounts_and_several_iothreads_serve() {
    on_both_transports(|tr| {
        let dir = tmpdir("fuse-mq");
        let img = dir.join("disk.img");
        sparse_image(&img, 64 << 20);
        let (mut s, mnt) = fuse_stord(
            &dir,
            &file_node(&img, "io_uring"),
            &format!("writable=on,iothread.0=io0,iothread.1=io1,{tr}"),
            &["io0", "io1"],
        );
        let out = run_ok(
            "fio",
            &[
                "--name=mq",
                &format!("--filename={}", mnt.display()),
                "--ioengine=libaio",
                "--direct=1",
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--numjobs=2",
                "--size=8M",
                "--offset_increment=8M",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_state_save=0",
                "--group_reporting",
            ],
        );
        assert!(
            !out.contains("verify: bad") && out.contains("err= 0"),
            "{out}"
        );
        s.signal(libc::SIGTERM);
        assert!(s.wait_exit(Duration::from_secs(10)).success());
        assert!(!is_mounted(&mnt));
    });
}
