//! Encrypted qcow2 images (`encrypt.format=luks`) side by side with QEMU: images qemu-img
//! made (default cipher and aes-128-cbc-essiv, with and without extended L2 entries, over
//! no, a plain and an encrypted backing file) get the same qemu-io writes through a stord
//! NBD export and through QEMU on a copy; each reads what the other wrote, `qemu-img
//! check` is clean and `qemu-img compare` with the secrets finds them equal. Jobs copy
//! between encrypted and plain images; `blockdev-create` makes what qemu-img makes;
//! `x-blockdev-amend` adds and removes key slots of `luks` volumes and encrypted qcow2
//! images as `qemu-img amend` does; refusals use QEMU's words, and the key shows nowhere.

mod common;

use std::path::Path;
use std::time::Duration;

use common::rawqmp::{monitor_args, RawQmp};
use common::{run, run_ok, tmpdir, Stord};

const PASS0: &str = "s3cr3t-pass";
const PASS1: &str = "n3w-pass";

fn secret(id: &str, pass: &str) -> String {
    format!("secret,id={id},data={pass}")
}

/// QEMU's options for the encrypted image `file` (`backing`: its backing file's secret,
/// when that is encrypted too).
fn qopts(file: &str, backing: Option<&str>) -> String {
    let mut o = format!("driver=qcow2,file.filename={file},encrypt.key-secret=sec0");
    if let Some(b) = backing {
        o.push_str(&format!(",backing.encrypt.key-secret={b}"));
    }
    o
}

/// Runs qemu-io's `cmds` on `target` (an NBD URI as raw, else image options) with the
/// secrets sec0 and sec1.
fn qemu_io(target: &str, cmds: &[&str]) -> String {
    let (s0, s1) = (secret("sec0", PASS0), secret("sec1", PASS1));
    let mut args = vec!["--object", &s0, "--object", &s1];
    if target.starts_with("nbd") {
        args.extend(["-f", "raw"]);
    } else {
        args.push("--image-opts");
    }
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(target);
    let out = run_ok("qemu-io", &args);
    assert!(
        !out.contains("Pattern verification failed") && !out.contains("failed:"),
        "qemu-io {cmds:?} on {target}: {out}"
    );
    out
}

/// `qemu-img` with both secrets and `--image-opts`, asserting success.
fn qemu_img(cmd: &str, args: &[&str]) -> String {
    let (s0, s1) = (secret("sec0", PASS0), secret("sec1", PASS1));
    let mut a = vec![cmd, "--object", &s0, "--object", &s1, "--image-opts"];
    a.extend(args);
    run_ok("qemu-img", &a)
}

fn check_clean(opts: &str) {
    let out = qemu_img("check", &[opts]);
    assert!(out.contains("No errors were found"), "{out}");
}

/// What QEMU writes first (a compressed cluster among it), then what both write (into
/// the compressed cluster too), then what both read back.
const BEFORE: &[&str] = &[
    "write -P 0x5a 0 256k",
    "write -P 0x21 1M 4k",
    "write -c -P 0x5c 6M 64k",
];
const WRITES: &[&str] = &[
    "write -P 0x77 64k 64k",
    "write -P 0x11 300 5",
    "write -P 0x12 4095 2",
    "write -z 512k 100k",
    "write -P 0x33 2M 1M",
    "write -P 0x44 5000000 70000",
    "write -P 0x66 6200k 3k",
    "write -z -u 7M 128k",
    "discard 3M 64k",
    "flush",
];
const CHECKS: &[&str] = &[
    "read -P 0x5a 0 300",
    "read -P 0x11 300 5",
    "read -P 0x5a 305 3790",
    "read -P 0x12 4095 2",
    "read -P 0x77 64k 64k",
    "read -P 0x5a 128k 128k",
    "read -P 0 512k 100k",
    "read -P 0x21 1M 4k",
    "read -P 0x33 2M 1M",
    "read -P 0x44 5000000 70000",
    "read -P 0x5c 6M 56k",
    "read -P 0x66 6200k 3k",
    "read -P 0x5c 6203k 5k",
    "read -P 0 7M 128k",
];

/// The backing file of a side-by-side image.
#[derive(Clone, Copy, PartialEq)]
enum Backing {
    None,
    Plain,
    /// Encrypted with sec1.
    Encrypted,
}

/// The backing file `base.qcow2` of `kind`, with data where the top has none.
fn make_base(dir: &Path, kind: Backing) -> String {
    let base = dir.join("base.qcow2").display().to_string();
    let s1 = secret("sec1", PASS1);
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if kind == Backing::Encrypted {
        args.extend([
            "--object",
            &s1,
            "-o",
            "encrypt.format=luks,encrypt.key-secret=sec1,encrypt.iter-time=10",
        ]);
    }
    args.extend([base.as_str(), "8M"]);
    run_ok("qemu-img", &args);
    let o = match kind {
        Backing::Encrypted => format!("driver=qcow2,file.filename={base},encrypt.key-secret=sec1"),
        _ => format!("driver=qcow2,file.filename={base}"),
    };
    qemu_io(&o, &["write -P 0xb1 0 8M"]);
    base
}

/// stord serving the encrypted `image` (over `base` of `kind`) as export `disk`.
fn stord_over(dir: &Path, image: &str, base: Option<(&str, Backing)>) -> Stord {
    let mut args: Vec<String> = ["sec0", "sec1"]
        .iter()
        .zip([PASS0, PASS1])
        .flat_map(|(id, p)| ["--object".to_string(), secret(id, p)])
        .collect();
    // Discards unmap, as qemu-io's do.
    let mut top = format!(
        "driver=qcow2,node-name=disk,file.driver=file,file.filename={image},\
         encrypt.format=luks,encrypt.key-secret=sec0,discard=unmap"
    );
    if let Some((b, Backing::Encrypted)) = base {
        // QEMU takes `backing.encrypt.*` for the backing file the image names; stord
        // takes the node.
        args.push("--blockdev".into());
        args.push(format!(
            "driver=qcow2,node-name=base,read-only=on,file.driver=file,file.filename={b},\
             encrypt.format=luks,encrypt.key-secret=sec1"
        ));
        top.push_str(",backing=base");
    }
    let s = dir.join("nbd.sock");
    args.extend([
        "--object".into(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        top,
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", s.display()),
        "--export".into(),
        "type=nbd,id=exp0,node-name=disk,name=disk,writable=on,iothread=io0".into(),
    ]);
    Stord::start(dir, &args)
}

/// Whether `file` holds a sector of `byte` as it is (plaintext on the disk).
fn holds_plain_sector(file: &str, byte: u8) -> bool {
    let data = std::fs::read(file).unwrap();
    data.chunks(512)
        .any(|c| c.len() == 512 && c.iter().all(|&b| b == byte))
}

/// One image made by qemu-img with `opts`, written by QEMU and by stord side by side.
fn side_by_side(name: &str, opts: &str, backing: Backing) {
    let dir = tmpdir(&format!("qcrypt-{name}"));
    let a = dir.join("a.qcow2").display().to_string();
    let b = dir.join("b.qcow2").display().to_string();
    let base = (backing != Backing::None).then(|| make_base(&dir, backing));
    let s0 = secret("sec0", PASS0);
    let o = format!("encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10{opts}");
    let mut args = vec!["create", "-q", "-f", "qcow2", "--object", &s0, "-o", &o];
    if let Some(base) = &base {
        args.extend(["-b", base, "-F", "qcow2"]);
    }
    args.extend([a.as_str(), "8M"]);
    run_ok("qemu-img", &args);
    let bsec = (backing == Backing::Encrypted).then_some("sec1");
    qemu_io(&qopts(&a, bsec), BEFORE);
    std::fs::copy(&a, &b).unwrap();
    {
        let s = stord_over(&dir, &a, base.as_deref().map(|b| (b, backing)));
        let reads: Vec<String> = BEFORE
            .iter()
            .map(|c| c.replace("write -c", "read").replace("write", "read"))
            .collect();
        let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
        qemu_io(&s.uri(), &reads);
        qemu_io(&s.uri(), WRITES);
        qemu_io(&s.uri(), CHECKS);
    }
    qemu_io(&qopts(&b, bsec), WRITES);
    qemu_io(&qopts(&a, bsec), CHECKS);
    qemu_img("compare", &[&qopts(&a, bsec), &qopts(&b, bsec)]);
    for f in [&a, &b] {
        check_clean(&qopts(f, bsec));
    }
    // What stord wrote is on the disk encrypted (QEMU's too); the compressed cluster is
    // stored as QEMU stores it, unencrypted.
    for byte in [0x77, 0x33, 0x44] {
        assert!(
            !holds_plain_sector(&a, byte),
            "{name}: {byte:#x} in the clear"
        );
    }
}

#[test]
fn default_cipher() {
    side_by_side("xts", "", Backing::None);
}

#[test]
fn aes_128_cbc_essiv_with_subclusters() {
    side_by_side(
        "essiv-l2",
        ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,\
         encrypt.ivgen-hash-alg=sha256,extended_l2=on,cluster_size=64k",
        Backing::None,
    );
}

#[test]
fn over_a_plain_backing_file() {
    side_by_side("plain-base", "", Backing::Plain);
}

#[test]
fn over_a_plain_backing_file_with_subclusters() {
    side_by_side(
        "plain-base-l2",
        ",extended_l2=on,cluster_size=32k",
        Backing::Plain,
    );
}

#[test]
fn over_an_encrypted_backing_file() {
    side_by_side(
        "enc-base",
        ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv",
        Backing::Encrypted,
    );
}

#[test]
fn over_an_encrypted_backing_file_with_subclusters() {
    side_by_side("enc-base-l2", ",extended_l2=on", Backing::Encrypted);
}

/// Runs `cmd` and asserts it returned.
fn ok(q: &mut RawQmp, cmd: &str) -> serde_json::Value {
    let r = q.send(cmd);
    assert!(r.get("return").is_some(), "{cmd}: {r}");
    r
}

/// stord with both secrets and a QMP monitor on `dir/qmp.sock`.
fn stord_qmp(dir: &Path) -> (Stord, RawQmp) {
    let sock = dir.join("qmp.sock");
    let mut args = vec![
        "--object".to_string(),
        secret("sec0", PASS0),
        "--object".to_string(),
        secret("sec1", PASS1),
    ];
    args.extend(monitor_args(&sock));
    let s = Stord::start(dir, &args);
    let mut q = RawQmp::connect(&sock);
    q.r.get_mut()
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    (s, q)
}

/// `blockdev-add` of qcow2 image `file` as `name` (`extra`: more members, JSON).
fn add(q: &mut RawQmp, name: &str, file: &str, extra: &str) {
    ok(
        q,
        &format!(
            r#"{{"execute":"blockdev-add","arguments":{{"driver":"qcow2","node-name":"{name}","file":{{"driver":"file","filename":"{file}"}}{extra}}}}}"#
        ),
    );
}

const ENC: &str = r#","encrypt":{"format":"luks","key-secret":"sec0"}"#;

/// Runs job `cmd` (id `id`) to its end; a mirror or an active commit is completed once
/// ready.
fn run_job(q: &mut RawQmp, cmd: &str, id: &str, ready_first: bool) {
    ok(q, cmd);
    if ready_first {
        q.wait_event("BLOCK_JOB_READY", "device", id);
        ok(
            q,
            &format!(r#"{{"execute":"job-complete","arguments":{{"id":"{id}"}}}}"#),
        );
    }
    let e = q.wait_event("BLOCK_JOB_COMPLETED", "device", id);
    assert!(e["data"].get("error").is_none(), "{e}");
}

fn create(args: &[&str]) {
    let s0 = secret("sec0", PASS0);
    let mut a = vec!["create", "-q", "-f", "qcow2", "--object", &s0];
    a.extend(args);
    run_ok("qemu-img", &a);
}

const ENC_OPTS: &str = "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10";

/// Mirror from an encrypted image to a plain one, backup from a plain one to an encrypted
/// one, and a commit of a plain overlay into its encrypted base, through stord's QMP:
/// QEMU reads each target as it reads the source.
#[test]
fn mirror_backup_and_commit_between_encrypted_and_plain_images() {
    let dir = tmpdir("qcrypt-jobs");
    let p = |n: &str| dir.join(n).display().to_string();
    let plain = |f: &str| format!("driver=qcow2,file.filename={f}");
    let data = [
        "write -P 0x31 0 1M",
        "write -P 0x32 3000k 5k",
        "write -c -P 0x33 5M 64k",
    ];
    create(&["-o", ENC_OPTS, &p("enc.qcow2"), "8M"]);
    qemu_io(&qopts(&p("enc.qcow2"), None), &data);
    create(&[&p("plain-target.qcow2"), "8M"]);
    create(&[&p("plain.qcow2"), "8M"]);
    qemu_io(&plain(&p("plain.qcow2")), &data);
    create(&["-o", ENC_OPTS, &p("enc-target.qcow2"), "8M"]);
    // The commit's chain: an encrypted base under a plain overlay.
    create(&["-o", ENC_OPTS, &p("base.qcow2"), "8M"]);
    qemu_io(&qopts(&p("base.qcow2"), None), &["write -P 0x41 0 4M"]);
    create(&["-b", &p("base.qcow2"), "-F", "qcow2", &p("top.qcow2"), "8M"]);
    let top_opts = format!("{},backing.encrypt.key-secret=sec0", plain(&p("top.qcow2")));
    qemu_io(&top_opts, &["write -P 0x42 1M 1500k", "write -z 3M 64k"]);
    let flat = p("flat.raw");
    qemu_img("convert", &[&top_opts, "-O", "raw", &flat]);
    let (_s, mut q) = stord_qmp(&dir);
    add(&mut q, "enc", &p("enc.qcow2"), ENC);
    add(&mut q, "pt", &p("plain-target.qcow2"), "");
    run_job(
        &mut q,
        r#"{"execute":"blockdev-mirror","arguments":{"job-id":"mi","device":"enc","target":"pt","sync":"full"}}"#,
        "mi",
        true,
    );
    add(&mut q, "plain", &p("plain.qcow2"), "");
    add(&mut q, "et", &p("enc-target.qcow2"), ENC);
    run_job(
        &mut q,
        r#"{"execute":"blockdev-backup","arguments":{"job-id":"bk","device":"plain","target":"et","sync":"full"}}"#,
        "bk",
        false,
    );
    add(&mut q, "base", &p("base.qcow2"), ENC);
    add(&mut q, "top", &p("top.qcow2"), r#","backing":"base""#);
    run_job(
        &mut q,
        r#"{"execute":"block-commit","arguments":{"job-id":"co","device":"top"}}"#,
        "co",
        true,
    );
    // The committed overlay left the graph with its job; the rest go now.
    for n in ["enc", "pt", "plain", "et", "top", "base"] {
        q.send(&format!(
            r#"{{"execute":"blockdev-del","arguments":{{"node-name":"{n}"}}}}"#
        ));
    }
    let enc = |f: &str| qopts(&p(f), None);
    qemu_img(
        "compare",
        &[&enc("enc.qcow2"), &plain(&p("plain-target.qcow2"))],
    );
    qemu_img(
        "compare",
        &[&plain(&p("plain.qcow2")), &enc("enc-target.qcow2")],
    );
    qemu_img(
        "compare",
        &[
            &enc("base.qcow2"),
            &format!("driver=raw,file.filename={flat}"),
        ],
    );
    for f in ["enc-target.qcow2", "base.qcow2"] {
        check_clean(&enc(f));
        assert!(!holds_plain_sector(&p(f), 0x42), "{f}: data in the clear");
    }
    check_clean(&plain(&p("plain-target.qcow2")));
}

/// An internal snapshot taken through stord's QMP, then writes into the clusters it
/// shares: the copies are encrypted again at their new place, and QEMU reads both the
/// image and the snapshot as they should be.
#[test]
fn internal_snapshots_of_an_encrypted_image() {
    let dir = tmpdir("qcrypt-snapshot");
    let a = dir.join("a.qcow2").display().to_string();
    create(&["-o", ENC_OPTS, &a, "8M"]);
    qemu_io(
        &qopts(&a, None),
        &["write -P 0x31 0 1M", "write -P 0x32 4M 64k"],
    );
    let sock = dir.join("qmp.sock");
    let nbd = dir.join("nbd.sock");
    let mut args = vec![
        "--object".to_string(),
        secret("sec0", PASS0),
        "--blockdev".into(),
        format!(
            "driver=qcow2,node-name=disk,file.driver=file,file.filename={a},\
             encrypt.format=luks,encrypt.key-secret=sec0"
        ),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", nbd.display()),
        "--export".into(),
        "type=nbd,id=exp0,node-name=disk,name=disk,writable=on".into(),
    ];
    args.extend(monitor_args(&sock));
    let s = Stord::start(&dir, &args);
    let mut q = RawQmp::connect(&sock);
    ok(
        &mut q,
        r#"{"execute":"blockdev-snapshot-internal-sync","arguments":{"device":"disk","name":"s1"}}"#,
    );
    let after = [
        "write -P 0x51 100k 8k",
        "write -P 0x52 4100k 1k",
        "write -P 0x53 7M 3k",
    ];
    qemu_io(&s.uri(), &after);
    drop(q);
    drop(s);
    let now = [
        "read -P 0x31 0 100k",
        "read -P 0x51 100k 8k",
        "read -P 0x31 108k 916k",
        "read -P 0x32 4M 4k",
        "read -P 0x52 4100k 1k",
        "read -P 0x32 4101k 59k",
        "read -P 0x53 7M 3k",
    ];
    qemu_io(&qopts(&a, None), &now);
    check_clean(&qopts(&a, None));
    let snap = dir.join("s1.raw").display().to_string();
    qemu_img(
        "convert",
        &[
            "-l",
            "snapshot.name=s1",
            &qopts(&a, None),
            "-O",
            "raw",
            &snap,
        ],
    );
    qemu_io(
        &format!("driver=raw,file.filename={snap}"),
        &[
            "read -P 0x31 0 1M",
            "read -P 0x32 4M 64k",
            "read -P 0 7M 3k",
        ],
    );
}

/// Runs `blockdev-create` with `options` to its end; the job's error, if any.
fn blockdev_create(q: &mut RawQmp, id: &str, options: &str) -> Option<String> {
    ok(
        q,
        &format!(
            r#"{{"execute":"blockdev-create","arguments":{{"job-id":"{id}","options":{options}}}}}"#
        ),
    );
    q.wait_event("JOB_STATUS_CHANGE", "status", "concluded");
    let job = job_entry(q, id);
    ok(
        q,
        &format!(r#"{{"execute":"job-dismiss","arguments":{{"id":"{id}"}}}}"#),
    );
    job.get("error").map(|e| e.as_str().unwrap().to_string())
}

fn job_entry(q: &mut RawQmp, id: &str) -> serde_json::Value {
    let jobs = ok(q, r#"{"execute":"query-jobs"}"#);
    jobs["return"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == id)
        .unwrap()
        .clone()
}

/// `qemu-img info` of an image, with what differs from image to image blanked out (its
/// name, UUID, iteration counts, sizes on disk).
fn info(file: &str) -> serde_json::Value {
    let out = run_ok("qemu-img", &["info", "--output=json", file]);
    let mut v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let e = &mut v["format-specific"]["data"]["encrypt"];
    e["uuid"] = "-".into();
    e["master-key-iters"] = 0.into();
    for s in e["slots"].as_array_mut().unwrap() {
        if s.get("iters").is_some() {
            s["iters"] = 0.into();
        }
    }
    v["filename"] = "-".into();
    v["actual-size"] = 0.into();
    v["children"] = serde_json::Value::Null;
    v
}

/// `blockdev-create` of encrypted qcow2 images: `qemu-img info` reads them as it reads
/// qemu-img's (but for UUIDs, salts and iteration counts), `qemu-img check` finds them
/// clean and QEMU reads and writes them; QEMU's errors where it has them.
#[test]
fn blockdev_create_makes_what_qemu_img_makes() {
    let dir = tmpdir("qcrypt-create");
    let p = |n: &str| dir.join(n).display().to_string();
    let (_s, mut q) = stord_qmp(&dir);
    for (name, extra, qemu) in [
        ("xts", "", ""),
        (
            "essiv",
            r#","cipher-alg":"aes-128","cipher-mode":"cbc","ivgen-alg":"essiv","ivgen-hash-alg":"sha256","hash-alg":"sha1""#,
            ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,\
             encrypt.ivgen-hash-alg=sha256,encrypt.hash-alg=sha1",
        ),
    ] {
        for (l2, l2_json, l2_qemu) in [
            ("", "", ""),
            (
                "-l2",
                r#","extended-l2":true,"cluster-size":32768"#,
                ",extended_l2=on,cluster_size=32k",
            ),
        ] {
            let ours = p(&format!("{name}{l2}.qcow2"));
            let theirs = p(&format!("{name}{l2}-qemu.qcow2"));
            std::fs::write(&ours, b"").unwrap();
            let node = format!("f-{name}{l2}");
            ok(
                &mut q,
                &format!(
                    r#"{{"execute":"blockdev-add","arguments":{{"driver":"file","node-name":"{node}","filename":"{ours}"}}}}"#
                ),
            );
            let opts = format!(
                r#"{{"driver":"qcow2","file":"{node}","size":67108864{l2_json},"encrypt":{{"format":"luks","key-secret":"sec0","iter-time":10{extra}}}}}"#
            );
            assert_eq!(blockdev_create(&mut q, &format!("c-{node}"), &opts), None);
            create(&["-o", &format!("{ENC_OPTS}{qemu}{l2_qemu}"), &theirs, "64M"]);
            assert_eq!(info(&ours), info(&theirs), "{name}{l2}");
            check_clean(&qopts(&ours, None));
            qemu_io(
                &qopts(&ours, None),
                &[
                    "write -P 0x42 1M 64k",
                    "read -P 0x42 1M 64k",
                    "read -P 0 0 1M",
                ],
            );
            check_clean(&qopts(&ours, None));
        }
    }
    let bad = |q: &mut RawQmp, id: &str, encrypt: &str| {
        let opts =
            format!(r#"{{"driver":"qcow2","file":"f-xts","size":1048576,"encrypt":{encrypt}}}"#);
        blockdev_create(q, id, &opts).expect("the job fails")
    };
    assert_eq!(
        bad(&mut q, "b1", r#"{"format":"luks","key-secret":"nope"}"#),
        "No secret with id 'nope'"
    );
    assert_eq!(
        bad(&mut q, "b2", r#"{"format":"luks"}"#),
        "Parameter 'encrypt.key-secret' is required for cipher"
    );
    // The union's tag is required, as QEMU's schema has it.
    let r = q.send(
        r#"{"execute":"blockdev-create","arguments":{"job-id":"b3","options":{"driver":"qcow2","file":"f-xts","size":1048576,"encrypt":{"key-secret":"sec0"}}}}"#,
    );
    let e = r["error"]["desc"].as_str().unwrap_or_default().to_string();
    assert!(e.contains("encrypt.format"), "{r}");
}

/// Key slots of `image` (a file, or image options): which are active.
fn active_slots(image: &str) -> Vec<bool> {
    let mut args = vec!["info", "--output=json", "-U"];
    if image.starts_with("driver=") {
        args.push("--image-opts");
    }
    args.push(image);
    let out = run_ok("qemu-img", &args);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let d = &v["format-specific"]["data"];
    let slots = d["encrypt"]["slots"].as_array().or(d["slots"].as_array());
    slots.unwrap().iter().map(|s| s["active"] == true).collect()
}

/// Whether QEMU opens the volume behind `opts` (which name key-secret sec0) with `pass`.
fn opens_with(opts: &str, pass: &str) -> bool {
    let s = secret("sec0", pass);
    let out = run(
        "qemu-io",
        &[
            "--object",
            &s,
            "--image-opts",
            opts,
            "-c",
            "read -P 0x3c 0 64k",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() || err.contains("Invalid password, cannot unlock any keyslot"),
        "{err}"
    );
    out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("failed")
}

/// Runs `x-blockdev-amend` of `node` with `options` to its end; the job's error, if any.
fn amend(q: &mut RawQmp, id: &str, node: &str, options: &str, force: bool) -> Option<String> {
    ok(
        q,
        &format!(
            r#"{{"execute":"x-blockdev-amend","arguments":{{"job-id":"{id}","node-name":"{node}","options":{options},"force":{force}}}}}"#
        ),
    );
    for _ in 0..6000 {
        let j = job_entry(q, id);
        if j["status"] == "concluded" {
            ok(
                q,
                &format!(r#"{{"execute":"job-dismiss","arguments":{{"id":"{id}"}}}}"#),
            );
            return j.get("error").map(|e| e.as_str().unwrap().to_string());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("amend {id} did not conclude");
}

/// One amendment done by stord (`node`'s `options`, a JSON member list) and by `qemu-img
/// amend` (`-o` `qemu`) on a copy; the key slots come out the same.
struct Step<'a> {
    json: &'a str,
    qemu: &'a str,
    /// The secret qemu-img opens the copy with (the slot the image opened with may be
    /// gone).
    open_pass: &'a str,
}

fn amend_side_by_side(
    dir: &Path,
    kind: &str,
    opts: impl Fn(&str) -> String,
    prefix: &str,
    steps: &[Step<'_>],
) {
    let a = dir.join(format!("a.{kind}")).display().to_string();
    let b = dir.join(format!("b.{kind}")).display().to_string();
    qemu_io(&opts(&a), &["write -P 0x3c 0 64k"]);
    std::fs::copy(&a, &b).unwrap();
    let (s, mut q) = stord_qmp(dir);
    let drv = if kind == "luks" { "luks" } else { "qcow2" };
    let node = format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"{drv}","node-name":"n","file":{{"driver":"file","filename":"{a}"}},"#
    );
    let node = if kind == "luks" {
        format!(r#"{node}"key-secret":"sec0"}}}}"#)
    } else {
        format!(r#"{node}"encrypt":{{"format":"luks","key-secret":"sec0"}}}}}}"#)
    };
    ok(&mut q, &node);
    for (i, st) in steps.iter().enumerate() {
        let o = format!(r#"{{"driver":"{drv}",{}}}"#, st.json);
        let e = amend(&mut q, &format!("am{i}"), "n", &o, false);
        assert_eq!(e, None, "{kind} step {i}");
        let s0 = secret("sec0", st.open_pass);
        let s1 = secret("sec1", PASS1);
        let s2 = secret("sec2", PASS0);
        let o = st.qemu.replace("%", prefix);
        run_ok(
            "qemu-img",
            &[
                "amend",
                "--object",
                &s0,
                "--object",
                &s1,
                "--object",
                &s2,
                "--image-opts",
                &opts(&b),
                "-o",
                &o,
            ],
        );
        assert_eq!(active_slots(&a), active_slots(&b), "{kind} step {i}");
    }
    // The node reads on with its key.
    let r = ok(
        &mut q,
        r#"{"execute":"query-named-block-nodes","arguments":{"flat":true}}"#,
    );
    assert!(!r.to_string().contains(PASS0) && !r.to_string().contains(PASS1));
    drop(q);
    drop(s);
    for f in [&a, &b] {
        assert!(
            opens_with(&opts(f), PASS1),
            "{kind}: the new secret opens it"
        );
        assert!(
            !opens_with(&opts(f), PASS0),
            "{kind}: the old one no longer"
        );
    }
}

/// Key slots added and erased by `x-blockdev-amend` on a `luks` volume and on an encrypted
/// qcow2 image, as `qemu-img amend` changes them; QEMU opens the result with the new
/// secret and not with the removed one; refusals in QEMU's words.
#[test]
fn amend_adds_and_erases_key_slots_as_qemu_img_amend() {
    let steps = [
        // sec1 into a new slot (slot 1), the open secret unlocking the key.
        Step {
            json: r#""state":"active","new-secret":"sec1","iter-time":10"#,
            qemu: "%state=active,%new-secret=sec1,%iter-time=10",
            open_pass: PASS0,
        },
        // sec1 again into slot 5, unlocked with sec1 (`secret`).
        Step {
            json: r#""state":"active","new-secret":"sec1","keyslot":5,"secret":"sec1","iter-time":10"#,
            qemu: "%state=active,%new-secret=sec1,%keyslot=5,%iter-time=10",
            open_pass: PASS0,
        },
        // Slot 5 erased by index, then every slot holding the old password.
        Step {
            json: r#""state":"inactive","keyslot":5"#,
            qemu: "%state=inactive,%keyslot=5",
            open_pass: PASS1,
        },
        // On the stord side sec0 is still the old password; qemu-img's sec2 is.
        Step {
            json: r#""state":"inactive","old-secret":"sec0""#,
            qemu: "%state=inactive,%old-secret=sec2",
            open_pass: PASS1,
        },
    ];
    let dir = tmpdir("qcrypt-amend-luks");
    let a = dir.join("a.luks").display().to_string();
    let s0 = secret("sec0", PASS0);
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "luks",
            "--object",
            &s0,
            "-o",
            "key-secret=sec0,iter-time=10",
            &a,
            "4M",
        ],
    );
    let luks = |f: &str| format!("driver=luks,file.filename={f},key-secret=sec0");
    amend_side_by_side(&dir, "luks", luks, "", &steps);
    let dir = tmpdir("qcrypt-amend-qcow2");
    let a = dir.join("a.qcow2").display().to_string();
    create(&["-o", ENC_OPTS, &a, "4M"]);
    let steps: Vec<Step<'_>> = steps
        .iter()
        .map(|s| Step {
            json: Box::leak(
                format!(r#""encrypt":{{"format":"luks",{}}}"#, s.json).into_boxed_str(),
            ),
            ..*s
        })
        .collect();
    amend_side_by_side(&dir, "qcow2", |f| qopts(f, None), "encrypt.", &steps);
}

/// A key slot added to a detached LUKS header (made by stord's `blockdev-create`): the
/// header's node is written, and QEMU opens the volume with the new secret.
#[test]
fn amend_writes_a_detached_header() {
    let dir = tmpdir("qcrypt-amend-detached");
    let p = |n: &str| dir.join(n).display().to_string();
    let (_s, mut q) = stord_qmp(&dir);
    for (node, f) in [("h", "vol.hdr"), ("d", "vol.img")] {
        std::fs::write(p(f), b"").unwrap();
        ok(
            &mut q,
            &format!(
                r#"{{"execute":"blockdev-add","arguments":{{"driver":"file","node-name":"{node}","filename":"{}"}}}}"#,
                p(f)
            ),
        );
    }
    let opts = r#"{"driver":"luks","header":"h","file":"d","size":1048576,"key-secret":"sec0","iter-time":10}"#;
    assert_eq!(blockdev_create(&mut q, "c", opts), None);
    ok(
        &mut q,
        r#"{"execute":"blockdev-add","arguments":{"driver":"luks","node-name":"l","file":"d","header":"h","key-secret":"sec0"}}"#,
    );
    let add = r#"{"driver":"luks","state":"active","new-secret":"sec1","iter-time":10}"#;
    assert_eq!(amend(&mut q, "a", "l", add, false), None);
    let before = std::fs::read(p("vol.img")).unwrap();
    let erase = r#"{"driver":"luks","state":"inactive","keyslot":0}"#;
    assert_eq!(amend(&mut q, "b", "l", erase, false), None);
    assert_eq!(
        std::fs::read(p("vol.img")).unwrap(),
        before,
        "the payload untouched"
    );
    let vol = format!(
        "driver=luks,file.filename={},header.driver=file,header.filename={},key-secret=sec0",
        p("vol.img"),
        p("vol.hdr")
    );
    qemu_io(&vol.replace("sec0", "sec1"), &["write -P 0x3c 0 64k"]);
    assert!(opens_with(&vol, PASS1));
    assert!(!opens_with(&vol, PASS0));
    assert_eq!(
        active_slots(&vol),
        [false, true, false, false, false, false, false, false]
    );
}

/// Refusals of `x-blockdev-amend` in QEMU's words, the image left as it was.
#[test]
fn amend_refusals_say_what_qemu_says() {
    let dir = tmpdir("qcrypt-amend-refused");
    let a = dir.join("a.qcow2").display().to_string();
    let plain = dir.join("plain.qcow2").display().to_string();
    create(&["-o", ENC_OPTS, &a, "4M"]);
    create(&[&plain, "4M"]);
    let before = std::fs::read(&a).unwrap();
    let (_s, mut q) = stord_qmp(&dir);
    add(&mut q, "n", &a, ENC);
    add(&mut q, "p", &plain, "");
    let enc = |m: &str| format!(r#"{{"driver":"qcow2","encrypt":{{"format":"luks",{m}}}}}"#);
    for (node, options, force, want) in [
        (
            "n",
            enc(r#""state":"inactive","keyslot":0"#),
            false,
            "Attempt to erase the only active keyslot 0 which will erase all the data in the image irreversibly - refusing operation",
        ),
        (
            "n",
            enc(r#""state":"active","new-secret":"sec1","keyslot":0"#),
            false,
            "Refusing to overwrite active keyslot 0 - please erase it first",
        ),
        (
            "n",
            enc(r#""state":"active","new-secret":"nope""#),
            false,
            "No secret with id 'nope'",
        ),
        (
            "n",
            enc(r#""state":"active","new-secret":"sec1","secret":"sec1""#),
            true,
            "Invalid password, cannot unlock any keyslot",
        ),
        (
            "n",
            enc(r#""state":"inactive","old-secret":"sec1""#),
            false,
            "No keyslots match given (old) password for erase operation",
        ),
        (
            "p",
            enc(r#""state":"active","new-secret":"sec1""#),
            false,
            "image is not encrypted, can't amend",
        ),
    ] {
        assert_eq!(
            amend(&mut q, "x", node, &options, force).as_deref(),
            Some(want),
            "{options}"
        );
    }
    assert_eq!(std::fs::read(&a).unwrap(), before, "nothing was written");
}

/// stord's error for `--blockdev blockdev` with `objects` (it must refuse to start).
fn refused(dir: &Path, objects: &[String], blockdev: &str) -> String {
    let pid = dir.join("never.pid").display().to_string();
    let mut args = vec!["60".to_string(), env!("CARGO_BIN_EXE_stord").to_string()];
    for o in objects {
        args.extend(["--object".to_string(), o.clone()]);
    }
    args.extend([
        "--blockdev".into(),
        blockdev.into(),
        "--pidfile".into(),
        pid,
    ]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run("timeout", &a);
    assert!(!out.status.success(), "stord opened {blockdev}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Opens that QEMU refuses are refused with its words (a wrong secret, none, a format the
/// header contradicts, legacy AES); an opened image says `encrypted` and shows no key.
#[test]
fn refusals_and_queries_as_qemu_gives_them() {
    let dir = tmpdir("qcrypt-refused");
    let p = |n: &str| dir.join(n).display().to_string();
    create(&["-o", ENC_OPTS, &p("a.qcow2"), "4M"]);
    create(&[&p("plain.qcow2"), "4M"]);
    let s0 = secret("sec0", PASS0);
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "--object",
            &s0,
            "-o",
            "encrypt.format=aes,encrypt.key-secret=sec0",
            &p("aes.qcow2"),
            "4M",
        ],
    );
    let node = |f: &str, extra: &str| {
        format!(
            "driver=qcow2,node-name=n,file.driver=file,file.filename={}{extra}",
            p(f)
        )
    };
    let ok_secret = vec![secret("sec0", PASS0)];
    for (objects, blockdev, want) in [
        (
            vec![secret("sec0", "wrong")],
            node("a.qcow2", ",encrypt.format=luks,encrypt.key-secret=sec0"),
            "Invalid password, cannot unlock any keyslot",
        ),
        (
            ok_secret.clone(),
            node("a.qcow2", ""),
            "Parameter 'encrypt.key-secret' is required for cipher",
        ),
        (
            ok_secret.clone(),
            node("a.qcow2", ",encrypt.format=luks,encrypt.key-secret=nope"),
            "No secret with id 'nope'",
        ),
        (
            ok_secret.clone(),
            node("a.qcow2", ",encrypt.format=aes,encrypt.key-secret=sec0"),
            "Header reported 'luks' encryption format but options specify 'aes'",
        ),
        (
            ok_secret.clone(),
            node("a.qcow2", ",encrypt.key-secret=sec0"),
            "'encrypt.format' is missing",
        ),
        (
            ok_secret.clone(),
            node(
                "plain.qcow2",
                ",encrypt.format=luks,encrypt.key-secret=sec0",
            ),
            "No encryption in image header, but options specified format 'luks'",
        ),
        (
            ok_secret.clone(),
            node("aes.qcow2", ",encrypt.format=aes,encrypt.key-secret=sec0"),
            "Use of AES-CBC encrypted qcow2 images is no longer supported in system emulators",
        ),
    ] {
        let e = refused(&dir, &objects, &blockdev);
        assert!(e.contains(want), "{blockdev}: {e}");
        assert!(!e.contains(PASS0), "the key in an error: {e}");
    }
    let (mut s, mut q) = stord_qmp(&dir);
    add(&mut q, "n", &p("a.qcow2"), ENC);
    let r = ok(
        &mut q,
        r#"{"execute":"query-named-block-nodes","arguments":{"flat":true}}"#,
    );
    let n = r["return"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node-name"] == "n")
        .unwrap();
    assert_eq!(n["encrypted"], true, "{n}");
    assert_eq!(n["image"]["encrypted"], true, "{n}");
    assert!(!r.to_string().contains(PASS0), "{r}");
    drop(q);
    let err = s.stop_and_stderr();
    assert!(!err.contains(PASS0), "{err}");
}
