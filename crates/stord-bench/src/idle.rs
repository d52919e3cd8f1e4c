//! `stord-bench idle`: what each daemon costs when nobody uses it. Two IoThreads and an NBD
//! export each (nbdkit: its defaults), no I/O for a while; CPU seconds used. The daemons
//! idle side by side (nobody does anything, so they do not disturb each other), which
//! makes the measurement take `seconds` instead of three times that.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::media::bench_dir;
use crate::peers::{process_cpu_ns, stord_binary, which, Daemon};

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
    let sock = |name: &str| dir.join(format!("idle-{name}.sock"));
    let qsd_style = |bin: PathBuf, sock: PathBuf| {
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
    let nbdkit_args = vec![
        "-f".into(),
        "-U".into(),
        sock("nbdkit").display().to_string(),
        "null".into(),
        "1G".into(),
    ];
    let peers: Vec<(&str, PathBuf, Vec<String>)> = vec![
        {
            let (b, a) = qsd_style(stord_binary(), sock("stord"));
            ("stord", b, a)
        },
        {
            let (b, a) = qsd_style(which("qemu-storage-daemon"), sock("qsd"));
            ("qsd", b, a)
        },
        ("nbdkit", which("nbdkit"), nbdkit_args),
    ];
    let running: Vec<(&str, Daemon)> = peers
        .into_iter()
        .map(|(name, bin, args)| (name, Daemon::start(name, &bin, &args, &sock(name))))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let c0: Vec<u64> = running
        .iter()
        .map(|(_, d)| process_cpu_ns(d.pid()))
        .collect();
    std::thread::sleep(Duration::from_secs(seconds));
    let mut rows = Vec::new();
    for ((name, d), c0) in running.iter().zip(c0) {
        let row = IdleRow {
            daemon: name.to_string(),
            seconds,
            cpu_ms: (process_cpu_ns(d.pid()) - c0) as f64 / 1e6,
        };
        println!(
            "{:<8} idle {:>3} s: {:>8.1} ms CPU",
            row.daemon, seconds, row.cpu_ms
        );
        rows.push(row);
    }
    drop(running);
    for name in ["stord", "qsd", "nbdkit"] {
        let _ = std::fs::remove_file(sock(name));
    }
    rows
}
