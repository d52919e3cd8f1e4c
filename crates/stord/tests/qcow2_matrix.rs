//! The qcow2 interoperability matrix: images as qemu-img makes them (cluster sizes, refcount
//! widths, compat levels, compressed clusters, backing chains, huge virtual sizes), each
//! given the same qemu-io operations through stord and, on a copy, through QEMU's own
//! driver. Afterwards `qemu-img check` must find stord's image clean and `qemu-img compare`
//! must find the two identical.

mod common;

use std::path::Path;

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
    assert!(!text.contains("leaked"), "qemu-img check {image}: {text}");
}

fn create(path: &Path, opts: &str, size: &str) -> String {
    let p = path.display().to_string();
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([p.as_str(), size]);
    run_ok("qemu-img", &args);
    p
}

/// The operations every case gets: unaligned writes, writes across cluster boundaries,
/// write-zeroes with and without unmap, discard, a flush between them, and `extra`.
fn ops(extra: &[&'static str]) -> Vec<&'static str> {
    let mut v = vec![
        "write -P 0x21 100k 8k",
        "write -P 0x22 3333 5000",
        "write -P 0x23 1M 300k",
        "flush",
        "write -z 1100k 100k",
        "write -z -u 2M 1M",
        "write -P 0x24 2560k 4k",
        "discard 1M 64k",
        "discard 3M 1M",
        "write -P 0x25 3600k 1",
        "flush",
    ];
    v.extend_from_slice(extra);
    v
}

/// Applies `cmds` to `image` through stord and to a copy through QEMU; then the image stord
/// wrote must be clean and read the same as the copy.
fn same_as_qemu(dir: &Path, image: &str, cmds: &[&str]) {
    let reference = format!("{image}.ref");
    std::fs::copy(image, &reference).unwrap();
    {
        let node = format!(
            "driver=qcow2,discard=unmap,file.driver=file,file.filename={image},file.discard=unmap"
        );
        let s = Stord::with_node(dir, &node, true);
        qemu_io(&["-f", "raw"], cmds, &s.uri());
    }
    qemu_io(&["-f", "qcow2"], cmds, &reference);
    check_clean(image);
    run_ok("qemu-img", &["compare", image, &reference]);
    std::fs::remove_file(&reference).unwrap();
}

#[test]
fn cluster_sizes_from_512_bytes_to_2_mib() {
    let dir = tmpdir("matrix-cluster");
    for cs in ["512", "4k", "64k", "2M"] {
        let img = create(
            &dir.join(format!("c{cs}.qcow2")),
            &format!("cluster_size={cs}"),
            "64M",
        );
        same_as_qemu(&dir, &img, &ops(&["write -P 0x26 60M 4M"]));
    }
}

#[test]
fn every_refcount_width() {
    let dir = tmpdir("matrix-refcount");
    for bits in [1, 2, 4, 8, 16, 32, 64] {
        let img = create(
            &dir.join(format!("r{bits}.qcow2")),
            &format!("refcount_bits={bits}"),
            "64M",
        );
        same_as_qemu(&dir, &img, &ops(&[]));
    }
}

#[test]
fn compat_0_10_and_lazy_refcounts() {
    let dir = tmpdir("matrix-compat");
    let v2 = create(&dir.join("v2.qcow2"), "compat=0.10", "64M");
    same_as_qemu(&dir, &v2, &ops(&[]));
    let lazy = create(
        &dir.join("lazy.qcow2"),
        "compat=1.1,lazy_refcounts=on",
        "64M",
    );
    same_as_qemu(&dir, &lazy, &ops(&[]));
    // Dirty: qemu-io killed with lazy refcounts on leaves refcounts behind the tables
    // (qemu-img check finds errors); opened read-write, stord repairs them first, as QEMU.
    let dirty = create(
        &dir.join("dirty.qcow2"),
        "lazy_refcounts=on,cluster_size=4k",
        "64M",
    );
    let out = run(
        "qemu-io",
        &[
            "-c",
            "write -P 0x11 0 8M",
            "-c",
            "write -c -P 0x12 16M 1M",
            "-c",
            "write -P 0x13 30M 64k",
            "-c",
            "sigraise 9",
            &dirty,
        ],
    );
    assert!(!out.status.success());
    assert!(!run("qemu-img", &["check", &dirty]).status.success());
    same_as_qemu(&dir, &dirty, &ops(&["read -P 0x11 4M 4M"]));
}

/// `qemu-img convert -c`: small compressed clusters share host clusters, so writing into
/// or discarding one must leave its neighbours readable (an earlier stord discarded the
/// shared host cluster with the first one freed).
#[test]
fn writes_into_shared_compressed_clusters() {
    let dir = tmpdir("matrix-compressed");
    let raw = dir.join("src.raw").display().to_string();
    run_ok("qemu-img", &["create", "-q", "-f", "raw", &raw, "16M"]);
    let mut fill = Vec::new();
    for i in 0..256u32 {
        fill.push(format!("write -P {} {}k 64k", i % 250 + 1, i * 64));
    }
    let fill: Vec<&str> = fill.iter().map(String::as_str).collect();
    qemu_io(&["-f", "raw"], &fill, &raw);
    for (cs, kind) in [
        ("4k", "zlib"),
        ("64k", "zlib"),
        ("64k", "zstd"),
        ("512", "zstd"),
    ] {
        let img = dir
            .join(format!("z{cs}-{kind}.qcow2"))
            .display()
            .to_string();
        run_ok(
            "qemu-img",
            &[
                "convert",
                "-q",
                "-c",
                "-O",
                "qcow2",
                "-o",
                &format!("cluster_size={cs},compression_type={kind}"),
                &raw,
                &img,
            ],
        );
        same_as_qemu(
            &dir,
            &img,
            &ops(&[
                "read -P 129 8M 64k",
                "read -P 200 12736k 64k",
                "write -P 0x31 128k 4k",
                "flush",
                "write -P 0x32 3000k 512",
                "write -z 1536k 64k",
                "flush",
            ]),
        );
        // Every untouched compressed cluster still reads as it was written.
        qemu_io(
            &["-f", "qcow2"],
            &[
                "read -P 3 132k 60k",
                "read -P 10 576k 64k",
                "read -P 129 8M 64k",
                "read -P 200 12736k 64k",
            ],
            &img,
        );
    }
}

/// 512-byte clusters: one refcount table cluster covers a few MiB, so writing tens of MiB
/// makes the table grow (writes failed with EIO before).
#[test]
fn small_clusters_written_past_the_first_refcount_table() {
    let dir = tmpdir("matrix-grow");
    let img = create(&dir.join("small.qcow2"), "cluster_size=512", "64M");
    same_as_qemu(
        &dir,
        &img,
        &ops(&["write -P 0x41 4M 40M", "flush", "write -P 0x42 50M 10M"]),
    );
    let img = create(
        &dir.join("small1.qcow2"),
        "cluster_size=512,refcount_bits=1",
        "32M",
    );
    same_as_qemu(&dir, &img, &ops(&["write -P 0x43 4M 28M"]));
}

#[test]
fn backing_chains_raw_and_qcow2_of_mixed_cluster_sizes() {
    let dir = tmpdir("matrix-chain");
    let base_raw = dir.join("base.raw").display().to_string();
    run_ok("qemu-img", &["create", "-q", "-f", "raw", &base_raw, "64M"]);
    qemu_io(&["-f", "raw"], &["write -P 0x51 0 8M"], &base_raw);
    let mid = create(
        &dir.join("mid.qcow2"),
        &format!("cluster_size=4k,backing_file={base_raw},backing_fmt=raw"),
        "64M",
    );
    qemu_io(&["-f", "qcow2"], &["write -P 0x52 2M 2M"], &mid);
    let top = create(
        &dir.join("top.qcow2"),
        &format!("cluster_size=2M,backing_file={mid},backing_fmt=qcow2"),
        "64M",
    );
    same_as_qemu(&dir, &top, &ops(&["write -P 0x53 5M 100k"]));
    let v2 = create(
        &dir.join("top-v2.qcow2"),
        &format!("compat=0.10,cluster_size=512,backing_file={mid},backing_fmt=qcow2"),
        "64M",
    );
    same_as_qemu(&dir, &v2, &ops(&[]));
}

/// Extended L2 entries (subclusters) across the matrix: every cluster size they allow,
/// the narrowest and widest refcounts, lazy refcounts (and a dirty image repaired),
/// metadata preallocation, compressed clusters, and a chain of subclustered images over
/// a raw base, each written as QEMU writes it.
#[test]
fn extended_l2_across_cluster_sizes_refcounts_and_chains() {
    let dir = tmpdir("matrix-extl2");
    for cs in ["16k", "32k", "64k", "128k", "512k", "2M"] {
        let img = create(
            &dir.join(format!("x{cs}.qcow2")),
            &format!("extended_l2=on,cluster_size={cs}"),
            "64M",
        );
        same_as_qemu(
            &dir,
            &img,
            &ops(&["write -P 0x61 60M 4M", "write -z 61M 3k"]),
        );
    }
    for opts in [
        "extended_l2=on,cluster_size=128k,refcount_bits=1",
        "extended_l2=on,cluster_size=64k,refcount_bits=64",
        "extended_l2=on,cluster_size=32k,lazy_refcounts=on",
        "extended_l2=on,cluster_size=128k,preallocation=metadata",
    ] {
        let name = opts.replace([',', '='], "-");
        let img = create(&dir.join(format!("{name}.qcow2")), opts, "64M");
        same_as_qemu(&dir, &img, &ops(&[]));
    }
    let dirty = create(
        &dir.join("dirty.qcow2"),
        "extended_l2=on,cluster_size=32k,lazy_refcounts=on",
        "64M",
    );
    let out = run(
        "qemu-io",
        &[
            "-c",
            "write -P 0x62 0 4M",
            "-c",
            "write -P 0x63 5000k 3k",
            "-c",
            "sigraise 9",
            &dirty,
        ],
    );
    assert!(!out.status.success());
    same_as_qemu(&dir, &dirty, &ops(&["read -P 0x63 5000k 3k"]));
    let raw = dir.join("src.raw").display().to_string();
    run_ok("qemu-img", &["create", "-q", "-f", "raw", &raw, "16M"]);
    qemu_io(&["-f", "raw"], &["write -P 0x64 0 16M"], &raw);
    let zipped = dir.join("zipped.qcow2").display().to_string();
    let o = "extended_l2=on,cluster_size=64k";
    run_ok(
        "qemu-img",
        &["convert", "-q", "-c", "-O", "qcow2", "-o", o, &raw, &zipped],
    );
    same_as_qemu(&dir, &zipped, &ops(&["read -P 0x64 8M 64k"]));
    let mid = create(
        &dir.join("mid.qcow2"),
        &format!("extended_l2=on,cluster_size=32k,backing_file={raw},backing_fmt=raw"),
        "64M",
    );
    qemu_io(&["-f", "qcow2"], &["write -P 0x65 5M 5k"], &mid);
    let top = create(
        &dir.join("top.qcow2"),
        &format!(
            "extended_l2=on,cluster_size=128k,preallocation=metadata,\
             backing_file={mid},backing_fmt=qcow2"
        ),
        "64M",
    );
    same_as_qemu(
        &dir,
        &top,
        &ops(&["read -P 0x64 10k 90k", "read -P 0x65 5M 5k"]),
    );
}

#[test]
fn two_tib_virtual_size() {
    let dir = tmpdir("matrix-huge");
    let img = create(&dir.join("huge.qcow2"), "", "2T");
    same_as_qemu(
        &dir,
        &img,
        &ops(&[
            "write -P 0x61 1T 1M",
            "write -P 0x62 2047G 1M",
            "write -z 1500G 4M",
            "discard 1T 512k",
        ]),
    );
}

/// Internal snapshots: the active image shares tables and clusters with them, so writes,
/// write-zeroes and discards copy before they change anything, and every snapshot still
/// reads as it was taken.
#[test]
fn images_with_internal_snapshots_are_written_without_touching_the_snapshots() {
    let dir = tmpdir("matrix-snapshots");
    for opts in ["", "cluster_size=4k", "compat=0.10,cluster_size=512"] {
        let img = create(&dir.join("snap.qcow2"), opts, "64M");
        qemu_io(
            &["-f", "qcow2"],
            &["write -P 0x71 0 4M", "write -c -P 0x72 8M 1M"],
            &img,
        );
        run_ok("qemu-img", &["snapshot", "-c", "s1", &img]);
        qemu_io(&["-f", "qcow2"], &["write -P 0x73 1M 1M"], &img);
        run_ok("qemu-img", &["snapshot", "-c", "s2", &img]);
        let reference = format!("{img}.orig");
        std::fs::copy(&img, &reference).unwrap();
        same_as_qemu(
            &dir,
            &img,
            &ops(&[
                "write -P 0x74 0 64k",
                "write -P 0x75 8200k 4k",
                "write -z 3M 1M",
                "flush",
            ]),
        );
        // Each snapshot of stord's image reads as the same snapshot of the untouched copy.
        for snap in ["s1", "s2"] {
            let dump = |image: &str, out: &str| {
                run_ok(
                    "qemu-img",
                    &[
                        "convert",
                        "-l",
                        &format!("snapshot.name={snap}"),
                        "-O",
                        "raw",
                        image,
                        out,
                    ],
                );
            };
            let (a, b) = (dir.join("a.raw"), dir.join("b.raw"));
            dump(&img, &a.display().to_string());
            dump(&reference, &b.display().to_string());
            assert!(
                std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
                "snapshot {snap} changed ({opts})"
            );
        }
        std::fs::remove_file(&reference).unwrap();
        std::fs::remove_file(&img).unwrap();
    }
}
