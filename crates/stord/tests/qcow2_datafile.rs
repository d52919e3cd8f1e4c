//! qcow2 images whose guest data lives in an external data file (`qemu-img create -f qcow2
//! -o data_file=disk.raw[,data_file_raw=on] disk.qcow2`, libvirt's `<dataStore>`), side by
//! side with QEMU: the same qemu-io operations through a stord NBD export and through
//! QEMU's own driver on a copy (both files copied), with the data file given as a node,
//! inline and by the image's header; then `qemu-img check` clean, `qemu-img compare`
//! equal, the maps alike and the data files byte for byte the same (a raw one reads as the
//! disk by itself). Also, each against qemu-storage-daemon: block status and allocation
//! depth, persistent dirty bitmaps, QEMU's refusals, `blockdev-create`, `block_resize`,
//! the permissions the data file is taken with; and the jobs over such images.

mod common;

use std::path::Path;

use common::rawqmp::{monitor_args, RawQmp};
use common::{run, run_ok, tmpdir, Stord};

const QSD: &str = "qemu-storage-daemon";

fn stord_bin() -> &'static str {
    env!("CARGO_BIN_EXE_stord")
}

/// qemu-io commands on `target`; fails the test on any error qemu-io prints.
fn qemu_io(args: &[&str], cmds: &[&str], target: &str) -> String {
    let mut a: Vec<&str> = args.to_vec();
    for c in cmds {
        a.push("-c");
        a.push(c);
    }
    a.push(target);
    let out = run_ok("qemu-io", &a);
    assert!(
        !out.contains("Pattern verification failed") && !out.contains("failed:"),
        "qemu-io {cmds:?} on {target}: {out}"
    );
    out
}

fn check_clean(image: &str) {
    let out = run("qemu-img", &["check", image]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qemu-img check {image}: {text}");
    assert!(text.contains("No errors"), "qemu-img check {image}: {text}");
    assert!(!text.contains("leaked"), "qemu-img check {image}: {text}");
}

/// `qemu-img map --output=json`, neighbours of one kind merged. Offsets are dropped, and
/// so is the zero flag of data runs: QEMU sets it where it finds a hole in the data file
/// of an image it guesses to be metadata-preallocated, a guess made from how sparse the
/// image file is, which differs between a copy and its original.
fn map(image: &str) -> Vec<serde_json::Value> {
    let out = run_ok("qemu-img", &["map", "-U", "--output=json", image]);
    let v: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let mut merged: Vec<serde_json::Value> = Vec::new();
    for mut e in v {
        let o = e.as_object_mut().unwrap();
        o.remove("offset");
        if o["data"] == true {
            o.remove("zero");
        }
        let kind = |e: &serde_json::Value| {
            let mut k = e.clone();
            let o = k.as_object_mut().unwrap();
            o.remove("start");
            o.remove("length");
            k
        };
        match merged.last_mut() {
            Some(last)
                if kind(last) == kind(&e)
                    && last["start"].as_u64().unwrap() + last["length"].as_u64().unwrap()
                        == e["start"].as_u64().unwrap() =>
            {
                let len = last["length"].as_u64().unwrap() + e["length"].as_u64().unwrap();
                last["length"] = len.into();
            }
            _ => merged.push(e),
        }
    }
    merged
}

/// `qemu-img info --output=json` of `image`, its format-specific data.
fn info(image: &str) -> serde_json::Value {
    let out = run_ok("qemu-img", &["info", "-U", "--output=json", image]);
    serde_json::from_str(&out).unwrap()
}

fn path(dir: &Path, name: &str) -> String {
    dir.join(name).display().to_string()
}

/// A 64 MiB image `name`.qcow2 in `dir` whose data file is `name`.raw (its absolute path
/// in the header), raw or not: both paths.
fn make(dir: &Path, name: &str, raw: bool) -> (String, String) {
    let (img, data) = (
        path(dir, &format!("{name}.qcow2")),
        path(dir, &format!("{name}.raw")),
    );
    let opts = format!(
        "data_file={data},data_file_raw={}",
        if raw { "on" } else { "off" }
    );
    run_ok(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "-o", &opts, &img, "64M"],
    );
    (img, data)
}

/// A copy of `image` and its data file named `name`.qcow2 / `name`.raw, the copy's
/// header naming its own data file: both paths.
fn copy(dir: &Path, (img, data): (&str, &str), name: &str) -> (String, String) {
    let (c_img, c_data) = (
        path(dir, &format!("{name}.qcow2")),
        path(dir, &format!("{name}.raw")),
    );
    std::fs::copy(img, &c_img).unwrap();
    std::fs::copy(data, &c_data).unwrap();
    let opts = format!("data_file={c_data}");
    run_ok("qemu-img", &["amend", "-f", "qcow2", "-o", &opts, &c_img]);
    (c_img, c_data)
}

/// What the guest does: a write at offset 0 (the data file's first cluster), partial
/// clusters, whole ones together, zeroes kept and unmapped, a write into a zero cluster,
/// discards, a partial zero write, the last MiB.
const GUEST_OPS: &[&str] = &[
    "write -P 0x11 0 64k",
    "write -P 0x12 100k 8k",
    "write -P 0x13 1020k 200k",
    "write -z 2M 192k",
    "write -z -u 3M 128k",
    "write -P 0x14 3080k 4k",
    "discard 0 64k",
    "write -P 0x15 4M 2M",
    "discard 4M 128k",
    "write -z 5M 3k",
    "write -P 0x16 2112k 1k",
    "write -P 0x17 63M 1M",
];

fn assert_same_bytes(a: &str, b: &str) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(x.len(), y.len(), "{a} and {b} differ in size");
    if let Some(i) = (0..x.len()).find(|&i| x[i] != y[i]) {
        panic!("{a} and {b} differ at byte {i}");
    }
}

/// The guest's writes through stord (the data file given `how`: by its node, inline, or
/// by the header) and through QEMU on a copy, for images with and without
/// data-file-raw: the same images and data files.
#[test]
fn guest_writes_land_as_qemu_puts_them() {
    for (raw, how) in [
        (false, "header"),
        (true, "header"),
        (false, "node"),
        (true, "inline"),
    ] {
        let dir = tmpdir(&format!("datafile-writes-{raw}-{how}"));
        let (img, data) = make(&dir, "disk", raw);
        let (r_img, r_data) = copy(&dir, (&img, &data), "ref");
        qemu_io(&["-f", "qcow2", "-d", "unmap"], GUEST_OPS, &r_img);
        let qcow2 = format!(
            "driver=qcow2,node-name=disk,discard=unmap,file.driver=file,file.filename={img}"
        );
        let mut blockdevs = Vec::new();
        match how {
            "node" => {
                blockdevs.push(format!(
                    "driver=file,node-name=df,filename={data},discard=unmap"
                ));
                blockdevs.push(format!("{qcow2},data-file=df"));
            }
            "inline" => blockdevs.push(format!(
                "{qcow2},data-file.driver=file,data-file.filename={data}"
            )),
            _ => blockdevs.push(qcow2),
        }
        let sock = dir.join("nbd.sock");
        let mut args = Vec::new();
        for b in blockdevs {
            args.extend(["--blockdev".to_string(), b]);
        }
        args.extend([
            "--nbd-server".to_string(),
            format!("addr.type=unix,addr.path={}", sock.display()),
            "--export".into(),
            "type=nbd,id=e,node-name=disk,name=disk,writable=on".into(),
        ]);
        let mut s = Stord::start(&dir, &args);
        qemu_io(&["-f", "raw"], GUEST_OPS, &s.uri());
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
                &r_img,
            ],
        );
        s.stop_and_stderr();
        check_clean(&img);
        check_clean(&r_img);
        run_ok("qemu-img", &["compare", &img, &r_img]);
        assert_same_bytes(&data, &r_data);
        assert_eq!(map(&img), map(&r_img), "{how}, raw {raw}");
        let d = &info(&img)["format-specific"]["data"];
        assert_eq!(
            (&d["data-file"], &d["data-file-raw"]),
            (&data.as_str().into(), &raw.into())
        );
        if raw {
            // The data file alone reads as the disk.
            run_ok(
                "qemu-img",
                &["compare", "-f", "raw", "-F", "qcow2", &data, &img],
            );
        }
    }
}

/// A daemon killed when dropped (a failing test leaves none behind).
struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `program` (stord or qemu-storage-daemon) in `dir` (its working directory) with
/// a QMP monitor and an NBD server there: the daemon and the QMP connection.
fn daemon(program: &str, dir: &Path) -> (Daemon, RawQmp) {
    let qmp = dir.join("qmp.sock");
    let nbd = dir.join("nbd.sock");
    for p in [&qmp, &nbd] {
        let _ = std::fs::remove_file(p);
    }
    let mut args = monitor_args(&qmp);
    args.extend([
        "--nbd-server".to_string(),
        format!("addr.type=unix,addr.path={}", nbd.display()),
    ]);
    let child = std::process::Command::new(program)
        .args(&args)
        .current_dir(dir)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The socket is there once bound, and takes connections once listening.
    let start = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&qmp).is_err() {
        assert!(start.elapsed().as_secs() < 10, "{program} did not start");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    (Daemon(child), RawQmp::connect(&qmp))
}

/// Sends `cmd` and asserts it returned.
fn ok(q: &mut RawQmp, cmd: &str) -> serde_json::Value {
    let r = q.send(cmd);
    assert!(r.get("return").is_some(), "{cmd}: {r}");
    r["return"].clone()
}

/// Sends `cmd` and returns its error's text (or "ok").
fn error_of(q: &mut RawQmp, cmd: &str) -> String {
    let r = q.send(cmd);
    match r["error"]["desc"].as_str() {
        Some(e) => e.to_string(),
        None => "ok".into(),
    }
}

fn add_qcow2(name: &str, image: &str, extra: &str) -> String {
    format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"{name}","file":{{"driver":"file","filename":"{image}"}}{extra}}}}}"#
    )
}

fn del(name: &str) -> String {
    format!(r#"{{"execute":"blockdev-del","arguments":{{"node-name":"{name}"}}}}"#)
}

/// Block status and allocation depth over NBD: stord and qemu-storage-daemon, each
/// exporting the same images read-only (their data files opened from the header), tell
/// them extent for extent; for a raw data file made by qemu-img, QEMU's guess that the
/// image is metadata-preallocated has block status ask the data file, which stord does too.
#[test]
fn block_status_and_allocation_depth_as_qsd() {
    for raw in [false, true] {
        let dir = tmpdir(&format!("datafile-status-{raw}"));
        let (img, _) = make(&dir, "disk", raw);
        qemu_io(&["-f", "qcow2", "-d", "unmap"], GUEST_OPS, &img);
        let maps = |program: &str| -> (String, String) {
            let (_d, mut q) = daemon(program, &dir);
            ok(
                &mut q,
                &format!(
                    r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"q","read-only":true,"file":{{"driver":"file","filename":"{img}"}}}}}}"#
                ),
            );
            ok(
                &mut q,
                r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"e","node-name":"q","name":"q","allocation-depth":true}}"#,
            );
            let uri = format!("nbd+unix:///q?socket={}", dir.join("nbd.sock").display());
            (
                run_ok("nbdinfo", &["--map", &uri]),
                run_ok("nbdinfo", &["--map=qemu:allocation-depth", &uri]),
            )
        };
        let (status, depth) = maps(stord_bin());
        let (qsd_status, qsd_depth) = maps(QSD);
        assert_eq!(status, qsd_status, "raw {raw}");
        assert_eq!(depth, qsd_depth, "raw {raw}");
        assert!(
            status.contains("data") && status.contains("zero"),
            "{status}"
        );
        assert!(depth.contains("local"), "{depth}");
    }
}

/// A persistent dirty bitmap on an image with a data file, through stord and through
/// qemu-storage-daemon: it lives in the image file, is stored when the node goes with the
/// bits the writes set, and is offered over NBD the same by both afterwards.
#[test]
fn persistent_bitmaps_on_a_data_file_image_as_qsd_keeps_them() {
    let dir = tmpdir("datafile-bitmaps");
    let flow = |program: &str, raw: bool| -> String {
        let (img, data) = make(&dir, "bm", raw);
        let data_len = std::fs::metadata(&data).unwrap().len();
        let (_d, mut q) = daemon(program, &dir);
        let add = add_qcow2("d", &img, "");
        ok(&mut q, &add);
        ok(
            &mut q,
            r#"{"execute":"block-dirty-bitmap-add","arguments":{"node":"d","name":"b0","persistent":true}}"#,
        );
        ok(
            &mut q,
            r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"e","node-name":"d","name":"d","writable":true}}"#,
        );
        let uri = format!("nbd+unix:///d?socket={}", dir.join("nbd.sock").display());
        qemu_io(
            &["-f", "raw"],
            &[
                "write -P 0x11 4k 1k",
                "write -z 1M 64k",
                "write -P 0x12 5M 300k",
            ],
            &uri,
        );
        ok(
            &mut q,
            r#"{"execute":"block-export-del","arguments":{"id":"e","mode":"hard"}}"#,
        );
        q.wait_event("BLOCK_EXPORT_DELETED", "id", "e");
        ok(&mut q, &del("d"));
        check_clean(&img);
        let text = run_ok("qemu-img", &["info", &img]);
        assert!(text.contains("b0") && !text.contains("in-use"), "{text}");
        // The header rewrites that stored the bitmap kept the data file's name and bits.
        let d = &info(&img)["format-specific"]["data"];
        assert_eq!(
            (&d["data-file"], &d["data-file-raw"]),
            (&data.as_str().into(), &raw.into())
        );
        // The bitmap is metadata: the data file holds the guest's bytes only.
        assert_eq!(std::fs::metadata(&data).unwrap().len(), data_len);
        ok(&mut q, &add);
        ok(
            &mut q,
            r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"e","node-name":"d","name":"d","writable":true,"bitmaps":["b0"]}}"#,
        );
        run_ok("nbdinfo", &["--map=qemu:dirty-bitmap:b0", &uri])
    };
    for raw in [false, true] {
        let ours = flow(stord_bin(), raw);
        let theirs = flow(QSD, raw);
        assert_eq!(ours, theirs, "raw {raw}");
        assert!(
            ours.lines().filter(|l| l.contains("dirty")).count() >= 2,
            "{ours}"
        );
    }
}

/// Sets the big-endian u64 at `off` of the file `image`.
fn poke64(image: &str, off: u64, v: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(image).unwrap();
    f.write_all_at(&v.to_be_bytes(), off).unwrap();
}

fn peek64(image: &str, off: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 8];
    std::fs::File::open(image)
        .unwrap()
        .read_exact_at(&mut b, off)
        .unwrap();
    u64::from_be_bytes(b)
}

/// What QEMU refuses, and in which words, as blockdev-add and the snapshot commands
/// answer stord and qemu-storage-daemon; and where QEMU finds a data file the header
/// names by a relative name: in its working directory, not the image's.
#[test]
fn refusals_and_relative_names_as_qsd() {
    let dir = tmpdir("datafile-refusals");
    let plain = path(&dir, "plain.qcow2");
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &plain, "16M"]);
    // The raw bit without a data file.
    let rawbit = path(&dir, "rawbit.qcow2");
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &rawbit, "16M"]);
    poke64(&rawbit, 88, 1 << 1);
    // A data file the header does not name.
    let (noname, _) = make(&dir, "noname", false);
    run_ok(
        "qemu-img",
        &["amend", "-f", "qcow2", "-o", "data_file=", &noname],
    );
    // Relative names: `rel.raw` in the daemon's directory; `sub/inner.raw` only below it.
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let rel = |image: &str, name: &str, cwd: &Path| {
        let out = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-o"])
            .arg(format!("data_file={name}"))
            .arg(image)
            .arg("16M")
            .current_dir(cwd)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    };
    let here = path(&dir, "here.qcow2");
    rel(&here, "rel.raw", &dir);
    let inner = path(&dir, "sub/inner.qcow2");
    rel(&inner, "inner.raw", &dir.join("sub"));
    let (snap, _) = make(&dir, "snap", false);
    let inline_raw = format!(
        r#","data-file":{{"driver":"file","filename":"{}"}}"#,
        path(&dir, "x.raw")
    );
    std::fs::File::create(dir.join("x.raw")).unwrap();
    let flow = |program: &str| -> Vec<String> {
        let (_d, mut q) = daemon(program, &dir);
        let mut seen = vec![
            error_of(&mut q, &add_qcow2("a", &plain, &inline_raw)),
            error_of(&mut q, &add_qcow2("b", &rawbit, "")),
            error_of(&mut q, &add_qcow2("c", &noname, "")),
            error_of(&mut q, &add_qcow2("d", &inner, "")),
            error_of(&mut q, &add_qcow2("e", &here, "")),
            error_of(&mut q, &add_qcow2("f", &snap, "")),
        ];
        seen.push(error_of(
            &mut q,
            r#"{"execute":"blockdev-snapshot-internal-sync","arguments":{"device":"f","name":"s1"}}"#,
        ));
        seen.push(error_of(
            &mut q,
            r#"{"execute":"blockdev-snapshot-delete-internal-sync","arguments":{"device":"f","name":"s1"}}"#,
        ));
        // The node stays usable: data read through it.
        ok(
            &mut q,
            r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"x","node-name":"e","name":"e"}}"#,
        );
        let uri = format!("nbd+unix:///e?socket={}", dir.join("nbd.sock").display());
        qemu_io(&["-f", "raw", "-r"], &["read -P 0 0 64k"], &uri);
        seen
    };
    let ours = flow(stord_bin());
    let theirs = flow(QSD);
    // stord's file driver names the node it failed to open before QEMU's words.
    assert!(ours[3].contains(&theirs[3]), "{ours:?} {theirs:?}");
    assert!(
        theirs[3].starts_with("Could not open 'inner.raw'"),
        "{theirs:?}"
    );
    assert_eq!(
        [&ours[..3], &ours[4..]].concat(),
        [&theirs[..3], &theirs[4..]].concat()
    );
    assert_eq!(
        ours[..3],
        [
            "'data-file' can only be set for images with an external data file",
            "data-file-raw requires a data file",
            "'data-file' is required for this image",
        ]
    );
    assert_eq!(ours[4..6], ["ok", "ok"]);
    assert_eq!(
        ours[6..],
        [
            "Failed to get a snapshot list: Operation not supported",
            "Failed to get a snapshot list: Operation not supported",
        ]
    );
}

/// L2 entries an image with a data file cannot have: a cluster mapped away from its guest
/// offset there, a compressed cluster. QEMU calls them corruption; stord answers EIO and
/// marks the image corrupt, as QEMU does with its copy.
#[test]
fn clusters_mapped_elsewhere_or_compressed_mark_the_image_corrupt() {
    const CORRUPT_BIT: u64 = 1 << 1;
    let dir = tmpdir("datafile-corrupt");
    // Guest cluster 1 (64 KiB) pointing at the data file's cluster 2; then compressed.
    for (name, entry) in [("away", 131072 | 1 << 63), ("compressed", 1 << 62 | 327680)] {
        let (img, data) = make(&dir, name, false);
        qemu_io(&["-f", "qcow2"], &["write -P 0x11 0 128k"], &img);
        let l1 = peek64(&img, 40);
        let l2 = peek64(&img, l1) & 0x00ff_ffff_ffff_fe00;
        assert_eq!(peek64(&img, l2 + 8), 65536 | 1 << 63);
        poke64(&img, l2 + 8, entry);
        let (r_img, _) = copy(&dir, (&img, &data), &format!("{name}-ref"));
        let mut s = Stord::with_node(
            &dir,
            &format!("driver=qcow2,file.driver=file,file.filename={img}"),
            true,
        );
        qemu_io(&["-f", "raw"], &["read -P 0x11 0 64k"], &s.uri());
        let text = |out: std::process::Output| {
            String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
        };
        let ours = text(run(
            "qemu-io",
            &["-f", "raw", "-c", "read 64k 64k", &s.uri()],
        ));
        let theirs = text(run(
            "qemu-io",
            &["-f", "qcow2", "-c", "read 64k 64k", &r_img],
        ));
        s.stop_and_stderr();
        assert!(ours.contains("Input/output error"), "{name}: {ours}");
        assert!(theirs.contains("Input/output error"), "{name}: {theirs}");
        for image in [&img, &r_img] {
            assert_ne!(
                peek64(image, 72) & CORRUPT_BIT,
                0,
                "{image} not marked corrupt"
            );
        }
        assert_eq!(info(&img)["format-specific"]["data"]["corrupt"], true);
    }
}

/// Waits until job `id` has concluded: its query-jobs entry.
fn wait_concluded(q: &mut RawQmp, id: &str) -> serde_json::Value {
    for _ in 0..1000 {
        let jobs = q.send(r#"{"execute":"query-jobs"}"#);
        let found = jobs["return"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["id"] == id && j["status"] == "concluded")
            .cloned();
        if let Some(j) = found {
            return j;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("job {id} did not conclude");
}

/// Runs blockdev-create job `id` with `options`: its concluded entry.
fn create_job(q: &mut RawQmp, id: &str, options: &str) -> serde_json::Value {
    ok(
        q,
        &format!(
            r#"{{"execute":"blockdev-create","arguments":{{"job-id":"{id}","options":{options}}}}}"#
        ),
    );
    let done = wait_concluded(q, id);
    ok(
        q,
        &format!(r#"{{"execute":"job-dismiss","arguments":{{"id":"{id}"}}}}"#),
    );
    done
}

/// `qemu-img info` JSON without what names or places the files.
fn info_sans_names(image: &str) -> serde_json::Value {
    let mut v = info(image);
    let o = v.as_object_mut().unwrap();
    for k in ["filename", "actual-size", "children"] {
        o.remove(k);
    }
    v["format-specific"]["data"]
        .as_object_mut()
        .unwrap()
        .remove("data-file");
    v
}

/// `blockdev-create` of qcow2 with `data-file` (a node) and `data-file-raw`, through stord
/// and through qemu-storage-daemon, and `qemu-img create` with the same options: the same
/// images (and data files), clean, and equal before and after the same writes; QEMU's
/// refusals as the job's error.
#[test]
fn blockdev_create_with_a_data_file_as_qemu_makes_it() {
    let dir = tmpdir("datafile-create");
    for raw in [false, true] {
        let made = |program: &str, name: &str| -> (String, String) {
            let (img, data) = (
                path(&dir, &format!("{name}.qcow2")),
                path(&dir, &format!("{name}.raw")),
            );
            std::fs::File::create(&img).unwrap();
            std::fs::File::create(&data).unwrap();
            let (_d, mut q) = daemon(program, &dir);
            for (node, file) in [("f", &img), ("df", &data)] {
                ok(
                    &mut q,
                    &format!(
                        r#"{{"execute":"blockdev-add","arguments":{{"driver":"file","node-name":"{node}","filename":"{file}"}}}}"#
                    ),
                );
            }
            let j = create_job(
                &mut q,
                "c",
                &format!(
                    r#"{{"driver":"qcow2","file":"f","data-file":"df","data-file-raw":{raw},"size":67108864}}"#
                ),
            );
            assert!(j.get("error").is_none(), "{program}: {j}");
            (img, data)
        };
        let ours = made(stord_bin(), "ours");
        let qsd = made(QSD, "qsd");
        let theirs = make(&dir, "theirs", raw);
        for (img, data) in [&ours, &qsd, &theirs] {
            check_clean(img);
            let d = &info(img)["format-specific"]["data"];
            assert_eq!(
                (&d["data-file"], &d["data-file-raw"]),
                (&data.as_str().into(), &raw.into())
            );
        }
        assert_eq!(
            info_sans_names(&ours.0),
            info_sans_names(&theirs.0),
            "raw {raw}"
        );
        assert_eq!(
            info_sans_names(&ours.0),
            info_sans_names(&qsd.0),
            "raw {raw}"
        );
        assert_eq!(map(&ours.0), map(&theirs.0), "raw {raw}");
        assert_eq!(map(&ours.0), map(&qsd.0), "raw {raw}");
        assert_same_bytes(&ours.1, &theirs.1);
        for (img, _) in [&ours, &theirs] {
            qemu_io(&["-f", "qcow2"], &GUEST_OPS[..6], img);
            check_clean(img);
        }
        run_ok("qemu-img", &["compare", &ours.0, &theirs.0]);
        assert_same_bytes(&ours.1, &theirs.1);
    }
    // data-file-raw over a raw disk that has data already: the image wraps it, every
    // cluster mapped to it (libvirt's <dataStore> over an existing disk).
    let (img, disk) = (path(&dir, "wrap.qcow2"), path(&dir, "wrap.raw"));
    std::fs::File::create(&img).unwrap();
    run_ok("qemu-img", &["create", "-q", "-f", "raw", &disk, "32M"]);
    qemu_io(
        &["-f", "raw"],
        &["write -P 0x5a 0 1M", "write -P 0x5b 31M 1M"],
        &disk,
    );
    {
        let (_d, mut q) = daemon(stord_bin(), &dir);
        for (node, file) in [("f", &img), ("df", &disk)] {
            ok(
                &mut q,
                &format!(
                    r#"{{"execute":"blockdev-add","arguments":{{"driver":"file","node-name":"{node}","filename":"{file}"}}}}"#
                ),
            );
        }
        let j = create_job(
            &mut q,
            "w",
            r#"{"driver":"qcow2","file":"f","data-file":"df","data-file-raw":true,"size":33554432}"#,
        );
        assert!(j.get("error").is_none(), "{j}");
    }
    check_clean(&img);
    qemu_io(
        &["-f", "qcow2"],
        &["read -P 0x5a 0 1M", "read -P 0x5b 31M 1M"],
        &img,
    );
    run_ok(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "qcow2", &disk, &img],
    );
    // QEMU's refusals, as the job's error.
    let refusals = |program: &str| -> Vec<String> {
        let (_d, mut q) = daemon(program, &dir);
        let (img, data) = (path(&dir, "bad.qcow2"), path(&dir, "bad.raw"));
        std::fs::File::create(&img).unwrap();
        std::fs::File::create(&data).unwrap();
        for (node, file) in [("f", &img), ("df", &data)] {
            ok(
                &mut q,
                &format!(
                    r#"{{"execute":"blockdev-add","arguments":{{"driver":"file","node-name":"{node}","filename":"{file}"}}}}"#
                ),
            );
        }
        [
            r#""data-file-raw":true"#,
            r#""data-file":"df","data-file-raw":true,"backing-file":"b.qcow2""#,
            r#""data-file":"df","version":"v2""#,
            r#""data-file":"nowhere""#,
        ]
        .iter()
        .map(|extra| {
            let j = create_job(
                &mut q,
                "bad",
                &format!(r#"{{"driver":"qcow2","file":"f","size":1048576,{extra}}}"#),
            );
            j["error"].as_str().unwrap_or("ok").to_string()
        })
        .collect()
    };
    let ours = refusals(stord_bin());
    assert_eq!(ours, refusals(QSD));
    assert_eq!(ours[0], "data-file-raw requires data-file");
}

/// `block_resize` of images with a data file, through stord and qemu-storage-daemon on
/// copies: the same images and data files after it (a raw data file grows with the disk,
/// its new clusters mapped one to one; another is sized to the disk).
#[test]
fn block_resize_grows_the_data_file_as_qsd_does() {
    let dir = tmpdir("datafile-resize");
    for raw in [false, true] {
        let orig = make(&dir, "orig", raw);
        qemu_io(&["-f", "qcow2"], &["write -P 0x31 63M 1M"], &orig.0);
        let resized = |program: &str, name: &str| -> (String, String) {
            let (img, data) = copy(&dir, (&orig.0, &orig.1), name);
            let (_d, mut q) = daemon(program, &dir);
            ok(&mut q, &add_qcow2("d", &img, ""));
            ok(
                &mut q,
                r#"{"execute":"block_resize","arguments":{"node-name":"d","size":134217728}}"#,
            );
            ok(
                &mut q,
                r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"e","node-name":"d","name":"d","writable":true}}"#,
            );
            let uri = format!("nbd+unix:///d?socket={}", dir.join("nbd.sock").display());
            qemu_io(
                &["-f", "raw"],
                &["write -P 0x32 100M 64k", "read -P 0x31 63M 1M"],
                &uri,
            );
            (img, data)
        };
        let ours = resized(stord_bin(), "ours");
        let theirs = resized(QSD, "theirs");
        check_clean(&ours.0);
        assert_eq!(info(&ours.0)["virtual-size"], 134217728u64);
        assert_eq!(std::fs::metadata(&ours.1).unwrap().len(), 134217728);
        run_ok("qemu-img", &["compare", &ours.0, &theirs.0]);
        assert_same_bytes(&ours.1, &theirs.1);
        assert_eq!(map(&ours.0), map(&theirs.0), "raw {raw}");
        if raw {
            run_ok(
                "qemu-img",
                &["compare", "-f", "raw", "-F", "qcow2", &ours.1, &ours.0],
            );
        }
    }
}

/// The permissions stord's image takes of its file and data file children with a
/// writable export on it, as x-debug-query-block-graph shows them, are qemu-storage-
/// daemon's; so are the locks another process meets (resizing the data file is refused),
/// and a read-only image's data file is read-only.
#[test]
fn the_data_file_is_taken_and_locked_as_qsd_takes_it() {
    let dir = tmpdir("datafile-perms");
    let (img, data) = make(&dir, "p", false);
    let (ro_img, _) = make(&dir, "ro", true);
    let flow = |program: &str| -> (Vec<String>, String, Vec<bool>) {
        let (_d, mut q) = daemon(program, &dir);
        ok(&mut q, &add_qcow2("q", &img, ""));
        ok(
            &mut q,
            r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"e","node-name":"q","name":"q","writable":true}}"#,
        );
        let g = ok(&mut q, r#"{"execute":"x-debug-query-block-graph"}"#);
        let mut edges: Vec<String> = g["edges"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] != "root")
            .map(|e| format!("{} {} {}", e["name"], e["perm"], e["shared-perm"]))
            .collect();
        edges.sort();
        let resize = run("qemu-img", &["resize", "-f", "raw", &data, "128M"]);
        let locked = String::from_utf8_lossy(&resize.stderr).to_string();
        ok(
            &mut q,
            &format!(
                r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"r","read-only":true,"file":{{"driver":"file","filename":"{ro_img}","read-only":true}}}}}}"#
            ),
        );
        let nodes = ok(&mut q, r#"{"execute":"query-named-block-nodes"}"#);
        let mut ro: Vec<bool> = nodes
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["file"].as_str().is_some_and(|f| f.ends_with(".raw")))
            .map(|n| n["ro"].as_bool().unwrap())
            .collect();
        ro.sort();
        (edges, locked, ro)
    };
    let ours = flow(stord_bin());
    assert_eq!(ours, flow(QSD));
    assert!(
        ours.0.iter().any(|e| e.starts_with("\"data-file\"")),
        "{ours:?}"
    );
    assert!(ours.1.contains("\"resize\" lock"), "{}", ours.1);
    assert_eq!(ours.2, [false, true]);
}

/// The jobs over images with data files: stream pulls a base into an overlay whose data
/// lives in a data file, commit writes an overlay into a base with a data file, mirror
/// and backup copy such an image to images with data files (one raw, which then reads as
/// the disk by itself). Each result reads as its source did and is clean.
#[test]
fn stream_commit_mirror_and_backup_with_data_files() {
    let dir = tmpdir("datafile-jobs");
    let base = path(&dir, "base.qcow2");
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &base, "64M"]);
    qemu_io(
        &["-f", "qcow2"],
        &["write -P 0xaa 0 8M", "write -P 0xbb 20M 1M"],
        &base,
    );
    let (top, top_raw) = (path(&dir, "top.qcow2"), path(&dir, "top.raw"));
    let opts = format!("data_file={top_raw}");
    run_ok(
        "qemu-img",
        &[
            "create", "-q", "-f", "qcow2", "-o", &opts, "-b", &base, "-F", "qcow2", &top,
        ],
    );
    qemu_io(&["-f", "qcow2"], &GUEST_OPS[..6], &top);
    let flat = path(&dir, "flat.raw");
    run_ok("qemu-img", &["convert", "-O", "raw", &top, &flat]);
    let (_d, mut q) = daemon(stord_bin(), &dir);
    let run_job = |q: &mut RawQmp, cmd: &str, id: &str, ready: bool| {
        ok(q, cmd);
        if ready {
            q.wait_event("BLOCK_JOB_READY", "device", id);
            ok(
                q,
                &format!(r#"{{"execute":"block-job-complete","arguments":{{"device":"{id}"}}}}"#),
            );
        }
        let e = q.wait_event("BLOCK_JOB_COMPLETED", "device", id);
        assert!(e["data"].get("error").is_none(), "{e}");
    };
    // Stream: the overlay takes the base in, into its data file.
    ok(&mut q, &add_qcow2("top", &top, ""));
    run_job(
        &mut q,
        r#"{"execute":"block-stream","arguments":{"job-id":"st","device":"top"}}"#,
        "st",
        false,
    );
    ok(&mut q, &del("top"));
    check_clean(&top);
    assert!(info(&top).get("backing-filename").is_none());
    run_ok(
        "qemu-img",
        &["compare", "-f", "qcow2", "-F", "raw", &top, &flat],
    );
    // Mirror and backup: from it to new images with data files.
    ok(&mut q, &add_qcow2("src", &top, ""));
    for (job, cmd, raw) in [
        ("mi", "blockdev-mirror", false),
        ("bk", "blockdev-backup", true),
    ] {
        let (target, target_data) = make(&dir, job, raw);
        ok(&mut q, &add_qcow2(job, &target, ""));
        let c = format!(
            r#"{{"execute":"{cmd}","arguments":{{"job-id":"{job}","device":"src","target":"{job}","sync":"full"}}}}"#
        );
        run_job(&mut q, &c, job, job == "mi");
        ok(&mut q, &del(job));
        check_clean(&target);
        run_ok(
            "qemu-img",
            &["compare", "-f", "qcow2", "-F", "raw", &target, &flat],
        );
        if raw {
            assert_same_bytes(&target_data, &flat);
        }
    }
    ok(&mut q, &del("src"));
    // Commit: a plain overlay into a base whose data lives in a data file.
    let (base2, _) = make(&dir, "base2", false);
    qemu_io(&["-f", "qcow2"], &["write -P 0x71 0 1M"], &base2);
    let top2 = path(&dir, "top2.qcow2");
    run_ok(
        "qemu-img",
        &[
            "create", "-q", "-f", "qcow2", "-b", &base2, "-F", "qcow2", &top2,
        ],
    );
    qemu_io(&["-f", "qcow2"], GUEST_OPS, &top2);
    let flat2 = path(&dir, "flat2.raw");
    run_ok("qemu-img", &["convert", "-O", "raw", &top2, &flat2]);
    ok(&mut q, &add_qcow2("top2", &top2, ""));
    run_job(
        &mut q,
        r#"{"execute":"block-commit","arguments":{"job-id":"co","device":"top2"}}"#,
        "co",
        true,
    );
    ok(&mut q, &del("top2"));
    check_clean(&base2);
    run_ok(
        "qemu-img",
        &["compare", "-f", "qcow2", "-F", "raw", &base2, &flat2],
    );
}
