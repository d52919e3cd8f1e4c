//! `block_resize` on file, raw, throttle and qcow2 nodes (the L1 table grows), the same
//! QMP flow against stord and qemu-storage-daemon, and the resize permission an NBD export
//! withholds.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::rawqmp::{monitor_args, RawQmp};
use common::{run, run_ok, tmpdir, Stord};

/// qsd with a QMP monitor on `sock`; killed by the caller.
fn start_qsd(dir: &Path, sock: &Path) -> std::process::Child {
    let pid = dir.join("qsd.pid");
    let mut c = Command::new("qemu-storage-daemon")
        .args(monitor_args(sock))
        .arg("--pidfile")
        .arg(&pid)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !pid.exists() {
        assert!(c.try_wait().unwrap().is_none(), "qsd exited");
        assert!(start.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(10));
    }
    c
}

/// The replies to one flow: add nodes over the images in `dir`, resize each, try a
/// shrink, export one over NBD and try again.
fn flow(q: &mut RawQmp, dir: &Path) -> Vec<String> {
    let f = |n: &str| dir.join(n).display().to_string();
    let mut out = Vec::new();
    let mut send = |q: &mut RawQmp, cmd: String| {
        let r = q.send(&cmd);
        // Error texts differ in places; the class and success are compared.
        let short = match r.get("error") {
            Some(e) => format!("error {}", e["class"]),
            None => "return".to_string(),
        };
        out.push(format!("{cmd} -> {short}"));
        r
    };
    for (node, args) in [
        (
            "q",
            format!(
                r#""driver":"qcow2","file":{{"driver":"file","filename":"{}"}}"#,
                f("a.qcow2")
            ),
        ),
        (
            "r",
            format!(
                r#""driver":"raw","file":{{"driver":"file","filename":"{}"}}"#,
                f("b.raw")
            ),
        ),
        (
            "fl",
            format!(r#""driver":"file","filename":"{}""#, f("c.raw")),
        ),
    ] {
        send(
            q,
            format!(r#"{{"execute":"blockdev-add","arguments":{{"node-name":"{node}",{args}}}}}"#),
        );
    }
    send(
        q,
        r#"{"execute":"object-add","arguments":{"qom-type":"throttle-group","id":"tg"}}"#.into(),
    );
    send(q, r#"{"execute":"blockdev-add","arguments":{"node-name":"t","driver":"throttle","throttle-group":"tg","file":"fl"}}"#.into());
    for (node, size) in [("q", 3u64 << 30), ("r", 48 << 20), ("t", 40 << 20)] {
        send(
            q,
            format!(
                r#"{{"execute":"block_resize","arguments":{{"node-name":"{node}","size":{size}}}}}"#
            ),
        );
    }
    send(
        q,
        r#"{"execute":"block_resize","arguments":{"node-name":"nope","size":1048576}}"#.into(),
    );
    send(
        q,
        r#"{"execute":"block_resize","arguments":{"node-name":"q","size":-1}}"#.into(),
    );
    send(
        q,
        format!(
            r#"{{"execute":"nbd-server-start","arguments":{{"addr":{{"type":"unix","data":{{"path":"{}"}}}}}}}}"#,
            f("n.sock")
        ),
    );
    send(q, r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"e","node-name":"r","writable":true}}"#.into());
    // The export does not share resize: refused while it is there.
    send(
        q,
        r#"{"execute":"block_resize","arguments":{"node-name":"r","size":67108864}}"#.into(),
    );
    send(
        q,
        r#"{"execute":"block-export-del","arguments":{"id":"e"}}"#.into(),
    );
    out
}

fn images(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let f = |n: &str| dir.join(n).display().to_string();
    // 512-byte clusters: the L1 table spans clusters and must move to grow.
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=512",
            &f("a.qcow2"),
            "64M",
        ],
    );
    run_ok("qemu-io", &["-c", "write -P 0x5a 63M 1M", &f("a.qcow2")]);
    run_ok(
        "qemu-img",
        &["create", "-q", "-f", "raw", &f("b.raw"), "32M"],
    );
    run_ok(
        "qemu-img",
        &["create", "-q", "-f", "raw", &f("c.raw"), "32M"],
    );
}

#[test]
fn block_resize_grows_every_node_kind_as_qsd_does() {
    let dir = tmpdir("resize");
    let (ours, theirs) = (dir.join("stord"), dir.join("qsd"));
    images(&ours);
    images(&theirs);
    let sock = ours.join("qmp.sock");
    let s = Stord::start(&ours, &monitor_args(&sock));
    let a = flow(&mut RawQmp::connect(&sock), &ours);
    drop(s);
    let qsock = theirs.join("qmp.sock");
    let mut q = start_qsd(&theirs, &qsock);
    let b = flow(&mut RawQmp::connect(&qsock), &theirs);
    q.kill().unwrap();
    q.wait().unwrap();
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            x.replace(&*ours.display().to_string(), ""),
            y.replace(&*theirs.display().to_string(), "")
        );
    }
    // The files as qsd left them: same sizes, the qcow2 clean, holding its data, and
    // writable past the old end.
    for name in ["a.qcow2", "b.raw", "c.raw"] {
        let info = |d: &Path| {
            let out = run_ok(
                "qemu-img",
                &["info", "--output=json", &d.join(name).display().to_string()],
            );
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            v["virtual-size"].as_u64().unwrap()
        };
        assert_eq!(info(&ours), info(&theirs), "{name}");
    }
    let img = ours.join("a.qcow2").display().to_string();
    let out = run("qemu-img", &["check", &img]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    run_ok(
        "qemu-io",
        &[
            "-c",
            "read -P 0x5a 63M 1M",
            "-c",
            "write -P 0x6b 3071M 1M",
            "-c",
            "read -P 0x6b 3071M 1M",
            &img,
        ],
    );
    run_ok("qemu-img", &["check", &img]);
}
