//! The `preallocate` filter side by side with qsd's, under a qcow2 image: while the daemon
//! serves writes, the image file stands `prealloc-size` past the data, aligned to
//! `prealloc-align`, as in qsd; once the daemon quits it is cut back to the data, and the
//! image is clean and reads as qsd's does; a bad alignment is refused in QEMU's words.

mod common;

use std::path::Path;

use common::rawqmp::RawQmp;
use common::side::{start_nodes, words};
use common::{run_ok, tmpdir};

fn p(path: &Path) -> String {
    path.display().to_string()
}

fn len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

const STEP: u64 = 4 << 20;
const ALIGN: u64 = 64 << 10;

fn nodes(img: &Path, extra: &str) -> Vec<String> {
    vec![
        format!("driver=file,node-name=f,filename={}", p(img)),
        format!("driver=preallocate,node-name=pre,file=f{extra}"),
        "driver=qcow2,node-name=b,file=pre".into(),
    ]
}

#[test]
fn grows_ahead_and_cuts_back_as_qsd() {
    let stord = env!("CARGO_BIN_EXE_stord");
    let mut images = Vec::new();
    for (i, binary) in ["qemu-storage-daemon", stord].into_iter().enumerate() {
        let dir = tmpdir(&format!("prealloc-{i}"));
        let img = dir.join("disk.qcow2");
        run_ok(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", &p(&img), "64M"],
        );
        let created = len(&img);
        let n = nodes(
            &img,
            &format!(",prealloc-size={STEP},prealloc-align={ALIGN}"),
        );
        let refs: Vec<&str> = n.iter().map(String::as_str).collect();
        let (mut d, sock) = start_nodes(binary, &dir, &refs).unwrap_or_else(|e| panic!("{e}"));
        let uri = format!("nbd+unix:///b?socket={}", p(&sock));
        let cmds = ["write -P 1 0 1m", "write -P 2 8m 256k", "flush"];
        let mut args = vec!["-f", "raw"];
        for c in cmds {
            args.extend(["-c", c]);
        }
        args.push(&uri);
        run_ok("qemu-io", &args);
        let serving = len(&img);
        assert!(
            serving > created + STEP && serving.is_multiple_of(ALIGN),
            "{binary}: the file is {serving} bytes while serving (created {created})"
        );
        let mut q = RawQmp::connect(&dir.join("qmp.sock"));
        q.send(r#"{"execute":"quit"}"#);
        d.0.wait().unwrap();
        let closed = len(&img);
        assert!(
            closed < serving && closed + STEP > serving,
            "{binary}: {closed} bytes after quit, {serving} while serving"
        );
        run_ok("qemu-img", &["check", "-q", &p(&img)]);
        images.push((img, dir));
    }
    run_ok(
        "qemu-img",
        &["compare", "-q", &p(&images[0].0), &p(&images[1].0)],
    );
}

#[test]
fn option_errors_as_qsd() {
    let dir = tmpdir("prealloc-options");
    let img = dir.join("disk.raw");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let stord = env!("CARGO_BIN_EXE_stord");
    for extra in [",prealloc-align=1000", ",bogus=1"] {
        let n = nodes(&img, extra);
        let refs: Vec<&str> = n[..2].iter().map(String::as_str).collect();
        let theirs = start_nodes("qemu-storage-daemon", &dir, &refs)
            .err()
            .expect("qsd refuses");
        let ours = start_nodes(stord, &dir, &refs)
            .err()
            .expect("stord refuses");
        assert_eq!(words(&ours, &n[1]), words(&theirs, &n[1]), "{extra}");
    }
}
