//! The `copy-on-read` filter side by side with qsd's: reads through it over NBD copy into
//! the top image what its backing chain holds (above `bottom`), and nothing where the chain
//! holds nothing; the top image's map (`qemu-img map`, with depths) is the same after
//! either daemon, and a bottom that is not there is refused in QEMU's words.

mod common;

use std::path::Path;

use common::rawqmp::RawQmp;
use common::side::{start_nodes, words};
use common::{run_ok, tmpdir};

fn p(path: &Path) -> String {
    path.display().to_string()
}

/// `qemu-img map` of `img` as (start, length, data, zero, depth) runs.
fn map(img: &Path) -> Vec<(u64, u64, bool, bool, u64)> {
    let out = run_ok("qemu-img", &["map", "--output=json", &p(img)]);
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
                e["depth"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// base (data at 0 and 1 MiB, zeroes at 2 MiB) <- mid (data at 512 KiB) <- top.
fn chain(dir: &Path) {
    let img = |n: &str| p(&dir.join(n));
    run_ok(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", &img("base.qcow2"), "4M"],
    );
    for c in ["write -P 1 0 128k", "write -P 2 1m 64k", "write -z 2m 64k"] {
        run_ok("qemu-io", &["-f", "qcow2", "-c", c, &img("base.qcow2")]);
    }
    let backed = |name: &str, backing: &str| {
        run_ok(
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                backing,
                "-F",
                "qcow2",
                &img(name),
            ],
        );
    };
    backed("mid.qcow2", &img("base.qcow2"));
    run_ok(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -P 3 512k 64k",
            &img("mid.qcow2"),
        ],
    );
    backed("top.qcow2", &img("mid.qcow2"));
}

/// The chain as named nodes, the filter `b` over the top (with `extra` options).
fn nodes(dir: &Path, extra: &str) -> Vec<String> {
    let node = |name: &str, backing: &str| {
        format!(
            "driver=qcow2,node-name={name},file.driver=file,file.filename={}{backing}",
            p(&dir.join(format!("{name}.qcow2")))
        )
    };
    vec![
        node("base", ""),
        node("mid", ",backing=base"),
        node("top", ",backing=mid"),
        format!("driver=copy-on-read,node-name=b,file=top{extra}"),
    ]
}

const READS: &[&str] = &[
    "read -P 1 0 64k",
    "read -P 2 1032k 4k",
    "read -P 3 520k 8k",
    "read -P 0 2m 64k",
    "read -P 0 3m 64k",
    "write -P 4 64k 4k",
    "read -P 1 100k 28k",
];

#[test]
fn copies_on_read_as_qsd() {
    let stord = env!("CARGO_BIN_EXE_stord");
    let mut per_bottom = Vec::new();
    for extra in ["", ",bottom=mid"] {
        let mut maps = Vec::new();
        for (i, binary) in ["qemu-storage-daemon", stord].into_iter().enumerate() {
            let dir = tmpdir(&format!("cor-{i}{}", extra.len()));
            chain(&dir);
            let n = nodes(&dir, extra);
            let refs: Vec<&str> = n.iter().map(String::as_str).collect();
            let (mut d, sock) =
                start_nodes(binary, &dir, &refs).unwrap_or_else(|e| panic!("{binary}: {e}"));
            let uri = format!("nbd+unix:///b?socket={}", p(&sock));
            let mut args = vec!["-f", "raw"];
            for c in READS {
                args.extend(["-c", c]);
            }
            args.push(&uri);
            let out = run_ok("qemu-io", &args);
            assert!(
                !out.contains("fail") && !out.contains("mismatch"),
                "{binary}: {out}"
            );
            let mut q = RawQmp::connect(&dir.join("qmp.sock"));
            q.send(r#"{"execute":"quit"}"#);
            d.0.wait().unwrap();
            run_ok("qemu-img", &["check", "-q", &p(&dir.join("top.qcow2"))]);
            maps.push(map(&dir.join("top.qcow2")));
        }
        assert_eq!(maps[1], maps[0], "{extra:?}: the top's map, stord then qsd");
        let copied = maps[0].iter().filter(|r| r.4 == 0 && r.2).count();
        assert!(copied >= 2, "{extra:?}: nothing copied: {:?}", maps[0]);
        per_bottom.push(maps.swap_remove(0));
    }
    // Above mid, the base's data stays where it is.
    assert_ne!(
        per_bottom[0], per_bottom[1],
        "bottom=mid copied as much as no bottom"
    );
}

#[test]
fn refuses_a_missing_bottom_as_qsd() {
    let dir = tmpdir("cor-bottom");
    chain(&dir);
    let stord = env!("CARGO_BIN_EXE_stord");
    let n = nodes(&dir, ",bottom=nowhere");
    let refs: Vec<&str> = n.iter().map(String::as_str).collect();
    let theirs = start_nodes("qemu-storage-daemon", &dir, &refs)
        .err()
        .expect("qsd refuses");
    let ours = start_nodes(stord, &dir, &refs)
        .err()
        .expect("stord refuses");
    assert_eq!(words(&ours, &n[3]), words(&theirs, &n[3]));
}
