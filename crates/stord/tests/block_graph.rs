//! The block graph: a `raw` format node over a `file` protocol node, named or inline, on
//! the command line, in JSON and over QMP; served by every export; and the rules that keep
//! a graph whole (a child in use cannot be removed; inline children go with their parent).

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::rawqmp::RawQmp;
use common::{blkio_read, run, run_ok, sparse_image, tmpdir, Stord};

const MIB: u64 = 1 << 20;

/// A 16 MiB image whose window [1 MiB, 5 MiB) holds 0x11 and the MiB after it 0x22.
fn patterned_image(path: &Path) {
    sparse_image(path, 16 * MIB);
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![0x11; 4 * MIB as usize], MIB).unwrap();
    f.write_all_at(&vec![0x22; MIB as usize], 5 * MIB).unwrap();
}

fn qmp_args(dir: &Path) -> Vec<String> {
    vec![
        "--chardev".into(),
        format!(
            "socket,id=m,path={},server=on,wait=off",
            dir.join("qmp.sock").display()
        ),
        "--monitor".into(),
        "chardev=m".into(),
    ]
}

/// The virtual size qemu-img sees through NBD.
fn nbd_size(uri: &str) -> u64 {
    let out = run_ok("qemu-img", &["info", "--output=json", uri]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["virtual-size"].as_u64().unwrap()
}

#[test]
fn a_raw_window_over_a_file_is_served_over_nbd_fuse_and_vhost_user_blk() {
    let dir = tmpdir("graph-window");
    let img = dir.join("disk.img");
    patterned_image(&img);
    let mnt = dir.join("mnt");
    std::fs::write(&mnt, b"").unwrap();
    let vsock = dir.join("vhost.sock");
    let mut args = qmp_args(&dir);
    args.extend([
        "--object".into(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        format!(
            "driver=file,node-name=f,filename={},aio=io_uring,cache.direct=on",
            img.display()
        ),
        "--blockdev".into(),
        "driver=raw,node-name=r,file=f,offset=1M,size=4M".into(),
        "--nbd-server".into(),
        format!(
            "addr.type=unix,addr.path={}",
            dir.join("nbd.sock").display()
        ),
        "--export".into(),
        "type=nbd,id=n,node-name=r,name=disk,writable=on,iothread=io0".into(),
        "--export".into(),
        format!("type=fuse,id=u,node-name=r,mountpoint={}", mnt.display()),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=v,node-name=r,addr.type=unix,addr.path={},iothread=io0",
            vsock.display()
        ),
    ]);
    let mut s = Stord::start(&dir, &args);
    let uri = s.uri();

    // NBD: the window's size and data; a write lands 1 MiB into the file; past the
    // window's end is an error, not the file's next bytes.
    assert_eq!(nbd_size(&uri), 4 * MIB);
    run_ok("qemu-io", &["-f", "raw", "-c", "read -P 0x11 0 4M", &uri]);
    run_ok("qemu-io", &["-f", "raw", "-c", "write -P 0xab 0 64k", &uri]);
    let out = run("qemu-io", &["-f", "raw", "-c", "read 4M 4k", &uri]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        !text.contains("read 4096/4096"),
        "read past the window succeeded: {text}"
    );
    let mut at = vec![0u8; 65536];
    std::fs::File::open(&img)
        .unwrap()
        .read_exact_at(&mut at, MIB)
        .unwrap();
    assert!(
        at.iter().all(|&b| b == 0xab),
        "the write did not land at offset 1 MiB"
    );

    // FUSE: a 4 MiB file holding the window.
    assert_eq!(std::fs::metadata(&mnt).unwrap().len(), 4 * MIB);
    let data = std::fs::read(&mnt).unwrap();
    assert!(data[..65536].iter().all(|&b| b == 0xab));
    assert!(
        data[65536..].iter().all(|&b| b == 0x11),
        "FUSE shows bytes outside the window"
    );

    // vhost-user-blk through libblkio: the capacity and the window's last block.
    let (capacity, last) = blkio_read(&vsock, 4 * MIB - 4096, 4096);
    assert_eq!(capacity, 4 * MIB);
    assert!(last.iter().all(|&b| b == 0x11));

    // The graph in query-named-block-nodes, and the child refused removal.
    let mut q = RawQmp::connect(&dir.join("qmp.sock"));
    let nodes = q.send(r#"{"execute":"query-named-block-nodes"}"#);
    let r = nodes["return"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node-name"] == "r")
        .unwrap_or_else(|| panic!("no node r in {nodes}"));
    assert_eq!(r["drv"], "raw");
    assert_eq!(r["image"]["virtual-size"], 4 * MIB);
    assert!(r["file"].as_str().unwrap().starts_with("json:"), "{r}");
    let e = q.send(r#"{"execute":"blockdev-del","arguments":{"node-name":"f"}}"#);
    let desc = e["error"]["desc"].as_str().unwrap_or_else(|| panic!("{e}"));
    assert!(desc.contains("in use") && desc.contains("'r'"), "{desc}");
    drop(q);
    let _ = s.stop_and_stderr();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inline_children_on_the_command_line_in_json_and_over_qmp() {
    let dir = tmpdir("graph-inline");
    let img = dir.join("disk.img");
    patterned_image(&img);
    let mut args = qmp_args(&dir);
    args.extend([
        "--blockdev".into(),
        format!(
            "driver=raw,node-name=disk,offset=1M,file.driver=file,file.filename={},file.aio=threads",
            img.display()
        ),
        "--blockdev".into(),
        format!(
            r#"{{"driver":"raw","node-name":"j","file":{{"driver":"file","filename":"{}"}}}}"#,
            img.display()
        ),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", dir.join("nbd.sock").display()),
        "--export".into(),
        "type=nbd,id=e,node-name=disk,name=disk".into(),
    ]);
    let mut s = Stord::start(&dir, &args);
    assert_eq!(nbd_size(&s.uri()), 15 * MIB);
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-r",
            "-c",
            "read -P 0x11 0 4M",
            "-c",
            "read -P 0x22 4M 1M",
            &s.uri(),
        ],
    );

    let mut q = RawQmp::connect(&dir.join("qmp.sock"));
    let names = |q: &mut RawQmp| -> Vec<String> {
        let r = q.send(r#"{"execute":"query-named-block-nodes"}"#);
        let mut v: Vec<String> = r["return"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["node-name"].as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&mut q), ["#block000", "#block001", "disk", "j"]);
    // An inline child belongs to its parent.
    let e = q.send(r##"{"execute":"blockdev-del","arguments":{"node-name":"#block001"}}"##);
    assert!(
        e["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("not owned by the monitor"),
        "{e}"
    );

    // QMP: a named child, then an inline one; a bad window or child is refused and
    // leaves nothing behind.
    let add = |q: &mut RawQmp, args: String| {
        q.send(&format!(
            r#"{{"execute":"blockdev-add","arguments":{args}}}"#
        ))
    };
    let r = add(
        &mut q,
        r#"{"driver":"null-co","node-name":"z","size":1048576}"#.into(),
    );
    assert!(r.get("return").is_some(), "{r}");
    let r = add(
        &mut q,
        r#"{"driver":"raw","node-name":"zr","file":"z","size":4096}"#.into(),
    );
    assert!(r.get("return").is_some(), "{r}");
    let r = add(
        &mut q,
        r#"{"driver":"raw","node-name":"bad","file":"nope"}"#.into(),
    );
    assert!(r["error"]["desc"].as_str().unwrap().contains("nope"), "{r}");
    let r = add(
        &mut q,
        format!(
            r#"{{"driver":"raw","node-name":"bad","size":1000,"file":{{"driver":"file","filename":"{}"}}}}"#,
            img.display()
        ),
    );
    assert!(
        r["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("multiple of 512"),
        "{r}"
    );
    assert_eq!(
        names(&mut q),
        ["#block000", "#block001", "disk", "j", "z", "zr"]
    );

    // Removing a parent removes its inline child; a named child stays, free to go.
    let r = q.send(r#"{"execute":"blockdev-del","arguments":{"node-name":"j"}}"#);
    assert!(r.get("return").is_some(), "{r}");
    let r = q.send(r#"{"execute":"blockdev-del","arguments":{"node-name":"z"}}"#);
    assert!(r["error"]["desc"].as_str().unwrap().contains("'zr'"), "{r}");
    let r = q.send(r#"{"execute":"blockdev-del","arguments":{"node-name":"zr"}}"#);
    assert!(r.get("return").is_some(), "{r}");
    let r = q.send(r#"{"execute":"blockdev-del","arguments":{"node-name":"z"}}"#);
    assert!(r.get("return").is_some(), "{r}");
    assert_eq!(names(&mut q), ["#block000", "disk"]);
    drop(q);
    let _ = s.stop_and_stderr();
    let _ = std::fs::remove_dir_all(&dir);
}
