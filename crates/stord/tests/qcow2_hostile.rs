//! Hostile qcow2 images: metadata that points into other metadata must never make stord
//! write guest data over the image's own tables. Either the image is refused read-write
//! at open, or the write fails with EIO and the image is marked corrupt, as QEMU does.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::{run, run_ok, tmpdir, Stord};

fn be64(f: &std::fs::File, off: u64) -> u64 {
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, off).unwrap();
    u64::from_be_bytes(b)
}

fn put64(f: &std::fs::File, off: u64, v: u64) {
    f.write_all_at(&v.to_be_bytes(), off).unwrap();
}

const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COPIED: u64 = 1 << 63;
const CORRUPT_BIT: u64 = 1 << 1;

/// A 64 MiB image (64 KiB clusters) with data at guest 0 and 1 MiB.
fn image(dir: &Path) -> String {
    let img = dir.join("h.qcow2").display().to_string();
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &img, "64M"]);
    run_ok(
        "qemu-io",
        &[
            "-c",
            "write -P 0x11 0 64k",
            "-c",
            "write -P 0x22 1M 64k",
            &img,
        ],
    );
    img
}

fn open(img: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .unwrap()
}

/// qemu-io through stord: the output, and whether every command succeeded.
fn write_through_stord(dir: &Path, img: &str, cmds: &[&str]) -> (String, bool) {
    let s = Stord::with_node(
        dir,
        &format!("driver=qcow2,file.driver=file,file.filename={img}"),
        true,
    );
    let mut args = vec!["-f".to_string(), "raw".into()];
    for c in cmds {
        args.push("-c".into());
        args.push(c.to_string());
    }
    args.push(s.uri());
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("qemu-io", &a);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let ok = out.status.success() && !text.contains("failed");
    drop(s);
    (text, ok)
}

fn snapshot(f: &std::fs::File, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, off).unwrap();
    b
}

#[test]
fn zeroed_refcounts_do_not_let_guest_data_over_the_header() {
    let dir = tmpdir("hostile-refcounts");
    let img = image(&dir);
    let f = open(&img);
    let reftable = be64(&f, 48);
    let block = be64(&f, reftable) & OFFSET_MASK;
    f.write_all_at(&vec![0u8; 65536], block).unwrap();
    let header = snapshot(&f, 0, 104);
    let (out, ok) = write_through_stord(&dir, &img, &["write -P 0x33 8M 64k", "flush"]);
    assert!(!ok, "the allocating write succeeded: {out}");
    // The header is what it was, but for the corrupt bit QEMU's check sets too.
    let now = snapshot(&f, 0, 104);
    assert_eq!(&now[..72], &header[..72]);
    assert_ne!(be64(&f, 72) & CORRUPT_BIT, 0, "image not marked corrupt");
    assert_eq!(&now[80..], &header[80..]);
    // QEMU refuses to write the image now, and reads the old data.
    let out = run("qemu-io", &["-c", "write 0 4k", &img]);
    assert!(!out.status.success());
    run_ok("qemu-io", &["-r", "-c", "read -P 0x11 0 64k", &img]);
}

#[test]
fn an_l2_entry_pointing_at_the_l1_table_gets_eio_not_a_write() {
    let dir = tmpdir("hostile-l2");
    let img = image(&dir);
    let f = open(&img);
    let l1 = be64(&f, 40);
    let l2 = be64(&f, l1) & OFFSET_MASK;
    put64(&f, l2, l1 | COPIED);
    let before = snapshot(&f, l1, 512);
    let (out, ok) = write_through_stord(&dir, &img, &["write -P 0x44 0 4k", "flush"]);
    assert!(!ok, "the write went through: {out}");
    assert_eq!(
        snapshot(&f, l1, 512),
        before,
        "the L1 table was overwritten"
    );
}

#[test]
fn tables_that_overlap_are_refused_read_write() {
    let dir = tmpdir("hostile-overlap");
    for case in ["l1-into-l1", "reftable-on-l1", "refblock-on-l1"] {
        let img = image(&dir);
        let f = open(&img);
        let l1 = be64(&f, 40);
        let reftable = be64(&f, 48);
        match case {
            "l1-into-l1" => put64(&f, l1, l1 | COPIED),
            "reftable-on-l1" => put64(&f, 48, l1),
            _ => put64(&f, reftable, l1),
        }
        let sock = dir.join("qmp.sock");
        let s = Stord::start(&dir, &common::rawqmp::monitor_args(&sock));
        let mut q = common::rawqmp::RawQmp::connect(&sock);
        let add = |q: &mut common::rawqmp::RawQmp, ro: bool| {
            q.send(&format!(
                r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"n{ro}","read-only":{ro},"file":{{"driver":"file","filename":"{img}"}}}}}}"#
            ))
        };
        let r = add(&mut q, false);
        let desc = r["error"]["desc"].as_str().unwrap_or_default().to_string();
        assert!(desc.contains("corrupt"), "{case}: {r}");
        drop(s);
        std::fs::remove_file(&img).unwrap();
    }
}

/// An L2 entry pointing at the refcount table: discarding that guest cluster must not free
/// (and punch) the table (the qcow2_image fuzz target found the header zeroed this way).
#[test]
fn a_data_cluster_on_the_refcount_table_is_never_freed() {
    let dir = tmpdir("hostile-free");
    let img = image(&dir);
    let f = open(&img);
    let l1 = be64(&f, 40);
    let reftable = be64(&f, 48);
    let l2 = be64(&f, l1) & OFFSET_MASK;
    put64(&f, l2, reftable | COPIED);
    let before = snapshot(&f, reftable, 512);
    let s = Stord::with_node(
        &dir,
        &format!(
            "driver=qcow2,discard=unmap,file.driver=file,file.filename={img},file.discard=unmap"
        ),
        true,
    );
    let out = run(
        "qemu-io",
        &["-f", "raw", "-c", "discard 0 64k", "-c", "flush", &s.uri()],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("failed"), "{text}");
    drop(s);
    assert_eq!(
        snapshot(&f, reftable, 512),
        before,
        "the refcount table was freed"
    );
    assert_ne!(be64(&f, 72) & CORRUPT_BIT, 0, "image not marked corrupt");
}
