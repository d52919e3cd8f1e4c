//! qcow2 images with extended L2 entries (subclusters), as Proxmox makes its snapshot
//! overlays (`qemu-img create -f qcow2 -o extended_l2=on,cluster_size=128k -b base.qcow2
//! -F qcow2 overlay.qcow2`). Side by side with QEMU: the same qemu-io operations through a
//! stord NBD export of the image and through QEMU's own driver on a copy; then both images
//! `qemu-img check` clean, `qemu-img compare` equal and `qemu-img map` the same run for run
//! (host offsets aside: the two allocators place clusters each their own way). Also:
//! internal snapshots, a dirty image repaired on open, `blockdev-create` with
//! `extended-l2`, the jobs, and concurrent writes into shared clusters.

mod common;

use std::path::Path;

use common::rawqmp::{monitor_args, RawQmp};
use common::{run, run_ok, tmpdir, Stord};

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

/// `qemu-img map --output=json` without host offsets, neighbours of one kind merged.
fn map(image: &str) -> Vec<serde_json::Value> {
    let out = run_ok("qemu-img", &["map", "-U", "--output=json", image]);
    let v: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let mut merged: Vec<serde_json::Value> = Vec::new();
    for mut e in v {
        e.as_object_mut().unwrap().remove("offset");
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

/// Whether a map has runs of less than a cluster (`cs`) of data in this image: the map
/// shows subclusters.
fn has_subcluster_runs(m: &[serde_json::Value], cs: u64) -> bool {
    m.iter()
        .any(|e| e["depth"] == 0 && e["data"] == true && e["length"].as_u64().unwrap() % cs != 0)
}

/// The node stord serves `image` with (discards passed down, as Proxmox configures them).
fn node(image: &str) -> String {
    format!("driver=qcow2,discard=unmap,file.driver=file,file.filename={image},file.discard=unmap")
}

/// Applies `cmds` to `image` through a stord NBD export and to a copy through QEMU; then
/// both must be clean, read the same and map the same. The maps are returned.
fn same_as_qemu(dir: &Path, image: &str, cmds: &[&str]) -> Vec<serde_json::Value> {
    let reference = format!("{image}.ref");
    std::fs::copy(image, &reference).unwrap();
    qemu_io(&["-f", "qcow2"], cmds, &reference);
    let mut s = Stord::with_node(dir, &node(image), true);
    qemu_io(&["-f", "raw"], cmds, &s.uri());
    // What stord serves is what QEMU reads from its own copy.
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
            &reference,
        ],
    );
    s.stop_and_stderr();
    check_clean(image);
    check_clean(&reference);
    run_ok("qemu-img", &["compare", image, &reference]);
    let (ours, theirs) = (map(image), map(&reference));
    assert_eq!(ours, theirs, "qemu-img map of {image} and of QEMU's copy");
    std::fs::remove_file(&reference).unwrap();
    ours
}

/// A Proxmox chain: a 64 MiB base with data (0xaa in the first 8 MiB, 0xbb at 12 MiB), a
/// compressed run (0xcc at 16 MiB) and zeroes written at 20 MiB; over it an overlay with
/// extended L2 entries and `cluster_size` clusters.
fn proxmox_chain(dir: &Path, cluster_size: &str) -> String {
    let base = dir.join("base.qcow2").display().to_string();
    let top = dir
        .join(format!("vm-disk-{cluster_size}.qcow2"))
        .display()
        .to_string();
    for f in [&base, &top] {
        let _ = std::fs::remove_file(f);
    }
    run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &base, "64M"]);
    qemu_io(
        &["-f", "qcow2"],
        &[
            "write -P 0xaa 0 8M",
            "write -P 0xbb 12M 1M",
            "write -c -P 0xcc 16M 256k",
            "write -z 20M 1M",
        ],
        &base,
    );
    let opts = format!("extended_l2=on,cluster_size={cluster_size}");
    run_ok(
        "qemu-img",
        &[
            "create", "-q", "-f", "qcow2", "-o", &opts, "-b", &base, "-F", "qcow2", &top,
        ],
    );
    top
}

/// What a guest does to a Proxmox overlay: writes within a subcluster, across subclusters
/// and clusters, over allocated subclusters; write-zeroes aligned and not, with and
/// without unmap; discards whole and partial; then reads across allocated, zero and
/// backing subclusters.
const GUEST_OPS: &[&str] = &[
    "write -P 0x11 4k 1k",
    "write -P 0x12 130k 10k",
    "write -P 0x13 120k 16k",
    "write -P 0x14 4k 512",
    "write -P 0x15 3k 6k",
    "flush",
    "write -z 300k 8k",
    "write -z 1000k 3k",
    "write -z 1020k 8k",
    "write -z -u 2M 256k",
    "write -P 0x16 2100k 4k",
    "write -z 4k 2k",
    "write -z -u 5k 100",
    "discard 3M 256k",
    "discard 3200k 10k",
    "write -P 0x17 12M 300k",
    "write -z -u 12M 128k",
    "write -P 0x18 16M 1k",
    "write -P 0x19 31M 1M",
    "write -z 40k 60k",
    "write -P 0x1a 20M 3k",
    "write -z -u 20M 512k",
    "flush",
    "read -P 0 2M 52k",
    "read -P 0xaa 9k 3k",
    "read -P 0xbb 12588k 724k",
    "read -P 0xcc 16385k 255k",
    "read -P 0x19 31M 1M",
    "read -P 0 300k 8k",
    "read -P 0 20M 1M",
    "read -P 0 40M 1M",
];

#[test]
fn proxmox_overlays_are_written_as_qemu_writes_them() {
    let dir = tmpdir("subcl-proxmox");
    for (cs, bytes) in [("128k", 128 << 10), ("64k", 64 << 10)] {
        let top = proxmox_chain(&dir, cs);
        let info = run_ok("qemu-img", &["info", &top]);
        assert!(info.contains("extended l2: true"), "{info}");
        let m = same_as_qemu(&dir, &top, GUEST_OPS);
        assert!(has_subcluster_runs(&m, bytes), "{cs}: {m:?}");
        // Zero subclusters over the backing file's data.
        assert!(
            m.iter().any(|e| e["depth"] == 0 && e["zero"] == true),
            "{cs}: {m:?}"
        );
    }
}

#[test]
fn images_without_a_backing_file_and_with_compressed_clusters() {
    let dir = tmpdir("subcl-compressed");
    let img = dir.join("c.qcow2").display().to_string();
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=128k",
            &img,
            "16M",
        ],
    );
    qemu_io(
        &["-f", "qcow2"],
        &[
            "write -c -P 0x51 0 128k",
            "write -c -P 0x52 256k 128k",
            "write -P 0x53 1M 512k",
            "write -P 0x54 4M 6k",
        ],
        &img,
    );
    same_as_qemu(
        &dir,
        &img,
        &[
            // Into a compressed cluster: the whole cluster is copied to a new one.
            "write -P 0x61 10k 1k",
            // Zeroes in a compressed cluster, which has no subclusters: written as data.
            "write -z 260k 8k",
            "write -z -u 1152k 128k",
            "discard 1M 128k",
            "write -z 2M 128k",
            "write -z 4M 3k",
            "write -z 4100k 2k",
            "write -P 0x62 8M 5k",
            "discard 8M 128k",
            "flush",
            "read -P 0x51 0 10k",
            "read -P 0x61 10k 1k",
            "read -P 0x51 11k 117k",
            "read -P 0 260k 8k",
            "read -P 0x52 268k 116k",
            "read -P 0 1M 256k",
            "read -P 0x53 1280k 256k",
            "read -P 0 4M 3k",
            "read -P 0x54 4197376 1k",
        ],
    );
}

/// An internal snapshot shares every cluster: the first write into one copies every
/// allocated subcluster of it to the new cluster (not only those the write touches), and
/// the snapshot reads as it was taken.
#[test]
fn an_internal_snapshot_then_a_write_copies_every_allocated_subcluster() {
    let dir = tmpdir("subcl-snapshot");
    let img = dir.join("s.qcow2").display().to_string();
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=128k",
            &img,
            "8M",
        ],
    );
    qemu_io(
        &["-f", "qcow2"],
        &[
            "write -P 0x31 8k 4k",
            "write -P 0x32 100k 8k",
            "write -z 50k 4k",
            "write -P 0x33 1M 256k",
            "write -c -P 0x34 2M 128k",
        ],
        &img,
    );
    run_ok("qemu-img", &["snapshot", "-c", "s1", &img]);
    let raw = |image: &str, snapshot: bool, out: &str| {
        let mut args = vec!["convert", "-U"];
        if snapshot {
            args.extend(["-l", "snapshot.name=s1"]);
        }
        args.extend(["-O", "raw", image, out]);
        run_ok("qemu-img", &args);
        std::fs::read(out).unwrap()
    };
    let before = raw(&img, false, &format!("{img}.before"));
    let m = same_as_qemu(
        &dir,
        &img,
        &[
            "write -P 0x41 20k 1k",
            "write -P 0x42 1M 5k",
            "write -P 0x43 2M 1k",
            "write -z 1100k 4k",
            "discard 1152k 128k",
            "read -P 0x31 8k 4k",
            "read -P 0x32 100k 8k",
            "read -P 0x34 2049k 127k",
        ],
    );
    // The first cluster's subclusters 2 (0x31) and 25-26 (0x32) came along with 5 (0x41),
    // and all between them (the zero subcluster 12 too, as zeroes); 0-1 and 27-31 stay
    // unallocated.
    let first: Vec<(u64, u64, bool)> = m
        .iter()
        .take_while(|e| e["start"].as_u64().unwrap() < 128 << 10)
        .filter(|e| e["data"] == true)
        .map(|e| {
            let (s, l) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
            (s >> 10, l >> 10, e["depth"] == 0)
        })
        .collect();
    assert_eq!(first, [(8, 100, true)], "{m:?}");
    assert!(
        raw(&img, true, &format!("{img}.s1")) == before,
        "the snapshot changed"
    );
}

/// Killed with lazy refcounts on, QEMU leaves the image dirty (refcounts behind the
/// tables); stord repairs it when it opens it read-write, walking extended entries.
#[test]
fn a_dirty_image_is_repaired_on_open() {
    let dir = tmpdir("subcl-dirty");
    let img = dir.join("d.qcow2").display().to_string();
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=64k,lazy_refcounts=on",
            &img,
            "64M",
        ],
    );
    let out = run(
        "qemu-io",
        &[
            "-c",
            "write -P 0x11 0 4M",
            "-c",
            "write -c -P 0x13 16M 64k",
            "-c",
            "write -P 0x12 8M 3k",
            "-c",
            "write -z 20M 4k",
            // Allocating last: its refcounts stay in QEMU's cache, never written.
            "-c",
            "write -P 0x16 30M 64k",
            "-c",
            "sigraise 9",
            &img,
        ],
    );
    assert!(!out.status.success());
    assert!(!run("qemu-img", &["check", &img]).status.success());
    same_as_qemu(
        &dir,
        &img,
        &[
            "read -P 0x11 0 4M",
            "read -P 0x12 8M 3k",
            "read -P 0x16 30M 64k",
            "write -P 0x14 8M 1k",
            "write -P 0x15 30M 64k",
        ],
    );
}

/// `blockdev-create` with `extended-l2` makes the image `qemu-img create -o
/// extended_l2=on` makes: the same format details, reading the same, and taking QEMU's
/// writes; and refuses what QEMU refuses, with its words.
#[test]
fn blockdev_create_with_extended_l2_as_qemu_img_makes_it() {
    let dir = tmpdir("subcl-create");
    let sock = dir.join("qmp.sock");
    let _s = Stord::start(&dir, &monitor_args(&sock));
    let mut q = RawQmp::connect(&sock);
    let job = |q: &mut RawQmp, id: &str, options: String| -> serde_json::Value {
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
    };
    for (cs, bytes) in [
        (131072u64, 1u64 << 30),
        (65536, 100 << 20),
        (16384, 16 << 20),
    ] {
        let ours = dir.join(format!("ours-{cs}.qcow2")).display().to_string();
        let theirs = dir.join(format!("theirs-{cs}.qcow2")).display().to_string();
        let size = bytes.to_string();
        std::fs::File::create(&ours).unwrap();
        let r = q.send(&format!(
            r#"{{"execute":"blockdev-add","arguments":{{"driver":"file","node-name":"f{cs}","filename":"{ours}"}}}}"#
        ));
        assert!(r.get("return").is_some(), "{r}");
        let j = job(
            &mut q,
            &format!("c{cs}"),
            format!(
                r#"{{"driver":"qcow2","file":"f{cs}","size":{bytes},"cluster-size":{cs},"extended-l2":true}}"#
            ),
        );
        assert!(j.get("error").is_none(), "{j}");
        q.send(&format!(
            r#"{{"execute":"blockdev-del","arguments":{{"node-name":"f{cs}"}}}}"#
        ));
        let opts = format!("extended_l2=on,cluster_size={cs}");
        run_ok(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "-o", &opts, &theirs, &size],
        );
        check_clean(&ours);
        let info = |image: &str| {
            let out = run_ok("qemu-img", &["info", "--output=json", image]);
            let mut v: serde_json::Value = serde_json::from_str(&out).unwrap();
            let o = v.as_object_mut().unwrap();
            for k in ["filename", "actual-size", "children"] {
                o.remove(k);
            }
            v
        };
        assert_eq!(info(&ours), info(&theirs));
        assert!(info(&ours)["format-specific"]["data"]["extended-l2"] == true);
        run_ok("qemu-img", &["compare", &ours, &theirs]);
        for img in [&ours, &theirs] {
            qemu_io(
                &["-f", "qcow2"],
                &["write -P 0x5c 1M 6k", "read -P 0x5c 1M 6k"],
                img,
            );
        }
        check_clean(&ours);
        run_ok("qemu-img", &["compare", &ours, &theirs]);
    }
    // QEMU's refusals, as the job's error.
    let bad = dir.join("bad.qcow2").display().to_string();
    std::fs::File::create(&bad).unwrap();
    q.send(&format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"file","node-name":"bad","filename":"{bad}"}}}}"#
    ));
    for (extra, want) in [
        (
            r#""cluster-size":8192"#,
            "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes",
        ),
        (
            r#""version":"v2""#,
            "Extended L2 entries are only supported with compatibility level 1.1 and above (use version=v3 or greater)",
        ),
    ] {
        let j = job(
            &mut q,
            "bad",
            format!(r#"{{"driver":"qcow2","file":"bad","size":1048576,"extended-l2":true,{extra}}}"#),
        );
        assert_eq!(j["error"], want, "{j}");
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

/// Sends `cmd` and asserts it returned.
fn ok(q: &mut RawQmp, cmd: &str) {
    let r = q.send(cmd);
    assert!(r.get("return").is_some(), "{cmd}: {r}");
}

/// Runs job `cmd` (its id `id`) and waits for it to complete (a mirror is completed once
/// ready).
fn run_job(q: &mut RawQmp, cmd: &str, id: &str, mirror: bool) {
    ok(q, cmd);
    if mirror {
        q.wait_event("BLOCK_JOB_READY", "device", id);
        ok(
            q,
            &format!(r#"{{"execute":"block-job-complete","arguments":{{"device":"{id}"}}}}"#),
        );
    }
    let e = q.wait_event("BLOCK_JOB_COMPLETED", "device", id);
    assert!(e["data"].get("error").is_none(), "{e}");
}

/// The jobs over images with extended L2 entries: stream pulls the base into an overlay
/// (subcluster by subcluster), commit writes an overlay into an extended base, mirror and
/// backup copy one to a new image. Each result reads as the chain did and is clean.
#[test]
fn stream_commit_mirror_and_backup_over_subclusters() {
    let dir = tmpdir("subcl-jobs");
    let guest = |top: &str| {
        qemu_io(
            &["-f", "qcow2"],
            &[
                "write -P 0x21 4k 1k",
                "write -P 0x22 1000k 300k",
                "write -z 8M 6k",
                "write -z 12M 128k",
                "write -P 0x23 12583936 1k",
            ],
            top,
        );
    };
    let top = proxmox_chain(&dir, "128k");
    guest(&top);
    let flat = dir.join("flat.raw").display().to_string();
    run_ok("qemu-img", &["convert", "-O", "raw", &top, &flat]);
    let sock = dir.join("qmp.sock");
    let _s = Stord::start(&dir, &monitor_args(&sock));
    let mut q = RawQmp::connect(&sock);
    let add = |q: &mut RawQmp, name: &str, image: &str| {
        ok(
            q,
            &format!(
                r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"{name}","file":{{"driver":"file","filename":"{image}"}}}}}}"#
            ),
        );
    };
    let del = |q: &mut RawQmp, name: &str| {
        ok(
            q,
            &format!(r#"{{"execute":"blockdev-del","arguments":{{"node-name":"{name}"}}}}"#),
        );
    };
    // Stream: the overlay takes everything in, its backing file goes.
    add(&mut q, "top", &top);
    run_job(
        &mut q,
        r#"{"execute":"block-stream","arguments":{"job-id":"st","device":"top"}}"#,
        "st",
        false,
    );
    del(&mut q, "top");
    check_clean(&top);
    assert!(!run_ok("qemu-img", &["info", &top]).contains("backing file:"));
    run_ok(
        "qemu-img",
        &["compare", "-f", "qcow2", "-F", "raw", &top, &flat],
    );
    // Commit: an extended overlay into an extended base.
    let base2 = dir.join("base2.qcow2").display().to_string();
    let top2 = dir.join("top2.qcow2").display().to_string();
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=64k",
            &base2,
            "64M",
        ],
    );
    qemu_io(
        &["-f", "qcow2"],
        &["write -P 0x71 0 1M", "write -P 0x72 3k 2k"],
        &base2,
    );
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=128k",
            "-b",
            &base2,
            "-F",
            "qcow2",
            &top2,
        ],
    );
    guest(&top2);
    let flat2 = dir.join("flat2.raw").display().to_string();
    run_ok("qemu-img", &["convert", "-O", "raw", &top2, &flat2]);
    add(&mut q, "top2", &top2);
    // The active layer: a mirror-like job, completed once ready.
    run_job(
        &mut q,
        r#"{"execute":"block-commit","arguments":{"job-id":"co","device":"top2"}}"#,
        "co",
        true,
    );
    del(&mut q, "top2");
    check_clean(&base2);
    run_ok(
        "qemu-img",
        &["compare", "-f", "qcow2", "-F", "raw", &base2, &flat2],
    );
    // Mirror and backup: from the streamed overlay to new extended images.
    add(&mut q, "src", &top);
    for (job, cmd) in [("mi", "blockdev-mirror"), ("bk", "blockdev-backup")] {
        let target = dir.join(format!("{job}.qcow2")).display().to_string();
        run_ok(
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "extended_l2=on,cluster_size=128k",
                &target,
                "64M",
            ],
        );
        add(&mut q, job, &target);
        let c = format!(
            r#"{{"execute":"{cmd}","arguments":{{"job-id":"{job}","device":"src","target":"{job}","sync":"full"}}}}"#
        );
        run_job(&mut q, &c, job, job == "mi");
        del(&mut q, job);
        check_clean(&target);
        run_ok(
            "qemu-img",
            &["compare", "-f", "qcow2", "-F", "raw", &target, &flat],
        );
    }
    del(&mut q, "src");
}

/// Writes of 3 KiB at queue depth 16 into a Proxmox overlay, over a third of 16 MiB: many
/// straddle subclusters and several land in one cluster at once (allocating it, or its
/// subclusters, together); fio verifies every block, and the image is clean, its clusters
/// partly allocated.
#[test]
fn concurrent_writes_into_subclusters_verify_and_leave_the_image_clean() {
    let dir = tmpdir("subcl-fio");
    let top = proxmox_chain(&dir, "128k");
    let mut s = Stord::with_node(&dir, &node(&top), true);
    let uri = format!("--uri={}", s.uri());
    let out = run_ok(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bs=3k",
            "--iodepth=16",
            "--size=16M",
            "--io_size=5M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
            "--output-format=json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "{out}");
    assert!(
        v["jobs"][0]["read"]["io_bytes"].as_u64().unwrap() > 0,
        "{out}"
    );
    s.stop_and_stderr();
    check_clean(&top);
    let m = map(&top);
    assert!(has_subcluster_runs(&m, 128 << 10), "{m:?}");
}

fn be64(f: &std::fs::File, off: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, off).unwrap();
    u64::from_be_bytes(b)
}

fn put64(f: &std::fs::File, off: u64, v: u64) {
    use std::os::unix::fs::FileExt;
    f.write_all_at(&v.to_be_bytes(), off).unwrap();
}

/// qemu-io commands through a stord export of `img`: the output and whether every one
/// succeeded.
fn through_stord(dir: &Path, img: &str, cmds: &[&str]) -> (String, bool) {
    let mut s = Stord::with_node(dir, &node(img), true);
    let mut args = vec!["-f".to_string(), "raw".into()];
    for c in cmds {
        args.extend(["-c".to_string(), c.to_string()]);
    }
    args.push(s.uri());
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("qemu-io", &a);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    s.stop_and_stderr();
    (
        text.clone(),
        out.status.success() && !text.contains("failed"),
    )
}

/// Extended entries that make no sense: a subcluster both allocated and zero gets EIO
/// (QEMU's check calls it corrupt too), and an entry pointing at the L1 table never turns
/// a guest write into a table write: EIO, the image marked corrupt, the table intact.
#[test]
fn invalid_bitmaps_and_entries_on_metadata_get_eio() {
    const CORRUPT_BIT: u64 = 1 << 1;
    let dir = tmpdir("subcl-hostile");
    let img = dir.join("h.qcow2").display().to_string();
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "extended_l2=on,cluster_size=64k",
            &img,
            "64M",
        ],
    );
    qemu_io(
        &["-f", "qcow2"],
        &["write -P 0x11 0 64k", "write -P 0x22 1M 3k"],
        &img,
    );
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let l1 = be64(&f, 40);
    let l2 = be64(&f, l1) & 0x00ff_ffff_ffff_fe00;
    // Cluster 0: subcluster 0 allocated and zero at once.
    let bitmap = be64(&f, l2 + 8);
    assert_eq!(bitmap, 0xffff_ffff);
    put64(&f, l2 + 8, bitmap | 1 << 32);
    let check = run("qemu-img", &["check", &img]);
    assert!(!check.status.success(), "QEMU finds it corrupt too");
    let (out, ok) = through_stord(&dir, &img, &["read 0 2k"]);
    assert!(!ok && out.contains("Input/output error"), "{out}");
    let (out, ok) = through_stord(&dir, &img, &["read -P 0x22 1M 3k"]);
    assert!(!ok || out.contains("read 3072"), "{out}");
    put64(&f, l2 + 8, bitmap);
    // Cluster 16 (1 MiB) pointing at the L1 table, as ours, with its first subcluster
    // allocated: a write into its second gets EIO, not a write over the table.
    put64(&f, l2 + 16 * 16, l1 | 1 << 63);
    let table = {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; 512];
        f.read_exact_at(&mut b, l1).unwrap();
        b
    };
    let (out, ok) = through_stord(&dir, &img, &["write -P 0x33 1052672 1k"]);
    assert!(!ok && out.contains("Input/output error"), "{out}");
    let now = {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; 512];
        f.read_exact_at(&mut b, l1).unwrap();
        b
    };
    assert!(now == table, "the L1 table was written over");
    assert_ne!(be64(&f, 72) & CORRUPT_BIT, 0, "not marked corrupt");
}

/// A daemon killed when dropped (a failing test leaves none behind).
struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `program` (stord or qemu-storage-daemon) with a QMP monitor and an NBD server
/// in `dir`: the daemon and the QMP connection.
fn daemon(program: &str, dir: &Path) -> (Daemon, RawQmp) {
    let qmp = dir.join(format!("{}.qmp", program.rsplit('/').next().unwrap()));
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

/// A persistent dirty bitmap on an image with extended L2 entries, through stord and
/// through qemu-storage-daemon: stored when the node goes, with the bits the writes set,
/// the image clean, and the same dirty extents offered over NBD by both afterwards.
#[test]
fn persistent_bitmaps_on_an_extended_image_as_qsd_keeps_them() {
    let dir = tmpdir("subcl-bitmaps");
    let flow = |program: &str| -> String {
        let top = proxmox_chain(&dir, "128k");
        let (child, mut q) = daemon(program, &dir);
        let add = format!(
            r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"d","file":{{"driver":"file","filename":"{top}"}}}}}}"#
        );
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
        ok(
            &mut q,
            r#"{"execute":"blockdev-del","arguments":{"node-name":"d"}}"#,
        );
        check_clean(&top);
        let info = run_ok("qemu-img", &["info", &top]);
        assert!(info.contains("b0") && !info.contains("in-use"), "{info}");
        // Opened again: the bitmap offered over NBD as it was stored.
        ok(&mut q, &add);
        ok(
            &mut q,
            r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"e","node-name":"d","name":"d","writable":true,"bitmaps":["b0"]}}"#,
        );
        let map = run_ok("nbdinfo", &["--map=qemu:dirty-bitmap:b0", &uri]);
        drop(child);
        map
    };
    let ours = flow(env!("CARGO_BIN_EXE_stord"));
    let theirs = flow("qemu-storage-daemon");
    assert_eq!(ours, theirs);
    assert!(
        ours.lines().filter(|l| l.contains("dirty")).count() >= 2,
        "{ours}"
    );
}

/// Block status and allocation depth over NBD, per subcluster: stord and
/// qemu-storage-daemon, each exporting the same Proxmox overlay read-only, describe it
/// extent for extent (data, zero and backing subclusters; local, backing and absent).
#[test]
fn block_status_and_allocation_depth_per_subcluster_as_qsd() {
    let dir = tmpdir("subcl-status");
    let top = proxmox_chain(&dir, "128k");
    qemu_io(&["-f", "qcow2"], GUEST_OPS, &top);
    let maps = |program: &str| -> (String, String) {
        let sock = dir.join("status.sock");
        let _ = std::fs::remove_file(&sock);
        let child = std::process::Command::new(program)
            .args([
                "--blockdev",
                &format!("driver=file,node-name=f,filename={top},read-only=on"),
                "--blockdev",
                "driver=qcow2,node-name=q,file=f,read-only=on",
                "--nbd-server",
                &format!("addr.type=unix,addr.path={}", sock.display()),
                "--export",
                "type=nbd,id=e,node-name=q,name=q,allocation-depth=on",
            ])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let _d = Daemon(child);
        let start = std::time::Instant::now();
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(start.elapsed().as_secs() < 10, "{program} did not start");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let uri = format!("nbd+unix:///q?socket={}", sock.display());
        (
            run_ok("nbdinfo", &["--map", &uri]),
            run_ok("nbdinfo", &["--map=qemu:allocation-depth", &uri]),
        )
    };
    let (status, depth) = maps(env!("CARGO_BIN_EXE_stord"));
    let (qsd_status, qsd_depth) = maps("qemu-storage-daemon");
    assert_eq!(status, qsd_status);
    assert_eq!(depth, qsd_depth);
    // Runs shorter than a cluster: the subclusters show.
    let short = |m: &str| {
        m.lines().any(|l| {
            let len: u64 = l.split_whitespace().nth(1).unwrap().parse().unwrap();
            !len.is_multiple_of(128 << 10)
        })
    };
    assert!(short(&status) && short(&depth), "{status}\n{depth}");
    for want in ["local", "backing depth 2", "absent"] {
        assert!(depth.contains(want), "{depth}");
    }
}
