//! The `throttle` filter and `throttle-group` object, as qsd users write them: a limit
//! holds under fio's load (within 5 %), two nodes in one group share it, and a group in
//! use cannot be deleted.

mod common;

use std::path::Path;

use common::rawqmp::{monitor_args, RawQmp};
use common::{run_ok, tmpdir, Stord};

/// fio's IOPS for 4 KiB random reads at QD16 for `secs` seconds against `uri`.
fn fio_iops(uri: &str, secs: u32) -> f64 {
    let out = run_ok(
        "fio",
        &[
            "--name=t",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randread",
            "--bs=4k",
            "--iodepth=16",
            "--time_based",
            &format!("--runtime={secs}"),
            "--output-format=json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    v["jobs"][0]["read"]["iops"].as_f64().unwrap()
}

fn start(dir: &Path, group: &str, exports: &[&str]) -> Stord {
    let img = dir.join("disk.img");
    // Data, not holes: the NBD server answers reads of holes without reading (as qsd's).
    std::fs::write(&img, vec![0x5a; 64 << 20]).unwrap();
    let sock = dir.join("nbd.sock");
    let mut args: Vec<String> = vec![
        "--object".into(),
        "iothread,id=io0".into(),
        "--object".into(),
        format!("throttle-group,id=tg0,{group}"),
        "--blockdev".into(),
        format!("driver=file,node-name=f,filename={}", img.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", sock.display()),
    ];
    for (i, name) in exports.iter().enumerate() {
        args.push("--blockdev".into());
        args.push(format!(
            "driver=throttle,node-name={name},throttle-group=tg0,file=f"
        ));
        args.push("--export".into());
        args.push(format!(
            "type=nbd,id=e{i},node-name={name},name={name},iothread=io0"
        ));
    }
    args.extend(monitor_args(&dir.join("qmp.sock")));
    Stord::start(dir, &args)
}

fn uri(s: &Stord, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", s.sock.display())
}

#[test]
fn a_1000_iops_limit_holds_within_5_percent() {
    let dir = tmpdir("throttle-1000");
    let s = start(&dir, "x-iops-total=1000", &["disk"]);
    let iops = fio_iops(&uri(&s, "disk"), 4);
    eprintln!("{iops:.0} IOPS under a 1000 IOPS limit");
    assert!((950.0..=1050.0).contains(&iops), "{iops} IOPS");
}

#[test]
fn nodes_in_one_group_share_its_limit_and_it_cannot_go_while_used() {
    let dir = tmpdir("throttle-share");
    let s = start(&dir, "limits.iops-total=1000", &["a", "b"]);
    let (ua, ub) = (uri(&s, "a"), uri(&s, "b"));
    let t = std::thread::spawn(move || fio_iops(&ub, 4));
    let a = fio_iops(&ua, 4);
    let b = t.join().unwrap();
    assert!((900.0..=1100.0).contains(&(a + b)), "{a} + {b} IOPS");
    let mut q = RawQmp::connect(&dir.join("qmp.sock"));
    let r = q.send(r#"{"execute":"object-del","arguments":{"id":"tg0"}}"#);
    assert!(r.get("error").is_some(), "{r}");
    drop(s);
}
