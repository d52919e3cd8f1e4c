//! The `compress` filter side by side with qsd's: the same qemu-io requests over NBD leave
//! the same clusters compressed (`qemu-img map`), the same contents (`qemu-img compare`)
//! and a clean image; a write into a cluster that has data fails in both; a child that
//! cannot compress is refused in QEMU's words.

mod common;

use std::path::Path;

use common::rawqmp::RawQmp;
use common::side::{start_nodes, words};
use common::{run, run_ok, tmpdir};

fn p(path: &Path) -> String {
    path.display().to_string()
}

/// qemu-io's answer to each of `cmds` over `sock`: whether it failed.
fn each_fails(sock: &Path, cmds: &[&str]) -> Vec<bool> {
    let uri = format!("nbd+unix:///b?socket={}", p(sock));
    cmds.iter()
        .map(|c| {
            let o = run("qemu-io", &["-f", "raw", "-t", "writeback", "-c", c, &uri]);
            let out = String::from_utf8_lossy(&o.stdout).to_string()
                + &String::from_utf8_lossy(&o.stderr);
            out.contains("failed")
        })
        .collect()
}

/// `qemu-img map` as (start, length, data, zero, compressed) runs.
fn compressed_map(img: &Path) -> Vec<(u64, u64, bool, bool, bool)> {
    let out = run_ok(
        "qemu-img",
        &["map", "--output=json", "-f", "qcow2", &p(img)],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["data"] == true,
                e["zero"] == true,
                e["compressed"] == true,
            )
        })
        .collect()
}

const CMDS: &[&str] = &[
    "write -P 1 0 64k",
    "write -P 2 200k 4k",
    "write -P 3 0 4k",
    "write -z 1m 64k",
    "write -P 4 2m 192k",
    "discard 2m 64k",
    "read -P 4 2112k 128k",
    "read -P 2 200k 4k",
];

#[test]
fn compresses_as_qsd() {
    let stord = env!("CARGO_BIN_EXE_stord");
    let mut seen = Vec::new();
    for (i, binary) in ["qemu-storage-daemon", stord].into_iter().enumerate() {
        let dir = tmpdir(&format!("compress-{i}"));
        let img = dir.join("disk.qcow2");
        run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &p(&img), "4M"]);
        let f = format!("driver=file,node-name=f,filename={}", p(&img));
        let nodes = [
            f.as_str(),
            "driver=qcow2,node-name=q,file=f,discard=unmap",
            "driver=compress,node-name=b,file=q",
        ];
        let (mut d, sock) = start_nodes(binary, &dir, &nodes).unwrap();
        let fails = each_fails(&sock, CMDS);
        let mut q = RawQmp::connect(&dir.join("qmp.sock"));
        q.send(r#"{"execute":"quit"}"#);
        d.0.wait().unwrap();
        run_ok("qemu-img", &["check", "-q", "-f", "qcow2", &p(&img)]);
        seen.push((fails, compressed_map(&img), img, dir));
    }
    let (theirs, ours) = (&seen[0], &seen[1]);
    assert_eq!(ours.0, theirs.0, "which requests failed: stord, then qsd");
    assert!(
        theirs.0[2],
        "a write into a compressed cluster succeeded in qsd"
    );
    assert!(
        !theirs.0[1] && !theirs.0[7],
        "qsd failed a padded write: {:?}",
        theirs.0
    );
    assert_eq!(ours.1, theirs.1, "the maps: stord, then qsd");
    assert!(
        ours.1.iter().any(|r| r.4),
        "nothing compressed: {:?}",
        ours.1
    );
    run_ok("qemu-img", &["compare", "-q", &p(&ours.2), &p(&theirs.2)]);
}

#[test]
fn refuses_a_child_that_cannot_compress_as_qsd() {
    let dir = tmpdir("compress-raw");
    let img = dir.join("disk.raw");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let f = format!("driver=file,node-name=f,filename={}", p(&img));
    let stord = env!("CARGO_BIN_EXE_stord");
    for child in [
        "driver=raw,node-name=q,file=f",
        "driver=null-co,node-name=q",
    ] {
        let opts = "driver=compress,node-name=b,file=q";
        let nodes = [f.as_str(), child, opts];
        let theirs = start_nodes("qemu-storage-daemon", &dir, &nodes)
            .err()
            .expect("qsd refuses");
        let ours = start_nodes(stord, &dir, &nodes)
            .err()
            .expect("stord refuses");
        assert_eq!(words(&ours, opts), words(&theirs, opts), "{child}");
    }
}
