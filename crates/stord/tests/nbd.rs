//! The NBD export end to end, with clients nobody here wrote: nbdinfo, nbdcopy,
//! qemu-img, qemu-io and fio's nbd engine (plus a tiny raw client for garbage).

mod common;

use std::time::Duration;

use common::rawnbd::{RawNbd, CMD_DISC, CMD_READ, CMD_WRITE};
use common::{run, run_ok, sparse_image, tmpdir, Stord};

fn file_node(img: &std::path::Path, aio: &str, direct: bool) -> String {
    format!(
        "driver=file,filename={},aio={aio},discard=unmap,cache.direct={}",
        img.display(),
        if direct { "on" } else { "off" }
    )
}

#[test]
fn nbdinfo_reports_size_flags_and_allocation_map() {
    let dir = tmpdir("nbdinfo");
    let img = dir.join("disk.img");
    sparse_image(&img, 64 << 20);
    let s = Stord::with_node(&dir, &file_node(&img, "io_uring", true), true);
    let uri = s.uri();
    let info: serde_json::Value =
        serde_json::from_str(&run_ok("nbdinfo", &["--json", &uri])).unwrap();
    let e = &info["exports"][0];
    assert_eq!(e["export-size"], 64 << 20);
    assert_eq!(e["is_read_only"], false);
    for flag in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_multi_conn",
        "can_df",
    ] {
        assert_eq!(e[flag], true, "{flag}: {e}");
    }
    assert!(e["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c == "base:allocation"));
    assert_eq!(info["protocol"], "newstyle-fixed");

    // Nothing written yet: one hole.
    let map = run_ok("nbdinfo", &["--map", "--totals", &uri]);
    assert!(map.contains("hole,zero") && !map.contains(" data"), "{map}");
    // Write 1 MiB at 4 MiB: the map shows data there.
    run_ok("qemu-io", &["-f", "raw", "-c", "write -P 0xab 4M 1M", &uri]);
    let map = run_ok("nbdinfo", &["--map", &uri]);
    assert!(
        map.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()[..3] == ["4194304", "1048576", "0"]),
        "{map}"
    );
    // Trim half of it: the hole now reaches 4.5 MiB and only the second half is data.
    run_ok("qemu-io", &["-f", "raw", "-c", "discard 4M 512k", &uri]);
    let map = run_ok("nbdinfo", &["--map", &uri]);
    let rows: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().take(3).collect())
        .collect();
    assert!(rows.contains(&vec!["0", "4718592", "3"]), "{map}");
    assert!(rows.contains(&vec!["4718592", "524288", "0"]), "{map}");
    // Write zeroes without a hole, then read back the pattern that is left.
    run_ok(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0xab 4718592 512k", &uri],
    );
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -z 4718592 4k",
            "-c",
            "read -P 0 4718592 4k",
            &uri,
        ],
    );
}

#[test]
fn qemu_img_convert_both_ways_and_compare() {
    let dir = tmpdir("convert");
    let img = dir.join("disk.img");
    sparse_image(&img, 32 << 20);
    // A source with data, zeroes and holes.
    let src = dir.join("src.raw");
    sparse_image(&src, 32 << 20);
    let src_s = src.display().to_string();
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x11 0 3M",
            "-c",
            "write -P 0x77 20M 1536k",
            &src_s,
        ],
    );
    let s = Stord::with_node(&dir, &file_node(&img, "io_uring", true), true);
    let uri = s.uri();
    run_ok(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", &src_s, &uri],
    );
    let out = run_ok(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", &src_s, &uri],
    );
    assert!(out.contains("Images are identical"), "{out}");
    let back = dir.join("back.raw");
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &uri,
            &back.display().to_string(),
        ],
    );
    let out = run_ok(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &src_s,
            &back.display().to_string(),
        ],
    );
    assert!(out.contains("Images are identical"), "{out}");
    // And a difference is noticed.
    run_ok("qemu-io", &["-f", "raw", "-c", "write -P 0x12 1M 4k", &uri]);
    let out = run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", &src_s, &uri],
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

fn fio_verify(uri: &str, size: &str) {
    let uri = format!("--uri={uri}");
    common::fio_write_and_verify(&["--ioengine=nbd", &uri], size);
}

#[test]
fn fio_verify_on_every_aio_mode() {
    let dir = tmpdir("fio-verify");
    for (aio, direct) in [
        ("io_uring", true),
        ("io_uring", false),
        ("native", true),
        ("threads", true),
        ("threads", false),
    ] {
        let img = dir.join(format!("{aio}-{direct}.img"));
        sparse_image(&img, 32 << 20);
        let s = Stord::with_node(&dir, &file_node(&img, aio, direct), true);
        fio_verify(&s.uri(), "16M");
        drop(s);
    }
    // native without O_DIRECT is refused, with a message naming the option.
    let img = dir.join("bad.img");
    sparse_image(&img, 1 << 20);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stord"))
        .args([
            "--blockdev",
            &format!("node-name=d,{}", file_node(&img, "native", false)),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cache.direct"));
}

#[test]
fn null_node_serves_zeroes() {
    let dir = tmpdir("null");
    let s = Stord::with_node(&dir, "driver=null-co,size=64M,read-zeroes=on", true);
    let out = run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x55 0 64k",
            "-c",
            "read -P 0 0 64k",
            &s.uri(),
        ],
    );
    assert!(out.contains("read 65536/65536"), "{out}");
    let info = run_ok("nbdinfo", &["--size", &s.uri()]);
    assert_eq!(info.trim(), (64u64 << 20).to_string());
}

#[test]
fn read_only_export_refuses_writes() {
    let dir = tmpdir("ro");
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0x42u8; 1 << 20]).unwrap();
    let s = Stord::with_node(&dir, &file_node(&img, "io_uring", false), false);
    let info: serde_json::Value =
        serde_json::from_str(&run_ok("nbdinfo", &["--json", &s.uri()])).unwrap();
    assert_eq!(info["exports"][0]["is_read_only"], true);
    let out = run("qemu-io", &["-f", "raw", "-c", "write 0 4k", &s.uri()]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // qemu-io sees the read-only flag and refuses to open for writing (EACCES).
    assert!(
        text.contains("Permission denied") || text.contains("not permitted"),
        "{text}"
    );
    // The raw protocol answer is EPERM, and the data is untouched.
    let mut c = RawNbd::connect(&s.sock, "disk");
    assert_eq!(c.write(1, 0, &[0u8; 512]), 1, "EPERM");
    let (e, d) = c.read(2, 0, 512);
    assert_eq!(e, 0);
    assert!(d.iter().all(|&b| b == 0x42));
    // A read-only node cannot be exported writable.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stord"))
        .args([
            "--blockdev",
            &format!(
                "node-name=d,read-only=on,{}",
                file_node(&img, "io_uring", false)
            ),
            "--nbd-server",
            &format!("addr.type=unix,addr.path={}", dir.join("x.sock").display()),
            "--export",
            "type=nbd,id=e,node-name=d,writable=on",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("read-only"));
}

#[test]
fn protocol_errors_close_only_that_connection() {
    let dir = tmpdir("garbage");
    let img = dir.join("disk.img");
    sparse_image(&img, 8 << 20);
    let s = Stord::with_node(&dir, &file_node(&img, "io_uring", true), true);
    let mut c = RawNbd::connect(&s.sock, "disk");
    assert_eq!(c.size, 8 << 20);
    // Past the end: EINVAL; straddling the end too.
    let (e, _) = c.read(1, 8 << 20, 512);
    assert_eq!(e, 22);
    let (e, _) = c.read(2, (8 << 20) - 512, 1024);
    assert_eq!(e, 22);
    assert_eq!(c.write(3, (8 << 20) - 4, &[1u8; 8]), 22);
    // Over the maximum payload: EOVERFLOW for a read.
    c.send_request(CMD_READ, 0, 4, 0, 64 << 20, &[]);
    assert_eq!(c.read_reply(0).0, 75);
    // Unknown command: EINVAL, and the connection still works.
    c.send_request(99, 0, 5, 0, 0, &[]);
    assert_eq!(c.read_reply(0).0, 22);
    assert_eq!(c.write(6, 4096, &[7u8; 4096]), 0);
    assert_eq!(c.read(7, 4096, 4096).1, vec![7u8; 4096]);
    // Garbage in transmission: the server closes this connection.
    use std::io::Write;
    c.s.write_all(&[0xffu8; 64]).unwrap();
    assert!(c.is_closed());
    // Garbage during negotiation: closed too.
    let mut g = std::os::unix::net::UnixStream::connect(&s.sock).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA")
        .unwrap();
    let mut raw = RawNbd {
        s: g,
        size: 0,
        flags: 0,
    };
    assert!(raw.is_closed());
    // Unknown export via GO: an error reply, not a crash.
    let out = run(
        "nbdinfo",
        &[&format!("nbd+unix:///nope?socket={}", s.sock.display())],
    );
    assert!(!out.status.success());
    // Everyone else is still served.
    let mut ok = RawNbd::connect(&s.sock, "disk");
    assert_eq!(ok.read(1, 4096, 4096).1, vec![7u8; 4096]);
    run_ok("nbdinfo", &[&s.uri()]);
}

#[test]
fn sixty_four_concurrent_connections() {
    let dir = tmpdir("conns");
    let img = dir.join("disk.img");
    sparse_image(&img, 16 << 20);
    let s = Stord::with_node(&dir, &file_node(&img, "io_uring", true), true);
    let mut clients: Vec<RawNbd> = (0..64).map(|_| RawNbd::connect(&s.sock, "disk")).collect();
    // All connected at once; each writes its own block, then all read everything back.
    for (i, c) in clients.iter_mut().enumerate() {
        assert_eq!(
            c.write(i as u64, i as u64 * 65536, &vec![i as u8 + 1; 65536]),
            0
        );
    }
    let handles: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            std::thread::spawn(move || {
                for j in 0..64u64 {
                    let (e, d) = c.read(j, j * 65536, 65536);
                    assert_eq!(e, 0);
                    assert!(d.iter().all(|&b| b == j as u8 + 1), "client {i} block {j}");
                }
                c.send_request(CMD_DISC, 0, 0, 0, 0, &[]);
                assert!(c.is_closed());
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn disconnect_mid_request_leaks_nothing() {
    let dir = tmpdir("midreq");
    let img = dir.join("disk.img");
    sparse_image(&img, 16 << 20);
    let mut s = Stord::with_node(&dir, &file_node(&img, "io_uring", true), true);
    // Warm up (lazy allocations, worker threads) before counting fds.
    drop(RawNbd::connect(&s.sock, "disk"));
    std::thread::sleep(Duration::from_millis(100));
    let fds_before = s.fd_count();
    for round in 0..20 {
        let mut c = RawNbd::connect(&s.sock, "disk");
        match round % 3 {
            // A write header promising 1 MiB, then only part of the payload.
            0 => c.send_request(1, 0, 1, 0, 1 << 20, &[0u8; 1000]),
            // Many reads whose replies nobody reads.
            1 => {
                for h in 0..200 {
                    c.send_request(CMD_READ, 0, h, (h % 16) << 20 >> 4, 65536, &[]);
                }
            }
            // Half a request header.
            _ => {
                use std::io::Write;
                c.s.write_all(&0x2560_9513u32.to_be_bytes()).unwrap();
            }
        }
        drop(c);
    }
    // The daemon is alive, serves, and has released every connection's fd.
    let start = std::time::Instant::now();
    while s.fd_count() > fds_before {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "fds leaked: {} > {fds_before}",
            s.fd_count()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(s.is_running());
    run_ok("nbdinfo", &[&s.uri()]);
}

#[test]
fn flushed_data_survives_kill_9() {
    let dir = tmpdir("kill9");
    let img = dir.join("disk.img");
    sparse_image(&img, 32 << 20);
    let fio_args = |uri: &str, verify_only: bool| {
        let mut a = vec![
            "--name=persist".to_string(),
            "--ioengine=nbd".to_string(),
            format!("--uri={uri}"),
            "--rw=randwrite".to_string(),
            "--bs=4k".to_string(),
            "--iodepth=8".to_string(),
            "--size=8M".to_string(),
            "--randseed=1234".to_string(),
            "--verify=crc32c".to_string(),
            "--verify_state_save=0".to_string(),
        ];
        if verify_only {
            a.push("--verify_only".to_string());
        } else {
            a.push("--do_verify=0".to_string());
            a.push("--end_fsync=1".to_string());
        }
        a
    };
    let mut s = Stord::with_node(&dir, &file_node(&img, "io_uring", true), true);
    let uri = s.uri();
    let args = fio_args(&uri, false);
    run_ok("fio", &args.iter().map(String::as_str).collect::<Vec<_>>());
    s.kill9();
    let s = Stord::start(&dir, &s.args.clone());
    let args = fio_args(&s.uri(), true);
    let out = run_ok("fio", &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!out.contains("verify: bad"), "{out}");
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let dir = tmpdir("sigterm");
    let img = dir.join("disk.img");
    sparse_image(&img, 1 << 20);
    let mut s = Stord::with_node(&dir, &file_node(&img, "threads", false), true);
    assert!(s.sock.exists());
    s.signal(libc::SIGTERM);
    let st = s.wait_exit(Duration::from_secs(10));
    assert!(st.success(), "{st}");
    assert!(!s.sock.exists(), "socket left behind");
    assert!(!s.pidfile.exists(), "pidfile left behind");
}

#[test]
fn bad_command_lines_name_the_problem() {
    let bin = env!("CARGO_BIN_EXE_stord");
    let cases: &[(&[&str], &str)] = &[
        (&["--blockdev", "driver=qcow9,node-name=x"], "driver"),
        (&["--blockdev", "driver=null-co"], "node-name"),
        (
            &["--blockdev", "driver=null-co,node-name=x,size=huge"],
            "size",
        ),
        (
            &["--blockdev", "driver=null-co,node-name=x,colour=blue"],
            "colour",
        ),
        (&["--object", "iothread,id=a,poll-weight=64"], "poll-weight"),
        (&["--object", "iothread,id=a,poll-policy=turbo"], "turbo"),
        (&["--export", "type=nbd,id=e,node-name=missing"], "missing"),
        (&["--frobnicate"], "--frobnicate"),
    ];
    for (args, needle) in cases {
        let out = std::process::Command::new(bin)
            .args(*args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn tcp_listener_serves_clients() {
    let dir = tmpdir("tcp");
    let img = dir.join("disk.img");
    sparse_image(&img, 4 << 20);
    // A port unlikely to be taken: derived from our pid, on loopback only.
    let port = 20000 + (std::process::id() % 20000) as u16;
    let args: Vec<String> = [
        "--blockdev",
        &format!("node-name=disk,{}", file_node(&img, "io_uring", false)),
        "--nbd-server",
        &format!("addr.type=inet,addr.host=127.0.0.1,addr.port={port}"),
        "--export",
        "type=nbd,id=e,node-name=disk,name=disk,writable=on",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let _s = Stord::start(&dir, &args);
    let uri = format!("nbd://127.0.0.1:{port}/disk");
    run_ok(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x3c 1M 64k", &uri],
    );
    run_ok("qemu-io", &["-f", "raw", "-c", "read -P 0x3c 1M 64k", &uri]);
    let size = run_ok("nbdinfo", &["--size", &uri]);
    assert_eq!(size.trim(), (4u64 << 20).to_string());
}

#[test]
fn no_arguments_serves_the_built_in_default() {
    let dir = tmpdir("default");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_stord"))
        .env("STORD_DATA_DIR", &dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let sock = dir.join("stord.sock");
    let start = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "default job did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let uri = format!("nbd+unix:///default?socket={}", sock.display());
    let size = run_ok("nbdinfo", &["--size", &uri]);
    assert_eq!(size.trim(), (1u64 << 30).to_string());
    // The image is sparse and writable.
    assert!(std::fs::metadata(dir.join("default.img")).unwrap().len() == 1 << 30);
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x61 0 4k",
            "-c",
            "read -P 0x61 0 4k",
            &uri,
        ],
    );
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert!(child.wait().unwrap().success());
    let mut out = String::new();
    use std::io::Read;
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(out.contains(&uri), "the banner prints the URI: {out}");
    assert!(!sock.exists());
}

#[test]
fn concurrent_unaligned_writes_with_o_direct_lose_nothing() {
    // Sub-sector writes under O_DIRECT go through read-modify-write; pipelined writes into
    // the same sectors must all land (they are serialised on their aligned span).
    for aio in ["io_uring", "threads", "native"] {
        let dir = tmpdir(&format!("rmw-{aio}"));
        let img = dir.join("disk.img");
        sparse_image(&img, 1 << 20);
        let s = Stord::with_node(&dir, &file_node(&img, aio, true), true);
        let mut c = RawNbd::connect(&s.sock, "disk");
        // 64 writes of 100 bytes, 64 bytes apart: every one overlaps its neighbours' sectors.
        for i in 0..64u64 {
            c.send_request(1, 0, i, 1000 + i * 64, 64, &[i as u8 + 1; 64]);
        }
        for _ in 0..64 {
            assert_eq!(c.read_reply(0).0, 0);
        }
        let (e, data) = c.read(999, 1000, 64 * 64);
        assert_eq!(e, 0);
        for i in 0..64usize {
            let chunk = &data[i * 64..(i + 1) * 64];
            assert!(
                chunk.iter().all(|&b| b == i as u8 + 1),
                "{aio}: write {i} lost"
            );
        }
    }
}

const CHUNK_DATA: u16 = 1;
const CHUNK_HOLE: u16 = 2;
const CMD_FLAG_DF: u16 = 1 << 2;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;

/// Reads `len` at `offset` with structured replies; the one chunk that answers it.
fn structured_read(
    c: &mut RawNbd,
    handle: u64,
    offset: u64,
    len: u32,
    flags: u16,
) -> (u16, Vec<u8>) {
    c.send_request(CMD_READ, flags, handle, offset, len, &[]);
    let (f, kind, h, d) = c.read_chunk();
    assert_eq!(
        (f & 1, h),
        (1, handle),
        "one chunk, flagged DONE, for our handle"
    );
    (kind, d)
}

/// A simple-reply command (write, trim, write-zeroes) on a structured connection: success.
fn structured_ok(c: &mut RawNbd, kind: u16, handle: u64, offset: u64, len: u32, payload: &[u8]) {
    c.send_request(kind, 0, handle, offset, len, payload);
    let mut h = [0u8; 16];
    std::io::Read::read_exact(&mut c.s, &mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
        0,
        "command {kind} failed"
    );
}

/// Sparse reads: a range that reads as zero comes back as one OFFSET_HOLE chunk (as qsd
/// does), unless the client set DF; and what the file driver remembers about extents
/// never outlives a write, a discard or a write-zeroes into them.
#[test]
fn reads_of_holes_are_hole_chunks_and_never_stale() {
    for aio in ["io_uring", "threads"] {
        let dir = tmpdir(&format!("sparse-{aio}"));
        let img = dir.join("disk.img");
        sparse_image(&img, 8 << 20);
        // 1 MiB of data at 2 MiB, the rest holes.
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
            f.write_all_at(&vec![0xa5; 1 << 20], 2 << 20).unwrap();
        }
        let s = Stord::with_node(&dir, &file_node(&img, aio, false), true);
        let mut c = RawNbd::connect_structured(&s.sock, "disk");

        // A hole: one OFFSET_HOLE chunk naming the range.
        let (kind, d) = structured_read(&mut c, 1, 4096, 8192, 0);
        assert_eq!(kind, CHUNK_HOLE, "{aio}");
        assert_eq!(u64::from_be_bytes(d[..8].try_into().unwrap()), 4096);
        assert_eq!(u32::from_be_bytes(d[8..12].try_into().unwrap()), 8192);
        // The same with DF: data (zeroes), in one OFFSET_DATA chunk.
        let (kind, d) = structured_read(&mut c, 2, 4096, 8192, CMD_FLAG_DF);
        assert_eq!(kind, CHUNK_DATA);
        assert!(d[8..].iter().all(|&b| b == 0) && d.len() == 8 + 8192);
        // Data stays data.
        let (kind, d) = structured_read(&mut c, 3, (2 << 20) + 4096, 4096, 0);
        assert_eq!((kind, d[8]), (CHUNK_DATA, 0xa5));
        // A read across data and hole is sent as data.
        let (kind, d) = structured_read(&mut c, 4, (3 << 20) - 4096, 8192, 0);
        assert_eq!(kind, CHUNK_DATA);
        assert_eq!((d[8], d[8 + 4096]), (0xa5, 0));

        // Write into a hole that was just reported: the next read sees the data.
        let _ = structured_read(&mut c, 5, 5 << 20, 4096, 0);
        structured_ok(&mut c, CMD_WRITE, 6, 5 << 20, 4096, &[0x3c; 4096]);
        let (kind, d) = structured_read(&mut c, 7, 5 << 20, 4096, 0);
        assert_eq!(
            (kind, d[8]),
            (CHUNK_DATA, 0x3c),
            "{aio}: stale hole after a write"
        );

        // Discard data that was just reported: a hole again.
        let _ = structured_read(&mut c, 8, 2 << 20, 4096, 0);
        structured_ok(&mut c, CMD_TRIM, 9, 2 << 20, 1 << 20, &[]);
        let (kind, _) = structured_read(&mut c, 10, 2 << 20, 4096, 0);
        assert_eq!(kind, CHUNK_HOLE, "{aio}: stale data after a discard");

        // Write zeroes over data: reads as zero, whichever chunk says so.
        structured_ok(&mut c, CMD_WRITE, 11, 6 << 20, 4096, &[0x77; 4096]);
        let _ = structured_read(&mut c, 12, 6 << 20, 4096, 0);
        structured_ok(&mut c, CMD_WRITE_ZEROES, 13, 6 << 20, 4096, &[]);
        let (kind, d) = structured_read(&mut c, 14, 6 << 20, 4096, 0);
        assert!(
            kind == CHUNK_HOLE || d[8..].iter().all(|&b| b == 0),
            "{aio}"
        );

        // A client without structured replies gets plain data.
        let mut plain = RawNbd::connect(&s.sock, "disk");
        let (e, d) = plain.read(15, 4096, 4096);
        assert_eq!((e, d), (0, vec![0; 4096]));
    }
}

/// One export on two IoThreads: two clients at once land on different IoThreads (each
/// serves requests), their data is right, and multi-conn is advertised unless turned off.
#[test]
fn connections_spread_over_the_exports_iothreads() {
    let dir = tmpdir("nbd-mt");
    let img = dir.join("disk.img");
    sparse_image(&img, 64 << 20);
    let sock = dir.join("nbd.sock");
    let qmp = dir.join("qmp.sock");
    let s = Stord::start(
        &dir,
        &[
            "--object".into(),
            "iothread,id=io0".into(),
            "--object".into(),
            "iothread,id=io1".into(),
            "--blockdev".into(),
            format!("node-name=disk,{}", file_node(&img, "io_uring", true)),
            "--blockdev".into(),
            "driver=null-co,node-name=nul,size=1M".into(),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}", sock.display()),
            "--export".into(),
            "type=nbd,id=exp0,node-name=disk,name=disk,writable=on,iothread.0=io0,iothread.1=io1"
                .into(),
            "--export".into(),
            "type=nbd,id=exp1,node-name=nul,name=nul,multi-conn=off".into(),
            "--chardev".into(),
            format!("socket,id=mon,path={},server=on,wait=off", qmp.display()),
            "--monitor".into(),
            "chardev=mon".into(),
        ],
    );
    let mut q = common::rawqmp::RawQmp::connect(&qmp);
    let per_thread = |q: &mut common::rawqmp::RawQmp| -> Vec<u64> {
        let r = q.send("{\"execute\":\"query-iothreads\"}");
        let mut v: Vec<(String, u64)> = r["return"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["id"].as_str().unwrap().to_string(),
                    t["x-stats"]["counters"]["nbd.requests"]
                        .as_u64()
                        .unwrap_or(0),
                )
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, n)| n).collect()
    };
    // Two clients connected at once, each writing and verifying its own half.
    let mut a = RawNbd::connect(&s.sock, "disk");
    let mut b = RawNbd::connect(&s.sock, "disk");
    const CAN_MULTI_CONN: u16 = 1 << 8;
    assert_ne!(a.flags & CAN_MULTI_CONN, 0, "multi-conn not advertised");
    for i in 0..64u64 {
        let pa = vec![(i as u8) ^ 0x11; 4096];
        let pb = vec![(i as u8) ^ 0x22; 4096];
        assert_eq!(a.write(i, i * 4096, &pa), 0);
        assert_eq!(b.write(i, (32 << 20) + i * 4096, &pb), 0);
        assert_eq!(a.read(100 + i, i * 4096, 4096), (0, pa));
        assert_eq!(b.read(100 + i, (32 << 20) + i * 4096, 4096), (0, pb));
    }
    let served = per_thread(&mut q);
    assert_eq!(served.len(), 2);
    assert!(
        served.iter().all(|&n| n >= 128),
        "both IoThreads should serve one client each: {served:?}"
    );
    drop((a, b));
    let c = RawNbd::connect(&s.sock, "nul");
    assert_eq!(
        c.flags & CAN_MULTI_CONN,
        0,
        "multi-conn=off still advertised it"
    );
}

/// A pattern no two 4 KiB blocks of the image share: block `b`'s bytes are `b` and `!b`.
fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let b = (i / 4096) as u8;
            if i % 2 == 0 {
                b
            } else {
                !b
            }
        })
        .collect()
}

/// The only request in flight sends its reply at once, from its own turn; a reply the
/// socket cannot take whole (a client that reads late) is finished by the connection's
/// writer, in order, and the replies after it (one at a time, then pipelined) are whole.
#[test]
fn a_reply_the_socket_cannot_take_at_once_arrives_whole() {
    let dir = tmpdir("nbd-late-reader");
    let img = dir.join("disk.img");
    let data = pattern(16 << 20);
    std::fs::write(&img, &data).unwrap();
    let s = Stord::with_node(&dir, &file_node(&img, "io_uring", false), true);
    let mut c = RawNbd::connect(&s.sock, "disk");
    c.send_request(CMD_READ, 0, 1, 4 << 20, 8 << 20, &[]);
    // Far more than a socket's buffer waits while the client is away.
    std::thread::sleep(Duration::from_millis(300));
    let (e, h, d) = c.read_reply(8 << 20);
    assert_eq!((e, h), (0, 1));
    assert!(
        d == data[4 << 20..12 << 20],
        "the late reader's 8 MiB differ"
    );

    assert_eq!(c.write(2, 4096, &[0xa5; 4096]), 0);
    assert_eq!(c.read(3, 4096, 4096), (0, vec![0xa5; 4096]));

    // Pipelined: a large read, a small read and a write, replies in any order.
    c.send_request(CMD_READ, 0, 10, 0, 4 << 20, &[]);
    c.send_request(CMD_READ, 0, 11, 8 << 20, 4096, &[]);
    c.send_request(CMD_WRITE, 0, 12, 12 << 20, 4096, &[0x3c; 4096]);
    std::thread::sleep(Duration::from_millis(100));
    let mut seen = Vec::new();
    for _ in 0..3 {
        let mut h = [0u8; 16];
        std::io::Read::read_exact(&mut c.s, &mut h).unwrap();
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let handle = u64::from_be_bytes(h[8..16].try_into().unwrap());
        assert_eq!(err, 0, "request {handle}");
        let (off, len) = match handle {
            10 => (0, 4 << 20),
            11 => (8 << 20, 4096),
            12 => (0, 0),
            other => panic!("unknown handle {other}"),
        };
        let mut got = vec![0u8; len];
        std::io::Read::read_exact(&mut c.s, &mut got).unwrap();
        let mut want = data[off..off + len].to_vec();
        if handle == 10 {
            want[4096..8192].fill(0xa5);
        }
        assert!(got == want, "request {handle}'s data differ");
        seen.push(handle);
    }
    seen.sort();
    assert_eq!(seen, [10, 11, 12]);
    assert_eq!(c.read(13, 12 << 20, 4096), (0, vec![0x3c; 4096]));
}

/// A pipelining client's requests that arrive together are answered together: 64 reads
/// of a null node sent in one write get their replies in a few writes, not one each,
/// though each request is done the moment it is read.
#[test]
fn replies_to_requests_that_arrive_together_leave_together() {
    let dir = tmpdir("nbd-coalesce");
    let sock = dir.join("nbd.sock");
    let qmp = dir.join("qmp.sock");
    let mut args = vec![
        "--object".to_string(),
        "iothread,id=io0".into(),
        "--blockdev".into(),
        "driver=null-co,node-name=disk,size=64M,read-zeroes=on".into(),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", sock.display()),
        "--export".into(),
        "type=nbd,id=e,node-name=disk,name=disk,iothread=io0".into(),
    ];
    args.extend(common::rawqmp::monitor_args(&qmp));
    let s = Stord::start(&dir, &args);
    let mut q = common::rawqmp::RawQmp::connect(&qmp);
    let mut counters = || {
        let r = q.send("{\"execute\":\"query-iothreads\"}");
        let c = &r["return"][0]["x-stats"]["counters"];
        let n = |k: &str| c[k].as_u64().unwrap_or(0);
        (n("nbd.requests"), n("nbd.sends"))
    };
    let mut c = RawNbd::connect(&s.sock, "disk");
    // One at a time first: a reply each.
    for h in 0..8 {
        assert_eq!(c.read(h, h * 4096, 512), (0, vec![0; 512]));
    }
    let (requests, sends) = counters();
    assert_eq!((requests, sends), (8, 8));
    let mut burst = Vec::new();
    for h in 100..164u64 {
        burst.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        burst.extend_from_slice(&0u16.to_be_bytes());
        burst.extend_from_slice(&CMD_READ.to_be_bytes());
        burst.extend_from_slice(&h.to_be_bytes());
        burst.extend_from_slice(&(h * 4096).to_be_bytes());
        burst.extend_from_slice(&512u32.to_be_bytes());
    }
    std::io::Write::write_all(&mut c.s, &burst).unwrap();
    for h in 100..164u64 {
        let (e, handle, d) = c.read_reply(512);
        assert_eq!((e, handle), (0, h));
        assert_eq!(d, vec![0; 512]);
    }
    let (requests, sends) = counters();
    assert_eq!(requests, 8 + 64);
    assert!(
        sends - 8 <= 4,
        "64 replies went out in {} writes",
        sends - 8
    );
}
