//! qcow2 images made and checked by QEMU's own tools: stord reads what qemu-img and
//! qemu-io wrote (backing chains, compressed and zero clusters), writes what they read
//! back identically, passes `qemu-img check` after fio and after kill -9, and serves the
//! images qsd's manual serves (NBD with an IoThread, FUSE mounted on the image itself).

mod common;

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::crash::{flushed_writes_then_kill, Rng, BLOCK};
use common::rawqmp::RawQmp;
use common::{fio_write_and_verify, run, run_ok, tmpdir, Stord};

const MIB: u64 = 1 << 20;

/// qemu-io commands run against `target` (`-f raw` for an NBD URI; `raw-ro` opens it
/// read-only).
fn qemu_io(format: &str, target: &str, cmds: &[&str]) -> String {
    let mut args = match format {
        "raw-ro" => vec!["-r", "-f", "raw"],
        f => vec!["-f", f],
    };
    for c in cmds {
        args.push("-c");
        args.push(c);
    }
    args.push(target);
    let out = run_ok("qemu-io", &args);
    assert!(
        !out.contains("Pattern verification failed") && !out.contains("failed:"),
        "qemu-io {cmds:?}: {out}"
    );
    out
}

/// A 64 MiB qcow2 base with data (0xaa in the first MiB, 0xbb at 10 MiB), a compressed
/// cluster (0xcc at 20 MiB) and an overlay naming it, with 4 KiB of 0x11 at 512 KiB.
fn chain(dir: &Path) -> (String, String) {
    let base = dir.join("base.qcow2").display().to_string();
    let top = dir.join("top.qcow2").display().to_string();
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &base, "64M"]);
    qemu_io(
        "qcow2",
        &base,
        &[
            "write -P 0xaa 0 1M",
            "write -P 0xbb 10M 64k",
            "write -c -P 0xcc 20M 64k",
        ],
    );
    run_ok(
        "qemu-img",
        &[
            "create", "-q", "-f", "qcow2", "-b", &base, "-F", "qcow2", &top,
        ],
    );
    qemu_io("qcow2", &top, &["write -P 0x11 512k 4k"]);
    (base, top)
}

fn qcow2_node(image: &str, extra: &str) -> String {
    format!("driver=qcow2,file.driver=file,file.filename={image}{extra}")
}

fn check_clean(image: &str) {
    let out = run("qemu-img", &["check", image]);
    assert!(
        out.status.success(),
        "qemu-img check {image}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn reads_what_qemu_wrote_through_a_backing_chain() {
    let dir = tmpdir("qcow2-read");
    let (_, top) = chain(&dir);
    let s = Stord::with_node(&dir, &qcow2_node(&top, ""), false);
    qemu_io(
        "raw-ro",
        &s.uri(),
        &[
            "read -P 0xaa 0 512k",
            "read -P 0x11 512k 4k",
            "read -P 0xaa 516k 508k",
            "read -P 0xbb 10M 64k",
            "read -P 0xcc 20M 64k",
            "read -P 0 30M 1M",
            "read -P 0 63M 1M",
        ],
    );
    // Every byte, as QEMU itself reads the chain.
    run_ok(
        "qemu-img",
        &["compare", "-U", "-f", "raw", "-F", "qcow2", &s.uri(), &top],
    );
    // Block status: the compressed cluster is data, the unallocated middle a hole.
    let out = run_ok("nbdinfo", &["--map", &s.uri()]);
    assert!(
        out.lines()
            .any(|l| l.contains("20971520") && l.contains("data")),
        "{out}"
    );
    assert!(out.contains("hole,zero"), "{out}");
}

#[test]
fn writes_read_back_as_qemu_io_writes_do() {
    let dir = tmpdir("qcow2-write");
    let (_, top) = chain(&dir);
    let reference = dir.join("ref.qcow2").display().to_string();
    std::fs::copy(&top, &reference).unwrap();
    let cmds = [
        "write -P 0x21 100k 8k",
        "write -P 0x22 20975616 4k",
        "write -P 0x23 40M 3M",
        // New clusters then clusters written above: the first run from the request's
        // buffer plan, the rest in place.
        "write -P 0x26 39M 2M",
        // Whole new clusters with FUA: the request's own buffer, then the metadata flushed.
        "write -f -P 0x27 48M 1M",
        "write -P 0x24 66121728 8k",
        "write -z 200k 300k",
        "write -P 0x25 10485860 1000",
        "write -z 1M 2M",
        "write -z -u 44M 2M",
        "discard 8M 1M",
        "flush",
    ];
    let s = Stord::with_node(&dir, &qcow2_node(&top, ",discard=unmap"), true);
    qemu_io("raw", &s.uri(), &cmds);
    qemu_io("qcow2", &reference, &cmds);
    // Read back through stord first, then by QEMU from the file stord wrote.
    qemu_io(
        "raw",
        &s.uri(),
        &["read -P 0x22 20975616 4k", "read -P 0xcc 20M 4k"],
    );
    drop(s);
    check_clean(&top);
    run_ok("qemu-img", &["compare", &top, &reference]);
}

#[test]
fn fio_verify_onto_an_overlay_then_qemu_img_check() {
    let dir = tmpdir("qcow2-fio");
    let (base, top) = chain(&dir);
    let blockdev = format!(
        "driver=qcow2,file.driver=file,file.filename={top},file.cache.direct=on,file.aio=io_uring"
    );
    let s = Stord::with_node(&dir, &blockdev, true);
    // 4 KiB writes at QD16 into 64 KiB clusters: many land in one cluster at once.
    fio_write_and_verify(&["--ioengine=nbd", &format!("--uri={}", s.uri())], "32M");
    drop(s);
    check_clean(&top);
    check_clean(&base);
    // What QEMU reads from the image stord wrote is what stord serves from it.
    let s = Stord::with_node(&dir, &qcow2_node(&top, ""), false);
    run_ok(
        "qemu-img",
        &["compare", "-U", "-f", "raw", "-F", "qcow2", &s.uri(), &top],
    );
}

#[test]
fn fio_verify_on_tmpfs_where_reads_go_to_the_kernels_workers() {
    // tmpfs reads cannot be tried without blocking, so the io_uring engine hands them to
    // io-wq's workers at once (IOSQE_ASYNC): on that path too, what QEMU wrote reads back
    // and what fio writes verifies, and the image stays clean.
    let dir =
        std::path::PathBuf::from(format!("/dev/shm/stord-qcow2-tmpfs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (_, top) = chain(&dir);
    let reference = dir.join("ref.qcow2").display().to_string();
    std::fs::copy(&top, &reference).unwrap();
    let blockdev = format!(
        "driver=qcow2,file.driver=file,file.filename={top},file.cache.direct=off,file.aio=io_uring"
    );
    let s = Stord::with_node(&dir, &blockdev, true);
    // What QEMU wrote reads back first (reads only), then fio writes and verifies at QD16.
    run_ok(
        "qemu-img",
        &[
            "compare",
            "-U",
            "-f",
            "raw",
            "-F",
            "qcow2",
            &s.uri(),
            &reference,
        ],
    );
    fio_write_and_verify(&["--ioengine=nbd", &format!("--uri={}", s.uri())], "32M");
    drop(s);
    check_clean(&top);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn kill_9_during_allocating_writes_loses_no_flushed_write() {
    const SIZE: u64 = 64 * MIB;
    let dir = tmpdir("qcow2-kill9");
    let base = dir.join("base.raw");
    let top = dir.join("top.qcow2").display().to_string();
    // The backing file's first half is 0x5a: partial-cluster writes copy it.
    std::fs::write(&base, vec![0x5a; (SIZE / 2) as usize]).unwrap();
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            &base.display().to_string(),
            "-F",
            "raw",
            &top,
            &SIZE.to_string(),
        ],
    );
    let mut rng = Rng::from_clock();
    let seed = rng.0;
    // What each written block must hold (a write's id in every word).
    let mut expect: std::collections::HashMap<u64, u64> = Default::default();
    let mut id = 0u64;
    for round in 0..10 {
        let mut s = Stord::with_node(&dir, &qcow2_node(&top, ""), true);
        let (flushed, unflushed) = flushed_writes_then_kill(&mut s, &mut rng, SIZE, &mut id);
        expect.extend(flushed);
        // No corruption; leaks (counted, unreferenced clusters) are allowed and repaired.
        let out = run("qemu-img", &["check", "-r", "leaks", &top]);
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "round {round}: {text}");
        // Every flushed write, as QEMU reads the image.
        let raw = dir.join("dump.raw").display().to_string();
        run_ok("qemu-img", &["convert", "-O", "raw", &top, &raw]);
        let dump = std::fs::File::open(&raw).unwrap();
        let read_id = |off: u64| {
            let mut b = vec![0u8; BLOCK as usize];
            dump.read_exact_at(&mut b, off).unwrap();
            b
        };
        for (&off, &want) in &expect {
            if unflushed.iter().any(|&(o, _)| o == off) {
                continue;
            }
            let b = read_id(off);
            let words: Vec<u64> = b
                .chunks(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                .collect();
            assert!(
                words.iter().all(|&w| w == want),
                "round {round}: block {off:#x} lost flushed write {want} (seed {seed})"
            );
        }
        // An unflushed write either landed whole or not at all... per sector: accept old
        // or new content, and remember what is there now.
        for (off, new) in unflushed {
            let b = read_id(off);
            let old = expect.get(&off).copied();
            for w in b.chunks(8) {
                let w = u64::from_le_bytes(w.try_into().unwrap());
                let old_ok = match old {
                    Some(o) => w == o,
                    None if off < SIZE / 2 => w == 0x5a5a_5a5a_5a5a_5a5a,
                    None => w == 0,
                };
                assert!(
                    w == new || old_ok,
                    "round {round}: block {off:#x} holds {w:#x}"
                );
            }
            expect.remove(&off);
        }
        std::fs::remove_file(&raw).unwrap();
    }
}

#[test]
fn fuse_mounted_on_the_image_itself_shows_the_guest_disk() {
    let dir = tmpdir("qcow2-fuse");
    let (_, top) = chain(&dir);
    // qsd's manual: the image file becomes its own raw view while exported.
    let args: Vec<String> = [
        "--blockdev",
        &format!("node-name=disk,{}", qcow2_node(&top, "")),
        "--export",
        &format!("type=fuse,id=f0,node-name=disk,mountpoint={top},writable=on"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let s = Stord::start(&dir, &args);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&top)
        .unwrap();
    assert_eq!(f.metadata().unwrap().len(), 64 * MIB);
    let mut b = vec![0u8; 4096];
    f.read_exact_at(&mut b, 512 * 1024).unwrap();
    assert!(b.iter().all(|&x| x == 0x11));
    f.read_exact_at(&mut b, 20 * MIB).unwrap();
    assert!(b.iter().all(|&x| x == 0xcc));
    f.write_all_at(&[0x77; 4096], 30 * MIB).unwrap();
    f.sync_all().unwrap();
    drop(f);
    drop(s);
    // Unmounted, the file is the qcow2 image again, holding the write.
    std::thread::sleep(Duration::from_millis(200));
    let mut magic = [0u8; 4];
    std::fs::File::open(&top)
        .unwrap()
        .read_exact(&mut magic)
        .unwrap();
    assert_eq!(&magic, b"QFI\xfb");
    check_clean(&top);
    qemu_io(
        "qcow2",
        &top,
        &["read -P 0x77 30M 4k", "read -P 0x11 512k 4k"],
    );
}

#[test]
fn unsupported_images_are_refused_and_named() {
    let dir = tmpdir("qcow2-refuse");
    let sock = dir.join("qmp.sock");
    let s = Stord::start(&dir, &common::rawqmp::monitor_args(&sock));
    let mut q = RawQmp::connect(&sock);
    let make = |name: &str, opts: &str| {
        let p = dir.join(name).display().to_string();
        run_ok(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "-o", opts, &p, "16M"],
        );
        p
    };
    let add = |q: &mut RawQmp, node: &str, image: &str, ro: bool| {
        q.send(&format!(
            r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"{node}","read-only":{ro},"file":{{"driver":"file","filename":"{image}"}}}}}}"#
        ))
    };
    // An external data file: served, the data file opened from the header's name
    // (qcow2_datafile.rs writes such images).
    let data = dir.join("data.raw").display().to_string();
    let r = add(
        &mut q,
        "datafile",
        &make("datafile.qcow2", &format!("data_file={data}")),
        false,
    );
    assert!(r.get("return").is_some(), "{r}");
    let nodes = q.send(r#"{"execute":"query-named-block-nodes"}"#);
    assert!(
        nodes["return"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["file"] == data.as_str()),
        "{nodes}"
    );
    // Extended L2 entries: served (qcow2_subclusters.rs writes them).
    let r = add(
        &mut q,
        "extl2",
        &make("extl2.qcow2", "extended_l2=on"),
        false,
    );
    assert!(r.get("return").is_some(), "{r}");
    // Internal snapshots: readable and writable (qcow2_matrix.rs writes them).
    let snap = make("snap.qcow2", "compat=1.1");
    run_ok("qemu-img", &["snapshot", "-c", "s1", &snap]);
    let r = add(&mut q, "snap-rw", &snap, false);
    assert!(r.get("return").is_some(), "{r}");
    // A raw file is not a qcow2 image.
    let raw = dir.join("plain.raw");
    std::fs::write(&raw, vec![0u8; 1 << 20]).unwrap();
    let r = add(&mut q, "plain", &raw.display().to_string(), false);
    assert!(
        r["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("not in qcow2 format"),
        "{r}"
    );
    drop(s);
}

#[test]
fn qsd_manual_examples_run_unchanged() {
    let dir = tmpdir("qcow2-manual");
    let (_, top) = chain(&dir);
    let nbd = dir.join("nbd.sock").display().to_string();
    let vhost = dir.join("vhost-user-blk.sock").display().to_string();
    // qemu-storage-daemon(1): "Export a qcow2 image file disk.qcow2 as a vhost-user-blk
    // device over UNIX domain socket", and as an NBD export with an IoThread, together.
    let args: Vec<String> = [
        "--object",
        "iothread,id=iothread0",
        "--blockdev",
        &format!("driver=file,node-name=file,filename={top}"),
        "--blockdev",
        "driver=qcow2,node-name=qcow2,file=file",
        "--export",
        &format!("type=vhost-user-blk,id=export,addr.type=unix,addr.path={vhost},node-name=qcow2,writable=on"),
        "--nbd-server",
        &format!("addr.type=unix,addr.path={nbd}"),
        "--export",
        "type=nbd,id=export2,node-name=qcow2,writable=on,iothread=iothread0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let s = Stord::start(&dir, &args);
    let uri = format!("nbd+unix:///qcow2?socket={nbd}");
    qemu_io(
        "raw",
        &uri,
        &["write -P 0x42 5M 64k", "read -P 0x11 512k 4k"],
    );
    let (capacity, data) = common::blkio_read(Path::new(&vhost), 5 * MIB, 65536);
    assert_eq!(capacity, 64 * MIB);
    assert!(data.iter().all(|&b| b == 0x42));
    let (_, data) = common::blkio_read(Path::new(&vhost), 20 * MIB, 4096);
    assert!(data.iter().all(|&b| b == 0xcc));
    drop(s);
    check_clean(&top);
    qemu_io("qcow2", &top, &["read -P 0x42 5M 64k"]);
}

#[test]
fn allocation_depth_matches_qsd_over_a_backing_chain() {
    let dir = tmpdir("qcow2-depth");
    let (_, top) = chain(&dir);
    qemu_io("qcow2", &top, &["write -z 2M 64k"]);
    let map = |program: &str, sock: &Path, depth: bool| {
        let mut child = std::process::Command::new(program)
            .args([
                "--blockdev",
                &format!("driver=file,node-name=f,filename={top},read-only=on"),
                "--blockdev",
                "driver=qcow2,node-name=q,file=f,read-only=on",
                "--nbd-server",
                &format!("addr.type=unix,addr.path={}", sock.display()),
                "--export",
                &format!(
                    "type=nbd,id=e,node-name=q,name=q,allocation-depth={}",
                    if depth { "on" } else { "off" }
                ),
            ])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        while !sock.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{program} did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let uri = format!("nbd+unix:///q?socket={}", sock.display());
        let out = if depth {
            run_ok("nbdinfo", &["--map=qemu:allocation-depth", &uri])
        } else {
            run_ok("nbdinfo", &["--list", "--content", &uri])
        };
        child.kill().unwrap();
        child.wait().unwrap();
        let _ = std::fs::remove_file(sock);
        out
    };
    let ours = map(env!("CARGO_BIN_EXE_stord"), &dir.join("s.sock"), true);
    let qsd = map("qemu-storage-daemon", &dir.join("q.sock"), true);
    assert_eq!(ours, qsd);
    // Local data, a local zero cluster, the backing file's data two deep, and nothing.
    for want in ["local", "backing depth 2", "absent"] {
        assert!(ours.contains(want), "{ours}");
    }
    // Offered only when asked for, as qsd.
    let listed = map(env!("CARGO_BIN_EXE_stord"), &dir.join("s.sock"), false);
    assert!(listed.contains("base:allocation") && !listed.contains("qemu:allocation-depth"));
}

/// Persistent bitmaps follow a node's life as QEMU's do: marked in use while a node
/// serves the image read-write (`qemu-img info -U` shows it), stored back by blockdev-del
/// with the bits the writes set, and left as they were when a blockdev-add fails after the
/// node went into service (the rollback closes it) or before (nothing was written).
#[test]
fn persistent_bitmaps_follow_blockdev_add_and_del() {
    let dir = tmpdir("qcow2-bitmaps");
    let img = dir.join("b.qcow2").display().to_string();
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &img, "16M"]);
    run_ok("qemu-img", &["bitmap", "--add", &img, "b0"]);
    let in_use = || run_ok("qemu-img", &["info", "-U", &img]).contains("in-use");
    let sock = dir.join("qmp.sock");
    let s = Stord::start(&dir, &common::rawqmp::monitor_args(&sock));
    let mut q = RawQmp::connect(&sock);
    let qcow2 = format!(r#"{{"driver":"qcow2","file":{{"driver":"file","filename":"{img}"}}}}"#);
    // Fails in its own options, before the node serves: nothing written.
    let r = q.send(&format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"b","bogus":1,"file":{{"driver":"file","filename":"{img}"}}}}}}"#
    ));
    assert!(r.get("error").is_some(), "{r}");
    assert!(!in_use());
    // Fails in the parent's options, after the inline qcow2 node served: closed again.
    let r = q.send(&format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"raw","node-name":"r","bogus":1,"file":{qcow2}}}}}"#
    ));
    assert!(r.get("error").is_some(), "{r}");
    assert!(!in_use());
    let r = q.send(&format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"raw","node-name":"r","file":{qcow2}}}}}"#
    ));
    assert!(r.get("return").is_some(), "{r}");
    assert!(in_use());
    let r = q.send(
        r#"{"execute":"block-dirty-bitmap-add","arguments":{"node":"r","name":"x","persistent":true}}"#,
    );
    assert_eq!(
        r["error"]["desc"], "Can't store persistent bitmaps to r: Operation not supported",
        "{r}"
    );
    let r = q.send(r#"{"execute":"blockdev-del","arguments":{"node-name":"r"}}"#);
    assert!(r.get("return").is_some(), "{r}");
    // Stored while stord still runs: not in use, and nothing leaked.
    assert!(!in_use());
    let info = run_ok("qemu-img", &["info", "-U", &img]);
    assert!(info.contains("b0"), "{info}");
    drop(s);
    let out = run("qemu-img", &["check", &img]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("No errors"), "{text}");
}
