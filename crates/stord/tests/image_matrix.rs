//! The images users' tools make, as a matrix: qcow2 as qemu-img 10.0 makes it (v3 and v2,
//! preallocated as Proxmox makes its disks), subclusters as Proxmox makes its overlays, LUKS in both forms (the `luks` format and
//! qcow2's `encrypt.format=luks`), external data files (with and without
//! `data_file_raw`, and encrypted), zstd-compressed clusters, persistent bitmaps. Each
//! kind is made twice by qemu-img, once for stord and once for QEMU; the same qemu-io
//! operations go through a stord NBD export of the one and straight through QEMU's own
//! driver to the other. Afterwards `qemu-img check` finds both clean and `qemu-img compare`
//! finds them equal (read through their secrets where they are encrypted).

mod common;

use std::path::{Path, PathBuf};

use common::{run, run_ok, tmpdir, Stord};

const SECRET: &str = "secret,id=sec0,data=matrix-pass";
const SIZE: &str = "64M";

/// One kind of image: how qemu-img makes it in a directory, and how it is opened there
/// (the `--blockdev` / `--image-opts` options, without a node name).
struct Kind {
    name: &'static str,
    make: fn(&Path),
    opts: fn(&Path) -> String,
    /// `qemu-img check` can look at it (the `luks` format has no check).
    checked: bool,
    /// QEMU gets a copy of stord's image rather than one made again: a raw LUKS volume's
    /// unwritten sectors read as its master key decrypts them, so two volumes made apart
    /// differ where nothing was written.
    copied: bool,
}

fn p(dir: &Path, file: &str) -> String {
    dir.join(file).display().to_string()
}

/// qemu-img `args` (a subcommand first), with the matrix's secret defined.
fn qemu_img(args: &[&str]) {
    let mut a = vec![args[0], "--object", SECRET];
    a.extend_from_slice(&args[1..]);
    run_ok("qemu-img", &a);
}

fn create(dir: &Path, fmt: &str, opts: &str, file: &str) {
    let path = p(dir, file);
    let mut args = vec!["create", "-q", "-f", fmt];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    args.extend([path.as_str(), SIZE]);
    qemu_img(&args);
}

fn qcow2_opts(dir: &Path) -> String {
    format!(
        "driver=qcow2,file.driver=file,file.filename={}",
        p(dir, "disk.qcow2")
    )
}

fn encrypted_opts(dir: &Path) -> String {
    format!(
        "{},encrypt.format=luks,encrypt.key-secret=sec0",
        qcow2_opts(dir)
    )
}

fn luks_opts(dir: &Path) -> String {
    format!(
        "driver=luks,key-secret=sec0,file.driver=file,file.filename={}",
        p(dir, "disk.luks")
    )
}

fn data_file_opts(dir: &Path) -> String {
    format!(
        "{},data-file.driver=file,data-file.filename={}",
        qcow2_opts(dir),
        p(dir, "disk.raw")
    )
}

/// A base image full of data in the matrix's shared directory (one level up), for the
/// overlays that read through to it.
fn base(dir: &Path) -> String {
    let base = dir.parent().unwrap().join("base.qcow2");
    if !base.exists() {
        let b = base.display().to_string();
        run_ok("qemu-img", &["create", "-q", "-f", "qcow2", &b, SIZE]);
        run_ok("qemu-io", &["-f", "qcow2", "-c", "write -P 0x5a 0 64M", &b]);
    }
    base.display().to_string()
}

fn compressed(dir: &Path) {
    let raw = p(dir, "src.raw");
    run_ok("qemu-img", &["create", "-q", "-f", "raw", &raw, SIZE]);
    let fill: Vec<String> = (0..64u32)
        .map(|i| format!("write -P {} {}k 64k", i + 1, i * 512))
        .collect();
    let mut a = vec!["-f", "raw"];
    for c in &fill {
        a.extend(["-c", c.as_str()]);
    }
    a.push(&raw);
    run_ok("qemu-io", &a);
    let img = p(dir, "disk.qcow2");
    let o = "compression_type=zstd";
    run_ok(
        "qemu-img",
        &["convert", "-q", "-c", "-O", "qcow2", "-o", o, &raw, &img],
    );
}

const KINDS: &[Kind] = &[
    Kind {
        name: "qcow2-v3",
        make: |d| create(d, "qcow2", "", "disk.qcow2"),
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "qcow2-v2",
        make: |d| create(d, "qcow2", "compat=0.10", "disk.qcow2"),
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "proxmox-overlay",
        make: |d| {
            let o = format!(
                "extended_l2=on,cluster_size=128k,backing_file={},backing_fmt=qcow2",
                base(d)
            );
            create(d, "qcow2", &o, "disk.qcow2")
        },
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "subclusters-64k",
        make: |d| create(d, "qcow2", "extended_l2=on,cluster_size=64k", "disk.qcow2"),
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
    Kind {
        // Proxmox's default for a new qcow2 disk.
        name: "qcow2-preallocated-metadata",
        make: |d| create(d, "qcow2", "preallocation=metadata", "disk.qcow2"),
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
    Kind {
        // Allocated clusters whose subclusters are all unallocated (reads go to the base).
        name: "proxmox-overlay-preallocated",
        make: |d| {
            let o = format!(
                "extended_l2=on,cluster_size=128k,preallocation=metadata,\
                 backing_file={},backing_fmt=qcow2",
                base(d)
            );
            create(d, "qcow2", &o, "disk.qcow2")
        },
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "subclusters-2m-falloc",
        make: |d| {
            let o = "extended_l2=on,cluster_size=2M,preallocation=falloc";
            create(d, "qcow2", o, "disk.qcow2")
        },
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "zstd-compressed",
        make: |d| compressed(d),
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "qcow2-luks",
        make: |d| {
            let o = "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10";
            create(d, "qcow2", o, "disk.qcow2")
        },
        opts: encrypted_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "qcow2-luks-subclusters-over-a-backing-file",
        make: |d| {
            let o = format!(
                "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10,\
                 extended_l2=on,cluster_size=128k,backing_file={},backing_fmt=qcow2",
                base(d)
            );
            create(d, "qcow2", &o, "disk.qcow2")
        },
        opts: encrypted_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "luks",
        make: |d| create(d, "luks", "key-secret=sec0,iter-time=10", "disk.luks"),
        opts: luks_opts,
        checked: false,
        copied: true,
    },
    Kind {
        name: "luks-aes-128-cbc-essiv",
        make: |d| {
            let o = "key-secret=sec0,iter-time=10,cipher-alg=aes-128,cipher-mode=cbc,\
                     ivgen-alg=essiv,ivgen-hash-alg=sha256,hash-alg=sha1";
            create(d, "luks", o, "disk.luks")
        },
        opts: luks_opts,
        checked: false,
        copied: true,
    },
    Kind {
        name: "data-file",
        make: |d| {
            create(
                d,
                "qcow2",
                &format!("data_file={}", p(d, "disk.raw")),
                "disk.qcow2",
            )
        },
        opts: data_file_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "data-file-raw",
        make: |d| {
            let o = format!("data_file={},data_file_raw=on", p(d, "disk.raw"));
            create(d, "qcow2", &o, "disk.qcow2")
        },
        opts: data_file_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "data-file-subclusters",
        make: |d| {
            let o = format!(
                "data_file={},extended_l2=on,cluster_size=32k",
                p(d, "disk.raw")
            );
            create(d, "qcow2", &o, "disk.qcow2")
        },
        opts: data_file_opts,
        checked: true,
        copied: false,
    },
    Kind {
        name: "data-file-encrypted",
        make: |d| {
            let o = format!(
                "data_file={},encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
                p(d, "disk.raw")
            );
            create(d, "qcow2", &o, "disk.qcow2")
        },
        opts: |d| {
            format!(
                "{},encrypt.format=luks,encrypt.key-secret=sec0",
                data_file_opts(d)
            )
        },
        checked: true,
        copied: false,
    },
    Kind {
        name: "persistent-bitmaps",
        make: |d| {
            create(d, "qcow2", "", "disk.qcow2");
            run_ok("qemu-img", &["bitmap", "--add", &p(d, "disk.qcow2"), "b0"]);
        },
        opts: qcow2_opts,
        checked: true,
        copied: false,
    },
];

/// What every kind gets: unaligned writes, writes across clusters, write-zeroes with and
/// without unmap, discards, flushes, and reads of what the base holds.
const OPS: &[&str] = &[
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
    "write -P 0x26 40M 129k",
    "flush",
    "read 0 64M",
];

fn qemu_io(target: &[&str]) {
    let mut a = vec!["--object", SECRET];
    a.extend_from_slice(target);
    for c in OPS {
        a.extend(["-c", c]);
    }
    let out = run_ok("qemu-io", &a);
    assert!(!out.contains("failed"), "qemu-io {target:?}: {out}");
}

fn check_clean(opts: &str) {
    let out = run(
        "qemu-img",
        &["check", "--object", SECRET, "--image-opts", opts],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qemu-img check {opts}: {text}");
    assert!(!text.contains("leaked"), "qemu-img check {opts}: {text}");
}

/// One kind: made for stord and for QEMU, the operations through each, then checked and
/// compared.
fn same_as_qemu(root: &Path, k: &Kind) {
    let (ours, theirs): (PathBuf, PathBuf) = (
        root.join(k.name).join("stord"),
        root.join(k.name).join("qemu"),
    );
    for d in [&ours, &theirs] {
        std::fs::create_dir_all(d).unwrap();
    }
    (k.make)(&ours);
    if k.copied {
        for f in std::fs::read_dir(&ours).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, theirs.join(f.file_name().unwrap())).unwrap();
        }
    } else {
        (k.make)(&theirs);
    }
    {
        // The daemon's socket and pid file in a short folder of their own: a kind's folder
        // name can take a socket path past the 108 bytes of sun_path.
        let run_dir = root.join("run");
        std::fs::create_dir_all(&run_dir).unwrap();
        let args: Vec<String> = [
            "--object",
            SECRET,
            "--object",
            "iothread,id=io0",
            "--blockdev",
            &format!("node-name=disk,discard=unmap,{}", (k.opts)(&ours)),
            "--nbd-server",
            &format!(
                "addr.type=unix,addr.path={}",
                run_dir.join("nbd.sock").display()
            ),
            "--export",
            "type=nbd,id=exp0,node-name=disk,name=disk,writable=on,iothread=io0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let s = Stord::start(&run_dir, &args);
        qemu_io(&["-f", "raw", &s.uri()]);
    }
    let theirs_opts = format!("discard=unmap,{}", (k.opts)(&theirs));
    qemu_io(&["--image-opts", &theirs_opts]);
    let (a, b) = ((k.opts)(&ours), (k.opts)(&theirs));
    if k.checked {
        check_clean(&a);
        check_clean(&b);
    }
    let out = run(
        "qemu-img",
        &["compare", "--object", SECRET, "--image-opts", &a, &b],
    );
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: qemu-img compare: {text}", k.name);
}

#[test]
fn every_kind_of_image_takes_the_same_writes_as_qemus_driver() {
    let root = tmpdir("image-matrix");
    let mut failed = Vec::new();
    for k in KINDS {
        let r = std::panic::catch_unwind(|| same_as_qemu(&root, k));
        if r.is_err() {
            failed.push(k.name);
        }
    }
    assert!(failed.is_empty(), "kinds that differ from QEMU: {failed:?}");
}

/// Data written by QEMU into a data file kept raw is the disk by itself, for stord's as
/// for QEMU's (the raw file read alone equals the image).
#[test]
fn a_raw_data_file_stays_the_disk_by_itself() {
    let root = tmpdir("image-matrix-raw");
    let k = KINDS.iter().find(|k| k.name == "data-file-raw").unwrap();
    same_as_qemu(&root, k);
    let ours = root.join(k.name).join("stord");
    let raw = format!(
        "driver=raw,file.driver=file,file.filename={}",
        p(&ours, "disk.raw")
    );
    let out = run(
        "qemu-img",
        &["compare", "--image-opts", &(k.opts)(&ours), &raw],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
