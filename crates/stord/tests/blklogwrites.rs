//! `blklogwrites` side by side with qsd's: the same requests from qemu-io over NBD give
//! the same log, byte for byte (superblock updates at flushes and every interval, padded
//! unaligned writes, write-zeroes, discards, FUA writes, a second session that appends),
//! and the same image; the options' errors are QEMU's.

mod common;

use std::path::Path;

use common::rawqmp::RawQmp;
use common::side::{start_nodes, words};
use common::{run_ok, tmpdir};

fn p(path: &Path) -> String {
    path.display().to_string()
}

/// The graph: a raw file under blklogwrites (node `b`), its log in a file.
fn nodes(dir: &Path, extra: &str) -> Vec<String> {
    vec![
        format!(
            "driver=file,node-name=f,filename={},discard=unmap",
            p(&dir.join("disk.raw"))
        ),
        format!("driver=file,node-name=l,filename={}", p(&dir.join("log"))),
        format!("driver=blklogwrites,node-name=b,file=f,log=l,discard=unmap{extra}"),
    ]
}

/// One session of `binary`: qemu-io's `cmds` over NBD (writeback, so only `write -f`
/// asks for FUA), then QMP quit.
fn session(binary: &str, dir: &Path, extra: &str, cmds: &[&str]) {
    let n = nodes(dir, extra);
    let refs: Vec<&str> = n.iter().map(String::as_str).collect();
    let (mut d, sock) = start_nodes(binary, dir, &refs).unwrap_or_else(|e| panic!("{binary}: {e}"));
    let uri = format!("nbd+unix:///b?socket={}", p(&sock));
    let mut args = vec!["-f", "raw", "-t", "writeback"];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(&uri);
    run_ok("qemu-io", &args);
    let mut q = RawQmp::connect(&dir.join("qmp.sock"));
    q.send(r#"{"execute":"quit"}"#);
    let st = d.0.wait().unwrap();
    assert!(st.success(), "{binary} exited {st}");
}

const FIRST: &[&str] = &[
    "write -P 1 0 64k",
    "write -f -P 2 64k 4k",
    "write -P 3 1000 100",
    "flush",
    "flush",
    "write -z 128k 64k",
    "discard 0 32k",
    "write -P 4 256k 128k",
    "write -P 5 3584 1024",
    "flush",
    "write -P 6 1m 4k",
    "write -P 7 1m 4k",
    "write -P 8 2m 8k",
];

const SECOND: &[&str] = &["write -P 9 8k 8k", "flush", "write -z 3m 4k", "flush"];

#[test]
fn logs_byte_for_byte_as_qsd() {
    let stord = env!("CARGO_BIN_EXE_stord");
    let mut logs = Vec::new();
    for (i, binary) in ["qemu-storage-daemon", stord].into_iter().enumerate() {
        let dir = tmpdir(&format!("blklogwrites-{i}"));
        std::fs::write(dir.join("disk.raw"), vec![0u8; 4 << 20]).unwrap();
        std::fs::write(dir.join("log"), b"").unwrap();
        session(binary, &dir, ",log-super-update-interval=3", FIRST);
        session(binary, &dir, ",log-append=on", SECOND);
        let log = std::fs::read(dir.join("log")).unwrap();
        let disk = std::fs::read(dir.join("disk.raw")).unwrap();
        logs.push((log, disk));
    }
    let (theirs, ours) = (&logs[0], &logs[1]);
    assert!(
        theirs.0.len() > 64 * 1024,
        "qsd logged {} bytes",
        theirs.0.len()
    );
    assert_eq!(ours.1, theirs.1, "the images differ");
    assert_eq!(ours.0.len(), theirs.0.len(), "the logs' lengths differ");
    let first = ours.0.iter().zip(&theirs.0).position(|(a, b)| a != b);
    assert_eq!(first, None, "the logs differ from byte {first:?}");
}

#[test]
fn option_errors_as_qsd() {
    let dir = tmpdir("blklogwrites-options");
    std::fs::write(dir.join("disk.raw"), vec![0u8; 1 << 20]).unwrap();
    std::fs::write(dir.join("log"), vec![0u8; 4096]).unwrap();
    let stord = env!("CARGO_BIN_EXE_stord");
    for extra in [
        ",log-append=on,log-sector-size=512",
        ",log-sector-size=100",
        ",log-sector-size=16",
        ",log-super-update-interval=0",
        ",log-append=on",
        ",log-append=maybe",
        ",bogus=1",
    ] {
        let n = nodes(&dir, extra);
        let refs: Vec<&str> = n.iter().map(String::as_str).collect();
        let theirs = start_nodes("qemu-storage-daemon", &dir, &refs)
            .err()
            .unwrap_or_else(|| panic!("qsd takes {extra}"));
        let ours = start_nodes(stord, &dir, &refs)
            .err()
            .unwrap_or_else(|| panic!("stord takes {extra}"));
        assert_eq!(words(&ours, &n[2]), words(&theirs, &n[2]), "{extra}");
    }
    // Without a log child.
    let f = nodes(&dir, "");
    let opts = "driver=blklogwrites,node-name=b,file=f";
    let theirs = start_nodes("qemu-storage-daemon", &dir, &[&f[0], opts]).err();
    let ours = start_nodes(stord, &dir, &[&f[0], opts]).err();
    assert_eq!(
        ours.map(|e| words(&e, opts)),
        theirs.map(|e| words(&e, opts))
    );
}
