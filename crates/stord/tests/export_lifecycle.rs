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
