//! What every export type shares, through the one `Export` table: ids and resources (a
//! mountpoint, a socket path) held by one export only, IoThreads that cannot be deleted
//! under an export of any type, and removal announced by BLOCK_EXPORT_DELETED.

mod common;

use common::rawqmp::RawQmp;
use common::{tmpdir, Stord};

fn ok(r: &serde_json::Value) {
    assert!(r.get("return").is_some(), "{r}");
}

fn err(r: &serde_json::Value) -> String {
    r["error"]["desc"]
        .as_str()
        .unwrap_or_else(|| panic!("expected an error: {r}"))
        .to_string()
}

#[test]
fn exports_of_every_type_share_ids_resources_and_iothread_rules() {
    let dir = tmpdir("export-lifecycle");
    let mnt = dir.join("mnt");
    std::fs::write(&mnt, b"").unwrap();
    let vsock = dir.join("vhost.sock");
    let qmp = dir.join("qmp.sock");
    let args: Vec<String> = vec![
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", qmp.display()),
        "--monitor".into(),
        "chardev=m".into(),
        "--object".into(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        "driver=null-co,node-name=n,size=64M".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v,node-name=n,addr.type=unix,addr.path={},iothread=io0",
            vsock.display()
        ),
        "--export".into(),
        format!(
            "type=fuse,id=u,node-name=n,mountpoint={},iothread=io0",
            mnt.display()
        ),
    ];
    let mut s = Stord::start(&dir, &args);
    let mut q = RawQmp::connect(&qmp);
    let add = |q: &mut RawQmp, a: String| {
        q.send(&format!(
            r#"{{"execute":"block-export-add","arguments":{a}}}"#
        ))
    };

    // One table: an id is taken whatever the type; a socket path or mountpoint too.
    let e = add(
        &mut q,
        format!(
            r#"{{"type":"fuse","id":"v","node-name":"n","mountpoint":"{}"}}"#,
            dir.join("other").display()
        ),
    );
    assert!(err(&e).contains("'v' is already in use"), "{e}");
    let e = add(
        &mut q,
        format!(
            r#"{{"type":"vhost-user-blk","id":"v2","node-name":"n","addr":{{"type":"unix","path":"{}"}}}}"#,
            vsock.display()
        ),
    );
    assert!(err(&e).contains("already used by another export"), "{e}");
    let e = add(
        &mut q,
        format!(
            r#"{{"type":"fuse","id":"u2","node-name":"n","mountpoint":"{}"}}"#,
            mnt.display()
        ),
    );
    assert!(err(&e).contains("already used by another export"), "{e}");
    let e = add(&mut q, r#"{"type":"nbd","id":"x","node-name":"n"}"#.into());
    assert!(err(&e).contains("NBD server not running"), "{e}");
    let e = add(&mut q, r#"{"type":"ublk","id":"x","node-name":"n"}"#.into());
    assert!(err(&e).contains("nbd, fuse, vhost-user-blk"), "{e}");

    let list = q.send(r#"{"execute":"query-block-exports"}"#);
    let types: Vec<&str> = list["return"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["fuse", "vhost-user-blk"], "{list}");

    // The IoThread serves both: it stays until the last of them is gone.
    let del_io = r#"{"execute":"object-del","arguments":{"id":"io0"}}"#;
    assert!(err(&q.send(del_io)).contains("in use"));
    ok(&q.send(r#"{"execute":"block-export-del","arguments":{"id":"v"}}"#));
    q.wait_event("BLOCK_EXPORT_DELETED", "id", "v");
    assert!(!vsock.exists(), "the vhost-user socket outlived its export");
    assert!(err(&q.send(del_io)).contains("in use"));
    ok(&q.send(r#"{"execute":"block-export-del","arguments":{"id":"u"}}"#));
    q.wait_event("BLOCK_EXPORT_DELETED", "id", "u");
    ok(&q.send(del_io));
    let list = q.send(r#"{"execute":"query-block-exports"}"#);
    assert_eq!(list["return"], serde_json::json!([]));
    drop(q);
    let _ = s.stop_and_stderr();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Names of the daemon's threads.
fn thread_names(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

fn aio_nr() -> u64 {
    std::fs::read_to_string("/proc/sys/fs/aio-nr")
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn an_iothreads_io_engines_go_with_it() {
    let dir = tmpdir("engines-teardown");
    let img = dir.join("disk.img");
    // Data, not a hole: a sparse read would be answered without any I/O.
    std::fs::write(&img, vec![0x5a; 16 << 20]).unwrap();
    let qmp = dir.join("qmp.sock");
    let mut args = common::rawqmp::monitor_args(&qmp);
    args.extend([
        "--object".into(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        format!(
            "driver=file,node-name=t,filename={},aio=threads",
            img.display()
        ),
        "--blockdev".into(),
        format!(
            "driver=file,node-name=a,filename={},aio=native,cache.direct=on",
            img.display()
        ),
        "--nbd-server".into(),
        format!(
            "addr.type=unix,addr.path={}",
            dir.join("nbd.sock").display()
        ),
        "--export".into(),
        "type=nbd,id=et,node-name=t,name=t,iothread=io0".into(),
        "--export".into(),
        "type=nbd,id=ea,node-name=a,name=a,iothread=io0".into(),
    ]);
    let aio_before = aio_nr();
    let mut s = Stord::start(&dir, &args);
    for name in ["t", "a"] {
        let uri = format!(
            "nbd+unix:///{name}?socket={}",
            dir.join("nbd.sock").display()
        );
        common::run_ok("qemu-io", &["-f", "raw", "-r", "-c", "read 0 64k", &uri]);
    }
    let workers = |pid| {
        thread_names(pid)
            .into_iter()
            .filter(|n| n.starts_with("io0-worker"))
            .count()
    };
    assert!(
        workers(s.pid()) > 0,
        "no pool worker of io0: {:?}",
        thread_names(s.pid())
    );
    assert!(aio_nr() > aio_before, "no Linux AIO context was set up");

    let mut q = RawQmp::connect(&qmp);
    for id in ["et", "ea"] {
        ok(&q.send(&format!(
            r#"{{"execute":"block-export-del","arguments":{{"id":"{id}"}}}}"#
        )));
        q.wait_event("BLOCK_EXPORT_DELETED", "id", id);
    }
    ok(&q.send(r#"{"execute":"object-del","arguments":{"id":"io0"}}"#));
    let t = std::time::Instant::now();
    while (workers(s.pid()) > 0 || aio_nr() > aio_before)
        && t.elapsed() < std::time::Duration::from_secs(5)
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(workers(s.pid()), 0, "io0's workers outlived it");
    assert_eq!(aio_nr(), aio_before, "io0's Linux AIO context outlived it");
    drop(q);
    let _ = s.stop_and_stderr();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A hard block-export-del of a vhost-user-blk export with a frontend connected completes
/// (the removal is woken when the frontend's control thread ends) and announces itself.
#[test]
fn hard_delete_of_a_connected_vhost_export_completes() {
    let dir = tmpdir("vhost-hard-del");
    let vsock = dir.join("vhost.sock");
    let qmp = dir.join("qmp.sock");
    let mut args = common::rawqmp::monitor_args(&qmp);
    args.extend([
        "--object".into(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        "driver=null-co,node-name=n,size=64M".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v,node-name=n,addr.type=unix,addr.path={},iothread=io0",
            vsock.display()
        ),
    ]);
    let mut s = Stord::start(&dir, &args);
    let mut b = blkio::Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", &vsock.display().to_string()).unwrap();
    b.set_bool("read-only", true).unwrap();
    b.connect()
        .unwrap_or_else(|e| panic!("connect: {}", e.message()));
    b.set_i32("num-queues", 1).unwrap();
    let _started = b
        .start()
        .unwrap_or_else(|e| panic!("start: {}", e.message()));

    let mut q = RawQmp::connect(&qmp);
    let e = q.send(r#"{"execute":"block-export-del","arguments":{"id":"v"}}"#);
    assert!(err(&e).contains("still in use"), "{e}");
    ok(&q.send(r#"{"execute":"block-export-del","arguments":{"id":"v","mode":"hard"}}"#));
    // RawQmp reads with a 10 s timeout: a removal that is never woken fails here.
    q.wait_event("BLOCK_EXPORT_DELETED", "id", "v");
    let list = q.send(r#"{"execute":"query-block-exports"}"#);
    assert_eq!(list["return"], serde_json::json!([]));
    drop(q);
    drop(b);
    let _ = s.stop_and_stderr();
    let _ = std::fs::remove_dir_all(&dir);
}
