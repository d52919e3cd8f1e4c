//! The vhost-user-blk export with a real guest: QEMU (TCG) boots Debian's kernel with a
//! busybox initramfs (scripts/build-guest.sh) and a vhost-user-blk-pci disk on our socket.
//! The guest runs a script from tests/guest/ and prints `GUEST-*` lines on its serial
//! console; the host checks them and the image. The same tests run against
//! qemu-storage-daemon, to show they are fair.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use common::rawqmp::{monitor_args, RawQmp};
use common::{run_ok, tmpdir, Stord};

/// One guest at a time: TCG keeps a core busy, and the machine has two.
static SERIAL: Mutex<()> = Mutex::new(());
static BUILD: Once = Once::new();

/// Builds the guest kernel + initramfs (once per test binary).
fn build_guest() {
    BUILD.call_once(|| common::guest::build(&[]));
}

/// Boots the guest against `sock` with `queues` queues, runs tests/guest/`script`.sh, and
/// returns its console output.
fn boot(sock: &Path, queues: u16, script: &str) -> String {
    boot_with(sock, queues, script, |_| {})
}

/// As [`boot`], calling `on_line` with each console line as it comes (so the host can act
/// when the guest says it is ready).
fn boot_with(sock: &Path, queues: u16, script: &str, on_line: impl FnMut(&str)) -> String {
    build_guest();
    let machine: Vec<String> = [
        "-machine",
        "q35,memory-backend=mem",
        "-smp",
        "2",
        "-m",
        "256",
        "-object",
        "memory-backend-memfd,id=mem,size=256M,share=on",
        "-chardev",
        &format!("socket,id=c,path={}", sock.display()),
        "-device",
        &format!("vhost-user-blk-pci,chardev=c,num-queues={queues}"),
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    common::guest::boot(
        &machine,
        "initrd",
        &format!("stord.script={script}"),
        Duration::from_secs(240),
        on_line,
    )
}

/// The value of the guest's `GUEST-<key> value` line.
fn field<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    let tag = format!("GUEST-{key} ");
    out.lines()
        .filter_map(|l| l.find(&tag).map(|i| l[i + tag.len()..].trim()))
        .next()
}

fn passed(out: &str) -> bool {
    out.contains("GUEST-PASS")
}

/// A 64 MiB image full of data (so a discard shows as freed blocks).
fn filled_image(dir: &Path) -> PathBuf {
    let img = dir.join("disk.img");
    let mut f = std::fs::File::create(&img).unwrap();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut chunk = vec![0u8; 1 << 20];
    for _ in 0..64 {
        for b in chunk.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_le_bytes());
        }
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
    img
}

fn sha256_of_range(img: &Path, skip_64k: u64, count_64k: u64) -> String {
    let out = run_ok(
        "sh",
        &[
            "-c",
            &format!(
                "dd if={} bs=64k skip={skip_64k} count={count_64k} 2>/dev/null | sha256sum",
                img.display()
            ),
        ],
    );
    out.split_whitespace().next().unwrap().to_string()
}

fn allocated(img: &Path) -> u64 {
    std::fs::metadata(img).unwrap().blocks() * 512
}

enum Peer {
    Stord(Stord),
    Qsd(Child),
}

/// Starts stord or qsd exporting `img` at `sock`. `export_extra` goes on the --export.
fn start_peer(
    qsd: bool,
    dir: &Path,
    img: &Path,
    sock: &Path,
    export_extra: &str,
    iothreads: usize,
) -> Peer {
    let mut args = Vec::new();
    for i in 0..iothreads {
        args.push("--object".to_string());
        args.push(format!("iothread,id=io{i}"));
    }
    args.push("--blockdev".into());
    args.push(format!(
        "file,node-name=disk,filename={},cache.direct=on,aio=io_uring,discard=unmap",
        img.display()
    ));
    args.push("--export".into());
    args.push(format!(
        "vhost-user-blk,id=vu0,node-name=disk,addr.type=unix,addr.path={}{export_extra}",
        sock.display()
    ));
    args.extend(monitor_args(&dir.join("qmp.sock")));
    if qsd {
        let child = Command::new("qemu-storage-daemon")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn qemu-storage-daemon");
        let start = Instant::now();
        while !sock.exists() || !dir.join("qmp.sock").exists() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "qsd did not listen"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Peer::Qsd(child)
    } else {
        Peer::Stord(Stord::start(dir, &args))
    }
}

impl Peer {
    /// Requests served per queue of export vu0 (stord's query-block-exports); empty for qsd.
    fn queue_requests(&self) -> Vec<u64> {
        let Peer::Stord(s) = self else {
            return Vec::new();
        };
        RawQmp::connect(&s.dir.join("qmp.sock")).queue_requests("vu0")
    }

    /// Stops the daemon; returns stord's stderr (empty for qsd).
    fn stop(self) -> String {
        match self {
            Peer::Stord(mut s) => s.stop_and_stderr(),
            Peer::Qsd(mut c) => {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
                let _ = c.wait();
                String::new()
            }
        }
    }
}

/// The guest runs tests/guest/resize.sh: when it says it is waiting, the host grows the
/// 64 MiB disk to 96 MiB with `block_resize`; the guest must see the new capacity (the
/// device told its frontend, which told the guest) and write and read past the old end.
fn resize(qsd: bool) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let who = if qsd { "qsd" } else { "stord" };
    let dir = tmpdir(&format!("vub-resize-{who}"));
    let img = filled_image(&dir);
    let sock = dir.join("vhost.sock");
    let peer = start_peer(qsd, &dir, &img, &sock, ",writable=on", 0);
    let mut resized = None;
    let out = boot_with(&sock, 1, "resize", |line| {
        if line.contains("GUEST-RESIZE-NOW") && resized.is_none() {
            let mut q = RawQmp::connect(&dir.join("qmp.sock"));
            resized = Some(q.send(
                r#"{"execute":"block_resize","arguments":{"node-name":"disk","size":100663296}}"#,
            ));
        }
    });
    let stderr = peer.stop();
    assert_eq!(
        resized.as_ref().map(|r| r.get("return").is_some()),
        Some(true),
        "{who}: block_resize: {resized:?}\n{out}"
    );
    assert!(passed(&out), "{who}: guest failed:\n{out}\n{stderr}");
    assert_eq!(field(&out, "SECTORS"), Some("131072"));
    assert_eq!(field(&out, "SECTORS-AFTER"), Some("196608"), "{who}");
    let wrote = field(&out, "WROTE").expect("WROTE");
    assert_eq!(field(&out, "READ"), Some(wrote), "{who}: read back differs");
    // Written at 80 MiB, past the old end.
    assert_eq!(
        sha256_of_range(&img, 1280, 16),
        wrote,
        "{who}: not in the image"
    );
}

#[test]
fn guest_sees_block_resize() {
    resize(false);
}

#[test]
fn qsd_passes_the_same_resize_test() {
    resize(true);
}

/// The read-write scenario: pattern written with O_DIRECT and read back in the guest, the
/// same bytes in the host image, every queue used, discard frees blocks in the image.
/// Returns the guest's output and the requests served per queue (stord only).
fn read_write(qsd: bool, queues: u16, iothreads: usize, extra: &str) -> (String, Vec<u64>) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let who = if qsd { "qsd" } else { "stord" };
    let dir = tmpdir(&format!("vub-rw-{who}-{queues}"));
    let img = filled_image(&dir);
    let sock = dir.join("vhost.sock");
    let mut export = format!(",writable=on,num-queues={queues}{extra}");
    if qsd && iothreads > 0 {
        // qsd 10.0 takes one iothread per export (lists arrived in 10.1).
        export.push_str(",iothread=io0");
    } else {
        for i in 0..iothreads {
            export.push_str(&format!(",iothread.{i}=io{i}"));
        }
    }
    let peer = start_peer(qsd, &dir, &img, &sock, &export, iothreads);
    let before = allocated(&img);
    let out = boot(&sock, queues, "rw");
    let per_queue = peer.queue_requests();
    let stderr = peer.stop();
    assert!(passed(&out), "{who}: guest failed:\n{out}\n{stderr}");
    let wrote = field(&out, "WROTE").expect("WROTE");
    assert_eq!(field(&out, "READ"), Some(wrote), "{who}: read back differs");
    assert_eq!(
        sha256_of_range(&img, 16, 64),
        wrote,
        "{who}: the host image does not hold what the guest wrote"
    );
    assert_eq!(field(&out, "QUEUES"), Some(queues.to_string().as_str()));
    assert_eq!(field(&out, "SECTORS"), Some("131072"));
    // The guest discards 8 MiB. The host filesystem may spend a block or so of the freed
    // space on its own extent tree once the hole splits the file's extents (seen once
    // with qsd: 4 KiB short), so a few blocks less still show the discard went through.
    let freed = before.saturating_sub(allocated(&img));
    assert!(
        freed >= (8 << 20) - (64 << 10),
        "{who}: discard freed only {freed} bytes of the image"
    );
    (out, per_queue)
}

#[test]
fn guest_reads_and_writes_through_one_queue_on_the_main_loop() {
    let (out, per_queue) = read_write(false, 1, 0, ",logical-block-size=4096");
    assert_eq!(field(&out, "LBS"), Some("4096"));
    assert_eq!(per_queue.len(), 1);
    assert!(per_queue[0] > 100, "{per_queue:?}");
}

#[test]
fn guest_uses_both_queues_on_two_iothreads() {
    let (_, per_queue) = read_write(false, 2, 2, "");
    assert_eq!(per_queue.len(), 2);
    assert!(
        per_queue.iter().all(|&n| n > 100),
        "a queue was idle: {per_queue:?}"
    );
}

#[test]
fn qsd_passes_the_same_read_write_test() {
    read_write(true, 2, 2, "");
}

fn read_only(qsd: bool) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let who = if qsd { "qsd" } else { "stord" };
    let dir = tmpdir(&format!("vub-ro-{who}"));
    let img = filled_image(&dir);
    let sock = dir.join("vhost.sock");
    let want = sha256_of_range(&img, 16, 64);
    let peer = start_peer(qsd, &dir, &img, &sock, ",writable=off", 1);
    let out = boot(&sock, 1, "ro");
    let stderr = peer.stop();
    assert!(passed(&out), "{who}: guest failed:\n{out}\n{stderr}");
    assert_eq!(field(&out, "RO"), Some("1"));
    assert_eq!(field(&out, "WRITE"), Some("refused"));
    assert_eq!(field(&out, "READ"), Some(want.as_str()));
    assert_eq!(sha256_of_range(&img, 16, 64), want, "{who}: image changed");
}

#[test]
fn read_only_export_is_read_only_in_the_guest() {
    read_only(false);
}

#[test]
fn qsd_passes_the_same_read_only_test() {
    read_only(true);
}

#[test]
fn a_bad_vhost_user_message_closes_only_that_connection() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tmpdir("vub-bad");
    let img = filled_image(&dir);
    let sock = dir.join("vhost.sock");
    let peer = start_peer(false, &dir, &img, &sock, ",writable=on", 1);
    // A header with an unknown request code and a body size beyond the protocol's limit.
    let mut c = UnixStream::connect(&sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut msg = Vec::new();
    msg.extend_from_slice(&0xdead_u32.to_le_bytes());
    msg.extend_from_slice(&1u32.to_le_bytes());
    msg.extend_from_slice(&0x7fff_ffff_u32.to_le_bytes());
    c.write_all(&msg).unwrap();
    let mut b = [0u8; 16];
    let n = c.read(&mut b).unwrap_or(0);
    assert_eq!(
        n, 0,
        "the daemon should close a connection that breaks the protocol"
    );
    drop(c);
    // The export still serves a real guest afterwards.
    let out = boot(&sock, 1, "ro");
    let stderr = peer.stop();
    assert!(
        out.contains("GUEST-RO 0"),
        "guest did not see the disk:\n{out}\n{stderr}"
    );
    assert!(
        stderr.contains("vhost-user-blk vu0: closing the connection"),
        "no log line for the bad message:\n{stderr}"
    );
}

/// A guest on an encrypted qcow2 image (`encrypt.format=luks`, as libvirt's
/// `<encryption format='luks'>` makes them): tests/guest/rw.sh's pattern written and read
/// back in the guest, then the image, decrypted by QEMU, holds it, and `qemu-img check`
/// finds it clean.
fn encrypted(qsd: bool) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let who = if qsd { "qsd" } else { "stord" };
    let dir = tmpdir(&format!("vub-luks-{who}"));
    let secret = "secret,id=sec0,data=guest-pass";
    let img = dir.join("disk.qcow2").display().to_string();
    let o = "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10";
    run_ok(
        "qemu-img",
        &[
            "create", "-q", "--object", secret, "-f", "qcow2", "-o", o, &img, "64M",
        ],
    );
    let sock = dir.join("vhost.sock");
    let mut args: Vec<String> = vec!["--object".into(), secret.into()];
    args.push("--blockdev".into());
    args.push(format!(
        "qcow2,node-name=disk,discard=unmap,encrypt.format=luks,encrypt.key-secret=sec0,\
         file.driver=file,file.filename={img},file.discard=unmap"
    ));
    args.push("--export".into());
    args.push(format!(
        "vhost-user-blk,id=vu0,node-name=disk,writable=on,addr.type=unix,addr.path={}",
        sock.display()
    ));
    args.extend(monitor_args(&dir.join("qmp.sock")));
    let peer = if qsd {
        let child = Command::new("qemu-storage-daemon")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn qemu-storage-daemon");
        let start = Instant::now();
        while !sock.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "qsd did not listen"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Peer::Qsd(child)
    } else {
        Peer::Stord(Stord::start(&dir, &args))
    };
    let out = boot(&sock, 1, "rw");
    let stderr = peer.stop();
    assert!(passed(&out), "{who}: guest failed:\n{out}\n{stderr}");
    let wrote = field(&out, "WROTE").expect("WROTE");
    assert_eq!(field(&out, "READ"), Some(wrote), "{who}: read back differs");
    let plain = dir.join("plain.raw");
    let opts = format!("driver=qcow2,encrypt.key-secret=sec0,file.filename={img}");
    run_ok(
        "qemu-img",
        &[
            "convert",
            "--object",
            secret,
            "--image-opts",
            &opts,
            "-O",
            "raw",
            &plain.display().to_string(),
        ],
    );
    assert_eq!(
        sha256_of_range(&plain, 16, 64),
        wrote,
        "{who}: the image, decrypted by QEMU, does not hold what the guest wrote"
    );
    run_ok(
        "qemu-img",
        &["check", "--object", secret, "--image-opts", &opts],
    );
    // Nothing the guest wrote lies in the file in the clear.
    let raw = std::fs::read(&img).unwrap();
    let pattern = std::fs::read(&plain).unwrap()[16 << 16..(16 << 16) + 4096].to_vec();
    assert!(
        !raw.windows(4096)
            .step_by(512)
            .any(|w| w == pattern.as_slice()),
        "{who}: the guest's data is in the image unencrypted"
    );
}

#[test]
fn guest_reads_and_writes_an_encrypted_qcow2() {
    encrypted(false);
}

#[test]
fn qsd_passes_the_same_encrypted_qcow2_test() {
    encrypted(true);
}
