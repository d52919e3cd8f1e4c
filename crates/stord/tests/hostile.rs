//! Hostile clients: each test reproduces a way one client could exhaust the daemon
//! (memory, descriptors, CPU, log volume) and checks both the bound and that other
//! clients are served meanwhile.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::rawnbd::RawNbd;
use common::rawqmp::RawQmp;
use common::*;

const MIB: u64 = 1 << 20;

fn file_export(name: &str, iothread: bool, extra_server: &str) -> (Stord, std::path::PathBuf) {
    let dir = tmpdir(name);
    let img = dir.join("disk.img");
    sparse_image(&img, 1 << 30);
    let sock = dir.join("nbd.sock");
    let mut args = vec![
        "--object".to_string(),
        "iothread,id=io0".to_string(),
        "--blockdev".into(),
        format!("driver=file,node-name=disk,filename={}", img.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}{extra_server}", sock.display()),
        "--export".into(),
        format!(
            "type=nbd,id=exp0,node-name=disk,name=disk,writable=on{}",
            if iothread { ",iothread=io0" } else { "" }
        ),
    ];
    if !iothread {
        args.drain(..2);
    }
    (Stord::start(&dir, &args), dir)
}

/// The probe that found the problem: 256 pipelined 32 MiB READs, replies never read.
fn pipelined_huge_reads(iothread: bool) {
    let (s, _dir) = file_export(
        if iothread {
            "pipelined-io"
        } else {
            "pipelined-main"
        },
        iothread,
        "",
    );
    let mut bad = RawNbd::connect(&s.sock, "disk");
    let mut reqs = Vec::new();
    for i in 0..256u64 {
        reqs.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        reqs.extend_from_slice(&0u16.to_be_bytes()); // flags
        reqs.extend_from_slice(&0u16.to_be_bytes()); // READ
        reqs.extend_from_slice(&i.to_be_bytes());
        reqs.extend_from_slice(&((i % 30) * 32 * MIB).to_be_bytes());
        reqs.extend_from_slice(&(32u32 << 20).to_be_bytes());
    }
    bad.s.write_all(&reqs).unwrap();

    // Meanwhile a well-behaved client is served, promptly.
    std::thread::sleep(Duration::from_secs(1));
    let mut good = RawNbd::connect(&s.sock, "disk");
    good.s
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let t = Instant::now();
    assert_eq!(good.write(1, 4096, &[0x5a; 4096]), 0);
    let (e, d) = good.read(2, 4096, 4096);
    assert_eq!((e, d), (0, vec![0x5a; 4096]));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // The misbehaving client holds its connection's budget and no more.
    std::thread::sleep(Duration::from_secs(3));
    let peak = s.status_kib("VmHWM") * 1024;
    assert!(
        peak < 1 << 30,
        "peak RSS {} MiB (the issue's bound)",
        peak >> 20
    );
    assert!(
        peak < 256 * MIB,
        "peak RSS {} MiB: one connection's budget is 64 MiB",
        peak >> 20
    );

    // Gone: everything it held is freed within 3 s.
    drop(bad);
    let t = Instant::now();
    loop {
        let rss = s.status_kib("VmRSS") * 1024;
        if rss < 128 * MIB {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "RSS still {} MiB 3 s after the client left",
            rss >> 20
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (e, d) = good.read(3, 4096, 4096);
    assert_eq!((e, d), (0, vec![0x5a; 4096]));
}

/// A connection to export `name` that sends 64 READs of 32 MiB (handles from
/// `c * 1000`) and never reads a reply.
fn pipeline_huge_reads(sock: &std::path::Path, name: &str, c: u64) -> RawNbd {
    let mut conn = RawNbd::connect(sock, name);
    let mut reqs = Vec::new();
    for i in 0..64u64 {
        reqs.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        reqs.extend_from_slice(&0u16.to_be_bytes());
        reqs.extend_from_slice(&0u16.to_be_bytes()); // READ
        reqs.extend_from_slice(&(c * 1000 + i).to_be_bytes());
        reqs.extend_from_slice(&((i % 30) * 32 * MIB).to_be_bytes());
        reqs.extend_from_slice(&(32u32 << 20).to_be_bytes());
    }
    conn.s.write_all(&reqs).unwrap();
    conn
}

/// Many connections that each hold their own budget (64 MiB of 32 MiB reads whose replies
/// they never read) hold the server's `x-buffer-limit` together, not 64 MiB each; a
/// well-behaved client is still served (a connection with nothing in flight always gets a
/// small request through), and the bytes come back when they leave.
#[test]
fn many_connections_together_stay_within_the_servers_buffer_limit() {
    let (s, _dir) = file_export("buffer-limit", true, ",x-buffer-limit=128M");
    let mut bad = Vec::new();
    for c in 0..12u64 {
        bad.push(pipeline_huge_reads(&s.sock, "disk", c));
    }
    std::thread::sleep(Duration::from_secs(2));
    let mut good = RawNbd::connect(&s.sock, "disk");
    good.s
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let t = Instant::now();
    assert_eq!(good.write(1, 4096, &[0x6b; 4096]), 0);
    assert_eq!(good.read(2, 4096, 4096), (0, vec![0x6b; 4096]));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    std::thread::sleep(Duration::from_secs(2));
    // 12 connections at 64 MiB each would be 768 MiB.
    let peak = s.status_kib("VmHWM") * 1024;
    assert!(
        peak < 320 * MIB,
        "peak RSS {} MiB with a 128 MiB server limit",
        peak >> 20
    );
    drop(bad);
    // What they held came back: a 32 MiB read (over the small-request allowance) runs.
    let t = Instant::now();
    let (e, d) = good.read(3, 0, 32 << 20);
    assert_eq!(e, 0);
    assert_eq!(d.len(), 32 << 20);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// A client pipelining 32 MiB reads it never reads holds its connection's budget; many
/// of them on one export hold that export's share (half the server's limit by default),
/// so another export's client still gets a 32 MiB read through at once.
#[test]
fn one_exports_clients_hold_only_that_exports_share() {
    let dir = tmpdir("export-limit");
    let (img, img2) = (dir.join("disk.img"), dir.join("other.img"));
    sparse_image(&img, 1 << 30);
    sparse_image(&img2, 1 << 30);
    let sock = dir.join("nbd.sock");
    let args: Vec<String> = [
        "--object".into(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        format!("driver=file,node-name=disk,filename={}", img.display()),
        "--blockdev".into(),
        format!("driver=file,node-name=other,filename={}", img2.display()),
        "--nbd-server".into(),
        format!(
            "addr.type=unix,addr.path={},x-buffer-limit=128M",
            sock.display()
        ),
        "--export".into(),
        "type=nbd,id=exp0,node-name=disk,name=disk,iothread=io0".into(),
        "--export".into(),
        "type=nbd,id=exp1,node-name=other,name=other,iothread=io0".into(),
    ]
    .to_vec();
    let s = Stord::start(&dir, &args);
    let mut bad = Vec::new();
    for c in 0..12u64 {
        bad.push(pipeline_huge_reads(&s.sock, "disk", c));
    }
    std::thread::sleep(Duration::from_secs(2));
    let mut other = RawNbd::connect(&s.sock, "other");
    other
        .s
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let t = Instant::now();
    let (e, d) = other.read(1, 0, 32 << 20);
    assert_eq!((e, d.len()), (0, 32 << 20));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // A small request on the crowded export still gets through.
    let mut good = RawNbd::connect(&s.sock, "disk");
    good.s
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(good.read(2, 4096, 4096).0, 0);
    let peak = s.status_kib("VmHWM") * 1024;
    assert!(peak < 320 * MIB, "peak RSS {} MiB", peak >> 20);
    drop(bad);
}

#[test]
fn pipelined_reads_never_read_stay_bounded_on_the_main_loop() {
    pipelined_huge_reads(false);
}

#[test]
fn pipelined_reads_never_read_stay_bounded_on_an_iothread() {
    pipelined_huge_reads(true);
}

/// Collects stord's stderr lines as they come (so the pipe never fills).
fn collect_stderr(s: &mut Stord) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let err = s.child.stderr.take().unwrap();
    let l2 = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            l2.lock().unwrap().push(line);
        }
    });
    lines
}

#[test]
fn descriptor_exhaustion_backs_off_quietly_and_recovers() {
    let dir = tmpdir("emfile");
    let img = dir.join("disk.img");
    sparse_image(&img, 64 << 20);
    let sock = dir.join("nbd.sock");
    let args = vec![
        "--blockdev".to_string(),
        format!("driver=file,node-name=disk,filename={}", img.display()),
        "--nbd-server".into(),
        // Idle clients may sit in the handshake for ever.
        format!(
            "addr.type=unix,addr.path={},handshake-max-seconds=0",
            sock.display()
        ),
        "--export".into(),
        "type=nbd,id=exp0,node-name=disk,name=disk".into(),
    ];
    let mut s = Stord::start_wrapped(&dir, &["prlimit", "--nofile=64:64"], &args);
    let lines = collect_stderr(&mut s);
    // More idle clients than the daemon has descriptors: the rest wait in the backlog.
    let idle: Vec<UnixStream> = (0..100)
        .map(|_| UnixStream::connect(&sock).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let failures = |l: &Arc<Mutex<Vec<String>>>| {
        l.lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("accept failed"))
            .count()
    };
    let (cpu0, logged0, t0) = (s.cpu_ns(), failures(&lines), Instant::now());
    std::thread::sleep(Duration::from_secs(3));
    let (cpu1, logged1, secs) = (s.cpu_ns(), failures(&lines), t0.elapsed().as_secs_f64());
    let cpu_share = (cpu1 - cpu0) as f64 / 1e9 / secs;
    assert!(
        cpu_share < 0.05,
        "daemon CPU {:.1} % while out of descriptors",
        cpu_share * 100.0
    );
    let rate = (logged1 - logged0) as f64 / secs;
    assert!(rate < 10.0, "{rate:.1} log lines per second");
    assert!(
        logged1 >= 1,
        "the exhaustion was never reported: {:?}",
        lines.lock().unwrap()
    );
    assert!(
        lines.lock().unwrap().len() < 100,
        "{} lines of log",
        lines.lock().unwrap().len()
    );
    // Descriptors free up: new clients are served.
    drop(idle);
    let t = Instant::now();
    let mut c = loop {
        let mut c = UnixStream::connect(&sock).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut greeting = [0u8; 18];
        if c.read_exact(&mut greeting).is_ok() {
            drop(c);
            break RawNbd::connect(&sock, "disk");
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no client served again"
        );
    };
    let (e, d) = c.read(1, 0, 4096);
    assert_eq!((e, d.len()), (0, 4096));
    assert!(s.is_running());
}

fn qmp_server(name: &str) -> (Stord, std::path::PathBuf) {
    let dir = tmpdir(name);
    let qmp = dir.join("qmp.sock");
    let s = Stord::start(
        &dir,
        &[
            "--chardev".into(),
            format!("socket,id=mon,path={},server=on,wait=off", qmp.display()),
            "--monitor".into(),
            "chardev=mon".into(),
        ],
    );
    (s, qmp)
}

/// Whether the daemon closed the connection (end of stream or reset), ignoring any reply
/// it sent first.
fn is_closed(c: &mut BufReader<UnixStream>) -> bool {
    let mut line = String::new();
    for _ in 0..3 {
        line.clear();
        match c.read_line(&mut line) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
    false
}

#[test]
fn qmp_limits_close_only_the_offending_connection() {
    let (s, qmp) = qmp_server("qmp-limits");
    let mut bystander = RawQmp::connect(&qmp);

    // Nested deeper than the JSON parser takes: an error object, the connection stays.
    let mut c = RawQmp::connect(&qmp);
    let deep = format!(
        "{{\"execute\":\"query-version\",\"arguments\":{{\"x\":{}{}}}}}",
        "[".repeat(200),
        "]".repeat(200)
    );
    let r = c.send(&deep);
    assert!(r.get("error").is_some(), "{r}");
    let r = c.send("{\"execute\":\"query-version\"}");
    assert!(r.get("return").is_some(), "{r}");

    // Beyond the nesting limit: that connection is closed.
    c.r.get_mut()
        .write_all("[".repeat(5000).as_bytes())
        .unwrap();
    assert!(is_closed(&mut c.r), "nesting over the limit must close");

    // A message over 1 MiB: closed too.
    let mut c = RawQmp::connect(&qmp);
    let big = format!(
        "{{\"execute\":\"query-version\",\"arguments\":{{\"x\":\"{}\"}}}}",
        "y".repeat(2 << 20)
    );
    let _ = c.r.get_mut().write_all(big.as_bytes());
    assert!(is_closed(&mut c.r), "an oversized message must close");

    let r = bystander.send("{\"execute\":\"query-version\"}");
    assert!(r.get("return").is_some(), "{r}");
    drop(s);
}

#[test]
fn qmp_client_that_never_reads_cannot_grow_the_daemon() {
    let (s, qmp) = qmp_server("qmp-flood");
    let rss0 = s.status_kib("VmRSS") * 1024;
    let flood = RawQmp::connect(&qmp);
    let mut writer = flood.r.get_ref().try_clone().unwrap();
    writer
        .set_write_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // 100k commands whose replies (a few KiB each) are never read: hundreds of MiB if
    // the daemon kept them all.
    let t = std::thread::spawn(move || {
        let cmd = b"{\"execute\":\"query-commands\"}\n".repeat(1000);
        for _ in 0..100 {
            if writer.write_all(&cmd).is_err() {
                return;
            }
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let grown = (s.status_kib("VmRSS") * 1024).saturating_sub(rss0);
    assert!(grown < 32 * MIB, "RSS grew by {} MiB", grown >> 20);
    let mut other = RawQmp::connect(&qmp);
    let r = other.send("{\"execute\":\"query-version\"}");
    assert!(r.get("return").is_some(), "{r}");
    flood
        .r
        .get_ref()
        .shutdown(std::net::Shutdown::Both)
        .unwrap();
    drop(flood);
    t.join().unwrap();
    let r = other.send("{\"execute\":\"query-version\"}");
    assert!(r.get("return").is_some(), "{r}");
}
