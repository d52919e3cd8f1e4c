//! QEMU's image locking both ways with real tools (qemu-io, qemu-img, qemu-storage-daemon
//! and a second stord), and the generic node options qsd users pass (Proxmox's command
//! lines: detect-zeroes, cache.*, discard, force-share) accepted with their effect.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::rawqmp::{monitor_args, RawQmp};
use common::{run, run_ok, tmpdir, Stord};

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout)
}

fn qcow2(dir: &Path, name: &str) -> String {
    let p = dir.join(name).display().to_string();
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &p, "64M"]);
    p
}

/// stord with `blockdevs` and nothing else; the error text if it exits.
fn stord_fails(dir: &Path, blockdevs: &[String]) -> String {
    let mut args = Vec::new();
    for b in blockdevs {
        args.push("--blockdev".to_string());
        args.push(b.clone());
    }
    args.push("--pidfile".into());
    args.push(dir.join("second.pid").display().to_string());
    let out = Command::new(env!("CARGO_BIN_EXE_stord"))
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "second stord started: {}",
        stderr_of(&out)
    );
    stderr_of(&out)
}

/// qemu-storage-daemon with `args`, started once its pidfile exists.
fn qsd(dir: &Path, args: &[String]) -> Child {
    let pid = dir.join("qsd.pid");
    let _ = std::fs::remove_file(&pid);
    let mut c = Command::new("qemu-storage-daemon")
        .args(args)
        .arg("--pidfile")
        .arg(&pid)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !pid.exists() {
        assert!(c.try_wait().unwrap().is_none(), "qsd exited");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "qsd did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    c
}

#[test]
fn an_image_stord_serves_is_locked_against_qemu_and_a_second_daemon() {
    let dir = tmpdir("lock-held");
    let img = qcow2(&dir, "a.qcow2");
    let node = format!("driver=qcow2,file.driver=file,file.filename={img}");
    let s = Stord::with_node(&dir, &node, true);
    // QEMU's writers are refused with QEMU's own message.
    let out = run("qemu-io", &["-c", "write 0 4k", &img]);
    assert!(!out.status.success());
    assert!(
        stderr_of(&out).contains("Failed to get \"write\" lock"),
        "{}",
        stderr_of(&out)
    );
    // A reader that does not share writes is refused; with -U (force-share) it reads.
    let out = run("qemu-img", &["info", &img]);
    assert!(!out.status.success());
    assert!(stderr_of(&out).contains("Failed to get shared \"write\" lock"));
    let info = run_ok("qemu-img", &["info", "-U", &img]);
    assert!(info.contains("file format: qcow2"), "{info}");
    // qsd refuses it as it refuses another qsd's image.
    let out = Command::new("qemu-storage-daemon")
        .args([
            "--blockdev",
            &format!("driver=file,node-name=f,filename={img}"),
            "--blockdev",
            "driver=qcow2,node-name=q,file=f",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr_of(&out).contains("Failed to get \"write\" lock"));
    // A second stord, writable or read-only, the same; read-only with force-share works.
    let e = stord_fails(
        &dir,
        &[node.replace("driver=qcow2", "node-name=d,driver=qcow2")],
    );
    assert!(
        e.contains("Failed to get \"write\" lock") && e.contains(&img),
        "{e}"
    );
    let ro = format!("node-name=d,driver=qcow2,read-only=on,file.driver=file,file.filename={img}");
    let e = stord_fails(&dir, std::slice::from_ref(&ro));
    assert!(e.contains("Failed to get shared \"write\" lock"), "{e}");
    let dir2 = dir.join("second");
    std::fs::create_dir_all(&dir2).unwrap();
    let shared = Stord::with_node(
        &dir2,
        &format!("driver=qcow2,read-only=on,force-share=on,file.driver=file,file.filename={img}"),
        false,
    );
    drop(shared);
    // Two file nodes on one image inside one stord see each other as well.
    drop(s);
    let e = stord_fails(
        &dir,
        &[
            format!("node-name=a,driver=qcow2,file.driver=file,file.filename={img}"),
            format!("node-name=b,driver=qcow2,file.driver=file,file.filename={img}"),
        ],
    );
    assert!(
        e.contains("--blockdev node-name=b") && e.contains("lock"),
        "{e}"
    );
    // Once stord has gone, QEMU writes again.
    run_ok("qemu-io", &["-c", "write 0 4k", &img]);
}

#[test]
fn an_image_qemu_holds_is_refused_by_stord_unless_locking_is_off() {
    let dir = tmpdir("lock-qsd");
    let img = qcow2(&dir, "a.qcow2");
    let mut q = qsd(
        &dir,
        &[
            "--blockdev".into(),
            format!("driver=file,node-name=f,filename={img}"),
            "--blockdev".into(),
            "driver=qcow2,node-name=q,file=f".into(),
        ],
    );
    let e = stord_fails(
        &dir,
        &[format!(
            "node-name=d,driver=qcow2,file.driver=file,file.filename={img}"
        )],
    );
    assert!(e.contains("Failed to get \"write\" lock"), "{e}");
    // Over QMP: blockdev-add fails with an error object, the daemon serves on.
    let sock = dir.join("qmp.sock");
    let s = Stord::start(&dir, &monitor_args(&sock));
    let mut m = RawQmp::connect(&sock);
    let r = m.send(&format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"d","file":{{"driver":"file","filename":"{img}"}}}}}}"#
    ));
    assert_eq!(r["error"]["class"], "GenericError", "{r}");
    assert!(
        r["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("Failed to get \"write\" lock"),
        "{r}"
    );
    // The failed add left nothing behind: the inline file node is gone too.
    let nodes = m.send(r#"{"execute":"query-named-block-nodes"}"#);
    assert_eq!(nodes["return"].as_array().unwrap().len(), 0, "{nodes}");
    // locking=off lets it through (the user's choice, as in QEMU).
    let r = m.send(&format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"d","read-only":true,"file":{{"driver":"file","filename":"{img}","locking":"off"}}}}}}"#
    ));
    assert!(r.get("return").is_some(), "{r}");
    drop(s);
    q.kill().unwrap();
    q.wait().unwrap();
}

/// A raw node passes its users' permissions through to the file, as QEMU's: a writable
/// NBD export lets other writers in but forbids resizing under it.
#[test]
fn raw_passes_its_exports_permissions_to_the_file() {
    let dir = tmpdir("lock-raw");
    let img = dir.join("a.raw").display().to_string();
    run_ok("qemu-img", &["create", "-q", "-f", "raw", &img, "16M"]);
    let s = Stord::with_node(
        &dir,
        &format!("driver=raw,file.driver=file,file.filename={img}"),
        true,
    );
    run_ok("qemu-io", &["-f", "raw", "-c", "write -P 0x11 0 4k", &img]);
    let out = run("qemu-img", &["resize", "-f", "raw", &img, "32M"]);
    assert!(!out.status.success());
    assert!(
        stderr_of(&out).contains("\"resize\" lock"),
        "{}",
        stderr_of(&out)
    );
    drop(s);
    run_ok("qemu-img", &["resize", "-f", "raw", &img, "32M"]);
}

/// Proxmox-style node options: accepted on every node, with their effect.
#[test]
fn generic_node_options_are_accepted_with_their_effect() {
    let dir = tmpdir("node-opts");
    let img = qcow2(&dir, "a.qcow2");
    run_ok("qemu-io", &["-c", "write -P 0x33 0 1M", &img]);
    // detect-zeroes=unmap with discard=unmap: a write of zeroes leaves no data behind.
    let node = format!(
        "driver=throttle,throttle-group=tg,discard=unmap,detect-zeroes=unmap,cache.direct=off,\
         cache.no-flush=off,file.driver=qcow2,file.discard=unmap,file.detect-zeroes=unmap,\
         file.cache.direct=on,file.cache.no-flush=off,file.file.driver=file,\
         file.file.filename={img},file.file.aio=io_uring"
    );
    let sock = dir.join("nbd.sock");
    let args: Vec<String> = [
        "--object",
        "throttle-group,id=tg,x-iops-total=100000",
        "--blockdev",
        &format!("node-name=disk,{node}"),
        "--blockdev",
        "node-name=nul,driver=null-co,size=1M,read-only=on,force-share=on,discard=ignore,detect-zeroes=on,cache.direct=on,cache.no-flush=on",
        "--nbd-server",
        &format!("addr.type=unix,addr.path={}", sock.display()),
        "--export",
        "type=nbd,id=e,node-name=disk,name=disk,writable=on,writethrough=on",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let s = Stord::start(&dir, &args);
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    run_ok(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0 0 512k", "-c", "flush", &uri],
    );
    drop(s);
    // QEMU sees the first half as zero clusters, not data.
    let map = run_ok("qemu-img", &["map", "--output=json", &img]);
    let v: serde_json::Value = serde_json::from_str(&map).unwrap();
    let first = &v[0];
    assert_eq!(first["start"], 0, "{map}");
    assert_eq!(first["zero"], true, "{map}");
    assert!(first["length"].as_u64().unwrap() >= 512 * 1024, "{map}");
    run_ok(
        "qemu-io",
        &[
            "-c",
            "read -P 0 0 512k",
            "-c",
            "read -P 0x33 512k 512k",
            &img,
        ],
    );
    run_ok("qemu-img", &["check", &img]);
    // The rules QEMU enforces, with its words.
    let e = stord_fails(&dir, &["node-name=n,driver=null-co,force-share=on".into()]);
    assert!(
        e.contains("force-share=on can only be used with read-only images"),
        "{e}"
    );
    let e = stord_fails(
        &dir,
        &["node-name=n,driver=null-co,detect-zeroes=unmap".into()],
    );
    assert!(
        e.contains("setting detect-zeroes to unmap is not allowed"),
        "{e}"
    );
}

/// blockdev-reopen to read-only gives the write lock back (QEMU's reopen does), and back to
/// writable takes it again, refused while another process holds the image.
#[test]
fn reopen_read_only_gives_the_write_lock_back() {
    let dir = tmpdir("lock-reopen");
    let img = qcow2(&dir, "a.qcow2");
    let sock = dir.join("qmp.sock");
    let s = Stord::start(&dir, &monitor_args(&sock));
    let mut m = RawQmp::connect(&sock);
    let r = m.send(&format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"d","file":{{"driver":"file","filename":"{img}"}}}}}}"#
    ));
    assert!(r.get("return").is_some(), "{r}");
    assert!(!run("qemu-img", &["info", &img]).status.success());
    let reopen = |m: &mut RawQmp, ro: bool| {
        m.send(&format!(
            r#"{{"execute":"blockdev-reopen","arguments":{{"options":[{{"driver":"qcow2","node-name":"d","read-only":{ro},"file":{{"driver":"file","filename":"{img}"}}}}]}}}}"#
        ))
    };
    let r = reopen(&mut m, true);
    assert!(r.get("return").is_some(), "{r}");
    // Read-only now: readers that do not share writes get in.
    run_ok("qemu-img", &["info", &img]);
    // Writable again while a QEMU reader holds the image unshared: refused.
    let mut reader = Command::new("qemu-io")
        .args(["-r", "-c", "sleep 3000", &img])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let r = reopen(&mut m, false);
    assert!(
        r["error"]["desc"]
            .as_str()
            .unwrap_or_default()
            .contains("lock"),
        "{r}"
    );
    reader.wait().unwrap();
    let r = reopen(&mut m, false);
    assert!(r.get("return").is_some(), "{r}");
    assert!(!run("qemu-img", &["info", &img]).status.success());
    drop(s);
}

/// A `blockdev-add` that fails after it has opened inline children (the parent's own
/// option is bad, or the backing chain fails deep inside) takes every node it opened out
/// again: no `#block` node stays, and neither the image nor its backing file stays locked.
#[test]
fn a_refused_blockdev_add_leaves_no_node_and_no_lock() {
    let dir = tmpdir("lock-rollback");
    let base = qcow2(&dir, "base.qcow2");
    let top = dir.join("top.qcow2").display().to_string();
    run_ok(
        "qemu-img",
        &[
            "create", "-q", "-f", "qcow2", "-b", &base, "-F", "qcow2", &top,
        ],
    );
    let sock = dir.join("qmp.sock");
    let s = Stord::start(&dir, &monitor_args(&sock));
    let mut m = RawQmp::connect(&sock);
    let add = |m: &mut RawQmp, extra: &str, backing_extra: &str| {
        m.send(&format!(
            r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"top",
                "file":{{"driver":"file","filename":"{top}"}},
                "backing":{{"driver":"qcow2","file":{{"driver":"file","filename":"{base}"}}{backing_extra}}}{extra}}}}}"#
        ).replace('\n', " "))
    };
    // The top node's own option is bad: its file, the backing node and the backing's file
    // were all open (and locked) by then.
    let r = add(&mut m, r#","bogus":1"#, "");
    assert!(
        r["error"]["desc"].as_str().unwrap().contains("bogus"),
        "{r}"
    );
    // A failure two levels down: the backing's own option is bad.
    let r = add(&mut m, "", r#","l2-cache-size":"x""#);
    assert!(r.get("error").is_some(), "{r}");
    let nodes = m.send(r#"{"execute":"query-named-block-nodes"}"#);
    assert_eq!(nodes["return"], serde_json::json!([]), "{nodes}");
    // Nothing holds either image: QEMU writes both.
    run_ok("qemu-io", &["-c", "write 0 4k", &top]);
    run_ok("qemu-io", &["-c", "write 0 4k", &base]);
    // And the same graph opens whole, with the names it would have had.
    let r = add(&mut m, "", "");
    assert!(r.get("return").is_some(), "{r}");
    let nodes = m.send(r#"{"execute":"query-named-block-nodes"}"#);
    assert_eq!(nodes["return"].as_array().unwrap().len(), 4, "{nodes}");
    assert!(!run("qemu-io", &["-c", "write 0 4k", &top]).status.success());
    drop(s);
}
