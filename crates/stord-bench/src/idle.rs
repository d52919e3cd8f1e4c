//! `stord-bench idle`: what each daemon costs when nobody uses it. Two IoThreads and an NBD
//! export each (nbdkit: its defaults), no I/O for a while; CPU seconds used.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::nbd::{bench_dir, which};
use crate::peers::{process_cpu_ns, stord_binary, Daemon};

/// One daemon's idle cost.
#[derive(Debug, Serialize)]
pub struct IdleRow {
    pub daemon: String,
    pub seconds: u64,
    pub cpu_ms: f64,
}

/// Runs each daemon idle for `seconds`.
pub fn run(seconds: u64) -> Vec<IdleRow> {
    let dir = bench_dir();
    let sock = dir.join("idle.sock");
    let qsd_style = |bin: PathBuf| {
        (
            bin,
            vec![
                "--object".to_string(),
                "iothread,id=io0".into(),
                "--object".into(),
                "iothread,id=io1".into(),
                "--blockdev".into(),
                "driver=null-co,node-name=n0,size=1073741824".into(),
                "--nbd-server".into(),
                format!("addr.type=unix,addr.path={}", sock.display()),
                "--export".into(),
                "type=nbd,id=e0,node-name=n0,name=n0,iothread=io0".into(),
            ],
        )
    };
    let peers: Vec<(&str, PathBuf, Vec<String>)> = vec![
        (
            "stord",
            qsd_style(stord_binary()).0,
            qsd_style(stord_binary()).1,
        ),
        (
            "qsd",
            which("qemu-storage-daemon"),
            qsd_style(which("qemu-storage-daemon")).1,
        ),
        (
            "nbdkit",
            which("nbdkit"),
            vec![
                "-f".into(),
                "-U".into(),
                sock.display().to_string(),
                "null".into(),
                "1G".into(),
            ],
        ),
    ];
    let mut rows = Vec::new();
    for (name, bin, args) in peers {
        let d = Daemon::start(name, &bin, &args, &sock);
        std::thread::sleep(Duration::from_millis(500));
        let c0 = process_cpu_ns(d.pid());
        std::thread::sleep(Duration::from_secs(seconds));
        let c1 = process_cpu_ns(d.pid());
        let row = IdleRow {
            daemon: name.to_string(),
            seconds,
            cpu_ms: (c1 - c0) as f64 / 1e6,
        };
        println!(
            "{:<8} idle {:>3} s: {:>8.1} ms CPU",
            row.daemon, seconds, row.cpu_ms
        );
        rows.push(row);
    }
    rows
}
